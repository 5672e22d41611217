"""@capped through real task queues: a django-q2 cluster (8 workers, ORM broker, CONN_MAX_AGE =
0) and a Celery worker (prefork, 4 processes, redis broker), against a real cluster.

Each queue's tasks contend for a cap smaller than its workers. Two observers that do not trust
the decorator show the cap binds across the worker processes: the tasks' own ledger (each
region's pid and CLOCK_MONOTONIC start and end, swept for the most regions at once) and a
sampler of the server's view of the cap's holders (pg_locks for session slots,
stage_e_slot_holders for leases). Every task is accounted for (ran + throttled = enqueued), and
the throttles the queue saw (on_throttle's ledger rows, or tasks failed with Throttled in
django-q2's Failure records and Celery's results) equal the extension's count, exactly.

The queues' projects are in tests/python/queues/ (qsite: the Django project; qcelery: the
Celery app); redis is Debian's redis-server, started here on a free loopback port."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pgcluster import Cluster, wait_for

QUEUES = Path(__file__).resolve().parent / "queues"
DEAD = "host=127.0.0.1 port={port} dbname=nowhere user=postgres connect_timeout=2"

# -- helpers ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    """The environment of a queue's processes: our projects importable, and no slot DSN but the
    one a test gives (@capped must find it where the test says, not in the caller's shell)."""
    env = {k: v for k, v in os.environ.items() if k != "STAGE_E_SLOTS_DSN"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(QUEUES), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _stop(proc: subprocess.Popen[Any], what: str, grace: float = 15) -> None:
    """Warm shutdown (SIGTERM to the main process), then SIGKILL of its whole session."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            print(f"{what} did not stop within {grace} s of SIGTERM: killing it")
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # children a warm shutdown left, if any
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def max_overlap(regions: list[tuple[float, float]]) -> int:
    """Most regions in progress at one instant (an end sorts before a start at the same time)."""
    events = sorted([(s, 1) for s, _ in regions] + [(e, -1) for _, e in regions])
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def totals(conn: psycopg.Connection, cap: str) -> dict[str, int]:
    """The cap's exact live counters (stage_e_throttle_totals), zeros while it is not in use."""
    cur = conn.execute("SELECT acquired, throttled, released, foreign_releases, released_by_exit, "
                       "waits, wait_timeouts, expired FROM stage_e_throttle_totals WHERE cap = %s",
                       (cap,))
    row = cur.fetchone()
    assert cur.description is not None
    return {d.name: int(v) for d, v in zip(cur.description, row or [0] * len(cur.description))}


class Sampler:
    """A thread that polls the server for the cap's holders, as fast as it can, until stopped:
    `query` returns one row per held slot, (slot, holder) with holder a pid or a token."""

    def __init__(self, dsn: str, query: str, params: tuple[object, ...]) -> None:
        self.dsn, self.query, self.params = dsn, query, params
        self.samples = 0
        self.most = 0
        self.slots: set[int] = set()
        self.holders: set[int] = set()
        self.seen: list[list[tuple[int, int]]] = []
        self.error: psycopg.Error | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as c:
                while not self.stop.is_set():
                    rows = [(int(s), int(h)) for s, h in c.execute(self.query, self.params)]
                    self.samples += 1
                    self.most = max(self.most, len(rows))
                    self.slots.update(s for s, _ in rows)
                    self.holders.update(h for _, h in rows)
                    if rows:
                        self.seen.append(rows)
                    time.sleep(0.002)
        except psycopg.Error as e:  # reported by sampling(), in the test's thread
            self.error = e


@contextmanager
def sampling(dsn: str, query: str, params: tuple[object, ...]) -> Iterator[Sampler]:
    sampler = Sampler(dsn, query, params)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    try:
        yield sampler
    finally:
        sampler.stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive(), "the sampler did not stop within 30 s"
    if sampler.error is not None:
        raise AssertionError(f"the sampler failed: {sampler.error!r}") from sampler.error


def lock_sampler(dsn: str, cap: str) -> AbstractContextManager[Sampler]:
    """Granted advisory locks on the cap's key in this database: its session slots, from the
    lock manager itself. All of them, whatever the slot number (a slot >= n would count too)."""
    return sampling(dsn, "SELECT objid::int, pid FROM pg_locks WHERE locktype = 'advisory' "
                   "AND objsubid = 2 AND granted AND classid = stage_e_cap_key(%s)::oid "
                   "AND database = (SELECT oid FROM pg_database "
                   "WHERE datname = current_database())", (cap,))


def lease_sampler(dsn: str, cap: str) -> AbstractContextManager[Sampler]:
    """The cap's leases (a lease holds no lock), from stage_e_slot_holders: (slot, token)."""
    return sampling(dsn, "SELECT slot, token FROM stage_e_slot_holders "
                   "WHERE cap = %s AND token IS NOT NULL", (cap,))


def make_ledger(conn: psycopg.Connection) -> None:
    conn.execute("CREATE TABLE queue_ledger (id bigserial PRIMARY KEY, task int NOT NULL, "
                 "outcome text NOT NULL, pid int NOT NULL, started float8 NOT NULL, "
                 "ended float8, backend int, backend_end int)")


def ledger(conn: psycopg.Connection) -> list[tuple[int, str, int, float, float | None]]:
    return [tuple(r) for r in conn.execute(  # type: ignore[misc]
        "SELECT task, outcome, pid, started, ended FROM queue_ledger ORDER BY id")]


def wait_until(done: Callable[[], bool], proc: subprocess.Popen[Any], log: Path, timeout: float,
               what: str) -> float:
    """Polls `done` until true; fails (with the queue's log) after `timeout` s or if the queue's
    process exits first. Returns the seconds it took."""
    started = time.monotonic()
    while not done():
        if proc.poll() is not None:
            raise AssertionError(f"the queue exited ({proc.returncode}) before {what}:\n"
                                 f"{log.read_text(errors='replace')[-6000:]}")
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}:\n"
                                 f"{log.read_text(errors='replace')[-6000:]}")
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.fixture
def observer(cluster: Cluster, db: str) -> Iterator[psycopg.Connection]:
    conn = cluster.connect(db, "queues-observer")
    make_ledger(conn)
    yield conn
    conn.close()


