"""The files a restart reads in pg_stat/ (0.6.0, docs/lifecycle.md), on plain clusters: the
lease file is trusted only as the last clean shutdown of this major wrote it. A corrupt lease
file, an older copy put back or another major's files are ignored with a LOG line, and the start
is a crash (held back, reclaimable), the pending counts of another major's file not applied; a
start that fails after shared memory is made leaves both files for the next start, which is
clean. (Split from test_lifecycle.py, whose clusters and helpers it uses.)
"""

import os
import re
import shutil
import subprocess

import pytest
from conftest import one
from pgcluster import wait_for
from test_leases import holders, lease
from test_lifecycle import (
    DB,
    JOURNAL_LAG,
    LEASE_FILE,
    assert_held_back,
    assert_logged_hold,
    assert_reclaims,
    held_back,
    held_lines,
    running,
    take,
    try_slot,
    wait_accepting,
    wait_journaled,
)


def test_a_corrupt_lease_file_is_ignored_and_the_start_treated_as_a_crash():
    with running("life_corrupt") as c:
        with c.connect(DB) as s:
            out = take(s, "jobs", 2, leases=1, ttl="1 min")
            assert try_slot(s, "sess", 1) == 0
            journaled = wait_journaled(s, "jobs", out.tokens, out.taken_at + JOURNAL_LAG)
        c.stop("fast")
        path = c.data / LEASE_FILE
        written = path.exists()
        size = path.stat().st_size if written else 0
        path.write_bytes((b"\xde\xad not a lease file \x00\xff" * 64)[:max(size, 64)])
        if os.geteuid() == 0:
            shutil.chown(path, "postgres", "postgres")
        path.chmod(0o600)
        since = len(c.log_text())
        c.start()
        wait_accepting(c)
        with c.connect(DB) as s:
            until = assert_held_back(s, out, "crash")
            assert journaled, "no stage_e_lease_horizon"
            assert_reclaims(s, out)
            assert try_slot(s, "sess", 1) == 0  # no live horizon: not held back
            logged = [line for line in c.log_text()[since:].splitlines()
                      if "LOG:  " in line and "stage_e_slots.leases" in line]
            assert logged, f"no LOG line about {LEASE_FILE}"
            assert_logged_hold(c, since, "jobs", "crash", until)
        assert written, f"no {LEASE_FILE} after the clean shutdown"


def failed_start(c):
    """A start that fails after shared memory is made: pg_hba.conf has a line the postmaster
    cannot load (it reads the file after making shared memory, before starting anything).
    The file is put back as it was. Returns the log text of the failed start."""
    hba = c.data / "pg_hba.conf"
    good = hba.read_text()
    hba.write_text(good + "local all all not_a_method\n")
    since = len(c.log_text())
    try:
        with pytest.raises(subprocess.CalledProcessError):
            c.start()
    finally:
        hba.write_text(good)
    wait_for(lambda: not (c.data / "postmaster.pid").exists(), timeout=30,
             what="the failed postmaster to exit")
    log = c.log_text()[since:]
    assert re.search(r"FATAL:  could not load \S*pg_hba.conf", log), log[-2000:]
    return log


def test_a_start_that_fails_after_shared_memory_is_made_loses_nothing():
    """Issue 35: a clean stop, then a start that fails after shared memory is made (a typo in
    pg_hba.conf), read and deleted the lease and pending files and wrote nothing back: the next
    good start lost the pending counts and treated the lease as after a crash. Now both files
    are there after the failed start, and the next start is clean: the lease is kept exactly,
    nothing is held back, and the counts reach the table."""
    # Counts stay pending until the shutdown writes them to the file (no flush before).
    with running("life_failed_start", {"stage_e_slots.flush_interval": "'1h'"}) as c:
        with c.connect(DB) as s:
            out = take(s, "jobs", 1, leases=1, ttl="10 min")
            for _ in range(2):
                assert one(s, "SELECT stage_e_release('sess', stage_e_try_slot('sess', 1))")
        c.stop("fast")
        failed_start(c)
        kept = {name: (c.data / "pg_stat" / name).exists()
                for name in ("stage_e_slots.leases", "stage_e_slots.pending")}
        since = start_stopped(c)
        with c.connect(DB) as s:
            got = [(h["slot"], h["token"], h["expires_at"]) for h in holders(s, "jobs")]
            assert got == out.leases, "the lease was not kept exactly"
            assert held_back(s) == []
            assert lease(s, "jobs", 1, "1 min") == (None, None)  # still full
            s.execute("SELECT stage_e_flush()")
            assert one(s, "SELECT acquired FROM stage_e_throttle_counter "
                          "WHERE cap = 'sess'") == 2, "the pending counts were lost"
        assert not held_lines(c.log_text()[since:], "jobs")
        assert kept == {"stage_e_slots.leases": True, "stage_e_slots.pending": True}, kept


