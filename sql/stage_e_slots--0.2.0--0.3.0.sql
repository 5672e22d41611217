-- stage_e_slots 0.2.0 -> 0.3.0: waiting for a slot, weighted acquisition, wait and hold
-- metrics, load averages.
--
-- The result is the same schema as a fresh 0.3.0 install (the update test compares them).
\echo Use "ALTER EXTENSION stage_e_slots UPDATE TO '0.3.0'" to load this file. \quit

-- Objects whose shape changes are dropped and created again; the totals view goes first.
DROP VIEW @extschema@.stage_e_throttle_totals;
DROP FUNCTION @extschema@.stage_e_stats();
DROP FUNCTION @extschema@.stage_e_flush();
DROP FUNCTION @extschema@.stage_e_pending(bigint);

-- The new counters, after flush_id (where a fresh install has them too); existing rows start
-- them at zero.
ALTER TABLE @extschema@.stage_e_throttle_counter
    ADD COLUMN waits         bigint NOT NULL DEFAULT 0,
    ADD COLUMN wait_timeouts bigint NOT NULL DEFAULT 0,
    ADD COLUMN wait_time     interval NOT NULL DEFAULT '0',
    ADD COLUMN hold_time     interval NOT NULL DEFAULT '0';

CREATE FUNCTION @extschema@."stage_e_stats"() RETURNS TABLE (
	"cap" TEXT,
	"max_slots" INT,
	"held" INT,
	"acquired" bigint,
	"throttled" bigint,
	"released" bigint,
	"foreign_releases" bigint,
	"released_by_exit" bigint,
	"waits" bigint,
	"wait_timeouts" bigint,
	"wait_time" interval,
	"hold_time" interval
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_stats_v3_wrapper';

CREATE FUNCTION @extschema@."stage_e_flush"() RETURNS TABLE (
	"cap" TEXT,
	"acquired" bigint,
	"throttled" bigint,
	"released" bigint,
	"foreign_releases" bigint,
	"released_by_exit" bigint,
	"waits" bigint,
	"wait_timeouts" bigint,
	"wait_time" interval,
	"hold_time" interval
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_flush_v3_wrapper';
REVOKE EXECUTE ON FUNCTION @extschema@.stage_e_flush() FROM PUBLIC;

CREATE FUNCTION @extschema@."stage_e_pending"(
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
	"hold_time" interval
)
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_pending_v3_wrapper';

CREATE FUNCTION @extschema@."stage_e_try_slot"(
	"n" INT,
	"wait" interval
) RETURNS INT
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_try_slot_wait_wrapper';

CREATE FUNCTION @extschema@."stage_e_try_slot"(
	"cap" TEXT,
	"n" INT,
	"wait" interval
) RETURNS INT
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_try_slot_wait_cap_wrapper';

CREATE FUNCTION @extschema@."stage_e_try_slots"(
	"cap" TEXT,
	"n" INT,
	"k" INT,
	"wait" interval DEFAULT '0'
) RETURNS INT[]
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_try_slots_wrapper';

CREATE FUNCTION @extschema@."stage_e_slot_waiters_internal"() RETURNS TABLE (
	"cap" TEXT,
	"pid" INT,
	"n" INT,
	"k" INT,
	"waiting_since" timestamp with time zone,
	"position" INT
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_slot_waiters_internal_wrapper';

CREATE FUNCTION @extschema@."stage_e_cap_load_internal"() RETURNS TABLE (
	"cap" TEXT,
	"held_1m" double precision,
	"held_5m" double precision,
	"held_15m" double precision,
	"throttled_per_min_1m" double precision,
	"throttled_per_min_5m" double precision,
	"throttled_per_min_15m" double precision
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_cap_load_internal_wrapper';

-- The views, as sql/schema/views.sql defines them.
-- Exact live totals per cap: the flushed row plus what is still pending in shared memory. The
-- newest flush_id the view sees goes to stage_e_pending, so a flush committing right now is
-- not counted twice.
CREATE VIEW @extschema@.stage_e_throttle_totals AS
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
       COALESCE(c.hold_time, '0') OPERATOR(pg_catalog.+) COALESCE(p.hold_time, '0') AS hold_time
  FROM @extschema@.stage_e_throttle_counter AS c
  FULL JOIN @extschema@.stage_e_pending(
              (SELECT pg_catalog.max(r.flush_id) FROM @extschema@.stage_e_throttle_counter AS r)
            ) AS p
    ON p.cap OPERATOR(pg_catalog.=) c.cap;
COMMENT ON VIEW @extschema@.stage_e_throttle_totals IS
  'Exact live totals per cap: the flushed row plus the counts still pending in shared memory.';
GRANT SELECT ON @extschema@.stage_e_throttle_totals TO PUBLIC;

-- Sessions waiting for slots, in queue order per cap (position 1 is next), with their session.
CREATE VIEW @extschema@.stage_e_slot_waiters AS
SELECT w.cap,
       w.pid,
       w.n,
       w.k,
       w.waiting_since,
       w.position,
       pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) w.waiting_since AS waiting_for,
       a.application_name,
       a.client_addr,
       a.wait_event_type,
       a.wait_event
  FROM @extschema@.stage_e_slot_waiters_internal() AS w
  LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid OPERATOR(pg_catalog.=) w.pid
 ORDER BY w.cap, w.position;
COMMENT ON VIEW @extschema@.stage_e_slot_waiters IS
  'One row per session waiting for slots of a cap in the current database, in queue order.';
GRANT SELECT ON @extschema@.stage_e_slot_waiters TO PUBLIC;

-- The load of each cap, to tune n against: slots held and throttles per minute, averaged over
-- 1, 5 and 15 minutes (the background worker samples every 5 seconds).
CREATE VIEW @extschema@.stage_e_cap_load AS
SELECT l.cap,
       l.held_1m, l.held_5m, l.held_15m,
       l.throttled_per_min_1m, l.throttled_per_min_5m, l.throttled_per_min_15m
  FROM @extschema@.stage_e_cap_load_internal() AS l
 ORDER BY l.cap;
COMMENT ON VIEW @extschema@.stage_e_cap_load IS
  'Per cap: slots held and throttles per minute, averaged over 1, 5 and 15 minutes.';
GRANT SELECT ON @extschema@.stage_e_cap_load TO PUBLIC;
