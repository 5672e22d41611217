"""Adaptive caps (0.9.0): the calls that make, change and end a policy. stage_e_adapt called
again keeps the learned limit within the new bounds and clamps it otherwise; bad bounds are
class 22 and change nothing; the calls are transactional (rollback, savepoint; a prepared
transaction may not make them) and restricted (42501, grantable); stage_e_adapt_off gives the
cap back to n alone; policies are per database and end with DROP EXTENSION; max_adaptive_caps
is a postmaster setting. (Split from test_adaptive.py, whose cluster fixture and helpers it
uses: this module gets a cluster of its own.)"""

import psycopg
import pytest
from conftest import one
from pgcluster import wait_for
from psycopg import errors
from test_adaptive import (
    ac,
    aconnect,
    adapt,
    adapt_off,
    adb,
    counter_row,
    lease,
    limit_row,
    limits,
    policy,
    try_slot,
)

# The fixtures, imported for pytest to find them here: this module's own cluster.
__all__ = ["ac", "aconnect", "adb"]


# -- bounds, input, transactions, privileges -------------------------------------------------

def test_calling_adapt_again_changes_bounds_and_keeps_the_learned_limit_clamped(aconnect):
    """A second stage_e_adapt keeps the learned limit when it is within the new bounds, and
    clamps it otherwise; the reason says so."""
    c = aconnect()
    adapt(c, "again", 3, 3)
    row = limit_row(c, "again")
    assert (row["limit"], row["reason"]) == (3, "started at min_slots: 3")
    adapt(c, "again", 1, 8)
    assert policy(c, "again") == (3, 1, 8, True)
    adapt(c, "again", 5, 8)
    row = limit_row(c, "again")
    assert (row["limit"], row["min_slots"], row["reason"]) == (5, 5, "bounds changed: 3 -> 5")
    adapt(c, "again", 1, 2)
    row = limit_row(c, "again")
    assert (row["limit"], row["max_slots"], row["reason"]) == (2, 2, "bounds changed: 5 -> 2")
    adapt(c, "again", 1, 2, False)
    assert policy(c, "again") == (2, 1, 2, False)


def test_bad_bounds_are_class_22_and_change_nothing(aconnect):
    """min < 1, max < min, max > stage_e_slots.max_slots, NULLs and a bad name are refused with
    a class-22 SQLSTATE; the view, the counter row and the enforcement are as before, and a cap
    without a policy gets none. max = stage_e_slots.max_slots itself is accepted."""
    c, observer = aconnect(), aconnect("observer")
    top = int(one(c, "SHOW stage_e_slots.max_slots"))
    adapt(c, "bounded", 2, 6)
    assert counter_row(observer, "bounded")[:3] == (2, 6, True)
    assert try_slot(c, "bounded", 8) == 0
    before, before_row = limits(observer), counter_row(observer, "bounded")
    bad = [(0, 4), (-1, 4), (5, 4), (1, top + 1), (top + 1, top + 1), (None, 4), (4, None),
           (-2147483648, 2147483647)]
    for cap in ["bounded", "untouched"]:
        for lo, hi in bad:
            with pytest.raises(psycopg.Error) as err:
                adapt(c, cap, lo, hi)
            assert err.value.diag.sqlstate.startswith("22"), (cap, lo, hi, err.value)
        with pytest.raises(psycopg.Error) as err:
            adapt(c, cap, 2, 4, None)
        assert err.value.diag.sqlstate.startswith("22"), (cap, "enforce NULL", err.value)
    for cap in [None, "", "x" * 64]:
        with pytest.raises(psycopg.Error) as err:
            adapt(c, cap, 1, 4)
        assert err.value.diag.sqlstate.startswith("22"), (cap, err.value)
        with pytest.raises(psycopg.Error) as err:
            adapt_off(c, cap)
        assert err.value.diag.sqlstate.startswith("22"), (cap, err.value)
    assert limits(observer) == before
    # The policy is as it was; its learned limit and baseline are the controller's to move.
    assert counter_row(observer, "bounded")[:3] == before_row[:3]
    assert counter_row(observer, "untouched") is None
    assert [try_slot(c, "bounded", 8) for _ in range(2)] == [1, None]
    adapt(c, "widest", 1, top)
    assert policy(c, "widest") == (1, 1, top, True)


