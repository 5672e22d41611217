"""Replays the incident against a database with stage_e_slots, in one of three modes:

  shared     the slot is held on django.db.connection (the original bug)
  dedicated  the slot is held through stage_e_slots.django.stage_e_slot, on a dedicated
             connection (the fix; the package must be installed: pip install ./python)
  lease      a lease (0.4.0) is taken on django.db.connection, through a PgBouncer in
             transaction mode that this runner starts in front of the cluster
             (scripts/pgbouncer.py) and points Django's DATABASES at; the lease's cap is named
             "dispatch" (settings.STAGE_E_LEASE_CAP)

It migrates, enqueues TASKS capped dispatches, runs a real django-q2 cluster (ORM broker,
CONN_MAX_AGE = 0, 8 workers, cap 7) until all are done, samples the slots held throughout
(pg_locks for session slots; stage_e_slot_holders for leases, which hold no lock), and prints a
JSON summary. HOST is the cluster's socket folder (the lease mode puts PgBouncer's files in it).
Usage: run_incident.py MODE HOST PORT DBNAME [TASKS]
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "scripts"))  # scripts/pgbouncer.py

KEY = 20260725
CAP = 7
MODES = ("shared", "dedicated", "lease")
# The cap each mode takes its slots of: the session-slot modes use the cap "default" (whose
# slot s is the lock (KEY, s)), the lease mode its own named cap.
CAP_NAMES = {"shared": "default", "dedicated": "default", "lease": "dispatch"}
POOL_SIZE = 4  # PgBouncer's server connections for the lease mode (the workers are 8)


def manage(env, *args, **kw):
    return subprocess.run([sys.executable, str(HERE / "manage.py"), *args], env=env,
                          cwd=HERE, check=True, capture_output=True, text=True, **kw)


def counters(conn, cap):
    cur = conn.execute("SELECT throttled, released_by_exit, foreign_releases, acquired, released, "
                       "expired FROM stage_e_throttle_totals WHERE cap = %s", (cap,))
    row = cur.fetchone()
    return dict(zip([d.name for d in cur.description], row or [0] * len(cur.description)))


def settled(conn, cap, before):
    """Every slot acquired during the run is accounted for as released, by a release, by its
    session's exit (the exit hook counts after it releases, so poll for it) or, for a lease, by
    its expiry."""
    deadline = time.monotonic() + 10
    while True:
        now = counters(conn, cap)
        d = {k: now[k] - before[k] for k in now}
        if (d["acquired"] == d["released"] + d["released_by_exit"] + d["expired"]
                or time.monotonic() > deadline):
            return now
        time.sleep(0.02)


class _ClusterAt:
    """What scripts/pgbouncer.py needs of a cluster: its socket folder and port."""

    def __init__(self, host, port):
        self.base = Path(host)
        self.port = int(port)
        if not self.base.is_dir():
            raise SystemExit(f"the lease mode needs HOST to be the cluster's socket folder, "
                             f"not {host!r}")


def shared_slots(rows):
    """Pairs of regions that overlapped in time on the same slot: two workers that each
    believed they held that slot at once."""
    ran = [(slot, s, e) for outcome, slot, s, e in rows if outcome == "ran"]
    return sum(1 for i, (a, s1, e1) in enumerate(ran) for (b, s2, e2) in ran[i + 1:]
               if a == b and s1 < e2 and s2 < e1)


def max_overlap(regions):
    """Most regions in progress at one instant (starts and ends swept in time order)."""
    events = sorted([(s, 1) for s, _ in regions] + [(e, -1) for _, e in regions])
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def main():
    mode, host, port, dbname = sys.argv[1:5]
    if mode not in MODES:
        raise SystemExit(f"MODE is one of {', '.join(MODES)}, not {mode!r}")
    tasks = int(sys.argv[5]) if len(sys.argv) > 5 else 48
    bouncer = None
    if mode == "lease":
        from pgbouncer import PgBouncer

        bouncer = PgBouncer(_ClusterAt(host, port), pool_mode="transaction",
                            pool_size=POOL_SIZE).start()
    try:
        summary = replay(mode, host, port, dbname, tasks, bouncer)
    finally:
        if bouncer is not None:
            bouncer.stop()
    print(json.dumps(summary))


def replay(mode, host, port, dbname, tasks, bouncer):
    cap_name = CAP_NAMES[mode]
    # Django (the workers, the enqueue, the migrations) goes through the pooler if there is
    # one; the observer always connects to the cluster itself.
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="capdemo.settings", CAPDEMO_PGHOST=host,
               CAPDEMO_PGPORT=port, CAPDEMO_PGDATABASE=dbname, CAPDEMO_MODE=mode,
               PYTHONUNBUFFERED="1")
    if bouncer is not None:
        env.update(CAPDEMO_PGHOST="127.0.0.1", CAPDEMO_PGPORT=str(bouncer.port),
                   CAPDEMO_POOLER=bouncer.pool_mode)
    dsn = f"host={host} port={port} dbname={dbname} user=postgres application_name=observer"
    manage(env, "migrate", "--noinput")

    observer = psycopg.connect(dsn, autocommit=True)
    observer.execute("TRUNCATE dispatch_outcome, dispatch_evidence, django_q_ormq, django_q_task")
    before = counters(observer, cap_name)

    # Enqueue every dispatch first, so that the workers start together and contend.
    enqueue = (f"from django_q.tasks import async_task\n"
               f"for b in range({tasks}): async_task('dispatch.tasks.dispatch_micro_batch', b, "
               f"'{mode}')\n")
    manage(env, "shell", "-c", enqueue)

    samples, worst, stop = [0], [0], threading.Event()

    if mode == "lease":
        # A lease holds no lock: the holders view shows it, with its token.
        held_now = ("SELECT count(*) FROM stage_e_slot_holders WHERE cap = %s "
                    "AND token IS NOT NULL", (cap_name,))
    else:
        held_now = ("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                    "AND classid = %s AND objsubid = 2 AND granted AND database = "
                    "(SELECT oid FROM pg_database WHERE datname = current_database())", (KEY,))

    def sample():
        with psycopg.connect(dsn, autocommit=True) as c:
            while not stop.is_set():
                n = c.execute(*held_now).fetchone()[0]
                samples[0] += 1
                worst[0] = max(worst[0], n)
                time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.monotonic()
    cluster = subprocess.Popen([sys.executable, str(HERE / "manage.py"), "qcluster"], env=env,
                               cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while observer.execute("SELECT count(*) FROM dispatch_outcome").fetchone()[0] < tasks:
            if time.monotonic() > deadline or cluster.poll() is not None:
                raise SystemExit(f"dispatches did not finish:\n{cluster.stdout.read()}")
            time.sleep(0.05)
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        sampler.join(timeout=10)  # it polls every few ms: a sampler still running is a hang
        if sampler.is_alive():
            raise SystemExit("the pg_locks sampler did not stop within 10 s")
        os.killpg(cluster.pid, signal.SIGTERM)
        try:
            cluster.wait(timeout=5)
        except subprocess.TimeoutExpired:  # every dispatch is done: no need to wait politely
            os.killpg(cluster.pid, signal.SIGKILL)
            cluster.wait()

    after = settled(observer, cap_name, before)
    rows = observer.execute("SELECT outcome, slot, region_start, region_end "
                            "FROM dispatch_outcome").fetchall()
    regions = [(s, e) for o, _, s, e in rows if o == "ran"]
    logged_throttles = sum(1 for o, _, _, _ in rows if o == "throttled")
    tokens, reconnected = observer.execute(
        "SELECT count(DISTINCT token), count(*) FILTER (WHERE reconnected) "
        "FROM dispatch_outcome WHERE outcome = 'ran'").fetchone()
    summary = {
        "mode": mode,
        "workers": 8,
        "cap": CAP,
        "cap_name": cap_name,
        "pooler": (f"pgbouncer pool_mode={bouncer.pool_mode} pool_size={bouncer.pool_size}"
                   if bouncer is not None else None),
        "dispatches": tasks,
        "ran": len(regions),
        "throttled_logged_by_workers": logged_throttles,
        "throttled_counted_by_extension": after["throttled"] - before["throttled"],
        # From stage_e_slot_holders in the lease mode (a lease holds no advisory lock).
        "max_concurrent_slot_holders_in_pg_locks": worst[0],
        "pg_locks_samples": samples[0],
        "max_concurrent_capped_regions": max_overlap(regions),
        "overlapping_regions_on_one_slot": shared_slots(rows),
        "acquired": after["acquired"] - before["acquired"],
        "released": after["released"] - before["released"],
        "released_by_exit": after["released_by_exit"] - before["released_by_exit"],
        "foreign_releases": after["foreign_releases"] - before["foreign_releases"],
        "expired": after["expired"] - before["expired"],
        # Lease mode: distinct fencing tokens of the regions that ran, and how many regions saw
        # django.db.connection closed and replaced while they held their lease.
        "distinct_tokens": tokens,
        "regions_whose_connection_was_replaced": reconnected,
        "seconds": round(elapsed, 1),
    }
    observer.close()
    return summary


if __name__ == "__main__":
    main()
