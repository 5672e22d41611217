"""Fair shares of one cap (issue 38), with real sessions against a real cluster and pg_locks as
the observer: a flood of one share does not hold back a later one, weights split the grants,
ceilings bind while the other shares take the rest (no slot idle while a usable waiter waits),
an idle share banks no credit, a waiter that times out, is cancelled or is terminated leaves its
share's accounting right (cancels and terminations amid hand-offs too), leases and session
slots count in one share, waiters that came before the cap had shares are served, policies are
transactional and survive a restart, and bad input is class 22."""

import random
import threading
import time

import psycopg
import pytest
from conftest import cap_locks, one, stats
from pgcluster import Cluster, wait_for
from psycopg import errors
from test_waiting import Waiter


def shares(conn, cap):
    """(share, held, waiting) of the cap's live shares, the unnamed one as None."""
    return conn.execute("SELECT share, held, waiting FROM stage_e_shares WHERE cap = %s "
                        "ORDER BY share NULLS FIRST", (cap,)).fetchall()


def waiting_in(conn, cap, share):
    return one(conn, "SELECT count(*) FROM stage_e_slot_waiters WHERE cap = %s "
                     "AND share IS NOT DISTINCT FROM %s", (cap, share))


def queue(connect, observer, cap, share, count, n, wait="60 s"):
    """`count` sessions waiting for a slot of `cap` (n) in `share`, queued one after the other
    (each seen in stage_e_slot_waiters before the next starts)."""
    ws = []
    for i in range(count):
        if share is None:  # a call in no share
            w = Waiter(connect(f"plain-{i}"), "SELECT stage_e_try_slot(%s, %s, %s)",
                       (cap, n, wait))
        else:
            w = Waiter(connect(f"{share}-{i}"), "SELECT stage_e_try_slot(%s, %s, %s, %s)",
                       (cap, n, wait, share))
        wait_for(lambda: waiting_in(observer, cap, share) == len(ws) + 1, timeout=5,
                 what=f"waiter {i} of {share} queued")
        ws.append(w)
    return ws


def served_next(ws_by_share, served):
    """The one waiter (of any share) that returned since `served` was taken."""
    def new():
        return [(s, w) for s, ws in ws_by_share.items() for w in ws
                if w.done.is_set() and w not in served]
    got = wait_for(new, timeout=10, what="a waiter to be served")
    assert len(got) == 1, got
    share, w = got[0]
    assert w.error is None, w.error
    served.append(w)
    return share, w


def test_a_flood_of_one_share_does_not_hold_back_a_later_one(connect):
    """n = 2, both held; share A queues 8 waiters, then share B's one waiter arrives. Releasing
    one slot at a time, B is served within the next 2 grants (in arrival order it would be
    the ninth); every grant is the lock manager's (pg_locks shows the holder)."""
    holder, observer = connect("holder"), connect("observer")
    assert one(holder, "SELECT stage_e_try_slots('flood', 2, 2)") == [0, 1]
    a = queue(connect, observer, "flood", "A", 8, 2)
    b = queue(connect, observer, "flood", "B", 1, 2)
    assert shares(observer, "flood") == [("A", 0, 8), ("B", 0, 1)]
    served, order = [], []
    # The holder's two slots, then each served waiter's own slot, one at a time.
    releases = [(holder, 0), (holder, 1)]
    while len(served) < 9:
        conn, slot = releases.pop(0)
        assert one(conn, "SELECT stage_e_release('flood', %s)", (slot,)) is True
        share, w = served_next({"A": a, "B": b}, served)
        order.append(share)
        assert (slot, w.pid) in cap_locks(observer, "flood")
        releases.append((w.conn, w.result))
    assert order.index("B") <= 1, order
    assert sorted(order) == ["A"] * 8 + ["B"]


