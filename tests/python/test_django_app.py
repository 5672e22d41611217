"""The installed package's Django app, stage_e_slots.django: its system checks, its DSN from
DATABASES, ``stage_e_slot`` on a dedicated connection and on a Django connection (with the
slot reported lost when Django replaces that connection mid-region), and ``manage.py
stage_e_status`` against a real cluster. Django runs in subprocesses, each with settings of
its own (a settings module written into the test's tmp_path), so that no Django settings
enter this process."""

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import psycopg
import pytest
import stage_e_slots
from pgcluster import wait_for  # scripts/, put on sys.path by tests/conftest.py

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "django"
CLEAR = "\x1b[H\x1b[2J"
SQLITE = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}


def postgres(cluster, db, **extra):
    """A DATABASES entry for the test's database on the test cluster."""
    return {"ENGINE": "django.db.backends.postgresql", "HOST": str(cluster.base),
            "PORT": cluster.port, "NAME": db, "USER": "postgres", **extra}


def _django(tmp_path, settings, code, args):
    """The command line and environment of a Django process with a settings module made of
    `settings` (name -> value, written as Python literals) and the app installed: `code` run
    after django.setup(), or, with code=None, `python -m django ARGS`."""
    module = {
        "SECRET_KEY": "stage-e-slots-test-not-secret",
        "USE_TZ": True,
        "INSTALLED_APPS": ["django.contrib.contenttypes", "django.contrib.auth",
                           "stage_e_slots.django"],
        **settings,
    }
    (tmp_path / "appsettings.py").write_text(
        "".join(f"{name} = {value!r}\n" for name, value in module.items()))
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="appsettings", PYTHONPATH=os.pathsep.join(path))
    if code is None:
        return [sys.executable, "-m", "django", *args], env
    return [sys.executable, "-c", "import django\ndjango.setup()\n" + textwrap.dedent(code)], env


def django_run(tmp_path, settings, code, *args, timeout=60):
    argv, env = _django(tmp_path, settings, code, args)
    return subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout, check=False)


def json_of(out):
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def totals(conn, cap):
    """The cap's live totals (stage_e_throttle_totals)."""
    cur = conn.execute("SELECT * FROM stage_e_throttle_totals WHERE cap = %s", (cap,))
    row = cur.fetchone()
    assert row is not None, f"cap {cap!r} has no totals"
    return dict(zip([d.name for d in cur.description], row))


# -- system checks ----------------------------------------------------------------------------

RUN_CHECKS = """
import json
from django.core.checks import run_checks
print(json.dumps([{"id": m.id, "level": m.level, "msg": m.msg, "hint": m.hint}
                  for m in run_checks() if m.id and m.id.startswith("stage_e_slots.")]))
"""

PG = {"ENGINE": "django.db.backends.postgresql", "NAME": "app", "HOST": "/nonexistent"}


def checks_of(tmp_path, **settings):
    return json_of(django_run(tmp_path, settings, RUN_CHECKS))


@pytest.mark.parametrize("conn_max_age", ["unset", 0, 60])
def test_w001_on_the_incidents_settings(tmp_path, conn_max_age):
    """Session slots on a connection Django closes: CONN_MAX_AGE missing (Django's 0), 0, or
    any number of seconds."""
    default = dict(PG) if conn_max_age == "unset" else dict(PG, CONN_MAX_AGE=conn_max_age)
    found = checks_of(tmp_path, DATABASES={"default": default},
                      STAGE_E_SLOTS_SESSION_CONNECTION="default")
    assert [m["id"] for m in found] == ["stage_e_slots.W001"]
    w = found[0]
    assert w["level"] == 30  # checks.WARNING
    shown = 0 if conn_max_age == "unset" else conn_max_age
    assert f"its CONN_MAX_AGE is {shown}" in w["msg"]
    assert "connection that Django closes" in w["msg"]
    assert "close_old_connections()" in w["msg"] and "cap stops binding" in w["msg"]
    for fix in ("unset STAGE_E_SLOTS_SESSION_CONNECTION", "STAGE_E_SLOTS_DSN", "leases",
                "DATABASES['default']['CONN_MAX_AGE'] = None"):
        assert fix in w["hint"]


