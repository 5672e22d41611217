"""Rate limits in `make bench` (issue 37), on a cluster of their own; `bench/rates.py` alone runs
just these (a few minutes) into bench/results/rates.json and rates.md.

- **Accuracy**: 16 clients call `stage_e_try_rate('k', 100, '1 s', 10)` as fast as they can
  for 20 s, each call inside a PL/pgSQL function that stamps the server's clock
  (`clock_timestamp()`) right before and right after it; each allowed call writes both stamps
  to an UNLOGGED table: its decision lies between them. The calls allowed are within
  [100 t - 1, 100 t + 10] for a run of t seconds, and no 1 s window [t, t + 1 s) holds more
  than 109 decisions: counted as the calls whose two stamps are both inside the window (a
  count of decisions certainly there, so one above 109 is a true excess), with the count of
  calls that may have been there (their span meets the window) and the widest span beside it.
  (A single stamp taken after each decision counted 110 in some window: a call decided just
  before a window's end and stamped just after it moves into the next.) The same for 1,000
  keys at 10 a second each (bursts of 10): every key within [10 t - 1, 10 t + 10] and at most
  19 in any of its 1 s windows.
- **Speed** (pgbench -M prepared, 8 clients, rounds alternating, ratios within each round):
  `stage_e_try_rate` against `SELECT abs($1)` (the floor of any call with a parameter), target
  >= 0.95x; and the two SQL peers of `../shared/docs/landscape-3.md`, on one hot key and on
  1,000 keys: a PL/pgSQL token bucket (`UPDATE ... RETURNING` on a logged row) and liberapay's
  leaky bucket (`INSERT ... ON CONFLICT` into an UNLOGGED table), ratios reported (the issue
  expects >= 5x).

- **Composed**: a cap of n = 4 with a rate policy of 20 a second (`stage_e_rate_limit`), 16
  clients taking a slot with `wait => '2 s'` and holding it 10 ms, for 30 s: never more than 4
  held (pg_locks sampled by an observer), at most 20 admissions in any 1 s window (+ the burst
  of 1), and the rate used: at least 0.95 x 20 a second over the run.
- **The pair on a rate-limited cap** (a rate it never refuses) against the pair on a plain cap,
  8 clients: target >= 0.95x.
"""

from __future__ import annotations

import bisect
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import verdicts
from pgcluster import PG_CONFIG, Cluster

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DB = "rates"
PORT = 5641
ACCURACY_S = 20
ROUNDS, SECONDS, CLIENTS = 5, 3, 8

PEERS = """
-- Each allowed call's decision lies between two server stamps taken around it (before, after).
CREATE UNLOGGED TABLE rate_log (key text, before timestamptz, after timestamptz);
CREATE FUNCTION stamped_rate(k text, cnt int, burst int) RETURNS void LANGUAGE plpgsql AS $$
DECLARE before timestamptz := clock_timestamp(); ok boolean; BEGIN
  SELECT allowed INTO ok FROM stage_e_try_rate(k, cnt, '1 s', burst);
  IF ok THEN INSERT INTO rate_log VALUES (k, before, clock_timestamp()); END IF;
END $$;
-- A PL/pgSQL token bucket on a logged row (the usual answer on Stack Overflow and in blogs).
CREATE TABLE token_buckets (key text PRIMARY KEY, tokens float8 NOT NULL, at timestamptz NOT NULL);
CREATE FUNCTION take_token(k text, rate float8, burst float8) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE ok boolean; now timestamptz := clock_timestamp(); BEGIN
  INSERT INTO token_buckets VALUES (k, burst, now) ON CONFLICT DO NOTHING;
  UPDATE token_buckets
     SET tokens = least(burst, tokens + rate * extract(epoch FROM now - at)) - 1, at = now
   WHERE key = k AND least(burst, tokens + rate * extract(epoch FROM now - at)) >= 1
  RETURNING true INTO ok;
  RETURN coalesce(ok, false);
END $$;
-- liberapay's leaky bucket (liberapay/utils/__init__.py, sql/app-conf-...): one upsert into
-- an UNLOGGED table, the counter leaked by the time since its last update.
CREATE UNLOGGED TABLE rate_limiting (key text PRIMARY KEY, counter int NOT NULL,
                                     ts timestamptz NOT NULL);
CREATE FUNCTION compute_leak(cap int, period float8, last_leak timestamptz) RETURNS int
LANGUAGE sql AS $$
  SELECT trunc(cap * extract(epoch FROM clock_timestamp() - last_leak) / period)::int $$;
CREATE FUNCTION hit_rate_limit(k text, cap int, period float8) RETURNS boolean
LANGUAGE sql AS $$
  INSERT INTO rate_limiting AS r (key, counter, ts) VALUES (k, 1, clock_timestamp())
  ON CONFLICT (key) DO UPDATE
     SET counter = r.counter + 1 - least(compute_leak(cap, period, r.ts), r.counter),
         ts = clock_timestamp()
  RETURNING counter <= cap $$;
"""

