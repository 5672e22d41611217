"""Multi-session behaviour of the cap against a real cluster."""

import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import KEY, one, slot_lock_holders, stats, wait_for


def notice(d):
    """Copies a notice's fields: psycopg's Diagnostic is only valid inside the handler."""
    return {"severity": d.severity, "message": d.message_primary, "detail": d.message_detail,
            "hint": d.message_hint}


def test_contention_twelve_sessions_for_eight_slots(connect):
    sessions = [connect(f"worker-{i}") for i in range(12)]
    before = stats(sessions[0])
    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda c: one(c, "SELECT stage_e_try_slot(8)"), sessions))
    won = sorted(s for s in got if s is not None)
    assert won == list(range(8))
    assert got.count(None) == 4
    observer = connect("observer")
    holders = slot_lock_holders(observer)
    assert [s for s, _ in holders] == list(range(8))
    winners = {c.info.backend_pid for c, s in zip(sessions, got) if s is not None}
    assert {pid for _, pid in holders} == winners
    after = stats(observer)
    assert after["acquired"] - before["acquired"] == 8
    assert after["throttled"] - before["throttled"] == 4
    assert after["held"] == 8


def test_foreign_release_warns_names_holder_and_changes_nothing(connect):
    holder, other = connect("holder"), connect("other")
    slot = one(holder, "SELECT stage_e_try_slot(4)")
    before = stats(other)
    notices = []
    other.add_notice_handler(lambda d: notices.append(notice(d)))
    assert one(other, "SELECT stage_e_release(%s)", (slot,)) is False
    assert len(notices) == 1
    n = notices[0]
    assert n["severity"] == "WARNING"
    assert f"slot {slot} was not held by this connection" in n["message"]
    assert f"held by pid {holder.info.backend_pid}" in n["detail"]
    assert n["hint"]
    # The real holder keeps its slot, per the lock manager and per itself.
    assert slot_lock_holders(other) == [(slot, holder.info.backend_pid)]
    assert one(holder, "SELECT stage_e_holding(%s)", (slot,)) is True
    after = stats(other)
    assert after["foreign_releases"] - before["foreign_releases"] == 1
    assert after["released"] == before["released"]
    assert after["held"] == 1
    # Nobody else gets that slot while it is held.
    assert slot == 0 and one(other, "SELECT stage_e_try_slot(1)") is None
    assert one(holder, "SELECT stage_e_release(%s)", (slot,)) is True


def test_release_of_a_free_slot_says_nobody_holds_it(connect):
    c = connect()
    notices = []
    c.add_notice_handler(lambda d: notices.append(notice(d)))
    assert one(c, "SELECT stage_e_release(5)") is False
    assert "slot 5 was not held by this connection" in notices[0]["message"]
    assert "No session holds slot 5" in notices[0]["detail"]
    # A database that never took a slot has no entry, and a release does not take one, so
    # there is nowhere to count it (max_caps counts caps in use).
    assert stats(c)["foreign_releases"] == 0
    assert one(c, "SELECT stage_e_try_slot(1)") == 0
    assert one(c, "SELECT stage_e_release(0)") is True
    assert one(c, "SELECT stage_e_release(5)") is False
    assert len(notices) == 2
    assert stats(c)["foreign_releases"] == 1


def test_extension_and_raw_advisory_locks_contend_both_ways(connect):
    ext, raw = connect("ext"), connect("raw")
    assert one(ext, "SELECT stage_e_try_slot(1)") == 0
    # A raw client cannot take a slot the extension handed out...
    assert one(raw, "SELECT pg_try_advisory_lock(%s, 0)", (KEY,)) is False
    assert one(ext, "SELECT stage_e_release(0)") is True
    # ...and a slot held with a raw lock counts as taken.
    assert one(raw, "SELECT pg_try_advisory_lock(%s, 0)", (KEY,)) is True
    throttled = stats(ext)["throttled"]
    assert one(ext, "SELECT stage_e_try_slot(1)") is None
    assert stats(ext)["throttled"] == throttled + 1
    assert one(ext, "SELECT stage_e_try_slot(2)") == 1
    assert one(ext, "SELECT stage_e_holding(0)") is False
    # The raw holder shows in the view, without an acquisition time.
    rows = ext.execute("SELECT slot, pid, acquired_at FROM stage_e_slot_holders").fetchall()
    assert rows[0][:2] == (0, raw.info.backend_pid) and rows[0][2] is None
    assert one(raw, "SELECT pg_advisory_unlock(%s, 0)", (KEY,)) is True
    assert one(ext, "SELECT stage_e_try_slot(1)") == 0


