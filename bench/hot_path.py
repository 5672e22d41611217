"""`bench/hot_path.py [PG_CONFIG]`: the hot-path targets of `make bench` alone, in one run.

The acquire+release pair against the raw advisory pair (and a named cap's against `default`'s)
at 1, 8 and 32 clients, and the throttled try against `SELECT 1` and across n at 8 clients:
`bench/run.py`'s `bench_pairs` and `bench_throttled` on a cluster of its own, with `make
bench`'s settings, rounds and targets (median and spread of the per-round ratios, PASS/FAIL
only when every round agrees), in a few minutes instead of the whole benchmark. Use a release
build (`make install`): `make test` installs a debug build over it.
"""

from __future__ import annotations

import sys

import run as bench
import verdicts
from pgcluster import PG_CONFIG, Cluster


def main() -> None:
    pg_config = sys.argv[1] if len(sys.argv) > 1 else PG_CONFIG
    c = Cluster("hot-path", {"fsync": "on", "stage_e_slots.max_slots": bench.BIG_N,
                             "stage_e_slots.max_session_slots": bench.BIG_N + 8 * bench.CAPS,
                             "max_locks_per_transaction": 512, "max_connections": 100},
                pg_config=pg_config, port=5650).init().start()
    try:
        bench.setup(c)
        pairs, pairs_rounds = bench.bench_pairs(c)
        _, throttled_rounds = bench.bench_throttled(c)
        rows = bench.pair_targets(pairs, pairs_rounds) + bench.throttled_targets(throttled_rounds)
        print("\n".join(verdicts.table(rows)))
        print(verdicts.tally(rows))
    finally:
        c.destroy()


if __name__ == "__main__":
    main()
