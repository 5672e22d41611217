"""Rate policies on caps (0.10.0, issue 37): stage_e_rate_limit(cap, count, per, burst) and
stage_e_rate_limit_off(cap), on a cluster of their own, pg_locks the independent observer.
Every acquisition of a rate-limited cap is granted only when a slot is free and the rate
allows, and charges both or neither (a refused rate takes no slot, a full cap charges no
rate); a prefix policy ('tenant:*') gives each cap under it a rate of its own and a cap's own
policy wins; k slots charge k; leases too; a waiter the rate holds back is served at the
instant the rate allows, keeping its turn; the policies are transactional, restricted and
durable (a restart and a crash keep them, from the counter rows)."""

import threading
import time

import pytest
from conftest import cap_locks, one
from pgcluster import Cluster
from psycopg import errors

DB = "ratepol"


@pytest.fixture(scope="module")
def pc():
    c = Cluster("rate_policies", {"stage_e_slots.flush_interval": "'1h'"}).init().start()
    c.create_database(DB)
    yield c
    c.destroy()


@pytest.fixture
def admin(pc):
    with pc.connect(DB, "admin") as a:
        yield a


def limit(conn, cap, count, per, burst=1):
    conn.execute("SELECT stage_e_rate_limit(%s, %s, %s::interval, %s)", (cap, count, per, burst))


def take(conn, cap, n, wait=None):
    if wait is None:
        return one(conn, "SELECT stage_e_try_slot(%s, %s)", (cap, n))
    return one(conn, "SELECT stage_e_try_slot(%s, %s, %s::interval)", (cap, n, wait))


def release(conn, cap, slot):
    assert one(conn, "SELECT stage_e_release(%s, %s)", (cap, slot)) is True


def test_slots_are_granted_only_while_the_rate_allows_and_a_refusal_takes_no_slot(pc, admin):
    """2 a minute in bursts of 2 on a cap of 4: two slots, then NULL with two slots free;
    pg_locks shows the two and no third; the throttled call is counted."""
    limit(admin, "api", 2, "1 min", 2)
    with pc.connect(DB, "w") as w:
        assert [take(w, "api", 4) for _ in range(3)] == [0, 1, None]
        assert [s for s, _ in cap_locks(admin, "api")] == [0, 1]
        assert admin.execute("SELECT throttled, rate_limited FROM stage_e_stats() "
                             "WHERE cap = 'api'").fetchone() == (1, 1)
        release(w, "api", 0)
        assert take(w, "api", 4) is None, "a release gives no rate back"
        assert [s for s, _ in cap_locks(admin, "api")] == [1]


def test_a_full_cap_charges_no_rate(pc, admin):
    """A cap of 1, 1 a minute in bursts of 3: while its slot is held, other calls are refused
    and charge nothing, so the burst serves exactly three acquisitions in all."""
    limit(admin, "full", 1, "1 min", 3)
    with pc.connect(DB, "a") as a, pc.connect(DB, "b") as b:
        got = 0
        for _ in range(3):
            slot = take(a, "full", 1)
            assert slot == 0
            got += 1
            for _ in range(5):
                assert take(b, "full", 1) is None  # the cap is full: no rate charged
            release(a, "full", slot)
        assert got == 3
        assert take(b, "full", 1) is None, "the burst is spent: 3 acquisitions in all"
        assert cap_locks(admin, "full") == []
        # 16 refusals; the rate refused the 6 made once the burst was spent (the last round's
        # 5, the cap full as well, and the last call), the full cap the 10 before.
        assert admin.execute("SELECT throttled, rate_limited FROM stage_e_stats() "
                             "WHERE cap = 'full'").fetchone() == (16, 6)


def test_k_slots_charge_k_and_more_than_the_burst_is_refused(pc, admin):
    limit(admin, "batch", 1, "1 min", 3)
    with pc.connect(DB, "w") as w:
        assert one(w, "SELECT stage_e_try_slots('batch', 8, 2)") == [0, 1]
        assert one(w, "SELECT stage_e_try_slots('batch', 8, 2)") is None, "1 left of 3"
        assert [s for s, _ in cap_locks(admin, "batch")] == [0, 1]
        assert take(w, "batch", 8) == 2
        with pytest.raises(errors.InvalidParameterValue) as e:
            w.execute("SELECT stage_e_try_slots('batch', 8, 4)")
        assert "could never be allowed" in e.value.diag.message_detail


