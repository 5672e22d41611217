"""asyncio: slots and leases for coroutines, on one dedicated connection per event loop.

::

    from stage_e_slots.aio import stage_e_lease, stage_e_slot

    async with stage_e_slot(DSN, "exports", n=4) as slot:
        if slot is None:
            return "throttled"
        await do_the_work()

    async with stage_e_slot(DSN, "exports", n=4, wait=30) as slot:   # wait up to 30 s
        ...

    async with stage_e_lease(DSN_or_async_connection, "exports", 4, ttl=60) as lease:
        if lease is None:
            return "throttled"
        async for chunk in work:
            await do(chunk)
            if not await lease.renew():     # False: the lease is gone, stop
                break

Everything is as in the sync API (``stage_e_slots.stage_e_slot``, ``stage_e_lease``; read
their docstrings), with an event loop where the sync API has a thread: the slot regions of one
running loop hold their slots on that loop's one dedicated autocommit connection
(``connection_for(dsn)``, a psycopg ``AsyncConnection``), never shared with another loop (a
second ``asyncio.run`` gets a new one) nor with a forked child. The same failure rules hold:
the database unreachable is throttled (None) with a WARNING, a slot the server refuses is
throttled with an ERROR and the connection kept, bad arguments raise, a release never opens a
new session, and a lease lost along the way raises ``LeaseLost`` at the region's end.

**One connection, many tasks.** The tasks of a loop take turns on its connection, one
statement at a time, in arrival order. A waiting call (``wait=``) waits inside the server, so
it would keep the connection for its whole wait, and a release by another task of the loop,
the very one that would free its slot, would queue behind it: a deadlock until the wait times
out. So the connection has at most one waiting call in the server at a time, the head, and
the head gives way: when a non-waiting call (a release, a try without ``wait``, ``holding()``,
a lease's renewal or release) queues behind its wait, the wait is interrupted (a cancel
request, answered by the server with ``QueryCanceled`` and no slot; a slot it had already got
is kept), that call runs, and the head waits again for what is left of its wait. The other
waiting calls of the loop never interrupt it: they queue in arrival order, in the client, to
be the head (whatever their cap), and one whose wait passes before its turn comes tries once
without waiting (a slot free just then is taken). So, as with the sync API, each waiting call
that ends without a slot counts exactly one ``throttled``, and one that gets a slot none. The
price:

- The waiting calls of one loop wait one after the other: a waiting call gets a slot no
  sooner than when it becomes the head, or when its wait has passed, even a slot of another
  cap, or one that is free all along (it then waits out its whole ``wait`` behind a head that
  waits on a full cap). And the head keeps no place in the server's queue while it is
  interrupted: waiters of other sessions that queued meanwhile go first.
- The server's other counters see the turns: each interrupt of the head counts one more
  ``waits`` for its cap (and leaves a "canceling statement due to user request" ERROR in the
  server log), but no ``wait_timeouts`` and no ``throttled``; a call whose wait passed before
  it became the head counts no ``waits`` and no ``wait_timeouts`` (its try does not wait),
  only its one ``throttled`` when it got no slot. ``throttled`` is exact; ``waits`` and
  ``wait_timeouts`` are not the number of waiting calls.

Where that matters (waiting calls served at once, strict FIFO with other processes), give
each waiting worker its own loop, or use the sync API in threads. Leases taken with a DSN work the
same way on the loop's lease connection; on an ``AsyncConnection`` of your own, nothing is
interrupted: a waiting lease keeps it for its whole wait.

**Cancellation.** A task cancelled while it waits for a slot (``task.cancel()``,
``asyncio.wait_for``'s timeout) has its server-side wait cancelled by psycopg. If the server
handed out the slot just before, the slot is held but unknown: it is given back at once (this
session's slots of the cap that no region holds), and the cancellation goes on. A release,
and a lease's release at its region's end, runs to its end even when the task is cancelled
meanwhile; a lease whose release cannot run is freed when its ttl passes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from ._aio_line import AsyncConn, Row, _fetch, _Line, _lost, _running_loop, _shielded
from ._leases import (
    _LEASE,
    _LEASE_LIVE,
    _RELEASE_LEASE,
    _RENEW,
    LeaseLost,
    Ttl,
    _as_ttl,
    _is_a,
    _lease_failed,
    _LeaseState,
    _Unreachable,
)
from ._slots import DEFAULT_CAP, Wait, _as_timedelta, _check_cap, log

__all__ = [
    "DEFAULT_CAP",
    "AsyncLease",
    "AsyncSlotConnection",
    "LeaseLost",
    "connection_for",
    "stage_e_lease",
    "stage_e_slot",
]

_HOLDERS = ("SELECT slot FROM stage_e_slot_holders WHERE pid = pg_backend_pid() AND cap = %s "
            "AND expires_at IS NULL")
# A lease's pid is the backend that took it: those taken in this very session (a pid can be
# reused by a later backend; acquired_at tells this session's from an earlier one's).
_OWN_LEASES = ("SELECT slot, token FROM stage_e_slot_holders WHERE pid = pg_backend_pid() "
               "AND cap = %s AND token IS NOT NULL AND acquired_at >= "
               "(SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid())")


# -- session slots ---------------------------------------------------------------------------

def _slot_query(cap: str, n: int, k: int, seconds: float) -> tuple[str, tuple[object, ...]]:
    delay = timedelta(seconds=seconds)
    if k == 1 and not delay:
        return "SELECT ARRAY[stage_e_try_slot(%s, %s)]", (cap, n)
    if k == 1:
        return "SELECT ARRAY[stage_e_try_slot(%s, %s, %s)]", (cap, n, delay)
    return "SELECT stage_e_try_slots(%s, %s, %s, %s)", (cap, n, k, delay)


class AsyncSlotConnection:
    """One dedicated autocommit connection for taking and releasing slots of any cap from the
    tasks of one event loop (``connection_for(dsn)`` is the running loop's). Its methods are
    ``SlotConnection``'s, as coroutines; ``slot()`` is an async context manager."""

    def __init__(self, dsn: str, *, application_name: str | None = None,
                 connect_timeout: int = 5) -> None:
        self.dsn = dsn
        self.application_name = application_name or f"stage_e_slot:{os.getpid()}:aio"
        self.connect_timeout = connect_timeout
        # Slots the regions of this connection hold, per cap (to find any they did not hear of).
        self._held: dict[str, set[int]] = {}
        self._line = _Line(dsn, self.application_name, connect_timeout, prepare=True,
                           on_drop=self._held.clear)

    async def try_slot(self, n: int, *, cap: str = DEFAULT_CAP, wait: Wait = 0) -> int | None:
        """A slot of `cap` (in [0, n)), waiting up to `wait` (seconds or a timedelta) for one;
        None when throttled or when no slot can be had."""
        got, _ = await self._take(n, 1, cap, wait)
        return None if got is None else got[0]

    async def try_slots(self, n: int, k: int, *, cap: str = DEFAULT_CAP,
                        wait: Wait = 0) -> list[int] | None:
        """k distinct slots of `cap` (in [0, n)), all or none, waiting up to `wait` for them;
        None when they could not all be had."""
        got, _ = await self._take(n, k, cap, wait)
        return got

    async def _take(self, n: int, k: int, cap: str, wait: Wait) -> tuple[list[int] | None, int]:
        _check_cap(cap)
        seconds = _as_timedelta(wait).total_seconds()
        taken: list[int] | None = None

        def got(row: Row | None) -> bool:
            nonlocal taken
            slots = row[0] if row is not None else None
            if slots is None or slots[0] is None:
                return False
            taken = [int(s) for s in slots]
            self._held.setdefault(cap, set()).update(taken)
            return True

        async def recover(conn: AsyncConn, why: str) -> None:
            await self._release_unknown(conn, cap, why)

        try:
            generation = await self._line.call(lambda s: _slot_query(cap, n, k, s), seconds,
                                               got=got, recover=recover)
        except _Unreachable as e:
            log.warning("stage_e_slot: treating as throttled (cap %r), cannot reach the "
                        "database: %s", cap, e)
            return None, -1
        except psycopg.OperationalError as e:
            log.error("stage_e_slot: treating as throttled (cap %r), the server refused the "
                      "slot: %s", cap, e)
            return None, -1
        return taken, generation

    async def _release_unknown(self, conn: AsyncConn, cap: str, why: str) -> None:
        """Releases this session's slots of `cap` that no region holds: taken by `why`."""
        try:
            cur = await conn.execute(_HOLDERS, (cap,))
            for (slot,) in await cur.fetchall():
                if slot not in self._held.get(cap, set()):
                    await conn.execute("SELECT stage_e_release(%s, %s)", (cap, slot))
                    log.log(logging.ERROR if why == "a call that then failed" else logging.WARNING,
                            "stage_e_slot: released slot %s of cap %r, taken by %s whose "
                            "answer was lost", slot, cap, why)
        except psycopg.Error as e:
            log.error("stage_e_slot: could not check the slots of cap %r after %s (%s); closing "
                      "the connection", cap, why, e)
            self._line.drop()

    async def release(self, slot: int, *, cap: str = DEFAULT_CAP) -> bool:
        """Gives the slot of `cap` back; False (logged) if this connection no longer held it.
        Runs to its end even if the calling task is cancelled meanwhile."""
        _check_cap(cap)
        return await _shielded(self._release(slot, cap, None))

    async def _release(self, slot: int, cap: str, generation: int | None) -> bool:
        line = self._line
        parent = line.forked_from()
        if parent is not None:
            log.error("stage_e_slot: slot %s of cap %r belongs to the connection of process %s; "
                      "a forked child does not release it", slot, cap, parent)
            line.drop()
            return False
        try:
            async with line.turn(connect=False) as turn:
                conn = turn.conn
                if conn is None or (generation is not None and generation != line.generation):
                    # Another session's release would only be a foreign release: the session
                    # that took the slot is gone, and the slot with it.
                    log.error("stage_e_slot: slot %s of cap %r was lost with its connection "
                              "before its release: the cap did not bind for this region",
                              slot, cap)
                    return False
                self._held.get(cap, set()).discard(slot)
                try:
                    row = await _fetch(conn, "SELECT stage_e_release(%s, %s)", (cap, slot))
                except BaseException as e:  # any failure: drop the session, which frees it
                    log.error("stage_e_slot: release of slot %s failed (cap %r: %s); closing the "
                              "connection, which frees it and any other slot it held", slot,
                              cap, e or type(e).__name__)
                    line.drop()
                    if not isinstance(e, Exception):
                        raise
                    return False
        except RuntimeError as e:  # the connection belongs to another loop
            log.error("stage_e_slot: slot %s of cap %r cannot be released here: %s", slot, cap,
                      e)
            return False
        released = bool(row is not None and row[0])
        if not released:
            log.error("stage_e_slot: slot %s of cap %r was no longer held by this connection "
                      "when released: the cap did not bind for this region", slot, cap)
        return released

    async def holding(self, slot: int, *, cap: str = DEFAULT_CAP) -> bool:
        """Whether this connection still holds the slot of `cap` (check before committing)."""
        _check_cap(cap)
        try:
            row = await self._line.one("SELECT stage_e_holding(%s, %s)", (cap, slot),
                                       connect=False)
        except _Unreachable:
            return False  # a new session would hold nothing
        except (psycopg.DataError, psycopg.ProgrammingError):
            raise  # bad arguments, or the extension is missing: a bug, not a lost slot
        except psycopg.Error as e:
            log.error("stage_e_slot: cannot tell whether slot %s of cap %r is held (%s); "
                      "treating it as not held", slot, cap, e)
            return False
        return bool(row is not None and row[0])

    @asynccontextmanager
    async def slot(self, n: int, *, cap: str = DEFAULT_CAP, wait: Wait = 0,
                   k: int = 1) -> AsyncIterator[Any]:
        """Yields a held slot of `cap` (with k > 1, a list of k slots), released on exit
        whatever happens (a cancellation included), or None when throttled; waits up to
        `wait` for it."""
        slots, generation = await self._take(n, k, cap, wait)
        try:
            yield None if slots is None else (slots[0] if k == 1 else slots)
        finally:
            if slots:
                await _shielded(self._release_all(slots, cap, generation))

    async def _release_all(self, slots: list[int], cap: str, generation: int) -> None:
        for slot in slots:
            await self._release(slot, cap, generation)

    async def close(self) -> None:
        """Closes the connection (which frees every slot it holds)."""
        self._line.drop()


# -- per event loop --------------------------------------------------------------------------

class _LoopConnections:
    def __init__(self) -> None:
        self.slots: dict[str, AsyncSlotConnection] = {}
        self.leases: dict[str, _AsyncDsnStatements] = {}

    def lines(self) -> list[_Line]:
        return [c._line for c in self.slots.values()] + [s._line for s in self.leases.values()]


_per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopConnections] = (
    weakref.WeakKeyDictionary())
