"""The connection machinery of ``stage_e_slots.aio``, hand-written (the asyncio modules
``_aio_slots.py`` and ``_aio_leases.py`` run on it; the sync ones generated from them run on
``_sync_line``, which has the same interface). Read ``stage_e_slots.aio``'s docstring for what
it promises; this module is private.

- ``_Line``: one psycopg AsyncConnection of one event loop, shared by its tasks in turns.
- ``_connections``: the connections of the running event loop (sync: of this thread).
- ``_AsyncConnectionStatements``: the statements of leases taken on a psycopg AsyncConnection
  the caller owns.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
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
    log,
)

T = TypeVar("T")
Row = tuple[Any, ...]
AsyncConn = psycopg.AsyncConnection[Any]

# What ends the connections' application_name (the sync API's end with the pid).
APP_SUFFIX = ":aio"
# Whether a lease taken by a call whose answer was lost (an interrupted wait, a cancelled
# task) is looked for and released at once (the sync API leaves it to its ttl).
RECOVER_LEASES = True

# An interrupt (cancel request) that reached the server before the statement it was for is
# ignored there; the statement still running this long after it gets another.
_INTERRUPT_RECHECK = 1.0
_INTERRUPTS = 5

def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: its caller may have been cancelled and never look


async def _shielded(work: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Runs ``work(*args)`` to its end even if the caller is cancelled meanwhile (a release cut
    off halfway would leave the slot held and unknown); the caller's cancellation still
    propagates."""
    task = asyncio.ensure_future(work(*args))
    task.add_done_callback(_retrieve)
    return await asyncio.shield(task)


async def _fetch(conn: AsyncConn, query: str, params: tuple[object, ...]) -> Row | None:
    cur = await conn.execute(query, params)
    row: Row | None = await cur.fetchone()
    return row


def _lost(conn: AsyncConn, e: psycopg.Error) -> bool:
    """Whether `e` means the session is gone (rather than a statement the server refused)."""
    sqlstate = e.sqlstate or ""
    return (conn.broken or conn.closed or sqlstate.startswith(("08", "57P"))
            or (not sqlstate and isinstance(e, psycopg.OperationalError)))


async def _cancel(conn: AsyncConn, timeout: float) -> None:
    cancel_safe = getattr(conn, "cancel_safe", None)  # psycopg 3.2+; before it, cancel()
    if cancel_safe is not None:
        await cancel_safe(timeout=timeout)
    else:
        await asyncio.get_running_loop().run_in_executor(None, conn.cancel)


def _running_loop(what: str) -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(f"{what} must be called from a coroutine running in an event loop "
                           "(its connection belongs to that loop); from sync code use "
                           "stage_e_slots' own API") from None


# A call's statement for a wait of so many seconds; None: only this connection can serve it.
Build = Callable[[float], "tuple[str, tuple[object, ...]] | None"]


class _OwnSlots:
    """What a turn answers when only this connection's own release could serve its call: the
    connection's release count then."""

    def __init__(self, releases: int) -> None:
        self.releases = releases


class _Turn:
    """One call's hold of a _Line's connection, from its turn to the end of its statements."""

    def __init__(self) -> None:
        self.conn: AsyncConn | None = None
        # The head's server-side wait, which a non-waiting call queueing behind it interrupts.
        self.preemptible = False
        self.cancel: asyncio.Task[None] | None = None
        self.done = asyncio.Event()
        # Work that must end before the next call's statement is sent (an interrupt whose
        # cancel request is in flight would hit that statement instead).
        self.after: list[asyncio.Future[Any]] = []

    @property
    def connection(self) -> AsyncConn:
        if self.conn is None:
            raise _Unreachable("no connection")
        return self.conn

    def statement_ended(self) -> None:
        self.preemptible = False
        self.done.set()

    async def settle(self) -> None:
        """Waits until an interrupt sent for this turn's statement is done with."""
        if self.cancel is not None:
            await asyncio.shield(self.cancel)


def _loop_ref(loop: asyncio.AbstractEventLoop) -> Callable[[], asyncio.AbstractEventLoop | None]:
    try:
        return weakref.ref(loop)
    except TypeError:  # a loop class without weak references: keep it (a process has few)
        return lambda: loop


