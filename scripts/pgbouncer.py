"""A throwaway PgBouncer in front of a pgcluster.Cluster, for the pooler tests.

It lives in a folder of its own under the cluster's base folder (ini, auth file, log, Unix
socket), listens on 127.0.0.1 on a free port, and forwards every database name to the cluster
(`* = host=<cluster socket folder> port=<cluster port>`), with trust authentication for the
user `postgres`. PgBouncer refuses to run as root: when we are root it is started with
`-u postgres`, so the process we hold is PgBouncer itself. It never touches the system
pgbouncer service (port 6432), which scripts/install-deps.sh stops and disables.

    with PgBouncer(cluster, pool_mode="transaction", pool_size=2) as bouncer:
        conn = bouncer.connect("mydb")
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
from pgcluster import Cluster

if TYPE_CHECKING:
    from typing_extensions import Self

POOL_MODES = ("session", "transaction", "statement")


def pgbouncer_binary() -> str:
    found = os.environ.get("PGBOUNCER") or shutil.which(
        "pgbouncer", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if not found:
        raise FileNotFoundError("pgbouncer is not installed: run scripts/install-deps.sh "
                                "(or apt-get install pgbouncer), or set PGBOUNCER")
    return found


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 20) -> str:
    if not path.exists():
        return f"({path.name} does not exist)"
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(text) if text else f"({path.name} is empty)"


class PgBouncer:
    """One PgBouncer process in front of `cluster`, with start/stop helpers and connections
    through it. `pool_size` is the number of server connections per (database, user) pool."""

    def __init__(self, cluster: Cluster, pool_mode: str = "transaction", pool_size: int = 4,
                 port: int | None = None):
        if pool_mode not in POOL_MODES:
            raise ValueError(f"pool_mode must be one of {POOL_MODES}, not {pool_mode!r}")
        self.cluster = cluster
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.fixed_port = port
        self.port = port
        self.binary = pgbouncer_binary()
        self.dir: Path | None = None
        self.proc: subprocess.Popen | None = None

    # -- files ---------------------------------------------------------------------------
    @property
    def ini(self) -> Path:
        return self.dir / "pgbouncer.ini"

    @property
    def log(self) -> Path:
        return self.dir / "pgbouncer.log"

    @property
    def stderr(self) -> Path:
        return self.dir / "stderr.log"

    def _write_config(self) -> None:
        settings = {
            "listen_addr": "127.0.0.1",
            "listen_port": self.port,
            "unix_socket_dir": self.dir,
            "auth_type": "trust",
            "auth_file": self.dir / "userlist.txt",
            "pool_mode": self.pool_mode,
            "default_pool_size": self.pool_size,
            "min_pool_size": 0,
            "reserve_pool_size": 0,
            "max_client_conn": 200,
            # JDBC and some drivers send extra_float_digits, which PgBouncer does not track.
            "ignore_startup_parameters": "extra_float_digits",
            "logfile": self.log,
        }
        if self.pool_mode != "session":
            # Nothing to reset between transactions; session mode keeps the default DISCARD
            # ALL, which a server connection runs when its client disconnects.
            settings["server_reset_query"] = ""
        lines = ["[databases]",
                 f"* = host={self.cluster.base} port={self.cluster.port}",
                 "",
                 "[pgbouncer]",
                 *(f"{k} = {v}" for k, v in settings.items())]
        self.ini.write_text("\n".join(lines) + "\n")
        (self.dir / "userlist.txt").write_text('"postgres" ""\n')

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> Self:
        """Starts PgBouncer and returns once a query through it has reached the cluster."""
        if self.proc is not None:
            raise RuntimeError("this PgBouncer is already running")
        self.dir = Path(tempfile.mkdtemp(prefix="pgbouncer-", dir=self.cluster.base))
        # A port picked for us may be taken by someone else before PgBouncer binds it: pick
        # another one then.
        for attempt in range(3):
            self.port = self.fixed_port or _free_port()
            try:
                self._launch(timeout)
                return self
            except _PortInUse:
                if self.fixed_port or attempt == 2:
                    raise RuntimeError(f"pgbouncer cannot listen on 127.0.0.1:{self.port}; "
                                       f"{self.log}:\n{_tail(self.log)}") from None

    def _launch(self, timeout: float) -> None:
        for old in (self.log, self.stderr):
            old.unlink(missing_ok=True)
        self._write_config()
        cmd = [self.binary]
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, pw.pw_uid, pw.pw_gid)
            cmd += ["-u", "postgres"]
        cmd.append(str(self.ini))
        with self.stderr.open("ab") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=err,
                                         stderr=subprocess.STDOUT, cwd="/tmp")
        deadline = time.monotonic() + timeout
        last_error = None
        while True:
            code = self.proc.poll()
            if code is not None:
                self.proc = None
                raise RuntimeError(f"pgbouncer exited with code {code} at start; "
                                   f"{self.log}:\n{_tail(self.log)}\n"
                                   f"stderr:\n{_tail(self.stderr)}")
            log = self.log_text()
            # PgBouncer only warns when the TCP port is taken, and serves its Unix socket: a
            # probe on that port would then reach whoever has it.
            if f"cannot listen on 127.0.0.1:{self.port}" in log:
                self.stop()
                raise _PortInUse()
            if f"listening on 127.0.0.1:{self.port}" in log:
                try:
                    with self.connect("postgres", application_name="pgbouncer-probe",
                                      connect_timeout=2) as c:
                        c.execute("SELECT 1")
                    return
                except psycopg.OperationalError as e:
                    last_error = e
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pgbouncer on port {self.port} did not pass a query to the "
                                   f"cluster within {timeout}s ({last_error or 'not listening'}); "
                                   f"{self.log}:\n{_tail(self.log)}")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> None:
        """Stops PgBouncer at once (SIGTERM) and waits for it; its server connections close
        with it (their backends exit shortly after)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- sessions ------------------------------------------------------------------------
    def conninfo(self, dbname: str = "postgres", application_name: str = "stage_e_test",
                 user: str = "postgres") -> str:
        return (f"host=127.0.0.1 port={self.port} user={user} dbname={dbname} "
                f"application_name={application_name}")

    def connect(self, dbname: str = "postgres", autocommit: bool = True,
                application_name: str = "stage_e_test", user: str = "postgres",
                **kw) -> psycopg.Connection:
        """A psycopg connection through the pooler. No server-side prepared statements: in
        transaction mode the next statement may run on another server connection."""
        kw.setdefault("prepare_threshold", None)
        return psycopg.connect(self.conninfo(dbname, application_name, user),
                               autocommit=autocommit, **kw)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.dir and self.log.exists() else ""

    def _stderr_text(self) -> str:
        return self.stderr.read_text(errors="replace") if self.stderr.exists() else ""


class _PortInUse(Exception):
    pass
