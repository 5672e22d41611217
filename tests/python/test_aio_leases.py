"""stage_e_slots.aio's leases against a real cluster: taken, renewed and released by token,
lost leases reported, waits that give way, cancellation while waiting and while renewing.
(tests/python/test_aio.py has the session slots and the shared helpers.)"""

import asyncio
import logging
import time

import psycopg
import pytest
from conftest import cap_locks, one, stats, wait_for  # tests/conftest.py's, via tests/python
from stage_e_slots import LeaseLost, _aio_leases
from stage_e_slots.aio import AsyncLease, stage_e_lease
from test_aio import run, until, waiters


@pytest.fixture
def dsn(cluster, db):
    return cluster.conninfo(db, "aio-test")


def leases(conn, cap):
    """(slot, token, pid, live) of the cap's rows in stage_e_slot_holders."""
    return conn.execute(
        "SELECT slot, token, pid, expires_at > clock_timestamp() FROM stage_e_slot_holders "
        "WHERE cap = %s ORDER BY slot", (cap,)).fetchall()


def test_a_lease_is_taken_renewed_and_released_by_token(dsn, connect):
    observer = connect("observer")

    async def main():
        async with stage_e_lease(dsn, "exports", 2, ttl=30) as lease:
            assert isinstance(lease, AsyncLease)
            assert lease.slot == 0 and lease.token > 0 and lease.lost is False
            [(slot, token, _pid, live)] = leases(observer, "exports")
            assert (slot, token, live) == (0, lease.token, True)
            assert cap_locks(observer, "exports") == []  # a token, not a session's lock
            assert await lease.still_held()
            assert await lease.renew(ttl=60) is True
            async with stage_e_lease(dsn, "exports", 2, ttl=30) as second:
                assert second.slot == 1
                async with stage_e_lease(dsn, "exports", 2, ttl=30) as third:
                    assert third is None
        assert leases(observer, "exports") == []
        assert not await lease.still_held()
        with pytest.raises(RuntimeError, match="region has ended"):
            await lease.renew()

    run(main())
    s = stats(observer, "exports")
    assert (s["acquired"], s["released"], s["throttled"], s["expired"]) == (2, 2, 1, 0)


def test_a_lost_lease_raises_lease_lost_or_is_noted_on_the_regions_exception(dsn, connect,
                                                                            caplog):
    observer = connect("observer")

    async def main():
        with caplog.at_level(logging.ERROR, logger="stage_e_slots"):
            with pytest.raises(LeaseLost) as lost:
                async with stage_e_lease(dsn, "expiring", 1, ttl=0.3) as lease:
                    await asyncio.sleep(0.6)
                    assert not await lease.still_held()
            assert lost.value.cap == "expiring" and lost.value.token == lease.token
            with pytest.raises(LeaseLost, match="a renewal found it expired"):
                async with stage_e_lease(dsn, "expiring", 1, ttl=0.2) as lease:
                    await asyncio.sleep(0.4)
                    assert await lease.renew() is False and lease.lost
            with pytest.raises(RuntimeError, match="work failed") as failed:
                async with stage_e_lease(dsn, "expiring", 1, ttl=0.2):
                    await asyncio.sleep(0.4)
                    raise RuntimeError("work failed")
            assert not hasattr(failed.value, "add_note") or any(  # notes: Python 3.11+
                "was lost before its region ended" in note for note in failed.value.__notes__)

    run(main())
    assert stats(observer, "expiring")["expired"] == 3


def test_a_waiting_lease_gives_way_to_the_release_it_waits_for(dsn, connect):
    observer = connect("observer")
    got = {}

    async def waiter():
        start = time.monotonic()
        async with stage_e_lease(dsn, "lw", 1, ttl=30, wait=10) as lease:
            got["slot"], got["after"] = lease.slot, time.monotonic() - start

    async def main():
        async with stage_e_lease(dsn, "lw", 1, ttl=30) as lease:
            assert lease.slot == 0
            task = asyncio.create_task(waiter())
            await until(lambda: waiters(observer, "lw") == 1, "the lease to wait")
        await asyncio.wait_for(task, 5)

    run(main())
    assert got["slot"] == 0 and got["after"] < 3
    s = stats(observer, "lw")
    assert (s["acquired"], s["released"], s["expired"], s["foreign_releases"]) == (2, 2, 0, 0)


def test_a_cancelled_lease_wait_the_server_had_served_gives_the_lease_back(dsn, connect,
                                                                           caplog):
    observer, blocker = connect("observer"), connect("blocker")
    _slot, token = blocker.execute("SELECT * FROM stage_e_lease('lc', 1, '30 s')").fetchone()

    async def waiter():
        async with stage_e_lease(dsn, "lc", 1, ttl=30, wait=30):
            raise AssertionError("the region must not run")

    async def main():
        async with stage_e_lease(dsn, "lkeep", 1, ttl=30) as keep:
            task = asyncio.create_task(waiter())
            await until(lambda: waiters(observer, "lc") == 1, "the lease to wait")
            assert one(blocker, "SELECT stage_e_release_lease('lc', 0, %s)", (token,)) is True
            wait_for(lambda: [r[1] for r in leases(observer, "lc")] not in ([], [token]),
                     what="the server to hand the lease to the waiter")
            time.sleep(0.2)  # noqa: ASYNC251 - blocking the loop is the point: answer unread
            task.cancel()
            with caplog.at_level(logging.WARNING, logger="stage_e_slots"), \
                    pytest.raises(asyncio.CancelledError):
                await task
            assert leases(observer, "lc") == []
            assert [r[1] for r in leases(observer, "lkeep")] == [keep.token]

    run(main())
    assert "taken by a call that was cancelled" in caplog.text
    s = stats(observer, "lc")
    assert (s["acquired"], s["released"], s["expired"], s["foreign_releases"]) == (2, 2, 0, 0)


