"""No role can make another role's cap name unusable by squatting its lock key (issue 21).

A cap's slot s is the advisory lock (key, s) with a 32-bit key, so a name whose key collides
with a victim's is found by brute force in seconds. Until 0.6.0 the name made second was refused
with 42710 while the other was in use, and making a colliding cap evicted the victim's idle
entry. Since 0.7.0 a collision is resolved: the later name takes the next key of its own probe
sequence, its counter row records it (`lock_key`), and it keeps it across reclaims, restarts,
a squatter arriving first, and dump/restore; `stage_e_cap_key` tells raw-lock users the key the
cap's locks really use. Each test fails on 0.6.0 (refused with 42710, or the key moved).

The squatting names below were found by brute force over `sq<n>`, as an attacker would."""

import pytest
from conftest import one
from pgcluster import Cluster

VICTIM = "exports"
# The victim's probe sequence (stage_e_core::directory::probe_key): its FNV key, then two more.
KEYS = (1_751_787_301, -1_155_795_468, 1_464_463_260)
# Names whose FNV key is the victim's i-th key.
SQUAT = ("sq4130751234", "sq918049272", "sq8468108422")


@pytest.fixture(scope="module")
def kc():
    c = Cluster("keys", {"stage_e_slots.flush_interval": "'200ms'"}).init().start()
    c.sql("CREATE ROLE mallory LOGIN")  # CONNECT only
    c.sql("CREATE ROLE alice LOGIN")
    yield c
    c.destroy()


def lock_of(conn, pid):
    """The (key, slot) advisory locks backend `pid` holds, from pg_locks."""
    return conn.execute(
        "SELECT classid::int, objid::int FROM pg_locks WHERE locktype = 'advisory' "
        "AND objsubid = 2 AND pid = %s AND granted ORDER BY 1, 2", (pid,)).fetchall()


def pid(conn):
    return one(conn, "SELECT pg_backend_pid()")


def flush(c, db):
    with c.connect(db) as s:
        s.execute("SELECT stage_e_flush()")


def recorded(c, db):
    return dict(c.sql("SELECT cap, lock_key FROM stage_e_throttle_counter", dbname=db))


def test_the_squatting_names_collide_as_claimed(kc):
    kc.create_database("check")
    with kc.connect("check") as s:
        assert one(s, "SELECT stage_e_cap_key(%s)", (VICTIM,)) == KEYS[0]
        for i, name in enumerate(SQUAT):
            assert one(s, "SELECT stage_e_cap_key(%s)", (name,)) == KEYS[i]


def test_a_squatter_on_a_names_key_moves_it_to_its_next_key_instead_of_refusing_it(kc):
    """The issue's attack: a CONNECT-only role leases a name colliding with `exports`; the
    victim's role then gets a slot of `exports` all the same, on its second key, and raw-lock
    users asking `stage_e_cap_key` are told that key."""
    kc.create_database("squat")
    with kc.connect("squat", user="mallory") as m, kc.connect("squat", user="alice") as a, \
            kc.connect("squat") as observer:
        lease = m.execute("SELECT * FROM stage_e_lease(%s, 1, '1 day')", (SQUAT[0],)).fetchone()
        assert lease[0] == 0
        assert one(a, "SELECT stage_e_cap_key(%s)", (VICTIM,)) == KEYS[1]
        assert one(a, "SELECT stage_e_try_slot(%s, 1)", (VICTIM,)) == 0
        assert lock_of(observer, pid(a)) == [(KEYS[1], 0)]
        # The raw path agrees: slot 0's lock is taken, slot 1's is free.
        assert one(observer, "SELECT pg_try_advisory_lock(stage_e_cap_key(%s), 0)",
                   (VICTIM,)) is False
        assert one(observer, "SELECT pg_try_advisory_lock(stage_e_cap_key(%s), 1)",
                   (VICTIM,)) is True
        observer.execute("SELECT pg_advisory_unlock_all()")
        # The cap binds: n = 1 is taken.
        assert one(observer, "SELECT stage_e_try_slot(%s, 1)", (VICTIM,)) is None
        assert observer.execute("SELECT cap, slot FROM stage_e_slot_holders ORDER BY cap"
                                ).fetchall() == [(VICTIM, 0), (SQUAT[0], 0)]
        assert one(a, "SELECT stage_e_holding(%s, 0)", (VICTIM,)) is True
        assert one(a, "SELECT stage_e_slot_token(%s, 0)", (VICTIM,)) is not None
        assert one(a, "SELECT stage_e_release(%s, 0)", (VICTIM,)) is True
        assert one(a, "SELECT stage_e_release_all(%s)", (SQUAT[0],)) == 0
        assert one(m, "SELECT stage_e_release_lease(%s, 0, %s::bigint)",
                   (SQUAT[0], lease[1])) is True
    flush(kc, "squat")
    assert recorded(kc, "squat") == {SQUAT[0]: KEYS[0], VICTIM: KEYS[1]}


