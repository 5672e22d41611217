"""The monitoring files (monitoring/) against the real components: Debian's
prometheus-postgres-exporter 0.11.1 and Prometheus 2.42 (scripts/monitoring.py starts them).

The exporter, with monitoring/postgres_exporter.yaml, against a database with traffic on two
caps (slots held, throttles, a wait served and one timed out, a foreign release, a slot lost
with its session, a lease released and one expired, a session waiting): every metric that the
monitoring guide (monitoring/README.md) names is on /metrics with its labels, equal to what
stage_e_stats(), stage_e_histograms() and the views it reads return at that moment, and
`promtool check metrics` finds nothing. In one database (the DSN's) and in every database
(--auto-discover-databases), where one cap name in two databases makes two series told apart by
`db`. Then a Prometheus scraping that exporter, with monitoring/alerts.yaml loaded, runs every
query of monitoring/grafana-dashboard.json and every rule's expression, and fires the incident's
two alerts live. A cap held back after a crash is exported too. (`make test-monitoring` checks
the rules and parses the dashboard offline.)
"""

import json
import math
import re
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import one, stats
from pgcluster import Cluster, wait_for
from test_leases import lease
from test_waiting import Waiter

from monitoring import (
    PROMTOOL,
    Exporter,
    Prometheus,
    binary,
    dashboard_queries,
    exporter_dsn,
    grafana_expr,
)

ROOT = Path(__file__).resolve().parent.parent
QUERIES = ROOT / "monitoring" / "postgres_exporter.yaml"
ALERTS = ROOT / "monitoring" / "alerts.yaml"
DASHBOARD = ROOT / "monitoring" / "grafana-dashboard.json"
README = ROOT / "monitoring" / "README.md"  # the monitoring guide names the metrics

CAPS = {"exports": 2, "reports": 3}  # cap: n
CAP_REGEX = "(exports|reports)"  # Grafana's rendering of a two-value $cap for Prometheus
# Served only while a cap is held back: checked after a crash, not with the traffic.
ONLY_WHILE_HELD_BACK = {"stage_e_slots_held_back_seconds"}
COUNTERS = {  # metric: stage_e_stats() column
    "stage_e_slots_acquired_total": "acquired",
    "stage_e_slots_throttled_total": "throttled",
    "stage_e_slots_released_total": "released",
    "stage_e_slots_foreign_releases_total": "foreign_releases",
    "stage_e_slots_released_by_exit_total": "released_by_exit",
    "stage_e_slots_waits_total": "waits",
    "stage_e_slots_wait_timeouts_total": "wait_timeouts",
    "stage_e_slots_expired_total": "expired",
    "stage_e_slots_rates_limited_total": "rate_limited",
}
SECONDS = {"stage_e_slots_wait_seconds_total": "wait_time",
           "stage_e_slots_hold_seconds_total": "hold_time"}
GAUGES = {"stage_e_slots_held": "held", "stage_e_slots_n": "n",
          "stage_e_slots_max_slots": "max_slots"}
LOAD = ["held_1m", "held_5m", "held_15m",
        "throttled_per_min_1m", "throttled_per_min_5m", "throttled_per_min_15m"]
HISTOGRAMS = {"stage_e_slots_hold_seconds": "hold", "stage_e_slots_wait_seconds": "wait"}
ADAPTIVE = {"stage_e_slots_adaptive_limit": "limit",  # metric: stage_e_cap_limits column
            "stage_e_slots_adaptive_min_slots": "min_slots",
            "stage_e_slots_adaptive_max_slots": "max_slots"}
ADAPTIVE_SECONDS = {"stage_e_slots_adaptive_baseline_hold_seconds": "baseline_hold",
                    "stage_e_slots_adaptive_recent_hold_seconds": "recent_hold"}
SHARES = {"stage_e_slots_share_held": "held",  # metric: stage_e_shares column
          "stage_e_slots_share_waiting": "waiting"}
MAIN_PANELS = ["Held vs n", "Throttle rate", "Wait time p50 / p99", "Hold time p50 / p99"]
FLOAT_TOLERANCE = 1e-6  # seconds: the exporter prints float8s in full


# -- the documented names ----------------------------------------------------------------------