# -- django-q2 ----------------------------------------------------------------------------


class DjangoQ:
    """The qsite project on the test's database: manage.py-style commands and a qcluster."""

    def __init__(self, cluster: Cluster, db: str, tmp: Path, slots_dsn: str | None = None):
        extra = {"DJANGO_SETTINGS_MODULE": "qsite.settings", "QSITE_PGHOST": str(cluster.base),
                 "QSITE_PGPORT": str(cluster.port), "QSITE_PGDATABASE": db}
        if slots_dsn is not None:
            extra["QSITE_SLOTS_DSN"] = slots_dsn
        self.env = _env(**extra)
        self.log = tmp / "qcluster.log"

    def django(self, *args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "django", *args], env=self.env, cwd=QUEUES,
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, f"django {args[0]} failed:\n{out.stdout}{out.stderr}"
        return out.stdout

    def shell(self, code: str) -> Any:
        """Runs `code` in the project's shell; it prints one JSON document, returned here."""
        return json.loads(self.django("shell", "-c", code).strip().splitlines()[-1])

    @contextmanager
    def qcluster(self) -> Iterator[subprocess.Popen[str]]:
        with self.log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "django", "qcluster"], env=self.env,
                                    cwd=QUEUES, stdout=out, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
        try:
            yield proc
        finally:
            _stop(proc, "qcluster")


