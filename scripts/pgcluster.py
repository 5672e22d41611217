"""Throwaway PostgreSQL clusters for the demo, the integration tests and the benchmark.

Each cluster lives under /tmp/stage_e_slots/, listens only on a Unix socket in its own folder
(so it never collides with another server's port), and runs as the `postgres` OS user when we
are root (initdb refuses root).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psycopg

PG_CONFIG = os.environ.get("PG_CONFIG", "/usr/lib/postgresql/15/bin/pg_config")
ROOT = Path(os.environ.get("STAGE_E_CLUSTERS", "/tmp/stage_e_slots"))


def bindir(pg_config: str = PG_CONFIG) -> Path:
    return Path(subprocess.check_output([pg_config, "--bindir"], text=True).strip())


def _as_owner() -> list[str]:
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


class Cluster:
    """One data directory, its socket folder and its log, with start/stop helpers."""

    def __init__(self, name: str, settings: dict[str, object] | None = None, port: int = 5433,
                 pg_config: str = PG_CONFIG):
        self.name = name
        self.port = port
        self.bin = bindir(pg_config)
        self.base = ROOT / f"{name}-{os.getpid()}"
        self.data = self.base / "data"
        self.log = self.base / "server.log"
        self.settings = {
            "listen_addresses": "''",
            "unix_socket_directories": f"'{self.base}'",
            "port": port,
            "shared_preload_libraries": "'stage_e_slots'",
            "max_connections": 100,
            "fsync": "off",
            "log_line_prefix": "'%m [%p] %a: '",
        }
        self.settings.update(settings or {})

    # -- lifecycle -----------------------------------------------------------------------
    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*_as_owner(), *args], check=check, capture_output=True, text=True, cwd="/tmp"
        )

    def init(self) -> Cluster:
        shutil.rmtree(self.base, ignore_errors=True)
        self.base.mkdir(parents=True)
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            ROOT.chmod(0o1777)
            os.chown(self.base, pw.pw_uid, pw.pw_gid)
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                  "--no-sync")
        self.write_settings()
        return self

    def write_settings(self) -> None:
        """Writes the settings to a file postgresql.conf includes (ALTER SYSTEM, which owns
        postgresql.auto.conf, still overrides them)."""
        lines = [f"{k} = {v}" for k, v in self.settings.items() if v is not None]
        conf = self.data / "stage_e_cluster.conf"
        conf.write_text("\n".join(lines) + "\n")
        main = self.data / "postgresql.conf"
        include = "include = 'stage_e_cluster.conf'\n"
        if include not in main.read_text():
            with main.open("a") as f:
                f.write(include)
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(conf, pw.pw_uid, pw.pw_gid)

    def start(self, env: dict[str, str] | None = None) -> Cluster:
        """Starts the server; `env` adds variables to its environment."""
        extra = [f"{k}={v}" for k, v in (env or {}).items()]
        self._run(*(["env", *extra] if extra else []), str(self.bin / "pg_ctl"), "-D",
                  str(self.data), "-l", str(self.log), "-w", "-t", "60", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop",
                  check=False)

    def crash(self) -> None:
        """kill -9 of the postmaster, as a power cut or the OOM killer would: waits until it and
        its children are gone (not just zombies: a new postmaster refuses a lock file whose pid
        exists), leaving the data directory as it was. start() then runs crash recovery."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        family = [postmaster] + children_of(postmaster)
        os.kill(postmaster, signal.SIGKILL)
        wait_for(lambda: all(proc_state(p) in (None, "Z") for p in family), timeout=60,
                 interval=0.05, what="the killed server's processes to exit")
        # Orphans are reparented to PID 1, which reaps them when it gets to it: wait for that too.
        wait_for(lambda: all(proc_state(p) is None for p in family), timeout=60, interval=0.05,
                 what="the killed server's processes to be reaped")

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)

    # -- sessions ------------------------------------------------------------------------
    def conninfo(self, dbname: str = "postgres", application_name: str = "stage_e_test",
                 user: str = "postgres") -> str:
        return (f"host={self.base} port={self.port} user={user} dbname={dbname} "
                f"application_name={application_name}")

    def connect(self, dbname: str = "postgres", application_name: str = "stage_e_test",
                user: str = "postgres", **kw) -> psycopg.Connection:
        return psycopg.connect(self.conninfo(dbname, application_name, user), autocommit=True,
                               **kw)

    def sql(self, query: str, dbname: str = "postgres", params=None):
        with self.connect(dbname) as c:
            cur = c.execute(query, params)
            return cur.fetchall() if cur.description else None

    def create_database(self, name: str, extension: bool = True) -> str:
        self.sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.sql(f'CREATE DATABASE "{name}"')
        if extension:
            self.sql("CREATE EXTENSION stage_e_slots", dbname=name)
        return name

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def start_as_standby_of(self, primary: Cluster) -> Cluster:
        """Makes this (not yet initialised) cluster a streaming standby of `primary`
        (pg_basebackup -R) and starts it."""
        self.base.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.base, "postgres", "postgres")
        self._run(str(bindir() / "pg_basebackup"), "-D", str(self.data), "-R",
                  "-h", str(primary.base), "-p", str(primary.port), "-U", "postgres")
        self.write_settings()
        return self.start()


def proc_state(pid: int) -> str | None:
    """The kernel's one-letter state of a process ('Z' zombie), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return kids


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """Polls `predicate` until it returns a truthy value; raises after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
