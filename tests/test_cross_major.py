"""A PostgreSQL 15 database moved to 18 with pg_dump/pg_restore. Collected only in the
PostgreSQL 18 run (conftest.py), which installs the 15 build first; pg_upgrade from Debian's
15 to 18 is not possible here at all (see the README's upgrade notes)."""

import subprocess
from pathlib import Path

import pytest
from conftest import one
from pgcluster import Cluster

REPO = Path(__file__).resolve().parent.parent
PG15_CONFIG = "/usr/lib/postgresql/15/bin/pg_config"


@pytest.fixture(scope="module")
def pg15_installed():
    """The 15 build of this very tree, installed into Debian's PostgreSQL 15."""
    out = subprocess.run(["make", "-C", str(REPO), "install-dev", "PG=15",
                          f"PG_CONFIG={PG15_CONFIG}"], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_a_15_database_dumped_and_restored_into_18_keeps_its_counts(pg15_installed):
    old = Cluster("cross_15", {"stage_e_slots.flush_interval": "'1h'"},
                  pg_config=PG15_CONFIG).init().start()
    new = Cluster("cross_18", {"stage_e_slots.flush_interval": "'1h'"}, port=5434).init().start()
    try:
        assert old.sql("SHOW server_version_num")[0][0].startswith("15")
        assert new.sql("SHOW server_version_num")[0][0].startswith("18")
        old.create_database("app")
        with old.connect("app", "holder") as holder, old.connect("app") as s:
            assert one(holder, "SELECT stage_e_try_slot(2)") == 0
            assert one(s, "SELECT stage_e_try_slot(2)") == 1
            assert one(s, "SELECT stage_e_try_slot(2)") is None
            assert one(s, "SELECT stage_e_release(1)") is True
            s.execute("SELECT stage_e_flush()")
            row = s.execute("SELECT * FROM stage_e_throttle_counter").fetchall()
        assert [r[1:6] for r in row] == [(2, 1, 1, 0, 0)]
        new.create_database("app", extension=False)
        dump = str(new.base / "app.dump")
        # The newer pg_dump reads the older server, as PostgreSQL recommends.
        new._run(str(new.bin / "pg_dump"), "-h", str(old.base), "-p", str(old.port),
                 "-U", "postgres", "-Fc", "-f", dump, "app")
        out = new._run(str(new.bin / "pg_restore"), "-h", str(new.base), "-p", str(new.port),
                       "-U", "postgres", "-d", "app", "--single-transaction", "--exit-on-error",
                       dump, check=False)
        assert out.returncode == 0, out.stderr
        with new.connect("app") as s, new.connect("app") as t:
            assert s.execute("SELECT * FROM stage_e_throttle_counter").fetchall() == row
            assert one(s, "SELECT stage_e_try_slot(1)") == 0
            assert one(t, "SELECT stage_e_try_slot(1)") is None
            s.execute("SELECT stage_e_flush()")
            assert s.execute("SELECT acquired, throttled FROM stage_e_throttle_counter"
                             ).fetchone() == (3, 2)
    finally:
        new.destroy()
        old.destroy()


