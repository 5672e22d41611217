"""Rate limits against a wall clock that jumps (issue 37: "a clock that jumps grants nothing"),
on a real server whose wall clock the test steps while it runs.

The postmaster runs under libfaketime (Debian's `faketime`, installed here when missing and
we are root): LD_PRELOAD=libfaketime.so.1 with FAKETIME_TIMESTAMP_FILE naming a file this test
rewrites ("+0", "+1h", "-1h": an offset from the real time), FAKETIME_NO_CACHE=1 so that every
clock read of every backend sees the file as it is now, and FAKETIME_DONT_FAKE_MONOTONIC=1 so
that only the wall clocks step (gettimeofday, time, CLOCK_REALTIME: now(),
clock_timestamp(), GetCurrentTimestamp), as NTP or an operator would step them, while
CLOCK_MONOTONIC and CLOCK_BOOTTIME, which no step of the wall clock moves, stay real.
libfaketime 0.9.10 (src/libfaketime.c, clock_gettime) leaves CLOCK_MONOTONIC,
CLOCK_MONOTONIC_RAW, CLOCK_MONOTONIC_COARSE and CLOCK_BOOTTIME alone under that setting, and
without it fakes all of them (CLOCK_BOOTTIME too; checked with ctypes: +1h put BOOTTIME at the
wall clock's value): the test needs the setting to model the real clocks. Each test first
checks that the server's now() and clock_timestamp() are off the real time by the offset (so
faketime is active: if it is not, the test fails, it does not skip).

Each assertion fails on a build whose rate clock is the wall clock (checked by building one
with CLOCK_REALTIME in ffi::boottime_ns):
- a key spent, the wall clock stepped 1 h forward: still denied, retry_after as before (no
  burst granted);
- a key spent, the wall clock stepped 1 h back: allowed on time, and its retry_after not
  inflated by the hour;
- a cap with a rate policy (stage_e_rate_limit) spent, the wall clock stepped 1 h forward:
  stage_e_try_slot is still NULL, and pg_locks shows no slot held;
- a clean restart with the wall clock stepped 1 h forward while the server is down: the key
  is still spent (the same boot: the saved arrival times are on CLOCK_BOOTTIME, which ran on).
A reboot cannot be made here (/proc/sys/kernel/random/boot_id): across one, the time counted
is the lesser of the new boot's uptime and the wall clock's move, which stage_e_core's
RateFile::carried unit tests check (a wall clock stepped forward grants nothing there either).
"""

import os
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import cap_locks, one
from pgcluster import Cluster, wait_for

DB = "clock"
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
HOUR = 3600.0
# How far the server's wall clock may be from the offset written (the call's own time, and
# the real clocks of the test and the server read a few ms apart).
SLACK = 5.0


def ensure_libfaketime() -> Path:
    """libfaketime, installed from Debian's `faketime` package when missing and we are root (as
    `make bench-quick` installs valgrind); scripts/install-deps.sh lists it too."""
    if not LIBFAKETIME.exists() and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        apt = ["apt-get", "-o", "DPkg::Lock::Timeout=600", "install", "-y", "-qq", "faketime"]
        if subprocess.run(apt, check=False, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], env=env, check=True, capture_output=True)
            subprocess.run(apt, env=env, check=True, capture_output=True)
    if not LIBFAKETIME.exists():
        pytest.fail(f"{LIBFAKETIME} is missing: run scripts/install-deps.sh "
                    "(or apt-get install faketime)")
    return LIBFAKETIME


