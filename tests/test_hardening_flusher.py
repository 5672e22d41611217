"""The background flusher against a database owner's (or a role's) settings, a database closed
to new connections, and a database whose flush keeps failing (hardening issue 21).

Each database here is owned by `flusher_owner`, a role that is not a superuser: what it may
set for its database (ALTER DATABASE … SET) applies to every session of the database, the
flusher's included, unless the flusher pins its own (`sql::WORKER_SETTINGS`)."""

import re
import subprocess
import time

import psycopg
import pytest
from conftest import one
from pgcluster import PG_CONFIG, Cluster, wait_for

OWNER = "flusher_owner"
MAX_CAPS = 32
_MAJOR = int(re.search(r"(\d+)", subprocess.check_output([PG_CONFIG, "--version"],
                                                          text=True)).group(1))


@pytest.fixture(scope="module")
def fc():
    """Flushes every 200 ms; few caps, so that one database's stuck counts fill them all; a
    database whose flush fails gives up its counts after 1 s (and 3 rounds)."""
    c = Cluster("hflush", {
        "stage_e_slots.flush_interval": "'200ms'",
        "stage_e_slots.max_caps": MAX_CAPS,
        "stage_e_slots.flush_give_up": "'1s'",
    }).init().start()
    c.sql(f"CREATE ROLE {OWNER} LOGIN")
    yield c
    c.destroy()


def owned_database(c, name):
    """A fresh database with the extension (installed by the superuser), owned by OWNER."""
    c.create_database(name)
    c.sql(f'ALTER DATABASE "{name}" OWNER TO {OWNER}')
    return name


def as_owner(c, db, statement):
    with c.connect(db, user=OWNER) as o:
        o.execute(statement)


def counter_row(conn, cap="default"):
    cur = conn.execute("SELECT * FROM stage_e_throttle_counter WHERE cap = %s", (cap,))
    r = cur.fetchone()
    return dict(zip([d.name for d in cur.description], r)) if r else None


def flushed(conn, cap="default"):
    """(acquired, throttled) of the cap's row, (0, 0) before its first flush."""
    r = counter_row(conn, cap)
    return (r["acquired"], r["throttled"]) if r else (0, 0)


def throttle(conn, times):
    """`times` tries of the default cap of one, whose slot another session holds."""
    return one(conn, "SELECT count(*) FILTER (WHERE s IS NULL) FROM "
                     "(SELECT stage_e_try_slot(1) AS s FROM generate_series(1, %s)) x", (times,))


class Sessions:
    """The sessions a test needs, opened before the database's settings change (so that its
    own statements are not bound by them): a holder of the default cap's only slot, a session
    that throttles, and a superuser session to look and to lock rows with."""

    def __init__(self, c, db):
        self.holder = c.connect(db, "holder")
        assert one(self.holder, "SELECT stage_e_try_slot(1)") == 0
        self.worker = c.connect(db, "worker")
        self.su = c.connect(db, "superuser")

    def close(self):
        for s in (self.holder, self.worker, self.su):
            s.close()


def flusher_waiting_on_a_lock(conn, db):
    """The pid of the flusher of `db` while it waits for a lock, else None."""
    return one(conn, "SELECT pid FROM pg_stat_activity WHERE backend_type = "
                     "'stage_e_slots flusher' AND datname = %s AND wait_event_type = 'Lock'",
               (db,))


def with_row_locked(c, s, db, then_commit=True, hold=0.0):
    """Locks the default cap's counter row (an UPDATE that changes nothing counted) until the
    flusher queues behind it, holds it `hold` s longer, then commits (or rolls back). Returns
    the waiting flusher's pid and whether that same process still waited at the end."""
    s.su.execute("BEGIN")
    s.su.execute("UPDATE stage_e_throttle_counter SET flushed_at = flushed_at "
                 "WHERE cap = 'default'")
    try:
        assert throttle(s.worker, 3) == 3
        pid = wait_for(lambda: flusher_waiting_on_a_lock(s.worker, db), timeout=5,
                       interval=0.005, what="the flusher to wait for the row lock")
        time.sleep(hold)
        still = flusher_waiting_on_a_lock(s.worker, db) == pid
    finally:
        s.su.execute("COMMIT" if then_commit else "ROLLBACK")
    return pid, still