def test_a_prefix_policy_gives_each_cap_its_own_rate_and_a_caps_own_policy_wins(pc, admin):
    limit(admin, "tenant:*", 1, "1 min", 1)
    limit(admin, "tenant:vip", 1000, "1 s", 1000)
    with pc.connect(DB, "w") as w:
        for cap in ("tenant:1", "tenant:2"):
            slot = take(w, cap, 4)
            assert slot == 0
            release(w, cap, slot)
            assert take(w, cap, 4) is None, f"{cap}: its own rate, 1 a minute"
        for _ in range(20):
            slot = take(w, "tenant:vip", 4)
            assert slot == 0
            release(w, "tenant:vip", slot)
        for _ in range(5):  # no policy: not limited
            release(w, "other", take(w, "other", 4))


def test_policies_are_transactional(pc, admin):
    """A rolled-back transaction, or savepoint, sets nothing; a committed one applies at its
    commit, not before (another session is not limited until then); off gives the cap back."""
    with pc.connect(DB, "w") as w:
        admin.execute("BEGIN")
        limit(admin, "tx", 1, "1 min")
        admin.execute("ROLLBACK")
        for _ in range(3):
            release(w, "tx", take(w, "tx", 4))
        admin.execute("BEGIN")
        admin.execute("SAVEPOINT s")
        limit(admin, "tx", 1, "1 min")
        admin.execute("ROLLBACK TO SAVEPOINT s")
        admin.execute("COMMIT")
        for _ in range(3):
            release(w, "tx", take(w, "tx", 4))
        admin.execute("BEGIN")
        limit(admin, "tx", 1, "1 min")
        for _ in range(3):  # not yet committed: not yet limited
            release(w, "tx", take(w, "tx", 4))
        admin.execute("COMMIT")
        release(w, "tx", take(w, "tx", 4))
        assert take(w, "tx", 4) is None
        assert admin.execute("SELECT rate_count, rate_per, rate_burst FROM "
                             "stage_e_throttle_counter WHERE cap = 'tx'").fetchone()[0] == 1
        admin.execute("SELECT stage_e_rate_limit_off('tx')")
        for _ in range(3):
            release(w, "tx", take(w, "tx", 4))
        assert admin.execute("SELECT rate_count FROM stage_e_throttle_counter "
                             "WHERE cap = 'tx'").fetchone()[0] is None


BAD = [
    ("NULL, 1, '1 s', 1", "22004"),
    ("'c', NULL, '1 s', 1", "22004"),
    ("'c', 1, NULL, 1", "22004"),
    ("'c', 1, '1 s', NULL", "22004"),
    ("'c', 0, '1 s', 1", "22023"),
    ("'c', 1, '0', 1", "22023"),
    ("'c', 1, '2 days', 1", "22023"),
    ("'c', 1, '1 s', 0", "22023"),
    ("'', 1, '1 s', 1", "22023"),
]


@pytest.mark.parametrize("args,state", BAD)
def test_bad_input_is_class_22_and_sets_nothing(pc, admin, args, state):
    with pytest.raises(errors.Error) as e:
        admin.execute(f"SELECT stage_e_rate_limit({args})")
    assert e.value.sqlstate == state
    assert one(admin, "SELECT count(*) FROM stage_e_throttle_counter WHERE cap = 'c'") == 0


def test_restricted_to_superusers_and_the_owner(pc, admin):
    pc.sql("DROP ROLE IF EXISTS rate_plain")
    pc.sql("CREATE ROLE rate_plain LOGIN")
    pc.sql(f'GRANT CONNECT ON DATABASE "{DB}" TO rate_plain')
    with pc.connect(DB, user="rate_plain") as u:
        for call in ("SELECT stage_e_rate_limit('x', 1, '1 s')",
                     "SELECT stage_e_rate_limit('x', 1, '1 s', 2)",
                     "SELECT stage_e_rate_limit_off('api')"):
            with pytest.raises(errors.InsufficientPrivilege):
                u.execute(call)
            u.rollback()
    assert one(admin, "SELECT count(*) FROM stage_e_throttle_counter WHERE cap = 'x'") == 0


