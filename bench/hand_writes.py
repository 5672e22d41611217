"""The cost of the counter table's trigger (`stage_e_throttle_counter_written`) on writes by
hand, the shape of a `pg_dump --inserts` restore: N single-row INSERT statements, each its own
transaction, run by `psql -f` into a loaded database with 20 rate policies, on a cluster of its
own. Prints the time and the time a row for each N; the time a row stays flat as N grows when
the trigger reads through its indexes (it read the whole table at first: quadratic).

    .venv/bin/python bench/hand_writes.py [N ...]     (default: 4000 20000)
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from pgcluster import Cluster

POLICIES = 20


def run(n: int) -> float:
    c = Cluster("hand_writes", {"stage_e_slots.flush_interval": "'1h'"}).init().start()
    try:
        c.create_database("p")
        with c.connect("p", "bench") as a:
            for i in range(POLICIES):
                a.execute("SELECT stage_e_rate_limit(%s, 5, '1 h', 5)", (f"rated{i}",))
            a.execute("SELECT stage_e_try_slot('warm', 1)")  # the database's policies loaded
        with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
            for i in range(n):
                f.write("INSERT INTO public.stage_e_throttle_counter (cap, acquired) "
                        f"VALUES ('k{i}', {i});\n")
        os.chmod(f.name, 0o644)
        try:
            start = time.monotonic()
            c._run(f"{c.bin}/psql", "-X", "-q", "-h", str(c.base), "-p", str(c.port),
                   "-U", "postgres", "-d", "p", "-v", "ON_ERROR_STOP=1", "-f", f.name)
            return time.monotonic() - start
        finally:
            os.unlink(f.name)
    finally:
        c.destroy()


def main() -> None:
    for n in [int(a) for a in sys.argv[1:]] or [4000, 20000]:
        dt = run(n)
        print(f"{n} single-row INSERTs: {dt:.2f} s ({dt / n * 1e6:.0f} us a row)", flush=True)


if __name__ == "__main__":
    main()