SCRIPTS = {
    "abs($1)": "\\set x random(1, 1000)\nSELECT abs(:x);\n",
    "stage_e_try_rate": ("\\set x random(1, 1000)\n"
                         "SELECT allowed FROM stage_e_try_rate('k' || :x, 1000000, '1 s', "
                         "1000000);\n"),
    # One hot key and 1,000 keys, each at 100 a second with bursts of 10 (mostly refused on the
    # hot key: the refused path is the common one under load).
    "stage_e_try_rate, hot key": ("\\set x 1\nSELECT allowed FROM stage_e_try_rate('hot', 100, "
                                  "'1 s', 10, :x);\n"),
    "token bucket (PL/pgSQL), hot key": "\\set x 1\nSELECT take_token('hot', 100, 10);\n",
    "leaky bucket (liberapay), hot key": "\\set x 1\nSELECT hit_rate_limit('hot', 10, 0.1);\n",
    "stage_e_try_rate, 1,000 keys": ("\\set x random(1, 1000)\nSELECT allowed FROM "
                                     "stage_e_try_rate('key' || :x, 100, '1 s', 10);\n"),
    "token bucket (PL/pgSQL), 1,000 keys": ("\\set x random(1, 1000)\n"
                                            "SELECT take_token('key' || :x, 100, 10);\n"),
    "leaky bucket (liberapay), 1,000 keys": ("\\set x random(1, 1000)\n"
                                             "SELECT hit_rate_limit('key' || :x, 10, 0.1);\n"),
    "pair, plain cap": ("SELECT stage_e_try_slot('plain', 64) AS s \\gset\n"
                        "SELECT stage_e_release('plain', :s);\n"),
    "pair, rate-limited cap": ("SELECT stage_e_try_slot('limited', 64) AS s \\gset\n"
                               "SELECT stage_e_release('limited', :s);\n"),
}
COMPOSED_S, COMPOSED_CLIENTS, COMPOSED_RATE = 30, 16, 20


def pgbench(c: Cluster, script: str, clients: int, seconds: int, db: str = DB) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False, dir="/tmp") as f:
        f.write(script)
    Path(f.name).chmod(0o644)
    cmd = [str(c.bin / "pgbench"), "-n", "-M", "prepared", "-h", str(c.base), "-p",
           str(c.port), "-U", "postgres", "-c", str(clients), "-j", str(min(clients, 2)), "-T",
           str(seconds), "-f", f.name, db]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    Path(f.name).unlink()
    m = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out.stdout)
    if not m:
        raise RuntimeError(f"pgbench failed: {out.stdout[-500:]} {out.stderr[-500:]}")
    return float(m.group(1))