def test_weights_one_to_three_split_the_grants_a_quarter_and_three_quarters(connect):
    """n = 1; shares A (weight 1) and B (weight 3) both kept backlogged by two sessions each
    that take, hold a moment and release in a loop: of 80 grants, B gets 75% within 3
    points (SFQ's bound is tighter: |W_A/1 - W_B/3| <= 1 + 1/3)."""
    admin = connect("admin")
    admin.execute("SELECT stage_e_share('w13', 'A', 1)")
    admin.execute("SELECT stage_e_share('w13', 'B', 3)")
    grants, lock, stop = [], threading.Lock(), threading.Event()

    def work(share):
        conn = connect(f"worker-{share}")
        while not stop.is_set():
            slot = one(conn, "SELECT stage_e_try_slot('w13', 1, '10 s', %s)", (share,))
            if slot is None:
                continue
            with lock:
                grants.append(share)
            time.sleep(0.005)
            assert one(conn, "SELECT stage_e_release('w13', %s)", (slot,)) is True

    threads = [threading.Thread(target=work, args=(s,)) for s in "AABB"]
    for t in threads:
        t.start()
    wait_for(lambda: len(grants) >= 84, timeout=60, what="84 grants")
    stop.set()
    for t in threads:
        t.join(timeout=20)
    counted = grants[4:84]  # past the start, when the shares were not yet all backlogged
    b = counted.count("B") / len(counted)
    assert 0.72 <= b <= 0.78, (b, "".join(counted))


def test_a_share_at_its_ceiling_is_passed_over_and_no_slot_stays_idle(connect):
    """n = 4; share H (max_slots 1) and share L each keep 3 sessions taking, holding and
    releasing. Sampled every 10 ms for 3 s (stage_e_slot_holders, stage_e_slot_waiters and
    pg_locks): H never holds more than 1; a slot free while a waiter that may use it waits (one
    of L, or of H under its ceiling) is only ever the instant of a hand-off, never 5 samples in
    a row (a missed wake-up would leave it for the waiter's 100 ms recheck)."""
    admin, observer = connect("admin"), connect("observer")
    admin.execute("SELECT stage_e_share('ceil', 'H', 1, 1)")
    stop, grants = threading.Event(), {"H": 0, "L": 0}

    def work(share):
        conn = connect(f"worker-{share}")
        while not stop.is_set():
            slot = one(conn, "SELECT stage_e_try_slot('ceil', 4, '10 s', %s)", (share,))
            if slot is not None:
                grants[share] += 1
                time.sleep(0.03)
                one(conn, "SELECT stage_e_release('ceil', %s)", (slot,))

    threads = [threading.Thread(target=work, args=(s,)) for s in "HHHLLL"]
    for t in threads:
        t.start()
    wait_for(lambda: grants["H"] + grants["L"] >= 20, timeout=30, what="20 grants")
    run, longest, samples = 0, 0, 0
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        held = dict(observer.execute("SELECT share, count(*) FROM stage_e_slot_holders "
                                     "WHERE cap = 'ceil' GROUP BY share").fetchall())
        waiting = dict(observer.execute(
            "SELECT share, count(*) FROM stage_e_slot_waiters WHERE cap = 'ceil' "
            "GROUP BY share").fetchall())
        locks = len(cap_locks(observer, "ceil"))
        assert held.get("H", 0) <= 1, held
        samples += 1
        usable = waiting.get("L", 0) > 0 or (waiting.get("H", 0) > 0 and held.get("H", 0) < 1)
        run = run + 1 if locks < 4 and usable else 0
        longest = max(longest, run)
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join(timeout=20)
    assert grants["L"] > grants["H"] > 0, grants
    assert samples > 50 and longest < 5, (longest, samples)