_per_loop_strong: dict[asyncio.AbstractEventLoop, _LoopConnections] = {}  # loops without weakrefs
_per_loop_lock = threading.Lock()


def _sweep() -> None:
    """Closes the connections of loops that have ended (the sessions would linger otherwise:
    nothing tells us when a loop closes)."""
    for registry in (_per_loop, _per_loop_strong):
        for loop, conns in list(registry.items()):
            if loop.is_closed():
                for line in conns.lines():
                    line.drop()
                del registry[loop]


def _for_loop(what: str) -> _LoopConnections:
    loop = _running_loop(what)
    with _per_loop_lock:
        try:
            conns = _per_loop.get(loop)
            registry: Any = _per_loop
        except TypeError:
            conns, registry = _per_loop_strong.get(loop), _per_loop_strong
        if conns is None:
            _sweep()
            conns = registry[loop] = _LoopConnections()
        return conns


def connection_for(dsn: str) -> AsyncSlotConnection:
    """The running event loop's dedicated AsyncSlotConnection for `dsn` (made on first use)."""
    conns = _for_loop("stage_e_slots.aio.connection_for")
    if dsn not in conns.slots:
        conns.slots[dsn] = AsyncSlotConnection(dsn)
    return conns.slots[dsn]


@asynccontextmanager
async def stage_e_slot(dsn: str, cap: str = DEFAULT_CAP, *, n: int, wait: Wait = 0,
                       k: int = 1) -> AsyncIterator[Any]:
    """``async with stage_e_slot(dsn, "exports", n=4) as slot:`` on the running loop's
    dedicated connection; ``stage_e_slot(dsn, n=8)`` is the cap ``default``. ``wait=`` (seconds
    or a timedelta) waits that long for a slot; ``k=3`` takes three at once (a list)."""
    async with connection_for(dsn).slot(n, cap=cap, wait=wait, k=k) as slot:
        yield slot


