"""``manage.py stage_e_status``: the caps of a database, their holders and their waiters.

One block per cap (its n, the slots held, the sessions waiting, the live totals of slots
acquired and calls throttled with the throttle rate, and an adaptive cap's limit), then one line
per held slot and one per waiting session, read from the extension's views
(stage_e_throttle_totals, stage_e_stats(), stage_e_cap_limits, stage_e_slot_holders,
stage_e_slot_waiters). ``--interval 2`` refreshes it every 2 seconds, like top.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.db.backends.utils import CursorWrapper

CLEAR = "\x1b[H\x1b[2J"  # cursor home, then erase the screen (ANSI)

# Every query filters on the optional cap the same way, with the cap as a parameter.
_CAP = "(%s::text IS NULL OR cap = %s)"
_EXTENSION = "SELECT extversion, current_database() FROM pg_extension WHERE extname = %s"
_TOTALS = f"SELECT cap, acquired, throttled FROM stage_e_throttle_totals WHERE {_CAP}"
_STATS = f"SELECT cap, n, held FROM stage_e_stats() WHERE {_CAP}"
_HAS_LIMITS = "SELECT to_regclass('stage_e_cap_limits') IS NOT NULL"
_LIMITS = ('SELECT cap, "limit", min_slots, max_slots, enforce, held, reason '
           f"FROM stage_e_cap_limits WHERE {_CAP}")
_HOLDERS = ("SELECT cap, slot, pid, token, held_for, application_name "
            f"FROM stage_e_slot_holders WHERE {_CAP} ORDER BY cap, slot")
_WAITERS = ("SELECT cap, position, pid, n, k, waiting_for, application_name "
            f"FROM stage_e_slot_waiters WHERE {_CAP} ORDER BY cap, position")


def _seconds(d: timedelta | None) -> str:
    return "-" if d is None else f"{d.total_seconds():.1f} s"


def _table(header: Sequence[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """Columns padded to their widest cell; the columns in `right` aligned right."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = []
    for row in [list(header), *rows]:
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return lines