def test_a_waiting_call_whose_share_is_served_first_takes_a_free_slot_at_once(connect):
    """n = 2; share H (max_slots 1) holds a slot and has a waiter passed over at its ceiling,
    so slot 1 is free while the cap has a waiter. A call of share L that may wait 30 s goes in
    line at once (it does not ask first whether it may take) and, its share served first, is
    seated and takes slot 1 at once: pg_locks shows it holding slot 1 while H's waiter is
    still queued. It did not wait, so it is not counted as a wait (`waits`, and the wait
    histogram's count with it): only H's waiter is."""
    admin, observer = connect("admin"), connect("observer")
    admin.execute("SELECT stage_e_share('first', 'H', 1, 1)")
    holder = connect("H-holder")
    assert one(holder, "SELECT stage_e_try_slot('first', 2, '0', 'H')") == 0
    h = queue(connect, observer, "first", "H", 1, 2, "30 s")[0]
    wait_for(lambda: stats(observer, "first")["waits"] == 1, timeout=5,
             what="H's waiter counted as a wait once its first look did not take")
    started = time.monotonic()
    low = Waiter(connect("L"), "SELECT stage_e_try_slot('first', 2, '30 s', 'L')")
    assert low.wait(10).result == 1, low.error
    assert low.returned_at - started < 2, low.returned_at - started
    assert cap_locks(observer, "first") == [(0, holder.info.backend_pid), (1, low.pid)]
    assert waiting_in(observer, "first", "H") == 1 and not h.done.is_set()
    assert shares(observer, "first") == [("H", 1, 1), ("L", 1, 0)]
    counted = stats(observer, "first")
    assert (counted["acquired"], counted["waits"]) == (2, 1), counted
    assert one(holder, "SELECT stage_e_release('first', 0)") is True
    assert h.wait(10).result == 0
    counted = stats(observer, "first")
    assert (counted["acquired"], counted["waits"], counted["wait_timeouts"]) == (3, 1, 0)
    assert one(observer, "SELECT seconds_count FROM stage_e_histograms() "
                         "WHERE cap = 'first' AND metric = 'wait'") == 1


def test_an_idle_share_banks_no_credit(connect):
    """n = 1; share B is served alone for a while (B's backlog of 6), share A idle. When A's 3
    waiters come, A and B alternate (equal weights): A never takes 3 grants in a row for the
    time it was idle."""
    holder, observer = connect("holder"), connect("observer")
    assert one(holder, "SELECT stage_e_try_slot('idle', 1, '0', 'B')") == 0
    b = queue(connect, observer, "idle", "B", 6, 1)
    served, order, release = [], [], (holder, 0)
    # B alone: two grants.
    for _ in range(2):
        assert one(release[0], "SELECT stage_e_release('idle', %s)", release[1:]) is True
        share, w = served_next({"B": b}, served)
        order.append(share)
        release = (w.conn, w.result)
    a = queue(connect, observer, "idle", "A", 3, 1)
    while len(served) < 9:
        assert one(release[0], "SELECT stage_e_release('idle', %s)", release[1:]) is True
        share, w = served_next({"A": a, "B": b}, served)
        order.append(share)
        release = (w.conn, w.result)
    after = "".join(order[2:])
    assert "AAA" not in after and "AA" not in after[:4], order
    assert after.count("A") == 3


def test_waiters_that_time_out_are_cancelled_or_terminated_leave_their_share_right(connect):
    """n = 1 held by share H. A waiter of share A times out, one of B is cancelled, one of C
    is terminated: each share then shows no waiter and is forgotten (it held nothing), and the
    next waiter of A is served at the next release as if the others had never come."""
    holder, observer = connect("holder"), connect("observer")
    assert one(holder, "SELECT stage_e_try_slot('leave', 1, '0', 'H')") == 0
    t = Waiter(connect("A-timeout"), "SELECT stage_e_try_slot('leave', 1, '300 ms', 'A')")
    c = queue(connect, observer, "leave", "B", 1, 1)[0]
    k = queue(connect, observer, "leave", "C", 1, 1)[0]
    assert t.wait(10).result is None
    observer.execute("SELECT pg_cancel_backend(%s)", (c.pid,))
    assert isinstance(c.wait(10).error, errors.QueryCanceled)
    observer.execute("SELECT pg_terminate_backend(%s)", (k.pid,))
    assert k.wait(10).error is not None
    wait_for(lambda: shares(observer, "leave") == [("H", 1, 0)], timeout=10,
             what="only H left")
    a = queue(connect, observer, "leave", "A", 1, 1)[0]
    assert one(holder, "SELECT stage_e_release('leave', 0)") is True
    assert a.wait(10).result == 0
    assert cap_locks(observer, "leave") == [(0, a.pid)]
    assert shares(observer, "leave") == [("A", 1, 0)]


