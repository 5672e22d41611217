-- stage_e_slots 0.10.0 -> 0.11.0: fair shares.
--
-- One cap shared among tenants: the waiting acquisitions gain a last argument, share
-- (stage_e_try_slot(cap, n, wait, share), stage_e_try_slots(cap, n, k, wait, share),
-- stage_e_lease(cap, n, ttl, wait, share)); while shares compete, freed slots go by start-time
-- fair queuing over the shares' weights, within each share's ceiling. stage_e_share(cap,
-- share, weight, max_slots) sets a share's weight and ceiling (share '*': every other share
-- of the cap), restricted as stage_e_rate_limit is, and keeps them in the new table
-- stage_e_share_policy (whose trigger makes a write by hand bind from its commit as well).
-- The view stage_e_shares shows the live shares; stage_e_slot_holders
-- and stage_e_slot_waiters gain share as their last column (their internal functions change
-- shape, so both views are dropped and made again: a view of yours over either must be
-- dropped first and made again after). Until a database is updated, the 0.11.0 library serves
-- it as 0.10.0 did. The result is the same schema as a fresh 0.11.0 install (the update test
-- compares them).
\echo Use "ALTER EXTENSION stage_e_slots UPDATE TO '0.11.0'" to load this file. \quit

CREATE TABLE stage_e_share_policy (
    cap       text NOT NULL
              CHECK (pg_catalog.octet_length(cap) OPERATOR(pg_catalog.>=) 1
                     AND pg_catalog.octet_length(cap) OPERATOR(pg_catalog.<=) 63),
    share     text NOT NULL
              CHECK (pg_catalog.octet_length(share) OPERATOR(pg_catalog.>=) 1
                     AND pg_catalog.octet_length(share) OPERATOR(pg_catalog.<=) 63),
    weight    integer NOT NULL DEFAULT 1
              CHECK (weight OPERATOR(pg_catalog.>=) 1 AND weight OPERATOR(pg_catalog.<=) 16),
    max_slots integer CHECK (max_slots OPERATOR(pg_catalog.>=) 1),
    PRIMARY KEY (cap, share)
);
COMMENT ON TABLE stage_e_share_policy IS
  'Fair shares of caps (stage_e_share): each share''s weight (1 to 16) and ceiling (max_slots, NULL for none); share ''*'' is the default of the cap''s other shares.';
COMMENT ON COLUMN stage_e_share_policy.weight IS
  'The share''s part of the cap''s slots when shares compete, against the others'' weights (1 to 16).';
COMMENT ON COLUMN stage_e_share_policy.max_slots IS
  'The most slots of the cap the share holds at once; NULL for no ceiling.';
