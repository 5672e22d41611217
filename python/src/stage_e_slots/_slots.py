# Generated from _aio_slots.py by scripts/generate_sync.py; do not edit. Edit _aio_slots.py,
# then run `python scripts/generate_sync.py` (`make lint` checks this is current).
"""The sync API's session slots: ``SlotConnection``, ``connection_for`` and ``stage_e_slot``
(their docs are ``stage_e_slots``'). Private."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from ._common import (
    _HOLDERS,
    _TRY_RATE,
    DEFAULT_CAP,
    Per,
    Rate,
    RateDecision,
    Wait,
    _as_per,
    _as_timedelta,
    _check_cap,
    _check_key,
    _check_rate,
    _check_share,
    _rate_failed,
    _slot_query,
    _Unreachable,
    log,
)
from ._sync_line import APP_SUFFIX, Conn, Row, _connections, _fetch, _Line, _shielded


class SlotConnection:
    """One dedicated autocommit connection for taking and releasing slots of any cap.
    ``connection_for(dsn)`` is this thread's (with ``stage_e_slots.aio``: the running event
    loop's, whose tasks take turns on it; the methods are then coroutines and ``slot()`` an
    async context manager)."""

    def __init__(self, dsn: str, *, application_name: str | None = None,
                 connect_timeout: int = 5) -> None:
        self.dsn = dsn
        self.application_name = application_name or f"stage_e_slot:{os.getpid()}{APP_SUFFIX}"
        self.connect_timeout = connect_timeout
        # Slots the regions of this connection hold, per cap (to find any they did not hear of).
        self._held: dict[str, set[int]] = {}
        self._line = _Line(dsn, self.application_name, connect_timeout, prepare=True,
                           on_drop=self._held.clear)

    @property
    def _conn(self) -> Conn | None:
        """The session, when one is open."""
        return self._line.conn

    def _connection(self) -> Conn:
        """The session, opened if there is none."""
        with self._line.turn(connect=True) as turn:
            return turn.connection

    def try_slot(
            self, n: int, *, cap: str = DEFAULT_CAP, wait: Wait = 0, rate: Rate | None = None,
            share: str | None = None,
    ) -> int | None:
        """A slot of `cap` (in [0, n)), waiting up to `wait` (seconds or a timedelta) for one;
        None when throttled or when no slot can be had. With `rate`, the cap's rate policy is
        made that rate first (see ``stage_e_slot``); with `share`, in that fair share of the
        cap (see ``stage_e_slot``)."""
        if rate is not None and not self._rated(cap, rate):
            return None
        got, _ = self._take(n, 1, cap, wait, share)
        return None if got is None else got[0]

    def try_slots(
            self, n: int, k: int, *, cap: str = DEFAULT_CAP, wait: Wait = 0,
            rate: Rate | None = None, share: str | None = None,
    ) -> list[int] | None:
        """k distinct slots of `cap` (in [0, n)), all or none, waiting up to `wait` for them
        (in arrival order with the cap's other waiters, or in `share`'s turn); None when they
        could not all be had. With `rate`, the cap's rate policy is made that rate first (k
        slots charge k)."""
        if rate is not None and not self._rated(cap, rate):
            return None
        got, _ = self._take(n, k, cap, wait, share)
        return got

    def _take(
            self, n: int, k: int, cap: str, wait: Wait, share: str | None = None,
    ) -> tuple[list[int] | None, int]:
        _check_cap(cap)
        _check_share(share)
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

        def recover(conn: Conn, why: str) -> None:
            self._release_unknown(conn, cap, why)

        def build(wait: float) -> tuple[str, tuple[object, ...]] | None:
            if wait > 0 and self._waits_for_itself(cap, n, k):
                return None  # the line waits for a release of this connection's instead
            return _slot_query(cap, n, k, wait, share)

        try:
            generation = self._line.call(build, seconds, got=got, recover=recover)
        except _Unreachable as e:
            log.warning("stage_e_slot: treating as throttled (cap %r), cannot reach the "
                        "database: %s", cap, e)
            return None, -1
        except psycopg.OperationalError as e:
            # The session is fine (and may hold other caps' slots): it is kept, and any slot of
            # this cap the server took for the failed call was given back (`recover`).
            log.error("stage_e_slot: treating as throttled (cap %r), the server refused the "
                      "slot: %s", cap, e)
            return None, -1
        return taken, generation

    def _waits_for_itself(self, cap: str, n: int, k: int) -> bool:
        """Whether the slots this connection holds leave fewer than ``k`` of ``[0, n)`` that
        another session's release could free: then only this connection can serve the call (the
        server answers such a wait at once, as throttled)."""
        mine = sum(1 for s in self._held.get(cap, ()) if s < n)
        return mine > 0 and n - mine < k

    def _release_unknown(self, conn: Conn, cap: str, why: str) -> None:
        """Releases this session's slots of `cap` that no region holds: taken by `why`."""
        try:
            cur = conn.execute(_HOLDERS, (cap,))
            for (slot,) in cur.fetchall():
                if slot not in self._held.get(cap, set()):
                    conn.execute("SELECT stage_e_release(%s, %s)", (cap, slot))
                    log.log(logging.ERROR if why == "a call that then failed" else logging.WARNING,
                            "stage_e_slot: released slot %s of cap %r, taken by %s whose "
                            "answer was lost", slot, cap, why)
        except psycopg.Error as e:
            log.error("stage_e_slot: could not check the slots of cap %r after %s (%s); closing "
                      "the connection", cap, why, e)
            self._line.drop()

    def release(self, slot: int, *, cap: str = DEFAULT_CAP) -> bool:
        """Gives the slot of `cap` back; False (logged) if this connection no longer held it. A
        release that fails closes the connection, which frees the slot (and every other slot
        it held); a release never opens a new connection."""
        _check_cap(cap)
        return _shielded(self._release, slot, cap, None)

    def _release(self, slot: int, cap: str, generation: int | None) -> bool:
        line = self._line
        parent = line.forked_from()
        if parent is not None:
            log.error("stage_e_slot: slot %s of cap %r belongs to the connection of process %s; "
                      "a forked child does not release it", slot, cap, parent)
            line.drop()
            return False
        try:
            with line.turn(connect=False) as turn:
                conn = turn.conn
                if conn is None or (generation is not None and generation != line.generation):
                    # Another session's release would only be a foreign release: the session
                    # that took the slot is gone, and the slot with it.
                    log.error("stage_e_slot: slot %s of cap %r was lost with its connection "
                              "before its release: the cap did not bind for this region",
                              slot, cap)
                    return False
                self._held.get(cap, set()).discard(slot)
                line.note_release()
                try:
                    row = _fetch(conn, "SELECT stage_e_release(%s, %s)", (cap, slot))
                except BaseException as e:  # any failure: drop the session, which frees it
                    log.error("stage_e_slot: release of slot %s failed (cap %r: %s); closing the "
                              "connection, which frees it and any other slot it held", slot,
                              cap, e or type(e).__name__)
                    line.drop()
                    if not isinstance(e, Exception):
                        raise
                    return False
        except RuntimeError as e:  # aio: the connection belongs to another loop
            log.error("stage_e_slot: slot %s of cap %r cannot be released here: %s", slot, cap,
                      e)
            return False
        released = bool(row is not None and row[0])
        if not released:
            log.error("stage_e_slot: slot %s of cap %r was no longer held by this connection "
                      "when released: the cap did not bind for this region", slot, cap)
        return released

    def holding(self, slot: int, *, cap: str = DEFAULT_CAP) -> bool:
        """Whether this connection still holds the slot of `cap` (check before committing)."""
        _check_cap(cap)
        try:
            row = self._line.one(
                "SELECT stage_e_holding(%s, %s)", (cap, slot), connect=False)
        except _Unreachable as e:
            if e.__cause__ is not None:  # the session broke under the question
                log.error("stage_e_slot: cannot tell whether slot %s of cap %r is held (%s); "
                          "treating it as not held", slot, cap, e)
            return False  # a new session would hold nothing
        except (psycopg.DataError, psycopg.ProgrammingError):
            raise  # bad arguments, or the extension is missing: a bug, not a lost slot
        except psycopg.Error as e:
            log.error("stage_e_slot: cannot tell whether slot %s of cap %r is held (%s); "
                      "treating it as not held", slot, cap, e)
            return False
        return bool(row is not None and row[0])

    def try_rate(
            self, key: str, count: int, per: Per, *, burst: int = 1, cost: int = 1,
    ) -> RateDecision:
        """Whether a call on rate `key` (`count` calls per `per`, seconds or a timedelta, in
        bursts of up to `burst`) counting for `cost` calls may go now; counted when it may, in
        the same step (``stage_e_try_rate``, the extension at 0.10.0). Not allowed when the
        database cannot be reached or refuses the call (logged: fail closed); bad arguments
        raise."""
        _check_key(key)
        params = (key, count, _as_per(per), burst, cost)
        try:
            row = self._line.one(_TRY_RATE, params, connect=True)
        except (_Unreachable, psycopg.Error) as e:
            return _rate_failed(key, e)
        if row is None:
            raise RuntimeError("stage_e_try_rate returned no row")
        return RateDecision(bool(row[0]), int(row[1]), row[2], row[3])

    @contextmanager
    def slot(
            self, n: int, *, cap: str = DEFAULT_CAP, wait: Wait = 0, k: int = 1,
            rate: Rate | None = None, share: str | None = None,
    ) -> Iterator[Any]:
        """Yields a held slot of `cap` (with k > 1, a list of k slots), released on exit
        whatever happens, or None when throttled; waits up to `wait` for it. With `rate`, the
        cap's rate policy is made that rate first; with `share`, in that fair share of the cap
        (see ``stage_e_slot``)."""
        if rate is not None and not self._rated(cap, rate):
            yield None
            return
        slots, generation = self._take(n, k, cap, wait, share)
        try:
            yield None if slots is None else (slots[0] if k == 1 else slots)
        finally:
            if slots:
                _shielded(self._release_all, slots, cap, generation)

    def _rated(self, cap: str, rate: Rate) -> bool:
        """Whether `cap`'s rate policy is `rate`, made so if need be (once per process for
        this DSN); False (logged) when that could not be told: throttled."""
        _check_cap(cap)
        _check_rate(cap, rate)
        return self._line.ensure_rate(cap, rate)

    def _release_all(self, slots: list[int], cap: str, generation: int) -> None:
        for slot in slots:
            self._release(slot, cap, generation)

    def close(self) -> None:
        """Closes the connection (which frees every slot it holds)."""
        self._line.drop()