def test_leases_and_session_slots_count_in_one_share_and_every_end_gives_back(connect):
    """Share T has max_slots 2: a lease and a session slot in T fill it, a third call in T
    (either kind) gets NULL while another share takes; the lease's release and the session's
    end each give their slot back to T."""
    admin, s1, observer = connect("admin"), connect("s1"), connect("observer")
    admin.execute("SELECT stage_e_share('mix', 'T', 1, 2)")
    lease = s1.execute("SELECT * FROM stage_e_lease('mix', 4, '1 min', '0', 'T')").fetchone()
    assert one(s1, "SELECT stage_e_try_slot('mix', 4, '0', 'T')") == 1
    assert s1.execute("SELECT * FROM stage_e_lease('mix', 4, '1 min', '0', 'T')"
                      ).fetchone() == (None, None)
    assert one(admin, "SELECT stage_e_try_slot('mix', 4, '0', 'T')") is None
    assert one(admin, "SELECT stage_e_try_slot('mix', 4, '0', 'U')") == 2
    assert shares(observer, "mix") == [("T", 2, 0), ("U", 1, 0)]
    assert observer.execute("SELECT slot, share FROM stage_e_slot_holders WHERE cap = 'mix' "
                            "ORDER BY slot").fetchall() == [(0, "T"), (1, "T"), (2, "U")]
    assert one(admin, "SELECT stage_e_release_lease('mix', %s, %s)", lease) is True
    assert shares(observer, "mix") == [("T", 1, 0), ("U", 1, 0)]
    s1.close()  # its session slot ends with it
    wait_for(lambda: shares(observer, "mix") == [("U", 1, 0)], timeout=10,
             what="the session's end to give T's slot back")
    assert one(observer, "SELECT stage_e_try_slots('mix', 4, 2, '0', 'T')") == [0, 1]


def test_waiters_from_before_the_cap_had_shares_are_served(connect):
    """Two waiters queue on a cap without shares; then calls in shares come. The earlier
    waiters join the cap's unnamed share and are served in their turn, not starved."""
    holder, observer = connect("holder"), connect("observer")
    assert one(holder, "SELECT stage_e_try_slot('mixed', 1)") == 0
    plain = queue(connect, observer, "mixed", None, 2, 1)
    a = queue(connect, observer, "mixed", "A", 3, 1)
    served, order, release = [], [], (holder, 0)
    while len(served) < 5:
        assert one(release[0], "SELECT stage_e_release('mixed', %s)", release[1:]) is True
        share, w = served_next({"plain": plain, "A": a}, served)
        order.append(share)
        release = (w.conn, w.result)
    # The unnamed share's two waiters and A's three alternate from the first grant: neither
    # side is passed over twice in a row while the other waits.
    assert order.index("plain") <= 1 and order.count("plain") == 2, order
    assert "AAA" not in "".join(s[0] for s in order), order


def test_a_policy_binds_from_its_commit_in_every_session(connect):
    """A session that has read a cap's policies (a ceiling of 2 for '*') sees a new one from
    the commit that sets it, and not before: rolled back, nothing changes."""
    admin, user, observer = connect("admin"), connect("user"), connect("observer")
    admin.execute("SELECT stage_e_share('txn', '*', 1, 2)")
    take = "SELECT stage_e_try_slot('txn', 8, '0', %s)"
    assert [one(user, take, ("A",)) for _ in range(3)] == [0, 1, None]
    with admin.transaction():
        admin.execute("SELECT stage_e_share('txn', 'A', 1, 3)")
        assert one(user, take, ("A",)) is None  # not committed yet
    assert one(user, take, ("A",)) == 2  # committed: A's own row, 3
    assert one(user, take, ("A",)) is None
    try:
        with admin.transaction():
            admin.execute("SELECT stage_e_share('txn', 'A', 1, 8)")
            raise RuntimeError("roll back")
    except RuntimeError:
        pass
    assert one(user, take, ("A",)) is None  # rolled back: still 3
    assert observer.execute("SELECT share, max_slots FROM stage_e_share_policy "
                            "WHERE cap = 'txn' ORDER BY share").fetchall() == [("*", 2), ("A", 3)]


