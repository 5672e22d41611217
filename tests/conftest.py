"""Fixtures: real clusters started from the installed extension, real sessions (psycopg)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from pgcluster import PG_CONFIG, Cluster, wait_for

KEY = 20260725  # the documented default stage_e_slots.lock_key

# A PostgreSQL 15 database moved to 18 needs both builds: it runs in the 18 run only.
_MAJOR = re.search(r"(\d+)", subprocess.check_output([PG_CONFIG, "--version"], text=True)).group(1)
collect_ignore = [] if _MAJOR == "18" else ["test_cross_major.py"]
# The driver matrix runs on one major (the CI time budget): 15; STAGE_E_DRIVER_TESTS=1 forces it
# on (to run it on 18 while developing), STAGE_E_DRIVER_TESTS=0 leaves it out.
_DRIVERS = os.environ.get("STAGE_E_DRIVER_TESTS", "1" if _MAJOR == "15" else "0")
if _DRIVERS != "1":
    collect_ignore.append("test_drivers.py")
# So does the Patroni switchover and failover test (etcd and two Patroni-managed nodes);
# STAGE_E_PATRONI_TESTS=1 forces it on, =0 leaves it out.
if os.environ.get("STAGE_E_PATRONI_TESTS", "1" if _MAJOR == "15" else "0") != "1":
    collect_ignore.append("test_patroni.py")

# Every test has a time limit (pytest-timeout, from scripts/requirements.txt), so that a hang
# fails that test instead of eating CI's 90 minutes: TEST_TIMEOUT seconds, unless the test has
# a `timeout` mark of its own (test_patroni.py's, whose own waits add up to about that) or the
# run chooses one (--timeout, the `timeout` ini setting or PYTEST_TIMEOUT). The limit covers the
# test's setup and teardown too (a module's cluster starts in its first test's setup). It fires
# as SIGALRM, which raises in the test's main thread, so fixtures still stop their clusters.
TEST_TIMEOUT = 600


# Tests marked `one_major` run for many seconds of wall clock (the adaptive controller settling
# under load) and test code that is the same on every major (the controller is the core crate's
# and its cluster part is version-independent): like the driver matrix, they run on 15 only;
# STAGE_E_ONE_MAJOR_TESTS=1 forces them on (=0 leaves them out).
_ONE_MAJOR = os.environ.get("STAGE_E_ONE_MAJOR_TESTS", "1" if _MAJOR == "15" else "0") == "1"


def pytest_configure(config):
    if not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError("pytest-timeout is missing: run scripts/install-deps.sh "
                                "(or .venv/bin/pip install -r scripts/requirements.txt)")
    config.addinivalue_line("markers", "one_major: run on PostgreSQL 15 only (see conftest)")


def pytest_collection_modifyitems(config, items):
    if not _ONE_MAJOR:  # not collected on this major, as test_drivers.py is not
        other = [item for item in items if item.get_closest_marker("one_major")]
        items[:] = [item for item in items if not item.get_closest_marker("one_major")]
        config.hook.pytest_deselected(items=other)
    if (config.getoption("timeout") is not None or config.getini("timeout")
            or os.environ.get("PYTEST_TIMEOUT")):
        return  # the run chose its own limit
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT))


@pytest.fixture(scope="session")
def cluster():
    # Each test gets its own database, hence its own pool: raise the per-database limit.
    c = Cluster("tests").init().start()
    yield c
    c.destroy()


@pytest.fixture
def db(cluster, request):
    """A fresh database with the extension, named after the test."""
    name = "t_" + re.sub(r"[^a-z0-9_]", "_", request.node.name.lower())[:50]
    cluster.create_database(name)
    yield name


@pytest.fixture
def connect(cluster, db):
    """Opens sessions on the test's database; closes whatever is left at the end."""
    opened = []

    def _connect(application_name="stage_e_test", dbname=None):
        conn = cluster.connect(dbname or db, application_name)
        opened.append(conn)
        return conn

    yield _connect
    for conn in opened:
        if not conn.closed:
            conn.close()


