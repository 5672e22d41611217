"""share= on @capped, stage_e_slot, the connection's try_slot/try_slots and stage_e_lease, sync
and asyncio, against a real cluster (the extension at 0.11.0): each takes its slot in the fair
share it names (stage_e_slot_holders shows it, pg_locks holds it), within the share's ceiling;
@capped takes the share from the call's arguments; bad shares raise before anything is sent."""

import asyncio

import pytest
import stage_e_slots
from conftest import cap_locks  # tests/conftest.py's, re-exported by tests/python's
from stage_e_slots import Throttled, aio, capped, stage_e_lease, stage_e_slot


@pytest.fixture
def dsn(cluster, db, monkeypatch):
    monkeypatch.delenv("STAGE_E_SLOTS_DSN", raising=False)
    conninfo = cluster.conninfo(db, "shares-test")
    yield conninfo
    stage_e_slots.connection_for(conninfo).close()


@pytest.fixture
def admin(connect):
    return connect("share-admin")


def holders(admin, cap):
    return admin.execute("SELECT slot, share FROM stage_e_slot_holders WHERE cap = %s "
                         "ORDER BY slot", (cap,)).fetchall()


def test_stage_e_slot_and_try_slots_take_in_their_share_within_its_ceiling(dsn, admin):
    admin.execute("SELECT stage_e_share('exports', 'tenant:1', 1, 1)")
    with stage_e_slot(dsn, "exports", n=4, share="tenant:1") as slot:
        assert slot == 0
        assert holders(admin, "exports") == [(0, "tenant:1")]
        assert len(cap_locks(admin, "exports")) == 1
        with stage_e_slot(dsn, "exports", n=4, share="tenant:1") as again:
            assert again is None  # at its ceiling of 1
        conn = stage_e_slots.connection_for(dsn)
        assert conn.try_slots(4, 2, cap="exports", share="tenant:2") == [1, 2]
        assert holders(admin, "exports") == [(0, "tenant:1"), (1, "tenant:2"), (2, "tenant:2")]
        for s in (1, 2):
            assert conn.release(s, cap="exports") is True
    assert holders(admin, "exports") == []
    assert admin.execute("SELECT count(*) FROM stage_e_shares").fetchone()[0] == 0


def test_a_lease_takes_in_its_share(dsn, admin):
    with stage_e_lease(dsn, "jobs", 2, ttl=60, share="tenant:1") as lease:
        assert lease is not None
        assert holders(admin, "jobs") == [(lease.slot, "tenant:1")]
    assert holders(admin, "jobs") == []


def test_capped_takes_the_share_from_the_call(dsn, admin):
    admin.execute("SELECT stage_e_share('api', '*', 1, 1)")
    seen = []

    @capped("api", 4, dsn=dsn, share=lambda tenant, inner=False: tenant)
    def call(tenant, inner=False):
        seen.append(holders(admin, "api"))
        if not inner:
            with pytest.raises(Throttled):
                call(tenant, inner=True)  # its share is at its ceiling of 1
        return tenant

    assert call("tenant:7") == "tenant:7"
    assert seen == [[(0, "tenant:7")]]


def test_the_asyncio_api_takes_in_its_share(dsn, admin):
    async def run():
        async with aio.stage_e_slot(dsn, "exports", n=2, share="tenant:3") as slot:
            assert slot == 0
            assert holders(admin, "exports") == [(0, "tenant:3")]
        async with aio.stage_e_lease(dsn, "exports", 2, ttl=60, share="tenant:4") as lease:
            assert holders(admin, "exports") == [(lease.slot, "tenant:4")]

        @capped("exports", 2, dsn=dsn, share="tenant:5")
        async def job():
            return holders(admin, "exports")

        assert await job() == [(0, "tenant:5")]
        await aio.connection_for(dsn).close()

    asyncio.run(run())


def test_bad_shares_raise_before_anything_is_sent(dsn, admin):
    for bad, error in [("", ValueError), ("x" * 64, ValueError), (7, TypeError)]:
        with pytest.raises(error), stage_e_slot(dsn, "exports", n=2, share=bad):
            pass
        with pytest.raises(error):
            capped("exports", 2, dsn=dsn, share=bad)
    assert admin.execute("SELECT count(*) FROM stage_e_slot_holders").fetchone()[0] == 0
