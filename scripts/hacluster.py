"""A throwaway high-availability cluster: one etcd and two Patroni-managed PostgreSQL nodes with
stage_e_slots preloaded, on loopback, for tests of what a switchover or a failover does to caps.

Everything runs as the `postgres` OS user (as the current user when not root) under one scratch
directory, /tmp/stage_e_ha-<pid>, on free ports of the 571xx range (570xx is left to other
scratch clusters). The facts it relies on (Patroni 3.0.2, etcd 3.4.23, Debian's packages, which
scripts/install-deps.sh installs) are in the project's HA recipe; in short:

* etcd 3.4 has its v2 API off, so Patroni uses its `etcd3:` section;
* `primary_start_timeout: 0`, or a kill -9 of the primary's postmaster restarts it in place
  instead of failing over;
* `wal_retrieve_retry_interval: 500ms`, or a replica whose first stream finds no slot yet
  waits 5 s to retry;
* a replica is "rejoined" when the leader's pg_stat_replication shows it streaming (its REST
  API can answer /replica 200 before it is rewound);
* processes reparented to PID 1 linger as zombies for a second or two: state Z counts as exited.

Nothing outlives the harness: down() runs at exit, on SIGTERM, and every daemon gets SIGTERM
from the kernel if the harness dies first (setpriv --pdeathsig). down() stops both Patronis at
once (each stops its PostgreSQL), then etcd, then kills by pid whatever is left whose command
line names the scratch directory.

Run as a script, it checks itself: bring-up, a switchover and a failover by kill, each with its
timings, for a number of rounds (`python scripts/hacluster.py --rounds 3`).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psycopg
from pgcluster import PG_CONFIG, bindir, wait_for

NODES = ("n1", "n2")
PORT_RANGE = range(57100, 57200)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int) -> list[int]:
    """`count` consecutive free ports in PORT_RANGE, starting at a pid-dependent block so that
    two harnesses started together are unlikely to race for the same ones."""
    blocks = len(PORT_RANGE) // 10
    first = os.getpid() % blocks
    for i in range(blocks):
        start = PORT_RANGE.start + 10 * ((first + i) % blocks)
        ports = list(range(start, start + count))
        if all(_port_free(p) for p in ports):
            return ports
    raise RuntimeError(f"no {count} free ports in {PORT_RANGE}")


def _running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (PID 1 reaps orphans only now and then)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _exit_on_sigterm(signum, frame):
    """A SIGTERM unwinds (finally blocks, atexit: down()) instead of killing us outright."""
    raise SystemExit(128 + signum)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def _postmaster_pid(data: Path) -> int | None:
    """The pid in data/postmaster.pid when it is a running process whose command line names
    that directory (not a stale file's pid, reused by something else)."""
    try:
        pid = int((data / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if _running(pid) and f"{data}" in _cmdline(pid) else None


def _naming(base: Path) -> list[int]:
    """Live processes (other than us) whose command line names a path under `base`."""
    return [pid for pid in (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
            if pid != os.getpid() and f"{base}/" in _cmdline(pid) and _running(pid)]


def _sweep(base: Path) -> None:
    """Ends what is left of a cluster under `base`: a postmaster whose Patroni did not stop
    it gets an immediate shutdown (which ends its children, whose command lines do not name
    the directory), then anything still naming `base` after 10 s gets SIGKILL."""
    for data in base.glob("n*/data"):
        pid = _postmaster_pid(data)
        if pid is not None:
            os.kill(pid, signal.SIGQUIT)
    try:
        wait_for(lambda: not _naming(base), timeout=10, interval=0.05,
                 what=f"the processes of {base} to exit")
    except AssertionError:
        for pid in _naming(base):
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not _naming(base), timeout=10, interval=0.05,
                 what=f"the processes of {base} to die")


def sweep_orphans() -> None:
    """Ends the processes and removes the scratch directory of every harness whose process is
    gone (one that was killed with SIGKILL could not run down(): its Patronis got SIGTERM from
    the kernel, but a PostgreSQL a Patroni was starting can outlive it)."""
    for base in Path("/tmp").glob("stage_e_ha-*"):
        owner = base.name.rsplit("-", 1)[1]
        if owner.isdigit() and not _running(int(owner)):
            _sweep(base)
            shutil.rmtree(base, ignore_errors=True)


class HACluster:
    """etcd plus Patroni nodes n1 and n2; `parameters` are extra postgresql.conf settings of
    both nodes (values as Patroni takes them: unquoted strings or numbers)."""

    def __init__(self, parameters: dict[str, object] | None = None, pg_config: str = PG_CONFIG,
                 scope: str = "stage_e_ha"):
        self.base = Path(f"/tmp/stage_e_ha-{os.getpid()}")
        self.bin = bindir(pg_config)
        self.scope = scope
        self.parameters = {
            "shared_preload_libraries": "stage_e_slots",
            "unix_socket_directories": str(self.base / "run"),
            "log_line_prefix": "%m [%p] %a: ",
            "shared_buffers": "32MB",
            "min_wal_size": "32MB",
            "max_wal_size": "128MB",
            "wal_retrieve_retry_interval": "500ms",
            **(parameters or {}),
        }
        self.etcd_port = self.peer_port = 0  # chosen by up()
        self.rest_port: dict[str, int] = {}
        self.pg_port: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.timings: dict[str, float] = {}
        self._lock = threading.Lock()

    # -- files and processes -------------------------------------------------------------
    def _owner(self) -> tuple[int, int]:
        if os.geteuid() != 0:
            return os.geteuid(), os.getegid()
        pw = pwd.getpwnam("postgres")
        return pw.pw_uid, pw.pw_gid

    def _mkdir(self, path: Path) -> Path:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chown(path, *self._owner())
        path.chmod(0o700)
        return path

    def _env(self, home: Path) -> dict[str, str]:
        """A clean environment (no ETCD_*, PATRONI_* or PG* of the caller leak in)."""
        return {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}

    def _spawn(self, name: str, argv: list[str], home: Path) -> subprocess.Popen:
        """Starts a daemon as the owner, its output appended to logs/<name>.out. setpriv
        execs, so the Popen's pid is the daemon's own."""
        wrap = ["setpriv", "--pdeathsig", "TERM"]
        if os.geteuid() == 0:
            wrap += ["--reuid=postgres", "--regid=postgres", "--init-groups"]
        with open(self.base / "logs" / f"{name}.out", "ab") as out:
            p = subprocess.Popen([*wrap, *argv], stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, env=self._env(home), cwd=home,
                                 start_new_session=True)
        self.procs[name] = p
        return p

    def config_path(self, node: str) -> Path:
        return self.base / node / "patroni.yml"

    def _write_config(self, node: str) -> None:
        """The node's Patroni configuration (JSON, which is YAML)."""
        home = self.base / node
        rest = f"127.0.0.1:{self.rest_port[node]}"
        pg = f"127.0.0.1:{self.pg_port[node]}"
        config = {
            "scope": self.scope,
            "namespace": "/stage_e_ha/",
            "name": node,
            "log": {"level": "INFO"},  # to stderr: interleaved with PostgreSQL's in <node>.out
            "restapi": {"listen": rest, "connect_address": rest},
            "etcd3": {"hosts": f"127.0.0.1:{self.etcd_port}"},
            "bootstrap": {
                "dcs": {
                    "ttl": 10, "loop_wait": 2, "retry_timeout": 3,
                    "primary_start_timeout": 0,  # a crashed primary fails over, not restarts
                    "maximum_lag_on_failover": 1048576,
                    "postgresql": {
                        "use_pg_rewind": True, "use_slots": True,
                        "parameters": {"wal_level": "replica", "hot_standby": "on",
                                       "max_wal_senders": 10, "max_replication_slots": 10,
                                       "wal_keep_size": "64MB"},
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C.UTF-8"}, {"auth": "trust"}],
            },
            "postgresql": {
                "listen": pg, "connect_address": pg,
                "data_dir": str(home / "data"), "bin_dir": str(self.bin),
                "pgpass": str(home / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": "postgres"},
                    "replication": {"username": "replicator", "password": "replicator"},
                    "rewind": {"username": "rewinder", "password": "rewinder"},
                },
                "parameters": self.parameters,
                "pg_hba": ["local all all trust", "host all all 127.0.0.1/32 trust",
                           "host replication all 127.0.0.1/32 trust"],
            },
        }
        path = self.config_path(node)
        path.write_text(json.dumps(config, indent=2) + "\n")
        os.chown(path, *self._owner())

    # -- bring-up ------------------------------------------------------------------------
    def up(self) -> HACluster:
        """etcd, then n1 until it is the primary, then n2 until it streams from n1. Records
        the seconds each took in `timings`. Call it from a thread that lives as long as the
        cluster (the main thread): the kernel's parent-death signal follows the thread that
        started the daemons, not the process."""
        atexit.register(self.down)
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        t0 = time.monotonic()
        sweep_orphans()  # first: an orphan may hold ports of the range
        etcd, peer, rest1, rest2, pg1, pg2 = _free_ports(6)
        self.etcd_port, self.peer_port = etcd, peer
        self.rest_port = {"n1": rest1, "n2": rest2}
        self.pg_port = {"n1": pg1, "n2": pg2}
        shutil.rmtree(self.base, ignore_errors=True)
        for d in ("", "logs", "run", "etcd", *NODES):
            self._mkdir(self.base / d)
        etcd, peer = f"http://127.0.0.1:{self.etcd_port}", f"http://127.0.0.1:{self.peer_port}"
        self._spawn("etcd", [
            "/usr/bin/etcd", "--name", "ha-etcd", "--data-dir", str(self.base / "etcd" / "data"),
            "--listen-client-urls", etcd, "--advertise-client-urls", etcd,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"ha-etcd={peer}", "--initial-cluster-token", self.scope,
            "--initial-cluster-state", "new", "--logger", "zap", "--log-outputs", "stderr",
        ], self.base / "etcd")
        wait_for(lambda: self._get(f"{etcd}/health") == 200, timeout=30, interval=0.05,
                 what="etcd's /health")
        self.timings["etcd"] = time.monotonic() - t0
        for node in NODES:
            self._write_config(node)
        self._spawn("n1", ["/usr/bin/patroni", str(self.config_path("n1"))], self.base / "n1")
        wait_for(lambda: self._rest("n1", "primary") == 200, timeout=60, interval=0.05,
                 what="n1 to become the primary")
        self.timings["primary"] = time.monotonic() - t0
        self._spawn("n2", ["/usr/bin/patroni", str(self.config_path("n2"))], self.base / "n2")
        self._wait_streaming("n1", "n2", timeout=60)
        wait_for(lambda: self._rest("n2", "replica") == 200, timeout=30, interval=0.05,
                 what="n2's /replica")
        self.timings["up"] = time.monotonic() - t0

    # -- REST API and sessions -----------------------------------------------------------
    @staticmethod
    def _get(url: str) -> int | None:
        """The HTTP status of GET url, or None when nothing answers."""
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def _rest(self, node: str, endpoint: str) -> int | None:
        return self._get(f"http://127.0.0.1:{self.rest_port[node]}/{endpoint}")

    def leader(self, timeout: float = 30) -> str:
        """The node whose Patroni answers GET /leader with 200 (exactly one of them)."""
        def one_leader():
            leaders = [n for n in NODES if self._rest(n, "leader") == 200]
            return leaders[0] if len(leaders) == 1 else None
        return wait_for(one_leader, timeout=timeout, interval=0.05, what="a single leader")

    def replica(self, timeout: float = 30) -> str:
        """The node whose Patroni answers GET /replica with 200."""
        def one_replica():
            replicas = [n for n in NODES if self._rest(n, "replica") == 200]
            return replicas[0] if len(replicas) == 1 else None
        return wait_for(one_replica, timeout=timeout, interval=0.05, what="a single replica")

    @staticmethod
    def other(node: str) -> str:
        return NODES[1 - NODES.index(node)]

    def node_of_port(self, port: int) -> str:
        return next(n for n in NODES if self.pg_port[n] == int(port))

    def conninfo(self, node: str | None = None, dbname: str = "postgres",
                 connect_timeout: int = 2, **extra: object) -> str:
        """Node `node`'s connection string over TCP, or with node=None one naming both nodes
        with target_session_attrs=read-write: libpq then finds whichever is the leader."""
        nodes = [node] if node else list(NODES)
        parts = {"host": ",".join("127.0.0.1" for _ in nodes),
                 "port": ",".join(str(self.pg_port[n]) for n in nodes),
                 "user": "postgres", "dbname": dbname, "connect_timeout": connect_timeout,
                 "application_name": "hacluster",
                 **({} if node else {"target_session_attrs": "read-write"}), **extra}
        return " ".join(f"{k}={v}" for k, v in parts.items())

    def connect(self, node: str | None = None, dbname: str = "postgres",
                **extra: object) -> psycopg.Connection:
        return psycopg.connect(self.conninfo(node, dbname, **extra), autocommit=True)

    def writable(self, node: str) -> bool:
        """True when `node` accepts new sessions and is out of recovery (so accepts writes)."""
        try:
            with self.connect(node, connect_timeout=1) as c:
                return not c.execute("SELECT pg_is_in_recovery()").fetchone()[0]
        except psycopg.Error:
            return False

    def _streaming(self, leader: str, replica: str) -> bool:
        try:
            with self.connect(leader, connect_timeout=1) as c:
                return c.execute("SELECT count(*) FROM pg_stat_replication WHERE "
                                 "application_name = %s AND state = 'streaming'",
                                 (replica,)).fetchone()[0] == 1
        except psycopg.Error:
            return False

    def _wait_streaming(self, leader: str, replica: str, timeout: float) -> None:
        wait_for(lambda: self._streaming(leader, replica), timeout=timeout, interval=0.05,
                 what=f"{replica} to stream from {leader}")

    # -- events --------------------------------------------------------------------------
    def switchover(self, timeout: float = 60) -> dict[str, object]:
        """`patronictl switchover --force` (it picks the replica). Returns once the new
        leader accepts writes and patronictl has exited (it returns about 0.6 s after):
        old and new leader, and the seconds to writable and to patronictl's exit."""
        old = self.leader()
        new = self.other(old)
        t0 = time.monotonic()
        ctl = subprocess.Popen(["patronictl", "-c", str(self.config_path(old)), "switchover",
                                "--force"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=self._env(self.base))
        try:
            wait_for(lambda: self.writable(new) or ctl.poll() not in (None, 0), timeout=timeout,
                     interval=0.05, what=f"{new} to accept writes after the switchover")
            writable = time.monotonic() - t0
            out = ctl.communicate(timeout=timeout)[0]
        finally:
            if ctl.poll() is None:
                ctl.kill()
                ctl.wait()
        if ctl.returncode != 0 or not self.writable(new):
            raise RuntimeError(f"patronictl switchover failed (rc {ctl.returncode}): {out}")
        return {"old": old, "new": new, "writable": writable,
                "patronictl": time.monotonic() - t0}

    def postmaster_pid(self, node: str) -> int:
        """The pid of `node`'s postmaster, from postmaster.pid, checked against its cmdline."""
        pid = _postmaster_pid(self.base / node / "data")
        if pid is None:
            raise RuntimeError(f"{node} has no running postmaster")
        return pid

    def failover_by_kill(self, timeout: float = 60) -> dict[str, object]:
        """kill -9 of the leader's postmaster; with primary_start_timeout 0 Patroni promotes
        the other node. Returns once that accepts writes: the nodes and the seconds it took."""
        old = self.leader()
        new = self.other(old)
        pid = self.postmaster_pid(old)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: self.writable(new), timeout=timeout, interval=0.05,
                 what=f"{new} to accept writes after the kill of {old}'s postmaster")
        return {"old": old, "new": new, "writable": time.monotonic() - t0}

    def wait_rejoined(self, timeout: float = 60) -> float:
        """Waits until the leader's pg_stat_replication shows the other node streaming (after
        a failover the old leader is rewound first); returns the seconds waited."""
        t0 = time.monotonic()
        leader = self.leader()
        self._wait_streaming(leader, self.other(leader), timeout)
        return time.monotonic() - t0

    def log_text(self, node: str) -> str:
        """Node's log: its PostgreSQL's stderr and its Patroni's, interleaved."""
        path = self.base / "logs" / f"{node}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- tear-down -----------------------------------------------------------------------
    def _stop(self, names: list[str], timeout: float) -> None:
        """SIGTERM to the named daemons at once; SIGKILL to any still there after `timeout`."""
        procs = [self.procs.pop(n) for n in names if n in self.procs]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def down(self, keep: bool = False) -> float:
        """Stops everything (idempotent); removes the scratch directory unless `keep`.
        Returns the seconds it took."""
        t0 = time.monotonic()
        with self._lock:
            self._stop(list(NODES), timeout=30)  # each Patroni stops its PostgreSQL
            self._stop(["etcd"], timeout=15)
            _sweep(self.base)
            if not keep:
                shutil.rmtree(self.base, ignore_errors=True)
        atexit.unregister(self.down)
        return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1, help="bring-ups, each with a switchover "
                    "and a failover by kill (default 1)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = ap.parse_args()
    for i in range(args.rounds):
        c = HACluster()
        try:
            c.up()
            print(f"round {i + 1}: up {c.timings['up']:.1f} s (etcd {c.timings['etcd']:.1f}, "
                  f"primary {c.timings['primary']:.1f}); leader {c.leader()}", flush=True)
            for name, event in (("switchover", c.switchover), ("kill -9", c.failover_by_kill)):
                r = event()
                extra = f", patronictl {r['patronictl']:.1f} s" if "patronictl" in r else ""
                print(f"  {name}: {r['old']} -> {r['new']} writable in {r['writable']:.1f} s"
                      f"{extra}, {r['old']} streaming again {c.wait_rejoined():.1f} s later",
                      flush=True)
        finally:
            print(f"  down {c.down(keep=args.keep):.1f} s", flush=True)


if __name__ == "__main__":
    main()