def test_a_lease_on_a_rate_limited_cap(pc, admin):
    limit(admin, "leased", 1, "1 min", 1)
    with pc.connect(DB, "w") as w:
        lease = "SELECT (stage_e_lease('leased', 4, '1 min')).slot"
        assert [one(w, lease) for _ in range(3)] == [0, None, None]
        assert one(admin, "SELECT count(*) FROM stage_e_slot_holders WHERE cap = 'leased'") == 1


def test_a_waiter_held_by_the_rate_is_served_at_its_instant_and_keeps_its_turn(pc, admin):
    """1 per 400 ms on a cap of 4: after one acquisition, a waiting call is served when the
    rate allows (about 400 ms later: by a timer, not at the next 100 ms recheck, and well
    before its wait ends), and a call that arrives while it waits takes nothing, though slots
    are free and the instant may have come."""
    limit(admin, "w", 1, "400 ms", 1)
    with pc.connect(DB, "a") as a, pc.connect(DB, "b") as b, pc.connect(DB, "c") as c:
        assert take(a, "w", 4) == 0
        result = {}

        def waiter():
            started = time.monotonic()
            result["slot"] = take(b, "w", 4, "5 s")
            result["waited"] = time.monotonic() - started

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.15)
        late = [take(c, "w", 4) for _ in range(20)]  # a later arrival, over the instant
        t.join(timeout=10)
        assert result["slot"] == 1, result
        assert 0.3 < result["waited"] < 0.55, result
        assert all(s is None for s in late[:3]), late
        assert [s for s, _ in cap_locks(admin, "w")][:2] == [0, 1]


def test_the_view_shows_each_policy_and_each_cap_under_a_prefix(pc):
    """stage_e_rate_limits: a cap's own policy with what its rate allows now and when next, a
    prefix policy's pattern and each live cap under it; rate_limited counts the refusals."""
    with pc.connect(DB, "admin") as admin, pc.connect(DB, "w") as w:
        limit(admin, "view:*", 2, "1 min", 2)
        limit(admin, "viewed", 1, "1 min", 1)
        for cap in ("view:1", "view:1", "view:1", "viewed", "viewed"):
            slot = take(w, cap, 4)
            if slot is not None:
                release(w, cap, slot)
        rows = admin.execute(
            "SELECT cap, count, per, burst, remaining, next_at > now() + '20 s', rate_limited "
            "FROM stage_e_rate_limits WHERE cap LIKE 'view%' ORDER BY cap").fetchall()
        per = rows[0][2]
        assert rows == [("view:*", 2, per, 2, None, None, 1),
                        ("view:1", 2, per, 2, 0, True, 1),
                        ("viewed", 1, per, 1, 0, True, 1)], rows
        assert per.total_seconds() == 60


def test_a_restored_dump_keeps_its_policies_in_the_view_and_on_the_caps(pc):
    """pg_dump | psql into a fresh database: the counter rows carry the policies, and the
    view shows them as the database's first statement (before any acquisition loads it: it
    showed none until then), and the caps are held to them. (Before the crash test below: a
    database first loaded after a crash starts its rate-limited caps spent.)"""
    src, dst = pc.create_database("ratepol_src"), pc.create_database("ratepol_dst",
                                                                   extension=False)
    with pc.connect(src, "admin") as a:
        limit(a, "dumped", 1, "1 h", 1)
        limit(a, "dumped:*", 1, "1 h", 1)
    conn = f"-h {pc.base} -p {pc.port} -U postgres"
    out = pc._run("bash", "-o", "pipefail", "-c",
                  f"{pc.bin}/pg_dump {conn} {src} | "
                  f"{pc.bin}/psql -X -q {conn} -1 -v ON_ERROR_STOP=1 -d {dst}", check=False)
    assert out.returncode == 0, out.stderr
    with pc.connect(dst, "w") as w:
        assert w.execute("SELECT cap, count, burst FROM stage_e_rate_limits ORDER BY cap"
                         ).fetchall() == [("dumped", 1, 1), ("dumped:*", 1, 1)]
        for cap in ("dumped", "dumped:1"):
            assert take(w, cap, 4) == 0
            assert take(w, cap, 4) is None, cap
            assert [s for s, _ in cap_locks(w, cap)] == [0]