def settle(c, s, expect):
    """Waits until the default cap's row reads `expect` (acquired, throttled), exactly."""
    wait_for(lambda: flushed(s.su) == expect, timeout=5, what=f"the flush of {expect}")
    time.sleep(0.5)  # a round or two more: nothing is written twice
    assert flushed(s.su) == expect


# -- settings a database owner or a role can make ---------------------------------------------

# Each runs with counts flushed before and after the change: the exact totals must reach the
# table. (The tests below make the others bite: a row lock, an update, a trigger.)
OWNER_SETTINGS = [
    # The case: every write failed.
    "default_transaction_read_only = on",
    "transaction_read_only = on",
    # Not armed for SPI in a background worker: the flush must simply still succeed.
    "statement_timeout = '1ms'",
    "idle_in_transaction_session_timeout = '1ms'",
    "idle_session_timeout = '1ms'",
]


@pytest.mark.parametrize("setting", OWNER_SETTINGS)
def test_an_owners_setting_does_not_stop_the_flush(fc, setting):
    db = owned_database(fc, "o_" + re.sub(r"[^a-z0-9]+", "_", setting)[:40])
    s = Sessions(fc, db)
    try:
        assert throttle(s.worker, 5) == 5
        settle(fc, s, (1, 5))
        as_owner(fc, db, f'ALTER DATABASE "{db}" SET {setting}')
        assert throttle(s.worker, 7) == 7
        settle(fc, s, (1, 12))
    finally:
        s.close()


def test_a_role_set_for_the_database_is_not_the_flusher_s_role(fc):
    """SET role in the database's settings: even a superuser's session then runs as that role,
    so the flusher, unpinned, would write as the owner (who may not write the extension's
    table) and fail every round."""
    db = owned_database(fc, "o_role")
    s = Sessions(fc, db)
    try:
        assert throttle(s.worker, 4) == 4
        settle(fc, s, (1, 4))
        as_owner(fc, db, f'ALTER DATABASE "{db}" SET role = \'{OWNER}\'')
        with fc.connect(db) as fresh:
            assert one(fresh, "SELECT current_user") == OWNER  # what the setting does
        assert throttle(s.worker, 3) == 3
        settle(fc, s, (1, 7))
    finally:
        s.close()


AUDIT = """
CREATE TABLE public.counter_audit (cap text, throttled bigint);
CREATE FUNCTION public.counter_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO public.counter_audit VALUES (NEW.cap, NEW.throttled);
  RETURN NEW;
END $$;
CREATE TRIGGER audit AFTER INSERT OR UPDATE ON stage_e_throttle_counter
  FOR EACH ROW EXECUTE FUNCTION public.counter_audit();
"""


@pytest.mark.parametrize("how", ["database", "role"])
def test_session_replication_role_replica_does_not_skip_a_trigger_on_the_counter_table(fc, how):
    """A DBA's audit trigger on the counter table sees every flush: `replica` (set for the
    database by an owner granted the parameter, or for the workers' role in this database by a
    superuser) would skip it silently."""
    db = owned_database(fc, f"o_srr_{how}")
    fc.sql(AUDIT, dbname=db)
    s = Sessions(fc, db)
    try:
        assert throttle(s.worker, 2) == 2
        settle(fc, s, (1, 2))
        if how == "database":
            fc.sql(f"GRANT SET ON PARAMETER session_replication_role TO {OWNER}")
            as_owner(fc, db, f'ALTER DATABASE "{db}" SET session_replication_role = replica')
        else:
            fc.sql(f'ALTER ROLE postgres IN DATABASE "{db}" SET session_replication_role = '
                   'replica')
        with fc.connect(db) as fresh:
            assert one(fresh, "SHOW session_replication_role") == "replica"
        assert throttle(s.worker, 3) == 3
        settle(fc, s, (1, 5))
        audited = [r[0] for r in s.su.execute(
            "SELECT throttled FROM public.counter_audit ORDER BY throttled").fetchall()]
        assert audited[-1] == 5, audited
    finally:
        s.close()


