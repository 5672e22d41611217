"""Attacks by a hostile role and mistakes by a careless operator: search_path and shadowing
objects, dump/restore, savepoints, read-only transactions, database entries, parallel workers,
EXECUTE privileges, a full lock table."""

import re

import psycopg
import pytest
from conftest import KEY, extension_calls, one, slot_lock_holders, stats
from pgcluster import Cluster, bindir, wait_for
from psycopg import errors

COLS = ["acquired", "throttled", "released", "foreign_releases", "released_by_exit"]


@pytest.fixture(scope="module")
def hc():
    """Flushes every 200 ms: the background flusher is part of what is attacked."""
    c = Cluster("hardening", {"stage_e_slots.flush_interval": "'200ms'"}).init().start()
    yield c
    c.destroy()


@pytest.fixture(scope="module")
def mc():
    """Flushes only when asked (the launcher's clock is an hour): manual flush tests."""
    c = Cluster("manual", {"stage_e_slots.flush_interval": "'1h'"}).init().start()
    yield c
    c.destroy()


def counter_rows(conn):
    cur = conn.execute("SELECT * FROM stage_e_throttle_counter ORDER BY cap")
    return [dict(zip([d.name for d in cur.description], r)) for r in cur.fetchall()]


def flushed(conn, col="throttled"):
    rows = counter_rows(conn)
    assert len(rows) <= 1, rows
    return rows[0][col] if rows else 0


def pending(conn, col="throttled"):
    """Pending counts as this transaction sees them (the view passes the row's flush id, so a
    flush made by this very transaction is not pending)."""
    return one(conn, f"SELECT coalesce(sum(p.{col}), 0)::bigint FROM stage_e_pending("
                     "(SELECT max(flush_id) FROM stage_e_throttle_counter)) AS p "
                     "WHERE cap = 'default'")


def totals(conn, cap="default"):
    cur = conn.execute("SELECT * FROM stage_e_throttle_totals WHERE cap = %s", (cap,))
    names = [d.name for d in cur.description]
    r = cur.fetchone()
    return dict(zip(names, r)) if r else dict.fromkeys(names, 0)


def throttle(conn, times):
    return conn.execute(
        "SELECT count(*) FILTER (WHERE s IS NULL) FROM "
        "(SELECT stage_e_try_slot(1) AS s FROM generate_series(1, %s)) x", (times,)).fetchone()[0]


def hold_cap_of_one(c, db):
    holder = c.connect(db, "holder")
    assert one(holder, "SELECT stage_e_try_slot(1)") == 0
    return holder


# -- search_path and shadowing objects -------------------------------------------------------

# A database owner (not a superuser) plants operators and functions that a careless statement
# would resolve to, each recording its caller and making its owner a superuser when the caller
# is one. The exploit is the `+`; the others cover every other lookup our SQL makes.
EVIL = r"""
CREATE SCHEMA evil;
CREATE TABLE evil.calls (what text, by_superuser boolean);
CREATE FUNCTION evil.trap(what text) RETURNS void LANGUAGE plpgsql AS $$
DECLARE su boolean := (SELECT rolsuper FROM pg_catalog.pg_roles
                        WHERE rolname OPERATOR(pg_catalog.=) current_user);
BEGIN
  INSERT INTO evil.calls VALUES (what, su);
  IF su THEN EXECUTE 'ALTER ROLE dbown SUPERUSER'; END IF;
END $$;
CREATE FUNCTION evil.add(a bigint, b bigint) RETURNS bigint LANGUAGE plpgsql AS $$
BEGIN PERFORM evil.trap('bigint +'); RETURN a OPERATOR(pg_catalog.+) b; END $$;
CREATE OPERATOR evil.+ (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = evil.add);
CREATE FUNCTION evil.eq_oid(a oid, b oid) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN PERFORM evil.trap('oid ='); RETURN a OPERATOR(pg_catalog.=) b; END $$;
CREATE OPERATOR evil.= (LEFTARG = oid, RIGHTARG = oid, FUNCTION = evil.eq_oid);
CREATE FUNCTION evil.eq_name(a name, b name) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN PERFORM evil.trap('name ='); RETURN a OPERATOR(pg_catalog.=) b; END $$;
CREATE OPERATOR evil.= (LEFTARG = name, RIGHTARG = name, FUNCTION = evil.eq_name);
CREATE FUNCTION evil.eq_name_text(a name, b text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN PERFORM evil.trap('name = text'); RETURN a OPERATOR(pg_catalog.=) b; END $$;
CREATE OPERATOR evil.= (LEFTARG = name, RIGHTARG = text, FUNCTION = evil.eq_name_text);
CREATE FUNCTION evil.eq_int(a integer, b integer) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN PERFORM evil.trap('int ='); RETURN a OPERATOR(pg_catalog.=) b; END $$;
CREATE OPERATOR evil.= (LEFTARG = integer, RIGHTARG = integer, FUNCTION = evil.eq_int);
CREATE FUNCTION evil.minus(a timestamptz, b timestamptz) RETURNS interval LANGUAGE plpgsql AS $$
BEGIN PERFORM evil.trap('timestamptz -'); RETURN a OPERATOR(pg_catalog.-) b; END $$;
CREATE OPERATOR evil.- (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = evil.minus);
CREATE FUNCTION evil.now() RETURNS timestamptz LANGUAGE plpgsql AS $$
BEGIN PERFORM evil.trap('now()'); RETURN pg_catalog.now(); END $$;
CREATE FUNCTION evil.quote_ident(t text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN PERFORM evil.trap('quote_ident()'); RETURN pg_catalog.quote_ident(t); END $$;
CREATE FUNCTION evil.set_config(a text, b text, c boolean) RETURNS text LANGUAGE plpgsql AS $$
BEGIN PERFORM evil.trap('set_config()'); RETURN pg_catalog.set_config(a, b, c); END $$;
CREATE TABLE evil.stage_e_throttle_counter (LIKE public.stage_e_throttle_counter);
CREATE TABLE evil.pg_extension (LIKE pg_catalog.pg_extension);
"""


