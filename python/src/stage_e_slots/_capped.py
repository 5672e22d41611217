"""``@capped``: a function (or coroutine function) that runs holding one slot of a cap.

::

    from stage_e_slots import Rate, Throttled, capped

    @capped("exports", 4)                 # at most 4 calls at once, across every process
    def export(job_id: int) -> str:
        ...

    @capped("llm", 8, wait=30, on_throttle=lambda prompt: None)
    async def complete(prompt: str) -> str | None:
        ...

    @capped("api", 4, rate=Rate(10, 1, burst=5))  # and at most 10 a second, bursts of 5
    def call_api(path: str) -> bytes:
        ...

Each call takes one slot of the cap on this thread's dedicated connection (a coroutine
function: on its event loop's, through ``stage_e_slots.aio``), runs the function, and gives the
slot back, whatever the function does. With ``lease_ttl`` the call holds a lease of that ttl
instead of a session slot (for work whose process may not keep one session for it); the
function then runs unguarded past the ttl, so pick one longer than the work. A throttled call
(no slot free within ``wait``, or the database unreachable: fail closed, logged) calls
``on_throttle(*args, **kwargs)`` and returns what it returns, or raises ``Throttled``.

With ``rate`` (a ``Rate``), the rate is the cap's policy in the database, which the server
enforces with the slot (a call gets one only when one is free and the rate allows it): the
first call in a process makes sure of it (``stage_e_slot``'s docstring says how; the last
writer wins, so give one cap one rate), and a throttled call may be one the rate held back.
A role that may not set the policy, when it differs, gets ``RatePolicyError`` and the function
does not run.

The database is looked up at each call, not when the function is decorated (settings are often
not loaded yet at import time): ``dsn=``, else the environment variable ``STAGE_E_SLOTS_DSN``,
else, in a Django project with ``"stage_e_slots.django"`` in ``INSTALLED_APPS``, the app's
``stage_e_slots.django.conf.dsn()``.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, TypeVar, Union, overload

from ._common import (
    Rate,
    Ttl,
    Wait,
    _as_timedelta,
    _as_ttl,
    _check_cap,
    _check_rate,
    _check_share,
)
from ._leases import stage_e_lease
from ._slots import stage_e_slot

R = TypeVar("R")
T = TypeVar("T")
# A share: its name, a function of the call's arguments that returns it, or None (the cap's
# unnamed share).
ShareOf = Union[str, Callable[..., Union[str, None]], None]

if TYPE_CHECKING:  # ParamSpec is Python 3.10+: at run time, only annotations name these
    from collections.abc import Coroutine
    from typing import ParamSpec, Protocol

    P = ParamSpec("P")
    T_co = TypeVar("T_co", covariant=True)

    class _Capping(Protocol):
        """``capped(...)`` without ``on_throttle``: the function keeps its signature (a
        throttled call raises)."""

        def __call__(self, func: Callable[P, R], /) -> Callable[P, R]: ...

    class _CappingOr(Protocol[T_co]):
        """``capped(..., on_throttle=f)``: a call returns the function's result or, throttled,
        ``f``'s (awaited, for a coroutine function)."""

        @overload
        def __call__(
                self, func: Callable[P, Coroutine[Any, Any, R]], /,
        ) -> Callable[P, Coroutine[Any, Any, R | T_co]]: ...

        @overload
        def __call__(self, func: Callable[P, R], /) -> Callable[P, R | T_co]: ...

DSN_ENV = "STAGE_E_SLOTS_DSN"


class Throttled(Exception):
    """A ``@capped`` call found no free slot of its cap (within its ``wait``), or its cap's
    rate allowed none, or it could not reach the database (which counts as throttled: fail
    closed). ``rate`` is the decorator's ``rate=``."""

    def __init__(self, cap: str, n: int, rate: Rate | None = None) -> None:
        self.cap, self.n, self.rate = cap, n, rate
        taken = f"all {n} slots were taken"
        if rate is not None:
            taken += f" or its rate ({rate}) allowed no call just then"
        super().__init__(f"throttled by cap {cap!r}: {taken} (or the database could not be "
                         "reached, see the log); retry later, or give @capped a wait= or an "
                         "on_throttle=")

    def __reduce__(self) -> tuple[Any, ...]:
        # Task queues (Celery, multiprocessing) pickle exceptions back to the caller.
        return (type(self), (self.cap, self.n, self.rate))


def _django_dsn() -> str | None:
    """The Django app's DSN, when this is a Django process whose settings are configured and
    that has the app installed; None otherwise. Never imports Django itself: a process that
    has not imported django.conf is not a Django one."""
    conf = sys.modules.get("django.conf")
    settings = getattr(conf, "settings", None)
    # `configured`, not truthiness: bool(settings) would load (or fail to load) the settings.
    if settings is None or not settings.configured:
        return None
    apps = sys.modules.get("django.apps")
    registry = getattr(apps, "apps", None)
    if registry is not None and registry.ready:
        installed = bool(registry.is_installed("stage_e_slots.django"))
    else:
        installed = any(entry == "stage_e_slots.django"
                        or entry.startswith("stage_e_slots.django.apps.")
                        for entry in getattr(settings, "INSTALLED_APPS", ()))
    if not installed:
        return None
    from .django.conf import dsn  # imported here: plain users never import Django

    return dsn()


