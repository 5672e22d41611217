"""The README's calls from asyncpg, parameters bound as its users bind them: asyncpg prepares
every statement and sends no types, so the server infers them; an interval is a timedelta.
tests/test_drivers.py runs it, reads what it prints and checks the server at each PAUSE.
Connection from PGHOST, PGPORT, PGDATABASE, PGUSER."""

import asyncio
import sys
from datetime import timedelta

import asyncpg


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


async def main():
    a = await asyncpg.connect(server_settings={"application_name": "drv-a"})
    b = await asyncpg.connect(server_settings={"application_name": "drv-b"})

    # Take a slot of a named cap.
    slot = await a.fetchval("SELECT stage_e_try_slot($1, $2)", "exports", 1)
    print(f"take exports 1: {show(slot)}", flush=True)
    pause("holding")
    got = await b.fetchval("SELECT stage_e_try_slot($1, $2)", "exports", 1)
    print(f"second connection take exports 1: {show(got)}")
    got = await b.fetchval("SELECT stage_e_try_slot($1, $2, $3)", "exports", 1,
                           timedelta(milliseconds=50))
    print(f"second connection wait 50 ms: {show(got)}")
    # Release it.
    done = await a.fetchval("SELECT stage_e_release($1, $2)", "exports", slot)
    print(f"release exports {slot}: {show(done)}", flush=True)
    pause("released")
    waited = await b.fetchval("SELECT stage_e_try_slot($1, $2, $3)", "exports", 1,
                              timedelta(seconds=10))
    print(f"wait up to 10 s: {show(waited)}")
    done = await b.fetchval("SELECT stage_e_release($1, $2)", "exports", waited)
    print(f"release exports {waited}: {show(done)}")

    slots = await a.fetchval("SELECT stage_e_try_slots($1, $2, $3)", "batch", 4, 2)
    print(f"take 2 of batch 4: {show(slots)}", flush=True)
    pause("holding batch")
    print(f"release_all batch: {show(await a.fetchval('SELECT stage_e_release_all($1)', 'batch'))}")

    # A lease: held by its token, so any connection renews and releases it.
    lease = await a.fetchrow("SELECT slot, token FROM stage_e_lease($1, $2, $3)", "jobs", 2,
                             timedelta(seconds=30))
    print(f"lease jobs 2 for 30 s: slot {show(lease['slot'])} token {show(lease['token'])}",
          flush=True)
    pause("leased")
    ok = await b.fetchval("SELECT stage_e_renew($1, $2, $3, $4)", "jobs", lease["slot"],
                          lease["token"], timedelta(seconds=60))
    print(f"renew for 60 s: {show(ok)}", flush=True)
    pause("renewed")
    for what in ("release_lease", "release_lease again"):
        ok = await b.fetchval("SELECT stage_e_release_lease($1, $2, $3)", "jobs", lease["slot"],
                              lease["token"])
        print(f"{what}: {show(ok)}")

    for r in await a.fetch("SELECT cap, held, acquired, throttled, released, foreign_releases, "
                           "waits, wait_timeouts, expired FROM stage_e_stats() ORDER BY cap"):
        print("stats " + " ".join(show(v) for v in r.values()))
    await a.close()
    await b.close()
    print("done", flush=True)


try:
    asyncio.run(main())
except asyncpg.PostgresError as e:
    print(f"ERROR {e.sqlstate} {e}", flush=True)
    sys.exit(1)
