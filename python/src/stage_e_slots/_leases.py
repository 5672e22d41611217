"""Leases: a slot held by a token for a ttl instead of by a session (the extension at 0.4.0)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Union

import psycopg
from psycopg.rows import tuple_row

from ._slots import Wait, _as_timedelta, _check_cap, log

Ttl = Union[float, int, timedelta]

_LEASE = "SELECT slot, token FROM stage_e_lease(%s, %s, %s, %s)"
_RENEW = "SELECT stage_e_renew(%s, %s, %s, %s)"
_RELEASE_LEASE = "SELECT stage_e_release_lease(%s, %s, %s)"
# The lease's row of the holders view, live now (this never extends it).
_LEASE_LIVE = ("SELECT expires_at > clock_timestamp() FROM stage_e_slot_holders "
               "WHERE cap = %s AND slot = %s AND token = %s")


class LeaseLost(Exception):
    """A lease ended before its region did: its ttl passed (the server freed the slot and
    counted it as expired) or its token was no longer the slot's current one. Whatever the
    region did after that was not guarded by the cap."""

    def __init__(self, cap: str, slot: int, token: int, reason: str) -> None:
        self.cap, self.slot, self.token, self.reason = cap, slot, token, reason
        super().__init__(f"the lease of slot {slot} of cap {cap!r} (token {token}) was lost "
                         f"before its region ended: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Task queues (Celery, multiprocessing) pickle exceptions back to the caller.
        return (type(self), (self.cap, self.slot, self.token, self.reason))


class _Unreachable(Exception):
    """The connection broke (or could not be opened); __cause__ is the driver's error."""


def _as_ttl(ttl: Ttl) -> timedelta:
    delay = ttl if isinstance(ttl, timedelta) else timedelta(seconds=ttl)
    if delay <= timedelta(0):
        raise ValueError(f"ttl must be positive: {ttl!r}")
    return delay


def _is_a(e: BaseException, name: str) -> bool:
    """Whether `e` is a DB-API error of class `name` (OperationalError, DataError...), or wraps
    one (Django re-raises the driver's errors as its own classes of the same names)."""
    seen: BaseException | None = e
    while seen is not None:
        if any(c.__name__ == name for c in type(seen).__mro__):
            return True
        seen = seen.__cause__
    return False


class _DsnStatements:
    """The statements of leases taken with a DSN, on this thread's connection for it: autocommit
    and without server-side prepared statements (``prepare_threshold=None``), so every
    statement is a transaction of its own and may run on any server connection of a
    transaction pooler. A lease needs no particular session: when this connection breaks, it is
    dropped and the next statement opens another (after a fork, the child opens its own)."""

    reconnects = True

    def __init__(self, dsn: str, *, application_name: str | None = None,
                 connect_timeout: int = 5) -> None:
        self.dsn = dsn
        self.application_name = application_name or f"stage_e_lease:{os.getpid()}"
        self.connect_timeout = connect_timeout
        self._conn: psycopg.Connection | None = None
        self._pid = os.getpid()

    def _connection(self) -> psycopg.Connection:
        conn = self._conn
        if conn is not None and (self._pid != os.getpid() or conn.broken or conn.closed):
            self._drop()
        if self._conn is None:
            try:
                self._conn = psycopg.connect(self.dsn, autocommit=True, prepare_threshold=None,
                                             application_name=self.application_name,
                                             connect_timeout=self.connect_timeout)
            except psycopg.OperationalError as e:
                raise _Unreachable(str(e)) from e
            self._pid = os.getpid()
        return self._conn

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and self._pid == os.getpid():
            try:
                conn.close()
            except Exception:  # noqa: BLE001, S110 - already broken; nothing more to do
                pass

    def row(self, query: str, params: tuple[object, ...]) -> tuple[Any, ...] | None:
        conn = self._connection()
        try:
            return conn.execute(query, params).fetchone()
        except psycopg.Error as e:
            sqlstate = e.sqlstate or ""
            if (conn.broken or conn.closed or sqlstate.startswith(("08", "57P"))
                    or (not sqlstate and isinstance(e, psycopg.OperationalError))):
                self._drop()
                raise _Unreachable(str(e)) from e
            raise

    def close(self) -> None:
        self._drop()


class _ConnectionStatements:
    """The statements of leases taken on a connection the caller owns: a psycopg connection,
    Django's ``django.db.connection``, or any DB-API connection with ``cursor()``. They run as
    they are, in the caller's transaction if one is open (a lease is not transactional: a
    rollback does not undo it), and never on another connection of ours."""

    reconnects = False

    def __init__(self, conn: Any) -> None:
        if not callable(getattr(conn, "cursor", None)):
            raise TypeError("stage_e_lease needs a DSN (str) or a connection with cursor(), "
                            f"not {type(conn).__name__}")
        self.conn = conn

    def row(self, query: str, params: tuple[object, ...]) -> tuple[Any, ...] | None:
        conn = self.conn
        if isinstance(conn, psycopg.Connection):
            if conn.broken or conn.closed:
                raise _Unreachable("the connection is closed")
            try:
                # prepare=False: no server-side prepared statement, whatever the connection's
                # prepare_threshold (a transaction pooler would run the next use elsewhere).
                with conn.cursor(row_factory=tuple_row) as cur:
                    cur.execute(query, params, prepare=False)
                    return cur.fetchone()
            except psycopg.Error as e:
                if conn.broken or conn.closed:
                    raise _Unreachable(str(e)) from e
                raise
        cur = conn.cursor()  # Django reconnects here if the framework closed its connection
        try:
            cur.execute(query, params)
            row = cur.fetchone()
            return None if row is None else tuple(row)
        finally:
            cur.close()