def test_an_older_copy_of_the_lease_file_put_back_is_not_trusted():
    """Issue 35: an operator who put back an older copy of the lease file (a restore of
    pg_stat/) made a clean start forget a live lease whose durable horizon was still ahead, and
    its slot went to another session at once. The file now names the shutdown that wrote it:
    an older copy is ignored with a LOG line and the start is a crash (held back, reclaimable)."""
    with running("life_old_copy") as c:
        c.stop("fast")
        older = (c.data / LEASE_FILE).read_bytes()  # no lease in it
        c.start()
        wait_accepting(c)
        with c.connect(DB) as s:
            out = take(s, "jobs", 1, leases=1, ttl="2 min")
            journaled = wait_journaled(s, "jobs", out.tokens, out.taken_at + JOURNAL_LAG)
        c.stop("fast")
        (c.data / LEASE_FILE).write_bytes(older)
        since = start_stopped(c)
        with c.connect(DB) as s:
            until = assert_held_back(s, out, "crash", "an older lease file put back")
            assert journaled, "no stage_e_lease_horizon"
            assert_reclaims(s, out)
            assert_logged_hold(c, since, "jobs", "crash", until)
        assert re.search(r"LOG:  stage_e_slots: ignoring pg_stat/stage_e_slots.leases: it was "
                         r"written at the shutdown checkpoint \S+, not at the last clean "
                         r"shutdown's", c.log_text()[since:]), c.log_text()[since:][-2000:]


def start_stopped(c):
    """Starts a cluster that was stopped cleanly (no crash recovery: the control file says
    so) and waits for it. Returns the log offset of the start."""
    since = len(c.log_text())
    c.start()
    assert "not properly shut down" not in c.log_text()[since:]
    wait_accepting(c)
    return since


def test_files_from_another_major_are_ignored_with_a_log_line_never_trusted():
    """pg_stat/ files written by a server of another major version (or edited to look so):
    the lease file's leases are not restored (the start is a crash: the cap is held back from
    its durable horizon instead) and the pending counts are not applied, each with a LOG line."""
    # Counts stay pending until the shutdown writes them to the file (no flush before).
    with running("life_major", {"stage_e_slots.flush_interval": "'1h'"}) as c:
        with c.connect(DB) as s:
            out = take(s, "jobs", 2, leases=1, ttl="1 min")
            assert try_slot(s, "sess", 1) == 0  # a pending count for the file
            assert wait_journaled(s, "jobs", out.tokens, out.taken_at + JOURNAL_LAG)
        c.stop("fast")
        for name, old, new in [(LEASE_FILE, b"\nmajor ", b"\nmajor 1"),
                               ("pg_stat/stage_e_slots.pending", b"stage_e_slots major ",
                                b"stage_e_slots major 1")]:
            path = c.data / name
            text = path.read_bytes()
            assert old in text, (name, text[:80])
            path.write_bytes(text.replace(old, new, 1))  # major 15 -> 115, 18 -> 118
        since = len(c.log_text())
        c.start()
        wait_accepting(c)
        with c.connect(DB) as s:
            assert_held_back(s, out, "crash")
            log = c.log_text()[since:]
            for name in (LEASE_FILE, "pg_stat/stage_e_slots.pending"):
                assert re.search(rf"LOG:  stage_e_slots: ignoring {re.escape(name)}: it was "
                                 r"written by PostgreSQL 1\d\d", log), (name, log[-2000:])
            # The pending count of sess was not applied.
            assert one(s, "SELECT coalesce(sum(acquired), 0) FROM stage_e_throttle_totals "
                          "WHERE cap = 'sess'") == 0
            assert_reclaims(s, out)
