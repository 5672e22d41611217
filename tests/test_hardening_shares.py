"""One database (or one session) cannot exhaust what every database shares: per-database shares
of caps, leases and slot memory (`stage_e_slots.database_share`), a bound on the session slots
one session holds (`stage_e_slots.max_session_slots`), the leases of a dropped database and of
a dropped extension freed, and no call in one database waiting on another's cap."""

import threading
import time
from pathlib import Path

import psycopg
import pytest
from conftest import one
from pgcluster import Cluster, wait_for
from psycopg import errors

MAX_CAPS = 32
MAX_LEASES = 16
SHARE = 25  # percent: 8 caps, 4 leases, 128 kB of slot memory per database
SESSION_SLOTS = 100


@pytest.fixture(scope="module")
def sc():
    c = Cluster("shares", {
        "stage_e_slots.max_caps": MAX_CAPS,
        "stage_e_slots.max_leases": MAX_LEASES,
        "stage_e_slots.slot_memory": "'512kB'",
        "stage_e_slots.database_share": SHARE,
        "stage_e_slots.max_session_slots": SESSION_SLOTS,
        "stage_e_slots.flush_interval": "'200ms'",
    }).init().start()
    c.sql("CREATE ROLE mallory LOGIN")  # CONNECT only: no privilege beyond PUBLIC's
    for db in ("attacker", "victim"):
        c.create_database(db)
    yield c
    c.destroy()


def connect(c, db, user="postgres"):
    return c.connect(db, user=user)


def hold_caps(conn, prefix, count, n=1):
    """Takes one session slot on each of `count` fresh caps; returns how many were had before
    the first refusal, and the refusal (or None)."""
    for i in range(count):
        try:
            assert one(conn, "SELECT stage_e_try_slot(%s, %s)", (f"{prefix}{i}", n)) == 0
        except psycopg.Error as e:
            return i, e
    return count, None


def test_one_database_holds_at_most_its_share_of_caps(sc):
    """The issue's attack: a CONNECT-only role fills max_caps from one database, and every other
    database is refused new caps. With a share of 25%, it gets 8 of 32; the victim still gets
    caps."""
    mallory = connect(sc, "attacker", "mallory")
    had, refusal = hold_caps(mallory, "sq", MAX_CAPS)
    assert had == MAX_CAPS * SHARE // 100, (had, refusal)
    assert isinstance(refusal, errors.ConfigurationLimitExceeded)
    assert "holds its share of the caps" in refusal.diag.message_primary
    assert "database_share is 25%" in refusal.diag.message_detail
    victim = connect(sc, "victim")
    got, refusal = hold_caps(victim, "v", 4)
    assert (got, refusal) == (4, None)
    victim.close()
    mallory.close()  # its slots go: the caps become idle, and reclaimable


def test_a_database_makes_room_in_its_share_from_its_own_idle_caps(sc):
    """At its share, a database's own idle caps are reclaimed for its new ones: the share limits
    what it holds, not how many names it uses over time."""
    conn = connect(sc, "attacker")
    for i in range(3 * MAX_CAPS):
        assert one(conn, "SELECT stage_e_try_slot(%s, 1)", (f"churn{i}",)) == 0
        assert one(conn, "SELECT stage_e_release(%s, 0)", (f"churn{i}",)) is True
    conn.close()


