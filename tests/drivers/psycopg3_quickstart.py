"""The README's calls from psycopg 3, parameters bound as its users bind them: server-side
parameters, a str sent untyped, an int typed, an interval as a timedelta.
tests/test_drivers.py runs it, reads what it prints and checks the server at each PAUSE.
Connection from PGHOST, PGPORT, PGDATABASE, PGUSER."""

import sys
from datetime import timedelta

import psycopg


def show(v):
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list):
        return ",".join(map(str, v))
    return str(v)


def pause(what):
    print(f"PAUSE {what}", flush=True)
    sys.stdin.readline()


def value(conn, query, params=()):
    return conn.execute(query, params).fetchone()[0]


def main():
    a = psycopg.connect(application_name="drv-a", autocommit=True)
    b = psycopg.connect(application_name="drv-b", autocommit=True)

    # Take a slot of a named cap.
    slot = a.execute("SELECT stage_e_try_slot(%s, %s)", ("exports", 1)).fetchone()[0]
    print(f"take exports 1: {show(slot)}", flush=True)
    pause("holding")
    print("second connection take exports 1: "
          + show(value(b, "SELECT stage_e_try_slot(%s, %s)", ("exports", 1))))
    print("second connection wait 50 ms: " + show(value(
        b, "SELECT stage_e_try_slot(%s, %s, %s)", ("exports", 1, timedelta(milliseconds=50)))))
    # Release it.
    done = a.execute("SELECT stage_e_release(%s, %s)", ("exports", slot)).fetchone()[0]
    print(f"release exports {slot}: {show(done)}", flush=True)
    pause("released")
    waited = value(b, "SELECT stage_e_try_slot(%s, %s, %s)",
                   ("exports", 1, timedelta(seconds=10)))
    print(f"wait up to 10 s: {show(waited)}")
    done = value(b, "SELECT stage_e_release(%s, %s)", ("exports", waited))
    print(f"release exports {waited}: {show(done)}")

    slots = value(a, "SELECT stage_e_try_slots(%s, %s, %s)", ("batch", 4, 2))
    print(f"take 2 of batch 4: {show(slots)}", flush=True)
    pause("holding batch")
    print("release_all batch: " + show(value(a, "SELECT stage_e_release_all(%s)", ("batch",))))

    # A lease: held by its token, so any connection renews and releases it.
    lease_slot, token = a.execute("SELECT slot, token FROM stage_e_lease(%s, %s, %s)",
                                  ("jobs", 2, timedelta(seconds=30))).fetchone()
    print(f"lease jobs 2 for 30 s: slot {show(lease_slot)} token {show(token)}", flush=True)
    pause("leased")
    ok = value(b, "SELECT stage_e_renew(%s, %s, %s, %s)",
               ("jobs", lease_slot, token, timedelta(seconds=60)))
    print(f"renew for 60 s: {show(ok)}", flush=True)
    pause("renewed")
    for what in ("release_lease", "release_lease again"):
        ok = b.execute("SELECT stage_e_release_lease(%s, %s, %s)",
                       ("jobs", lease_slot, token)).fetchone()[0]
        print(f"{what}: {show(ok)}")

    for r in a.execute("SELECT cap, held, acquired, throttled, released, foreign_releases, "
                       "waits, wait_timeouts, expired FROM stage_e_stats() ORDER BY cap"):
        print("stats " + " ".join(show(v) for v in r))
    a.close()
    b.close()
    print("done", flush=True)


try:
    main()
except psycopg.Error as e:
    print(f"ERROR {e.sqlstate} {e}", flush=True)
    sys.exit(1)
