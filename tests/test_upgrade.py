"""ALTER EXTENSION stage_e_slots UPDATE from 0.1.0, 0.2.0, 0.3.0, 0.4.0, 0.5.0, 0.6.0, 0.7.0, 0.8.0, 0.9.0 and 0.10.0,
with data and holders, against the current library; and the updated schema against a fresh install's."""

import re
from datetime import timedelta
from pathlib import Path

import pytest
import tomllib
from conftest import KEY, one, slot_lock_holders
from pgcluster import Cluster, wait_for
from psycopg import errors

# Every object of the extension, described without OIDs: functions (arguments, result,
# volatility, parallel safety, strictness, SECURITY DEFINER, SET options, C symbol, privileges,
# comment), tables and views
# (columns, defaults, constraints, indexes, definition, privileges, comment) and the tables
# pg_dump keeps the data of.
DESCRIBE = r"""
WITH ext AS (SELECT oid, extconfig, extcondition FROM pg_extension
              WHERE extname = 'stage_e_slots'),
members AS (SELECT d.classid, d.objid FROM pg_depend d, ext
             WHERE d.refclassid = 'pg_extension'::regclass AND d.refobjid = ext.oid
               AND d.deptype = 'e')
SELECT 'function ' || p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ') '
       || pg_get_function_arguments(p.oid) || ' -> ' || pg_get_function_result(p.oid)
       || ' ' || p.provolatile::text || p.proparallel::text || p.proisstrict::text
       || ' secdef=' || p.prosecdef::text || ' config=' || coalesce(p.proconfig::text, '-')
       || ' ' || p.prosrc || ' acl=' || coalesce(p.proacl::text, '-')
       || ' comment=' || coalesce(obj_description(p.oid, 'pg_proc'), '-')
  FROM members m JOIN pg_proc p ON m.classid = 'pg_proc'::regclass AND p.oid = m.objid
UNION ALL
SELECT c.relkind::text || ' ' || c.relname || ' acl=' || coalesce(c.relacl::text, '-')
       || ' comment=' || coalesce(obj_description(c.oid, 'pg_class'), '-')
       || ' def=' || coalesce(pg_get_viewdef(c.oid), '-')
  FROM members m JOIN pg_class c ON m.classid = 'pg_class'::regclass AND c.oid = m.objid
UNION ALL
SELECT 'column ' || c.relname || '.' || a.attnum || ' ' || a.attname || ' '
       || format_type(a.atttypid, a.atttypmod) || ' notnull=' || a.attnotnull
       || ' default=' || coalesce(pg_get_expr(ad.adbin, ad.adrelid), '-')
       || ' dropped=' || a.attisdropped
  FROM members m JOIN pg_class c ON m.classid = 'pg_class'::regclass AND c.oid = m.objid
  JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0
  LEFT JOIN pg_attrdef ad ON ad.adrelid = c.oid AND ad.adnum = a.attnum
UNION ALL
SELECT 'constraint ' || c.relname || ' ' || k.conname || ' ' || pg_get_constraintdef(k.oid)
  FROM members m JOIN pg_class c ON m.classid = 'pg_class'::regclass AND c.oid = m.objid
  JOIN pg_constraint k ON k.conrelid = c.oid
UNION ALL
SELECT 'index ' || pg_get_indexdef(i.indexrelid)
  FROM members m JOIN pg_index i ON m.classid = 'pg_class'::regclass AND i.indrelid = m.objid
UNION ALL
SELECT 'type ' || t.typname || ' ('
       || (SELECT string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod), ', '
                             ORDER BY a.attnum)
             FROM pg_attribute a WHERE a.attrelid = t.typrelid AND a.attnum > 0)
       || ') comment=' || coalesce(obj_description(t.oid, 'pg_type'), '-')
  FROM members m JOIN pg_type t ON m.classid = 'pg_type'::regclass AND t.oid = m.objid
UNION ALL
SELECT 'dumped data ' || cfg::regclass::text || ' where ' || coalesce(cond, '-')
  FROM ext, unnest(ext.extconfig, ext.extcondition) AS u(cfg, cond)
UNION ALL
SELECT 'trigger ' || pg_get_triggerdef(t.oid) || ' enabled=' || t.tgenabled::text
  FROM members m JOIN pg_trigger t ON m.classid = 'pg_class'::regclass AND t.tgrelid = m.objid
 WHERE NOT t.tgisinternal
UNION ALL
SELECT 'member of another kind ' || m.classid::regclass::text
  FROM members m WHERE m.classid NOT IN ('pg_proc'::regclass, 'pg_class'::regclass,
                                         'pg_type'::regclass)
ORDER BY 1
"""


ROOT = Path(__file__).resolve().parent.parent
CURRENT = tomllib.loads((Path(__file__).resolve().parent.parent / "Cargo.toml").read_text())[
    "package"]["version"]


@pytest.fixture(scope="module")
def uc():
    c = Cluster("upgrade", {"stage_e_slots.flush_interval": "'1h'"}).init().start()
    yield c
    c.destroy()


def describe(c, db):
    return [r[0] for r in c.sql(DESCRIBE, dbname=db)]