@pytest.mark.parametrize("settings", [
    pytest.param({"DATABASES": {"default": PG}}, id="no-setting"),
    pytest.param({"DATABASES": {"default": dict(PG, CONN_MAX_AGE=None)},
                  "STAGE_E_SLOTS_SESSION_CONNECTION": "default"}, id="conn-max-age-none"),
    pytest.param({"DATABASES": {"default": SQLITE},
                  "STAGE_E_SLOTS_DSN": "host=/nonexistent dbname=app"}, id="dedicated-dsn"),
    pytest.param({"DATABASES": {"default": PG}, "STAGE_E_SLOTS_SESSION_CONNECTION": ""},
                 id="empty-setting"),
])
def test_quiet_on_the_fixed_settings(tmp_path, settings):
    assert checks_of(tmp_path, **settings) == []


def test_e001_for_an_alias_not_in_databases(tmp_path):
    found = checks_of(tmp_path, DATABASES={"default": PG},
                      STAGE_E_SLOTS_SESSION_CONNECTION="replica")
    assert [(m["id"], m["level"]) for m in found] == [("stage_e_slots.E001", 40)]
    assert "'replica'" in found[0]["msg"] and "(default)" in found[0]["msg"]


def test_other_configuration_errors(tmp_path):
    # An alias that is not PostgreSQL; one with a connection pool; no DSN to build at all.
    found = checks_of(tmp_path, DATABASES={"default": PG, "cache": SQLITE},
                      STAGE_E_SLOTS_SESSION_CONNECTION="cache")
    assert [m["id"] for m in found] == ["stage_e_slots.E002"]
    found = checks_of(tmp_path, DATABASES={"default": dict(PG, OPTIONS={"pool": True})},
                      STAGE_E_SLOTS_SESSION_CONNECTION="default")
    assert [m["id"] for m in found] == ["stage_e_slots.E003", "stage_e_slots.W001"]
    found = checks_of(tmp_path, DATABASES={"default": SQLITE})
    assert [m["id"] for m in found] == ["stage_e_slots.W002"]
    assert "STAGE_E_SLOTS_DSN" in found[0]["hint"]


def test_the_demo_projects_check(tmp_path):
    """examples/django: `manage.py check` flags the shared mode (the bug replay), not the
    dedicated and lease modes."""
    said = {}
    for mode in ("shared", "dedicated", "lease"):
        env = dict(os.environ, DJANGO_SETTINGS_MODULE="capdemo.settings", CAPDEMO_MODE=mode,
                   CAPDEMO_PGHOST="/nonexistent", CAPDEMO_PGPORT="5432",
                   CAPDEMO_PGDATABASE="capdemo")
        out = subprocess.run([sys.executable, str(EXAMPLE / "manage.py"), "check"], env=env,
                             cwd=EXAMPLE, capture_output=True, text=True, timeout=60,
                             check=False)
        assert out.returncode == 0, out.stdout + out.stderr  # a warning does not fail check
        said[mode] = out.stdout + out.stderr
    assert "(stage_e_slots.W001)" in said["shared"]
    assert "its CONN_MAX_AGE is 0 (Django's default)" in said["shared"]
    for mode in ("dedicated", "lease"):
        assert "System check identified no issues" in said[mode], said[mode]


# -- conf.dsn() -------------------------------------------------------------------------------

DSN_SCRIPT = """
import json
import psycopg
from psycopg.conninfo import conninfo_to_dict
from stage_e_slots.django.conf import dsn
with psycopg.connect(dsn()) as conn:
    row = conn.execute("SELECT current_database(), current_user, "
                       "current_setting('statement_timeout'), "
                       "current_setting('application_name')").fetchone()
print(json.dumps({"params": conninfo_to_dict(dsn()), "session": row}))
"""


def test_dsn_from_databases_connects(tmp_path, cluster, db):
    options = {"sslmode": "disable", "options": "-c statement_timeout=12345",
               "application_name": "from-options",
               # Django's and psycopg's own options, which are no libpq parameters:
               "prepare_threshold": None, "server_side_binding": False,
               "isolation_level": psycopg.IsolationLevel.SERIALIZABLE.value}
    default = postgres(cluster, db, PASSWORD="unused-with-trust", OPTIONS=options)
    s = json_of(django_run(tmp_path, {"DATABASES": {"default": default}}, DSN_SCRIPT))
    assert s["session"] == [db, "postgres", "12345ms", "from-options"]
    assert s["params"] == {"host": str(cluster.base), "port": str(cluster.port), "dbname": db,
                           "user": "postgres", "password": "unused-with-trust",
                           "sslmode": "disable", "options": "-c statement_timeout=12345",
                           "application_name": "from-options"}


