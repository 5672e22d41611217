"""Cap names (and share names) in any server encoding (hardening, issue 21).

A cap's name is UTF-8 inside the extension (shared memory, the lock key, the pending-counts and
lease files are the server's, whatever each database's encoding), converted from and to the
database's encoding at the edge. So in a LATIN1 and in a SQL_ASCII database every function
that takes a cap name works with 'café', every view and row shows it as 'café', and it is the
same cap (the same lock key) as 'café' in a UTF8 database. A SQL_ASCII database stores whatever
bytes it is sent: a name there must be UTF-8, and one that is not is refused with SQLSTATE
22021 and changes nothing. The 63-byte limit counts the name's bytes in UTF-8.

Before 0.6.1, 'café' in a LATIN1 database raised XX000 "datums converted to &str should be
valid UTF-8", and an invalid byte in a SQL_ASCII database raised Utf8Error { valid_up_to: 0 }.
"""

import threading
import time

import psycopg
import pytest
from conftest import cap_locks, one
from pgcluster import Cluster, wait_for
from psycopg import errors
from test_leases import holders, lease, release_lease, renew, slot_token
from test_lifecycle import clean_restart, crash_restart, held_back, wait_journaled

NAME = "café"
LONGEST = "é" * 31 + "x"  # 63 bytes in UTF-8 (32 in LATIN1): the longest name
TOO_LONG = "é" * 32  # 64 bytes in UTF-8, 32 in LATIN1: too long in every database
ENCODINGS = ["LATIN1", "SQL_ASCII"]
DBS = {"UTF8": "e_utf8", "LATIN1": "e_latin1", "SQL_ASCII": "e_sql_ascii"}
SETTINGS = {
    "stage_e_slots.flush_interval": "'200ms'",
    "stage_e_slots.lease_horizon_margin": "'200ms'",
}