def test_a_0_1_0_database_is_served_then_updated_with_its_counts_and_holders(uc):
    uc.create_database("old", extension=False)
    uc.sql("CREATE EXTENSION stage_e_slots VERSION '0.1.0'", dbname="old")
    with uc.connect("old", "holder") as holder, uc.connect("old", "other") as other, \
            uc.connect("old", "observer") as observer:
        assert one(observer, "SELECT extversion FROM pg_extension "
                             "WHERE extname = 'stage_e_slots'") == "0.1.0"
        # The 0.2.0 library serves 0.1.0's SQL: slots, stats, views, flush, snapshot.
        assert one(holder, "SELECT stage_e_try_slot(1)") == 0
        assert one(other, "SELECT stage_e_try_slot(1)") is None
        assert observer.execute("SELECT * FROM stage_e_stats()").fetchone() == (
            1024, 1, 1, 1, 0, 0, 0)
        assert observer.execute("SELECT slot, pid FROM stage_e_slot_holders").fetchall() == [
            (0, holder.info.backend_pid)]
        assert observer.execute("SELECT * FROM stage_e_flush()").fetchone() == (1, 1, 0, 0, 0)
        assert observer.execute("SELECT id, acquired, throttled FROM stage_e_throttle_counter"
                                ).fetchall() == [(True, 1, 1)]
        assert one(other, "SELECT stage_e_try_slot(1)") is None  # pending at the update
        assert one(other, "SELECT stage_e_release(0)") is False  # a foreign release, pending
        assert observer.execute("SELECT throttled, pending_throttled, foreign_releases "
                                "FROM stage_e_throttle_totals").fetchone() == (2, 1, 1)
        snap = one(observer, "SELECT stage_e_snapshot()")
        assert snap["totals"]["throttled"] == 2 and snap["holders"][0]["slot"] == 0

        observer.execute("ALTER EXTENSION stage_e_slots UPDATE")
        assert one(observer, "SELECT extversion FROM pg_extension "
                             "WHERE extname = 'stage_e_slots'") == CURRENT
        # The holder kept its slot: the same lock, seen by the lock manager and by itself.
        assert slot_lock_holders(observer) == [(0, holder.info.backend_pid)]
        assert one(holder, "SELECT stage_e_holding(0)") is True
        assert one(holder, "SELECT stage_e_holding('default', 0)") is True
        assert one(other, "SELECT stage_e_try_slot('default', 1)") is None
        # The counts: the 0.1.0 row is the row of 'default'; pending counts were kept.
        assert observer.execute("SELECT cap, acquired, throttled, foreign_releases "
                                "FROM stage_e_throttle_counter").fetchall() == [
            ("default", 1, 1, 0)]
        assert observer.execute(
            "SELECT cap, acquired, throttled, foreign_releases, pending_throttled "
            "FROM stage_e_throttle_totals").fetchall() == [("default", 1, 3, 1, 2)]
        # 0.2.0 behaviour: a named cap, beside default.
        assert one(other, "SELECT stage_e_try_slot('exports', 2)") == 0
        assert one(observer, "SELECT stage_e_cap_key('exports')") != KEY
        rows = observer.execute("SELECT cap, held, acquired, throttled FROM stage_e_stats()"
                                ).fetchall()
        assert rows == [("default", 1, 1, 3), ("exports", 1, 1, 0)]
        assert observer.execute("SELECT cap, slot, pid FROM stage_e_slot_holders").fetchall() == [
            ("default", 0, holder.info.backend_pid), ("exports", 0, other.info.backend_pid)]
        flushed = observer.execute("SELECT cap, acquired, throttled, released, foreign_releases, released_by_exit FROM stage_e_flush() ORDER BY cap").fetchall()
        assert flushed == [("default", 0, 2, 0, 1, 0), ("exports", 1, 0, 0, 0, 0)]
        assert observer.execute("SELECT cap, acquired, throttled FROM stage_e_throttle_counter "
                                "ORDER BY cap").fetchall() == [("default", 1, 3), ("exports", 1, 0)]
        assert one(holder, "SELECT stage_e_release(0)") is True
        assert one(other, "SELECT stage_e_release_all()") == 1
    # The updated schema is exactly a fresh install's.
    uc.create_database("fresh")
    assert describe(uc, "old") == describe(uc, "fresh")


def test_the_background_flusher_writes_a_0_1_0_database_until_it_is_updated():
    c = Cluster("upgrade_flusher", {"stage_e_slots.flush_interval": "'200ms'"}).init().start()
    try:
        c.create_database("old", extension=False)
        c.sql("CREATE EXTENSION stage_e_slots VERSION '0.1.0'", dbname="old")
        with c.connect("old") as h, c.connect("old") as s:
            assert one(h, "SELECT stage_e_try_slot(1)") == 0
            assert one(s, "SELECT stage_e_try_slot(1)") is None
            wait_for(lambda: s.execute("SELECT throttled FROM stage_e_throttle_counter"
                                       ).fetchall() == [(1,)], timeout=5, what="a 0.1.0 flush")
            s.execute("ALTER EXTENSION stage_e_slots UPDATE")
            assert one(s, "SELECT stage_e_try_slot(1)") is None
            assert one(s, "SELECT stage_e_try_slot('other', 1)") == 0
            wait_for(lambda: s.execute("SELECT cap, throttled, acquired FROM "
                                       "stage_e_throttle_counter ORDER BY cap").fetchall()
                     == [("default", 2, 1), ("other", 0, 1)], timeout=5,
                     what="0.2.0 flushes after the update")
    finally:
        c.destroy()


def test_a_dump_of_an_updated_database_restores():
    c = Cluster("upgrade_dump", {"stage_e_slots.flush_interval": "'1h'"}).init().start()
    try:
        c.create_database("old", extension=False)
        c.sql("CREATE EXTENSION stage_e_slots VERSION '0.1.0'", dbname="old")
        with c.connect("old") as s:
            assert one(s, "SELECT stage_e_try_slot(1)") == 0
            s.execute("SELECT stage_e_flush()")
            s.execute("ALTER EXTENSION stage_e_slots UPDATE")
            assert one(s, "SELECT stage_e_try_slot('exports', 1)") == 0
            s.execute("SELECT stage_e_flush()")
            rows = s.execute("SELECT * FROM stage_e_throttle_counter ORDER BY cap").fetchall()
        c.create_database("copy", extension=False)
        out = c._run("bash", "-o", "pipefail", "-c",
                     f"{c.bin}/pg_dump -h {c.base} -p {c.port} -U postgres old | "
                     f"{c.bin}/psql -X -q -h {c.base} -p {c.port} -U postgres -1 "
                     f"-v ON_ERROR_STOP=1 -d copy", check=False)
        assert out.returncode == 0, out.stderr
        with c.connect("copy") as s:
            assert s.execute("SELECT * FROM stage_e_throttle_counter ORDER BY cap"
                             ).fetchall() == rows
    finally:
        c.destroy()


def test_a_leftover_max_databases_setting_only_warns():
    """0.1.0's stage_e_slots.max_databases is gone; a postgresql.conf that still sets it must
    not keep the server from starting."""
    c = Cluster("leftover", {"stage_e_slots.max_databases": 16}).init().start()
    try:
        assert one_sql(c, "SELECT stage_e_try_slot(1)") == 0
        assert 'invalid configuration parameter name "stage_e_slots.max_databases"' \
            in c.log_text()
    finally:
        c.destroy()


