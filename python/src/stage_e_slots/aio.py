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

Rate limits (the extension at 0.10.0)::

    decision = await try_rate(DSN, "api.example.com", 10, 1, burst=5)   # 10 a second
    if not decision:
        await asyncio.sleep(decision.retry_after.total_seconds() if decision.retry_after else 1)

    async with stage_e_slot(DSN, "api", n=4, rate=Rate(10, 1, burst=5)) as slot:   # a cap's
        ...                                                   # rate, enforced with its slots

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
without waiting (a slot free just then is taken). A head whose cap's slots are all held by
its own connection (so that only a release of this loop can serve it; the server would answer
that wait at once, as the session would wait for itself) sends no wait: it waits in the client
for a release on the connection, then asks again. So, as with the sync API, each waiting call
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

from ._aio_leases import AsyncLease, stage_e_lease
from ._aio_line import _sweep  # noqa: F401 - the tests sweep ended loops
from ._aio_slots import AsyncSlotConnection, connection_for, stage_e_slot, try_rate
from ._common import DEFAULT_CAP, LeaseLost, Rate, RateDecision, RatePolicyError

# The code of this module is in _aio_slots.py and _aio_leases.py, the one source of the sync
# API too (scripts/generate_sync.py), and in _aio_line.py, the connection shared by a loop's tasks.

__all__ = [
    "DEFAULT_CAP",
    "AsyncLease",
    "AsyncSlotConnection",
    "LeaseLost",
    "Rate",
    "RateDecision",
    "RatePolicyError",
    "connection_for",
    "stage_e_lease",
    "stage_e_slot",
    "try_rate",
]
