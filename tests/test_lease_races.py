"""Lease races (0.4.0): a 12-session stress run of leases and releases checked against a
client-side ledger, and grants, expiries and late releases racing the launcher's sweeps. The
helpers and the other lease tests are in test_leases.py."""

import re
import shutil
import subprocess
import threading
import time

import pytest
from conftest import one, stats
from pgcluster import Cluster, proc_state, wait_for
from test_leases import (
    LAUNCHER,
    freed_by,
    holders,
    launcher_paused,
    lease,
    release_lease,
    server_now,
    wait_past,
)


@pytest.fixture(scope="module")
def fast():
    """The launcher sweeps leases (and flushes) every 100 ms, the shortest interval."""
    c = Cluster("lease_races_fast", {"stage_e_slots.flush_interval": "'100ms'"}).init().start()
    yield c
    c.destroy()


# -- concurrency -------------------------------------------------------------------------------

def test_stress_twelve_sessions_lease_and_release_never_overlap(connect):
    threads, cycles = 12, 30
    sessions = [connect(f"stress-{i}") for i in range(threads)]
    observer = connect("observer")
    lock = threading.Lock()
    holding, overlaps, ledger, out_of_range, most, failures = {}, [], [], [], [0], []
    results = [None] * threads

    def work(i):
        c = sessions[i]
        nulls = released = 0
        try:
            for _ in range(cycles):
                called = time.monotonic()
                slot, token = lease(c, "stress", 3, "10 s", "5 s")
                got = time.monotonic()
                if slot is None:
                    nulls += 1
                    continue
                with lock:
                    if not 0 <= slot < 3:
                        out_of_range.append((slot, token))
                    if slot in holding:
                        overlaps.append((slot, holding[slot], token))
                    holding[slot] = token
                    most[0] = max(most[0], len(holding))
                time.sleep(0.001)  # the guarded work
                with lock:
                    del holding[slot]
                releasing = time.monotonic()
                ok = release_lease(c, "stress", slot, token)
                released += ok is True
                with lock:
                    ledger.append({"slot": slot, "token": token, "called": called, "got": got,
                                   "releasing": releasing})
            results[i] = (nulls, released)
        except Exception as e:  # noqa: BLE001 - fails the test below
            failures.append((i, repr(e)))

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    assert not [t for t in workers if t.is_alive()], "a worker did not finish"
    assert failures == []
    assert None not in results, "a worker failed"
    nulls = sum(r[0] for r in results)
    released = sum(r[1] for r in results)
    assert out_of_range == []
    assert overlaps == []
    assert 1 <= most[0] <= 3  # never more believed holders at once than n
    assert len(ledger) == threads * cycles and nulls == 0  # a 5 s wait always got a slot
    assert released == len(ledger)
    tokens = [e["token"] for e in ledger]
    assert len(set(tokens)) == len(tokens)
    # Per slot, in token order, each holder got the slot only after the one before it had
    # started to release it.
    for slot in range(3):
        seq = sorted((e for e in ledger if e["slot"] == slot), key=lambda e: e["token"])
        for prev, nxt in zip(seq, seq[1:]):
            assert prev["releasing"] < nxt["got"], (slot, prev, nxt)
    # An acquisition that started after another had returned has a larger token.
    for e in ledger:
        earlier = [x["token"] for x in ledger if x["got"] < e["called"]]
        assert not earlier or max(earlier) < e["token"]
    s = stats(observer, "stress")
    assert (s["acquired"], s["released"], s["throttled"]) == (len(ledger), released, nulls)
    assert (s["expired"], s["foreign_releases"], s["held"], s["wait_timeouts"]) == (0, 0, 0, 0)
    assert s["waits"] > 0  # there was contention: the waiting path was exercised
    assert holders(observer, "stress") == []
    assert one(observer, "SELECT count(*) FROM stage_e_slot_waiters") == 0


