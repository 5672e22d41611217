"""`bench/latency_bounds.py [PG_CONFIG] [TRIALS]`: the README's 100 ms bounds, measured.

A waiter sleeps on its latch and wakes by itself at least every 100 ms (`RECHECK` in
src/slots/waiting.rs) to look for what no release wakes it for. Three things only that look
finds, each measured TRIALS times on a throwaway cluster of its own (port 5670, `make bench`'s
durability), as the median and the maximum:

1. a slot freed by a raw `pg_advisory_unlock` of a session that took it with
   `pg_try_advisory_lock` (the extension never sees that release): from the unlock to the
   waiter's return, both read from the server's clock (`clock_timestamp()` right after each
   call);
2. a waiting client that went away (its process killed: the kernel closes its socket): from the
   kill to the waiter's backend leaving the queue, seen by an observer polling
   `stage_e_slot_waiters` every millisecond;
3. an expired lease freed by a waiter of its cap: from the lease's `expires_at` to the
   waiter's return (server clock); the launcher's own sweep comes only every 5 s.

In each trial the waiter is seen in the queue before the event, and a random 0-100 ms passes
between its queueing and the event (before the unlock or the kill; before the waiter starts, for
the lease), so the event falls anywhere in the waiter's 100 ms sleep. The bound: every trial
within BOUND_MS (the 100 ms sleep, and SLACK_MS for the wake-up, the look and being scheduled
on a busy machine).

Also measured, for the README's leases section: the first lease of a cap, which waits once for
the lease horizon's advance to commit (fsync on), against a second lease on the same cap.

`bench_bounds(pg_config)` returns the figures (bench/run.py calls it); `main()` also prints the
table and writes results/latency_bounds.json.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scripts"))
import verdicts
from pgcluster import PG_CONFIG, Cluster

PORT = 5670
DB = "bounds"
RESULTS = HERE / "results"
TRIALS = 20
RECHECK_MS = 100
SLACK_MS = 10
BOUND_MS = RECHECK_MS + SLACK_MS
LEASE_TTL_MS = 300
# `SELECT f(...) AS x OFFSET 0` is evaluated before the outer clock_timestamp(): the time
# right after the call returned, on the server's clock.
AFTER = "SELECT x, clock_timestamp() FROM (SELECT {call} AS x OFFSET 0) AS q"


def queued(observer, pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not observer.execute("SELECT EXISTS (SELECT FROM stage_e_slot_waiters WHERE pid = %s)",
                               (pid,)).fetchone()[0]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"backend {pid} did not queue")
        time.sleep(0.002)


class Waiter:
    """A statement run in a thread of its own on `conn`: its row, or its error."""

    def __init__(self, conn, query: str, params=()):
        self.conn, self.pid = conn, conn.info.backend_pid
        self.row, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(query, params))
        self.thread.start()

    def _run(self, query, params) -> None:
        try:
            self.row = self.conn.execute(query, params).fetchone()
        except BaseException as e:  # noqa: BLE001 - reported by result()
            self.error = e

    def result(self, timeout: float = 30):
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RuntimeError(f"backend {self.pid}'s wait hangs")
        if self.error is not None:
            raise self.error
        return self.row


def raw_unlock(cluster: Cluster, trials: int) -> list[float]:
    """ms from a raw pg_advisory_unlock of a cap's slot 0 to the return of the waiter that
    gets it."""
    raw, waiter, observer = (cluster.connect(DB, application_name=a)
                             for a in ("bounds-raw", "bounds-waiter", "bounds-observer"))
    key = observer.execute("SELECT stage_e_cap_key('raw')").fetchone()[0]
    out = []
    try:
        for _ in range(trials):
            assert raw.execute("SELECT pg_try_advisory_lock(%s, 0)", (key,)).fetchone()[0]
            w = Waiter(waiter, AFTER.format(call="stage_e_try_slot('raw', 1, '30 s')"))
            queued(observer, w.pid)
            time.sleep(random.uniform(0, RECHECK_MS / 1e3))
            ok, unlocked = raw.execute(AFTER.format(call="pg_advisory_unlock(%s, 0)"),
                                       (key,)).fetchone()
            assert ok
            slot, got = w.result()
            assert slot == 0, slot
            out.append((got - unlocked).total_seconds() * 1e3)
            assert waiter.execute("SELECT stage_e_release('raw', 0)").fetchone()[0]
    finally:
        for c in (raw, waiter, observer):
            c.close()
    return out


def client_gone(cluster: Cluster, trials: int) -> list[float]:
    """ms from the kill of a waiting client (psql) to its backend leaving the queue."""
    holder, observer = (cluster.connect(DB, application_name=a)
                        for a in ("bounds-holder", "bounds-observer"))
    assert holder.execute("SELECT stage_e_try_slot('gone', 1)").fetchone()[0] == 0
    psql = str(cluster.bin / "psql")
    out = []
    try:
        for i in range(trials):
            name = f"bounds-gone-{i}"
            client = subprocess.Popen(
                [psql, "-X", "-q", "-h", str(cluster.base), "-p", str(cluster.port),
                 "-U", "postgres", "-d", DB, "-c", "SELECT stage_e_try_slot('gone', 1, '60 s')"],
                env={**os.environ, "PGAPPNAME": name}, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
            try:
                deadline = time.monotonic() + 10
                while True:
                    row = observer.execute("SELECT pid FROM stage_e_slot_waiters "
                                           "WHERE application_name = %s", (name,)).fetchone()
                    if row:
                        pid = row[0]
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{name} did not queue")
                    time.sleep(0.002)
                time.sleep(random.uniform(0, RECHECK_MS / 1e3))
                killed = time.perf_counter()
                client.send_signal(signal.SIGKILL)
                while observer.execute("SELECT EXISTS (SELECT FROM stage_e_slot_waiters "
                                       "WHERE pid = %s)", (pid,)).fetchone()[0]:
                    if time.perf_counter() - killed > 10:
                        raise RuntimeError(f"{name}'s backend still waits 10 s after its client"
                                           " was killed")
                    time.sleep(0.001)
                out.append((time.perf_counter() - killed) * 1e3)
            finally:
                client.kill()
                client.wait(10)
    finally:
        holder.close()
        observer.close()
    return out


def expired_lease(cluster: Cluster, trials: int) -> list[float]:
    """ms from a lease's expiry to the return of the waiter that gets its slot."""
    holder, waiter, observer = (cluster.connect(DB, application_name=a)
                                for a in ("bounds-holder", "bounds-waiter", "bounds-observer"))
    out = []
    try:
        for _ in range(trials):
            slot, token = holder.execute("SELECT slot, token FROM stage_e_lease('exp', 1, %s)",
                                         (f"{LEASE_TTL_MS} ms",)).fetchone()
            assert slot == 0, slot
            expires = observer.execute("SELECT expires_at FROM stage_e_slot_holders "
                                       "WHERE cap = 'exp' AND token = %s", (token,)).fetchone()[0]
            # The waiter looks every 100 ms from when it queued: a random start puts the
            # expiry anywhere in its sleep.
            time.sleep(random.uniform(0, RECHECK_MS / 1e3))
            w = Waiter(waiter, AFTER.format(call="stage_e_try_slot('exp', 1, '30 s')"))
            queued(observer, w.pid)
            queued_at = observer.execute("SELECT clock_timestamp()").fetchone()[0]
            if queued_at >= expires:
                raise RuntimeError(f"the waiter queued after the lease of {LEASE_TTL_MS} ms "
                                   "expired: raise LEASE_TTL_MS")
            got_slot, got = w.result()
            assert got_slot == 0, got_slot
            out.append((got - expires).total_seconds() * 1e3)
            assert waiter.execute("SELECT stage_e_release('exp', 0)").fetchone()[0]
    finally:
        for c in (holder, waiter, observer):
            c.close()
    return out


