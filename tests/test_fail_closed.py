"""Bad input, missing preload, standby, settings: clear errors, never an uncapped slot."""

import psycopg
import pytest
from conftest import KEY, extension_calls, one, slot_lock_holders, stats
from pgcluster import Cluster, bindir, wait_for
from psycopg import errors

BAD_CALLS = [
    ("SELECT stage_e_try_slot(NULL)", "n must not be NULL"),
    ("SELECT stage_e_try_slot(0)", "between 1 and stage_e_slots.max_slots (1024)"),
    ("SELECT stage_e_try_slot(-3)", "between 1 and stage_e_slots.max_slots (1024)"),
    ("SELECT stage_e_try_slot(1025)", "between 1 and stage_e_slots.max_slots (1024)"),
    ("SELECT stage_e_release(NULL)", "slot must not be NULL"),
    ("SELECT stage_e_release(-1)", "numbered 0 to 1023"),
    ("SELECT stage_e_release(1024)", "numbered 0 to 1023"),
    ("SELECT stage_e_holding(NULL)", "slot must not be NULL"),
    ("SELECT stage_e_holding(-1)", "numbered 0 to 1023"),
    ("SELECT stage_e_holding(5000)", "numbered 0 to 1023"),
]


@pytest.mark.parametrize("call,bound", BAD_CALLS)
def test_bad_input_is_a_class_22_error_naming_the_bound_and_changes_nothing(connect, call, bound):
    c, observer = connect(), connect("observer")
    assert one(c, "SELECT stage_e_try_slot(4)") == 0
    before = stats(observer)
    with pytest.raises(psycopg.Error) as err:
        c.execute(call)
    diag = err.value.diag
    assert diag.sqlstate.startswith("22"), diag.sqlstate
    assert bound in (diag.message_primary + " " + (diag.message_detail or ""))
    assert stats(observer) == before
    assert slot_lock_holders(observer) == [(0, c.info.backend_pid)]


def test_every_refusal_names_the_sql_function_called(connect):
    """Issue 35: verbose errors said `LOCATION: stage_e_slots, errors.rs:29` for every refusal.
    Each now names the function called: for a bad argument (a NULL), for a cap name refused as
    the function reads it (an empty one, a name refused before the function's body ran), and
    for a WARNING, every function that takes a cap."""
    c = connect()
    calls = [(sig, call) for sig, _, call in extension_calls(c) if "(text" in sig]
    assert len({sig for sig, _ in calls}) >= 12
    for sig, call in calls:
        function = sig.split("(")[0]
        with pytest.raises(psycopg.DataError) as err:  # class 22
            c.execute("SELECT * FROM " + call.replace("('k'", "(''", 1))
        assert_names_the_function(err, function, call)
        with pytest.raises(psycopg.DataError) as err:
            c.execute("SELECT * FROM " + call.replace("('k'", "(NULL", 1))
        assert_names_the_function(err, function, call)
    with pytest.raises(psycopg.DataError) as err:
        c.execute("SELECT stage_e_try_slot(0)")
    assert_names_the_function(err, "stage_e_try_slot", "stage_e_try_slot(0)")
    warnings = []
    # (A notice's fields are read in the handler: psycopg frees them after it.)
    c.add_notice_handler(lambda d: warnings.append((d.severity, d.source_function)))
    assert one(c, "SELECT stage_e_release('k', 0)") is False
    assert warnings == [("WARNING", "stage_e_release")]


@pytest.mark.parametrize("storage", ["main", "external"])
def test_a_cap_name_read_from_a_stored_value_is_read_whole(connect, storage):
    """A cap argument that is not an inline, uncompressed value (a column's compressed
    value, or one stored out of line) is read through PostgreSQL's detoast, not as the
    bytes of its header: a 6,000-byte name is refused as too long, naming its length and
    the function, and a short name read from the same column is the same cap as a
    literal."""
    c, observer = connect(), connect("observer")
    c.execute(f"""CREATE TEMP TABLE names (name text);
                  ALTER TABLE names ALTER name SET STORAGE {storage}""")
    c.execute("INSERT INTO names VALUES (repeat('ab', 3000)), ('stored')")
    # The long value is compressed inline (main) or kept out of line (external).
    kind = "compressed" if storage == "main" else "external"
    stored = one(c, "SELECT pg_column_size(name) < 6000 FROM names WHERE length(name) > 63")
    assert stored is (kind == "compressed"), kind
    before = stats(observer)
    with pytest.raises(psycopg.DataError) as err:
        c.execute("SELECT stage_e_try_slot(name, 8) FROM names WHERE length(name) > 63")
    assert "6000" in err.value.diag.message_primary + (err.value.diag.message_detail or "")
    assert_names_the_function(err, "stage_e_try_slot", kind)
    assert stats(observer) == before
    assert one(c, "SELECT stage_e_try_slot(name, 8) FROM names WHERE name = 'stored'") == 0
    assert one(c, "SELECT stage_e_holding('stored', 0)") is True