def test_a_lease_taken_by_a_waiter_woken_by_a_sweep_still_expires(fast):
    """The everyday form of the race below: a waiting stage_e_lease is woken when the launcher
    frees an expired lease, and takes that slot while the launcher's sweep goes on over the
    cap's other slots. Its lease must still come back once its own ttl has passed. (Whether the
    launcher or the waiter's own recheck frees the first lease is up to timing: a round where
    the waiter did it proves nothing, so it runs 20 rounds, and more until the expiry LOG lines
    show the launcher freeing the first lease in one of them, at most 60.)"""
    fast.create_database("sweep_wake")
    since = len(fast.log_text())
    with fast.connect("sweep_wake") as a, fast.connect("sweep_wake") as w, \
            fast.connect("sweep_wake") as p:
        launcher = one(p, LAUNCHER)
        # A cap of 1,024 slots: the sweep looks at all of them.
        assert one(p, "SELECT stage_e_try_slot('nat', 1024)") == 0
        assert one(p, "SELECT stage_e_release_all()") == 1
        freers = []  # per round, who freed the first lease: "launcher" or another pid
        for attempt in range(60):
            if attempt >= 20 and "launcher" in freers:
                break
            _, first = lease(a, "nat", 1, "50 ms")
            slot, token = lease(w, "nat", 1, "200 ms", "5 s")
            assert slot == 0
            expires = holders(p, "nat")[0]["expires_at"]
            wait_past(p, expires, margin=0.3)
            got = one(p, "SELECT stage_e_try_slot('nat', 1)")
            assert got == 0, (
                f"round {attempt}: the waiter's lease (token {token}) expired at {expires} "
                f"is still held at {server_now(p)}, and the acquisition was throttled")
            assert one(p, "SELECT stage_e_release('nat', 0)") is True
            # Both leases ended as expiries (each logged once, by whoever freed it).
            by = wait_for(lambda first=first, token=token:
                          freed_by(fast.log_text()[since:], "nat", first, token),
                          timeout=5, what=f"round {attempt}'s expiry LOG lines")
            assert by[token] in (launcher, p.info.backend_pid, w.info.backend_pid), by
            freers.append("launcher" if by[first] == launcher else by[first])
        s = stats(p, "nat")
        assert (s["expired"], s["held"]) == (2 * len(freers), 0)
        print(f"\n{len(freers)} rounds; the first lease freed by the launcher in "
              f"{freers.count('launcher')}, by the waiter in {freers.count(w.info.backend_pid)}")
        assert "launcher" in freers, "the launcher never freed the lease the waiter waited for"


