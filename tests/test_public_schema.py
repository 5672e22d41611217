"""Where `public` is writable by every role (PostgreSQL 14 and earlier by default, and clusters
upgraded from them), any role can plant a function that shadows ours for callers whose driver
sends untyped parameters (node-postgres sends every parameter so; psycopg 3 sends a str so):
`public.stage_e_try_slot(text, text)` is a better match for `stage_e_try_slot($1, $2)` with two
unknowns than ours, `(text, integer)`. The README's install section says what to do; this shows
the attack, then that each remedy it names stops it. The planting role has CONNECT only."""

import psycopg
import pytest
from conftest import one
from psycopg import errors

PLANT = ("CREATE FUNCTION public.stage_e_try_slot(cap text, n text) RETURNS integer "
         "LANGUAGE sql AS 'SELECT 42'")
UNTYPED_CALL = "SELECT stage_e_try_slot(%s, %s)"  # psycopg 3 sends both str as unknown


@pytest.fixture
def planter(cluster):
    cluster.sql("DROP ROLE IF EXISTS planter")
    cluster.sql("CREATE ROLE planter LOGIN")
    yield
    for db in cluster.sql("SELECT datname FROM pg_database WHERE datname LIKE 'pub_%'"):
        cluster.sql(f'DROP DATABASE IF EXISTS "{db[0]}" WITH (FORCE)')
    cluster.sql("DROP ROLE planter")


def database(cluster, name, schema=None, public_writable=True):
    """A database with the extension (in `schema`, or public) and, if asked, public writable by
    every role as before PostgreSQL 15."""
    cluster.create_database(name, extension=False)
    with cluster.connect(name) as c:
        c.autocommit = True
        if public_writable:
            c.execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
        if schema:
            c.execute(f"CREATE SCHEMA {schema}")
            c.execute(f"GRANT USAGE ON SCHEMA {schema} TO PUBLIC")
            c.execute(f"CREATE EXTENSION stage_e_slots SCHEMA {schema}")
        else:
            c.execute("CREATE EXTENSION stage_e_slots")
    return name


def as_planter(cluster, db):
    return psycopg.connect(cluster.conninfo(db, "planter", user="planter"), autocommit=True)


def test_a_writable_public_lets_any_role_shadow_the_untyped_call(cluster, planter):
    """The risk, shown: the worker's untyped call runs the planted function, not ours."""
    db = database(cluster, "pub_open")
    with as_planter(cluster, db) as p:
        p.execute(PLANT)
    with cluster.connect(db) as worker:
        assert one(worker, UNTYPED_CALL, ("jobs", "8")) == 42
        assert one(worker, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'") == 0


def test_revoking_create_on_public_refuses_the_plant(cluster, planter):
    """Remedy 1: `REVOKE CREATE ON SCHEMA public FROM PUBLIC` (PostgreSQL 15's default): the
    plant is refused (42501) and the untyped call takes our slot."""
    db = database(cluster, "pub_revoked")
    cluster.sql("REVOKE CREATE ON SCHEMA public FROM PUBLIC", dbname=db)
    with as_planter(cluster, db) as p, pytest.raises(errors.InsufficientPrivilege):
        p.execute(PLANT)
    with cluster.connect(db) as worker:
        assert one(worker, UNTYPED_CALL, ("jobs", "8")) == 0
        assert one(worker, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                           "AND pid = pg_backend_pid()") == 1


def test_its_own_schema_first_and_public_off_the_workers_path_stops_it(cluster, planter):
    """Remedy 2: the extension in a schema of its own, and the worker role's search_path
    without public: a plant in public (still writable here) is never a candidate."""
    db = database(cluster, "pub_own_schema", schema="stage_e")
    with as_planter(cluster, db) as p:
        p.execute(PLANT)
    with cluster.connect(db) as worker:
        worker.execute("SET search_path = stage_e")
        assert one(worker, UNTYPED_CALL, ("jobs", "8")) == 0
        assert one(worker, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                           "AND pid = pg_backend_pid()") == 1
        # With public back on the path, the plant wins again: the remedy is the path.
        worker.execute("SET search_path = stage_e, public")
        assert one(worker, UNTYPED_CALL, ("jobs2", "8")) == 42


def test_a_call_qualified_with_the_extensions_own_schema_is_never_shadowed(cluster, planter):
    """Remedy 3: the extension in a schema of its own and the calls qualified with it: only
    that schema's functions are candidates, whatever the search_path."""
    db = database(cluster, "pub_qualified", schema="stage_e")
    with as_planter(cluster, db) as p:
        p.execute(PLANT)
    with cluster.connect(db) as worker:
        worker.execute("SET search_path = public, stage_e")
        assert one(worker, "SELECT stage_e.stage_e_try_slot(%s, %s)", ("jobs", "8")) == 0
        assert one(worker, UNTYPED_CALL, ("jobs2", "8")) == 42  # unqualified: the plant
