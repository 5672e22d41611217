"""Fair shares (issue 38), on a cluster of their own: `bench/shares.py [PG_CONFIG]` runs these
(about five minutes) into bench/results/shares.json, shares.md and shares.png; `make bench`
runs them too (`bench_shares`), with its other parts.

- **Flood**: n = 4, each grant held 50 ms (plotted with the two runs below). Share A queues
  64 waiters behind 4 blockers, then share B's one waiter arrives, and the blockers release
  one at a time, 10 ms apart. B is served within the next 2 grants (in arrival order it would
  be the 65th; the grants are ordered by the server's clock), and its wait is at most 1.5x the
  hold time.
- **Many tenants**: n = 4, each grant held 5 ms; one share queues 1,000 waiters, then 200
  shares queue one waiter each (1,204 sessions): every small share is served before the big
  share's 10th grant.
- **Weights 1:3**: n = 4; share A (weight 1) and share B (weight 3) each kept backlogged by 8
  sessions that take (waiting), hold 20 ms and release, for 60 s: B's part of the grants is
  75% within 3 points.
- **Ceiling**: the same with `max_slots => 1` on the heavy share B: B never holds more than 1,
  A takes the other 3 (work-conserving). An observer samples every 10 ms whether a slot is
  free while a waiter that may use it waits: a sample can fall inside a hand-off (a release,
  then the waiter it wakes taking), so the figure is the share of such samples and the
  longest run of them; a slot left idle (a missed wake-up) would show as a run of 10 or more
  (the waiter's 100 ms recheck).
- **Hand-off with 10 shares**: 32 clients (pgbench -M prepared) take with a wait and release at
  once on a cap of n = 4, each call in one of 10 shares at random, against the same on a cap
  without shares, in alternating rounds: the ratio of each round is at least 0.9.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import rates
import verdicts
from pgcluster import PG_CONFIG, Cluster, wait_for

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DB = "shares"
PORT = 5643
RUN_S = 60
WARMUP_S = 2
HANDOFF_CLIENTS = 32
HANDOFF_SHARES = 10
HANDOFF_ROUNDS = 6
HANDOFF_SECONDS = 5
HANDOFF_MARK = 0.9
# One cap of n = 4, its every call in one of 10 shares at random, or in none. The same cap for
# both, so that its key's place in the lock manager (its slots' partitions) weighs alike: its
# shares are forgotten at the end of each round with them (checked before a round without).
HANDOFF = {
    "no shares": ("SELECT stage_e_try_slot('handoff', 4, '60 s') AS slot \\gset\n"
                  "SELECT stage_e_release('handoff', :slot::int);\n"),
    f"{HANDOFF_SHARES} shares": (
        f"\\set tenant random(1, {HANDOFF_SHARES})\n"
        "SELECT stage_e_try_slot('handoff', 4, '60 s', 'tenant ' || :tenant::int) "
        "AS slot \\gset\n"
        "SELECT stage_e_release('handoff', :slot::int);\n"),
}
# The calibration: the run without shares once more, as a third alternate. Its ratio to the
# first, round by round, is the spread this machine shows where nothing differs (no verdict: it
# says how far a round of the ratio above can be trusted).
AGAIN = "no shares, again"
HANDOFF[AGAIN] = HANDOFF["no shares"]


def one(conn, query, params=None):
    row = conn.execute(query, params).fetchone()
    return row[0] if row else None


def blocked(c: Cluster, cap: str) -> list:
    """Four sessions holding every slot of `cap` (n = 4), for waiters to queue behind."""
    blockers = [c.connect(DB, f"blocker-{i}") for i in range(4)]
    for b in blockers:
        assert one(b, "SELECT stage_e_try_slot(%s, 4)", (cap,)) is not None
    return blockers


def flood(c: Cluster) -> dict:
    hold = 0.05
    admin = c.connect(DB, "admin")
    blockers = blocked(c, "flood")
    grants, lock = [], threading.Lock()

    def waiter(share: str, i: int, ready: threading.Event) -> None:
        with c.connect(DB, f"{share}-{i}") as conn:
            ready.set()
            asked = time.monotonic()
            # The grant's instant on the server's clock, read right after the call returns
            # there: the order of grants without the clients' scheduling.
            slot, at = conn.execute("SELECT stage_e_try_slot('flood', 4, '120 s', %s), "
                                    "extract(epoch FROM clock_timestamp())::float8",
                                    (share,)).fetchone()
            got = time.monotonic()
            with lock:
                grants.append((share, asked, got, at))
            time.sleep(hold)
            one(conn, "SELECT stage_e_release('flood', %s)", (slot,))

    def queued(share: str) -> int:
        return one(admin, "SELECT count(*) FROM stage_e_slot_waiters WHERE share = %s",
                   (share,))

    threads = []
    for share, count in (("A", 64), ("B", 1)):
        for i in range(count):
            ready = threading.Event()
            t = threading.Thread(target=waiter, args=(share, i, ready))
            t.start()
            threads.append(t)
            ready.wait(10)
        wait_for(lambda share=share, count=count: queued(share) == count, timeout=30,
                 what=f"{share} queued")
    # One slot at a time, 10 ms apart: four slots freed at once would wake four waiters
    # together, and which of them returns first is the scheduler's choice, not the queue's.
    for b in blockers:
        one(b, "SELECT stage_e_release_all()")
        b.close()
        time.sleep(0.01)
    for t in threads:
        t.join(120)
    admin.close()
    grants.sort(key=lambda g: g[3])
    order = [s for s, _, _, _ in grants]
    b_wait = next(got - asked for s, asked, got, _ in grants if s == "B")
    first = grants[0][2]
    return {"grants": len(order), "b_position": order.index("B") + 1,
            "b_wait_ms": round(b_wait * 1000, 1), "hold_ms": hold * 1000,
            "b_wait_vs_hold": round(b_wait / hold, 2), "order": "".join(order[:12]),
            "series": [(round(got - first, 4), s) for s, _, got, _ in grants]}


def many_tenants(c: Cluster, small: int = 200, big: int = 1000) -> dict:
    """n = 4, each grant held 5 ms. The big share queues `big` waiters behind 4 blockers, then
    `small` shares queue one waiter each; every small share is served before the big share's
    10th grant."""
    hold = 0.005
    admin = c.connect(DB, "admin")
    blockers = blocked(c, "many")
    grants, lock = [], threading.Lock()
    conns = [(c.connect(DB, "big"), "big") for _ in range(big)]
    conns += [(c.connect(DB, "small"), f"small-{i}") for i in range(small)]

    def waiter(conn, share: str) -> None:
        slot = one(conn, "SELECT stage_e_try_slot('many', 4, '300 s', %s)", (share,))
        with lock:
            grants.append((share, time.monotonic()))
        time.sleep(hold)
        one(conn, "SELECT stage_e_release('many', %s)", (slot,))
        conn.close()

    def queued() -> int:
        return one(admin, "SELECT count(*) FROM stage_e_slot_waiters WHERE cap = 'many'")

    threads = []
    for i, (conn, share) in enumerate(conns):
        t = threading.Thread(target=waiter, args=(conn, share))
        t.start()
        threads.append(t)
        if i + 1 in (big, big + small):  # the big share all queued before the small ones
            wait_for(lambda i=i: queued() == i + 1, timeout=120, what="the waiters queued")
    for b in blockers:
        one(b, "SELECT stage_e_release_all()")
        b.close()
    for t in threads:
        t.join(300)
    admin.close()
    grants.sort(key=lambda g: g[1])
    order = ["big" if s == "big" else "small" for s, _ in grants]
    big_at = [i + 1 for i, s in enumerate(order) if s == "big"]
    last_small = max(i + 1 for i, s in enumerate(order) if s == "small")
    return {"grants": len(order), "small": small, "big": big, "last_small_at": last_small,
            "big_10th_at": big_at[9], "big_grants_before_last_small":
            sum(1 for b in big_at if b < last_small)}


def backlogged(c: Cluster, cap: str, ceiling: int | None) -> dict:
    """Shares A (weight 1) and B (weight 3, `ceiling`) on `cap` (n = 4), 8 sessions each in a
    take-hold-release loop for RUN_S seconds; an observer samples the holders, the waiters and
    pg_locks every 10 ms."""
    admin = c.connect(DB, "admin")
    admin.execute("SELECT stage_e_share(%s, 'A', 1)", (cap,))
    admin.execute("SELECT stage_e_share(%s, 'B', 3, %s)", (cap, ceiling))
    stop, grants, lock = threading.Event(), [], threading.Lock()
    started = time.monotonic()

    def work(share: str, i: int) -> None:
        with c.connect(DB, f"{share}-{i}") as conn:
            while not stop.is_set():
                slot = one(conn, "SELECT stage_e_try_slot(%s, 4, '10 s', %s)", (cap, share))
                if slot is None:
                    continue
                with lock:
                    grants.append((time.monotonic() - started, share))
                time.sleep(0.02)
                one(conn, "SELECT stage_e_release(%s, %s)", (cap, slot))

    threads = [threading.Thread(target=work, args=(s, i)) for s in "AB" for i in range(8)]
    for t in threads:
        t.start()
    samples, in_handoff, run, longest, most_b = 0, 0, 0, 0, 0
    deadline = started + RUN_S
    while time.monotonic() < deadline:
        held = dict(admin.execute("SELECT share, count(*) FROM stage_e_slot_holders "
                                  "WHERE cap = %s GROUP BY share", (cap,)).fetchall())
        waiting = dict(admin.execute("SELECT share, count(*) FROM stage_e_slot_waiters "
                                     "WHERE cap = %s GROUP BY share", (cap,)).fetchall())
        locks = one(admin, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND "
                           "objsubid = 2 AND granted AND objid < 4 AND classid = "
                           "stage_e_cap_key(%s)::oid", (cap,))
        if time.monotonic() - started >= WARMUP_S:
            samples += 1
            most_b = max(most_b, held.get("B", 0))
            b_usable = waiting.get("B", 0) > 0 and (ceiling is None or held.get("B", 0) < ceiling)
            idle = locks < 4 and (waiting.get("A", 0) > 0 or b_usable)
            in_handoff += idle
            run = run + 1 if idle else 0
            longest = max(longest, run)
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join(30)
    admin.close()
    counted = [s for t, s in grants if t >= WARMUP_S]
    return {"grants": len(counted), "b_share": round(counted.count("B") / len(counted), 4),
            "samples": samples, "idle_samples": in_handoff, "longest_idle_run": longest,
            "most_b_held": most_b, "series": grants}


def plot(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(19, 4.5))
    for ax, (key, title) in zip(axes, [("flood", "Flood: A's 64 waiters, then B's one, n = 4"),
                                      ("weights", "Weights 1:3, n = 4, both backlogged"),
                                      ("ceiling", "Weights 1:3, B at most 1 slot")]):
        for share in "AB":
            times = [t for t, s in r[key]["series"] if s == share]
            ax.plot(times, range(1, len(times) + 1), drawstyle="steps-post",
                    label=f"share {share}")
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.set_ylabel("grants so far")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def handoff(c: Cluster) -> dict:
    """The hand-off of a saturated cap (32 clients, n = 4) with every call in one of 10 shares
    against the same cap without shares, twice (the second is the calibration), in
    HANDOFF_ROUNDS alternating rounds."""
    with c.connect(DB, "admin") as admin:
        admin.execute("SELECT stage_e_release('handoff', stage_e_try_slot('handoff', 4))")
        seen: dict[str, list[float]] = {k: [] for k in HANDOFF}
        order = list(HANDOFF)
        for r in range(HANDOFF_ROUNDS):
            for name in (order if r % 2 == 0 else order[::-1]):
                if name != f"{HANDOFF_SHARES} shares":
                    wait_for(lambda: one(admin, "SELECT count(*) FROM stage_e_shares "
                                                "WHERE cap = 'handoff'") == 0, timeout=10,
                             what="the shares of the last round forgotten")
                seen[name].append(rates.pgbench(c, HANDOFF[name], HANDOFF_CLIENTS,
                                                HANDOFF_SECONDS, DB))
    return {"clients": HANDOFF_CLIENTS, "shares": HANDOFF_SHARES, "seconds": HANDOFF_SECONDS,
            "tps_rounds": seen}


def targets(r: dict) -> list[dict]:
    """Issue 38's marks: the counts measured once, the hand-off ratio round by round."""
    T = verdicts.target
    f, w, c, m = r["flood"], r["weights"], r["ceiling"], r["many"]
    rows = [
        T("Flood: B served within the next 2 grants", [f["b_position"]], "<=", 2, ""),
        T("Flood: B's wait vs the hold time", [f["b_wait_vs_hold"]], "<=", 1.5),
        T(f"Many tenants: {m['small']} shares of 1 waiter, one of {m['big']}: the last small "
          "share's grant before the big share's 10th", [m["last_small_at"]], "<",
          m["big_10th_at"], "", f"< {m['big_10th_at']} (the big share's 10th)"),
        T("Weights 1:3: B's part of the grants, points from 75%",
          [round(abs(w["b_share"] - 0.75) * 100, 2)], "<=", 3, ""),
        T("Ceiling 1 on B: most slots B held", [c["most_b_held"]], "<=", 1, ""),
        T("Ceiling 1 on B: longest run of samples with a slot free while a usable waiter waits",
          [c["longest_idle_run"]], "<", 10, ""),
    ]
    if "handoff" in r:
        h = r["handoff"]["tps_rounds"]
        rows.append(T(f"hand-off, {HANDOFF_CLIENTS} clients, n = 4: {HANDOFF_SHARES} shares vs "
                      "no shares", verdicts.ratios(h[f"{HANDOFF_SHARES} shares"], h["no shares"]),
                      ">=", HANDOFF_MARK))
    return rows