SLOW_RENEWAL = "SELECT stage_e_renew(%s, %s, %s, %s), pg_sleep(30)"  # renews, then sleeps


@pytest.mark.parametrize("through", ["dsn", "own connection"])
def test_a_renewal_cancelled_midway_still_ends_with_the_release(through, cluster, db, dsn,
                                                                connect, monkeypatch):
    observer = connect("observer")
    monkeypatch.setattr(_aio_leases, "_RENEW", SLOW_RENEWAL)

    async def region(target, renewing):
        async with stage_e_lease(target, "renewed", 1, ttl=30) as lease:
            renewing.set()
            await lease.renew()

    async def main():
        target = (dsn if through == "dsn" else
                  await psycopg.AsyncConnection.connect(cluster.conninfo(db, "owner"),
                                                        autocommit=True))
        renewing = asyncio.Event()
        task = asyncio.create_task(region(target, renewing))
        await renewing.wait()
        await until(lambda: one(observer, "SELECT count(*) FROM pg_stat_activity WHERE query "
                                          "LIKE 'SELECT stage_e_renew(%%pg_sleep%%' AND "
                                          "state = 'active'") == 1, "the renewal to sleep")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        assert leases(observer, "renewed") == []
        if through != "dsn":
            await target.close()

    run(main())
    s = stats(observer, "renewed")
    assert (s["acquired"], s["released"], s["expired"], s["foreign_releases"]) == (1, 1, 0, 0)


@pytest.mark.skipif(tuple(map(int, psycopg.__version__.split(".")[:2])) < (3, 3),
                    reason="psycopg closes a connection whose cancellation is interrupted "
                    "since 3.3")
def test_a_renewal_whose_cancellation_broke_the_connection_leaves_the_ttl_to_free_the_lease(
        cluster, db, connect, monkeypatch, caplog):
    """Cancelled twice mid-renewal, psycopg gives up on the connection it owns; the release on
    exit cannot run there, says so, and the ttl frees the slot."""
    observer = connect("observer")
    monkeypatch.setattr(_aio_leases, "_RENEW", SLOW_RENEWAL)

    async def region(conn, renewing, box):
        async with stage_e_lease(conn, "renewed", 1, ttl=1) as lease:
            box.append(lease)
            renewing.set()
            await lease.renew()

    async def main():
        conn = await psycopg.AsyncConnection.connect(cluster.conninfo(db, "owner"),
                                                     autocommit=True)
        renewing, box = asyncio.Event(), []
        task = asyncio.create_task(region(conn, renewing, box))
        await renewing.wait()
        await until(lambda: one(observer, "SELECT count(*) FROM pg_stat_activity WHERE query "
                                          "LIKE 'SELECT stage_e_renew(%%pg_sleep%%' AND "
                                          "state = 'active'") == 1, "the renewal to sleep")
        task.cancel()
        await asyncio.sleep(0)  # psycopg is now cancelling the renewal...
        task.cancel()  # ...and is interrupted: it closes the connection
        with caplog.at_level(logging.ERROR, logger="stage_e_slots"), \
                pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        assert conn.closed
        return box[0]

    lease = run(main())
    assert "could not be released, its connection is gone" in caplog.text
    assert lease.lost is False
    assert [r[1] for r in leases(observer, "renewed")] == [lease.token]
    time.sleep(1.2)
    slot, _ = observer.execute("SELECT * FROM stage_e_lease('renewed', 1, '30 s')").fetchone()
    assert slot == 0
    assert stats(observer, "renewed")["expired"] == 1


def test_a_lease_on_an_async_connection_of_ones_own_runs_there_unprepared(cluster, db,
                                                                          connect):
    observer = connect("observer")

    async def main():
        conn = await psycopg.AsyncConnection.connect(cluster.conninfo(db, "owner"),
                                                     autocommit=True, prepare_threshold=0)
        try:
            for _ in range(3):
                async with stage_e_lease(conn, "owned", 1, ttl=30) as lease:
                    assert [r[:3] for r in leases(observer, "owned")] == [
                        (0, lease.token, conn.info.backend_pid)]
                    assert await lease.renew() and await lease.still_held()
            cur = await conn.execute("SELECT count(*) FROM pg_prepared_statements",
                                     prepare=False)
            assert (await cur.fetchone())[0] == 0
        finally:
            await conn.close()

    run(main())
    assert stats(observer, "owned")["released"] == 3


def test_lease_bad_arguments_raise(dsn, connect):
    observer = connect("observer")
    sync_conn = connect("sync")

    async def main():
        with pytest.raises(ValueError, match="ttl must be positive"):
            async with stage_e_lease(dsn, "exports", 1, ttl=0):
                pass
        with pytest.raises(TypeError, match="cap must be a cap name"):
            async with stage_e_lease(dsn, 4, 1, ttl=30):
                pass
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="out of range"):
            async with stage_e_lease(dsn, "exports", 0, ttl=30):
                pass
        with pytest.raises(TypeError, match="use stage_e_slots.stage_e_lease"):
            async with stage_e_lease(sync_conn, "exports", 1, ttl=30):
                pass
        with pytest.raises(TypeError, match="a psycopg AsyncConnection, not int"):
            async with stage_e_lease(42, "exports", 1, ttl=30):
                pass

    run(main())
    assert leases(observer, "exports") == []
