"""`make demo`: a throwaway cluster with stage_e_slots preloaded, and the cap at work."""

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pgcluster import Cluster, wait_for


def show(title, cur):
    print(f"\n== {title}")
    cols = [d.name for d in cur.description]
    rows = [["" if v is None else str(v) for v in r] for r in cur.fetchall()]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c)
              for i, c in enumerate(cols)]
    print("  " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("  " + "-+-".join("-" * w for w in widths))
    for r in rows:
        print("  " + " | ".join(v.ljust(w) for v, w in zip(r, widths)))


def main():
    cluster = Cluster("demo", {"log_min_messages": "log"}).init().start()
    print(f"Started a throwaway PostgreSQL cluster in {cluster.base} "
          "with shared_preload_libraries = 'stage_e_slots'")
    try:
        cluster.sql("CREATE EXTENSION stage_e_slots")
        admin = cluster.connect(application_name="demo-admin")
        workers = [cluster.connect(application_name=f"worker-{i:02}") for i in range(1, 13)]

        print("\n== 12 workers race for stage_e_try_slot(8) at the same moment")
        with ThreadPoolExecutor(12) as pool:
            got = list(pool.map(
                lambda c: c.execute("SELECT stage_e_try_slot(8)").fetchone()[0], workers))
        for c, slot in zip(workers, got):
            outcome = f"slot {slot}" if slot is not None else "NULL (throttled)"
            print(f"  {c.info.parameter_status('application_name')}  pid {c.info.backend_pid:<6} "
                  f"-> {outcome}")

        show("SELECT slot, pid, application_name, state, held_for FROM stage_e_slot_holders",
             admin.execute("SELECT slot, pid, application_name, state, "
                           "date_trunc('milliseconds', held_for) AS held_for "
                           "FROM stage_e_slot_holders"))

        holder = next(c for c, s in zip(workers, got) if s == 0)
        thief = next(c for c, s in zip(workers, got) if s is None)
        notices = []
        thief.add_notice_handler(lambda d: notices.append(
            (d.severity, d.message_primary, d.message_detail)))
        ok = thief.execute("SELECT stage_e_release(0)").fetchone()[0]
        print(f"\n== {thief.info.parameter_status('application_name')} (holds nothing) calls "
              f"stage_e_release(0) -> {ok}")
        for sev, msg, detail in notices:
            print(f"  {sev}:  {msg}\n  DETAIL:  {detail}")
        still = holder.execute("SELECT stage_e_holding(0)").fetchone()[0]
        print(f"  {holder.info.parameter_status('application_name')} still holds slot 0: {still}")

        print(f"\n== The incident: a framework closes "
              f"{holder.info.parameter_status('application_name')}'s connection mid-region")
        pid = holder.info.backend_pid
        holder.close()
        wait_for(lambda: not admin.execute(
            "SELECT 1 FROM stage_e_slot_holders WHERE pid = %s", (pid,)).fetchone(),
            what="the slot to be freed")
        time.sleep(0.2)
        for line in cluster.log_text().splitlines():
            if "exited holding" in line:
                print("  server log: " + line.split(": ", 1)[1])
        retry = thief.execute("SELECT stage_e_try_slot(8)").fetchone()[0]
        print(f"  the freed slot goes to the next worker at once: stage_e_try_slot(8) -> {retry}")

        print("\n== Named caps: 'exports' has slots of its own, and a caller can wait for one")
        exporter = cluster.connect(application_name="exporter")
        waiter = cluster.connect(application_name="export-waiter")
        first = exporter.execute("SELECT stage_e_try_slot('exports', 1)").fetchone()[0]
        print(f"  exporter: stage_e_try_slot('exports', 1) -> {first}")
        got_export = []
        started = time.monotonic()
        t = threading.Thread(target=lambda: got_export.append(waiter.execute(
            "SELECT stage_e_try_slot('exports', 1, '10 s')").fetchone()[0]))
        t.start()
        wait_for(lambda: admin.execute("SELECT count(*) FROM stage_e_slot_waiters").fetchone()[0],
                 what="the waiter to queue")
        show("SELECT cap, pid, position, wait_event_type FROM stage_e_slot_waiters",
             admin.execute("SELECT cap, pid, position, wait_event_type "
                           "FROM stage_e_slot_waiters"))
        exporter.execute("SELECT stage_e_release('exports', 0)")
        t.join(timeout=15)  # its wait is 10 s: still running after 15 is a hang
        if t.is_alive():
            raise SystemExit("the waiter did not return within 15 s")
        print(f"  exporter releases; export-waiter's stage_e_try_slot('exports', 1, '10 s') "
              f"returns slot {got_export[0]} after {time.monotonic() - started:.2f} s, woken by "
              "the release")
        exporter.close()
        waiter.close()

        show("SELECT cap, held, acquired, throttled, released, foreign_releases, "
             "released_by_exit, waits, wait_time FROM stage_e_stats()",
             admin.execute("SELECT cap, held, acquired, throttled, released, foreign_releases, "
                           "released_by_exit, waits, date_trunc('milliseconds', wait_time) "
                           "AS wait_time FROM stage_e_stats()"))
        admin.execute("SELECT stage_e_flush()")
        show("After SELECT stage_e_flush(): SELECT cap, throttled, foreign_releases, "
             "released_by_exit, flushed_at FROM stage_e_throttle_counter",
             admin.execute("SELECT cap, throttled, foreign_releases, released_by_exit, "
                           "date_trunc('seconds', flushed_at) AS flushed_at "
                           "FROM stage_e_throttle_counter ORDER BY cap"))
        for c in workers:
            if not c.closed:
                c.close()
        admin.close()
    finally:
        cluster.destroy()
        print("\nStopped and removed the demo cluster.")


if __name__ == "__main__":
    main()
