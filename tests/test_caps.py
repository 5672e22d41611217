"""Named caps: independent slots and locks per name, the default cap, lock keys and their
collisions, name rules, growth, per-cap counters and rows, and caps at scale."""

import time

import psycopg
import pytest
from conftest import KEY, cap_locks, one, slot_lock_holders, stats
from pgcluster import Cluster, wait_for
from psycopg import errors

# Two names whose lock keys collide (found by search; src/directory.rs pins them too).
COLLIDING = ("c128898", "c153422")


def test_named_caps_have_their_own_slots_locks_and_counters(connect):
    a, b, c, observer = connect("a"), connect("b"), connect("c"), connect("observer")
    assert one(a, "SELECT stage_e_try_slot('exports', 2)") == 0
    assert one(b, "SELECT stage_e_try_slot('exports', 2)") == 1
    assert one(c, "SELECT stage_e_try_slot('exports', 2)") is None
    # Another cap is not throttled by the first one's holders.
    assert one(c, "SELECT stage_e_try_slot('dispatch', 2)") == 0
    assert cap_locks(observer, "exports") == [(0, a.info.backend_pid), (1, b.info.backend_pid)]
    assert cap_locks(observer, "dispatch") == [(0, c.info.backend_pid)]
    assert slot_lock_holders(observer) == []  # nothing on default's key
    rows = observer.execute("SELECT cap, held, acquired, throttled FROM stage_e_stats()"
                            ).fetchall()
    assert rows == [("dispatch", 1, 1, 0), ("exports", 2, 2, 1)]
    assert observer.execute("SELECT cap, slot, pid FROM stage_e_slot_holders").fetchall() == [
        ("dispatch", 0, c.info.backend_pid), ("exports", 0, a.info.backend_pid),
        ("exports", 1, b.info.backend_pid)]
    # Releases are per cap: slot 0 of dispatch is not slot 0 of exports.
    assert one(a, "SELECT stage_e_release('dispatch', 0)") is False
    assert one(a, "SELECT stage_e_holding('exports', 0)") is True
    assert one(c, "SELECT stage_e_release('dispatch', 0)") is True
    assert stats(observer, "dispatch")["foreign_releases"] == 1
    assert stats(observer, "exports")["foreign_releases"] == 0


def test_the_one_argument_forms_are_the_cap_named_default(connect):
    a, b, observer = connect("a"), connect("b"), connect("observer")
    assert one(a, "SELECT stage_e_try_slot(2)") == 0
    assert one(b, "SELECT stage_e_try_slot('default', 2)") == 1
    assert one(b, "SELECT stage_e_try_slot(2)") is None
    # Its slot s is the lock (lock_key, s), as in 0.1.0.
    assert slot_lock_holders(observer) == [(0, a.info.backend_pid), (1, b.info.backend_pid)]
    assert one(observer, "SELECT stage_e_cap_key('default')") == KEY
    assert one(a, "SELECT stage_e_holding('default', 0)") is True
    assert one(a, "SELECT stage_e_release('default', 0)") is True
    assert one(b, "SELECT stage_e_release(1)") is True
    assert stats(observer)["released"] == 2 and stats(observer)["throttled"] == 1


def test_a_caps_key_is_fixed_and_raw_locks_on_it_contend(connect):
    c, raw, observer = connect(), connect("raw"), connect("observer")
    # The same on every server and release (the 32-bit FNV-1a of the name, folded).
    assert one(c, "SELECT stage_e_cap_key('exports')") == 1_751_787_301
    assert one(c, "SELECT stage_e_cap_key('tenant:1')") == 655_409_628
    assert one(raw, "SELECT pg_try_advisory_lock(stage_e_cap_key('exports'), 0)") is True
    assert one(c, "SELECT stage_e_try_slot('exports', 2)") == 1
    assert one(c, "SELECT stage_e_try_slot('exports', 2)") is None
    rows = observer.execute("SELECT cap, slot, pid, acquired_at IS NULL FROM stage_e_slot_holders"
                            ).fetchall()
    assert rows == [("exports", 0, raw.info.backend_pid, True),
                    ("exports", 1, c.info.backend_pid, False)]
    assert one(observer, "SELECT held FROM stage_e_stats() WHERE cap = 'exports'") == 2
    # And the extension's slot blocks a raw locker.
    assert one(raw, "SELECT pg_try_advisory_lock(stage_e_cap_key('exports'), 1)") is False


