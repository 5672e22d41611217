-- stage_e_slots 0.5.0 -> 0.6.0: caps keep binding across restarts, crashes and failovers
-- (docs/lifecycle.md).
--
-- Adds the table stage_e_lease_horizon (each cap's durable lease horizon, token floor and lease
-- journal, written by the background flusher) and the view stage_e_held_back. Until a database
-- is updated, the 0.6.0 library serves it as 0.5.0 did: a clean restart keeps its leases, but
-- a crash or a failover frees them. From the first flush after the update on, its leases are
-- covered. The result is the same schema as a fresh 0.6.0 install (the update test compares
-- them).
\echo Use "ALTER EXTENSION stage_e_slots UPDATE TO '0.6.0'" to load this file. \quit

CREATE FUNCTION "stage_e_held_back_internal"() RETURNS TABLE (
	"cap" TEXT,  /* String */
	"held_until" timestamp with time zone,  /* Option < TimestampWithTimeZone > */
	"reason" TEXT  /* String */
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'stage_e_held_back_internal_wrapper';

-- What outlives shared memory (docs/lifecycle.md): one row per cap of this database, written
-- only by the background flusher, in its own committed transaction, ahead of need. A lease is
-- granted only while its expiry plus stage_e_slots.lease_horizon_margin is at most the
-- committed horizon, and its token at most token_floor; after a crash or a promotion, a cap
-- whose horizon is in the future is held back until it, and its journaled leases (leases:
-- [[slot, token, expires_at in microseconds since 2000-01-01], ...]) can be reclaimed by
-- renewing them.
CREATE TABLE stage_e_lease_horizon (
    cap         text PRIMARY KEY
                CHECK (pg_catalog.octet_length(cap) OPERATOR(pg_catalog.<=) 63),
    horizon     timestamptz NOT NULL,
    token_floor bigint NOT NULL,
    n           integer NOT NULL,
    leases      jsonb NOT NULL DEFAULT '[]',
    written_at  timestamptz NOT NULL
);
COMMENT ON TABLE stage_e_lease_horizon IS
  'Durable lease horizon, token floor and lease journal of each cap of this database, written by the stage_e_slots flusher: after a crash or a failover, caps are held back until their horizon. Internal: do not write.';
-- The journal holds every holder's token: readable by superusers and the extension's owner
-- only. Not dumped: like pg_stat's files, it describes the running server, not the data.
REVOKE ALL ON stage_e_lease_horizon FROM PUBLIC;

CREATE VIEW stage_e_held_back AS
SELECT h.cap, h.held_until, h.reason
  FROM @extschema@.stage_e_held_back_internal() AS h
 ORDER BY h.cap;
COMMENT ON VIEW stage_e_held_back IS
  'Caps of this database held back after a crash or a promotion (reason crash, promotion or recovery_hold): no new slot or lease until held_until. Empty on a standby and when none is.';
GRANT SELECT ON stage_e_held_back TO PUBLIC;