def test_a_policy_written_by_hand_binds_from_its_commit_in_every_session(cluster, connect):
    """The table's owner may write stage_e_share_policy itself, and a restore (pg_restore
    --data-only into a live database) fills it with COPY: a session that has read the cap's
    policies sees such a write from its commit, as it sees stage_e_share's (the table's
    trigger), and the server's log names it. Not committed, or rolled back, it changes
    nothing; stage_e_share's own write is logged once, as the call's."""
    admin, user = connect("admin"), connect("user")
    take = "SELECT stage_e_try_slot('byhand', 8, '0', 'A')"
    assert [one(user, take) for _ in range(2)] == [0, 1]  # read: no policy, no ceiling
    with admin.cursor().copy("COPY stage_e_share_policy FROM STDIN") as copy:
        copy.write_row(("byhand", "A", 1, 3))
    assert [one(user, take) for _ in range(2)] == [2, None]
    admin.execute("UPDATE stage_e_share_policy SET max_slots = 4 WHERE cap = 'byhand'")
    assert [one(user, take) for _ in range(2)] == [3, None]
    try:
        with admin.transaction():
            admin.execute("DELETE FROM stage_e_share_policy WHERE cap = 'byhand'")
            assert one(user, take) is None  # not committed yet
            raise RuntimeError("roll back")
    except RuntimeError:
        pass
    assert one(user, take) is None  # rolled back: still at most 4
    admin.execute("TRUNCATE stage_e_share_policy")
    assert one(user, take) == 4  # no ceiling again
    admin.execute("SELECT stage_e_share('byhand', 'B', 2)")
    log, dbname = cluster.log_text(), admin.info.dbname
    wrote = {op: log.count(f'of database "{dbname}" ({op}), not through stage_e_share')
             for op in ("INSERT", "UPDATE", "DELETE", "TRUNCATE")}
    # The COPY, the UPDATE and the TRUNCATE; not the DELETE (rolled back), nor the INSERT of
    # stage_e_share, whose own line says what it set.
    assert wrote == {"INSERT": 1, "UPDATE": 1, "DELETE": 0, "TRUNCATE": 1}, wrote
    assert log.count(f'share "B" of cap "byhand" of database "{dbname}" weight 2') == 1


def test_a_restored_dump_keeps_the_policies_and_they_bind(cluster, connect, db):
    """pg_dump | psql into a fresh database (the extension made by the dump's CREATE EXTENSION,
    the table's trigger with it, not from the dump): the policy rows come back, written by the
    restore's COPY, and bind there from the restore's commit."""
    admin = connect("admin")
    admin.execute("SELECT stage_e_share('dumped', '*', 1, 2)")
    admin.execute("SELECT stage_e_share('dumped', 'A', 3, 1)")
    rows = admin.execute("SELECT * FROM stage_e_share_policy ORDER BY share").fetchall()
    dst = cluster.create_database(db + "_copy", extension=False)
    conn = f"-h {cluster.base} -p {cluster.port} -U postgres"
    out = cluster._run("bash", "-o", "pipefail", "-c",
                       f"{cluster.bin}/pg_dump {conn} {db} | "
                       f"{cluster.bin}/psql -X -q {conn} -1 -v ON_ERROR_STOP=1 -d {dst}",
                       check=False)
    assert out.returncode == 0, out.stderr
    w = connect("w", dst)
    assert w.execute("SELECT * FROM stage_e_share_policy ORDER BY share").fetchall() == rows
    assert one(w, "SELECT count(*) FROM pg_trigger WHERE tgname = "
                  "'stage_e_share_policy_written'") == 1
    take = "SELECT stage_e_try_slot('dumped', 8, '0', %s)"
    assert [one(w, take, ("A",)) for _ in range(2)] == [0, None]  # A's own row: 1
    assert [one(w, take, ("B",)) for _ in range(3)] == [1, 2, None]  # '*': 2


def test_stage_e_share_is_restricted(cluster, connect):
    """A role that is not a superuser nor the owner may not set a share's policy (42501), and
    may use shares."""
    admin = connect("admin")
    admin.execute("DROP ROLE IF EXISTS share_user")
    admin.execute("CREATE ROLE share_user LOGIN")
    try:
        with cluster.connect(admin.info.dbname, "share_user", user="share_user") as c:
            with pytest.raises(errors.InsufficientPrivilege):
                c.execute("SELECT stage_e_share('r', 'A', 2)")
            c.rollback()
            assert one(c, "SELECT stage_e_try_slot('r', 1, '0', 'A')") == 0
    finally:
        admin.execute("DROP OWNED BY share_user")
        admin.execute("DROP ROLE share_user")