def first_lease(cluster: Cluster, trials: int) -> dict:
    """ms of the first lease of a fresh cap (it waits for the lease horizon's advance to
    commit) and of a second lease on the same cap (the advance already made), client-side."""
    c = cluster.connect(DB, application_name="bounds-first")
    first, second = [], []
    try:
        for i in range(trials):
            for into in (first, second):
                t0 = time.perf_counter()
                slot, token = c.execute("SELECT slot, token FROM stage_e_lease(%s, 2, '10 s')",
                                        (f"first:{i}",)).fetchone()
                into.append((time.perf_counter() - t0) * 1e3)
                assert slot is not None
                assert c.execute("SELECT stage_e_release_lease(%s, %s, %s)",
                                 (f"first:{i}", slot, token)).fetchone()[0]
    finally:
        c.close()
    return {"first": first, "second": second}


def summary(values: list[float]) -> dict:
    return {"median_ms": statistics.median(values), "max_ms": max(values),
            "min_ms": min(values), "trials": len(values), "values_ms": values}


def bench_bounds(pg_config: str = PG_CONFIG, trials: int | None = None) -> dict:
    trials = TRIALS if trials is None else trials
    started = time.monotonic()
    cluster = Cluster("bounds", {"fsync": "on", "max_connections": 100}, port=PORT,
                      pg_config=pg_config).init().start()
    try:
        cluster.create_database(DB)
        with cluster.connect(DB) as c:
            version = c.execute("SELECT extversion FROM pg_extension "
                                "WHERE extname = 'stage_e_slots'").fetchone()[0]
            server = c.execute("SHOW server_version").fetchone()[0]
        print(f"Latency bounds: stage_e_slots {version}, PostgreSQL {server}, {trials} trials "
              "each", flush=True)
        r: dict = {"version": version, "server": server, "bound_ms": BOUND_MS,
                   "recheck_ms": RECHECK_MS}
        for key, what, run in (
                ("raw_unlock", "a slot freed by a raw pg_advisory_unlock", raw_unlock),
                ("client_gone", "a waiting client killed", client_gone),
                ("expired_lease", f"a lease of {LEASE_TTL_MS} ms expired", expired_lease)):
            print(f"  {what}: until the waiter notices", flush=True)
            r[key] = summary(run(cluster, trials))
            print(f"    median {r[key]['median_ms']:.1f} ms, max {r[key]['max_ms']:.1f} ms",
                  flush=True)
        print("  the first lease of a cap against a second one", flush=True)
        got = first_lease(cluster, trials)
        r["first_lease"] = {k: summary(v) for k, v in got.items()}
    finally:
        cluster.destroy()
    r["seconds"] = round(time.monotonic() - started)
    return r