class Clock:
    """The wall clock of the server: an offset from the real time, in libfaketime's file."""

    def __init__(self, path: Path):
        self.path = path

    def set(self, offset: str) -> None:
        # Whole or not at all: a backend reading the file meanwhile must not see it empty.
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(offset + "\n")
        tmp.chmod(0o644)
        os.replace(tmp, self.path)

    def env(self) -> dict[str, str]:
        return {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME_TIMESTAMP_FILE": str(self.path),
                "FAKETIME_NO_CACHE": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


@pytest.fixture(scope="module")
def cc():
    ensure_libfaketime()
    c = Cluster("rate_clock", {"stage_e_slots.flush_interval": "'1h'"}).init()
    c.clock = Clock(c.base / "faketime.rc")
    c.clock.set("+0")
    try:
        c.start(env=c.clock.env())
        c.create_database(DB)
        yield c
    finally:
        c.destroy()


@pytest.fixture
def clock(cc):
    """The wall clock at the real time when the test starts, and put back after it."""
    cc.clock.set("+0")
    yield cc.clock
    cc.clock.set("+0")


def server_offset(conn) -> float:
    """How far the server's wall clock is from the real one, in seconds, as now() and
    clock_timestamp() both tell it (each statement is a transaction of its own: both are read
    now, by this session's backend)."""
    real_before = time.time()
    started, current = conn.execute(
        "SELECT extract(epoch FROM now())::float8, "
        "extract(epoch FROM clock_timestamp())::float8").fetchone()
    real_after = time.time()
    offsets = [t - (real_before + real_after) / 2 for t in (started, current)]
    assert abs(offsets[0] - offsets[1]) < SLACK, offsets
    return offsets[1]


def step(clock: Clock, conn, offset: str, seconds: float) -> None:
    """Sets the wall clock to `offset` from the real time and checks that the server, in this
    session, sees it: the proof that the server runs under libfaketime."""
    clock.set(offset)
    got = server_offset(conn)
    assert abs(got - seconds) < SLACK, (
        f"the server's wall clock is {got:+.1f} s from the real time, not {offset}: "
        "libfaketime is not active in the server")


def rate(conn, key, count, per, burst=1):
    return conn.execute("SELECT allowed, remaining, retry_after, reset_after "
                        "FROM stage_e_try_rate(%s, %s, %s::interval, %s)",
                        (key, count, per, burst)).fetchone()


def test_a_wall_clock_stepped_forward_grants_nothing(cc, clock):
    """1 per 10 s, burst 1: one allowed, the next denied. The wall clock steps 1 h forward:
    still denied, retry_after no longer than before (at most 10 s) and reset_after too; a key
    of burst 3 spent before the step is denied as well (no burst). A new key after the step
    gets its burst and no more."""
    with cc.connect(DB) as s:
        step(clock, s, "+0", 0)
        assert rate(s, "fwd", 1, "10 s")[0] is True
        assert [rate(s, "fwd3", 1, "10 s", 3)[0] for _ in range(3)] == [True] * 3
        before = rate(s, "fwd", 1, "10 s")
        assert before[0] is False and timedelta(0) < before[2] <= timedelta(seconds=10)
        assert rate(s, "fwd3", 1, "10 s", 3)[:2] == (False, 0)

        step(clock, s, "+1h", HOUR)
        after = rate(s, "fwd", 1, "10 s")
        assert after[0] is False, "a wall clock stepped 1 h forward granted the key a call"
        assert timedelta(0) < after[2] <= before[2], (before, after)
        assert after[3] <= timedelta(seconds=10), after
        assert rate(s, "fwd3", 1, "10 s", 3)[:2] == (False, 0), \
            "a wall clock stepped 1 h forward granted the key a burst"
        assert rate(s, "new", 1, "10 s", 2)[:2] == (True, 1)
        assert rate(s, "new", 1, "10 s", 2)[:2] == (True, 0)
        assert rate(s, "new", 1, "10 s", 2)[0] is False


def test_a_wall_clock_stepped_back_denies_nothing_extra(cc, clock):
    """1 per second: allowed, then denied with retry_after at most 1 s. The wall clock steps
    1 h back: still denied (the second is not over), retry_after no longer than before (not
    an hour more); polled, the key is allowed again 1 s after the first call, not later."""
    with cc.connect(DB) as s:
        step(clock, s, "+0", 0)
        start = time.monotonic()
        assert rate(s, "back", 1, "1 s")[0] is True
        first_done = time.monotonic()
        before = rate(s, "back", 1, "1 s")
        assert before[0] is False and timedelta(0) < before[2] <= timedelta(seconds=1)

        step(clock, s, "-1h", -HOUR)
        after = rate(s, "back", 1, "1 s")
        assert time.monotonic() - first_done < 0.9, "too slow a machine for a 1 s interval"
        assert after[0] is False
        assert timedelta(0) < after[2] <= before[2], (
            f"retry_after {after[2]} after the step back, {before[2]} before it", before, after)
        assert after[3] <= timedelta(seconds=1), after

        # Polled every 20 ms: allowed between 1 s after the first call and 1 s plus a poll
        # (and the machine's slack) after it.
        def allowed():
            polled = time.monotonic()
            return polled if rate(s, "back", 1, "1 s")[0] else None

        polled = wait_for(allowed, timeout=5, interval=0.02,
                          what="the key to be allowed after its second")
        done = time.monotonic()
        assert done - start >= 1.0, "allowed before its second was over"
        assert polled - first_done <= 1.5, (
            f"allowed {polled - first_done:.2f} s after the first call, not about 1 s: "
            "the step back held it")
        assert server_offset(s) < -HOUR + SLACK  # the wall clock is still an hour back


def test_a_rate_policy_on_a_cap_grants_nothing_when_the_wall_clock_steps_forward(cc, clock):
    """stage_e_rate_limit('c', 1, '10 s', 1), committed: one slot taken and released, the
    next call NULL. The wall clock steps 1 h forward: stage_e_try_slot('c', 4) is still NULL,
    pg_locks (another session) shows no slot of 'c' held, the view shows nothing remaining."""
    with cc.connect(DB, "admin") as admin, cc.connect(DB, "worker") as w:
        step(clock, w, "+0", 0)
        admin.execute("SELECT stage_e_rate_limit('c', 1, '10 s', 1)")
        slot = one(w, "SELECT stage_e_try_slot('c', 4)")
        assert slot is not None
        assert cap_locks(admin, "c") == [(slot, w.info.backend_pid)]
        assert one(w, "SELECT stage_e_release('c', %s)", (slot,)) is True
        assert one(w, "SELECT stage_e_try_slot('c', 4)") is None
        assert cap_locks(admin, "c") == []

        step(clock, w, "+1h", HOUR)
        assert one(w, "SELECT stage_e_try_slot('c', 4)") is None, \
            "a wall clock stepped 1 h forward granted a rate-limited slot"
        assert cap_locks(admin, "c") == [], "a slot of 'c' is held after the step"
        assert one(admin, "SELECT remaining FROM stage_e_rate_limits WHERE cap = 'c'") == 0
        assert one(admin, "SELECT rate_limited FROM stage_e_stats() WHERE cap = 'c'") == 2


def test_a_clean_restart_with_the_wall_clock_stepped_forward_keeps_the_key_spent(cc, clock):
    """1 a minute, burst 2, spent. A clean shutdown, the wall clock stepped 1 h forward while
    the server is down, a start: the key is still denied, its retry_after no longer than
    before the restart; a key never used has its burst."""
    with cc.connect(DB) as s:
        step(clock, s, "+0", 0)
        assert [rate(s, "kept", 1, "1 min", 2)[0] for _ in range(2)] == [True, True]
        before = rate(s, "kept", 1, "1 min", 2)
        assert before[0] is False
    cc.stop("fast")
    assert "saved" in cc.log_text() and "rate key(s)" in cc.log_text()
    clock.set("+1h")
    cc.start(env=clock.env())
    with cc.connect(DB) as s:
        step(clock, s, "+1h", HOUR)
        after = rate(s, "kept", 1, "1 min", 2)
        assert after[0] is False, \
            "a wall clock stepped 1 h forward across a clean restart granted the key a call"
        assert timedelta(0) < after[2] <= before[2], (before, after)
        assert after[3] > timedelta(seconds=60), after
        assert rate(s, "never", 1, "1 min", 2)[:2] == (True, 1)