# -- leases ----------------------------------------------------------------------------------

class _AsyncDsnStatements:
    """The statements of leases taken with a DSN, on the running loop's lease connection for
    it: autocommit, never prepared, re-opened whenever it breaks (a lease needs no particular
    session), and shared by the loop's tasks like the slot connection (a waiting lease gives
    way to a release)."""

    reconnects = True

    def __init__(self, dsn: str, *, connect_timeout: int = 5) -> None:
        self._line = _Line(dsn, f"stage_e_lease:{os.getpid()}:aio", connect_timeout,
                           prepare=False)
        # The tokens of the leases of live regions taken here (to find any nobody heard of).
        self.tokens: set[int] = set()

    async def row(self, query: str, params: tuple[object, ...]) -> Row | None:
        return await self._line.one(query, params, connect=True)

    async def take(self, cap: str, n: int, ttl: timedelta, wait: timedelta) -> Row | None:
        taken: Row | None = None

        def got(row: Row | None) -> bool:
            nonlocal taken
            if row is None or row[0] is None:
                return False
            taken = row
            self.tokens.add(int(row[1]))
            return True

        async def recover(conn: AsyncConn, why: str) -> None:
            await self._release_unknown(conn, cap, why)

        await self._line.call(lambda s: (_LEASE, (cap, n, ttl, timedelta(seconds=s))),
                              wait.total_seconds(), got=got, recover=recover)
        return taken

    async def _release_unknown(self, conn: AsyncConn, cap: str, why: str) -> None:
        try:
            cur = await conn.execute(_OWN_LEASES, (cap,))
            for slot, token in await cur.fetchall():
                if token not in self.tokens:
                    await conn.execute(_RELEASE_LEASE, (cap, slot, token))
                    log.warning("stage_e_lease: released the lease of slot %s of cap %r (token "
                                "%s), taken by %s whose answer was lost", slot, cap, token, why)
        except psycopg.Error as e:
            log.error("stage_e_lease: could not check the leases of cap %r after %s (%s): a "
                      "lease it took is freed when its ttl passes", cap, why, e)
            if _lost(conn, e):
                self._line.drop()

    def ended(self, token: int) -> None:
        self.tokens.discard(token)

    async def close(self) -> None:
        self._line.drop()


