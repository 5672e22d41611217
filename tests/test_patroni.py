"""Leases across a real switchover and a real failover: Patroni 3 and etcd (scripts/hacluster.py)
in front of two PostgreSQL nodes with stage_e_slots preloaded, and clients that follow the
leader as applications do (libpq's target_session_attrs=read-write over both nodes).

Eight clients share cap `jobs` with n = 3 through leases (ttl 10 s), each renewing every second
and releasing after a few seconds. Independently of the server, the test keeps a ledger of what
every client believes: it holds a slot from the moment a grant (or a renewal that returned
true) comes back until the earlier of the moment that request was sent + ttl and the moment it
learned otherwise (a renewal returned false, or it released). Across a `patronictl switchover`
and a failover by kill -9 of the leader's postmaster, the ledger must never show more than 3
believers nor a slot believed by two clients; every client that held a lease when the leader
changed must either reclaim it on the new leader (its renewal with its old token returns true)
or learn that it lost it; the new leader must hold the cap back (stage_e_held_back, reason
'promotion', and its LOG line) and then grant again, with tokens above every earlier one
(docs/lifecycle.md). 0.5.0 fails it: a promoted standby hands the slots out again at once.

Run on PostgreSQL 15 only (conftest.py; STAGE_E_PATRONI_TESTS=1 runs it on any major, =0 skips
it); needs Debian's patroni and etcd-server (scripts/install-deps.sh).
"""

from __future__ import annotations

import random
import re
import threading
import time
from dataclasses import dataclass, field

import psycopg
import pytest
from hacluster import HACluster
from pgcluster import wait_for

CAP, N, TTL = "jobs", 3, 10.0
CLIENTS = 8
RENEW_EVERY = 1.0
HOLD_FOR = (2.0, 5.0)  # seconds a client keeps a lease before releasing it
DB = "stage_e_ha"
HELD_BACK_LOG = re.compile(
    r'LOG:  stage_e_slots: cap "jobs" of database "stage_e_ha" is held back until [^\n]*')

now = time.monotonic


@pytest.fixture(scope="module")
def ha():
    # The margin is the replication lag the grant rule tolerates at failover (2 s is the
    # default; named here because the test relies on loopback's lag being below it).
    c = HACluster({"stage_e_slots.lease_horizon_margin": "2s"})
    c.up()
    try:
        yield c
    finally:
        c.down()


# -- the ledger ------------------------------------------------------------------------------

@dataclass
class Renewal:
    sent: float
    returned: float
    ok: bool
    node: str
    connected_at: float  # when the session it went through was opened


@dataclass
class Holding:
    """One lease as its client saw it, from its grant to the end of its client's belief."""
    client: int
    slot: int
    token: int
    node: str
    sent: float
    granted: float  # when the grant returned
    renewals: list[Renewal] = field(default_factory=list)
    ended: float | None = None  # when it released, or learned it had lost it
    end: str | None = None  # 'released', 'lost' or 'stopped' (the workload ended)

    def believed(self) -> list[tuple[float, float]]:
        """The intervals during which the client believed it held the slot: each grant or
        true renewal from its return to its send + ttl, cut at `ended`, merged."""
        pieces = [(self.granted, self.sent + TTL)]
        pieces += [(r.returned, r.sent + TTL) for r in self.renewals if r.ok]
        cut = self.ended if self.ended is not None else float("inf")
        merged: list[list[float]] = []
        for a, b in sorted((a, min(b, cut)) for a, b in pieces):
            if a >= b:
                continue
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return [(a, b) for a, b in merged]


@dataclass
class Event:
    kind: str
    at: float  # just before it was triggered
    old: str
    new: str
    result: dict = field(default_factory=dict)
    held_back: object = None  # stage_e_held_back's rows for the cap on the new leader, or error
    log_from: int = 0  # the new leader's log length at the event


class Ledger:
    def __init__(self):
        self.lock = threading.Lock()
        self.holdings: list[Holding] = []
        self.errors: dict[str, int] = {}

    def add(self, h: Holding) -> None:
        with self.lock:
            self.holdings.append(h)

    def error(self, e: Exception) -> None:
        with self.lock:
            kind = type(e).__name__
            self.errors[kind] = self.errors.get(kind, 0) + 1

    def snapshot(self) -> list[Holding]:
        with self.lock:
            return list(self.holdings)


