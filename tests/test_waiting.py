"""Waiting for a slot: woken by every kind of release, in arrival order, all-or-nothing for k
slots, with timeouts and interrupts that leave nothing behind, visible while it waits, and
counted (waits, timeouts, wait and hold time, load averages)."""

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import psycopg
import pytest
from conftest import cap_locks, one, stats
from pgcluster import Cluster, wait_for
from psycopg import errors


def waiters(conn, cap=None):
    rows = conn.execute("SELECT cap, pid, n, k, position FROM stage_e_slot_waiters "
                        "ORDER BY cap, position").fetchall()
    return [r for r in rows if cap is None or r[0] == cap]


class Waiter:
    """Runs a waiting call on its own session in a thread; `result` once it returns."""

    def __init__(self, conn, query, params=()):
        self.conn, self.pid = conn, conn.info.backend_pid
        self.result, self.error, self.done = None, None, threading.Event()
        self.returned_at = None
        self.thread = threading.Thread(target=self._run, args=(query, params))
        self.thread.start()

    def _run(self, query, params):
        try:
            self.result = one(self.conn, query, params)
        except Exception as e:  # noqa: BLE001 - inspected by the test
            self.error = e
        finally:
            self.returned_at = time.monotonic()
            self.done.set()

    def wait(self, timeout=10):
        assert self.done.wait(timeout), "the waiting call did not return"
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "the waiter's thread did not end"
        return self


def queued(observer, w, cap, position):
    wait_for(lambda: (cap, w.pid) in [(r[0], r[1]) for r in waiters(observer, cap)]
             and [r[4] for r in waiters(observer, cap) if r[1] == w.pid] == [position],
             timeout=5, what=f"pid {w.pid} queued at {position}")


def test_wait_zero_is_exactly_a_try_and_bad_waits_are_class_22(connect):
    holder, c = connect("holder"), connect()
    assert one(holder, "SELECT stage_e_try_slot('z', 1)") == 0
    assert one(c, "SELECT stage_e_try_slot('z', 1, '0')") is None
    assert one(c, "SELECT stage_e_try_slot('default', 1, '0')") == 0  # free
    s = stats(c, "z")
    assert (s["throttled"], s["waits"], s["wait_timeouts"]) == (1, 0, 0)
    for call, params in [("SELECT stage_e_try_slot('z', 1, %s)", ("-1 s",)),
                         ("SELECT stage_e_try_slot('z', 1, %s)", (None,)),
                         ("SELECT stage_e_try_slot('default', 1, %s)", ("-1 ms",)),
                         ("SELECT stage_e_try_slots('z', 2, %s)", (3,)),
                         ("SELECT stage_e_try_slots('z', 2, %s)", (0,)),
                         ("SELECT stage_e_try_slots('z', 2, %s)", (None,))]:
        with pytest.raises(psycopg.Error) as err:
            c.execute(call, params)
        assert err.value.diag.sqlstate.startswith("22"), (call, params)
    assert stats(c, "z")["throttled"] == 1  # bad input changed nothing


@pytest.mark.parametrize("how", ["release", "release_all", "exit", "lost"])
def test_a_waiter_is_woken_by_every_release_the_extension_sees(connect, how):
    holder, observer = connect("holder"), connect("observer")
    assert one(holder, "SELECT stage_e_try_slot('w', 1)") == 0
    w = Waiter(connect("waiter"), "SELECT stage_e_try_slot('w', 1, '30 s')")
    queued(observer, w, "w", 1)
    row = observer.execute("SELECT n, k, waiting_since IS NOT NULL, wait_event_type "
                           "FROM stage_e_slot_waiters WHERE pid = %s", (w.pid,)).fetchone()
    assert row == (1, 1, True, "Extension")
    major = int(one(observer, "SHOW server_version_num")) // 10000
    if major >= 17:
        assert one(observer, "SELECT wait_event FROM pg_stat_activity WHERE pid = %s",
                   (w.pid,)) == "StageESlotWait"
    if how == "release":
        assert one(holder, "SELECT stage_e_release('w', 0)") is True
    elif how == "release_all":
        assert one(holder, "SELECT stage_e_release_all()") == 1
    elif how == "exit":
        holder.close()
    else:  # dropped behind the extension's back, then noticed by the holder itself
        holder.execute("SELECT pg_advisory_unlock(stage_e_cap_key('w'), 0)")
        assert one(holder, "SELECT stage_e_holding('w', 0)") is False
    assert w.wait().error is None and w.result == 0
    assert cap_locks(observer, "w") == [(0, w.pid)]
    assert waiters(observer) == []
    s = stats(observer, "w")
    assert (s["waits"], s["wait_timeouts"], s["acquired"]) == (1, 0, 2)


