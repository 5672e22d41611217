"""stage_e_slots: concurrency caps enforced inside PostgreSQL, from Python.

See the README's "Using it from Python" section. The sync API is here; ``stage_e_slots.aio``
has the same for asyncio, and ``stage_e_slots.django`` is the Django app.
"""

from __future__ import annotations

from ._capped import Throttled, capped
from ._leases import Lease, LeaseLost, stage_e_lease
from ._slots import DEFAULT_CAP, SlotConnection, connection_for, stage_e_slot

__version__ = "0.9.0"

__all__ = [
    "DEFAULT_CAP",
    "Lease",
    "LeaseLost",
    "SlotConnection",
    "Throttled",
    "__version__",
    "capped",
    "connection_for",
    "stage_e_lease",
    "stage_e_slot",
]