def one(conn, query, params=None):
    row = conn.execute(query, params).fetchone()
    return row[0] if row else None


def stats(conn, cap="default"):
    """The cap's row of stage_e_stats() (zeros while the cap is not in use)."""
    cur = conn.execute("SELECT * FROM stage_e_stats() WHERE cap = %s", (cap,))
    names = [d.name for d in cur.description]
    row = cur.fetchone()
    if row is None:
        row = [cap, int(one(conn, "SHOW stage_e_slots.max_slots"))] + [0] * (len(names) - 2)
    return dict(zip(names, row))


def slot_lock_holders(conn, n=None):
    """(slot, pid) of granted slot locks in conn's database, straight from pg_locks."""
    q = ("SELECT objid::int, pid FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
         "AND objsubid = 2 AND granted AND database = "
         "(SELECT oid FROM pg_database WHERE datname = current_database())")
    rows = conn.execute(q, (KEY,)).fetchall()
    return sorted(r for r in rows if n is None or r[0] < n)


__all__ = ["KEY", "one", "slot_lock_holders", "stats", "wait_for"]


def cap_locks(conn, cap):
    """(slot, pid) of the granted advisory locks of `cap` in this database, from pg_locks."""
    return conn.execute(
        "SELECT objid::int, pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 "
        "AND granted AND classid = stage_e_cap_key(%s)::oid AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database()) ORDER BY 1",
        (cap,)).fetchall()


# -- every function of the extension, from the catalog ------------------------------------------

# Sample arguments for each function of the extension, by its signature (name and argument
# types), and what it is: "acts" (takes, releases or renews slots, leases or policies, or writes
# counts: refused on a standby, 25006, and in parallel mode, 25000) or "reads" (works on a
# standby and in parallel mode). extension_calls() fails for a function of the catalog that is
# not here, so that a new function cannot be left out of the every-function tests (hostile
# search_path, parallel mode, standby, not preloaded); add it here with arguments that succeed
# on a primary. Cap 'k' throughout; waits are short.
FUNCTION_SAMPLES = {
    "stage_e_adapt(text, integer, integer, boolean)": ("acts", ["'k'", "1", "2", "true"]),
    "stage_e_adapt_off(text)": ("acts", ["'k'"]),
    "stage_e_cap_key(text)": ("reads", ["'k'"]),
    "stage_e_cap_limits_internal()": ("reads", []),
    "stage_e_cap_load_internal()": ("reads", []),
    "stage_e_flush()": ("acts", []),
    "stage_e_held_back_internal()": ("reads", []),
    "stage_e_histogram_quantiles_internal()": ("reads", []),
    "stage_e_histograms()": ("reads", []),
    "stage_e_holding(integer)": ("acts", ["0"]),
    "stage_e_holding(text, integer)": ("acts", ["'k'", "0"]),
    "stage_e_lease(text, integer, interval, interval)": ("acts",
                                                        ["'k'", "2", "'1 min'", "'10 ms'"]),
    "stage_e_lease(text, integer, interval, interval, text)": (
        "acts", ["'k'", "2", "'1 min'", "'10 ms'", "'t'"]),
    "stage_e_pending(bigint)": ("reads", ["0"]),
    "stage_e_release(integer)": ("acts", ["0"]),
    "stage_e_release(text, integer)": ("acts", ["'k'", "0"]),
    "stage_e_release_all()": ("acts", []),
    "stage_e_release_all(text)": ("acts", ["'k'"]),
    "stage_e_release_lease(text, integer, bigint)": ("acts", ["'k'", "0", "1"]),
    "stage_e_renew(text, integer, bigint, interval)": ("acts", ["'k'", "0", "1", "'1 s'"]),
    "stage_e_reset_stats()": ("acts", []),
    "stage_e_reset_stats(text)": ("acts", ["'k'"]),
    "stage_e_share(text, text, integer, integer)": ("acts", ["'k'", "'t'", "2", "2"]),
    "stage_e_shares_internal()": ("reads", []),
    "stage_e_slot_holders_internal()": ("reads", []),
    "stage_e_slot_token(text, integer)": ("reads", ["'k'", "0"]),
    "stage_e_slot_waiters_internal()": ("reads", []),
    "stage_e_snapshot()": ("reads", []),
    "stage_e_stats()": ("reads", []),
    "stage_e_rate_limit(text, integer, interval, integer)": (
        "acts", ["'k'", "1000", "'1 s'", "1000"]),
    "stage_e_rate_limit_off(text)": ("acts", ["'k'"]),
    "stage_e_rate_limits_internal()": ("reads", []),
    "stage_e_try_rate(text, integer, interval, integer, integer)": (
        "acts", ["'k'", "1000", "'1 s'", "1000", "1"]),
    "stage_e_try_slot(integer)": ("acts", ["2"]),
    "stage_e_try_slot(text, integer)": ("acts", ["'k'", "2"]),
    "stage_e_try_slot(text, integer, interval)": ("acts", ["'k'", "2", "'10 ms'"]),
    "stage_e_try_slot(text, integer, interval, text)": ("acts", ["'k'", "2", "'10 ms'", "'t'"]),
    "stage_e_try_slots(text, integer, integer, interval)": ("acts", ["'k'", "2", "2", "'10 ms'"]),
    "stage_e_try_slots(text, integer, integer, interval, text)": (
        "acts", ["'k'", "2", "2", "'10 ms'", "'t'"]),
}

