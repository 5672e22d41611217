"""`make layers` (scripts/layers.py): passes on the tree, fails naming a planted cycle.

Plain files, no cluster: each test copies src/ and plants one use that breaks the floors.
"""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "layers.py"


def layers(src):
    return subprocess.run([sys.executable, str(SCRIPT), str(src)], capture_output=True,
                          text=True, timeout=60, check=False)


def copied(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src", src)
    return src


def planted(tmp_path, file, after, line):
    src = copied(tmp_path)
    path = src / file
    text = path.read_text()
    assert after in text, f"{file} no longer has {after!r}: move the plant"
    path.write_text(text.replace(after, after + line + "\n", 1))
    return src


def test_the_tree_keeps_its_floors():
    r = layers(ROOT / "src")
    assert r.returncode == 0, r.stderr
    assert "all downward" in r.stdout


def test_a_bottom_floor_module_using_an_upper_one_fails_naming_the_cycle(tmp_path):
    # gucs is on the bottom floor; slots (floor 8) uses it, so this closes a cycle.
    src = planted(tmp_path, "gucs.rs", "use pgrx::pg_sys;\n", "use crate::slots::SlotError;")
    r = layers(src)
    assert r.returncode != 0
    assert "cycle among modules" in r.stderr and "gucs -> slots" in r.stderr, r.stderr
    assert "src/gucs.rs:" in r.stderr and "upward edge: module `gucs` (floor 1) uses `slots`" \
        in r.stderr, r.stderr


def test_a_use_on_the_same_floor_fails(tmp_path):
    # backend and gucs share the bottom floor: neither may use the other, even without a cycle.
    src = planted(tmp_path, "backend.rs", "use std::cell::{Cell, RefCell};\n",
                  "use crate::gucs as _;")
    r = layers(src)
    assert r.returncode != 0
    assert "`backend` (floor 1) uses `gucs`, on its own floor" in r.stderr, r.stderr


def test_a_path_without_use_counts_too(tmp_path):
    # A call through a full path, `super::` resolved upward, from a file of a folder.
    src = copied(tmp_path)
    path = src / "shmem" / "caps.rs"
    path.write_text(path.read_text() + "\nfn planted() {\n    super::super::hooks::ensure();\n}\n")
    r = layers(src)
    assert r.returncode != 0
    assert "upward edge: module `shmem`" in r.stderr and "uses `hooks`" in r.stderr, r.stderr


def test_a_shmem_file_using_a_later_one_fails(tmp_path):
    src = planted(tmp_path, "shmem/records.rs", "use pgrx::pg_sys;\n", "use super::persist as _;")
    r = layers(src)
    assert r.returncode != 0
    assert "shmem file `records` (floor 1) uses `persist`" in r.stderr, r.stderr
    assert "cycle among shmem files" in r.stderr, r.stderr


def test_a_module_missing_from_the_list_fails(tmp_path):
    src = planted(tmp_path, "lib.rs", "mod worker;\n", "mod unlisted;")
    (src / "unlisted.rs").write_text("use crate::gucs;\n")
    r = layers(src)
    assert r.returncode != 0
    assert "`unlisted` is on no floor" in r.stderr, r.stderr
