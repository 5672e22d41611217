"""The capped dispatch: the two ways the incident's module held its slot, and a lease."""

import os
import time

from django.conf import settings
from django.db import connection
from stage_e_slots import stage_e_lease
from stage_e_slots.django import stage_e_slot

from .models import Evidence, Outcome

REGION_ITEMS = 3
ITEM_SECONDS = 0.05
# The fixed modes hold their regions until some worker has been throttled (at most this long),
# so that the run shows the cap binding whatever the scheduling: 8 workers and a cap of 7.
FIRST_THROTTLE_SECONDS = 10


def follow_on(evidence_id):
    """The follow-on task the post_save receiver enqueues; its content does not matter."""
    return evidence_id


def _region(batch, until_first_throttle=None):
    """The capped work: persist evidence (each row's post_save enqueues a task); in the fixed
    modes, then hold the slot until the first throttle of that mode (see below)."""
    start = time.time()
    for item in range(REGION_ITEMS):
        Evidence.objects.create(batch=batch, item=item)
        time.sleep(ITEM_SECONDS)
    if until_first_throttle is not None:
        _until_first_throttle(until_first_throttle)
    return start, time.time()


def _until_first_throttle(mode):
    """Certain contention: with 8 workers and a cap of 7, the regions that hold the 7 slots
    wait here until the 8th worker has tried and been throttled; from then on, nobody waits.
    Without it, whether two regions ever overlap enough to throttle is scheduling's."""
    deadline = time.monotonic() + FIRST_THROTTLE_SECONDS
    while time.monotonic() < deadline:
        if Outcome.objects.filter(mode=mode, outcome="throttled").exists():
            return
        time.sleep(0.01)


def _log(batch, mode, slot, region=None, **extra):
    start, end = region or (None, None)
    Outcome.objects.create(batch=batch, mode=mode, outcome="ran" if region else "throttled",
                           slot=slot, worker_pid=os.getpid(), region_start=start,
                           region_end=end, **extra)


def dispatch_micro_batch(batch, mode):
    if mode == "shared":
        return _dispatch_on_django_connection(batch)
    if mode == "lease":
        return _dispatch_with_a_lease(batch)
    return _dispatch_on_dedicated_connection(batch)


def _dispatch_on_django_connection(batch):
    """The original bug: the slot lives on django.db.connection, which the broker closes."""
    with connection.cursor() as cur:
        cur.execute("SELECT stage_e_try_slot(%s)", [settings.STAGE_E_CAP])
        slot = cur.fetchone()[0]
    if slot is None:
        _log(batch, "shared", None)
        return "throttled"
    try:
        region = _region(batch)
    finally:
        # By now Django may have reconnected: this runs on another session.
        with connection.cursor() as cur:
            cur.execute("SELECT stage_e_release(%s)", [slot])
    _log(batch, "shared", slot, region)
    return "ran"


def _dispatch_on_dedicated_connection(batch):
    """The fix: stage_e_slots holds the slot on a connection of its own, to the same database,
    that nothing else touches."""
    with stage_e_slot("default", settings.STAGE_E_CAP) as slot:
        if slot is None:
            _log(batch, "dedicated", None)
            return "throttled"
        region = _region(batch, until_first_throttle="dedicated")
    _log(batch, "dedicated", slot, region)
    return "ran"


def _dispatch_with_a_lease(batch):
    """A lease on django.db.connection itself, which the runner points at PgBouncer in
    transaction mode: the slot is held by the lease's token, not by a session, so the broker
    closing the connection mid-region (exactly as in the shared mode) does not free it, and
    the release by token lands on whatever server connection runs it."""
    with stage_e_lease(connection, settings.STAGE_E_LEASE_CAP, settings.STAGE_E_CAP,
                       ttl=settings.STAGE_E_LEASE_TTL) as lease:
        if lease is None:
            _log(batch, "lease", None)
            return "throttled"
        before = connection.connection  # the DB-API connection Django has open now
        region = _region(batch, until_first_throttle="lease")
        reconnected = connection.connection is not before
    _log(batch, "lease", lease.slot, region, token=lease.token, reconnected=reconnected)
    return "ran"
