"""``stage_e_slots.django.stage_e_slot``: a slot for a region of Django code.

By default the slot is held on the dedicated connection of ``stage_e_slots.stage_e_slot`` (the
DSN from ``conf.dsn()``): Django never sees that connection, so nothing Django does mid-region
(``close_old_connections()``, a request's end, an error) can free the slot.

With ``STAGE_E_SLOTS_SESSION_CONNECTION = "<alias>"`` it is held on that Django connection
itself, which is the incident's configuration: when Django closes that connection mid-region
the slot goes with it and the cap stops binding. This module cannot prevent that, but it makes
it loud: the region remembers the driver connection its slot was taken on, and a release that
finds Django has closed or replaced it logs an ERROR and returns False, without running
``stage_e_release`` on the new session (where it would be a foreign release). The system check
stage_e_slots.W001 warns about the configuration before it runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from django.db import DatabaseError as DjangoDatabaseError
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from .._common import Rate, Wait, log
from .._slots import SlotConnection
from .._slots import stage_e_slot as _dedicated_slot
from .._sync_line import Conn, _Line
from .conf import dsn, session_connection_alias


class _DjangoLine(_Line):
    """A SlotConnection's line on a Django connection: opened by Django, "usable" only while
    Django still has it open, and closed through Django."""

    def __init__(self, alias: str, on_drop: Callable[[], None]) -> None:
        super().__init__(f"django connection {alias!r}", "", 0, prepare=True, on_drop=on_drop)
        self.alias = alias

    def wrapper(self) -> BaseDatabaseWrapper:
        return connections[self.alias]

    def replaced(self) -> bool:
        """Whether Django no longer has the connection our slots were taken on open (it
        closed it, and maybe opened another since)."""
        return self.conn is not None and self.wrapper().connection is not self.conn

    def usable(self) -> bool:
        return super().usable() and not self.replaced()

    def _open(self) -> Conn:
        wrapper = self.wrapper()
        try:
            wrapper.ensure_connection()
        except DjangoDatabaseError as e:
            # SlotConnection treats psycopg's OperationalError as "unreachable: throttled".
            raise psycopg.OperationalError(
                f"Django's connection {self.alias!r} cannot be opened: {e}") from e
        raw = wrapper.connection
        if not isinstance(raw, psycopg.Connection):
            raise TypeError(
                f"STAGE_E_SLOTS_SESSION_CONNECTION = {self.alias!r} needs Django's psycopg 3 "
                f"backend, but that connection is a {type(raw).__module__}."
                f"{type(raw).__name__}; install psycopg 3 (Django then prefers it) or "
                "unset the setting to use a dedicated connection")
        return raw

    def ensure_rate(self, cap: str, rate: Rate) -> bool:
        # Django's connection may be inside the caller's transaction, where a policy must not
        # be set (a rollback would undo it, and it would apply only at that commit).
        raise TypeError(
            f"SessionSlotConnection.slot(rate=...) on cap {cap!r}: a rate is set as the cap's "
            "policy in a transaction of its own, which Django's connection (perhaps inside "
            "your transaction) cannot give. Use stage_e_slots.stage_e_slot(dsn, ..., rate=...) "
            "on a dedicated connection, or set the policy once with SELECT "
            "stage_e_rate_limit(cap, count, per, burst) and take the slot without rate=")

    def _close(self, conn: Conn) -> None:
        # Django owns the connection. Close it (through Django, so that Django opens a fresh
        # one next time) only while it is still Django's current one: that frees its slots, as
        # SlotConnection's fail-safe wants; a connection Django already replaced is closed, and
        # the new one holds none of our slots.
        if self.wrapper().connection is conn:
            with contextlib.suppress(Exception):  # already broken: nothing more to do
                self.wrapper().close()


class SessionSlotConnection(SlotConnection):
    """A SlotConnection on a Django connection (``django.db.connections[alias]``) instead of a
    connection of its own: the slots are session locks of whatever psycopg connection Django
    has open for that alias when they are taken.

    Make one per region: it remembers the driver connection its slots were taken on, and
    counts them lost once Django has closed or replaced that connection, without releasing
    anything on Django's new session. Statements run on the driver connection directly (so
    psycopg's errors reach SlotConnection's fail-closed handling, not Django's wrappers), in
    Django's current transaction if one is open; session locks outlive its rollback. Needs
    Django's psycopg 3 backend (psycopg2 connections are refused with a TypeError)."""

    def __init__(self, alias: str = "default") -> None:
        super().__init__(f"django connection {alias!r}")
        self.alias = alias
        self._line = self._django = _DjangoLine(alias, self._held.clear)

    def _release(self, slot: int, cap: str, generation: int | None) -> bool:
        # Every release, a region's end's included, comes here.
        if self._django.replaced() and self._django.forked_from() is None:
            # Not released on the new session: there it would be a foreign release (counted,
            # warned about), and the slot is free anyway, freed when its session closed.
            wrapper = self._django.wrapper()
            log.error("stage_e_slots: slot %s of cap %r was lost: Django closed its connection "
                      "%r during the region (with CONN_MAX_AGE = %r, any close_old_connections() "
                      "does, as django-q2's ORM broker does on enqueue), and the slot went with "
                      "that session, so the cap did not bind for this region. Not released on "
                      "Django's new session. Fix: unset STAGE_E_SLOTS_SESSION_CONNECTION (a "
                      "dedicated connection, STAGE_E_SLOTS_DSN) or take a lease", slot, cap,
                      self.alias, wrapper.settings_dict.get("CONN_MAX_AGE", 0))
            self._held.get(cap, set()).discard(slot)
            return False
        return super()._release(slot, cap, generation)


@contextmanager
def stage_e_slot(cap: str, n: int, *, wait: Wait = 0, k: int = 1) -> Iterator[Any]:
    """``with stage_e_slot("exports", 4) as slot:`` one of the 4 slots of the cap ``exports``
    (None when throttled), released on exit; ``wait=`` (seconds or a timedelta) waits that
    long for one, ``k=3`` takes three at once (a list).

    Held on the dedicated connection for ``conf.dsn()`` (settings.STAGE_E_SLOTS_DSN, else
    DATABASES["default"] reached on a connection of its own), or, with
    STAGE_E_SLOTS_SESSION_CONNECTION set, on that Django connection, where a slot whose
    connection Django closed mid-region is reported lost (an ERROR in the log) at the exit."""
    alias = session_connection_alias()
    if alias is None:
        with _dedicated_slot(dsn(), cap, n=n, wait=wait, k=k) as slot:
            yield slot
        return
    with SessionSlotConnection(alias).slot(n, cap=cap, wait=wait, k=k) as slot:
        yield slot