def rows_policies(conn):
    rates = conn.execute("SELECT cap, count, burst FROM stage_e_rate_limits "
                         "WHERE cap LIKE 'hand%' ORDER BY cap").fetchall()
    adaptive = conn.execute("SELECT cap, min_slots, max_slots FROM stage_e_cap_limits "
                            "WHERE cap LIKE 'hand%' ORDER BY cap").fetchall()
    return rates, adaptive


def test_policies_written_into_the_rows_by_hand_bind_from_their_commit(pc, admin):
    """The counter rows are what a restart loads: a write of their policy columns that is not
    the functions' (a COPY, the owner's UPDATE or DELETE, a TRUNCATE, in a session whose
    session_replication_role is replica too) binds from its commit in every session, as the
    restart would, and is logged; not committed, or rolled back, it changes nothing. The functions' own writes and the flusher's are logged once, as theirs."""
    table = "stage_e_throttle_counter"
    with pc.connect(DB, "w") as w:
        release(w, "hand-first", take(w, "hand-first", 1))  # the database's policies loaded
        with admin.cursor().copy(f"COPY {table} (cap, rate_count, rate_per, rate_burst, "
                                 "adapt_min, adapt_max, adapt_enforce) FROM STDIN") as copy:
            copy.write_row(("hand-rate", 1, "1 h", 1, None, None, None))
            copy.write_row(("hand-adapt", None, None, None, 1, 1, True))
        assert rows_policies(w) == ([("hand-rate", 1, 1)], [("hand-adapt", 1, 1)])
        release(w, "hand-rate", take(w, "hand-rate", 4))
        assert take(w, "hand-rate", 4) is None  # 1 an hour, spent
        assert take(w, "hand-adapt", 4) == 0
        assert take(w, "hand-adapt", 4) is None  # at most 1 of 4
        assert [s for s, _ in cap_locks(admin, "hand-adapt")] == [0]
        admin.execute(f"UPDATE {table} SET adapt_max = 2 WHERE cap = 'hand-adapt'")
        assert rows_policies(w)[1] == [("hand-adapt", 1, 2)]
        admin.execute("BEGIN")
        admin.execute(f"DELETE FROM {table} WHERE cap = 'hand-rate'")
        assert take(w, "hand-rate", 4) is None  # not committed yet
        admin.execute("ROLLBACK")
        assert take(w, "hand-rate", 4) is None  # rolled back: still 1 an hour
        admin.execute(f"UPDATE {table} SET rate_count = NULL, rate_per = NULL, "
                      "rate_burst = NULL WHERE cap = 'hand-rate'")
        assert rows_policies(w)[0] == []
        assert take(w, "hand-rate", 4) == 0  # no rate policy: the slot is free
        admin.execute("SET session_replication_role = replica")  # a bulk load's
        admin.execute(f"UPDATE {table} SET rate_count = 2, rate_per = '1 h', rate_burst = 1 "
                      "WHERE cap = 'hand-rate'")
        admin.execute("RESET session_replication_role")
        assert rows_policies(w)[0] == [("hand-rate", 2, 1)]
        admin.execute(f"UPDATE {table} SET rate_count = NULL, rate_per = NULL, "
                      "rate_burst = NULL WHERE cap = 'hand-rate'")
        admin.execute("SELECT stage_e_rate_limit('hand-own', 5, '1 h', 5)")
        admin.execute("SELECT stage_e_flush()")
        admin.execute(f"TRUNCATE {table}")
        assert rows_policies(w) == ([], [])
        assert take(w, "hand-adapt", 4) == 1  # at most 4 again (slot 0 is still held)
        release(w, "hand-rate", 0)
    log, ops = pc.log_text(), ("INSERT", "UPDATE", "DELETE", "TRUNCATE")
    wrote = {op: log.count(f'of database "{DB}" ({op}), not through') for op in ops}
    # The COPY's two policies and the four UPDATEs; not the rolled-back DELETE, nor the INSERTs
    # of stage_e_rate_limit and of the flush. The TRUNCATE ends every policy of the database
    # (the earlier tests' too), each in a line of its own.
    assert wrote["INSERT"] == 2 and wrote["UPDATE"] == 4 and wrote["DELETE"] == 0, wrote
    assert log.count(f'of database "{DB}" (TRUNCATE), not through stage_e_adapt_off: cap '
                     '"hand-adapt" is adaptive no more') == 1
    assert log.count(f'of database "{DB}" (TRUNCATE), not through stage_e_rate_limit_off: cap '
                     '"hand-own" has no rate policy') == 1
    assert log.count('limited cap "hand-own" of database') == 1


