"""The connection machinery of the sync API, hand-written: the counterpart of ``_aio_line``
that the modules generated from the asyncio ones (``_slots.py`` from ``_aio_slots.py``,
``_leases.py`` from ``_aio_leases.py``, by scripts/generate_sync.py) run on. Private.

- ``_Line``: one psycopg Connection of one thread, with ``_aio_line._Line``'s interface. A
  thread runs one statement at a time on a connection of its own, so there are no turns to
  queue for and no server-side wait to interrupt: a turn is the connection (opened if need be,
  replaced when it broke or crossed a fork), a call is its one statement.
- ``_connections``: the connections of this thread (aio: of the running event loop).
- ``_ConnectionStatements``: the statements of leases taken on a connection the caller owns,
  which for the sync API may be any DB-API connection (aio takes a psycopg AsyncConnection).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import psycopg
from psycopg.rows import tuple_row

from ._common import (
    _ENSURED,
    _RATE_OF,
    _SET_RATE,
    Rate,
    _lease_query,
    _rate_not_set,
    _rate_to_set,
    _rate_was_set,
    _Unreachable,
)

T = TypeVar("T")
Row = tuple[Any, ...]
Conn = psycopg.Connection[Any]

# What ends the connections' application_name (aio's say ":aio").
APP_SUFFIX = ""
# Whether a lease taken by a call whose answer was lost is looked for and released at once. Not
# here: only a statement_timeout or a server error loses a sync call's answer, and behind a
# transaction pooler this session's leases cannot be told from another client's: such a lease
# is freed when its ttl passes. (aio interrupts its own waits, so it must.)
RECOVER_LEASES = False


def _shielded(work: Callable[..., T], *args: Any) -> T:
    """``work(*args)``. (aio's ``_shielded`` runs it to its end even when the task is
    cancelled meanwhile; a sync call runs to its end anyway.)"""
    return work(*args)


def _fetch(conn: Conn, query: str, params: tuple[object, ...]) -> Row | None:
    row: Row | None = conn.execute(query, params).fetchone()
    return row


def _lost(conn: Conn, e: psycopg.Error) -> bool:
    """Whether `e` means the session is gone (rather than a statement the server refused)."""
    sqlstate = e.sqlstate or ""
    return (conn.broken or conn.closed or sqlstate.startswith(("08", "57P"))
            or (not sqlstate and isinstance(e, psycopg.OperationalError)))


class _Turn:
    """A call's hold of a _Line's connection (None when there is none and it opened none)."""

    def __init__(self, conn: Conn | None) -> None:
        self.conn = conn

    @property
    def connection(self) -> Conn:
        if self.conn is None:
            raise _Unreachable("no connection")
        return self.conn


class _Line:
    """One dedicated autocommit psycopg Connection, used by one thread (see the module
    docstring). A connection never crosses a fork: the child would share the parent's
    session, so a forked child forgets it, without closing it, and opens its own."""

    def __init__(self, dsn: str, application_name: str, connect_timeout: int, *,
                 prepare: bool, on_drop: Callable[[], None] | None = None) -> None:
        self.dsn = dsn
        self.application_name = application_name
        self.connect_timeout = connect_timeout
        self._prepare = prepare
        self._on_drop = on_drop
        self.conn: Conn | None = None
        self._pid = os.getpid()
        # Bumped whenever the connection is dropped: a region's slot taken on an earlier
        # connection went with it, and its release must not run on the new one.
        self.generation = 0

    def forked_from(self) -> int | None:
        """The pid of the process whose connection this is, when that is not this one."""
        return self._pid if self.conn is not None and self._pid != os.getpid() else None

    def usable(self) -> bool:
        """Whether the current connection is this process's and still alive."""
        conn = self.conn
        return (conn is not None and self._pid == os.getpid() and not conn.broken
                and not conn.closed)

    def drop(self) -> None:
        """Closes the connection (which frees every slot its session held); after a fork,
        forgets it without touching it (it is the parent's session)."""
        conn, self.conn = self.conn, None
        self.generation += 1
        if self._on_drop is not None:
            self._on_drop()
        if conn is not None and self._pid == os.getpid():
            self._close(conn)

    def _close(self, conn: Conn) -> None:
        try:
            conn.close()  # closing the session frees any slot it still holds
        except Exception:  # noqa: BLE001, S110 - already broken; nothing more to do
            pass

    def _open(self) -> Conn:
        return psycopg.connect(self.dsn, autocommit=True,
                               application_name=self.application_name,
                               connect_timeout=self.connect_timeout,
                               **({} if self._prepare else {"prepare_threshold": None}))

    @contextmanager
    def turn(self, *, connect: bool) -> Iterator[_Turn]:
        """The connection; ``connect``: open one if there is none (a release never does:
        ``turn.conn`` is then None). Raises _Unreachable when it cannot be opened."""
        if self.conn is not None and not self.usable():
            self.drop()
        if self.conn is None and connect:
            try:
                self.conn = self._open()
            except psycopg.OperationalError as e:
                raise _Unreachable(str(e)) from e
            self._pid = os.getpid()
        yield _Turn(self.conn)

    def one(self, query: str, params: tuple[object, ...], *, connect: bool) -> Row | None:
        """One statement. Raises _Unreachable when there is no connection (and ``connect`` is
        False) or it broke (it is then dropped)."""
        with self.turn(connect=connect) as turn:
            conn = turn.connection
            try:
                return _fetch(conn, query, params)
            except psycopg.Error as e:
                if _lost(conn, e):
                    self.drop()
                    raise _Unreachable(str(e)) from e
                raise

    def ensure_rate(self, cap: str, rate: Rate) -> bool:
        """Makes ``rate`` the rate policy of ``cap``, once per process for this DSN
        (``_ENSURED``): reads the policy, and when it is absent or differs sets it (a WARNING
        when it replaces another), each statement a transaction of its own on this autocommit
        connection, never the caller's. True when the policy is ``rate``; False (logged) when
        the database cannot be reached or refused the statement, which makes the call
        throttled. Raises RatePolicyError when this role may not set it, or the extension is
        older than 0.10.0."""
        key = (self.dsn, cap, rate)
        if key in _ENSURED:
            return True
        row = None
        try:
            row = self.one(_RATE_OF, (cap,), connect=True)
            if _rate_to_set(rate, row):
                self.one(_SET_RATE, (cap, rate.count, rate.per, rate.burst), connect=True)
                _rate_was_set(cap, rate, row)
        except (_Unreachable, psycopg.Error) as e:
            return _rate_not_set(cap, rate, row, e)
        _ENSURED.add(key)
        return True

    def note_release(self) -> None:
        """A release ran on this connection (the asyncio line wakes a waiting call with it; a
        thread's connection has no other call to wake)."""

    def call(self, build: Callable[[float], tuple[str, tuple[object, ...]] | None], wait: float,
             *, got: Callable[[Row | None], bool],
             recover: Callable[[Conn, str], None]) -> int:
        """Runs ``build(wait)``, a statement that waits up to ``wait`` seconds in the server;
        ``got(row)`` is called with its row. ``build`` returns None for a wait that only this
        connection's own release could end: nothing else runs on a thread's connection while
        it waits, so it is sent as a try (``build(0)``), answered at once. ``recover(conn, why)`` gives back what the server
        may have handed out to a statement whose answer was lost (a cancel or a
        statement_timeout landing just then): the session is kept, it may hold the thread's
        other slots. Returns the connection's generation. Raises _Unreachable when the database
        cannot be reached (the connection is dropped), and the server's other errors."""
        with self.turn(connect=True) as turn:
            conn = turn.connection
            built = build(max(0.0, wait))
            query, params = built if built is not None else _must(build(0.0))
            try:
                row = _fetch(conn, query, params)
            except psycopg.Error as e:
                if _lost(conn, e):
                    self.drop()
                    raise _Unreachable(str(e)) from e
                if isinstance(e, psycopg.OperationalError):
                    recover(conn, "a call that then failed")
                raise
            got(row)
            return self.generation


def _must(built: tuple[str, tuple[object, ...]] | None) -> tuple[str, tuple[object, ...]]:
    if built is None:
        raise RuntimeError("stage_e_slots: no statement for a call without a wait (a bug)")
    return built


class _Connections:
    """The dedicated connections of one thread, by DSN."""

    def __init__(self) -> None:
        self.slots: dict[str, Any] = {}  # SlotConnection
        self.leases: dict[str, Any] = {}  # _DsnStatements


_local = threading.local()


def _connections(what: str) -> _Connections:
    """This thread's connections (``what`` names the caller in aio's error when there is no
    running loop; a thread always has its own)."""
    conns: _Connections | None = getattr(_local, "conns", None)
    if conns is None:
        conns = _local.conns = _Connections()
    return conns


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

    def row(self, query: str, params: tuple[object, ...]) -> Row | None:
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

    def take(
            self, cap: str, n: int, ttl: timedelta, wait: timedelta, share: str | None = None,
    ) -> Row | None:
        return self.row(*_lease_query(cap, n, ttl, wait, share))

    def ended(self, token: int) -> None:
        pass
