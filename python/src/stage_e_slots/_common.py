"""What the sync and asyncio APIs share and that does no I/O: the logger, argument checks, the
SQL of slots and leases, the exceptions, how a lease statement's error is classified, and the
rates of ``rate=`` (``Rate``, which of them this process has made its caps' policies).
Private; the public names are re-exported by ``stage_e_slots`` and ``stage_e_slots.aio``."""

from __future__ import annotations

import logging
import threading
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
_LEASE_SHARE = "SELECT slot, token FROM stage_e_lease(%s, %s, %s, %s, %s)"
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
# A cap's rate policy as the server applies it (its own, or a prefix policy's), and setting it
# (restricted: EXECUTE is revoked from PUBLIC; applied at the statement's commit).
_RATE_OF = "SELECT count, per, burst FROM stage_e_rate_limits WHERE cap = %s"
_SET_RATE = "SELECT stage_e_rate_limit(%s, %s, %s, %s)"


def _slot_query(
        cap: str, n: int, k: int, seconds: float, share: str | None = None,
) -> tuple[str, tuple[object, ...]]:
    """The statement taking k slots of `cap` (in [0, n)), waiting up to `seconds` in the
    server; in fair share `share` if one is given (the extension at 0.11.0)."""
    delay = timedelta(seconds=seconds)
    if share is not None:
        return "SELECT stage_e_try_slots(%s, %s, %s, %s, %s)", (cap, n, k, delay, share)
    if k == 1 and not delay:
        return "SELECT ARRAY[stage_e_try_slot(%s, %s)]", (cap, n)
    if k == 1:
        return "SELECT ARRAY[stage_e_try_slot(%s, %s, %s)]", (cap, n, delay)
    return "SELECT stage_e_try_slots(%s, %s, %s, %s)", (cap, n, k, delay)


def _lease_query(
        cap: str, n: int, ttl: timedelta, wait: timedelta, share: str | None = None,
) -> tuple[str, tuple[object, ...]]:
    """The statement taking a lease of `cap` (in [0, n)) for `ttl`, waiting up to `wait` in
    the server; in fair share `share` if one is given (the extension at 0.11.0)."""
    if share is not None:
        return _LEASE_SHARE, (cap, n, ttl, wait, share)
    return _LEASE, (cap, n, ttl, wait)


def _check_share(share: str | None) -> None:
    """A share is a name of 1 to 63 bytes (UTF-8), as a cap's; None is the cap's unnamed share
    (no share argument sent)."""
    if share is None:
        return
    if not isinstance(share, str):
        raise TypeError(f"share must be a share name (str), not {type(share).__name__}: "
                        f"{share!r}")
    if not 1 <= len(share.encode()) <= 63:
        raise ValueError(f"a share name is 1 to 63 bytes: {share!r}")


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


# -- rate= on slots, leases and @capped --------------------------------------------------------

_INT_MAX = 2**31 - 1  # count and burst are SQL integers
_LONGEST_PER = timedelta(days=1)  # what stage_e_rate_limit takes


def _rate_int(name: str, value: int) -> int:
    what = (f"Rate's {name} must be an int from 1 to {_INT_MAX}, not {value!r}: e.g. "
            "Rate(10, 1, burst=5) is 10 calls a second in bursts of up to 5")
    if not isinstance(value, int):
        raise TypeError(what)
    if isinstance(value, bool) or not 1 <= value <= _INT_MAX:  # True is an int, not a count
        raise ValueError(what)
    return value


def _rate_per(per: Per) -> timedelta:
    what = (f"Rate's per must be seconds (an int or a float) or a timedelta, above 0 and at "
            f"most one day (the longest stage_e_rate_limit takes), not {per!r}: e.g. "
            f"Rate(10, 60) is 10 calls a minute, Rate(1, 86400) one a day")
    if not isinstance(per, (int, float, timedelta)):
        raise TypeError(what)
    try:
        delay = per if isinstance(per, timedelta) else timedelta(seconds=per)
    except (OverflowError, ValueError):  # inf, nan
        raise ValueError(what) from None
    # timedelta keeps microseconds: a per below half of one is 0, refused here.
    if isinstance(per, bool) or not timedelta(0) < delay <= _LONGEST_PER:
        raise ValueError(what)
    return delay


@dataclass(frozen=True, init=False)
class Rate:
    """A rate for ``rate=`` of ``stage_e_slot``, ``stage_e_lease`` and ``@capped``: at most
    ``count`` acquisitions per ``per`` (seconds or a ``timedelta``, above 0 and at most one
    day), in bursts of up to ``burst``. ``per`` is kept as a ``timedelta``, so
    ``Rate(10, 1) == Rate(10, timedelta(seconds=1))``. Bad values raise here: ``ValueError``
    (``TypeError`` for a value of the wrong type, such as a str).

    The rate becomes the cap's policy in the database (``stage_e_rate_limit``), which the
    server enforces atomically with the slot, for every client of the cap: see
    ``stage_e_slot``'s docstring."""

    count: int
    per: timedelta
    burst: int

    def __init__(self, count: int, per: Per, burst: int = 1) -> None:
        object.__setattr__(self, "count", _rate_int("count", count))
        object.__setattr__(self, "per", _rate_per(per))
        object.__setattr__(self, "burst", _rate_int("burst", burst))

    def __reduce__(self) -> tuple[Any, ...]:
        # Through __init__ again (task queues pickle a decorated function's arguments' kin).
        return (type(self), (self.count, self.per, self.burst))

    def __str__(self) -> str:
        return f"{self.count} per {_interval(self.per)}, bursts of {self.burst}"


