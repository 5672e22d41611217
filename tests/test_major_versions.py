"""Moving a database to a new cluster with pg_upgrade (same major: PG_CONFIG's), with the
extension preloaded on both sides and counts in the table and pending in shared memory."""

import os
import pwd
import shutil
from pathlib import Path

from conftest import one, stats
from pgcluster import Cluster, wait_for

PENDING_FILE = Path("pg_stat/stage_e_slots.pending")


def throttle(conn, times):
    return conn.execute(
        "SELECT count(*) FILTER (WHERE s IS NULL) FROM "
        "(SELECT stage_e_try_slot(1) AS s FROM generate_series(1, %s)) x", (times,)).fetchone()[0]


def test_pg_upgrade_keeps_the_counts_and_starts_no_worker_in_binary_upgrade_mode():
    settings = {"stage_e_slots.flush_interval": "'1h'"}
    old = Cluster("upgrade_old", settings).init().start()
    new = Cluster("upgrade_new", settings, port=5434).init()
    try:
        old.create_database("app")
        with old.connect("app", "holder") as holder, old.connect("app") as s:
            assert one(holder, "SELECT stage_e_try_slot(1)") == 0
            assert throttle(s, 5) == 5
            s.execute("SELECT stage_e_flush()")
            assert throttle(s, 3) == 3  # pending at shutdown: saved to the pending file
            before_row = s.execute("SELECT * FROM stage_e_throttle_counter").fetchall()
        with old.connect("app") as s:
            wait_for(lambda: stats(s)["released_by_exit"] == 1, what="the holder's exit")
            before = s.execute("SELECT acquired, throttled, released_by_exit "
                               "FROM stage_e_throttle_totals").fetchone()
        assert before == (1, 8, 1)
        old.stop("fast")
        assert (old.data / PENDING_FILE).exists()

        out = new._run(str(new.bin / "pg_upgrade"), "-b", str(old.bin), "-B", str(new.bin),
                       "-d", str(old.data), "-D", str(new.data), "-U", "postgres",
                       "-s", str(new.base), "-p", "50432", "-P", "50433", "--retain",
                       check=False)
        assert out.returncode == 0, out.stdout + out.stderr
        # pg_upgrade started both servers with the library preloaded, in binary-upgrade mode:
        # the flush launcher must not have run in either (it would write into databases
        # pg_upgrade is copying).
        logs = "".join(p.read_text(errors="replace")
                       for p in (new.data / "pg_upgrade_output.d").rglob("*.log"))
        assert "pg_upgrade_server.log" in " ".join(
            p.name for p in (new.data / "pg_upgrade_output.d").rglob("*.log"))
        assert "database system is ready to accept connections" in logs
        assert "stage_e_slots launcher started" not in logs

        new.start()
        with new.connect("app") as s:
            # The table came across as it was.
            assert s.execute("SELECT * FROM stage_e_throttle_counter").fetchall() == before_row
        new.stop("fast")
        # The pending file goes along too (pg_upgrade keeps database OIDs), as the README says.
        shutil.copy2(old.data / PENDING_FILE, new.data / PENDING_FILE)
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(new.data / PENDING_FILE, pw.pw_uid, pw.pw_gid)
        new.start()
        with new.connect("app") as s:
            after = s.execute("SELECT acquired, throttled, released_by_exit "
                              "FROM stage_e_throttle_totals").fetchone()
            assert after == before
            wait_for(lambda: s.execute("SELECT acquired, throttled, released_by_exit "
                                       "FROM stage_e_throttle_counter").fetchone() == before,
                     timeout=5, what="the launcher's first round to write the carried counts")
            assert one(s, "SELECT stage_e_try_slot(1)") == 0
            assert one(s, "SELECT stage_e_release(0)") is True
    finally:
        new.destroy()
        old.destroy()