def test_releasing_a_raw_lock_on_a_slot_counts_no_release(connect):
    """Issue 35: stage_e_release of a slot this session holds only by a raw pg_advisory_lock
    freed it and counted a release the extension never handed out (released > acquired). It
    still frees the lock the caller holds (true), but counts nothing."""
    c, observer = connect(), connect("observer")
    assert one(c, "SELECT stage_e_try_slot(4)") == 0  # the cap exists, with its counters
    assert one(c, "SELECT stage_e_release(0)") is True
    before = stats(observer)
    assert one(c, "SELECT pg_advisory_lock(%s, 2)", (KEY,)) == ""
    assert one(c, "SELECT stage_e_release(2)") is True
    after = stats(observer)
    assert (after["acquired"], after["released"], after["foreign_releases"]) == (
        before["acquired"], before["released"], before["foreign_releases"])
    assert slot_lock_holders(observer) == []


def test_a_release_of_a_leased_slot_says_a_lease_holds_it(connect):
    """The WARNING's DETAIL of a session release of a leased slot said "No session holds slot
    0"; it says a lease does, and how a lease is released."""
    c = connect()
    assert c.execute("SELECT slot FROM stage_e_lease('leased_rel', 1, '1 h')").fetchone()[0] == 0
    notices = []
    c.add_notice_handler(lambda d: notices.append(notice(d)))
    assert one(c, "SELECT stage_e_release('leased_rel', 0)") is False
    assert "is leased; its holder keeps it" in notices[0]["detail"], notices
    assert "stage_e_release_lease" in notices[0]["detail"]
    assert one(c, "SELECT count(*) FROM stage_e_slot_holders WHERE cap = 'leased_rel'") == 1


def test_same_session_raw_lock_is_not_handed_out_twice(connect):
    c, observer = connect(), connect("observer")
    assert one(c, "SELECT pg_advisory_lock(%s, 0)", (KEY,)) == ""
    assert one(c, "SELECT stage_e_try_slot(3)") == 1
    assert one(c, "SELECT stage_e_try_slot(3)") == 2
    assert one(c, "SELECT stage_e_try_slot(3)") is None
    assert [s for s, _ in slot_lock_holders(observer)] == [0, 1, 2]


@pytest.mark.parametrize("how", ["close", "terminate", "kill_client"])
def test_exit_while_holding_frees_slots_at_once_counts_and_logs(cluster, db, connect, how):
    observer = connect("observer")
    before = stats(observer)
    if how == "kill_client":
        # A client process killed outright while its session sits idle holding the slots
        # (a worker busy on the client side): the server sees the socket close.
        proc = subprocess.Popen(["psql", cluster.conninfo(db, "doomed-worker"), "-Xq"],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, text=True)
        proc.stdin.write("SELECT stage_e_try_slot(4), stage_e_try_slot(4);\n")
        proc.stdin.flush()
        wait_for(lambda: len(slot_lock_holders(observer)) == 2, what="psql to take 2 slots")
        pid = slot_lock_holders(observer)[0][1]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    else:
        doomed = connect("doomed-worker")
        assert one(doomed, "SELECT stage_e_try_slot(4)") == 0
        assert one(doomed, "SELECT stage_e_try_slot(4)") == 1
        pid = doomed.info.backend_pid
        if how == "close":
            doomed.close()
        else:
            assert one(observer, "SELECT pg_terminate_backend(%s)", (pid,)) is True
    # The exit hook releases the locks first and counts them after: wait for the count.
    wait_for(lambda: stats(observer)["released_by_exit"] - before["released_by_exit"] == 2,
             timeout=5, what="the exit to be counted")
    assert slot_lock_holders(observer) == []
    # Free for others: the next session gets slot 0 again.
    assert one(observer, "SELECT stage_e_try_slot(4)") == 0
    line = f"backend pid {pid} (application_name \"doomed-worker\") exited holding slot(s) 0, 1"
    wait_for(lambda: line in cluster.log_text(), timeout=5, what="the exit LOG line")


