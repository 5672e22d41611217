"""Every call of every function of the extension resolves when all its parameters are untyped,
as node-postgres sends them and asyncpg prepares them. Generated from the catalog: for each
function and each number of arguments its defaults allow, `PREPARE` a call whose parameters
have no type; it must resolve to exactly that function (the statement's inferred parameter
types are the function's argument types). Run on every major. Also from the catalog: the
functions with a form without `cap` are the ones the README's Functions section names."""

import re
from pathlib import Path

import pytest
from conftest import FUNCTION_SAMPLES, extension_calls, extension_signatures, one
from psycopg import errors

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
    assert len(every) == len({(n, k, tuple(t)) for n, k, t, _ in every})
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


# Every function of the extension with the names of its input arguments.
INPUTS = """
SELECT p.proname,
       ARRAY(SELECT a.name
               FROM unnest(p.proargnames,
                           coalesce(p.proargmodes, array_fill('i'::"char",
                                    ARRAY[coalesce(cardinality(p.proargnames), 0)])))
                    AS a(name, mode)
              WHERE a.mode IN ('i', 'b', 'v'))
  FROM pg_depend d
  JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'stage_e_slots'
  JOIN pg_proc p ON p.oid = d.objid AND d.classid = 'pg_proc'::regclass
 WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e' AND p.prokind = 'f'
"""

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_forms_without_cap():
    """The functions the README's Functions section says have a form without `cap`: (those
    whose form is for the cap `default`, those whose form is for every cap)."""
    section = README.read_text().split("\n### Functions\n", 1)[1]
    head = " ".join(section.split("No two functions", 1)[0].split())
    named, _ = head.split(" The other functions that take a cap have no form without it", 1)
    for_default, for_every_cap = named.split("for the cap named `default`", 1)
    return (set(re.findall(r"`(stage_e_\w+)`", for_default)),
            set(re.findall(r"`(stage_e_\w+)`", for_every_cap)))


def test_the_functions_with_a_form_without_cap_are_the_ones_the_readme_names(connect):
    """From the catalog: of the functions that take a `cap` argument, those that also have a
    form without one are exactly the README's two lists (a new form, or a new cap-only
    function named there, fails this until the sentence says so)."""
    forms = {}
    for name, args in connect().execute(INPUTS).fetchall():
        forms.setdefault(name, []).append(args)
    takes_cap = {n for n, fs in forms.items() if any("cap" in a for a in fs)}
    without_cap = {n for n in takes_cap if any("cap" not in a for a in forms[n])}
    for_default, for_every_cap = readme_forms_without_cap()
    assert for_default and for_every_cap and not for_default & for_every_cap
    assert for_default | for_every_cap == without_cap
    # The cap-only ones, among them the lease functions and stage_e_slot_token.
    assert {"stage_e_try_slots", "stage_e_lease", "stage_e_renew", "stage_e_release_lease",
            "stage_e_slot_token", "stage_e_cap_key"} <= takes_cap - without_cap
    # A form for `default` takes what the cap's form takes, less the cap.
    for name in for_default:
        capless = [a for a in forms[name] if "cap" not in a]
        assert all(a in [[x for x in f if x != "cap"] for f in forms[name] if "cap" in f]
                   for a in capless), (name, forms[name])


def test_the_forms_without_cap_act_on_default_or_on_every_cap(connect):
    """What the two lists mean: the first ones' forms are the cap `default`'s, the others'
    act on every cap of the database."""
    c, other = connect(), connect("other")
    for_default, for_every_cap = readme_forms_without_cap()
    assert for_default == {"stage_e_try_slot", "stage_e_release", "stage_e_holding"}
    assert for_every_cap == {"stage_e_release_all", "stage_e_reset_stats"}
    assert one(c, "SELECT stage_e_try_slot(2)") == 0
    assert one(other, "SELECT stage_e_try_slot('default', 2)") == 1
    assert one(c, "SELECT stage_e_holding(0)") is True
    assert one(c, "SELECT stage_e_holding('default', 0)") is True
    assert one(other, "SELECT stage_e_holding(1)") is True
    assert one(other, "SELECT stage_e_release(1)") is True
    assert one(other, "SELECT stage_e_holding('default', 1)") is False
    # release_all() gives back this session's slots of every cap; reset_stats() zeroes every
    # cap's counts.
    assert one(c, "SELECT stage_e_try_slot('exports', 2)") == 0
    assert one(c, "SELECT stage_e_release_all()") == 2
    assert one(c, "SELECT count(*) FROM stage_e_slot_holders") == 0
    totals = "SELECT cap, acquired, released FROM stage_e_throttle_totals ORDER BY cap"
    assert c.execute(totals).fetchall() == [("default", 2, 2), ("exports", 1, 1)]
    c.execute("SELECT stage_e_reset_stats()")
    assert c.execute(totals).fetchall() == [("default", 0, 0), ("exports", 0, 0)]


