"""End-to-end replay of the incident with Django and django-q2 (examples/django)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parent.parent / "examples" / "django" / "run_incident.py"
CAP = 7


def replay(cluster, db, mode):
    out = subprocess.run([sys.executable, str(RUNNER), mode, str(cluster.base),
                          str(cluster.port), db], capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n{mode}: {json.dumps(summary)}")
    return summary


@pytest.mark.parametrize("mode", ["shared", "dedicated"])
def test_incident_replay(cluster, db, mode):
    since = len(cluster.log_text())
    s = replay(cluster, db, mode)
    log = cluster.log_text()[since:]  # only what this replay made the server say
    assert s["dispatches"] == 48 and s["ran"] + s["throttled_logged_by_workers"] == 48
    assert s["pg_locks_samples"] > 50
    # Every slot handed out came back, by a release or by its session's exit.
    assert s["acquired"] == s["released"] + s["released_by_exit"]
    if mode == "shared":
        # The bug: django-q2's enqueue closed django.db.connection mid-region, so the slot went
        # with it and the release ran on another session. The cap did not bind (more regions
        # at once than the cap), and the extension says so, loudly.
        assert s["max_concurrent_capped_regions"] > CAP
        assert s["released_by_exit"] >= 1
        assert s["foreign_releases"] >= 1
        assert log.count("was not held by this connection") == s["foreign_releases"]
        assert "exited holding slot(s)" in log
    else:
        # The fix: the cap binds (a client-side measure: regions in progress at once), no two
        # workers ever believed they held one slot at the same time, and every throttle the
        # workers logged was counted, exactly.
        assert s["max_concurrent_capped_regions"] <= CAP
        assert s["overlapping_regions_on_one_slot"] == 0
        assert s["released_by_exit"] == 0 and s["foreign_releases"] == 0
        assert s["throttled_logged_by_workers"] >= 1
        assert s["throttled_counted_by_extension"] == s["throttled_logged_by_workers"]
        assert "was not held by this connection" not in log
        assert "exited holding slot(s)" not in log