def run_django_q(cluster: Cluster, db: str, observer: psycopg.Connection, tmp: Path, func: str,
                 tasks: int, slots_dsn: str | None = None) -> dict[str, Any]:
    """Enqueues `tasks` runs of qsite.tasks.`func`, then runs the cluster until every one has its
    Task record; returns what the queue, the ledger and the server saw."""
    q = DjangoQ(cluster, db, tmp, slots_dsn)
    q.django("migrate", "--noinput")
    # Everything enqueued before the cluster starts, so that its 8 workers contend at once.
    q.shell(f"from django_q.tasks import async_task\n"
            f"for t in range({tasks}): async_task('qsite.tasks.{func}', t, group='g')\n"
            f"print('{{}}')")
    done = ("SELECT count(*) FROM django_q_task WHERE \"group\" = 'g'", ())
    with (lock_sampler(cluster.conninfo(db, "queues-sampler"), "q_cap") as locks,
          q.qcluster() as proc):
        seconds = wait_until(lambda: observer.execute(*done).fetchone()[0] >= tasks,  # type: ignore[index]
                             proc, q.log, 60, f"{tasks} django-q2 Task records")
    # django-q2's own records, read through its models: Success and Failure (proxies of Task).
    records = q.shell(
        "import json\nfrom django_q.models import Failure, Success, Task\n"
        "print(json.dumps({'successes': [s.result for s in Success.objects.filter(group='g')], "
        "'failures': [str(f.result) for f in Failure.objects.filter(group='g')], "
        "'attempts': sorted({t.attempt_count for t in Task.objects.filter(group='g')})}))")
    return {"records": records, "ledger": ledger(observer), "locks": locks, "seconds": seconds,
            "totals": totals(observer, "q_cap"), "log": q.log.read_text(errors="replace")}


def report(name: str, figures: dict[str, object]) -> None:
    print(f"\n{name}: {json.dumps(figures)}")


@pytest.mark.parametrize("variant", ["on_throttle", "raises"])
def test_django_q_workers_share_the_cap(cluster, db, observer, tmp_path, variant):
    """40 tasks on 8 workers, cap 3 of "q_cap", each region ~0.15 s, with Django closing its
    connection mid-region (CONN_MAX_AGE = 0, as django-q2's broker does; the ledger shows each
    region's two ends on different backends): at most 3 regions at
    once by the ledger and at most 3 slot locks by pg_locks, taken by several worker processes;
    throttles happened, each one either counted by on_throttle or a failed task with Throttled
    in its Failure record, and exactly as many as the extension counted. The slot DSN comes
    from the Django settings (the app stage_e_slots.django, derived from DATABASES)."""
    tasks = 40
    func = "dispatch_counted" if variant == "on_throttle" else "dispatch_raising"
    since = len(cluster.log_text())
    r = run_django_q(cluster, db, observer, tmp_path, func, tasks)
    # Django's connection at each end of a region that ran: (backend at start, at end).
    django_backends = observer.execute("SELECT backend, backend_end FROM queue_ledger "
                                       "WHERE outcome = 'ran'").fetchall()
    rows, rec, locks, t = r["ledger"], r["records"], r["locks"], r["totals"]
    ran = [row for row in rows if row[1] == "ran"]
    counted = [row for row in rows if row[1] == "throttled"]
    unfinished = [row for row in rows if row[1] not in ("ran", "throttled")]
    regions = [(s, e) for _, _, _, s, e in ran]
    failed_throttled = [f for f in rec["failures"] if "Throttled" in f and "q_cap" in f]
    report(f"django-q2 {variant}", {
        "tasks": tasks, "ran": len(ran), "throttled_on_throttle": len(counted),
        "failed_throttled": len(failed_throttled), "extension": t,
        "max_regions_at_once_ledger": max_overlap(regions),
        "max_slot_locks_pg_locks": locks.most, "pg_locks_samples": locks.samples,
        "worker_pids_that_ran": len({row[2] for row in ran}),
        "slot_holder_backends": len(locks.holders), "seconds": round(r["seconds"], 2)})

    assert unfinished == [] and len({row[0] for row in rows}) == len(rows)
    assert rec["attempts"] == [1]  # no task handed out twice
    # The cap binds, by both observers, and across processes.
    assert max_overlap(regions) <= 3
    assert locks.samples > 50 and 1 <= locks.most <= 3
    assert locks.slots <= {0, 1, 2}
    assert len({row[2] for row in ran}) >= 2 and len(locks.holders) >= 2
    # Every task accounted for, the throttles exactly the extension's.
    assert len(ran) >= 3 and t["acquired"] == t["released"] == len(ran)
    assert t["released_by_exit"] == 0 and t["foreign_releases"] == 0
    if variant == "on_throttle":
        assert Counter(rec["successes"]) == Counter(ran=len(ran), throttled=len(counted))
        assert rec["failures"] == []
        throttled = len(counted)
    else:
        assert counted == []
        assert rec["successes"] == ["ran"] * len(ran)
        assert len(failed_throttled) == len(rec["failures"])  # every failure is a throttle
        throttled = len(failed_throttled)
    assert throttled > 0
    assert len(ran) + throttled == tasks
    assert t["throttled"] == throttled
    # Django did replace its connection mid-region, every time, and no slot went with it.
    assert django_backends and all(a != b for a, b in django_backends)
    assert "exited holding slot(s)" not in cluster.log_text()[since:]


