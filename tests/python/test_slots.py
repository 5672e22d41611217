"""The package's sync API (stage_e_slots: session slots and leases) against a real cluster."""

import gc
import logging
import os
import pickle
import threading

import psycopg
import pytest
from conftest import (  # tests/conftest.py's, re-exported by tests/python/conftest.py
    KEY,
    one,
    slot_lock_holders,
    stats,
    wait_for,
)
from pgcluster import Cluster
from stage_e_slots import SlotConnection, connection_for, stage_e_slot


@pytest.fixture
def dsn(cluster, db):
    return cluster.conninfo(db, "helper-test")


def test_holds_on_its_own_connection_and_releases_on_exit(dsn, connect):
    observer = connect("observer")
    with stage_e_slot(dsn, n=2) as slot:
        assert slot == 0
        holders = slot_lock_holders(observer)
        assert [s for s, _ in holders] == [0]
        assert holders[0][1] != observer.info.backend_pid
    assert slot_lock_holders(observer) == []
    assert stats(observer)["released"] == 1


def test_throttled_yields_none_and_is_counted(dsn, connect):
    blocker = connect("blocker")
    assert one(blocker, "SELECT stage_e_try_slot(1)") == 0
    with stage_e_slot(dsn, n=1) as slot:
        assert slot is None
    assert stats(blocker)["throttled"] == 1


def test_an_exception_in_the_region_still_releases(dsn, connect):
    observer = connect("observer")
    with pytest.raises(RuntimeError), stage_e_slot(dsn, n=1):
        raise RuntimeError("work failed")
    assert slot_lock_holders(observer) == []


def test_one_connection_per_thread_is_reused(dsn):
    pids = []
    for _ in range(3):
        with stage_e_slot(dsn, n=4):
            pids.append(connection_for(dsn)._conn.info.backend_pid)
    assert len(set(pids)) == 1
    other = []
    t = threading.Thread(target=lambda: other.append(
        connection_for(dsn)._connection().info.backend_pid))
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    assert other[0] != pids[0]


def test_unreachable_database_fails_closed(caplog):
    sc = SlotConnection("host=/nonexistent port=1 user=nobody dbname=none", connect_timeout=1)
    with caplog.at_level(logging.WARNING, logger="stage_e_slots"), sc.slot(8) as slot:
        assert slot is None
    assert "treating as throttled" in caplog.text


def test_a_lost_connection_is_reported_at_release_and_replaced(dsn, connect, caplog):
    observer = connect("observer")
    sc = SlotConnection(dsn)
    with caplog.at_level(logging.ERROR, logger="stage_e_slots"):
        with sc.slot(1) as slot:
            assert slot == 0 and sc.holding(0)
            one(observer, "SELECT pg_terminate_backend(%s)", (sc._conn.info.backend_pid,))
        assert "release of slot 0 failed" in caplog.text
    # The next use opens a fresh connection and works.
    with sc.slot(1) as slot:
        assert slot == 0 and sc.holding(0)
    sc.close()
    assert slot_lock_holders(observer) == []


def test_a_forked_child_opens_its_own_connection_and_leaves_the_parents_slot_alone(dsn, connect):
    """A worker pool that forks (Celery prefork, gunicorn, multiprocessing) must not share the
    parent's session: the child gets a new one, and nothing the child does (including dropping
    the inherited connection object) may end the parent's session or its slot."""
    observer = connect("observer")
    sc = SlotConnection(dsn)
    with sc.slot(4) as slot:
        assert slot == 0
        parent_backend = sc._conn.info.backend_pid
        r, w = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                os.close(r)
                # The parent's slot is not the child's to give back: no release, anywhere.
                if sc.release(0) is not False or sc._conn is not None:
                    raise AssertionError("the child released the parent's slot")
                with sc.slot(4) as s2:
                    os.write(w, f"{s2} {sc._conn.info.backend_pid}".encode())
                sc.close()
                gc.collect()
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        _, status = os.waitpid(child, 0)
        got = os.read(r, 100).decode().split()
        os.close(r)
        assert os.waitstatus_to_exitcode(status) == 0
        child_slot, child_backend = int(got[0]), int(got[1])
        assert child_slot == 1 and child_backend != parent_backend
        # The parent's session and slot are intact, per the lock manager and per the parent.
        assert sc.holding(0)
        assert sc._conn.info.backend_pid == parent_backend
        assert slot_lock_holders(observer) == [(0, parent_backend)]
        assert stats(observer)["foreign_releases"] == 0
    assert slot_lock_holders(observer) == []
    sc.close()


