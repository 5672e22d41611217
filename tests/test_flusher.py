"""Durable counters: the background flusher, restarts, crashes, permissions, snapshot."""

import os
import re
import signal
import time

import psycopg
import pytest
from conftest import one, stats
from pgcluster import Cluster, wait_for
from psycopg import errors

INTERVAL_MS = 200
COLS = ["acquired", "throttled", "released", "foreign_releases", "released_by_exit"]


@pytest.fixture(scope="module")
def fc():
    """A cluster flushing every 200 ms."""
    c = Cluster("flush", {"stage_e_slots.flush_interval": f"'{INTERVAL_MS}ms'"}).init().start()
    yield c
    c.destroy()


@pytest.fixture(scope="module")
def manual():
    """A cluster whose launcher waits an hour between rounds: only explicit flushes write."""
    c = Cluster("flush_manual", {"stage_e_slots.flush_interval": "'1h'"}).init().start()
    yield c
    c.destroy()


def row(conn, cap="default"):
    """The cap's counter row, or None before its first flush."""
    cur = conn.execute("SELECT * FROM stage_e_throttle_counter WHERE cap = %s", (cap,))
    rows = cur.fetchall()
    assert len(rows) <= 1, rows
    return dict(zip([d.name for d in cur.description], rows[0])) if rows else None


def flushed(conn, col="throttled"):
    r = row(conn)
    return r[col] if r else 0


def totals(conn, cap="default"):
    cur = conn.execute("SELECT * FROM stage_e_throttle_totals WHERE cap = %s", (cap,))
    names = [d.name for d in cur.description]
    r = cur.fetchone()
    return dict(zip(names, r)) if r else dict.fromkeys(names, 0) | {"cap": cap, "flushed_at": None}


def throttle(conn, times):
    """`times` tries of a cap of one whose slot another session holds: all NULL."""
    return conn.execute(
        "SELECT count(*) FILTER (WHERE s IS NULL) FROM "
        "(SELECT stage_e_try_slot(1) AS s FROM generate_series(1, %s)) x", (times,)).fetchone()[0]


def held_cap(c, db):
    """A session holding the only slot of a cap of 1, so that others' tries throttle."""
    holder = c.connect(db, "holder")
    assert one(holder, "SELECT stage_e_try_slot(1)") == 0
    return holder


def new_log(c, since):
    return c.log_text()[since:]


def test_flushes_within_the_interval_into_exactly_one_row(fc):
    db = fc.create_database("f_interval")
    holder = held_cap(fc, db)
    with fc.connect(db) as c:
        assert row(c) is None  # no row until the first flush (see pg_dump in the README)
        assert throttle(c, 25) == 25
        wait_for(lambda: flushed(c) == 25, timeout=3, what="the flush")
        r = row(c)
        assert r["acquired"] == 1 and r["flushed_at"] is not None
        assert totals(c)["throttled"] == 25 and totals(c)["pending_throttled"] == 0
        assert throttle(c, 5) == 5
        wait_for(lambda: flushed(c) == 30, timeout=3, what="the second flush")
        assert one(c, "SELECT count(*) FROM stage_e_throttle_counter") == 1
    holder.close()


def test_one_row_update_per_interval_not_per_event(fc):
    db = fc.create_database("f_deltas")
    holder = held_cap(fc, db)
    with fc.connect(db) as c:
        def writes():
            c.execute("SELECT pg_stat_force_next_flush()")
            return one(c, "SELECT n_tup_upd + n_tup_ins FROM pg_stat_user_tables "
                          "WHERE relname = 'stage_e_throttle_counter'")
        before = writes()
        started = time.monotonic()
        for _ in range(20):
            throttle(c, 500)
        wait_for(lambda: totals(c)["pending_throttled"] == 0, timeout=3, what="the flush")
        elapsed = time.monotonic() - started
        assert flushed(c) == 10_000
        n = writes() - before
        # At most one write per interval (plus one for the interval in progress).
        assert 1 <= n <= elapsed / (INTERVAL_MS / 1000) + 2, (n, elapsed)
    holder.close()


