"""The package's tests run against the *installed* wheel (make test-python installs it into a
fresh venv), never against python/src: a file missing from the wheel must fail here.

tests/conftest.py gives the fixtures (pytest finds it as this directory's parent's); its
helpers are re-exported here, because `from conftest import ...` in tests/python finds this
module first."""

import importlib.util
import sys
from pathlib import Path

import stage_e_slots

_SOURCE = Path(__file__).resolve().parents[2] / "python" / "src"
_INSTALLED = Path(stage_e_slots.__file__).resolve()
if _SOURCE in _INSTALLED.parents or "site-packages" not in _INSTALLED.parts:
    raise RuntimeError(f"stage_e_slots was imported from {_INSTALLED}, not from an installed "
                       "wheel: run these tests with `make test-python` (a fresh venv with the "
                       "wheel installed)")


def _parent_conftest():
    name = "stage_e_tests_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parents[1] / "conftest.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_helpers = _parent_conftest()
KEY, cap_locks, one, slot_lock_holders, stats, wait_for = (
    _helpers.KEY, _helpers.cap_locks, _helpers.one, _helpers.slot_lock_holders, _helpers.stats,
    _helpers.wait_for)
