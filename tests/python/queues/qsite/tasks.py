"""The capped tasks the django-q2 cluster of test_task_queues.py runs.

Each run writes its region to the ledger table `queue_ledger` (made by the test) on Django's
own connection: a row when the region starts and its end when it ends, with the worker's pid,
CLOCK_MONOTONIC times (system-wide on Linux, so regions of different processes compare) and
the backend pid of Django's connection at each end (they differ: Django replaced it).
"""

import os
import time

from django.db import close_old_connections, connection
from stage_e_slots import capped

CAP = "q_cap"
SLOTS = 3
HOLD = 0.15  # seconds a region holds its slot


def _region(task: int) -> str:
    started = time.monotonic()
    with connection.cursor() as cur:
        cur.execute("INSERT INTO queue_ledger (task, outcome, pid, started, backend) "
                    "VALUES (%s, 'running', %s, %s, pg_backend_pid()) RETURNING id",
                    [task, os.getpid(), started])
        row = cur.fetchone()
    # As django-q2's ORM broker does on every enqueue: with CONN_MAX_AGE = 0 this closes
    # Django's connection mid-region. The slot is on @capped's own connection and must stay.
    close_old_connections()
    time.sleep(HOLD)
    ended = time.monotonic()
    with connection.cursor() as cur:
        cur.execute("UPDATE queue_ledger SET outcome = 'ran', ended = %s, "
                    "backend_end = pg_backend_pid() WHERE id = %s", [ended, row[0]])
    return "ran"


def count_throttle(task: int) -> str:
    """on_throttle: the task ran nowhere; the ledger says so."""
    now = time.monotonic()
    with connection.cursor() as cur:
        cur.execute("INSERT INTO queue_ledger (task, outcome, pid, started, ended) "
                    "VALUES (%s, 'throttled', %s, %s, %s)", [task, os.getpid(), now, now])
    return "throttled"


@capped(CAP, SLOTS, on_throttle=count_throttle)
def dispatch_counted(task: int) -> str:
    return _region(task)


@capped(CAP, SLOTS)
def dispatch_raising(task: int) -> str:
    return _region(task)