def test_dsn_setting_wins_and_a_missing_database_is_explained(tmp_path, cluster, db):
    own = cluster.conninfo(db, "own-dsn")
    s = json_of(django_run(tmp_path, {"DATABASES": {"default": SQLITE},
                                      "STAGE_E_SLOTS_DSN": own}, DSN_SCRIPT))
    assert s["session"][0] == db and s["session"][3] == "own-dsn"
    out = django_run(tmp_path, {"DATABASES": {"default": SQLITE}}, DSN_SCRIPT)
    assert out.returncode != 0
    assert "ImproperlyConfigured" in out.stderr and "is not a PostgreSQL database" in out.stderr
    assert "set STAGE_E_SLOTS_DSN" in out.stderr


# -- stage_e_slots.django.stage_e_slot --------------------------------------------------------

# Collects what the app logs, to print it with the rest.
LOG_CAPTURE = """
import json, logging
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append([record.levelname, record.getMessage()])
logging.getLogger("stage_e_slots").addHandler(Keep())
from django.db import close_old_connections, connection
from stage_e_slots.django import SessionSlotConnection, stage_e_slot

def sql(query, params=()):
    with connection.cursor() as cur:
        cur.execute(query, params)
        return [list(r) for r in cur.fetchall()]

def holders(cap):
    return sql("SELECT slot, pid FROM stage_e_slot_holders WHERE cap = %s", [cap])

def backend():
    return sql("SELECT pg_backend_pid()")[0][0]
"""


def test_dedicated_connection_outlives_djangos(tmp_path, cluster, db, connect):
    observer = connect("observer")
    code = LOG_CAPTURE + """
out = {}
with stage_e_slot("exports", 2) as slot:
    out["slot"], out["holders"], out["django_pid"] = slot, holders("exports"), backend()
    close_old_connections()  # CONN_MAX_AGE = 0: Django closes its connection, as the broker does
    out["held_after_close"], out["django_pid_after"] = holders("exports"), backend()
with stage_e_slot("exports", 1) as a:
    with stage_e_slot("exports", 1) as b:
        out["nested"] = [a, b]
with stage_e_slot("exports", 4, k=2, wait=0.5) as slots:
    out["k2"] = slots
out["after"], out["records"] = holders("exports"), records
print(json.dumps(out))
"""
    s = json_of(django_run(tmp_path, {"DATABASES": {"default": postgres(cluster, db)}}, code))
    assert s["slot"] == 0
    [(slot, pid)] = s["holders"]
    assert slot == 0 and pid != s["django_pid"]  # not on Django's connection
    assert s["django_pid_after"] != s["django_pid"]  # Django did reconnect
    assert s["held_after_close"] == s["holders"]  # and the slot did not care
    assert s["nested"] == [0, None]  # the cap binds: the second region is throttled
    assert s["k2"] == [0, 1]
    assert s["after"] == [] and s["records"] == []
    t = totals(observer, "exports")
    assert (t["acquired"], t["released"], t["throttled"]) == (4, 4, 1)
    assert (t["foreign_releases"], t["released_by_exit"]) == (0, 0)


def test_session_connection_holds_on_djangos_connection(tmp_path, cluster, db, connect):
    """STAGE_E_SLOTS_SESSION_CONNECTION with CONN_MAX_AGE = None: the slot is a lock of
    Django's own session, released on it; an unreachable alias is throttled, not uncapped."""
    observer = connect("observer")
    code = LOG_CAPTURE + """
out = {}
with stage_e_slot("exports", 2) as slot:
    out["slot"], out["holders"], out["django_pid"] = slot, holders("exports"), backend()
    close_old_connections()  # CONN_MAX_AGE = None: the connection stays
out["after"], out["django_pid_after"] = holders("exports"), backend()
out["down"] = SessionSlotConnection("down").try_slot(1, cap="exports")
out["records"] = records
print(json.dumps(out))
"""
    settings = {"DATABASES": {"default": postgres(cluster, db, CONN_MAX_AGE=None),
                              "down": postgres(cluster, db, PORT=1, CONN_MAX_AGE=None)},
                "STAGE_E_SLOTS_SESSION_CONNECTION": "default"}
    s = json_of(django_run(tmp_path, settings, code))
    assert s["slot"] == 0 and s["holders"] == [[0, s["django_pid"]]]
    assert s["after"] == [] and s["django_pid_after"] == s["django_pid"]
    assert s["down"] is None
    [(level, message)] = s["records"]
    assert level == "WARNING" and "treating as throttled" in message
    assert "cannot be opened" in message
    t = totals(observer, "exports")
    assert (t["acquired"], t["released"], t["foreign_releases"]) == (1, 1, 0)


