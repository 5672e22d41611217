"""Hold a stage_e_slots slot of a named cap on a connection you alone own.

A slot is a session-level advisory lock: it lives exactly as long as the connection that took
it. Holding it on a framework's connection (Django's ``django.db.connection``, a pool's) is the
bug this extension was born from: the framework closes or resets the connection mid-region and
the cap silently stops binding. This module keeps one dedicated autocommit connection per
process and thread, never shared with anything else, and fails closed: if it cannot talk to the
database, the caller is told "throttled", never "go ahead uncapped".

Each cap has a name and its own slots: ``stage_e_slot(DSN, "exports", n=4)`` takes one of the
4 slots of the cap ``exports``, whatever the other caps hold. Leaving the name out is the cap
``default``, the one the SQL functions' one-argument forms use::

    from stage_e_slots import stage_e_slot

    with stage_e_slot(DSN, "exports", n=4) as slot:
        if slot is None:
            return "throttled"       # counted on the exports row of stage_e_throttle_totals
        do_the_work()

    with stage_e_slot(DSN, n=8) as slot:   # the cap named "default"
        ...

    with stage_e_slot(DSN, "exports", n=4, wait=30) as slot:   # wait up to 30 s for a slot
        ...

    with stage_e_slot(DSN, "exports", n=8, k=3) as slots:      # three slots at once, a list
        ...

A waiting call is woken as soon as a slot frees, and waiters are served in arrival order
(a big request at the head is not overtaken by small ones); ``wait`` is seconds or a
``timedelta``; a call that times out is throttled (None). Waiting needs the extension at
0.3.0 or later in the database.

The slots of every cap this thread holds live on its one connection, so regions of different
caps nest freely. ``connection_for(DSN)`` is that connection's ``SlotConnection``: its
``try_slot``, ``release``, ``holding`` and ``slot`` take the cap as the keyword ``cap``
(default ``"default"``), e.g. ``connection_for(DSN).holding(slot, cap="exports")`` before
committing work.

Failures:

- The database cannot be reached (or the connection broke): the slot is "throttled" (None),
  with a WARNING in the log, and the broken connection is replaced on the next call.
- The server refuses the slot with an operational error (no room for one more cap,
  ``stage_e_slots.max_caps``; the extension not preloaded; a statement timeout): also None,
  logged as an ERROR, and the connection is kept, so the slots of the other caps this thread
  holds on it stay held.
- Bad arguments (an empty or over-long cap name, n out of range) raise, and so does a database
  without the extension at version 0.2.0 or later (``ALTER EXTENSION stage_e_slots UPDATE``):
  they are bugs to fix, not load.
- A release that fails closes the connection, which frees the slot; it also frees every other
  slot the thread held on it, and their regions' releases then report them lost. A release
  never opens a new connection: a slot can only be given back by the session that took it.

Opening a connection costs milliseconds; the slot call itself a fraction of one. So the
connection is reused across calls (per thread, and re-opened after a fork or a failure).

Leases (the extension at 0.4.0): ``stage_e_lease`` holds a slot by a token for a ttl instead
of by a session, so it works on any connection, a framework's or a transaction pooler's
included; see its docstring::

    with stage_e_lease(DSN_or_connection, "exports", 4, ttl=60) as lease:
        if lease is None:
            return "throttled"
        for chunk in work:
            do(chunk)
            if not lease.renew():    # False: the lease is gone, stop (the exit reports it)
                break

The same for asyncio (one connection per event loop) is ``stage_e_slots.aio``; a decorator,
``stage_e_slots.capped``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Union

import psycopg

log = logging.getLogger("stage_e_slots")

DEFAULT_CAP = "default"


def _value(conn: psycopg.Connection, query: str, params: tuple[object, ...]) -> Any:
    """The one value of a one-row SELECT."""
    row = conn.execute(query, params).fetchone()
    return row[0] if row is not None else None


Wait = Union[float, int, timedelta]


def _as_timedelta(wait: Wait) -> timedelta:
    delay = wait if isinstance(wait, timedelta) else timedelta(seconds=wait)
    if delay < timedelta(0):
        raise ValueError(f"wait must not be negative: {wait!r}")
    return delay


def _check_cap(cap: str) -> None:
    # A cap is a name; an int here is almost surely n passed in its place.
    if not isinstance(cap, str):
        raise TypeError(f"cap must be a cap name (str), not {type(cap).__name__}: {cap!r}")


class SlotConnection:
    """One dedicated autocommit connection for taking and releasing slots of any cap."""

    def __init__(self, dsn: str, *, application_name: str | None = None,
                 connect_timeout: int = 5) -> None:
        self.dsn = dsn
        self.application_name = application_name or f"stage_e_slot:{os.getpid()}"
        self.connect_timeout = connect_timeout
        self._conn: psycopg.Connection | None = None
        self._pid = os.getpid()
        # Slots this object took on its connection, per cap (to find any it did not hear of).
        self._held: dict[str, set[int]] = {}

    def _usable(self) -> bool:
        """Whether the current connection is this process's and still alive."""
        conn = self._conn
        return (conn is not None and self._pid == os.getpid() and not conn.broken
                and not conn.closed)

    def _connection(self) -> psycopg.Connection:
        # A connection must never cross a fork: the child would share the parent's session.
        if self._conn is not None and not self._usable():
            self._drop()
        if self._conn is None:
            self._conn = psycopg.connect(self.dsn, autocommit=True,
                                         application_name=self.application_name,
                                         connect_timeout=self.connect_timeout)
            self._pid = os.getpid()
        return self._conn

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self._held.clear()
        if conn is not None and self._pid == os.getpid():
            try:
                conn.close()  # closing the session frees any slot it still holds
            except Exception:  # noqa: BLE001, S110 - already broken; nothing more to do
                pass

    @staticmethod
    def _connection_lost(conn: psycopg.Connection, e: psycopg.Error) -> bool:
        """Whether `e` means the session is gone (rather than a statement the server refused)."""
        sqlstate = e.sqlstate or ""
        return (conn.broken or conn.closed or not sqlstate
                or sqlstate.startswith(("08", "57P")))

    def try_slot(self, n: int, *, cap: str = DEFAULT_CAP, wait: Wait = 0) -> int | None:
        """A slot of `cap` (in [0, n)), waiting up to `wait` (seconds or a timedelta) for one;
        None when throttled or when no slot can be had."""
        got = self.try_slots(n, 1, cap=cap, wait=wait)
        return None if got is None else got[0]

    def try_slots(self, n: int, k: int, *, cap: str = DEFAULT_CAP,
                  wait: Wait = 0) -> list[int] | None:
        """k distinct slots of `cap` (in [0, n)), all or none, waiting up to `wait` for them
        (in arrival order with the cap's other waiters); None when they could not all be had."""
        _check_cap(cap)
        delay = _as_timedelta(wait)
        params: tuple[object, ...]
        if k == 1 and not delay:
            query, params = "SELECT ARRAY[stage_e_try_slot(%s, %s)]", (cap, n)
        elif k == 1:
            query, params = "SELECT ARRAY[stage_e_try_slot(%s, %s, %s)]", (cap, n, delay)
        else:
            query, params = "SELECT stage_e_try_slots(%s, %s, %s, %s)", (cap, n, k, delay)
        try:
            conn = self._connection()
        except psycopg.OperationalError as e:
            log.warning("stage_e_slot: treating as throttled (cap %r), cannot reach the "
                        "database: %s", cap, e)
            return None
        try:
            got = _value(conn, query, params)
        except psycopg.OperationalError as e:
            if self._connection_lost(conn, e):
                log.warning("stage_e_slot: treating as throttled (cap %r), cannot reach the "
                            "database: %s", cap, e)
                self._drop()
            else:
                # The session is fine (and may hold other caps' slots): keep it. But the error
                # may have come after the server took a slot (a cancel or statement_timeout
                # landing just then): a slot we did not hear of would be held until the
                # connection closes, so give back any of this cap we do not know.
                log.error("stage_e_slot: treating as throttled (cap %r), the server refused "
                          "the slot: %s", cap, e)
                self._release_unknown(conn, cap)
            return None
        if got is None or got[0] is None:
            return None
        slots = [int(s) for s in got]
        self._held.setdefault(cap, set()).update(slots)
        return slots

    def _release_unknown(self, conn: psycopg.Connection, cap: str) -> None:
        """Releases this session's slots of `cap` that no region of ours holds."""
        try:
            rows = conn.execute("SELECT slot FROM stage_e_slot_holders "
                                "WHERE pid = pg_backend_pid() AND cap = %s", (cap,)).fetchall()
            for (slot,) in rows:
                if slot not in self._held.get(cap, set()):
                    conn.execute("SELECT stage_e_release(%s, %s)", (cap, slot))
                    log.error("stage_e_slot: released slot %s of cap %r, taken by a call that "
                              "then failed", slot, cap)
        except psycopg.Error as e:
            log.error("stage_e_slot: could not check the slots of cap %r after a failed call "
                      "(%s); closing the connection", cap, e)
            self._drop()

    def release(self, slot: int, *, cap: str = DEFAULT_CAP) -> bool:
        """Gives the slot of `cap` back; False (logged) if this connection no longer held it."""
        _check_cap(cap)
        if not self._usable():
            # Another session's release would only be a foreign release: either the session
            # that took the slot is gone, and the slot with it, or it is the parent's (forked).
            if self._conn is not None and self._pid != os.getpid():
                log.error("stage_e_slot: slot %s of cap %r belongs to the connection of process "
                          "%s; a forked child does not release it", slot, cap, self._pid)
            else:
                log.error("stage_e_slot: slot %s of cap %r was lost with its connection before "
                          "its release: the cap did not bind for this region", slot, cap)
            self._drop()
            return False
        conn = self._connection()
        self._held.get(cap, set()).discard(slot)
        try:
            released = _value(conn, "SELECT stage_e_release(%s, %s)", (cap, slot))
        except Exception as e:  # noqa: BLE001 - any failure: drop the session, which frees it
            log.error("stage_e_slot: release of slot %s failed (cap %r: %s); closing the "
                      "connection, which frees it and any other slot it held", slot, cap, e)
            self._drop()
            return False
        if not released:
            log.error("stage_e_slot: slot %s of cap %r was no longer held by this connection "
                      "when released: the cap did not bind for this region", slot, cap)
        return bool(released)

    def holding(self, slot: int, *, cap: str = DEFAULT_CAP) -> bool:
        """Whether this connection still holds the slot of `cap` (check before committing)."""
        _check_cap(cap)
        if not self._usable():
            self._drop()
            return False  # a new session would hold nothing
        conn = self._connection()
        try:
            return bool(_value(conn, "SELECT stage_e_holding(%s, %s)", (cap, slot)))
        except (psycopg.DataError, psycopg.ProgrammingError):
            raise  # bad arguments, or the extension is missing: a bug, not a lost slot
        except psycopg.Error as e:
            log.error("stage_e_slot: cannot tell whether slot %s of cap %r is held (%s); "
                      "treating it as not held", slot, cap, e)
            if self._connection_lost(conn, e):
                self._drop()
            return False

    @contextmanager
    def slot(self, n: int, *, cap: str = DEFAULT_CAP, wait: Wait = 0,
             k: int = 1) -> Iterator[Any]:
        """Yields a held slot of `cap` (with k > 1, a list of k slots), released on exit
        whatever happens, or None when throttled; waits up to `wait` for it."""
        slots = self.try_slots(n, k, cap=cap, wait=wait)
        try:
            yield None if slots is None else (slots[0] if k == 1 else slots)
        finally:
            for slot in slots or []:
                self.release(slot, cap=cap)

    def close(self) -> None:
        self._drop()


_local = threading.local()


def connection_for(dsn: str) -> SlotConnection:
    """This thread's dedicated SlotConnection for `dsn` (created on first use)."""
    conns: dict[str, SlotConnection] | None = getattr(_local, "conns", None)
    if conns is None:
        conns = _local.conns = {}
    if dsn not in conns:
        conns[dsn] = SlotConnection(dsn)
    return conns[dsn]


@contextmanager
def stage_e_slot(dsn: str, cap: str = DEFAULT_CAP, *, n: int, wait: Wait = 0,
                 k: int = 1) -> Iterator[Any]:
    """``with stage_e_slot(dsn, "exports", n=4) as slot:`` on this thread's dedicated
    connection; ``stage_e_slot(dsn, n=8)`` is the cap ``default``. ``wait=`` (seconds or a
    timedelta) waits that long for a slot; ``k=3`` takes three at once (a list)."""
    with connection_for(dsn).slot(n, cap=cap, wait=wait, k=k) as slot:
        yield slot