# -- named caps ------------------------------------------------------------------------------

def cap_lock_holders(conn, cap):
    """(slot, pid) of granted slot locks of `cap` in conn's database, straight from pg_locks:
    classid = stage_e_cap_key(cap), objid = slot, objsubid = 2."""
    rows = conn.execute(
        "SELECT objid::int, pid FROM pg_locks WHERE locktype = 'advisory' "
        "AND classid = stage_e_cap_key(%s)::oid AND objsubid = 2 AND granted AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database())", (cap,)).fetchall()
    return sorted(rows)


def test_two_caps_have_independent_slots_and_counters(dsn, connect):
    observer = connect("observer")
    other_worker = SlotConnection(dsn, application_name="other-worker")
    try:
        with stage_e_slot(dsn, "exports", n=1) as exports, \
                stage_e_slot(dsn, "dispatch", n=1) as dispatch:
            # Each cap has its own slot 0, held at once by this thread's one connection.
            assert (exports, dispatch) == (0, 0)
            pid = connection_for(dsn)._conn.info.backend_pid
            assert cap_lock_holders(observer, "exports") == [(0, pid)]
            assert cap_lock_holders(observer, "dispatch") == [(0, pid)]
            # Another worker: exports is full, so throttled; the default cap is untouched.
            with other_worker.slot(1, cap="exports") as second:
                assert second is None
            with other_worker.slot(1) as default_slot:
                assert default_slot == 0
                assert slot_lock_holders(observer) == [
                    (0, other_worker._conn.info.backend_pid)]
            e, d, dflt = (stats(observer, c) for c in ("exports", "dispatch", "default"))
            assert (e["held"], e["acquired"], e["throttled"]) == (1, 1, 1)
            assert (d["held"], d["acquired"], d["throttled"]) == (1, 1, 0)
            assert (dflt["acquired"], dflt["throttled"], dflt["released"]) == (1, 0, 1)
            # The one throttle is on the exports row, and on no other.
            assert one(observer, "SELECT sum(throttled) FROM stage_e_stats()") == 1
        assert cap_lock_holders(observer, "exports") == []
        assert cap_lock_holders(observer, "dispatch") == []
        assert stats(observer, "exports")["released"] == 1
        assert stats(observer, "dispatch")["released"] == 1
    finally:
        other_worker.close()


def test_release_gives_back_the_slot_of_its_own_cap(dsn, connect, caplog):
    observer = connect("observer")
    key = {c: one(observer, "SELECT stage_e_cap_key(%s)", (c,)) for c in ("exports", "dispatch")}
    assert len({key["exports"], key["dispatch"], KEY}) == 3
    sc = connection_for(dsn)
    pid = sc._connection().info.backend_pid
    with stage_e_slot(dsn, "dispatch", n=2) as d:
        with stage_e_slot(dsn, "exports", n=2) as e:
            assert (d, e) == (0, 0)
            held = observer.execute(
                "SELECT classid::bigint, objid::int, objsubid FROM pg_locks "
                "WHERE locktype = 'advisory' AND granted AND pid = %s ORDER BY 1", (pid,))
            assert sorted(held.fetchall()) == sorted(
                [(key["exports"] % 2**32, 0, 2), (key["dispatch"] % 2**32, 0, 2)])
            assert sc.holding(0, cap="exports") and sc.holding(0, cap="dispatch")
            assert not sc.holding(0)  # the default cap's slot 0 is another lock
        # Leaving the exports region gave back exports' slot 0, not dispatch's.
        assert cap_lock_holders(observer, "exports") == []
        assert cap_lock_holders(observer, "dispatch") == [(0, pid)]
        assert sc.holding(0, cap="dispatch") and not sc.holding(0, cap="exports")
    assert cap_lock_holders(observer, "dispatch") == []

    # release() names its cap: the wrong cap is a logged no-op, the right one frees the slot.
    slot = sc.try_slot(3, cap="exports")
    assert slot == 0
    with caplog.at_level(logging.ERROR, logger="stage_e_slots"):
        assert sc.release(slot, cap="dispatch") is False
    assert "slot 0 of cap 'dispatch' was no longer held" in caplog.text
    assert cap_lock_holders(observer, "exports") == [(0, pid)]
    assert stats(observer, "dispatch")["foreign_releases"] == 1
    assert sc.release(slot, cap="exports") is True
    assert cap_lock_holders(observer, "exports") == []
    assert stats(observer, "exports")["foreign_releases"] == 0
    assert sc._conn.info.backend_pid == pid  # one connection throughout


