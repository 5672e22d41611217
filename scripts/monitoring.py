"""A throwaway postgres_exporter and Prometheus for the monitoring tests (Debian's
prometheus-postgres-exporter 0.11.1 and prometheus 2.42, which scripts/install-deps.sh installs
with their services disabled).

Each process lives in a folder of its own (config, data, log), listens on 127.0.0.1 on a free
port, and runs as whoever we are (both run as root). Neither touches the system services
(ports 9187 and 9090).

    with Exporter(exporter_dsn(cluster, "app"), "monitoring/postgres_exporter.yaml") as exp:
        status, text = exp.scrape()
        with Prometheus([exp.address], rule_files=["monitoring/alerts.yaml"]) as prom:
            prom.wait_for_sample("stage_e_slots_held")
            prom.query("sum by (cap) (stage_e_slots_held)")

Run as a script, it prints the Grafana dashboard's PromQL as a Prometheus rule file, one
recording rule per panel query, so that `promtool check rules` parses every one of them
(`make test-monitoring`):

    python3 scripts/monitoring.py dashboard-rules monitoring/grafana-dashboard.json > rules.json
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

EXPORTER = "prometheus-postgres-exporter"
PROMETHEUS = "prometheus"
PROMTOOL = "promtool"


def binary(name: str) -> str:
    found = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin",
                                                      "/usr/sbin"]))
    if not found:
        raise FileNotFoundError(f"{name} is not installed: run scripts/install-deps.sh (or "
                                "apt-get install --no-install-recommends "
                                "prometheus-postgres-exporter prometheus)")
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exporter_dsn(cluster, dbname: str, user: str = "postgres") -> str:
    """The exporter's DATA_SOURCE_NAME for a pgcluster.Cluster, which listens on a Unix socket
    only: key=value, not a URL. --auto-discover-databases appends `dbname=<each database>` to a
    key=value DSN, but sets a URL's path, which a URL with an empty host (a socket given as
    ?host=) turns into the host name: `lookup a2 ... no such host` (0.11.1)."""
    return f"host={cluster.base} port={cluster.port} user={user} dbname={dbname} sslmode=disable"


def http_get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    """(HTTP status, body) of a GET; an HTTP error status is returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _tail(path: Path, lines: int = 20) -> str:
    if not path.exists():
        return f"({path.name} does not exist)"
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(text) if text else f"({path.name} is empty)"


class _Process:
    """A child process in a folder of its own, on a free loopback port, with its output in
    `log`. Subclasses give `_command()` and `_ready()`."""

    name = "process"

    def __init__(self, port: int | None = None, base: str | Path | None = None):
        self.fixed_port = port
        self.port = port
        self.base = Path(base) if base else None
        self.dir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self._own_dir = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def log(self) -> Path:
        return self.dir / f"{self.name}.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.dir and self.log.exists() else ""

    def start(self, timeout: float = 20.0):
        """Starts the process and returns once it answers on its port."""
        if self.proc is not None:
            raise RuntimeError(f"this {self.name} is already running")
        if self.dir is None:
            self._own_dir = self.base is None
            self.dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir=self.base))
        # A port picked for us may be taken before the process binds it: pick another then.
        for attempt in range(3):
            self.port = self.fixed_port or free_port()
            self._prepare()
            self.log.unlink(missing_ok=True)
            with self.log.open("ab") as out:
                self.proc = subprocess.Popen(self._command(), stdin=subprocess.DEVNULL,
                                             stdout=out, stderr=subprocess.STDOUT,
                                             cwd=self.dir, env=self._env())
            deadline = time.monotonic() + timeout
            while True:
                code = self.proc.poll()
                if code is not None:
                    self.proc = None
                    if "address already in use" in self.log_text() and not self.fixed_port \
                            and attempt < 2:
                        break
                    raise RuntimeError(f"{self.name} exited with code {code} at start; "
                                       f"{self.log}:\n{_tail(self.log)}")
                if self._ready():
                    return self
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{self.name} on port {self.port} did not answer within "
                                       f"{timeout}s; {self.log}:\n{_tail(self.log)}")
                time.sleep(0.05)
        raise RuntimeError(f"{self.name} found no free port; {self.log}:\n{_tail(self.log)}")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then waits for the PID (both take a second or two to exit); SIGKILL after
        `timeout`. Removes the folder if this object made it under the system temp folder."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._own_dir and self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _prepare(self) -> None:
        pass

    def _env(self) -> dict[str, str]:
        return dict(os.environ)

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError


