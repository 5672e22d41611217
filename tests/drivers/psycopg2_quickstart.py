"""The README's calls from psycopg2, parameters bound as its users bind them (%s; psycopg2
quotes them into the statement client-side, so a string arrives as an untyped literal).
tests/test_drivers.py runs it, reads what it prints and checks the server at each PAUSE.
Connection from PGHOST, PGPORT, PGDATABASE, PGUSER."""

import sys

import psycopg2


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
    with conn.cursor() as cur:
        cur.execute(query, params)
        return cur.fetchone()[0]


def main():
    a = psycopg2.connect("", application_name="drv-a")
    b = psycopg2.connect("", application_name="drv-b")
    a.autocommit = b.autocommit = True  # a slot outlives transactions; no idle-in-transaction

    # Take a slot of a named cap.
    with a.cursor() as cur:
        cur.execute("SELECT stage_e_try_slot(%s, %s)", ("exports", 1))
        slot = cur.fetchone()[0]
    print(f"take exports 1: {show(slot)}", flush=True)
    pause("holding")
    print("second connection take exports 1: "
          + show(value(b, "SELECT stage_e_try_slot(%s, %s)", ("exports", 1))))
    print("second connection wait 50 ms: "
          + show(value(b, "SELECT stage_e_try_slot(%s, %s, %s)", ("exports", 1, "50 ms"))))
    # Release it.
    with a.cursor() as cur:
        cur.execute("SELECT stage_e_release(%s, %s)", ("exports", slot))
        done = cur.fetchone()[0]
    print(f"release exports {slot}: {show(done)}", flush=True)
    pause("released")
    waited = value(b, "SELECT stage_e_try_slot(%s, %s, %s)", ("exports", 1, "10 s"))
    print(f"wait up to 10 s: {show(waited)}")
    done = value(b, "SELECT stage_e_release(%s, %s)", ("exports", waited))
    print(f"release exports {waited}: {show(done)}")

    slots = value(a, "SELECT stage_e_try_slots(%s, %s, %s)", ("batch", 4, 2))
    print(f"take 2 of batch 4: {show(slots)}", flush=True)
    pause("holding batch")
    print("release_all batch: " + show(value(a, "SELECT stage_e_release_all(%s)", ("batch",))))

    # A lease: held by its token, so any connection renews and releases it.
    with a.cursor() as cur:
        cur.execute("SELECT slot, token FROM stage_e_lease(%s, %s, %s)", ("jobs", 2, "30 s"))
        lease_slot, token = cur.fetchone()
    print(f"lease jobs 2 for 30 s: slot {show(lease_slot)} token {show(token)}", flush=True)
    pause("leased")
    ok = value(b, "SELECT stage_e_renew(%s, %s, %s, %s)", ("jobs", lease_slot, token, "60 s"))
    print(f"renew for 60 s: {show(ok)}", flush=True)
    pause("renewed")
    for what in ("release_lease", "release_lease again"):
        with b.cursor() as cur:
            cur.execute("SELECT stage_e_release_lease(%s, %s, %s)", ("jobs", lease_slot, token))
            ok = cur.fetchone()[0]
        print(f"{what}: {show(ok)}")

    with a.cursor() as cur:
        cur.execute("SELECT cap, held, acquired, throttled, released, foreign_releases, waits, "
                    "wait_timeouts, expired FROM stage_e_stats() ORDER BY cap")
        for r in cur.fetchall():
            print("stats " + " ".join(show(v) for v in r))
    a.close()
    b.close()
    print("done", flush=True)


try:
    main()
except psycopg2.Error as e:
    print(f"ERROR {e.pgcode} {e}".strip(), flush=True)
    sys.exit(1)