def test_every_function_of_the_catalog_has_a_sample_and_a_kind(connect):
    """conftest.FUNCTION_SAMPLES, which the every-function tests (hostile search_path, parallel
    mode, standby, not preloaded) draw their calls from, has exactly the catalog's functions:
    none missing, none stale, each "acts" or "reads". Among the calls: every form of the
    functions the README's table names."""
    c = connect()
    assert sorted(FUNCTION_SAMPLES) == extension_signatures(c)
    assert {kind for kind, _ in FUNCTION_SAMPLES.values()} == {"acts", "reads"}
    names = {sig.split("(")[0] for sig in FUNCTION_SAMPLES}
    table = README.read_text().split("\n### Functions\n", 1)[1].split("\n### ", 1)[0]
    documented = set(re.findall(r"^\| `(stage_e_\w+)\(", table, re.MULTILINE))
    assert len(documented) >= 20 and documented <= names, documented - names
    called = [call for _, _, call in extension_calls(c)]
    # The wait forms, the lease functions, try_slots, reset_stats(cap), adapt with and
    # without its default: one call each, from the catalog.
    for call in ["public.stage_e_try_slot('k', 2, '10 ms')", "public.stage_e_try_slots('k', 2, 2)",
                 "public.stage_e_try_slots('k', 2, 2, '10 ms')",
                 "public.stage_e_lease('k', 2, '1 min')",
                 "public.stage_e_lease('k', 2, '1 min', '10 ms')",
                 "public.stage_e_renew('k', 0, 1, '1 s')", "public.stage_e_release_lease('k', 0, 1)",
                 "public.stage_e_slot_token('k', 0)", "public.stage_e_reset_stats('k')",
                 "public.stage_e_adapt('k', 1, 2)", "public.stage_e_adapt('k', 1, 2, true)",
                 "public.stage_e_pending()", "public.stage_e_pending(0)"]:
        assert call in called, call
    assert len(called) == len(set(called))


def test_a_function_added_to_the_extension_without_a_sample_is_not_forgotten(connect):
    """The point of generating the lists: a function that joins the extension (here added by
    hand, as a new version's script would) makes every every-function test fail until it has a
    sample, instead of going untested."""
    c = connect()
    c.execute("CREATE FUNCTION public.stage_e_new_thing(cap text, n integer) RETURNS integer "
              "LANGUAGE sql AS 'SELECT 1'")
    c.execute("ALTER EXTENSION stage_e_slots ADD FUNCTION public.stage_e_new_thing(text, integer)")
    try:
        with pytest.raises(AssertionError, match=r"stage_e_new_thing\(text, integer\)"):
            extension_calls(c)
    finally:
        c.execute("ALTER EXTENSION stage_e_slots DROP FUNCTION "
                  "public.stage_e_new_thing(text, integer)")
        c.execute("DROP FUNCTION public.stage_e_new_thing(text, integer)")
    assert {sig for sig, _, _ in extension_calls(c)} == set(FUNCTION_SAMPLES)  # whole again


def _reference():
    """The README's Reference section (functions, views and table, settings)."""
    return README.read_text().split("\n## Reference\n", 1)[1].split("\n## Monitoring\n", 1)[0]


def test_the_readme_reference_documents_every_function_view_and_setting(connect):
    """From the catalog, not from a list: every function, view and table of the extension and
    every stage_e_slots.* setting has a row in the README's Reference tables (a new object
    fails this until it is documented there)."""
    c = connect()
    reference = _reference()
    rows = {line.split("|")[1] for line in reference.splitlines() if line.startswith("| `")}
    documented = " ".join(rows)
    functions = {sig.split("(")[0] for sig in extension_signatures(c)}
    relations = {r[0] for r in c.execute(
        "SELECT c.relname FROM pg_depend d JOIN pg_class c ON c.oid = d.objid "
        "AND d.classid = 'pg_class'::regclass JOIN pg_extension e ON e.oid = d.refobjid "
        "AND e.extname = 'stage_e_slots' WHERE d.deptype = 'e' AND c.relkind IN ('v', 'r')")}
    settings = {r[0] for r in c.execute(
        "SELECT name FROM pg_settings WHERE name LIKE 'stage\\_e\\_slots.%'")}
    assert functions and relations and settings
    missing = sorted(f for f in functions if f"`{f}(" not in documented)
    missing += sorted(r for r in relations if f"`{r}`" not in documented
                      and f"`{r} " not in documented)
    missing += sorted(s for s in settings if f"`{s}`" not in documented)
    assert missing == [], f"not in the README's Reference tables: {missing}"
