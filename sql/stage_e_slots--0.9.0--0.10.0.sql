-- stage_e_slots 0.9.0 -> 0.10.0: rate limits.
--
-- stage_e_try_rate(key, count, per, burst, cost) is a rate limit on its own, no slot: GCRA,
-- one arrival time per key in shared memory (stage_e_slots.max_rate_keys), decided and charged
-- in one step, kept exactly across a clean restart and started spent after a crash or a
-- promotion. stage_e_rate_limit(cap, count, per, burst) / stage_e_rate_limit_off(cap) put a
-- rate on a cap's acquisitions (or, for 'prefix*', on every cap of the prefix, each its own),
-- restricted as stage_e_adapt is; the counter table gains rate_count, rate_per and rate_burst,
-- where the policy is kept (rows made before the update have none), and the counter
-- rate_limited (throttled by a rate policy), which stage_e_stats(), stage_e_pending(),
-- stage_e_flush() and the view stage_e_throttle_totals gain as their last column (the
-- functions are dropped and made again: a view of yours over stage_e_stats() must be dropped
-- first and made again after). The view stage_e_rate_limits shows each rate-limited cap.
-- Until a database is updated, the 0.10.0 library serves it as 0.9.0 did. The result is the
-- same schema as a fresh 0.10.0 install (the update test compares them).
\echo Use "ALTER EXTENSION stage_e_slots UPDATE TO '0.10.0'" to load this file. \quit

CREATE FUNCTION stage_e_try_rate(
	"key" TEXT,
	"count" INT,
	"per" interval,
	"burst" INT DEFAULT 1,
	"cost" INT DEFAULT 1
) RETURNS TABLE (
	"allowed" bool,
	"remaining" INT,
	"retry_after" interval,
	"reset_after" interval
)
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_try_rate_wrapper';

ALTER TABLE stage_e_throttle_counter
  ADD COLUMN rate_count integer,
  ADD COLUMN rate_per interval,
  ADD COLUMN rate_burst integer,
  ADD CONSTRAINT stage_e_throttle_counter_rate
    CHECK ((rate_count IS NULL) = (rate_per IS NULL) AND (rate_count IS NULL) = (rate_burst IS NULL)
           AND rate_count OPERATOR(pg_catalog.>=) 1 AND rate_burst OPERATOR(pg_catalog.>=) 1
           AND rate_per OPERATOR(pg_catalog.>) '0'::pg_catalog.interval
           AND rate_per OPERATOR(pg_catalog.<=) '1 day'::pg_catalog.interval),
  ADD COLUMN rate_limited bigint NOT NULL DEFAULT 0;
COMMENT ON COLUMN stage_e_throttle_counter.rate_count IS
  'A rate-limited cap''s count calls per rate_per (stage_e_rate_limit); NULL when it has no rate policy.';
COMMENT ON COLUMN stage_e_throttle_counter.rate_per IS
  'The interval rate_count is over (at most 1 day).';
COMMENT ON COLUMN stage_e_throttle_counter.rate_burst IS
  'How many acquisitions may come at once (1: none).';
COMMENT ON COLUMN stage_e_throttle_counter.rate_limited IS
  'Acquisitions throttled by the cap''s rate policy (counted in throttled too).';

-- The counter functions gain rate_limited: a function's result type cannot change in place,
-- and the totals view over stage_e_pending() goes and comes back with it.
DROP VIEW stage_e_throttle_totals;
DROP FUNCTION stage_e_pending(bigint);
CREATE FUNCTION stage_e_pending(
	"row_flush_id" bigint DEFAULT NULL
) RETURNS TABLE (
	"cap" TEXT,
	"acquired" bigint,
	"throttled" bigint,
	"released" bigint,
	"foreign_releases" bigint,
	"released_by_exit" bigint,
	"waits" bigint,
	"wait_timeouts" bigint,
	"wait_time" interval,
	"hold_time" interval,
	"expired" bigint,
	"rate_limited" bigint
)
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_pending_v5_wrapper';

