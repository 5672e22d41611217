#!/usr/bin/env python3
"""Generates the Python package's sync modules from its asyncio ones, as httpcore does:

    python scripts/generate_sync.py          # writes python/src/stage_e_slots/_slots.py, _leases.py
    python scripts/generate_sync.py --check  # exit 1 and a diff when one is stale (make lint)

The asyncio code is the one source of what the two APIs share: ``_aio_slots.py`` (the slot
connection: take, release, holding, the region, connection_for, stage_e_slot) becomes
``_slots.py``, and ``_aio_leases.py`` (Lease, stage_e_lease, the DSN's lease connection) becomes
``_leases.py``. The transformation is unasync's (PyPI ``unasync``, python-trio: ``async`` and
``await`` taken out, ``asynccontextmanager``/``AsyncIterator`` made sync) with the token
replacements below, then the textual ones (docstrings and comments name the sync classes), a
header, the sync module's own docstring, and the imports sorted (ruff).

Hand-written, because they are not twins:
- ``_aio_line.py``: one connection per event loop shared by its tasks in turns, the head's
  server-side wait interrupted (cancel request) when a release queues behind it, the per-loop
  registry swept when loops close, shielding from cancellation, and leases on a caller's
  AsyncConnection. A thread has none of that: its counterpart, ``_sync_line.py``, keeps one
  connection per thread (replaced after a fork or a failure) with the same interface, and
  takes leases on any DB-API connection (Django's included), which aio does not.
- ``_common.py``: what both share and that does no I/O (SQL, argument checks, exceptions).
- ``aio.py`` and ``__init__.py``: the public modules and their docs; ``_capped.py`` (one
  decorator for both kinds of function) and ``django/``.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import unasync

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "src" / "stage_e_slots"

# source (asyncio) -> generated (sync), with the generated module's docstring.
FILES = {
    "_aio_slots.py": ("_slots.py", (
        "The sync API's session slots: ``SlotConnection``, ``connection_for`` and "
        "``stage_e_slot``\n(their docs are ``stage_e_slots``'). Private.")),
    "_aio_leases.py": ("_leases.py", (
        "The sync API's leases: ``Lease`` and ``stage_e_lease`` (their docs are\n"
        "``stage_e_slots``'). Private.")),
}

# Names (tokens) renamed on the way, beyond unasync's own (asynccontextmanager, AsyncIterator...).
TOKENS = {
    "_aio_line": "_sync_line",
    "AsyncConn": "Conn",
    "AsyncSlotConnection": "SlotConnection",
    "AsyncLease": "Lease",
    "_AsyncDsnStatements": "_DsnStatements",
    "_AsyncConnectionStatements": "_ConnectionStatements",
    "dsn_or_async_connection": "dsn_or_connection",
}

# Then in the text (docstrings, comments, messages), in this order.
TEXT = [
    *((rf"\b{old}\b", new) for old, new in TOKENS.items()),
    (r"``async with ", "``with "),
    (r"stage_e_slots\.aio\.", "stage_e_slots."),
]

HEADER = ("# Generated from {source} by scripts/generate_sync.py; do not edit. Edit {source},\n"
          "# then run `python scripts/generate_sync.py` (`make lint` checks this is current).\n")


def generate(source: str) -> str:
    target, docstring = FILES[source]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "_async", target)
        src.parent.mkdir()
        shutil.copyfile(PACKAGE / source, src)
        rule = unasync.Rule("/_async/", "/_sync/", additional_replacements=TOKENS)
        unasync.unasync_files([str(src)], rules=[rule])
        text = Path(tmp, "_sync", target).read_text()
    for pattern, new in TEXT:
        text = re.sub(pattern, new, text)
    text, found = re.subn(r'\A""".*?"""\n', f'"""{docstring}"""\n', text, count=1, flags=re.DOTALL)
    if not found:
        raise SystemExit(f"{source} must open with its docstring")
    # The renamed imports sort elsewhere: ruff (the project's linter, beside this Python)
    # sorts them as `make lint` wants them.
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        raise SystemExit("scripts/generate_sync.py needs ruff (make deps installs it in .venv)")
    sorted_text = subprocess.run(
        [ruff, "check", "--config", str(ROOT / "python" / "pyproject.toml"), "--select", "I",
         "--fix-only", "--exit-zero", "--quiet", "--stdin-filename", str(PACKAGE / target), "-"],
        input=HEADER.format(source=source) + text, capture_output=True, text=True, check=True)
    return sorted_text.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a generated file is not current")
    args = parser.parse_args()
    stale = 0
    for source, (target, _) in FILES.items():
        want = generate(source)
        path = PACKAGE / target
        have = path.read_text() if path.exists() else ""
        if have == want:
            continue
        if args.check:
            stale += 1
            rel = path.relative_to(ROOT)
            sys.stdout.writelines(difflib.unified_diff(
                have.splitlines(keepends=True), want.splitlines(keepends=True),
                f"{rel} (as it is)", f"{rel} (generated from {source})"))
            print(f"{rel} is not what scripts/generate_sync.py generates from {source}: edit "
                  f"{source}, not it, and run `python scripts/generate_sync.py`", file=sys.stderr)
        else:
            path.write_text(want)
            print(f"wrote {path.relative_to(ROOT)}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