def test_session_slot_lost_when_django_replaces_its_connection(tmp_path, cluster, db, connect):
    """The incident, with the app: CONN_MAX_AGE = 0 and close_old_connections() mid-region.
    The slot goes with Django's session (another worker takes it: the cap did not bind), and
    the region's end says so: an ERROR per slot, release() False, and no stage_e_release on
    Django's new session, where it would be a foreign release."""
    since = len(cluster.log_text())
    observer = connect("observer")
    other = connect("other-worker")
    code = LOG_CAPTURE + """
import sys
import time
out = {}
with stage_e_slot("exports", 1) as slot:
    out["slot"], out["holders"], out["django_pid"] = slot, holders("exports"), backend()
    close_old_connections()  # as django-q2's ORM broker does on every enqueue
    out["django_pid_after"] = backend()  # Django's new session
    # The old session's backend frees its locks as it exits, just after the close: poll.
    deadline = time.monotonic() + 10
    while holders("exports") and time.monotonic() < deadline:
        time.sleep(0.01)
    out["held_mid_region"] = holders("exports")
    print("region", flush=True)
    sys.stdin.readline()  # the other worker takes the freed slot now
    out["held_by_other"] = holders("exports")
with stage_e_slot("pair", 4, k=2) as slots:
    out["k2"] = slots
    close_old_connections()
conn = SessionSlotConnection("default")
taken = conn.try_slot(2, cap="direct")
connection.close()
backend()
out["direct"] = [taken, conn.release(taken, cap="direct")]
out["records"] = records
print(json.dumps(out))
"""
    settings = {"DATABASES": {"default": postgres(cluster, db, CONN_MAX_AGE=0)},
                "STAGE_E_SLOTS_SESSION_CONNECTION": "default"}
    argv, env = _django(tmp_path, settings, code, ())
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "region", proc.stderr.read()
        # Django's old session is gone and its slot with it: a second worker gets slot 0 of
        # a cap of 1, while the first is still in its region.
        assert other.execute("SELECT stage_e_try_slot('exports', 1)").fetchone()[0] == 0
        proc.stdin.write("\n")
        proc.stdin.flush()
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout + stderr
    s = json.loads(stdout.strip().splitlines()[-1])
    print("\n" + "\n".join(f"{level}: {m}" for level, m in s["records"]))
    assert s["slot"] == 0 and s["holders"] == [[0, s["django_pid"]]]
    assert s["django_pid_after"] != s["django_pid"]
    assert s["held_mid_region"] == []
    other_pid = other.info.backend_pid
    assert s["held_by_other"] == [[0, other_pid]]
    assert s["k2"] == [0, 1]
    assert s["direct"] == [0, False]
    # Nothing was released: not the other worker's slot, not on anyone's behalf.
    assert other.execute("SELECT stage_e_holding('exports', 0)").fetchone()[0] is True
    for cap, acquired in (("exports", 2), ("pair", 2), ("direct", 1)):
        t = totals(observer, cap)
        assert t["acquired"] == acquired and t["released"] == 0 and t["foreign_releases"] == 0
    wait_for(lambda: totals(observer, "pair")["released_by_exit"] == 2
             and totals(observer, "direct")["released_by_exit"] == 1
             and totals(observer, "exports")["released_by_exit"] == 1,
             what="the closed sessions' slots counted as released by exit")
    assert "was not held by this connection" not in cluster.log_text()[since:]
    # ...and each region's end said its slots were lost, in so many words.
    errors = [m for level, m in s["records"] if level == "ERROR"]
    lost = [re.search(r"slot (\d+) of cap '(\w+)' was lost", m) for m in errors]
    assert [m.groups() if m else None for m in lost] == [
        ("0", "exports"), ("0", "pair"), ("1", "pair"), ("0", "direct")], errors
    for m in errors:
        assert "Django closed its connection 'default'" in m and "CONN_MAX_AGE = 0" in m
        assert "Not released on Django's new session" in m
    assert len(s["records"]) == len(errors)


# -- manage.py stage_e_status -----------------------------------------------------------------