CREATE VIEW stage_e_throttle_totals AS
SELECT COALESCE(c.cap, p.cap) AS cap,
       COALESCE(c.acquired, 0) OPERATOR(pg_catalog.+) COALESCE(p.acquired, 0) AS acquired,
       COALESCE(c.throttled, 0) OPERATOR(pg_catalog.+) COALESCE(p.throttled, 0) AS throttled,
       COALESCE(c.released, 0) OPERATOR(pg_catalog.+) COALESCE(p.released, 0) AS released,
       COALESCE(c.foreign_releases, 0) OPERATOR(pg_catalog.+) COALESCE(p.foreign_releases, 0)
         AS foreign_releases,
       COALESCE(c.released_by_exit, 0) OPERATOR(pg_catalog.+) COALESCE(p.released_by_exit, 0)
         AS released_by_exit,
       COALESCE(p.throttled, 0) AS pending_throttled,
       c.flushed_at,
       COALESCE(c.waits, 0) OPERATOR(pg_catalog.+) COALESCE(p.waits, 0) AS waits,
       COALESCE(c.wait_timeouts, 0) OPERATOR(pg_catalog.+) COALESCE(p.wait_timeouts, 0)
         AS wait_timeouts,
       COALESCE(c.wait_time, '0') OPERATOR(pg_catalog.+) COALESCE(p.wait_time, '0') AS wait_time,
       COALESCE(c.hold_time, '0') OPERATOR(pg_catalog.+) COALESCE(p.hold_time, '0') AS hold_time,
       COALESCE(c.expired, 0) OPERATOR(pg_catalog.+) COALESCE(p.expired, 0) AS expired,
       COALESCE(c.rate_limited, 0) OPERATOR(pg_catalog.+) COALESCE(p.rate_limited, 0)
         AS rate_limited
  FROM @extschema@.stage_e_throttle_counter AS c
  FULL JOIN @extschema@.stage_e_pending(
              (SELECT pg_catalog.max(r.flush_id) FROM @extschema@.stage_e_throttle_counter AS r)
            ) AS p
    ON p.cap OPERATOR(pg_catalog.=) c.cap;
COMMENT ON VIEW stage_e_throttle_totals IS
  'Exact live totals per cap: the flushed row plus the counts still pending in shared memory.';
GRANT SELECT ON stage_e_throttle_totals TO PUBLIC;

DROP FUNCTION stage_e_stats();
CREATE FUNCTION stage_e_stats() RETURNS TABLE (
	"cap" TEXT,
	"max_slots" INT,
	"held" INT,
	"n" INT,
	"acquired" bigint,
	"throttled" bigint,
	"released" bigint,
	"foreign_releases" bigint,
	"released_by_exit" bigint,
	"waits" bigint,
	"wait_timeouts" bigint,
	"wait_time" interval,
	"hold_time" interval,
	"expired" bigint,
	"rate_limited" bigint
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_stats_v6_wrapper';

DROP FUNCTION stage_e_flush();
CREATE FUNCTION stage_e_flush() RETURNS TABLE (
	"cap" TEXT,
	"acquired" bigint,
	"throttled" bigint,
	"released" bigint,
	"foreign_releases" bigint,
	"released_by_exit" bigint,
	"waits" bigint,
	"wait_timeouts" bigint,
	"wait_time" interval,
	"hold_time" interval,
	"expired" bigint,
	"rate_limited" bigint
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_flush_v5_wrapper';
REVOKE EXECUTE ON FUNCTION stage_e_flush() FROM PUBLIC;

CREATE FUNCTION stage_e_rate_limit(
	"cap" TEXT,
	"count" INT,
	"per" interval,
	"burst" INT DEFAULT 1
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_rate_limit_wrapper';

CREATE FUNCTION stage_e_rate_limit_off(
	"cap" TEXT
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_rate_limit_off_wrapper';

-- A cap's rate policy binds every role that uses it, and is kept in the counter table.
REVOKE EXECUTE ON FUNCTION stage_e_rate_limit(text, integer, interval, integer) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION stage_e_rate_limit_off(text) FROM PUBLIC;

CREATE FUNCTION stage_e_rate_limits_internal() RETURNS TABLE (
	"cap" TEXT,
	"count" INT,
	"per" interval,
	"burst" INT,
	"remaining" INT,
	"next_at" timestamp with time zone
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_rate_limits_internal_wrapper';

CREATE VIEW stage_e_rate_limits AS
SELECT r.cap,
       r.count,
       r.per,
       r.burst,
       r.remaining,
       r.next_at,
       CASE WHEN pg_catalog.right(r.cap, 1) OPERATOR(pg_catalog.=) '*'
            THEN (SELECT COALESCE(pg_catalog.sum(t.rate_limited), 0)::pg_catalog.int8
                    FROM @extschema@.stage_e_throttle_totals AS t
                   WHERE pg_catalog.starts_with(t.cap,
                           pg_catalog.left(r.cap, -1)))
            ELSE COALESCE((SELECT t.rate_limited FROM @extschema@.stage_e_throttle_totals AS t
                            WHERE t.cap OPERATOR(pg_catalog.=) r.cap), 0)
       END AS rate_limited
  FROM @extschema@.stage_e_rate_limits_internal() AS r;
COMMENT ON VIEW stage_e_rate_limits IS
  'One row per rate-limited cap of the current database (stage_e_rate_limit): its rate, how many acquisitions of one slot it allows now, when the next is allowed, and how many were throttled by it; a prefix policy shows its pattern and each live cap under it.';
GRANT SELECT ON stage_e_rate_limits TO PUBLIC;
