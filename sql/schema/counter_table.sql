-- The durable counters: one row per cap of this database, inserted by the cap's first flush
-- and added to once per flush interval (one statement per database, whatever the rate).
-- The wait and hold counters (0.3.0) come after flush_id, where the update from 0.2.0 adds them,
-- and expired (0.4.0) after them, lock_key (0.7.0), the histograms (0.8.0), then an adaptive
-- cap's policy and learned limit (0.9.0), then a rate policy and the rate_limited counter
-- (0.10.0) last.
-- Every statement of the extension names this table with its schema (see src/sql.rs).
CREATE TABLE stage_e_throttle_counter (
    cap              text PRIMARY KEY
                     CHECK (pg_catalog.octet_length(cap) OPERATOR(pg_catalog.<=) 63),
    acquired         bigint NOT NULL DEFAULT 0,
    throttled        bigint NOT NULL DEFAULT 0,
    released         bigint NOT NULL DEFAULT 0,
    foreign_releases bigint NOT NULL DEFAULT 0,
    released_by_exit bigint NOT NULL DEFAULT 0,
    flushed_at       timestamptz,
    flush_id         bigint NOT NULL DEFAULT 0,
    waits            bigint NOT NULL DEFAULT 0,
    wait_timeouts    bigint NOT NULL DEFAULT 0,
    wait_time        interval NOT NULL DEFAULT '0',
    hold_time        interval NOT NULL DEFAULT '0',
    expired          bigint NOT NULL DEFAULT 0,
    lock_key         integer,
    hold_buckets     bigint[] NOT NULL DEFAULT '{0,0,0,0,0,0,0,0,0,0,0,0,0}',
    wait_buckets     bigint[] NOT NULL DEFAULT '{0,0,0,0,0,0,0,0,0,0,0,0,0}',
    adapt_min        integer,
    adapt_max        integer,
    adapt_enforce    boolean,
    adapt_limit      integer,
    adapt_baseline   interval,
    CONSTRAINT stage_e_throttle_counter_adapt_bounds
      CHECK (adapt_min OPERATOR(pg_catalog.>=) 1 AND adapt_max OPERATOR(pg_catalog.>=) adapt_min),
    rate_count       integer,
    rate_per         interval,
    rate_burst       integer,
    rate_limited     bigint NOT NULL DEFAULT 0,
    CONSTRAINT stage_e_throttle_counter_rate
      CHECK ((rate_count IS NULL) = (rate_per IS NULL) AND (rate_count IS NULL) = (rate_burst IS NULL)
             AND rate_count OPERATOR(pg_catalog.>=) 1 AND rate_burst OPERATOR(pg_catalog.>=) 1
             AND rate_per OPERATOR(pg_catalog.>) '0'::pg_catalog.interval
             AND rate_per OPERATOR(pg_catalog.<=) '1 day'::pg_catalog.interval)
);
-- lock_key (0.7.0): the first int4 of the cap's advisory locks, written by the flush and read
-- when the cap is next made, so that a name whose key collides with another's keeps the key it
-- was given (src/keys.rs). The index serves "which row records key k".
CREATE INDEX stage_e_throttle_counter_lock_key ON stage_e_throttle_counter (lock_key);
COMMENT ON COLUMN stage_e_throttle_counter.lock_key IS
  'The first int4 of the cap''s advisory locks (stage_e_cap_key), kept while this row lives.';
-- The histograms (0.8.0): per bucket, not cumulative, how many holds and waits took at most
-- 1 ms, 4 ms, 16 ms, ... 4194.304 s (1 ms times powers of 4), the 13th above them all; their
-- sums are hold_time and wait_time (stage_e_core::histogram).
COMMENT ON COLUMN stage_e_throttle_counter.hold_buckets IS
  'Holds per bucket (not cumulative): at most 1 ms, 4 ms, 16 ms, ... 4194.304 s (1 ms times powers of 4), then above; their sum is hold_time.';
COMMENT ON COLUMN stage_e_throttle_counter.wait_buckets IS
  'Waits (served or timed out) per bucket, as hold_buckets; their sum is wait_time.';
-- Adaptive caps (0.9.0): the policy stage_e_adapt wrote (NULL: not adaptive), and the limit
-- and baseline hold time the background flusher last wrote, from which a restart resumes.
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
-- Rate policies (0.10.0): what stage_e_rate_limit wrote (NULL: none). A row whose cap ends in
-- '*' ('tenant:*') is a policy for every cap starting with what precedes it, and has no counts.
COMMENT ON COLUMN stage_e_throttle_counter.rate_count IS
  'A rate-limited cap''s count calls per rate_per (stage_e_rate_limit); NULL when it has no rate policy.';
COMMENT ON COLUMN stage_e_throttle_counter.rate_per IS
  'The interval rate_count is over (at most 1 day).';
COMMENT ON COLUMN stage_e_throttle_counter.rate_burst IS
  'How many acquisitions may come at once (1: none).';
COMMENT ON COLUMN stage_e_throttle_counter.rate_limited IS
  'Acquisitions throttled by the cap''s rate policy (counted in throttled too).';
COMMENT ON TABLE stage_e_throttle_counter IS
  'Durable stage_e_slots counters of this database: one row per cap, written by its first flush and added to once per flush interval. Rows of caps no longer used may be deleted.';
-- No row is inserted here: pg_dump keeps the table's data, and a restore (which runs
-- CREATE EXTENSION first) must find the table empty.
SELECT pg_catalog.pg_extension_config_dump('stage_e_throttle_counter', '');
GRANT SELECT ON stage_e_throttle_counter TO PUBLIC;
-- A write of the policy columns not made by the extension (an UPDATE or DELETE by the owner, a
-- restore's COPY into a database in use, a TRUNCATE) binds the adaptive and rate policies the
-- rows then say from its commit (0.11.0), as a restart would: the rows and what binds agree.
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