def test_bad_arguments_raise_and_keep_the_other_caps_slots(dsn, connect):
    observer = connect("observer")
    with stage_e_slot(dsn, "exports", n=1) as slot:
        assert slot == 0
        pid = connection_for(dsn)._conn.info.backend_pid
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="cap name"), \
                stage_e_slot(dsn, "", n=1):
            pass
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="out of range"), \
                stage_e_slot(dsn, "dispatch", n=0):
            pass
        with pytest.raises(TypeError, match="cap must be a cap name"), \
                stage_e_slot(dsn, 4, n=1):  # type: ignore[arg-type]
            pass
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            connection_for(dsn).holding(0, cap="x" * 64)
        assert cap_lock_holders(observer, "exports") == [(0, pid)]
        assert connection_for(dsn)._conn.info.backend_pid == pid
    assert cap_lock_holders(observer, "exports") == []


def test_a_cap_the_server_has_no_room_for_is_throttled_and_the_connection_is_kept(caplog):
    """With every cap entry in use (stage_e_slots.max_caps), one more cap is refused (53400, an
    OperationalError in psycopg). That is "throttled" for the new cap, but the connection is
    healthy and holds this thread's other caps' slots: it must not be closed."""
    c = Cluster("helper_few_caps", {"stage_e_slots.max_caps": 16}).init().start()
    sc = SlotConnection(c.conninfo("postgres", "helper-test"))
    try:
        c.sql("CREATE EXTENSION stage_e_slots")
        with c.connect() as filler, c.connect() as observer:
            with sc.slot(1, cap="outer") as outer:
                assert outer == 0
                pid = sc._conn.info.backend_pid
                for i in range(15):
                    assert one(filler, "SELECT stage_e_try_slot(%s, 1)", (f"cap-{i}",)) == 0
                with caplog.at_level(logging.WARNING, logger="stage_e_slots"), \
                        sc.slot(1, cap="one too many") as refused:
                    assert refused is None
                assert "the server refused the slot" in caplog.text
                assert "stage_e_slots has no room for cap" in caplog.text
                assert "cannot reach the database" not in caplog.text
                # The outer region's slot is still held, on the same session.
                assert sc._conn.info.backend_pid == pid and sc.holding(0, cap="outer")
                assert cap_lock_holders(observer, "outer") == [(0, pid)]
            assert cap_lock_holders(observer, "outer") == []
            assert stats(observer, "outer")["released"] == 1
            assert stats(observer, "outer")["released_by_exit"] == 0
    finally:
        sc.close()
        c.destroy()


def test_after_a_failed_release_the_other_regions_slot_is_reported_lost_not_released_elsewhere(
        dsn, connect, caplog):
    """Nested regions of two caps share the thread's connection. If it dies, the inner release
    fails and drops it; the outer region's slot went with the session, and its release must say
    so rather than open a new session and release there (a foreign release)."""
    observer = connect("observer")
    sc = SlotConnection(dsn)
    with caplog.at_level(logging.ERROR, logger="stage_e_slots"):
        with sc.slot(1, cap="exports") as e:
            with sc.slot(1, cap="dispatch") as d:
                assert (e, d) == (0, 0)
                pid = sc._conn.info.backend_pid
                one(observer, "SELECT pg_terminate_backend(%s)", (pid,))
            assert "release of slot 0 failed (cap 'dispatch'" in caplog.text
            assert sc._conn is None
        assert "slot 0 of cap 'exports' was lost with its connection" in caplog.text
    assert sc._conn is None  # the outer release opened no session
    for cap in ("exports", "dispatch"):
        wait_for(lambda cap=cap: stats(observer, cap)["released_by_exit"] == 1,
                 what=f"{cap}'s slot counted as released by exit")
        assert stats(observer, cap)["foreign_releases"] == 0
        assert stats(observer, cap)["released"] == 0
    # The next region opens a fresh connection and works.
    with sc.slot(1, cap="exports") as e:
        assert e == 0 and sc._conn.info.backend_pid != pid
    sc.close()
    assert cap_lock_holders(observer, "exports") == []