def test_live_totals_are_exact_before_any_flush_and_a_reload_changes_the_interval():
    c = Cluster("flush_reload", {"stage_e_slots.flush_interval": "'1h'"}).init().start()
    try:
        db = c.create_database("app")
        holder = held_cap(c, db)
        with c.connect(db) as s:
            assert throttle(s, 7) == 7
            t = totals(s)
            assert (t["throttled"], t["acquired"], t["pending_throttled"]) == (7, 1, 7)
            assert row(s) is None
            # A reload applies the new interval without a restart.
            c.sql("ALTER SYSTEM SET stage_e_slots.flush_interval = '200ms'")
            c.sql("SELECT pg_reload_conf()")
            wait_for(lambda: flushed(s) == 7, timeout=5, what="a flush after the reload")
            assert totals(s)["throttled"] == 7 and totals(s)["pending_throttled"] == 0
        holder.close()
    finally:
        c.destroy()


def test_flush_returns_exactly_what_it_added_and_reset_zeroes(manual):
    db = manual.create_database("f_manual")
    holder = held_cap(manual, db)
    with manual.connect(db) as c:
        throttle(c, 3)
        assert c.execute("SELECT cap, acquired, throttled, released, foreign_releases, released_by_exit FROM stage_e_flush()").fetchall() == [
            ("default", 1, 3, 0, 0, 0)]
        throttle(c, 4)
        assert c.execute("SELECT cap, acquired, throttled, released, foreign_releases, released_by_exit FROM stage_e_flush()").fetchall() == [
            ("default", 0, 4, 0, 0, 0)]
        assert flushed(c) == 7 and flushed(c, "acquired") == 1 and totals(c)["throttled"] == 7
        # Nothing new: no row is written.
        assert c.execute("SELECT * FROM stage_e_flush()").fetchall() == []
        assert flushed(c) == 7
        throttle(c, 5)
        since = len(manual.log_text())
        c.execute("SELECT stage_e_reset_stats()")
        r = row(c)
        assert [r[k] for k in COLS] == [0] * 5
        assert totals(c)["throttled"] == 0
        throttle(c, 2)
        assert totals(c)["throttled"] == 2
        # stage_e_stats() still counts since server start.
        assert stats(c)["throttled"] == 14
    holder.close()
    wait_for(lambda: 'counters of database "f_manual" reset by role "postgres" (table zeroed, '
                     '5 pending throttles dropped)' in new_log(manual, since),
             timeout=3, what="the reset LOG line")


def test_a_rolled_back_flush_leaves_the_counts_pending(manual):
    db = manual.create_database("f_rollback")
    holder = held_cap(manual, db)
    with manual.connect(db) as c:
        throttle(c, 9)
        with pytest.raises(errors.DivisionByZero), c.transaction():
            assert c.execute("SELECT throttled FROM stage_e_flush()").fetchone()[0] == 9
            # Mid-flush, another session's view counts each throttle once.
            with manual.connect(db) as other:
                assert totals(other)["throttled"] == 9
            c.execute("SELECT 1/0")
        assert row(c) is None
        assert totals(c)["throttled"] == 9
        assert c.execute("SELECT throttled FROM stage_e_flush()").fetchone()[0] == 9
        assert totals(c)["throttled"] == 9 and flushed(c) == 9
        with pytest.raises(errors.ObjectInUse), c.transaction():
            c.execute("SELECT stage_e_flush()")
            c.execute("SELECT stage_e_flush()")
    holder.close()


def test_pending_subtracts_the_flush_the_reader_already_sees(manual):
    """The totals view passes the row's flush_id to stage_e_pending: a reader that already
    sees a flush's row (the flushing transaction itself, or anyone between its commit and the
    pool's acknowledgement) must not count that delta twice."""
    db = manual.create_database("f_flush_id")
    holder = held_cap(manual, db)
    with manual.connect(db) as c:
        throttle(c, 6)
        c.execute("SELECT stage_e_flush()")
        throttle(c, 4)
        with c.transaction():
            before = totals(c)
            assert (before["throttled"], before["pending_throttled"]) == (10, 4)
            assert one(c, "SELECT throttled FROM stage_e_flush()") == 4
            flush_id = one(c, "SELECT flush_id FROM stage_e_throttle_counter")
            # This transaction sees the row with the new delta; the pool has not advanced.
            assert flushed(c) == 10
            assert one(c, "SELECT throttled FROM stage_e_pending(NULL)") == 4
            assert one(c, "SELECT throttled FROM stage_e_pending(%s)", (flush_id,)) == 0
            assert one(c, "SELECT throttled FROM stage_e_pending(%s)", (flush_id - 1,)) == 4
            after = totals(c)
            assert (after["throttled"], after["pending_throttled"]) == (10, 0)
        assert totals(c)["throttled"] == 10
    holder.close()


