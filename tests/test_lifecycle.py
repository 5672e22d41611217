"""Restarts, crashes and failovers (0.6.0, docs/lifecycle.md), on plain clusters.

A clean restart keeps every lease exactly (the lease file). After a crash (kill -9 of the
postmaster) or a promotion, every cap whose durable lease horizon is in the future is held back
until it: new grants are NULL (throttled), stage_e_held_back lists it with its reason, the
server logs it, and the holders of the journalled leases reclaim them by renewing with their
token; once the horizon passes, the cap hands out all n slots again. Tokens always continue
above every earlier one. stage_e_slots.recovery_hold also holds back caps used only with session
slots; a cap with no live horizon is never held back. An idle cap's horizon row is written
once, not over and over. The files in pg_stat/ and when they are trusted: test_lifecycle_files.py.

Each test runs its own cluster(s), with the 200 ms flusher and a 200 ms lease_horizon_margin so
that the holds (about ttl + margin + 10 s after the last grant) stay short.
"""

import os
import re
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

import psycopg
import pytest
from conftest import one, stats
from pgcluster import Cluster, wait_for
from psycopg import errors
from test_leases import (
    Call,
    Notices,
    children_of,
    hammer_until_free,
    holders,
    lease,
    proc_state,
    release_lease,
    renew,
    server_now,
    slot_token,
)

DB = "app"
MARGIN = timedelta(milliseconds=200)
SETTINGS = {
    "stage_e_slots.flush_interval": "'200ms'",
    "stage_e_slots.lease_horizon_margin": "'200ms'",
}
# Long enough for a lease to outlive the 2 s journal wait, the crash or promotion and the
# restart, so that its holder can still reclaim it; short enough to keep the hold (about
# LEASE_TTL + 10 s) short.
LEASE_TTL = "15 s"
RECLAIM_TTL = timedelta(seconds=3)  # well inside the loaded horizon: a reclaim needs no advance
JOURNAL_LAG = 2.0  # seconds between a grant and the crash: the journal is rewritten about 1/s
LEASE_FILE = "pg_stat/stage_e_slots.leases"
MADE_UP = 7_777_777  # added to a real token: a token nobody was ever given

HELD_LINE = re.compile(
    r'LOG:  stage_e_slots: cap "(?P<cap>[^"]+)" of database "(?P<db>[^"]+)" is held back '
    r'until (?P<until>.+?) \((?P<reason>[a-z_]+)\)')


# -- clusters --------------------------------------------------------------------------------

@contextmanager
def running(name, settings=None, port=5433):
    """A started cluster of its own with database DB; destroyed at the end, whatever happens."""
    c = Cluster(name, {**SETTINGS, **(settings or {})}, port=port)
    try:
        c.init().start()
        c.create_database(DB)
        yield c
    finally:
        c.destroy()


@contextmanager
def standby_of(primary, name, port=5434):
    """A streaming standby of `primary` (pg_basebackup -R), with the same stage_e_slots
    settings; destroyed at the end."""
    own = {k: v for k, v in primary.settings.items() if k.startswith("stage_e_slots.")}
    s = Cluster(name, own, port=port)
    try:
        # pg_basebackup's spread checkpoint would take minutes over the new database's pages.
        primary.sql("CHECKPOINT")
        s.start_as_standby_of(primary)
        with s.connect(DB) as conn:
            wait_for(lambda: one(conn, "SELECT pg_is_in_recovery()"), what="standby in recovery")
        yield s
    finally:
        s.destroy()


def wait_accepting(c, timeout=60):
    """Waits until `c` accepts connections to DB and is out of recovery."""
    def ok():
        try:
            with c.connect(DB) as s:
                return one(s, "SELECT NOT pg_is_in_recovery()")
        except psycopg.OperationalError:
            return False
    wait_for(ok, timeout=timeout, interval=0.1, what=f"cluster {c.name} to accept writes")


def clean_restart(c):
    """pg_ctl restart -m fast. Returns the log offset of the new start and whether the lease
    file was there while the server was down."""
    c.stop("fast")
    assert not (c.data / "postmaster.pid").exists(), "the fast shutdown did not complete"
    lease_file = (c.data / LEASE_FILE).exists()
    since = len(c.log_text())
    c.start()
    assert "not properly shut down" not in c.log_text()[since:]
    wait_accepting(c)
    return since, lease_file


def kill_postmaster(c):
    """kill -9 of the postmaster (the first line of postmaster.pid); returns once it and every
    child it had are gone (not just zombies: a new postmaster refuses a lock file whose pid
    exists). Nothing is removed from the data directory."""
    postmaster = int((c.data / "postmaster.pid").read_text().split()[0])
    family = [postmaster] + children_of(postmaster)
    assert len(family) > 1, "the postmaster has no children: is it running?"
    os.kill(postmaster, signal.SIGKILL)
    wait_for(lambda: all(proc_state(p) is None for p in family), timeout=60, interval=0.1,
             what=f"the postmaster {postmaster} and its children to be gone")
    assert (c.data / "postmaster.pid").exists()  # left as a crash leaves it