@pytest.fixture
def owned_db(hc):
    """Database `ownd`, owned by the non-superuser `dbown`, with the extension installed by a
    superuser and the planted objects first in the database's search_path."""
    hc.sql("DROP DATABASE IF EXISTS ownd WITH (FORCE)")
    hc.sql("DROP ROLE IF EXISTS dbown")
    hc.sql("CREATE ROLE dbown LOGIN")
    hc.sql("CREATE DATABASE ownd OWNER dbown")
    hc.sql("CREATE EXTENSION stage_e_slots", dbname="ownd")
    with hc.connect("ownd", user="dbown") as c:
        c.execute(EVIL)
        c.execute("ALTER DATABASE ownd SET search_path = evil, pg_catalog, public")
    yield "ownd"
    hc.sql("DROP DATABASE IF EXISTS ownd WITH (FORCE)")
    hc.sql("DROP ROLE IF EXISTS dbown")


def assert_not_escalated(hc):
    with hc.connect("ownd") as c:
        assert one(c, "SELECT count(*) FROM evil.calls") == 0, \
            c.execute("SELECT * FROM evil.calls").fetchall()
    assert hc.sql("SELECT rolsuper FROM pg_roles WHERE rolname = 'dbown'") == [(False,)]


def test_a_database_owner_cannot_escalate_through_the_background_flusher(hc, owned_db):
    with hc.connect(owned_db, user="dbown") as owner, hc.connect(owned_db, user="dbown") as o2:
        assert one(owner, "SHOW search_path") == "evil, pg_catalog, public"
        assert one(owner, "SELECT stage_e_try_slot(1)") == 0
        assert one(o2, "SELECT stage_e_try_slot(1)") is None
        # Two flushes: the first inserts the row, the second adds to it (the `+`).
        wait_for(lambda: one(o2, "SELECT throttled FROM public.stage_e_throttle_counter") == 1,
                 timeout=5, what="the first flush")
        assert one(o2, "SELECT stage_e_try_slot(1)") is None
        wait_for(lambda: one(o2, "SELECT throttled FROM public.stage_e_throttle_counter") == 2,
                 timeout=5, what="the second flush")
    assert_not_escalated(hc)


# The views (every function of the extension is called too, from the catalog).
VIEW_READS = [
    "SELECT * FROM public.stage_e_throttle_totals",
    "SELECT * FROM public.stage_e_slot_holders",
    "SELECT * FROM public.stage_e_slot_waiters",
    "SELECT * FROM public.stage_e_cap_load",
    "SELECT * FROM public.stage_e_histogram_quantiles",
    "SELECT * FROM public.stage_e_cap_limits",
    "SELECT * FROM public.stage_e_held_back",
    "SELECT * FROM public.stage_e_rate_limits",
]


def test_a_superuser_with_a_hostile_search_path_runs_none_of_its_objects(hc, owned_db):
    """Every function of the extension (every form, from the catalog: conftest.extension_calls)
    and every view, called by a superuser whose search_path puts the planted objects first; and
    the policy tables' triggers, run by writes of the tables by hand."""
    with hc.connect(owned_db) as su:
        # The session starts with the database's planted search_path: the test's own catalog
        # query runs with pg_catalog alone (it qualifies its operators too).
        su.execute("SET search_path = pg_catalog")
        calls = [f"SELECT * FROM {call}" for _, _, call in extension_calls(su)]
        # Then default's row written by an explicit flush: a throttle (this session holds slot
        # 0 of default from the calls above) and a flush.
        calls += VIEW_READS + ["SELECT public.stage_e_try_slot(1)",
                               "SELECT * FROM public.stage_e_flush()",
                               "INSERT INTO public.stage_e_share_policy VALUES ('k', 'h', 1, 1)",
                               "DELETE FROM public.stage_e_share_policy",
                               ("UPDATE public.stage_e_throttle_counter SET adapt_min = NULL "
                                "WHERE cap OPERATOR(pg_catalog.=) 'k'")]
        su.execute("SET search_path = evil, pg_catalog")
        for call in calls:
            su.execute(call)
            # Our pinned search_path never leaks into the caller's session.
            assert one(su, "SHOW search_path") == "evil, pg_catalog", call
        # The calls did their work in the extension's table, not the planted one: the explicit
        # flush wrote `default`'s row, and the background flusher (every 200 ms) may also have
        # written cap k's between its calls and the reset, but nothing else.
        assert one(su, "SELECT count(*) FROM public.stage_e_throttle_counter "
                       "WHERE cap OPERATOR(pg_catalog.=) 'default'") == 1
        assert one(su, "SELECT count(*) FROM public.stage_e_throttle_counter "
                       "WHERE cap OPERATOR(pg_catalog.<>) ALL ('{default,k}'::text[])") == 0
        assert one(su, "SELECT count(*) FROM evil.stage_e_throttle_counter") == 0
        # The lease the calls took is the extension's (its horizon written by the flusher in
        # this database, under the planted search_path).
        assert one(su, "SELECT count(*) FROM public.stage_e_slot_holders "
                       "WHERE cap OPERATOR(pg_catalog.=) 'k' AND token IS NOT NULL") == 2
    assert_not_escalated(hc)