def test_a_slot_freed_by_a_raw_unlock_is_found_by_the_recheck(connect):
    raw, observer = connect("raw"), connect("observer")
    assert one(raw, "SELECT pg_try_advisory_lock(stage_e_cap_key('r'), 0)") is True
    w = Waiter(connect("waiter"), "SELECT stage_e_try_slot('r', 1, '30 s')")
    queued(observer, w, "r", 1)
    assert one(raw, "SELECT pg_advisory_unlock(stage_e_cap_key('r'), 0)") is True
    assert w.wait(5).result == 0


def test_a_timeout_returns_null_counts_and_leaves_the_queue(connect):
    holder, c, observer = connect("holder"), connect(), connect("observer")
    assert one(holder, "SELECT stage_e_try_slot('t', 1)") == 0
    started = time.monotonic()
    assert one(c, "SELECT stage_e_try_slot('t', 1, '300 ms')") is None
    assert time.monotonic() - started >= 0.3
    assert waiters(observer) == []
    s = stats(observer, "t")
    assert (s["waits"], s["wait_timeouts"], s["throttled"]) == (1, 1, 1)
    assert s["wait_time"].total_seconds() >= 0.3
    assert cap_locks(observer, "t") == [(0, holder.info.backend_pid)]


def test_waiters_are_served_in_arrival_order(connect):
    holder, observer = connect("holder"), connect("observer")
    assert one(holder, "SELECT stage_e_try_slot('fifo', 1)") == 0
    ws = []
    for i in range(4):
        w = Waiter(connect(f"waiter-{i}"), "SELECT stage_e_try_slot('fifo', 1, '30 s')")
        queued(observer, w, "fifo", i + 1)
        ws.append(w)
    assert [r[1] for r in waiters(observer, "fifo")] == [w.pid for w in ws]
    assert one(holder, "SELECT stage_e_release('fifo', 0)") is True
    for i, w in enumerate(ws):
        assert w.wait().result == 0, i
        assert [r[1] for r in waiters(observer, "fifo")] == [x.pid for x in ws[i + 1:]]
        assert one(w.conn, "SELECT stage_e_release('fifo', 0)") is True


def test_a_head_waiting_for_k_slots_is_not_overtaken(connect):
    holder, observer, eager = connect("holder"), connect("observer"), connect("eager")
    for _ in range(3):
        assert one(holder, "SELECT stage_e_try_slot('k', 4)") is not None
    # One slot free; the head wants two of them, and the waiter behind it one.
    a = Waiter(connect("big"), "SELECT stage_e_try_slots('k', 4, 2, '30 s')")
    queued(observer, a, "k", 1)
    b = Waiter(connect("small"), "SELECT stage_e_try_slot('k', 4, '30 s')")
    queued(observer, b, "k", 2)
    # A try that does not wait is throttled while others wait, although a slot is free.
    assert one(eager, "SELECT stage_e_try_slot('k', 4)") is None
    time.sleep(0.3)  # several rechecks: the small request behind must not take the free slot
    assert not b.done.is_set() and not a.done.is_set()
    assert len(cap_locks(observer, "k")) == 3
    assert one(holder, "SELECT stage_e_release('k', 0)") is True
    assert sorted(a.wait().result) == [0, 3]
    assert not b.done.is_set()
    assert one(holder, "SELECT stage_e_release('k', 1)") is True
    assert b.wait().result == 1
    assert len(cap_locks(observer, "k")) == 4


