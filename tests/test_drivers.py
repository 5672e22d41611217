"""The README's calls from the drivers people use, parameters bound as each driver's users bind
them (no literals, no casts added for us): node-postgres, asyncpg, psycopg2, psycopg 3, ruby-pg,
pgx and the PostgreSQL JDBC driver, each installed by scripts/install-deps.sh.

Each program in tests/drivers/ prints what every call returned and stops at each `PAUSE`
until a line arrives on its stdin; meanwhile this test checks the server through its own
psycopg session (the lock manager, the holders and waiters views), so a driver that printed
the right words without holding the slot would fail. Run on PostgreSQL 15 only (conftest.py;
STAGE_E_DRIVER_TESTS=1 runs them on any major)."""

import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import cap_locks, one, wait_for
from pgcluster import Cluster

ROOT = Path(__file__).resolve().parent.parent
DRIVERS_DIR = ROOT / "tests" / "drivers"
JDBC_JAR = Path("/usr/share/java/postgresql.jar")  # Debian's libpostgresql-jdbc-java
GOPATH = Path("/usr/share/gocode")  # Debian's golang-*-dev packages (no Go module proxy here)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dc():
    """A cluster on 127.0.0.1 as well as its socket: the JDBC driver speaks TCP only."""
    port = _free_port()
    c = Cluster("drivers", {"listen_addresses": "'127.0.0.1'",
                            "stage_e_slots.flush_interval": "'1h'"}, port=port).init().start()
    yield c
    c.destroy()


@pytest.fixture(scope="module")
def go_program(tmp_path_factory):
    """The pgx program, built in GOPATH mode against Debian's packaged modules."""
    out = tmp_path_factory.mktemp("go") / "quickstart"
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": str(GOPATH),
           "GOCACHE": str(tmp_path_factory.mktemp("gocache")), "GOFLAGS": ""}
    r = subprocess.run(["go", "build", "-o", str(out), str(DRIVERS_DIR / "go" / "quickstart.go")],
                       env=env, capture_output=True, text=True, cwd=DRIVERS_DIR / "go",
                       check=False)
    assert r.returncode == 0, r.stderr
    return str(out)


def argv_of(driver, go_program):
    return {
        "node-postgres": ["node", str(DRIVERS_DIR / "node" / "quickstart.js")],
        "asyncpg": [sys.executable, str(DRIVERS_DIR / "asyncpg_quickstart.py")],
        "psycopg2": [sys.executable, str(DRIVERS_DIR / "psycopg2_quickstart.py")],
        "psycopg3": [sys.executable, str(DRIVERS_DIR / "psycopg3_quickstart.py")],
        "ruby-pg": ["ruby", str(DRIVERS_DIR / "quickstart.rb")],
        "pgx": [go_program] if driver == "pgx" else None,
        "jdbc": ["java", "-cp", str(JDBC_JAR), str(DRIVERS_DIR / "Quickstart.java")],
    }[driver]


class Program:
    """A driver program on the cluster: its stdout read line by line, PAUSE by PAUSE."""

    def __init__(self, argv, cluster, db):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(PGHOST="127.0.0.1", PGPORT=str(cluster.port), PGDATABASE=db,
                   PGUSER="postgres")
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.lines = queue.Queue()
        self.stderr = []
        threading.Thread(target=self._read, args=(self.p.stdout, self.lines.put),
                         daemon=True).start()
        threading.Thread(target=self._read, args=(self.p.stderr, self.stderr.append),
                         daemon=True).start()

    @staticmethod
    def _read(stream, put):
        for line in stream:
            put(line.rstrip("\n"))
        put(None)

    def until(self, pause=None, timeout=90):
        """The lines printed up to `PAUSE <pause>` (or up to the end when pause is None)."""
        got = []
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no `PAUSE {pause}` after {got} (stderr: {self.stderr})")
            if line is None:
                assert pause is None, f"ended before `PAUSE {pause}`: {got} {self.stderr}"
                assert self.p.wait(timeout=30) == 0, (got, self.stderr)
                return got
            if line == f"PAUSE {pause}":
                return got
            got.append(line)

    def go(self):
        self.p.stdin.write("\n")
        self.p.stdin.flush()

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


def pid_of(conn, application_name):
    return one(conn, "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
                     "AND datname = current_database()", (application_name,))


