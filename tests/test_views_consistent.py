"""What the views show while slots pass between sessions and leases (issue 35): the holders view
and stage_e_stats().held read the lock manager and the lease records as one reading, so a slot
handed from a session to a lease (or back) between the two reads never shows twice."""

import threading
import time

from conftest import one
from psycopg import sql
from test_leases import lease, release_lease

# Session slots taken and given back, server-side, as fast as one backend can, until `until`.
SESSION_LOOP = """
DO $$
DECLARE s int;
BEGIN
  WHILE pg_catalog.clock_timestamp() < {until}::timestamptz LOOP
    s := public.stage_e_try_slot('flip', 1);
    IF s IS NOT NULL THEN PERFORM public.stage_e_release('flip', s); END IF;
  END LOOP;
END $$"""

# Leases of the same cap taken and given back likewise.
LEASE_LOOP = """
DO $$
DECLARE l public.stage_e_lease_slot;
BEGIN
  WHILE pg_catalog.clock_timestamp() < {until}::timestamptz LOOP
    l := public.stage_e_lease('flip', 1, '1 min');
    IF l.slot IS NOT NULL THEN
      PERFORM public.stage_e_release_lease('flip', l.slot, l.token);
    END IF;
  END LOOP;
END $$"""

# One poll: the cap's rows in the holders view, its distinct slots and its leases there (one
# reading of the view), and its held count in stage_e_stats() (another).
POLL = """
SELECT h.rows, h.slots, h.leases, (SELECT held FROM stage_e_stats() WHERE cap = 'flip')
  FROM (SELECT pg_catalog.count(*) AS rows, pg_catalog.count(DISTINCT slot) AS slots,
               pg_catalog.count(token) AS leases
          FROM stage_e_slot_holders WHERE cap = 'flip') AS h"""


def test_a_slot_passing_between_a_session_and_a_lease_shows_once(connect):
    sessions, leases, poller = connect("flip-session"), connect("flip-lease"), connect("flip-poll")
    # The first lease waits for the cap's committed horizon; the loop's leases then find it.
    slot, token = lease(leases, "flip", 1, "1 min", "10 s")
    assert slot == 0 and release_lease(leases, "flip", slot, token) is True
    until = one(poller, "SELECT (clock_timestamp() + interval '6 s')::text")
    failures = []

    def loop(conn, q):
        try:
            conn.execute(sql.SQL(q).format(until=sql.Literal(until)))
        except Exception as e:  # noqa: BLE001 - reported by the test
            failures.append(e)

    loops = [threading.Thread(target=loop, args=(c, q))
             for c, q in ((sessions, SESSION_LOOP), (leases, LEASE_LOOP))]
    for t in loops:
        t.start()
    polls, seen, bad = 0, set(), []
    try:
        # Polled until the loops' end less a margin (both loops run all along), or the first
        # reading that shows more than n = 1 holder: on 0.9.0 about 2% of polls did.
        stop = time.monotonic() + 5
        while time.monotonic() < stop and not bad:
            rows, slots, leased, held = poller.execute(POLL).fetchone()
            polls += 1
            seen.add((rows, leased))
            if rows > 1 or slots != rows or (held or 0) > 1:
                bad.append((rows, slots, held))
    finally:
        if bad:  # seen: no need to let the loops run out
            for c in (sessions, leases):
                c.cancel_safe()
        for t in loops:
            t.join()
    assert not bad, f"poll {polls} showed (rows, distinct slots, held) = {bad[0]} with n = 1"
    assert not failures, failures
    # The slot did pass around while polled: held by a session, by a lease, and by none.
    assert polls > 500 and {(1, 0), (1, 1), (0, 0)} <= seen, (polls, seen)


def test_a_raw_lock_on_a_leased_slot_still_shows_twice(connect):
    """The views read the two kinds of holder as one reading, they do not merge rows: a raw
    pg_advisory_lock taken on a leased slot is a real double admission, and shows as one."""
    owner, raw, viewer = connect("raw-lease"), connect("raw-lock"), connect("raw-view")
    slot, token = lease(owner, "raw", 1, "1 min", "10 s")
    assert slot == 0
    assert one(raw, "SELECT pg_try_advisory_lock(stage_e_cap_key('raw'), 0)") is True
    rows = viewer.execute("SELECT slot, pid, token FROM stage_e_slot_holders WHERE cap = 'raw' "
                          "ORDER BY token NULLS FIRST").fetchall()
    pids = [one(c, "SELECT pg_backend_pid()") for c in (raw, owner)]
    assert rows == [(0, pids[0], None), (0, pids[1], token)], rows
    assert one(viewer, "SELECT held FROM stage_e_stats() WHERE cap = 'raw'") == 2
    assert release_lease(owner, "raw", slot, token) is True