def test_a_reader_whose_snapshot_predates_a_flush_still_counts_its_delta(manual):
    """Totals are rows plus pending counts, and a flush moves counts from one to the other when
    its transaction commits. A reader whose snapshot was taken before that commit does not see
    the new row, so the delta must still be pending for it (0.4.0 counted it in neither, and a
    statement that straddled a flush's commit came up short). REPEATABLE READ holds the
    snapshot across the other session's flush; a single statement has the same window."""
    db = manual.create_database("f_snapshot")
    holder = held_cap(manual, db)
    with manual.connect(db) as c, manual.connect(db) as flusher:
        throttle(c, 6)
        flusher.execute("SELECT stage_e_flush()")
        throttle(c, 4)
        with c.transaction():
            c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            assert totals(c)["throttled"] == 10  # the snapshot: the row holds 6, 4 pending
            assert one(flusher, "SELECT throttled FROM stage_e_flush()") == 4  # commits
            assert totals(flusher)["throttled"] == 10  # a new snapshot: the row holds 10
            again = totals(c)
            assert (again["throttled"], again["pending_throttled"]) == (10, 4)
            assert flushed(c) == 6  # this snapshot still sees the old row
        # Nothing new since: a later flush round keeps the settled delta for old snapshots.
        assert one(flusher, "SELECT count(*) FROM stage_e_flush()") == 0
        assert totals(c)["throttled"] == 10
        throttle(c, 1)
        assert totals(c)["throttled"] == 11
    holder.close()


def test_two_databases_keep_separate_totals(fc):
    a, b = fc.create_database("f_a"), fc.create_database("f_b")
    ha, hb = held_cap(fc, a), held_cap(fc, b)
    with fc.connect(a) as ca, fc.connect(b) as cb:
        throttle(ca, 11)
        throttle(cb, 4)
        wait_for(lambda: flushed(ca) == 11 and flushed(cb) == 4, timeout=3, what="both flushes")
        # Later rounds find nothing pending and change nothing.
        first = (row(ca)["flushed_at"], row(cb)["flushed_at"])
        throttle(cb, 1)
        wait_for(lambda: flushed(cb) == 5, timeout=3, what="b's next flush")
        assert flushed(ca) == 11 and row(ca)["flushed_at"] == first[0]
    ha.close()
    hb.close()


def test_a_database_whose_extension_was_dropped_gets_nothing_written(fc):
    db = fc.create_database("f_dropped_ext")
    holder = held_cap(fc, db)
    since = len(fc.log_text())
    with fc.connect(db) as c:
        with c.transaction():
            # Counts made while the table is locked (so no flush can write them), then the
            # extension and its table dropped: the counts have nowhere to go.
            c.execute("LOCK stage_e_throttle_counter IN ACCESS EXCLUSIVE MODE")
            throttle(c, 3)
            c.execute("DROP EXTENSION stage_e_slots")
        holder.close()
        wait_for(lambda: re.search(r"dropped pending counters of 1 cap\(s\) of database \d+, "
                                   r"which no longer has the extension", new_log(fc, since)),
                 timeout=5, what="the flusher to drop the orphaned counts")
        assert one(c, "SELECT count(*) FROM pg_class WHERE relname LIKE 'stage_e%'") == 0
        # Re-created, it starts from zero: the orphaned counts did not come back.
        c.execute("CREATE EXTENSION stage_e_slots")
        assert totals(c)["throttled"] == 0
        assert row(c) is None


def test_only_superusers_and_the_owner_write_flush_or_reset(manual):
    db = manual.create_database("f_perms")
    manual.sql("DROP ROLE IF EXISTS app_worker")
    manual.sql("CREATE ROLE app_worker LOGIN")
    holder = held_cap(manual, db)
    with manual.connect(db, user="app_worker") as c:
        assert one(c, "SELECT stage_e_try_slot(2)") == 1
        throttle(c, 2)
        assert totals(c)["throttled"] == 2
        with manual.connect(db) as admin:
            admin.execute("SELECT stage_e_flush()")
        assert flushed(c) == 2 and flushed(c, "acquired") == 2
        assert one(c, "SELECT held FROM stage_e_stats()") == 2
        snap = one(c, "SELECT stage_e_snapshot()")
        assert snap["caps"][0]["flushed"]["throttled"] == 2 and snap["held"] == 2
        for sql in ["UPDATE stage_e_throttle_counter SET throttled = 0",
                    "DELETE FROM stage_e_throttle_counter",
                    "INSERT INTO stage_e_throttle_counter DEFAULT VALUES",
                    "SELECT stage_e_flush()", "SELECT stage_e_reset_stats()"]:
            with pytest.raises(errors.InsufficientPrivilege):
                c.execute(sql)
        assert flushed(c) == 2 and totals(c)["throttled"] == 2
    holder.close()