def test_bad_input_does_not_throttle_or_foreign_count(connect):
    c = connect()
    for call, _ in BAD_CALLS:
        with pytest.raises(psycopg.Error) as err:
            c.execute(call)
        assert err.value.diag.sqlstate.startswith("22")
    s = stats(c)
    assert (s["acquired"], s["throttled"], s["released"], s["foreign_releases"]) == (0, 0, 0, 0)


def test_reserved_prefix_rejects_typos(connect):
    c = connect()
    with pytest.raises(psycopg.Error, match="reserved prefix"):
        c.execute("SET stage_e_slots.max_slot = 5")
    assert one(c, "SHOW stage_e_slots.max_slots") == "1024"
    assert one(c, "SHOW stage_e_slots.lock_key") == str(KEY)
    with pytest.raises(errors.CantChangeRuntimeParam):
        c.execute("SET stage_e_slots.max_slots = 5")


@pytest.fixture(scope="module")
def not_preloaded():
    c = Cluster("nopreload", {"shared_preload_libraries": "''"}).init().start()
    c.sql("CREATE EXTENSION stage_e_slots")
    yield c
    c.destroy()


def assert_names_the_function(err, function, call):
    """A report's LOCATION (verbose clients, log_error_verbosity = verbose) names the SQL
    function called and the line of ours that decided it, not the plumbing that reports it."""
    d = err.value.diag
    assert d.source_function == function, (call, d.source_function)
    assert d.source_file and d.source_file.endswith(".rs"), (call, d.source_file)
    assert not d.source_file.endswith(("errors.rs", "report.rs")), (call, d.source_file)


