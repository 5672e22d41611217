"""rate= (a Rate) on @capped, stage_e_slot and stage_e_lease, sync and asyncio, against a real
cluster (the extension at 0.10.0): the first acquisition makes the rate the cap's policy (read
from stage_e_rate_limits, set with stage_e_rate_limit when it differs), the server then grants
a slot only while the rate allows, with slots free; a different rate replaces the policy with a
WARNING, once per process; a role without EXECUTE on stage_e_rate_limit gets RatePolicyError
(nothing runs) unless the policy already is the rate; an extension older than 0.10.0 says to
update it; an unreachable database is throttled; bad rates raise."""

import asyncio
import logging
from datetime import timedelta

import psycopg
import pytest
import stage_e_slots
from conftest import cap_locks, stats  # tests/conftest.py's, re-exported by tests/python's
from stage_e_slots import (
    Rate,
    RatePolicyError,
    Throttled,
    aio,
    capped,
    stage_e_lease,
    stage_e_slot,
)

BAD_DSN = "host=/nonexistent port=1 user=nobody dbname=none connect_timeout=1"
ROLE = "rate_worker"


@pytest.fixture
def dsn(cluster, db, monkeypatch):
    monkeypatch.delenv("STAGE_E_SLOTS_DSN", raising=False)
    conninfo = cluster.conninfo(db, "capped-rate-test")
    yield conninfo
    stage_e_slots.connection_for(conninfo).close()


@pytest.fixture
def admin(connect):
    return connect("rate-admin")


@pytest.fixture
def worker_dsn(cluster, db):
    """A role that may use the caps but not set rate policies (EXECUTE on stage_e_rate_limit
    is revoked from PUBLIC)."""
    cluster.sql(f"DROP ROLE IF EXISTS {ROLE}")
    cluster.sql(f"CREATE ROLE {ROLE} LOGIN")
    conninfo = cluster.conninfo(db, "rate-worker", user=ROLE)
    yield conninfo
    stage_e_slots.connection_for(conninfo).close()
    cluster.sql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = "
                f"'{ROLE}'")
    cluster.sql(f"DROP ROLE {ROLE}")


def policy(admin, cap):
    """The cap's row of stage_e_rate_limits: (count, per, burst), None without a policy."""
    return admin.execute("SELECT count, per, burst FROM stage_e_rate_limits WHERE cap = %s",
                         (cap,)).fetchone()


def warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_capped_makes_the_rate_the_policy_and_the_rate_binds_with_slots_free(dsn, admin):
    """2 a minute in bursts of 2 on a cap of 4: the first call sets the policy, the third
    immediate call is throttled (on_throttle) while all 4 slots are free; pg_locks showed each
    call's slot; the server counts the refusal as rate_limited."""
    ran, throttled, held = [], [], []

    @capped("api", 4, dsn=dsn, rate=Rate(2, 60, burst=2),
            on_throttle=lambda i: throttled.append(i) or "throttled")
    def call(i):
        ran.append(i)
        held.append(len(cap_locks(admin, "api")))
        return i

    assert policy(admin, "api") is None
    assert call(0) == 0
    assert policy(admin, "api") == (2, timedelta(minutes=1), 2)
    assert [call(1), call(2)] == [1, "throttled"]
    assert ran == [0, 1] and throttled == [2] and held == [1, 1]
    assert cap_locks(admin, "api") == [], "the throttled call had 4 free slots"
    s = stats(admin, "api")
    assert (s["throttled"], s["rate_limited"]) == (1, 1)

    # Made sure of once per process: an operator's change later stands (no statement of this
    # decorator's reads or writes the policy again): here, the policy taken off.
    admin.execute("SELECT stage_e_rate_limit_off('api')")
    assert [call(3), call(4), call(5)] == [3, 4, 5]
    assert policy(admin, "api") is None


def test_a_different_rate_replaces_the_policy_with_a_warning(dsn, admin, caplog):
    # Fast rates: a policy that replaces another goes on from the cap's rate state (a time),
    # which a slow first rate would leave far ahead.
    @capped("shared", 4, dsn=dsn, rate=Rate(100, 1, burst=10))
    def first():
        return "first"

    @capped("shared", 4, dsn=dsn, rate=Rate(50, timedelta(seconds=1), burst=5))
    def second():
        return "second"

    with caplog.at_level(logging.WARNING, logger="stage_e_slots"):
        assert first() == "first"
        assert warnings(caplog) == [], "no policy to replace"
        assert second() == "second"
        assert policy(admin, "shared") == (50, timedelta(seconds=1), 5)
        [warning] = warnings(caplog)
        assert "'shared'" in warning and "100 per 1 s, bursts of 10" in warning
        assert "50 per 1 s, bursts of 5" in warning and "last writer wins" in warning
        caplog.clear()
        # Each made sure of its rate once: the first does not take the policy back.
        assert [first(), second(), first()] == ["first", "second", "first"]
        assert warnings(caplog) == []
    assert policy(admin, "shared") == (50, timedelta(seconds=1), 5)


