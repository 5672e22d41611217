"""Hold and wait histograms (0.8.0): each hold and wait lands in its bucket, with sums equal to
the hold_time and wait_time counters; stage_e_histograms() is in the shape postgres_exporter
reads; the counter rows keep them exactly once per flush, across a rollback, a reset and a
clean restart; stage_e_stats() shows the cap's current n; the quantiles view interpolates as
histogram_quantile does."""

import threading
import time

import pytest
from conftest import one
from pgcluster import Cluster, wait_for

BOUNDS = [0.001 * 4 ** i for i in range(12)]


@pytest.fixture(scope="module")
def hc():
    # Flushes only when asked: each test decides what the rows hold.
    c = Cluster("histograms", {"stage_e_slots.flush_interval": "'1h'"}).init().start()
    yield c
    c.destroy()


@pytest.fixture
def hdb(hc, request):
    name = "h_" + request.node.name.lower()[:40]
    hc.create_database(name)
    return name


def bucket(seconds):
    """Index of the bucket a duration falls in (13 buckets: 12 bounds and one above)."""
    return next((i for i, b in enumerate(BOUNDS) if seconds <= b), len(BOUNDS))


def histograms(conn, cap):
    """{metric: (per-bucket counts (13), sum, count)} of stage_e_histograms() for `cap`."""
    out = {}
    for metric, bounds, cumulative, total, count in conn.execute(
            "SELECT metric, seconds, seconds_bucket, seconds_sum, seconds_count "
            "FROM stage_e_histograms() WHERE cap = %s ORDER BY metric", (cap,)).fetchall():
        assert bounds == pytest.approx(BOUNDS, rel=1e-12)
        assert cumulative == sorted(cumulative) and cumulative[-1] <= count
        per = [cumulative[0]] + [b - a for a, b in zip(cumulative, cumulative[1:])]
        out[metric] = (per + [count - cumulative[-1]], total, count)
    return out


def expected(*seconds):
    counts = [0] * 13
    for s in seconds:
        counts[bucket(s)] += 1
    return counts


def test_every_hold_and_wait_lands_in_its_bucket_and_sums_are_the_counters(hc, hdb):
    with hc.connect(hdb) as a, hc.connect(hdb) as b, hc.connect(hdb) as observer:
        # Taken and given back in one statement: a hold of 0.
        assert one(a, "SELECT stage_e_release('h', stage_e_try_slot('h', 2))") is True
        # A session slot held 0.4 s, and a lease released after 0.4 s.
        slot = one(a, "SELECT stage_e_try_slot('h', 2)")
        lease = a.execute("SELECT slot, token FROM stage_e_lease('h', 2, '1 hour')").fetchone()
        time.sleep(0.4)
        assert one(a, "SELECT stage_e_release('h', %s)", (slot,)) is True
        assert one(a, "SELECT stage_e_release_lease('h', %s, %s)", lease) is True
        # A wait that times out after 300 ms (both slots held), and one served after ~100 ms.
        held = [one(a, "SELECT stage_e_try_slot('h', 2)") for _ in range(2)]
        t0 = time.monotonic()
        assert one(b, "SELECT stage_e_try_slot('h', 2, '300 ms')") is None
        timed_out = time.monotonic() - t0
        releaser = threading.Timer(0.1, lambda: a.execute(
            "SELECT stage_e_release('h', %s)", (held[0],)))
        releaser.start()
        t0 = time.monotonic()
        assert one(b, "SELECT stage_e_try_slot('h', 2, '10 s')") == held[0]
        served = time.monotonic() - t0
        releaser.join(timeout=10)
        assert not releaser.is_alive()
        # A lease of 1.2 s left to expire, freed by a later call for its slot at about 1.6 s.
        one(b, "SELECT stage_e_release_all()")
        one(a, "SELECT stage_e_release_all()")
        assert one(a, "SELECT slot FROM stage_e_lease('h', 2, '1.2 s')") == 0
        time.sleep(1.6)
        assert one(b, "SELECT stage_e_try_slot('h', 1)") == 0
        # A session that ends holding a slot: its hold ends with it.
        with hc.connect(hdb) as c:
            assert one(c, "SELECT stage_e_try_slot('h', 2)") == 1
        wait_for(lambda: one(observer, "SELECT released_by_exit FROM stage_e_stats() "
                                       "WHERE cap = 'h'") == 1, timeout=10, what="the exit")

        h = histograms(observer, "h")
        st = observer.execute("SELECT released, released_by_exit, expired, waits, "
                              "extract(epoch FROM hold_time)::float8, "
                              "extract(epoch FROM wait_time)::float8 "
                              "FROM stage_e_stats() WHERE cap = 'h'").fetchone()
        released, by_exit, expired, waits, hold_s, wait_s = st
        hold, wait = h["hold"], h["wait"]
        # Holds: 0, 0.4, 0.4 (lease), the slot the timer released, the two released by
        # release_all, the lease that expired (freed at about 1.6 s), the exited session's.
        assert hold[2] == released + by_exit + expired == 8
        assert (expired, by_exit) == (1, 1)
        assert hold[0][bucket(0)] >= 1 and hold[0][bucket(0.4)] >= 2
        assert hold[0][bucket(1.6)] == 1, hold
        assert hold[1] == pytest.approx(hold_s, abs=1e-6)
        # Waits: one timed out after 300 ms, one served after about 100 ms.
        assert wait[2] == waits == 2
        # The server's waits are at least 300 ms and about 100 ms, and at most what the client
        # measured around them: each lands in a bucket from its least to the client's figure's
        # (on a quiet machine (256 ms, 1.024 s] and (64 ms, 256 ms]; a stall moves only the top).
        waits_at = sorted(i for i, k in enumerate(wait[0]) for _ in range(k))
        ranges = [(bucket(0.3), bucket(timed_out)), (bucket(0.09), bucket(served))]
        assert any(all(lo <= b <= hi for b, (lo, hi) in zip(order, ranges))
                   for order in (waits_at, waits_at[::-1])), (wait[0], timed_out, served)
        assert wait[1] == pytest.approx(wait_s, abs=1e-6)
        assert wait[1] == pytest.approx(timed_out + served, abs=0.05)
        # The quantiles view sees the same counts.
        assert observer.execute("SELECT metric, count FROM stage_e_histogram_quantiles "
                                "WHERE cap = 'h' ORDER BY metric").fetchall() == [
            ("hold", 8), ("wait", 2)]


