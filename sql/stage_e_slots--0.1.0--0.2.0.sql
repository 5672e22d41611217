-- stage_e_slots 0.1.0 -> 0.2.0: named caps.
--
-- The anonymous cap of 0.1.0 becomes the cap named 'default' (its slot s is still the lock
-- (stage_e_slots.lock_key, s), so sessions holding slots keep them across this update), and
-- its counter row becomes the row of cap 'default'. The result is the same schema as a fresh
-- 0.2.0 install (the update test compares them).
\echo Use "ALTER EXTENSION stage_e_slots UPDATE TO '0.2.0'" to load this file. \quit

-- Objects whose shape changes are dropped and created again; the views go first.
DROP VIEW @extschema@.stage_e_throttle_totals;
DROP VIEW @extschema@.stage_e_slot_holders;
DROP FUNCTION @extschema@.stage_e_stats();
DROP FUNCTION @extschema@.stage_e_slot_holders_internal();
DROP FUNCTION @extschema@.stage_e_flush();
DROP FUNCTION @extschema@.stage_e_pending(bigint);

-- The counter table: from one row to one row per cap, the 0.1.0 row becoming 'default'.
ALTER TABLE @extschema@.stage_e_throttle_counter RENAME TO stage_e_throttle_counter_0_1_0;
-- Its constraints (the primary key with its index, the check, and on PostgreSQL 18 the NOT NULL
-- constraints, which have names there too) step aside, so the new table's get the same names
-- as in a fresh install.
DO $$
DECLARE
  c record;
BEGIN
  FOR c IN SELECT k.conname FROM pg_catalog.pg_constraint AS k
            WHERE k.conrelid OPERATOR(pg_catalog.=)
                  '@extschema@.stage_e_throttle_counter_0_1_0'::pg_catalog.regclass
  LOOP
    EXECUTE pg_catalog.format(
      'ALTER TABLE @extschema@.stage_e_throttle_counter_0_1_0 RENAME CONSTRAINT %I TO %I',
      c.conname, c.conname OPERATOR(pg_catalog.||) '_0_1_0');
  END LOOP;
END
$$;

CREATE TABLE @extschema@.stage_e_throttle_counter (
    cap              text PRIMARY KEY
                     CHECK (pg_catalog.octet_length(cap) OPERATOR(pg_catalog.<=) 63),
    acquired         bigint NOT NULL DEFAULT 0,
    throttled        bigint NOT NULL DEFAULT 0,
    released         bigint NOT NULL DEFAULT 0,
    foreign_releases bigint NOT NULL DEFAULT 0,
    released_by_exit bigint NOT NULL DEFAULT 0,
    flushed_at       timestamptz,
    flush_id         bigint NOT NULL DEFAULT 0
);
COMMENT ON TABLE @extschema@.stage_e_throttle_counter IS
  'Durable stage_e_slots counters of this database: one row per cap, written by its first flush and added to once per flush interval. Rows of caps no longer used may be deleted.';
INSERT INTO @extschema@.stage_e_throttle_counter
       (cap, acquired, throttled, released, foreign_releases, released_by_exit, flushed_at,
        flush_id)
SELECT 'default', acquired, throttled, released, foreign_releases, released_by_exit,
       flushed_at, flush_id
  FROM @extschema@.stage_e_throttle_counter_0_1_0;
-- Out of the extension first: that also takes it off the list of tables pg_dump keeps.
ALTER EXTENSION stage_e_slots DROP TABLE @extschema@.stage_e_throttle_counter_0_1_0;
DROP TABLE @extschema@.stage_e_throttle_counter_0_1_0;
SELECT pg_catalog.pg_extension_config_dump('@extschema@.stage_e_throttle_counter', '');
GRANT SELECT ON @extschema@.stage_e_throttle_counter TO PUBLIC;

-- Functions of 0.2.0, as the generated install script defines them.
CREATE FUNCTION @extschema@."stage_e_cap_key"(
	"cap" TEXT
) RETURNS INT
STABLE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_cap_key_wrapper';

CREATE FUNCTION @extschema@."stage_e_try_slot"(
	"cap" TEXT,
	"n" INT
) RETURNS INT
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_try_slot_cap_wrapper';

CREATE FUNCTION @extschema@."stage_e_release"(
	"cap" TEXT,
	"slot" INT
) RETURNS bool
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_release_cap_wrapper';

CREATE FUNCTION @extschema@."stage_e_holding"(
	"cap" TEXT,
	"slot" INT
) RETURNS bool
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_holding_cap_wrapper';

CREATE FUNCTION @extschema@."stage_e_release_all"(
	"cap" TEXT
) RETURNS INT
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_release_all_cap_wrapper';

CREATE FUNCTION @extschema@."stage_e_reset_stats"(
	"cap" TEXT
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_reset_stats_cap_wrapper';

CREATE FUNCTION @extschema@."stage_e_stats"() RETURNS TABLE (
	"cap" TEXT,
	"max_slots" INT,
	"held" INT,
	"acquired" bigint,
	"throttled" bigint,
	"released" bigint,
	"foreign_releases" bigint,
	"released_by_exit" bigint
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_stats_v2_wrapper';

CREATE FUNCTION @extschema@."stage_e_slot_holders_internal"() RETURNS TABLE (
	"cap" TEXT,
	"slot" INT,
	"pid" INT,
	"acquired_at" timestamp with time zone
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_slot_holders_internal_v2_wrapper';

CREATE FUNCTION @extschema@."stage_e_flush"() RETURNS TABLE (
	"cap" TEXT,
	"acquired" bigint,
	"throttled" bigint,
	"released" bigint,
	"foreign_releases" bigint,
	"released_by_exit" bigint
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_flush_v2_wrapper';

CREATE FUNCTION @extschema@."stage_e_pending"(
	"row_flush_id" bigint DEFAULT NULL
) RETURNS TABLE (
	"cap" TEXT,
	"acquired" bigint,
	"throttled" bigint,
	"released" bigint,
	"foreign_releases" bigint,
	"released_by_exit" bigint
)
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_pending_v2_wrapper';

CREATE OR REPLACE FUNCTION @extschema@."stage_e_snapshot"() RETURNS jsonb
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_snapshot_v2_wrapper';

REVOKE EXECUTE ON FUNCTION @extschema@.stage_e_flush() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION @extschema@.stage_e_reset_stats(text) FROM PUBLIC;

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
       c.flushed_at
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
       a.state
  FROM @extschema@.stage_e_slot_holders_internal() AS h
  LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid OPERATOR(pg_catalog.=) h.pid
 ORDER BY h.cap, h.slot;
COMMENT ON VIEW @extschema@.stage_e_slot_holders IS
  'One row per held slot of each cap in the current database, from the lock manager, with the holder''s session.';
GRANT SELECT ON @extschema@.stage_e_slot_holders TO PUBLIC;