def documented_metrics():
    """{metric: type} of the metrics table of the monitoring guide (monitoring/README.md)."""
    out, table = {}, False
    for line in README.read_text().splitlines():
        if line.startswith("| Metric | Type |"):
            table = True
        elif table and not line.startswith("|"):
            break
        elif table and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            for name in re.findall(r"`(stage_e_slots_\w+)`", cells[0]):
                out[name] = cells[1]
    assert len(out) > 20 and ONLY_WHILE_HELD_BACK <= set(out), out
    return out


def alert_names():
    return re.findall(r"^\s*- alert: (\w+)\s*$", ALERTS.read_text(), re.MULTILINE)


# -- /metrics ----------------------------------------------------------------------------------

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"')


class Scrape:
    """One /metrics text: its samples by name, as (labels, value), and its # TYPE lines."""

    def __init__(self, text):
        self.text = text
        self.samples, self.types = {}, {}
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ", 3)
                self.types[name] = kind
            elif line and not line.startswith("#"):
                m = SAMPLE.match(line)
                assert m, f"not a sample line: {line!r}"
                labels = dict(LABEL.findall(m.group(2) or ""))
                self.samples.setdefault(m.group(1), []).append((labels, float(m.group(3))))

    def series(self, name, **labels):
        return [(l, v) for l, v in self.samples.get(name, [])
                if all(l.get(k) == v for k, v in labels.items())]

    def value(self, name, **labels):
        found = self.series(name, **labels)
        assert len(found) == 1, f"{name}{labels}: {len(found)} series on /metrics: {found}"
        return found[0][1]

    def ours(self):
        return {n: s for n, s in self.samples.items() if n.startswith("stage_e_slots_")}


def scrape(exporter):
    status, text = exporter.scrape()
    assert status == 200, f"/metrics answered HTTP {status}: {text[:2000]}\n{exporter.log_text()}"
    return Scrape(text)


