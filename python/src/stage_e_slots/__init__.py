"""stage_e_slots: concurrency caps enforced inside PostgreSQL, from Python.

See also the README's "Using it from Python" section. The sync API is here: hold a slot of a
named cap on a connection you alone own. ``stage_e_slots.aio`` has the same for asyncio,
``stage_e_slots.django`` is the Django app.

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

Rate limits (the extension at 0.10.0): ``try_rate`` asks whether a call may go now at a rate,
and counts it when it may, in one step; a ``RateDecision`` is true when allowed::

    decision = try_rate(DSN, "api.example.com", 10, 1, burst=5)    # 10 a second, bursts of 5
    if not decision:
        time.sleep(decision.retry_after.total_seconds() if decision.retry_after else 1)

The database unreachable, or refusing the call (no room for another key), is not allowed
(logged, both times None): fail closed. Bad arguments raise.

A rate on a cap's slots: ``rate=Rate(10, 1, burst=5)`` on ``stage_e_slot``, ``stage_e_lease``
or ``capped`` makes it the cap's policy in the database (``stage_e_rate_limit``, set once per
process when it differs; the last writer wins), and the server then grants a slot only when
one is free and the rate allows it, in one step; see ``stage_e_slot``'s docstring::

    with stage_e_slot(DSN, "api", n=4, rate=Rate(10, 1, burst=5)) as slot:
        if slot is None:
            return "throttled"       # no slot free, or the rate allowed none just then
        call_the_api()

The same for asyncio (one connection per event loop) is ``stage_e_slots.aio``; a decorator,
``stage_e_slots.capped``.
"""

from __future__ import annotations

from ._capped import Throttled, capped
from ._common import DEFAULT_CAP, LeaseLost, Rate, RateDecision, RatePolicyError
from ._leases import Lease, stage_e_lease
from ._slots import SlotConnection, connection_for, stage_e_slot, try_rate

__version__ = "0.11.0"

__all__ = [
    "DEFAULT_CAP",
    "Lease",
    "LeaseLost",
    "Rate",
    "RateDecision",
    "RatePolicyError",
    "SlotConnection",
    "Throttled",
    "__version__",
    "capped",
    "connection_for",
    "stage_e_lease",
    "stage_e_slot",
    "try_rate",
]