def test_django_q_fails_closed_when_the_database_is_unreachable(cluster, db, observer,
                                                                tmp_path):
    """settings.STAGE_E_SLOTS_DSN pointing at a dead port: every task is throttled (on_throttle
    called, with the ledger's row), none runs uncapped, and the reason is logged."""
    tasks = 12
    dead = DEAD.format(port=_free_port())
    r = run_django_q(cluster, db, observer, tmp_path, "dispatch_counted", tasks, slots_dsn=dead)
    rows = r["ledger"]
    report("django-q2 fail-closed", {
        "tasks": tasks, "ran": sum(1 for row in rows if row[1] != "throttled"),
        "throttled_on_throttle": sum(1 for row in rows if row[1] == "throttled"),
        "seconds": round(r["seconds"], 2)})
    assert [row[1] for row in rows] == ["throttled"] * tasks
    assert sorted(row[0] for row in rows) == list(range(tasks))
    assert r["records"]["successes"] == ["throttled"] * tasks and r["records"]["failures"] == []
    assert r["locks"].most == 0
    assert totals(observer, "q_cap") == totals(observer, "no such cap")  # all zero: never used
    # The reason, logged by every task's call (stage_e_slots's WARNING, qsite's LOGGING).
    assert r["log"].count("treating as throttled (cap 'q_cap'), cannot reach the database") \
        == tasks


# -- Celery -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    """Our own redis-server (Debian's package, not its system service), in the foreground,
    persisting nothing, on a free loopback port; stopped at the end of the module."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is missing: apt-get install -y redis-server "
                    "(scripts/install-deps.sh)")
    import redis

    port = _free_port()
    folder = tmp_path_factory.mktemp("redis")
    log = (folder / "redis.log").open("w")
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--daemonize", "no", "--dir", str(folder)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    try:
        def ready() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                assert proc.poll() is None, (folder / "redis.log").read_text()
                return False

        wait_for(ready, timeout=30, interval=0.05, what="redis-server to answer PING")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        _stop(proc, "redis-server", grace=10)
        log.close()


class CeleryRun:
    """The qcelery app's worker (prefork, 4 processes) on the test's redis and database."""

    def __init__(self, redis_url: str, ledger_dsn: str, slots_dsn: str, tmp: Path) -> None:
        import redis
        from celery import Celery

        redis.Redis.from_url(redis_url).flushdb()  # nothing left from an earlier test
        self.env = _env(QCELERY_BROKER=redis_url, QCELERY_LEDGER_DSN=ledger_dsn,
                        STAGE_E_SLOTS_DSN=slots_dsn)
        self.log = tmp / "celery.log"
        self.client = Celery("qcelery-client", broker=redis_url, backend=redis_url)

    def send(self, name: str, tasks: int) -> list[Any]:
        return [self.client.send_task(name, args=(t,)) for t in range(tasks)]

    @contextmanager
    def worker(self) -> Iterator[subprocess.Popen[str]]:
        with self.log.open("w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "qcelery", "worker", "--pool", "prefork",
                 "--concurrency", "4", "--loglevel", "INFO", "--without-gossip",
                 "--without-mingle", "--without-heartbeat", "-n", f"h3-{os.getpid()}@localhost"],
                env=self.env, cwd=QUEUES, stdout=out, stderr=subprocess.STDOUT, text=True,
                start_new_session=True)
        try:
            yield proc
        finally:
            _stop(proc, "the Celery worker")

    def run(self, results: list[Any]) -> float:
        with self.worker() as proc:
            return wait_until(lambda: all(r.ready() for r in results), proc, self.log, 60,
                              f"{len(results)} Celery results")