ROWS = (("raw_unlock", "a slot freed by a raw pg_advisory_unlock: unlock to the waiter's return"),
        ("client_gone", "a waiting client killed: kill to its backend leaving the queue"),
        ("expired_lease", "an expired lease: its expires_at to a waiter's return"))


def targets(r: dict) -> list[dict]:
    """Each bound: every trial within BOUND_MS (a verdict on the maximum, one value: a trial
    over the bound is a FAIL, not noise)."""
    return [verdicts.target(f"{what} (max of {r[key]['trials']})", [r[key]["max_ms"]], "<=",
                            r["bound_ms"], " ms") for key, what in ROWS]


def report(r: dict) -> str:
    lines = [(f"stage_e_slots {r['version']} on PostgreSQL {r['server']}: what only a waiter's "
              f"own look (every {r['recheck_ms']} ms) finds, {r['raw_unlock']['trials']} trials "
              "each."), "",
             "| latency (ms) | median | min | max | wanted | |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    rows = r.get("targets") or targets(r)
    for (key, what), t in zip(ROWS, rows):
        s = r[key]
        lines.append(f"| {what} | {s['median_ms']:.1f} | {s['min_ms']:.1f} | "
                     f"{s['max_ms']:.1f} | {t['wanted']} | {t['verdict']} |")
    f = r["first_lease"]
    lines += ["", "| lease on a cap (ms, client-side, fsync on) | median | min | max |",
              "| --- | ---: | ---: | ---: |"]
    for key, what in (("first", "first lease of a cap (waits for the horizon's advance)"),
                      ("second", "second lease, same cap")):
        s = f[key]
        lines.append(f"| {what} | {s['median_ms']:.1f} | {s['min_ms']:.1f} | "
                     f"{s['max_ms']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    pg_config = sys.argv[1] if len(sys.argv) > 1 else PG_CONFIG
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else None
    RESULTS.mkdir(exist_ok=True)
    r = bench_bounds(pg_config, trials)
    r["targets"] = targets(r)
    print("\n" + report(r))
    (RESULTS / "latency_bounds.json").write_text(json.dumps(r, indent=2, default=str) + "\n")
    print(f"\nWrote {RESULTS}/latency_bounds.json ({r['seconds']} s)")
    return 1 if verdicts.failed(r["targets"]) else 0


if __name__ == "__main__":
    sys.exit(main())