# -- the clients -----------------------------------------------------------------------------

class Client(threading.Thread):
    """A lease user that reconnects (with backoff) to whichever node is the leader. After a
    reconnect, a client with a lease first renews it, to learn whether it still has it."""

    def __init__(self, i: int, ha: HACluster, ledger: Ledger, stop: threading.Event):
        super().__init__(name=f"client{i}", daemon=True)
        self.i, self.ha, self.ledger, self.stop = i, ha, ledger, stop
        self.conn: psycopg.Connection | None = None
        self.node, self.connected_at = "", 0.0
        self.holding: Holding | None = None
        self.release_at = self.next_renew = 0.0
        self.must_renew = False
        self.failure: BaseException | None = None
        self.rng = random.Random(i)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    if self.conn is None:
                        self.connect()
                    elif self.holding is None:
                        self.acquire()
                    else:
                        self.tend()
                except psycopg.Error as e:
                    self.ledger.error(e)
                    self.conn.close()
                    self.conn = None
            self.finish()
        # A bug here: the test reports it instead of hanging on it.
        except BaseException as e:  # noqa: BLE001
            self.failure = e
            self.stop.set()

    def connect(self) -> None:
        delay = 0.05
        while not self.stop.is_set():
            try:
                conn = psycopg.connect(self.ha.conninfo(dbname=DB, connect_timeout=1,
                                                        application_name=self.name),
                                       autocommit=True)
            except psycopg.Error as e:
                self.ledger.error(e)
                self.stop.wait(delay * self.rng.uniform(0.5, 1.5))
                delay = min(2 * delay, 0.8)
                continue
            self.conn, self.node, self.connected_at = conn, self.ha.node_of_port(
                conn.info.port), now()
            self.must_renew = self.holding is not None
            return

    def acquire(self) -> None:
        sent = now()
        slot, token = self.conn.execute(
            "SELECT slot, token FROM stage_e_lease(%s, %s::int, %s::interval, %s::interval)",
            (CAP, N, f"{TTL} s", "1 s")).fetchone()
        if slot is None:
            return
        h = Holding(self.i, slot, token, self.node, sent, now())
        self.ledger.add(h)
        self.holding = h
        self.release_at = h.granted + self.rng.uniform(*HOLD_FOR)
        self.next_renew = sent + RENEW_EVERY

    def tend(self) -> None:
        h = self.holding
        if not self.must_renew:
            if self.stop.wait(max(0.0, min(self.next_renew, self.release_at) - now())):
                return
            if now() >= self.release_at:
                h.ended, h.end = now(), "released"
                self.holding = None
                self.conn.execute("SELECT stage_e_release_lease(%s, %s::int, %s::bigint)",
                                  (CAP, h.slot, h.token))
                return
        sent = now()
        ok = self.conn.execute("SELECT stage_e_renew(%s, %s::int, %s::bigint, %s::interval)",
                               (CAP, h.slot, h.token, f"{TTL} s")).fetchone()[0]
        returned = now()
        h.renewals.append(Renewal(sent, returned, ok, self.node, self.connected_at))
        self.must_renew, self.next_renew = False, sent + RENEW_EVERY
        if not ok:
            h.ended, h.end = returned, "lost"
            self.holding = None

    def finish(self) -> None:
        if self.holding is not None:
            h = self.holding
            h.ended, h.end = now(), "stopped"
            if self.conn is not None:
                try:
                    self.conn.execute("SELECT stage_e_release_lease(%s, %s::int, %s::bigint)",
                                      (CAP, h.slot, h.token))
                except psycopg.Error:
                    pass  # the cluster goes down next: nothing to clean up after
        if self.conn is not None:
            self.conn.close()


# -- what the ledger shows -------------------------------------------------------------------

