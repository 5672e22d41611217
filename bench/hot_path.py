"""`bench/hot_path.py [PG_CONFIG]`: the hot-path targets of `make bench` alone, in one run.

The acquire+release pair against the raw advisory pair at 1, 8 and 32 clients, and the
throttled try (n = 8, every slot held) against `SELECT 1` at 8 clients: `bench/run.py`'s
`bench_pairs` and `bench_throttled` on a cluster of its own, with `make bench`'s settings, in a
few minutes instead of the whole benchmark. Use a release build (`make install`): `make test`
installs a debug build over it.
"""

from __future__ import annotations

import sys

import run as bench
from pgcluster import PG_CONFIG, Cluster


def main() -> None:
    pg_config = sys.argv[1] if len(sys.argv) > 1 else PG_CONFIG
    c = Cluster("hot-path", {"fsync": "on", "stage_e_slots.max_slots": bench.BIG_N,
                             "stage_e_slots.max_session_slots": bench.BIG_N + 8 * bench.CAPS,
                             "max_locks_per_transaction": 512, "max_connections": 100},
                pg_config=pg_config, port=5650).init().start()
    try:
        bench.setup(c)
        pairs, throttled = bench.bench_pairs(c), bench.bench_throttled(c)
        for n in (1, 8, 32):
            ours, raw = pairs[n]["stage_e_slots"], pairs[n]["raw advisory pair"]
            print(f"pair, {n} client(s): {ours:,.0f} vs raw {raw:,.0f} tps = {ours / raw:.3f}x"
                  " (target >= 0.95x)")
        t, one = throttled["stage_e_slots n=8"], throttled["reference: SELECT 1"]
        print(f"throttled n=8, 8 clients: {t:,.0f} vs SELECT 1 {one:,.0f} tps = {t / one:.3f}x"
              " (target >= 0.9x)")
    finally:
        c.destroy()


if __name__ == "__main__":
    main()