def test_adapt_takes_effect_at_commit_and_a_rollback_or_savepoint_undoes_it(aconnect):
    """Until its transaction commits, stage_e_adapt changes nothing others see or are limited
    by; a rolled-back transaction or savepoint leaves no policy and no row; a committed one
    appears exactly (started at min_slots, no hold times yet). Later changes and
    stage_e_adapt_off are undone the same way; the last call of a committed transaction wins."""
    a, b, observer = aconnect("a"), aconnect("b"), aconnect("observer")
    with a.transaction(force_rollback=True):
        adapt(a, "tx", 3, 3)
        assert limits(observer) == {}
        assert [try_slot(b, "tx", 8) for _ in range(4)] == [0, 1, 2, 3]  # not limited yet
        assert one(b, "SELECT stage_e_release_all()") == 4
    assert limits(observer) == {}
    assert one(observer, "SELECT count(*) FROM stage_e_throttle_counter "
                         "WHERE adapt_min IS NOT NULL") == 0
    with a.transaction(), a.transaction(force_rollback=True):  # a savepoint, rolled back
        adapt(a, "tx", 3, 3)
    assert limits(observer) == {}
    # The inner transaction: a savepoint whose statement fails after the call.
    with a.transaction(), pytest.raises(errors.DivisionByZero), a.transaction():
        adapt(a, "tx", 3, 3)
        a.execute("SELECT 1 / 0")
    assert limits(observer) == {}
    assert [try_slot(b, "tx", 8) for _ in range(4)] == [0, 1, 2, 3]
    assert one(b, "SELECT stage_e_release_all()") == 4

    with a.transaction():
        adapt(a, "tx", 3, 3)
    row = limit_row(observer, "tx")
    assert row is not None and row["changed_at"] is not None
    assert {k: v for k, v in row.items() if k != "changed_at"} == {
        "cap": "tx", "limit": 3, "min_slots": 3, "max_slots": 3, "enforce": True,
        "baseline_hold": None, "recent_hold": None, "held": 0,
        "reason": "started at min_slots: 3"}
    assert counter_row(observer, "tx")[:3] == (3, 3, True)
    assert [try_slot(b, "tx", 8) for _ in range(4)] == [0, 1, 2, None]

    # A change rolled back to its savepoint: the committed bounds stay.
    with a.transaction(), a.transaction(force_rollback=True):
        adapt(a, "tx", 5, 5)
    assert policy(observer, "tx") == (3, 3, 3, True)
    with a.transaction():
        adapt(a, "tx", 5, 5)
        with a.transaction(force_rollback=True):
            adapt(a, "tx", 2, 2)
        assert try_slot(b, "tx", 8) is None  # still 3 until the commit
    assert policy(observer, "tx") == (5, 5, 5, True)
    assert try_slot(b, "tx", 8) == 3
    # stage_e_adapt_off rolled back: the policy stays, and so does its enforcement.
    with a.transaction(force_rollback=True):
        adapt_off(a, "tx")
    assert policy(observer, "tx") == (5, 5, 5, True)
    assert [try_slot(b, "tx", 8) for _ in range(2)] == [4, None]
    # adapt then adapt_off in one committed transaction: no policy.
    with a.transaction():
        adapt(a, "tx2", 2, 2)
        adapt_off(a, "tx2")
    assert "tx2" not in limits(observer)
    assert [try_slot(b, "tx2", 4) for _ in range(4)] == [0, 1, 2, 3]


def test_adapt_and_adapt_off_are_refused_to_a_plain_role_until_granted(ac, adb, aconnect):
    """A plain LOGIN role gets insufficient_privilege (42501) from stage_e_adapt and
    stage_e_adapt_off and changes nothing. EXECUTE alone is not enough (the policy is written
    to the counter table with the caller's rights: 42501 names the table); with INSERT and
    UPDATE on it too, as the README says, it may call stage_e_adapt."""
    observer = aconnect("observer")
    adapt(observer, "kept", 2, 2)
    ac.sql("DROP ROLE IF EXISTS adapt_plain")
    ac.sql("CREATE ROLE adapt_plain LOGIN")
    try:
        ac.sql(f'GRANT CONNECT ON DATABASE "{adb}" TO adapt_plain')
        before = limits(observer)
        with ac.connect(adb, user="adapt_plain") as u:
            for call, args in [("SELECT stage_e_adapt(%s::text, %s::int, %s::int)",
                                ("plain", 1, 4)),
                               ("SELECT stage_e_adapt(%s::text, %s::int, %s::int, %s::boolean)",
                                ("kept", 1, 4, False)),
                               ("SELECT stage_e_adapt_off(%s::text)", ("kept",))]:
                with pytest.raises(errors.InsufficientPrivilege) as err:
                    u.execute(call, args)
                assert err.value.diag.sqlstate == "42501"
            assert limits(observer) == before
            observer.execute("GRANT EXECUTE ON FUNCTION stage_e_adapt(text, integer, integer, "
                             "boolean) TO adapt_plain")
            with pytest.raises(errors.InsufficientPrivilege) as err:
                adapt(u, "plain", 1, 4)
            assert "stage_e_throttle_counter" in err.value.diag.message_primary
            u.rollback()
            assert limits(observer) == before
            observer.execute("GRANT INSERT, UPDATE ON stage_e_throttle_counter TO adapt_plain")
            adapt(u, "plain", 1, 4)
            assert policy(observer, "plain") == (1, 1, 4, True)
            with pytest.raises(errors.InsufficientPrivilege):
                adapt_off(u, "plain")
            observer.execute("REVOKE EXECUTE ON FUNCTION stage_e_adapt(text, integer, integer, "
                             "boolean) FROM adapt_plain")
    finally:
        ac.sql("REVOKE EXECUTE ON FUNCTION stage_e_adapt(text, integer, integer, boolean) "
               "FROM adapt_plain", dbname=adb)
        ac.sql("REVOKE INSERT, UPDATE ON stage_e_throttle_counter FROM adapt_plain", dbname=adb)
        ac.sql(f'REVOKE CONNECT ON DATABASE "{adb}" FROM adapt_plain')
        ac.sql("DROP ROLE adapt_plain")


