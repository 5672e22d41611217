from django.db import models


class Evidence(models.Model):
    """Written inside the capped region; its post_save enqueues a follow-on task."""

    batch = models.IntegerField()
    item = models.IntegerField()


class Outcome(models.Model):
    """What each dispatch did, as the workers logged it: ran (with its slot) or throttled."""

    batch = models.IntegerField()
    mode = models.CharField(max_length=16)
    outcome = models.CharField(max_length=16)
    slot = models.IntegerField(null=True)
    worker_pid = models.IntegerField()
    region_start = models.FloatField(null=True)
    region_end = models.FloatField(null=True)
    # Lease mode: the lease's fencing token, and whether django.db.connection was closed and
    # replaced during the region (the incident's trigger).
    token = models.BigIntegerField(null=True)
    reconnected = models.BooleanField(null=True)