def test_a_policy_binds_roles_the_table_hides_it_from(cluster, connect, db):
    """A policy binds every role of the cap, whatever the table lets the calling role see: with
    row-level security showing each tenant role only its own share's rows, a tenant's share
    without a row of its own is still held to the cap's '*' ceiling; with SELECT on the table
    revoked from PUBLIC, a call in a share is still served, under its policy."""
    admin = connect("admin")
    admin.execute("DROP ROLE IF EXISTS tenant_t")
    admin.execute("CREATE ROLE tenant_t LOGIN")
    admin.execute("SELECT stage_e_share('hidden', '*', 1, 1)")
    admin.execute("SELECT stage_e_share('hidden', 'tenant_t', 1, 2)")
    admin.execute("SELECT stage_e_share('hidden', 'other', 1, 3)")
    admin.execute("ALTER TABLE stage_e_share_policy ENABLE ROW LEVEL SECURITY")
    admin.execute("CREATE POLICY own ON stage_e_share_policy USING (share = current_user)")
    take = "SELECT stage_e_try_slot('hidden', 8, '0', %s)"
    try:
        with cluster.connect(db, "tenant", user="tenant_t") as t:
            assert t.execute("SELECT share FROM stage_e_share_policy").fetchall() == [
                ("tenant_t",)]
            assert [one(t, take, ("tenant_t",)) for _ in range(3)] == [0, 1, None]
            assert [one(t, take, ("new",)) for _ in range(2)] == [2, None]  # '*': 1
            assert [one(t, take, ("other",)) for _ in range(4)] == [3, 4, 5, None]
        admin.execute("DROP POLICY own ON stage_e_share_policy")
        admin.execute("ALTER TABLE stage_e_share_policy DISABLE ROW LEVEL SECURITY")
        admin.execute("REVOKE SELECT ON stage_e_share_policy FROM PUBLIC")
        with cluster.connect(db, "tenant", user="tenant_t") as t:
            with pytest.raises(errors.InsufficientPrivilege):
                t.execute("SELECT share FROM stage_e_share_policy")
            t.rollback()
            assert [one(t, take, ("new",)) for _ in range(2)] == [0, None]
    finally:  # the table as the extension made it, for the module's later tests
        admin.execute("DROP POLICY IF EXISTS own ON stage_e_share_policy")
        admin.execute("ALTER TABLE stage_e_share_policy DISABLE ROW LEVEL SECURITY")
        admin.execute("GRANT SELECT ON stage_e_share_policy TO PUBLIC")
        admin.execute("DROP ROLE tenant_t")


def test_bad_share_input_is_class_22_and_changes_nothing(connect):
    c = connect()
    for call, params, code in [
        ("SELECT stage_e_try_slot('bad', 2, '0', %s)", ("",), "22023"),
        ("SELECT stage_e_try_slot('bad', 2, '0', %s)", ("x" * 64,), "22023"),
        ("SELECT stage_e_try_slot('bad', 2, '0', %s)", (None,), "22004"),
        ("SELECT stage_e_try_slots('bad', 4, 3, '0', %s)", ("capped",), "22023"),
        ("SELECT stage_e_share('bad', 'a', %s)", (0,), "22023"),
        ("SELECT stage_e_share('bad', 'a', %s)", (17,), "22023"),
        ("SELECT stage_e_share('bad', 'a', 1, %s)", (0,), "22023"),
        ("SELECT stage_e_share('bad', %s)", (None,), "22004"),
        ("SELECT stage_e_share('bad', %s)", ("",), "22023"),
    ]:
        if "capped" in params:
            c.execute("SELECT stage_e_share('bad', 'capped', 1, 2)")
        with pytest.raises(psycopg.Error) as err:
            c.execute(call, params)
        assert err.value.sqlstate == code, (call, params, err.value)
    assert c.execute("SELECT cap, share FROM stage_e_share_policy").fetchall() == [
        ("bad", "capped")]
    assert c.execute("SELECT * FROM stage_e_shares").fetchall() == []
    assert c.execute("SELECT * FROM stage_e_slot_holders").fetchall() == []