def _interval(per: timedelta) -> str:
    """``per`` as an SQL interval literal's text ('1 s', '0.25 s', '86400 s')."""
    seconds = f"{per.total_seconds():.6f}".rstrip("0").rstrip(".")
    return f"{seconds} s"


def _check_rate(cap: str, rate: Rate | None) -> None:
    if rate is None:
        return
    if not isinstance(rate, Rate):
        raise TypeError(f"rate must be a stage_e_slots.Rate (e.g. Rate(10, 1, burst=5)), not "
                        f"{type(rate).__name__}: {rate!r}")
    if isinstance(cap, str) and cap.endswith("*"):
        raise ValueError(f"rate= on cap {cap!r}: stage_e_rate_limit reads a name ending with "
                         "'*' as a prefix policy for every cap starting with what precedes it; "
                         "set such a policy with SELECT stage_e_rate_limit(...) instead")


class RatePolicyError(Exception):
    """``rate=`` found the cap's rate policy different from the rate (or absent) and could not
    set it: this role may not (EXECUTE on ``stage_e_rate_limit`` is revoked from PUBLIC), or
    the extension in the database is older than 0.10.0. Raised before anything is taken: a
    call is never run without the rate it asked for."""

    def __init__(self, cap: str, rate: Rate, message: str) -> None:
        self.cap, self.rate = cap, rate
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.cap, self.rate, str(self)))


class _EnsuredRates:
    """The (dsn, cap, rate) whose policy this process has made sure of: each is read (and set
    if need be) once, so the acquisitions after it cost no statement more. Two threads or
    tasks making sure of one at once both may: a duplicate read, or write of the same policy,
    is harmless, and no lock is held over I/O (it would stall an event loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: set[tuple[str, str, Rate]] = set()

    def __contains__(self, key: tuple[str, str, Rate]) -> bool:
        with self._lock:
            return key in self._done

    def add(self, key: tuple[str, str, Rate]) -> None:
        with self._lock:
            self._done.add(key)


_ENSURED = _EnsuredRates()


def _rate_to_set(rate: Rate, row: tuple[Any, ...] | None) -> bool:
    """Whether a cap whose policy is ``row`` (of ``_RATE_OF``; None: it has none) must be set to
    ``rate``."""
    return row is None or (row[0], row[1], row[2]) != (rate.count, rate.per, rate.burst)


def _rate_was_set(cap: str, rate: Rate, row: tuple[Any, ...] | None) -> None:
    """Logs that ``cap``'s policy is now ``rate``: a WARNING when it replaced another (``row``),
    which the last writer wins."""
    if row is None:
        log.info("stage_e_slots: set the rate policy of cap %r to %s (rate=)", cap, rate)
        return
    log.warning("stage_e_slots: cap %r had the rate policy %s; rate= replaced it with %s (the "
                "last writer wins: callers giving different rates for one cap replace each "
                "other's, once per process each)", cap, Rate(row[0], row[1], row[2]), rate)


def _rate_call(cap: str, rate: Rate) -> str:
    quoted = "'" + cap.replace("'", "''") + "'"
    return (f"SELECT stage_e_rate_limit({quoted}, {rate.count}, '{_interval(rate.per)}', "
            f"{rate.burst})")


def _rate_not_set(cap: str, rate: Rate, row: tuple[Any, ...] | None, e: Exception) -> bool:
    """What making sure of ``cap``'s policy failing with ``e`` makes of the call: throttled
    (False, logged) when the database is unreachable or refused it with an operational error
    (no room for another policy, a statement timeout), as an acquisition would be; a
    RatePolicyError when this role may not set the policy, or the extension is older than
    0.10.0; ``e`` itself otherwise (a bug, not load)."""
    if isinstance(e, _Unreachable):
        log.warning("stage_e_slots: treating as throttled (cap %r), cannot reach the database "
                    "to read or set its rate policy: %s", cap, e)
        return False
    sqlstate = getattr(e, "sqlstate", None)
    said = getattr(getattr(e, "diag", None), "message_primary", None) or e
    if sqlstate == "42501":
        current = "none" if row is None else str(Rate(row[0], row[1], row[2]))
        raise RatePolicyError(cap, rate, (
            f"rate= on cap {cap!r} asks for {rate}, but the cap's rate policy is {current}, and "
            f"this role may not set it (EXECUTE on stage_e_rate_limit is revoked from PUBLIC: "
            f"{said}). Nothing was taken. Have a role with the privilege run "
            f"`{_rate_call(cap, rate)}` once (it applies at its commit; with the policy in "
            f"place this role needs no privilege), or grant this role EXECUTE ON FUNCTION "
            f"stage_e_rate_limit(text, integer, interval, integer)")) from e
    if sqlstate in ("42883", "42P01"):  # the function, or the view, is missing
        raise RatePolicyError(cap, rate, (
            f"rate= on cap {cap!r} needs the extension at 0.10.0 in this database, and "
            f"stage_e_rate_limit or stage_e_rate_limits is missing ({said}). Nothing was "
            f"taken. Run `ALTER EXTENSION stage_e_slots UPDATE` (as the extension's owner), "
            f"or, if it is installed in a schema that is not on this role's search_path, put "
            f"that schema on it")) from e
    if _is_a(e, "OperationalError"):
        log.error("stage_e_slots: treating as throttled (cap %r), the server refused to read or "
                  "set its rate policy: %s", cap, e)
        return False
    raise e