def outcomes(results: list[Any]) -> tuple[list[Any], list[Any]]:
    """(values of the tasks that succeeded, tracebacks of those that failed)."""
    ok = [r.result for r in results if r.state == "SUCCESS"]
    failed = [r.traceback or "" for r in results if r.state == "FAILURE"]
    assert len(ok) + len(failed) == len(results), [r.state for r in results]
    return ok, failed


def test_celery_prefork_workers_wait_then_fail_with_throttled(cluster, db, observer, redis_url,
                                                               tmp_path):
    """30 tasks on 4 prefork processes, cap 2 of "c_cap", wait=0.05 s, regions ~0.15 s: at most
    2 regions at once by the ledger and 2 slot locks by pg_locks; a task whose wait ran out
    failed with Throttled, exactly as many as the extension's throttles and timed-out waits."""
    tasks = 30
    dsn = cluster.conninfo(db, "celery-worker")
    c = CeleryRun(redis_url, cluster.conninfo(db, "celery-ledger"), dsn, tmp_path)
    results = c.send("qcelery.wait_raising", tasks)
    with lock_sampler(cluster.conninfo(db, "queues-sampler"), "c_cap") as locks:
        seconds = c.run(results)
    ok, failed = outcomes(results)
    rows = ledger(observer)
    regions = [(s, e) for _, o, _, s, e in rows if o == "ran"]
    throttled = [tb for tb in failed if "Throttled" in tb and "c_cap" in tb]
    t = totals(observer, "c_cap")
    report("celery wait", {
        "tasks": tasks, "ran": len(rows), "failed_throttled": len(throttled), "extension": t,
        "max_regions_at_once_ledger": max_overlap(regions), "max_slot_locks_pg_locks": locks.most,
        "pg_locks_samples": locks.samples, "worker_pids_that_ran": len({r[2] for r in rows}),
        "slot_holder_backends": len(locks.holders), "seconds": round(seconds, 2)})

    assert [o for _, o, _, _, _ in rows] == ["ran"] * len(rows) and ok == ["ran"] * len(rows)
    assert sorted(r[0] for r in rows) == sorted({r[0] for r in rows})
    assert max_overlap(regions) <= 2
    assert locks.samples > 50 and 1 <= locks.most <= 2 and locks.slots <= {0, 1}
    assert len({r[2] for r in rows}) >= 2 and len(locks.holders) >= 2
    assert len(throttled) == len(failed) > 0  # every failure is a throttle, and there were some
    assert len(rows) + len(throttled) == tasks
    assert t["throttled"] == t["wait_timeouts"] == len(throttled)  # each waited, then gave up
    assert t["acquired"] == t["released"] == len(rows)
    assert t["released_by_exit"] == 0 and t["foreign_releases"] == 0


