-- stage_e_slots 0.7.0 -> 0.8.0: metrics where operators look.
--
-- Each counter row keeps the cap's hold and wait histograms (hold_buckets, wait_buckets: per
-- bucket, 1 ms times powers of 4 up to 4194.304 s, then above), flushed with the counters;
-- stage_e_histograms() shows them per cap as postgres_exporter's HISTOGRAM usage reads them,
-- the view stage_e_histogram_quantiles their p50, p90 and p99; stage_e_stats() gains n, the
-- cap's current n (that of its latest acquisition), after held. Rows made before the update
-- start with empty histograms. Until a database is updated, the 0.8.0 library serves it as
-- 0.7.0 did. The result is the same schema as a fresh 0.8.0 install (the update test compares
-- them).
\echo Use "ALTER EXTENSION stage_e_slots UPDATE TO '0.8.0'" to load this file. \quit

ALTER TABLE stage_e_throttle_counter
  ADD COLUMN hold_buckets bigint[] NOT NULL DEFAULT '{0,0,0,0,0,0,0,0,0,0,0,0,0}',
  ADD COLUMN wait_buckets bigint[] NOT NULL DEFAULT '{0,0,0,0,0,0,0,0,0,0,0,0,0}';
COMMENT ON COLUMN stage_e_throttle_counter.hold_buckets IS
  'Holds per bucket (not cumulative): at most 1 ms, 4 ms, 16 ms, ... 4194.304 s (1 ms times powers of 4), then above; their sum is hold_time.';
COMMENT ON COLUMN stage_e_throttle_counter.wait_buckets IS
  'Waits (served or timed out) per bucket, as hold_buckets; their sum is wait_time.';

-- stage_e_stats() gains a column: a function's result type cannot change in place.
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
	"expired" bigint
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_stats_v5_wrapper';

CREATE FUNCTION stage_e_histograms() RETURNS TABLE (
	"cap" TEXT,
	"metric" TEXT,
	"seconds" double precision[],
	"seconds_bucket" bigint[],
	"seconds_sum" double precision,
	"seconds_count" bigint
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_histograms_wrapper';

CREATE FUNCTION stage_e_histogram_quantiles_internal() RETURNS TABLE (
	"cap" TEXT,
	"metric" TEXT,
	"count" bigint,
	"p50" interval,
	"p90" interval,
	"p99" interval
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_histogram_quantiles_internal_wrapper';

CREATE VIEW stage_e_histogram_quantiles AS
SELECT q.cap, q.metric, q.count, q.p50, q.p90, q.p99
  FROM @extschema@.stage_e_histogram_quantiles_internal() AS q
 ORDER BY q.cap, q.metric;
COMMENT ON VIEW stage_e_histogram_quantiles IS
  'Per cap in use and metric (hold, wait): observations since the cap was made and their 50th, 90th and 99th percentiles, interpolated within the histogram''s buckets as histogram_quantile does.';
GRANT SELECT ON stage_e_histogram_quantiles TO PUBLIC;