def crash_restart(c):
    """kill -9 of the postmaster, then a plain start on the same data directory (crash
    recovery). Returns (log offset of the new start, monotonic time the start began)."""
    kill_postmaster(c)
    since, started = len(c.log_text()), time.monotonic()
    c.start()
    assert "not properly shut down" in c.log_text()[since:], "the start was not a crash recovery"
    wait_accepting(c)
    return since, started


def backend_crash(c):
    """kill -9 of a backend: the postmaster resets shared memory (a crash reset, no new start).
    Returns the log offset before it."""
    since = len(c.log_text())
    victim = c.connect(DB, "victim")
    os.kill(victim.info.backend_pid, signal.SIGKILL)
    wait_for(lambda: "all server processes terminated; reinitializing" in c.log_text()[since:],
             timeout=30, what="the crash reset")
    victim.close()
    wait_accepting(c)
    return since


def immediate_restart(c):
    """pg_ctl stop -m immediate, then start: crash recovery. Returns the log offset."""
    c.stop("immediate")
    since = len(c.log_text())
    c.start()
    assert "not properly shut down" in c.log_text()[since:], "the start was not a crash recovery"
    wait_accepting(c)
    return since


def promote(standby):
    """pg_ctl promote (waiting for it). Returns (log offset before it, monotonic time it began)."""
    since, started = len(standby.log_text()), time.monotonic()
    standby._run(str(standby.bin / "pg_ctl"), "-D", str(standby.data), "-w", "promote")
    wait_accepting(standby)
    return since, started