DRIVERS = ["node-postgres", "asyncpg", "psycopg2", "psycopg3", "ruby-pg", "pgx", "jdbc"]


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_readme_calls_with_bound_parameters(dc, driver, request):
    go = request.getfixturevalue("go_program") if driver == "pgx" else None
    db = dc.create_database("drv_" + re.sub(r"[^a-z0-9]", "_", driver))
    prog = Program(argv_of(driver, go), dc, db)
    try:
        with dc.connect(db, "observer") as obs, dc.connect(db, "rival") as rival:
            # A slot of a named cap: the lock manager shows drv-a holding it.
            assert prog.until("holding") == ["take exports 1: 0"]
            a = pid_of(obs, "drv-a")
            assert cap_locks(obs, "exports") == [(0, a)]
            assert obs.execute("SELECT slot, pid, application_name, token "
                               "FROM stage_e_slot_holders WHERE cap = 'exports'").fetchall() == [
                (0, a, "drv-a", None)]
            prog.go()
            # Throttled on a second connection, at once and after a 50 ms wait; released.
            assert prog.until("released") == [
                "second connection take exports 1: null",
                "second connection wait 50 ms: null",
                "release exports 0: true",
            ]
            assert cap_locks(obs, "exports") == []
            # Now this test holds the slot, so the driver's next call waits (queued, seen in
            # the waiters view) until the rival releases it.
            assert one(rival, "SELECT stage_e_try_slot('exports', 1)") == 0
            prog.go()
            b = wait_for(lambda: one(obs, "SELECT pid FROM stage_e_slot_waiters "
                                          "WHERE cap = 'exports' AND application_name = 'drv-b'"),
                         timeout=30, what=f"{driver}'s second connection queued on exports")
            assert b == pid_of(obs, "drv-b") and b != a
            assert one(rival, "SELECT stage_e_release('exports', 0)") is True
            # The waiter got the slot, released it, then took two slots of batch at once.
            assert prog.until("holding batch") == [
                "wait up to 10 s: 0",
                "release exports 0: true",
                "take 2 of batch 4: 0,1",
            ]
            assert cap_locks(obs, "batch") == [(0, a), (1, a)]
            assert cap_locks(obs, "exports") == []
            prog.go()
            # A lease: the holders view shows its token and a 30 s expiry.
            lines = prog.until("leased")
            assert lines[0] == "release_all batch: 2"
            m = re.fullmatch(r"lease jobs 2 for 30 s: slot 0 token (\d+)", lines[1])
            assert m and len(lines) == 2, lines
            token = int(m.group(1))
            assert cap_locks(obs, "batch") == []
            lease = "SELECT slot, token, extract(epoch FROM expires_at - now()) " \
                    "FROM stage_e_slot_holders WHERE cap = 'jobs'"
            rows = obs.execute(lease).fetchall()
            assert [r[:2] for r in rows] == [(0, token)] and 20 < rows[0][2] <= 30, rows
            prog.go()
            assert prog.until("renewed") == ["renew for 60 s: true"]
            rows = obs.execute(lease).fetchall()
            assert [r[:2] for r in rows] == [(0, token)] and 50 < rows[0][2] <= 60, rows
            prog.go()
            # Released by its token (from the other connection), refused the second time; then
            # the stats the driver read are the stats as this session reads them.
            lines = prog.until()
            stats = obs.execute(
                "SELECT cap, held, acquired, throttled, released, foreign_releases, waits, "
                "wait_timeouts, expired FROM stage_e_stats() ORDER BY cap").fetchall()
            assert lines == [
                "release_lease: true",
                "release_lease again: false",
                *["stats " + " ".join(map(str, r)) for r in stats],
                "done",
            ]
            # cap, held, acquired, throttled, released, foreign, waits, wait_timeouts, expired:
            # exports was taken by drv-a, the rival and the waiter; throttled at once and after
            # its 50 ms wait; waited twice (one timed out).
            assert stats == [
                ("batch", 0, 2, 0, 2, 0, 0, 0, 0),
                ("exports", 0, 3, 2, 3, 0, 2, 1, 0),
                ("jobs", 0, 1, 0, 1, 1, 0, 0, 0),
            ]
            assert obs.execute("SELECT count(*) FROM stage_e_slot_holders").fetchone() == (0,)
    finally:
        prog.kill()


