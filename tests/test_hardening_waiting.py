"""Waiting fairness across different n (hardening, issue 21): while a cap has waiters, a call is
held back only by waiters that could use the slots it would get. A waiter on n = 1 waits for
slot 0 alone, so tries on n = 4 still get slots 1..3; a try on n = 1 is throttled until the
waiter is served, and the waiter still gets slot 0 at the very next release. The same with k
slots (`stage_e_try_slots`), for tries and for waiters queued behind a head of a smaller n."""

import threading
import time

from conftest import cap_locks, one, stats
from pgcluster import wait_for
from test_waiting import Waiter, queued, waiters


def test_tries_on_a_wider_n_get_the_slots_a_waiter_on_n1_cannot_use(connect):
    holder, observer, tries = connect("holder"), connect("observer"), connect("tries")
    assert one(holder, "SELECT stage_e_try_slot('mix', 1)") == 0
    w = Waiter(connect("waiter"), "SELECT stage_e_try_slot('mix', 1, '30 s')")
    queued(observer, w, "mix", 1)
    # 20 tries on n = 4 that do not wait: slots 1..3 are free and no waiter can use them.
    got = [one(tries, "SELECT stage_e_try_slot('mix', 4)") for _ in range(3)]
    assert got == [1, 2, 3]
    assert one(tries, "SELECT stage_e_try_slot('mix', 4)") is None  # 1..3 held, 0 the waiter's
    assert one(tries, "SELECT stage_e_release_all('mix')") == 3
    for _ in range(16):
        assert one(tries, "SELECT stage_e_try_slot('mix', 4)") == 1
        assert one(tries, "SELECT stage_e_release('mix', 1)") is True
    # A try on n = 1 wants the waiter's slot: throttled while it waits.
    assert one(tries, "SELECT stage_e_try_slot('mix', 1)") is None
    # A call on n = 4 that would wait takes a free slot no waiter can use at once, unqueued.
    started = time.monotonic()
    assert one(tries, "SELECT stage_e_try_slot('mix', 4, '5 s')") == 1
    assert time.monotonic() - started < 2
    assert [r[1] for r in waiters(observer, "mix")] == [w.pid]
    assert not w.done.is_set()
    s = stats(observer, "mix")
    assert (s["throttled"], s["waits"]) == (2, 1)
    # Tries on n = 1 in a loop, and on n = 4 holding slot 1: the waiter gets slot 0 at the next
    # release, and no try ever gets it meanwhile.
    stop, grabbed, failed = threading.Event(), [], []
    hammers = [connect(f"try-{i}") for i in range(2)]
    tries_made = [0] * len(hammers)

    def hammer(i, c):
        try:
            while not stop.is_set():
                if one(c, "SELECT stage_e_try_slot('mix', 1)") is not None:
                    grabbed.append(c.info.backend_pid)
                    one(c, "SELECT stage_e_release('mix', 0)")
                tries_made[i] += 1
        except Exception as e:  # noqa: BLE001 - asserted below
            failed.append(repr(e))

    threads = [threading.Thread(target=hammer, args=(i, c)) for i, c in enumerate(hammers)]
    for t in threads:
        t.start()
    try:
        # Both hammers are trying before the release, and still trying after the grant.
        wait_for(lambda: min(tries_made) >= 20 or failed != [], timeout=30,
                 what="both hammers trying")
        assert one(holder, "SELECT stage_e_release('mix', 0)") is True
        assert w.wait().result == 0
        at_grant = list(tries_made)
        wait_for(lambda: all(a >= b + 20 for a, b in zip(tries_made, at_grant)) or failed != [],
                 timeout=30, what="both hammers trying after the grant")
        assert grabbed == []
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not [t for t in threads if t.is_alive()], "a hammer did not stop"
    assert failed == [], failed
    assert cap_locks(observer, "mix") == [(0, w.pid), (1, tries.info.backend_pid)]
    assert waiters(observer) == []