def test_a_slot_taken_by_a_call_that_then_failed_is_given_back(dsn, connect, monkeypatch):
    """A cancel or statement_timeout can land after the server took the slot: the client sees
    an error, the session holds a slot nobody knows of. The helper keeps the connection (it
    holds the thread's other slots) and releases that one."""
    from stage_e_slots import _sync_line as helper

    observer = connect("observer")
    sc = SlotConnection(dsn)
    with sc.slot(1, cap="outer") as outer:
        assert outer == 0
        backend = sc._conn.info.backend_pid
        real = helper._fetch

        def cancelled_after_the_fact(conn, query, params):
            real(conn, query, params)
            if "stage_e_try_slot" in query:
                raise psycopg.errors.QueryCanceled("canceling statement due to statement timeout")

        monkeypatch.setattr(helper, "_fetch", cancelled_after_the_fact)
        assert sc.try_slot(2, cap="inner") is None
        monkeypatch.setattr(helper, "_fetch", real)
        locks = observer.execute(
            "SELECT cap, slot FROM stage_e_slot_holders WHERE pid = %s ORDER BY cap",
            (backend,)).fetchall()
        assert locks == [("outer", 0)]  # the inner slot went back; the outer one stayed
        assert sc._conn.info.backend_pid == backend
    assert slot_lock_holders(observer) == []
    sc.close()


def test_wait_is_woken_by_a_release_and_times_out_as_throttled(dsn, connect):
    from datetime import timedelta

    blocker, observer = connect("blocker"), connect("observer")
    assert one(blocker, "SELECT stage_e_try_slot('w', 1)") == 0
    got = []
    t = threading.Thread(target=lambda: got.append(SlotConnection(dsn).try_slot(
        1, cap="w", wait=30)))
    t.start()
    wait_for(lambda: one(observer, "SELECT count(*) FROM stage_e_slot_waiters") == 1,
             what="the helper to wait")
    assert one(blocker, "SELECT stage_e_release('w', 0)") is True
    t.join(10)
    assert not t.is_alive(), "the waiting helper did not return"
    assert got == [0]
    sc = SlotConnection(dsn)
    assert one(blocker, "SELECT stage_e_try_slot('w2', 1)") == 0
    with sc.slot(1, cap="w2", wait=timedelta(milliseconds=200)) as slot:
        assert slot is None
    assert stats(observer, "w2")["wait_timeouts"] == 1
    with pytest.raises(ValueError):
        sc.try_slot(1, cap="w2", wait=-1)
    sc.close()


def test_a_wait_for_slots_this_threads_connection_holds_is_answered_at_once(dsn, connect):
    """Nothing else runs on a thread's connection while it waits: a wait for slots only it
    holds would wait for itself. It is answered at once, one throttle, no wait."""
    observer = connect("observer")
    start = time.monotonic()
    with stage_e_slot(dsn, "self", n=1) as held, stage_e_slot(dsn, "self", n=1, wait=10) as s:
        assert held == 0 and s is None
    assert time.monotonic() - start < 3
    s = stats(observer, "self")
    assert (s["acquired"], s["released"], s["waits"], s["throttled"]) == (1, 1, 0, 1)


def test_k_slots_at_once_are_a_list_and_all_released(dsn, connect):
    observer = connect("observer")
    with stage_e_slot(dsn, "multi", n=4, k=3) as slots:
        assert slots == [0, 1, 2]
        assert len(observer.execute("SELECT * FROM stage_e_slot_holders WHERE cap = 'multi'"
                                    ).fetchall()) == 3
        with stage_e_slot(dsn, "multi", n=4, k=2) as more:
            assert more is None  # only one left: all or nothing
    assert observer.execute("SELECT * FROM stage_e_slot_holders").fetchall() == []
    assert stats(observer, "multi")["released"] == 3


# -- leases (0.4.0): slots held by a token, through any connection -------------------------------

import time
from datetime import timedelta

from pgbouncer import PgBouncer
from stage_e_slots import Lease, LeaseLost, stage_e_lease
from stage_e_slots._leases import _lease_statements


