"""`bench/statements.py [PG_CONFIG]`: instructions per call, each call its own statement.

bench/callgrind.py counts a PL/pgSQL loop's iterations: one transaction for all of them, so a
cost paid once per statement or per transaction (parse, plan, the transaction's end, our
transaction-end callback) is spread to nothing. pgbench sends every call as a statement of its
own; so does this: a single-user backend under `valgrind --tool=callgrind` reads SMALL, then
LARGE lines of one workload, and the difference divided by LARGE - SMALL is one line's cost,
start-up cancelled out. Counts repeat to a few instructions on one machine, whatever its load.

Workloads: the default cap's pair and a named cap's (two statements each), the SQL advisory-lock
pair, a throttled try (this backend holds its cap's one slot), and `SELECT abs(1)`, the floor
of any call with a parameter. (A try on a random one of 1,000 full caps is not among them: in
one backend the caps' holder is the caller, and PostgreSQL's own transaction end then walks its
1,000 advisory locks: `SELECT abs(1)` costs 431k instead of 41k with them held.)

Measured at 0.4.0 to 0.9.0 for issue 36 (PostgreSQL 18, release builds): the named pair
95,821 -> 93,520, the default pair 85,484 -> 85,271, the advisory pair about 85,300 throughout.
Needs valgrind and a release build (`make install`); takes a few minutes. Prints JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from pgcluster import PG_CONFIG, Cluster, bindir

SMALL, LARGE = 2_000, 6_000
HOLD_ONE = "SELECT stage_e_try_slot('c0', 1);"
WORKLOADS = {
    "default pair": ("", "SELECT stage_e_try_slot(8);\nSELECT stage_e_release(0);"),
    "named pair": ("", ("SELECT stage_e_try_slot('tenant:42', 8);\n"
                        "SELECT stage_e_release('tenant:42', 0);")),
    "SQL advisory pair": ("", ("SELECT pg_try_advisory_lock(1, 2);\n"
                               "SELECT pg_advisory_unlock(1, 2);")),
    "throttled try": (HOLD_ONE, "SELECT stage_e_try_slot('c0', 1);"),
    "abs(1)": ("", "SELECT abs(1);"),
}


def instructions(postgres: str, data: str, text: str) -> int:
    with tempfile.NamedTemporaryFile(suffix=".callgrind", delete=False) as tmp:
        out = tmp.name
    os.chmod(out, 0o666)
    owner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    run = subprocess.run([*owner, "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                          postgres, "--single", "-D", data,
                          "-c", "shared_preload_libraries=stage_e_slots", "bench"],
                         input=text, text=True, capture_output=True, check=True)
    # The single-user backend reports a failed statement and still exits 0.
    if re.search(r"\b(ERROR|FATAL|PANIC):  ", run.stdout + run.stderr):
        raise RuntimeError(f"a statement failed under callgrind:\n{run.stdout[-2000:]}")
    with open(out) as f:
        total = re.search(r"^summary: (\d+)", f.read(), re.MULTILINE)
    os.unlink(out)
    return int(total.group(1))


def main(pg_config: str = PG_CONFIG) -> dict:
    c = Cluster("statements", pg_config=pg_config, port=5622).init().start()
    try:
        c.sql("CREATE DATABASE bench")
        with c.connect("bench") as s:
            s.execute("CREATE EXTENSION stage_e_slots")
            version = s.execute("SELECT extversion FROM pg_extension "
                                "WHERE extname = 'stage_e_slots'").fetchone()[0]
        c.stop()
        postgres = str(bindir(pg_config) / "postgres")
        r: dict = {"version": version, "lines": [SMALL, LARGE], "per_line": {}}
        for name, (setup, line) in WORKLOADS.items():
            few = instructions(postgres, str(c.data), f"{setup}\n" + f"{line}\n" * SMALL)
            many = instructions(postgres, str(c.data), f"{setup}\n" + f"{line}\n" * LARGE)
            r["per_line"][name] = round((many - few) / (LARGE - SMALL))
    finally:
        c.destroy()
    print(json.dumps(r, indent=2))
    return r


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else PG_CONFIG)
