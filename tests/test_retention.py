"""stage_e_slots.counter_retention: the background flusher deletes the counter rows of caps
unused for longer than it (issue 21, "Unbounded growth and quadratic reads"), never those of
caps in use, and only quiet lease horizon rows."""

import time

import pytest
from conftest import one
from pgcluster import Cluster, wait_for


@pytest.fixture(scope="module")
def rc():
    """Rows older than 1 s go; rounds every 200 ms; horizons end with their leases."""
    c = Cluster("retention", {"stage_e_slots.counter_retention": "'1s'",
                              "stage_e_slots.flush_interval": "'200ms'",
                              "stage_e_slots.lease_horizon_margin": "0"}).init().start()
    yield c
    c.destroy()


def caps_with_rows(conn, table="stage_e_throttle_counter"):
    return sorted(r[0] for r in conn.execute(f"SELECT cap FROM {table}").fetchall())


def test_rows_of_caps_used_once_go_after_the_retention(rc):
    db = rc.create_database("r_once")
    since = len(rc.log_text())
    with rc.connect(db) as c:
        c.autocommit = True
        for cap in ("a", "b", "c"):
            assert one(c, "SELECT stage_e_try_slot(%s, 2)", (cap,)) == 0
            assert one(c, "SELECT stage_e_release(%s, 0)", (cap,)) is True
        wait_for(lambda: caps_with_rows(c) == ["a", "b", "c"], what="the first flush")
        wait_for(lambda: caps_with_rows(c) == [], timeout=15, what="the rows to go")
        log = rc.log_text()[since:]
        assert "unused for longer than stage_e_slots.counter_retention (1 s)" in log, log
        # A cap used again starts a fresh row, exact.
        assert one(c, "SELECT stage_e_try_slot('a', 2)") == 0
        assert one(c, "SELECT stage_e_release('a', 0)") is True
        totals = c.execute("SELECT acquired, released FROM stage_e_throttle_totals "
                           "WHERE cap = 'a'").fetchone()
        assert totals == (1, 1)


def test_quiet_lease_horizon_rows_go_but_the_highest_floor_stays(rc):
    db = rc.create_database("r_horizon")
    with rc.connect(db) as c:
        c.autocommit = True
        for cap in ("h1", "h2"):
            c.execute("SELECT stage_e_lease(%s, 1, '1 s')", (cap,))
        wait_for(lambda: caps_with_rows(c, "stage_e_lease_horizon") == ["h1", "h2"],
                 what="the horizon rows")
        wait_for(lambda: caps_with_rows(c) == [], timeout=15, what="the counter rows to go")
        wait_for(lambda: len(caps_with_rows(c, "stage_e_lease_horizon")) == 1, timeout=15,
                 what="the lower floor's horizon row to go")
        # The one left has the database's highest floor: tokens after a crash start above it.
        top = one(c, "SELECT token_floor FROM stage_e_lease_horizon")
        assert top >= one(c, "SELECT max(token) FROM (SELECT (stage_e_lease('h3', 1, '1 s'))"
                             ".token) t") - 1


def test_caps_in_use_keep_their_rows_and_their_totals(rc):
    db = rc.create_database("r_in_use")
    with rc.connect(db) as c, rc.connect(db) as holder, rc.connect(db) as leaser:
        for s in (c, holder, leaser):
            s.autocommit = True
        assert one(holder, "SELECT stage_e_try_slot('held', 1)") == 0
        leaser.execute("SELECT stage_e_lease('leased', 1, '1 h')")
        assert one(c, "SELECT stage_e_try_slot('gone', 1)") == 0
        assert one(c, "SELECT stage_e_release('gone', 0)") is True
        wait_for(lambda: caps_with_rows(c) == ["gone", "held", "leased"], what="the flush")
        wait_for(lambda: caps_with_rows(c) == ["held", "leased"], timeout=15,
                 what="the unused cap's row to go")
        # Throttled calls on the held cap all along: its totals stay exact.
        throttled = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert one(c, "SELECT stage_e_try_slot('held', 1)") is None
            throttled += 1
            time.sleep(0.05)
        assert caps_with_rows(c) == ["held", "leased"]
        assert one(c, "SELECT throttled FROM stage_e_throttle_totals WHERE cap = 'held'") \
            == throttled
        assert one(c, "SELECT count(*) FROM stage_e_lease_horizon WHERE cap = 'leased'") == 1


def test_the_rows_of_adaptive_caps_are_never_deleted(rc):
    """The README: "The rows of adaptive caps are never deleted by counter_retention" (the row
    keeps the policy and the learned limit). An adaptive cap used before a plain one: once the
    plain cap's younger row went, the retention passed over the adaptive row, which stays with
    its policy."""
    db = rc.create_database("r_adaptive")
    since = len(rc.log_text())
    with rc.connect(db) as c:
        c.autocommit = True
        c.execute("SELECT stage_e_adapt('kept', 2, 4)")
        assert one(c, "SELECT stage_e_try_slot('kept', 8)") == 0
        assert one(c, "SELECT stage_e_release('kept', 0)") is True
        wait_for(lambda: caps_with_rows(c) == ["kept"], what="the adaptive cap's row")
        assert one(c, "SELECT stage_e_try_slot('plain', 2)") == 0
        assert one(c, "SELECT stage_e_release('plain', 0)") is True
        wait_for(lambda: caps_with_rows(c) == ["kept", "plain"], what="the plain cap's row")
        wait_for(lambda: caps_with_rows(c) == ["kept"], timeout=15, what="the plain row to go")
        assert "unused for longer than stage_e_slots.counter_retention" in rc.log_text()[since:]
        assert c.execute("SELECT adapt_min, adapt_max, adapt_enforce FROM "
                         "stage_e_throttle_counter WHERE cap = 'kept'").fetchone() == (2, 4, True)
        assert one(c, "SELECT count(*) FROM stage_e_cap_limits WHERE cap = 'kept'") == 1
