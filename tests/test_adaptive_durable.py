"""Adaptive caps (0.9.0) across a server's lifecycle, on a cluster of their own: the policy
and learned limit survive a clean restart and a crash, a limit kept across new bounds is written
and restored, a policy and its limit outlive the cap's reclaim, and max_adaptive_caps full is
53400 and changes nothing. (test_adaptive.py has the controller, enforcement and the calls.)"""

import time
from datetime import timedelta

import pytest
from conftest import one
from pgcluster import Cluster, wait_for
from psycopg import errors
from test_adaptive import (
    Clients,
    Service,
    _adapt_ok,
    _try,
    adapt,
    adapt_off,
    counter_row,
    lease,
    limit_of,
    limit_row,
    limits,
    policy,
    release,
    settle,
    try_slot,
)

# -- persistence: a cluster of its own, restarted and crashed --------------------------------

@pytest.fixture(scope="module")
def pc():
    """Restarted and crashed by its tests; at most 16 caps and 16 adaptive caps."""
    c = Cluster("adaptive_persist", {"stage_e_slots.flush_interval": "'1s'",
                                     "stage_e_slots.max_caps": 16,
                                     "stage_e_slots.max_adaptive_caps": 16}).init().start()
    yield c
    c.destroy()


def flushed_row(cluster, db, cap, hold=2.5, timeout=30):
    """Waits until the adapt columns of the cap's row have not changed for `hold` seconds
    (past two flush intervals); returns them and the live limit."""
    state = {"row": None, "since": None}
    with cluster.connect(db) as s:
        def stable():
            row = counter_row(s, cap)
            if row != state["row"]:
                state.update(row=row, since=time.monotonic())
                return False
            return row is not None and row[3] is not None \
                and time.monotonic() - state["since"] >= hold
        wait_for(stable, timeout=timeout, interval=0.1, what=f"{cap}'s row to be flushed")
        return state["row"], limit_of(s, cap)


def test_a_learned_limit_survives_a_clean_restart_and_a_crash(pc):
    """A limit learned on a service of capacity 3 (bounds [1, 8]) and flushed to the row (the
    last adapt_limit written) comes back after a clean restart and after a crash: same bounds,
    limit = the row's adapt_limit, baseline = its adapt_baseline, reason 'restored: N', and it
    is applied (N slots of n = 16, then NULL)."""
    pc.create_database("learned")
    with pc.connect("learned") as s:
        adapt(s, "learned", 1, 8)
        clients = Clients(pc, "learned", "learned", Service(3), 8)
        try:
            settle(s, "learned", 2, 5, timeout=30, hold=2.0)
        finally:
            clients.stop()
    for restart in ("clean", "crash"):
        row, live = flushed_row(pc, "learned", "learned")
        limit = row[3]
        assert row[:3] == (1, 8, True) and 1 <= limit <= 8
        if live != limit:
            print(f"\n{restart}: the live limit {live} is not the flushed {limit} (see "
                  f"test_a_limit_kept_across_new_bounds_is_written_and_survives_a_restart)")
        assert row[4] is not None and row[4] > timedelta(0), row  # a baseline was learned
        if restart == "clean":
            assert limit >= 2, "the limit never left min_slots: nothing learned to restore"
            pc.stop()
        else:
            pc.crash()
        pc.start()
        with pc.connect("learned") as s:
            after = limit_row(s, "learned")
            assert (after["limit"], after["min_slots"], after["max_slots"], after["enforce"]) \
                == (limit, 1, 8, True), (restart, after)
            assert after["reason"] == f"restored: {limit}", (restart, after)
            assert counter_row(s, "learned") == row
            assert after["baseline_hold"] == row[4]  # the baseline comes back with it
            print(f"\n{restart}: restored {limit}; baseline row {row[4]}, "
                  f"view {after['baseline_hold']}")
            sessions = [pc.connect("learned") for _ in range(limit + 1)]
            try:
                got = [try_slot(x, "learned", 16) for x in sessions]
                assert got == list(range(limit)) + [None], (restart, got)
            finally:
                for x in sessions:
                    x.close()


def test_a_limit_kept_across_new_bounds_is_written_and_survives_a_restart(pc):
    """Pinned at 4 (stage_e_adapt(cap, 4, 4)), then widened to [1, 9]: the live limit stays 4
    (kept, as documented); the cap's row must come to hold 4 as well, so that a clean restart
    resumes at 4, not at min_slots."""
    pc.create_database("clamped")
    with pc.connect("clamped") as s:
        adapt(s, "clamped", 4, 4)
        adapt(s, "clamped", 1, 9)
        assert policy(s, "clamped") == (4, 1, 9, True)
        rows = []
        try:
            wait_for(lambda: rows.append(counter_row(s, "clamped")) or rows[-1][3] == 4,
                     timeout=10, interval=0.2, what="the row to hold the live limit 4")
        except AssertionError:
            pass
    pc.stop()
    pc.start()
    with pc.connect("clamped") as s:
        restored = limit_row(s, "clamped")
    assert (rows[-1][3], restored["limit"], restored["reason"]) == (4, 4, "restored: 4"), (
        f"live limit 4; the row held adapt_limit = {rows[-1][3]} (row {rows[-1]}); after a "
        f"clean restart: {restored}")