def one_sql(c, q):
    c.sql("CREATE EXTENSION IF NOT EXISTS stage_e_slots")
    return c.sql(q)[0][0]


def test_a_0_2_0_database_is_served_then_updated_with_its_counts(uc):
    uc.create_database("v020", extension=False)
    uc.sql("CREATE EXTENSION stage_e_slots VERSION '0.2.0'", dbname="v020")
    with uc.connect("v020", "holder") as holder, uc.connect("v020", "other") as other, \
            uc.connect("v020", "observer") as observer:
        # The library serves 0.2.0's SQL, with 0.2.0's five counters.
        assert one(holder, "SELECT stage_e_try_slot('exports', 1)") == 0
        assert one(other, "SELECT stage_e_try_slot('exports', 1)") is None
        assert observer.execute("SELECT * FROM stage_e_stats()").fetchall() == [
            ("exports", 1024, 1, 1, 1, 0, 0, 0)]
        assert observer.execute("SELECT * FROM stage_e_flush()").fetchall() == [
            ("exports", 1, 1, 0, 0, 0)]
        assert one(other, "SELECT stage_e_try_slot('exports', 1)") is None  # pending
        assert observer.execute("SELECT * FROM stage_e_pending()").fetchall() == [
            ("exports", 0, 1, 0, 0, 0)]
        assert observer.execute("SELECT cap, throttled, pending_throttled "
                                "FROM stage_e_throttle_totals").fetchall() == [("exports", 2, 1)]
        snap = one(observer, "SELECT stage_e_snapshot()")
        assert snap["caps"][0]["totals"]["throttled"] == 2

        observer.execute("ALTER EXTENSION stage_e_slots UPDATE")
        assert one(observer, "SELECT extversion FROM pg_extension "
                             "WHERE extname = 'stage_e_slots'") == CURRENT
        assert one(holder, "SELECT stage_e_holding('exports', 0)") is True
        row = observer.execute("SELECT cap, acquired, throttled, waits, wait_time, hold_time "
                               "FROM stage_e_throttle_counter").fetchall()
        assert [r[:4] for r in row] == [("exports", 1, 1, 0)]
        assert row[0][4].total_seconds() == 0 and row[0][5].total_seconds() == 0
        assert observer.execute("SELECT cap, throttled, pending_throttled "
                                "FROM stage_e_throttle_totals").fetchall() == [("exports", 2, 1)]
        # 0.3.0 behaviour: waiting, and the wait and hold counters.
        assert one(other, "SELECT stage_e_try_slot('exports', 1, '50 ms')") is None
        assert one(holder, "SELECT stage_e_release('exports', 0)") is True
        assert one(other, "SELECT stage_e_try_slot('exports', 1, '1 s')") == 0
        s = observer.execute("SELECT waits, wait_timeouts FROM stage_e_stats()").fetchall()
        assert s == [(1, 1)]
        observer.execute("SELECT stage_e_flush()")
        assert observer.execute("SELECT waits, wait_timeouts, hold_time > '0' "
                                "FROM stage_e_throttle_counter").fetchall() == [(1, 1, True)]
        assert one(other, "SELECT stage_e_release_all()") == 1
    uc.create_database("fresh3")
    assert describe(uc, "v020") == describe(uc, "fresh3")


def test_a_0_3_0_database_is_served_then_updated_with_its_counts_and_holder(uc):
    uc.create_database("v030", extension=False)
    uc.sql("CREATE EXTENSION stage_e_slots VERSION '0.3.0'", dbname="v030")
    with uc.connect("v030", "holder") as holder, uc.connect("v030", "other") as other, \
            uc.connect("v030", "observer") as observer:
        # The library serves 0.3.0's SQL, with 0.3.0's nine counters and holders without the
        # lease columns.
        assert one(holder, "SELECT stage_e_try_slot('jobs', 1)") == 0
        assert one(other, "SELECT stage_e_try_slot('jobs', 1, '20 ms')") is None
        stats = observer.execute("SELECT * FROM stage_e_stats()").fetchall()
        assert [r[:10] for r in stats] == [("jobs", 1024, 1, 1, 1, 0, 0, 0, 1, 1)]
        assert len(stats[0]) == 12
        flushed = observer.execute("SELECT * FROM stage_e_flush()").fetchall()
        assert [r[:8] for r in flushed] == [("jobs", 1, 1, 0, 0, 0, 1, 1)] and len(flushed[0]) == 10
        assert one(other, "SELECT stage_e_try_slot('jobs', 1)") is None  # pending
        pending = observer.execute("SELECT * FROM stage_e_pending()").fetchall()
        assert [r[:3] for r in pending] == [("jobs", 0, 1)] and len(pending[0]) == 10
        assert observer.execute("SELECT cap, slot, pid FROM stage_e_slot_holders").fetchall() == [
            ("jobs", 0, holder.info.backend_pid)]
        assert "token" not in [d.name for d in observer.execute(
            "SELECT * FROM stage_e_slot_holders").description]
        snap = one(observer, "SELECT stage_e_snapshot()")
        assert snap["caps"][0]["totals"]["throttled"] == 2
        assert snap["holders"][0]["token"] is None

        observer.execute("ALTER EXTENSION stage_e_slots UPDATE")
        assert one(observer, "SELECT extversion FROM pg_extension "
                             "WHERE extname = 'stage_e_slots'") == CURRENT
        # The holder kept its slot, the row its counts, and the new column starts at zero.
        assert one(holder, "SELECT stage_e_holding('jobs', 0)") is True
        assert observer.execute("SELECT cap, acquired, throttled, waits, expired "
                                "FROM stage_e_throttle_counter").fetchall() == [
            ("jobs", 1, 1, 1, 0)]
        assert observer.execute("SELECT cap, throttled, pending_throttled, expired "
                                "FROM stage_e_throttle_totals").fetchall() == [("jobs", 2, 1, 0)]
        # 0.4.0 behaviour: a fencing token for the session slot, leases beside session slots.
        token = one(holder, "SELECT stage_e_slot_token('jobs', 0)")
        assert token is not None
        assert one(other, "SELECT stage_e_lease('jobs', 1, '10 s')") is None  # n shared
        lease = other.execute("SELECT * FROM stage_e_lease('jobs', 2, '10 s')").fetchone()
        assert lease[0] == 1 and lease[1] > token
        assert observer.execute("SELECT cap, slot, token IS NOT NULL FROM stage_e_slot_holders "
                                "ORDER BY slot").fetchall() == [("jobs", 0, False),
                                                                ("jobs", 1, True)]
        assert one(observer, "SELECT stage_e_release_lease('jobs', 1, %s)", (lease[1],)) is True
        assert one(holder, "SELECT stage_e_release_all()") == 1
    uc.create_database("fresh4")
    assert describe(uc, "v030") == describe(uc, "fresh4")