def test_slots_freed_together_serve_the_waiters_behind_a_head_not_yet_running(connect):
    """Two slots freed at once serve the first two waiters at once: the second does not wait
    for the head to be scheduled (here it is stopped), and the third, not covered, waits."""
    holder, observer = connect("holder"), connect("observer")
    assert [one(holder, "SELECT stage_e_try_slot('fan', 3)") for _ in range(3)] == [0, 1, 2]
    ws = []
    for i in range(3):
        w = Waiter(connect(f"w{i}"), "SELECT stage_e_try_slot('fan', 3, '30 s')")
        queued(observer, w, "fan", i + 1)
        ws.append(w)
    head, second, third = ws
    os.kill(head.pid, signal.SIGSTOP)
    try:
        assert one(holder, "SELECT stage_e_release('fan', 0) AND stage_e_release('fan', 1)")
        got = second.wait(5).result
        assert got in (0, 1)
        time.sleep(0.3)  # several rechecks: the slot left is the head's, not the third's
        assert not third.done.is_set() and not head.done.is_set()
        assert [s for s, _ in cap_locks(observer, "fan")] == sorted([2, got])
    finally:
        os.kill(head.pid, signal.SIGCONT)
    assert head.wait().result == 1 - got
    assert not third.done.is_set()
    assert one(holder, "SELECT stage_e_release('fan', 2)") is True
    assert third.wait().result == 2
    assert cap_locks(observer, "fan") == sorted(
        [(head.result, head.pid), (got, second.pid), (2, third.pid)])


def test_a_waiter_wins_against_continuous_tries_at_the_first_release(connect):
    holder, observer = connect("holder"), connect("observer")
    assert one(holder, "SELECT stage_e_try_slot('busy', 1)") == 0
    stop, grabbed, failures = threading.Event(), [], []
    tries = [connect(f"try-{i}") for i in range(3)]
    attempts = [0] * len(tries)  # tries each hammer made (each one returned)

    def hammer(i):
        c = tries[i]
        try:
            while not stop.is_set():
                s = one(c, "SELECT stage_e_try_slot('busy', 1)")
                attempts[i] += 1
                if s is not None:
                    grabbed.append(c.info.backend_pid)
                    one(c, "SELECT stage_e_release('busy', 0)")
        except Exception as e:  # noqa: BLE001 - fails the test below
            failures.append((i, repr(e)))

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(len(tries))]
    for t in threads:
        t.start()
    try:
        w = Waiter(connect("waiter"), "SELECT stage_e_try_slot('busy', 1, '30 s')")
        queued(observer, w, "busy", 1)
        # Every hammer is trying while the waiter waits, right up to the release.
        seen = list(attempts)
        wait_for(lambda: all(a >= s + 3 for a, s in zip(attempts, seen)) or failures,
                 timeout=10, what="every hammer to try while the waiter waits")
        assert one(holder, "SELECT stage_e_release('busy', 0)") is True
        assert w.wait().result == 0
        assert grabbed == []  # no try got the slot while the waiter waited
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not [t for t in threads if t.is_alive()], "a hammer did not stop"
    assert failures == []
    assert all(a > 0 for a in attempts), attempts
    # Every try the hammers made was throttled, and counted so.
    assert stats(observer, "busy")["throttled"] == sum(attempts)


def test_k_slots_all_or_nothing_and_each_released_alone(connect):
    c, other, observer = connect(), connect("other"), connect("observer")
    got = one(c, "SELECT stage_e_try_slots('multi', 8, 3)")
    assert got == [0, 1, 2]
    assert one(other, "SELECT stage_e_try_slots('multi', 8, 6)") is None  # 5 free: none taken
    assert [s for s, _ in cap_locks(observer, "multi")] == [0, 1, 2]
    assert one(other, "SELECT stage_e_try_slots('multi', 8, 5)") == [3, 4, 5, 6, 7]
    assert one(c, "SELECT stage_e_release('multi', 1)") is True
    assert one(c, "SELECT stage_e_release_all('multi')") == 2
    s = stats(observer, "multi")
    assert (s["acquired"], s["throttled"], s["released"]) == (8, 1, 3)