def make_databases(c):
    for enc, db in DBS.items():
        c.sql(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        c.sql(f"CREATE DATABASE \"{db}\" ENCODING '{enc}' LC_COLLATE 'C' LC_CTYPE 'C' "
              "TEMPLATE template0")
        c.sql("CREATE EXTENSION stage_e_slots", dbname=db)


@pytest.fixture(scope="module")
def ec():
    """A cluster with a UTF8, a LATIN1 and a SQL_ASCII database, flushing every 200 ms."""
    c = Cluster("encoding", SETTINGS).init().start()
    make_databases(c)
    yield c
    c.destroy()


@pytest.fixture
def opened():
    conns = []
    yield conns
    for conn in conns:
        conn.close()


def session(c, enc, opened, client_encoding="UTF8", application_name="stage_e_test"):
    """A session on the database of server encoding `enc`, with that client_encoding."""
    conn = psycopg.connect(c.conninfo(DBS[enc], application_name)
                           + f" client_encoding={client_encoding}", autocommit=True)
    opened.append(conn)
    return conn


def fresh(c, enc):
    """Recreates the database of encoding `enc` (a test that needs it empty)."""
    db = DBS[enc]
    c.sql(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    c.sql(f"CREATE DATABASE \"{db}\" ENCODING '{enc}' LC_COLLATE 'C' LC_CTYPE 'C' "
          "TEMPLATE template0")
    c.sql("CREATE EXTENSION stage_e_slots", dbname=db)


def caps_of(conn, view):
    return sorted(r[0] for r in conn.execute(f"SELECT cap FROM {view}").fetchall())


def key_in(c, enc, name, opened):
    return one(session(c, enc, opened), "SELECT stage_e_cap_key(%s)", (name,))


def test_the_databases_have_the_encodings_the_tests_need(ec, opened):
    for enc in DBS:
        assert one(session(ec, enc, opened), "SHOW server_encoding") == enc


# -- every function, every view ------------------------------------------------------------

@pytest.mark.parametrize("enc", ENCODINGS)
def test_every_function_taking_a_cap_works_with_a_non_ascii_name(ec, opened, enc):
    fresh(ec, enc)
    s = session(ec, enc, opened)
    key = one(s, "SELECT stage_e_cap_key(%s)", (NAME,))
    assert key == key_in(ec, "UTF8", NAME, opened)
    # Session slots.
    assert one(s, "SELECT stage_e_try_slot(%s, 3)", (NAME,)) == 0
    assert one(s, "SELECT stage_e_try_slots(%s, 3, 1)", (NAME,)) == [1]
    assert one(s, "SELECT stage_e_holding(%s, 0)", (NAME,)) is True
    assert one(s, "SELECT stage_e_holding(%s, 2)", (NAME,)) is False
    assert slot_token(s, NAME, 0) > 0
    pid = s.info.backend_pid
    assert cap_locks(s, NAME) == [(0, pid), (1, pid)]
    # Its lock is (stage_e_cap_key('café'), s), in this database.
    assert one(s, "SELECT count(*)::int FROM pg_locks WHERE locktype = 'advisory' "
                  "AND classid = %s::int::oid AND objid = 0 AND granted", (key,)) == 1
    # A lease of the same cap.
    slot, token = lease(s, NAME, 3, "1 min")
    assert slot == 2 and token > 0
    assert renew(s, NAME, slot, token, "2 min") is True
    # What shows it: every view and the snapshot, by its name.
    assert one(s, "SELECT held FROM stage_e_stats() WHERE cap = %s", (NAME,)) == 3
    assert caps_of(s, "stage_e_stats()") == [NAME]
    assert [(h["slot"], h["token"] is not None) for h in holders(s, NAME)] == [
        (0, False), (1, False), (2, True)]
    assert caps_of(s, "stage_e_slot_holders") == [NAME] * 3
    doc = one(s, "SELECT stage_e_snapshot()")
    assert [(x["cap"], x["key"], x["held"]) for x in doc["caps"]] == [(NAME, key, 3)]
    assert [h["cap"] for h in doc["holders"]] == [NAME] * 3
    assert caps_of(s, "stage_e_throttle_totals") == [NAME]
    assert set(caps_of(s, "stage_e_cap_load")) <= {NAME}
    assert held_back(s) == []
    # A waiter is listed by the cap's name too.
    assert one(s, "SELECT stage_e_try_slot(%s, 3)", (NAME,)) is None  # full: throttled
    w = session(ec, enc, opened, application_name="waiter")
    got = {}
    t = threading.Thread(target=lambda: got.update(
        slot=one(w, "SELECT stage_e_try_slot(%s, 3, '20 s')", (NAME,))))
    t.start()
    wait_for(lambda: caps_of(s, "stage_e_slot_waiters") == [NAME], what="the waiter listed")
    # Released, each way.
    assert release_lease(s, NAME, slot, token) is True
    t.join(10)
    assert not t.is_alive(), "the waiter did not return"
    assert got == {"slot": 2}
    assert one(s, "SELECT stage_e_release(%s, 1)", (NAME,)) is True
    assert one(s, "SELECT stage_e_release_all(%s)", (NAME,)) == 1
    assert cap_locks(s, NAME) == [(2, w.info.backend_pid)]
    assert one(w, "SELECT stage_e_release_all()") == 1
    counts = s.execute("SELECT acquired, throttled, released FROM stage_e_stats() "
                       "WHERE cap = %s", (NAME,)).fetchone()
    assert counts == (4, 1, 4)


@pytest.mark.parametrize("enc", ENCODINGS)
def test_the_name_limit_counts_utf8_bytes(ec, opened, enc):
    """63 bytes in UTF-8, whatever the name takes in the database's encoding: the same name is
    accepted or refused in every database of the server."""
    s = session(ec, enc, opened)
    assert one(s, "SELECT stage_e_try_slot(%s, 1)", (LONGEST,)) == 0
    assert LONGEST in caps_of(s, "stage_e_stats()")
    assert one(s, "SELECT stage_e_cap_key(%s)", (LONGEST,)) == key_in(ec, "UTF8", LONGEST, opened)
    assert one(s, "SELECT stage_e_release(%s, 0)", (LONGEST,)) is True
    with pytest.raises(errors.InvalidParameterValue) as e:
        s.execute("SELECT stage_e_try_slot(%s, 1)", (TOO_LONG,))
    assert e.value.diag.message_primary == "cap name is too long (64 bytes)"
    assert e.value.diag.message_detail == "A cap name is 1 to 63 bytes, counted in UTF-8."


# -- rows the flusher writes and reads -----------------------------------------------------

def counter_row(conn, name):
    return conn.execute("SELECT acquired, throttled FROM stage_e_throttle_counter WHERE cap = %s",
                        (name,)).fetchone()


@pytest.mark.parametrize("enc", ENCODINGS)
def test_the_flushed_rows_have_the_name_in_the_databases_encoding(ec, opened, enc):
    fresh(ec, enc)
    s = session(ec, enc, opened)
    assert one(s, "SELECT stage_e_try_slot(%s, 1)", (NAME,)) == 0
    assert one(s, "SELECT stage_e_try_slot(%s, 1)", (NAME,)) is None
    slot, token = lease(s, LONGEST, 1, "1 min")
    # Both rows: a flush (every 200 ms) may come between café's calls and the lease, and then
    # café's row is complete a flush before the lease's cap has one.
    wait_for(lambda: counter_row(s, NAME) == (1, 1)
             and caps_of(s, "stage_e_throttle_counter") == sorted([NAME, LONGEST]),
             what="the flusher's rows of café and of the lease's cap")
    # The row holds the name as this database spells it: a literal finds it, and it is 'café'
    # in the database's encoding (LATIN1: 4 bytes; SQL_ASCII: its UTF-8 bytes, 5).
    width = {"LATIN1": 4, "SQL_ASCII": 5}[enc]
    assert one(s, "SELECT octet_length(cap) FROM stage_e_throttle_counter WHERE cap = 'café'") \
        == width
    assert one(s, "SELECT convert_to(cap, 'UTF8') FROM stage_e_throttle_counter "
                  "WHERE cap = 'café'") == NAME.encode()
    # The lease's horizon row too.
    wait_for(lambda: LONGEST in caps_of(s, "stage_e_lease_horizon"), what="the horizon row")
    # stage_e_flush() names what it added; stage_e_reset_stats(cap) finds the row.
    assert one(s, "SELECT stage_e_release(%s, 0)", (NAME,)) is True
    flushed = s.execute("SELECT cap, released FROM stage_e_flush() WHERE released > 0").fetchall()
    assert flushed in ([(NAME, 1)], [])  # [] when the background flusher was first
    wait_for(lambda: one(s, "SELECT released FROM stage_e_throttle_counter WHERE cap = %s",
                         (NAME,)) == 1, what="the release flushed")
    s.execute("SELECT stage_e_reset_stats(%s)", (NAME,))
    assert counter_row(s, NAME) == (0, 0)
    assert release_lease(s, LONGEST, slot, token) is True


# -- one name, one cap ---------------------------------------------------------------------

def test_one_name_has_one_lock_key_in_every_database(ec, opened):
    for name in (NAME, LONGEST, "plain"):
        keys = {enc: key_in(ec, enc, name, opened) for enc in DBS}
        assert len(set(keys.values())) == 1, (name, keys)


def test_another_client_encoding_names_the_same_cap(ec, opened):
    """LATIN1 server, LATIN1 and UTF8 clients; UTF8 server, WIN1252 client: the server converts
    each client's text, and the extension its own, so 'café' is one cap, and messages name it
    in each client's encoding."""
    fresh(ec, "LATIN1")
    holder = session(ec, "LATIN1", opened, client_encoding="LATIN1")
    other = session(ec, "LATIN1", opened, client_encoding="UTF8")
    assert one(holder, "SELECT stage_e_try_slot(%s, 1)", (NAME,)) == 0
    assert one(other, "SELECT stage_e_try_slot(%s, 1)", (NAME,)) is None
    assert caps_of(holder, "stage_e_stats()") == caps_of(other, "stage_e_stats()") == [NAME]
    assert one(holder, "SELECT stage_e_cap_key(%s)", (NAME,)) == key_in(ec, "UTF8", NAME, opened)
    notices = []
    # (The diagnostic is read inside the handler: it is valid only there.)
    other.add_notice_handler(lambda d: notices.append((d.message_primary, d.message_detail)))
    assert one(other, "SELECT stage_e_release(%s, 0)", (NAME,)) is False
    assert notices == [(f'slot 0 of cap "{NAME}" was not held by this connection',
                        (f'Slot 0 of cap "{NAME}" is held by pid {holder.info.backend_pid}; '
                         "it keeps the slot."))]
    # An ERROR that names the cap, in the LATIN1 client's encoding.
    slot, token = lease(holder, NAME + "!", 1, "1 min")
    holder.execute("DROP ROLE IF EXISTS enc_other")
    holder.execute("CREATE ROLE enc_other")
    holder.execute("SET ROLE enc_other")
    with pytest.raises(errors.InsufficientPrivilege) as e:
        renew(holder, NAME + "!", slot, token, "1 min")
    assert e.value.diag.message_primary == (
        f'permission denied to renew or release the lease of slot 0 of cap "{NAME}!"')
    holder.execute("RESET ROLE")
    assert release_lease(holder, NAME + "!", slot, token) is True
    # A UTF8 database, a WIN1252 client.
    u = session(ec, "UTF8", opened, client_encoding="WIN1252")
    assert one(u, "SELECT stage_e_try_slot(%s, 1)", (NAME,)) == 0
    assert NAME in caps_of(u, "stage_e_stats()")
    assert one(u, "SELECT stage_e_release(%s, 0)", (NAME,)) is True


# -- bytes that are not UTF-8, in SQL_ASCII ------------------------------------------------

BAD = b"'caf\xe9'"  # LATIN1's 'café': not UTF-8
CALLS = [
    b"SELECT stage_e_try_slot(%s, 2)",
    b"SELECT stage_e_try_slot(%s, 2, '1 s')",
    b"SELECT stage_e_try_slots(%s, 2, 1)",
    b"SELECT stage_e_release(%s, 0)",
    b"SELECT stage_e_release_all(%s)",
    b"SELECT stage_e_holding(%s, 0)",
    b"SELECT stage_e_slot_token(%s, 0)",
    b"SELECT stage_e_cap_key(%s)",
    b"SELECT * FROM stage_e_lease(%s, 2, '1 min')",
    b"SELECT stage_e_renew(%s, 0, 1, '1 min')",
    b"SELECT stage_e_release_lease(%s, 0, 1)",
    b"SELECT stage_e_reset_stats(%s)",
]


def refused_not_utf8(raw, call, what):
    """`call` with BAD as its `what` ("cap" or "share") name, on a SQL_ASCII session: refused
    with 22021 in words about that name; returns the error's diagnostics."""
    with pytest.raises(errors.CharacterNotInRepertoire) as e:
        raw.execute(call.replace(b"%s", BAD))
    d = e.value.diag
    assert d.message_primary == (f"{what} name is not valid UTF-8: invalid byte sequence 0xe9 "
                                 "at byte 4"), call
    assert "nothing was taken or changed" in d.message_detail
    assert d.message_hint.startswith(f"Send {what} names in UTF-8")
    return d


def test_bytes_that_are_not_utf8_are_refused_with_22021_in_sql_ascii(ec, opened):
    fresh(ec, "SQL_ASCII")
    raw = session(ec, "SQL_ASCII", opened, client_encoding="SQL_ASCII")
    for call in CALLS:
        d = refused_not_utf8(raw, call, "cap")
        assert "a cap name is read as UTF-8" in d.message_detail
        # Refused as the function reads the name (a name refused while the arguments were
        # converted named no function): LOCATION names the one called (issue 35).
        function = call.split(b"(")[0].split()[-1].decode()
        assert d.source_function == function, (call, d.source_function)
    # Nothing changed: no cap, no lock, no count, no row.
    s = session(ec, "SQL_ASCII", opened)
    assert caps_of(s, "stage_e_stats()") == []
    assert caps_of(s, "stage_e_slot_holders") == []
    assert one(s, "SELECT count(*)::int FROM pg_locks WHERE locktype = 'advisory' AND database = "
                  "(SELECT oid FROM pg_database WHERE datname = current_database())") == 0
    assert one(s, "SELECT stage_e_snapshot()->'caps'") == []
    time.sleep(0.6)  # three flush intervals
    assert caps_of(s, "stage_e_throttle_counter") == []
    # The same bytes in UTF-8 are the name 'café', also from that client.
    assert one(raw, b"SELECT stage_e_try_slot('caf\xc3\xa9', 1)") == 0
    assert caps_of(s, "stage_e_stats()") == [NAME]
    assert one(raw, b"SELECT stage_e_release('caf\xc3\xa9', 0)") is True


# -- restarts: the names in the pending-counts file, the lease file and the horizon rows --------

@pytest.mark.parametrize("enc", ENCODINGS)
def test_names_come_back_after_a_clean_restart_and_a_crash(opened, enc):
    c = Cluster("encoding_restart", SETTINGS).init().start()
    try:
        make_databases(c)
        c.create_database("app")  # the restart helpers wait for it
        s = session(c, enc, opened)
        slot, token = lease(s, NAME, 2, "10 min")
        assert one(s, "SELECT stage_e_try_slot(%s, 1)", (LONGEST,)) == 0
        assert one(s, "SELECT stage_e_try_slot(%s, 1)", (LONGEST,)) is None
        s.close()
        # Clean: the lease file keeps the lease; the counters are flushed or kept pending.
        clean_restart(c)
        s = session(c, enc, opened)
        assert [(h["slot"], h["token"]) for h in holders(s, NAME)] == [(slot, token)]
        wait_for(lambda: one(s, "SELECT throttled FROM stage_e_throttle_totals WHERE cap = %s",
                             (LONGEST,)) == 1, what="the throttle of the longest name")
        assert renew(s, NAME, slot, token, "15 s") is True
        assert wait_journaled(s, NAME, [token], not_before=time.monotonic() + 2.0)
        s.close()
        # Crash: the horizon row holds the cap back, and its lease is reclaimed by its token.
        crash_restart(c)
        s = session(c, enc, opened)
        assert [(cap, reason) for cap, _, reason in held_back(s)] == [(NAME, "crash")]
        assert renew(s, NAME, slot, token, "1 min") is True
        assert [(h["slot"], h["token"]) for h in holders(s, NAME)] == [(slot, token)]
        assert release_lease(s, NAME, slot, token) is True
        if enc == "LATIN1":
            # The flusher said so in the database's encoding (PostgreSQL's rule for a message).
            logged = c.log.read_bytes()
            assert f'cap "{NAME}" of database "{DBS[enc]}" is held back'.encode("latin1") \
                in logged
    finally:
        for conn in opened:
            conn.close()
        c.destroy()


def test_the_policies_of_non_ascii_caps_are_their_rows_and_bind_after_a_restart(opened):
    """In a LATIN1 database, stage_e_adapt, stage_e_rate_limit and stage_e_share (and their
    _off forms) write their cap's row in the database's encoding, as the flusher does: one
    row per cap, named as the views name it, the learned limit written to it; so after a
    restart, which loads the policies from the rows, they still bind those caps. (Before,
    their statements sent the name's UTF-8 bytes: a second row under a garbled name, and after a
    restart the caps were limited no more.)"""
    c = Cluster("encoding_policies", SETTINGS).init().start()
    try:
        make_databases(c)
        c.create_database("app")  # the restart helpers wait for it
        enc, adapted, rated, shared = "LATIN1", NAME, "thé", "crème"
        s = session(c, enc, opened)
        s.execute("SELECT stage_e_adapt(%s, 1, 2, true)", (adapted,))
        s.execute("SELECT stage_e_rate_limit(%s, 1, '1 h', 1)", (rated,))
        s.execute("SELECT stage_e_share(%s, %s, 1, 1)", (shared, NAME))
        s.execute("SELECT stage_e_rate_limit(%s, 5, '1 h', 5)", ("off",))
        s.execute("SELECT stage_e_rate_limit_off(%s)", ("off",))
        assert [one(s, "SELECT stage_e_try_slot(%s, 8)", (adapted,)) for _ in range(2)] == [
            0, None]
        assert [one(s, "SELECT stage_e_try_slot(%s, 8)", (rated,)) for _ in range(2)] == [
            0, None]
        assert one(s, "SELECT stage_e_release(%s, 0)", (adapted,)) is True
        wait_for(lambda: s.execute(
            "SELECT cap, adapt_min, adapt_max, adapt_limit IS NOT NULL, rate_count "
            "FROM stage_e_throttle_counter ORDER BY cap").fetchall() == [
                (adapted, 1, 2, True, None), ("off", None, None, False, None),
                (rated, None, None, False, 1)],
            what="one row per cap, with its policy and the learned limit")
        assert s.execute("SELECT cap, share, max_slots FROM stage_e_share_policy").fetchall() \
            == [(shared, NAME, 1)]
        s.close()
        clean_restart(c)
        s = session(c, enc, opened)
        assert [one(s, "SELECT stage_e_try_slot(%s, 8)", (adapted,)) for _ in range(2)] == [
            0, None]
        assert one(s, "SELECT stage_e_try_slot(%s, 8)", (rated,)) is None  # spent for an hour
        take = "SELECT stage_e_try_slot(%s, 8, '0', %s)"
        assert [one(s, take, (shared, NAME)) for _ in range(2)] == [0, None]  # its ceiling
        s.execute("SELECT stage_e_adapt_off(%s)", (adapted,))
        s.execute("SELECT stage_e_rate_limit_off(%s)", (rated,))
        assert s.execute("SELECT count(*) FROM stage_e_throttle_counter WHERE adapt_min IS NOT "
                         "NULL OR rate_count IS NOT NULL").fetchone()[0] == 0
    finally:
        for conn in opened:
            conn.close()
        c.destroy()


# -- the extension's schema ----------------------------------------------------------------

def test_a_schema_named_in_the_databases_encoding_is_found(ec, opened):
    """The flusher and the snapshot name the extension's tables with its schema: a schema name
    that is not ASCII, in a LATIN1 database, reaches them (as U&"sch\\00E9ma") and them only."""
    fresh(ec, "LATIN1")
    s = session(ec, "LATIN1", opened)
    s.execute("DROP EXTENSION stage_e_slots")
    s.execute('CREATE SCHEMA "schéma"')
    s.execute('CREATE EXTENSION stage_e_slots SCHEMA "schéma"')
    s.execute('SET search_path = "schéma", public')
    assert one(s, "SELECT stage_e_try_slot(%s, 1)", (NAME,)) == 0
    wait_for(lambda: counter_row(s, NAME) == (1, 0), what="the row of café in schéma")
    doc = one(s, "SELECT stage_e_snapshot()")
    assert [x["cap"] for x in doc["caps"]] == [NAME]
    assert [h["cap"] for h in doc["holders"]] == [NAME]
    assert one(s, "SELECT stage_e_release(%s, 0)", (NAME,)) is True
    assert [r[0] for r in s.execute("SELECT cap FROM stage_e_flush()").fetchall()] in ([NAME], [])


# -- an encoding in which a name takes more bytes than in UTF-8 ----------------------------

FOUR_BYTES_IN_EUC_TW = """
    CREATE FUNCTION pg_temp.four_bytes() RETURNS text LANGUAGE plpgsql AS $$
    DECLARE b bytea;
    BEGIN
        FOR g IN x'4e00'::int .. x'9fa5'::int LOOP
            BEGIN
                b := convert_to(chr(g), 'EUC_TW');
                -- SS2, then a plane the server's EUC_TW accepts (0xa1 .. 0xa7)
                IF octet_length(b) = 4 AND get_byte(b, 1) BETWEEN 161 AND 167 THEN
                    RETURN chr(g);
                END IF;
            EXCEPTION WHEN others THEN NULL;  -- no EUC_TW equivalent
            END;
        END LOOP;
        RETURN NULL;
    END $$"""


def test_a_name_must_fit_63_bytes_of_the_databases_encoding_too(ec, opened):
    """A CNS 11643 plane-2 character is 3 bytes in UTF-8 and 4 in EUC_TW: 16 of them fit the
    UTF-8 limit (48) but not the counter table's cap column (64 > 63 bytes), which the flusher
    would then fail to write at every round. So they are refused, in words, when the name comes
    in; 15 (60 bytes there) are a cap whose row is written."""
    u = session(ec, "UTF8", opened)
    u.execute(FOUR_BYTES_IN_EUC_TW)
    c = one(u, "SELECT pg_temp.four_bytes()")
    assert c is not None and len(c.encode()) == 3
    ec.sql('DROP DATABASE IF EXISTS "e_euc_tw" WITH (FORCE)')
    ec.sql("CREATE DATABASE e_euc_tw ENCODING 'EUC_TW' LC_COLLATE 'C' LC_CTYPE 'C' "
           "TEMPLATE template0")
    # (client_encoding UTF8: Python has no EUC_TW codec.)
    s = psycopg.connect(ec.conninfo("e_euc_tw") + " client_encoding=UTF8", autocommit=True)
    opened.append(s)
    s.execute("CREATE EXTENSION stage_e_slots")
    with pytest.raises(errors.InvalidParameterValue) as e:
        s.execute("SELECT stage_e_try_slot(%s, 1)", (c * 16,))
    assert e.value.diag.message_primary == "cap name is too long in encoding EUC_TW (64 bytes)"
    assert "counted in UTF-8 and in the database's encoding" in e.value.diag.message_detail
    assert one(s, "SELECT stage_e_try_slot(%s, 1)", (c * 15,)) == 0
    assert one(s, "SELECT stage_e_cap_key(%s)", (c * 15,)) == one(
        u, "SELECT stage_e_cap_key(%s)", (c * 15,))
    wait_for(lambda: counter_row(s, c * 15) == (1, 0), what="the row of the 60-byte name")
    assert caps_of(s, "stage_e_stats()") == [c * 15]


# -- share names (issue 38): the cap-name rules ----------------------------------------------

@pytest.mark.parametrize("enc", ENCODINGS)
def test_a_share_named_in_any_encoding_is_one_share_and_its_policy_binds(ec, opened, enc):
    """A share name is read as a cap name is: in a LATIN1 and a SQL_ASCII database, 'café' as
    stage_e_share writes it (its row, in the database's encoding) is the 'café' of the calls
    (its ceiling of 1 binds them), and every view shows it as 'café'."""
    fresh(ec, enc)
    s, other = session(ec, enc, opened), session(ec, enc, opened, application_name="other")
    s.execute("SELECT stage_e_share(%s, %s, 2, 1)", (NAME, NAME))
    assert s.execute("SELECT cap, share, weight, max_slots FROM stage_e_share_policy"
                     ).fetchall() == [(NAME, NAME, 2, 1)]
    take = "SELECT stage_e_try_slot(%s, 3, '0', %s)"
    assert one(s, take, (NAME, NAME)) == 0
    assert one(other, take, (NAME, NAME)) is None  # its ceiling: 1
    assert s.execute("SELECT cap, share, weight, max_slots, held FROM stage_e_shares"
                     ).fetchall() == [(NAME, NAME, 2, 1, 1)]
    assert s.execute("SELECT cap, slot, share FROM stage_e_slot_holders").fetchall() == [
        (NAME, 0, NAME)]
    got = {}
    t = threading.Thread(target=lambda: got.update(
        slot=one(other, "SELECT stage_e_try_slot(%s, 3, '20 s', %s)", (NAME, NAME))))
    t.start()
    wait_for(lambda: s.execute("SELECT cap, share FROM stage_e_slot_waiters").fetchall()
             == [(NAME, NAME)], what="the waiter listed with its share")
    assert one(s, "SELECT stage_e_release(%s, 0)", (NAME,)) is True
    t.join(10)
    assert not t.is_alive() and got == {"slot": 0}
    assert one(other, "SELECT stage_e_release(%s, 0)", (NAME,)) is True


def test_a_share_name_refused_for_its_encoding_is_said_to_be_the_shares(ec, opened):
    """A share name that is not UTF-8 in a SQL_ASCII database, or takes more than 63 bytes in
    the database's encoding (EUC_TW), is refused in words about the share, not the cap (whose
    name is fine), class 22, and nothing changes."""
    fresh(ec, "SQL_ASCII")
    raw = session(ec, "SQL_ASCII", opened, client_encoding="SQL_ASCII")
    for call in (b"SELECT stage_e_try_slot('k', 2, '0', %s)",
                 b"SELECT stage_e_try_slots('k', 2, 1, '0', %s)",
                 b"SELECT * FROM stage_e_lease('k', 2, '1 min', '0', %s)",
                 b"SELECT stage_e_share('k', %s, 2)"):
        d = refused_not_utf8(raw, call, "share")
        assert "a share name is read as UTF-8, as a cap name is" in d.message_detail
    s = session(ec, "SQL_ASCII", opened)
    assert caps_of(s, "stage_e_stats()") == []
    assert one(s, "SELECT count(*)::int FROM stage_e_share_policy") == 0
    u = session(ec, "UTF8", opened)
    u.execute(FOUR_BYTES_IN_EUC_TW)
    c = one(u, "SELECT pg_temp.four_bytes()")
    ec.sql('DROP DATABASE IF EXISTS "e_euc_tw" WITH (FORCE)')
    ec.sql("CREATE DATABASE e_euc_tw ENCODING 'EUC_TW' LC_COLLATE 'C' LC_CTYPE 'C' "
           "TEMPLATE template0")
    t = psycopg.connect(ec.conninfo("e_euc_tw") + " client_encoding=UTF8", autocommit=True)
    opened.append(t)
    t.execute("CREATE EXTENSION stage_e_slots")
    for call in ("SELECT stage_e_try_slot('k', 2, '0', %s)", "SELECT stage_e_share('k', %s, 2)"):
        with pytest.raises(errors.InvalidParameterValue) as e:
            t.execute(call, (c * 16,))
        d = e.value.diag
        assert d.message_primary == "share name is too long in encoding EUC_TW (64 bytes)", call
        assert "in which stage_e_share_policy keeps it" in d.message_detail
    assert one(t, "SELECT count(*)::int FROM stage_e_share_policy") == 0
    t.execute("SELECT stage_e_share('k', %s, 2)", (c * 15,))  # 60 bytes there: a row
    assert one(t, "SELECT octet_length(share) FROM stage_e_share_policy") == 60
