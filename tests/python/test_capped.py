"""@capped and Throttled against a real cluster: plain and coroutine functions, the cap binding
across threads, tasks and processes (seen by ledgers the decorator does not write and by the
server's lock table), throttling, waits, leases, and where the DSN comes from."""

import asyncio
import inspect
import json
import logging
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
import time

import psycopg
import pytest
import stage_e_slots
from conftest import (  # tests/conftest.py's, re-exported by tests/python/conftest.py
    cap_locks,
    one,
    stats,
)
from stage_e_slots import Throttled, aio, capped

BAD_DSN = "host=/nonexistent port=1 user=nobody dbname=none connect_timeout=1"


@pytest.fixture
def dsn(cluster, db, monkeypatch):
    monkeypatch.delenv("STAGE_E_SLOTS_DSN", raising=False)
    yield cluster.conninfo(db, "capped-test")
    stage_e_slots.connection_for(cluster.conninfo(db, "capped-test")).close()


def thread_pid(dsn):
    return stage_e_slots.connection_for(dsn)._conn.info.backend_pid


def most_at_once(intervals):
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    at_once = best = 0
    for _, d in events:
        at_once += d
        best = max(best, at_once)
    return best


class LockSampler:
    """Samples, from a session of its own, how many slots of a cap the server says are held
    (pg_locks for session slots, stage_e_slot_holders for leases)."""

    def __init__(self, conninfo, cap, leases=False):
        self.conninfo, self.cap, self.leases = conninfo, cap, leases
        self.samples, self.most, self.slots = 0, 0, set()
        self._stop = threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._run)
        self._thread.start()
        return self

    def _run(self):
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            while not self._stop.is_set():
                if self.leases:
                    held = [r[0] for r in conn.execute(
                        "SELECT slot FROM stage_e_slot_holders WHERE cap = %s AND token IS NOT "
                        "NULL AND expires_at > clock_timestamp()", (self.cap,)).fetchall()]
                else:
                    held = [s for s, _ in cap_locks(conn, self.cap)]
                self.samples += 1
                self.most = max(self.most, len(held))
                self.slots.update(held)
                time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive()


# -- plain functions -------------------------------------------------------------------------

def test_a_call_holds_one_slot_on_the_threads_connection_and_gives_it_back(dsn, connect):
    observer = connect("observer")
    seen = []

    @capped("c", 2, dsn=dsn)
    def work(a, b=0):
        """Does the work."""
        seen.append(cap_locks(observer, "c"))
        return a + b

    assert work(1, b=2) == 3
    assert seen == [[(0, thread_pid(dsn))]]
    assert cap_locks(observer, "c") == []
    assert work.__name__ == "work" and work.__doc__ == "Does the work."
    assert work.__wrapped__(5) == 5  # functools.wraps: the original, uncapped
    assert inspect.signature(work) == inspect.signature(work.__wrapped__)
    s = stats(observer, "c")
    assert (s["acquired"], s["released"], s["throttled"]) == (1, 1, 0)


def test_throttled_raises_with_the_cap_and_n_and_survives_pickling(dsn, connect):
    blocker = connect("blocker")
    assert one(blocker, "SELECT stage_e_try_slots('full', 2, 2)") == [0, 1]
    ran = []

    @capped("full", 2, dsn=dsn)
    def work():
        ran.append(1)

    with pytest.raises(Throttled) as throttled:
        work()
    assert ran == []
    assert (throttled.value.cap, throttled.value.n) == ("full", 2)
    assert "'full'" in str(throttled.value)
    copy = pickle.loads(pickle.dumps(throttled.value))  # task queues send it back pickled
    assert isinstance(copy, Throttled) and (copy.cap, copy.n) == ("full", 2)
    assert str(copy) == str(throttled.value)
    assert stats(blocker, "full")["throttled"] == 1


