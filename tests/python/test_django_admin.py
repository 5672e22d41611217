"""The counter rows in Django admin (the installed package's app, stage_e_slots.django, in the
demo project examples/django), through Django's test client on a real database, in a
subprocess (examples/django/check_admin.py) so that Django's settings stay out of this
process."""

import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from pgcluster import wait_for  # scripts/, put on sys.path by tests/conftest.py
from stage_e_slots import SlotConnection

CHECKER = Path(__file__).resolve().parents[2] / "examples" / "django" / "check_admin.py"
COUNTERS = ["acquired", "throttled", "released", "foreign_releases", "released_by_exit",
            "expired"]
ADAPT = ["adapt_min", "adapt_max", "adapt_enforce", "adapt_limit"]
RATE = ["rate_count", "rate_per", "rate_burst", "rate_limited"]


def stats(conn, cap):
    """The cap's row of stage_e_stats() (the live counts since the cap was made)."""
    cur = conn.execute("SELECT * FROM stage_e_stats() WHERE cap = %s", (cap,))
    row = cur.fetchone()
    assert row is not None, f"cap {cap!r} is not in use"
    return dict(zip([d.name for d in cur.description], row))


def counter_rows(conn):
    cur = conn.execute(f"SELECT cap, {', '.join(COUNTERS + ADAPT + RATE)}, flushed_at "
                       "FROM stage_e_throttle_counter ORDER BY cap")
    names = [d.name for d in cur.description]
    return {row[0]: dict(zip(names[1:], row[1:])) for row in cur.fetchall()}


def extension_owns_counter_table(conn):
    return conn.execute(
        "SELECT count(*) FROM pg_depend WHERE classid = 'pg_class'::regclass "
        "AND objid = 'stage_e_throttle_counter'::regclass "
        "AND refclassid = 'pg_extension'::regclass AND deptype = 'e'").fetchone()[0] == 1