def bracketed_windows(calls: list[tuple[float, float]]) -> tuple[int, int]:
    """For calls each decided at an unknown instant within (before, after): the most that were
    certainly decided inside one window [t, t + 1 s) (before >= t and after < t + 1: a lower
    bound of the true most, so a count above the bound is a true excess), and the most that
    may have been (their spans meet the window: an upper bound). A window that holds calls
    certainly starts at one of their `before`s, and one that may hold them at an `after`."""
    calls = sorted(calls)
    certain = 0
    for i, (t, _) in enumerate(calls):
        inside, j = 0, i
        while j < len(calls) and calls[j][0] < t + 1.0:
            inside += calls[j][1] < t + 1.0
            j += 1
        certain = max(certain, inside)
    # [t, t + 1) meets the spans with before < t + 1 less those over by t (after < t: their
    # before is < t + 1 too).
    befores, afters = [b for b, _ in calls], sorted(a for _, a in calls)
    possible = max((bisect.bisect_left(befores, t + 1.0) - bisect.bisect_left(afters, t)
                    for t in afters), default=0)
    return certain, possible


def windows(stamps: list[float]) -> int:
    """The most stamps in any window of 1 s."""
    stamps, most, j = sorted(stamps), 0, 0
    for i, t in enumerate(stamps):
        while stamps[j] <= t - 1.0:
            j += 1
        most = max(most, i - j + 1)
    return most


def accuracy(c: Cluster, keys: int, count: int, burst: int) -> dict:
    """16 clients for ACCURACY_S seconds on `keys` keys (picked at random) at `count` a second
    and bursts of `burst`: per key, how many were allowed and the most in any 1 s window."""
    with c.connect(DB) as s:
        s.execute("TRUNCATE rate_log")
    tag = f"acc{keys}:"
    pick = "1" if keys == 1 else f"random(1, {keys})"
    script = f"\\set x {pick}\nSELECT stamped_rate('{tag}' || :x, {count}, {burst});\n"
    started = time.time()
    calls = pgbench(c, script, 16, ACCURACY_S) * ACCURACY_S
    elapsed = time.time() - started
    with c.connect(DB) as s:
        rows = s.execute("SELECT key, extract(epoch FROM before)::float8, "
                         "extract(epoch FROM after)::float8 FROM rate_log").fetchall()
    per_key: dict[str, list[tuple[float, float]]] = {}
    for key, before, after in rows:
        per_key.setdefault(key, []).append((before, after))
    spans = [bracketed_windows(v) for v in per_key.values()]
    # The run's own length: from pgbench's start to its end, less connecting (at most it).
    allowed = [len(v) for v in per_key.values()] + [0] * (keys - len(per_key))
    return {"keys": keys, "count": count, "burst": burst, "seconds": ACCURACY_S,
            "elapsed": elapsed, "calls": round(calls), "allowed_total": sum(allowed),
            "allowed_min": min(allowed), "allowed_max": max(allowed),
            "window_max": max((w[0] for w in spans), default=0),
            "window_max_possible": max((w[1] for w in spans), default=0),
            "span_max_ms": 1000 * max((a - b for v in per_key.values() for b, a in v),
                                      default=0.0)}


