"""stage_e_slots.aio against a real cluster: regions of many tasks on one connection per event
loop, waits that give way to the loop's other calls, cancellation, failures, event loops and
forks. The leases are in test_aio_leases.py, which uses this file's helpers."""

import asyncio
import logging
import os
import threading
import time
import weakref
from datetime import timedelta

import psycopg
import pytest
from conftest import (  # tests/conftest.py's, re-exported by tests/python/conftest.py
    cap_locks,
    one,
    stats,
    wait_for,
)
from stage_e_slots import aio
from stage_e_slots.aio import (
    AsyncSlotConnection,
    connection_for,
    stage_e_lease,
    stage_e_slot,
)


@pytest.fixture
def dsn(cluster, db):
    return cluster.conninfo(db, "aio-test")


def run(main):
    """asyncio.run, then closes the connections of the loop that ended."""
    try:
        return asyncio.run(main)
    finally:
        aio._sweep()


async def until(pred, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def loop_pid(dsn):
    conn = connection_for(dsn)._line.conn
    return None if conn is None else conn.info.backend_pid


def waiters(observer, cap):
    return one(observer, "SELECT count(*) FROM stage_e_slot_waiters WHERE cap = %s", (cap,))


def cancels_logged(cluster, since):
    return cluster.log_text()[since:].count("canceling statement due to user request")


# -- regions ---------------------------------------------------------------------------------

def test_regions_of_many_tasks_hold_on_the_loops_one_connection(dsn, connect):
    observer = connect("observer")
    results = []

    async def region(hold):
        async with stage_e_slot(dsn, "many", n=3) as slot:
            results.append(slot)
            await hold.wait()

    async def main():
        hold = asyncio.Event()
        tasks = [asyncio.create_task(region(hold)) for _ in range(5)]
        await until(lambda: len(results) == 5, "every region to start")
        pid = loop_pid(dsn)
        assert sorted(s for s in results if s is not None) == [0, 1, 2]
        assert results.count(None) == 2
        assert cap_locks(observer, "many") == [(0, pid), (1, pid), (2, pid)]
        assert pid != observer.info.backend_pid
        hold.set()
        await asyncio.gather(*tasks)
        assert loop_pid(dsn) == pid
        assert cap_locks(observer, "many") == []

    run(main())
    s = stats(observer, "many")
    assert (s["acquired"], s["throttled"], s["released"], s["foreign_releases"]) == (3, 2, 3, 0)


def test_k_slots_at_once_are_a_list_and_all_released(dsn, connect):
    observer = connect("observer")

    async def main():
        async with stage_e_slot(dsn, "multi", n=4, k=3) as slots:
            assert slots == [0, 1, 2]
            assert len(cap_locks(observer, "multi")) == 3
            async with stage_e_slot(dsn, "multi", n=4, k=2) as more:
                assert more is None  # one left: all or nothing
        assert cap_locks(observer, "multi") == []

    run(main())
    assert stats(observer, "multi")["released"] == 3


def test_an_exception_or_a_cancellation_in_the_region_still_releases(dsn, connect):
    observer = connect("observer")

    async def held_forever(started):
        async with stage_e_slot(dsn, "c", n=1) as slot:
            assert slot == 0
            started.set()
            await asyncio.sleep(60)

    async def main():
        with pytest.raises(RuntimeError, match="work failed"):
            async with stage_e_slot(dsn, "c", n=1):
                raise RuntimeError("work failed")
        assert cap_locks(observer, "c") == []
        started = asyncio.Event()
        task = asyncio.create_task(held_forever(started))
        await started.wait()
        assert len(cap_locks(observer, "c")) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cap_locks(observer, "c") == []

    run(main())
    assert stats(observer, "c")["released"] == 2


def test_unreachable_database_is_throttled_and_logged(caplog):
    sc = AsyncSlotConnection("host=/nonexistent port=1 user=nobody dbname=none",
                             connect_timeout=1)

    async def main():
        with caplog.at_level(logging.WARNING, logger="stage_e_slots"):
            async with sc.slot(8, cap="x") as slot:
                assert slot is None
            assert await sc.try_slots(8, 2, cap="x", wait=1) is None
            assert await sc.holding(0, cap="x") is False
        async with stage_e_lease("host=/nonexistent port=1 user=nobody dbname=none", "x", 1,
                                 ttl=30) as lease:
            assert lease is None

    run(main())
    assert caplog.text.count("treating as throttled (cap 'x'), cannot reach the database") == 3


def test_bad_arguments_raise_and_keep_the_other_regions_slot(dsn, connect):
    observer = connect("observer")

    async def main():
        async with stage_e_slot(dsn, "exports", n=1) as slot:
            assert slot == 0
            pid = loop_pid(dsn)
            with pytest.raises(psycopg.errors.InvalidParameterValue, match="cap name"):
                async with stage_e_slot(dsn, "", n=1):
                    pass
            with pytest.raises(psycopg.errors.InvalidParameterValue, match="out of range"):
                async with stage_e_slot(dsn, "dispatch", n=0, wait=5):
                    pass
            with pytest.raises(TypeError, match="cap must be a cap name"):
                async with stage_e_slot(dsn, 4, n=1):
                    pass
            with pytest.raises(ValueError, match="wait must not be negative"):
                async with stage_e_slot(dsn, "dispatch", n=1, wait=-1):
                    pass
            with pytest.raises(psycopg.errors.InvalidParameterValue):
                await connection_for(dsn).holding(0, cap="x" * 64)
            assert cap_locks(observer, "exports") == [(0, pid)]
            assert loop_pid(dsn) == pid

    run(main())
    assert cap_locks(observer, "exports") == []


def test_a_statement_the_server_cancels_is_throttled_and_the_connection_kept(dsn, connect,
                                                                            caplog):
    """A statement_timeout ending a wait is the server's QueryCanceled, not an interrupt of
    ours: throttled, logged as refused, the connection (and the other cap's slot) kept."""
    observer = connect("observer")
    assert one(observer, "SELECT stage_e_try_slot('full', 1)") == 0

    async def main():
        async with stage_e_slot(dsn, "outer", n=1) as outer:
            assert outer == 0
            pid = loop_pid(dsn)
            await connection_for(dsn)._line.conn.execute("SET statement_timeout = '300ms'")
            with caplog.at_level(logging.ERROR, logger="stage_e_slots"):
                async with stage_e_slot(dsn, "full", n=1, wait=5) as slot:
                    assert slot is None
            assert "the server refused the slot" in caplog.text
            assert "statement timeout" in caplog.text
            assert loop_pid(dsn) == pid and await connection_for(dsn).holding(0, cap="outer")

    run(main())
    assert stats(observer, "outer")["released"] == 1


# -- waiting on a shared connection -----------------------------------------------------------

def test_a_wait_gives_way_to_the_release_it_waits_for(dsn, connect, cluster):
    """The deadlock case: one region of the loop holds a slot, another waits on the same
    connection for a slot of that cap, whose other slot another session holds (so the wait is
    in the server: either release may serve it). The region's release must not queue behind
    the wait: it interrupts it, runs, and the waiter gets the slot at once."""
    observer = connect("observer")
    assert one(observer, "SELECT stage_e_try_slot('w', 2)") == 0
    since = len(cluster.log_text())
    got = {}

    async def waiter():
        start = time.monotonic()
        async with stage_e_slot(dsn, "w", n=2, wait=10) as slot:
            got["slot"], got["after"] = slot, time.monotonic() - start

    async def main():
        async with stage_e_slot(dsn, "w", n=2) as slot:
            assert slot == 1
            task = asyncio.create_task(waiter())
            await until(lambda: waiters(observer, "w") == 1, "the waiter to wait in the server")
        # The holder's release ran: the waiter got the slot well before its 10 s.
        await asyncio.wait_for(task, 5)

    run(main())
    assert got["slot"] == 1 and got["after"] < 3
    assert one(observer, "SELECT stage_e_release('w', 0)") is True
    s = stats(observer, "w")
    # One wait, interrupted; the waiter's next try took the freed slot without waiting.
    assert (s["acquired"], s["released"], s["waits"], s["wait_timeouts"], s["throttled"]) == (
        3, 3, 1, 0, 0)
    assert cancels_logged(cluster, since) == 1


def test_a_wait_for_slots_only_this_loop_holds_waits_in_the_client_for_their_release(
        dsn, connect, cluster):
    """A region of the loop holds the only slot and another waits for it on the same
    connection. The server would answer that wait at once (its session waits for itself), so
    the waiter never sends it: it waits in the client for a release on its connection, and is
    served by the region's release without a wait or an interrupt in the server. Without a
    release, its wait ends by its deadline with one try: one throttle, as any waiting call."""
    observer = connect("observer")
    since = len(cluster.log_text())
    got = {}

    async def waiter(cap, wait):
        start = time.monotonic()
        async with stage_e_slot(dsn, cap, n=1, wait=wait) as slot:
            got[cap] = (slot, time.monotonic() - start)

    async def main():
        async with stage_e_slot(dsn, "own", n=1) as slot:
            assert slot == 0
            task = asyncio.create_task(waiter("own", 10))
            await asyncio.sleep(0.5)
            assert not task.done() and waiters(observer, "own") == 0  # waiting, in the client
        await asyncio.wait_for(task, 5)
        async with stage_e_slot(dsn, "own2", n=1) as slot:
            assert slot == 0
            await waiter("own2", 0.5)

    run(main())
    assert got["own"][0] == 0 and got["own"][1] < 3
    assert got["own2"][0] is None and 0.5 <= got["own2"][1] < 3
    s = stats(observer, "own")
    assert (s["acquired"], s["released"], s["waits"], s["wait_timeouts"], s["throttled"]) == (
        2, 2, 0, 0, 0)
    s = stats(observer, "own2")
    assert (s["acquired"], s["released"], s["waits"], s["throttled"]) == (1, 1, 0, 1)
    assert cancels_logged(cluster, since) == 0


def test_holding_and_other_caps_do_not_queue_behind_a_wait(dsn, connect):
    observer = connect("observer")
    assert one(observer, "SELECT stage_e_try_slot('blocked', 1)") == 0
    timings = {}

    async def waiter():
        async with stage_e_slot(dsn, "blocked", n=1, wait=30) as slot:
            timings["waiter"] = slot

    async def main():
        sc = connection_for(dsn)
        async with stage_e_slot(dsn, "mine", n=1) as mine:
            task = asyncio.create_task(waiter())
            await until(lambda: waiters(observer, "blocked") == 1, "the waiter to wait")
            start = time.monotonic()
            assert await sc.holding(mine, cap="mine")
            async with stage_e_slot(dsn, "other", n=2) as other:
                assert other == 0
            timings["calls"] = time.monotonic() - start
            # The waiter is back in the server's queue, and a release there still wakes it.
            await until(lambda: waiters(observer, "blocked") == 1, "the waiter to wait again")
            assert one(observer, "SELECT stage_e_release('blocked', 0)") is True
            await asyncio.wait_for(task, 5)

    run(main())
    assert timings["calls"] < 2 and timings["waiter"] == 0


def test_a_wait_is_woken_by_a_release_in_another_session_and_times_out_as_throttled(
        dsn, connect):
    observer = connect("observer")
    assert one(observer, "SELECT stage_e_try_slot('w', 1)") == 0

    async def main():
        task = asyncio.create_task(connection_for(dsn).try_slot(1, cap="w", wait=30))
        await until(lambda: waiters(observer, "w") == 1, "the waiter to wait")
        assert one(observer, "SELECT stage_e_release('w', 0)") is True
        assert await asyncio.wait_for(task, 5) == 0
        assert await connection_for(dsn).release(0, cap="w") is True
        assert one(observer, "SELECT stage_e_try_slot('w2', 1)") == 0
        start = time.monotonic()
        async with stage_e_slot(dsn, "w2", n=1, wait=timedelta(milliseconds=300)) as slot:
            assert slot is None
        assert time.monotonic() - start >= 0.3

    run(main())
    assert stats(observer, "w")["waits"] == 1
    s = stats(observer, "w2")
    assert (s["waits"], s["wait_timeouts"], s["throttled"]) == (1, 1, 1)


def test_waiters_of_one_loop_never_interrupt_each_other(dsn, connect, cluster):
    """Two waiters of two caps on one connection: the first waits in the server (the head),
    the second queues in the client behind it, never interrupting it nor slicing its own
    wait; served once it is the head, without a throttle or a timed-out wait on either."""
    observer = connect("observer")
    for cap in ("x", "y"):
        assert one(observer, "SELECT stage_e_try_slot(%s, 1)", (cap,)) == 0
    since = len(cluster.log_text())
    served = {}

    async def waiter(cap):
        async with stage_e_slot(dsn, cap, n=1, wait=20) as slot:
            served[cap] = (slot, time.monotonic())

    async def main():
        x = asyncio.create_task(waiter("x"))
        await until(lambda: waiters(observer, "x") == 1, "x to wait")
        y = asyncio.create_task(waiter("y"))
        await asyncio.sleep(1.0)
        assert cancels_logged(cluster, since) == 0  # y did not interrupt x
        assert waiters(observer, "y") == 0  # y waits in the client, behind the head
        assert stats(observer, "y")["waits"] == 0
        for cap, task in (("x", x), ("y", y)):
            assert one(observer, "SELECT stage_e_release(%s, 0)", (cap,)) is True
            released = time.monotonic()
            await asyncio.wait_for(task, 5)
            served[cap] = (served[cap][0], served[cap][1] - released)

    run(main())
    assert served["x"][0] == 0 and served["y"][0] == 0
    assert served["x"][1] < 2 and served["y"][1] < 2
    # At most one: x's region's release may interrupt y once y waits as the head.
    assert cancels_logged(cluster, since) <= 1
    for cap in ("x", "y"):
        s = stats(observer, cap)
        assert (s["acquired"], s["wait_timeouts"], s["throttled"]) == (2, 0, 0), (cap, s)


def throttle_totals(conn, cap):
    """(throttled, waits, wait_timeouts) of the cap's row in stage_e_throttle_totals (live)."""
    row = conn.execute("SELECT throttled, waits, wait_timeouts FROM stage_e_throttle_totals "
                       "WHERE cap = %s", (cap,)).fetchone()
    return tuple(row) if row else (0, 0, 0)


def test_many_waiters_of_one_loop_on_a_full_cap_count_one_throttle_each(dsn, connect):
    """Twenty waiting regions of one loop on a cap of 2 that others hold: each ends throttled
    by its deadline and the extension counts exactly twenty throttles, as twenty sync
    waiters would make (turns of a slice would count one per turn)."""
    observer, blocker = connect("observer"), connect("blocker")
    assert one(blocker, "SELECT stage_e_try_slots('full20', 2, 2)") == [0, 1]

    async def waiter():
        async with stage_e_slot(dsn, "full20", n=2, wait=2) as slot:
            return slot

    async def main():
        start = time.monotonic()
        results = await asyncio.gather(*(waiter() for _ in range(20)))
        return results, time.monotonic() - start

    results, took = run(main())
    assert results == [None] * 20
    assert 2 <= took < 4  # each ended by its deadline (2 s), not one after the other's wait
    s = stats(observer, "full20")
    assert (s["acquired"], s["throttled"], s["held"]) == (2, 20, 2)
    throttled, waits, wait_timeouts = throttle_totals(observer, "full20")
    assert throttled == 20
    # Only heads waited in the server (each interrupt of one by a deadline's try, one more
    # wait): at most one at a time, so at most one timed out; the others' deadlines passed in
    # the client queue, and their tries waited not at all.
    print(f"full20: throttled {throttled}, waits {waits}, wait_timeouts {wait_timeouts}")
    assert waits >= 1 and wait_timeouts == s["wait_timeouts"] <= 1
    assert one(blocker, "SELECT stage_e_release_all('full20')") == 2
    assert stats(observer, "full20")["held"] == 0 and cap_locks(observer, "full20") == []


def test_waiters_get_the_slots_the_loops_holders_release_and_count_exact_throttles(
        dsn, connect, cluster):
    """Two regions of the loop hold a cap of 2 for 0.3 s while ten of the same loop wait 1 s
    for it (holding what they get 0.5 s). The releases interrupt the head's wait instead of
    queueing behind it, so the waiters are served as the slots free; and the extension
    counts exactly one throttle per waiter left without a slot, none for the others."""
    observer = connect("observer")
    grants = []

    async def holder(started):
        async with stage_e_slot(dsn, "rel", n=2) as slot:
            assert slot is not None
            started.release()
            await asyncio.sleep(0.3)

    async def waiter(start):
        async with stage_e_slot(dsn, "rel", n=2, wait=1.0) as slot:
            if slot is not None:
                grants.append(time.monotonic() - start)
                await asyncio.sleep(0.5)
            return slot

    async def main():
        started = asyncio.Semaphore(0)
        holders = [asyncio.create_task(holder(started)) for _ in range(2)]
        for _ in range(2):
            await started.acquire()
        start = time.monotonic()
        results = await asyncio.gather(*(waiter(start) for _ in range(10)))
        await asyncio.gather(*holders)
        return results

    results = run(main())
    got = [r for r in results if r is not None]
    assert len(got) >= 2 and set(got) <= {0, 1}
    assert min(grants) < 0.7  # the holders' releases at 0.3 s, not after a 1 s wait
    s = stats(observer, "rel")
    print(f"rel: {len(got)} served, first after {min(grants):.2f} s, throttled {s['throttled']}")
    assert s["throttled"] == results.count(None) == throttle_totals(observer, "rel")[0]
    assert (s["acquired"], s["released"], s["held"]) == (2 + len(got), 2 + len(got), 0)


def test_a_waiter_queued_behind_a_head_on_another_full_cap_ends_by_its_deadline(
        dsn, connect, cluster):
    """The head waits 10 s on a full cap X; a waiter of cap Y, queued behind it, ends by its
    own deadline with one try: one throttle while Y stays full, the slot when Y freed
    meanwhile. Its try interrupts the head, which waits on for what is left: the interrupt
    counts one more wait for X, and no throttle nor timed-out wait."""
    observer = connect("observer")
    for cap in ("bx", "by"):
        assert one(observer, "SELECT stage_e_try_slot(%s, 1)", (cap,)) == 0
    since = len(cluster.log_text())

    async def main():
        sc = connection_for(dsn)
        head = asyncio.create_task(sc.try_slot(1, cap="bx", wait=10))
        await until(lambda: waiters(observer, "bx") == 1, "the head to wait")
        start = time.monotonic()
        assert await sc.try_slot(1, cap="by", wait=0.5) is None
        took = time.monotonic() - start
        assert 0.5 <= took < 1.5
        await until(lambda: waiters(observer, "bx") == 1, "the head to wait again")
        assert throttle_totals(observer, "by") == (1, 0, 0)
        # Y frees while its waiter is queued: its deadline's try takes the slot.
        freed = asyncio.get_running_loop().call_later(
            0.2, lambda: one(observer, "SELECT stage_e_release('by', 0)"))
        assert await sc.try_slot(1, cap="by", wait=0.5) == 0
        freed.cancel()
        assert not head.done()
        await until(lambda: waiters(observer, "bx") == 1, "the head to wait once more")
        assert one(observer, "SELECT stage_e_release('bx', 0)") is True
        assert await asyncio.wait_for(head, 5) == 0
        assert await sc.release(0, cap="bx") and await sc.release(0, cap="by")

    run(main())
    assert throttle_totals(observer, "by") == (1, 0, 0)
    # Head X: its first wait, one per interrupt (the two tries of Y), none timed out.
    assert throttle_totals(observer, "bx") == (0, 3, 0)
    assert cancels_logged(cluster, since) == 2
    assert stats(observer, "bx")["acquired"] == 2 and stats(observer, "by")["acquired"] == 2


def test_waiters_of_two_loops_are_served_in_arrival_order(dsn, connect):
    """Each loop has its own session, so the server's queue orders them: FIFO."""
    observer = connect("observer")
    assert one(observer, "SELECT stage_e_try_slot('fifo', 1)") == 0
    order, errors = [], []

    def loop_thread(name, hold):
        async def main():
            async with stage_e_slot(dsn, "fifo", n=1, wait=30) as slot:
                order.append((name, slot))
                await asyncio.to_thread(hold.wait, 10)

        try:
            run(main())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    holds = {name: threading.Event() for name in ("first", "second")}
    threads = {name: threading.Thread(target=loop_thread, args=(name, holds[name]))
               for name in holds}
    threads["first"].start()
    wait_for(lambda: waiters(observer, "fifo") == 1, what="the first loop to wait")
    threads["second"].start()
    wait_for(lambda: waiters(observer, "fifo") == 2, what="the second loop to wait")
    assert one(observer, "SELECT stage_e_release('fifo', 0)") is True
    wait_for(lambda: len(order) == 1, what="the first waiter to be served")
    assert order == [("first", 0)] and waiters(observer, "fifo") == 1
    holds["first"].set()
    wait_for(lambda: len(order) == 2, what="the second waiter to be served")
    holds["second"].set()
    for t in threads.values():
        t.join(30)
        assert not t.is_alive()
    assert errors == [] and order == [("first", 0), ("second", 0)]


# -- cancellation ------------------------------------------------------------------------------

def test_a_cancelled_wait_the_server_had_served_gives_the_slot_back(dsn, connect, caplog):
    """The server hands the slot to the waiter, and the waiting task is cancelled before it
    reads the answer: psycopg cancels (too late) and re-raises; the slot is held but unknown
    to any region, so it is released, and the loop's other region keeps its own."""
    observer, blocker = connect("observer"), connect("blocker")
    assert one(blocker, "SELECT stage_e_try_slot('c', 1)") == 0

    async def waiter():
        async with stage_e_slot(dsn, "c", n=1, wait=30):
            raise AssertionError("the region must not run")

    async def main():
        async with stage_e_slot(dsn, "keep", n=1) as keep:
            assert keep == 0
            pid = loop_pid(dsn)
            task = asyncio.create_task(waiter())
            await until(lambda: waiters(observer, "c") == 1, "the waiter to wait")
            # Without yielding to the loop: the slot goes to the waiter, its answer arrives
            # in the socket unread, and then the task is cancelled.
            assert one(blocker, "SELECT stage_e_release('c', 0)") is True
            wait_for(lambda: cap_locks(observer, "c") == [(0, pid)],
                     what="the server to hand the slot to the waiter")
            time.sleep(0.2)  # noqa: ASYNC251 - blocking the loop is the point: answer unread
            task.cancel()
            with caplog.at_level(logging.WARNING, logger="stage_e_slots"), \
                    pytest.raises(asyncio.CancelledError):
                await task
            assert cap_locks(observer, "c") == []
            assert cap_locks(observer, "keep") == [(0, pid)]
            assert loop_pid(dsn) == pid

    run(main())
    assert "released slot 0 of cap 'c', taken by a call that was cancelled" in caplog.text
    s = stats(observer, "c")
    assert (s["acquired"], s["released"], s["foreign_releases"]) == (2, 2, 0)


def test_cancelling_many_waiting_tasks_leaves_no_slot_held(dsn, connect):
    """Twelve tasks wait for a cap of 2 while the blocker's slots free: some are served, some
    are cancelled while waiting (task.cancel() and wait_for timeouts), some in their region.
    Nothing of the cap stays held, and the loop's other region keeps its slot."""
    observer, blocker = connect("observer"), connect("blocker")
    assert one(blocker, "SELECT stage_e_try_slots('many', 2, 2)") == [0, 1]
    served = {}

    async def waiter(i):
        async with stage_e_slot(dsn, "many", n=2, wait=30) as slot:
            served[i] = slot
            await asyncio.sleep(0.05 * (i % 4))

    async def main():
        async with stage_e_slot(dsn, "keep", n=1) as keep:
            assert keep == 0
            pid = loop_pid(dsn)
            tasks = [asyncio.create_task(asyncio.wait_for(waiter(i), 0.5 + 0.1 * i))
                     if i % 2 else asyncio.create_task(waiter(i)) for i in range(12)]
            await asyncio.sleep(0.3)
            assert one(blocker, "SELECT stage_e_release_all('many')") == 2
            for i, task in enumerate(tasks):
                if i % 3 == 0:
                    await asyncio.sleep(0.07)
                    task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert cap_locks(observer, "many") == []
            assert cap_locks(observer, "keep") == [(0, pid)]
            assert one(observer, "SELECT count(*) FROM stage_e_slot_waiters") == 0
            return results

    results = run(main())
    ended = [isinstance(r, (asyncio.CancelledError, asyncio.TimeoutError)) for r in results]
    assert any(e and i not in served for i, e in enumerate(ended))  # cancelled while waiting
    assert served and all(s in (0, 1) for s in served.values())
    s = stats(observer, "many")
    # Every slot handed out came back (those taken by a wait whose answer was lost too).
    assert s["held"] == 0 and s["acquired"] == s["released"] >= len(served) + 2
    assert s["foreign_releases"] == 0


def test_a_wait_for_timeout_cancels_the_server_wait(dsn, connect):
    observer = connect("observer")
    assert one(observer, "SELECT stage_e_try_slot('t', 1)") == 0

    async def region():
        async with stage_e_slot(dsn, "t", n=1, wait=30):
            raise AssertionError("the region must not run")

    async def main():
        start = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(region(), 0.5)
        assert time.monotonic() - start < 3
        assert waiters(observer, "t") == 0
        # The connection is fine afterwards.
        async with stage_e_slot(dsn, "u", n=1) as slot:
            assert slot == 0

    run(main())
    s = stats(observer, "t")
    assert (s["waits"], s["wait_timeouts"], s["acquired"]) == (1, 0, 1)


# -- failures of the connection ----------------------------------------------------------------

def test_a_release_never_reconnects_and_a_slot_of_a_dropped_connection_is_reported_lost(
        dsn, connect, caplog):
    """A region's connection dies; another task then opens the loop's next connection. The
    region's release must say its slot was lost, not run on the new session (a foreign
    release); and a release with no connection opens none."""
    observer = connect("observer")
    app = f"stage_e_slot:{os.getpid()}:aio"

    async def main():
        sc = connection_for(dsn)
        with caplog.at_level(logging.ERROR, logger="stage_e_slots"):
            async with sc.slot(1, cap="a") as a:
                assert a == 0
                first = loop_pid(dsn)
                one(observer, "SELECT pg_terminate_backend(%s)", (first,))
                wait_for(lambda: one(observer, "SELECT count(*) FROM pg_stat_activity "
                                                "WHERE pid = %s", (first,)) == 0,
                         what="the backend to exit")
                # Another task's region: the loop's connection is re-opened.
                async with sc.slot(1, cap="b") as b:
                    assert b is None  # the probe found the connection broken: throttled
                async with sc.slot(1, cap="b") as b:
                    assert b == 0 and loop_pid(dsn) != first
                    second = loop_pid(dsn)
            assert "slot 0 of cap 'a' was lost with its connection" in caplog.text
            assert loop_pid(dsn) == second
            # No connection at all: a release opens none.
            await sc.close()
            assert await sc.release(0, cap="a") is False
            assert await sc.holding(0, cap="a") is False
            assert sc._line.conn is None
            # A backend leaves pg_stat_activity a moment after its client closes.
            wait_for(lambda: one(observer, "SELECT count(*) FROM pg_stat_activity "
                                           "WHERE application_name = %s", (app,)) == 0,
                     what="the loop's closed connection to leave pg_stat_activity")

    run(main())
    for cap in ("a", "b"):
        assert stats(observer, cap)["foreign_releases"] == 0
    assert stats(observer, "a")["released_by_exit"] == 1


def test_a_release_whose_connection_died_is_reported_and_the_next_region_reconnects(
        dsn, connect, caplog):
    observer = connect("observer")

    async def main():
        with caplog.at_level(logging.ERROR, logger="stage_e_slots"):
            async with stage_e_slot(dsn, "d", n=1) as slot:
                assert slot == 0
                first = loop_pid(dsn)
                one(observer, "SELECT pg_terminate_backend(%s)", (first,))
            assert "release of slot 0 failed" in caplog.text
        async with stage_e_slot(dsn, "d", n=1) as slot:
            assert slot == 0 and loop_pid(dsn) != first

    run(main())
    assert cap_locks(observer, "d") == []


# -- event loops and processes ---------------------------------------------------------------

def test_a_connection_never_crosses_event_loops(dsn, connect):
    observer = connect("observer")
    seen = []

    async def main():
        async with stage_e_slot(dsn, "loops", n=2) as slot:
            # Compared while it is in use, through a weak reference: an id() may be the freed
            # first object's address given again to the second (a false "same object").
            conn = connection_for(dsn)
            reused = any(ref() is conn for ref, _, _, _ in seen)
            seen.append((weakref.ref(conn), reused, loop_pid(dsn), slot))

    asyncio.run(main())  # no sweep: the next loop's first use must not reuse this connection
    asyncio.run(main())
    (_, _, pid1, slot1), (_, reused, pid2, slot2) = seen
    assert (slot1, slot2) == (0, 0)
    assert not reused and pid1 != pid2
    # The ended loop's connection was closed when the next loop made its own.
    wait_for(lambda: one(observer, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                         (pid1,)) == 0, what="the first loop's session to end")

    # A connection object of one's own: a new session in a new loop; another running loop
    # cannot use it.
    sc = AsyncSlotConnection(dsn)
    pids = []

    async def own():
        async with sc.slot(1, cap="own") as slot:
            assert slot == 0
            pids.append(sc._line.conn.info.backend_pid)

    asyncio.run(own())
    asyncio.run(own())
    assert pids[0] != pids[1]

    started, stop, errors = threading.Event(), threading.Event(), []

    async def hold_loop():
        async with sc.slot(1, cap="own"):
            started.set()
            await asyncio.to_thread(stop.wait, 10)

    t = threading.Thread(target=lambda: asyncio.run(hold_loop()))
    t.start()
    assert started.wait(10)
    try:
        with pytest.raises(RuntimeError, match="belongs to another running event loop"):
            asyncio.run(sc.try_slot(1, cap="own"))
        # Two loops at once, each with connection_for: two sessions.
        async def pid_of_this_loop():
            async with stage_e_slot(dsn, "two", n=2) as slot:
                return slot, loop_pid(dsn)

        other = run(pid_of_this_loop())
        assert other[1] != sc._line.conn.info.backend_pid
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive() and errors == []
    run(sc.close())


def test_a_forked_child_uses_its_own_connection_and_leaves_the_parents_slot(dsn, connect):
    """The child gets sessions of its own, through connection_for and through a connection
    object it inherited, and cannot release (or end) the parent's."""
    observer = connect("observer")
    sc = AsyncSlotConnection(dsn)
    r, w = os.pipe()

    async def parent():
        async with stage_e_slot(dsn, "fork", n=4) as slot, sc.slot(4, cap="own") as own:
            assert (slot, own) == (0, 0)
            pid, own_pid = loop_pid(dsn), sc._line.conn.info.backend_pid
            child = os.fork()
            if child == 0:  # pragma: no cover - runs in the child
                code = 1
                try:
                    os.close(r)

                    async def in_child():
                        async with stage_e_slot(dsn, "fork", n=4) as s2:
                            got = [s2, loop_pid(dsn)]
                        # The parent's slot is not the child's to give back.
                        got.append(await sc.release(0, cap="own"))
                        async with sc.slot(4, cap="own") as s3:
                            got += [s3, sc._line.conn.info.backend_pid]
                        await sc.close()
                        return got

                    os.write(w, " ".join(map(str, asyncio.run(in_child()))).encode())
                    code = 0
                finally:
                    os._exit(code)
            os.close(w)
            _, status = await asyncio.to_thread(os.waitpid, child, 0)
            got = os.read(r, 200).decode().split()
            os.close(r)
            assert os.waitstatus_to_exitcode(status) == 0
            assert int(got[0]) == 1 and int(got[1]) not in (pid, own_pid)
            assert got[2] == "False"
            assert int(got[3]) == 1 and int(got[4]) not in (pid, own_pid)
            assert cap_locks(observer, "fork") == [(0, pid)]
            assert cap_locks(observer, "own") == [(0, own_pid)]
            assert await connection_for(dsn).holding(0, cap="fork")
            assert await sc.holding(0, cap="own")
            assert (loop_pid(dsn), sc._line.conn.info.backend_pid) == (pid, own_pid)

    run(parent())
    run(sc.close())
    for cap in ("fork", "own"):
        s = stats(observer, cap)
        assert (s["acquired"], s["released"], s["foreign_releases"]) == (2, 2, 0)


def test_connection_for_needs_a_running_loop(dsn):
    with pytest.raises(RuntimeError, match="running in an event loop"):
        connection_for(dsn)