def test_jdbc_setstring_for_an_interval_is_what_is_left(dc):
    """JDBC's setString sends varchar, which PostgreSQL casts to interval only explicitly, and
    PGInterval("10 s") is zero: the README says what binds a wait or a ttl (a PGInterval from
    its fields, setObject with Types.OTHER, stringtype=unspecified). Pinned so the note stays
    true; the cap and n bound with setString / setInt resolve."""
    db = dc.create_database("drv_jdbc_varchar")
    src = DRIVERS_DIR / "JdbcVarchar.java"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(PGHOST="127.0.0.1", PGPORT=str(dc.port), PGDATABASE=db, PGUSER="postgres")
    r = subprocess.run(["java", "-cp", str(JDBC_JAR), str(src)], env=env, capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "setString cap, setInt n: 0",
        "setString wait: 42883",  # function stage_e_try_slot(varchar, integer, varchar)
        "stringtype=unspecified, setString wait: null",
        'setObject("50 ms", Types.OTHER) wait: null',
        "PGInterval(0, 0, 0, 0, 0, 0.05) wait: null",
        'PGInterval("10 s") is 0 years 0 mons 0 days 0 hours 0 mins 0.0 secs',
    ]
    # The three ways that bind an interval really waited (and timed out): no zero wait.
    with dc.connect(db) as c:
        assert c.execute("SELECT acquired, throttled, waits, wait_timeouts FROM stage_e_stats() "
                         "WHERE cap = 'exports'").fetchall() == [(1, 3, 3, 3)]


def test_every_driver_is_installed():
    """The matrix runs every driver: none may be silently missing (install-deps.sh installs
    them all on the majors this module runs on)."""
    missing = [t for t in ("node", "ruby", "go", "java") if shutil.which(t) is None]
    assert not missing
    assert (DRIVERS_DIR / "node" / "node_modules" / "pg" / "package.json").exists()
    assert JDBC_JAR.exists() and (GOPATH / "src" / "github.com" / "jackc" / "pgx" / "v4").is_dir()
    r = subprocess.run(["ruby", "-e", "require 'pg'"], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr
    import asyncpg  # noqa: F401
    import psycopg2  # noqa: F401


# Which drivers the 0.4.0 API failed: those that send (cap, n) untyped, for which
# stage_e_try_slot(cap text, n integer) and the retired (n integer, wait interval) tied.
FAILED_ON_0_4_0 = {"node-postgres", "asyncpg", "ruby-pg", "pgx"}


@pytest.mark.parametrize("driver", DRIVERS)
def test_on_a_0_4_0_database_untyped_drivers_hit_the_ambiguity(dc, driver, request):
    """The matrix has teeth: a database still at 0.4.0 (served by this library) gives the
    drivers that send untyped parameters 42725 at the README's first call."""
    go = request.getfixturevalue("go_program") if driver == "pgx" else None
    db = dc.create_database("old_" + re.sub(r"[^a-z0-9]", "_", driver), extension=False)
    dc.sql("CREATE EXTENSION stage_e_slots VERSION '0.4.0'", dbname=db)
    prog = Program(argv_of(driver, go), dc, db)
    try:
        if driver in FAILED_ON_0_4_0:
            line = prog.lines.get(timeout=90)
            assert line.startswith("ERROR 42725 ") and "is not unique" in line, line
            assert prog.p.wait(timeout=30) == 1
        else:
            assert prog.until("holding") == ["take exports 1: 0"]
    finally:
        prog.kill()


def test_the_readme_shows_the_lines_the_programs_run():
    """Each line of README's "From your language" blocks is a line of its program here."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## From your language\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.DOTALL)
    programs = ["node/quickstart.js", "asyncpg_quickstart.py", "psycopg3_quickstart.py",
                "psycopg2_quickstart.py", "quickstart.rb", "go/quickstart.go", "Quickstart.java"]
    assert [lang for lang, _ in blocks] == ["js", "python", "python", "python", "ruby", "go",
                                            "java"]
    for (_, block), program in zip(blocks, programs):
        source = {line.strip() for line in (DRIVERS_DIR / program).read_text().splitlines()}
        missing = [line for line in block.splitlines() if line.strip() not in source]
        assert not missing, (program, missing)