def test_worker_survives_a_locked_table_and_a_recreated_extension(fc):
    db = fc.create_database("f_survive")
    holder = held_cap(fc, db)
    since = len(fc.log_text())
    with fc.connect(db) as c, fc.connect(db, "locker") as locker:
        throttle(c, 1)
        wait_for(lambda: flushed(c) == 1, timeout=3, what="the first flush")
        with locker.transaction():
            locker.execute("LOCK stage_e_throttle_counter IN ACCESS EXCLUSIVE MODE")
            throttle(c, 6)
            wait_for(lambda: "canceling statement due to lock timeout" in new_log(fc, since),
                     timeout=10, what="a flush to time out on the lock")
            assert one(c, "SELECT throttled FROM stage_e_pending()") == 6
        wait_for(lambda: flushed(c) == 7, timeout=5, what="a flush after the lock")
        assert totals(c)["throttled"] == 7
        holder.close()
        c.execute("DROP EXTENSION stage_e_slots")
        c.execute("CREATE EXTENSION stage_e_slots")
        holder = held_cap(fc, db)
        throttle(c, 3)
        wait_for(lambda: flushed(c) == 3, timeout=5, what="a flush into the new table")
    holder.close()
    with fc.connect() as p:
        assert one(p, "SELECT count(*) FROM pg_stat_activity "
                      "WHERE backend_type = 'stage_e_slots launcher'") == 1


def test_snapshot_is_a_monitoring_document(manual):
    db = manual.create_database("f_snapshot")
    holder = held_cap(manual, db)
    with manual.connect(db) as c:
        throttle(c, 5)
        c.execute("SELECT stage_e_flush()")
        throttle(c, 2)
        assert one(c, "SELECT stage_e_try_slot('exports', 3)") == 0  # a second cap, unflushed
        snap = one(c, "SELECT stage_e_snapshot()")
        assert snap["database"] == db
        assert snap["config"] == {"max_slots": 1024, "lock_key": 20260725, "max_caps": 4096,
                                  "slot_memory_kb": 2048, "max_leases": 4096,
                                  "flush_interval_ms": 3_600_000}
        assert [cap["cap"] for cap in snap["caps"]] == ["default", "exports"]
        d, e = snap["caps"]
        assert d["totals"] == {"acquired": 1, "throttled": 7, "released": 0,
                               "foreign_releases": 0, "released_by_exit": 0, "waits": 0,
                               "wait_timeouts": 0, "wait_time": 0, "hold_time": 0,
                               "expired": 0, "rate_limited": 0}
        assert d["flushed"]["throttled"] == 5 and d["pending"]["throttled"] == 2
        assert d["flushed_at"] == one(c, "SELECT flushed_at::text FROM stage_e_throttle_counter")
        assert (d["key"], d["held"]) == (20260725, 1)
        assert (e["key"], e["held"], e["flushed_at"]) == (
            one(c, "SELECT stage_e_cap_key('exports')"), 1, None)
        assert e["totals"]["acquired"] == 1 and e["flushed"]["acquired"] == 0
        assert snap["held"] == 2
        h = snap["holders"][0]
        assert (h["cap"], h["slot"], h["pid"], h["application_name"], h["state"]) == (
            "default", 0, holder.info.backend_pid, "holder", "idle")
        assert (h["token"], h["expires_at"]) == (None, None)  # a session slot, not a lease
        assert snap["holders"][1]["cap"] == "exports"
        assert snap["memory"]["caps_in_use"] >= 2 and snap["memory"]["max_caps"] == 4096
        assert set(snap) == {"database", "config", "memory", "held", "caps_total", "truncated",
                             "caps", "holders"}
        assert (snap["caps_total"], snap["truncated"]) == (2, False)
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
            wait_for(lambda: stats(s)["released_by_exit"] == 1, what="the holder's exit")
            before = totals(s)
        assert before["throttled"] == 1234 and before["pending_throttled"] == 1234
        c.stop(mode)
        assert "saved pending counters of 1 cap(s)" in c.log_text()
        c.start()
        with c.connect("app") as s:
            # The launcher's first round after start writes them into the table; the totals
            # view is read after it (read while that first flush commits, the view can miss
            # its delta for one statement: a known fault, see the README's Limits).
            wait_for(lambda: flushed(s) == 1234, timeout=5, what="the carried flush")
            after = totals(s)
            assert {k: after[k] for k in COLS} == {k: before[k] for k in COLS}
            assert after["pending_throttled"] == 0
    finally:
        c.destroy()