@pytest.fixture
def lease_dsn(dsn):
    """The test database's DSN for leases; this thread's lease connection for it is closed at
    the end."""
    yield dsn
    _lease_statements(dsn).close()


def leases(conn, cap):
    """(slot, token, pid, live) of the cap's rows in stage_e_slot_holders."""
    return conn.execute(
        "SELECT slot, token, pid, expires_at > clock_timestamp() FROM stage_e_slot_holders "
        "WHERE cap = %s ORDER BY slot", (cap,)).fetchall()


def expires_at(conn, cap, slot):
    return one(conn, "SELECT expires_at FROM stage_e_slot_holders WHERE cap = %s AND slot = %s",
               (cap, slot))


def test_lease_is_taken_on_entry_and_released_by_token_on_exit(lease_dsn, connect):
    observer = connect("observer")
    assert leases(observer, "exports") == []
    with stage_e_lease(lease_dsn, "exports", 2, ttl=30) as lease:
        assert isinstance(lease, Lease)
        assert lease.slot == 0 and lease.token > 0 and lease.lost is False
        [(slot, token, pid, live)] = leases(observer, "exports")
        assert (slot, token, live) == (0, lease.token, True)
        assert pid != observer.info.backend_pid
        # Held by its token, not by a session: no advisory lock anywhere.
        assert cap_lock_holders(observer, "exports") == []
        assert lease.still_held()
        s = stats(observer, "exports")
        assert (s["held"], s["acquired"], s["released"]) == (1, 1, 0)
    assert leases(observer, "exports") == []
    assert lease.lost is False and not lease.still_held()
    s = stats(observer, "exports")
    assert (s["held"], s["acquired"], s["released"]) == (0, 1, 1)
    assert (s["foreign_releases"], s["expired"], s["released_by_exit"]) == (0, 0, 0)


def test_an_exception_in_the_region_still_releases_the_lease(lease_dsn, connect):
    observer = connect("observer")
    with pytest.raises(RuntimeError, match="work failed"), \
            stage_e_lease(lease_dsn, "exports", 1, ttl=30) as lease:
        assert lease.slot == 0
        raise RuntimeError("work failed")
    assert leases(observer, "exports") == []
    assert stats(observer, "exports")["released"] == 1


def test_throttled_lease_yields_none_and_is_counted(lease_dsn, connect):
    blocker, observer = connect("blocker"), connect("observer")
    slot, token = blocker.execute("SELECT * FROM stage_e_lease('exports', 1, '30 s')").fetchone()
    assert slot == 0
    with stage_e_lease(lease_dsn, "exports", 1, ttl=30) as lease:
        assert lease is None
    assert stats(observer, "exports")["throttled"] == 1
    # With a wait: a timeout is throttled too (counted as a timed-out wait)...
    with stage_e_lease(lease_dsn, "exports", 1, ttl=30, wait=timedelta(milliseconds=200)) as lease:
        assert lease is None
    s = stats(observer, "exports")
    assert (s["throttled"], s["wait_timeouts"]) == (2, 1)
    # ...and the blocker's release by token wakes a waiting lease.
    got = []
    t = threading.Thread(target=lambda: got.append(_take_and_release(lease_dsn)))
    t.start()
    wait_for(lambda: one(observer, "SELECT count(*) FROM stage_e_slot_waiters") == 1,
             what="the lease to wait")
    assert one(blocker, "SELECT stage_e_release_lease('exports', 0, %s)", (token,)) is True
    t.join(10)
    assert not t.is_alive(), "the waiting lease did not return"
    assert len(got) == 1 and got[0][0] == 0 and got[0][1] > token
    assert leases(observer, "exports") == []


def _take_and_release(dsn):
    try:
        with stage_e_lease(dsn, "exports", 1, ttl=30, wait=30) as lease:
            return lease.slot, lease.token
    finally:
        _lease_statements(dsn).close()


