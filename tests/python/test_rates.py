"""try_rate (the extension at 0.10.0) in the sync and asyncio APIs against a real cluster: the
burst, then denied with how long to wait; a decision is true when allowed; many threads or
tasks on one key admit exactly the burst; bad arguments raise; an unreachable database is not
allowed (fail closed)."""

import asyncio
import itertools
import logging
import threading
from datetime import timedelta

import psycopg
import pytest
from stage_e_slots import RateDecision, SlotConnection, aio, try_rate

_keys = itertools.count()


def key(what):
    """A key of its own for each call of a test (the cluster and its database are shared)."""
    return f"py:{what}:{next(_keys)}"


@pytest.fixture
def dsn(cluster, db):
    return cluster.conninfo(db, "rate-test")


def test_the_burst_then_denied_with_how_long_to_wait(dsn):
    k = key("burst")
    got = [try_rate(dsn, k, 1, 60, burst=2) for _ in range(3)]
    assert [bool(d) for d in got] == [True, True, False]
    assert got[0] == RateDecision(True, 1, None, got[0].reset_after)
    assert got[1].remaining == 0 and got[1].retry_after is None
    assert timedelta(seconds=100) < got[1].reset_after <= timedelta(seconds=120)
    assert got[2].allowed is False and got[2].remaining == 0
    assert timedelta(seconds=50) < got[2].retry_after <= timedelta(seconds=60)


def test_per_as_a_timedelta_and_cost(dsn):
    k = key("cost")
    assert try_rate(dsn, k, 1, timedelta(minutes=1), burst=3, cost=2).remaining == 1
    assert not try_rate(dsn, k, 1, timedelta(minutes=1), burst=3, cost=2)
    assert try_rate(dsn, k, 1, timedelta(minutes=1), burst=3)


def test_threads_on_one_key_admit_exactly_the_burst(dsn):
    k, allowed = key("threads"), []

    def call():
        for _ in range(5):
            allowed.append(bool(try_rate(dsn, k, 1, 60, burst=4)))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(allowed) == 20 and sum(allowed) == 4


def test_bad_arguments_raise(dsn):
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="can never be allowed|larger"):
        try_rate(dsn, key("bad"), 10, 1, burst=2, cost=3)
    with pytest.raises(ValueError, match="per must be positive"):
        try_rate(dsn, key("bad"), 10, 0)
    with pytest.raises(TypeError, match="rate key"):
        try_rate(dsn, 42, 10, 1)  # type: ignore[arg-type]
    # The connection is kept: the next call is served.
    assert try_rate(dsn, key("after"), 10, 1)


def test_an_unreachable_database_is_not_allowed(caplog):
    sc = SlotConnection("host=/nonexistent port=1 user=nobody dbname=none", connect_timeout=1)
    with caplog.at_level(logging.WARNING, logger="stage_e_slots"):
        decision = sc.try_rate("k", 10, 1)
    assert decision == RateDecision(False, 0, None, None) and not decision
    assert "treating as not allowed" in caplog.text


def test_aio_tasks_on_one_key_admit_exactly_the_burst(dsn):
    k = key("aio")

    async def main():
        got = await asyncio.gather(*(aio.try_rate(dsn, k, 1, 60, burst=3) for _ in range(10)))
        late = await aio.try_rate(dsn, k, 1, 60, burst=3)
        return got, late

    try:
        got, late = asyncio.run(main())
    finally:
        aio._sweep()
    assert sum(bool(d) for d in got) == 3
    assert not late and timedelta(0) < late.retry_after <= timedelta(seconds=60)