@pytest.mark.parametrize("how", [
    "DISCARD ALL",
    "SELECT pg_advisory_unlock_all()",
    f"SELECT pg_advisory_unlock({KEY}, 0)",
])
def test_locks_freed_behind_our_back_never_leave_a_slot_stuck(cluster, connect, how):
    holder, other = connect("pooled"), connect("other")
    assert one(holder, "SELECT stage_e_try_slot(1)") == 0
    assert one(other, "SELECT stage_e_try_slot(1)") is None
    before = stats(other)
    since = len(cluster.log_text())
    holder.execute(how)
    # Right after the statement that dropped it, the slot is neither reported held nor stuck.
    assert one(other, "SELECT count(*) FROM stage_e_slot_holders") == 0
    assert stats(other)["held"] == 0
    assert one(other, "SELECT stage_e_try_slot(1)") == 0
    assert one(holder, "SELECT stage_e_holding(0)") is False
    assert one(holder, "SELECT stage_e_try_slot(1)") is None
    # Counted as released once (not as a foreign release), and said in the log.
    after = stats(other)
    assert after["released"] - before["released"] == 1
    assert after["foreign_releases"] == before["foreign_releases"]
    line = (f"slot 0 of cap \"default\" of pid {holder.info.backend_pid} was released outside "
            "stage_e_release "
            "(DISCARD ALL, pg_advisory_unlock_all() or pg_advisory_unlock()); it is free again")
    wait_for(lambda: line in cluster.log_text()[since:], timeout=5, what="the LOG line")
    assert cluster.log_text()[since:].count(line) == 1
    assert one(other, "SELECT stage_e_release(0)") is True
    assert one(holder, "SELECT stage_e_try_slot(1)") == 0


def test_a_slot_unlocked_by_hand_in_this_transaction_is_found_when_the_cap_is_full(connect):
    """What "lowest free slot" means inside one transaction (see the README): a slot whose lock
    this session itself dropped with pg_advisory_unlock earlier in the same transaction is not
    looked for on every try (that would cost a lock-table lookup per held slot per call). It
    is taken again once every other slot is taken, and cleared at transaction end."""
    c = connect()
    assert one(c, "SELECT stage_e_try_slot(3)") == 0
    with c.transaction():
        assert one(c, "SELECT pg_advisory_unlock(%s, 0)", (KEY,)) is True
        assert one(c, "SELECT stage_e_try_slot(3)") == 1
        assert one(c, "SELECT stage_e_try_slot(3)") == 2
        assert one(c, "SELECT stage_e_try_slot(3)") == 0
        assert one(c, "SELECT stage_e_try_slot(3)") is None
    assert one(c, "SELECT stage_e_release_all()") == 3
    assert one(c, "SELECT stage_e_try_slot(3)") == 0
    with c.transaction():
        assert one(c, "SELECT pg_advisory_unlock(%s, 0)", (KEY,)) is True
    # After the transaction ended, the slot is the lowest free one again.
    assert one(c, "SELECT stage_e_try_slot(3)") == 0


def test_held_counts_raw_advisory_locks_on_slots(connect):
    c, raw = connect(), connect("raw")
    assert one(raw, "SELECT pg_try_advisory_lock(%s, 5)", (KEY,)) is True
    assert one(raw, "SELECT pg_try_advisory_lock(%s, 2000)", (KEY,)) is True  # >= max_slots
    assert one(c, "SELECT stage_e_try_slot(8)") == 0
    s = stats(c)
    assert s["held"] == 2 and s["acquired"] == 1
    rows = c.execute("SELECT slot, pid, acquired_at IS NULL FROM stage_e_slot_holders").fetchall()
    assert rows == [(0, c.info.backend_pid, False), (5, raw.info.backend_pid, True)]


