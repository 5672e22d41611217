"""System checks (``manage.py check``, and every management command's start).

- stage_e_slots.W001: STAGE_E_SLOTS_SESSION_CONNECTION names a connection whose CONN_MAX_AGE is
  not None. Django closes such a connection whenever anything calls close_old_connections()
  (every request's start and end, django-q2's ORM broker on each enqueue), and a session slot
  goes with its session: the cap stops binding. That is the incident this project exists for.
- stage_e_slots.E001: STAGE_E_SLOTS_SESSION_CONNECTION names no database of DATABASES.
- stage_e_slots.E002: it names a database that is not PostgreSQL.
- stage_e_slots.E003: it names a database with a connection pool (OPTIONS["pool"]): a closed
  connection goes back to the pool with its slots still held, to serve another thread.
- stage_e_slots.W002: no STAGE_E_SLOTS_DSN and no PostgreSQL DATABASES["default"] to build the
  dedicated connection's DSN from (``stage_e_slot`` and ``@capped`` would fail).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks

from .conf import is_postgresql

_FIX = ("hold slots on a dedicated connection: unset STAGE_E_SLOTS_SESSION_CONNECTION (the "
        "slots then use STAGE_E_SLOTS_DSN, or DATABASES['default'] on a connection of their "
        "own); or take leases (stage_e_slots.stage_e_lease)")


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """The stage_e_slots settings' checks (registered by the app's ready())."""
    messages: list[checks.CheckMessage] = []
    databases: dict[str, dict[str, Any]] = settings.DATABASES
    alias = getattr(settings, "STAGE_E_SLOTS_SESSION_CONNECTION", None)
    if alias not in (None, ""):
        messages += _check_session_connection(alias, databases)
    if not getattr(settings, "STAGE_E_SLOTS_DSN", None) and not (
            "default" in databases and is_postgresql(databases["default"])):
        messages.append(checks.Warning(
            "stage_e_slots has no database for its dedicated slot connections: "
            "STAGE_E_SLOTS_DSN is not set and DATABASES['default'] is not a PostgreSQL "
            "database, so stage_e_slots.django.stage_e_slot and @capped will fail.",
            hint="Set STAGE_E_SLOTS_DSN to the conninfo of the database that has the "
                 "stage_e_slots extension.",
            id="stage_e_slots.W002"))
    return messages


def _check_session_connection(alias: object,
                              databases: dict[str, dict[str, Any]]) -> list[checks.CheckMessage]:
    if not isinstance(alias, str) or alias not in databases:
        return [checks.Error(
            f"STAGE_E_SLOTS_SESSION_CONNECTION is {alias!r}, which is not a database alias of "
            f"DATABASES ({', '.join(sorted(databases)) or 'none'}).",
            hint=f"Name a database of DATABASES, or {_FIX}.",
            id="stage_e_slots.E001")]
    entry = databases[alias]
    if not is_postgresql(entry):
        return [checks.Error(
            f"STAGE_E_SLOTS_SESSION_CONNECTION is {alias!r}, a database that is not PostgreSQL "
            f"(ENGINE {entry.get('ENGINE')!r}): it has no stage_e_slots to hold slots of.",
            hint="Name the PostgreSQL database that has the stage_e_slots extension, or "
                 "remove the setting and set STAGE_E_SLOTS_DSN.",
            id="stage_e_slots.E002")]
    messages: list[checks.CheckMessage] = []
    if (entry.get("OPTIONS") or {}).get("pool"):
        messages.append(checks.Error(
            f"STAGE_E_SLOTS_SESSION_CONNECTION is {alias!r}, whose connections come from a "
            "connection pool (OPTIONS['pool']): when Django closes one it goes back to the "
            "pool with its session slots still held, and serves another thread next.",
            hint=f"{_FIX[:1].upper()}{_FIX[1:]}.",
            id="stage_e_slots.E003"))
    # Django's default CONN_MAX_AGE is 0 (missing counts as 0): only None keeps a connection.
    conn_max_age = entry.get("CONN_MAX_AGE", 0)
    if conn_max_age is not None:
        default = " (Django's default)" if conn_max_age == 0 else ""
        messages.append(checks.Warning(
            f"STAGE_E_SLOTS_SESSION_CONNECTION = {alias!r} holds session slots on a connection "
            f"that Django closes: its CONN_MAX_AGE is {conn_max_age!r}{default}, so any "
            "close_old_connections() (each request's start and end, django-q2's ORM broker "
            "on every enqueue) may close it in the middle of a capped region. A slot goes with "
            "its session, so the cap stops binding (the incident stage_e_slots was made for).",
            hint=f"{_FIX[:1].upper()}{_FIX[1:]}; or, keeping the setting, set "
                 f"DATABASES[{alias!r}]['CONN_MAX_AGE'] = None (a persistent connection, which "
                 "Django still closes after a database error).",
            id="stage_e_slots.W001"))
    return messages