def test_on_throttle_gets_the_calls_arguments_and_its_result_is_returned(dsn, connect):
    blocker = connect("blocker")
    assert one(blocker, "SELECT stage_e_try_slot('full', 1)") == 0
    calls = []

    def later(*args, **kwargs):
        calls.append((args, kwargs))
        return "queued for later"

    @capped("full", 1, dsn=dsn, on_throttle=later)
    def work(job, *, urgent=False):
        return "ran"

    assert work(7, urgent=True) == "queued for later"
    assert calls == [((7,), {"urgent": True})]
    assert one(blocker, "SELECT stage_e_release('full', 0)") is True
    assert work(8) == "ran" and len(calls) == 1


def test_the_functions_exception_propagates_and_the_slot_is_released(dsn, connect):
    observer = connect("observer")

    @capped("e", 1, dsn=dsn)
    def work():
        assert len(cap_locks(observer, "e")) == 1
        raise KeyError("work failed")

    with pytest.raises(KeyError, match="work failed"):
        work()
    assert cap_locks(observer, "e") == []
    assert stats(observer, "e")["released"] == 1


def test_wait_waits_for_a_slot_and_then_throttles(dsn, connect):
    blocker = connect("blocker")
    assert one(blocker, "SELECT stage_e_try_slot('w', 1)") == 0

    @capped("w", 1, dsn=dsn, wait=10)
    def patient():
        return "ran"

    @capped("w", 1, dsn=dsn, wait=0.3)
    def impatient():
        return "ran"

    start = time.monotonic()
    with pytest.raises(Throttled):
        impatient()
    assert time.monotonic() - start >= 0.3
    timer = threading.Timer(0.5, lambda: one(blocker, "SELECT stage_e_release('w', 0)"))
    timer.start()
    start = time.monotonic()
    assert patient() == "ran"
    assert 0.4 < time.monotonic() - start < 5
    timer.join()
    s = stats(blocker, "w")
    assert (s["waits"], s["wait_timeouts"], s["acquired"], s["released"]) == (2, 1, 2, 2)


def test_lease_ttl_holds_a_lease_instead_of_a_session_slot(dsn, connect):
    observer = connect("observer")
    seen = []

    @capped("leased", 2, dsn=dsn, lease_ttl=30)
    def work():
        seen.append(observer.execute(
            "SELECT slot, token IS NOT NULL, expires_at > clock_timestamp() + interval '20 s' "
            "FROM stage_e_slot_holders WHERE cap = 'leased'").fetchall())
        seen.append(cap_locks(observer, "leased"))

    work()
    assert seen == [[(0, True, True)], []]  # a live lease with a token, and no session lock
    assert observer.execute("SELECT * FROM stage_e_slot_holders WHERE cap = 'leased'"
                            ).fetchall() == []
    s = stats(observer, "leased")
    assert (s["acquired"], s["released"], s["expired"]) == (1, 1, 0)
    slot, _ = observer.execute("SELECT * FROM stage_e_lease('leased', 1, '30 s')").fetchone()

    @capped("leased", 1, dsn=dsn, lease_ttl=30, on_throttle=lambda: "throttled")
    def full():
        return "ran"

    assert slot == 0 and full() == "throttled"


def test_the_dsn_is_read_at_call_time_from_the_environment(dsn, connect, monkeypatch):
    observer = connect("observer")

    @capped("env", 1)
    def work():
        return cap_locks(observer, "env")

    monkeypatch.setenv("STAGE_E_SLOTS_DSN", dsn)  # after the decoration
    assert work() == [(0, thread_pid(dsn))]
    monkeypatch.setenv("STAGE_E_SLOTS_DSN", BAD_DSN)
    with pytest.raises(Throttled):
        work()  # unreachable: throttled, fail closed
    monkeypatch.setenv("STAGE_E_SLOTS_DSN", dsn)
    assert capped("env", 1, dsn=BAD_DSN, on_throttle=lambda: "argument first")(work)() == (
        "argument first")