def test_lock_timeout_of_1ms_does_not_fail_a_flush_behind_a_row_lock(fc):
    """With the database's 1 ms, a flusher behind a row lock would fail at once, every round,
    while the lock is held: it waits (up to its own 1 s) instead, and adds once it is free."""
    db = owned_database(fc, "o_lock_timeout")
    s = Sessions(fc, db)
    try:
        assert throttle(s.worker, 1) == 1
        settle(fc, s, (1, 1))
        as_owner(fc, db, f'ALTER DATABASE "{db}" SET lock_timeout = \'1ms\'')
        _pid, still = with_row_locked(fc, s, db, hold=0.3)
        assert still, "the flusher stopped waiting for the lock"
        settle(fc, s, (1, 4))
    finally:
        s.close()


def test_serializable_deferrable_default_does_not_fail_a_flush_behind_an_update(fc):
    """Under the database's serializable (deferrable) default, a flusher whose row another
    transaction updated meanwhile fails with a serialization error; at read committed it adds
    to the row as committed."""
    db = owned_database(fc, "o_serializable")
    s = Sessions(fc, db)
    try:
        assert throttle(s.worker, 1) == 1
        settle(fc, s, (1, 1))
        as_owner(fc, db, f'ALTER DATABASE "{db}" SET default_transaction_isolation = '
                         "'serializable'")
        as_owner(fc, db, f'ALTER DATABASE "{db}" SET default_transaction_deferrable = on')
        log_from = len(fc.log_text())
        pid, _ = with_row_locked(fc, s, db, then_commit=True)
        settle(fc, s, (1, 4))
        log = fc.log_text()[log_from:]
        assert "could not serialize access" not in log, log
        # The very flusher that waited is the one that wrote.
        assert not re.search(rf"\[{pid}\] .*(ERROR|FATAL)", log), log
    finally:
        s.close()


@pytest.mark.parametrize("how", ["database", "role"])
def test_transaction_timeout_does_not_end_a_flusher_waiting_for_a_lock(fc, how):
    """transaction_timeout ends the process (FATAL): a flusher queued behind a row lock for
    longer would be killed, every round while the lock lasts. (Before PostgreSQL 17 there is no
    such setting, so no owner or role can set it: checked instead.)"""
    if _MAJOR < 17:
        with pytest.raises(psycopg.errors.UndefinedObject):
            fc.sql("ALTER ROLE postgres SET transaction_timeout = '100ms'")
        return
    db = owned_database(fc, f"o_txn_timeout_{how}")
    s = Sessions(fc, db)
    try:
        assert throttle(s.worker, 1) == 1
        settle(fc, s, (1, 1))
        if how == "database":
            as_owner(fc, db, f'ALTER DATABASE "{db}" SET transaction_timeout = \'100ms\'')
        else:
            fc.sql(f'ALTER ROLE postgres IN DATABASE "{db}" SET transaction_timeout = \'100ms\'')
        log_from = len(fc.log_text())
        _pid, still = with_row_locked(fc, s, db, hold=0.4)
        assert still, "the flusher did not outlive transaction_timeout"
        settle(fc, s, (1, 4))
        assert "transaction timeout" not in fc.log_text()[log_from:]
    finally:
        s.close()


# -- a database closed to new connections ----------------------------------------------------

def test_a_database_closed_to_connections_is_still_flushed(fc):
    """ALTER DATABASE … WITH ALLOW_CONNECTIONS false while sessions made before still use its
    caps: the flusher connects anyway (as autovacuum does), so its counts reach the table and
    its caps stay reclaimable."""
    db = owned_database(fc, "o_closed")
    s = Sessions(fc, db)
    try:
        assert throttle(s.worker, 2) == 2
        settle(fc, s, (1, 2))
        # (From another database: not even its owner may close the database it is in.)
        as_owner(fc, "postgres", f'ALTER DATABASE "{db}" WITH ALLOW_CONNECTIONS false')
        with pytest.raises(Exception, match="not currently accepting connections"):
            fc.connect(db).close()
        log_from = len(fc.log_text())
        assert throttle(s.worker, 6) == 6
        settle(fc, s, (1, 8))
        assert "not currently accepting connections" not in fc.log_text()[log_from:]
    finally:
        s.close()
        fc.sql(f'ALTER DATABASE "{db}" WITH ALLOW_CONNECTIONS true')


# -- a database whose flush keeps failing -----------------------------------------------------

FAILING_TRIGGER = """
CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'counter rows are frozen here'; END $$;
CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON stage_e_throttle_counter
  FOR EACH ROW EXECUTE FUNCTION public.refuse();
"""