def believers(holdings: list[Holding]) -> tuple[int, list[tuple]]:
    """The most holdings believed at one instant, and every pair of holdings of one slot whose
    beliefs overlapped: (slot, holding, later holding, seconds of overlap)."""
    edges = sorted((t, d) for h in holdings for a, b in h.believed() for t, d in ((a, 1), (b, -1)))
    most = count = 0
    for _, d in edges:  # at equal times -1 sorts first: touching intervals do not overlap
        count += d
        most = max(most, count)
    shared = []
    by_slot: dict[int, list[tuple[float, float, Holding]]] = {}
    for h in holdings:
        by_slot.setdefault(h.slot, []).extend((a, b, h) for a, b in h.believed())
    for slot, spans in by_slot.items():
        spans.sort(key=lambda s: s[0])
        for i, (a, b, h) in enumerate(spans):
            for a2, b2, h2 in spans[i + 1:]:
                if a2 >= b:
                    break
                if h2 is not h:
                    shared.append((slot, h, h2, min(b, b2) - a2))
    return most, shared


def epoch_of(h: Holding, events: list[Event], first_leader: str) -> int:
    """Which leader granted `h`: the latest epoch (0 before the first event, k after the k-th)
    whose leader is h's node and which had begun when the grant was sent."""
    leaders = [first_leader] + [e.new for e in events]
    starts = [float("-inf")] + [e.at for e in events]
    return max(k for k in range(len(leaders)) if leaders[k] == h.node and h.sent >= starts[k])


def outcomes(holdings: list[Holding], events: list[Event], i: int,
             first_leader: str) -> dict[str, list[Holding]]:
    """The holdings that event `i` caught (granted by an earlier leader, including the one it
    replaced while it was being replaced, and not ended when it began), by what became of
    them: 'reclaimed' or 'lost' (the first renewal on a session to the new leader opened
    after the event returned true or false), 'released' (released before any such renewal,
    on the old leader) or 'undecided'."""
    e = events[i]
    out: dict[str, list[Holding]] = {"reclaimed": [], "lost": [], "released": [],
                                     "undecided": []}
    for h in holdings:
        if epoch_of(h, events, first_leader) > i or (h.ended is not None and h.ended <= e.at):
            continue
        first = next((r for r in h.renewals if r.node == e.new and r.connected_at > e.at), None)
        if first is not None:
            out["reclaimed" if first.ok else "lost"].append(h)
        elif h.end == "released":
            out["released"].append(h)
        else:
            out["undecided"].append(h)
    return out


def settled(holdings: list[Holding], events: list[Event], first_leader: str) -> bool:
    """Whether the latest event's holders all know their fate and the workload has run on for
    3 s since the new leader's first grant (after the hold, if there is one)."""
    i = len(events) - 1
    new = [h.granted for h in holdings if epoch_of(h, events, first_leader) == i + 1]
    return (not outcomes(holdings, events, i, first_leader)["undecided"] and bool(new)
            and now() > min(new) + 3)


def poll_held_back(ha: HACluster, node: str):
    """stage_e_held_back's rows for the cap on `node` as soon as it has some (up to 5 s), or
    the error reading it (0.5.0 has no such view)."""
    rows = []

    def held():
        rows[:] = c.execute("SELECT cap, held_until, reason FROM stage_e_held_back "
                            "WHERE cap = %s", (CAP,)).fetchall()
        return rows

    try:
        with ha.connect(node, DB) as c:
            wait_for(held, timeout=5, interval=0.05, what="stage_e_held_back to list the cap")
    except (psycopg.Error, AssertionError) as e:
        return f"{type(e).__name__}: {e}".strip()
    return rows


# -- the test --------------------------------------------------------------------------------

