"""The installed distribution itself: its version is the extension's, it is typed, and it is
the wheel's copy that runs (tests/python/conftest.py refuses the source tree)."""

import importlib.metadata
import sys
from pathlib import Path

import stage_e_slots
import tomllib

REPO = Path(__file__).resolve().parents[2]


def test_version_is_the_extensions():
    cargo = tomllib.loads((REPO / "Cargo.toml").read_text())["package"]["version"]
    assert stage_e_slots.__version__ == cargo
    assert importlib.metadata.version("stage-e-slots") == cargo


def test_installed_wheel_is_typed_and_outside_the_source_tree():
    installed = Path(stage_e_slots.__file__).resolve().parent
    assert (installed / "py.typed").is_file()
    assert Path(sys.prefix).resolve() in installed.parents
    assert REPO / "python" not in installed.parents
    files = importlib.metadata.files("stage-e-slots") or []
    assert any(str(f).endswith("stage_e_slots/py.typed") for f in files)