def test_a_role_without_execute_gets_a_clear_error_unless_the_policy_is_the_rate(
        worker_dsn, admin, caplog):
    ran = []

    @capped("guarded", 4, dsn=worker_dsn, rate=Rate(2, 60, burst=2))
    def work():
        ran.append(1)
        return "ran"

    with pytest.raises(RatePolicyError) as e:
        work()
    message = str(e.value)
    assert "cap 'guarded'" in message and "policy is none" in message
    assert "EXECUTE on stage_e_rate_limit" in message
    assert "`SELECT stage_e_rate_limit('guarded', 2, '60 s', 2)`" in message
    assert isinstance(e.value.__cause__, psycopg.errors.InsufficientPrivilege)
    assert (e.value.cap, e.value.rate) == ("guarded", Rate(2, 60, burst=2))
    assert ran == [] and cap_locks(admin, "guarded") == [] and policy(admin, "guarded") is None

    admin.execute("SELECT stage_e_rate_limit('guarded', 3, '1 min')")
    with caplog.at_level(logging.WARNING, logger="stage_e_slots"), \
            pytest.raises(RatePolicyError, match=r"policy is 3 per 60 s, bursts of 1, and this"):
        work()
    assert ran == [] and policy(admin, "guarded") == (3, timedelta(minutes=1), 1)
    assert warnings(caplog) == [], "nothing was replaced"

    # Set as asked by a role with the privilege: this one needs none, and the rate binds it.
    admin.execute("SELECT stage_e_rate_limit('guarded', 2, '1 min', 2)")
    assert [work(), work()] == ["ran", "ran"]
    with pytest.raises(Throttled, match=r"its rate \(2 per 60 s, bursts of 2\)"):
        work()
    assert len(ran) == 2

    # The same for asyncio, on a cap whose policy differs.
    @capped("guarded-aio", 4, dsn=worker_dsn, rate=Rate(1, 60))
    async def work_async():
        ran.append(1)

    try:
        with pytest.raises(RatePolicyError, match="may not set it"):
            asyncio.run(work_async())
    finally:
        aio._sweep()
    assert len(ran) == 2 and cap_locks(admin, "guarded-aio") == []


def test_asyncio_capped_slot_and_lease_take_a_rate(dsn, admin):
    throttled = []

    async def on_throttle(i):
        throttled.append(i)
        return "throttled"

    @capped("aio-api", 4, dsn=dsn, rate=Rate(2, 60, burst=2), on_throttle=on_throttle)
    async def call(i):
        await asyncio.sleep(0)
        return i

    async def main():
        got = [await call(i) for i in range(3)]
        slots = []
        for _ in range(2):
            async with aio.stage_e_slot(dsn, "aio-slot", n=4, rate=Rate(1, 60)) as slot:
                slots.append(slot)
        leases = []
        for _ in range(2):
            async with aio.stage_e_lease(dsn, "aio-lease", 4, ttl=30, rate=Rate(1, 60)) as lease:
                leases.append(lease)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            with pytest.raises(TypeError, match="needs a DSN"):
                async with aio.stage_e_lease(conn, "aio-lease", 4, ttl=30, rate=Rate(1, 60)):
                    pass
        return got, slots, leases

    try:
        got, slots, leases = asyncio.run(main())
    finally:
        aio._sweep()
    assert got == [0, 1, "throttled"] and throttled == [2]
    assert policy(admin, "aio-api") == (2, timedelta(minutes=1), 2)
    assert slots == [0, None] and policy(admin, "aio-slot") == (1, timedelta(minutes=1), 1)
    assert leases[0] is not None and leases[1] is None
    assert policy(admin, "aio-lease") == (1, timedelta(minutes=1), 1)
    assert [stats(admin, cap)["rate_limited"] for cap in ("aio-api", "aio-slot", "aio-lease")] \
        == [1, 1, 1]


def test_sync_slot_and_lease_take_a_rate(dsn, admin, cluster, db):
    slots = []
    for _ in range(2):
        with stage_e_slot(dsn, "slot-rated", n=4, rate=Rate(1, 60)) as slot:
            slots.append((slot, cap_locks(admin, "slot-rated")))
    pid = stage_e_slots.connection_for(dsn)._conn.info.backend_pid
    assert slots == [(0, [(0, pid)]), (None, [])], "the second had 4 free slots"
    assert policy(admin, "slot-rated") == (1, timedelta(minutes=1), 1)
    assert stats(admin, "slot-rated")["rate_limited"] == 1

    got = []
    for _ in range(2):
        with stage_e_lease(dsn, "lease-rated", 4, ttl=30, rate=Rate(1, 60)) as lease:
            got.append(lease is not None)
    assert got == [True, False] and policy(admin, "lease-rated") == (1, timedelta(minutes=1), 1)

    # A lease on a connection of the caller's: the policy cannot be set in a transaction of
    # its own there.
    with cluster.connect(db) as conn, pytest.raises(TypeError, match="needs a DSN"), \
            stage_e_lease(conn, "lease-rated", 4, ttl=30, rate=Rate(1, 60)):
        pass


