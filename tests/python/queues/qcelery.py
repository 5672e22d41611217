"""The Celery app of test_task_queues.py: capped tasks on a redis broker (and result backend).

The slots' DSN is the environment's STAGE_E_SLOTS_DSN (no Django here). Each run writes its
region to the ledger table `queue_ledger` on a connection of its own (QCELERY_LEDGER_DSN), with
the worker process's pid and CLOCK_MONOTONIC times (system-wide on Linux).
"""

import os
import time

import psycopg
from celery import Celery
from stage_e_slots import capped

BROKER = os.environ["QCELERY_BROKER"]
HOLD = 0.15  # seconds a region holds its slot

app = Celery("qcelery", broker=BROKER, backend=BROKER)
app.conf.update(
    worker_prefetch_multiplier=1,  # a process takes one task at a time: the 4 contend
    task_acks_late=False,
    broker_connection_retry_on_startup=True,
    result_expires=3600,
)

_ledgers: dict[int, psycopg.Connection] = {}


def _ledger() -> psycopg.Connection:
    # One per process, opened in the prefork child that uses it (never inherited over a fork).
    conn = _ledgers.get(os.getpid())
    if conn is None or conn.closed:
        conn = psycopg.connect(os.environ["QCELERY_LEDGER_DSN"], autocommit=True)
        _ledgers[os.getpid()] = conn
    return conn


def _record(task: int, outcome: str, started: float, ended: float) -> None:
    _ledger().execute("INSERT INTO queue_ledger (task, outcome, pid, started, ended) "
                      "VALUES (%s, %s, %s, %s, %s)",
                      (task, outcome, os.getpid(), started, ended))


def _region(task: int) -> str:
    started = time.monotonic()
    time.sleep(HOLD)
    _record(task, "ran", started, time.monotonic())
    return "ran"


def count_throttle(task: int) -> str:
    now = time.monotonic()
    _record(task, "throttled", now, now)
    return "throttled"


@app.task(name="qcelery.wait_raising")
@capped("c_cap", 2, wait=0.05)
def wait_raising(task: int) -> str:
    return _region(task)


@app.task(name="qcelery.lease_counted")
@capped("c_lease", 2, lease_ttl=30, wait=0.05, on_throttle=count_throttle)
def lease_counted(task: int) -> str:
    return _region(task)