def assert_not_preloaded_error(c, call, function=None):
    with pytest.raises(errors.ObjectNotInPrerequisiteState) as err:
        c.execute(call)
    if function is not None:
        assert_names_the_function(err, function, call)
    assert "shared_preload_libraries" in err.value.diag.message_primary, call
    assert "shared_preload_libraries = 'stage_e_slots'" in err.value.diag.message_hint, call
    # And nothing was locked behind the error.
    assert one(c, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'") == 0, call


@pytest.mark.parametrize("view", [
    "stage_e_slot_holders", "stage_e_throttle_totals", "stage_e_slot_waiters",
    "stage_e_cap_load", "stage_e_histogram_quantiles", "stage_e_cap_limits",
    "stage_e_held_back", "stage_e_rate_limits",
])
def test_not_preloaded_every_view_errors_with_a_hint(not_preloaded, view):
    with not_preloaded.connect() as c:
        assert_not_preloaded_error(c, f"SELECT * FROM {view}")


def test_not_preloaded_every_function_errors_with_a_hint(not_preloaded):
    """Every function of the extension, every form (from the catalog:
    conftest.extension_calls), reads included."""
    with not_preloaded.connect() as c:
        calls = extension_calls(c)
        assert len({sig for sig, _, _ in calls}) >= 30
        for sig, _, call in calls:
            assert_not_preloaded_error(c, f"SELECT * FROM {call}", sig.split("(")[0])


def test_custom_key_and_bounds_are_honoured():
    c = Cluster("custom", {
        "stage_e_slots.lock_key": 77,
        "stage_e_slots.max_slots": 16,
        "stage_e_slots.max_caps": 16,
    }).init().start()
    try:
        c.sql("CREATE EXTENSION stage_e_slots")
        with c.connect() as s, c.connect() as raw:
            assert one(s, "SELECT stage_e_try_slot(16)") == 0
            row = raw.execute("SELECT classid::int, objid::int, objsubid FROM pg_locks "
                              "WHERE locktype = 'advisory' AND pid = %s",
                              (s.info.backend_pid,)).fetchone()
            assert row == (77, 0, 2)
            assert one(raw, "SELECT pg_try_advisory_lock(77, 0)") is False
            with pytest.raises(errors.InvalidParameterValue, match="out of range") as err:
                s.execute("SELECT stage_e_try_slot(17)")
            assert "(16)" in err.value.diag.message_detail
            assert one(s, "SELECT max_slots FROM stage_e_stats()") == 16
            assert one(s, "SELECT stage_e_cap_key('default')") == 77
            # Caps in use fill max_caps (16; each holds a slot): the 17th is refused, never
            # given an uncapped slot.
            for i in range(15):
                assert one(s, "SELECT stage_e_try_slot(%s, 1)", (f"cap-{i}",)) == 0
            with pytest.raises(errors.ConfigurationLimitExceeded) as err:
                s.execute("SELECT stage_e_try_slot('one too many', 1)")
            assert "stage_e_slots.max_caps" in err.value.diag.message_hint
            assert "16 caps" in err.value.diag.message_detail
            assert one(raw, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'") == 16
    finally:
        c.destroy()


def test_hot_standby_refuses_slots_and_reports_what_is_true_there():
    primary = Cluster("primary").init().start()
    standby = Cluster("standby", port=5434)
    try:
        primary.sql("CREATE EXTENSION stage_e_slots")
        with primary.connect() as p, primary.connect() as q:
            assert one(p, "SELECT stage_e_try_slot(1)") == 0
            assert one(q, "SELECT stage_e_try_slot(1)") is None
            q.execute("SELECT stage_e_flush()")
            flushed_row = q.execute("SELECT throttled, acquired, flush_id "
                                    "FROM stage_e_throttle_counter").fetchone()
        assert flushed_row[:2] == (1, 1)
        standby.start_as_standby_of(primary)
        with standby.connect() as s:
            wait_for(lambda: one(s, "SELECT pg_is_in_recovery()"), what="standby in recovery")
            # Every function of the extension, every form (from the catalog): those that act
            # are refused, those that read work and show what is true here.
            acts = 0
            for _, kind, call in extension_calls(s):
                if kind == "reads":
                    s.execute(f"SELECT * FROM {call}").fetchall()
                    continue
                acts += 1
                with pytest.raises(errors.ReadOnlySqlTransaction) as err:
                    s.execute(f"SELECT * FROM {call}")
                assert "standby" in err.value.diag.message_primary, call
                assert "primary" in err.value.diag.message_hint, call
            assert acts >= 20
            assert one(s, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'") == 0
            # What is true on the standby: the settings, the replicated row, nothing held or
            # pending here.
            snap = one(s, "SELECT stage_e_snapshot()")
            assert snap["config"]["max_slots"] == 1024 and snap["held"] == 0
            cap = snap["caps"][0]
            assert (cap["cap"], cap["flushed"]["throttled"], cap["flushed"]["acquired"]) == (
                "default", 1, 1)
            assert cap["pending"] == dict.fromkeys(cap["pending"], 0)
            assert snap["holders"] == []
            t = s.execute("SELECT cap, throttled, acquired, pending_throttled "
                          "FROM stage_e_throttle_totals").fetchall()
            assert t == [("default", 1, 1, 0)]
            assert s.execute("SELECT * FROM stage_e_stats()").fetchall() == []
            assert s.execute("SELECT * FROM stage_e_slot_holders").fetchall() == []
            assert s.execute("SELECT * FROM stage_e_pending()").fetchall() == []
            assert s.execute("SELECT * FROM stage_e_cap_limits").fetchall() == []
            assert s.execute("SELECT * FROM stage_e_rate_limits").fetchall() == []
            # The flush launcher waits for promotion instead of writing or crash-looping.
            launcher = ("SELECT count(*) FROM pg_stat_activity "
                        "WHERE backend_type = 'stage_e_slots launcher'")
            assert one(s, launcher) == 0
            assert "stage_e_slots launcher" not in standby.log_text()
        standby._run(str(bindir() / "pg_ctl"), "-D", str(standby.data), "-w", "promote")
        with standby.connect() as s:
            wait_for(lambda: one(s, launcher) == 1, what="the launcher after promotion")
            assert one(s, "SELECT stage_e_try_slot(8)") == 0
    finally:
        standby.destroy()
        primary.destroy()


def test_the_suite_runs_on_the_major_pg_config_names(cluster):
    """`make test PG=18` must really test 18: the cluster is the one PG_CONFIG names."""
    import re
    import subprocess

    from pgcluster import PG_CONFIG
    want = re.search(r"(\d+)", subprocess.check_output([PG_CONFIG, "--version"], text=True))
    got = int(cluster.sql("SHOW server_version_num")[0][0]) // 10000
    print(f"\nPostgreSQL {got} from {PG_CONFIG}")
    assert got == int(want.group(1))


SETTINGS = {
    # name: (min, max, unit, context)
    "stage_e_slots.max_slots": ("1", "65536", None, "postmaster"),
    "stage_e_slots.lock_key": ("0", "2147483647", None, "postmaster"),
    "stage_e_slots.max_caps": ("16", "1048576", None, "postmaster"),
    "stage_e_slots.slot_memory": ("64", "1048576", "kB", "postmaster"),
    "stage_e_slots.max_leases": ("16", "1048576", None, "postmaster"),
    "stage_e_slots.flush_interval": ("100", "3600000", "ms", "sighup"),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_every_setting_has_its_documented_bounds_and_context(connect, name):
    lo, hi, unit, context = SETTINGS[name]
    c = connect()
    assert c.execute("SELECT min_val, max_val, unit, context FROM pg_settings WHERE name = %s",
                     (name,)).fetchone() == (lo, hi, unit, context)
    for bad in [int(lo) - 1, int(hi) + 1]:
        with pytest.raises(errors.InvalidParameterValue, match="outside the valid range|exceeds"):
            c.execute(f"ALTER SYSTEM SET {name} = {bad}")
    # None of them can be changed by a session: they size shared memory, name its locks, or
    # pace a server-wide worker.
    with pytest.raises(errors.CantChangeRuntimeParam):
        c.execute(f"SET {name} = {lo}")
    c.execute(f"ALTER SYSTEM RESET {name}")