def test_a_write_by_hand_changes_the_policies_of_its_own_rows_only(pc, admin):
    """A hand edit in a REPEATABLE READ transaction whose snapshot predates another session's
    committed policy (shared memory has it, the snapshot's rows do not) leaves that policy as
    it is: the rows are read with the latest snapshot, and only the rows the transaction wrote
    or deleted are its to change. A hand edit in a rolled-back savepoint changes nothing."""
    limit(admin, "hand-mine", 1, "1 h", 1)
    with pc.connect(DB, "other") as other, pc.connect(DB, "w") as w:
        admin.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        assert rows_policies(admin)[0] == [("hand-mine", 1, 1)]  # the snapshot
        limit(other, "hand-theirs", 1, "1 h", 1)
        admin.execute("UPDATE stage_e_throttle_counter SET rate_burst = 2 "
                      "WHERE cap = 'hand-mine'")
        admin.execute("COMMIT")
        assert rows_policies(w)[0] == [("hand-mine", 1, 2), ("hand-theirs", 1, 1)]
        release(w, "hand-theirs", take(w, "hand-theirs", 4))
        assert take(w, "hand-theirs", 4) is None  # still 1 an hour
        admin.execute("BEGIN")
        admin.execute("SAVEPOINT s")
        admin.execute("DELETE FROM stage_e_throttle_counter WHERE cap LIKE 'hand-%'")
        admin.execute("ROLLBACK TO SAVEPOINT s")
        admin.execute("COMMIT")
        assert rows_policies(w)[0] == [("hand-mine", 1, 2), ("hand-theirs", 1, 1)]
        assert take(w, "hand-theirs", 4) is None
    for cap in ("hand-mine", "hand-theirs"):
        admin.execute("SELECT stage_e_rate_limit_off(%s)", (cap,))


def test_a_write_by_hand_reads_the_policy_rows_through_indexes(pc, admin):
    """The trigger reads the rows that keep a policy (a partial index) and those of the caps
    that have one (the primary key), never the whole table, whatever its statistics say: a
    restore of one INSERT per row (pg_dump --inserts) stays linear. pg_stat_user_tables counts
    no sequential scan of the table across such INSERTs, with and without policies."""
    limit(admin, "hand-indexed", 1, "1 h", 1)

    def scans():
        admin.execute("SELECT pg_stat_force_next_flush()")
        admin.execute("SELECT pg_stat_clear_snapshot()")
        return admin.execute("SELECT seq_scan, idx_scan FROM pg_stat_user_tables "
                             "WHERE relname = 'stage_e_throttle_counter'").fetchone()

    seq, idx = scans()
    for i in range(5):
        admin.execute("INSERT INTO stage_e_throttle_counter (cap, acquired) VALUES (%s, 1)",
                      (f"hand-row{i}",))
    admin.execute("INSERT INTO stage_e_throttle_counter (cap, rate_count, rate_per, rate_burst) "
                  "VALUES ('hand-row-rated', 2, '1 h', 1)")
    after = scans()
    assert after[0] == seq, "a sequential scan of the counter table"
    assert after[1] >= idx + 12  # two index scans a statement at least
    assert rows_policies(admin)[0][1] == ("hand-row-rated", 2, 1)
    for cap in ("hand-indexed", "hand-row-rated"):
        admin.execute("SELECT stage_e_rate_limit_off(%s)", (cap,))


def test_a_row_edited_past_its_check_into_no_rate_is_refused_and_changes_nothing(pc, admin):
    """With the table's CHECK dropped (a superuser may), a row that is not a valid rate is
    refused with class 22, the statement rolled back and the policy kept."""
    limit(admin, "hand-bad", 1, "1 h", 1)
    admin.execute("BEGIN")
    admin.execute("ALTER TABLE stage_e_throttle_counter "
                  "DROP CONSTRAINT stage_e_throttle_counter_rate")
    with pytest.raises(errors.InvalidParameterValue) as err:
        admin.execute("UPDATE stage_e_throttle_counter SET rate_count = 0 "
                      "WHERE cap = 'hand-bad'")
    admin.execute("ROLLBACK")
    assert 'row "hand-bad" of stage_e_throttle_counter is not a valid rate' in str(err.value)
    assert err.value.diag.message_hint.startswith("Set rate policies with stage_e_rate_limit")
    assert rows_policies(admin)[0] == [("hand-bad", 1, 1)]
    admin.execute("SELECT stage_e_rate_limit_off('hand-bad')")


