"""Durable counters: the background flusher, restarts, crashes, permissions, snapshot."""

import json
import os
import signal
import time

import psycopg
import pytest
from psycopg import errors

from conftest import one, stats
from pgcluster import Cluster, wait_for

INTERVAL_MS = 200
COLS = ["acquired", "throttled", "released", "foreign_releases", "released_by_exit"]


@pytest.fixture(scope="module")
def fc():
    """A cluster flushing every 200 ms."""
    c = Cluster("flush", {"stage_e_slots.flush_interval": f"'{INTERVAL_MS}ms'",
                          "stage_e_slots.max_databases": 64}).init().start()
    yield c
    c.destroy()


def row(conn):
    cur = conn.execute("SELECT * FROM stage_e_throttle_counter")
    rows = cur.fetchall()
    assert len(rows) == 1, rows
    return dict(zip([d.name for d in cur.description], rows[0]))


def totals(conn):
    cur = conn.execute("SELECT * FROM stage_e_throttle_totals")
    return dict(zip([d.name for d in cur.description], cur.fetchone()))


def throttle(conn, times):
    """`times` NULLs from a cap of 1 whose only slot is held by `conn` itself... by another."""
    return conn.execute(
        "SELECT count(*) FILTER (WHERE s IS NULL) FROM "
        "(SELECT stage_e_try_slot(1) AS s FROM generate_series(1, %s)) x", (times,)).fetchone()[0]


def held_cap(c, db):
    """A session holding the only slot of a cap of 1, so that others' tries throttle."""
    holder = c.connect(db, "holder")
    assert one(holder, "SELECT stage_e_try_slot(1)") == 0
    return holder


def test_flushes_within_the_interval_into_exactly_one_row(fc):
    db = fc.create_database("f_interval")
    holder = held_cap(fc, db)
    with fc.connect(db) as c:
        assert throttle(c, 25) == 25
        wait_for(lambda: row(c)["throttled"] == 25, timeout=3, what="the flush")
        r = row(c)
        assert r["acquired"] == 1 and r["flushed_at"] is not None
        assert one(c, "SELECT count(*) FROM stage_e_throttle_counter") == 1
        assert totals(c)["throttled"] == 25 and totals(c)["pending_throttled"] == 0
    holder.close()


def test_one_row_update_per_interval_not_per_event(fc):
    db = fc.create_database("f_deltas")
    holder = held_cap(fc, db)
    with fc.connect(db) as c:
        def updates():
            c.execute("SELECT pg_stat_force_next_flush()")
            return one(c, "SELECT n_tup_upd + n_tup_ins FROM pg_stat_user_tables "
                          "WHERE relname = 'stage_e_throttle_counter'")
        before = updates()
        started = time.monotonic()
        for _ in range(20):
            throttle(c, 500)
        wait_for(lambda: totals(c)["pending_throttled"] == 0, timeout=3, what="the flush")
        elapsed = time.monotonic() - started
        assert row(c)["throttled"] == 10_000
        writes = updates() - before
        # At most one write per interval (plus one for the interval in progress).
        assert 1 <= writes <= elapsed / (INTERVAL_MS / 1000) + 2, (writes, elapsed)
    holder.close()


def test_live_totals_are_exact_before_any_flush(fc):
    fc.sql("ALTER SYSTEM SET stage_e_slots.flush_interval = '1h'")
    fc.sql("SELECT pg_reload_conf()")
    try:
        db = fc.create_database("f_live")
        time.sleep(0.5)  # let the launcher pick up the new interval
        holder = held_cap(fc, db)
        with fc.connect(db) as c:
            assert throttle(c, 7) == 7
            t = totals(c)
            assert (t["throttled"], t["acquired"], t["pending_throttled"]) == (7, 1, 7)
            assert row(c)["throttled"] == 0
            # Reload: the new interval takes effect without a restart.
            fc.sql("ALTER SYSTEM SET stage_e_slots.flush_interval = '200ms'")
            fc.sql("SELECT pg_reload_conf()")
            wait_for(lambda: row(c)["throttled"] == 7, timeout=5, what="a flush after reload")
            assert totals(c)["throttled"] == 7
        holder.close()
    finally:
        fc.sql("ALTER SYSTEM RESET stage_e_slots.flush_interval")
        fc.sql("SELECT pg_reload_conf()")