DROPPED = re.compile(
    r'dropped (\d+) pending count\(s\) \((\d+) acquired, (\d+) throttled\) of (\d+) cap\(s\) '
    r'of database "(\w+)", because its flush has failed in each of the last (\d+) rounds')


def test_a_database_whose_flush_keeps_failing_gives_up_its_counts_and_its_caps(fc):
    """A trigger raises on every write of the counter table (a superuser's, or anything the
    flusher cannot pin): its caps' counts could never be written, so they were never idle and
    never reclaimed. One churn of max_caps fresh names there filled the directory for every
    database. Now its counts are dropped (one LOG line) and another database's churn of more
    than max_caps names succeeds."""
    bad = owned_database(fc, "o_failing")
    fc.sql(FAILING_TRIGGER, dbname=bad)
    log_from = len(fc.log_text())
    with fc.connect(bad, "churn") as b:
        # Two statements: all of them pending before the first failed round is 1 s old.
        assert one(b, "SELECT count(*) FROM generate_series(0, %s) AS i "
                      "WHERE stage_e_try_slot('stuck' || i, 1) = 0", (MAX_CAPS - 1,)) == MAX_CAPS
        assert one(b, "SELECT count(*) FROM generate_series(0, %s) AS i "
                      "WHERE stage_e_release('stuck' || i, 0)", (MAX_CAPS - 1,)) == MAX_CAPS
    wait_for(lambda: "counter rows are frozen here" in fc.log_text()[log_from:], timeout=5,
             what="a failed flush")
    m = wait_for(lambda: DROPPED.search(fc.log_text()[log_from:]), timeout=15,
                 what="the LOG line dropping the failing database's counts")
    counts, acquired, throttled, caps, name, rounds = m.groups()
    assert (name, int(caps), int(acquired), int(throttled)) == ("o_failing", MAX_CAPS,
                                                               MAX_CAPS, 0)
    assert int(counts) == 2 * MAX_CAPS  # acquired and released, once each
    assert int(rounds) >= 3
    # Its caps are idle now: another database churns through more names than max_caps.
    good = owned_database(fc, "o_churn")
    with fc.connect(good, "churn") as g:
        for i in range(MAX_CAPS + 8):
            assert one(g, "SELECT stage_e_try_slot(%s, 1)", (f"fresh{i}",)) == 0
            assert one(g, "SELECT stage_e_release(%s, 0)", (f"fresh{i}",))
    # One line per database and give-up: the failing database has nothing pending since.
    time.sleep(1.5)
    assert len(DROPPED.findall(fc.log_text()[log_from:])) == 1
    with fc.connect(bad) as b:
        assert one(b, "SELECT count(*) FROM stage_e_throttle_counter") == 0
        assert one(b, "SELECT coalesce(sum(acquired), 0) FROM stage_e_pending()") == 0


def test_counts_saved_at_shutdown_are_retried_once_then_dropped_again():
    """A clean shutdown saves the failing database's pending counts (they are counts like any
    other), the next start restores them and the flusher tries again, for flush_give_up, then
    drops them by the same rule: the file does not bring them back forever."""
    c = Cluster("hflush_restart", {"stage_e_slots.flush_interval": "'200ms'",
                                   "stage_e_slots.flush_give_up": "'1h'"}).init().start()
    try:
        db = c.create_database("stuck")
        c.sql(FAILING_TRIGGER, dbname=db)
        with c.connect(db) as s:
            assert one(s, "SELECT stage_e_try_slot('a', 1)") == 0
            assert one(s, "SELECT stage_e_release('a', 0)")
        wait_for(lambda: "counter rows are frozen here" in c.log_text(), timeout=5,
                 what="a failed flush")
        c.stop()
        assert "saved pending counters of 1 cap(s)" in c.log_text()
        c.settings["stage_e_slots.flush_give_up"] = "'1s'"
        c.write_settings()
        restarted = len(c.log_text())
        c.start()
        m = wait_for(lambda: DROPPED.search(c.log_text()[restarted:]), timeout=15,
                     what="the restored counts to be dropped")
        assert m.group(5, 4, 2) == ("stuck", "1", "1")
        with c.connect(db) as s:
            assert one(s, "SELECT coalesce(sum(acquired), 0) FROM stage_e_pending()") == 0
        again = len(c.log_text())
        c.stop()
        c.start()
        assert "saved pending counters" not in c.log_text()[again:]
    finally:
        c.destroy()