@pytest.mark.parametrize("how", ["statement_timeout", "cancel", "terminate", "client_gone"])
def test_an_interrupted_waiter_leaves_the_queue_and_the_next_one_is_served(
        cluster, db, connect, how):
    holder, observer = connect("holder"), connect("observer")
    assert one(holder, "SELECT stage_e_try_slot('int', 1)") == 0
    first_conn = connect("first")
    proc = None
    if how == "statement_timeout":
        first_conn.execute("SET statement_timeout = '400ms'")
    if how == "client_gone":
        proc = subprocess.Popen(["psql", cluster.conninfo(db, "doomed"), "-Xq", "-c",
                                 "SELECT stage_e_try_slot('int', 1, '60 s')"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: len(waiters(observer, "int")) == 1, what="psql to wait")
        first_pid = waiters(observer, "int")[0][1]
    else:
        first = Waiter(first_conn, "SELECT stage_e_try_slot('int', 1, '60 s')")
        first_pid = first.pid
        queued(observer, first, "int", 1)
    second = Waiter(connect("second"), "SELECT stage_e_try_slot('int', 1, '60 s')")
    queued(observer, second, "int", 2)
    if how == "cancel":
        assert one(observer, "SELECT pg_cancel_backend(%s)", (first_pid,)) is True
    elif how == "terminate":
        assert one(observer, "SELECT pg_terminate_backend(%s)", (first_pid,)) is True
    elif how == "client_gone":
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    if how != "client_gone":
        first.wait()
        expected = {"statement_timeout": errors.QueryCanceled, "cancel": errors.QueryCanceled,
                    "terminate": psycopg.OperationalError}[how]
        assert isinstance(first.error, expected), first.error
    # The interrupted waiter is gone from the queue (its backend too, when it exited), and the
    # one behind it is now first.
    wait_for(lambda: [r[1] for r in waiters(observer, "int")] == [second.pid],
             timeout=5, what="the interrupted waiter to leave the queue")
    assert [r[4] for r in waiters(observer, "int")] == [1]
    if how in ("terminate", "client_gone"):
        wait_for(lambda: one(observer, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                             (first_pid,)) == 0, timeout=5, what="the backend to exit")
    assert cap_locks(observer, "int") == [(0, holder.info.backend_pid)]
    assert one(holder, "SELECT stage_e_release('int', 0)") is True
    assert second.wait().result == 0
    assert cap_locks(observer, "int") == [(0, second.pid)]


def test_waiting_never_admits_more_than_n(connect):
    sessions = [connect(f"w{i}") for i in range(12)]
    observer = connect("observer")
    ledger, lock, violations, most = {}, threading.Lock(), [], [0]

    def work(i):
        c = sessions[i]
        got = 0
        for _ in range(15):
            slot = one(c, "SELECT stage_e_try_slot('many', 3, '5 s')")
            if slot is None:
                continue
            with lock:
                if not 0 <= slot < 3:
                    violations.append(("out of range", slot, i))
                if slot in ledger:
                    violations.append((slot, ledger[slot], i))
                ledger[slot] = i
                most[0] = max(most[0], len(ledger))
            time.sleep(0.002)
            with lock:
                del ledger[slot]
            assert one(c, "SELECT stage_e_release('many', %s)", (slot,)) is True
            got += 1
        return got

    with ThreadPoolExecutor(12) as pool:
        total = sum(pool.map(work, range(12)))
    assert violations == []
    assert 1 <= most[0] <= 3  # never more believed holders at once than n
    assert total == 12 * 15  # with a 5 s wait every call got its slot
    s = stats(observer, "many")
    assert s["acquired"] == total and s["released"] == total
    assert s["waits"] > 0 and s["wait_timeouts"] == 0
    assert waiters(observer) == [] and cap_locks(observer, "many") == []


def test_wait_and_hold_times_reach_the_rows_totals_and_snapshot(connect):
    holder, c, observer = connect("holder"), connect(), connect("observer")
    assert one(holder, "SELECT stage_e_try_slot('m', 1)") == 0
    w = Waiter(c, "SELECT stage_e_try_slot('m', 1, '30 s')")
    queued(observer, w, "m", 1)
    # Polled, not slept: the waiter has been in the queue for 0.3 s (the view's own clock).
    wait_for(lambda: one(observer, "SELECT waiting_for FROM stage_e_slot_waiters WHERE pid = %s",
                         (w.pid,)) >= timedelta(seconds=0.3),
             timeout=10, what="the waiter to have waited 0.3 s")
    since = one(observer, "SELECT waiting_since FROM stage_e_slot_waiters WHERE pid = %s",
                (w.pid,))
    held_from = one(observer, "SELECT acquired_at FROM stage_e_slot_holders WHERE pid = %s",
                    (holder.info.backend_pid,))
    released, released_at = holder.execute(
        "SELECT stage_e_release('m', 0), statement_timestamp()").fetchone()
    assert released is True
    assert w.wait().result == 0
    got_at = one(observer, "SELECT acquired_at FROM stage_e_slot_holders WHERE pid = %s",
                 (w.pid,))
    assert since < released_at <= got_at
    # The waiter's hold lasts 0.2 s at least: polled on the server's clock, not slept.
    wait_for(lambda: one(observer, "SELECT clock_timestamp()") >= got_at + timedelta(seconds=0.2),
             timeout=10, what="0.2 s of the waiter's hold")
    done, done_at = c.execute("SELECT stage_e_release('m', 0), statement_timestamp()").fetchone()
    assert done is True
    s = stats(c, "m")
    # Waited from joining the queue until it had the slot, after the release.
    assert s["waits"] == 1 and s["wait_time"] >= released_at - since
    assert s["wait_time"] >= timedelta(seconds=0.3)
    # Two holds: the holder's, from its statement's start to its release statement's start,
    # and the waiter's, from the moment it got the slot to its release statement's start.
    assert s["hold_time"] == (released_at - held_from) + (done_at - got_at)
    assert s["hold_time"] >= timedelta(seconds=0.5)
    holder.execute("SELECT stage_e_flush()")
    row = holder.execute("SELECT waits, wait_timeouts, wait_time, hold_time FROM "
                         "stage_e_throttle_counter WHERE cap = 'm'").fetchone()
    assert row == (1, 0, s["wait_time"], s["hold_time"])
    t = holder.execute("SELECT waits, wait_time, hold_time FROM stage_e_throttle_totals "
                       "WHERE cap = 'm'").fetchone()
    assert t == (1, s["wait_time"], s["hold_time"])
    snap = one(holder, "SELECT stage_e_snapshot()")
    m = next(cap for cap in snap["caps"] if cap["cap"] == "m")
    assert m["totals"]["waits"] == 1
    assert m["totals"]["hold_time"] == round(s["hold_time"].total_seconds() * 1e6)


def test_the_load_view_averages_held_slots_and_throttles():
    c = Cluster("load", {"stage_e_slots.flush_interval": "'200ms'"}).init().start()
    try:
        c.create_database("app")
        with c.connect("app") as h, c.connect("app") as s:
            assert one(h, "SELECT stage_e_try_slots('busy', 2, 2)") == [0, 1]
            assert one(s, "SELECT stage_e_try_slot('idle', 2)") == 0
            assert one(s, "SELECT stage_e_release('idle', 0)") is True

            def load(cap):
                return s.execute("SELECT held_1m, held_15m, throttled_per_min_1m "
                                 "FROM stage_e_cap_load WHERE cap = %s", (cap,)).fetchone()

            wait_for(lambda: load("busy") and load("busy")[0] > 1.9, timeout=10,
                     what="the 1-minute held average of a cap holding 2")
            for _ in range(5):  # throttles at a steady pace
                s.execute("SELECT count(stage_e_try_slot('busy', 2)) FROM generate_series(1, 100)")
                time.sleep(0.2)
            held_1m, held_15m, rate = load("busy")
            assert 1.9 < held_1m <= 2.0 and 1.9 < held_15m <= 2.0
            assert rate > 0
            assert load("idle")[0] < 1.0
            assert [r[0] for r in s.execute("SELECT cap FROM stage_e_cap_load").fetchall()] == [
                "busy", "idle"]
    finally:
        c.destroy()


def test_two_untyped_arguments_resolve_to_cap_and_n(connect):
    """Until 0.5.0, stage_e_try_slot(cap, n) and stage_e_try_slot(n, wait) both took two
    arguments and two untyped ones were ambiguous (42725). With the cap-less waiting form
    retired, untyped literals and parameters sent without types (node-postgres, asyncpg)
    resolve to (cap, n); a typed integer still does too."""
    c = connect()
    assert one(c, "SELECT stage_e_try_slot('exports', '4')") == 0
    assert one(c, "SELECT stage_e_try_slot('exports', 4)") == 1
    assert one(c, "SELECT stage_e_try_slot('exports', '4'::int)") == 2
    # Both parameters untyped, as node-postgres sends them (psycopg's text dumper does the same
    # for strings): the statement's parameters are inferred as (text, integer).
    c.execute("PREPARE untyped AS SELECT stage_e_try_slot($1, $2)")
    assert c.execute("SELECT parameter_types::text[] FROM pg_prepared_statements "
                     "WHERE name = 'untyped'").fetchone() == (["text", "integer"],)
    assert one(c, "EXECUTE untyped('exports', '4')") == 3
    assert one(c, "EXECUTE untyped('exports', '4')") is None  # all four held: throttled
    assert stats(c, "exports")["held"] == 4
    # The retired (n, wait) form is gone: a typed interval finds no function.
    with pytest.raises(errors.UndefinedFunction):
        c.execute("SELECT stage_e_try_slot(4, '0'::interval)")
    # psycopg sends Python ints typed, strings untyped: (unknown, int) resolves.
    assert one(c, "SELECT stage_e_try_slot(%s, %s)", ("other", 4)) == 0
