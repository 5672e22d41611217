"""End-to-end replay of the incident with Django and django-q2 (examples/django, which uses
the installed package: stage_e_slots.django in INSTALLED_APPS, its stage_e_slot for the fix).

The README's table of the two session-slot modes, figure by figure: what follows from the
mechanism is asserted exactly (every dispatch ran or was throttled; in the shared mode regions
that believed they held one slot ran at once, and every region that ran lost its slot with its
connection and released it on another session, so `released_by_exit` and `foreign_releases`
equal the regions that ran, 48 when none was throttled; in the dedicated mode none of either,
every slot released by its holder; in every mode the extension's throttle count equals the
workers' log). The fixed modes' contention is made certain: their regions hold their slots until
the first throttle of the run (examples/django/dispatch/tasks.py), so with 8 workers and a cap of
7 every run throttles at least once. What depends on scheduling is bounded only: the ran /
throttled split (48 / 0 and 35 / 13 there, from one run: the shared mode is throttled only if 7
slots are held at one instant, each for the few milliseconds before the broker closes its
connection; the fixed modes' split moves with how the workers' regions overlap), the shared
mode's 8 regions at once (all 8 workers in a region at one instant: most runs, not all), and the
fixed modes' regions at once, at most 7."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[2] / "examples" / "django" / "run_incident.py"
CAP = 7


def replay(cluster, db, mode):
    out = subprocess.run([sys.executable, str(RUNNER), mode, str(cluster.base),
                          str(cluster.port), db], capture_output=True, text=True, timeout=150,
                         check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n{mode}: {json.dumps(summary)}")
    return summary


@pytest.mark.parametrize("mode", ["shared", "dedicated", "lease"])
def test_incident_replay(cluster, db, mode):
    since = len(cluster.log_text())
    s = replay(cluster, db, mode)
    log = cluster.log_text()[since:]  # only what this replay made the server say
    assert s["dispatches"] == 48 and s["ran"] + s["throttled_logged_by_workers"] == 48
    assert s["pg_locks_samples"] > 50
    # Every slot handed out came back, by a release, by its session's exit, or by expiry.
    assert s["acquired"] == s["released"] + s["released_by_exit"] + s["expired"]
    if mode == "shared":
        # The bug: django-q2's enqueue closed django.db.connection mid-region, so the slot went
        # with it and the release ran on another session. The cap did not bind: regions that
        # each believed they held the same slot ran at once (every region's slot was freed at
        # its first enqueue, so the next worker got it again), and the extension says so,
        # loudly. How many of the 8 workers were in a region at one instant is scheduling's:
        # all 8 in most runs, 7 in one fresh-clone CI run (not asserted: at most the workers
        # by construction).
        assert s["overlapping_regions_on_one_slot"] > 0
        assert s["acquired"] == s["ran"]
        assert s["released_by_exit"] == s["ran"]  # every region's slot went with its connection
        assert s["foreign_releases"] == s["ran"]  # and every release ran on another session
        assert s["throttled_counted_by_extension"] == s["throttled_logged_by_workers"]
        assert log.count("was not held by this connection") == s["foreign_releases"]
        assert "exited holding slot(s)" in log
    elif mode == "lease":
        # A lease on django.db.connection itself, through PgBouncer in transaction mode: the
        # broker closed Django's connection in every region, exactly as in the shared mode, and
        # the slot stayed (held by the lease's token, not by a session). The cap binds, no two
        # regions held one slot at once, every release by token found its lease (none foreign,
        # none expired), no slot went with a session, and every throttle was counted, exactly.
        assert s["cap_name"] == "dispatch" and s["pooler"].startswith("pgbouncer")
        assert s["ran"] >= 1
        assert s["regions_whose_connection_was_replaced"] == s["ran"]
        assert s["distinct_tokens"] == s["ran"]
        assert s["max_concurrent_capped_regions"] <= CAP
        assert s["max_concurrent_slot_holders_in_pg_locks"] <= CAP  # from the holders view
        # ...and it was reached: a lease is throttled only while all 7 are leased.
        assert s["throttled_logged_by_workers"] >= 1
        assert s["overlapping_regions_on_one_slot"] == 0
        assert s["foreign_releases"] == 0 and s["released_by_exit"] == 0
        assert s["expired"] == 0
        assert s["acquired"] == s["released"] == s["ran"]
        assert s["throttled_counted_by_extension"] == s["throttled_logged_by_workers"]
        # Only this replay's cap: leases other tests left to their ttl expire in this log too.
        ours = "\n".join(line for line in log.splitlines() if 'cap "dispatch"' in line)
        for said in ("was not held by this connection", "exited holding slot(s)",
                     "is not the current lease", "expired"):
            assert said not in ours
    else:
        # The fix: the cap binds (a client-side measure: regions in progress at once), no two
        # workers ever believed they held one slot at the same time, and every throttle the
        # workers logged was counted, exactly.
        assert s["max_concurrent_capped_regions"] <= CAP
        # The independent observer: pg_locks never showed more of the cap's slots granted, and
        # it saw slots held (the regions hold theirs until the first throttle).
        assert 1 <= s["max_concurrent_slot_holders_in_pg_locks"] <= CAP
        assert s["overlapping_regions_on_one_slot"] == 0
        assert s["released_by_exit"] == 0 and s["foreign_releases"] == 0
        assert s["acquired"] == s["released"] == s["ran"]
        assert s["throttled_logged_by_workers"] >= 1
        assert s["throttled_counted_by_extension"] == s["throttled_logged_by_workers"]
        assert "was not held by this connection" not in log
        assert "exited holding slot(s)" not in log