def test_adapt_off_gives_the_cap_back_to_n_alone(aconnect):
    """stage_e_adapt_off: at commit the view's row is gone, every acquisition is back to its n,
    and the row's adapt columns are NULL (and stay so after the next flushes)."""
    c, observer = aconnect(), aconnect("observer")
    adapt(c, "off", 2, 2)
    assert counter_row(observer, "off")[:3] == (2, 2, True)
    assert [try_slot(c, "off", 5) for _ in range(3)] == [0, 1, None]
    wait_for(lambda: counter_row(observer, "off")[3] is not None, timeout=15, interval=0.1,
             what="a flush to write the learned limit")
    off_at = one(observer, "SELECT clock_timestamp()")
    adapt_off(c, "off")
    assert "off" not in limits(observer)
    assert counter_row(observer, "off") == (None,) * 5
    assert [try_slot(c, "off", 5) for _ in range(4)] == [2, 3, 4, None]
    assert lease(observer, "off", 6, "30 s")[0] == 5
    # The acquisitions above are pending counts: a flush writes the row after the policy went.
    wait_for(lambda: one(observer, "SELECT flushed_at > %s FROM stage_e_throttle_counter "
                                   "WHERE cap = 'off'", (off_at,)) is True,
             timeout=15, interval=0.1, what="a flush after the policy was turned off")
    assert counter_row(observer, "off") == (None,) * 5
    assert "off" not in limits(observer)


def test_policies_are_per_database(ac, aconnect):
    """A policy applies to the cap of its own database only; another database's cap of the
    same name keeps its n and shows no row."""
    c = aconnect()
    adapt(c, "shared-name", 2, 2)
    other = ac.create_database("a_other_db")
    with ac.connect(other) as o:
        assert limits(o) == {}
        assert [try_slot(o, "shared-name", 4) for _ in range(4)] == [0, 1, 2, 3]
    assert [try_slot(c, "shared-name", 4) for _ in range(3)] == [0, 1, None]
    assert list(limits(c)) == ["shared-name"]


def test_max_adaptive_caps_is_a_postmaster_setting(aconnect):
    """stage_e_slots.max_adaptive_caps: default 64, set at server start only."""
    c = aconnect()
    setting, boot, context = c.execute(
        "SELECT setting, boot_val, context FROM pg_settings "
        "WHERE name = 'stage_e_slots.max_adaptive_caps'").fetchone()
    assert (setting, boot, context) == ("64", "64", "postmaster")
    with pytest.raises(errors.CantChangeRuntimeParam):
        c.execute("SET stage_e_slots.max_adaptive_caps = 100")


def test_a_prepared_transaction_may_not_change_a_policy(aconnect):
    """PREPARE TRANSACTION of a transaction that called stage_e_adapt (or stage_e_adapt_off),
    or wrote a policy into the counter rows by hand, is refused (0A000): the change would have
    to follow a COMMIT PREPARED made later, by any session. The transaction is rolled back, so
    nothing changes."""
    c, observer = aconnect(), aconnect("observer")
    for call in ["SELECT stage_e_adapt('prepared', 1, 4)", "SELECT stage_e_adapt_off('kept')",
                 ("INSERT INTO stage_e_throttle_counter (cap, adapt_min, adapt_max) "
                  "VALUES ('prepared', 1, 4)")]:
        c.execute("BEGIN")
        c.execute(call)
        with pytest.raises(errors.FeatureNotSupported, match="cannot PREPARE a transaction "
                                                             "that changed a stage_e_slots "
                                                             "policy") as err:
            c.execute("PREPARE TRANSACTION 'adapt'")
        assert "wrote the policies of stage_e_throttle_counter" in err.value.diag.message_detail
        assert "prepared" not in limits(observer)
        assert one(observer, "SELECT count(*) FROM pg_prepared_xacts") == 0
    assert counter_row(observer, "prepared") is None


def test_drop_extension_ends_the_databases_policies(ac, aconnect, adb):
    """DROP EXTENSION ends the database's policies with its rows: once made again, the
    extension shows none, and the cap binds with the caller's n alone."""
    c = aconnect()
    adapt(c, "dropped", 2, 2)
    assert [try_slot(c, "dropped", 4) for _ in range(3)] == [0, 1, None]
    c.execute("SELECT stage_e_release_all()")
    c.execute("DROP EXTENSION stage_e_slots")
    c.execute("CREATE EXTENSION stage_e_slots")
    assert limits(c) == {}
    assert [try_slot(c, "dropped", 4) for _ in range(5)] == [0, 1, 2, 3, None]
