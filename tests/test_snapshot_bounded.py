"""stage_e_snapshot() over many counter rows: linear in rows, bounded in size (issue 21,
"Unbounded growth and quadratic reads")."""

import json
import time
from pathlib import Path

import pytest
from conftest import one
from pgcluster import Cluster

ROWS = 50_000
LIMIT = 1_000  # snapshot::MAX_CAPS, as the README says


@pytest.fixture(scope="module")
def sc():
    """A cluster whose launcher waits an hour between rounds: only explicit flushes write."""
    c = Cluster("snap_bounded", {"stage_e_slots.flush_interval": "'1h'"}).init().start()
    yield c
    c.destroy()


def fill(conn, rows, throttled_every=0):
    """`rows` counter rows c1 .. c<rows>, inserted directly (as a churn of cap names leaves)."""
    conn.execute(
        "INSERT INTO stage_e_throttle_counter (cap, acquired, throttled, flushed_at, flush_id) "
        "SELECT 'c' || i, i, CASE WHEN %s > 0 AND i %% %s = 0 THEN i ELSE 0 END, "
        "       now() - interval '1 day', 1 FROM generate_series(1, %s) i",
        (throttled_every, max(throttled_every, 1), rows))


def test_a_snapshot_of_50k_rows_is_bounded_and_marked(sc):
    db = sc.create_database("s_50k")
    with sc.connect(db) as c:
        fill(c, ROWS, throttled_every=20)
        holder = sc.connect(db, "holder")
        assert one(holder, "SELECT stage_e_try_slot('zz_busy', 2)") == 0  # held, no row yet
        t = time.monotonic()
        snap = one(c, "SELECT stage_e_snapshot()")
        took = time.monotonic() - t
        t = time.monotonic()
        size = one(c, "SELECT octet_length(stage_e_snapshot()::text)")
        again = time.monotonic() - t
        print(f"\nstage_e_snapshot() over {ROWS} counter rows: {took:.3f} s (then {again:.3f} s), "
              f"{size} bytes")
        assert snap["caps_total"] == ROWS + 1
        assert snap["truncated"] is True
        assert len(snap["caps"]) == LIMIT
        names = [cap["cap"] for cap in snap["caps"]]
        assert names == sorted(names)  # still ordered by name
        # The busiest first: the held cap, then the most throttled.
        assert "zz_busy" in names
        throttled = sorted((cap["totals"]["throttled"] for cap in snap["caps"]), reverse=True)
        assert throttled[0] == ROWS and throttled[LIMIT - 2] == ROWS - (LIMIT - 2) * 20
        assert throttled[LIMIT - 1] == 0  # zz_busy, in for its held slot
        assert size < 2_000_000
        holder.close()


def test_a_small_snapshot_is_complete_and_unmarked(sc):
    db = sc.create_database("s_small")
    with sc.connect(db) as c:
        fill(c, 3)
        assert one(c, "SELECT stage_e_try_slot('c2', 2)") == 0
        assert one(c, "SELECT stage_e_try_slot('new', 1)") == 0
        snap = one(c, "SELECT stage_e_snapshot()")
        assert (snap["caps_total"], snap["truncated"]) == (4, False)
        assert [cap["cap"] for cap in snap["caps"]] == ["c1", "c2", "c3", "new"]
        c1, c2, _, new = snap["caps"]
        assert (c1["held"], c1["totals"]["acquired"], c1["pending"]["acquired"]) == (0, 1, 0)
        assert (c2["held"], c2["flushed"]["acquired"], c2["pending"]["acquired"],
                c2["totals"]["acquired"]) == (1, 2, 1, 3)
        assert (new["held"], new["flushed_at"], new["totals"]["acquired"]) == (1, None, 1)
        assert c1["key"] == one(c, "SELECT stage_e_cap_key('c1')")
        assert c1["flushed_at"] == one(
            c, "SELECT flushed_at::text FROM stage_e_throttle_counter WHERE cap = 'c1'")
        # Every key of the document before the bound: the caps' and the holders' too.
        assert set(snap) >= {"database", "config", "memory", "held", "caps", "holders"}
        assert set(c1) == {"cap", "key", "held", "totals", "flushed", "flushed_at", "pending"}
        assert snap["held"] == 2 and len(snap["holders"]) == 2


def test_a_small_snapshot_is_what_it_was_before_the_bound(sc):
    """The document of a few caps, minus the two new keys, equals the one built the old way
    (tests/data/snapshot_small.json was taken from the unbounded build, with the volatile
    fields blanked)."""
    db = sc.create_database("s_same")
    with sc.connect(db) as c:
        fill(c, 5, throttled_every=2)
        assert one(c, "SELECT stage_e_try_slot('c3', 4)") == 0
        assert one(c, "SELECT stage_e_try_slot('fresh', 2)") is not None
        snap = one(c, "SELECT stage_e_snapshot()")
        got = normalize(snap)
        print("\n" + json.dumps(got, sort_keys=True))
        assert got == EXPECTED


def normalize(snap):
    """The snapshot without the new keys and with what changes from run to run blanked."""
    snap = {k: v for k, v in snap.items() if k not in ("caps_total", "truncated")}
    snap["database"] = "-"
    for cap in snap["caps"]:
        cap["flushed_at"] = cap["flushed_at"] and "-"
    for h in snap["holders"]:
        h["pid"] = h["acquired_at"] = h["state"] = "-"
    snap["memory"] = {k: "-" for k in snap["memory"]}
    return snap


EXPECTED = json.loads((Path(__file__).parent / "data" / "snapshot_small.json").read_text())
