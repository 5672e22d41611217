-- The peers stage_e_slots is compared with, as a user would write them without the extension.
-- Loaded into the benchmark database by bench/run.py. :key is the advisory-lock key.

-- 2. A PL/pgSQL loop over pg_try_advisory_lock. Note the re-entrancy bug a naive loop has (a
--    session that already holds slot s gets it again); the benchmark never triggers it.
CREATE FUNCTION peer_plpgsql_try(k int, n int) RETURNS int
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog AS $$
BEGIN
  FOR s IN 0 .. n - 1 LOOP
    IF pg_try_advisory_lock(k, s) THEN
      RETURN s;
    END IF;
  END LOOP;
  RETURN NULL;
END $$;

-- 2b. The same loop, counting each throttle in a one-row table (the incident's first fix).
CREATE TABLE peer_throttle_counter (id int PRIMARY KEY CHECK (id = 1), throttled bigint NOT NULL);
INSERT INTO peer_throttle_counter VALUES (1, 0);

CREATE FUNCTION peer_plpgsql_try_counted(k int, n int) RETURNS int
LANGUAGE plpgsql VOLATILE SET search_path = public, pg_catalog AS $$
BEGIN
  FOR s IN 0 .. n - 1 LOOP
    IF pg_try_advisory_lock(k, s) THEN
      RETURN s;
    END IF;
  END LOOP;
  UPDATE peer_throttle_counter SET throttled = throttled + 1 WHERE id = 1;
  RETURN NULL;
END $$;

-- 3. A table-row semaphore like Solid Queue's solid_queue_semaphores.
CREATE TABLE peer_semaphores (key text PRIMARY KEY, value int NOT NULL);

-- 4. Waiting by polling: try every slot, sleep 10 ms, try again (redis-semaphore's default
--    retry delay), until a slot frees or the timeout passes.
CREATE FUNCTION peer_poll_slot(k int, n int, timeout_s float8) RETURNS int
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog AS $$
DECLARE
  deadline timestamptz := clock_timestamp() + make_interval(secs => timeout_s);
BEGIN
  LOOP
    FOR s IN 0 .. n - 1 LOOP
      IF pg_try_advisory_lock(k, s) THEN
        RETURN s;
      END IF;
    END LOOP;
    IF clock_timestamp() > deadline THEN
      RETURN NULL;
    END IF;
    PERFORM pg_sleep(0.01);
  END LOOP;
END $$;
