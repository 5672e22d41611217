"""The targets of `make bench`: a figure per round, its median and spread, and a verdict.

A target compares two workloads (or one figure with a mark). The bench runs the compared
workloads in turn, in several short rounds (A B, B A, A B, ...), and takes the target's figure
within each round, so that the machine's noise at that moment falls on both. The verdict is
PASS only when every round's figure meets the mark, FAIL only when none does, and "noisy" when
the spread straddles the mark: this machine could not tell. A figure measured once (one run, an
exact count) has a spread of one value, so its verdict is PASS or FAIL.
"""

from __future__ import annotations

import statistics

PASS, FAIL, NOISY = "PASS", "FAIL", "noisy"
OPS = {">=": lambda v, m: v >= m, "<=": lambda v, m: v <= m,
       "<": lambda v, m: v < m, ">": lambda v, m: v > m}


def verdict(values: list[float | None], op: str, mark: float) -> str:
    """PASS when every value meets `op mark`, FAIL when none does, noisy otherwise. A None
    value (the thing never happened) meets nothing, and no value at all (no round ran) is a
    FAIL: a target nothing measured is not met."""
    met = [v is not None and OPS[op](v, mark) for v in values]
    if not met:
        return FAIL
    return PASS if all(met) else FAIL if not any(met) else NOISY


def target(name: str, values: list[float | None], op: str, mark: float, unit: str = "x",
           wanted: str | None = None) -> dict:
    """One target row: the values of every round (or the one measurement), their median and
    range, the mark (`op mark unit`, or `wanted` as written) and the verdict."""
    known = [v for v in values if v is not None]
    return {
        "target": name,
        "median": statistics.median(known) if known else None,
        "low": min(known) if known else None,
        "high": max(known) if known else None,
        "rounds": len(values),
        "values": values,
        "op": op, "mark": mark, "unit": unit,
        "wanted": wanted or f"{op} {mark}{unit}",
        "verdict": verdict(values, op, mark),
    }


def ratios(a: list[float], b: list[float]) -> list[float]:
    """Round by round: a[i] / b[i] (the two ran next to each other in time)."""
    if len(a) != len(b):
        raise ValueError(f"rounds differ: {len(a)} against {len(b)}")
    return [x / y for x, y in zip(a, b)]


def shown(v: float | None, unit: str) -> str:
    return "never" if v is None else f"{v:.2f}{unit}"


def table(rows: list[dict]) -> list[str]:
    """The targets as a Markdown table: median, spread (min-max of the rounds), mark, verdict."""
    lines = ["| target | median | spread (min-max) | wanted | |",
             "| --- | ---: | ---: | ---: | --- |"]
    for t in rows:
        if t["rounds"] > 1:
            spread = (f"{shown(t['low'], '')}-{shown(t['high'], t['unit'])}, "
                      f"{t['rounds']} rounds")
        elif t["rounds"] == 1:
            spread = "one run"
        else:
            spread = "not run"
        lines.append(f"| {t['target']} | {shown(t['median'], t['unit'])} | {spread} | "
                     f"{t['wanted']} | {t['verdict']} |")
    return lines


def tally(rows: list[dict]) -> str:
    n = {v: sum(t["verdict"] == v for t in rows) for v in (PASS, NOISY, FAIL)}
    return f"{n[PASS]} PASS, {n[NOISY]} noisy, {n[FAIL]} FAIL of {len(rows)} targets"


def failed(rows: list[dict]) -> bool:
    """True when some target FAILed (noisy is not a failure: the machine could not tell)."""
    return any(t["verdict"] == FAIL for t in rows)