class _AsyncConnectionStatements:
    """The statements of leases taken on a psycopg AsyncConnection the caller owns: they run as
    they are (in the caller's transaction if one is open), never prepared, never on another
    connection of ours. A waiting lease occupies that connection for its wait."""

    reconnects = False

    def __init__(self, conn: Any) -> None:
        if not isinstance(conn, psycopg.AsyncConnection):
            hint = (" (a sync connection: use stage_e_slots.stage_e_lease)"
                    if callable(getattr(conn, "cursor", None)) else "")
            raise TypeError("stage_e_slots.aio.stage_e_lease needs a DSN (str) or a psycopg "
                            f"AsyncConnection, not {type(conn).__name__}{hint}")
        self.conn: AsyncConn = conn

    async def row(self, query: str, params: tuple[object, ...]) -> Row | None:
        conn = self.conn
        if conn.broken or conn.closed:
            raise _Unreachable("the connection is closed")
        try:
            # prepare=False: no server-side prepared statement, whatever the connection's
            # prepare_threshold (a transaction pooler would run the next use elsewhere).
            async with conn.cursor(row_factory=tuple_row) as cur:
                await cur.execute(query, params, prepare=False)
                return await cur.fetchone()
        except psycopg.Error as e:
            if conn.broken or conn.closed:
                raise _Unreachable(str(e)) from e
            raise

    async def take(self, cap: str, n: int, ttl: timedelta, wait: timedelta) -> Row | None:
        return await self.row(_LEASE, (cap, n, ttl, wait))

    def ended(self, token: int) -> None:
        pass