def test_celery_leases_bind_and_their_tokens_grow(cluster, db, observer, redis_url, tmp_path):
    """The same worker, cap 2 of "c_lease" taken as leases (lease_ttl=30 s, wait=0.05 s),
    on_throttle counting to the ledger: stage_e_slot_holders shows the running tasks' leases
    with their tokens, at most 2 at once, no lock held on the cap's key; each new lease of a slot
    has a larger token than all before it on that slot; every lease released by its holder (none
    expired), the throttles exactly the extension's."""
    tasks = 30
    c = CeleryRun(redis_url, cluster.conninfo(db, "celery-ledger"),
                  cluster.conninfo(db, "celery-worker"), tmp_path)
    # Every later acquisition's token is larger than this one's (tokens are server-wide).
    floor_slot, token_floor = observer.execute(
        "SELECT (l).slot, (l).token FROM stage_e_lease('floor', 1, '60 s') AS l").fetchone()  # type: ignore[misc]
    assert observer.execute("SELECT stage_e_release_lease('floor', %s, %s)",
                            (floor_slot, token_floor)).fetchone() == (True,)
    results = c.send("qcelery.lease_counted", tasks)
    with (lease_sampler(cluster.conninfo(db, "queues-sampler"), "c_lease") as leases,
          lock_sampler(cluster.conninfo(db, "queues-lock-sampler"), "c_lease") as locks):
        seconds = c.run(results)
    ok, failed = outcomes(results)
    rows = ledger(observer)
    ran = [r for r in rows if r[1] == "ran"]
    counted = [r for r in rows if r[1] == "throttled"]
    regions = [(s, e) for _, _, _, s, e in ran]
    t = totals(observer, "c_lease")
    # Tokens grow where fencing needs them to: a slot's token is drawn once the slot is claimed,
    # so each new lease of a slot has a larger token than every lease of that slot before it,
    # and every token is above token_floor (drawn before any task ran). Across slots there
    # is no such order to see: a grant draws its token, then may wait for room under the
    # committed horizon before its record is published, so a concurrent grant on another slot
    # with the next token can show in stage_e_slot_holders first (seen in CI, stop 53).
    last_of_slot: dict[int, int] = {}
    regressions: list[tuple[int, int, int]] = []
    for sample in leases.seen:
        for slot, tok in sample:
            before = last_of_slot.get(slot, token_floor)
            if tok < before or tok <= token_floor:
                regressions.append((slot, before, tok))
            last_of_slot[slot] = max(before, tok)
    report("celery lease", {
        "tasks": tasks, "ran": len(ran), "throttled_on_throttle": len(counted), "extension": t,
        "max_regions_at_once_ledger": max_overlap(regions),
        "max_leases_stage_e_slot_holders": leases.most, "holders_samples": leases.samples,
        "distinct_tokens_seen": len(leases.holders), "slot_locks_seen": locks.most,
        "worker_pids_that_ran": len({r[2] for r in ran}), "seconds": round(seconds, 2)})

    assert failed == [] and Counter(ok) == Counter(r[1] for r in rows)
    assert len(ran) + len(counted) == tasks and sorted(r[0] for r in rows) == list(range(tasks))
    assert max_overlap(regions) <= 2
    assert leases.samples > 50 and 1 <= leases.most <= 2 and leases.slots <= {0, 1}
    assert locks.most == 0  # a lease holds no lock
    assert len({r[2] for r in ran}) >= 2
    # Leases were seen while tasks ran, each with its own token (a token per lease taken; the
    # sampler may miss a lease while it is descheduled, never most of them), and tokens grow.
    assert len(ran) // 2 <= len(leases.holders) <= len(ran)
    assert regressions == [], (regressions, leases.seen)
    assert len(counted) > 0 and t["throttled"] == t["wait_timeouts"] == len(counted)
    assert t["acquired"] == t["released"] == len(ran) and t["expired"] == 0
    assert t["foreign_releases"] == 0


def test_celery_fails_closed_when_the_database_is_unreachable(cluster, db, observer, redis_url,
                                                               tmp_path):
    """STAGE_E_SLOTS_DSN pointing at a dead port: every task fails with Throttled, none runs."""
    tasks = 8
    c = CeleryRun(redis_url, cluster.conninfo(db, "celery-ledger"),
                  DEAD.format(port=_free_port()), tmp_path)
    results = c.send("qcelery.wait_raising", tasks)
    seconds = c.run(results)
    ok, failed = outcomes(results)
    report("celery fail-closed", {"tasks": tasks, "ran": len(ledger(observer)),
                                  "failed_throttled": sum("Throttled" in f for f in failed),
                                  "seconds": round(seconds, 2)})
    assert ok == [] and len(failed) == tasks
    assert all("Throttled" in tb and "c_cap" in tb for tb in failed)
    assert ledger(observer) == []
    assert totals(observer, "c_cap") == totals(observer, "no such cap")
    # The reason, logged by every task's call (stage_e_slots's WARNING, in the worker's log).
    assert c.log.read_text(errors="replace").count(
        "treating as throttled (cap 'c_cap'), cannot reach the database") == tasks
