"""Where the Django app takes its slots: settings read at call time, never at import.

``STAGE_E_SLOTS_DSN``
    A libpq conninfo or URI for the dedicated slot connections (``stage_e_slot``,
    ``@capped``). Unset: built from ``DATABASES["default"]`` by ``dsn()``, i.e. the same
    database, reached with a connection of its own that Django never closes.
``STAGE_E_SLOTS_SESSION_CONNECTION``
    A database alias: hold session slots on that Django connection itself. That is the
    incident's configuration (Django closes its connections, and a closed session's slots go
    with it); the system check stage_e_slots.W001 warns unless the alias's CONN_MAX_AGE is
    None. The app then reports a slot whose connection Django replaced mid-region as lost.
"""

from __future__ import annotations

from typing import Any

import psycopg
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db.utils import load_backend
from psycopg.conninfo import make_conninfo

# Django's own keys of a DATABASES entry that are libpq connection parameters, by libpq name.
_DATABASE_KEYS = {"HOST": "host", "PORT": "port", "USER": "user", "PASSWORD": "password"}


def _libpq_keywords() -> frozenset[str]:
    """The connection parameters this libpq accepts (sslmode, options, service, ...)."""
    return frozenset(o.keyword.decode() for o in psycopg.pq.Conninfo.get_defaults())


def is_postgresql(entry: dict[str, Any]) -> bool:
    """Whether a DATABASES entry is a PostgreSQL database: by its backend's vendor, so that
    PostGIS and third-party backends built on Django's postgresql backend count too."""
    engine = entry.get("ENGINE")
    if not engine:
        return False
    try:
        return bool(load_backend(engine).DatabaseWrapper.vendor == "postgresql")
    except (ImproperlyConfigured, ImportError):
        return False  # a backend that cannot be loaded: Django itself reports that


def database_conninfo(alias: str = "default") -> str:
    """A libpq conninfo for a separate connection to the database of DATABASES[alias]: its
    NAME, HOST, PORT, USER, PASSWORD and those OPTIONS that are libpq parameters (sslmode,
    options, service, ...), not Django's or psycopg's own (isolation_level, pool,
    prepare_threshold, server_side_binding, ...), which mean nothing to libpq."""
    databases: dict[str, dict[str, Any]] = settings.DATABASES
    if alias not in databases:
        raise ImproperlyConfigured(
            f"stage_e_slots: DATABASES has no {alias!r} entry to build the slot connection's "
            f"DSN from (it has {sorted(databases)}); set STAGE_E_SLOTS_DSN")
    if not is_postgresql(databases[alias]):
        raise ImproperlyConfigured(
            f"stage_e_slots: DATABASES[{alias!r}] is not a PostgreSQL database (ENGINE "
            f"{databases[alias].get('ENGINE')!r}), so there is no stage_e_slots there to take "
            "slots of; set STAGE_E_SLOTS_DSN to the database that has the extension")
    entry = databases[alias]
    options: dict[str, Any] = dict(entry.get("OPTIONS") or {})
    keywords = _libpq_keywords()
    params: dict[str, Any] = {k: v for k, v in options.items()
                              if k in keywords and v is not None}
    # Django's NAME: None means the maintenance database "postgres", "" only goes with a
    # service (which names the database itself), as Django itself reads it.
    name = entry.get("NAME")
    if name:
        params["dbname"] = name
    elif name is None and "service" not in params:
        params["dbname"] = "postgres"
    elif "service" not in params:
        raise ImproperlyConfigured(
            f"stage_e_slots: DATABASES[{alias!r}] has neither NAME nor OPTIONS['service']; "
            "set one of them, or STAGE_E_SLOTS_DSN")
    for key, libpq in _DATABASE_KEYS.items():
        value = entry.get(key)
        if value not in (None, ""):
            params[libpq] = str(value)
    return make_conninfo(**params)


def dsn() -> str:
    """The conninfo of the dedicated slot connections: settings.STAGE_E_SLOTS_DSN if set, else
    one built from DATABASES["default"] (``database_conninfo``). Read at each call, so that
    settings overridden in tests (and Django's test database) are followed."""
    configured = getattr(settings, "STAGE_E_SLOTS_DSN", None)
    if configured:
        if not isinstance(configured, str):
            raise ImproperlyConfigured(
                f"stage_e_slots: STAGE_E_SLOTS_DSN must be a libpq conninfo or URI string, "
                f"not {type(configured).__name__}")
        return configured
    return database_conninfo("default")


def session_connection_alias() -> str | None:
    """settings.STAGE_E_SLOTS_SESSION_CONNECTION: the database alias whose Django connection
    holds the session slots, or None (the default: dedicated connections, ``dsn()``)."""
    alias = getattr(settings, "STAGE_E_SLOTS_SESSION_CONNECTION", None)
    if alias in (None, ""):
        return None
    if not isinstance(alias, str):
        raise ImproperlyConfigured(
            f"stage_e_slots: STAGE_E_SLOTS_SESSION_CONNECTION must be a database alias (str), "
            f"not {type(alias).__name__}: {alias!r}")
    return alias