def test_locks_dropped_inside_an_open_transaction_are_cleared_at_its_end(connect):
    holder, other = connect("holder"), connect("other")
    assert one(holder, "SELECT stage_e_try_slot(1)") == 0
    with holder.transaction():
        holder.execute("SELECT pg_advisory_unlock_all()")
        # Until the holder's transaction ends, the slot may read as taken (never over-admitted).
        assert one(other, "SELECT stage_e_try_slot(1)") in (None, 0)
        other.execute("SELECT stage_e_release_all()")
    assert one(other, "SELECT stage_e_try_slot(1)") == 0


def test_two_databases_have_separate_slots_stats_and_views(cluster, db, connect):
    other_db = cluster.create_database(db + "_b")
    a1, a2 = connect("a1"), connect("a2")
    b1 = connect("b1", dbname=other_db)
    assert [one(a1, "SELECT stage_e_try_slot(2)") for _ in range(3)] == [0, 1, None]
    assert one(b1, "SELECT stage_e_try_slot(2)") == 0
    assert one(a2, "SELECT stage_e_try_slot(2)") is None
    sa, sb = stats(a2), stats(b1)
    assert (sa["held"], sa["acquired"], sa["throttled"]) == (2, 2, 2)
    assert (sb["held"], sb["acquired"], sb["throttled"]) == (1, 1, 0)
    assert a2.execute("SELECT slot, pid FROM stage_e_slot_holders").fetchall() == [
        (0, a1.info.backend_pid), (1, a1.info.backend_pid)]
    assert b1.execute("SELECT slot, pid FROM stage_e_slot_holders").fetchall() == [
        (0, b1.info.backend_pid)]
    # A release in one database cannot touch the other's slot 0.
    assert one(b1, "SELECT stage_e_release(1)") is False
    assert one(a2, "SELECT stage_e_holding(0)") is False
    assert stats(a2)["held"] == 2


def test_holders_view_joins_the_session(connect):
    c, observer = connect("billing-worker-7"), connect("observer")
    slot = one(c, "SELECT stage_e_try_slot(8)")
    # acquired_at is the start of the statement that took the slot: the holder's query_start
    # while that statement is its last; held_for counts from it.
    row = observer.execute(
        "SELECT h.slot, h.pid, h.acquired_at = a.query_start, "
        "h.held_for >= statement_timestamp() - h.acquired_at, "
        "h.held_for <= clock_timestamp() - h.acquired_at, "
        "h.application_name, h.client_addr, h.state "
        "FROM stage_e_slot_holders AS h JOIN pg_stat_activity AS a USING (pid)").fetchone()
    assert row == (slot, c.info.backend_pid, True, True, True, "billing-worker-7", None, "idle")
    cols = [d.name for d in observer.execute("SELECT * FROM stage_e_slot_holders").description]
    assert cols == ["cap", "slot", "pid", "acquired_at", "held_for", "application_name", "client_addr",
                    "state", "token", "expires_at", "share"]
    # A session slot has no lease token or expiry, and this one was taken in no share.
    assert observer.execute("SELECT token, expires_at, share FROM stage_e_slot_holders"
                            ).fetchall() == [(None, None, None)]


def test_a_full_cap_of_1024_throttles_and_counts(connect):
    holders = [connect(f"h{i}") for i in range(4)]
    for h in holders:
        for _ in range(256):
            assert one(h, "SELECT stage_e_try_slot(1024)") is not None
    c = connect()
    before = stats(c)
    assert all(one(c, "SELECT stage_e_try_slot(1024)") is None for _ in range(50))
    assert stats(c)["throttled"] - before["throttled"] == 50
    assert stats(c)["held"] == 1024
    assert len(slot_lock_holders(c)) == 1024