def test_renew_extends_the_lease_past_its_original_ttl(lease_dsn, connect):
    observer = connect("observer")
    with stage_e_lease(lease_dsn, "renewed", 1, ttl=1) as lease:
        first = expires_at(observer, "renewed", 0)
        time.sleep(0.4)
        assert lease.renew(ttl=3) is True
        second = expires_at(observer, "renewed", 0)
        assert second - first > timedelta(seconds=2)
        time.sleep(1.0)  # 1.4 s after the take: past the original ttl
        assert lease.still_held()
        assert expires_at(observer, "renewed", 0) == second  # reading does not extend it
        # Still taken, for everyone else.
        assert observer.execute("SELECT * FROM stage_e_lease('renewed', 1, '30 s')"
                                ).fetchone() == (None, None)
        assert lease.renew() is True  # its own ttl (1 s) from now
        assert lease.still_held() and lease.lost is False
    s = stats(observer, "renewed")
    assert (s["acquired"], s["released"], s["expired"], s["foreign_releases"]) == (1, 1, 0, 0)
    with pytest.raises(RuntimeError, match="region has ended"):
        lease.renew()


def test_still_held_turns_false_at_expiry_and_the_exit_raises_lease_lost(
        cluster, lease_dsn, connect, caplog):
    observer = connect("observer")
    since = len(cluster.log_text())
    with caplog.at_level(logging.ERROR, logger="stage_e_slots"), \
            pytest.raises(LeaseLost) as lost, \
            stage_e_lease(lease_dsn, "expiring", 1, ttl=0.3) as lease:
        assert lease.still_held()
        time.sleep(0.6)
        assert not lease.still_held()
        assert lease.lost is False  # a read, not a verdict: the release decides
    assert lost.value.cap == "expiring" and lost.value.token == lease.token
    copy = pickle.loads(pickle.dumps(lost.value))  # task queues send it back pickled
    assert (copy.cap, copy.slot, copy.token, str(copy)) == (
        "expiring", lease.slot, lease.token, str(lost.value))
    assert lease.lost is True
    assert "was lost before its region ended" in caplog.text
    s = stats(observer, "expiring")
    assert (s["acquired"], s["expired"], s["released"], s["held"]) == (1, 1, 0, 0)
    # The release found the lease expired (and freed it then), or the background worker's
    # sweep freed it first; either way the late release is a foreign one, counted once.
    log = cluster.log_text()[since:]
    swept_first = "stage_e_release_lease: the token is not the current lease" in log
    assert swept_first or 'the lease of slot 0 of cap "expiring" had expired' in log
    assert s["foreign_releases"] == 1


def test_a_renewal_that_finds_the_lease_expired_marks_it_lost_and_skips_the_release(
        lease_dsn, connect, caplog):
    observer = connect("observer")
    with caplog.at_level(logging.ERROR, logger="stage_e_slots"), \
            pytest.raises(LeaseLost, match="a renewal found it expired"), \
            stage_e_lease(lease_dsn, "expiring", 1, ttl=0.2) as lease:
        time.sleep(0.4)
        assert lease.renew() is False
        assert lease.lost is True
        assert lease.renew() is False and not lease.still_held()
    s = stats(observer, "expiring")
    # Counted once, as expired; the exit did not release a lease the server had freed.
    assert (s["expired"], s["released"], s["foreign_releases"]) == (1, 0, 0)


def test_a_lost_lease_does_not_mask_the_regions_own_exception(lease_dsn, connect):
    observer = connect("observer")
    with pytest.raises(RuntimeError, match="work failed") as failed, \
            stage_e_lease(lease_dsn, "expiring", 1, ttl=0.2):
        time.sleep(0.4)
        raise RuntimeError("work failed")
    assert not hasattr(failed.value, "add_note") or any(  # notes: Python 3.11+
        "was lost before its region ended" in note for note in failed.value.__notes__)
    assert stats(observer, "expiring")["expired"] == 1


