"""Hold a stage_e_slots slot on a connection you alone own.

A slot is a session-level advisory lock: it lives exactly as long as the connection that took
it. Holding it on a framework's connection (Django's ``django.db.connection``, a pool's) is the
bug this extension was born from: the framework closes or resets the connection mid-region and
the cap silently stops binding. This module keeps one dedicated autocommit connection per
process and thread, never shared with anything else, and fails closed: if it cannot talk to the
database, the caller is told "throttled", never "go ahead uncapped".

    from stage_e_slot import stage_e_slot

    with stage_e_slot(DSN, n=8) as slot:
        if slot is None:
            return "throttled"
        do_the_work()

Opening a connection costs milliseconds; the slot call itself a fraction of one. So the
connection is reused across calls (per thread, and re-opened after a fork or a failure).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

log = logging.getLogger("stage_e_slot")


class SlotConnection:
    """One dedicated autocommit connection for taking and releasing slots."""

    def __init__(self, dsn: str, *, application_name: str | None = None,
                 connect_timeout: int = 5) -> None:
        self.dsn = dsn
        self.application_name = application_name or f"stage_e_slot:{os.getpid()}"
        self.connect_timeout = connect_timeout
        self._conn: psycopg.Connection | None = None
        self._pid = os.getpid()

    def _connection(self) -> psycopg.Connection:
        # A connection must never cross a fork: the child would share the parent's session.
        if self._conn is not None and (self._pid != os.getpid() or self._conn.broken
                                       or self._conn.closed):
            self._drop()
        if self._conn is None:
            self._conn = psycopg.connect(self.dsn, autocommit=True,
                                         application_name=self.application_name,
                                         connect_timeout=self.connect_timeout)
            self._pid = os.getpid()
        return self._conn

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and self._pid == os.getpid():
            try:
                conn.close()  # closing the session frees any slot it still holds
            except Exception:  # noqa: BLE001 - already broken; nothing more to do
                pass

    def try_slot(self, n: int) -> int | None:
        """A slot of the cap n, or None when throttled or when the database is unreachable."""
        try:
            return self._connection().execute("SELECT stage_e_try_slot(%s)", (n,)).fetchone()[0]
        except psycopg.OperationalError as e:
            log.warning("stage_e_slot: treating as throttled, cannot reach the database: %s", e)
            self._drop()
            return None

    def release(self, slot: int) -> bool:
        """Gives the slot back; False (logged) if this connection no longer held it."""
        try:
            released = self._connection().execute(
                "SELECT stage_e_release(%s)", (slot,)).fetchone()[0]
        except Exception as e:  # noqa: BLE001 - any failure: drop the session, which frees it
            log.error("stage_e_slot: release of slot %s failed (%s); closing the connection",
                      slot, e)
            self._drop()
            return False
        if not released:
            log.error("stage_e_slot: slot %s was no longer held by this connection when "
                      "released: the cap did not bind for this region", slot)
        return bool(released)

    def holding(self, slot: int) -> bool:
        """Whether this connection still holds the slot (check before committing work)."""
        try:
            return bool(self._connection().execute(
                "SELECT stage_e_holding(%s)", (slot,)).fetchone()[0])
        except psycopg.Error:
            self._drop()
            return False

    @contextmanager
    def slot(self, n: int) -> Iterator[int | None]:
        """Yields a held slot (released on exit, whatever happens) or None when throttled."""
        slot = self.try_slot(n)
        try:
            yield slot
        finally:
            if slot is not None:
                self.release(slot)

    def close(self) -> None:
        self._drop()


_local = threading.local()


def connection_for(dsn: str) -> SlotConnection:
    """This thread's dedicated SlotConnection for `dsn` (created on first use)."""
    conns = getattr(_local, "conns", None)
    if conns is None:
        conns = _local.conns = {}
    if dsn not in conns:
        conns[dsn] = SlotConnection(dsn)
    return conns[dsn]


@contextmanager
def stage_e_slot(dsn: str, n: int) -> Iterator[int | None]:
    """``with stage_e_slot(dsn, n=8) as slot:`` on this thread's dedicated connection."""
    with connection_for(dsn).slot(n) as slot:
        yield slot