def test_a_policy_and_its_limit_outlive_the_caps_reclaim(pc):
    """The cap idle and flushed, 16 other caps in use take every entry (max_caps = 16): the
    cap is reclaimed (gone from stage_e_stats()), its policy and live limit are not; made
    again, it is limited as before (4 of n = 8, leases too)."""
    pc.create_database("reclaim")
    with pc.connect("reclaim") as s:
        adapt(s, "kept", 4, 4)
        adapt(s, "kept", 1, 9)
        assert try_slot(s, "kept", 8) == 0 and release(s, "kept", 0) is True
        s.execute("SELECT stage_e_flush()")
        holder = pc.connect("reclaim")
        try:
            for i in range(16):
                cap = f"other{i}"
                wait_for(lambda cap=cap: _try(holder, cap) == 0, timeout=20, interval=0.1,
                         what=f"room for cap {cap}")
            assert "kept" not in [r[0] for r in s.execute("SELECT cap FROM stage_e_stats()")]
            assert policy(s, "kept") == (4, 1, 9, True)
        finally:
            holder.close()
        sessions = [pc.connect("reclaim") for _ in range(5)]
        try:
            wait_for(lambda: _try(sessions[0], "kept", 8) == 0, timeout=20, interval=0.1,
                     what="room for cap kept again")
            assert [try_slot(x, "kept", 8) for x in sessions[1:]] == [1, 2, 3, None]
            assert lease(s, "kept", 8, "30 s") == (None, None)
            assert policy(s, "kept") == (4, 1, 9, True)
            assert limit_row(s, "kept")["held"] == 4
        finally:
            for x in sessions:
                x.close()


def test_max_adaptive_caps_full_refuses_with_53400_and_changes_nothing(pc):
    """max_adaptive_caps = 16 counts the policies of every database: once 16 caps are
    adaptive, stage_e_adapt of another cap is refused (53400) in any database and nothing
    changes; an existing policy can still be changed; one given back makes room."""
    pc.create_database("many")
    pc.create_database("many2")
    in_use = 0
    for (db,) in pc.sql("SELECT datname FROM pg_database WHERE NOT datistemplate"):
        with pc.connect(db) as s:
            if one(s, "SELECT count(*) FROM pg_extension WHERE extname = 'stage_e_slots'"):
                in_use += len(limits(s))
    assert 0 <= in_use < 16
    with pc.connect("many") as s, pc.connect("many2") as t:
        for i in range(16 - in_use):
            adapt(s, f"ad{i}", 1, 4)
        before = limits(s)
        for conn in (s, t):
            with pytest.raises(errors.ConfigurationLimitExceeded) as err:
                adapt(conn, "one-more", 1, 4)
            d = err.value.diag
            assert d.sqlstate == "53400"
            assert "stage_e_slots.max_adaptive_caps" in " ".join(
                x or "" for x in (d.message_primary, d.message_detail, d.message_hint))
            assert counter_row(conn, "one-more") is None
        assert limits(s) == before and limits(t) == {}
        adapt(s, "ad0", 2, 4)  # its own record: still changeable
        assert policy(s, "ad0") == (2, 2, 4, True)
        adapt_off(s, "ad0")
        wait_for(lambda: _adapt_ok(t, "one-more"), timeout=15, interval=0.2,
                 what="room for an adaptive cap")
        assert policy(t, "one-more") == (1, 1, 4, True)


@pytest.fixture(scope="module")
def race():
    """Two adaptive policy records in all (max_adaptive_caps = 2)."""
    c = Cluster("adaptive_race", {"stage_e_slots.flush_interval": "'1s'",
                                  "stage_e_slots.max_adaptive_caps": 2}).init().start()
    yield c
    c.destroy()


def _rows_and_memory(conn):
    """(caps whose row says adaptive, caps the view shows as adaptive), each sorted."""
    rows = sorted(r[0] for r in conn.execute(
        "SELECT cap FROM stage_e_throttle_counter WHERE adapt_min IS NOT NULL"))
    return rows, sorted(limits(conn))


def test_a_policy_whose_record_was_taken_before_commit_fails_at_commit(race):
    """With one record left, session A calls stage_e_adapt (room at the call) but session B
    takes the last record before A commits: A's COMMIT is refused (53400, the detail naming
    max_adaptive_caps) and rolls its row back; B's policy holds. A policy of a cap that
    already has a record still commits, even with every record taken. The rows and shared
    memory agree throughout, and again after a clean restart (nothing lost a policy)."""
    race.create_database("race")
    with race.connect("race") as s, race.connect("race") as a, race.connect("race") as b:
        adapt(s, "first", 1, 4)
        a.execute("BEGIN")
        adapt(a, "from-a", 1, 4)  # one record left: room at the call
        adapt(b, "from-b", 1, 4)  # autocommit: takes it
        with pytest.raises(errors.ConfigurationLimitExceeded) as err:
            a.execute("COMMIT")
        d = err.value.diag
        assert d.sqlstate == "53400"
        assert "stage_e_slots.max_adaptive_caps" in (d.message_detail or ""), d.message_detail
        assert counter_row(a, "from-a") is None
        assert _rows_and_memory(s) == (["first", "from-b"], ["first", "from-b"])
        # Its own record, every record taken: new bounds still commit.
        a.execute("BEGIN")
        adapt(a, "first", 2, 4)
        a.execute("COMMIT")
        assert policy(s, "first")[1:] == (2, 4, True)
        # Off and on again in one transaction keeps the record it frees.
        a.execute("BEGIN")
        adapt_off(a, "from-b")
        adapt(a, "from-b", 1, 3)
        a.execute("COMMIT")
        assert policy(s, "from-b")[1:] == (1, 3, True)
        # The refused transaction released what it held: a record given back is taken again.
        adapt_off(b, "from-b")
        adapt(a, "from-a", 1, 4)
        assert _rows_and_memory(s) == (["first", "from-a"], ["first", "from-a"])
    race.stop()
    race.start()
    with race.connect("race") as s:
        assert _rows_and_memory(s) == (["first", "from-a"], ["first", "from-a"])
        assert "is not adaptive" not in race.log_text()
