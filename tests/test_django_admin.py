"""The counter rows in Django admin (examples/django/stage_e_counters), through Django's test
client on a real database, in a subprocess (examples/django/check_admin.py) so that Django's
settings stay out of this process."""

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "python"))

from conftest import stats, wait_for  # noqa: E402
from stage_e_slot import SlotConnection  # noqa: E402

CHECKER = Path(__file__).resolve().parent.parent / "examples" / "django" / "check_admin.py"
COUNTERS = ["acquired", "throttled", "released", "foreign_releases", "released_by_exit"]


def counter_rows(conn):
    cur = conn.execute(f"SELECT cap, {', '.join(COUNTERS)}, flushed_at "
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
    # Two caps, with different counts in every column, so that each column of each row on
    # the page can be told apart.
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
    observer.execute("SELECT * FROM stage_e_flush()")
    expected = {
        "dispatch": {"acquired": 1, "throttled": 5, "released": 0, "foreign_releases": 0,
                     "released_by_exit": 1},
        "exports": {"acquired": 1, "throttled": 3, "released": 1, "foreign_releases": 1,
                    "released_by_exit": 0},
    }
    before = counter_rows(observer)
    assert {cap: {k: row[k] for k in COUNTERS} for cap, row in before.items()} == expected
    assert all(row["flushed_at"] is not None for row in before.values())

    out = subprocess.run([sys.executable, str(CHECKER), str(cluster.base), str(cluster.port),
                          db], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    s = json.loads(out.stdout.strip().splitlines()[-1])

    # Migrating created nothing: the table is still the extension's, with the same rows, and
    # the model's migration is recorded but runs no SQL.
    assert extension_owns_counter_table(observer)
    assert counter_rows(observer) == before
    assert "CREATE TABLE" not in s["sqlmigrate"].upper()
    assert s["migrations_match_models"] is True
    assert observer.execute("SELECT count(*) FROM django_migrations WHERE app = "
                            "'stage_e_counters' AND name = '0001_initial'").fetchone()[0] == 1

    # Anonymous: sent to the login page.
    assert s["anonymous_status"] == 302
    assert s["anonymous_location"].startswith("/admin/login/")

    # The superuser's changelist shows each cap's row, every counter as in the table.
    assert s["logged_in"] is True
    assert s["changelist_status"] == 200
    page = s["changelist_rows"]
    assert sorted(page) == ["dispatch", "exports"]
    assert page["exports"]["throttled"] == "3" and page["dispatch"]["throttled"] == "5"
    for cap, row in expected.items():
        assert {k: page[cap][k] for k in COUNTERS} == {k: str(v) for k, v in row.items()}
        assert page[cap]["flushed_at"] not in ("", "-")
    assert {cap: {k: r[k] for k in COUNTERS} for cap, r in s["orm_rows"].items()} == expected
    assert {cap: r["flushed_at"] for cap, r in s["orm_rows"].items()} == {
        cap: r["flushed_at"].isoformat() for cap, r in before.items()}

    # Read-only, even for a superuser: no adding, changing or deleting, by GET or POST; the
    # change page is a view.
    assert s["add_status"] == 403 and s["add_post_status"] == 403
    assert s["change_cap"] == "dispatch" and s["change_status"] == 200
    assert s["change_post_status"] == 403
    assert s["delete_status"] == 403 and s["delete_post_status"] == 403