def test_flush_function_returns_what_it_added_and_reset_zeroes(fc):
    db = fc.create_database("f_manual")
    holder = held_cap(fc, db)
    with fc.connect(db) as c:
        throttle(c, 3)
        wait_for(lambda: totals(c)["pending_throttled"] == 0, timeout=3, what="the flush")
        throttle(c, 4)
        added = c.execute("SELECT * FROM stage_e_flush()").fetchone()
        assert 0 <= added[1] <= 4  # the worker may have flushed some of them first
        assert row(c)["throttled"] == 7 and totals(c)["throttled"] == 7
        assert c.execute("SELECT * FROM stage_e_flush()").fetchone() == (0, 0, 0, 0, 0)
        throttle(c, 5)
        c.execute("SELECT stage_e_reset_stats()")
        r = row(c)
        assert [r[k] for k in COLS] == [0] * 5
        assert totals(c)["throttled"] == 0
        throttle(c, 2)
        assert totals(c)["throttled"] == 2
        # stage_e_stats() still counts since server start.
        assert stats(c)["throttled"] == 14
    holder.close()
    wait_for(lambda: "counters of database \"f_manual\" reset by role \"postgres\"" in
             fc.log_text(), timeout=3, what="the reset LOG line")


def test_a_rolled_back_flush_leaves_the_counts_pending(fc):
    fc.sql("ALTER SYSTEM SET stage_e_slots.flush_interval = '1h'")
    fc.sql("SELECT pg_reload_conf()")
    try:
        db = fc.create_database("f_rollback")
        time.sleep(0.5)
        holder = held_cap(fc, db)
        with fc.connect(db) as c:
            throttle(c, 9)
            with pytest.raises(psycopg.Error):
                with c.transaction():
                    assert c.execute("SELECT throttled FROM stage_e_flush()").fetchone()[0] == 9
                    # Mid-flush, another session's view counts each throttle once.
                    with fc.connect(db) as other:
                        assert totals(other)["throttled"] == 9
                    c.execute("SELECT 1/0")
            assert row(c)["throttled"] == 0
            assert totals(c)["throttled"] == 9
            assert c.execute("SELECT throttled FROM stage_e_flush()").fetchone()[0] == 9
            assert totals(c)["throttled"] == 9 and row(c)["throttled"] == 9
            with pytest.raises(errors.ObjectInUse):
                with c.transaction():
                    c.execute("SELECT stage_e_flush()")
                    c.execute("SELECT stage_e_flush()")
        holder.close()
    finally:
        fc.sql("ALTER SYSTEM RESET stage_e_slots.flush_interval")
        fc.sql("SELECT pg_reload_conf()")


def test_two_databases_keep_separate_totals_and_others_are_untouched(fc):
    a, b = fc.create_database("f_a"), fc.create_database("f_b")
    plain = fc.create_database("f_plain", extension=False)
    ha, hb = held_cap(fc, a), held_cap(fc, b)
    with fc.connect(a) as ca, fc.connect(b) as cb:
        throttle(ca, 11)
        throttle(cb, 4)
        wait_for(lambda: row(ca)["throttled"] == 11 and row(cb)["throttled"] == 4, timeout=3,
                 what="both flushes")
        time.sleep(3 * INTERVAL_MS / 1000)
        assert row(ca)["throttled"] == 11 and row(cb)["throttled"] == 4
    with fc.connect(plain) as cp:
        assert one(cp, "SELECT to_regclass('stage_e_throttle_counter')") is None
        assert one(cp, "SELECT count(*) FROM pg_class WHERE relname LIKE 'stage_e%'") == 0
    ha.close()
    hb.close()


def test_only_superusers_and_the_owner_write_flush_or_reset(fc):
    db = fc.create_database("f_perms")
    fc.sql("DROP ROLE IF EXISTS app_worker")
    fc.sql("CREATE ROLE app_worker LOGIN")
    holder = held_cap(fc, db)
    with psycopg.connect(fc.conninfo(db).replace("user=postgres", "user=app_worker"),
                         autocommit=True) as c:
        assert one(c, "SELECT stage_e_try_slot(2)") == 1
        throttle(c, 2)
        assert totals(c)["throttled"] == 2
        assert row(c)["throttled"] >= 0
        assert one(c, "SELECT held FROM stage_e_stats()") == 2
        assert isinstance(one(c, "SELECT stage_e_snapshot()"), dict)
        for sql in ["UPDATE stage_e_throttle_counter SET throttled = 0",
                    "DELETE FROM stage_e_throttle_counter",
                    "INSERT INTO stage_e_throttle_counter DEFAULT VALUES",
                    "SELECT stage_e_flush()", "SELECT stage_e_reset_stats()"]:
            with pytest.raises(errors.InsufficientPrivilege):
                c.execute(sql)
    holder.close()