def composed(c: Cluster) -> dict:
    """16 clients on a cap of 4 limited to 20 a second: each takes a slot waiting up to 2 s,
    holds it 10 ms, gives it back; an observer samples the cap's granted locks in pg_locks."""
    with c.connect(DB) as s:
        s.execute("SELECT stage_e_rate_limit('composed', %s, '1 s')", (COMPOSED_RATE,))
        key = s.execute("SELECT stage_e_cap_key('composed')").fetchone()[0]
    stop = time.monotonic() + COMPOSED_S
    grants: list[float] = []
    timeouts = [0]
    held_max = [0]
    lock = threading.Lock()

    def client() -> None:
        with c.connect(DB, "composed") as s:
            while time.monotonic() < stop:
                slot = s.execute("SELECT stage_e_try_slot('composed', 4, '2 s')").fetchone()[0]
                if slot is None:
                    with lock:
                        timeouts[0] += 1
                    continue
                with lock:
                    grants.append(time.monotonic())
                time.sleep(0.01)
                s.execute("SELECT stage_e_release('composed', %s)", (slot,))

    def observer() -> None:
        with c.connect(DB, "observer") as s:
            while time.monotonic() < stop:
                held = s.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                                 "AND classid = %s::oid AND objsubid = 2 AND granted",
                                 (key,)).fetchone()[0]
                held_max[0] = max(held_max[0], held)
                time.sleep(0.002)

    threads = [threading.Thread(target=client) for _ in range(COMPOSED_CLIENTS)]
    threads.append(threading.Thread(target=observer))
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    return {"seconds": COMPOSED_S, "elapsed": elapsed, "clients": COMPOSED_CLIENTS,
            "rate": COMPOSED_RATE, "n": 4, "grants": len(grants), "timeouts": timeouts[0],
            "held_max": held_max[0], "window_max": windows(grants),
            "per_second": len(grants) / COMPOSED_S}


def bench_rates(pg_config: str = PG_CONFIG) -> dict:
    started = time.monotonic()
    c = Cluster("rates_bench", {"fsync": "on", "max_connections": 100}, port=PORT,
                pg_config=pg_config).init().start()
    try:
        c.create_database(DB)
        with c.connect(DB) as s:
            s.execute(PEERS)
            version = s.execute("SELECT extversion FROM pg_extension "
                                "WHERE extname = 'stage_e_slots'").fetchone()[0]
            server = s.execute("SHOW server_version").fetchone()[0]
        print("  rate accuracy: one key, 16 clients, 20 s", flush=True)
        one = accuracy(c, 1, 100, 10)
        print("  rate accuracy: 1,000 keys, 16 clients, 20 s", flush=True)
        many = accuracy(c, 1000, 10, 10)
        print(f"  composed: a cap of 4 at {COMPOSED_RATE}/s, {COMPOSED_CLIENTS} clients, "
              f"{COMPOSED_S} s", flush=True)
        both = composed(c)
        with c.connect(DB) as s:  # a rate the pair never meets: its cost alone
            s.execute("SELECT stage_e_rate_limit('limited', 1000000000, '1 s', 1000000000)")
        seen: dict[str, list[float]] = {k: [] for k in SCRIPTS}
        order = list(SCRIPTS)
        print(f"  rate speed: {len(SCRIPTS)} workloads, {ROUNDS} rounds x {SECONDS} s, "
              f"{CLIENTS} clients", flush=True)
        for r in range(ROUNDS):
            for name in (order if r % 2 == 0 else order[::-1]):
                seen[name].append(pgbench(c, SCRIPTS[name], CLIENTS, SECONDS))
    finally:
        c.destroy()
    return {"version": version, "server": server, "accuracy": {"one key": one,
                                                               "1,000 keys": many},
            "composed": both,
            "tps_rounds": seen, "tps": {k: statistics.median(v) for k, v in seen.items()},
            "seconds": round(time.monotonic() - started)}