def test_stage_e_status(tmp_path, cluster, db, connect):
    observer = connect("observer")
    holder, thrower, waiter, leaser = (connect(n) for n in
                                       ("holder-a", "thrower", "waiter-b", "leaser"))
    assert holder.execute("SELECT stage_e_try_slot('exports', 1)").fetchone()[0] == 0
    assert thrower.execute("SELECT stage_e_try_slot('exports', 1)").fetchone()[0] is None
    slot, token = leaser.execute("SELECT * FROM stage_e_lease('dispatch', 3, '60 s')").fetchone()
    assert slot == 0
    observer.execute("SELECT stage_e_adapt('llm', 2, 8)")  # unused, so it stays at 2
    served = []
    t = threading.Thread(target=lambda: served.append(waiter.execute(
        "SELECT stage_e_try_slot('exports', 1, '60 s')").fetchone()[0]))
    t.start()
    try:
        wait_for(lambda: observer.execute("SELECT count(*) FROM stage_e_slot_waiters")
                 .fetchone()[0] == 1, what="the waiter queued")
        settings = {"DATABASES": {"default": postgres(cluster, db)}}

        def status(*args):
            out = django_run(tmp_path, settings, None, "stage_e_status", *args)
            assert out.returncode == 0, out.stdout + out.stderr
            return out.stdout

        full = status()
        by_cap = status("--cap", "exports")
        frames = status("--count", "2", "--interval", "0.1")
    finally:
        holder.execute("SELECT stage_e_release('exports', 0)")
        t.join(timeout=30)
    assert not t.is_alive() and served == [0]
    print(f"\n{full}")

    lines = full.splitlines()
    # The extension's version is the package's (both are Cargo.toml's).
    version = re.escape(stage_e_slots.__version__)
    assert re.fullmatch(rf"stage_e_slots {version}, database {db}, .+", lines[0])
    blocks = "\n".join(lines)
    assert ("cap dispatch: n 3, held 1, waiting 0\n"
            "  acquired 1, throttled 0, throttle rate 0.0%\n") in blocks
    assert ("cap exports: n 1, held 1, waiting 1\n"
            "  acquired 1, throttled 1, throttle rate 50.0%\n") in blocks
    assert ("cap llm: n -, held 0, waiting 0\n"
            "  acquired 0, throttled 0, throttle rate -\n"
            "  adaptive limit 2 (min 2, max 8, enforced): started at min_slots: 2\n") in blocks
    holders = _section(lines, "HOLDERS")
    assert holders[0].split() == ["cap", "slot", "holder", "held", "for", "application_name"]
    assert re.fullmatch(rf"dispatch +0 +lease {token} \(pid {leaser.info.backend_pid}\) +"
                        r"\d+\.\d s +leaser", holders[1])
    assert re.fullmatch(rf"exports +0 +pid {holder.info.backend_pid} +\d+\.\d s +holder-a",
                        holders[2])
    assert len(holders) == 3
    waiters = _section(lines, "WAITERS")
    assert re.fullmatch(rf"exports +1 +{waiter.info.backend_pid} +1 +1 +\d+\.\d s +waiter-b",
                        waiters[1])
    assert len(waiters) == 2

    # --cap: that cap's block, holders and waiters only.
    assert "cap exports: n 1, held 1, waiting 1" in by_cap
    assert "dispatch" not in by_cap and "llm" not in by_cap
    assert len(_section(by_cap.splitlines(), "HOLDERS")) == 2
    assert len(_section(by_cap.splitlines(), "WAITERS")) == 2

    # --interval: each frame after clearing the screen; --count: that many frames.
    assert frames.count(CLEAR) == 2 and frames.startswith(CLEAR)
    assert len(re.findall(rf"^(?:\x1b\[H\x1b\[2J)?stage_e_slots {version}, ", frames,
                          re.MULTILINE)) == 2
    assert frames.count("cap exports: n 1, held 1, waiting 1") == 2
    assert CLEAR not in full


def _section(lines, title):
    """The lines of a table (its header first), up to the next blank line."""
    start = lines.index(title) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def test_stage_e_status_errors(tmp_path, cluster, db):
    settings = {"DATABASES": {"default": postgres(cluster, db)}}
    out = django_run(tmp_path, settings, None, "stage_e_status", "--database", "nope")
    assert out.returncode != 0 and "--database 'nope' is not a database alias" in out.stderr
    cluster.create_database(db + "_bare", extension=False)
    bare = {"DATABASES": {"default": postgres(cluster, db + "_bare")}}
    out = django_run(tmp_path, bare, None, "stage_e_status")
    assert out.returncode != 0 and "extension is not installed" in out.stderr
    out = django_run(tmp_path, settings, None, "stage_e_status", "--cap", "none-such")
    assert out.returncode == 0 and "no caps named 'none-such'" in out.stdout