def test_the_policy_triggers_fire_only_on_the_extensions_own_tables(pc, admin):
    """A role may copy a policy table's shape, but may not attach the extension's trigger
    functions to its copy (no EXECUTE); a superuser who does gets 39P01 at its first write:
    the write is rolled back, no policy binds and no line says a policy table was written."""
    pc.sql("DROP ROLE IF EXISTS rate_copier")
    pc.sql("CREATE ROLE rate_copier LOGIN")
    pc.sql(f'GRANT CONNECT ON DATABASE "{DB}" TO rate_copier', DB)
    pc.sql("GRANT CREATE ON SCHEMA public TO rate_copier", DB)
    pairs = (("counter_copy", "stage_e_throttle_counter", "stage_e_throttle_counter_written"),
             ("share_copy", "stage_e_share_policy", "stage_e_share_policy_written"))
    with pc.connect(DB, user="rate_copier") as u:
        for copy, table, function in pairs:
            u.execute(f"CREATE TABLE {copy} (LIKE {table} INCLUDING DEFAULTS)")
            with pytest.raises(errors.InsufficientPrivilege):
                u.execute(f"CREATE TRIGGER steer AFTER INSERT ON {copy} "
                          f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()")
    logged = pc.log_text().count("wrote stage_e_share_policy")
    for copy, table, function in pairs:
        admin.execute(f"CREATE TRIGGER steer AFTER INSERT ON {copy} "
                      f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()")
    with pytest.raises(errors.TriggerProtocolViolated) as err:
        admin.execute("INSERT INTO counter_copy (cap, rate_count, rate_per, rate_burst) "
                      "VALUES ('copied', 1, '1 h', 1)")
    assert err.value.diag.message_primary == ("stage_e_throttle_counter_written() fires only on the "
                              "extension's table stage_e_throttle_counter")
    with pytest.raises(errors.TriggerProtocolViolated):
        admin.execute("INSERT INTO share_copy (cap, share, weight) VALUES ('copied', 'a', 3)")
    assert one(admin, "SELECT count(*) FROM counter_copy") == 0
    assert one(admin, "SELECT count(*) FROM stage_e_rate_limits WHERE cap = 'copied'") == 0
    with pc.connect(DB, "w") as w:
        assert [take(w, "copied", 4) for _ in range(3)] == [0, 1, 2], "no rate binds"
    assert pc.log_text().count("wrote stage_e_share_policy") == logged
    for copy, _, _ in pairs:
        admin.execute(f"DROP TABLE {copy}")


def test_a_write_by_hand_sees_every_row_whatever_the_writer_may_see(pc):
    """The owner lets a role write the rows of its own caps only (row-level security, and
    SELECT revoked from PUBLIC): its UPDATE of its own cap's rate binds, and leaves the
    policies of the rows it cannot see as they are (read as the writer, they looked gone and
    were turned off at its commit)."""
    db = pc.create_database("ratepol_rls")
    pc.sql("DROP ROLE IF EXISTS team_a")
    pc.sql("CREATE ROLE team_a LOGIN")
    with pc.connect(db, "admin") as a:
        a.execute("SELECT stage_e_rate_limit('hand-a', 1, '1 h', 1)")
        a.execute("SELECT stage_e_rate_limit('hand-b', 1, '1 h', 1)")
        a.execute("SELECT stage_e_adapt('hand-b', 1, 2)")
        a.execute("ALTER TABLE stage_e_throttle_counter ENABLE ROW LEVEL SECURITY")
        a.execute("CREATE POLICY own ON stage_e_throttle_counter TO team_a "
                  "USING (cap LIKE 'hand-a%')")
        a.execute("REVOKE SELECT ON stage_e_throttle_counter FROM PUBLIC")
        a.execute("GRANT SELECT, UPDATE ON stage_e_throttle_counter TO team_a")
        with pc.connect(db, "team", user="team_a") as t:
            t.execute("UPDATE stage_e_throttle_counter SET rate_count = 2 WHERE cap = 'hand-a'")
        assert rows_policies(a) == ([("hand-a", 2, 1), ("hand-b", 1, 1)], [("hand-b", 1, 2)])
        with pc.connect(db, "w") as w:
            release(w, "hand-b", take(w, "hand-b", 4))
            assert take(w, "hand-b", 4) is None  # still 1 an hour
    pc.sql(f'DROP DATABASE "{db}" WITH (FORCE)')
    pc.sql("DROP ROLE team_a")


def test_a_session_writes_by_hand_across_the_extension_dropped_and_made_again(pc):
    """The trigger keeps its query's plan for the session's life: after DROP EXTENSION and
    CREATE EXTENSION in the same session (a new table, new indexes), its next write by hand
    reads the new table, and its policy binds; made again in another schema, and after DISCARD
    ALL, too."""
    db = pc.create_database("ratepol_again")
    with pc.connect(db, "admin") as a, pc.connect(db, "w") as w:
        release(w, "warm", take(w, "warm", 1))  # the database's policies loaded
        table = "stage_e_throttle_counter"
        a.execute(f"INSERT INTO {table} (cap, rate_count, rate_per, rate_burst) "
                  "VALUES ('hand-before', 1, '1 h', 1)")  # the plan, kept
        assert rows_policies(w)[0] == [("hand-before", 1, 1)]
        a.execute("DISCARD ALL")  # a pooler's reset: every cached plan invalidated
        a.execute(f"UPDATE {table} SET rate_count = 2 WHERE cap = 'hand-before'")
        assert rows_policies(w)[0] == [("hand-before", 2, 1)]
        a.execute("DROP EXTENSION stage_e_slots")
        a.execute("CREATE EXTENSION stage_e_slots")
        assert rows_policies(w)[0] == []
        a.execute(f"INSERT INTO {table} (cap, rate_count, rate_per, rate_burst) "
                  "VALUES ('hand-after', 1, '1 h', 1)")
        assert rows_policies(w)[0] == [("hand-after", 1, 1)]
        release(w, "hand-after", take(w, "hand-after", 4))
        assert take(w, "hand-after", 4) is None  # 1 an hour, spent
        # Made again in another schema: the query names it, so it is another plan.
        a.execute("DROP EXTENSION stage_e_slots")
        a.execute("CREATE SCHEMA elsewhere")
        a.execute("CREATE EXTENSION stage_e_slots SCHEMA elsewhere")
        for conn in (a, w):
            conn.execute("SET search_path = elsewhere")
        a.execute(f"INSERT INTO {table} (cap, rate_count, rate_per, rate_burst) "
                  "VALUES ('hand-elsewhere', 1, '1 h', 1)")
        assert rows_policies(w)[0] == [("hand-elsewhere", 1, 1)]
        release(w, "hand-elsewhere", take(w, "hand-elsewhere", 4))
        assert take(w, "hand-elsewhere", 4) is None
    pc.sql(f'DROP DATABASE "{db}" WITH (FORCE)')


def test_policies_survive_a_clean_restart_and_a_crash(pc, admin):
    """1 an hour on 'kept' and on every 'kept:...' cap, each spent once: after a clean restart
    (the keys kept exactly) and after a crash (every key starts spent) both are still refused,
    from the policies the rows keep; a cap without a policy is not."""
    limit(admin, "kept", 1, "1 h", 1)
    limit(admin, "kept:*", 1, "1 h", 1)
    with pc.connect(DB, "w") as w:
        for cap in ("kept", "kept:1"):
            release(w, cap, take(w, cap, 4))
    for stop in ("clean", "crash"):
        if stop == "clean":
            pc.stop("fast")
        else:
            pc.crash()
        pc.start()
        with pc.connect(DB, "w") as w:
            assert take(w, "kept", 4) is None, stop
            assert take(w, "kept:1", 4) is None, stop
            assert take(w, "kept:2", 4) is None if stop == "crash" else take(w, "kept:3", 4) == 0
            release(w, "free", take(w, "free", 4))