class Exporter(_Process):
    """prometheus-postgres-exporter with `queries` as --extend.query-path and nothing else
    exported but its own pg_up/pg_exporter_* series (and go_/process_/promhttp_ ones).
    `auto_discover` adds --auto-discover-databases (with `include`/`exclude` lists)."""

    name = "postgres_exporter"

    def __init__(self, dsn: str, queries: str | Path, auto_discover: bool = False,
                 include: list[str] | None = None, exclude: list[str] | None = None,
                 port: int | None = None, base: str | Path | None = None):
        super().__init__(port, base)
        self.dsn = dsn
        self.queries = Path(queries).resolve()
        self.auto_discover = auto_discover
        self.include = include
        self.exclude = exclude
        self.binary = binary(EXPORTER)

    def _env(self) -> dict[str, str]:
        return {**os.environ, "DATA_SOURCE_NAME": self.dsn}

    def _command(self) -> list[str]:
        cmd = [self.binary, f"--web.listen-address={self.address}",
               f"--extend.query-path={self.queries}",
               "--disable-default-metrics", "--disable-settings-metrics",
               "--no-collector.database", "--no-collector.bgwriter"]
        if self.auto_discover:
            cmd.append("--auto-discover-databases")
        if self.include:
            cmd.append("--include-databases=" + ",".join(self.include))
        if self.exclude:
            cmd.append("--exclude-databases=" + ",".join(self.exclude))
        return cmd

    def _ready(self) -> bool:
        # It listens at once and connects to the database at the first scrape: its landing
        # page answers without touching the database.
        try:
            return http_get(self.url + "/", timeout=1)[0] == 200
        except OSError:
            return False

    def scrape(self, timeout: float = 30.0) -> tuple[int, str]:
        """(HTTP status, body) of one GET /metrics: every query runs once."""
        return http_get(self.url + "/metrics", timeout)


class Prometheus(_Process):
    """A Prometheus scraping `targets` (host:port) every `interval`, evaluating `rule_files`
    as often, with its TSDB in its folder."""

    name = "prometheus"

    def __init__(self, targets: list[str], rule_files: list[str | Path] = (),
                 interval: str = "1s", job: str = "stage_e_slots", port: int | None = None,
                 base: str | Path | None = None):
        super().__init__(port, base)
        self.targets = list(targets)
        self.rule_files = [Path(f).resolve() for f in rule_files]
        self.interval = interval
        self.job = job
        self.binary = binary(PROMETHEUS)

    @property
    def config(self) -> Path:
        return self.dir / "prometheus.yml"

    def _prepare(self) -> None:
        # JSON is YAML: no YAML writer needed.
        config = {
            "global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
            "rule_files": [str(f) for f in self.rule_files],
            "scrape_configs": [{"job_name": self.job,
                                "static_configs": [{"targets": self.targets}]}],
        }
        self.config.write_text(json.dumps(config, indent=2) + "\n")

    def _command(self) -> list[str]:
        return [self.binary, f"--config.file={self.config}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address={self.address}"]

    def _ready(self) -> bool:
        try:
            return http_get(self.url + "/-/ready", timeout=1)[0] == 200
        except OSError:
            return False

    def api(self, path: str, **params) -> dict:
        """The decoded JSON of GET /api/v1/<path>; an error reply is returned, not raised."""
        query = urllib.parse.urlencode(params)
        status, body = http_get(f"{self.url}/api/v1/{path}" + (f"?{query}" if query else ""))
        try:
            reply = json.loads(body)
        except ValueError:
            reply = {"status": "error", "error": f"HTTP {status}: {body[:500]}"}
        reply["http_status"] = status
        return reply

    def query(self, expr: str) -> dict:
        return self.api("query", query=expr)

    def wait_for_sample(self, expr: str, timeout: float = 30.0) -> list:
        """Polls an instant query until it returns a series (the first sample comes about
        5.5 s after the start, whatever the scrape interval); returns the result."""
        deadline = time.monotonic() + timeout
        while True:
            reply = self.query(expr)
            if reply.get("status") == "success" and reply["data"]["result"]:
                return reply["data"]["result"]
            if time.monotonic() > deadline:
                raise AssertionError(f"no sample of {expr} within {timeout}s: {reply}; "
                                     f"{self.log}:\n{_tail(self.log)}")
            time.sleep(0.2)


# -- the Grafana dashboard's queries ---------------------------------------------------------

def dashboard_queries(path: str | Path) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every target of every panel (rows' panels included)."""
    dashboard = json.loads(Path(path).read_text())
    out = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                out.append((panel.get("title", ""), target.get("refId", ""), target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard.get("panels", []))
    return out


def grafana_expr(expr: str, variables: dict[str, str] | None = None,
                 rate_interval: str = "1m") -> str:
    """`expr` with the dashboard's variables replaced as Grafana would: $cap and $db (regex
    matchers, `.*` for All unless given) and $__rate_interval. Any other $variable left over
    is an error."""
    values = {"__rate_interval": rate_interval, "db": ".*", "cap": ".*", **(variables or {})}

    def sub(m):
        name = m.group(1) or m.group(2)
        if name not in values:
            raise ValueError(f"unknown Grafana variable ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, expr)


def dashboard_rules(path: str | Path) -> dict:
    """A Prometheus rule file (as a dict; JSON is YAML) with one recording rule per panel
    query, named after its panel and refId."""
    rules = []
    for i, (title, ref, expr) in enumerate(dashboard_queries(path)):
        slug = re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")
        rules.append({"record": f"dashboard:{slug}:{ref.lower() or i}", "expr": grafana_expr(expr)})
    return {"groups": [{"name": "grafana-dashboard", "rules": rules}]}


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "dashboard-rules":
        print(json.dumps(dashboard_rules(argv[1]), indent=2))
        return 0
    print("usage: monitoring.py dashboard-rules DASHBOARD.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
