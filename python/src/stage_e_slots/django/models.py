"""The extension's durable counters, read through the ORM (and so shown in Django admin).

``stage_e_throttle_counter`` belongs to the extension: CREATE EXTENSION stage_e_slots makes it,
and the extension's flush (its background worker, every stage_e_slots.flush_interval) inserts
a cap's row at its first flush and adds to it after that. Django must neither create nor write
it: the model is unmanaged, so migrations leave the table alone, and the admin is read-only.
The rows lag the live counts by up to one flush interval; the view stage_e_throttle_totals (and
``manage.py stage_e_status``) adds what is still pending.

The columns are those of the extension at 0.10.0 (``ALTER EXTENSION stage_e_slots UPDATE`` an
older one: reading the rows of an older table fails on the columns it lacks). The table is looked up on the connection's search_path: if the extension lives in
another schema than public, put that schema on the search_path (OPTIONS in DATABASES).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from django.contrib.postgres.fields import ArrayField
from django.db import models

if TYPE_CHECKING:
    # The fields' value types, for mypy (django-stubs without its plugin, which would need a
    # settings module); at runtime these annotations are never evaluated.
    from datetime import datetime, timedelta

    Text = models.TextField[str, str]
    Count = models.BigIntegerField[int, int]
    Duration = models.DurationField[timedelta, timedelta]
    Buckets = ArrayField[list[int], list[int]]
    MaybeInt = models.IntegerField[int | None, int | None]
    MaybeBool = models.BooleanField[bool | None, bool | None]
    MaybeDuration = models.DurationField[timedelta | None, timedelta | None]
    MaybeTime = models.DateTimeField[datetime | None, datetime | None]

_BUCKETS = "per bucket, not cumulative: at most 1 ms, 4 ms, 16 ms, ... 4194.304 s, then above"


class ThrottleCounter(models.Model):
    """One row per cap of this database, as of the last flush."""

    cap: Text = models.TextField(primary_key=True)
    acquired: Count = models.BigIntegerField(help_text="Slots handed out.")
    throttled: Count = models.BigIntegerField(help_text="Calls that found every slot taken.")
    released: Count = models.BigIntegerField(help_text="Slots given back (by their holder).")
    foreign_releases: Count = models.BigIntegerField(
        help_text="Releases by a session that did not hold the slot (the holder kept it).")
    released_by_exit: Count = models.BigIntegerField(
        help_text="Slots freed because their session ended while holding them.")
    flushed_at: MaybeTime = models.DateTimeField(
        null=True, help_text="When the row was last added to.")
    flush_id: Count = models.BigIntegerField(help_text="The flush that last wrote the row.")
    waits: Count = models.BigIntegerField(help_text="Calls that waited for a slot.")
    wait_timeouts: Count = models.BigIntegerField(
        help_text="Waits that ended without a slot (also counted as throttled).")
    wait_time: Duration = models.DurationField(help_text="Time spent waiting, in all.")
    hold_time: Duration = models.DurationField(
        help_text="Time slots were held, in all (released ones).")
    expired: Count = models.BigIntegerField(
        help_text="Leases that ended by their ttl, not a release.")
    lock_key: MaybeInt = models.IntegerField(
        null=True, help_text="The first int4 of the cap's advisory locks (stage_e_cap_key).")
    hold_buckets: Buckets = ArrayField(models.BigIntegerField(), size=13,
                                       help_text=f"The hold-time histogram, {_BUCKETS}.")
    wait_buckets: Buckets = ArrayField(models.BigIntegerField(), size=13,
                                       help_text=f"The wait-time histogram, {_BUCKETS}.")
    adapt_min: MaybeInt = models.IntegerField(
        null=True, help_text="An adaptive cap's min_slots; empty: not adaptive.")
    adapt_max: MaybeInt = models.IntegerField(
        null=True, help_text="An adaptive cap's max_slots; empty: not adaptive.")
    adapt_enforce: MaybeBool = models.BooleanField(
        null=True, help_text="Whether the learned limit is applied (false: monitor mode).")
    adapt_limit: MaybeInt = models.IntegerField(
        null=True, help_text="The learned limit, as last written (a restart resumes from it).")
    adapt_baseline: MaybeDuration = models.DurationField(
        null=True, help_text="The baseline hold time the limit was learned against.")
    rate_count: MaybeInt = models.IntegerField(
        null=True, help_text="A rate-limited cap's count of calls per rate_per "
                             "(stage_e_rate_limit); empty: no rate policy.")
    rate_per: MaybeDuration = models.DurationField(
        null=True, help_text="The interval rate_count is over (at most 1 day).")
    rate_burst: MaybeInt = models.IntegerField(
        null=True, help_text="How many acquisitions may come at once (1: none).")
    rate_limited: Count = models.BigIntegerField(
        help_text="Acquisitions throttled by the cap's rate policy (counted in throttled too).")

    class Meta:
        managed = False
        db_table = "stage_e_throttle_counter"
        ordering: ClassVar[list[str]] = ["cap"]
        verbose_name = "throttle counter"

    def __str__(self) -> str:
        return str(self.cap)
