"""`make bench`'s results, as bench/run.py measured them: the files in bench/results/, written
with every target judged by this code's marks and read back (`bench/run.py --rejudge`,
`--waiting`); the tables of summary.md, each part after the marker bench/readme.py copies it
into README.md by; and the figure bench.png. The targets of make bench's own workloads stay in
bench/run.py, next to the contenders they name: write_results is given them.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import adaptive
import latency_bounds
import rates
import shares
import verdicts

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def load_results() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """results.json, adaptive.json and latency_bounds.json as make bench wrote them (the keys
    that were numbers made numbers again)."""
    r = json.loads((RESULTS / "results.json").read_text())
    for key in ("pairs", "pairs_rounds", "wake"):
        r[key] = {int(k): v for k, v in r[key].items()}
    a = json.loads((RESULTS / "adaptive.json").read_text())
    a["simulated"] = {int(k): v for k, v in a["simulated"].items()}
    for part in [*a["simulated"].values(), a.get("cpu", {})]:
        if "static" in part:
            part["static"] = {int(k): v for k, v in part["static"].items()}
    bounds = json.loads((RESULTS / "latency_bounds.json").read_text())
    if (RESULTS / "rates.json").exists():  # measured since 0.10.0 (bench/rates.py)
        r["rates"] = json.loads((RESULTS / "rates.json").read_text())
    if (RESULTS / "shares.json").exists():  # measured since 0.11.0 (bench/shares.py)
        r["shares"] = json.loads((RESULTS / "shares.json").read_text())
    return r, a, bounds


def write_results(r: dict[str, Any], bounds: dict[str, Any],
                  targets: Callable[[dict[str, Any]], list[dict[str, Any]]]
                  ) -> list[dict[str, Any]]:
    """Judges every target with the marks of this code (make bench's own with `targets`,
    bench/run.py's), writes the three results files and summary.md; returns every target."""
    r["targets"] = targets(r)
    r["adaptive"]["targets"] = adaptive.targets(r["adaptive"])
    bounds["targets"] = latency_bounds.targets(bounds)
    rate = r.pop("rates", None)
    if rate is not None:
        rate["targets"] = rates.targets(rate)
    share = r.pop("shares", None)
    if share is not None:
        share["targets"] = shares.targets(share)
    # The parts bench/readme.py copies into README.md, each after its marker.
    table = "\n\n".join([part("make bench", report(r)),
                          part("adaptive caps", adaptive.report(r["adaptive"])),
                          part("latency bounds", latency_bounds.report(bounds))]
                         + ([part("rate limits", rates.report(rate))] if rate else [])
                         + ([part("fair shares", shares.report(share))] if share else []))
    print("\n" + table)
    (RESULTS / "results.json").write_text(json.dumps(r, indent=2) + "\n")
    (RESULTS / "adaptive.json").write_text(json.dumps(r["adaptive"], indent=2) + "\n")
    (RESULTS / "latency_bounds.json").write_text(json.dumps(bounds, indent=2) + "\n")
    if rate is not None:
        (RESULTS / "rates.json").write_text(json.dumps(rate, indent=2) + "\n")
    if share is not None:
        shares.write(share)
    (RESULTS / "summary.md").write_text(table + "\n")
    every: list[dict[str, Any]] = (r["targets"] + r["adaptive"]["targets"] + bounds["targets"]
                                   + (rate["targets"] if rate else [])
                                   + (share["targets"] if share else []))
    return every


def part(name: str, text: str) -> str:
    """A part of summary.md, after the marker bench/readme.py finds it by."""
    return f"<!-- part: {name} -->\n{text}"


def report(r: dict[str, Any]) -> str:
    again = r.get("remeasured")
    lines = [f"Measured on commit {r['commit']}: {r['rounds']} rounds of {r['seconds_per_run']} s "
             "per pgbench contender, medians."
             + (f" Measured again alone (`bench/run.py --waiting`) on commit {again['commit']}: "
                f"{again['what']}." if again else ""), "",
             "| acquire+release pair (tps) | 1 client | 8 clients | 32 clients |",
             "| --- | ---: | ---: | ---: |"]
    for name in r["pairs"][1]:
        lines.append(f"| {name} | " + " | ".join(
            f"{r['pairs'][c][name]:,.0f}" for c in (1, 8, 32)) + " |")
    lines += ["", "| throttled try, 8 clients (calls/s) | tps | vs stage_e_slots n=8 |",
              "| --- | ---: | ---: |"]
    base = r["throttled"]["stage_e_slots n=8"]
    for name, tps in r["throttled"].items():
        lines.append(f"| {name} | {tps:,.0f} | {tps / base:.2f}x |")
    lines += ["", "| in-server pair (ns per acquire+release) | ns |", "| --- | ---: |"]
    for name, ns in r["inserver_ns"].items():
        lines.append(f"| {name} | {ns:,.0f} |")
    h = r["waiting"]["handoff_tps"]
    lines += ["", ("| hand-off, 32 clients acquiring and releasing at once (tps) | tps | vs no "
               "contention |"), "| --- | ---: | ---: |"]
    for name, tps in h.items():
        lines.append(f"| {name} | {tps:,.0f} | {tps / h['no contention n=32']:.2f}x |")
    lines += ["", ("| wake latency, release to the waiter's return (ms) | 1 waiter p50 | p99 |"
               " 64 waiters p50 | p99 |"), "| --- | ---: | ---: | ---: | ---: |"]
    for name in r["wake"][1]:
        lines.append(f"| {name} | " + " | ".join(
            f"{r['wake'][w][name][q]:.3f}" for w in (1, 64) for q in ("p50_ms", "p99_ms")) + " |")
    lines += ["", "| leases, 8 clients (pairs per second) | tps |", "| --- | ---: |"]
    for where in ("direct", "pgbouncer"):
        for name, tps in r["leases"][where].items():
            lines.append(f"| {name} | {tps:,.0f} |")
    lc = r["lifecycle"]
    lines += ["", "| lifecycle | measured |", "| --- | ---: |",
              f"| lease pairs per second (pgbench -R 1000) | {lc['pairs_per_s']:,.0f} |",
              f"| stage_e_lease_horizon rows written per minute | {lc['rows_per_minute']:.0f} |",
              ("| first lease after promotion, no lease outstanding | "
               f"{lc['first_grant_quiet_s'] * 1000:.0f} ms |"),
              ("| first lease after promotion, a live 3 s lease | "
               f"{lc['first_grant_live_s']:.2f} s |")]
    lines += ["", ("Targets: each ratio is taken within each round (the compared workloads ran "
               "next to each other, each first in half the rounds); PASS or FAIL only when "
               "every round agrees, noisy when the rounds straddle the mark "
               f"({verdicts.tally(r['targets'])})."), ""]
    lines += verdicts.table(r["targets"])
    idle, fair = r["waiting"]["idle"], r["waiting"]["fairness"]
    med = statistics.median
    lines += ["", (f"Idle waiters, medians of {len(idle)} periods: "
               f"{med([x['wakeups_per_waiter_s'] for x in idle]):.2f} wake-ups a second each, "
               f"{med([x['us_per_wakeup'] for x in idle]):.1f} µs of CPU per wake-up "
               "(schedstat); utime + stime, which are charged by the clock tick, saw "
               f"{med([x['tick_share'] for x in idle]) * 100:.2f} %. Fairness, medians of "
               f"{len(fair)} runs: mean wait {med([f['mean_ms'] for f in fair]):.1f} ms, longest "
               f"{med([f['max_ms'] for f in fair]):.1f} ms on the server's clock (client-side "
               f"{med([f['client_ratio'] for f in fair]):.2f}x the mean); "
               f"{sum(f['in_arrival_order'] for f in fair)} of {sum(f['waited'] for f in fair)} "
               "grants in arrival order, the rest at most "
               f"{max(f['stray_max'] for f in fair)} places from it.")]
    m = r["memory"]
    lines += ["", (f"Shared memory at the defaults: {m['default_total'] / 1e6:.2f} MB in all; "
               f"a cap costs {m['entry_bytes']:.0f} B (its 768-byte entry and its share of the "
               f"index), and each kB of "
               f"`stage_e_slots.slot_memory` costs {m['arena_bytes_per_kb']:.0f} B (arena and "
               f"its allocator).")]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, w) = plt.subplots(1, 3, figsize=(19, 4.8))
    names = list(r["pairs"][1])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(3)]
        med = [r["pairs"][c][name] for c in (1, 8, 32)]
        seen = [r["pairs_rounds"][c][name] for c in (1, 8, 32)]
        a.bar(xs, med, width, label=name,
              yerr=[[m - min(v) for m, v in zip(med, seen)],
                    [max(v) - m for m, v in zip(med, seen)]], capsize=2)
    a.set_xticks(range(3), ["1 client", "8 clients", "32 clients"])
    a.set_ylabel("pairs per second (whiskers: min-max of the rounds)")
    a.set_title("Acquire + release (higher is better)")
    a.legend(fontsize=8)
    th = r["throttled"]
    colors = ["tab:orange" if k.startswith("stage_e") else
              "tab:blue" if k.startswith("reference") else "tab:gray" for k in th]
    seen = [r["throttled_rounds"][k] for k in th]
    b.barh(list(th), list(th.values()), color=colors,
           xerr=[[m - min(v) for m, v in zip(th.values(), seen)],
                 [max(v) - m for m, v in zip(th.values(), seen)]], capsize=2)
    b.invert_yaxis()
    b.set_xscale("log")
    b.set_xlabel("throttled calls per second, 8 clients (log scale; bars: min-max of the rounds)")
    b.set_title("Throttled try: cost flat in n, counted for free")
    b.tick_params(axis="y", labelsize=8)
    wake = r["wake"]
    names = list(wake[1])
    groups = [(w_, q) for w_ in (1, 64) for q in ("p50_ms", "p99_ms")]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(groups))]
        med = [wake[w_][name][q] for w_, q in groups]
        seen = [[x[q] for x in wake[w_][name]["rounds"]] for w_, q in groups]
        w.bar(xs, med, width, label=name,
              yerr=[[m - min(v) for m, v in zip(med, seen)],
                    [max(v) - m for m, v in zip(med, seen)]], capsize=2)
    w.set_xticks(range(len(groups)),
                 [f"{w_} waiter{'s' if w_ > 1 else ''}, {q[:3]}" for w_, q in groups])
    w.set_yscale("log")
    w.set_ylabel("ms from release to the waiter's return (log scale)")
    w.set_title("Wake latency (lower is better)")
    w.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