def report(r: dict) -> str:
    f, w, c, m = r["flood"], r["weights"], r["ceiling"], r["many"]
    measured = [
        f"grant {f['b_position']} of {f['grants']} (order {f['order']}...)",
        f"{f['b_wait_ms']} ms vs {f['hold_ms']:.0f} ms: {f['b_wait_vs_hold']}x",
        (f"last small share at grant {m['last_small_at']}, the big share's 10th at "
        f"{m['big_10th_at']} ({m['big_grants_before_last_small']} big grants before it)"),
        f"{w['b_share']:.1%} of {w['grants']}",
        f"at most {c['most_b_held']}",
        (f"{c['idle_samples']} of {c['samples']} samples in a hand-off, longest run "
        f"{c['longest_idle_run']}"),
    ]
    rows = r["targets"]
    lines = [(f"stage_e_slots {r['version']} on {r['server']}, commit {r['commit']}: fair shares "
             "(`bench/shares.py`)."), "", "| check | measured | wanted | verdict |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {t['target']} | {got} | {t['wanted']} | {t['verdict']} |"
              for t, got in zip(rows, measured)]
    if "handoff" in r:
        h = r["handoff"]
        lines += ["", f"The hand-off with shares (a cluster with max_connections 100, as make "
                  f"bench's waiting figures): pgbench -M prepared, {h['clients']} clients "
                  f"taking with a wait and releasing at once, n = 4, {HANDOFF_ROUNDS} rounds x "
                  f"{h['seconds']} s alternating; tps medians "
                  + ", ".join(f"{k} {statistics.median(v):,.0f}"
                              for k, v in h["tps_rounds"].items()) + ".", ""]
        lines += verdicts.table(rows[len(measured):])
        if AGAIN in h["tps_rounds"]:
            again = verdicts.ratios(h["tps_rounds"][AGAIN], h["tps_rounds"]["no shares"])
            lines += ["", (f"Calibration: the run without shares against itself once more, "
                           f"round by round, median {statistics.median(again):.2f}x "
                           f"({min(again):.2f}-{max(again):.2f}): the spread of a round's "
                           "ratio on this machine where nothing differs.")]
    lines += ["", "![grants per share over time](../bench/results/shares.png)"]
    return "\n".join(lines)