# -- pg_dump / pg_restore ----------------------------------------------------------------------

def dumped_db(c, name):
    """A database whose counter row holds flushed counts, with nothing pending."""
    db = c.create_database(name)
    holder = hold_cap_of_one(c, db)
    with c.connect(db) as s:
        assert throttle(s, 7) == 7
        assert one(s, "SELECT stage_e_release(5)") is False  # a foreign release, counted
        s.execute("SELECT * FROM stage_e_flush()")
    holder.close()
    with c.connect(db) as s:
        wait_for(lambda: pending(s, "released_by_exit") == 1, what="the holder's exit")
        s.execute("SELECT * FROM stage_e_flush()")
        rows = counter_rows(s)
    assert len(rows) == 1
    assert rows[0]["cap"] == "default" and [rows[0][k] for k in COLS] == [1, 7, 0, 1, 1]
    return db, rows[0]


@pytest.mark.parametrize("fmt", ["custom", "plain"])
def test_dump_and_restore_into_a_fresh_database_keeps_the_counter_row(mc, fmt):
    src, row = dumped_db(mc, f"dump_src_{fmt}")
    dst = mc.create_database(f"dump_dst_{fmt}", extension=False)
    bin_ = bindir()
    conn = ["-h", str(mc.base), "-p", str(mc.port), "-U", "postgres"]
    if fmt == "custom":
        dump = str(mc.base / f"{src}.dump")
        mc._run(str(bin_ / "pg_dump"), *conn, "-Fc", "-f", dump, src)
        out = mc._run(str(bin_ / "pg_restore"), *conn, "-d", dst, "--single-transaction",
                      "--exit-on-error", dump, check=False)
    else:
        out = mc._run("bash", "-o", "pipefail", "-c",
                      f"{bin_}/pg_dump {' '.join(conn)} {src} | "
                      f"{bin_}/psql -X -q {' '.join(conn)} -1 -v ON_ERROR_STOP=1 -d {dst}",
                      check=False)
    assert out.returncode == 0, out.stderr
    assert "ERROR" not in out.stderr, out.stderr
    with mc.connect(dst) as s:
        assert counter_rows(s) == [row]
        assert totals(s)["throttled"] == 7
        # The restored database works, and adds to the restored counts.
        holder = hold_cap_of_one(mc, dst)
        assert throttle(s, 2) == 2
        s.execute("SELECT * FROM stage_e_flush()")
        assert flushed(s) == 9 and flushed(s, "acquired") == 2
        holder.close()


# -- savepoints ----------------------------------------------------------------------------------

def test_a_flush_in_a_rolled_back_savepoint_loses_nothing_and_counts_nothing_twice(mc):
    db = mc.create_database("sp_flush")
    holder = hold_cap_of_one(mc, db)
    with mc.connect(db) as s:
        throttle(s, 5)
        with s.transaction():
            s.execute("SAVEPOINT a")
            assert one(s, "SELECT throttled FROM stage_e_flush()") == 5
            s.execute("ROLLBACK TO SAVEPOINT a")
            # The row change is undone, so the counts are pending again, at once.
            assert pending(s) == 5 and flushed(s) == 0
            # And this transaction may flush again.
            assert one(s, "SELECT throttled FROM stage_e_flush()") == 5
        assert (flushed(s), pending(s), totals(s)["throttled"]) == (5, 0, 5)

        # A PL/pgSQL EXCEPTION block is a subtransaction too.
        throttle(s, 3)
        s.execute("""DO $$ BEGIN
                       BEGIN PERFORM stage_e_flush(); RAISE EXCEPTION 'undo';
                       EXCEPTION WHEN raise_exception THEN NULL; END;
                     END $$""")
        assert (flushed(s), pending(s), totals(s)["throttled"]) == (5, 3, 8)
        assert one(s, "SELECT throttled FROM stage_e_flush()") == 3
        assert (flushed(s), pending(s)) == (8, 0)

        # Nested: the flush in an inner savepoint that was released belongs to the outer one,
        # and goes when the outer one is rolled back.
        throttle(s, 2)
        with s.transaction():
            s.execute("SAVEPOINT outer_sp")
            s.execute("SAVEPOINT inner_sp")
            s.execute("SELECT stage_e_flush()")
            s.execute("RELEASE SAVEPOINT inner_sp")
            assert pending(s) == 0 and flushed(s) == 10
            s.execute("ROLLBACK TO SAVEPOINT outer_sp")
            assert pending(s) == 2 and flushed(s) == 8
        # A released savepoint's flush commits with the transaction, once.
        with s.transaction():
            s.execute("SAVEPOINT a")
            s.execute("SELECT stage_e_flush()")
            s.execute("RELEASE SAVEPOINT a")
        assert (flushed(s), pending(s), totals(s)["throttled"]) == (10, 0, 10)
        # ...and is undone with a transaction that rolls back.
        throttle(s, 1)
        with pytest.raises(psycopg.Error), s.transaction():
            s.execute("SAVEPOINT a")
            s.execute("SELECT stage_e_flush()")
            s.execute("RELEASE SAVEPOINT a")
            s.execute("SELECT 1/0")
        assert (flushed(s), pending(s), totals(s)["throttled"]) == (10, 1, 11)
        assert stats(s)["throttled"] == 11
    holder.close()


