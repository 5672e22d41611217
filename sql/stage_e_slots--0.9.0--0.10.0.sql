-- stage_e_slots 0.9.0 -> 0.10.0: rate limits.
--
-- stage_e_try_rate(key, count, per, burst, cost) is a rate limit on its own, no slot: GCRA,
-- one arrival time per key in shared memory (stage_e_slots.max_rate_keys), decided and charged
-- in one step, kept exactly across a clean restart and started spent after a crash or a
-- promotion. stage_e_rate_limit(cap, count, per, burst) / stage_e_rate_limit_off(cap) put a
-- rate on a cap's acquisitions (or, for 'prefix*', on every cap of the prefix, each its own),
-- restricted as stage_e_adapt is; the counter table gains rate_count, rate_per and rate_burst,
-- where the policy is kept (rows made before the update have none). Until a database is
-- updated, the 0.10.0 library serves it as 0.9.0 did. The result is the same schema as a fresh
-- 0.10.0 install (the update test compares them).
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
           AND rate_per OPERATOR(pg_catalog.<=) '1 day'::pg_catalog.interval);
COMMENT ON COLUMN stage_e_throttle_counter.rate_count IS
  'A rate-limited cap''s count calls per rate_per (stage_e_rate_limit); NULL when it has no rate policy.';
COMMENT ON COLUMN stage_e_throttle_counter.rate_per IS
  'The interval rate_count is over (at most 1 day).';
COMMENT ON COLUMN stage_e_throttle_counter.rate_burst IS
  'How many acquisitions may come at once (1: none).';

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