class _LeaseState:
    """What the sync Lease and aio's AsyncLease both keep: the lease, whether it was lost, and
    a lower bound of its expiry."""

    def __init__(self, statements: Any, cap: str, slot: int, token: int, ttl: timedelta,
                 sent: float) -> None:
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


class Lease(_LeaseState):
    """A slot of ``cap`` held by ``token`` until ``ttl`` passes unless renewed, as
    ``stage_e_lease`` yields it. ``lost`` becomes True once a renewal or the release found it
    gone (expired, or the token no longer current)."""

    def _row(self, query: str, params: tuple[object, ...]) -> tuple[Any, ...] | None:
        """Runs a statement that may run twice (a renewal, a read): after a broken connection,
        once more on a fresh one (with a DSN)."""
        row: tuple[Any, ...] | None
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
        caller's decision, not this helper's. Nothing renews in the background."""
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
        except Exception as e:  # noqa: BLE001 - the region's end must not fail on it
            log.error("stage_e_lease: the release of the lease of slot %s of cap %r (token %s) "
                      "failed (%s): the slot stays taken until its ttl passes", self.slot,
                      self.cap, self.token, e)
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
        except Exception as e:  # noqa: BLE001 - as above
            log.error("stage_e_lease: the lease of slot %s of cap %r (token %s) could not be "
                      "released (%s): the slot stays taken until its ttl passes", self.slot,
                      self.cap, self.token, e)
            return None

    def _end(self, failure: BaseException | None) -> None:
        """The region's end: releases by token (unless a renewal already found the lease gone:
        releasing it then would only count a foreign release), and reports a lost lease."""
        self._ended = True
        if not self.lost and self._release() is False:
            self._mark_lost("its release found it expired, or its token no longer current")
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


_lease_local = threading.local()


def _lease_statements(dsn: str) -> _DsnStatements:
    """This thread's lease connection for `dsn` (created on first use)."""
    conns: dict[str, _DsnStatements] | None = getattr(_lease_local, "conns", None)
    if conns is None:
        conns = _lease_local.conns = {}
    if dsn not in conns:
        conns[dsn] = _DsnStatements(dsn)
    return conns[dsn]


def _lease_failed(cap: str, e: Exception) -> None:
    """What a lease statement's error makes of the call (sync and asyncio alike): throttled,
    logged, when the database is unreachable or refused it with an operational error;
    re-raised otherwise (bad arguments, the extension missing or too old: a bug, not load)."""
    if isinstance(e, _Unreachable):
        log.warning("stage_e_lease: treating as throttled (cap %r), cannot reach the "
                    "database: %s", cap, e)
    elif _is_a(e, "OperationalError"):
        log.error("stage_e_lease: treating as throttled (cap %r), the lease statement failed "
                  "(the server refused it, or the connection failed): %s", cap, e)
    else:
        raise e


def _take_lease(statements: Any, cap: str, n: int, ttl: Ttl, wait: Wait) -> Lease | None:
    _check_cap(cap)
    delay, waiting = _as_ttl(ttl), _as_timedelta(wait)
    sent = time.monotonic()
    try:
        row = statements.row(_LEASE, (cap, n, delay, waiting))
    except Exception as e:  # noqa: BLE001 - _lease_failed re-raises all but load
        _lease_failed(cap, e)
        return None
    if row is None or row[0] is None:
        return None
    return Lease(statements, cap, int(row[0]), int(row[1]), delay, sent)


@contextmanager
def stage_e_lease(dsn_or_connection: Any, cap: str, n: int, ttl: Ttl,
                  wait: Wait = 0) -> Iterator[Lease | None]:
    """``with stage_e_lease(dsn_or_connection, "exports", 4, ttl=60) as lease:`` holds one of
    the 4 slots of cap ``exports`` by a token (``lease.slot``, ``lease.token``) for ``ttl``
    (seconds or a timedelta), waiting up to ``wait`` for one; ``lease`` is None when throttled
    (counted on the cap's row), as with ``stage_e_slot``. On exit, normal or not, the lease is
    released by its token. Needs the extension at 0.4.0.

    A lease belongs to its token, not to a session, so unlike ``stage_e_slot`` it may be taken
    on any connection: a DSN (this thread's own autocommit connection for it, without
    server-side prepared statements, re-opened whenever it breaks), a psycopg connection (its
    statements never prepared), Django's ``django.db.connection``, any DB-API connection. The
    framework closing that connection mid-region, or a transaction pooler (PgBouncer
    ``pool_mode = transaction``) running each statement on another server connection, does not
    lose the slot, and the release lands on whichever connection runs it. What ends a lease
    early is its ttl: it is freed when the ttl passes (counted as ``expired``), never earlier.

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
    """
    if isinstance(dsn_or_connection, str):
        statements: Any = _lease_statements(dsn_or_connection)
    else:
        statements = _ConnectionStatements(dsn_or_connection)
    lease = _take_lease(statements, cap, n, ttl, wait)
    if lease is None:
        yield None
        return
    try:
        yield lease
    except BaseException as failure:
        lease._end(failure)
        raise
    lease._end(None)