def test_a_crash_loses_exactly_the_counts_since_the_last_flush():
    c = _restart_cluster("crash", "1h")
    try:
        _holder = held_cap(c, "app")  # kept open, holding the slot the tries throttle on
        with c.connect("app") as s:
            throttle(s, 100)
            s.execute("SELECT stage_e_flush()")
            throttle(s, 40)
            # The state at the kill: 100 in the table, 40 only in shared memory.
            assert (flushed(s), totals(s)["pending_throttled"]) == (100, 40)
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
        # Shared memory was reset: the 40 pending counts are gone, the flushed 100 are not.
        assert (after["throttled"], after["pending_throttled"]) == (100, 0)
        assert not re.search(r"saved pending counters", c.log_text())
    finally:
        c.destroy()


def _expected_acquired(i):
    return i % 3 + 1


def test_counts_that_do_not_fit_a_smaller_max_caps_are_kept_until_they_fit():
    """Issue 21: a pending file of 100 caps restored with max_caps = 16 dropped 84 caps' counts,
    logged as Rust Debug text (`NoEntry { max_caps: 16, held: 16 }`). Now what does not fit is
    written back to the pending file, with a LOG line in words; each start restores what fits
    (a crash in between neither loses nor doubles what was kept), and a start with the larger
    setting brings back the rest: every count reaches the table exactly."""
    caps = 100
    c = Cluster("shrink", {"stage_e_slots.flush_interval": "'1h'",
                           "stage_e_slots.max_caps": 256}).init().start()
    try:
        c.create_database("app")
        with c.connect("app") as s:
            for i in range(caps):
                for _ in range(_expected_acquired(i)):
                    assert one(s, "SELECT stage_e_release(%s, stage_e_try_slot(%s, 1))",
                               (f"c{i}", f"c{i}")) is True
            assert one(s, "SELECT count(*) FROM stage_e_throttle_counter") == 0  # all pending
        c.stop("fast")
        assert f"saved pending counters of {caps} cap(s)" in c.log_text()

        def start_and_flush(max_caps):
            since = len(c.log_text())
            c.settings["stage_e_slots.max_caps"] = max_caps
            c.write_settings()
            c.start()
            with c.connect("app") as s:
                s.execute("SELECT stage_e_flush()")
                return s.execute("SELECT cap, acquired, released FROM stage_e_throttle_counter"
                                 ).fetchall(), c.log_text()[since:]

        rows, log = start_and_flush(16)
        assert len(rows) == 16, rows
        m = re.search(r"kept the saved counts of (\d+) cap\(s\) in pg_stat/stage_e_slots.pending "
                      r"for a later start, because they did not fit in shared memory: all 16 "
                      r"caps \(stage_e_slots.max_caps\) are in use", log)
        assert m and int(m.group(1)) == caps - 16, log
        assert "dropped the saved counts" not in log and "NoEntry" not in log
        # A crash keeps what the file kept: the next start restores 16 more.
        c.crash()
        rows, log = start_and_flush(16)
        assert len(rows) == 32, rows
        assert "kept the saved counts of 68 cap(s)" in log, log
        # A clean shutdown at the small setting merges the kept counts into the file it writes.
        c.stop("fast")
        rows, log = start_and_flush(256)
        assert "kept the saved counts" not in log, log
        assert sorted(rows) == sorted((f"c{i}", _expected_acquired(i), _expected_acquired(i))
                                      for i in range(caps))
        with c.connect("app") as s:
            assert one(s, "SELECT sum(acquired) FROM stage_e_throttle_totals") == sum(
                _expected_acquired(i) for i in range(caps))
        # Every LOG line of ours is in words: no Rust Debug text (`Name { field: ... }`).
        ours = [line for line in c.log_text().splitlines() if "stage_e_slots" in line]
        debug = [line for line in ours if re.search(r"\b[A-Z]\w* \{ \w+: |\w+Error\b", line)]
        assert not debug, debug
    finally:
        c.destroy()
