"""Stress: many sessions cycling through a small cap. What our code could break is a slot
handed out without its lock, a slot outside [0, n), one slot believed held by two clients at
once, or a fencing token that does not grow: each client checks its slot in pg_locks (the lock
manager, not our counters) in the same statement that took it, with the slot's token; a
client-side ledger catches any two clients holding one slot at the same time and any token not
above every earlier one (of the slot, and of the whole run). An independent observer samples
every advisory lock on the cap's key in pg_locks throughout: the extension must never lock a
slot at or above n, not even for a moment in its search (the lock manager would allow it)."""

import threading
import time

from conftest import KEY, one, slot_lock_holders, stats

SESSIONS = 32
CYCLES = 2000
CAP = 4

# Takes a slot and, in the same statement, asks the lock manager whether this very backend
# holds that slot's lock, and the extension for the slot's fencing token.
TRY_AND_VERIFY = f"""
WITH t AS MATERIALIZED (SELECT stage_e_try_slot({CAP}) AS slot)
SELECT t.slot,
       (SELECT count(*) FROM pg_catalog.pg_locks AS l
         WHERE l.locktype = 'advisory' AND l.classid = {KEY} AND l.objsubid = 2 AND l.granted
           AND l.objid = t.slot::oid AND l.pid = pg_catalog.pg_backend_pid()),
       CASE WHEN t.slot IS NOT NULL THEN stage_e_slot_token('default', t.slot) END
  FROM t
"""


def test_no_slot_without_its_lock_no_slot_held_twice_and_every_null_counted(connect):
    workers = [connect(f"stress-{i}") for i in range(SESSIONS)]
    observer = connect("observer")
    before = stats(observer)
    nulls = [0] * SESSIONS
    acquired = [0] * SESSIONS
    errors = []
    ledger_lock = threading.Lock()
    ledger = {}  # slot -> worker that believes it holds it
    last_token = {}  # slot -> the token of its latest holder
    tokens = set()  # every token handed out in the run
    violations = []
    done = threading.Event()
    samples, worst = [0], [0]

    def work(i):
        c = workers[i]
        try:
            for _ in range(CYCLES):
                slot, mine, token = c.execute(TRY_AND_VERIFY).fetchone()
                if slot is None:
                    nulls[i] += 1
                    continue
                acquired[i] += 1
                if not 0 <= slot < CAP or mine != 1:
                    violations.append(f"worker {i} got slot {slot}; its lock rows: {mine}")
                # Set after the server granted it, cleared before the release is sent: two
                # entries at once can only mean two holders at once, and the order in which a
                # slot's entries are set is the order of its holders, whose tokens must grow.
                with ledger_lock:
                    if slot in ledger:
                        violations.append(f"slot {slot} held by workers {ledger[slot]} and {i}")
                    ledger[slot] = i
                    if token is None or token <= last_token.get(slot, 0) or token in tokens:
                        violations.append(f"worker {i} got slot {slot} with token {token}, "
                                          f"after token {last_token.get(slot)}")
                    last_token[slot] = token
                    tokens.add(token or 0)
                # The hold: one round trip, in which the session must see itself holding it.
                if one(c, "SELECT stage_e_holding(%s)", (slot,)) is not True:
                    violations.append(f"worker {i} does not hold slot {slot} it was given")
                with ledger_lock:
                    del ledger[slot]
                if one(c, "SELECT stage_e_release(%s)", (slot,)) is not True:
                    violations.append(f"worker {i} could not release slot {slot}")
        except Exception as e:  # noqa: BLE001 - reported below, in the main thread
            errors.append(e)

    def observe():
        try:
            while not done.is_set():
                held = slot_lock_holders(observer)  # every slot lock of the key, of any slot
                samples[0] += 1
                worst[0] = max(worst[0], len(held))
                if any(s >= CAP for s, _ in held):
                    violations.append(f"pg_locks shows a slot at or above {CAP}: {held}")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(SESSIONS)]
    watcher = threading.Thread(target=observe)
    watcher.start()
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    done.set()
    watcher.join(timeout=30)
    elapsed = time.monotonic() - started

    assert not [t for t in threads + [watcher] if t.is_alive()], "a thread did not finish"
    assert not errors, errors[:3]
    assert not violations, violations[:5]
    assert samples[0] > 50, "the observer must actually have sampled during the run"
    assert 1 <= worst[0] <= CAP  # it saw holders, and never more slots than [0, CAP) has
    assert len(tokens) == sum(acquired)
    after = stats(observer)
    assert after["throttled"] - before["throttled"] == sum(nulls)
    assert after["acquired"] - before["acquired"] == sum(acquired)
    assert after["released"] - before["released"] == sum(acquired)
    assert sum(nulls) > 0 and sum(acquired) > 0
    assert after["held"] == 0
    print(f"\n{SESSIONS}x{CYCLES} cycles in {elapsed:.1f}s: {sum(acquired)} acquired, "
          f"{sum(nulls)} throttled, {samples[0]} pg_locks samples, max {worst[0]} holders")
