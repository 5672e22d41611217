"""`make demo-django`: the incident replayed with Django + django-q2, then the fix."""

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pgcluster import Cluster  # noqa: E402

RUNNER = Path(__file__).resolve().parent.parent / "examples" / "django" / "run_incident.py"

TITLES = {
    "shared": "1. The original bug: the slot held on django.db.connection",
    "dedicated": "2. The fix: the slot held on the helper's dedicated connection",
}


def main():
    cluster = Cluster("demo-django", {"stage_e_slots.flush_interval": "'1s'"}).init().start()
    try:
        cluster.create_database("capdemo")
        print("8 django-q2 workers (ORM broker, CONN_MAX_AGE = 0) run 48 capped dispatches, "
              "cap 7;\neach dispatch writes rows whose post_save enqueues a follow-on task.")
        for mode in ("shared", "dedicated"):
            out = subprocess.run([sys.executable, str(RUNNER), mode, str(cluster.base),
                                  str(cluster.port), "capdemo"], capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(out.stdout + out.stderr)
            s = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"\n== {TITLES[mode]}")
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
