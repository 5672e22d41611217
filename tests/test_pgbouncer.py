"""Slots through PgBouncer (Debian's 1.18): in transaction mode a release can run on another
server connection, which the extension detects but cannot undo; in session mode take and
release stay on one backend. Leases (0.4.0) are held by a token, not a server connection, so
they work through a transaction pooler: take, work and release may each run on another
backend, and a holder that dies loses its lease after the TTL, never before."""

import random
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from conftest import one, stats, wait_for
from pgbouncer import PgBouncer

CAP = "pooled"
# The LOG line of an expiry, with the log_line_prefix ('%m [%p] %a: ') pid of who freed it.
EXPIRY = re.compile(
    r"\[(?P<by>\d+)\] [^\n]*LOG:  stage_e_slots: lease of slot (?P<slot>\d+) of cap "
    r"\"(?P<cap>[^\"]+)\" \(token (?P<token>\d+), taken by pid (?P<pid>\d+)\) expired")


def notice(d):
    """Copies a notice's fields: psycopg's Diagnostic is only valid inside the handler."""
    return {"severity": d.severity, "message": d.message_primary, "detail": d.message_detail,
            "hint": d.message_hint}


def slot_locks(conn, cap=CAP):
    """(slot, pid, granted) of the cap's advisory locks in conn's database, from pg_locks."""
    return conn.execute(
        "SELECT objid::int, pid, granted FROM pg_locks WHERE locktype = 'advisory' "
        "AND classid = stage_e_cap_key(%s)::oid AND objsubid = 2 AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database()) ORDER BY 1, 2",
        (cap,)).fetchall()


def client_closes(bouncer, db):
    """How many clients of database db PgBouncer logged as disconnected."""
    return sum(1 for line in bouncer.log_text().splitlines()
               if f" {db}/postgres@" in line and "closing because: client close request" in line)


