-- stage_e_slots 0.3.0 -> 0.4.0: leases (slots held by a token rather than a session, so they
-- work through transaction poolers), fencing tokens, and the expired counter.
--
-- The result is the same schema as a fresh 0.4.0 install (the update test compares them).
\echo Use "ALTER EXTENSION stage_e_slots UPDATE TO '0.4.0'" to load this file. \quit

-- Objects whose shape changes are dropped and created again; the views over them go first.
DROP VIEW @extschema@.stage_e_throttle_totals;
DROP VIEW @extschema@.stage_e_slot_holders;
DROP FUNCTION @extschema@.stage_e_stats();
DROP FUNCTION @extschema@.stage_e_flush();
DROP FUNCTION @extschema@.stage_e_pending(bigint);
DROP FUNCTION @extschema@.stage_e_slot_holders_internal();

-- The new counter, after hold_time (where a fresh install has it too); rows start it at zero.
ALTER TABLE @extschema@.stage_e_throttle_counter
    ADD COLUMN expired bigint NOT NULL DEFAULT 0;

CREATE TYPE @extschema@.stage_e_lease_slot AS (slot integer, token bigint);
COMMENT ON TYPE @extschema@.stage_e_lease_slot IS 'A leased slot and its fencing token.';

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
	"hold_time" interval,
	"expired" bigint
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_stats_v4_wrapper';

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
	"hold_time" interval,
	"expired" bigint
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_flush_v4_wrapper';
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
	"hold_time" interval,
	"expired" bigint
)
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_pending_v4_wrapper';

CREATE FUNCTION @extschema@."stage_e_slot_holders_internal"() RETURNS TABLE (
	"cap" TEXT,
	"slot" INT,
	"pid" INT,
	"acquired_at" timestamp with time zone,
	"token" bigint,
	"expires_at" timestamp with time zone
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_slot_holders_internal_v3_wrapper';

CREATE FUNCTION @extschema@."stage_e_lease"(
	"cap" TEXT,
	"n" INT,
	"ttl" interval,
	"wait" interval DEFAULT '0'
) RETURNS @extschema@.stage_e_lease_slot
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_lease_wrapper';

CREATE FUNCTION @extschema@."stage_e_renew"(
	"cap" TEXT,
	"slot" INT,
	"token" bigint,
	"ttl" interval
) RETURNS bool
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_renew_wrapper';

CREATE FUNCTION @extschema@."stage_e_release_lease"(
	"cap" TEXT,
	"slot" INT,
	"token" bigint
) RETURNS bool
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_release_lease_wrapper';

CREATE FUNCTION @extschema@."stage_e_slot_token"(
	"cap" TEXT,
	"slot" INT
) RETURNS bigint
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_slot_token_wrapper';

-- The views, as sql/schema/views.sql defines them.
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
       COALESCE(c.hold_time, '0') OPERATOR(pg_catalog.+) COALESCE(p.hold_time, '0') AS hold_time,
       COALESCE(c.expired, 0) OPERATOR(pg_catalog.+) COALESCE(p.expired, 0) AS expired
  FROM @extschema@.stage_e_throttle_counter AS c
  FULL JOIN @extschema@.stage_e_pending(
              (SELECT pg_catalog.max(r.flush_id) FROM @extschema@.stage_e_throttle_counter AS r)
            ) AS p
    ON p.cap OPERATOR(pg_catalog.=) c.cap;
COMMENT ON VIEW @extschema@.stage_e_throttle_totals IS
  'Exact live totals per cap: the flushed row plus the counts still pending in shared memory.';
GRANT SELECT ON @extschema@.stage_e_throttle_totals TO PUBLIC;

CREATE VIEW @extschema@.stage_e_slot_holders AS
SELECT h.cap,
       h.slot,
       h.pid,
       h.acquired_at,
       pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) h.acquired_at AS held_for,
       a.application_name,
       a.client_addr,
       a.state,
       h.token,
       h.expires_at
  FROM @extschema@.stage_e_slot_holders_internal() AS h
  LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid OPERATOR(pg_catalog.=) h.pid
 ORDER BY h.cap, h.slot;
COMMENT ON VIEW @extschema@.stage_e_slot_holders IS
  'One row per held slot of each cap in the current database: session slots from the lock manager, with the holder''s session, and leases with their token and expiry (pid is the backend that took the lease, which may be gone).';
GRANT SELECT ON @extschema@.stage_e_slot_holders TO PUBLIC;