def test_a_0_4_0_database_serves_the_retired_wait_form_until_it_is_updated(uc):
    """0.5.0 retires stage_e_try_slot(n integer, wait interval) (two untyped parameters tied it
    with (cap, n)); a database still at 0.4.0 keeps calling it through the library's symbol.
    The update drops it with its data, holders and leases kept."""
    uc.create_database("v040", extension=False)
    uc.sql("CREATE EXTENSION stage_e_slots VERSION '0.4.0'", dbname="v040")
    with uc.connect("v040", "holder") as holder, uc.connect("v040", "other") as other, \
            uc.connect("v040", "observer") as observer:
        assert one(observer, "SELECT extversion FROM pg_extension "
                             "WHERE extname = 'stage_e_slots'") == "0.4.0"
        # The retired form, served by the 0.5.0 library: a slot of default, a timed-out wait.
        assert one(holder, "SELECT stage_e_try_slot(1, '20 ms')") == 0
        assert one(other, "SELECT stage_e_try_slot(1, '20 ms'::interval)") is None
        assert slot_lock_holders(observer) == [(0, holder.info.backend_pid)]
        # There, two untyped parameters are still ambiguous.
        with pytest.raises(errors.AmbiguousFunction):
            other.execute("SELECT stage_e_try_slot('jobs', '1')")
        # A lease and counts, flushed and pending, to carry across the update.
        lease = other.execute("SELECT * FROM stage_e_lease('jobs', 2, '30 s')").fetchone()
        assert lease[0] == 0
        observer.execute("SELECT stage_e_flush()")
        assert one(other, "SELECT stage_e_try_slot(1)") is None  # pending at the update
        assert observer.execute("SELECT cap, acquired, throttled, waits, wait_timeouts "
                                "FROM stage_e_throttle_counter ORDER BY cap").fetchall() == [
            ("default", 1, 1, 1, 1), ("jobs", 1, 0, 0, 0)]

        observer.execute("ALTER EXTENSION stage_e_slots UPDATE")
        assert one(observer, "SELECT extversion FROM pg_extension "
                             "WHERE extname = 'stage_e_slots'") == CURRENT
        # The form is gone; the named form replaces it; the holder and the lease were kept.
        with pytest.raises(errors.UndefinedFunction):
            other.execute("SELECT stage_e_try_slot(1, '20 ms'::interval)")
        assert one(holder, "SELECT stage_e_holding('default', 0)") is True
        assert one(other, "SELECT stage_e_try_slot('default', 1, '20 ms')") is None
        assert observer.execute("SELECT cap, slot, token FROM stage_e_slot_holders "
                                "ORDER BY cap").fetchall() == [
            ("default", 0, None), ("jobs", 0, lease[1])]
        # Two untyped parameters now resolve to (cap, n).
        assert one(other, "SELECT stage_e_try_slot('jobs', '2')") == 1
        assert observer.execute("SELECT cap, acquired, throttled, waits, wait_timeouts, "
                                "pending_throttled FROM stage_e_throttle_totals ORDER BY cap"
                                ).fetchall() == [("default", 1, 3, 2, 2, 2), ("jobs", 2, 0, 0, 0, 0)]
        assert one(observer, "SELECT stage_e_release_lease('jobs', 0, %s)", (lease[1],)) is True
        assert one(other, "SELECT stage_e_release_all()") == 1
        assert one(holder, "SELECT stage_e_release_all()") == 1
    uc.create_database("fresh5")
    assert describe(uc, "v040") == describe(uc, "fresh5")


def test_a_0_5_0_database_keeps_0_5_0_behaviour_until_updated_then_its_leases_outlive_a_crash():
    """The 0.6.0 library serves a 0.5.0 database as 0.5.0 did: it has no durable lease horizon,
    so a crash frees its leases (the README says so). The update keeps its holder, its lease
    and its counts; from then on the flusher covers its leases, and a crash holds the cap back
    until they have expired, with the old token able to reclaim its slot."""
    c = Cluster("upgrade050", {"stage_e_slots.flush_interval": "200",
                               "stage_e_slots.lease_horizon_margin": "'100ms'"}).init().start()
    try:
        c.create_database("v050", extension=False)
        c.sql("CREATE EXTENSION stage_e_slots VERSION '0.5.0'", dbname="v050")
        with c.connect("v050") as s:
            before = s.execute("SELECT * FROM stage_e_lease('jobs', 1, '30 s')").fetchone()
            assert before[0] == 0
            assert one(s, "SELECT to_regclass('stage_e_lease_horizon')") is None
        c.crash()
        c.start()
        with c.connect("v050", "holder") as holder, c.connect("v050", "observer") as observer:
            # What the crash kept of the first lease's count: the flusher (200 ms) may or may not
            # have written it before the crash. Nothing is pending after a crash, so this is
            # the row as it stands; the second lease adds one to it.
            jobs_before = one(observer, "SELECT coalesce(sum(acquired), 0) "
                                        "FROM stage_e_throttle_counter WHERE cap = 'jobs'")
            assert jobs_before in (0, 1)
            # 0.5.0's behaviour: nothing covered the lease, so the crash freed its slot.
            lease = holder.execute("SELECT * FROM stage_e_lease('jobs', 1, '30 s')").fetchone()
            assert lease[0] == 0 and lease[1] > before[1]
            assert one(observer, "SELECT to_regclass('stage_e_held_back')") is None
            assert one(holder, "SELECT stage_e_try_slot('sess', 2)") == 0
            observer.execute("SELECT stage_e_flush()")

            observer.execute("ALTER EXTENSION stage_e_slots UPDATE")
            assert one(observer, "SELECT extversion FROM pg_extension "
                                 "WHERE extname = 'stage_e_slots'") == CURRENT
            assert observer.execute("SELECT cap, slot, token FROM stage_e_slot_holders "
                                    "ORDER BY cap").fetchall() == [
                ("jobs", 0, lease[1]), ("sess", 0, None)]
            assert one(holder, "SELECT stage_e_holding('sess', 0)") is True
            assert observer.execute("SELECT cap, acquired FROM stage_e_throttle_counter "
                                    "ORDER BY cap").fetchall() == [("jobs", jobs_before + 1),
                                                                   ("sess", 1)]
            # The flusher writes the lease into the journal (the flush interval is 200 ms).
            wait_for(lambda: one(observer, "SELECT leases FROM stage_e_lease_horizon "
                                           "WHERE cap = 'jobs'") not in (None, []),
                     timeout=30, interval=0.1, what="the lease in the journal")
            row = observer.execute("SELECT leases, horizon >= now() + '29 s'::interval "
                                   "FROM stage_e_lease_horizon WHERE cap = 'jobs'").fetchone()
            assert row[0][0][:2] == [0, lease[1]] and row[1] is True
        c.crash()
        c.start()
        with c.connect("v050") as s:
            held = s.execute("SELECT cap, reason FROM stage_e_held_back").fetchall()
            assert held == [("jobs", "crash")]
            assert s.execute("SELECT * FROM stage_e_lease('jobs', 1, '1 s')").fetchone() == (
                None, None)
            assert one(s, "SELECT stage_e_renew('jobs', 0, %s::bigint, '5 s')",
                       (lease[1],)) is True
            assert s.execute("SELECT slot, token FROM stage_e_slot_holders WHERE cap = 'jobs'"
                             ).fetchall() == [(0, lease[1])]
        c.create_database("fresh6")
        assert describe(c, "v050") == describe(c, "fresh6")
    finally:
        c.destroy()