def test_worker_survives_a_locked_table_and_a_recreated_extension(fc):
    db = fc.create_database("f_survive")
    holder = held_cap(fc, db)
    with fc.connect(db) as c, fc.connect(db, "locker") as locker:
        with locker.transaction():
            locker.execute("LOCK stage_e_throttle_counter IN ACCESS EXCLUSIVE MODE")
            throttle(c, 6)
            time.sleep(2.5)  # a few intervals: each flush times out on the lock
        wait_for(lambda: row(c)["throttled"] == 6, timeout=5, what="a flush after the lock")
        assert totals(c)["throttled"] == 6
        assert "lock timeout" in fc.log_text()
        holder.close()
        c.execute("DROP EXTENSION stage_e_slots")
        c.execute("CREATE EXTENSION stage_e_slots")
        holder = held_cap(fc, db)
        throttle(c, 3)
        wait_for(lambda: row(c)["throttled"] == 3, timeout=5, what="a flush into the new table")
    holder.close()
    with fc.connect() as p:
        assert one(p, "SELECT count(*) FROM pg_stat_activity "
                      "WHERE backend_type = 'stage_e_slots launcher'") == 1


def test_snapshot_is_a_monitoring_document(fc):
    db = fc.create_database("f_snapshot")
    holder = held_cap(fc, db)
    with fc.connect(db) as c:
        throttle(c, 5)
        snap = one(c, "SELECT stage_e_snapshot()")
        assert snap["database"] == db
        assert snap["config"] == {"max_slots": 1024, "lock_key": 20260725,
                                  "max_databases": 64, "flush_interval_ms": INTERVAL_MS}
        assert snap["totals"]["throttled"] == 5
        assert snap["flushed"]["throttled"] + snap["pending"]["throttled"] == 5
        assert snap["held"] == 1
        assert snap["holders"][0]["slot"] == 0
        assert snap["holders"][0]["pid"] == holder.info.backend_pid
        assert snap["holders"][0]["application_name"] == "holder"
        assert set(snap) == {"database", "config", "totals", "flushed", "flushed_at", "pending",
                             "held", "holders"}
    holder.close()


# -- restarts and crashes: each on a cluster of its own --------------------------------------

def _restart_cluster(name, interval):
    c = Cluster(name, {"stage_e_slots.flush_interval": f"'{interval}'"}).init().start()
    c.create_database("app")
    return c


@pytest.mark.parametrize("mode", ["fast", "smart"])
def test_clean_restart_loses_nothing(mode):
    c = _restart_cluster(f"restart_{mode}", "1h")  # nothing flushed by the clock
    try:
        holder = held_cap(c, "app")
        with c.connect("app") as s:
            throttle(s, 1234)
            holder.close()  # counted in released_by_exit, like any exit while holding
            wait_for(lambda: stats(s)["held"] == 0, what="the holder's exit")
            before = totals(s)
        assert before["throttled"] == 1234 and before["pending_throttled"] == 1234
        assert before["released_by_exit"] == 1
        c.stop(mode)
        assert "saved pending counters of 1 database(s)" in c.log_text()
        c.start()
        with c.connect("app") as s:
            after = totals(s)
            assert {k: after[k] for k in COLS} == {k: before[k] for k in COLS}
            # The launcher's first round after start writes them into the table.
            wait_for(lambda: row(s)["throttled"] == 1234, timeout=5, what="the carried flush")
            assert totals(s)["throttled"] == 1234
    finally:
        c.destroy()


def test_crash_loses_at_most_one_interval():
    c = _restart_cluster("crash", "500ms")
    try:
        holder = held_cap(c, "app")
        with c.connect("app") as s:
            throttle(s, 100)
            wait_for(lambda: row(s)["throttled"] == 100, timeout=5, what="a flush")
            throttle(s, 40)  # within the current interval: may be lost
            victim = c.connect("app", "victim")
            os.kill(victim.info.backend_pid, signal.SIGKILL)
        wait_for(lambda: "all server processes terminated; reinitializing" in c.log_text(),
                 timeout=10, what="crash recovery")

        def recovered():
            try:
                with c.connect("app") as s:
                    return totals(s)
            except psycopg.OperationalError:
                return None
        after = wait_for(recovered, timeout=30, what="the server after recovery")
        assert 100 <= after["throttled"] <= 140
        assert 140 - after["throttled"] <= 40, "lost more than the last interval's counts"
    finally:
        c.destroy()


def test_flush_and_reset_in_a_database_without_activity(fc):
    db = fc.create_database("f_idle")
    with fc.connect(db) as c:
        assert c.execute("SELECT * FROM stage_e_flush()").fetchone() == (0, 0, 0, 0, 0)
        c.execute("SELECT stage_e_reset_stats()")
        assert [row(c)[k] for k in COLS] == [0] * 5
        assert totals(c)["throttled"] == 0