def test_k_slots_mixed_n_tries_and_waiters_take_only_what_no_waiter_ahead_can_use(connect):
    holder, observer, tries, wide = (connect("holder"), connect("observer"), connect("tries"),
                                     connect("wide"))
    assert one(holder, "SELECT stage_e_try_slots('mixk', 2, 2)") == [0, 1]
    head = Waiter(connect("head"), "SELECT stage_e_try_slots('mixk', 2, 2, '30 s')")
    queued(observer, head, "mixk", 1)
    # Tries for k slots get them from slot 2 up (the head can use only 0 and 1), all or none.
    assert one(tries, "SELECT stage_e_try_slots('mixk', 6, 3)") == [2, 3, 4]
    assert one(tries, "SELECT stage_e_try_slots('mixk', 6, 2)") is None  # only 5 is free
    assert one(tries, "SELECT stage_e_try_slots('mixk', 3, 1)") is None  # 2 is held
    assert one(tries, "SELECT stage_e_release_all('mixk')") == 3
    assert one(tries, "SELECT stage_e_try_slots('mixk', 3, 2)") is None  # only 2 is past 0, 1
    assert one(tries, "SELECT stage_e_try_slots('mixk', 3, 1)") == [2]
    assert one(tries, "SELECT stage_e_release_all('mixk')") == 1
    # Slots 2..5 held by another session; a waiter for two of [0, 6) queues behind the head.
    assert one(wide, "SELECT stage_e_try_slots('mixk', 6, 4)") == [2, 3, 4, 5]
    second = Waiter(connect("second"), "SELECT stage_e_try_slots('mixk', 6, 2, '30 s')")
    queued(observer, second, "mixk", 2)
    # One of the head's slots frees: the head waits for its second one, and nobody takes it.
    assert one(holder, "SELECT stage_e_release('mixk', 0)") is True
    time.sleep(0.3)  # several rechecks
    assert one(tries, "SELECT stage_e_try_slot('mixk', 6)") is None
    assert not head.done.is_set() and not second.done.is_set()
    # Slots 4 and 5 free: the second waiter takes them, though the head still waits (they are
    # no use to it).
    assert one(wide, "SELECT stage_e_release('mixk', 4) AND stage_e_release('mixk', 5)")
    assert sorted(second.wait(5).result) == [4, 5]
    assert not head.done.is_set()
    assert [r[1] for r in waiters(observer, "mixk")] == [head.pid]
    assert one(holder, "SELECT stage_e_release('mixk', 1)") is True
    assert sorted(head.wait().result) == [0, 1]
    assert cap_locks(observer, "mixk") == sorted(
        [(0, head.pid), (1, head.pid), (2, wide.info.backend_pid), (3, wide.info.backend_pid),
         (4, second.pid), (5, second.pid)])
    s = stats(observer, "mixk")
    assert (s["waits"], s["wait_timeouts"]) == (2, 0)


def test_a_session_that_holds_what_it_waits_for_is_answered_at_once(connect):
    """A session holding all n slots of a cap (or so many that fewer than k are left to free)
    and then waiting on it would wait its whole wait for itself: only it can free them. Such a
    call answers NULL at once, counted as throttled, and waits for nothing; a session whose
    slots leave room for another's release still waits (and is served by it)."""
    me, other, observer = connect("me"), connect("other"), connect("observer")
    assert [one(me, "SELECT stage_e_try_slot('self', 2)") for _ in range(2)] == [0, 1]
    before = stats(observer, "self")
    started = time.monotonic()
    assert one(me, "SELECT stage_e_try_slot('self', 2, '10 s')") is None
    assert one(me, "SELECT stage_e_try_slots('self', 3, 2, '10 s')") is None  # 1 of 3 left
    assert time.monotonic() - started < 2, "it waited for itself"
    after = stats(observer, "self")
    assert after["throttled"] - before["throttled"] == 2
    assert after["waits"] == before["waits"]
    # One of 3 mine, two another session's: my wait for one slot is a real wait, served by
    # the other's release.
    assert one(me, "SELECT stage_e_release('self', 1)") is True
    assert one(other, "SELECT stage_e_try_slot('self', 3)") == 1
    assert one(other, "SELECT stage_e_try_slot('self', 3)") == 2
    w = Waiter(me, "SELECT stage_e_try_slot('self', 3, '30 s')")
    queued(observer, w, "self", 1)
    assert one(other, "SELECT stage_e_release('self', 2)") is True
    assert w.wait().result == 2
    assert cap_locks(observer, "self") == [(0, w.pid), (1, other.info.backend_pid), (2, w.pid)]
