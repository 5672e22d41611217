"""`make bench-quick` (`bench/quick.py [--update] [PG_CONFIG]`): the hot path in instructions,
against a baseline, in a few minutes.

Wall-clock figures on a shared 2-core machine swing by ±15% from run to run; instruction counts
repeat to a few instructions. This counts every hot-path contender that `make bench` times, as
in-server PL/pgSQL loops under callgrind: the cluster's postmaster runs under valgrind, so each
backend writes its own count as it exits; each loop runs in a backend of its own at SMALL and
LARGE iterations, and the difference over LARGE - SMALL is one iteration, connection and
start-up cancelled out (bench/callgrind.py's method, with a server instead of a single-user
backend: another backend holds the slots the throttled loops are refused, as in `make bench`,
and the launcher commits the lease horizons a lease needs):

- the pairs (take and give back): the default cap, a named cap, a lease, and PostgreSQL's SQL
  advisory-lock pair;
- throttled tries on caps whose every slot another backend holds: n = 8, 1,024 and 16,384;
  one named cap of 1,000 live caps, and a random one of them (`'tenant:' || c`);
- the floor of any call with a parameter, `abs(i)`, in the same loop, and as a statement
  `left($1, $2)`, the floor of a call with the throttled try's arguments (text, integer);
- as statements only: `stage_e_try_rate` (issue 37) and PostgreSQL's own function with OUT
  parameters in FROM (`pg_walfile_name_offset`), the floor of any `RETURNS TABLE` call.

Two kinds of verdict:

- **regressions** (what makes `make bench-quick` fail): every count against
  `bench/results/quick-baseline-pg<major>.json`; more than 3% above it fails. `--update`
  rewrites the baseline from this run (after a change that is meant to cost more, say why in
  the commit);
- **targets** (issue 36's and issue 37's, as instruction ratios: a ratio of instructions per call is the
  inverse of a ratio of calls per second when a call's cost is its instructions): printed
  PASS or FAIL beside the wall-clock figures of `make bench`, not a failure of this command;
  their table goes to `bench/results/quick-pg<major>.md` too, which bench/readme.py copies
  into the README.

Needs valgrind (Debian's `valgrind`) and a release build (`make bench-quick` installs one).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from pgcluster import PG_CONFIG, Cluster

RESULTS = Path(__file__).resolve().parent / "results"
SMALL, LARGE = 4_000, 12_000
BIG_N, CAPS = 16384, 1000
HELD = (8, 1024, BIG_N)  # the caps the holder fills
GROWTH = 1.03  # a count more than 3% above its baseline is a regression
# Each count is the least of REPEAT backends': some work is paid by time, not by call (the
# expiry sweep, the launcher's signals), and a backend under valgrind runs some 50 times
# slower, so one backend may pay a few more of those than another (up to 14% of a throttled
# try's count in one backend of PostgreSQL 18); the least is the call's own cost.
REPEAT = 2

# The holder holds a cap of BIG_N, one of 1,024, one of 8 and CAPS caps of 8.
SETTINGS = {"stage_e_slots.max_slots": BIG_N,
            "stage_e_slots.max_session_slots": BIG_N + 1032 + 8 * CAPS + 1,
            "max_locks_per_transaction": 512}

FUNCTIONS = [
    """CREATE FUNCTION q_pair(iters int) RETURNS void LANGUAGE plpgsql AS $$
       DECLARE s int; ok bool; BEGIN
       FOR i IN 1 .. iters LOOP s := stage_e_try_slot(8); ok := stage_e_release(s); END LOOP;
       END $$""",
    """CREATE FUNCTION q_named_pair(iters int) RETURNS void LANGUAGE plpgsql AS $$
       DECLARE s int; ok bool; BEGIN
       FOR i IN 1 .. iters LOOP
         s := stage_e_try_slot('exports', 8); ok := stage_e_release('exports', s);
       END LOOP; END $$""",
    """CREATE FUNCTION q_advisory_pair(iters int) RETURNS void LANGUAGE plpgsql AS $$
       DECLARE got bool; ok bool; BEGIN
       FOR i IN 1 .. iters LOOP
         got := pg_try_advisory_lock(1, 0); ok := pg_advisory_unlock(1, 0);
       END LOOP; END $$""",
    # Another backend (the holder) takes every slot of these caps; the loops are throttled.
    """CREATE FUNCTION q_hold(n int) RETURNS void LANGUAGE plpgsql AS $$ BEGIN
       IF (SELECT count(stage_e_try_slot('full' || n, n)) FROM generate_series(1, n)) <> n
         THEN RAISE 'not all % slots taken', n; END IF; END $$""",
    """CREATE FUNCTION q_hold_caps() RETURNS void LANGUAGE plpgsql AS $$ BEGIN
       IF (SELECT count(stage_e_try_slot('tenant:' || g, 8))
           FROM generate_series(1, CAPS) AS g, generate_series(1, 8)) <> CAPS * 8
         THEN RAISE 'not all slots taken'; END IF; END $$""".replace("CAPS", str(CAPS)),
    """CREATE FUNCTION q_throttled(n int, iters int) RETURNS void LANGUAGE plpgsql AS $$
       DECLARE s int; BEGIN
       FOR i IN 1 .. iters LOOP s := stage_e_try_slot('full' || n, n); END LOOP;
       IF s IS NOT NULL THEN RAISE 'not throttled: %', s; END IF; END $$""",
    # A throttled try on one of the CAPS caps: the same one (caps = 1) or one picked at random
    # (caps = CAPS), with the same work around the call.
    """CREATE FUNCTION q_caps(caps int, iters int) RETURNS void LANGUAGE plpgsql AS $$
       DECLARE s int; c int; BEGIN
       FOR i IN 1 .. iters LOOP
         c := 1 + floor(random() * caps)::int;
         s := stage_e_try_slot('tenant:' || c, 8);
       END LOOP;
       IF s IS NOT NULL THEN RAISE 'not throttled: %', s; END IF; END $$""",
    """CREATE FUNCTION q_lease_pair(iters int) RETURNS void LANGUAGE plpgsql AS $$
       DECLARE l record; ok bool; BEGIN
       FOR i IN 1 .. iters LOOP
         SELECT * INTO l FROM stage_e_lease('leases', 8, '60 s');
         ok := stage_e_release_lease('leases', l.slot, l.token);
       END LOOP; END $$""",
    """CREATE FUNCTION q_floor(iters int) RETURNS void LANGUAGE plpgsql AS $$
       DECLARE x int; BEGIN FOR i IN 1 .. iters LOOP x := abs(i); END LOOP; END $$""",
]

LOOPS = {
    "default pair": "SELECT q_pair({n})",
    "named pair": "SELECT q_named_pair({n})",
    "lease pair": "SELECT q_lease_pair({n})",
    "SQL advisory pair": "SELECT q_advisory_pair({n})",
    "throttled n=8": "SELECT q_throttled(8, {n})",
    "throttled n=1024": "SELECT q_throttled(1024, {n})",
    f"throttled n={BIG_N}": f"SELECT q_throttled({BIG_N}, {{n}})",
    "throttled, one cap of 1,000": "SELECT q_caps(1, {n})",
    "throttled, random cap of 1,000": f"SELECT q_caps({CAPS}, {{n}})",
    "floor: abs(i)": "SELECT q_floor({n})",
}

# Each call its own statement, as pgbench -M prepared sends them (what `make bench` times:
# parse-once, bind, execute, the transaction's end): (the statements of one iteration, each
# with its parameters given the iteration i and the previous statement's answer).
Stmt = tuple[str, Callable[[int, object], tuple[object, ...]]]
STATEMENTS: dict[str, list[Stmt]] = {
    "default pair": [("SELECT stage_e_try_slot(%s::int)", lambda i, p: (8,)),
                     ("SELECT stage_e_release(%s::int)", lambda i, prev: (prev,))],
    "named pair": [("SELECT stage_e_try_slot(%s, %s::int)", lambda i, p: ("exports", 8)),
                   ("SELECT stage_e_release(%s, %s::int)", lambda i, prev: ("exports", prev))],
    "SQL advisory pair": [("SELECT pg_try_advisory_lock(%s::int, 0)", lambda i, p: (1,)),
                          ("SELECT pg_advisory_unlock(%s::int, 0)", lambda i, p: (1,))],
    "throttled n=8": [("SELECT stage_e_try_slot(%s, %s::int)", lambda i, p: ("full8", 8))],
    "throttled, one cap of 1,000": [("SELECT stage_e_try_slot('tenant:' || %s, %s::int)",
                                     lambda i, p: (1, 8))],
    "throttled, random cap of 1,000": [("SELECT stage_e_try_slot('tenant:' || %s, %s::int)",
                                        lambda i, p: (1 + i * 7919 % CAPS, 8))],
    "floor: abs($1)": [("SELECT abs(%s::int)", lambda i, p: (i,))],
    # The floor of a call with the throttled try's arguments (a text and an integer, the same
    # values): PostgreSQL's own left(text, int), whose work is a few instructions; what it
    # costs above abs($1) is what any function of these arguments pays to be called.
    "floor: left($1, $2)": [("SELECT left(%s, %s::int)", lambda i, p: ("full8", 8))],
    # Issue 37: a rate limit on its own, on one of 1,000 keys it always allows, against the
    # floor above and PostgreSQL's own function with OUT parameters in FROM (what any
    # RETURNS TABLE function pays there: the row type rebuilt from pg_proc at executor start).
    "stage_e_try_rate": [("SELECT allowed FROM stage_e_try_rate(%s, 1000000, '1 s', 1000000)",
                          lambda i, p: (str(i % 1000),))],
    "floor: OUT parameters in FROM": [
        ("SELECT file_offset FROM pg_walfile_name_offset(%s::pg_lsn)",
         lambda i, p: (f"0/{i:X}",))],
}
STMT_SMALL, STMT_LARGE = 500, 1_500

# Issues 36 and 37's targets as instruction ratios: (label, group, contender, against, at most).
TARGETS = [
    ("named pair vs default pair (>= 0.95x)", "statements", "named pair", "default pair",
     1 / 0.95),
    ("random cap of 1,000 vs one cap (>= 0.85x)", "statements",
     "throttled, random cap of 1,000", "throttled, one cap of 1,000", 1 / 0.85),
    ("throttled try n=8 vs SELECT abs($1) (>= 0.95x)", "statements", "throttled n=8",
     "floor: abs($1)", 1 / 0.95),
    ("throttled try n=8 vs SELECT left($1, $2), its arguments' floor (>= 0.95x; proposed)",
     "statements", "throttled n=8", "floor: left($1, $2)", 1 / 0.95),
    ("in-server pair vs the SQL advisory pair (<= 1.2x)", "loops", "default pair",
     "SQL advisory pair", 1.2),
    ("issue 37: stage_e_try_rate vs SELECT abs($1) (>= 0.95x)", "statements",
     "stage_e_try_rate", "floor: abs($1)", 1 / 0.95),
]


def _summary(path: Path) -> int:
    total = re.search(r"^summary: (\d+)", path.read_text(), re.MULTILINE)
    if total is None:
        raise RuntimeError(f"no summary in {path}")
    return int(total.group(1))


class _Server:
    """The cluster's postmaster run under callgrind, so that each backend it forks writes its
    own count at its exit (`cg.<pid>`): a loop is counted in a backend of its own while another
    backend holds the slots it is throttled on, as in `make bench`, and the launcher commits
    lease horizons as in production."""

    def __init__(self, c: Cluster) -> None:
        self.c, self.out = c, c.base / "callgrind"
        self.out.mkdir()
        owner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if owner:
            shutil.chown(self.out, "postgres", "postgres")
        with open(c.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*owner, "valgrind", "--tool=callgrind",
                 f"--callgrind-out-file={self.out}/cg.%p", str(c.bin / "postgres"), "-D",
                 str(c.data)], stdout=log, stderr=subprocess.STDOUT, cwd="/tmp")
        deadline = time.monotonic() + 300
        while True:
            try:
                c.connect("bench").close()
                return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start under callgrind: "
                                       f"{c.log_text()[-2000:]}") from None
                time.sleep(1)

    def count(self, query: str) -> int:
        """Instructions of a backend that runs `query` and exits."""
        with self.c.connect("bench") as s:
            pid = s.execute("SELECT pg_backend_pid()").fetchone()[0]
            s.execute(query)
        return self._counted(pid)

    def count_statements(self, statements: list[Stmt], iterations: int) -> int:
        """Instructions of a backend that runs `iterations` times each of `statements`, each
        its own prepared statement and transaction, and exits."""
        with self.c.connect("bench", prepare_threshold=0) as s:
            pid = s.execute("SELECT pg_backend_pid()").fetchone()[0]
            for i in range(iterations):
                prev: object = None
                for query, params in statements:
                    row = s.execute(query, params(i, prev), prepare=True).fetchone()
                    prev = row[0] if row else None
        return self._counted(pid)

    def _counted(self, pid: int) -> int:
        """The count backend `pid` writes as it exits."""
        path = self.out / f"cg.{pid}"
        deadline = time.monotonic() + 120
        while not (path.exists() and "\nsummary: " in path.read_text()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"backend {pid} wrote no count")
            time.sleep(0.2)
        return _summary(path)

    def stop(self) -> None:
        self.c.stop("fast")
        self.proc.wait(120)


def count(pg_config: str) -> dict:
    c = Cluster("quick", {k: (f"'{v}'" if isinstance(v, str) else v)
                          for k, v in SETTINGS.items()}, pg_config=pg_config, port=5623).init()
    server = None
    try:
        c.start()
        c.sql("CREATE DATABASE bench")
        with c.connect("bench") as s:
            s.execute("CREATE EXTENSION stage_e_slots")
            for f in FUNCTIONS:
                s.execute(f)
            version = s.execute("SELECT extversion FROM pg_extension "
                                "WHERE extname = 'stage_e_slots'").fetchone()[0]
            server_version = s.execute("SHOW server_version").fetchone()[0]
        c.stop()
        server = _Server(c)
        with c.connect("bench", application_name="holder") as holder:
            for n in HELD:
                holder.execute("SELECT q_hold(%s)", (n,))
            holder.execute("SELECT q_hold_caps()")
            # A slot of each pair's named cap stays held, so that the launcher never reclaims
            # the cap as idle between two counted backends (the one that then made it anew
            # would count its making): the pairs take slot 1.
            holder.execute("SELECT stage_e_try_slot('exports', 8)")
            holder.execute("SELECT stage_e_lease('leases', 8, '1 day')")
            loops, statements = {}, {}
            for name, loop in LOOPS.items():
                few = min(server.count(loop.format(n=SMALL)) for _ in range(REPEAT))
                many = min(server.count(loop.format(n=LARGE)) for _ in range(REPEAT))
                loops[name] = round((many - few) / (LARGE - SMALL))
                print(f"  loop, {name}: {loops[name]:,} instructions per iteration", flush=True)
            for name, stmts in STATEMENTS.items():
                few = min(server.count_statements(stmts, STMT_SMALL) for _ in range(REPEAT))
                many = min(server.count_statements(stmts, STMT_LARGE) for _ in range(REPEAT))
                statements[name] = round((many - few) / (STMT_LARGE - STMT_SMALL))
                print(f"  statements, {name}: {statements[name]:,} instructions per iteration",
                      flush=True)
    finally:
        if server is not None:
            server.stop()
        c.destroy()
    return {"version": version, "server": server_version,
            "iterations": {"loops": [SMALL, LARGE], "statements": [STMT_SMALL, STMT_LARGE]},
            "loops": loops, "statements": statements}


def major(server: str) -> str:
    return re.match(r"\d+", server).group(0)


def verdicts(r: dict, baseline: dict | None) -> tuple[list[str], bool]:
    """The report's lines, and whether any count regressed (or has no baseline)."""
    lines = ["| contender | instructions | baseline | change | verdict |",
             "| --- | ---: | ---: | ---: | --- |"]
    regressed = False
    for group in ("loops", "statements"):
        for name, now in r[group].items():
            label = f"{group[:-1]}: {name}"
            base = (baseline or {}).get(group, {}).get(name)
            if not base:
                lines.append(f"| {label} | {now:,} | none | | FAIL (no baseline) |")
                regressed = True
                continue
            bad = now > base * GROWTH
            regressed |= bad
            lines.append(f"| {label} | {now:,} | {base:,} | {now / base - 1:+.1%} | "
                         f"{'FAIL (> +3%)' if bad else 'PASS'} |")
    lines += ["", "| target (instruction ratio) | ratio | at most | verdict |",
              "| --- | ---: | ---: | --- |"]
    for label, group, a, b, most in TARGETS:
        ratio = r[group][a] / r[group][b]
        lines.append(f"| {label} | {ratio:.3f} | {most:.3f} | "
                     f"{'PASS' if ratio <= most else 'FAIL'} |")
    return lines, regressed