def test_a_0_6_0_database_refuses_a_colliding_name_until_updated_then_records_every_key():
    """The 0.7.0 library serves a 0.6.0 database as 0.6.0 did: a name colliding with a cap in
    use is refused (42710). The update keeps the holder and the counts, records each row's key
    (the one its cap had: the FNV key, and stage_e_slots.lock_key for `default`), and from then
    on the colliding name gets a key of its own."""
    c = Cluster("upgrade060", {"stage_e_slots.flush_interval": "'1h'"}).init().start()
    try:
        c.create_database("v060", extension=False)
        c.sql("CREATE EXTENSION stage_e_slots VERSION '0.6.0'", dbname="v060")
        with c.connect("v060", "holder") as holder, c.connect("v060", "other") as other:
            assert one(holder, "SELECT stage_e_try_slot('exports', 2)") == 0
            assert one(holder, "SELECT stage_e_try_slot(1)") == 0
            lease = holder.execute("SELECT * FROM stage_e_lease('jobs', 1, '1 hour')"
                                   ).fetchone()
            holder.execute("SELECT stage_e_flush()")
            with pytest.raises(errors.DuplicateObject, match='as cap "exports"'):
                other.execute("SELECT stage_e_try_slot('sq4130751234', 1)")
            keys = dict(other.execute(
                "SELECT cap, stage_e_cap_key(cap) FROM stage_e_throttle_counter").fetchall())
            assert keys == {"default": KEY, "exports": 1_751_787_301,
                            "jobs": one(other, "SELECT stage_e_cap_key('jobs')")}

            other.execute("ALTER EXTENSION stage_e_slots UPDATE")
            assert one(other, "SELECT extversion FROM pg_extension "
                              "WHERE extname = 'stage_e_slots'") == CURRENT
            assert dict(other.execute("SELECT cap, lock_key FROM stage_e_throttle_counter"
                                      ).fetchall()) == keys
            assert other.execute("SELECT cap, acquired FROM stage_e_throttle_counter "
                                 "ORDER BY cap").fetchall() == [
                ("default", 1), ("exports", 1), ("jobs", 1)]
            assert one(holder, "SELECT stage_e_holding('exports', 0)") is True
            assert other.execute("SELECT cap, slot, token FROM stage_e_slot_holders "
                                 "ORDER BY cap").fetchall() == [
                ("default", 0, None), ("exports", 0, None), ("jobs", 0, lease[1])]
            # Now the colliding name gets its next key, and both caps hold slot 0.
            assert one(other, "SELECT stage_e_try_slot('sq4130751234', 1)") == 0
            assert one(other, "SELECT stage_e_cap_key('sq4130751234')") != 1_751_787_301
            assert one(holder, "SELECT stage_e_release('exports', 0)") is True
        c.create_database("fresh7")
        assert describe(c, "v060") == describe(c, "fresh7")
    finally:
        c.destroy()


