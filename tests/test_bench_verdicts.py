"""bench/verdicts.py, the verdicts of `make bench`: PASS only when every round meets the mark,
FAIL when none does or nothing was measured, noisy when the rounds straddle it. No server."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from verdicts import FAIL, NOISY, PASS, failed, ratios, table, tally, target, verdict


@pytest.mark.parametrize("values,op,mark,expected", [
    ([1.1, 1.2, 1.05], ">=", 1.0, PASS),
    ([0.9, 0.8], ">=", 1.0, FAIL),
    ([0.9, 1.1], ">=", 1.0, NOISY),
    ([1.0], ">=", 1.0, PASS),            # the mark itself meets >=
    ([1.0], ">", 1.0, FAIL),             # ...and not >
    ([2.0, 2.5], "<=", 3.0, PASS),
    ([None, None], ">=", 1.0, FAIL),     # never happened: meets nothing
    ([None, 1.2], ">=", 1.0, NOISY),
    ([], ">=", 1.0, FAIL),               # no round ran: not met (it was PASS: all([]))
    ([], "<=", 3.0, FAIL),
])
def test_a_verdict_needs_every_round(values, op, mark, expected):
    assert verdict(values, op, mark) == expected


def test_a_target_row_and_its_table():
    rows = [target("pair vs raw", [1.1, 0.95, 1.02], ">=", 0.9),
            target("nothing ran", [], ">=", 0.9),
            target("one count", [1.31], "<=", 1.2, wanted="<= 1.2x (instructions)")]
    assert [(r["median"], r["low"], r["high"], r["rounds"]) for r in rows] == [
        (1.02, 0.95, 1.1, 3), (None, None, None, 0), (1.31, 1.31, 1.31, 1)]
    assert [r["verdict"] for r in rows] == [PASS, FAIL, FAIL]
    assert tally(rows) == "1 PASS, 0 noisy, 2 FAIL of 3 targets"
    assert failed(rows) and not failed(rows[:1])
    lines = table(rows)
    assert lines[2] == "| pair vs raw | 1.02x | 0.95-1.10x, 3 rounds | >= 0.9x | PASS |"
    assert lines[3] == "| nothing ran | never | not run | >= 0.9x | FAIL |"
    assert lines[4] == "| one count | 1.31x | one run | <= 1.2x (instructions) | FAIL |"


def test_ratios_pair_the_rounds():
    assert ratios([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]
    with pytest.raises(ValueError, match="rounds differ"):
        ratios([1.0], [1.0, 2.0])
