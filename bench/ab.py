"""`bench/ab.py BASE_PG_CONFIG NEW_PG_CONFIG [ROUNDS]`: two builds of stage_e_slots, one run.

For a change that must not make the hot path slower: each build gets a cluster of its own (same
settings), and every round runs each figure on both, in an order that rotates, so that the
machine's noise falls on both alike. Figures: the in-server pair (bench/run.py's PL/pgSQL loop
against the same loop of SQL advisory-lock calls, each build's ratio to the lock manager's own
pair), the acquire+release pair through pgbench at 1 and 8 clients, and the throttled try with
every slot held, at 8 clients (each call must be counted as a throttle). Prints medians and the
new/base ratio of each. Make the base build with a worktree of the base revision, e.g.:

    git worktree add /tmp/base 35846e3 && cd /tmp/base && \
      STAGE_E_PG18_VENV=/opt/stage_e_slots/pg18-base make install PG=18 \
      PG_CONFIG=$(STAGE_E_PG18_VENV=/opt/stage_e_slots/pg18-base scripts/pg-config.sh 18)
"""

from __future__ import annotations

import statistics
import sys

import run as bench
from pgcluster import Cluster


def main() -> None:
    base_cfg, new_cfg = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    builds = {"base": base_cfg, "new": new_cfg}
    clusters: dict[str, Cluster] = {}
    holders = []
    try:
        for i, (name, cfg) in enumerate(builds.items()):
            c = Cluster(f"ab-{name}", pg_config=cfg, port=5600 + i).init().start()
            bench.setup(c)
            clusters[name] = c
        conns = {n: c.connect("bench") for n, c in clusters.items()}
        for n, c in conns.items():  # warm both up, then hold every slot of cap 'tenant:1'
            c.execute("SELECT inserver_stage_e(20000), inserver_raw(%s, 20000)", (bench.KEY,))
            h = clusters[n].connect("bench", application_name="ab-holder")
            held = h.execute("SELECT count(stage_e_try_slot('tenant:1', 8)) "
                             "FROM generate_series(1, 8)").fetchone()[0]
            assert held == 8, held
            holders.append(h)

        def inserver(n: str, which: str) -> float:
            q = ("SELECT inserver_stage_e(%s)", (200_000,)) if which == "stage_e" else \
                ("SELECT inserver_raw(%s, %s)", (bench.KEY, 200_000))
            return conns[n].execute(*q).fetchone()[0]

        figures = {
            "in-server pair, ns": lambda n: inserver(n, "stage_e"),
            "in-server raw advisory pair, ns": lambda n: inserver(n, "raw"),
            "pair, 1 client, tps": lambda n: bench.pgbench(
                clusters[n], "pair_stage_e.sql", 1, n=64),
            "pair, 8 clients, tps": lambda n: bench.pgbench(
                clusters[n], "pair_stage_e.sql", 8, n=64),
            "throttled named cap n=8, 8 clients, tps": lambda n: bench.counted(
                clusters[n], "throttled_named.sql", 8, n=8),
        }
        seen = {(f, n): [] for f in figures for n in builds}
        ratio = {n: [] for n in builds}
        names = list(builds)
        for r in range(rounds):
            print(f"  round {r + 1}/{rounds}", flush=True)
            for f, run in figures.items():
                for n in names[r % 2:] + names[:r % 2]:
                    seen[(f, n)].append(run(n))
            for n in names:
                ratio[n].append(seen[("in-server pair, ns", n)][-1]
                                / seen[("in-server raw advisory pair, ns", n)][-1])
        print(f"\n| figure (median of {rounds} rounds) | base | new | new / base |")
        print("| --- | ---: | ---: | ---: |")
        for f in figures:
            b, w = (statistics.median(seen[(f, n)]) for n in names)
            print(f"| {f} | {b:,.1f} | {w:,.1f} | {w / b:.3f} |")
        b, w = (statistics.median(ratio[n]) for n in names)
        print(f"| in-server pair / raw advisory pair (median of per-round ratios) "
              f"| {b:.3f}x | {w:.3f}x | |")
    finally:
        for h in holders:
            h.close()
        for c in clusters.values():
            c.stop()
            c.destroy()


if __name__ == "__main__":
    main()
