"""Every call of every function of the extension resolves when all its parameters are untyped,
as node-postgres sends them and asyncpg prepares them. Generated from the catalog: for each
function and each number of arguments its defaults allow, `PREPARE` a call whose parameters
have no type; it must resolve to exactly that function (the statement's inferred parameter
types are the function's argument types). Run on every major."""

from psycopg import errors

from conftest import one

# The extension's functions: name, argument types, how many have defaults.
FUNCTIONS = """
SELECT p.proname, p.proargtypes::oid[]::regtype[]::text[], p.pronargdefaults, n.nspname
  FROM pg_depend d
  JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'stage_e_slots'
  JOIN pg_proc p ON p.oid = d.objid AND d.classid = 'pg_proc'::regclass
  JOIN pg_namespace n ON n.oid = p.pronamespace
 WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e' AND p.prokind = 'f'
 ORDER BY 1, 2
"""


def calls(conn):
    """(name, arity, expected parameter types, schema) for every call the catalog allows."""
    out = []
    for name, types, ndefaults, schema in conn.execute(FUNCTIONS).fetchall():
        for k in range(len(types) - ndefaults, len(types) + 1):
            out.append((name, k, types[:k], schema))
    return out


def unresolved(conn):
    """The calls that do not resolve to exactly their function with untyped parameters, as
    (name, arity, SQLSTATE or the parameter types they resolved to)."""
    bad = []
    for i, (name, k, types, schema) in enumerate(calls(conn)):
        stmt = f"untyped_{i}"
        args = ", ".join(f"${j + 1}" for j in range(k))
        try:
            conn.execute(f'PREPARE {stmt} AS SELECT "{schema}"."{name}"({args})')
        except (errors.AmbiguousFunction, errors.UndefinedFunction) as e:
            bad.append((name, k, e.sqlstate))
            continue
        got = one(conn, "SELECT parameter_types::text[] FROM pg_prepared_statements "
                        "WHERE name = %s", (stmt,))
        conn.execute(f"DEALLOCATE {stmt}")
        if got != types:
            bad.append((name, k, got))
    return bad


def test_every_call_resolves_with_untyped_parameters(connect):
    c = connect()
    every = calls(c)
    # The catalog query sees the whole surface: the documented calls are among those checked.
    names = {(name, k) for name, k, _, _ in every}
    assert {("stage_e_try_slot", 1), ("stage_e_try_slot", 2), ("stage_e_try_slot", 3),
            ("stage_e_try_slots", 3), ("stage_e_try_slots", 4), ("stage_e_release", 1),
            ("stage_e_release", 2), ("stage_e_release_all", 0), ("stage_e_release_all", 1),
            ("stage_e_holding", 1), ("stage_e_holding", 2), ("stage_e_lease", 3),
            ("stage_e_lease", 4), ("stage_e_renew", 4), ("stage_e_release_lease", 3),
            ("stage_e_slot_token", 2), ("stage_e_cap_key", 1), ("stage_e_stats", 0),
            ("stage_e_flush", 0), ("stage_e_pending", 0), ("stage_e_pending", 1),
            ("stage_e_reset_stats", 0), ("stage_e_reset_stats", 1),
            ("stage_e_snapshot", 0), ("stage_e_adapt", 3), ("stage_e_adapt", 4),
            ("stage_e_adapt_off", 1)} <= names
    assert len(every) == len(set((n, k, tuple(t)) for n, k, t, _ in every))
    assert unresolved(c) == []


def test_the_two_argument_call_resolves_to_cap_and_n(connect):
    c = connect()
    c.execute("PREPARE two AS SELECT stage_e_try_slot($1, $2)")
    assert one(c, "SELECT parameter_types::text[] FROM pg_prepared_statements "
                  "WHERE name = 'two'") == ["text", "integer"]
    assert one(c, "EXECUTE two('exports', '1')") == 0
    assert one(connect("other"), "SELECT stage_e_try_slot('exports', 1)") is None


def test_the_check_finds_the_0_4_0_ambiguity(cluster):
    """The same generated check, on a database at 0.4.0, finds the one call that failed there:
    stage_e_try_slot with two untyped parameters (cap, n) or (n, wait)."""
    cluster.create_database("overloads_040", extension=False)
    cluster.sql("CREATE EXTENSION stage_e_slots VERSION '0.4.0'", dbname="overloads_040")
    with cluster.connect("overloads_040") as c:
        # Once per function of two arguments: (cap text, n integer) and (n integer, wait interval).
        assert unresolved(c) == [("stage_e_try_slot", 2, "42725")] * 2
        c.execute("ALTER EXTENSION stage_e_slots UPDATE")
        assert unresolved(c) == []
