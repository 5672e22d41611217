"""Stress: many sessions cycling through a small cap while an independent observer watches
pg_locks. The lock manager, not our counters, is the witness."""

import threading
import time

from conftest import one, slot_lock_holders, stats

SESSIONS = 32
CYCLES = 2000
CAP = 4


def test_never_more_than_n_holders_and_every_null_counted(connect):
    workers = [connect(f"stress-{i}") for i in range(SESSIONS)]
    observer = connect("observer")
    before = stats(observer)
    nulls = [0] * SESSIONS
    acquired = [0] * SESSIONS
    errors = []
    done = threading.Event()
    samples, worst = [0], [0]

    def work(i):
        c = workers[i]
        try:
            for _ in range(CYCLES):
                slot = one(c, "SELECT stage_e_try_slot(%s)", (CAP,))
                if slot is None:
                    nulls[i] += 1
                    continue
                assert 0 <= slot < CAP
                acquired[i] += 1
                assert one(c, "SELECT stage_e_release(%s)", (slot,)) is True
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def observe():
        while not done.is_set():
            held = slot_lock_holders(observer)
            samples[0] += 1
            worst[0] = max(worst[0], len(held))
            assert len({s for s, _ in held}) == len(held)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(SESSIONS)]
    watcher = threading.Thread(target=observe)
    watcher.start()
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    elapsed = time.monotonic() - started

    assert not errors, errors[:3]
    assert samples[0] > 50, "the observer must actually have sampled during the run"
    assert worst[0] <= CAP, f"pg_locks showed {worst[0]} holders of a cap of {CAP}"
    after = stats(observer)
    assert after["throttled"] - before["throttled"] == sum(nulls)
    assert after["acquired"] - before["acquired"] == sum(acquired)
    assert after["released"] - before["released"] == sum(acquired)
    assert sum(nulls) > 0 and sum(acquired) > 0
    assert after["held"] == 0
    print(f"\n{SESSIONS}x{CYCLES} cycles in {elapsed:.1f}s: {sum(acquired)} acquired, "
          f"{sum(nulls)} throttled, {samples[0]} pg_locks samples, max {worst[0]} holders")