def bench_shares(pg_config: str = PG_CONFIG) -> dict:
    """Every part above on a cluster of its own; the figures, with "targets" judged."""
    started = time.monotonic()
    c = Cluster("shares_bench", {"max_connections": 1300}, port=PORT,
                pg_config=pg_config).init().start()
    try:
        c.create_database(DB)
        with c.connect(DB) as s:
            version = one(s, "SELECT extversion FROM pg_extension "
                             "WHERE extname = 'stage_e_slots'")
            server = one(s, "SELECT version()").split(" on ")[0]
        r = {"version": version, "server": server,
             "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                      capture_output=True, text=True, check=False).stdout.strip()}
        print("  fair shares: flood (n = 4, 64 waiters of A, then B)", flush=True)
        r["flood"] = flood(c)
        print("  fair shares: many tenants (1,000 waiters of one share, 200 of one each)",
              flush=True)
        r["many"] = many_tenants(c)
        print(f"  fair shares: weights 1:3, {RUN_S} s; then with a ceiling of 1 on B", flush=True)
        r["weights"] = backlogged(c, "w13", None)
        r["ceiling"] = backlogged(c, "w13c", 1)
    finally:
        c.destroy()
    # The hand-off on a cluster set up as make bench's waiting figures are (max_connections
    # 100): a step of the fair queue reads every backend's waiter record, so its cost grows
    # with max_connections, which the runs above raise to 1,300.
    print(f"  fair shares: hand-off, {HANDOFF_CLIENTS} clients, {HANDOFF_SHARES} shares vs "
          f"none (twice), {HANDOFF_ROUNDS} rounds x {HANDOFF_SECONDS} s", flush=True)
    c = Cluster("shares_handoff", {"max_connections": 100}, port=PORT,
                pg_config=pg_config).init().start()
    try:
        c.create_database(DB)
        r["handoff"] = handoff(c)
    finally:
        c.destroy()
    r["targets"] = targets(r)
    r["seconds"] = round(time.monotonic() - started)
    return r


def write(r: dict) -> str:
    """shares.png, shares.md and shares.json from bench_shares's figures; the report."""
    RESULTS.mkdir(exist_ok=True)
    plot(r, RESULTS / "shares.png")
    text = report(r)
    for key in ("weights", "ceiling"):
        r[key]["series"] = [(round(t, 3), s) for t, s in r[key]["series"]]
    (RESULTS / "shares.json").write_text(json.dumps(r, indent=2) + "\n")
    (RESULTS / "shares.md").write_text(text + "\n")
    return text


def main() -> int:
    r = bench_shares(sys.argv[1] if sys.argv[1:] else PG_CONFIG)
    print("\n" + write(r))
    print(verdicts.tally(r["targets"]))
    return 1 if verdicts.failed(r["targets"]) else 0


if __name__ == "__main__":
    sys.exit(main())