def test_a_names_key_outlives_a_restart_even_when_the_squatter_comes_first(kc):
    """After a restart nothing is in shared memory: `exports`, now made before the squatter, keeps
    the key its row records rather than taking back its first key (which the squatter's row
    records), and the squatter keeps its own."""
    kc.stop()
    kc.start()
    with kc.connect("squat", user="alice") as a, kc.connect("squat", user="mallory") as m, \
            kc.connect("squat") as observer:
        assert one(observer, "SELECT count(*) FROM stage_e_stats()") == 0
        assert one(a, "SELECT stage_e_try_slot(%s, 1)", (VICTIM,)) == 0
        assert one(m, "SELECT stage_e_try_slot(%s, 1)", (SQUAT[0],)) == 0
        assert lock_of(observer, pid(a)) == [(KEYS[1], 0)]
        assert lock_of(observer, pid(m)) == [(KEYS[0], 0)]
        assert one(observer, "SELECT stage_e_cap_key(%s)", (VICTIM,)) == KEYS[1]


def test_a_squatter_made_after_the_name_takes_another_key_and_evicts_nothing(kc):
    """`exports` is in use first (its first key), then idle: a squatter made now gets a key of
    its own, the idle `exports` entry stays, and `exports` is used again on its key. (0.6.0
    evicted the idle entry, then refused `exports` with 42710.)"""
    kc.create_database("late")
    with kc.connect("late", user="alice") as a, kc.connect("late", user="mallory") as m, \
            kc.connect("late") as observer:
        assert one(a, "SELECT stage_e_try_slot(%s, 1)", (VICTIM,)) == 0
        assert one(a, "SELECT stage_e_release(%s, 0)", (VICTIM,)) is True
        observer.execute("SELECT stage_e_flush()")
        assert one(m, "SELECT stage_e_try_slot(%s, 1)", (SQUAT[0],)) == 0
        (squat_key, _), = lock_of(observer, pid(m))
        assert squat_key not in (KEYS[0],)
        assert squat_key == one(observer, "SELECT stage_e_cap_key(%s)", (SQUAT[0],))
        assert [r[0] for r in observer.execute("SELECT cap FROM stage_e_stats() ORDER BY cap")
                ] == [VICTIM, SQUAT[0]]
        assert one(a, "SELECT stage_e_try_slot(%s, 1)", (VICTIM,)) == 0
        assert lock_of(observer, pid(a)) == [(KEYS[0], 0)]


def test_squatters_on_a_names_first_keys_only_push_it_further(kc):
    """Squatting the victim's first two keys (two brute-forced names) moves it to its third; each
    key a squatter holds cost it a search, and the name always has a next one."""
    kc.create_database("chain")
    with kc.connect("chain", user="mallory") as m, kc.connect("chain", user="alice") as a, \
            kc.connect("chain") as observer:
        for name in SQUAT[:2]:
            assert one(m, "SELECT stage_e_try_slot(%s, 1)", (name,)) == 0
        assert one(a, "SELECT stage_e_cap_key(%s)", (VICTIM,)) == KEYS[2]
        assert one(a, "SELECT stage_e_try_slot(%s, 1)", (VICTIM,)) == 0
        assert lock_of(observer, pid(a)) == [(KEYS[2], 0)]
        assert lock_of(observer, pid(m)) == sorted([(KEYS[0], 0), (KEYS[1], 0)])