def test_a_reset_in_a_rolled_back_savepoint_changes_nothing(mc):
    db = mc.create_database("sp_reset")
    holder = hold_cap_of_one(mc, db)
    with mc.connect(db) as s:
        throttle(s, 4)
        s.execute("SELECT stage_e_flush()")
        throttle(s, 6)
        with s.transaction():
            s.execute("SAVEPOINT a")
            s.execute("SELECT stage_e_reset_stats()")
            assert totals(s)["throttled"] == 0
            s.execute("ROLLBACK TO SAVEPOINT a")
        assert (flushed(s), pending(s), totals(s)["throttled"]) == (4, 6, 10)
        s.execute("""DO $$ BEGIN
                       BEGIN PERFORM stage_e_reset_stats(); RAISE EXCEPTION 'undo';
                       EXCEPTION WHEN raise_exception THEN NULL; END;
                     END $$""")
        assert (flushed(s), pending(s), totals(s)["throttled"]) == (4, 6, 10)
        s.execute("SELECT stage_e_reset_stats()")
        assert (flushed(s), pending(s), totals(s)["throttled"]) == (0, 0, 0)
    holder.close()


# -- read functions are read-only --------------------------------------------------------------

READS = [
    "SELECT stage_e_snapshot()",
    "SELECT * FROM stage_e_stats()",
    "SELECT * FROM stage_e_pending()",
    "SELECT * FROM stage_e_throttle_totals",
    "SELECT * FROM stage_e_slot_holders",
    "SELECT * FROM stage_e_throttle_counter",
    "SELECT * FROM stage_e_slot_waiters",
    "SELECT * FROM stage_e_cap_load",
    "SELECT * FROM stage_e_histograms()",
    "SELECT * FROM stage_e_histogram_quantiles",
    "SELECT * FROM stage_e_cap_limits",
]


@pytest.mark.parametrize("begin", ["BEGIN", "BEGIN READ ONLY"])
def test_read_functions_assign_no_transaction_id(mc, begin):
    db = mc.create_database("reads_" + begin.split()[-1].lower())
    holder = hold_cap_of_one(mc, db)
    with mc.connect(db) as s:
        throttle(s, 3)
        s.execute("SELECT stage_e_flush()")
        throttle(s, 2)
        s.execute(begin)
        try:
            for q in READS:
                s.execute(q).fetchall()
                assert one(s, "SELECT txid_current_if_assigned()") is None, q
            snap = one(s, "SELECT stage_e_snapshot()")
            cap = snap["caps"][0]
            assert (cap["flushed"]["throttled"], cap["pending"]["throttled"]) == (3, 2)
            assert snap["holders"][0]["pid"] == holder.info.backend_pid
        finally:
            s.execute("ROLLBACK")
    holder.close()


# -- caps of dropped databases; reads that take nothing ---------------------------------------

@pytest.fixture(scope="module")
def small():
    """Room for 16 caps; nothing flushed by the clock, so used caps keep pending counts (and
    are not idle) until flushed."""
    c = Cluster("entries", {"stage_e_slots.max_caps": 16,
                            "stage_e_slots.flush_interval": "'1h'"}).init().start()
    yield c
    c.destroy()


def test_dropped_databases_give_their_caps_back(small):
    c = small
    since = len(c.log_text())
    for i in range(5):
        db = c.create_database(f"rolling_{i}")
        with c.connect(db) as s, c.connect(db) as t:
            # Twelve caps with counts not yet flushed: not idle, so only the database's drop
            # frees them; two rounds of twelve do not fit in 16 without that.
            for k in range(12):
                assert one(s, "SELECT stage_e_try_slot(%s, 1)", (f"c{k}",)) == 0
                assert one(t, "SELECT stage_e_try_slot(%s, 1)", (f"c{k}",)) is None
            assert stats(t, "c11")["throttled"] == 1
        c.sql(f"DROP DATABASE {db} WITH (FORCE)")
    # The next database that needed room (or the launcher) reclaimed them, with a LOG line
    # each: rounds 1 to 4 each needed 8 caps more than were free.
    lines = re.findall(r'reclaimed cap "c\d+" of dropped database \d+', c.log_text()[since:])
    assert len(lines) >= 4 * 8


def test_counts_of_a_dropped_database_are_dropped_with_a_log_line():
    c = Cluster("dropped_counts", {"stage_e_slots.max_caps": 64,
                                   "stage_e_slots.flush_interval": "'1h'"}).init().start()
    try:
        c.create_database("gone")
        with c.connect("gone") as s:
            for k in range(3):
                assert one(s, "SELECT stage_e_try_slot(%s, 1)", (f"g{k}",)) == 0
        c.sql("DROP DATABASE gone WITH (FORCE)")
        # Filling three quarters of max_caps asks the launcher for a round at once; its first
        # step reclaims the caps of databases that no longer exist.
        c.create_database("busy")
        with c.connect("busy") as s:
            for k in range(46):
                assert one(s, "SELECT stage_e_try_slot(%s, 1)", (f"b{k}",)) == 0
            wait_for(lambda: len(re.findall(
                r'reclaimed cap "g\d" of dropped database \d+; dropped its pending counters '
                r"\(1 acquired, 0 throttled\)", c.log_text())) == 3,
                timeout=10, what="the launcher to reclaim the dropped database's caps")
    finally:
        c.destroy()