def main(argv: list[str]) -> int:
    update = "--update" in argv
    args = [a for a in argv if a != "--update"]
    pg_config = args[0] if args else PG_CONFIG
    print(f"bench-quick: {len(LOOPS)} loops ({SMALL:,} and {LARGE:,} iterations) and "
          f"{len(STATEMENTS)} statement workloads ({STMT_SMALL:,} and {STMT_LARGE:,}) under "
          "callgrind", flush=True)
    r = count(pg_config)
    commit = subprocess.run(["git", "-C", str(RESULTS), "rev-parse", "--short", "HEAD"],
                            check=False, capture_output=True, text=True).stdout.strip()
    r["commit"] = commit or "unknown"
    path = RESULTS / f"quick-baseline-pg{major(r['server'])}.json"
    baseline = json.loads(path.read_text()) if path.exists() else None
    lines, regressed = verdicts(r, baseline)
    print(f"\nstage_e_slots {r['version']} on PostgreSQL {r['server']}, commit {commit}; "
          f"baseline: {path.name}" + (f" (commit {baseline['commit']})" if baseline else ""))
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"quick-pg{major(r['server'])}.json").write_text(json.dumps(r, indent=2) + "\n")
    # The targets' table, which bench/readme.py copies into the README.
    targets = lines[lines.index("") + 1:]
    (RESULTS / f"quick-pg{major(r['server'])}.md").write_text(
        f"stage_e_slots {r['version']} on PostgreSQL {r['server']}, commit {commit}: issues 36 "
        "and 37's targets as ratios of instructions per call (`make bench-quick`, callgrind).\n\n"
        + "\n".join(targets) + "\n")
    if update:
        path.write_text(json.dumps(r, indent=2) + "\n")
        print(f"\nWrote the baseline {path}")
        return 0
    if regressed:
        print(f"\nFAIL: a hot-path count grew more than {GROWTH - 1:.0%} against {path.name} "
              "(or has no baseline). If the cost is meant, rerun with --update and say why.")
        return 1
    print(f"\nPASS: no hot-path count grew more than {GROWTH - 1:.0%}.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