BAD_NAMES = [
    (None, errors.NullValueNotAllowed, "cap must not be NULL"),
    ("", errors.InvalidParameterValue, "cap name must not be empty"),
    ("x" * 64, errors.InvalidParameterValue, "cap name is too long (64 bytes)"),
    ("é" * 32, errors.InvalidParameterValue, "cap name is too long (64 bytes)"),
]
CALLS = ["SELECT stage_e_try_slot(%s, 2)", "SELECT stage_e_release(%s, 0)",
         "SELECT stage_e_holding(%s, 0)", "SELECT stage_e_release_all(%s)",
         "SELECT stage_e_cap_key(%s)", "SELECT stage_e_reset_stats(%s)"]


@pytest.mark.parametrize("name,error,message", BAD_NAMES)
def test_a_bad_cap_name_is_a_class_22_error_that_changes_nothing(connect, name, error, message):
    c, observer = connect(), connect("observer")
    assert one(c, "SELECT stage_e_try_slot('kept', 1)") == 0
    before = observer.execute("SELECT * FROM stage_e_stats()").fetchall()
    for call in CALLS:
        with pytest.raises(error) as err:
            c.execute(call, (name,))
        assert err.value.diag.sqlstate.startswith("22"), call
        assert message in err.value.diag.message_primary, call
        assert "1 to 63 bytes" in err.value.diag.message_detail, call
    assert observer.execute("SELECT * FROM stage_e_stats()").fetchall() == before
    assert one(observer, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'") == 1
    # 63 bytes is the longest name.
    assert one(c, "SELECT stage_e_try_slot(%s, 1)", ("x" * 63,)) == 0


def test_two_names_on_one_key_never_share_slots(connect):
    """Since 0.7.0 the name made second takes the next key of its own probe sequence (see
    tests/test_hardening_keys.py for the attacks); neither is refused, and their slots are
    distinct locks."""
    first, second = COLLIDING
    a, b = connect("a"), connect("b")
    key = one(a, "SELECT stage_e_cap_key(%s)", (first,))
    assert one(a, "SELECT stage_e_cap_key(%s)", (second,)) == key
    assert one(a, "SELECT stage_e_try_slot(%s, 1)", (first,)) == 0
    other = one(b, "SELECT stage_e_cap_key(%s)", (second,))
    assert other != key
    assert one(b, "SELECT stage_e_try_slot(%s, 1)", (second,)) == 0
    assert sorted(b.execute("SELECT classid::int, objid::int FROM pg_locks "
                            "WHERE locktype = 'advisory'").fetchall()) == sorted(
        [(key, 0), (other, 0)])
    assert b.execute("SELECT cap FROM stage_e_stats() ORDER BY cap").fetchall() == [
        (first,), (second,)]
    # Each release finds its own slot; neither frees the other's.
    assert one(b, "SELECT stage_e_release(%s, 0)", (first,)) is False
    assert one(b, "SELECT stage_e_release(%s, 0)", (second,)) is True
    assert one(a, "SELECT stage_e_release(%s, 0)", (first,)) is True


def test_a_name_on_the_default_key_takes_its_next_key():
    c = Cluster("key_default", {"stage_e_slots.lock_key": 1_751_787_301}).init().start()
    try:
        c.create_database("app")
        with c.connect("app") as s:
            assert one(s, "SELECT stage_e_try_slot('exports', 1)") == 0
            assert one(s, "SELECT stage_e_try_slot(1)") == 0
            assert sorted(s.execute("SELECT classid::int, objid::int FROM pg_locks "
                                    "WHERE locktype = 'advisory'").fetchall()) == [
                (-1_155_795_468, 0), (1_751_787_301, 0)]
            assert one(s, "SELECT stage_e_cap_key('exports')") == -1_155_795_468
    finally:
        c.destroy()


def test_release_all_of_one_cap_or_of_every_cap(connect):
    c, observer = connect(), connect("observer")
    for cap, n in [("a", 3), ("b", 2)]:
        for _ in range(n):
            assert one(c, "SELECT stage_e_try_slot(%s, 5)", (cap,)) is not None
    assert one(c, "SELECT stage_e_try_slot(4)") == 0
    assert one(c, "SELECT stage_e_release_all('a')") == 3
    assert cap_locks(observer, "a") == [] and len(cap_locks(observer, "b")) == 2
    assert one(c, "SELECT stage_e_release_all('nothing here')") == 0
    assert observer.execute("SELECT cap FROM stage_e_stats()").fetchall() == [
        ("a",), ("b",), ("default",)]  # releasing created no cap
    assert one(c, "SELECT stage_e_release_all()") == 3
    assert one(observer, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'") == 0
    assert stats(observer, "b")["released"] == 2 and stats(observer)["released"] == 1


def test_a_cap_used_with_a_larger_n_grows_and_its_holders_keep_their_slots(connect):
    holders = [connect(f"h{i}") for i in range(4)]
    observer = connect("observer")
    for i, h in enumerate(holders):
        assert one(h, "SELECT stage_e_try_slot('grows', 4)") == i
    assert one(observer, "SELECT stage_e_try_slot('grows', 4)") is None
    # n = 40 needs a larger block than n = 4 had: the cap moves, the holders stay.
    assert one(observer, "SELECT stage_e_try_slot('grows', 40)") == 4
    assert [s for s, _ in cap_locks(observer, "grows")] == [0, 1, 2, 3, 4]
    for i, h in enumerate(holders):
        assert one(h, "SELECT stage_e_holding('grows', %s)", (i,)) is True
    acquired = observer.execute("SELECT slot, acquired_at IS NOT NULL FROM stage_e_slot_holders "
                                "WHERE cap = 'grows'").fetchall()
    assert acquired == [(s, True) for s in range(5)]
    assert one(holders[1], "SELECT stage_e_release('grows', 1)") is True
    assert one(observer, "SELECT stage_e_try_slot('grows', 4)") == 1
    assert stats(observer, "grows")["acquired"] == 6 and stats(observer, "grows")["throttled"] == 1


def test_reset_of_one_cap_and_rows_per_cap(connect):
    c, other = connect(), connect("other")
    for cap in ["a", "b"]:
        assert one(other, "SELECT stage_e_try_slot(%s, 1)", (cap,)) == 0
        assert one(c, "SELECT stage_e_try_slot(%s, 1)", (cap,)) is None
    assert c.execute("SELECT cap, acquired, throttled, released, foreign_releases, released_by_exit FROM stage_e_flush() ORDER BY cap").fetchall() == [
        ("a", 1, 1, 0, 0, 0), ("b", 1, 1, 0, 0, 0)]
    c.execute("SELECT stage_e_reset_stats('a')")
    assert c.execute("SELECT cap, acquired, throttled FROM stage_e_throttle_counter ORDER BY cap"
                     ).fetchall() == [("a", 0, 0), ("b", 1, 1)]
    assert c.execute("SELECT cap, throttled FROM stage_e_throttle_totals ORDER BY cap"
                     ).fetchall() == [("a", 0), ("b", 1)]
    c.execute("SELECT stage_e_reset_stats()")
    assert c.execute("SELECT cap, acquired, throttled FROM stage_e_throttle_counter ORDER BY cap"
                     ).fetchall() == [("a", 0, 0), ("b", 0, 0)]


def test_one_flush_writes_only_the_caps_with_new_counts(connect):
    c, other = connect(), connect("other")
    for cap in ["a", "b", "c"]:
        assert one(other, "SELECT stage_e_try_slot(%s, 1)", (cap,)) == 0
    c.execute("SELECT stage_e_flush()")
    first = dict(c.execute("SELECT cap, flush_id FROM stage_e_throttle_counter").fetchall())
    assert len(set(first.values())) == 1  # one flush wrote all three rows
    assert one(c, "SELECT stage_e_try_slot('b', 1)") is None
    assert c.execute("SELECT cap FROM stage_e_flush()").fetchall() == [("b",)]
    second = dict(c.execute("SELECT cap, flush_id FROM stage_e_throttle_counter").fetchall())
    assert second["a"] == first["a"] and second["c"] == first["c"]
    assert second["b"] > first["b"]


def test_the_owner_may_delete_rows_of_caps_no_longer_used(connect):
    c = connect()
    assert one(c, "SELECT stage_e_try_slot('old', 1)") == 0
    assert one(c, "SELECT stage_e_release('old', 0)") is True
    c.execute("SELECT stage_e_flush()")
    c.execute("DELETE FROM stage_e_throttle_counter WHERE cap = 'old'")
    assert one(c, "SELECT acquired FROM stage_e_throttle_totals WHERE cap = 'old'") == 0
    # Used again, it starts a new row.
    assert one(c, "SELECT stage_e_try_slot('old', 1)") == 0
    c.execute("SELECT stage_e_flush()")
    assert c.execute("SELECT cap, acquired, released FROM stage_e_throttle_counter").fetchall() \
        == [("old", 1, 0)]


def test_a_thousand_caps_of_eight_fit_with_the_default_settings(connect):
    c, observer = connect(), connect("observer")
    got = one(c, "SELECT count(stage_e_try_slot('tenant:' || i, 8)) "
                 "FROM generate_series(1, 1000) AS i")
    assert got == 1000
    assert one(observer, "SELECT count(*) FROM stage_e_stats() WHERE held = 1") == 1000
    assert one(observer, "SELECT count(*) FROM stage_e_slot_holders") == 1000
    snap = one(observer, "SELECT stage_e_snapshot()")
    assert snap["memory"]["caps_in_use"] >= 1000 and snap["memory"]["max_caps"] == 4096
    # A thousand caps of up to 15 slots take a 256-byte block each.
    assert snap["memory"]["slot_pages"] - snap["memory"]["slot_pages_free"] >= 1000
    assert one(c, "SELECT stage_e_release_all()") == 1000


def test_a_rolling_set_of_keys_never_runs_out():
    """Many distinct per-tenant names over time, few in use at once: idle caps are reclaimed,
    so a small max_caps never refuses (the day of 100,000 names, 500 at once, compressed)."""
    c = Cluster("rolling", {"stage_e_slots.max_caps": 128,
                            "stage_e_slots.flush_interval": "'100ms'"}).init().start()
    try:
        c.create_database("app")
        names, window, held = 3000, 20, []
        with c.connect("app") as s:
            started = time.monotonic()
            for i in range(names):
                cap = f"tenant:{i}"
                assert one(s, "SELECT stage_e_try_slot(%s, 4)", (cap,)) == 0, cap
                held.append(cap)
                if len(held) > window:
                    assert one(s, "SELECT stage_e_release(%s, 0)", (held.pop(0),)) is True
                time.sleep(0.002)
            for cap in held:
                assert one(s, "SELECT stage_e_release(%s, 0)", (cap,)) is True
            elapsed = time.monotonic() - started
            # Every acquisition is counted exactly once, in the rows or still pending.
            wait_for(lambda: one(s, "SELECT sum(acquired) FROM stage_e_throttle_totals")
                     == names, timeout=10, what="all counts in the totals")
            assert one(s, "SELECT sum(released) FROM stage_e_throttle_totals") == names
            snap = one(s, "SELECT stage_e_snapshot()")
            assert snap["memory"]["caps_in_use"] <= 128
        print(f"\n{names} caps, {window} at once, in {elapsed:.1f}s with max_caps = 128")
    finally:
        c.destroy()


def test_caps_truly_in_use_beyond_max_caps_are_refused_then_fit_again():
    """With every entry truly in use, a new cap is refused (53400), after waiting a second for a
    flush round that could free one. Once a cap is released it is idle only when its counts
    are in its row; with a flush interval of an hour no timed round comes, so only the round a
    refused call asks for (shmem::request_flush) frees the entry, and the call waits for it."""
    c = Cluster("few_caps", {"stage_e_slots.max_caps": 16,
                             "stage_e_slots.flush_interval": "'1h'"}).init().start()
    try:
        c.create_database("app")
        with c.connect("app") as s, c.connect("app") as t:
            for i in range(16):
                assert one(s, "SELECT stage_e_try_slot(%s, 1)", (f"k{i}",)) == 0
            started = time.monotonic()
            with pytest.raises(errors.ConfigurationLimitExceeded) as err:
                t.execute("SELECT stage_e_try_slot('k16', 1)")
            refused_after = time.monotonic() - started
            assert err.value.diag.sqlstate == "53400"
            assert "stage_e_slots.max_caps" in err.value.diag.message_hint
            # Refused only after the room wait (1 s): nothing could free an entry meanwhile.
            assert refused_after >= 0.95, refused_after
            assert one(t, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                          "AND pid = pg_backend_pid()") == 0
            # Freed, k0 still has a count (its release) that is in no row: not idle yet.
            assert one(s, "SELECT stage_e_release('k0', 0)") is True
            started = time.monotonic()
            first = _try(t, "k16")
            took = time.monotonic() - started
            if first is None:
                # Only where the machine is too slow for the round to land within the room
                # wait: that call waited all of it, and a later one finds the room.
                assert took >= 0.95, took
                wait_for(lambda: _try(t, "k16") == 0, timeout=30,
                         what="room after a requested flush")
            else:
                assert first == 0
            # The requested round wrote k0's counts (no timed flush ran): that made it idle.
            assert c.sql("SELECT acquired, released FROM stage_e_throttle_counter "
                         "WHERE cap = 'k0'", dbname="app") == [(1, 1)]
            print(f"\nrefused after {refused_after:.2f} s; the first call after the release "
                  f"{'got the room' if first == 0 else 'was refused'} in {took:.2f} s")
    finally:
        c.destroy()


def test_full_slot_memory_is_53400_naming_the_setting_and_takes_nothing():
    """stage_e_slots.slot_memory bounds the slot blocks of all caps (256-byte pages; a cap of
    n = 1024 takes a 32 kB block). At its minimum, 64 kB, a cap of 4 and one of 1024 leave no
    32 kB block: a new cap of 1024 and growing the small one to 1024 are both ERROR 53400 whose
    DETAIL and HINT name the setting, and take nothing (no lock, no block, no cap); the cap
    that could not grow keeps its holder and works at its old n. Once the big cap is idle,
    its block serves the new one."""
    c = Cluster("slot_memory", {"stage_e_slots.slot_memory": "'64kB'",
                                "stage_e_slots.flush_interval": "'1h'"}).init().start()
    try:
        c.create_database("app")
        with c.connect("app") as s, c.connect("app") as t:
            def memory():
                m = one(s, "SELECT stage_e_snapshot()")["memory"]
                return m["slot_pages"], m["slot_pages_free"]

            assert memory() == (256, 256)
            assert one(s, "SELECT stage_e_try_slot('small', 4)") == 0
            assert one(s, "SELECT stage_e_try_slot('big0', 1024)") == 0
            assert memory() == (256, 127)  # 1 page and 128; no 128 contiguous pages are left
            for cap, n in [("big1", 1024), ("small", 1024)]:
                with pytest.raises(errors.ConfigurationLimitExceeded) as err:
                    t.execute("SELECT stage_e_try_slot(%s, %s)", (cap, n))
                d = err.value.diag
                assert d.sqlstate == "53400"
                assert d.message_primary == (
                    f'stage_e_slots has no room for {n} slots of cap "{cap}"')
                assert "stage_e_slots.slot_memory" in d.message_detail
                assert "stage_e_slots.slot_memory" in d.message_hint
                assert one(t, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                              "AND pid = pg_backend_pid()") == 0
                assert memory() == (256, 127)
            assert [r[0] for r in s.execute("SELECT cap FROM stage_e_stats() ORDER BY cap")
                    ] == ["big0", "small"]
            # The cap that could not grow is as it was: its holder keeps slot 0, n = 4 works.
            assert cap_locks(s, "small") == [(0, s.info.backend_pid)]
            assert one(t, "SELECT stage_e_try_slot('small', 4)") == 1
            # big0 idle (released, its counts in its row): its block serves big1.
            assert one(s, "SELECT stage_e_release('big0', 0)") is True
            s.execute("SELECT stage_e_flush()")
            assert one(t, "SELECT stage_e_try_slot('big1', 1024)") == 0
            assert memory() == (256, 127)
            assert one(s, "SELECT stage_e_release_all()") == 1
            assert one(t, "SELECT stage_e_release_all()") == 2
    finally:
        c.destroy()


def _try(conn, cap):
    try:
        return one(conn, "SELECT stage_e_try_slot(%s, 1)", (cap,))
    except psycopg.errors.ConfigurationLimitExceeded:
        return None