# Every function (prokind 'f') that is a member of the extension, but its trigger functions
# (no statement can call them; test_hardening writes their tables instead): its name, its
# signature (the name and argument types, as FUNCTION_SAMPLES keys it), how many arguments it
# takes and how many of them have defaults. Every operator qualified: it runs under hostile
# search_paths.
EXTENSION_FUNCTIONS = """
SELECT p.proname,
       pg_catalog.concat(p.proname, '(', pg_catalog.oidvectortypes(p.proargtypes), ')'),
       p.pronargs, p.pronargdefaults
  FROM pg_catalog.pg_depend d
  JOIN pg_catalog.pg_extension e ON e.oid OPERATOR(pg_catalog.=) d.refobjid
   AND e.extname OPERATOR(pg_catalog.=) 'stage_e_slots'::pg_catalog.name
  JOIN pg_catalog.pg_proc p ON p.oid OPERATOR(pg_catalog.=) d.objid
   AND d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
 WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_extension'::pg_catalog.regclass
   AND d.deptype OPERATOR(pg_catalog.=) 'e' AND p.prokind OPERATOR(pg_catalog.=) 'f'
   AND p.prorettype OPERATOR(pg_catalog.<>) 'pg_catalog.trigger'::pg_catalog.regtype
 ORDER BY 2
"""


def extension_signatures(conn):
    """The signatures of the extension's functions, from the catalog."""
    return [r[1] for r in conn.execute(EXTENSION_FUNCTIONS).fetchall()]


def extension_calls(conn, schema="public"):
    """Every call of every function of the extension in conn's database, from the catalog:
    (signature, kind, call) for each function and each number of arguments its defaults allow,
    the arguments from FUNCTION_SAMPLES, the name qualified with `schema`. Fails, naming them,
    if a function has no sample."""
    rows = conn.execute(EXTENSION_FUNCTIONS).fetchall()
    missing = sorted(sig for _, sig, _, _ in rows if sig not in FUNCTION_SAMPLES)
    assert not missing, (f"functions of the extension without a sample in "
                         f"conftest.FUNCTION_SAMPLES: {missing}")
    assert rows, "the catalog query found no function of the extension"
    out = []
    for name, sig, nargs, ndefaults in rows:
        kind, args = FUNCTION_SAMPLES[sig]
        assert len(args) == nargs, (sig, args)
        for k in range(nargs - ndefaults, nargs + 1):
            out.append((sig, kind, f"{schema}.{name}({', '.join(args[:k])})"))
    return out
