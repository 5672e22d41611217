"""`bench/callgrind.py [PG_CONFIG]`: instructions per in-server call, exactly.

Time on a shared 2-core machine is noisy; instruction counts are not. This makes a cluster with
bench/run.py's PL/pgSQL loops, stops it, and runs a single-user backend under
`valgrind --tool=callgrind` (shared_preload_libraries loaded, no background worker) with each
loop at SMALL and LARGE iterations. The difference divided by LARGE - SMALL is one iteration's
cost, with start-up cancelled out:

- the stage_e_slots pair (`stage_e_try_slot(8)` + `stage_e_release`) and the SQL advisory-lock
  pair (`pg_try_advisory_lock` + `pg_advisory_unlock`), and their ratio;
- the pair on a named cap, plain and adaptive (its limit pinned at n = 8 by
  `stage_e_adapt(cap, 8, 8)`, so the limit's checks run on every acquisition): what an
  adaptive cap costs the hot path;
- a throttled `stage_e_try_slot(8)` (the backend holds all 8 slots of its cap) against
  `pg_backend_pid()` in the same loop: a throttled call against a trivial C function.

Prints them and writes results/callgrind.json and results/callgrind.md (the table
bench/readme.py copies into README.md). Needs valgrind (Debian's `valgrind`) and a release
build (`make install`); takes a few minutes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import run as bench
from pgcluster import PG_CONFIG, Cluster, bindir

RESULTS = Path(__file__).resolve().parent / "results"
SMALL, LARGE = 10_000, 30_000
LOOPS = {"stage_e_slots": "SELECT inserver_stage_e({n})",
         "SQL advisory locks": f"SELECT inserver_raw({bench.KEY}, {{n}})",
         "named cap": "SELECT inserver_named('plain', {n})",
         "adaptive cap": "SELECT inserver_named('adaptive', {n})",
         "throttled try": "SELECT inserver_throttled({n})",
         "pg_backend_pid()": "SELECT inserver_backend_pid({n})"}


def instructions(postgres: str, data: str, query: str,
                 settings: list[str] | None = None) -> int:
    """What the single-user backend runs for `query`; `settings` replace the default
    `-c shared_preload_libraries=stage_e_slots` (give it among them)."""
    with tempfile.NamedTemporaryFile(suffix=".callgrind", delete=False) as tmp:
        out = tmp.name
    os.chmod(out, 0o666)
    owner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    run = subprocess.run([*owner, "valgrind", "--tool=callgrind",
                          f"--callgrind-out-file={out}", postgres, "--single", "-D", data,
                          *(settings or ["-c", "shared_preload_libraries=stage_e_slots"]),
                          "bench"],
                         input=query + "\n", text=True, capture_output=True, check=True)
    # The single-user backend reports a failed statement and still exits 0.
    if re.search(r"\b(ERROR|FATAL|PANIC):  ", run.stdout + run.stderr):
        raise RuntimeError(f"{query} failed under callgrind:\n{run.stdout}\n{run.stderr}")
    with open(out) as f:
        total = re.search(r"^summary: (\d+)", f.read(), re.MULTILINE)
    os.unlink(out)
    return int(total.group(1))


def main(pg_config: str = PG_CONFIG, small: int = SMALL, large: int = LARGE,
         loops: list[str] | None = None) -> dict:
    c = Cluster("callgrind", pg_config=pg_config, port=5620).init().start()
    try:
        bench.setup(c)
        with c.connect("bench") as s:
            s.execute("""CREATE FUNCTION inserver_named(cap text, iters int) RETURNS void
                         LANGUAGE plpgsql AS $$ DECLARE s int; ok bool; BEGIN
                         FOR i IN 1 .. iters LOOP s := stage_e_try_slot(cap, 8);
                         ok := stage_e_release(cap, s); END LOOP; END $$""")
            # This backend takes all 8 slots of its cap, then every try is throttled.
            s.execute("""CREATE FUNCTION inserver_throttled(iters int) RETURNS void
                         LANGUAGE plpgsql AS $$ DECLARE s int; BEGIN
                         FOR i IN 1 .. 8 LOOP s := stage_e_try_slot('full', 8);
                           IF s IS NULL THEN RAISE 'slot % not taken', i; END IF; END LOOP;
                         FOR i IN 1 .. iters LOOP s := stage_e_try_slot('full', 8); END LOOP;
                         IF s IS NOT NULL THEN RAISE 'not throttled: %', s; END IF;
                         PERFORM stage_e_release_all(); END $$""")
            s.execute("""CREATE FUNCTION inserver_backend_pid(iters int) RETURNS void
                         LANGUAGE plpgsql AS $$ DECLARE p int; BEGIN
                         FOR i IN 1 .. iters LOOP p := pg_backend_pid(); END LOOP; END $$""")
            s.commit()
            # Kept in the cap's row: the single-user backend's load of the database restores it.
            s.execute("SELECT stage_e_adapt('adaptive', 8, 8)")
            s.commit()
            version = s.execute("SELECT extversion FROM pg_extension "
                                "WHERE extname = 'stage_e_slots'").fetchone()[0]
            server = s.execute("SHOW server_version").fetchone()[0]
        c.stop()
        postgres = str(bindir(pg_config) / "postgres")
        per_call = {}
        for name in loops or LOOPS:
            loop = LOOPS[name]
            few = instructions(postgres, str(c.data), loop.format(n=small))
            many = instructions(postgres, str(c.data), loop.format(n=large))
            per_call[name] = (many - few) / (large - small)
            print(f"{name}: {per_call[name]:,.0f} instructions per iteration", flush=True)
    finally:
        c.destroy()
    commit = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse",
                             "--short", "HEAD"], capture_output=True, text=True, check=False
                            ).stdout.strip() or "unknown"
    r = {"commit": commit, "version": version, "server": server, "iterations": [small, large],
         "per_call": per_call, "ratios": {}}
    for label, a, b in (("stage_e_slots pair / SQL advisory-lock pair", "stage_e_slots",
                         "SQL advisory locks"),
                        ("adaptive cap pair / named cap pair", "adaptive cap", "named cap"),
                        ("throttled try / pg_backend_pid()", "throttled try",
                         "pg_backend_pid()")):
        if a in per_call and b in per_call:
            r["ratios"][label] = per_call[a] / per_call[b]
            print(f"{label}: {r['ratios'][label]:.3f}x")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "callgrind.json").write_text(json.dumps(r, indent=2) + "\n")
    (RESULTS / "callgrind.md").write_text(report(r) + "\n")
    print(f"Wrote {RESULTS}/callgrind.json, callgrind.md")
    return r


def report(r: dict) -> str:
    p = r["per_call"]
    lines = [(f"stage_e_slots {r['version']} on PostgreSQL {r['server']}, commit {r['commit']}: "
              f"instructions per iteration of a PL/pgSQL loop (callgrind, {r['iterations'][1]:,} "
              f"minus {r['iterations'][0]:,} iterations)."), "",
             "| in-server, one iteration | instructions | against | ratio |",
             "| --- | ---: | ---: | ---: |"]
    for name, base, label in (("stage_e_slots", "SQL advisory locks",
                               "stage_e_slots pair (`default`) vs the SQL advisory-lock pair"),
                              ("adaptive cap", "named cap",
                               "pair on an adaptive cap (limit pinned at 8) vs a plain named cap"),
                              ("throttled try", "pg_backend_pid()",
                               "throttled `stage_e_try_slot(8)` vs `pg_backend_pid()`")):
        if name in p and base in p:
            lines.append(f"| {label} | {p[name]:,.0f} | {p[base]:,.0f} | "
                         f"{p[name] / p[base]:.3f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else PG_CONFIG)