def test_a_0_7_0_database_is_served_without_histograms_then_updated_keeps_its_rows():
    """The 0.8.0 library serves a 0.7.0 database as 0.7.0 did: stage_e_stats() without `n`,
    flushes that write the counters only (its table has no histogram columns). The update keeps
    the rows, the holder and the lease, gives the old rows empty histograms, and from then on
    flushes add each cap's histograms; `n` shows the cap's current n."""
    c = Cluster("upgrade070", {"stage_e_slots.flush_interval": "'1h'"}).init().start()
    try:
        c.create_database("v070", extension=False)
        c.sql("CREATE EXTENSION stage_e_slots VERSION '0.7.0'", dbname="v070")
        with c.connect("v070", "holder") as holder, c.connect("v070", "other") as other:
            assert one(holder, "SELECT stage_e_try_slot('exports', 2)") == 0
            lease = holder.execute("SELECT * FROM stage_e_lease('jobs', 1, '1 hour')"
                                   ).fetchone()
            assert one(other, "SELECT stage_e_release('exports', stage_e_try_slot('exports', 2))"
                       ) is True
            cur = other.execute("SELECT * FROM stage_e_stats() ORDER BY cap")
            assert [d.name for d in cur.description][:4] == ["cap", "max_slots", "held",
                                                             "acquired"]
            assert [r[:4] for r in cur.fetchall()] == [("exports", 1024, 1, 2),
                                                       ("jobs", 1024, 1, 1)]
            holder.execute("SELECT stage_e_flush()")
            assert other.execute("SELECT cap, acquired, released FROM stage_e_throttle_counter "
                                 "ORDER BY cap").fetchall() == [("exports", 2, 1), ("jobs", 1, 0)]
            with pytest.raises(errors.UndefinedFunction):
                other.execute("SELECT * FROM stage_e_histograms()")
            other.rollback()

            other.execute("ALTER EXTENSION stage_e_slots UPDATE")
            assert one(other, "SELECT extversion FROM pg_extension "
                              "WHERE extname = 'stage_e_slots'") == CURRENT
            zero = [0] * 13
            assert other.execute("SELECT cap, acquired, released, hold_buckets, wait_buckets "
                                 "FROM stage_e_throttle_counter ORDER BY cap").fetchall() == [
                ("exports", 2, 1, zero, zero), ("jobs", 1, 0, zero, zero)]
            assert one(holder, "SELECT stage_e_holding('exports', 0)") is True
            assert other.execute("SELECT cap, slot, token FROM stage_e_slot_holders "
                                 "ORDER BY cap").fetchall() == [
                ("exports", 0, None), ("jobs", 0, lease[1])]
            assert other.execute("SELECT cap, held, n FROM stage_e_stats() ORDER BY cap"
                                 ).fetchall() == [("exports", 1, 2), ("jobs", 1, 1)]
            # Both holds are in the histograms since the caps were made; the row of `exports`
            # was flushed before the update (its table had no histograms), so only the lease's
            # release, after it, reaches a row.
            assert one(holder, "SELECT stage_e_release_lease('jobs', %s, %s)", lease[:2]) is True
            assert other.execute("SELECT cap, seconds_count FROM stage_e_histograms() "
                                 "WHERE metric = 'hold' ORDER BY cap").fetchall() == [
                ("exports", 1), ("jobs", 1)]
            holder.execute("SELECT stage_e_flush()")
            assert [sum(h) for (h,) in other.execute(
                "SELECT hold_buckets FROM stage_e_throttle_counter ORDER BY cap").fetchall()] == [
                0, 1]
        c.create_database("fresh8")
        assert describe(c, "v070") == describe(c, "fresh8")
    finally:
        c.destroy()


def test_a_0_8_0_database_is_served_without_adaptive_caps_then_updated_keeps_its_rows():
    """The 0.9.0 library serves a 0.8.0 database as 0.8.0 did (no stage_e_adapt; its flushes
    write the counters and histograms only). The update keeps the rows, the holder and the
    lease; the old rows have no policy; then stage_e_adapt works on a cap with a row and on
    one without, its policy is in the rows and applies (the caller's n is cut to the limit); a
    flush writes the learned limit; the schema equals a fresh install's."""
    c = Cluster("upgrade080", {"stage_e_slots.flush_interval": "'1h'"}).init().start()
    try:
        c.create_database("v080", extension=False)
        c.sql("CREATE EXTENSION stage_e_slots VERSION '0.8.0'", dbname="v080")
        with c.connect("v080", "holder") as holder, c.connect("v080", "other") as other:
            assert one(holder, "SELECT stage_e_try_slot('exports', 4)") == 0
            lease = holder.execute("SELECT * FROM stage_e_lease('jobs', 1, '1 hour')"
                                   ).fetchone()
            holder.execute("SELECT stage_e_flush()")
            with pytest.raises(errors.UndefinedFunction):
                other.execute("SELECT stage_e_adapt('exports', 1, 2)")
            other.rollback()

            other.execute("ALTER EXTENSION stage_e_slots UPDATE")
            assert one(other, "SELECT extversion FROM pg_extension "
                              "WHERE extname = 'stage_e_slots'") == CURRENT
            assert other.execute(
                "SELECT cap, acquired, adapt_min, adapt_max, adapt_enforce, adapt_limit "
                "FROM stage_e_throttle_counter ORDER BY cap").fetchall() == [
                ("exports", 1, None, None, None, None), ("jobs", 1, None, None, None, None)]
            assert one(holder, "SELECT stage_e_holding('exports', 0)") is True
            assert other.execute("SELECT cap, slot, token FROM stage_e_slot_holders "
                                 "ORDER BY cap").fetchall() == [
                ("exports", 0, None), ("jobs", 0, lease[1])]

            # A policy on a cap with a row, and one on a cap without: both rows keep it.
            other.execute("SELECT stage_e_adapt('exports', 2, 2)")
            other.execute("SELECT stage_e_adapt('fresh', 1, 3, false)")
            assert other.execute(
                "SELECT cap, acquired, adapt_min, adapt_max, adapt_enforce "
                "FROM stage_e_throttle_counter ORDER BY cap").fetchall() == [
                ("exports", 1, 2, 2, True), ("fresh", 0, 1, 3, False),
                ("jobs", 1, None, None, None)]
            assert other.execute('SELECT cap, "limit", min_slots, max_slots, enforce '
                                 "FROM stage_e_cap_limits").fetchall() == [
                ("exports", 2, 2, 2, True), ("fresh", 1, 1, 3, False)]
            # The holder keeps slot 0; n = 4 is cut to the limit 2: one more slot, then none.
            assert one(other, "SELECT stage_e_try_slot('exports', 4)") == 1
            assert one(other, "SELECT stage_e_try_slot('exports', 4)") is None
            holder.execute("SELECT stage_e_flush()")
        c.create_database("fresh9")
        assert describe(c, "v080") == describe(c, "fresh9")
    finally:
        c.destroy()


