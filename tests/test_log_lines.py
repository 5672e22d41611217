"""Every report of ours is one line of the server log, and a name in it cannot pass itself off
as the report's own words (issue 35: cap and role names were quoted into LOG lines as they
were, so a name with a newline forged lines and one with a quote ended its quotes early). A
name's quote and backslash are escaped with a backslash, its control characters written out
(\\n, \\r, \\t, \\xNN)."""

from conftest import one

FORGED = "LOG:  stage_e_slots: forged"
EVIL = 'e" of pid 1\n' + FORGED + "\r\x01"  # 42 bytes: a valid cap name
ESCAPED = 'e\\" of pid 1\\n' + FORGED + "\\r\\x01"


def lines_since(cluster, since):
    return cluster.log_text()[since:].splitlines()


def test_a_name_with_a_newline_and_a_quote_stays_in_its_quotes_on_one_line(cluster, db):
    """A plain session takes a slot of such a cap and drops its lock behind the extension's
    back: the LOG line that says so is one line, with the name escaped inside its quotes."""
    since = len(cluster.log_text())
    with cluster.connect(db, "evil") as s:
        assert one(s, "SELECT stage_e_try_slot(%s, 2)", (EVIL,)) == 0
        s.execute("SELECT pg_advisory_unlock_all()")
        assert one(s, "SELECT stage_e_holding(%s, 0)", (EVIL,)) is False
    lines = lines_since(cluster, since)
    assert not [x for x in lines if x.startswith(FORGED)], "a forged line"
    said = [x for x in lines if "was released outside stage_e_release" in x]
    assert len(said) == 1, said
    assert f'of cap "{ESCAPED}" of pid ' in said[0], said[0]


def test_policy_lines_escape_cap_role_and_database(cluster, db):
    """stage_e_adapt's LOG line names a role, a cap and a database, each escaped."""
    since = len(cluster.log_text())
    with cluster.connect(db) as s:
        s.execute("SELECT stage_e_adapt(%s, 1, 2)", (EVIL,))
        s.execute("SELECT stage_e_adapt_off(%s)", (EVIL,))
    lines = lines_since(cluster, since)
    assert not [x for x in lines if x.startswith(FORGED)], "a forged line"
    made = [x for x in lines if "adaptive between 1 and 2 slots" in x]
    assert len(made) == 1 and f'made cap "{ESCAPED}" of database "{db}"' in made[0], made
    assert 'role "postgres"' in made[0]
    back = [x for x in lines if "to the callers' n alone" in x]
    assert len(back) == 1 and f'returned cap "{ESCAPED}"' in back[0], back


def test_an_error_naming_such_a_cap_is_one_line_too(cluster, db):
    """A refusal's message reaches the server log as well (log_min_messages): one line."""
    since = len(cluster.log_text())
    with cluster.connect(db) as s:
        assert one(s, "SELECT stage_e_try_slot(%s, 1)", (EVIL,)) == 0
        s.execute("SET client_min_messages = error")
        assert one(s, "SELECT stage_e_release(%s, 0)", (EVIL,)) is True
        # Not held any more: a release by this session is refused with a WARNING naming it.
        assert one(s, "SELECT stage_e_release(%s, 0)", (EVIL,)) is False
    lines = lines_since(cluster, since)
    assert not [x for x in lines if x.startswith(FORGED)], "a forged line"