def test_try_slot_and_try_slots_of_a_connection_take_a_rate(dsn, admin):
    """SlotConnection.try_slot / try_slots (sync and asyncio) with rate=: the policy set on
    the first call, then refusals by the rate with slots free; k slots charge k."""
    conn = stage_e_slots.connection_for(dsn)
    first = conn.try_slot(4, cap="try-rated", rate=Rate(1, 60))
    assert (first, conn.try_slot(4, cap="try-rated", rate=Rate(1, 60))) == (0, None)
    assert policy(admin, "try-rated") == (1, timedelta(minutes=1), 1)
    assert conn.release(first, cap="try-rated") is True
    three = conn.try_slots(8, 3, cap="try-k", rate=Rate(3, 60, burst=3))
    assert three == [0, 1, 2] and len(cap_locks(admin, "try-k")) == 3
    assert conn.try_slots(8, 1, cap="try-k", rate=Rate(3, 60, burst=3)) is None, "3 charged"
    for slot in three:
        assert conn.release(slot, cap="try-k") is True
    assert stats(admin, "try-k")["rate_limited"] == 1

    async def main():
        aconn = aio.connection_for(dsn)
        got = [await aconn.try_slot(4, cap="aio-try", rate=Rate(1, 60)) for _ in range(2)]
        more = await aconn.try_slots(4, 1, cap="aio-try", rate=Rate(1, 60))
        await aconn.release(got[0], cap="aio-try")
        return got, more

    try:
        got, more = asyncio.run(main())
    finally:
        aio._sweep()
    assert got == [0, None] and more is None
    assert policy(admin, "aio-try") == (1, timedelta(minutes=1), 1)


def test_an_extension_older_than_0_10_0_says_to_update_it(cluster):
    name = cluster.create_database("t_capped_rate_old", extension=False)
    cluster.sql("CREATE EXTENSION stage_e_slots VERSION '0.9.0'", dbname=name)
    conninfo = cluster.conninfo(name, "rate-old")
    ran = []

    @capped("old", 4, dsn=conninfo, rate=Rate(1, 60))
    def work():
        ran.append(1)

    try:
        with pytest.raises(RatePolicyError, match="ALTER EXTENSION stage_e_slots UPDATE"):
            work()
        assert ran == []
        cluster.sql("ALTER EXTENSION stage_e_slots UPDATE", dbname=name)
        work()
        assert ran == [1]
        with pytest.raises(Throttled):
            work()
    finally:
        stage_e_slots.connection_for(conninfo).close()
        cluster.sql(f'DROP DATABASE "{name}" WITH (FORCE)')


def test_an_unreachable_database_is_throttled(caplog):
    @capped("far", 2, dsn=BAD_DSN, rate=Rate(1, 1), on_throttle=lambda: "throttled")
    def work():
        raise AssertionError("ran without its cap")

    with caplog.at_level(logging.WARNING, logger="stage_e_slots"):
        assert work() == "throttled"
    assert any("rate policy" in w for w in warnings(caplog))


def test_bad_rates_raise():
    for args, kwargs in [((0, 1), {}), ((1, 0), {}), ((1, -1), {}),
                         ((1, timedelta(days=1, microseconds=1)), {}), ((1, 1e-7), {}),
                         ((1, float("nan")), {}), ((1, 1), {"burst": 0}), ((2**31, 1), {}),
                         ((True, 1), {}), ((1, True), {}), ((1, 1), {"burst": False})]:
        with pytest.raises(ValueError, match="Rate's (count|per|burst) must be"):
            Rate(*args, **kwargs)
    with pytest.raises(TypeError, match="Rate's per must be"):
        Rate(1, "1")
    assert Rate(10, 1) == Rate(10, timedelta(seconds=1)) and Rate(1, 86400).per.days == 1
    assert len({Rate(10, 1), Rate(10, 1.0), Rate(10, 1, burst=2)}) == 2
    with pytest.raises(TypeError, match="rate must be a stage_e_slots.Rate"):
        capped("api", 4, rate=(10, 1))
    with pytest.raises(ValueError, match="prefix policy"):
        capped("tenant:*", 4, rate=Rate(10, 1))
    with pytest.raises(TypeError, match="rate must be a stage_e_slots.Rate"), \
            stage_e_slot(BAD_DSN, "api", n=4, rate=10):
        pass


def test_a_slot_on_a_django_connection_refuses_a_rate():
    """Django's connection may be inside the caller's transaction: no policy is set there."""
    from stage_e_slots.django._session import SessionSlotConnection

    with pytest.raises(TypeError, match="transaction of its own"), \
            SessionSlotConnection("default").slot(4, cap="api", rate=Rate(1, 1)):
        pass