def test_reading_releasing_and_flushing_take_no_cap(small):
    c = small
    for db in ["keeper", "reader", "late"]:
        c.create_database(db)
    try:
        with c.connect("keeper") as k:
            for i in range(15):
                assert one(k, "SELECT stage_e_try_slot(%s, 1)", (f"k{i}",)) == 0
            with c.connect("reader") as r:
                for q in READS + ["SELECT stage_e_release_all()", "SELECT stage_e_holding(0)",
                                  "SELECT stage_e_release(0)", "SELECT stage_e_cap_key('x')",
                                  "SELECT stage_e_release_all('x')",
                                  "SELECT stage_e_holding('x', 0)", "SELECT stage_e_release('x', 0)",
                                  "SELECT * FROM stage_e_flush()", "SELECT stage_e_reset_stats()",
                                  "SELECT stage_e_reset_stats('x')"]:
                    r.execute(q).fetchall()
                assert r.execute("SELECT * FROM stage_e_stats()").fetchall() == []
                assert r.execute("SELECT * FROM stage_e_flush()").fetchall() == []
            # The reader took nothing, so the 16th cap is still free for `late`.
            with c.connect("late") as lt:
                assert one(lt, "SELECT stage_e_try_slot('l', 1)") == 0
                # All 16 caps hold a slot now: a 17th is refused, clearly.
                with pytest.raises(errors.ConfigurationLimitExceeded) as err:
                    lt.execute("SELECT stage_e_try_slot('l2', 1)")
                assert "stage_e_slots.max_caps" in err.value.diag.message_hint
    finally:
        for db in ["keeper", "reader", "late"]:
            c.sql(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")


# -- parallel workers ----------------------------------------------------------------------------

def test_every_function_refuses_to_act_in_parallel_mode_and_reads_work_there(cluster, connect):
    """Every function of the extension (from the catalog), each in a PL/pgSQL wrapper wrongly
    marked PARALLEL SAFE and run by a parallel worker (debug_parallel_query): those that act on
    slots, leases, policies or counts raise 25000 and take nothing; those that read work there.
    Outside parallel mode every wrapper works."""
    c, observer = connect(), connect("observer")
    major = int(one(c, "SHOW server_version_num")) // 10000
    force = "debug_parallel_query" if major >= 16 else "force_parallel_mode"
    wrappers = []
    for i, (sig, kind, call) in enumerate(extension_calls(c)):
        name = f"par_{i}"
        c.execute(f"CREATE FUNCTION {name}() RETURNS bigint LANGUAGE plpgsql PARALLEL SAFE "
                  f"AS $$ BEGIN RETURN (SELECT count(*) FROM {call} AS f); END $$")
        wrappers.append((name, kind, call))
    c.execute(f"SET {force} = on")
    wrong = []
    for name, kind, call in wrappers:
        plan = "\n".join(r[0] for r in c.execute(f"EXPLAIN (VERBOSE) SELECT {name}()").fetchall())
        assert "Gather" in plan and "Single Copy: true" in plan, (call, plan)
        try:
            c.execute(f"SELECT {name}()")
            got = "works"
        except errors.InvalidTransactionState as e:
            assert "parallel operation" in e.diag.message_primary, call
            assert "PARALLEL SAFE" in e.diag.message_hint, call
            got = "refused"
        if got != {"acts": "refused", "reads": "works"}[kind]:
            wrong.append((call, kind, got))
        # Nothing was taken behind a refusal: no lock, no lease.
        assert slot_lock_holders(observer) == [] and cap_locks_of(observer, "k") == [], call
        assert one(observer, "SELECT count(*) FROM stage_e_slot_holders") == 0, call
    assert wrong == []
    # Outside parallel mode the same wrappers work.
    c.execute(f"RESET {force}")
    for name, _, call in wrappers:
        c.execute(f"SELECT {name}()")


def cap_locks_of(conn, cap):
    return conn.execute("SELECT objid::int, pid FROM pg_locks WHERE locktype = 'advisory' "
                        "AND classid = stage_e_cap_key(%s)::oid AND objsubid = 2", (cap,)
                        ).fetchall()


# -- privileges --------------------------------------------------------------------------------

SLOT_FUNCTIONS = ("stage_e_try_slot(integer), stage_e_try_slot(text, integer), stage_e_release(integer), "
                  "stage_e_release(text, integer), stage_e_release_all(), stage_e_release_all(text), "
                  "stage_e_holding(integer), stage_e_holding(text, integer)")


def test_execute_can_be_limited_to_worker_roles(cluster, db, connect):
    cluster.sql("DROP ROLE IF EXISTS intruder")
    cluster.sql("DROP ROLE IF EXISTS worker_1")
    cluster.sql("DROP ROLE IF EXISTS workers")
    cluster.sql("CREATE ROLE workers NOLOGIN")
    cluster.sql("CREATE ROLE worker_1 LOGIN IN ROLE workers")
    cluster.sql("CREATE ROLE intruder LOGIN")
    admin = connect()
    admin.execute(f"REVOKE EXECUTE ON FUNCTION {SLOT_FUNCTIONS} FROM PUBLIC")
    admin.execute(f"GRANT EXECUTE ON FUNCTION {SLOT_FUNCTIONS} TO workers")
    with cluster.connect(db, user="intruder") as c:
        for call in ["SELECT stage_e_try_slot(1)", "SELECT stage_e_release(0)",
                     "SELECT stage_e_release_all()", "SELECT stage_e_holding(0)",
                     "SELECT stage_e_try_slot('x', 1)", "SELECT stage_e_release('x', 0)",
                     "SELECT stage_e_release_all('x')", "SELECT stage_e_holding('x', 0)"]:
            with pytest.raises(errors.InsufficientPrivilege):
                c.execute(call)
        # Reading stays open to everyone.
        assert c.execute("SELECT * FROM stage_e_stats()").fetchall() == []
        assert one(c, "SELECT count(*) FROM stage_e_slot_holders") == 0
    with cluster.connect(db, user="worker_1") as w:
        assert one(w, "SELECT stage_e_try_slot(1)") == 0
        assert one(w, "SELECT stage_e_release(0)") is True
        assert one(w, "SELECT stage_e_try_slot('x', 1)") == 0
        assert one(w, "SELECT stage_e_release_all('x')") == 1
    assert slot_lock_holders(admin) == []


LEASE_FUNCTIONS = ("stage_e_lease(text, integer, interval, interval), "
                   "stage_e_renew(text, integer, bigint, interval), "
                   "stage_e_release_lease(text, integer, bigint)")


def test_a_lease_belongs_to_its_role_and_lease_functions_can_be_limited_like_slots(
        cluster, db, connect):
    """0.4.0 let any role free another's lease with the token the holders view showed it. Now
    the view hides another role's token and the lease refuses anyone but its role (42501); and
    the README's recipe (EXECUTE for worker roles only) still keeps other roles from leasing."""
    for role in ("intruder2", "worker_2", "workers2"):
        cluster.sql(f"DROP ROLE IF EXISTS {role}")
    cluster.sql("CREATE ROLE workers2 NOLOGIN")
    cluster.sql("CREATE ROLE worker_2 LOGIN IN ROLE workers2")
    cluster.sql("CREATE ROLE intruder2 LOGIN")
    admin = connect()
    with cluster.connect(db, user="worker_2") as w, cluster.connect(db, user="intruder2") as c:
        slot, token = w.execute("SELECT * FROM stage_e_lease('jobs', 2, '1 h')").fetchone()
        seen = c.execute("SELECT slot, token FROM stage_e_slot_holders WHERE cap = 'jobs'"
                         ).fetchall()
        assert seen == [(slot, None)]
        # Even with the token, the intruder cannot free the worker's lease.
        with pytest.raises(errors.InsufficientPrivilege):
            c.execute("SELECT stage_e_release_lease('jobs', %s, %s)", (slot, token))
        assert one(w, "SELECT stage_e_release_lease('jobs', %s, %s)", (slot, token)) is True
        admin.execute(f"REVOKE EXECUTE ON FUNCTION {LEASE_FUNCTIONS} FROM PUBLIC")
        admin.execute(f"GRANT EXECUTE ON FUNCTION {LEASE_FUNCTIONS} TO workers2")
        slot, token = w.execute("SELECT * FROM stage_e_lease('jobs', 2, '1 h')").fetchone()
        for call, args in [("SELECT stage_e_release_lease('jobs', %s, %s)", (slot, token)),
                           ("SELECT stage_e_renew('jobs', %s, %s, '1 s')", (slot, token)),
                           ("SELECT * FROM stage_e_lease('jobs', 2, '1 h')", ())]:
            with pytest.raises(errors.InsufficientPrivilege):
                c.execute(call, args)
        assert w.execute("SELECT slot, token FROM stage_e_slot_holders WHERE cap = 'jobs'"
                         ).fetchall() == [(slot, token)]
        assert one(w, "SELECT stage_e_release_lease('jobs', %s, %s)", (slot, token)) is True
    admin.execute(f"GRANT EXECUTE ON FUNCTION {LEASE_FUNCTIONS} TO PUBLIC")


# -- a full lock table -------------------------------------------------------------------------

def test_a_full_lock_table_is_a_clear_error_without_a_backtrace_and_leaks_nothing():
    # The lock table may grow into whatever the shared memory segment has spare past its
    # requests (rounded up, to huge pages where there are some), so how many locks fill it moves
    # with the size of every other request, ours included: the session's own limit is raised
    # out of the way so that the lock table is what fills.
    c = Cluster("locktable", {"max_locks_per_transaction": 10, "max_connections": 10,
                              "stage_e_slots.max_slots": 65536,
                              "stage_e_slots.max_session_slots": 100000})
    # RUST_BACKTRACE in the server's environment must not put a Rust stack into a client message.
    c.init().start(env={"RUST_BACKTRACE": "1"})
    try:
        c.create_database("app")
        with c.connect("app") as s, c.connect("app", "observer") as observer:
            with pytest.raises(errors.OutOfMemory) as err:
                s.execute("SELECT stage_e_try_slot(65536) FROM generate_series(1, 100000)")
            d = err.value.diag
            assert d.message_primary == "out of shared memory"
            assert "max_locks_per_transaction" in d.message_hint
            assert d.message_detail is None or not re.search(
                r"backtrace|\.rs:\d+|rust_begin_unwind|pgrx", d.message_detail), d.message_detail
            # Every slot the statement got before the ERROR is held, tracked and released.
            # (The observer reads pg_locks without touching pg_database, a shared catalog whose
            # lock would need a free entry of the full table.)
            def slot_locks():
                return observer.execute(
                    "SELECT objid::int, pid FROM pg_locks WHERE locktype = 'advisory' "
                    "AND classid = %s AND objsubid = 2 AND granted ORDER BY 1", (KEY,)).fetchall()
            held = slot_locks()
            assert len(held) > 100 and {pid for _, pid in held} == {s.info.backend_pid}
            assert [slot for slot, _ in held] == list(range(len(held)))
            assert one(observer, "SELECT held FROM stage_e_stats()") == len(held)
            assert one(s, "SELECT stage_e_release_all()") == len(held)
            assert slot_locks() == []
            # And the cap works again.
            assert one(s, "SELECT stage_e_try_slot(4)") == 0
        assert "stack backtrace" not in c.log_text()
    finally:
        c.destroy()


# -- leases belong to the role that took them (issue: one role freed or stole another's) -------

@pytest.fixture
def roles(cluster, db):
    """Role alice takes leases; mallory is another CONNECT-only role; ops is a member of
    pg_signal_backend; reader of pg_read_all_stats; team_member is a member of alice."""
    made = ["alice", "mallory", "ops", "reader", "team_member"]
    for r in made:
        cluster.sql(f"DROP ROLE IF EXISTS {r}")
        cluster.sql(f"CREATE ROLE {r} LOGIN")
        cluster.sql(f'GRANT CONNECT ON DATABASE "{db}" TO {r}')
    cluster.sql("GRANT pg_signal_backend TO ops")
    cluster.sql("GRANT pg_read_all_stats TO reader")
    cluster.sql("GRANT alice TO team_member")
    yield {r: (lambda r=r: cluster.connect(db, r, user=r)) for r in made}
    cluster.sql(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    for r in made:
        cluster.sql(f"DROP ROLE IF EXISTS {r}")


def lease_of(conn, cap, n, ttl):
    return conn.execute("SELECT slot, token FROM stage_e_lease(%s, %s, %s)",
                        (cap, n, ttl)).fetchone()


def test_another_role_can_neither_release_nor_renew_a_lease_nor_read_its_token(roles, connect):
    observer = connect("observer")  # the superuser
    with roles["alice"]() as alice, roles["mallory"]() as mallory:
        slot, token = lease_of(alice, "one", 1, "1 h")
        before = observer.execute("SELECT * FROM stage_e_stats() WHERE cap = 'one'").fetchone()
        # The token is not shown to another role: not in the view, not in the snapshot.
        assert mallory.execute("SELECT slot, token FROM stage_e_slot_holders WHERE cap = 'one'"
                               ).fetchall() == [(0, None)]
        snap = mallory.execute("SELECT stage_e_snapshot()").fetchone()[0]
        assert [h["token"] for h in snap["holders"] if h["cap"] == "one"] == [None]
        assert alice.execute("SELECT token FROM stage_e_slot_holders WHERE cap = 'one'"
                             ).fetchone()[0] == token
        # Knowing (or guessing) it does not help: release, a renewal to 1 ms, one to 100,000
        # years, and a guess are refused with 42501 and change nothing, not even a count.
        for call, args in [("SELECT stage_e_release_lease('one', %s, %s)", (slot, token)),
                           ("SELECT stage_e_renew('one', %s, %s, '1 ms')", (slot, token)),
                           ("SELECT stage_e_renew('one', %s, %s, '23 hours')",
                            (slot, token)),
                           ("SELECT stage_e_release_lease('one', %s, %s)", (slot, token + 1))]:
            with pytest.raises(errors.InsufficientPrivilege) as err:
                mallory.execute(call, args)
            assert "belongs to role \"alice\"" in err.value.diag.message_detail
            assert str(token) not in str(err.value.diag.message_detail)
        assert observer.execute("SELECT slot, token, expires_at > now() + '59 min'::interval "
                                "FROM stage_e_slot_holders WHERE cap = 'one'").fetchall() == [
            (0, token, True)]
        assert observer.execute("SELECT * FROM stage_e_stats() WHERE cap = 'one'"
                                ).fetchone() == before
        # A new lease by mallory on the full cap is throttled, as ever.
        assert lease_of(mallory, "one", 1, "1 s") == (None, None)
        assert alice.execute("SELECT stage_e_release_lease('one', %s, %s)", (slot, token)
                             ).fetchone()[0] is True


def test_a_stale_token_is_lost_whoever_leased_the_slot_since(roles, connect):
    """Issue 35: alice's lease expired and mallory (another role) leased the slot. Alice's
    renewal and release with her old token raised 42501, as if she were a thief; the token is
    merely stale (older than the slot's lease): false and a WARNING, as for any stale token,
    and mallory keeps the slot. Her token or a guess past it stays 42501."""
    observer = connect("observer")
    with roles["alice"]() as alice, roles["mallory"]() as mallory:
        slot, old = lease_of(alice, "stale", 1, "200 ms")
        wait_for(lambda: lease_of(mallory, "stale", 1, "1 h")[0] == slot, timeout=10,
                 what="mallory to lease the expired slot")
        mine = observer.execute("SELECT token FROM stage_e_slot_holders WHERE cap = 'stale'"
                                ).fetchone()[0]
        assert mine > old
        seen = []
        alice.add_notice_handler(lambda d: seen.append((d.severity, d.message_detail)))
        assert alice.execute("SELECT stage_e_renew('stale', %s, %s, '1 h')", (slot, old)
                             ).fetchone()[0] is False
        assert alice.execute("SELECT stage_e_release_lease('stale', %s, %s)", (slot, old)
                             ).fetchone()[0] is False
        assert [s[0] for s in seen] == ["WARNING", "WARNING"], seen
        assert all(str(mine) not in str(d) for _, d in seen)
        for guess in (mine, mine + 1):
            with pytest.raises(errors.InsufficientPrivilege):
                alice.execute("SELECT stage_e_release_lease('stale', %s, %s)", (slot, guess))
        assert observer.execute("SELECT slot, token FROM stage_e_slot_holders "
                                "WHERE cap = 'stale'").fetchall() == [(slot, mine)]
        assert mallory.execute("SELECT stage_e_release_lease('stale', %s, %s)", (slot, mine)
                               ).fetchone()[0] is True


def test_a_wrong_token_warning_never_shows_the_current_token(roles):
    with roles["alice"]() as alice:
        slot, token = lease_of(alice, "w", 1, "1 h")
        seen = []
        alice.add_notice_handler(lambda d: seen.append((d.message_primary, d.message_detail)))
        assert alice.execute("SELECT stage_e_renew('w', %s, %s, '1 s')", (slot, token - 1)
                             ).fetchone()[0] is False
        assert len(seen) == 1 and str(token) not in " ".join(map(str, seen[0]))
        assert "another token" in seen[0][1]
        assert alice.execute("SELECT stage_e_release_lease('w', %s, %s)", (slot, token)
                             ).fetchone()[0] is True


def test_members_operators_and_readers_get_what_postgresql_gives_them(roles, connect):
    """As pg_terminate_backend and pg_stat_activity decide: a member of the owner may act for
    it, pg_signal_backend may end another role's lease, pg_read_all_stats may see tokens."""
    with roles["alice"]() as alice, roles["team_member"]() as member, \
            roles["ops"]() as ops, roles["reader"]() as reader:
        slot, token = lease_of(alice, "m", 3, "1 h")
        assert member.execute("SELECT stage_e_renew('m', %s, %s, '2 h')", (slot, token)
                              ).fetchone()[0] is True
        assert reader.execute("SELECT token FROM stage_e_slot_holders WHERE cap = 'm'"
                              ).fetchone()[0] == token
        with pytest.raises(errors.InsufficientPrivilege):
            reader.execute("SELECT stage_e_release_lease('m', %s, %s)", (slot, token))
        assert ops.execute("SELECT token FROM stage_e_slot_holders WHERE cap = 'm'"
                           ).fetchone()[0] is None
        assert ops.execute("SELECT stage_e_release_lease('m', %s, %s)", (slot, token)
                           ).fetchone()[0] is True
    # A superuser's lease is beyond pg_signal_backend, as a superuser's backend is.
    su = connect("su")
    slot, token = lease_of(su, "m", 3, "1 h")
    with roles["ops"]() as ops, pytest.raises(errors.InsufficientPrivilege):
        ops.execute("SELECT stage_e_release_lease('m', %s, %s)", (slot, token))
    assert su.execute("SELECT stage_e_release_lease('m', %s, %s)", (slot, token)
                      ).fetchone()[0] is True


def test_drop_role_while_it_holds_a_lease_leaves_the_lease_to_its_ttl_or_a_superuser(cluster):
    """A lease is no catalog object, so DROP ROLE of its role succeeds (once its privileges
    are gone) while it holds one (issue 35 asked: refuse it, or say what happens; docs/security.md
    says this). The lease keeps its slot until its ttl, the holders view still shows it, and a
    superuser may still renew or release it by its token."""
    db = cluster.create_database("drop_leaser")
    cluster.sql("DROP ROLE IF EXISTS gone_leaser")
    cluster.sql("CREATE ROLE gone_leaser LOGIN")
    cluster.sql(f'GRANT CONNECT ON DATABASE "{db}" TO gone_leaser')
    with cluster.connect(db, user="gone_leaser") as leaser:
        slot, token = lease_of(leaser, "orphan", 1, "1 h")
    cluster.sql(f'REVOKE CONNECT ON DATABASE "{db}" FROM gone_leaser')
    cluster.sql("DROP ROLE gone_leaser")
    with cluster.connect(db) as su:
        rows = su.execute("SELECT slot, token FROM stage_e_slot_holders "
                          "WHERE cap = 'orphan'").fetchall()
        assert rows == [(slot, token)]
        assert lease_of(su, "orphan", 1, "1 s") == (None, None)  # still held
        assert one(su, "SELECT stage_e_renew('orphan', %s, %s, '1 h')", (slot, token)) is True
        assert one(su, "SELECT stage_e_release_lease('orphan', %s, %s)", (slot, token)) is True
        assert su.execute("SELECT count(*) FROM stage_e_slot_holders WHERE cap = 'orphan'"
                          ).fetchone()[0] == 0
