-- Views over the counter rows, the pending counts and the lock manager. Bodies qualify the
-- extension's objects and every operator (see src/sql.rs for the rule).

-- Exact live totals per cap: the flushed row plus what is still pending in shared memory. The
-- newest flush_id the view sees goes to stage_e_pending, so a flush committing right now is
-- not counted twice.
CREATE VIEW stage_e_throttle_totals AS
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
       COALESCE(c.expired, 0) OPERATOR(pg_catalog.+) COALESCE(p.expired, 0) AS expired,
       COALESCE(c.rate_limited, 0) OPERATOR(pg_catalog.+) COALESCE(p.rate_limited, 0)
         AS rate_limited
  FROM @extschema@.stage_e_throttle_counter AS c
  FULL JOIN @extschema@.stage_e_pending(
              (SELECT pg_catalog.max(r.flush_id) FROM @extschema@.stage_e_throttle_counter AS r)
            ) AS p
    ON p.cap OPERATOR(pg_catalog.=) c.cap;
COMMENT ON VIEW stage_e_throttle_totals IS
  'Exact live totals per cap: the flushed row plus the counts still pending in shared memory.';
GRANT SELECT ON stage_e_throttle_totals TO PUBLIC;

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

-- Sessions waiting for slots, in queue order per cap (position 1 is next), with their session.
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

-- The load of each cap, to tune n against: slots held and throttles per minute, averaged over
-- 1, 5 and 15 minutes (the background worker samples every 5 seconds).
CREATE VIEW stage_e_cap_load AS
SELECT l.cap,
       l.held_1m, l.held_5m, l.held_15m,
       l.throttled_per_min_1m, l.throttled_per_min_5m, l.throttled_per_min_15m
  FROM @extschema@.stage_e_cap_load_internal() AS l
 ORDER BY l.cap;
COMMENT ON VIEW stage_e_cap_load IS
  'Per cap: slots held and throttles per minute, averaged over 1, 5 and 15 minutes.';
GRANT SELECT ON stage_e_cap_load TO PUBLIC;

-- Percentiles of each cap's hold and wait histograms, for people who read SQL rather than
-- Prometheus (which computes them with histogram_quantile from stage_e_histograms()).
CREATE VIEW stage_e_histogram_quantiles AS
SELECT q.cap, q.metric, q.count, q.p50, q.p90, q.p99
  FROM @extschema@.stage_e_histogram_quantiles_internal() AS q
 ORDER BY q.cap, q.metric;
COMMENT ON VIEW stage_e_histogram_quantiles IS
  'Per cap in use and metric (hold, wait): observations since the cap was made and their 50th, 90th and 99th percentiles, interpolated within the histogram''s buckets as histogram_quantile does.';
GRANT SELECT ON stage_e_histogram_quantiles TO PUBLIC;

-- Adaptive caps (stage_e_adapt): the limit each learned from its hold times, its bounds, and
-- why it last moved.
CREATE VIEW stage_e_cap_limits AS
SELECT l.cap, l."limit", l.min_slots, l.max_slots, l.enforce, l.baseline_hold, l.recent_hold,
       l.held, l.changed_at, l.reason
  FROM @extschema@.stage_e_cap_limits_internal() AS l
 ORDER BY l.cap;
COMMENT ON VIEW stage_e_cap_limits IS
  'One row per adaptive cap of the current database: the limit learned from hold times (applied as least(n, limit) unless enforce is false), its bounds, the baseline and recent hold times, the slots held, and why the limit last moved.';
GRANT SELECT ON stage_e_cap_limits TO PUBLIC;

-- Rate policies (0.10.0): one row per rate-limited cap of this database. A prefix policy shows
-- its pattern ('tenant:*', with its caps' throttles summed) and each live cap under it; a cap
-- shows how many acquisitions of one slot its rate allows now and when the next is allowed.
CREATE VIEW stage_e_rate_limits AS
SELECT r.cap,
       r.count,
       r.per,
       r.burst,
       r.remaining,
       r.next_at,
       CASE WHEN pg_catalog.right(r.cap, 1) OPERATOR(pg_catalog.=) '*'
            THEN (SELECT COALESCE(pg_catalog.sum(t.rate_limited), 0)::pg_catalog.int8
                    FROM @extschema@.stage_e_throttle_totals AS t
                   WHERE pg_catalog.starts_with(t.cap,
                           pg_catalog.left(r.cap, -1)))
            ELSE COALESCE((SELECT t.rate_limited FROM @extschema@.stage_e_throttle_totals AS t
                            WHERE t.cap OPERATOR(pg_catalog.=) r.cap), 0)
       END AS rate_limited
  FROM @extschema@.stage_e_rate_limits_internal() AS r;
COMMENT ON VIEW stage_e_rate_limits IS
  'One row per rate-limited cap of the current database (stage_e_rate_limit): its rate, how many acquisitions of one slot it allows now, when the next is allowed, and how many were throttled by it; a prefix policy shows its pattern and each live cap under it.';
GRANT SELECT ON stage_e_rate_limits TO PUBLIC;

-- Fair shares (0.11.0): one row per live share of a cap (holding or waiting for slots), with
-- its policy as of its last call and what it was granted since it became live.
CREATE VIEW stage_e_shares AS
SELECT s.cap, s.share, s.weight, s.max_slots, s.held, s.waiting, s.granted, s.wait_time
  FROM @extschema@.stage_e_shares_internal() AS s
 ORDER BY s.cap, s.share NULLS FIRST;
COMMENT ON VIEW stage_e_shares IS
  'One row per live fair share of a cap of the current database (stage_e_share, and the share argument of the waiting acquisitions): its weight and ceiling, the slots it holds and the calls waiting in it, the slots granted to it and the time its waiters waited for them since it became live (an idle share is forgotten). share NULL: the cap''s unnamed share, of calls that name none.';
GRANT SELECT ON stage_e_shares TO PUBLIC;
