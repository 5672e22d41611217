# Generated from _aio_leases.py by scripts/generate_sync.py; do not edit. Edit _aio_leases.py,
# then run `python scripts/generate_sync.py` (`make lint` checks this is current).
"""The sync API's leases: ``Lease`` and ``stage_e_lease`` (their docs are
``stage_e_slots``'). Private."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg

from ._common import (
    _LEASE_LIVE,
    _OWN_LEASES,
    _RELEASE_LEASE,
    _RENEW,
    LeaseLost,
    Rate,
    Ttl,
    Wait,
    _as_timedelta,
    _as_ttl,
    _check_cap,
    _check_rate,
    _check_share,
    _is_a,
    _lease_failed,
    _lease_query,
    _Unreachable,
    log,
)
from ._sync_line import (
    APP_SUFFIX,
    RECOVER_LEASES,
    Conn,
    Row,
    _connections,
    _ConnectionStatements,
    _Line,
    _lost,
    _shielded,
)


class _DsnStatements:
    """The statements of leases taken with a DSN, on this thread's lease connection for it
    (aio: the running loop's, shared by its tasks like the slot connection: a waiting lease
    gives way to a release): autocommit and without server-side prepared statements
    (``prepare_threshold=None``), so every statement is a transaction of its own and may run on
    any server connection of a transaction pooler. A lease needs no particular session: when
    this connection breaks, it is dropped and the next statement opens another (after a fork,
    the child opens its own)."""

    reconnects = True

    def __init__(self, dsn: str, *, connect_timeout: int = 5) -> None:
        self._line = _Line(dsn, f"stage_e_lease:{os.getpid()}{APP_SUFFIX}", connect_timeout,
                           prepare=False)
        # The tokens of the leases of live regions taken here (to find any nobody heard of).
        self.tokens: set[int] = set()

    def row(self, query: str, params: tuple[object, ...]) -> Row | None:
        return self._line.one(query, params, connect=True)

    def take(
            self, cap: str, n: int, ttl: timedelta, wait: timedelta, share: str | None = None,
    ) -> Row | None:
        taken: Row | None = None

        def got(row: Row | None) -> bool:
            nonlocal taken
            if row is None or row[0] is None:
                return False
            taken = row
            self.tokens.add(int(row[1]))
            return True

        def recover(conn: Conn, why: str) -> None:
            if RECOVER_LEASES:
                self._release_unknown(conn, cap, why)

        self._line.call(
            lambda s: _lease_query(cap, n, ttl, timedelta(seconds=s), share),
            wait.total_seconds(),
            got=got, recover=recover)
        return taken

    def _release_unknown(self, conn: Conn, cap: str, why: str) -> None:
        try:
            cur = conn.execute(_OWN_LEASES, (cap,))
            for slot, token in cur.fetchall():
                if token not in self.tokens:
                    conn.execute(_RELEASE_LEASE, (cap, slot, token))
                    log.warning("stage_e_lease: released the lease of slot %s of cap %r (token "
                                "%s), taken by %s whose answer was lost", slot, cap, token, why)
        except psycopg.Error as e:
            log.error("stage_e_lease: could not check the leases of cap %r after %s (%s): a "
                      "lease it took is freed when its ttl passes", cap, why, e)
            if _lost(conn, e):
                self._line.drop()

    def ended(self, token: int) -> None:
        self.tokens.discard(token)

    def ensure_rate(self, cap: str, rate: Rate) -> bool:
        return self._line.ensure_rate(cap, rate)

    def close(self) -> None:
        self._line.drop()


_Statements = Any  # _DsnStatements or _ConnectionStatements


class Lease:
    """A slot of ``cap`` held by ``token`` until ``ttl`` passes unless renewed, as
    ``stage_e_lease`` yields it. ``lost`` becomes True once a renewal or the release found it
    gone (expired, or the token no longer current)."""

    def __init__(self, statements: _Statements, cap: str, slot: int, token: int,
                 ttl: timedelta, sent: float) -> None:
        self.cap, self.slot, self.token, self.ttl = cap, slot, token, ttl
        self.lost = False
        self.lost_reason: str | None = None
        self._st = statements
        # A lower bound of the server's expiry, on this process's monotonic clock: the server
        # counts the ttl from the moment it ran the statement, after `sent`.
        self._deadline = sent + ttl.total_seconds()
        self._ended = False

    def __repr__(self) -> str:
        state = "lost" if self.lost else "ended" if self._ended else "held"
        return f"<{type(self).__name__} {self.cap!r} slot {self.slot} token {self.token} ({state})>"

    def _mark_lost(self, reason: str) -> None:
        if not self.lost:
            self.lost, self.lost_reason = True, reason

    def _row(self, query: str, params: tuple[object, ...]) -> Row | None:
        """Runs a statement that may run twice (a renewal, a read): after a broken connection,
        once more on a fresh one (with a DSN)."""
        row: Row | None
        try:
            row = self._st.row(query, params)
        except _Unreachable:
            if not self._st.reconnects:
                raise
            row = self._st.row(query, params)
        return row

    def renew(self, ttl: Ttl | None = None) -> bool:
        """Extends the lease to ``ttl`` (default: the lease's own) from now. True when extended;
        False when the server says the lease is gone (it expired, and was freed and counted as
        expired, or the token is no longer the slot's current one): the lease is then lost
        (``lost``; later calls say False without asking), and the region should stop what the
        cap guards.

        A renewal that cannot reach the server raises the driver's error and leaves the lease
        as it was: it may well be alive (its ttl has not passed), so whether to go on is the
        caller's decision, not this helper's; one cancelled midway (aio) leaves it renewed or
        not, and the region's end releases it either way. Nothing renews in the background."""
        if self._ended:
            raise RuntimeError(f"{self!r}: its region has ended")
        if self.lost:
            return False
        delay = self.ttl if ttl is None else _as_ttl(ttl)
        sent = time.monotonic()
        try:
            row = self._row(_RENEW, (self.cap, self.slot, self.token, delay))
        except _Unreachable as e:
            raise e.__cause__ or e from None
        if row is not None and row[0]:
            self._deadline = sent + delay.total_seconds()
            return True
        self._mark_lost("a renewal found it expired, or its token no longer current")
        log.error("stage_e_lease: lease of slot %s of cap %r (token %s) could not be renewed: "
                  "it expired or its token is no longer current", self.slot, self.cap,
                  self.token)
        return False

    def still_held(self) -> bool:
        """Whether the lease is live now, per the server's holders view (this token on this
        slot, ``expires_at`` in the future). Does not extend it; one read. An answer the server
        cannot give (unreachable) is False, logged; it does not mark the lease lost."""
        if self._ended or self.lost:
            return False
        try:
            row = self._row(_LEASE_LIVE, (self.cap, self.slot, self.token))
        except Exception as e:  # classified below
            cause = e.__cause__ if isinstance(e, _Unreachable) else e
            if not isinstance(e, _Unreachable) and not _is_a(e, "OperationalError"):
                raise  # the extension missing, a bug: not an answer about the lease
            log.error("stage_e_lease: cannot tell whether the lease of slot %s of cap %r is "
                      "held (%s); treating it as not held", self.slot, self.cap, cause)
            return False
        return bool(row is not None and row[0])

    def _release(self) -> bool | None:
        """Releases by token: True when released, False when the server found the lease gone
        (expired, or not current), None when it could not be told (logged)."""
        args = (self.cap, self.slot, self.token)
        try:
            row = self._st.row(_RELEASE_LEASE, args)
            return bool(row is not None and row[0])
        except _Unreachable as e:
            if not self._st.reconnects:
                log.error("stage_e_lease: the lease of slot %s of cap %r (token %s) could not be "
                          "released, its connection is gone (%s): the slot stays taken until "
                          "its ttl passes", self.slot, self.cap, self.token, e)
                return None
        except BaseException as e:  # the region's end must not fail on it (a cancellation
            # or an interrupt is re-raised)
            log.error("stage_e_lease: the release of the lease of slot %s of cap %r (token %s) "
                      "failed (%s): the slot stays taken until its ttl passes", self.slot,
                      self.cap, self.token, e or type(e).__name__)
            if not isinstance(e, Exception):
                raise
            return None
        # The connection broke around the release, which may or may not have run. Any
        # connection serves a lease: ask a fresh one whether it is still there.
        try:
            row = self._st.row(_LEASE_LIVE, args)
            if row is None:
                # Gone: our release ran, or the lease expired and was freed. Before our
                # deadline it cannot have expired; after it, the two cannot be told apart, and
                # a loss is reported rather than hidden.
                return time.monotonic() < self._deadline
            row = self._st.row(_RELEASE_LEASE, args)
            return bool(row is not None and row[0])
        except BaseException as e:  # as above
            log.error("stage_e_lease: the lease of slot %s of cap %r (token %s) could not be "
                      "released (%s): the slot stays taken until its ttl passes", self.slot,
                      self.cap, self.token, e or type(e).__name__)
            if not isinstance(e, Exception):
                raise
            return None

    def _end(self, failure: BaseException | None) -> None:
        """The region's end: releases by token (unless a renewal already found the lease gone:
        releasing it then would only count a foreign release), and reports a lost lease
        (LeaseLost when the region ended normally, else a note on its exception)."""
        self._ended = True
        try:
            if not self.lost and self._release() is False:
                self._mark_lost("its release found it expired, or its token no longer current")
        finally:
            self._st.ended(self.token)
        if not self.lost:
            return
        message = (f"stage_e_lease: the lease of slot {self.slot} of cap {self.cap!r} (token "
                   f"{self.token}) was lost before its region ended ({self.lost_reason}): the "
                   f"cap did not guard the work after that")
        log.error(message)
        if failure is None:
            raise LeaseLost(self.cap, self.slot, self.token, self.lost_reason or "lost")
        if hasattr(failure, "add_note"):  # Python 3.11+
            failure.add_note(message)


def _lease_statements(dsn: str) -> _DsnStatements:
    """This thread's lease connection for `dsn` (aio: the running loop's), made on first
    use."""
    conns = _connections("stage_e_slots.stage_e_lease").leases
    found: _DsnStatements | None = conns.get(dsn)
    if found is None:
        found = conns[dsn] = _DsnStatements(dsn)
    return found


def _take_lease(
        statements: _Statements, cap: str, n: int, ttl: Ttl, wait: Wait, rate: Rate | None,
        share: str | None = None,
) -> Lease | None:
    _check_cap(cap)
    _check_share(share)
    delay, waiting = _as_ttl(ttl), _as_timedelta(wait)
    if rate is not None and not statements.ensure_rate(cap, rate):
        return None
    sent = time.monotonic()
    try:
        row = statements.take(cap, n, delay, waiting, share)
    except Exception as e:  # noqa: BLE001 - _lease_failed re-raises all but load
        _lease_failed(cap, e)
        return None
    if row is None or row[0] is None:
        return None
    return Lease(statements, cap, int(row[0]), int(row[1]), delay, sent)


@contextmanager
def stage_e_lease(
        dsn_or_connection: Any, cap: str, n: int, ttl: Ttl, wait: Wait = 0, *,
        rate: Rate | None = None, share: str | None = None,
) -> Iterator[Lease | None]:
    """``with stage_e_lease(dsn_or_connection, "exports", 4, ttl=60) as lease:``
    holds one of the 4 slots of cap ``exports`` by a token (``lease.slot``, ``lease.token``)
    for ``ttl`` (seconds or a timedelta), waiting up to ``wait`` for one; ``lease`` is None
    when throttled (counted on the cap's row), as with ``stage_e_slot``. On exit, normal or
    not, the lease is released by its token. Needs the extension at 0.4.0.

    A lease belongs to its token, not to a session, so unlike ``stage_e_slot`` it may be taken
    on any connection: a DSN (this thread's own autocommit connection for it, aio: the running
    loop's, without server-side prepared statements, re-opened whenever it breaks) or a
    connection of your own (its statements never prepared): with the sync API a psycopg
    connection, Django's ``django.db.connection``, any DB-API connection; with
    ``stage_e_slots.aio`` a psycopg ``AsyncConnection``. The framework closing that connection
    mid-region, or a transaction pooler (PgBouncer ``pool_mode = transaction``) running each
    statement on another server connection, does not lose the slot, and the release lands on
    whichever connection runs it. What ends a lease early is its ttl: it is freed when the ttl
    passes (counted as ``expired``), never earlier.

    - ``lease.renew(ttl=None)`` extends it (True), or says it is gone (False, ``lease.lost``).
      Nothing renews in the background and nothing is ever interrupted by this helper: a region
      longer than its ttl renews between steps and stops when ``renew()`` says False.
    - ``lease.still_held()`` reads whether it is live (does not extend it).
    - A lost lease is reported, not hidden: when the release on exit finds the lease gone
      (it expired meanwhile), or a renewal found it gone, the loss is logged (ERROR, logger
      ``stage_e_slots``), and if the region ended normally the exit raises ``LeaseLost``, so
      code after the ``with`` does not take unguarded work for guarded. If the region raised,
      its exception propagates unchanged, with the loss added as a note. A renewal that found
      the lease gone skips the release (it would count a foreign release).
    - The database unreachable, or the lease refused by an operational error: throttled (None),
      logged. If that happened after the server took the lease, the slot is freed when its ttl
      passes. Bad arguments raise (``ValueError`` for a ttl that is not positive).
    - A release that cannot run (the given connection is gone, its transaction aborted, the
      database unreachable) is logged; the slot then comes back when the ttl passes. With a DSN,
      a release whose connection broke is checked and, if need be, run again on a fresh one.
      The release runs to its end even when the task is being cancelled (aio).
    - ``rate=Rate(10, 1)`` makes that rate the cap's policy first, as with ``stage_e_slot``
      (read its docstring): with a DSN only, on the lease connection (each statement a
      transaction of its own). A connection of yours may be inside your transaction, where
      a policy must not be set: there ``rate=`` raises ``TypeError``.
    - ``share="tenant:42"`` takes the lease in that fair share of the cap (the extension at
      0.11.0, docs/shares.md): while shares compete, slots go to them by their weights, each
      within its ceiling (``stage_e_share``); the lease gives its slot back to the share when
      it ends.
    """
    _check_rate(cap, rate)
    if isinstance(dsn_or_connection, str):
        statements: _Statements = _lease_statements(dsn_or_connection)
    elif rate is not None:
        raise TypeError(
            "stage_e_lease(rate=...) needs a DSN, not a connection of yours: the cap's rate "
            "policy is set in a transaction of its own, which your connection (perhaps inside "
            "a transaction of yours) cannot give. Pass the DSN, or set the policy once with "
            "SELECT stage_e_rate_limit(cap, count, per, burst) and call without rate= (the "
            "server enforces it on every acquisition of the cap)")
    else:
        statements = _ConnectionStatements(dsn_or_connection)
    lease = _take_lease(statements, cap, n, ttl, wait, rate, share)
    if lease is None:
        yield None
        return
    try:
        yield lease
    except BaseException as failure:
        _shielded(lease._end, failure)
        raise
    _shielded(lease._end, None)