class ClosingPgBouncer(PgBouncer):
    """A PgBouncer that closes the client connections it opened when it stops."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.clients = []

    def connect(self, *args, **kw):
        conn = super().connect(*args, **kw)
        self.clients.append(conn)
        return conn

    def stop(self, *args, **kw):
        for conn in self.clients:
            conn.close()
        super().stop(*args, **kw)


@pytest.fixture
def pooler(cluster):
    """Starts PgBouncers in front of the test cluster; stops them all at the end, whatever
    happened."""
    started = []

    def _start(pool_mode, pool_size):
        started.append(ClosingPgBouncer(cluster, pool_mode=pool_mode, pool_size=pool_size))
        return started[-1].start()

    yield _start
    for bouncer in started:
        bouncer.stop()


def test_transaction_pooling_release_on_another_backend_is_detected_and_orphans_the_slot(
        cluster, db, pooler):
    bouncer = pooler("transaction", pool_size=2)
    direct = cluster.connect(db, "observer")
    try:
        a = bouncer.connect(db, application_name="client-a")
        slot, pid_a = a.execute(
            f"SELECT stage_e_try_slot('{CAP}', 2), pg_backend_pid()").fetchone()
        assert slot == 0
        assert slot_locks(direct) == [(0, pid_a, True)]

        # B and C each hold a server connection in an open transaction: the pool's two
        # connections are busy, and one of them is the backend that holds A's slot.
        b = bouncer.connect(db, autocommit=False, application_name="client-b")
        c = bouncer.connect(db, autocommit=False, application_name="client-c")
        pid_b = one(b, "SELECT pg_backend_pid()")
        pid_c = one(c, "SELECT pg_backend_pid()")
        assert pid_b != pid_c
        assert pid_a in (pid_b, pid_c)
        holder_tx, other_tx = (b, c) if pid_b == pid_a else (c, b)
        other_pid = pid_c if pid_b == pid_a else pid_b

        # Free the other backend only: A's next statement can only run there.
        other_tx.commit()
        before = stats(direct, CAP)
        notices = []
        a.add_notice_handler(lambda d: notices.append(notice(d)))
        released, pid_release = a.execute(
            f"SELECT stage_e_release('{CAP}', 0), pg_backend_pid()").fetchone()
        assert pid_release == other_pid != pid_a
        assert released is False
        assert len(notices) == 1
        n = notices[0]
        assert n["severity"] == "WARNING"
        assert n["message"] == f'slot 0 of cap "{CAP}" was not held by this connection'
        assert n["detail"] == f'Slot 0 of cap "{CAP}" is held by pid {pid_a}; it keeps the slot.'
        assert "session-level lock" in n["hint"]
        after = stats(direct, CAP)
        assert after["foreign_releases"] - before["foreign_releases"] == 1
        assert after["released"] == before["released"]
        assert after["held"] == 1

        # The slot is orphaned: held by a server connection no client is using, and ending the
        # transaction that runs there does not free it (a session lock outlives transactions).
        assert slot_locks(direct) == [(0, pid_a, True)]
        holder_tx.commit()
        assert slot_locks(direct) == [(0, pid_a, True)]
        assert one(direct, f"SELECT stage_e_try_slot('{CAP}', 1)") is None
        # Nor does the disconnect of the client that took it (or of anyone): the server
        # connection goes back to the pool as it is.
        for client in (a, b, c):
            client.close()
        wait_for(lambda: client_closes(bouncer, db) == 3,
                 what="PgBouncer to log the three clients' disconnects")
        assert slot_locks(direct) == [(0, pid_a, True)]

        # Only the end of that server connection frees it: stopping the pooler closes it.
        released_by_exit = after["released_by_exit"]
        since = len(cluster.log_text())
        bouncer.stop()
        wait_for(lambda: slot_locks(direct) == [], timeout=10,
                 what="the pooler's server connections to end")
        wait_for(lambda: stats(direct, CAP)["released_by_exit"] == released_by_exit + 1,
                 timeout=5, what="the exit to be counted")
        line = re.compile(rf'backend pid {pid_a} \(application_name "[^"]*"\) exited holding '
                          rf'slot\(s\) 0 of cap "{CAP}"; released')
        wait_for(lambda: line.search(cluster.log_text()[since:]), timeout=5,
                 what="the exit LOG line")
        assert one(direct, f"SELECT stage_e_try_slot('{CAP}', 1)") == 0
    finally:
        direct.close()


def test_session_pooling_keeps_take_and_release_on_one_backend(cluster, db, pooler):
    bouncer = pooler("session", pool_size=2)
    direct = cluster.connect(db, "observer")
    try:
        worker = bouncer.connect(db, application_name="worker")
        other = bouncer.connect(db, autocommit=False, application_name="other")
        slot, pid_take = worker.execute(
            f"SELECT stage_e_try_slot('{CAP}', 2), pg_backend_pid()").fetchone()
        assert slot == 0
        # Another client busy in a transaction meanwhile uses its own server connection.
        assert one(other, "SELECT pg_backend_pid()") != pid_take
        assert slot_locks(direct) == [(0, pid_take, True)]
        before = stats(direct, CAP)
        notices = []
        worker.add_notice_handler(lambda d: notices.append(notice(d)))
        released, pid_release = worker.execute(
            f"SELECT stage_e_release('{CAP}', 0), pg_backend_pid()").fetchone()
        assert pid_release == pid_take
        assert released is True
        assert notices == []
        after = stats(direct, CAP)
        assert after["released"] - before["released"] == 1
        assert after["foreign_releases"] == before["foreign_releases"]
        assert slot_locks(direct) == []
        other.commit()

        # A client that disconnects holding a slot frees it too: PgBouncer runs its
        # server_reset_query (DISCARD ALL) before the server connection serves anyone else.
        slot, pid_take = worker.execute(
            f"SELECT stage_e_try_slot('{CAP}', 2), pg_backend_pid()").fetchone()
        assert slot == 0 and slot_locks(direct) == [(0, pid_take, True)]
        released = stats(direct, CAP)["released"]
        since = len(cluster.log_text())
        worker.close()
        wait_for(lambda: slot_locks(direct) == [], timeout=10,
                 what="PgBouncer's DISCARD ALL to drop the slot's lock")
        # The backend stays in the pool; the extension clears the slot at the end of the
        # DISCARD ALL and says so (after the slot is free again).
        line = (f'slot 0 of cap "{CAP}" of pid {pid_take} was released outside '
                "stage_e_release")
        wait_for(lambda: line in cluster.log_text()[since:], timeout=5, what="the LOG line")
        assert one(direct, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                   (pid_take,)) == 1
        assert stats(direct, CAP)["released"] == released + 1
        assert one(direct, f"SELECT stage_e_try_slot('{CAP}', 1)") == 0
    finally:
        direct.close()


# -- leases through a transaction pooler -----------------------------------------------------

LEASE = "SELECT l.slot, l.token, pg_backend_pid() FROM stage_e_lease(%s, %s, %s) AS l"
RELEASE_LEASE = "SELECT stage_e_release_lease(%s, %s, %s), pg_backend_pid()"


def lease_holders(conn, cap):
    """(slot, pid, token, acquired_at, expires_at) of the cap's rows of stage_e_slot_holders."""
    return conn.execute(
        "SELECT slot, pid, token, acquired_at, expires_at FROM stage_e_slot_holders "
        "WHERE cap = %s ORDER BY slot", (cap,)).fetchall()