def promtool_check_metrics(text):
    r = subprocess.run([binary(PROMTOOL), "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0, f"promtool check metrics: rc {r.returncode}\n{r.stdout}{r.stderr}"


# -- what SQL says -----------------------------------------------------------------------------

def rows(conn, query, params=None):
    cur = conn.execute(query, params)
    names = [d.name for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


def snapshot(conn):
    """What the database says now, read without the exporter's queries: (stable, moving).
    `stable` cannot change while nothing happens; `moving` are the values that move with the
    clock (waits and ages) or the background worker's 5 s samples (load averages)."""
    now = one(conn, "SELECT clock_timestamp()")
    start = one(conn, "SELECT pg_postmaster_start_time()")
    stats_rows = {r["cap"]: r for r in rows(conn, "SELECT * FROM stage_e_stats()")}
    hist = {(r["cap"], r["metric"]): r for r in rows(conn, "SELECT * FROM stage_e_histograms()")}
    waiting = {r["cap"]: r for r in rows(
        conn, "SELECT cap, count(*) AS n, max(waiting_for) AS oldest FROM stage_e_slot_waiters "
              "GROUP BY cap")}
    load = {r["cap"]: r for r in rows(conn, "SELECT * FROM stage_e_cap_load")}
    flushed = {r["cap"]: r for r in rows(
        conn, "SELECT cap, flushed_at, flush_id FROM stage_e_throttle_counter")}
    pending = {}
    for r in rows(conn, "SELECT * FROM stage_e_pending((SELECT max(flush_id) "
                        "FROM stage_e_throttle_counter))"):
        counts = sum(r[c] for c in COUNTERS.values())
        pending[r["cap"]] = (counts, counts > 0 or r["wait_time"] > timedelta(0)
                             or r["hold_time"] > timedelta(0))
    interval = one(conn, "SELECT setting::float8 / 1000 FROM pg_settings "
                         "WHERE name = 'stage_e_slots.flush_interval' AND unit = 'ms'")
    limits = {r["cap"]: r for r in rows(
        conn, 'SELECT cap, "limit", min_slots, max_slots, enforce, baseline_hold, recent_hold '
              "FROM stage_e_cap_limits")}
    shares = {(r["cap"], r["share"]): r for r in rows(
        conn, "SELECT cap, share, held, waiting FROM stage_e_shares")}
    stable = {"stats": stats_rows, "hist": hist, "flushed": flushed, "pending": pending,
              "waiters": {c: r["n"] for c, r in waiting.items()}, "interval": interval,
              "limits": limits, "shares": shares}
    age = {}
    for cap, (_, any_pending) in pending.items():
        last = max(t for t in (flushed.get(cap, {}).get("flushed_at"), start) if t)
        age[cap] = (now - last).total_seconds() if any_pending else 0.0
    moving = {"oldest": {c: r["oldest"].total_seconds() for c, r in waiting.items()},
              "load": load, "age": age}
    return stable, moving


def scrape_quiet(exporter, conn, attempts=3):
    """Scrapes between two snapshots that agree on everything that cannot move while nothing
    happens (a background flush in between, say, makes it try again). Returns
    (scrape, stable, moving before, moving after)."""
    for _ in range(attempts):
        before, moving_before = snapshot(conn)
        got = scrape(exporter)
        after, moving_after = snapshot(conn)
        if before == after:
            return got, before, moving_before, moving_after
    raise AssertionError(f"the database kept changing during {attempts} scrapes: "
                         f"{before} != {after}")


def between(value, a, b, what):
    lo, hi = min(a, b) - FLOAT_TOLERANCE, max(a, b) + FLOAT_TOLERANCE
    assert lo <= value <= hi, f"{what}: {value} on /metrics, not within [{a}, {b}] of SQL"


# -- traffic -----------------------------------------------------------------------------------

def take(conn, cap, n, wait=None):
    if wait is None:
        return one(conn, "SELECT stage_e_try_slot(%s, %s::int)", (cap, n))
    return one(conn, "SELECT stage_e_try_slot(%s, %s::int, %s::interval)", (cap, n, wait))


def give(conn, cap, slot):
    return one(conn, "SELECT stage_e_release(%s, %s::int)", (cap, slot))


def make_traffic(cluster, db, opened):
    """On each cap of CAPS, every counter of stage_e_stats() and both histograms nonzero: a
    lease released by its token, all n slots taken, a throttle, a wait that times out, a wait
    that is served, a foreign release, the waiter's session ending with its slot, a lease that
    expires, an acquisition a rate policy refuses. Left at the end: a holder of slots 0 .. n-2 of each cap, whose session is in
    `opened` with every other one this opens (the caller closes them)."""
    holder = cluster.connect(db, "holder")
    other = cluster.connect(db, "other")
    opened += [holder, other]
    for cap, n in CAPS.items():
        slot, token = lease(other, cap, n, "30 s")
        assert one(other, "SELECT stage_e_release_lease(%s, %s, %s)", (cap, slot, token)) is True
        assert [take(holder, cap, n) for _ in range(n)] == list(range(n))
        assert take(other, cap, n) is None
        assert take(other, cap, n, "0.2 s") is None
        waiter_conn = cluster.connect(db, "waiter")
        opened.append(waiter_conn)
        waiter = Waiter(waiter_conn, "SELECT stage_e_try_slot(%s, %s::int, '30 s')", (cap, n))
        wait_for(lambda cap=cap, waiter=waiter:
                 one(other, "SELECT count(*) FROM stage_e_slot_waiters "
                            "WHERE cap = %s AND pid = %s", (cap, waiter.pid)) == 1,
                 timeout=10, what=f"the waiter of {cap} in stage_e_slot_waiters")
        assert give(holder, cap, n - 1) is True
        assert waiter.wait().error is None and waiter.result == n - 1
        assert give(other, cap, 0) is False  # held by `holder`: a foreign release
        waiter_conn.close()  # holding slot n-1: released by its exit
        wait_for(lambda cap=cap: stats(other, cap)["released_by_exit"] == 1, timeout=10,
                 what=f"the waiter's exit to release its slot of {cap}")
        assert lease(other, cap, n, "0.3 s")[0] == n - 1
        wait_for(lambda cap=cap: stats(other, cap)["expired"] == 1, timeout=15, interval=0.1,
                 what=f"the 0.3 s lease of {cap} to be freed and counted as expired")
        # A rate policy of one an hour: one acquisition, then one the rate refuses
        # (rate_limited); taken off again.
        other.execute("SELECT stage_e_rate_limit(%s, 1, '1 h')", (cap,))
        assert take(other, cap, n) == n - 1
        assert take(other, cap, n) is None
        assert give(other, cap, n - 1) is True
        other.execute("SELECT stage_e_rate_limit_off(%s)", (cap,))
    for cap, n in CAPS.items():
        s = stats(other, cap)
        zero = [c for c in [*COUNTERS.values(), *SECONDS.values()] if not s[c]]
        assert not zero, f"the traffic left counters of {cap} at zero: {zero}"
        assert s["held"] == n - 1
    return holder, other


@pytest.fixture
def sessions():
    opened = []
    yield opened
    for conn in opened:
        if not conn.closed:
            conn.close()


@pytest.fixture
def processes():
    """Exporters and Prometheus servers started by the test; stopped (and waited for) at the
    end, whatever happened."""
    started = []

    def _start(proc):
        started.append(proc)
        return proc.start()

    yield _start
    for proc in reversed(started):
        proc.stop()


# -- the dashboard's shape (no Grafana here: checked against its JSON model) ------------------

def test_dashboard_is_one_grafana_dashboard_with_its_variables_and_panels():
    d = json.loads(DASHBOARD.read_text())
    assert d["schemaVersion"] >= 36 and d["title"] and d["uid"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("cap", "db"):
        v = variables[name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"], v
        assert re.fullmatch(rf"label_values\(stage_e_slots_held(\{{.*\}})?, {name}\)",
                            v["query"]["query"]), v["query"]
        assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    ids, cells = set(), set()
    for panel in d["panels"]:
        assert panel["id"] not in ids, f"two panels with id {panel['id']}"
        ids.add(panel["id"])
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {panel['title']!r} overlaps another"
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["type"] == "timeseries" and panel["title"] and panel["description"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for t in panel["targets"]:
            assert t["datasource"] == panel["datasource"] and t["expr"].strip(), t
            # Every query is limited to the chosen databases and caps.
            assert 'db=~"$db"' in t["expr"] and 'cap=~"$cap"' in t["expr"], t["expr"]
    assert {p["title"] for p in d["panels"]} >= set(MAIN_PANELS) | {
        "Foreign releases and slots lost with their connection", "Held, load averages"}
    for title in ("Wait time p50 / p99", "Hold time p50 / p99"):
        [panel] = [p for p in d["panels"] if p["title"] == title]
        exprs = [t["expr"] for t in panel["targets"]]
        assert any(e.startswith("histogram_quantile(0.5, ") for e in exprs)
        assert any(e.startswith("histogram_quantile(0.99, ") for e in exprs)
        assert all("by (le, db, cap) (rate(" in e and "_bucket{" in e and "[5m]" in e
                   for e in exprs if e.startswith("histogram_quantile"))


# -- (a) one database: every value equals SQL ------------------------------------------------

def test_exporter_serves_every_documented_metric_equal_to_sql(cluster, db, sessions,
                                                               processes):
    documented = documented_metrics()
    holder, other = make_traffic(cluster, db, sessions)
    # exports adaptive, in monitor mode (its n still binds, so the figures below hold).
    holder.execute("SELECT stage_e_adapt('exports', 1, 2, false)")
    wait_for(lambda: one(other, "SELECT count(*) FROM stage_e_cap_limits") == 1, timeout=10,
             what="the policy in stage_e_cap_limits")
    # exports full, with a session waiting for it; reports full, with one count pending.
    assert take(holder, "exports", CAPS["exports"]) == CAPS["exports"] - 1
    assert take(holder, "reports", CAPS["reports"]) == CAPS["reports"] - 1
    waiting_conn = cluster.connect(db, "still-waiting")
    sessions.append(waiting_conn)
    # In a fair share: the per-share series show it waiting.
    waiting = Waiter(waiting_conn, "SELECT stage_e_try_slot('exports', 2, '60 s', 'tenant')")
    try:
        wait_for(lambda: one(other, "SELECT count(*) FROM stage_e_slot_waiters "
                                    "WHERE pid = %s", (waiting.pid,)) == 1,
                 timeout=10, what="the waiter in stage_e_slot_waiters")
        other.execute("SELECT stage_e_flush()")
        assert take(other, "reports", CAPS["reports"]) is None

        exporter = processes(Exporter(exporter_dsn(cluster, db), QUERIES, base=cluster.base))
        got, sql, moving_before, moving_after = scrape_quiet(exporter, other)
    finally:
        other.execute("SELECT pg_cancel_backend(%s)", (waiting.pid,))
        waiting.wait()
    server = got.series("stage_e_slots_held")[0][0]["server"]
    base = {"db": db, "server": server}

    # The exporter's own health.
    assert got.value("pg_up") == 1
    assert got.value("pg_exporter_last_scrape_error") == 0, exporter.log_text()
    assert got.value("pg_exporter_user_queries_load_error", filename=str(QUERIES)) == 0

    # Every documented family and nothing else, each with its type.
    ours = got.ours()
    families = set(ours) | {n for n in got.types if n.startswith("stage_e_slots_")}
    expected = set(documented) - ONLY_WHILE_HELD_BACK
    served = {n for n in families if not re.search(r"_(bucket|sum|count)$", n)} | \
        {n for n in HISTOGRAMS if f"{n}_bucket" in ours}
    assert served == expected, (f"missing: {sorted(expected - served)}, "
                                f"not documented: {sorted(served - expected)}")
    for name in expected:
        assert got.types.get(name) == documented[name], (name, got.types.get(name))
    # Labels: db, cap and server; le on buckets, share on the shares'; nothing of another
    # database.
    for name, samples in ours.items():
        for labels, _ in samples:
            extra = {"le"} if name.endswith("_bucket") else {"share"} if name in SHARES \
                else set()
            assert set(labels) == {"db", "cap", "server"} | extra, (name, labels)
            assert labels["db"] == db and labels["server"] == server, (name, labels)

    assert set(sql["stats"]) == set(CAPS)
    for cap, n in CAPS.items():
        s, lab = sql["stats"][cap], {**base, "cap": cap}
        for name, column in {**GAUGES, **COUNTERS}.items():
            assert got.value(name, **lab) == s[column], (name, cap, s[column])
        for name, column in SECONDS.items():
            assert math.isclose(got.value(name, **lab), s[column].total_seconds(),
                                abs_tol=FLOAT_TOLERANCE), (name, cap, s[column])
        assert s["n"] == s["held"] == n  # both full

        assert got.value("stage_e_slots_waiters", **lab) == sql["waiters"].get(cap, 0)
        between(got.value("stage_e_slots_oldest_wait_seconds", **lab),
                moving_before["oldest"].get(cap, 0), moving_after["oldest"].get(cap, 0),
                f"oldest wait of {cap}")

        for name, metric in HISTOGRAMS.items():
            h = sql["hist"][(cap, metric)]
            assert h["seconds_count"] > 0 and len(h["seconds"]) == 12
            assert h["seconds"] == [0.001 * 4 ** i for i in range(12)] or all(
                math.isclose(a, 0.001 * 4 ** i) for i, a in enumerate(h["seconds"]))
            buckets = {float(l["le"]): v for l, v in got.series(f"{name}_bucket", **lab)}
            want = dict(zip(h["seconds"], h["seconds_bucket"]))
            want[math.inf] = h["seconds_count"]
            assert buckets == want, (name, cap)
            assert got.value(f"{name}_count", **lab) == h["seconds_count"]
            assert math.isclose(got.value(f"{name}_sum", **lab), h["seconds_sum"],
                                abs_tol=FLOAT_TOLERANCE), (name, cap)

        for column in LOAD:
            between(got.value(f"stage_e_slots_load_{column}", **lab),
                    moving_before["load"][cap][column], moving_after["load"][cap][column],
                    f"{column} of {cap}")

        counts, _ = sql["pending"][cap]
        assert got.value("stage_e_slots_flush_pending", **lab) == counts
        assert got.value("stage_e_slots_flush_interval_seconds", **lab) == sql["interval"]
        between(got.value("stage_e_slots_flush_age_seconds", **lab),
                moving_before["age"][cap], moving_after["age"][cap], f"flush age of {cap}")
    # The adaptive cap's policy and what it learned, as stage_e_cap_limits says.
    assert set(sql["limits"]) == {"exports"}
    limits, lab = sql["limits"]["exports"], {**base, "cap": "exports"}
    for name, column in ADAPTIVE.items():
        assert got.value(name, **lab) == limits[column], (name, limits[column])
    assert limits["min_slots"] == 1 and limits["max_slots"] == 2 and limits["enforce"] is False
    assert got.value("stage_e_slots_adaptive_enforced", **lab) == 0
    for name, column in ADAPTIVE_SECONDS.items():
        value, want = got.value(name, **lab), limits[column]
        if want is None:
            assert math.isnan(value), (name, value)
        else:
            assert math.isclose(value, want.total_seconds(), abs_tol=FLOAT_TOLERANCE), name
    assert got.series("stage_e_slots_adaptive_limit", **base, cap="reports") == []
    # The live share, as stage_e_shares says: the waiter's, holding nothing yet.
    assert set(sql["shares"]) == {("exports", "tenant")}
    lab = {**base, "cap": "exports", "share": "tenant"}
    for name, column in SHARES.items():
        assert got.value(name, **lab) == sql["shares"][("exports", "tenant")][column], name
    assert got.value("stage_e_slots_share_waiting", **lab) == 1

    # The waiter and the throttle after the flush make these nonzero.
    assert got.value("stage_e_slots_waiters", **base, cap="exports") == 1
    assert got.value("stage_e_slots_oldest_wait_seconds", **base, cap="exports") > 0
    assert sql["pending"]["reports"][0] == 1 and sql["pending"]["exports"][0] == 0
    assert got.value("stage_e_slots_flush_age_seconds", **base, cap="reports") > 0
    assert got.value("stage_e_slots_flush_age_seconds", **base, cap="exports") == 0

    promtool_check_metrics(got.text)


# -- (b) every database ------------------------------------------------------------------------

def test_every_database_mode_tells_one_cap_name_in_two_databases_apart(cluster, db,
                                                                       sessions, processes):
    second = cluster.create_database(f"{db[:50]}_b")
    without = cluster.create_database(f"{db[:50]}_none", extension=False)
    try:
        # Cap "exports" in both: one slot held in db, two (all) in the second, where another
        # session's try waits in vain (the holder's own would be answered at once).
        held = {db: 1, second: 2}
        for name, count in held.items():
            conn = cluster.connect(name, "holder")
            sessions.append(conn)
            assert [take(conn, "exports", 2) for _ in range(count)] == list(range(count))
        waiter = cluster.connect(second, "waiter")
        sessions.append(waiter)
        assert take(waiter, "exports", 2, "0.05 s") is None
        truth = {}
        for name in held:
            with cluster.connect(name) as conn:
                truth[name] = {r["cap"]: r for r in rows(conn, "SELECT * FROM stage_e_stats()")}

        # One database: the DSN's, only.
        single = processes(Exporter(exporter_dsn(cluster, db), QUERIES, base=cluster.base))
        got = scrape(single)
        assert {l["db"] for s in got.ours().values() for l, _ in s} == {db}
        single.stop()

        # Every database (of the two): HTTP 200, one series per database, each its own values.
        every = processes(Exporter(exporter_dsn(cluster, db), QUERIES, auto_discover=True,
                                   include=[db, second], base=cluster.base))
        got = scrape(every)
        assert got.value("pg_exporter_last_scrape_error") == 0, every.log_text()
        for name, samples in got.ours().items():
            keys = [tuple(sorted(l.items())) for l, _ in samples]
            assert len(keys) == len(set(keys)), f"duplicate series of {name}"
        for name in held:
            lab = {"db": name, "cap": "exports"}
            for metric, column in {**GAUGES, **COUNTERS}.items():
                assert got.value(metric, **lab) == truth[name]["exports"][column], (metric, lab)
        assert got.value("stage_e_slots_held", db=second, cap="exports") == 2
        assert got.value("stage_e_slots_held", db=db, cap="exports") == 1
        assert got.value("stage_e_slots_wait_timeouts_total", db=second, cap="exports") == 1
        assert got.value("stage_e_slots_wait_timeouts_total", db=db, cap="exports") == 0
        promtool_check_metrics(got.text)
        every.stop()

        # The DSN's database is queried even when --include-databases leaves it out.
        only_second = processes(Exporter(exporter_dsn(cluster, db), QUERIES,
                                         auto_discover=True, include=[second],
                                         base=cluster.base))
        got = scrape(only_second)
        assert {l["db"] for l, _ in got.series("stage_e_slots_held")} == {db, second}
        only_second.stop()

        # A database without the extension: its queries fail on every scrape (logged, and
        # pg_exporter_last_scrape_error 1); the others are still served.
        with_bare = processes(Exporter(exporter_dsn(cluster, db), QUERIES, auto_discover=True,
                                       include=[db, second, without], base=cluster.base))
        got = scrape(with_bare)
        assert got.value("pg_exporter_last_scrape_error") == 1
        assert "function stage_e_stats() does not exist" in with_bare.log_text()
        assert {l["db"] for l, _ in got.series("stage_e_slots_held")} == {db, second}
    finally:
        for conn in sessions:
            conn.close()
        for name in (second, without):
            cluster.sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- (c) Prometheus: the dashboard's and the rules' queries ------------------------------------

def test_prometheus_runs_every_dashboard_and_rule_query(cluster, db, sessions, processes):
    holder, other = make_traffic(cluster, db, sessions)
    exporter = processes(Exporter(exporter_dsn(cluster, db), QUERIES, base=cluster.base))
    prom = processes(Prometheus([exporter.address], rule_files=[ALERTS], interval="1s",
                                base=cluster.base))
    prom.wait_for_sample(f'stage_e_slots_held{{db="{db}"}}', timeout=30)

    # Traffic Prometheus sees happen: a throttle, a wait and a hold on each cap, a foreign
    # release on exports, a slot lost with its session on reports.
    for cap, n in CAPS.items():
        assert take(holder, cap, n) == n - 1
        assert take(other, cap, n, "0.1 s") is None
        assert give(holder, cap, n - 1) is True
    assert give(other, "exports", 0) is False
    leaving = cluster.connect(db, "leaving")
    assert take(leaving, "reports", CAPS["reports"]) == CAPS["reports"] - 1
    leaving.close()
    wait_for(lambda: stats(other, "reports")["released_by_exit"] == 2, timeout=10,
             what="the leaving session's slot to be released by its exit")

    sel = f'db="{db}", cap=~"{CAP_REGEX}"'

    def finite_for_every_cap(expr):
        reply = prom.query(expr)
        assert reply["status"] == "success", reply
        found = {r["metric"].get("cap") for r in reply["data"]["result"]
                 if math.isfinite(float(r["value"][1])) and float(r["value"][1]) > 0}
        return found >= set(CAPS)

    for metric in ("hold", "wait"):
        expr = (f"histogram_quantile(0.5, sum by (le, db, cap) "
                f"(rate(stage_e_slots_{metric}_seconds_bucket{{{sel}}}[5m])))")
        wait_for(lambda expr=expr: finite_for_every_cap(expr), timeout=30, interval=0.5,
                 what=f"a finite {metric} quantile of both caps in Prometheus")
    wait_for(lambda: finite_for_every_cap(f"rate(stage_e_slots_throttled_total{{{sel}}}[1m])"),
             timeout=30, interval=0.5, what="a nonzero throttle rate of both caps")

    # Every query of the dashboard, with $db, $cap and $__rate_interval as Grafana fills them.
    queries = dashboard_queries(DASHBOARD)
    assert len(queries) >= 20
    for title, ref, expr in queries:
        q = grafana_expr(expr, {"db": db, "cap": CAP_REGEX}, rate_interval="1m")
        reply = prom.query(q)
        assert reply["status"] == "success" and "error" not in reply, (title, ref, q, reply)
        assert not reply.get("warnings"), (title, ref, q, reply)
        if title in MAIN_PANELS:
            caps = {r["metric"].get("cap") for r in reply["data"]["result"]}
            assert caps == set(CAPS), f"panel {title!r} {ref}: series of {caps} for {q}"
            values = [float(r["value"][1]) for r in reply["data"]["result"]]
            assert all(math.isfinite(v) for v in values), (title, ref, q, values)
    assert {t for t, _, _ in queries} >= set(MAIN_PANELS)
    # The cap variable's query: label_values(stage_e_slots_held{db=~"$db"}, cap).
    reply = prom.api("label/cap/values", **{"match[]": f'stage_e_slots_held{{db=~"{db}"}}'})
    assert reply["status"] == "success" and set(reply["data"]) == set(CAPS), reply

    # Every rule loaded and evaluated without error, and its expression runs.
    names = alert_names()
    assert len(names) == 8, names

    def rules():
        reply = prom.api("rules")
        assert reply["status"] == "success", reply
        return [r for g in reply["data"]["groups"] for r in g["rules"]]

    wait_for(lambda: all(r["health"] == "ok" for r in rules()) and rules(), timeout=20,
             interval=0.5, what="every rule evaluated with health ok")
    loaded = rules()
    assert sorted(r["name"] for r in loaded) == sorted(names)
    for rule in loaded:
        assert rule["type"] == "alerting" and not rule.get("lastError"), rule
        reply = prom.query(rule["query"])
        assert reply["status"] == "success" and "error" not in reply, (rule["name"], reply)

    # The incident's two signatures fire at once (no `for`), labelled with the series'.
    def firing():
        reply = prom.api("alerts")
        assert reply["status"] == "success", reply
        return {(a["labels"]["alertname"], a["labels"]["cap"]): a
                for a in reply["data"]["alerts"]
                if a["state"] == "firing" and a["labels"].get("db") == db}

    want = {("StageESlotsForeignRelease", "exports"), ("StageESlotsSlotLostWithConnection",
                                                       "reports")}
    wait_for(lambda: want <= set(firing()), timeout=20, interval=0.5,
             what=f"{sorted(want)} firing in Prometheus")
    for key in want:
        labels = firing()[key]["labels"]
        assert labels["job"] == prom.job and labels["instance"] == exporter.address, labels
        assert labels["severity"] == "critical" and labels["server"], labels


# -- (d) a held-back cap -----------------------------------------------------------------------

def test_a_cap_held_back_after_a_crash_is_exported():
    # recovery_hold: after a crash, every cap with a counter row is held back that long.
    c = Cluster("monitoring_held", {"stage_e_slots.recovery_hold": "'60s'"})
    exporter = None
    try:
        c.init().start()
        c.create_database("app")
        with c.connect("app") as s:
            assert take(s, "sess", 2) == 0
            s.execute("SELECT stage_e_flush()")
        c.crash()
        c.start()
        with c.connect("app") as s:
            assert take(s, "sess", 2) is None  # held back
            held = ("SELECT extract(epoch FROM held_until - clock_timestamp())::float8 "
                    "FROM stage_e_held_back")
            assert one(s, "SELECT reason FROM stage_e_held_back WHERE cap = 'sess'") == \
                "recovery_hold"
            exporter = Exporter(exporter_dsn(c, "app"), QUERIES, base=c.base).start()
            before = one(s, held)
            got = scrape(exporter)
            after = one(s, held)
        name = "stage_e_slots_held_back_seconds"
        assert documented_metrics()[name] == got.types.get(name) == "gauge"
        [(labels, value)] = got.series(name)
        assert set(labels) == {"db", "cap", "reason", "server"}, labels
        assert (labels["db"], labels["cap"], labels["reason"]) == ("app", "sess", "recovery_hold")
        between(value, before, after, "seconds held back")
        assert 0 < value <= 60
        assert got.value("pg_exporter_last_scrape_error") == 0, exporter.log_text()
        promtool_check_metrics(got.text)
    finally:
        if exporter is not None:
            exporter.stop()
        c.destroy()


def test_the_share_query_returns_no_rows_with_export_shares_off(cluster, db):
    """stage_e_slots.export_shares = off (for the exporter's role, or a session) leaves the
    per-share series out: the exporter's own query returns no rows, and on again, one per live
    share."""
    text = QUERIES.read_text().split("\nstage_e_slots_share:\n  query: |\n", 1)[1]
    query = text.split("\n  master:", 1)[0]
    with cluster.connect(db, "holder") as holder, cluster.connect(db, "monitor") as monitor:
        assert one(holder, "SELECT stage_e_try_slot('exports', 2, '0', 'tenant')") == 0
        assert monitor.execute(query).fetchall() == [(db, "exports", "tenant", 1, 0)]
        monitor.execute("SET stage_e_slots.export_shares = off")
        assert monitor.execute(query).fetchall() == []
        assert one(monitor, "SELECT count(*) FROM stage_e_shares") == 1  # the view either way