def test_the_squatters_row_alone_does_not_take_the_key(kc):
    """A squatter's cap that is gone but whose row records the victim's first key still keeps
    the victim off it: a later `exports` gets its next key, so that the squatter's recorded key
    stays true when it comes back."""
    kc.create_database("rows")
    with kc.connect("rows", user="mallory") as m:
        assert one(m, "SELECT stage_e_try_slot(%s, 1)", (SQUAT[0],)) == 0
        assert one(m, "SELECT stage_e_release(%s, 0)", (SQUAT[0],)) is True
    flush(kc, "rows")
    kc.stop()
    kc.start()  # the squatter's cap is gone; its row stays
    with kc.connect("rows", user="alice") as a, kc.connect("rows") as observer:
        assert one(a, "SELECT stage_e_try_slot(%s, 1)", (VICTIM,)) == 0
        assert lock_of(observer, pid(a)) == [(KEYS[1], 0)]
        assert one(observer, "SELECT stage_e_cap_key(%s)", (SQUAT[0],)) == KEYS[0]


def test_a_dump_keeps_the_keys(kc):
    """The rows, keys included, are in a dump: the restored database gives `exports` the key it
    had, even with the squatter made first."""
    out = kc._run("bash", "-o", "pipefail", "-c",
                  f"{kc.bin}/createdb -h {kc.base} -p {kc.port} -U postgres squatcopy && "
                  f"{kc.bin}/pg_dump -h {kc.base} -p {kc.port} -U postgres squat | "
                  f"{kc.bin}/psql -X -q -h {kc.base} -p {kc.port} -U postgres -1 "
                  f"-v ON_ERROR_STOP=1 -d squatcopy", check=False)
    assert out.returncode == 0, out.stderr
    assert recorded(kc, "squatcopy") == {SQUAT[0]: KEYS[0], VICTIM: KEYS[1]}
    with kc.connect("squatcopy", user="mallory") as m, \
            kc.connect("squatcopy", user="alice") as a, kc.connect("squatcopy") as observer:
        assert one(m, "SELECT stage_e_try_slot(%s, 1)", (SQUAT[0],)) == 0
        assert one(a, "SELECT stage_e_try_slot(%s, 1)", (VICTIM,)) == 0
        assert lock_of(observer, pid(a)) == [(KEYS[1], 0)]


def test_keys_survive_a_clean_restart_through_the_files_before_any_flush():
    """With no flush yet (a 1-hour interval), only the shutdown files know the keys: the lease
    and the pending counts of `exports` come back on its second key, beside the squatter."""
    c = Cluster("keys_files", {"stage_e_slots.flush_interval": "'1h'"}).init().start()
    try:
        c.create_database("app")
        with c.connect("app") as s, c.connect("app") as t:
            assert one(s, "SELECT stage_e_try_slot(%s, 1)", (SQUAT[0],)) == 0
            lease = t.execute("SELECT * FROM stage_e_lease(%s, 2, '1 hour')",
                              (VICTIM,)).fetchone()
            assert one(t, "SELECT stage_e_try_slot('counted', 1)") == 0
            assert lock_of(t, pid(s)) == [(KEYS[0], 0)]
        assert c.sql("SELECT count(*) FROM stage_e_throttle_counter", dbname="app") == [(0,)]
        c.stop()
        c.start()
        with c.connect("app") as s, c.connect("app") as observer:
            assert observer.execute("SELECT cap, slot, token FROM stage_e_slot_holders"
                                    ).fetchall() == [(VICTIM, 0, lease[1])]
            # Restored from the files: the squatter's counts and the lease's cap, each on its key.
            assert one(observer, "SELECT stage_e_cap_key(%s)", (VICTIM,)) == KEYS[1]
            assert one(observer, "SELECT stage_e_cap_key(%s)", (SQUAT[0],)) == KEYS[0]
            assert one(s, "SELECT stage_e_try_slot(%s, 2)", (VICTIM,)) == 1
            assert lock_of(observer, pid(s)) == [(KEYS[1], 1)]
            observer.execute("SELECT stage_e_flush()")
        assert dict(c.sql("SELECT cap, lock_key FROM stage_e_throttle_counter",
                          dbname="app")) == {SQUAT[0]: KEYS[0], VICTIM: KEYS[1],
                                             "counted": one_key(c, "counted")}
    finally:
        c.destroy()


def one_key(c, name):
    return c.sql("SELECT stage_e_cap_key(%s)", dbname="app", params=(name,))[0][0]
