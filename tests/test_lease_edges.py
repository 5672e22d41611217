"""Leases at their edges, as the README states them: fencing tokens keep growing across a cap's
reclaim and re-make within one server run (the everyday path of per-tenant caps); a cap held
only by leases is never reclaimed, however much room new caps need; a lease is not
transactional (a rolled-back transaction keeps it, like a session slot); `SELECT
(stage_e_lease(...)).*` runs the function once per column and takes two leases; a raw advisory
lock on a leased slot's key is not refused; and tokens keep growing across a clean restart,
a backend crash and a kill -9 of the postmaster.

(Also README claims about leases tested elsewhere: a clean restart keeps every lease exactly,
tests/test_lifecycle.py::test_a_clean_restart_keeps_every_lease_exactly; a dropped database's
leases are freed by the launcher, tests/test_hardening_shares.py::
test_a_dropped_databases_leases_are_freed.)
"""

import os
import signal
import time

import psycopg
import pytest
from conftest import cap_locks, one, stats
from pgcluster import Cluster, children_of, proc_state, wait_for
from psycopg import errors
from test_leases import holders, lease, lease_rows, release_lease, slot_token

MAX_CAPS = 16


@pytest.fixture(scope="module")
def few():
    """Room for 16 caps, flushed only when asked (or when a refused cap asks for a round), so
    that which caps are idle is up to the test."""
    c = Cluster("lease_edges", {"stage_e_slots.max_caps": MAX_CAPS,
                                "stage_e_slots.flush_interval": "'1h'"}).init().start()
    yield c
    c.destroy()


def caps_in_use(conn):
    """The caps of this database that have an entry now (stage_e_stats() lists those)."""
    return {r[0] for r in conn.execute("SELECT cap FROM stage_e_stats()").fetchall()}


@pytest.fixture
def fdb(few, request):
    """A database of its own on `few`, dropped at the end (its caps then never idle-count
    against the next test: a dropped database's caps are reclaimed first)."""
    name = "e_" + request.node.name.lower().replace("[", "_").replace("]", "").replace("-", "_")
    few.create_database(name[:60])
    yield name[:60]
    few.sql(f'DROP DATABASE IF EXISTS "{name[:60]}" WITH (FORCE)')


def fill_until(conn, prefix, done, limit=4 * MAX_CAPS):
    """Takes a slot of cap prefix0, prefix1, ... until `done()` (True), or until a new cap is
    refused (False): then every entry of the server is truly in use. Returns (result, tokens
    of the slots taken, how many caps were taken)."""
    tokens = []
    for i in range(limit):
        if done():
            return True, tokens, i
        try:
            assert one(conn, "SELECT stage_e_try_slot(%s, 1)", (f"{prefix}{i}",)) == 0
        except errors.ConfigurationLimitExceeded as e:
            assert "stage_e_slots.max_caps" in e.diag.message_hint
            return False, tokens, i
        tokens.append(slot_token(conn, f"{prefix}{i}", 0))
    raise AssertionError(f"{limit} caps taken and still not done")


def test_tokens_keep_growing_across_a_caps_reclaim_and_remake(few, fdb):
    """Cap tenant:0 is used (a session slot and a lease), goes idle, is reclaimed to make room
    for other caps, and is made again: its new tokens are above every token the server gave
    before, its own and the other caps'. That the cap really was reclaimed and made again is
    shown by stage_e_stats(), which lists the caps with an entry and counts since the cap was
    made."""
    with few.connect(fdb, "tenant") as s, few.connect(fdb, "fillers") as f:
        seen = []
        assert one(s, "SELECT stage_e_try_slot('tenant:0', 1)") == 0
        seen.append(slot_token(s, "tenant:0", 0))
        assert one(s, "SELECT stage_e_release('tenant:0', 0)") is True
        slot, token = lease(s, "tenant:0", 1, "1 min")
        seen.append(token)
        assert release_lease(s, "tenant:0", slot, token) is True
        s.execute("SELECT stage_e_flush()")  # its counts in its row: idle now
        key = one(s, "SELECT stage_e_cap_key('tenant:0')")
        # Other caps, each holding a slot, until one of them needed tenant:0's entry.
        reclaimed, tokens, fillers = fill_until(
            f, "filler:", lambda: "tenant:0" not in caps_in_use(s))
        assert reclaimed, "tenant:0 was never reclaimed"
        seen += tokens
        # Room for tenant:0 again: one filler let go (and flushed, so idle).
        assert one(f, "SELECT stage_e_release('filler:0', 0)") is True
        s.execute("SELECT stage_e_flush()")
        assert one(s, "SELECT stage_e_try_slot('tenant:0', 1)") == 0
        assert "tenant:0" in caps_in_use(s)
        # Made again: its counts start over (its row kept the earlier ones: the totals, row
        # plus pending, count all three, whether or not a requested flush round has run since),
        # its key is its own.
        assert (stats(s, "tenant:0")["acquired"], stats(s, "tenant:0")["released"]) == (1, 0)
        assert one(s, "SELECT acquired FROM stage_e_throttle_totals "
                      "WHERE cap = 'tenant:0'") == 3
        assert one(s, "SELECT stage_e_cap_key('tenant:0')") == key
        again = slot_token(s, "tenant:0", 0)
        assert again > max(seen), (again, seen)
        assert one(s, "SELECT stage_e_release('tenant:0', 0)") is True
        slot, later = lease(s, "tenant:0", 1, "1 min")
        assert later > again
        assert release_lease(s, "tenant:0", slot, later) is True
        assert one(f, "SELECT stage_e_release_all()") == fillers - 1


