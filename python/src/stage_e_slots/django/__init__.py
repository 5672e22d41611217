"""stage_e_slots for Django: add ``"stage_e_slots.django"`` to INSTALLED_APPS.

- ``stage_e_slot(cap, n, *, wait=0, k=1)``: a slot for a region, held on a dedicated
  connection to the database of ``conf.dsn()`` (settings.STAGE_E_SLOTS_DSN, else
  DATABASES["default"]), never on ``django.db.connection``, which Django closes whenever
  anything calls ``close_old_connections()`` (the incident this project exists for).
- ``conf.dsn()``: that DSN, also what ``stage_e_slots.capped`` uses under Django.
- The admin of the extension's counter rows (``stage_e_throttle_counter``, read-only).
- The system checks stage_e_slots.W001 (slots held on a Django connection that Django closes,
  STAGE_E_SLOTS_SESSION_CONNECTION), E001-E003 and W002.
- ``manage.py stage_e_status``: caps, holders and waiters, once or refreshed.
"""

from __future__ import annotations

from ._session import SessionSlotConnection, stage_e_slot

__all__ = ["SessionSlotConnection", "stage_e_slot"]
