"""The extension's durable counters, read through the ORM (and so visible in Django admin).

`stage_e_throttle_counter` belongs to the extension: CREATE EXTENSION stage_e_slots makes it,
and the extension's flush (its background worker every stage_e_slots.flush_interval) inserts
a cap's row at its first flush and adds to it after that. Django must neither create nor
write it: the model is unmanaged, so migrations leave the table alone, and the admin is
read-only. The rows lag the live counts by up to one flush interval; the view
stage_e_throttle_totals adds what is still pending.

The table is looked up on the connection's search_path: if the extension lives in another
schema than public, put that schema on the search_path (OPTIONS in DATABASES).
"""

from django.db import models


class ThrottleCounter(models.Model):
    """One row per cap of this database, as of the last flush."""

    cap = models.TextField(primary_key=True)
    acquired = models.BigIntegerField(help_text="Slots handed out.")
    throttled = models.BigIntegerField(help_text="Calls that found every slot taken.")
    released = models.BigIntegerField(help_text="Slots given back (by their holder).")
    foreign_releases = models.BigIntegerField(
        help_text="Releases by a session that did not hold the slot (the holder kept it).")
    released_by_exit = models.BigIntegerField(
        help_text="Slots freed because their session ended while holding them.")
    flushed_at = models.DateTimeField(null=True, help_text="When the row was last added to.")

    class Meta:
        managed = False
        db_table = "stage_e_throttle_counter"
        ordering = ["cap"]
        verbose_name = "throttle counter"

    def __str__(self) -> str:
        return self.cap
