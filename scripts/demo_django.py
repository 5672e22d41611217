"""`make demo-django`: the incident replayed with Django + django-q2, then the fix.

The demo project (examples/django) uses the stage_e_slots package's Django app: it must be
installed for this interpreter, with its django extra (pip install "./python[django]")."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pgcluster import Cluster

PROJECT = Path(__file__).resolve().parent.parent / "examples" / "django"
RUNNER = PROJECT / "run_incident.py"

TITLES = {
    "shared": "1. The original bug: the slot held on django.db.connection",
    "dedicated": "2. The fix: the slot held on stage_e_slots' dedicated connection",
}


def system_check(cluster, mode):
    """What `manage.py check` says of the mode's settings (stage_e_slots.W001 for the bug)."""
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="capdemo.settings", CAPDEMO_MODE=mode,
               CAPDEMO_PGHOST=str(cluster.base), CAPDEMO_PGPORT=str(cluster.port),
               CAPDEMO_PGDATABASE="capdemo")
    out = subprocess.run([sys.executable, str(PROJECT / "manage.py"), "check"], env=env,
                         cwd=PROJECT, capture_output=True, text=True, check=False)
    # A warning's first clause is enough here (the whole text and its hint: run the check).
    return [line.split(", so any")[0].lstrip("?: ") for line in (out.stdout + out.stderr)
            .splitlines() if line.startswith("?: (stage_e_slots.") or "no issues" in line]


def main():
    if importlib.util.find_spec("stage_e_slots") is None:
        raise SystemExit(f"the stage_e_slots package is not installed for {sys.executable}: "
                         f"{sys.executable} -m pip install './python[django]'")
    cluster = Cluster("demo-django", {"stage_e_slots.flush_interval": "'1s'"}).init().start()
    try:
        cluster.create_database("capdemo")
        print("8 django-q2 workers (ORM broker, CONN_MAX_AGE = 0) run 48 capped dispatches, "
              "cap 7;\neach dispatch writes rows whose post_save enqueues a follow-on task.")
        for mode in ("shared", "dedicated"):
            out = subprocess.run([sys.executable, str(RUNNER), mode, str(cluster.base),
                                  str(cluster.port), "capdemo"], capture_output=True, text=True,
                                 check=False)
            if out.returncode:
                raise SystemExit(out.stdout + out.stderr)
            s = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"\n== {TITLES[mode]}")
            for line in system_check(cluster, mode):
                print(f"  manage.py check: {line.strip()}")
            print(f"  dispatches ran / throttled (as the workers logged): "
                  f"{s['ran']} / {s['throttled_logged_by_workers']}")
            print(f"  throttles counted by stage_e_slots:               "
                  f"{s['throttled_counted_by_extension']}")
            print(f"  most capped regions running at once:              "
                  f"{s['max_concurrent_capped_regions']}  (cap {s['cap']})")
            print(f"  most slot holders seen in pg_locks:               "
                  f"{s['max_concurrent_slot_holders_in_pg_locks']}  "
                  f"({s['pg_locks_samples']} samples)")
            print(f"  slots lost with a closed connection (released_by_exit): "
                  f"{s['released_by_exit']}")
            print(f"  releases by a session that did not hold the slot:       "
                  f"{s['foreign_releases']}")
        log = cluster.log_text().splitlines()
        sample = [line.split(": ", 1)[1] for line in log if "exited holding" in line][:1]
        sample += [line.split(": ", 1)[1] for line in log
                   if "was not held by this connection" in line][:1]
        if sample:
            print("\nWhat the server log said during the buggy run (first of each):")
            for line in sample:
                print("  " + line)
    finally:
        cluster.destroy()


if __name__ == "__main__":
    main()
