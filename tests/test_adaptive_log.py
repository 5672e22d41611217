"""Adaptive caps in the server log: who changed which policy, and the controller's moves, at
most a line every 10 s per cap with the moves left out counted in the next (split from
test_adaptive.py, whose cluster fixture and helpers it uses)."""

import re
import time
from datetime import datetime, timedelta

import pytest
from pgcluster import wait_for

# ac, aconnect and adb are test_adaptive's fixtures: pytest passes them to the tests below by
# parameter name, which reads to ruff as an unused import (F401) then redefined (F811).
from test_adaptive import Clients, Service, ac, aconnect, adapt, adapt_off, adb, limit_of, moves  # noqa: F401


def test_policy_changes_and_moves_of_the_limit_are_logged(ac, aconnect, adb):  # noqa: F811
    """stage_e_adapt logs, at its commit, who made which cap of which database adaptive
    between which bounds and whether enforced (a rolled-back call logs nothing), and
    stage_e_adapt_off who returned it; the controller's first move (slow start from min_slots = 1 to 2)
    logs a line naming the cap, its database, the reason and 1 -> 2, as the view shows it."""
    c = aconnect()
    since = len(ac.log_text())
    adapt(c, "logged", 3, 3)
    adapt(c, "logged", 1, 4, False)
    with c.transaction(force_rollback=True):
        c.execute("SELECT stage_e_adapt('logged', 5, 6)")
    adapt_off(c, "logged")
    log = ac.log_text()[since:]
    for bounds, mode in [("3 and 3", "enforced"), ("1 and 4", "monitor mode")]:
        assert (f'LOG:  stage_e_slots: role "postgres" made cap "logged" of database "{adb}" '
                f"adaptive between {bounds} slots ({mode})\n") in log, log
    assert "between 5 and 6" not in log, log
    assert (f'LOG:  stage_e_slots: role "postgres" returned cap "logged" of database "{adb}" '
            "to the callers' n alone (stage_e_adapt_off)") in log, log
    adapt(c, "moving", 1, 4)
    service = Service(4)
    clients = Clients(ac, adb, "moving", service, 4, n=4)
    try:
        wait_for(lambda: moves(ac.log_text()[since:], "moving"), timeout=20,
                 what="the LOG line of the first move")
    finally:
        clients.stop()
    first = moves(ac.log_text()[since:], "moving")[0]
    assert (first["db"], first["old"], first["new"], first["left_out"]) == (adb, "1", "2", None)
    assert re.fullmatch(r"used 1 of 1, hold time \d+\.\dx baseline: 1 -> 2", first["reason"]), \
        first["reason"]


@pytest.mark.one_major
def test_moves_left_out_of_the_log_are_counted_in_its_next_line(ac, adb):  # noqa: F811
    """The README: a cap's moves are logged at most one line every 10 s, and the ones left out
    are counted in the next. Slow start from 1 moves the limit every window or so; the line
    after the first, at least 10 s later (the service shrunk to force a move then), says how
    many moves it left out, and starts from where they took the limit."""
    since = len(ac.log_text())
    with ac.connect(adb) as c:
        adapt(c, "quiet", 1, 8)
        service = Service(6)
        clients = Clients(ac, adb, "quiet", service, 8, n=8)
        try:
            wait_for(lambda: moves(ac.log_text()[since:], "quiet"), timeout=20,
                     what="the first move's line")
            first_seen = time.monotonic()
            wait_for(lambda: limit_of(c, "quiet") >= 4, timeout=20,
                     what="more moves after the first line")
            time.sleep(max(0.0, first_seen + 10.5 - time.monotonic()))  # the claim: 10 s
            service.resize(2)
            wait_for(lambda: len(moves(ac.log_text()[since:], "quiet")) >= 2, timeout=30,
                     what="the next line")
        finally:
            clients.stop()
    first, second = moves(ac.log_text()[since:], "quiet")[:2]
    gap = (datetime.strptime(second["at"], "%Y-%m-%d %H:%M:%S.%f")
           - datetime.strptime(first["at"], "%Y-%m-%d %H:%M:%S.%f"))
    assert gap >= timedelta(seconds=10), (first, second)
    assert first["left_out"] is None
    assert second["left_out"] is not None and int(second["left_out"]) >= 2, second
    # The moves left out took the limit from the first line's new value to the second's old.
    assert int(second["old"]) >= 4 > int(first["new"]), (first, second)