class Command(BaseCommand):
    help = ("Shows each stage_e_slots cap of the database (n, held, waiting, acquired, "
            "throttled, throttle rate, an adaptive cap's limit), then the slots' holders and "
            "the waiting sessions; once, or every --interval seconds.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--interval", type=float, default=None, metavar="SECONDS",
                            help="Refresh every SECONDS seconds, clearing the screen first "
                                 "(until interrupted, unless --count is given).")
        parser.add_argument("--count", type=int, default=None, metavar="N",
                            help="Show N times, then exit (default: once; with --interval, "
                                 "until interrupted).")
        parser.add_argument("--database", default=DEFAULT_DB_ALIAS, metavar="ALIAS",
                            help="The database alias to read (default: %(default)s).")
        parser.add_argument("--cap", default=None, metavar="NAME",
                            help="Show only this cap (its block, holders and waiters).")

    def handle(self, *args: Any, **options: Any) -> None:
        interval: float | None = options["interval"]
        count: int | None = options["count"]
        alias: str = options["database"]
        cap: str | None = options["cap"]
        if interval is not None and interval <= 0:
            raise CommandError(f"--interval must be a positive number of seconds, not {interval}")
        if count is not None and count < 1:
            raise CommandError(f"--count must be at least 1, not {count}")
        if alias not in connections:
            raise CommandError(f"--database {alias!r} is not a database alias of DATABASES "
                               f"({', '.join(connections)})")
        if count is None:
            count = 1 if interval is None else 0  # 0: until interrupted
        shown = 0
        try:
            while True:
                frame = self.frame(alias, cap)
                if interval is not None:
                    self.stdout.write(CLEAR, ending="")
                self.stdout.write("\n".join(frame))
                shown += 1
                if shown == count or interval is None:
                    return
                time.sleep(interval)
        except KeyboardInterrupt:
            return  # the way to stop a refresh loop

    def frame(self, alias: str, cap: str | None) -> list[str]:
        """What one look shows, as lines."""
        try:
            with connections[alias].cursor() as cur:
                return self._frame(cur, cap)
        except DatabaseError as e:
            raise CommandError(f"cannot read stage_e_slots' views on database {alias!r}: "
                               f"{e}".rstrip()) from e

    def _frame(self, cur: CursorWrapper, cap: str | None) -> list[str]:
        only = [cap, cap]
        cur.execute(_EXTENSION, ["stage_e_slots"])
        ext = cur.fetchone()
        if ext is None:
            raise CommandError("the stage_e_slots extension is not installed in this database "
                               "(CREATE EXTENSION stage_e_slots, as a superuser)")
        version, database = ext
        cur.execute(_TOTALS, only)
        totals = {r[0]: (int(r[1]), int(r[2])) for r in cur.fetchall()}
        cur.execute(_STATS, only)
        stats = {r[0]: (r[1], int(r[2])) for r in cur.fetchall()}
        cur.execute(_HAS_LIMITS)
        limits: dict[str, tuple[Any, ...]] = {}
        row = cur.fetchone()
        if row is not None and row[0]:
            cur.execute(_LIMITS, only)
            limits = {r[0]: tuple(r[1:]) for r in cur.fetchall()}
        cur.execute(_HOLDERS, only)
        holders = cur.fetchall()
        cur.execute(_WAITERS, only)
        waiters = cur.fetchall()
        waiting: dict[str, int] = {}
        for w in waiters:
            waiting[w[0]] = waiting.get(w[0], 0) + 1

        lines = [f"stage_e_slots {version}, database {database}, "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
                 + (f", cap {cap}" if cap is not None else ""), ""]
        caps = sorted(set(totals) | set(stats) | set(limits) | set(waiting)
                      | {h[0] for h in holders})
        if not caps:
            lines.append("no caps" + (f" named {cap!r}" if cap is not None else "") +
                         " in use or counted in this database")
        for i, name in enumerate(caps):
            lines += [""] if i else []
            lines += self._cap_block(name, totals.get(name), stats.get(name),
                                     limits.get(name), waiting.get(name, 0))
        lines += ["", "HOLDERS"]
        if holders:
            lines += _table(
                ["cap", "slot", "holder", "held for", "application_name"],
                [[h[0], str(h[1]),
                  f"pid {h[2]}" if h[3] is None else f"lease {h[3]} (pid {h[2]})",
                  _seconds(h[4]), h[5] or ""] for h in holders], right={1})
        else:
            lines.append("(none)")
        lines += ["", "WAITERS"]
        if waiters:
            lines += _table(
                ["cap", "position", "pid", "n", "k", "waiting for", "application_name"],
                [[w[0], str(w[1]), str(w[2]), str(w[3]), str(w[4]), _seconds(w[5]), w[6] or ""]
                 for w in waiters], right={1, 2, 3, 4})
        else:
            lines.append("(none)")
        return lines

    @staticmethod
    def _cap_block(name: str, totals: tuple[int, int] | None, stats: tuple[Any, int] | None,
                   limit: tuple[Any, ...] | None, waiting: int) -> list[str]:
        acquired, throttled = totals or (0, 0)
        n, held = stats or (None, 0)
        calls = acquired + throttled
        # The share of slot requests refused: what to tune n against.
        rate = f"{100 * throttled / calls:.1f}%" if calls else "-"
        block = [f"cap {name}: n {'-' if n is None else n}, held {held}, waiting {waiting}",
                 f"  acquired {acquired}, throttled {throttled}, throttle rate {rate}"]
        if limit is not None:
            value, lo, hi, enforce, _held, reason = limit
            block.append(f"  adaptive limit {value} (min {lo}, max {hi}, "
                         f"{'enforced' if enforce else 'monitor only'})"
                         + (f": {reason}" if reason else ""))
        return block