def test_the_database_unreachable_is_throttled_and_logged(caplog):
    @capped("c", 1, dsn=BAD_DSN)
    def work():
        return "ran"

    with caplog.at_level(logging.WARNING, logger="stage_e_slots"), pytest.raises(Throttled):
        work()
    assert "treating as throttled (cap 'c'), cannot reach the database" in caplog.text
    stage_e_slots.connection_for(BAD_DSN).close()


def _python(code, env):
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, cwd="/tmp", check=False)


def test_without_a_dsn_a_call_raises_runtime_error_and_never_imports_django():
    env = {k: v for k, v in os.environ.items()
           if k not in ("STAGE_E_SLOTS_DSN", "DJANGO_SETTINGS_MODULE")}
    done = _python(
        "import sys\n"
        "from stage_e_slots import capped\n"
        "@capped('c', 1)\n"
        "def work(): pass\n"
        "try:\n"
        "    work()\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
        "print('django imported' if 'django' in sys.modules else 'django not imported')\n",
        env)
    assert done.returncode == 0, done.stderr
    assert "@capped has no database" in done.stdout and "STAGE_E_SLOTS_DSN" in done.stdout
    assert "INSTALLED_APPS" in done.stdout
    assert done.stdout.strip().endswith("django not imported")
    # Django imported but not configured (no settings module): not a Django project either.
    done = _python(
        "import django.conf\n"
        "from stage_e_slots import capped\n"
        "try:\n"
        "    capped('c', 1)(lambda: None)()\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
        "print(django.conf.settings.configured)\n", env)
    assert done.returncode == 0, done.stderr
    assert "@capped has no database" in done.stdout
    assert done.stdout.strip().endswith("False")