# Its own waits add up to about 600 s at worst, the suite's default limit (conftest.py): the
# bring-up (180 s), the warm-up (30 s), and per event up to 60 s each to switch or fail over,
# to rejoin and to settle. A run takes about a minute; twice the worst case as its limit.
@pytest.mark.timeout(1200)
def test_leases_across_switchover_and_failover(ha):
    leader = ha.leader()
    with ha.connect(leader) as c:
        c.execute(f"CREATE DATABASE {DB}")
    with ha.connect(leader, DB) as c:
        c.execute("CREATE EXTENSION stage_e_slots")
        version = c.execute("SELECT extversion FROM pg_extension "
                            "WHERE extname = 'stage_e_slots'").fetchone()[0]

    ledger, stop = Ledger(), threading.Event()
    clients = [Client(i, ha, ledger, stop) for i in range(CLIENTS)]
    events: list[Event] = []
    t0 = now()
    try:
        for client in clients:
            client.start()
        wait_for(lambda: len(ledger.snapshot()) >= N and now() - t0 > 4, timeout=30,
                 what="the workload to warm up")
        for kind, trigger in (("switchover", ha.switchover),
                              ("failover by kill -9", ha.failover_by_kill)):
            old = ha.leader()
            e = Event(kind, now(), old, ha.other(old), log_from=len(ha.log_text(ha.other(old))))
            events.append(e)
            e.result = trigger()
            assert e.result["new"] == e.new
            e.held_back = poll_held_back(ha, e.new)
            e.result["rejoined"] = ha.wait_rejoined()
            wait_for(lambda: settled(ledger.snapshot(), events, leader), timeout=60,
                     interval=0.2, what=f"the workload to settle after the {kind}")
    finally:
        stop.set()
        for client in clients:
            client.join(10)
    assert not [c.failure for c in clients if c.failure or c.is_alive()]
    holdings = ledger.snapshot()

    # -- figures -----------------------------------------------------------------------------
    most, shared = believers(holdings)
    print(f"\nstage_e_slots {version}: {len(holdings)} holds by {CLIENTS} clients in "
          f"{now() - t0:.0f} s; at most {most} believed holders at once, {len(shared)} times "
          f"a slot believed by two; "
          f"client errors {ledger.errors}; bring-up "
          + ", ".join(f"{k} {v:.1f} s" for k, v in ha.timings.items()))
    for i, e in enumerate(events):
        fates = {k: len(v) for k, v in outcomes(holdings, events, i, leader).items()}
        first = min((h.granted for h in holdings if epoch_of(h, events, leader) == i + 1),
                    default=None)
        line = HELD_BACK_LOG.search(ha.log_text(e.new)[e.log_from:])
        e.result["log"] = line and line[0]
        print(f"epoch {i + 1}, {e.kind} {e.old} -> {e.new}: writable after "
              f"{e.result['writable']:.1f} s, {e.old} streaming {e.result['rejoined']:.1f} s "
              f"later; its holders: {fates}; first new grant "
              f"{'never' if first is None else f'{first - e.at:.1f} s'} after it; "
              f"held back: {e.held_back}; {e.new}'s log: {e.result['log']}")
    overlaps = [f"slot {slot}: client {h.client} (token {h.token}, epoch "
                f"{epoch_of(h, events, leader)}) and client {h2.client} (token {h2.token}, "
                f"epoch {epoch_of(h2, events, leader)}) for {seconds:.2f} s"
                for slot, h, h2, seconds in shared]
    print("".join(f"  believed twice: {o}\n" for o in overlaps), end="")

    # -- assertions --------------------------------------------------------------------------
    assert not overlaps, f"slots believed by two clients at once: {overlaps}"
    assert most <= N, f"{most} clients believed they held one of the cap's {N} slots at once"
    for i, e in enumerate(events):
        fates = outcomes(holdings, events, i, leader)
        assert not fates["undecided"], f"{e.kind}: holders that never learned their fate"
        # The event caught a live holder, whose renewal on the new leader decided its fate:
        # otherwise nothing above says what a failover does to a lease.
        assert fates["reclaimed"] or fates["lost"], f"{e.kind}: caught no live holder: {fates}"
        before = [h.token for h in holdings if epoch_of(h, events, leader) <= i]
        after = [h.token for h in holdings if epoch_of(h, events, leader) == i + 1]
        assert after, f"{e.kind}: no new grant on the new leader"
        assert min(after) > max(before), f"{e.kind}: a token after it is not above all before"
        assert isinstance(e.held_back, list) and [r[2] for r in e.held_back] == ["promotion"], \
            f"{e.kind}: stage_e_held_back on {e.new} right after: {e.held_back}"
        assert e.result["log"], f"{e.kind}: no held-back LOG line on {e.new}"