_Statements = Any  # _AsyncDsnStatements or _AsyncConnectionStatements


class AsyncLease(_LeaseState):
    """A slot of ``cap`` held by ``token`` until ``ttl`` passes unless renewed, as
    ``stage_e_lease`` yields it: the sync ``Lease``, with ``renew`` and ``still_held`` as
    coroutines. ``lost`` becomes True once a renewal or the release found it gone."""

    async def _row(self, query: str, params: tuple[object, ...]) -> Row | None:
        """A statement that may run twice (a renewal, a read): after a broken connection, once
        more on a fresh one (with a DSN)."""
        row: Row | None
        try:
            row = await self._st.row(query, params)
        except _Unreachable:
            if not self._st.reconnects:
                raise
            row = await self._st.row(query, params)
        return row

    async def renew(self, ttl: Ttl | None = None) -> bool:
        """Extends the lease to ``ttl`` (default: its own) from now: True when extended, False
        when the server says it is gone (``lost``). A renewal that cannot reach the server
        raises the driver's error and leaves the lease as it was; one cancelled midway leaves
        it renewed or not (the region's end releases it either way)."""
        if self._ended:
            raise RuntimeError(f"{self!r}: its region has ended")
        if self.lost:
            return False
        delay = self.ttl if ttl is None else _as_ttl(ttl)
        sent = time.monotonic()
        try:
            row = await self._row(_RENEW, (self.cap, self.slot, self.token, delay))
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

    async def still_held(self) -> bool:
        """Whether the lease is live now, per the server's holders view (does not extend it).
        An answer the server cannot give is False, logged; it does not mark the lease lost."""
        if self._ended or self.lost:
            return False
        try:
            row = await self._row(_LEASE_LIVE, (self.cap, self.slot, self.token))
        except Exception as e:  # classified below
            cause = e.__cause__ if isinstance(e, _Unreachable) else e
            if not isinstance(e, _Unreachable) and not _is_a(e, "OperationalError"):
                raise  # the extension missing, a bug: not an answer about the lease
            log.error("stage_e_lease: cannot tell whether the lease of slot %s of cap %r is "
                      "held (%s); treating it as not held", self.slot, self.cap, cause)
            return False
        return bool(row is not None and row[0])

    async def _release(self) -> bool | None:
        """Releases by token: True when released, False when the server found the lease gone,
        None when it could not be told (logged)."""
        args = (self.cap, self.slot, self.token)
        try:
            row = await self._st.row(_RELEASE_LEASE, args)
            return bool(row is not None and row[0])
        except _Unreachable as e:
            if not self._st.reconnects:
                log.error("stage_e_lease: the lease of slot %s of cap %r (token %s) could not be "
                          "released, its connection is gone (%s): the slot stays taken until "
                          "its ttl passes", self.slot, self.cap, self.token, e)
                return None
        except BaseException as e:
            log.error("stage_e_lease: the release of the lease of slot %s of cap %r (token %s) "
                      "failed (%s): the slot stays taken until its ttl passes", self.slot,
                      self.cap, self.token, e or type(e).__name__)
            if not isinstance(e, Exception):
                raise
            return None
        # The connection broke around the release, which may or may not have run: ask a
        # fresh one whether the lease is still there.
        try:
            row = await self._st.row(_LEASE_LIVE, args)
            if row is None:
                # Gone: our release ran, or the lease expired. Before our deadline it cannot
                # have expired; after it, a loss is reported rather than hidden.
                return time.monotonic() < self._deadline
            row = await self._st.row(_RELEASE_LEASE, args)
            return bool(row is not None and row[0])
        except BaseException as e:
            log.error("stage_e_lease: the lease of slot %s of cap %r (token %s) could not be "
                      "released (%s): the slot stays taken until its ttl passes", self.slot,
                      self.cap, self.token, e or type(e).__name__)
            if not isinstance(e, Exception):
                raise
            return None

    async def _end(self, failure: BaseException | None) -> None:
        """The region's end: releases by token (unless a renewal found the lease gone), and
        reports a lost lease (LeaseLost when the region ended normally, else a note)."""
        self._ended = True
        try:
            if not self.lost and await self._release() is False:
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


