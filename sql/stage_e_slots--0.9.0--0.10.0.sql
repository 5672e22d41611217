-- stage_e_slots 0.9.0 -> 0.10.0: rate limits.
--
-- stage_e_try_rate(key, count, per, burst, cost) is a rate limit on its own, no slot: GCRA,
-- one arrival time per key in shared memory (stage_e_slots.max_rate_keys), decided and charged
-- in one step, kept exactly across a clean restart and started spent after a crash or a
-- promotion. It adds no table and no column. Until a database is updated, the 0.10.0 library
-- serves it as 0.9.0 did. The result is the same schema as a fresh 0.10.0 install (the update
-- test compares them).
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