def test_a_lock_on_the_policy_table_holds_up_the_named_call_alone(connect):
    """A call in a named share reads its policy (by SPI, on a miss of its backend's cache)
    before admission pins its cap: a lock a DBA holds on stage_e_share_policy holds up that call
    only, and a grow of its cap, which waits for every pin to go, goes on. Before, the policy
    was read with the cap pinned, and the grow waited for the lock's holder."""
    admin, observer = connect("admin"), connect("observer")
    assert one(admin, "SELECT stage_e_try_slot('policy_locked', 2)") == 0  # the cap exists
    admin.execute("SELECT stage_e_release_all()")
    blocker = connect("blocker")
    blocker.execute("BEGIN")
    blocker.execute("LOCK TABLE stage_e_share_policy IN ACCESS EXCLUSIVE MODE")
    named = Waiter(connect("named"), "SELECT stage_e_try_slot(%s, %s, %s, %s)",
                   ("policy_locked", 2, "0", "tenant"))
    wait_for(lambda: one(observer, "SELECT count(*) FROM pg_locks WHERE NOT granted AND "
                                   "relation = 'stage_e_share_policy'::regclass") == 1,
             timeout=10, what="the named call to wait for the policy table's lock")
    grower = Waiter(connect("grower"), "SELECT stage_e_try_slot('policy_locked', 1000)")
    grower.wait(20)
    assert (grower.error, grower.result) == (None, 0), "the grow waited for the named call"
    assert not named.done.is_set()
    blocker.execute("ROLLBACK")
    named.wait()
    assert (named.error, named.result) == (None, 1)  # the grower holds slot 0
    assert shares(observer, "policy_locked") == [("tenant", 1, 0)]


def test_a_restart_keeps_weights_ceilings_and_the_shares_of_leases():
    """The policies are rows: after a restart, a share's ceiling and the '*' default bind
    again, read afresh by the new backends. Leases carried over a clean restart count in the
    shares they were taken in (the lease file says which): share 'big' (at most 2) keeps one
    lease, so it takes one more slot, not two; the unnamed share (at most 1, the '*' default)
    keeps its lease, so a call without a share gets NULL; and a restored lease's release gives
    its slot back to its share."""
    c = Cluster("shares_restart").init().start()
    try:
        c.create_database("r")
        c.sql("SELECT stage_e_share('jobs', '*', 1, 1)", dbname="r")
        c.sql("SELECT stage_e_share('jobs', 'big', 4, 2)", dbname="r")
        with c.connect("r") as s:
            big = s.execute("SELECT * FROM stage_e_lease('jobs', 8, '1 h', '0', 'big')"
                            ).fetchone()
            unnamed = s.execute("SELECT * FROM stage_e_lease('jobs', 8, '1 h')").fetchone()
            assert (big[0], unnamed[0]) == (0, 1)
            before = shares(s, "jobs")
            assert before == [(None, 1, 0), ("big", 1, 0)]
        c.stop()
        c.start()
        with c.connect("r") as s, c.connect("r") as observer:
            assert shares(observer, "jobs") == before, "the leases' shares after the restart"
            assert observer.execute("SELECT slot, share, token FROM stage_e_slot_holders "
                                    "WHERE cap = 'jobs' ORDER BY slot").fetchall() == [
                (0, "big", big[1]), (1, None, unnamed[1])]
            take = "SELECT stage_e_try_slot('jobs', 8, '0', %s)"
            assert one(s, "SELECT stage_e_try_slot('jobs', 8)") is None, "the unnamed share's 1"
            assert [one(s, take, ("big",)) for _ in range(2)] == [2, None]
            assert [one(s, take, ("small",)) for _ in range(2)] == [3, None]
            assert s.execute("SELECT share, weight, max_slots, held FROM stage_e_shares "
                             "WHERE cap = 'jobs' ORDER BY share NULLS FIRST").fetchall() == [
                (None, 1, 1, 1), ("big", 4, 2, 2), ("small", 1, 1, 1)]
            # pg_locks sees the session's slots (the leases are held by no session).
            assert [slot for slot, _ in cap_locks(observer, "jobs")] == [2, 3]
            assert one(s, "SELECT stage_e_release_lease('jobs', %s, %s)", big) is True
            assert one(s, take, ("big",)) == 0, "the restored lease's slot given back to 'big'"
            assert one(s, "SELECT stage_e_release_lease('jobs', %s, %s)", unnamed) is True
            assert one(s, "SELECT stage_e_try_slot('jobs', 8)") == 1
    finally:
        c.destroy()