class _Line:
    """One psycopg AsyncConnection of one event loop, shared by its tasks: one statement at a
    time in arrival order; at most one server-side wait at a time, the head's, interrupted
    when a non-waiting call queues behind it; the other waiting calls queue client-side for
    the head position (see stage_e_slots.aio's docstring). Never used from another loop or a
    forked child."""

    def __init__(self, dsn: str, application_name: str, connect_timeout: int, *,
                 prepare: bool, on_drop: Callable[[], None] | None = None) -> None:
        self.dsn = dsn
        self.application_name = application_name
        self.connect_timeout = connect_timeout
        self._prepare = prepare
        self._on_drop = on_drop
        self.conn: AsyncConn | None = None
        self._pid = os.getpid()
        self._loop: Callable[[], asyncio.AbstractEventLoop | None] | None = None
        # Turns on the connection, in arrival order: the head and the non-waiting calls.
        self._lock: asyncio.Lock | None = None
        # The head position: the waiting calls, in arrival order; its holder is the head.
        self._head: asyncio.Lock | None = None
        self._turn: _Turn | None = None
        # Calls queued for the connection (behind the head, the non-waiting ones).
        self.queued = 0
        # Bumped whenever the connection is dropped: a region's slot taken on an earlier
        # connection went with it, and its release must not run on the new one.
        self.generation = 0
        # Bumped by each release on the connection (and each drop), which wakes a waiting call
        # that only this connection's own slots kept out (``_OwnSlots``).
        self.releases = 0
        self._released: asyncio.Event | None = None

    def forked_from(self) -> int | None:
        """The pid of the process whose connection this is, when that is not this one."""
        return self._pid if self.conn is not None and self._pid != os.getpid() else None

    def usable(self) -> bool:
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
        if not self.loop_closed():
            self.note_release()  # every slot went with the session
        if conn is not None and self._pid == os.getpid():
            try:
                conn.pgconn.finish()  # what close() does, without needing its loop
            except Exception:  # noqa: BLE001, S110 - already broken; nothing more to do
                pass

    def loop_closed(self) -> bool:
        loop = self._loop() if self._loop is not None else None
        return loop is None or loop.is_closed()

    def _bind(self) -> tuple[asyncio.Lock, asyncio.Lock]:
        """(the connection's lock, the head's lock) of the running loop."""
        loop = _running_loop("stage_e_slots.aio")
        bound = self._loop() if self._loop is not None else None
        if self._pid != os.getpid():
            self.drop()  # a forked child: the parent's connection and loop are not its own
            bound = None
        if bound is loop and self._lock is not None and self._head is not None:
            return self._lock, self._head
        if bound is not None and not bound.is_closed():
            raise RuntimeError(f"this connection to {self.dsn!r} belongs to another running "
                               "event loop: a connection must not cross loops; use "
                               "stage_e_slots.aio.connection_for(dsn), one per loop")
        # First use, or the loop it served has ended (a second asyncio.run): start afresh.
        self.drop()
        self._pid = os.getpid()
        self._loop, self._turn, self.queued = _loop_ref(loop), None, 0
        self._released = None
        self._lock, self._head = asyncio.Lock(), asyncio.Lock()
        return self._lock, self._head

    def note_release(self) -> None:
        """A release ran on this connection: a call waiting for its own slots tries again."""
        self.releases += 1
        event, self._released = self._released, None
        if event is not None:
            event.set()

    async def _until_released(self, since: int, timeout: float) -> bool:
        """Whether a release ran on this connection since ``since`` (waiting up to ``timeout``
        seconds for one)."""
        if self.releases != since:
            return True
        if timeout <= 0:
            return False
        if self._released is None:
            self._released = asyncio.Event()
        try:
            await asyncio.wait_for(self._released.wait(), timeout)
        except asyncio.TimeoutError:
            return self.releases != since
        return True

    def _preempt(self) -> None:
        turn = self._turn
        if turn is not None and turn.preemptible and turn.cancel is None \
                and turn.conn is not None:
            turn.cancel = asyncio.ensure_future(self._interrupt(turn))

    async def _interrupt(self, turn: _Turn) -> None:
        assert turn.conn is not None
        for _ in range(_INTERRUPTS):
            try:
                await _cancel(turn.conn, float(self.connect_timeout))
            except Exception as e:  # noqa: BLE001 - the wait then runs to its end; say so
                log.warning("stage_e_slots.aio: could not interrupt a wait to let another call "
                            "through (%s); that call runs once the wait ends", e)
                return
            try:
                await asyncio.wait_for(turn.done.wait(), _INTERRUPT_RECHECK)
                return
            except asyncio.TimeoutError:
                pass  # the request reached the server before the statement did: once more
        log.warning("stage_e_slots.aio: a wait did not answer %s interrupts; the calls queued "
                    "behind it run once it ends", _INTERRUPTS)

    @asynccontextmanager
    async def turn(self, *, connect: bool) -> AsyncIterator[_Turn]:
        """The connection, for this call alone, once the calls queued before it are done.
        ``connect``: open one if there is none (a release never does: ``turn.conn`` is then
        None). Raises _Unreachable when it cannot be opened."""
        lock = self._bind()[0]
        self.queued += 1
        try:
            self._preempt()  # only the head's wait is preemptible: no other waits here
            await lock.acquire()
        finally:
            self.queued -= 1
        turn = _Turn()
        try:
            if self.conn is not None and not self.usable():
                self.drop()
            if self.conn is None and connect:
                try:
                    self.conn = await psycopg.AsyncConnection.connect(
                        self.dsn, autocommit=True, application_name=self.application_name,
                        connect_timeout=self.connect_timeout,
                        **({} if self._prepare else {"prepare_threshold": None}))
                except psycopg.OperationalError as e:
                    raise _Unreachable(str(e)) from e
                self._pid = os.getpid()
            turn.conn = self.conn
            self._turn = turn
            yield turn
        finally:
            self._turn = None
            pending = [f for f in (turn.cancel, *turn.after) if f is not None and not f.done()]
            if pending:
                # Not before they end: no statement may follow a cancel request in flight.
                gathered = asyncio.gather(*pending, return_exceptions=True)
                gathered.add_done_callback(lambda _: lock.release())
            else:
                lock.release()

    async def one(self, query: str, params: tuple[object, ...], *, connect: bool) -> Row | None:
        """One short statement in its turn. Raises _Unreachable when there is no connection
        (and ``connect`` is False) or it broke (it is then dropped)."""
        async with self.turn(connect=connect) as turn:
            conn = turn.connection
            try:
                return await _fetch(conn, query, params)
            except psycopg.Error as e:
                if _lost(conn, e):
                    self.drop()
                    raise _Unreachable(str(e)) from e
                raise
            except BaseException:  # cancelled: psycopg cancelled the statement and waited
                if not self.usable():
                    self.drop()
                raise

    async def ensure_rate(self, cap: str, rate: Rate) -> bool:
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
            row = await self.one(_RATE_OF, (cap,), connect=True)
            if _rate_to_set(rate, row):
                await self.one(_SET_RATE, (cap, rate.count, rate.per, rate.burst), connect=True)
                _rate_was_set(cap, rate, row)
        except (_Unreachable, psycopg.Error) as e:
            return _rate_not_set(cap, rate, row, e)
        _ENSURED.add(key)
        return True

    async def _recover(self, turn: _Turn, recover: Callable[[AsyncConn, str], Awaitable[None]],
                       conn: AsyncConn, why: str) -> None:
        async def settle_then_recover() -> None:
            await turn.settle()
            if self.conn is conn and self.usable():
                await recover(conn, why)

        task = asyncio.ensure_future(settle_then_recover())
        turn.after.append(task)
        await asyncio.shield(task)

    async def call(self, build: Build, wait: float,
                   *, got: Callable[[Row | None], bool],
                   recover: Callable[[AsyncConn, str], Awaitable[None]]) -> int:
        """Runs ``build(seconds)``, a statement that waits up to ``seconds`` in the server, for
        at most ``wait`` seconds in all; ``got(row)`` is called in the turn, as the row arrives.
        With ``wait``, the call first queues (in arrival order, behind the other waiting calls)
        to be the line's one waiter, the head; the head waits in the server with what is left
        of ``wait``, and when a non-waiting call interrupts it, queues for the connection again
        with what is then left, still the head. A call whose ``wait`` passes before it is the
        head tries once without waiting. So the server sees at most one wait per call that
        ends without what it wanted, and counts one throttle for it (an interrupted wait counts
        none). ``recover(conn, why)`` gives back what the server may have handed out to a
        statement whose answer was lost (an interrupt or a cancellation landing just then, a
        server error). Returns the connection's generation. Raises _Unreachable when the
        database cannot be reached (the connection is dropped), and the server's other
        errors.

        ``build(seconds)`` returns None instead of a statement when only this connection's own
        slots keep the call from what it asks (the server would answer such a wait at once,
        throttled: it waits for itself there). Here another task of the loop may release them:
        the head waits in the client for a release on the connection, then asks again; once its
        wait has passed it tries once (its one throttle)."""
        if wait <= 0:
            return await self._until_answered(build, 0.0, got, recover)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        head = self._bind()[1]
        try:
            await asyncio.wait_for(head.acquire(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            # Its wait passed while other waiters were served: one try, which takes a slot
            # freed meanwhile, or is this call's one throttle.
            return await self._until_answered(build, 0.0, got, recover)
        try:
            return await self._until_answered(build, deadline, got, recover, loop=loop)
        finally:
            head.release()

    async def _until_answered(self, build: Build, until: float,
                              got: Callable[[Row | None], bool],
                              recover: Callable[[AsyncConn, str], Awaitable[None]], *,
                              loop: asyncio.AbstractEventLoop | None = None) -> int:
        """The statement with a wait up to ``until`` (the loop's time; without ``loop``, no
        wait), again after each interrupt, until the server answers it."""
        while True:
            seconds = 0.0 if loop is None else max(0.0, until - loop.time())
            generation = await self._attempt(build, seconds, got, recover)
            if isinstance(generation, _OwnSlots):
                assert loop is not None  # build(0) is always a statement
                if not await self._until_released(generation.releases, until - loop.time()):
                    loop = None  # its wait has passed: one try
                continue
            if generation is not None:
                return generation
            # Interrupted (no answer, nothing counted as throttled): queue again, behind the
            # call that interrupted it, for what is left.

    async def _attempt(self, build: Build, seconds: float, got: Callable[[Row | None], bool],
                       recover: Callable[[AsyncConn, str], Awaitable[None]],
                       ) -> int | None | _OwnSlots:
        """One turn: the statement built for ``seconds``. The generation when the server
        answered it (``got`` called), None when a non-waiting call interrupted it, or was
        queued for the connection when this turn came (then nothing was sent); ``_OwnSlots``
        when only this connection's release can serve it (nothing was sent)."""
        async with self.turn(connect=True) as turn:
            if seconds > 0 and self.queued:
                # Calls queued while it waited for its turn (they found no wait to interrupt):
                # let them go first rather than start a wait they would have to interrupt.
                return None
            conn = turn.connection
            built = build(seconds)
            if built is None:
                return _OwnSlots(self.releases)
            query, params = built
            turn.preemptible = seconds > 0
            try:
                row = await _fetch(conn, query, params)
            except psycopg.Error as e:
                turn.statement_ended()
                if _lost(conn, e):
                    self.drop()
                    raise _Unreachable(str(e)) from e
                interrupted = (turn.cancel is not None
                               and isinstance(e, psycopg.errors.QueryCanceled))
                if isinstance(e, psycopg.OperationalError):
                    await self._recover(turn, recover, conn, "an interrupted wait"
                                        if interrupted else "a call that then failed")
                if interrupted:
                    return None
                raise
            except BaseException:
                turn.statement_ended()
                if self.usable():
                    await self._recover(turn, recover, conn, "a call that was cancelled")
                else:
                    self.drop()
                raise
            turn.statement_ended()
            got(row)
            return self.generation


# -- per event loop --------------------------------------------------------------------------

class _LoopConnections:
    """The dedicated connections of one event loop, by DSN."""

    def __init__(self) -> None:
        self.slots: dict[str, Any] = {}  # AsyncSlotConnection
        self.leases: dict[str, Any] = {}  # _AsyncDsnStatements

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


def _connections(what: str) -> _LoopConnections:
    """The running loop's connections (``what`` names the caller in the error when no loop is
    running)."""
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


# -- leases on the caller's connection ---------------------------------------------------------

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

    async def take(
            self, cap: str, n: int, ttl: timedelta, wait: timedelta, share: str | None = None,
    ) -> Row | None:
        return await self.row(*_lease_query(cap, n, ttl, wait, share))

    def ended(self, token: int) -> None:
        pass