def connection_for(dsn: str) -> SlotConnection:
    """This thread's dedicated SlotConnection for `dsn` (with ``stage_e_slots.aio``: the
    running event loop's), made on first use."""
    conns = _connections("stage_e_slots.connection_for").slots
    found: SlotConnection | None = conns.get(dsn)
    if found is None:
        found = conns[dsn] = SlotConnection(dsn)
    return found


def try_rate(
        dsn: str, key: str, count: int, per: Per, *, burst: int = 1, cost: int = 1,
) -> RateDecision:
    """``try_rate(dsn, "api.example.com", 10, 1, burst=5)``: whether a call may go now at 10
    a second in bursts of 5, counted when it may, on the dedicated connection of
    ``connection_for(dsn)``. See ``SlotConnection.try_rate``."""
    return connection_for(dsn).try_rate(key, count, per, burst=burst, cost=cost)


@contextmanager
def stage_e_slot(
        dsn: str, cap: str = DEFAULT_CAP, *, n: int, wait: Wait = 0, k: int = 1,
        rate: Rate | None = None, share: str | None = None,
) -> Iterator[Any]:
    """``with stage_e_slot(dsn, "exports", n=4) as slot:`` on the dedicated connection of
    ``connection_for(dsn)``; ``stage_e_slot(dsn, n=8)`` is the cap ``default``. ``wait=``
    (seconds or a timedelta) waits that long for a slot; ``k=3`` takes three at once (a
    list).

    ``rate=Rate(10, 1, burst=5)`` makes that rate the cap's policy in the database (the
    extension at 0.10.0): from then on the server grants each acquisition of the cap, this
    process's and every other client's, only when a slot is free and the rate allows it,
    both in one step (docs/rates.md). On the first region with that rate for the cap and DSN
    in this process, the policy is read (``stage_e_rate_limits``) and, when it is absent or
    differs, set with ``stage_e_rate_limit`` in a transaction of its own, with a WARNING when
    it replaces a different one: the last writer wins, so give one cap one rate. Later regions
    send no statement more. Setting it needs EXECUTE on ``stage_e_rate_limit`` (revoked from
    PUBLIC); a role without it works when the policy is already the rate, and otherwise gets
    ``RatePolicyError`` (so does a database whose extension is older than 0.10.0), before
    anything is taken. The database unreachable is throttled (None), as always. A policy
    changed later (by an operator, another process) stands: this process does not look
    again until it restarts. ``rate=None`` sends nothing.

    ``share="tenant:42"`` takes the slot in that fair share of the cap (the extension at
    0.11.0, docs/shares.md): while shares compete for the cap, freed slots go to them by their
    weights, each within its ceiling (``stage_e_share``), so one tenant's backlog does not
    hold the others back; ``share=None`` is the cap's unnamed share."""
    with connection_for(dsn).slot(n, cap=cap, wait=wait, k=k, rate=rate,
                                        share=share) as slot:
        yield slot
