"""`bench/ab_handoff.py BASE_PG_CONFIG NEW_PG_CONFIG [ROUNDS]`: the hand-off of two builds.

The waiting figures of `make bench` (32 clients acquiring with a wait and releasing at once),
for a change to the queue: each build gets a cluster of its own, and every round runs each
figure on both, alternating which goes first, so that the machine's noise falls on both alike.
PostgreSQL's own blocking `pg_advisory_lock` runs on both clusters too: its new/base ratio
shows how much of a difference is noise. Prints medians, new/base, and each build's ratio to
PostgreSQL's hand-off at equal contention (the `make bench` targets). Make the base build as
`bench/ab.py` says.
"""

from __future__ import annotations

import statistics
import sys

import run as bench
from pgcluster import Cluster

CLIENTS = 32
FIGURES = {
    "wait n=1": ("pair_wait.sql", 1),
    "PostgreSQL blocking lock, 1 key": ("pair_blocking.sql", 1),
    "wait, 4 caps of n=1, clients spread evenly": ("pair_wait_even.sql", 4),
    "PostgreSQL blocking lock, 4 keys, clients spread evenly": ("pair_blocking_even.sql", 4),
    "wait n=4": ("pair_wait.sql", 4),
}
EQUAL = (("n=1 vs 1 key", "wait n=1", "PostgreSQL blocking lock, 1 key"),
         ("4 caps vs 4 keys, spread evenly", "wait, 4 caps of n=1, clients spread evenly",
          "PostgreSQL blocking lock, 4 keys, clients spread evenly"))


def main() -> None:
    builds = {"base": sys.argv[1], "new": sys.argv[2]}
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    clusters: dict[str, Cluster] = {}
    try:
        for i, (name, cfg) in enumerate(builds.items()):
            c = Cluster(f"abh-{name}", {"fsync": "on", "max_locks_per_transaction": 512,
                                        "max_connections": 100},
                        pg_config=cfg, port=5610 + i).init().start()
            bench.setup(c)
            clusters[name] = c
        names = list(builds)
        seen = {(f, n): [] for f in FIGURES for n in names}
        for r in range(rounds):
            print(f"  round {r + 1}/{rounds}", flush=True)
            for f, (script, n) in FIGURES.items():
                for b in names[r % 2:] + names[:r % 2]:
                    seen[(f, b)].append(bench.pgbench(clusters[b], script, CLIENTS, n=n))
        med = {k: statistics.median(v) for k, v in seen.items()}
        print(f"\n| figure, {CLIENTS} clients (median of {rounds} rounds, tps) | base | new "
              "| new / base |")
        print("| --- | ---: | ---: | ---: |")
        for f in FIGURES:
            b, w = med[(f, "base")], med[(f, "new")]
            print(f"| {f} | {b:,.0f} | {w:,.0f} | {w / b:.3f} |")
        print("\n| against PostgreSQL's hand-off | base | new |\n| --- | ---: | ---: |")
        for label, ours, pg in EQUAL:
            b, w = (med[(ours, n)] / med[(pg, n)] for n in names)
            print(f"| {label} | {b:.3f}x | {w:.3f}x |")
    finally:
        for c in clusters.values():
            c.destroy()


if __name__ == "__main__":
    main()
