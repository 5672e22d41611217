"""`bench/callgrind.py [PG_CONFIG]`: instructions per in-server acquire+release pair, exactly.

Time on a shared 2-core machine is noisy; instruction counts are not. This makes a cluster with
bench/run.py's PL/pgSQL loops, stops it, and runs a single-user backend under
`valgrind --tool=callgrind` (shared_preload_libraries loaded, no background worker) with each
loop at 10,000 and 30,000 iterations. The difference divided by 20,000 is one pair's cost, with
start-up cancelled out: the stage_e_slots pair (`stage_e_try_slot(8)` + `stage_e_release`), the
SQL advisory-lock pair, and their ratio; then the pair on a named cap, plain and adaptive (its
limit pinned at n = 8 by `stage_e_adapt(cap, 8, 8)`, so the limit's checks run on every
acquisition): what an adaptive cap costs the hot path. Needs valgrind (Debian's `valgrind`) and a release
build (`make install`); takes a few minutes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import run as bench
from pgcluster import PG_CONFIG, Cluster, bindir

LOOPS = {"stage_e_slots": "SELECT inserver_stage_e({n})",
         "SQL advisory locks": f"SELECT inserver_raw({bench.KEY}, {{n}})",
         "named cap": "SELECT inserver_named('plain', {n})",
         "adaptive cap": "SELECT inserver_named('adaptive', {n})"}


def instructions(postgres: str, data: str, query: str) -> int:
    out = tempfile.NamedTemporaryFile(suffix=".callgrind", delete=False).name
    os.chmod(out, 0o666)
    owner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    subprocess.run([*owner, "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                    postgres, "--single", "-D", data,
                    "-c", "shared_preload_libraries=stage_e_slots", "bench"],
                   input=query + "\n", text=True, capture_output=True, check=True)
    with open(out) as f:
        total = re.search(r"^summary: (\d+)", f.read(), re.M)
    os.unlink(out)
    return int(total.group(1))


def main() -> None:
    pg_config = sys.argv[1] if len(sys.argv) > 1 else PG_CONFIG
    c = Cluster("callgrind", pg_config=pg_config, port=5620).init().start()
    try:
        bench.setup(c)
        with c.connect("bench") as s:
            s.execute("""CREATE FUNCTION inserver_named(cap text, iters int) RETURNS void
                         LANGUAGE plpgsql AS $$ DECLARE s int; ok bool; BEGIN
                         FOR i IN 1 .. iters LOOP s := stage_e_try_slot(cap, 8);
                         ok := stage_e_release(cap, s); END LOOP; END $$""")
            s.commit()
            # Kept in the cap's row: the single-user backend's load of the database restores it.
            s.execute("SELECT stage_e_adapt('adaptive', 8, 8)")
            s.commit()
        c.stop()
        postgres = str(bindir(pg_config) / "postgres")
        per_pair = {}
        for name, loop in LOOPS.items():
            small = instructions(postgres, str(c.data), loop.format(n=10_000))
            large = instructions(postgres, str(c.data), loop.format(n=30_000))
            per_pair[name] = (large - small) / 20_000
            print(f"{name}: {per_pair[name]:,.0f} instructions per pair", flush=True)
        ratio = per_pair["stage_e_slots"] / per_pair["SQL advisory locks"]
        print(f"ratio: {ratio:.3f}x")
        adaptive = per_pair["adaptive cap"] / per_pair["named cap"]
        print(f"adaptive cap / named cap: {adaptive:.3f}x")
    finally:
        c.destroy()


if __name__ == "__main__":
    main()