def test_a_lease_taken_while_its_cap_is_being_swept_still_expires(tmp_path):
    """A lease started while another process sweeps the cap's expired leases, on a slot the
    sweep has already passed, must still be freed once its own ttl passes. gdb stops the
    launcher inside its sweep (at the expired lease of slot 5), a lease is taken on slot 0,
    and the sweep goes on. (gdb is installed by scripts/install-deps.sh; this needs the debug
    build `make test` installs, where end_lease is a symbol of its own.)"""
    assert shutil.which("gdb"), "gdb is missing: run scripts/install-deps.sh"
    c = Cluster("lease_sweep_race", {"stage_e_slots.flush_interval": "'200ms'"}).init().start()
    gdb = None
    try:
        c.create_database("app")
        with c.connect("app") as a, c.connect("app") as t:
            launcher = one(a, LAUNCHER)
            assert one(a, "SELECT stage_e_try_slots('race', 6, 5)") == [0, 1, 2, 3, 4]
            ready, hit, go = (tmp_path / n for n in ("ready", "hit", "go"))
            # gdb writes into a descriptor of its own: ours is closed once it has started.
            with open(tmp_path / "gdb.out", "w") as gdb_out:
                gdb = subprocess.Popen(
                    ["gdb", "-p", str(launcher), "-batch", "-nx",
                     "-ex",
                     "handle SIGUSR1 SIGUSR2 SIGHUP SIGPIPE SIGURG SIGALRM nostop noprint pass",
                     "-ex", "break stage_e_slots::shmem::Cap::end_lease",
                     "-ex", f"shell touch {ready}",
                     "-ex", "continue",
                     "-ex", f"shell touch {hit}",
                     "-ex", f"shell while [ ! -e {go} ]; do sleep 0.02; done",
                     "-ex", "delete", "-ex", "detach"],
                    stdout=gdb_out, stderr=subprocess.STDOUT)
            wait_for(ready.exists, timeout=120, what="gdb to attach")
            since = len(c.log_text())
            # The only lease: slot 5, expiring in 100 ms; then slots 0-4 are freed.
            five, five_token = lease(a, "race", 6, "100 ms")
            assert five == 5
            assert one(a, "SELECT stage_e_release_all()") == 5
            wait_for(hit.exists, timeout=30, what="the launcher's sweep to reach slot 5")
            # The race itself: the launcher is stopped inside end_lease (ptrace's "t"), its
            # sweep not done (the expiry of slot 5 is not logged yet), while slot 0 is leased.
            assert proc_state(launcher) == "t"
            slot, token = lease(t, "race", 6, "300 ms")  # behind the sweep
            assert slot == 0
            assert proc_state(launcher) == "t"
            assert freed_by(c.log_text()[since:], "race", five_token) is None
            go.touch()
            assert gdb.wait(30) == 0
            gdb = None
            assert re.search(r"Breakpoint 1, .*stage_e_slots::shmem::Cap::end_lease",
                             (tmp_path / "gdb.out").read_text())
            # The stopped sweep was the launcher's, ending slot 5's lease.
            assert wait_for(lambda: freed_by(c.log_text()[since:], "race", five_token),
                            timeout=10, what="slot 5's expiry LOG line")[five_token] == launcher
            expires = holders(a, "race")[0]["expires_at"]
            wait_past(a, expires, margin=0.2)
            # Expired, so the acquisition that would otherwise be throttled frees it.
            got = one(a, "SELECT stage_e_try_slot('race', 1)")
            assert got == 0, (
                f"the lease (token {token}) expired at {expires} is still held at "
                f"{server_now(a)}: {holders(a, 'race')}")
            # It ended as an expiry: logged (by this acquisition, or a sweep just before it)
            # and counted, with slot 5's.
            by = wait_for(lambda: freed_by(c.log_text()[since:], "race", token), timeout=10,
                          what="slot 0's expiry LOG line")
            assert by[token] in (launcher, a.info.backend_pid)
            assert stats(a, "race")["expired"] == 2
    finally:
        if gdb is not None:
            (tmp_path / "go").touch()
            try:
                gdb.wait(30)
            except subprocess.TimeoutExpired:
                gdb.kill()
        c.destroy()


def test_a_late_release_counts_the_same_whether_or_not_a_sweep_came_first(fast):
    """The same client action (a release by token after the ttl) counts one expiry and one
    foreign release, whether the release itself finds the lease expired or the launcher freed
    it before (helper-found: the counts used to depend on that race)."""
    fast.create_database("late_release")
    with fast.connect("late_release") as c, fast.connect("late_release") as other:
        with launcher_paused(other, cover=("late", 1)):
            first = lease(c, "late", 1, "100 ms")
            wait_past(c, holders(c, "late")[0]["expires_at"])
            assert release_lease(c, "late", *first) is False  # finds it expired
        second = lease(c, "late2", 1, "100 ms")
        wait_for(lambda: stats(c, "late2")["expired"] == 1, timeout=10,
                 what="the launcher to free the lease")
        assert release_lease(c, "late2", *second) is False  # the sweep came first
        a, b = stats(c, "late"), stats(c, "late2")
        assert (a["expired"], a["foreign_releases"], a["released"]) == (1, 1, 1)  # the cover
        assert (b["expired"], b["foreign_releases"], b["released"]) == (1, 1, 0)