def resolve_dsn(dsn: str | None = None) -> str:
    """The database ``@capped`` takes slots on (see the module docstring for the order)."""
    if dsn:
        return dsn
    from_env = os.environ.get(DSN_ENV)
    if from_env:
        return from_env
    from_django = _django_dsn()
    if from_django:
        return from_django
    raise RuntimeError(
        f"@capped has no database to take slots on: pass dsn= to @capped, set the environment "
        f"variable {DSN_ENV} (a libpq conninfo or URI, e.g. 'dbname=app host=db'), or, in a "
        f"Django project, add 'stage_e_slots.django' to INSTALLED_APPS (it uses "
        f"settings.STAGE_E_SLOTS_DSN, else DATABASES['default'])")


@overload
def capped(cap: str, n: int, *, dsn: str | None = None, wait: Wait | None = None,
           lease_ttl: Ttl | None = None, rate: Rate | None = None,
           share: ShareOf = None, on_throttle: None = None) -> _Capping: ...


@overload
def capped(cap: str, n: int, *, dsn: str | None = None, wait: Wait | None = None,
           lease_ttl: Ttl | None = None, rate: Rate | None = None,
           share: ShareOf = None,
           on_throttle: Callable[..., Coroutine[Any, Any, T]]) -> _CappingOr[T]: ...


@overload
def capped(cap: str, n: int, *, dsn: str | None = None, wait: Wait | None = None,
           lease_ttl: Ttl | None = None, rate: Rate | None = None,
           share: ShareOf = None, on_throttle: Callable[..., T]) -> _CappingOr[T]: ...


def capped(cap: str, n: int, *, dsn: str | None = None, wait: Wait | None = None,
           lease_ttl: Ttl | None = None, rate: Rate | None = None,
           share: ShareOf = None, on_throttle: Callable[..., Any] | None = None) -> Any:
    """Decorates a function or a coroutine function so that each call runs holding one of the
    ``n`` slots of ``cap`` (see the module docstring). ``wait`` (seconds or a timedelta) waits
    that long for a slot; ``lease_ttl`` holds a lease of that ttl instead of a session slot;
    ``rate`` (a ``Rate``) makes that rate the cap's policy, enforced with the slot;
    ``share`` takes the slot in a fair share of the cap (docs/shares.md): a name, or a function
    called with the call's arguments that returns the name (``share=lambda job: job.tenant``),
    or None for the cap's unnamed share; ``on_throttle`` is called with the call's arguments when throttled, and its result
    returned (for a coroutine function it may be a coroutine function too), else ``Throttled``
    is raised. Bad arguments raise here, at decoration."""
    _check_cap(cap)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int (the cap's number of slots), not {n!r}")
    waiting = _as_timedelta(wait if wait is not None else 0)
    ttl = None if lease_ttl is None else _as_ttl(lease_ttl)
    _check_rate(cap, rate)
    if not callable(share):
        _check_share(share)
    if on_throttle is not None and not callable(on_throttle):
        raise TypeError(f"on_throttle must be callable, not {type(on_throttle).__name__}")

    def share_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        name = share(*args, **kwargs) if callable(share) else share
        _check_share(name)
        return name

    def throttled(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if on_throttle is None:
            raise Throttled(cap, n, rate)
        return on_throttle(*args, **kwargs)

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(f"@capped cannot guard the generator function {func!r}: its slot "
                            "would be given back before the generator runs; cap the function "
                            "that consumes it")
        if not inspect.iscoroutinefunction(func) and inspect.iscoroutinefunction(on_throttle):
            raise TypeError(f"@capped: on_throttle {on_throttle!r} is a coroutine function but "
                            f"{func!r} is not; a throttled call would return an unawaited "
                            "coroutine")
        if inspect.iscoroutinefunction(func):
            # The asyncio half, imported for coroutine functions only.
            from .aio import stage_e_lease as aio_lease
            from .aio import stage_e_slot as aio_slot

            async def run_async(*args: Any, **kwargs: Any) -> Any:
                target, name = resolve_dsn(dsn), share_of(args, kwargs)
                if ttl is None:
                    async with aio_slot(target, cap, n=n, wait=waiting, rate=rate,
                                        share=name) as slot:
                        if slot is not None:
                            return await func(*args, **kwargs)
                else:
                    async with aio_lease(target, cap, n, ttl, waiting, rate=rate,
                                         share=name) as lease:
                        if lease is not None:
                            return await func(*args, **kwargs)
                result = throttled(args, kwargs)
                return await result if inspect.isawaitable(result) else result

            return functools.wraps(func)(run_async)

        def run(*args: Any, **kwargs: Any) -> Any:
            target, name = resolve_dsn(dsn), share_of(args, kwargs)
            if ttl is None:
                with stage_e_slot(target, cap, n=n, wait=waiting, rate=rate,
                                  share=name) as slot:
                    if slot is not None:
                        return func(*args, **kwargs)
            else:
                with stage_e_lease(target, cap, n, ttl, waiting, rate=rate,
                                   share=name) as lease:
                    if lease is not None:
                        return func(*args, **kwargs)
            return throttled(args, kwargs)

        return functools.wraps(func)(run)

    return decorate