def test_quantiles_interpolate_within_the_bucket(hc, hdb):
    with hc.connect(hdb) as s:
        for _ in range(10):
            assert one(s, "SELECT stage_e_release('q', stage_e_try_slot('q', 1))") is True
        row = s.execute("SELECT count, extract(epoch FROM p50)::float8, "
                        "extract(epoch FROM p90)::float8, extract(epoch FROM p99)::float8 "
                        "FROM stage_e_histogram_quantiles WHERE cap = 'q' AND metric = 'hold'"
                        ).fetchone()
        # Ten holds of 0 in the first bucket (0, 1 ms]: the q-quantile is q ms.
        assert row == (10, pytest.approx(0.0005), pytest.approx(0.0009), pytest.approx(0.00099))
        assert s.execute("SELECT count, p50, p90, p99 FROM stage_e_histogram_quantiles "
                         "WHERE cap = 'q' AND metric = 'wait'").fetchone() == (0, None, None,
                                                                              None)


def rows(conn):
    return {cap: (hold, wait) for cap, hold, wait in conn.execute(
        "SELECT cap, hold_buckets, wait_buckets FROM stage_e_throttle_counter").fetchall()}


def test_flushes_add_the_histograms_to_the_row_once_and_a_reset_zeroes_them(hc, hdb):
    zero = [0] * 13
    with hc.connect(hdb) as s, hc.connect(hdb) as other:
        for _ in range(3):
            assert one(s, "SELECT stage_e_release('f', stage_e_try_slot('f', 1))") is True
        assert one(s, "SELECT stage_e_try_slot('f', 1)") == 0
        assert one(other, "SELECT stage_e_try_slot('f', 1, '10 ms')") is None
        s.execute("SELECT stage_e_flush()")
        first = rows(s)["f"]
        # Three holds of 0 (taken and given back in one statement), and one wait of at least
        # its 10 ms: in 10 ms's bucket or, on a loaded machine, a later one (a wait's end is
        # when its backend next runs).
        assert first[0] == expected(0, 0, 0)
        assert sum(first[1]) == 1 and first[1].index(1) >= bucket(0.01), first[1]
        # A flush rolled back writes nothing, and its counts stay pending for the next one.
        assert one(s, "SELECT stage_e_release('f', 0)") is True  # held about 0 to 0.1 s
        s.autocommit = False
        s.execute("SELECT stage_e_flush()")
        s.rollback()
        s.autocommit = True
        assert rows(s)["f"] == first
        s.execute("SELECT stage_e_flush()")
        hold, wait = rows(s)["f"]
        assert sum(hold) == 4 and hold[0] >= 3 and wait == first[1]
        assert hold == histograms(s, "f")["hold"][0]
        # Nothing new: the next flush leaves the row alone.
        s.execute("SELECT stage_e_flush()")
        assert rows(s)["f"] == (hold, wait)
        s.execute("SELECT stage_e_reset_stats('f')")
        assert rows(s)["f"] == (zero, zero)
        s.execute("SELECT stage_e_flush()")
        assert rows(s)["f"] == (zero, zero), "a reset drops the pending histograms too"


def test_histograms_survive_a_clean_restart_and_n_follows_the_latest_acquisition(hc, hdb):
    with hc.connect(hdb) as s:
        assert one(s, "SELECT stage_e_release('r', stage_e_try_slot('r', 3))") is True
        assert one(s, "SELECT n FROM stage_e_stats() WHERE cap = 'r'") == 3
        assert one(s, "SELECT stage_e_try_slot('r', 5, '10 ms')") == 0
        assert one(s, "SELECT n FROM stage_e_stats() WHERE cap = 'r'") == 5
        assert one(s, "SELECT stage_e_release('r', 0)") is True
        before = histograms(s, "r")
        assert (before["hold"][2], before["wait"][2]) == (2, 0)
    hc.stop()  # a clean (fast) shutdown: the pending counts go to the pending file
    hc.start()
    with hc.connect(hdb) as s:
        # The cap is back with its pending counts, not yet acquired since: no n, and no
        # histogram counts since it was made (as stage_e_stats() shows no counts).
        assert s.execute("SELECT n, acquired FROM stage_e_stats() WHERE cap = 'r'"
                         ).fetchone() == (None, 0)
        assert histograms(s, "r")["hold"][2] == 0
        s.execute("SELECT stage_e_flush()")
        assert rows(s)["r"] == (before["hold"][0], [0] * 13)
        assert one(s, "SELECT acquired FROM stage_e_throttle_counter WHERE cap = 'r'") == 2