def test_admin_shows_each_caps_counter_row_read_only(cluster, db, connect):
    observer = connect("observer")
    dsn = cluster.conninfo(db, "admin-test")
    # Three caps, with different counts in every column, so that each column of each row on
    # the page can be told apart: one of them adaptive, one with an expired lease.
    a = SlotConnection(dsn, application_name="worker-a")
    b = SlotConnection(dsn, application_name="worker-b")
    with a.slot(1, cap="exports") as slot:
        assert slot == 0
        assert [b.try_slot(1, cap="exports") for _ in range(3)] == [None] * 3
    assert b.release(0, cap="exports") is False  # a foreign release: nobody holds it
    assert a.try_slot(1, cap="dispatch") == 0
    assert [b.try_slot(1, cap="dispatch") for _ in range(5)] == [None] * 5
    a.close()  # exits holding dispatch's slot 0
    wait_for(lambda: stats(observer, "dispatch")["released_by_exit"] == 1,
             what="dispatch's slot counted as released by exit")
    b.close()
    # An adaptive cap that nothing uses stays at its min_slots: a limit that does not move.
    observer.execute("SELECT stage_e_adapt('dispatch', 2, 6)")
    # A lease that expires: its renewal finds it gone and counts it as expired, once.
    slot, token = observer.execute("SELECT * FROM stage_e_lease('leases', 2, '50 ms')").fetchone()
    time.sleep(0.3)
    assert observer.execute("SELECT stage_e_renew('leases', %s, %s, '1 s')",
                            (slot, token)).fetchone()[0] is False
    # A rate-limited cap (0.10.0): one acquisition an hour, so a second try finds its slot
    # free and is refused by the rate, counted throttled and rate-limited.
    observer.execute("SELECT stage_e_rate_limit('rated', 1, '1 hour')")
    r = SlotConnection(dsn, application_name="worker-r")
    assert r.try_slot(2, cap="rated") == 0
    assert r.release(0, cap="rated") is True
    assert r.try_slot(2, cap="rated") is None
    r.close()
    observer.execute("SELECT * FROM stage_e_flush()")
    not_adaptive = dict.fromkeys(ADAPT)
    no_rate = {**dict.fromkeys(RATE[:3]), "rate_limited": 0}
    expected = {
        "dispatch": {"acquired": 1, "throttled": 5, "released": 0, "foreign_releases": 0,
                     "released_by_exit": 1, "expired": 0, "adapt_min": 2, "adapt_max": 6,
                     "adapt_enforce": True, "adapt_limit": 2, **no_rate},
        "exports": {"acquired": 1, "throttled": 3, "released": 1, "foreign_releases": 1,
                    "released_by_exit": 0, "expired": 0, **not_adaptive, **no_rate},
        "leases": {"acquired": 1, "throttled": 0, "released": 0, "foreign_releases": 0,
                   "released_by_exit": 0, "expired": 1, **not_adaptive, **no_rate},
        "rated": {"acquired": 1, "throttled": 1, "released": 1, "foreign_releases": 0,
                  "released_by_exit": 0, "expired": 0, **not_adaptive, "rate_count": 1,
                  "rate_per": timedelta(hours=1), "rate_burst": 1, "rate_limited": 1},
    }
    before = counter_rows(observer)
    assert {cap: {k: row[k] for k in COUNTERS + ADAPT + RATE}
            for cap, row in before.items()} == expected
    assert all(row["flushed_at"] is not None for row in before.values())

    out = subprocess.run([sys.executable, str(CHECKER), str(cluster.base), str(cluster.port),
                          db], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    s = json.loads(out.stdout.strip().splitlines()[-1])

    # Migrating created nothing: the table is still the extension's, with the same rows, and
    # the model's migration is recorded but runs no SQL.
    assert extension_owns_counter_table(observer)
    assert counter_rows(observer) == before
    assert "CREATE TABLE" not in s["sqlmigrate"].upper()
    assert s["migrations_match_models"] is True
    assert observer.execute("SELECT count(*) FROM django_migrations WHERE app = "
                            "'stage_e_slots' AND name = '0001_initial'").fetchone()[0] == 1

    # Anonymous: sent to the login page.
    assert s["anonymous_status"] == 302
    assert s["anonymous_location"].startswith("/admin/login/")

    # The superuser's changelist shows each cap's row, every counter as in the table.
    assert s["logged_in"] is True
    assert s["changelist_status"] == 200
    page = s["changelist_rows"]
    assert sorted(page) == ["dispatch", "exports", "leases", "rated"]
    assert page["exports"]["throttled"] == "3" and page["dispatch"]["throttled"] == "5"
    for cap, row in expected.items():
        assert {k: page[cap][k] for k in COUNTERS} == {k: str(row[k]) for k in COUNTERS}
        assert page[cap]["flushed_at"] not in ("", "-")
    # The learned limit is a column; Django shows an empty one as "-".
    assert {cap: page[cap]["adapt_limit"] for cap in page} == {
        "dispatch": "2", "exports": "-", "leases": "-", "rated": "-"}
    assert {cap: page[cap]["rate_limited"] for cap in page} == {
        "dispatch": "0", "exports": "0", "leases": "0", "rated": "1"}
    # The ORM reads every column of 0.10.0 (an interval as seconds, through the checker's JSON).
    in_json = {cap: {k: v.total_seconds() if isinstance(v, timedelta) else v
                     for k, v in row.items()} for cap, row in expected.items()}
    assert {cap: {k: r[k] for k in COUNTERS + ADAPT + RATE}
            for cap, r in s["orm_rows"].items()} == in_json
    assert {cap: r["flushed_at"] for cap, r in s["orm_rows"].items()} == {
        cap: r["flushed_at"].isoformat() for cap, r in before.items()}

    # Read-only, even for a superuser: no adding, changing or deleting, by GET or POST; the
    # change page is a view.
    assert s["add_status"] == 403 and s["add_post_status"] == 403
    assert s["change_cap"] == "dispatch" and s["change_status"] == 200
    # The change page is a read-only view of every column of the row, the adaptive cap's
    # policy and learned limit included (a boolean is shown as an icon, alt "True").
    fields = s["change_fields"]
    assert {k: fields[k] for k in ["cap", "acquired", "throttled", "released_by_exit",
                                   "expired", "adapt_min", "adapt_max", "adapt_limit"]} == {
        "cap": "dispatch", "acquired": "1", "throttled": "5", "released_by_exit": "1",
        "expired": "0", "adapt_min": "2", "adapt_max": "6", "adapt_limit": "2"}
    assert {"waits", "wait_time", "hold_time", "hold_buckets", "wait_buckets", "lock_key",
            "flush_id", "adapt_enforce", "adapt_baseline", "flushed_at", "rate_count",
            "rate_per", "rate_burst", "rate_limited"} <= set(fields)
    assert fields["rate_limited"] == "0"
    assert s["change_post_status"] == 403
    assert s["delete_status"] == 403 and s["delete_post_status"] == 403