@pytest.mark.parametrize("lease_kept", [True, False], ids=["leased", "control-released"])
def test_a_cap_held_only_by_leases_is_never_reclaimed(few, fdb, lease_kept):
    """A cap whose only holder is a lease (no session slot, no pending count) is not idle: new
    caps are made until one is refused (53400, after the room wait: every entry of the server
    truly in use), reclaiming every idle cap on the way, and the leased cap is not among them;
    its lease is untouched. The control: the same cap with its lease released is idle, and is
    reclaimed on the way like the other idle cap."""
    with few.connect(fdb, "leaser") as s, few.connect(fdb, "fillers") as f, \
            few.connect(fdb, "newcomer") as t:
        slot, token = lease(s, "leased", 1, "10 min")
        if not lease_kept:
            assert release_lease(s, "leased", slot, token) is True
        # An idle cap too, which room pressure must take.
        assert one(s, "SELECT stage_e_try_slot('idle', 1)") == 0
        assert one(s, "SELECT stage_e_release('idle', 0)") is True
        s.execute("SELECT stage_e_flush()")  # no pending count anywhere
        before = lease_rows(s, "leased")
        started = time.monotonic()
        done, _, fillers = fill_until(f, "held", lambda: False)
        assert not done and fillers >= MAX_CAPS - 2
        assert time.monotonic() - started >= 0.95  # the last one waited for room in vain
        assert "idle" not in caps_in_use(s)  # the pressure was real: it took the idle cap
        if not lease_kept:
            assert "leased" not in caps_in_use(s)
        else:
            assert "leased" in caps_in_use(s), "a cap holding a lease was reclaimed"
            # The lease is as it was, and still binds; its cap's counts were not reset.
            assert lease_rows(s, "leased") == before and before[0][2] == token
            assert (stats(s, "leased")["acquired"], stats(s, "leased")["held"]) == (1, 1)
            assert lease(t, "leased", 1, "1 min") == (None, None)
            assert one(t, "SELECT stage_e_try_slot('leased', 1)") is None
            assert release_lease(t, "leased", slot, token) is True
            s.execute("SELECT stage_e_flush()")
            # Idle now: a new cap takes its entry at once.
            started = time.monotonic()
            assert one(t, "SELECT stage_e_try_slot('new', 1)") == 0
            assert time.monotonic() - started < 0.9  # no room wait: an idle entry was there
            assert "leased" not in caps_in_use(s)
        assert one(f, "SELECT stage_e_release_all()") == fillers


@pytest.mark.parametrize("how", ["rollback", "error", "savepoint"])
def test_a_lease_taken_in_a_rolled_back_transaction_stays_taken(connect, how):
    """A lease is not transactional: ROLLBACK, an aborted transaction and a rolled-back
    savepoint all keep it (and the session slot taken beside it, as with any session lock)."""
    c, observer = connect("taker"), connect("observer")
    c.execute("BEGIN")
    if how == "savepoint":
        c.execute("SAVEPOINT s")
    slot, token = lease(c, "rb", 2, "1 min")
    assert one(c, "SELECT stage_e_try_slot('rb', 2)") == 1
    if how == "rollback":
        c.execute("ROLLBACK")
    elif how == "error":
        with pytest.raises(errors.DivisionByZero):
            c.execute("SELECT 1 / 0")
        c.execute("ROLLBACK")
    else:
        c.execute("ROLLBACK TO SAVEPOINT s")
        c.execute("COMMIT")
    assert (slot, token is not None) == (0, True)
    assert [(h["slot"], h["token"]) for h in holders(observer, "rb")] == [(0, token), (1, None)]
    assert cap_locks(observer, "rb") == [(1, c.info.backend_pid)]
    s = stats(observer, "rb")
    assert (s["held"], s["acquired"], s["released"]) == (2, 2, 0)
    assert lease(observer, "rb", 2, "1 min") == (None, None)  # the cap is full
    assert release_lease(observer, "rb", slot, token) is True
    assert one(c, "SELECT stage_e_release('rb', 1)") is True


