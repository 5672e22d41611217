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
       c.flushed_at
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
       a.state
  FROM @extschema@.stage_e_slot_holders_internal() AS h
  LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid OPERATOR(pg_catalog.=) h.pid
 ORDER BY h.cap, h.slot;
COMMENT ON VIEW stage_e_slot_holders IS
  'One row per held slot of each cap in the current database, from the lock manager, with the holder''s session.';
GRANT SELECT ON stage_e_slot_holders TO PUBLIC;
