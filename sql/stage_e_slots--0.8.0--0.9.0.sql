-- stage_e_slots 0.8.0 -> 0.9.0: adaptive caps.
--
-- stage_e_adapt(cap, min_slots, max_slots, enforce) makes a cap adaptive: it hands out slots
-- only while fewer than least(n, limit) are held, the limit learned from the cap's hold times
-- between the bounds; stage_e_adapt_off(cap) returns it to the caller's n alone. Both are
-- restricted, as stage_e_reset_stats is. The view stage_e_cap_limits shows each adaptive cap's
-- limit and why it last moved. Each counter row keeps its cap's policy and learned limit
-- (adapt_*), so that a restart resumes from them. Rows made before the update have no policy.
-- Until a database is updated, the 0.9.0 library serves it as 0.8.0 did. The result is the
-- same schema as a fresh 0.9.0 install (the update test compares them).
\echo Use "ALTER EXTENSION stage_e_slots UPDATE TO '0.9.0'" to load this file. \quit

ALTER TABLE stage_e_throttle_counter
  ADD COLUMN adapt_min integer,
  ADD COLUMN adapt_max integer,
  ADD COLUMN adapt_enforce boolean,
  ADD COLUMN adapt_limit integer,
  ADD COLUMN adapt_baseline interval,
  ADD CONSTRAINT stage_e_throttle_counter_adapt_bounds
    CHECK (adapt_min OPERATOR(pg_catalog.>=) 1 AND adapt_max OPERATOR(pg_catalog.>=) adapt_min);
COMMENT ON COLUMN stage_e_throttle_counter.adapt_min IS
  'An adaptive cap''s min_slots (stage_e_adapt); NULL when the cap is not adaptive.';
COMMENT ON COLUMN stage_e_throttle_counter.adapt_max IS
  'An adaptive cap''s max_slots (stage_e_adapt); NULL when the cap is not adaptive.';
COMMENT ON COLUMN stage_e_throttle_counter.adapt_enforce IS
  'Whether the learned limit is applied (false: monitor mode).';
COMMENT ON COLUMN stage_e_throttle_counter.adapt_limit IS
  'The learned limit, as the background flusher last wrote it; a restart resumes from it.';
COMMENT ON COLUMN stage_e_throttle_counter.adapt_baseline IS
  'The baseline hold time the limit was learned against, as last written.';

CREATE FUNCTION stage_e_adapt(
	"cap" TEXT,
	"min_slots" INT,
	"max_slots" INT,
	"enforce" bool DEFAULT true
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_adapt_wrapper';

CREATE FUNCTION stage_e_adapt_off(
	"cap" TEXT
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_adapt_off_wrapper';

REVOKE EXECUTE ON FUNCTION stage_e_adapt(text, integer, integer, boolean) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION stage_e_adapt_off(text) FROM PUBLIC;

CREATE FUNCTION stage_e_cap_limits_internal() RETURNS TABLE (
	"cap" TEXT,
	"limit" INT,
	"min_slots" INT,
	"max_slots" INT,
	"enforce" bool,
	"baseline_hold" interval,
	"recent_hold" interval,
	"held" INT,
	"changed_at" timestamp with time zone,
	"reason" TEXT
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_cap_limits_internal_wrapper';

CREATE VIEW stage_e_cap_limits AS
SELECT l.cap, l."limit", l.min_slots, l.max_slots, l.enforce, l.baseline_hold, l.recent_hold,
       l.held, l.changed_at, l.reason
  FROM @extschema@.stage_e_cap_limits_internal() AS l
 ORDER BY l.cap;
COMMENT ON VIEW stage_e_cap_limits IS
  'One row per adaptive cap of the current database: the limit learned from hold times (applied as least(n, limit) unless enforce is false), its bounds, the baseline and recent hold times, the slots held, and why the limit last moved.';
GRANT SELECT ON stage_e_cap_limits TO PUBLIC;