SELECT pg_catalog.pg_extension_config_dump('stage_e_share_policy', '');
GRANT SELECT ON stage_e_share_policy TO PUBLIC;
-- A write not made by stage_e_share (an UPDATE by hand, a restore's COPY, a TRUNCATE) moves
-- the database's generation of share policies at its commit too: no session keeps a policy
-- it read before.
CREATE FUNCTION "stage_e_share_policy_written"() RETURNS trigger
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_share_policy_written_wrapper';
CREATE TRIGGER stage_e_share_policy_written
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON stage_e_share_policy
    FOR EACH STATEMENT EXECUTE FUNCTION stage_e_share_policy_written();
ALTER TABLE stage_e_share_policy ENABLE ALWAYS TRIGGER stage_e_share_policy_written;
-- A write of stage_e_throttle_counter's policy columns not made by the extension binds the
-- adaptive and rate policies the rows then say from its commit, as a restart would.
CREATE FUNCTION "stage_e_throttle_counter_written"() RETURNS trigger
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_throttle_counter_written_wrapper';
CREATE TRIGGER stage_e_throttle_counter_written
    AFTER INSERT
       OR UPDATE OF cap, adapt_min, adapt_max, adapt_enforce, rate_count, rate_per, rate_burst
       OR DELETE OR TRUNCATE ON stage_e_throttle_counter
    FOR EACH STATEMENT EXECUTE FUNCTION stage_e_throttle_counter_written();
-- Also in a session whose session_replication_role is replica (a bulk load, a logical
-- replication apply): the write binds all the same.
ALTER TABLE stage_e_throttle_counter ENABLE ALWAYS TRIGGER stage_e_throttle_counter_written;
-- The rows that keep a policy: the trigger reads them (and the rows of the caps whose policy
-- binds) after every write by hand, so a restore of one INSERT per row stays linear.
CREATE INDEX stage_e_throttle_counter_policies ON stage_e_throttle_counter (cap)
    WHERE adapt_max IS NOT NULL OR rate_count IS NOT NULL;

CREATE FUNCTION "stage_e_try_slot"(
	"cap" TEXT,
	"n" INT,
	"wait" interval,
	"share" TEXT
) RETURNS INT
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_try_slot_share_wrapper';

CREATE FUNCTION "stage_e_try_slots"(
	"cap" TEXT,
	"n" INT,
	"k" INT,
	"wait" interval,
	"share" TEXT
) RETURNS INT[]
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_try_slots_share_wrapper';

CREATE FUNCTION "stage_e_lease"(
	"cap" TEXT,
	"n" INT,
	"ttl" interval,
	"wait" interval,
	"share" TEXT
) RETURNS stage_e_lease_slot
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_lease_share_wrapper';

CREATE FUNCTION "stage_e_share"(
	"cap" TEXT,
	"share" TEXT,
	"weight" INT DEFAULT 1,
	"max_slots" INT DEFAULT NULL
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_share_wrapper';
-- A share's weight and ceiling bind every role that uses the cap, and are kept in
-- stage_e_share_policy: the same.
REVOKE EXECUTE ON FUNCTION stage_e_share(text, text, integer, integer) FROM PUBLIC;
-- The policy tables' trigger functions: CREATE TRIGGER needs EXECUTE, and no role but the
-- extension's tables has use for them (each refuses to fire on any other table too).
REVOKE EXECUTE ON FUNCTION stage_e_throttle_counter_written() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION stage_e_share_policy_written() FROM PUBLIC;

CREATE FUNCTION "stage_e_shares_internal"() RETURNS TABLE (
	"cap" TEXT,
	"share" TEXT,
	"weight" INT,
	"max_slots" INT,
	"held" INT,
	"waiting" INT,
	"granted" bigint,
	"wait_time" interval
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_shares_internal_wrapper';

-- The holders and waiters gain their share: their functions change shape, so the views go
-- and come back with them.
DROP VIEW stage_e_slot_holders;
DROP VIEW stage_e_slot_waiters;
DROP FUNCTION stage_e_slot_holders_internal();
DROP FUNCTION stage_e_slot_waiters_internal();

CREATE FUNCTION "stage_e_slot_holders_internal"() RETURNS TABLE (
	"cap" TEXT,
	"slot" INT,
	"pid" INT,
	"acquired_at" timestamp with time zone,
	"token" bigint,
	"expires_at" timestamp with time zone,
	"share" TEXT
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_slot_holders_internal_v4_wrapper';

CREATE FUNCTION "stage_e_slot_waiters_internal"() RETURNS TABLE (
	"cap" TEXT,
	"pid" INT,
	"n" INT,
	"k" INT,
	"waiting_since" timestamp with time zone,
	"position" INT,
	"share" TEXT
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stage_e_slot_waiters_internal_v2_wrapper';

CREATE VIEW stage_e_slot_holders AS
SELECT h.cap,
       h.slot,
       h.pid,
       h.acquired_at,
       pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) h.acquired_at AS held_for,
       a.application_name,
       a.client_addr,
       a.state,
       h.token,
       h.expires_at,
       h.share
  FROM @extschema@.stage_e_slot_holders_internal() AS h
  LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid OPERATOR(pg_catalog.=) h.pid
 ORDER BY h.cap, h.slot;
COMMENT ON VIEW stage_e_slot_holders IS
  'One row per held slot of each cap in the current database: session slots from the lock manager, with the holder''s session, and leases with their token and expiry (pid is the backend that took the lease, which may be gone); share is the fair share the slot was taken in (NULL: none, or the cap''s unnamed share).';
GRANT SELECT ON stage_e_slot_holders TO PUBLIC;

CREATE VIEW stage_e_slot_waiters AS
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
       a.wait_event,
       w.share
  FROM @extschema@.stage_e_slot_waiters_internal() AS w
  LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid OPERATOR(pg_catalog.=) w.pid
 ORDER BY w.cap, w.position;
COMMENT ON VIEW stage_e_slot_waiters IS
  'One row per session waiting for slots of a cap in the current database, in queue order (arrival); share is the fair share it waits in (NULL: none, or the cap''s unnamed share).';
GRANT SELECT ON stage_e_slot_waiters TO PUBLIC;

-- Fair shares (0.11.0): one row per live share of a cap (holding or waiting for slots), with
-- its policy as of its last call and what it was granted since it became live.
CREATE VIEW stage_e_shares AS
SELECT s.cap, s.share, s.weight, s.max_slots, s.held, s.waiting, s.granted, s.wait_time
  FROM @extschema@.stage_e_shares_internal() AS s
 ORDER BY s.cap, s.share NULLS FIRST;
COMMENT ON VIEW stage_e_shares IS
  'One row per live fair share of a cap of the current database (stage_e_share, and the share argument of the waiting acquisitions): its weight and ceiling, the slots it holds and the calls waiting in it, the slots granted to it and the time its waiters waited for them since it became live (an idle share is forgotten). share NULL: the cap''s unnamed share, of calls that name none.';
GRANT SELECT ON stage_e_shares TO PUBLIC;