def test_the_release_runs_on_a_fresh_connection_when_the_taking_one_died(lease_dsn, connect):
    """A lease needs no particular session: the backend that took it is terminated mid-region,
    and the release by token runs on a new connection, and frees it."""
    observer = connect("observer")
    with stage_e_lease(lease_dsn, "exports", 2, ttl=30) as lease:
        [(_, _, taker, _)] = leases(observer, "exports")
        assert one(observer, "SELECT pg_terminate_backend(%s)", (taker,)) is True
        wait_for(lambda: one(observer, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                             (taker,)) == 0, what="the taking backend to exit")
        # The slot did not go with its session.
        assert [r[:2] for r in leases(observer, "exports")] == [(0, lease.token)]
    assert lease.lost is False
    assert leases(observer, "exports") == []
    s = stats(observer, "exports")
    assert (s["released"], s["foreign_releases"], s["released_by_exit"], s["expired"]) == (
        1, 0, 0, 0)
    releaser = one(observer, "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                   (f"stage_e_lease:{os.getpid()}",))
    assert releaser is not None and releaser != taker


def test_through_pgbouncer_transaction_mode_the_release_lands_on_another_server_connection(
        cluster, db, connect):
    observer = connect("observer")
    with PgBouncer(cluster, pool_mode="transaction", pool_size=2) as bouncer:
        dsn = bouncer.conninfo(db, "lease-client")
        b = bouncer.connect(db, autocommit=False, application_name="client-b")
        c = bouncer.connect(db, autocommit=False, application_name="client-c")
        try:
            with stage_e_lease(dsn, "pooled", 2, ttl=30) as lease:
                assert lease.slot == 0
                [(_, _, taker, _)] = leases(observer, "pooled")
                # B and C take the pool's two server connections, one of them the taker...
                pid_b, pid_c = one(b, "SELECT pg_backend_pid()"), one(c, "SELECT pg_backend_pid()")
                assert pid_b != pid_c and taker in (pid_b, pid_c)
                holder_tx, other_tx = (b, c) if pid_b == taker else (c, b)
                other = pid_c if pid_b == taker else pid_b
                # ...then only the other one is freed: the release can only run there.
                other_tx.commit()
            assert lease.lost is False
            assert one(observer, "SELECT query FROM pg_stat_activity WHERE pid = %s",
                       (other,)).startswith("SELECT stage_e_release_lease(")
            holder_tx.commit()
        finally:
            b.close()
            c.close()
            _lease_statements(dsn).close()
    assert leases(observer, "pooled") == []
    s = stats(observer, "pooled")
    assert (s["acquired"], s["released"], s["foreign_releases"], s["expired"]) == (1, 1, 0, 0)


def test_many_clients_through_pgbouncer_transaction_mode_keep_the_cap(cluster, db, connect):
    """Eight threads, each with its own client connection, share two server connections; each
    region renews and reads its lease, so takes, renewals and releases land on either server
    connection. The cap of 3 binds, no slot is shared, and every count is exact."""
    observer = connect("observer")
    clients, rounds, n = 8, 6, 3
    results, errors = [], []
    with PgBouncer(cluster, pool_mode="transaction", pool_size=2) as bouncer:
        dsn = bouncer.conninfo(db, "lease-client")

        def client():
            try:
                for _ in range(rounds):
                    with stage_e_lease(dsn, "many", n, ttl=30) as lease:
                        if lease is None:
                            results.append(("throttled", None, None, None, None))
                            time.sleep(0.01)
                            continue
                        start = time.monotonic()
                        time.sleep(0.02)
                        assert lease.renew() and lease.still_held()
                        time.sleep(0.02)
                        results.append(("ran", lease.slot, lease.token, start, time.monotonic()))
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)
            finally:
                _lease_statements(dsn).close()

        threads = [threading.Thread(target=client) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not [t for t in threads if t.is_alive()], "a client did not finish in 60 s"
        # The pooler's server connections to this database: every backend here but ours.
        servers = one(observer, "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                                "AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
                      (db,))
    assert errors == []
    assert 1 <= servers <= 2  # eight clients, at most two server connections
    ran = [r for r in results if r[0] == "ran"]
    throttled = len(results) - len(ran)
    assert len(results) == clients * rounds and ran
    assert len({r[2] for r in ran}) == len(ran)  # every lease had a token of its own
    assert all(0 <= r[1] < n for r in ran)
    assert not any(a[1] == b[1] and a[3] < b[4] and b[3] < a[4]
                   for i, a in enumerate(ran) for b in ran[i + 1:])
    events = sorted([(r[3], 1) for r in ran] + [(r[4], -1) for r in ran])
    at_once = best = 0
    for _, d in events:
        at_once += d
        best = max(best, at_once)
    assert best <= n
    s = stats(observer, "many")
    assert (s["acquired"], s["released"], s["throttled"]) == (len(ran), len(ran), throttled)
    assert (s["foreign_releases"], s["expired"], s["held"]) == (0, 0, 0)


def test_on_a_psycopg_connection_never_prepared_even_through_pgbouncer(cluster, db, connect):
    """A connection the caller owns: the helper's statements run on it, never as server-side
    prepared statements (prepare_threshold=0 would prepare everything on first use), so a
    transaction pooler is fine whatever the connection's settings."""
    observer = connect("observer")
    conn = cluster.connect(db, "owner", prepare_threshold=0)
    try:
        for _ in range(3):
            with stage_e_lease(conn, "owned", 1, ttl=30) as lease:
                assert lease.slot == 0
                assert [r[:3] for r in leases(observer, "owned")] == [
                    (0, lease.token, conn.info.backend_pid)]
                assert lease.renew() and lease.still_held()
        assert conn.execute("SELECT count(*) FROM pg_prepared_statements",
                            prepare=False).fetchone()[0] == 0
        conn.execute("SELECT 1")  # the check: this connection does prepare what it is not told
        assert conn.execute("SELECT count(*) FROM pg_prepared_statements",
                            prepare=False).fetchone()[0] == 1
    finally:
        conn.close()
    with PgBouncer(cluster, pool_mode="transaction", pool_size=2) as bouncer:
        pooled = bouncer.connect(db, application_name="owner", prepare_threshold=0)
        other = bouncer.connect(db, application_name="other")
        try:
            for i in range(8):
                with stage_e_lease(pooled, "owned", 1, ttl=30) as lease:
                    assert lease.slot == 0
                    other.execute("SELECT 1")  # a second client in the pool meanwhile
                    assert lease.renew() and lease.still_held()
        finally:
            pooled.close()
            other.close()
    s = stats(observer, "owned")
    assert (s["acquired"], s["released"], s["foreign_releases"]) == (11, 11, 0)


def test_a_closed_connection_of_the_callers_cannot_release_and_the_ttl_frees_the_slot(
        cluster, db, connect, caplog):
    observer = connect("observer")
    conn = cluster.connect(db, "owner")
    with caplog.at_level(logging.ERROR, logger="stage_e_slots"):
        with stage_e_lease(conn, "owned", 1, ttl=0.5) as lease:
            conn.close()
        # Not lost (the ttl has not passed), but not released either: said, not raised.
        assert "could not be released, its connection is gone" in caplog.text
    assert lease.lost is False
    assert [r[:2] for r in leases(observer, "owned")] == [(0, lease.token)]
    # The ttl frees it: the next lease that finds the slot taken looks at its expiry.
    time.sleep(0.6)
    slot, _ = observer.execute("SELECT * FROM stage_e_lease('owned', 1, '30 s')").fetchone()
    assert slot == 0
    assert stats(observer, "owned")["expired"] == 1


def test_a_lease_starts_no_thread(lease_dsn, connect):
    """Nothing runs behind the region's back: no renewer, no watchdog that could stop healthy
    work when a renewal fails. A lease nobody renews expires."""
    before, count = set(threading.enumerate()), threading.active_count()
    with pytest.raises(LeaseLost), stage_e_lease(lease_dsn, "exports", 1, ttl=0.5) as lease:
        assert set(threading.enumerate()) == before
        assert lease.renew() and lease.still_held()
        assert set(threading.enumerate()) == before
        time.sleep(0.7)  # nothing renewed it behind our back
        assert not lease.still_held()
        assert threading.active_count() == count
        assert lease.renew() is False
    assert set(threading.enumerate()) == before and threading.active_count() == count


def test_unreachable_database_is_throttled_and_bad_arguments_raise(lease_dsn, caplog):
    bad = "host=/nonexistent port=1 user=nobody dbname=none"
    try:
        with caplog.at_level(logging.WARNING, logger="stage_e_slots"), \
                stage_e_lease(bad, "exports", 1, ttl=30) as lease:
            assert lease is None
        assert "treating as throttled" in caplog.text
    finally:
        _lease_statements(bad).close()
    with pytest.raises(ValueError, match="ttl must be positive"), \
            stage_e_lease(lease_dsn, "exports", 1, ttl=0):
        pass
    with pytest.raises(TypeError, match="cap must be a cap name"), \
            stage_e_lease(lease_dsn, 4, 1, ttl=30):  # type: ignore[arg-type]
        pass
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="out of range"), \
            stage_e_lease(lease_dsn, "exports", 0, ttl=30):
        pass
    with pytest.raises(TypeError, match="a connection with cursor"), \
            stage_e_lease(42, "exports", 1, ttl=30):  # type: ignore[arg-type]
        pass
