"""What the sync and asyncio APIs share and that does no I/O: the logger, argument checks, the
SQL of slots and leases, the exceptions, and how a lease statement's error is classified.
Private; the public names are re-exported by ``stage_e_slots`` and ``stage_e_slots.aio``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Union

log = logging.getLogger("stage_e_slots")

DEFAULT_CAP = "default"

Wait = Union[float, int, timedelta]
Ttl = Union[float, int, timedelta]
Per = Union[float, int, timedelta]

# A session's slots of a cap (leases excluded: they are not the session's).
_HOLDERS = ("SELECT slot FROM stage_e_slot_holders WHERE pid = pg_backend_pid() AND cap = %s "
            "AND expires_at IS NULL")
_LEASE = "SELECT slot, token FROM stage_e_lease(%s, %s, %s, %s)"
_RENEW = "SELECT stage_e_renew(%s, %s, %s, %s)"
_RELEASE_LEASE = "SELECT stage_e_release_lease(%s, %s, %s)"
_TRY_RATE = ("SELECT allowed, remaining, retry_after, reset_after "
             "FROM stage_e_try_rate(%s, %s, %s, %s, %s)")
# The lease's row of the holders view, live now (this never extends it).
_LEASE_LIVE = ("SELECT expires_at > clock_timestamp() FROM stage_e_slot_holders "
               "WHERE cap = %s AND slot = %s AND token = %s")
# A lease's pid is the backend that took it: those taken in this very session (a pid can be
# reused by a later backend; acquired_at tells this session's from an earlier one's).
_OWN_LEASES = ("SELECT slot, token FROM stage_e_slot_holders WHERE pid = pg_backend_pid() "
               "AND cap = %s AND token IS NOT NULL AND acquired_at >= "
               "(SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid())")


def _slot_query(cap: str, n: int, k: int, seconds: float) -> tuple[str, tuple[object, ...]]:
    """The statement taking k slots of `cap` (in [0, n)), waiting up to `seconds` in the
    server."""
    delay = timedelta(seconds=seconds)
    if k == 1 and not delay:
        return "SELECT ARRAY[stage_e_try_slot(%s, %s)]", (cap, n)
    if k == 1:
        return "SELECT ARRAY[stage_e_try_slot(%s, %s, %s)]", (cap, n, delay)
    return "SELECT stage_e_try_slots(%s, %s, %s, %s)", (cap, n, k, delay)


def _as_timedelta(wait: Wait) -> timedelta:
    delay = wait if isinstance(wait, timedelta) else timedelta(seconds=wait)
    if delay < timedelta(0):
        raise ValueError(f"wait must not be negative: {wait!r}")
    return delay


def _check_cap(cap: str) -> None:
    # A cap is a name; an int here is almost surely n passed in its place.
    if not isinstance(cap, str):
        raise TypeError(f"cap must be a cap name (str), not {type(cap).__name__}: {cap!r}")


def _as_ttl(ttl: Ttl) -> timedelta:
    delay = ttl if isinstance(ttl, timedelta) else timedelta(seconds=ttl)
    if delay <= timedelta(0):
        raise ValueError(f"ttl must be positive: {ttl!r}")
    return delay


def _as_per(per: Per) -> timedelta:
    delay = per if isinstance(per, timedelta) else timedelta(seconds=per)
    if delay <= timedelta(0):
        raise ValueError(f"per must be positive: {per!r}")
    return delay


def _check_key(key: str) -> None:
    if not isinstance(key, str):
        raise TypeError(f"key must be a rate key (str), not {type(key).__name__}: {key!r}")


@dataclass(frozen=True)
class RateDecision:
    """What ``try_rate`` answers: ``allowed`` (the call may go, and was counted), how many calls
    of cost 1 remain right after it, how long until a denied call would be allowed
    (``retry_after``, None when allowed) and until the key has its full burst again
    (``reset_after``). True when allowed, so ``if try_rate(...):`` reads as it should. When the
    database cannot be reached or refuses the call (fail closed), ``allowed`` is False and both
    times are None: nobody knows when."""

    allowed: bool
    remaining: int
    retry_after: timedelta | None
    reset_after: timedelta | None

    def __bool__(self) -> bool:
        return self.allowed


# Not allowed, nothing known: the answer when the database cannot say.
_NOT_ALLOWED = RateDecision(False, 0, None, None)


def _rate_failed(key: str, e: Exception) -> RateDecision:
    """What a rate statement's error makes of the call: not allowed, logged, when the database
    is unreachable or refused it with an operational error (no room for another key, a
    statement timeout); re-raised otherwise (bad arguments, the extension missing or older than
    0.10.0: a bug, not load)."""
    if isinstance(e, _Unreachable):
        log.warning("stage_e_try_rate: treating as not allowed (key %r), cannot reach the "
                    "database: %s", key, e)
    elif _is_a(e, "OperationalError"):
        log.error("stage_e_try_rate: treating as not allowed (key %r), the server refused the "
                  "call: %s", key, e)
    else:
        raise e
    return _NOT_ALLOWED


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


def _is_a(e: BaseException, name: str) -> bool:
    """Whether `e` is a DB-API error of class `name` (OperationalError, DataError...), or wraps
    one (Django re-raises the driver's errors as its own classes of the same names)."""
    seen: BaseException | None = e
    while seen is not None:
        if any(c.__name__ == name for c in type(seen).__mro__):
            return True
        seen = seen.__cause__
    return False


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