def test_one_database_holds_at_most_its_share_of_leases(sc):
    """4,096 leases from one database used to refuse every other database's leases (53400)."""
    mallory = connect(sc, "attacker", "mallory")
    taken = []
    with pytest.raises(errors.ConfigurationLimitExceeded) as refused:
        for i in range(MAX_LEASES):
            taken.append(mallory.execute(
                "SELECT slot, token FROM stage_e_lease(%s, 1, '10 min')", (f"l{i}",)).fetchone())
    assert len(taken) == MAX_LEASES * SHARE // 100
    assert "holds its share of the lease records" in refused.value.diag.message_primary
    victim = connect(sc, "victim")
    for i in range(MAX_LEASES * SHARE // 100):
        assert victim.execute("SELECT slot FROM stage_e_lease(%s, 1, '10 min')",
                              (f"vl{i}",)).fetchone()[0] == 0
    # What the attacker gives back, it may take again.
    cap, (slot, token) = "l0", taken[0]
    assert one(mallory, "SELECT stage_e_release_lease(%s, %s, %s)", (cap, slot, token)) is True
    assert mallory.execute("SELECT slot FROM stage_e_lease('l_again', 1, '10 min')"
                           ).fetchone()[0] == 0
    for i, (slot, token) in enumerate(taken[1:], 1):
        one(mallory, "SELECT stage_e_release_lease(%s, %s, %s)", (f"l{i}", slot, token))
    mallory.execute("SELECT stage_e_release_lease('l_again', 0, token) "
                    "FROM stage_e_slot_holders WHERE cap = 'l_again'")
    for i in range(MAX_LEASES * SHARE // 100):
        victim.execute("SELECT stage_e_release_lease(cap, slot, token) "
                       "FROM stage_e_slot_holders WHERE cap = %s", (f"vl{i}",))
    victim.close()
    mallory.close()


def test_one_database_holds_at_most_its_share_of_slot_memory(sc):
    """64 leases of n = 1024 filled slot_memory for everyone. A cap of n = 1024 takes 32 kB; a
    25% share of 512 kB is 128 kB: four of them, and the victim still gets its own."""
    mallory = connect(sc, "attacker", "mallory")
    had, refusal = hold_caps(mallory, "big", 8, n=1024)
    assert had == 4, (had, refusal)
    assert isinstance(refusal, errors.ConfigurationLimitExceeded)
    assert "holds its share of the slot memory" in refusal.diag.message_primary
    victim = connect(sc, "victim")
    got, refusal = hold_caps(victim, "vbig", 2, n=1024)
    assert (got, refusal) == (2, None)
    victim.close()
    mallory.close()


def test_a_superuser_may_give_one_database_more(sc):
    """The share is a superuser's setting, also per database (as a connection limit is)."""
    sc.sql("ALTER DATABASE victim SET stage_e_slots.database_share = 75")
    victim = connect(sc, "victim")
    got, refusal = hold_caps(victim, "wide", MAX_CAPS * 3 // 4 + 1)
    assert got == MAX_CAPS * 3 // 4 and refusal is not None, (got, refusal)
    victim.close()
    sc.sql("ALTER DATABASE victim RESET stage_e_slots.database_share")
    mallory = connect(sc, "attacker", "mallory")
    with pytest.raises(errors.InsufficientPrivilege):
        mallory.execute("SET stage_e_slots.database_share = 100")
    with pytest.raises(errors.InsufficientPrivilege):
        mallory.execute("SET stage_e_slots.max_session_slots = 100000")
    mallory.close()


def test_one_statement_cannot_fill_the_lock_table(sc):
    """`stage_e_try_slot('lk' || (i / 1000), 1000)` over 60,000 rows took about 9,000 slots and
    filled the shared lock table for every database. A session now holds at most
    max_session_slots; the lock manager (pg_locks) is the observer."""
    mallory = connect(sc, "attacker", "mallory")
    with pytest.raises(errors.ConfigurationLimitExceeded) as refused:
        mallory.execute("SELECT count(stage_e_try_slot('lk' || (i / 50), 50)) "
                        "FROM generate_series(0, 999) AS i")
    assert f"may hold at most {SESSION_SLOTS}" in refused.value.diag.message_primary
    pid = mallory.info.backend_pid
    assert one(mallory, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                        "AND pid = %s", (pid,)) == SESSION_SLOTS
    # k at once counts whole: nothing of it is taken.
    assert one(mallory, "SELECT stage_e_release('lk0', 0)") is True
    with pytest.raises(errors.ConfigurationLimitExceeded):
        mallory.execute("SELECT stage_e_try_slots('many', 8, 2)")
    assert one(mallory, "SELECT stage_e_try_slot('one_more', 8)") == 0
    assert one(mallory, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                        "AND pid = %s", (pid,)) == SESSION_SLOTS
    assert one(mallory, "SELECT stage_e_release_all()") == SESSION_SLOTS
    mallory.close()


# -- dropped databases and extensions ----------------------------------------------------------

@pytest.fixture(scope="module")
def dc():
    """Every database may use all of each pool: what a dropped database held must come back."""
    c = Cluster("dropped", {
        "stage_e_slots.max_leases": MAX_LEASES,
        "stage_e_slots.flush_interval": "'200ms'",
    }).init().start()
    yield c
    c.destroy()


def test_a_session_holds_at_most_1024_session_slots_by_default(dc):
    """The README's default of stage_e_slots.max_session_slots (this cluster leaves it unset):
    1,024 session slots held, the next one is 53400 naming the setting and takes nothing; the
    lock manager is the observer."""
    dc.create_database("default_slots")
    s = connect(dc, "default_slots")
    assert one(s, "SHOW stage_e_slots.max_session_slots") == "1024"
    assert one(s, "SELECT count(stage_e_try_slot('d' || (i / 64), 64)) "
                  "FROM generate_series(0, 1023) AS i") == 1024
    pid = s.info.backend_pid
    held = ("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s", (pid,))
    assert one(s, *held) == 1024
    with pytest.raises(errors.ConfigurationLimitExceeded) as refused:
        s.execute("SELECT stage_e_try_slot('one_more', 8)")
    assert "may hold at most 1024" in refused.value.diag.message_primary
    assert "stage_e_slots.max_session_slots" in str(refused.value.diag.message_primary) + str(
        refused.value.diag.message_detail) + str(refused.value.diag.message_hint)
    assert one(s, *held) == 1024
    assert one(s, "SELECT stage_e_release_all()") == 1024
    s.close()


def test_a_dropped_databases_leases_are_freed(dc):
    """`DROP DATABASE` of a database holding leases left them pinned until their TTL: here every
    lease record, so that every other database got 53400 for a day."""
    dc.create_database("doomed")
    dc.create_database("other")
    doomed = connect(dc, "doomed")
    for i in range(MAX_LEASES):
        doomed.execute("SELECT * FROM stage_e_lease(%s, 1, '1 day')", (f"d{i}",))
    other = connect(dc, "other")
    with pytest.raises(errors.ConfigurationLimitExceeded):
        other.execute("SELECT * FROM stage_e_lease('o', 1, '1 min')")
    doomed.close()
    dc.sql("DROP DATABASE doomed")
    wait_for(lambda: "freed 1 lease of cap \"d0\" of dropped database" in dc.log_text(),
             timeout=30, what="the launcher to free the dropped database's leases")

    def leases_again():
        try:
            other.execute("SELECT * FROM stage_e_lease('o', 1, '1 min')")
            return True
        except errors.ConfigurationLimitExceeded:
            return False
    wait_for(leases_again, timeout=30, what="a lease record to be free again")
    for i in range(1, MAX_LEASES):
        other.execute("SELECT * FROM stage_e_lease(%s, 1, '1 min')", (f"o{i}",))
    other.execute("SELECT stage_e_release_lease(cap, slot, token) FROM stage_e_slot_holders")
    other.close()


def counter_row(conn, cap):
    return conn.execute("SELECT acquired, throttled FROM stage_e_throttle_counter WHERE cap = %s",
                        (cap,)).fetchone()


@pytest.fixture(scope="module")
def ec():
    """Flushes counters only when asked (an hour's interval): counts stay pending."""
    c = Cluster("dropext", {"stage_e_slots.flush_interval": "'1h'"}).init().start()
    c.create_database("ext")
    yield c
    c.destroy()


def test_drop_extension_ends_its_caps(ec):
    """DROP EXTENSION then CREATE EXTENSION within a flush interval carried old pending counts
    into the new table, and leases survived the drop. Now the drop's commit frees the leases and
    drops the pending counts (with a LOG line); a drop rolled back changes nothing."""
    conn = connect(ec, "ext")
    token = conn.execute("SELECT token FROM stage_e_lease('dx', 1, '1 day')").fetchone()[0]
    holder = connect(ec, "ext")
    assert one(holder, "SELECT stage_e_try_slot('dx_s', 1)") == 0
    for _ in range(7):
        assert one(conn, "SELECT stage_e_try_slot('dx_s', 1)") is None
    assert one(conn, "SELECT throttled FROM stage_e_stats() WHERE cap = 'dx_s'") == 7

    # Rolled back (also in a subtransaction): the lease and the counts are all still there.
    conn.execute("BEGIN")
    conn.execute("DROP EXTENSION stage_e_slots")
    conn.execute("ROLLBACK")
    conn.execute("BEGIN")
    conn.execute("SAVEPOINT s")
    conn.execute("DROP EXTENSION stage_e_slots")
    conn.execute("ROLLBACK TO SAVEPOINT s")
    conn.execute("COMMIT")
    assert one(conn, "SELECT token FROM stage_e_slot_holders WHERE cap = 'dx'") == token
    assert one(conn, "SELECT throttled FROM stage_e_stats() WHERE cap = 'dx_s'") == 7
    assert "the extension was dropped from database" not in ec.log_text()

    # Committed (from a released savepoint), then made again at once.
    conn.execute("BEGIN")
    conn.execute("SAVEPOINT s")
    conn.execute("DROP EXTENSION stage_e_slots")
    conn.execute("RELEASE SAVEPOINT s")
    conn.execute("COMMIT")
    conn.execute("CREATE EXTENSION stage_e_slots")
    wait_for(lambda: "the extension was dropped from database" in ec.log_text(), timeout=10,
             what="the drop's LOG line")
    assert "freed 1 lease(s) and dropped the pending counters of 2 cap(s)" in ec.log_text()
    # The lease is gone: its slot is free for another.
    assert conn.execute("SELECT slot FROM stage_e_lease('dx', 1, '1 min')").fetchone()[0] == 0
    assert one(conn, "SELECT token FROM stage_e_slot_holders WHERE cap = 'dx'") != token
    # No old count reaches the new table.
    conn.execute("SELECT stage_e_flush()")
    row = counter_row(conn, "dx_s")
    assert row is None or row == (0, 0), row
    # The session slot stays its session's (a lock-manager lock): taken, for the new cap too.
    assert one(conn, "SELECT stage_e_try_slot('dx_s', 1)") is None
    holder.close()
    wait_for(lambda: one(conn, "SELECT stage_e_try_slot('dx_s', 1)") == 0, timeout=10,
             what="the slot to come back when its session ends")
    conn.close()


def cap_stats(conn, cap):
    """(held, acquired, throttled, released, histogram observations) of the cap."""
    return conn.execute(
        "SELECT s.held, s.acquired, s.throttled, s.released, "
        "(SELECT sum(h.seconds_count)::int FROM stage_e_histograms() AS h WHERE h.cap = s.cap) "
        "FROM stage_e_stats() AS s WHERE s.cap = %s", (cap,)).fetchone()


def test_drop_and_create_extension_restarts_its_stats(ec):
    """After DROP EXTENSION and CREATE EXTENSION the table started clean but stage_e_stats()
    kept the old counts. Now the drop's commit restarts the counts and histograms of the
    database's caps at zero, also of a cap whose flush holds its role then (blocked on the
    drop's lock: it restarts them as it gives the role back, and drops its pending counts, which
    reached the new table before). A slot held across the drop stays held and its cap enforced;
    another database's counts stay."""
    ec.create_database("restart")
    ec.create_database("restart_other")
    conn, holder, other = (connect(ec, d) for d in ("restart", "restart", "restart_other"))
    assert one(holder, "SELECT stage_e_try_slot('kept', 1)") == 0
    for _ in range(3):
        assert one(conn, "SELECT stage_e_try_slot('kept', 1)") is None
        for c in (conn, other):
            assert one(c, "SELECT stage_e_release('used', stage_e_try_slot('used', 2))") is True
    assert cap_stats(conn, "kept") == (1, 1, 3, 0, 0)
    assert cap_stats(conn, "used") == (0, 3, 0, 3, 3)
    assert cap_stats(other, "used") == (0, 3, 0, 3, 3)

    conn.execute("DROP EXTENSION stage_e_slots")
    conn.execute("CREATE EXTENSION stage_e_slots")
    assert cap_stats(conn, "kept") == (1, 0, 0, 0, 0)
    assert cap_stats(conn, "used") == (0, 0, 0, 0, 0)
    assert cap_stats(other, "used") == (0, 3, 0, 3, 3), "another database's counts stay"
    # The slot held across the drop is still its session's, and the cap still enforced.
    assert one(conn, "SELECT stage_e_try_slot('kept', 1)") is None
    assert cap_stats(conn, "kept") == (1, 0, 1, 0, 0)
    conn.execute("SELECT stage_e_flush()")
    assert counter_row(conn, "kept") == (0, 1)

    # A flush takes the role of 'kept' (a throttle pending) and waits for the drop's lock on
    # the table; the drop commits with the role taken, and the flush fails.
    assert one(conn, "SELECT stage_e_try_slot('kept', 1)") is None
    conn.execute("BEGIN")
    conn.execute("DROP EXTENSION stage_e_slots")
    flusher = ec.connect("restart", application_name="restart-flusher")
    failed = []

    def flush():
        try:
            flusher.execute("SELECT stage_e_flush()")
        except psycopg.Error as e:
            failed.append(e)

    t = threading.Thread(target=flush)
    t.start()
    wait_for(lambda: one(holder, "SELECT wait_event_type FROM pg_stat_activity "
                                 "WHERE application_name = 'restart-flusher'") == "Lock",
             timeout=10, what="the flush to wait for the drop's lock")
    conn.execute("COMMIT")
    t.join(10)
    assert not t.is_alive() and failed, "the flush of a dropped table fails"
    conn.execute("CREATE EXTENSION stage_e_slots")
    assert cap_stats(conn, "kept") == (1, 0, 0, 0, 0)
    conn.execute("SELECT stage_e_flush()")
    assert counter_row(conn, "kept") in (None, (0, 0)), "a count of before the drop"
    assert one(conn, "SELECT stage_e_try_slot('kept', 1)") is None
    assert one(holder, "SELECT stage_e_release('kept', 0)") is True
    assert cap_stats(conn, "kept")[:4] == (0, 0, 1, 1)
    for c in (conn, holder, other, flusher):
        c.close()


# -- no call waits on another database's cap ---------------------------------------------------

# x86_64 syscall numbers of a sleep: select, nanosleep, clock_nanosleep, pselect6.
SLEEP_SYSCALLS = {"23", "35", "230", "270"}


def test_growing_a_pinned_cap_does_not_stall_other_databases(dc):
    """A lease waiting for its horizon keeps its cap pinned; growing that cap waits for the pin.
    That wait held the directory lock, so a fresh session's first call in *another* database
    stalled until the grow gave up. Now the other database's call returns while the grow still
    waits: an order of events, not a time."""
    dc.create_database("pinned")
    dc.create_database("elsewhere")
    # Both databases loaded first: a load, too, waits for the launcher, which the lock blocks.
    for db in ("pinned", "elsewhere"):
        with connect(dc, db) as warm:
            assert one(warm, "SELECT stage_e_try_slot('warm', 1)") == 0
    blocker = connect(dc, "pinned")
    blocker.execute("BEGIN")
    blocker.execute("LOCK TABLE stage_e_lease_horizon IN ACCESS EXCLUSIVE MODE")
    results = {}

    def run(name, query):
        conn = dc.connect("pinned", application_name=name)
        try:
            results[name] = conn.execute(query).fetchone()
        except psycopg.Error as e:
            results[name] = e
        finally:
            results[name + "_done"] = time.monotonic()
            conn.close()

    observer = connect(dc, "pinned")  # outside the blocker's transaction (and its snapshot)

    def active(name):
        return one(observer, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                            "AND state = 'active'", (name,)) == 1

    def start_waiting(name, query):
        """Runs `query` in a thread and returns it once the call is seen waiting."""
        thread = threading.Thread(target=run, args=(name, query))
        thread.start()
        wait_for(lambda: active(name) or results.get(name + "_done"), timeout=10,
                 what=f"the {name} to wait")
        assert name + "_done" not in results, results
        return thread

    def launcher_blocked():
        """The launcher waits for the blocker's lock: the lease asked it for a horizon and now
        waits for room, its cap pinned."""
        return one(observer, "SELECT count(*) FROM pg_locks WHERE NOT granted "
                             "AND relation = 'stage_e_lease_horizon'::regclass") >= 1

    def napping(name):
        """The call sleeps in the server (pg_usleep, which shows no wait event: select on 15,
        nanosleep on 16+), three looks in a row: the grow waiting for the lease's pin."""
        pid = one(observer, "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
                            "AND state = 'active'", (name,))
        if pid is None:
            return False
        for _ in range(3):
            try:
                call = Path(f"/proc/{pid}/syscall").read_text().split()[0]
            except OSError:
                return False
            if call not in SLEEP_SYSCALLS:
                return False
            time.sleep(0.005)
        return True

    # A cap's first lease waits for the launcher to commit its horizon: blocked by the lock.
    lease = start_waiting("leaser", "SELECT slot FROM stage_e_lease('grown', 1, '1 min')")
    wait_for(launcher_blocked, timeout=10, what="the launcher to block on the horizon's lock")
    # A waiting lease holds no pin of its cap (tests/test_lease_grow.py): the grow does not
    # wait for it at all, and the other database's call waits for nothing either.
    grow = threading.Thread(target=run, args=("grower", "SELECT stage_e_try_slot('grown', 1000)"))
    grow.start()
    grow.join(30)
    assert not grow.is_alive() and results["grower"] == (0,), results
    assert "leaser_done" not in results, "the lease stopped waiting for its horizon"
    other = connect(dc, "elsewhere")
    assert one(other, "SELECT stage_e_try_slot('fresh', 2)") == 0
    blocker.execute("ROLLBACK")
    lease.join(30)
    assert not lease.is_alive()
    other.close()


def test_drop_schema_cascade_ends_the_caps_too(ec):
    """The extension dropped as a dependent object (DROP SCHEMA ... CASCADE) ends its caps the
    same way."""
    ec.create_database("ext_schema", extension=False)
    conn = connect(ec, "ext_schema")
    conn.execute("CREATE SCHEMA s")
    conn.execute("CREATE EXTENSION stage_e_slots SCHEMA s")
    conn.execute("SELECT * FROM s.stage_e_lease('cascade', 1, '1 day')")
    before = ec.log_text().count("the extension was dropped from database")
    conn.execute("DROP SCHEMA s CASCADE")
    wait_for(lambda: ec.log_text().count("the extension was dropped from database") > before,
             timeout=10, what="the drop's LOG line")
    conn.execute("CREATE EXTENSION stage_e_slots")
    assert conn.execute("SELECT slot FROM stage_e_lease('cascade', 1, '1 min')"
                        ).fetchone()[0] == 0
    conn.close()