def most_at_once(intervals):
    """The most of the (start, end) intervals in progress at any one instant. An end sorts
    before a start at the same instant: a region's start is read after its lease came back and
    its end before its release is sent, so a slot handed over never makes a real tie."""
    events = sorted([(start, 1) for start, end in intervals]
                    + [(end, -1) for start, end in intervals],
                    key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def test_leases_through_a_transaction_pooler_keep_the_cap_under_stress(cluster, db, pooler):
    """16 clients over 4 server connections, cap n=3: a client-side ledger of the regions
    between lease and release never has more than 3 at once, nor two on one slot, and the
    extension's counters match what the clients saw, one for one."""
    cap, n, clients, cycles = "bounce", 3, 16, 25
    bouncer = pooler("transaction", pool_size=4)
    direct = cluster.connect(db, "observer")  # straight to the cluster, not through the pooler
    conns = []
    try:
        before = stats(direct, cap)
        conns = [bouncer.connect(db, application_name=f"leaser-{i}") for i in range(clients)]
        barrier = threading.Barrier(clients)
        lock = threading.Lock()
        regions = []        # (start, end, slot, token, lease_pid, release_pid, released)
        throttled = [0] * clients
        errors = []

        def client(i):
            conn = conns[i]
            try:
                barrier.wait(timeout=60)
                for _ in range(cycles):
                    slot, token, lease_pid = conn.execute(LEASE, (cap, n, "30 s")).fetchone()
                    if slot is None:
                        assert token is None
                        throttled[i] += 1
                        # Back off a little, so that the cycles are not mostly throttles.
                        time.sleep(random.uniform(0.005, 0.02))
                        continue
                    start = time.monotonic()
                    # The work is a transaction of its own: it, and the release after it, may
                    # run on another server connection than the lease.
                    conn.execute("SELECT pg_sleep(0.005)")
                    end = time.monotonic()
                    released, release_pid = conn.execute(
                        RELEASE_LEASE, (cap, slot, token)).fetchone()
                    with lock:
                        regions.append((start, end, slot, token, lease_pid, release_pid,
                                        released))
            except BaseException as e:  # noqa: BLE001 - reported below, with the client
                with lock:
                    errors.append((i, repr(e)))
                barrier.abort()

        threads = [threading.Thread(target=client, args=(i,), daemon=True)
                   for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a client did not finish in 300 s"
        assert errors == []
        assert len(regions) + sum(throttled) == clients * cycles

        # The ledger, independent of the extension's own accounting.
        assert regions, "no client ever got a lease"
        assert sum(throttled) > 0, "the cap was never full: the test proves nothing"
        assert most_at_once([(r[0], r[1]) for r in regions]) <= n
        by_slot = {}
        for start, end, slot, *_ in regions:
            assert 0 <= slot < n
            by_slot.setdefault(slot, []).append((start, end))
        for slot, spans in by_slot.items():
            assert most_at_once(spans) == 1, f"two regions held slot {slot} at once"
        assert all(r[6] is True for r in regions), "a release by token returned false"
        tokens = [r[3] for r in regions]
        assert len(set(tokens)) == len(tokens), "a token was handed out twice"

        # The point of leases: the release often ran on another server connection than the
        # lease (with session slots each of those would be a foreign release and an orphan),
        # and the 16 clients shared at most 4 of them.
        moved = sum(1 for r in regions if r[4] != r[5])
        assert moved > 0, "every release ran on the lease's own backend"
        backends = {r[4] for r in regions} | {r[5] for r in regions}
        assert 1 < len(backends) <= 4

        # The extension's counts, read straight from the cluster, match the clients' exactly.
        after = stats(direct, cap)
        delta = {k: after[k] - before[k] for k in
                 ("acquired", "released", "throttled", "foreign_releases", "expired",
                  "released_by_exit")}
        assert delta == {"acquired": len(regions), "released": len(regions),
                         "throttled": sum(throttled), "foreign_releases": 0, "expired": 0,
                         "released_by_exit": 0}
        assert after["held"] == 0
        assert lease_holders(direct, cap) == []
    finally:
        for conn in conns:
            conn.close()
        direct.close()


# Takes a lease, prints "slot token backend_pid" and holds its connection until killed.
HOLDER = """
import sys
import psycopg
conn = psycopg.connect(sys.argv[1], autocommit=True, prepare_threshold=None)
row = conn.execute(sys.argv[2], (sys.argv[3], 1, "6 s")).fetchone()
print(*row, flush=True)
sys.stdin.read()
"""


def test_a_lease_outlives_its_crashed_holder_until_its_ttl_and_no_longer(cluster, db, pooler):
    """A client killed mid-region through the pooler, and the backend that ran its lease
    terminated too: the slot stays held (a lease is nobody's session) until the TTL, and is
    freed after it, counted and logged as expired, never before its expires_at."""
    cap = "crashy"
    bouncer = pooler("transaction", pool_size=2)
    direct = cluster.connect(db, "observer")
    holder = None
    try:
        before = stats(direct, cap)
        # The holder is a process of its own, so that it can die like a crashed client: killed,
        # its socket closed by the kernel, nothing released, no Terminate message sent.
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, bouncer.conninfo(db, "holder"), LEASE, cap],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = holder.stdout.readline().split()
        assert len(line) == 3, f"the holder printed {line!r}"
        slot, token, pid_lease = (int(x) for x in line)
        assert slot == 0
        ((h_slot, h_pid, h_token, acquired_at, expires_at),) = lease_holders(direct, cap)
        assert (h_slot, h_pid, h_token) == (0, pid_lease, token)
        since = len(cluster.log_text())

        # The crash: the client dies mid-region, and so does the backend that ran the lease.
        holder.kill()
        holder.wait(timeout=10)
        assert one(direct, "SELECT pg_terminate_backend(%s, 5000)", (pid_lease,)) is True
        wait_for(lambda: one(direct, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                             (pid_lease,)) == 0, what="the lease's backend to exit")

        # The backend is gone, so its exit hooks have run. Then until a second of the 6 s TTL
        # has passed on the server's clock (polled): what we see is the lease surviving the
        # exit, not a check made before anything could act, with 5 s to spare before the TTL,
        # so the slot must still be held (the check below says when it was made).
        wait_for(lambda: one(direct, "SELECT clock_timestamp()") >= acquired_at
                 + timedelta(seconds=1), timeout=10, what="a second of the lease to pass")
        other = bouncer.connect(db, application_name="other")
        nulls = 0
        row = other.execute(LEASE, (cap, 1, "2 s")).fetchone()
        checked_at = one(direct, "SELECT clock_timestamp()")
        assert row[:2] == (None, None), (
            f"the slot was free {(checked_at - acquired_at).total_seconds():.3f} s after the "
            f"lease (expires_at {expires_at})")
        assert checked_at < expires_at  # the check was made while the lease was live
        nulls += 1
        assert lease_holders(direct, cap) == [(0, pid_lease, token, acquired_at, expires_at)]
        mid = stats(direct, cap)
        assert mid["held"] == 1
        assert mid["expired"] == before["expired"]
        assert mid["released_by_exit"] == before["released_by_exit"]  # a lease is no session's

        # After the TTL the slot comes back: poll through the pooler until a lease succeeds.
        deadline = time.monotonic() + 30
        while True:
            new_slot, new_token, _ = other.execute(LEASE, (cap, 1, "2 s")).fetchone()
            if new_slot is not None:
                break
            nulls += 1
            assert time.monotonic() < deadline, "the expired lease was never freed"
            time.sleep(0.05)
        assert new_slot == 0 and new_token > token
        # Not freed before its expiry: the new lease was taken (clock of the server that
        # freed the old one) at or after the old one's expires_at.
        ((_, _, h_token, new_acquired_at, _),) = lease_holders(direct, cap)
        assert h_token == new_token
        assert new_acquired_at >= expires_at
        after = stats(direct, cap)
        assert after["expired"] - before["expired"] == 1
        assert after["throttled"] - before["throttled"] == nulls
        assert after["acquired"] - before["acquired"] == 2
        line = re.compile(rf'lease of slot 0 of cap "{cap}" \(token {token}, taken by pid '
                          rf'{pid_lease}\) expired')
        wait_for(lambda: line.search(cluster.log_text()[since:]), timeout=5,
                 what="the expiry's LOG line")

        # The dead holder's token is stale: a release with it (a zombie coming back) does not
        # free the new lease.
        notices = []
        other.add_notice_handler(lambda d: notices.append(notice(d)))
        assert one(other, "SELECT stage_e_release_lease(%s, 0, %s)", (cap, token)) is False
        assert [n["severity"] for n in notices] == ["WARNING"]
        # Never the current token: it is the new holder's key to its slot.
        assert "is leased under another token" in notices[0]["detail"]
        assert str(new_token) not in notices[0]["detail"]
        assert [r[2] for r in lease_holders(direct, cap)] == [new_token]
        assert one(other, "SELECT stage_e_release_lease(%s, 0, %s)", (cap, new_token)) is True
        assert lease_holders(direct, cap) == []
        other.close()
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()
        direct.close()


def release_on_the_other_backend(bouncer, db, take, release):
    """The deterministic sequence of the misuse test, through a pool of two server connections:
    client A runs `take` (a query returning (slot, extra, backend pid)); B and C then hold the
    two server connections in open transactions; the one that is not A's is freed, so A's
    `release` (given the take's row, returning (result, backend pid)) can only run there. Returns
    (take's row, A's backend, the release's row, its notices); the transactions are ended."""
    a = bouncer.connect(db, application_name="client-a")
    took = a.execute(take).fetchone()
    pid_a = took[-1]
    b = bouncer.connect(db, autocommit=False, application_name="client-b")
    c = bouncer.connect(db, autocommit=False, application_name="client-c")
    pid_b = one(b, "SELECT pg_backend_pid()")
    pid_c = one(c, "SELECT pg_backend_pid()")
    assert pid_b != pid_c and pid_a in (pid_b, pid_c)
    holder_tx, other_tx = (b, c) if pid_b == pid_a else (c, b)
    other_tx.commit()
    notices = []
    a.add_notice_handler(lambda d: notices.append(notice(d)))
    released = a.execute(release(took)).fetchone()
    holder_tx.commit()
    for client in (a, b, c):
        client.close()
    return took, pid_a, released, notices


def test_a_release_on_another_backend_fails_for_a_session_slot_and_works_for_a_lease(
        cluster, db, pooler):
    bouncer = pooler("transaction", pool_size=2)
    direct = cluster.connect(db, "observer")
    lease_cap = "leased"
    try:
        # A session slot: the release on the other backend is refused, the slot orphaned.
        before = stats(direct, CAP)
        took, pid_a, (released, pid_release), notices = release_on_the_other_backend(
            bouncer, db, f"SELECT stage_e_try_slot('{CAP}', 2), NULL, pg_backend_pid()",
            lambda took: f"SELECT stage_e_release('{CAP}', {took[0]}), pg_backend_pid()")
        assert took[0] == 0
        assert pid_release != pid_a
        assert released is False
        assert [n["message"] for n in notices] == [
            f'slot 0 of cap "{CAP}" was not held by this connection']
        assert stats(direct, CAP)["foreign_releases"] - before["foreign_releases"] == 1
        assert slot_locks(direct) == [(0, pid_a, True)]
        assert [(r[0], r[1], r[2]) for r in lease_holders(direct, CAP)] == [(0, pid_a, None)]

        # A lease, the same sequence on the same pooler: the release by token works wherever
        # it runs, and leaves neither a lock nor a lease behind.
        before = stats(direct, lease_cap)
        took, pid_a, (released, pid_release), notices = release_on_the_other_backend(
            bouncer, db, f"SELECT l.slot, l.token, pg_backend_pid() "
                         f"FROM stage_e_lease('{lease_cap}', 2, '30 s') AS l",
            lambda took: f"SELECT stage_e_release_lease('{lease_cap}', {took[0]}, {took[1]}), "
                         "pg_backend_pid()")
        assert took[0] == 0 and took[1] is not None
        assert pid_release != pid_a
        assert released is True
        assert notices == []
        after = stats(direct, lease_cap)
        assert after["released"] - before["released"] == 1
        assert after["foreign_releases"] == before["foreign_releases"]
        assert after["held"] == 0
        assert lease_holders(direct, lease_cap) == []
        assert slot_locks(direct, lease_cap) == []
        # The slot is really free: the whole cap can be leased again, from anywhere.
        assert one(direct, f"SELECT (stage_e_lease('{lease_cap}', 1, '30 s')).slot") == 0
    finally:
        direct.close()


def test_expired_leases_are_freed_while_the_freed_slot_is_leased_again(cluster, db, pooler):
    """Holders that all crash: leases of a one-slot cap with a 1 ms TTL, never released, taken
    back to back by 8 clients over 4 server connections, so that each expired lease is freed by
    one backend's sweep while another leases the slot again. Once they stop, the last lease is
    long expired: the next try must free it and get the slot (a throttled try sweeps first),
    and the launcher frees it within its 5 s sweep interval in any case. Correct code passes
    every round whatever the timing; the rounds only give a race in the sweep its chances.
    That it happened is checked too: in every round leases expired (each lease of the round
    ended, by its expiry or, for the last one, the release), and the expiry LOG lines show
    several backends freeing leases, some of them leases another backend had taken."""
    cap, clients, rounds = "churn", 8, 15
    bouncer = pooler("transaction", pool_size=4)
    direct = cluster.connect(db, "observer")
    conns = []
    since = len(cluster.log_text())
    expired = 0
    try:
        conns = [bouncer.connect(db, application_name=f"churner-{i}") for i in range(clients)]
        # 50 tries per round trip, to spend the time in the server rather than in Python.
        churn = ("SELECT count((stage_e_lease(%s, 1, '1 ms')).slot) "
                 "FROM generate_series(1, 50)")
        for round_ in range(rounds):
            before = stats(direct, cap)
            stop = threading.Event()
            errors = []

            def client(conn, stop=stop, errors=errors):
                try:
                    while not stop.is_set():
                        conn.execute(churn, (cap,))
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(repr(e))

            threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in conns]
            for t in threads:
                t.start()
            time.sleep(1.0)  # the churn's length (each round gives the race its chances)
            stop.set()
            for t in threads:
                t.join(timeout=60)
            assert not [t for t in threads if t.is_alive()], "a client did not stop in 60 s"
            assert errors == []
            # Every lease of the round past its expiry (polled on the server's clock).
            wait_for(lambda: one(direct, "SELECT coalesce(bool_and(expires_at < "
                                         "clock_timestamp()), true) FROM stage_e_slot_holders "
                                         "WHERE cap = %s", (cap,)),
                     timeout=10, what="the round's last lease to expire")
            got = direct.execute("SELECT * FROM stage_e_lease(%s, 1, '30 s')",
                                 (cap,)).fetchone()
            if got[0] is None:
                stuck = lease_holders(direct, cap)
                time.sleep(6)  # more than the launcher's sweep interval (5 s)
                again = one(direct, "SELECT (stage_e_lease(%s, 1, '30 s')).slot", (cap,))
                past = one(direct, "SELECT array_agg(clock_timestamp() - expires_at) "
                                   "FROM stage_e_slot_holders WHERE cap = %s", (cap,))
                # A lease of another slot lowers the cap's next-expiry mark (fetch_min): if the
                # stuck lease is then freed, it was live and expired, only missing from the mark.
                other = one(direct, "SELECT (stage_e_lease(%s, 2, '1 ms')).slot", (cap,))
                time.sleep(0.05)
                healed = one(direct, "SELECT (stage_e_lease(%s, 1, '30 s')).slot", (cap,))
                pytest.fail(
                    f"round {round_}: an expired lease is never freed. Holders {stuck}; 6 s "
                    f"later a new lease of n=1 still got {again} and the lease was {past} past "
                    f"its expiry ({stats(direct, cap)}). A lease of n=2 then got slot {other}, "
                    f"and 50 ms later a lease of n=1 got slot {healed}.")
            assert got[0] == 0
            assert one(direct, "SELECT stage_e_release_lease(%s, 0, %s)",
                       (cap, got[1])) is True
            # Every lease of the round ended: the direct one released, all others expired
            # (freed by a churner's sweep, the direct lease's or the launcher's).
            d = {k: stats(direct, cap)[k] - before[k]
                 for k in ("acquired", "expired", "released", "foreign_releases")}
            assert d["released"] == 1 and d["foreign_releases"] == 0, d
            assert d["expired"] == d["acquired"] - 1 >= 1, (round_, d)
            expired += d["expired"]
        # Each expiry logged once, with who freed it ([pid] of the line) and who had taken it.
        lines = [m.groupdict() for m in EXPIRY.finditer(cluster.log_text()[since:])
                 if m["cap"] == cap]
        assert len(lines) == expired
        # The pooler's server connections, apart from this observer and the launcher: several
        # of them freed leases, and some freed a lease another one had taken.
        launcher = one(direct, "SELECT pid FROM pg_stat_activity "
                               "WHERE backend_type = 'stage_e_slots launcher'")
        pooled = [m for m in lines if int(m["by"]) not in (direct.info.backend_pid, launcher)]
        freers = {m["by"] for m in pooled}
        by_another = sum(1 for m in pooled if m["by"] != m["pid"])
        print(f"\n{expired} leases expired in {rounds} rounds, {len(pooled)} freed by "
              f"{len(freers)} server connections of the pooler, {by_another} of those taken by "
              f"another one")
        assert len(freers) >= 2 and by_another >= 1
    finally:
        for conn in conns:
            conn.close()
        direct.close()