def test_shares_divide_an_adaptive_limit_and_are_charged_by_a_rate(connect):
    """Composes: a cap pinned at 2 (stage_e_adapt(cap, 2, 2)) asked n = 8 gives its shares 2
    slots in all; a rate-limited cap (2 a minute) refuses a third acquisition whichever share
    asks, with slots free."""
    admin, observer = connect("admin"), connect("observer")
    admin.execute("SELECT stage_e_adapt('pinned', 2, 2)")
    take = "SELECT stage_e_try_slot(%s, 8, '0', %s)"
    wait_for(lambda: one(observer, "SELECT count(*) FROM stage_e_cap_limits") == 1,
             timeout=10, what="the adaptive policy")
    assert [one(admin, take, ("pinned", s)) for s in ("A", "B", "C")] == [0, 1, None]
    assert len(cap_locks(observer, "pinned")) == 2
    admin.execute("SELECT stage_e_rate_limit('rated', 2, '1 min', 2)")
    assert [one(admin, take, ("rated", s)) for s in ("A", "B", "C")] == [0, 1, None]
    assert one(observer, "SELECT rate_limited FROM stage_e_stats() WHERE cap = 'rated'") == 1
    assert shares(observer, "rated") == [("A", 1, 0), ("B", 1, 0)]


def test_cancels_and_terminations_amid_hand_offs_leave_every_share_right(connect, cluster, db):
    """An attack on the hand-off itself: 8 sessions take and release slots of a cap of n = 2
    in shares A (at most 1) and B, waiting, while an attacker cancels and terminates them at
    random, so some land between a waiter's take of its slot and the count of its grant.
    Sampled meanwhile, A never holds more than 1 and pg_locks never shows more than 2 slots;
    once every session has stopped, no share is left, no slot is held, and A and B each still
    take their slots."""
    admin, observer = connect("admin"), connect("observer")
    admin.execute("SELECT stage_e_share('churn', 'A', 1, 1)")
    stop = time.monotonic() + 4
    pids: dict[int, str] = {}
    lock = threading.Lock()

    def worker(i: int) -> None:
        share = "AB"[i % 2]
        while time.monotonic() < stop:
            try:
                with cluster.connect(db, f"churn-{i}") as c:
                    with lock:
                        pids[c.info.backend_pid] = share
                    while time.monotonic() < stop:
                        slot = one(c, "SELECT stage_e_try_slot('churn', 2, '1 s', %s)", (share,))
                        if slot is not None:
                            assert one(c, "SELECT stage_e_release('churn', %s)", (slot,)) is True
            except (errors.QueryCanceled, psycopg.OperationalError):
                continue  # the attacker's doing: a new session, the same share

    def attacker() -> None:
        rng, k = random.Random(38), 0
        while time.monotonic() < stop:
            with lock:
                victims = sorted(pids)
            if victims:
                k += 1
                f = "pg_terminate_backend" if k % 5 == 0 else "pg_cancel_backend"
                admin.execute(f"SELECT {f}(%s)", (rng.choice(victims),))
            time.sleep(rng.uniform(0.001, 0.02))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    threads.append(threading.Thread(target=attacker))
    for t in threads:
        t.start()
    most_a, most_locks, samples = 0, 0, 0
    while any(t.is_alive() for t in threads[:-1]):
        held = {s: h for s, h, _ in shares(observer, "churn")}
        most_a = max(most_a, held.get("A", 0))
        most_locks = max(most_locks, len(cap_locks(observer, "churn")))
        samples += 1
    for t in threads:
        t.join()
    assert samples > 10, samples
    assert (most_a, most_locks) <= (1, 2), (most_a, most_locks)
    wait_for(lambda: shares(observer, "churn") == [] and cap_locks(observer, "churn") == [],
             timeout=10, what="every share forgotten, every slot free")
    assert one(observer, "SELECT stage_e_try_slots('churn', 2, 1, '0', 'A')") == [0]
    assert one(observer, "SELECT stage_e_try_slots('churn', 2, 1, '0', 'A')") is None
    assert one(observer, "SELECT stage_e_try_slots('churn', 2, 1, '0', 'B')") == [1]