def test_a_0_9_0_database_is_served_without_rate_limits_then_updated_keeps_its_rows(uc):
    """The 0.10.0 library serves a 0.9.0 database as 0.9.0 did (no stage_e_try_rate). The
    update keeps the rows, the holder, the lease and the adaptive policy; then
    stage_e_try_rate works (a burst of 2, then denied), and a rate policy on a cap with a row
    is kept in it and binds; the schema equals a fresh install's."""
    uc.create_database("v090", extension=False)
    uc.sql("CREATE EXTENSION stage_e_slots VERSION '0.9.0'", dbname="v090")
    with uc.connect("v090", "holder") as holder, uc.connect("v090", "other") as other:
        assert one(holder, "SELECT stage_e_try_slot('exports', 4)") == 0
        lease = holder.execute("SELECT * FROM stage_e_lease('jobs', 1, '1 hour')").fetchone()
        holder.execute("SELECT stage_e_adapt('exports', 1, 3)")
        holder.execute("SELECT stage_e_flush()")
        with pytest.raises(errors.UndefinedFunction):
            other.execute("SELECT * FROM stage_e_try_rate('api', 1, '1 min', 2)")
        other.rollback()
        columns = "SELECT * FROM stage_e_stats() WHERE cap = 'exports'"
        cur = other.execute(columns)
        assert [d.name for d in cur.description][-2:] == ["hold_time", "expired"]
        assert cur.fetchone()[4] == 1  # acquired, through 0.9.0's symbol

        other.execute("ALTER EXTENSION stage_e_slots UPDATE")
        cur = other.execute(columns)
        assert [d.name for d in cur.description][-2:] == ["expired", "rate_limited"]
        assert cur.fetchone()[4] == 1
        assert one(other, "SELECT extversion FROM pg_extension "
                          "WHERE extname = 'stage_e_slots'") == CURRENT
        assert other.execute(
            "SELECT cap, acquired, adapt_min, adapt_max FROM stage_e_throttle_counter "
            "ORDER BY cap").fetchall() == [("exports", 1, 1, 3), ("jobs", 1, None, None)]
        assert one(holder, "SELECT stage_e_holding('exports', 0)") is True
        assert other.execute("SELECT cap, slot, token FROM stage_e_slot_holders "
                             "ORDER BY cap").fetchall() == [
            ("exports", 0, None), ("jobs", 0, lease[1])]
        rate = "SELECT allowed FROM stage_e_try_rate('api', 1, '1 min', 2)"
        assert [one(other, rate) for _ in range(3)] == [True, True, False]
        # A rate policy on a cap with a row: kept in it, and it binds.
        other.execute("SELECT stage_e_rate_limit('jobs', 1, '1 min')")
        assert other.execute("SELECT rate_count, rate_per, rate_burst FROM "
                             "stage_e_throttle_counter WHERE cap = 'jobs'").fetchone() == (
            1, timedelta(minutes=1), 1)
        assert [one(other, "SELECT stage_e_try_slot('jobs', 4)") for _ in range(2)] == [1, None]
    uc.create_database("fresh10")
    assert describe(uc, "v090") == describe(uc, "fresh10")


def test_a_0_10_0_database_is_served_without_shares_then_updated_keeps_its_rows(uc):
    """The 0.11.0 library serves a 0.10.0 database as 0.10.0 did: no share forms, holders
    without a share column (through 0.10.0's symbols). The update keeps the rows, the holder,
    the lease and the rate policy; the holders gain share (NULL for slots taken in none); then
    stage_e_share keeps a policy in stage_e_share_policy and it binds (a share at its ceiling
    gets NULL while another share takes the next slot); the schema equals a fresh install's."""
    uc.create_database("v0100", extension=False)
    uc.sql("CREATE EXTENSION stage_e_slots VERSION '0.10.0'", dbname="v0100")
    with uc.connect("v0100", "holder") as holder, uc.connect("v0100", "other") as other:
        assert one(holder, "SELECT stage_e_try_slot('exports', 4)") == 0
        lease = holder.execute("SELECT * FROM stage_e_lease('jobs', 1, '1 hour')").fetchone()
        holder.execute("SELECT stage_e_rate_limit('api', 100, '1 s', 10)")
        holder.execute("SELECT stage_e_flush()")
        with pytest.raises(errors.UndefinedFunction):
            other.execute("SELECT stage_e_try_slots('exports', 4, 1, '0', 'tenant-a')")
        other.rollback()
        holders = "SELECT * FROM stage_e_slot_holders ORDER BY cap"
        cur = other.execute(holders)
        assert [d.name for d in cur.description][-1] == "expires_at"
        assert len(cur.fetchall()) == 2  # through 0.10.0's symbol

        other.execute("ALTER EXTENSION stage_e_slots UPDATE")
        assert one(other, "SELECT extversion FROM pg_extension "
                          "WHERE extname = 'stage_e_slots'") == CURRENT
        assert other.execute(
            "SELECT cap, acquired, rate_count FROM stage_e_throttle_counter "
            "ORDER BY cap").fetchall() == [("api", 0, 100), ("exports", 1, None),
                                           ("jobs", 1, None)]
        assert one(holder, "SELECT stage_e_holding('exports', 0)") is True
        assert other.execute("SELECT cap, slot, token, share FROM stage_e_slot_holders "
                             "ORDER BY cap").fetchall() == [
            ("exports", 0, None, None), ("jobs", 0, lease[1], None)]
        assert other.execute("SELECT * FROM stage_e_shares").fetchall() == []
        # A policy, kept in its table; it binds from the commit (autocommit here).
        other.execute("SELECT stage_e_share('exports', 'tenant-a', 2, 1)")
        assert other.execute("SELECT cap, share, weight, max_slots FROM stage_e_share_policy"
                             ).fetchall() == [("exports", "tenant-a", 2, 1)]
        take = "SELECT stage_e_try_slots('exports', 4, 1, '0', %s)"
        assert one(other, take, ("tenant-a",)) == [1]
        assert one(other, take, ("tenant-a",)) is None  # at its ceiling of 1
        assert one(other, take, ("tenant-b",)) == [2]
        # The holder's slot 0 was taken in no share: it counts in none.
        assert other.execute("SELECT share, weight, max_slots, held FROM stage_e_shares "
                             "WHERE cap = 'exports' ORDER BY share").fetchall() == [
            ("tenant-a", 2, 1, 1), ("tenant-b", 1, None, 1)]
    uc.create_database("fresh11")
    assert describe(uc, "v0100") == describe(uc, "fresh11")


def update_chain():
    """The versions from 0.1.0 to the current one, one update script of sql/ at a time."""
    steps = {}
    for path in (ROOT / "sql").glob("stage_e_slots--*--*.sql"):
        old, new = path.name.removesuffix(".sql").split("--")[1:]
        steps.setdefault(old, []).append(new)
    chain = ["0.1.0"]
    while chain[-1] != CURRENT:
        assert len(steps.get(chain[-1], [])) == 1, f"the updates from {chain[-1]}: {steps}"
        chain.append(steps[chain[-1]][0])
        assert len(chain) <= len(steps) + 1, f"the updates loop: {chain}"
    # Every update script is a step of it.
    assert len(chain) - 1 == sum(len(v) for v in steps.values()), (chain, steps)
    return chain