def targets(r: dict) -> list[dict]:
    """The issue's bounds for a run of ACCURACY_S seconds (pgbench -T: its clients call for
    that long), each measured once; the speed ratios round by round."""
    T, rows = verdicts.target, []
    for label, a in r["accuracy"].items():
        t, count, burst = a["seconds"], a["count"], a["burst"]
        rows.append(T(f"rate accuracy, {label}: most allowed for a key", [a["allowed_max"]],
                      "<=", count * t + burst, ""))
        rows.append(T(f"rate accuracy, {label}: fewest allowed for a key", [a["allowed_min"]],
                      ">=", count * t - 1, ""))
        rows.append(T(f"rate accuracy, {label}: most allowed for a key in a 1 s window "
                      "(decided certainly inside it)",
                      [a["window_max"]], "<=", count + burst - 1, ""))
    if "composed" in r:
        b = r["composed"]
        rows.append(T("composed (n = 4, 20/s): most held at once (pg_locks)", [b["held_max"]],
                      "<=", 4, ""))
        rows.append(T("composed (n = 4, 20/s): most admitted in a 1 s window", [b["window_max"]],
                      "<=", b["rate"] + 1, ""))
        rows.append(T("composed (n = 4, 20/s): admitted per second over the run",
                      [b["per_second"]], ">=", 0.95 * b["rate"], "/s"))
    tps = r["tps_rounds"]
    if "pair, rate-limited cap" in tps:
        rows.append(T("pair on a rate-limited cap vs on a plain cap, 8 clients",
                      verdicts.ratios(tps["pair, rate-limited cap"], tps["pair, plain cap"]),
                      ">=", 0.95))
    rows.append(T("stage_e_try_rate vs SELECT abs($1), 8 clients",
                  verdicts.ratios(tps["stage_e_try_rate"], tps["abs($1)"]), ">=", 0.95))
    for where in ("hot key", "1,000 keys"):
        for peer in ("token bucket (PL/pgSQL)", "leaky bucket (liberapay)"):
            rows.append(T(f"stage_e_try_rate vs {peer}, {where}, 8 clients",
                          verdicts.ratios(tps[f"stage_e_try_rate, {where}"],
                                          tps[f"{peer}, {where}"]), ">=", 5.0))
    return rows


def report(r: dict) -> str:
    lines = [(f"Rate limits: stage_e_slots {r['version']} on PostgreSQL {r['server']}. "
              f"Accuracy: 16 clients for {ACCURACY_S} s; speed: pgbench -M prepared, {CLIENTS} "
              f"clients, {ROUNDS} rounds x {SECONDS} s alternating, ratios within each round."),
             "",
             ("| accuracy | calls | allowed (all keys) | fewest / most for a key | most in 1 s "
              "(certainly / possibly) | widest stamp span |"),
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, a in r["accuracy"].items():
        lines.append(f"| {label}, {a['count']}/s, burst {a['burst']}, {a['elapsed']:.1f} s | "
                     f"{a['calls']:,} | {a['allowed_total']:,} | {a['allowed_min']} / "
                     f"{a['allowed_max']} | {a['window_max']} / "
                     f"{a.get('window_max_possible', '?')} | {a.get('span_max_ms', 0):.1f} ms |")
    if "composed" in r:
        b = r["composed"]
        lines += ["", ("| composed: n = 4, 20/s, 16 clients waiting up to 2 s, holding 10 ms | "
                       "figure |"), "| --- | ---: |",
                  (f"| admitted in {b['seconds']} s | {b['grants']:,} "
                   f"({b['per_second']:.1f}/s) |"),
                  f"| most admitted in a 1 s window | {b['window_max']} |",
                  f"| most held at once (pg_locks, sampled) | {b['held_max']} |",
                  f"| waits that timed out | {b['timeouts']:,} |"]
    lines += ["", "| workload | tps (median) |", "| --- | ---: |"]
    lines += [f"| {k} | {v:,.0f} |" for k, v in r["tps"].items()]
    rows = r.get("targets") or targets(r)
    lines += ["", f"Targets ({verdicts.tally(rows)}):", ""] + verdicts.table(rows)
    return "\n".join(lines)


def main() -> int:
    r = bench_rates(sys.argv[1] if sys.argv[1:] else PG_CONFIG)
    r["targets"] = targets(r)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rates.json").write_text(json.dumps(r, indent=2) + "\n")
    text = report(r)
    (RESULTS / "rates.md").write_text(text + "\n")
    print("\n" + text)
    return 1 if verdicts.failed(r["targets"]) else 0


if __name__ == "__main__":
    sys.exit(main())