def _lease_statements(dsn: str) -> _AsyncDsnStatements:
    """The running loop's lease connection for `dsn` (made on first use)."""
    conns = _for_loop("stage_e_slots.aio.stage_e_lease")
    if dsn not in conns.leases:
        conns.leases[dsn] = _AsyncDsnStatements(dsn)
    return conns.leases[dsn]


async def _take_lease(statements: _Statements, cap: str, n: int, ttl: Ttl,
                      wait: Wait) -> AsyncLease | None:
    _check_cap(cap)
    delay, waiting = _as_ttl(ttl), _as_timedelta(wait)
    sent = time.monotonic()
    try:
        row = await statements.take(cap, n, delay, waiting)
    except Exception as e:  # noqa: BLE001 - _lease_failed re-raises all but load
        _lease_failed(cap, e)
        return None
    if row is None or row[0] is None:
        return None
    return AsyncLease(statements, cap, int(row[0]), int(row[1]), delay, sent)


@asynccontextmanager
async def stage_e_lease(dsn_or_async_connection: Any, cap: str, n: int, ttl: Ttl,
                        wait: Wait = 0) -> AsyncIterator[AsyncLease | None]:
    """``async with stage_e_lease(dsn_or_async_connection, "exports", 4, ttl=60) as lease:``
    holds one of the 4 slots of cap ``exports`` by a token for ``ttl``, waiting up to ``wait``
    for one; None when throttled. As the sync ``stage_e_slots.stage_e_lease`` (read it), on a
    DSN (the running loop's lease connection for it) or a psycopg ``AsyncConnection`` you own.
    The release on exit runs to its end even when the task is being cancelled; a lost lease
    raises ``LeaseLost`` at a normal exit, or is noted on the region's own exception."""
    if isinstance(dsn_or_async_connection, str):
        statements: _Statements = _lease_statements(dsn_or_async_connection)
    else:
        statements = _AsyncConnectionStatements(dsn_or_async_connection)
    lease = await _take_lease(statements, cap, n, ttl, wait)
    if lease is None:
        yield None
        return
    try:
        yield lease
    except BaseException as failure:
        await _shielded(lease._end(failure))
        raise
    await _shielded(lease._end(None))