def test_in_a_django_project_the_apps_dsn_is_used(cluster, db, connect):
    """With settings configured and the app installed, @capped takes its slots on the app's
    DSN (here built from DATABASES["default"]); without the app, it asks for a DSN."""
    observer = connect("observer")
    env = {k: v for k, v in os.environ.items()
           if k not in ("STAGE_E_SLOTS_DSN", "DJANGO_SETTINGS_MODULE")}
    settings = {
        "DATABASES": {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": db,
                                  "HOST": str(cluster.base), "PORT": str(cluster.port),
                                  "USER": "postgres"}},
    }
    code = (
        "import json, sys\n"
        "import django\n"
        "from django.conf import settings\n"
        "settings.configure(INSTALLED_APPS=json.loads(sys.argv[1]), **json.loads(sys.argv[2]))\n"
        "django.setup()\n"
        "import psycopg\n"
        "from stage_e_slots import capped\n"
        "@capped('dj', 1)\n"
        "def work():\n"
        "    with psycopg.connect(sys.argv[3], autocommit=True) as c:\n"
        "        return c.execute(\"SELECT count(*) FROM stage_e_slot_holders WHERE cap = 'dj'\""
        ").fetchone()[0]\n"
        "try:\n"
        "    print('held', work())\n"
        "except RuntimeError as e:\n"
        "    print('RuntimeError', e)\n")

    def run_with(apps):
        done = subprocess.run(
            [sys.executable, "-c", code, json.dumps(apps), json.dumps(settings),
             cluster.conninfo(db, "observer-2")], env=env, capture_output=True, text=True,
            timeout=120, cwd="/tmp", check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert run_with(["stage_e_slots.django"]) == "held 1"
    assert stats(observer, "dj")["released"] == 1
    assert run_with([]).startswith("RuntimeError @capped has no database")


def test_bad_arguments_raise_at_decoration():
    with pytest.raises(TypeError, match="cap must be a cap name"):
        capped(4, 2)
    with pytest.raises(ValueError, match="n must be a positive int"):
        capped("c", 0)
    with pytest.raises(ValueError, match="wait must not be negative"):
        capped("c", 1, wait=-1)
    with pytest.raises(ValueError, match="ttl must be positive"):
        capped("c", 1, lease_ttl=0)

    def gen():
        yield 1

    with pytest.raises(TypeError, match="generator function"):
        capped("c", 1)(gen)

    async def later():
        return None

    with pytest.raises(TypeError, match="on_throttle .* is a coroutine function"):
        capped("c", 1, on_throttle=later)(lambda: None)


# -- the cap binds: threads and processes ------------------------------------------------------

def test_the_cap_binds_across_threads(dsn, connect):
    n, threads, calls = 3, 8, 12
    intervals, throttled, errors = [], [], []
    lock = threading.Lock()

    @capped("threads", n, dsn=dsn, on_throttle=lambda i: throttled.append(i))
    def work(i):
        start = time.monotonic()
        time.sleep(0.01)
        with lock:
            intervals.append((start, time.monotonic()))

    def client(t):
        try:
            for i in range(calls):
                work(t * 100 + i)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        finally:
            stage_e_slots.connection_for(dsn).close()

    with LockSampler(dsn, "threads") as locks:
        workers = [threading.Thread(target=client, args=(t,)) for t in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(60)
        assert not [t for t in workers if t.is_alive()]
    assert errors == []
    assert len(intervals) + len(throttled) == threads * calls and throttled
    assert 2 <= most_at_once(intervals) <= n
    assert locks.samples > 20 and 1 <= locks.most <= n and locks.slots <= set(range(n))
    s = stats(connect("observer"), "threads")
    assert (s["acquired"], s["released"], s["throttled"]) == (
        len(intervals), len(intervals), len(throttled))


def _process_worker(dsn, ledger, calls, lease):
    """A worker process (forked): @capped calls, each region's CLOCK_MONOTONIC start and end
    appended to the ledger (one write each, O_APPEND), throttles too."""

    @capped("procs", 2, dsn=dsn, wait=0.01, lease_ttl=30 if lease else None)
    def work():
        start = time.monotonic()
        time.sleep(0.02)
        return start, time.monotonic()

    fd = os.open(ledger, os.O_WRONLY | os.O_APPEND)
    try:
        for _ in range(calls):
            try:
                start, end = work()
                os.write(fd, f"ran {os.getpid()} {start} {end}\n".encode())
            except Throttled as e:
                os.write(fd, f"throttled {os.getpid()} {e.cap} {e.n}\n".encode())
    finally:
        os.close(fd)


@pytest.mark.parametrize("lease", [False, True], ids=["session slot", "lease"])
def test_the_cap_binds_across_processes(lease, dsn, connect, tmp_path):
    observer = connect("observer")
    ledger = tmp_path / "ledger"
    ledger.touch()
    processes, calls = 4, 15
    ctx = multiprocessing.get_context("fork")
    with LockSampler(dsn, "procs", leases=lease) as locks:
        workers = [ctx.Process(target=_process_worker, args=(dsn, str(ledger), calls, lease))
                   for _ in range(processes)]
        for p in workers:
            p.start()
        for p in workers:
            p.join(120)
        assert all(p.exitcode == 0 for p in workers)
    lines = [line.split() for line in ledger.read_text().splitlines()]
    ran = [(float(s), float(e)) for kind, _, s, e in lines if kind == "ran"]
    throttled = [line for line in lines if line[0] == "throttled"]
    assert len(lines) == processes * calls and ran and throttled
    assert len({line[1] for line in lines}) == processes
    assert all(line[2:] == ["procs", "2"] for line in throttled)
    assert 1 <= most_at_once(ran) <= 2
    assert locks.samples > 20 and 1 <= locks.most <= 2 and locks.slots <= {0, 1}
    s = stats(observer, "procs")
    assert (s["acquired"], s["released"], s["throttled"]) == (len(ran), len(ran), len(throttled))
    assert (s["foreign_releases"], s["expired"], s["held"]) == (0, 0, 0)


# -- coroutine functions -----------------------------------------------------------------------

def run(main):
    try:
        return asyncio.run(main)
    finally:
        aio._sweep()


def test_a_coroutine_function_holds_its_slot_on_the_loops_connection(dsn, connect):
    observer = connect("observer")
    blocker = connect("blocker")

    @capped("ac", 2, dsn=dsn)
    async def work(a, *, b):
        """Async work."""
        await asyncio.sleep(0)
        return a, b, cap_locks(observer, "ac"), aio.connection_for(dsn)._line.conn.info.backend_pid

    async def fallback(a, *, b):
        return "fallback", a, b

    @capped("ac", 2, dsn=dsn, on_throttle=fallback)
    async def with_async_fallback(a, *, b):
        return "ran"

    @capped("ac", 2, dsn=dsn, on_throttle=lambda a, *, b: ("sync fallback", a, b))
    async def with_sync_fallback(a, *, b):
        return "ran"

    @capped("ac", 2, dsn=dsn)
    async def failing():
        raise KeyError("work failed")

    async def main():
        assert inspect.iscoroutinefunction(work) and work.__doc__ == "Async work."
        a, b, locks, pid = await work(1, b=2)
        assert (a, b) == (1, 2) and locks == [(0, pid)]
        assert cap_locks(observer, "ac") == []
        with pytest.raises(KeyError, match="work failed"):
            await failing()
        assert cap_locks(observer, "ac") == []
        assert one(blocker, "SELECT stage_e_try_slots('ac', 2, 2)") == [0, 1]
        with pytest.raises(Throttled) as throttled:
            await work(1, b=2)
        assert (throttled.value.cap, throttled.value.n) == ("ac", 2)
        assert await with_async_fallback(3, b=4) == ("fallback", 3, 4)
        assert await with_sync_fallback(5, b=6) == ("sync fallback", 5, 6)

    run(main())
    s = stats(observer, "ac")
    assert (s["acquired"], s["released"], s["throttled"]) == (4, 2, 3)


def test_coroutine_functions_wait_and_lease(dsn, connect):
    observer = connect("observer")
    blocker = connect("blocker")
    assert one(blocker, "SELECT stage_e_try_slot('aw', 1)") == 0

    @capped("aw", 1, dsn=dsn, wait=10)
    async def patient():
        return "ran"

    @capped("al", 1, dsn=dsn, lease_ttl=30)
    async def leased():
        return observer.execute("SELECT token IS NOT NULL FROM stage_e_slot_holders "
                                "WHERE cap = 'al'").fetchall(), cap_locks(observer, "al")

    async def main():
        task = asyncio.create_task(patient())
        await asyncio.sleep(0.3)
        assert one(blocker, "SELECT stage_e_release('aw', 0)") is True
        assert await asyncio.wait_for(task, 5) == "ran"
        assert await leased() == ([(True,)], [])

    run(main())
    assert stats(observer, "aw")["waits"] == 1
    s = stats(observer, "al")
    assert (s["acquired"], s["released"], s["expired"]) == (1, 1, 0)


def test_the_cap_binds_across_the_tasks_of_a_loop(dsn, connect):
    """Twenty tasks of one loop, one connection, a cap of 3 and waits: the waits give way to
    the releases, so every call runs, at most 3 at once."""
    intervals = []

    @capped("tasks", 3, dsn=dsn, wait=30)
    async def work():
        start = time.monotonic()
        await asyncio.sleep(0.03)
        intervals.append((start, time.monotonic()))

    async def main():
        await asyncio.wait_for(asyncio.gather(*(work() for _ in range(20))), 60)

    with LockSampler(dsn, "tasks") as locks:
        run(main())
    assert len(intervals) == 20
    assert 2 <= most_at_once(intervals) <= 3
    assert 1 <= locks.most <= 3
    s = stats(connect("observer"), "tasks")
    assert (s["acquired"], s["released"], s["held"]) == (20, 20, 0)