def test_select_lease_star_takes_two_leases(connect):
    """`SELECT (stage_e_lease(...)).*` expands to one call per column: two leases are taken,
    and the row returned pairs the first lease's slot with the second lease's token, so a
    release with it frees neither. `SELECT * FROM stage_e_lease(...)` takes one."""
    c, observer = connect(), connect("observer")
    assert c.execute("SELECT * FROM stage_e_lease('once', 4, '1 min')").fetchall() == [
        (0, holders(observer, "once")[0]["token"])]
    assert len(holders(observer, "once")) == 1
    [(slot, token)] = c.execute("SELECT (stage_e_lease('twice', 4, '1 min')).*").fetchall()
    rows = [(h["slot"], h["token"]) for h in holders(observer, "twice")]
    assert len(rows) == 2, rows
    assert stats(observer, "twice")["acquired"] == 2
    assert slot in [r[0] for r in rows] and token in [r[1] for r in rows]
    assert (slot, token) not in rows, "the row returned is one lease's: expected a mixed pair"
    assert release_lease(c, "twice", slot, token) is False  # the token is the other slot's
    for s, t in rows:
        assert release_lease(c, "twice", s, t) is True
    assert release_lease(c, "once", 0, holders(observer, "once")[0]["token"]) is True


def test_a_raw_advisory_lock_on_a_leased_slot_is_not_refused(connect):
    """A lease is not an advisory lock, so the lock manager grants a raw lock on its slot's
    key: the slot then has two holders (the cap shows 2 held of n = 1). The raw lock still
    counts as taken for the extension: after the lease's release the slot stays unavailable
    to session slots and leases until the raw lock goes."""
    leaser, raw, observer = connect("leaser"), connect("raw"), connect("observer")
    slot, token = lease(leaser, "rawl", 1, "1 min")
    assert slot == 0
    assert one(raw, "SELECT pg_try_advisory_lock(stage_e_cap_key('rawl'), 0)") is True
    assert cap_locks(observer, "rawl") == [(0, raw.info.backend_pid)]
    assert observer.execute("SELECT slot, pid, token, acquired_at IS NULL FROM "
                            "stage_e_slot_holders WHERE cap = 'rawl' ORDER BY token NULLS LAST"
                            ).fetchall() == [(0, leaser.info.backend_pid, token, False),
                                             (0, raw.info.backend_pid, None, True)]
    assert (stats(observer, "rawl")["held"], stats(observer, "rawl")["n"]) == (2, 1)
    assert one(observer, "SELECT stage_e_try_slot('rawl', 1)") is None
    assert release_lease(leaser, "rawl", slot, token) is True
    # The lock manager is the truth: the raw lock keeps the slot.
    assert one(observer, "SELECT stage_e_try_slot('rawl', 1)") is None
    assert lease(observer, "rawl", 1, "1 min") == (None, None)
    assert one(raw, "SELECT pg_advisory_unlock(stage_e_cap_key('rawl'), 0)") is True
    assert one(observer, "SELECT stage_e_try_slot('rawl', 1)") == 0


def test_tokens_increase_across_a_clean_restart_and_crashes():
    c = Cluster("lease_tokens", {"stage_e_slots.flush_interval": "'1h'"}).init().start()

    def take():
        """A session slot and a lease of cap fence: their tokens (session slot first). The
        lease is given back, so that a crash has nothing to hold the cap back for."""
        with c.connect("app") as s:
            slot = one(s, "SELECT stage_e_try_slot('fence', 8)")
            got = [slot_token(s, "fence", slot), lease(s, "fence", 8, "1 h")]
            assert release_lease(s, "fence", got[1][0], got[1][1]) is True
        got[1] = got[1][1]
        assert got[0] < got[1], got
        return got

    def quiet():
        """The cap's durable horizon has come down to the present (no lease for 2 s)."""
        with c.connect("app") as s:
            wait_for(lambda: one(s, "SELECT horizon <= now() FROM stage_e_lease_horizon "
                                    "WHERE cap = 'fence'"),
                     timeout=30, interval=0.2, what="the cap's horizon to come down")

    def accepting():
        try:
            with c.connect("app") as s:
                return one(s, "SELECT NOT pg_is_in_recovery()")
        except psycopg.OperationalError:
            return False

    try:
        c.create_database("app")
        rounds = [take(), take()]
        c.stop("fast")
        c.start()
        rounds.append(take())  # after a clean restart

        quiet()
        since = len(c.log_text())
        victim = c.connect("app", "victim")
        os.kill(victim.info.backend_pid, signal.SIGKILL)  # a backend crash: crash recovery
        wait_for(lambda: "all server processes terminated; reinitializing" in
                 c.log_text()[since:], timeout=30, what="the crash restart")
        victim.close()
        wait_for(accepting, timeout=60, interval=0.2, what="the server after the crash")
        rounds.append(take())

        quiet()
        postmaster = int((c.data / "postmaster.pid").read_text().split()[0])
        family = [postmaster] + children_of(postmaster)
        os.kill(postmaster, signal.SIGKILL)  # the postmaster itself
        # Gone, not just zombies: the new postmaster refuses a lock file whose pid exists.
        wait_for(lambda: all(proc_state(p) is None for p in family), timeout=60,
                 interval=0.1, what="the orphaned server processes to exit and be reaped")
        since = len(c.log_text())
        c.start()
        assert "not properly shut down" in c.log_text()[since:]
        wait_for(accepting, timeout=60, interval=0.2, what="the server after the kill -9")
        rounds.append(take())

        tokens = [t for r in rounds for t in r]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), rounds
    finally:
        c.destroy()