def wait_replayed(primary_conn, standby_conn, timeout=30):
    """Waits until the standby has replayed everything the primary has written so far."""
    lsn = one(primary_conn, "SELECT pg_current_wal_lsn()::text")
    wait_for(lambda: one(standby_conn, "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,)),
             timeout=timeout, what=f"the standby to replay up to {lsn}")


# -- the durable state and the hold ----------------------------------------------------------

def journal(conn, cap):
    """The numbers in the cap's lease journal (stage_e_lease_horizon.leases: [[slot, token,
    expires_at_us], ...]) as a set, None while the cap has no row. Raises UndefinedTable where
    the database has no stage_e_lease_horizon."""
    row = conn.execute("SELECT leases::text FROM stage_e_lease_horizon WHERE cap = %s",
                       (cap,)).fetchone()
    return None if row is None else {int(x) for x in re.findall(r"\d+", row[0] or "")}


def wait_journaled(conn, cap, tokens, not_before=None, timeout=15):
    """Waits until the cap's journal lists every one of `tokens`, and (with `not_before`, a
    monotonic time) until then. True once they are there. False at once where the database has
    no stage_e_lease_horizon (0.5.0): the test asserts that only after its behavioural checks,
    so that 0.5.0 fails at the missing behaviour."""
    try:
        wait_for(lambda: (j := journal(conn, cap)) is not None and set(tokens) <= j,
                 timeout=timeout, interval=0.1, what=f"tokens {tokens} in the journal of {cap}")
    except errors.UndefinedTable:
        return False
    if not_before is not None:
        time.sleep(max(0.0, not_before - time.monotonic()))
    return True


def wait_horizon_passed(conn, cap, timeout=40):
    """Waits until the cap's durable horizon is in the past. True then; False at once where
    the database has no stage_e_lease_horizon (0.5.0), as wait_journaled."""
    def passed():
        h = one(conn, "SELECT horizon FROM stage_e_lease_horizon WHERE cap = %s", (cap,))
        return h is not None and h < server_now(conn)
    try:
        wait_for(passed, timeout=timeout, interval=0.2, what=f"the horizon of {cap} to pass")
    except errors.UndefinedTable:
        return False
    return True


def held_back(conn):
    """(cap, held_until, reason) of stage_e_held_back, by cap."""
    return conn.execute("SELECT cap, held_until, reason FROM stage_e_held_back "
                        "ORDER BY cap").fetchall()


def attempt(fn):
    """('ok', fn()) or ('error', 'SQLSTATE: message'): a check made now, asserted later."""
    try:
        return ("ok", fn())
    except psycopg.Error as e:
        return ("error", f"{e.diag.sqlstate}: {e.diag.message_primary}")


def try_slot(conn, cap, n, wait=None):
    if wait is None:
        return one(conn, "SELECT stage_e_try_slot(%s, %s::int)", (cap, n))
    return one(conn, "SELECT stage_e_try_slot(%s, %s::int, %s::interval)", (cap, n, wait))


def held_lines(text, cap):
    return [m for m in HELD_LINE.finditer(text) if m["cap"] == cap and m["db"] == DB]


def assert_logged_hold(c, since, cap, reason, until):
    """The server logged the hold of `cap` (of DB) after offset `since`: its reason, and the
    time it is held back until (the view's held_until, to the second)."""
    wait_for(lambda: held_lines(c.log_text()[since:], cap), timeout=10,
             what=f'the LOG line "cap "{cap}" ... is held back until ... ({reason})"')
    lines = held_lines(c.log_text()[since:], cap)
    assert [m["reason"] for m in lines] == [reason] * len(lines), [m[0] for m in lines]
    logged = datetime.fromisoformat(lines[0]["until"])
    assert abs(logged - until) < timedelta(seconds=1), (lines[0][0], until)


@dataclass
class Outstanding:
    """What a cap had out when the server restarted, crashed or was replaced."""
    cap: str
    n: int
    leases: list  # (slot, token, expires_at) of each lease, as stage_e_slot_holders showed it
    session: list  # (slot, token) of each session slot, held by the connection that took it
    taken_at: float  # monotonic time of the last grant

    @property
    def tokens(self):
        return [t for _, t, _ in self.leases] + [t for _, t in self.session]

    @property
    def latest_expiry(self):
        return max(e for _, _, e in self.leases)


def take(conn, cap, n, leases, ttl, session_slots=0):
    """`leases` leases of `cap` (slots 0, 1, ...), then `session_slots` session slots held by
    `conn` (the next slots)."""
    got = [lease(conn, cap, n, ttl) for _ in range(leases)]
    assert [s for s, _ in got] == list(range(leases)), got
    session = []
    for i in range(session_slots):
        slot = try_slot(conn, cap, n)
        assert slot == leases + i
        session.append((slot, slot_token(conn, cap, slot)))
    rows = {h["slot"]: h for h in holders(conn, cap)}
    assert [rows[s]["token"] for s, _ in got] == [t for _, t in got]
    return Outstanding(cap, n, [(s, t, rows[s]["expires_at"]) for s, t in got], session,
                       time.monotonic())


def assert_held_back(conn, out, reason, event=None):
    """`out.cap` is held back (and no other cap is): a new lease and a new session slot are
    NULL and counted as throttled, although the cap has free slots; stage_e_held_back lists it
    with `reason` and a held_until at least the latest expiry granted before + the margin.
    Returns held_until."""
    event = event or f"the {reason}"
    before = stats(conn, out.cap)["throttled"]
    got = lease(conn, out.cap, out.n, "5 s")
    assert got == (None, None), (
        f"cap {out.cap} is not held back after {event}: a new lease got {got}")
    slot = try_slot(conn, out.cap, out.n)
    assert slot is None, f"cap {out.cap} is not held back after {event}: got slot {slot}"
    assert stats(conn, out.cap)["throttled"] == before + 2
    rows = held_back(conn)
    assert [(cap, why) for cap, _, why in rows] == [(out.cap, reason)], (event, rows)
    until = rows[0][1]
    assert until >= out.latest_expiry + MARGIN, (until, out.latest_expiry)
    assert until > server_now(conn)
    return until


def assert_reclaims(conn, out):
    """The holder of the first lease reclaims it by renewing with its token: same slot and
    token, a new expiry. Then nothing else is admitted: a made-up token on that slot or on an
    unreclaimed lease's slot, and a session slot's token on its slot, renew nothing, and the
    holders are as they were, never more than n."""
    slot, token, expires = out.leases[0]
    now = server_now(conn)
    assert now < expires - timedelta(seconds=1), (
        f"the test was too slow: the lease to reclaim expires at {expires}, it is {now}")
    assert renew(conn, out.cap, slot, token, RECLAIM_TTL) is True, (
        f"the lease of slot {slot} (token {token}) could not be reclaimed")
    after = server_now(conn)
    [h] = [h for h in holders(conn, out.cap) if h["slot"] == slot]
    assert h["token"] == token
    assert now + RECLAIM_TTL <= h["expires_at"] <= after + RECLAIM_TTL, (now, h, after)
    rows = holders(conn, out.cap)
    assert renew(conn, out.cap, slot, token + MADE_UP, RECLAIM_TTL) is False
    for s, t, _ in out.leases[1:]:
        assert renew(conn, out.cap, s, t + MADE_UP, RECLAIM_TTL) is False
    for s, t in out.session:
        assert renew(conn, out.cap, s, t, RECLAIM_TTL) is False  # a session slot is no lease
    assert holders(conn, out.cap) == rows
    assert len(rows) <= out.n


def assert_hold_is_kept(conn, out):
    """While held back: a waiting lease or session slot waits out its wait and gets NULL, and
    bad input is still an error of class 22 (not a NULL, not counted as throttled)."""
    started = time.monotonic()
    assert lease(conn, out.cap, out.n, "5 s", "300 ms") == (None, None)
    assert try_slot(conn, out.cap, out.n, "300 ms") is None
    assert time.monotonic() - started >= 0.6
    slot, token, _ = out.leases[0]
    before = stats(conn, out.cap)
    for call, sqlstate in [
            (f"SELECT stage_e_lease('{out.cap}', 0, '1 s')", "22023"),
            (f"SELECT stage_e_lease('{out.cap}', {out.n}, '-1 s')", "22023"),
            (f"SELECT stage_e_try_slot('{out.cap}', 0)", "22023"),
            (f"SELECT stage_e_renew('{out.cap}', {slot}, NULL, '1 s')", "22004"),
            (f"SELECT stage_e_renew('{out.cap}', NULL, {token}, '1 s')", "22004"),
            (f"SELECT stage_e_release_lease('{out.cap}', -1, {token})", "22023")]:
        with pytest.raises(psycopg.Error) as err:
            conn.execute(call)
        assert err.value.diag.sqlstate == sqlstate, (call, err.value.diag.message_primary)
    after = stats(conn, out.cap)
    assert (after["throttled"], after["acquired"]) == (before["throttled"], before["acquired"])


def assert_hold_ends(c, out, until):
    """Until `until` every try is throttled; after it the cap hands out all n slots (the
    unreclaimed leases' slots too: their recorded expiry has passed) to a waiting lease, a
    session slot and a lease, and no more; nothing is held back; the unreclaimed leases' old
    tokens renew nothing; every new token is above every token granted before."""
    with c.connect(DB, "waiter") as w, c.connect(DB, "prober") as p, c.connect(DB) as q:
        waiter = Call(w, "SELECT slot, token FROM stage_e_lease(%s, %s::int, '30 s', '60 s')",
                      (out.cap, out.n))
        deadline = (until - server_now(p)).total_seconds() + 10
        slot, at, failed = hammer_until_free(p, out.cap, out.n, timeout=deadline)
        assert at >= until, f"a slot was handed out at {at}, before the hold's end {until}"
        assert failed and max(failed) < until + timedelta(seconds=1), (until, failed[-3:])
        waiter.wait(15)
        assert waiter.error is None and waiter.row[0] is not None, (waiter.error, waiter.row)
        [h] = [h for h in holders(q, out.cap) if h["token"] == waiter.row[1]]
        assert h["acquired_at"] >= until
        third = lease(q, out.cap, out.n, "30 s")
        assert third[0] is not None
        assert lease(q, out.cap, out.n, "30 s") == (None, None)  # all n are out
        assert try_slot(q, out.cap, out.n) is None
        assert sorted([slot, waiter.row[0], third[0]]) == list(range(out.n))
        assert held_back(q) == []
        for s, t, _ in out.leases[1:]:
            assert renew(q, out.cap, s, t, "5 s") is False  # its slot has a new holder
        assert len(holders(q, out.cap)) == out.n
        new = [waiter.row[1], third[1], slot_token(p, out.cap, slot)]
        assert min(new) > max(out.tokens), (new, out.tokens)


# -- 1. clean restart ------------------------------------------------------------------------

def test_a_clean_restart_keeps_every_lease_exactly():
    with running("life_clean") as c:
        with c.connect(DB) as s:
            jobs = take(s, "jobs", 1, leases=1, ttl="10 min")
            pool = take(s, "pool", 3, leases=2, ttl="10 min", session_slots=1)
            # Right after the grants: kept by the lease file, not by the journal.
            since, lease_file = clean_restart(c)
        with c.connect(DB) as s:
            for out in (jobs, pool):
                got = [(h["slot"], h["token"], h["expires_at"]) for h in holders(s, out.cap)]
                assert got == out.leases, f"the leases of {out.cap} were not kept exactly"
            # jobs is still full; pool's session slot went with its connection: one slot left.
            assert lease(s, "jobs", 1, "1 min") == (None, None)
            assert try_slot(s, "jobs", 1) is None
            extra = lease(s, "pool", 3, "1 min")
            assert extra[0] == 2 and extra[1] > max(pool.tokens)
            assert try_slot(s, "pool", 3) is None
            # The kept leases are leases: renewed and released by their tokens.
            slot, token, expires = jobs.leases[0]
            assert renew(s, "jobs", slot, token, "20 min") is True
            [h] = holders(s, "jobs")
            assert h["token"] == token and h["expires_at"] > expires
            for slot_, token_, _ in pool.leases:
                assert release_lease(s, "pool", slot_, token_) is True
            assert release_lease(s, "jobs", slot, token) is True
            after = lease(s, "jobs", 1, "1 min")
            assert after[0] == 0 and after[1] > token
            assert sorted([try_slot(s, "pool", 3), try_slot(s, "pool", 3)]) == [0, 1]
            assert held_back(s) == []
        assert not held_lines(c.log_text()[since:], "jobs")
        assert not held_lines(c.log_text()[since:], "pool")
        assert lease_file, f"no {LEASE_FILE} after the clean shutdown"


# -- 2. crash ----------------------------------------------------------------------------------

def test_after_a_crash_a_cap_with_live_leases_is_held_back_and_its_leases_reclaimed():
    with running("life_crash") as c:
        with c.connect(DB) as s:
            out = take(s, "jobs", 3, leases=2, ttl=LEASE_TTL, session_slots=1)
            journaled = wait_journaled(s, "jobs", [t for _, t, _ in out.leases],
                                       not_before=out.taken_at + JOURNAL_LAG)
            since, _ = crash_restart(c)  # the session slot dies with its connection
        with c.connect(DB) as s:
            until = assert_held_back(s, out, "crash")
            assert journaled, "no stage_e_lease_horizon"
            assert_reclaims(s, out)
            assert release_lease(s, "jobs", *out.leases[0][:2]) is True
            assert try_slot(s, "jobs", 3) is None  # a free slot, still held back
            assert_hold_is_kept(s, out)
            assert_logged_hold(c, since, "jobs", "crash", until)
        assert_hold_ends(c, out, until)


def test_a_lease_the_journal_had_not_recorded_is_lost_after_a_crash_false_and_a_warning():
    """The README: a lease granted within about a second before a crash may not be in the
    journal; its renewal is then false with a WARNING, and the holder knows it lost the slot.
    A journalled lease of the same cap is reclaimed. The journal row the crash left (durable,
    read after the restart) says which lease it missed. A cap's journal is rewritten at most once
    a second: a lease granted just after a rewrite and a crash at once miss it unless the
    processes outlive the killed postmaster that long, so each try uses a cap of its own, up to
    five."""
    with running("life_unjournalled") as c:
        for attempt in range(5):
            cap = f"unj{attempt}"
            with c.connect(DB) as s:
                out = take(s, cap, 3, leases=1, ttl=LEASE_TTL)
                # Just rewritten (polled every 100 ms): the next rewrite is a second away.
                wait_journaled(s, cap, [out.leases[0][1]])
                slot, token = lease(s, cap, 3, LEASE_TTL)
                crash_restart(c)
            with c.connect(DB) as s:
                if token not in journal(s, cap):
                    break
        else:
            pytest.fail("every try's lease was journalled before its crash")
        with c.connect(DB) as s:
            assert cap in [r[0] for r in held_back(s)]
            notices = Notices(s)
            assert renew(s, cap, slot, token, RECLAIM_TTL) is False
            said = notices.take()
            assert [n["severity"] for n in said] == ["WARNING"], said
            assert slot not in [h["slot"] for h in holders(s, cap)]
            assert renew(s, cap, *out.leases[0][:2], RECLAIM_TTL) is True
            assert notices.take() == []


def test_a_backend_crash_reset_and_an_immediate_stop_are_crashes_too():
    """The other crashes of the spec's table: a backend killed (the postmaster resets shared
    memory) and pg_ctl stop -m immediate. Each holds back the cap with reason 'crash' and lets
    its holder reclaim; a reclaimed lease is journalled again and survives the next crash."""
    with running("life_resets") as c:
        with c.connect(DB) as s:
            out = take(s, "jobs", 2, leases=1, ttl="1 min")
            journaled = wait_journaled(s, "jobs", out.tokens, out.taken_at + JOURNAL_LAG)
        for crash, event in [(backend_crash, "a backend crash and reset"),
                             (immediate_restart, "pg_ctl stop -m immediate")]:
            since = crash(c)
            with c.connect(DB) as s:
                until = assert_held_back(s, out, "crash", event)
                assert journaled, "no stage_e_lease_horizon"
                assert_reclaims(s, out)
                assert_logged_hold(c, since, "jobs", "crash", until)
                reclaimed = time.monotonic()
                # Renewed far enough to outlive the next crash, and journalled again.
                assert renew(s, "jobs", *out.leases[0][:2], "1 min") is True
                out.leases[0] = (*out.leases[0][:2], holders(s, "jobs")[0]["expires_at"])
                assert wait_journaled(s, "jobs", out.tokens, reclaimed + JOURNAL_LAG)


def test_after_a_crash_a_cap_is_held_back_for_its_live_leases_not_the_longest_ever():
    """Issue 35: a lease of 120 s taken and released at once, then a short lease kept renewed,
    held the whole cap back for about 120 s after a backend crash: the durable horizon stayed
    at the longest lease ever granted for as long as any lease was live. The flusher now brings
    it down to the leases that may be live (in a journal write it makes anyway): after the
    crash the cap is held back until the short lease's expiry plus the margin and one step
    (4 s), no longer, and no shorter."""
    ttl, step = timedelta(seconds=5), timedelta(seconds=4)
    with running("life_lowered") as c:
        with c.connect(DB) as s:
            assert release_lease(s, "jobs", *lease(s, "jobs", 2, "120 s")) is True
            [(slot, token)] = [lease(s, "jobs", 2, ttl)]

            def come_down():
                assert renew(s, "jobs", slot, token, ttl) is True
                h = one(s, "SELECT horizon FROM stage_e_lease_horizon WHERE cap = 'jobs'")
                return h is not None and h <= server_now(s) + ttl + MARGIN + step
            wait_for(come_down, timeout=15, interval=0.5,
                     what="the horizon of jobs to come down to its short lease")
            [h] = holders(s, "jobs")
            assert h["token"] == token
            assert wait_journaled(s, "jobs", [token])
            renewed_at = server_now(s)
            backend_crash(c)
        with c.connect(DB) as s:
            [(cap, until, why)] = held_back(s)
            assert (cap, why) == ("jobs", "crash")
            assert until >= h["expires_at"] + MARGIN, (until, h)
            print(f"\nheld back until {until - renewed_at} after the last renewal")
            latest = renewed_at + ttl + MARGIN + step + timedelta(seconds=1)
            assert until <= latest, (
                f"held back until {until}, {until - renewed_at} after the last renewal: longer "
                f"than the live lease's {ttl} plus the margin and a step")


def test_a_clean_restart_while_a_cap_is_held_back_keeps_the_hold():
    """Found with issue 35's item 2: after a crash a cap is held back until its durable
    horizon, since a lease the journal missed may still be live; a clean restart before then
    wrote a lease file without the hold, the next start trusted it as clean, and the cap handed
    out its free slots at once. The file now carries the hold (written once every database is
    loaded, so that every hold is known; until then the next start is a crash again): each
    restart holds the cap back until the same time, and its holder still reclaims."""
    with running("life_hold_kept") as c:
        with c.connect(DB) as s:
            out = take(s, "jobs", 2, leases=1, ttl="1 min")
            journaled = wait_journaled(s, "jobs", out.tokens, out.taken_at + JOURNAL_LAG)
        crash_restart(c)
        with c.connect(DB) as s:
            until = assert_held_back(s, out, "crash")
        # The shutdown carries the hold once every database is loaded (the launcher asks for
        # them all at the crash start): a restart or two.
        for _ in range(3):
            since, lease_file = clean_restart(c)
            with c.connect(DB) as s:
                assert assert_held_back(s, out, "crash", "a clean restart while held") == until
            if "restored 1 lease(s) and 1 hold(s)" in c.log_text()[since:]:
                break
        else:
            pytest.fail("no clean restart carried the hold in the lease file")
        with c.connect(DB) as s:
            assert journaled, "no stage_e_lease_horizon"
            assert_reclaims(s, out)
        assert lease_file


# -- 3. promotion ------------------------------------------------------------------------------

def test_after_a_promotion_a_cap_with_live_leases_is_held_back_and_reclaimed_there():
    with running("life_prom_primary") as primary, \
            standby_of(primary, "life_prom_standby") as standby:
        with primary.connect(DB) as p, standby.connect(DB) as s:
            out = take(p, "jobs", 3, leases=2, ttl=LEASE_TTL, session_slots=1)
            tokens = [t for _, t, _ in out.leases]
            journaled = wait_journaled(p, "jobs", tokens, not_before=out.taken_at + JOURNAL_LAG)
            wait_replayed(p, s)
            replayed = journaled and wait_journaled(s, "jobs", tokens)
            on_standby = attempt(lambda: s.execute("SELECT * FROM stage_e_held_back").fetchall())
            primary.stop("immediate")
        since, _ = promote(standby)
        with standby.connect(DB) as s:
            until = assert_held_back(s, out, "promotion")
            assert journaled and replayed, "no stage_e_lease_horizon"
            assert on_standby == ("ok", []), f"stage_e_held_back on the standby: {on_standby}"
            assert_reclaims(s, out)
            assert release_lease(s, "jobs", *out.leases[0][:2]) is True
            assert_hold_is_kept(s, out)
            assert_logged_hold(standby, since, "jobs", "promotion", until)
        assert_hold_ends(standby, out, until)


def test_a_standby_started_without_its_signal_file_is_a_crash_not_a_clean_start():
    """A standby shut down cleanly wrote an empty lease file, so starting its data directory
    without standby.signal (a primary made by hand instead of a promotion) was a clean start
    with no lease: the old primary's leases were forgotten at once. A standby's shutdown now
    writes no lease file, and that start is a crash: held back from the replicated horizons."""
    with running("life_sb_primary") as primary, \
            standby_of(primary, "life_sb_standby") as standby:
        with primary.connect(DB) as p, standby.connect(DB) as s:
            out = take(p, "jobs", 2, leases=1, ttl="1 min")
            journaled = wait_journaled(p, "jobs", out.tokens, out.taken_at + JOURNAL_LAG)
            wait_replayed(p, s)
            primary.stop("immediate")
        standby.stop("fast")
        written = (standby.data / LEASE_FILE).exists()
        (standby.data / "standby.signal").unlink()
        standby.start()
        wait_accepting(standby)
        with standby.connect(DB) as s:
            assert_held_back(s, out, "crash", "a standby started without standby.signal")
            assert journaled, "no stage_e_lease_horizon"
            assert_reclaims(s, out)
        assert not written, f"a standby's shutdown wrote {LEASE_FILE}"


# -- 4. recovery_hold --------------------------------------------------------------------------

def test_recovery_hold_holds_back_a_session_cap_with_a_counter_row_after_a_crash():
    hold = timedelta(seconds=3)
    with running("life_hold", {"stage_e_slots.recovery_hold": "'3s'"}) as c:
        with c.connect(DB) as s:
            assert try_slot(s, "sess", 2) == 0  # held at the crash
            s.execute("SELECT stage_e_flush()")
            assert one(s, "SELECT count(*) FROM stage_e_throttle_counter WHERE cap = 'sess'") == 1
            assert one(s, "SELECT count(*) FROM stage_e_throttle_counter "
                          "WHERE cap = 'fresh'") == 0
            killed_at = server_now(s)
            since, _ = crash_restart(c)
        with c.connect(DB) as s:
            first = server_now(s)
            start = one(s, "SELECT pg_postmaster_start_time()")
            got = try_slot(s, "sess", 2)
            assert got is None, (f"cap sess is not held back by recovery_hold: slot {got}, "
                                 f"{first - start} after the start")
            assert try_slot(s, "fresh", 1) == 0  # no counter row: not held back
            rows = held_back(s)
            assert [(cap, why) for cap, _, why in rows] == [("sess", "recovery_hold")], rows
            until = rows[0][1]
            slack = timedelta(seconds=1)
            assert killed_at + hold - slack <= until <= first + hold + slack, (
                killed_at, until, first)
            slot, at, failed = hammer_until_free(s, "sess", 2, timeout=10)
            assert slot == 0 and until <= at < until + timedelta(seconds=1), (until, at)
            assert failed
            assert held_back(s) == []
            assert_logged_hold(c, since, "sess", "recovery_hold", until)
            assert one(s, "SHOW stage_e_slots.recovery_hold") == "3s"
            # ALTER SYSTEM and a reload change it; back to the default, '0'.
            s.execute("ALTER SYSTEM SET stage_e_slots.recovery_hold = '5s'")
            s.execute("SELECT pg_reload_conf()")
            wait_for(lambda: one(s, "SHOW stage_e_slots.recovery_hold") == "5s",
                     what="recovery_hold = 5s after the reload")
            s.execute("ALTER SYSTEM RESET stage_e_slots.recovery_hold")
            del c.settings["stage_e_slots.recovery_hold"]
            c.write_settings()
            s.execute("SELECT pg_reload_conf()")
            wait_for(lambda: one(s, "SHOW stage_e_slots.recovery_hold") == "0",
                     what="recovery_hold back to its default after the reload")
            assert one(s, "SELECT boot_val FROM pg_settings "
                          "WHERE name = 'stage_e_slots.recovery_hold'") == "0"
            assert try_slot(s, "sess", 2) == 1  # held at the next crash
            s.execute("SELECT stage_e_flush()")
            crash_restart(c)
        with c.connect(DB) as s:
            assert try_slot(s, "sess", 2) == 0, "held back with recovery_hold = 0"
            assert held_back(s) == []


# -- 5. caps without live leases -----------------------------------------------------------------

FREE_CAPS = ["sessions", "released", "never"]  # n = 2 each


def grant_free_caps(conn, started, event, leases=False):
    """Each free cap grants on its first try (a session slot, then with `leases` a lease):
    nothing is held back. Prints the time from `started` to the first grant."""
    got, first = {}, {}
    for cap in FREE_CAPS:
        got[cap] = try_slot(conn, cap, 2)
        if got[cap] is not None:
            first.setdefault("grant", time.monotonic() - started)
    if leases:
        for cap in ["released", "never"]:
            got[f"{cap} lease"] = lease(conn, cap, 2, "30 s")[0]
            if got[f"{cap} lease"] is not None:
                first.setdefault("lease", time.monotonic() - started)
    print(f"\n{event}: " + ", ".join(f"first {k} {v:.3f} s" for k, v in first.items())
          + " after it began")
    assert got == {"sessions": 0, "released": 0, "never": 0,
                   **({"released lease": 1, "never lease": 1} if leases else {})}, (
        f"a cap without live leases was held back after the {event}")


def test_a_cap_without_live_leases_is_never_held_back_after_a_crash_or_a_promotion():
    with running("life_free_primary") as primary, \
            standby_of(primary, "life_free_standby") as standby:
        with primary.connect(DB) as p:
            assert release_lease(p, "released", *lease(p, "released", 2, "500 ms")) is True
            busy = take(p, "busy", 1, leases=1, ttl="1 min")  # the control: held back
            assert try_slot(p, "sessions", 2) == 0
            p.execute("SELECT stage_e_flush()")
            passed = wait_horizon_passed(p, "released")
            journaled = wait_journaled(p, "busy", busy.tokens, busy.taken_at + JOURNAL_LAG)
            _, started = crash_restart(primary)
        with primary.connect(DB) as p, standby.connect(DB) as s:
            grant_free_caps(p, started, "crash")
            assert lease(p, "busy", 1, "5 s") == (None, None), "busy is not held back"
            assert passed and journaled, "no stage_e_lease_horizon"
            assert [(cap, why) for cap, _, why in held_back(p)] == [("busy", "crash")]
            wait_replayed(p, s)
            assert wait_journaled(s, "busy", busy.tokens)
            assert held_back(s) == []
            primary.stop("immediate")
        _, started = promote(standby)
        with standby.connect(DB) as s:
            grant_free_caps(s, started, "promotion", leases=True)
            assert lease(s, "busy", 1, "5 s") == (None, None), "busy is not held back"
            assert [(cap, why) for cap, _, why in held_back(s)] == [("busy", "promotion")]


# -- 6. idle caps' rows ----------------------------------------------------------------------

def horizon_row_writes(conn):
    """Rows of stage_e_lease_horizon written so far, per the statistics (flushers report them
    as they exit)."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return one(conn, "SELECT coalesce(sum(n_tup_ins + n_tup_upd), 0) FROM pg_stat_all_tables "
                     "WHERE relname = 'stage_e_lease_horizon'")


def test_idle_caps_rows_are_written_once_not_over_and_over():
    """A cap used once with a session slot gets its row (its token floor) once; a cap whose
    lease ended gets its horizon brought down once: then nothing is written for either, however
    long they stay idle (a row written for its floor alone must not look like a horizon to bring
    down, every 2 s, forever)."""
    with running("life_idle") as c, c.connect(DB) as s:
        assert try_slot(s, "sess", 2) == 0
        assert one(s, "SELECT stage_e_release('sess', 0)") is True
        slot, token = lease(s, "gone", 1, "1 s")
        assert one(s, "SELECT stage_e_release_lease('gone', %s, %s)", (slot, token)) is True
        wait_for(lambda: one(s, "SELECT count(*) FROM stage_e_lease_horizon WHERE "
                                "cap = 'sess' OR (cap = 'gone' AND horizon <= now())") == 2,
                 timeout=30, interval=0.2, what="both rows written, gone's brought down")
        # The statistics of those writes (sess's row, gone's, gone's brought down) arrive
        # when the processes that wrote them report: at least these three, then the window.
        wait_for(lambda: horizon_row_writes(s) >= 3, timeout=30, interval=0.2,
                 what="the statistics of the rows' writes")
        before = horizon_row_writes(s)
        time.sleep(6)
        assert horizon_row_writes(s) == before


# -- 7. bad settings ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,default", [("stage_e_slots.recovery_hold", "0"),
                                          ("stage_e_slots.lease_horizon_margin", "2s")])
def test_a_bad_lifecycle_setting_is_refused_with_class_22(name, default):
    with running(f"life_bad_{name.split('.')[1]}",
                 {"stage_e_slots.lease_horizon_margin": None}) as c, c.connect(DB) as s:
        assert one(s, f"SHOW {name}") == default
        for bad in ["-1s", "-1", "-5 min", "soon"]:
            with pytest.raises(errors.InvalidParameterValue) as err:
                s.execute(f"ALTER SYSTEM SET {name} = '{bad}'")
            assert err.value.diag.sqlstate == "22023"
            # A session setting it: refused too (22023, or 55P02 if it is not a session's).
            for call in [f"SET {name} = '{bad}'",
                         f"SELECT set_config('{name}', '{bad}', false)"]:
                with pytest.raises(psycopg.Error) as err:
                    s.execute(call)
                assert err.value.diag.sqlstate in ("22023", "55P02"), call
        assert one(s, f"SHOW {name}") == default
        assert name not in (c.data / "postgresql.auto.conf").read_text()