def test_every_update_one_step_at_a_time_with_a_slot_held_across_each(uc):
    """0.1.0 to the current version, one ALTER EXTENSION ... UPDATE TO at a time (the versions
    from sql/'s update scripts), a session holding a slot of `default` across every step and,
    from 0.4.0 on, a lease too. After each step: the version is the step's, the holder still
    holds its lock (pg_locks, and stage_e_holding), the cap still binds, the holders view
    shows it. At the end the counts made along the way are all there, and the schema is a
    fresh install's."""
    chain = update_chain()
    assert chain[0] == "0.1.0" and chain[-1] == CURRENT and len(chain) >= 9, chain
    uc.create_database("chain", extension=False)
    uc.sql("CREATE EXTENSION stage_e_slots VERSION '0.1.0'", dbname="chain")
    with uc.connect("chain", "holder") as holder, uc.connect("chain", "other") as other, \
            uc.connect("chain", "observer") as observer:
        assert one(holder, "SELECT stage_e_try_slot(1)") == 0
        lease = None
        for i, version in enumerate(chain):
            if i:
                observer.execute(f"ALTER EXTENSION stage_e_slots UPDATE TO '{version}'")
            assert one(observer, "SELECT extversion FROM pg_extension "
                                 "WHERE extname = 'stage_e_slots'") == version
            assert slot_lock_holders(observer) == [(0, holder.info.backend_pid)], version
            assert one(holder, "SELECT stage_e_holding(0)") is True, version
            assert one(other, "SELECT stage_e_try_slot(1)") is None, version  # a throttle
            if version == "0.4.0":
                lease = other.execute("SELECT * FROM stage_e_lease('jobs', 1, '1 hour')"
                                      ).fetchone()
                assert lease[0] == 0
            if lease is not None:
                assert observer.execute(
                    "SELECT cap, slot, pid, token FROM stage_e_slot_holders ORDER BY cap"
                ).fetchall() == [("default", 0, holder.info.backend_pid, None),
                                 ("jobs", 0, other.info.backend_pid, lease[1])], version
                assert other.execute("SELECT * FROM stage_e_lease('jobs', 1, '1 hour')"
                                     ).fetchone() == (None, None), version
            elif i:
                assert observer.execute("SELECT cap, slot, pid FROM stage_e_slot_holders"
                                        ).fetchall() == [
                    ("default", 0, holder.info.backend_pid)], version
        assert lease is not None
        # Nothing was flushed on the way (flush_interval is an hour): every count made at any
        # version was still pending across the later updates, and is in the totals.
        steps_with_lease = len(chain) - chain.index("0.4.0")
        assert observer.execute("SELECT cap, acquired, throttled FROM stage_e_throttle_totals "
                                "ORDER BY cap").fetchall() == [
            ("default", 1, len(chain)), ("jobs", 1, steps_with_lease)]
        observer.execute("SELECT stage_e_flush()")
        assert observer.execute("SELECT cap, acquired, throttled FROM stage_e_throttle_counter "
                                "ORDER BY cap").fetchall() == [
            ("default", 1, len(chain)), ("jobs", 1, steps_with_lease)]
        assert one(holder, "SELECT stage_e_release('default', 0)") is True
        assert one(other, "SELECT stage_e_release_lease('jobs', 0, %s)", (lease[1],)) is True
    uc.create_database("fresh_chain")
    assert describe(uc, "chain") == describe(uc, "fresh_chain")


def test_the_readmes_package_names_carry_the_version_of_cargo_toml():
    """The artifacts the README names (the .deb, the tarball and its folder), and the wheel
    python/README.md names, are of the version `make package` builds now, Cargo.toml's."""
    text = (ROOT / "README.md").read_text() + (ROOT / "python" / "README.md").read_text()
    names = re.findall(r"stage[-_]e[-_]slots[-_](\d+\.\d+\.\d+)", text)
    assert len(names) >= 4, names  # the .deb twice, the tarball, its folder
    assert set(names) == {CURRENT}


SECURITY_DEFINERS = """
SELECT p.oid::regprocedure::text, p.prosecdef, p.proconfig
  FROM pg_depend d
  JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'stage_e_slots'
  JOIN pg_proc p ON p.oid = d.objid AND d.classid = 'pg_proc'::regclass
 WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
   AND (p.prosecdef OR p.proconfig IS NOT NULL)
 ORDER BY 1
"""


def test_no_version_has_a_security_definer_function_and_the_comparison_sees_one(uc):
    """docs/security.md: "There are no `SECURITY DEFINER` functions." None at any version (a
    database not yet updated runs its version's functions), none with SET options either (the
    pinned search_path is set by the statements the extension runs, not by function options).
    And the schema comparison of the update tests sees the difference: a fresh install with one
    function made SECURITY DEFINER (or given a SET option) no longer compares equal."""
    security = " ".join((ROOT / "docs" / "security.md").read_text().split())
    assert "There are no `SECURITY DEFINER` functions." in security
    for version in update_chain():
        db = "secdef_" + version.replace(".", "_")
        uc.create_database(db, extension=False)
        uc.sql(f"CREATE EXTENSION stage_e_slots VERSION '{version}'", dbname=db)
        assert uc.sql(SECURITY_DEFINERS, dbname=db) == [], version
    uc.create_database("secdef_fresh")
    uc.create_database("secdef_altered")
    assert describe(uc, "secdef_altered") == describe(uc, "secdef_fresh")
    uc.sql("ALTER FUNCTION stage_e_cap_key(text) SECURITY DEFINER", dbname="secdef_altered")
    assert uc.sql(SECURITY_DEFINERS, dbname="secdef_altered") == [
        ("stage_e_cap_key(text)", True, None)]
    assert describe(uc, "secdef_altered") != describe(uc, "secdef_fresh")
    uc.sql("ALTER FUNCTION stage_e_cap_key(text) SECURITY INVOKER", dbname="secdef_altered")
    assert describe(uc, "secdef_altered") == describe(uc, "secdef_fresh")
    uc.sql("ALTER FUNCTION stage_e_cap_key(text) SET search_path = public",
           dbname="secdef_altered")
    assert describe(uc, "secdef_altered") != describe(uc, "secdef_fresh")
