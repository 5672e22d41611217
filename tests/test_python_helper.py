"""The Python recipe (examples/python/stage_e_slot.py) against a real cluster."""

import gc
import logging
import os
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "python"))

from conftest import one, slot_lock_holders, stats  # noqa: E402
from stage_e_slot import SlotConnection, connection_for, stage_e_slot  # noqa: E402


@pytest.fixture
def dsn(cluster, db):
    return cluster.conninfo(db, "helper-test")


def test_holds_on_its_own_connection_and_releases_on_exit(dsn, connect):
    observer = connect("observer")
    with stage_e_slot(dsn, n=2) as slot:
        assert slot == 0
        holders = slot_lock_holders(observer)
        assert [s for s, _ in holders] == [0]
        assert holders[0][1] != observer.info.backend_pid
    assert slot_lock_holders(observer) == []
    assert stats(observer)["released"] == 1


def test_throttled_yields_none_and_is_counted(dsn, connect):
    blocker = connect("blocker")
    assert one(blocker, "SELECT stage_e_try_slot(1)") == 0
    with stage_e_slot(dsn, n=1) as slot:
        assert slot is None
    assert stats(blocker)["throttled"] == 1


def test_an_exception_in_the_region_still_releases(dsn, connect):
    observer = connect("observer")
    with pytest.raises(RuntimeError):
        with stage_e_slot(dsn, n=1):
            raise RuntimeError("work failed")
    assert slot_lock_holders(observer) == []


def test_one_connection_per_thread_is_reused(dsn):
    pids = []
    for _ in range(3):
        with stage_e_slot(dsn, n=4):
            pids.append(connection_for(dsn)._conn.info.backend_pid)
    assert len(set(pids)) == 1
    other = []
    t = threading.Thread(target=lambda: other.append(
        connection_for(dsn)._connection().info.backend_pid))
    t.start()
    t.join()
    assert other[0] != pids[0]


def test_unreachable_database_fails_closed(caplog):
    sc = SlotConnection("host=/nonexistent port=1 user=nobody dbname=none", connect_timeout=1)
    with caplog.at_level(logging.WARNING, logger="stage_e_slot"):
        with sc.slot(8) as slot:
            assert slot is None
    assert "treating as throttled" in caplog.text


def test_a_lost_connection_is_reported_at_release_and_replaced(dsn, connect, caplog):
    observer = connect("observer")
    sc = SlotConnection(dsn)
    with caplog.at_level(logging.ERROR, logger="stage_e_slot"):
        with sc.slot(1) as slot:
            assert slot == 0 and sc.holding(0)
            one(observer, "SELECT pg_terminate_backend(%s)", (sc._conn.info.backend_pid,))
        assert "release of slot 0 failed" in caplog.text
    # The next use opens a fresh connection and works.
    with sc.slot(1) as slot:
        assert slot == 0 and sc.holding(0)
    sc.close()
    assert slot_lock_holders(observer) == []


def test_a_forked_child_opens_its_own_connection_and_leaves_the_parents_slot_alone(dsn, connect):
    """A worker pool that forks (Celery prefork, gunicorn, multiprocessing) must not share the
    parent's session: the child gets a new one, and nothing the child does (including dropping
    the inherited connection object) may end the parent's session or its slot."""
    observer = connect("observer")
    sc = SlotConnection(dsn)
    with sc.slot(4) as slot:
        assert slot == 0
        parent_backend = sc._conn.info.backend_pid
        r, w = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                os.close(r)
                with sc.slot(4) as s2:
                    os.write(w, f"{s2} {sc._conn.info.backend_pid}".encode())
                sc.close()
                gc.collect()
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        _, status = os.waitpid(child, 0)
        got = os.read(r, 100).decode().split()
        os.close(r)
        assert os.waitstatus_to_exitcode(status) == 0
        child_slot, child_backend = int(got[0]), int(got[1])
        assert child_slot == 1 and child_backend != parent_backend
        # The parent's session and slot are intact, per the lock manager and per the parent.
        assert sc.holding(0)
        assert sc._conn.info.backend_pid == parent_backend
        assert slot_lock_holders(observer) == [(0, parent_backend)]
    assert slot_lock_holders(observer) == []
    sc.close()
