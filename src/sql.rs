//! Every SQL statement the extension runs itself goes through this module (the background
//! flusher, `stage_e_flush`, `stage_e_reset_stats`, `stage_e_snapshot`, the schema lookup), and
//! keeps one rule: **no statement of ours may resolve to an object another role can create.**
//!
//! - Each runs with `search_path` pinned to `pg_catalog, pg_temp`, saved and restored around the
//!   statement as fmgr does for a function with `SET search_path`, so neither the database's,
//!   the role's nor the caller's setting applies.
//! - The extension's own objects are named with the extension's schema ([`extension`]),
//!   and every operator is written `OPERATOR(pg_catalog.x)`: a schema earlier in nobody's path
//!   can then supply a better-matching `+` or `=`.
//! - Reads go through read-only SPI ([`read`]), which assigns no transaction id: they work on a
//!   standby and in `BEGIN READ ONLY`. (pgrx's `Spi::get_one`/`Spi::run` take the read-write
//!   path and assign one.)
//! - A read that decides what binds (a policy table's rows) runs as the table's owner, with
//!   row-level security not forced ([`as_owner`]): what binds every role of a cap must not
//!   depend on what the calling role may see.
//!
//! The statements' text is built here too ([`counter_add_query`] and the others), from the
//! version of the database's objects. The extension scripts (`sql/`) follow the same rule for
//! view bodies.

use crate::backend::BackendLocal;
use crate::gucs;
use crate::names::Text;
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;
use pgrx::spi::{self, SpiClient, SpiHeapTupleData};
use pgrx::Spi;
use stage_e_core::counters::CounterValues;
use stage_e_core::histogram::BUCKETS;
use stage_e_core::version::SchemaVersion;
use std::cell::{Cell, RefCell};
use std::ffi::{CStr, CString};

/// A read-only query session with the search path pinned; assigns no transaction id.
pub fn read<R>(f: impl FnOnce(&SpiClient<'_>) -> spi::Result<R>) -> spi::Result<R> {
    gucs::pinned(|| Spi::connect(f))
}

/// One writing statement with the search path pinned.
pub fn write(query: &str, args: &[DatumWithOid<'_>]) -> spi::Result<()> {
    let _ours = Ours::start();
    gucs::pinned(|| Spi::connect_mut(|c| c.update(query, None, args).map(|_| ())))
}

/// One writing statement with the search path pinned, returning its rows as `f` reads them.
pub fn write_returning<R>(
    query: &str,
    args: &[DatumWithOid<'_>],
    f: impl FnOnce(spi::SpiTupleTable<'_>) -> spi::Result<R>,
) -> spi::Result<R> {
    let _ours = Ours::start();
    gucs::pinned(|| Spi::connect_mut(|c| f(c.update(query, None, args)?)))
}

/// Whether the statement now writing is one of ours ([`write`]): the policy tables' triggers
/// leave such a write to the function that made it, which queues and logs its own change. A
/// write by anything else (the owner's UPDATE, a restore's COPY) is the trigger's to bind.
pub fn writing_ours() -> bool {
    OURS.get()
}

static OURS: BackendLocal<Cell<bool>> = BackendLocal::new(Cell::new(false));

/// [`OURS`] for one statement, put back however it ends (an ERROR unwinds through it).
struct Ours(bool);

impl Ours {
    fn start() -> Ours {
        Ours(OURS.replace(true))
    }
}

impl Drop for Ours {
    fn drop(&mut self) {
        OURS.set(self.0);
    }
}

/// A flusher waits at most this long for a lock (on the counter rows, the horizon rows) before
/// giving up until the next round, so that a locked table cannot stall the other databases.
pub const WORKER_LOCK_TIMEOUT: &CStr = c"1s";

/// The settings the launcher and every flusher pin for themselves, over whatever a database
/// owner (`ALTER DATABASE … SET`), a role (`ALTER ROLE … [IN DATABASE …] SET`, the workers'
/// role being the bootstrap superuser) or `ALTER ROLE ALL` set: each of these could make the
/// flush fail, wait, or write differently. Set at session level ([`pin_worker_settings`]).
const WORKER_SETTINGS: &[(&CStr, &CStr)] = &[
    // `SET role` in a database's settings makes every session of it, ours too, run as that
    // role (the owner's own): without rights on the extension's tables, the flush fails.
    (c"role", c"none"),
    // A read-only default fails every write; the transaction's own setting follows the
    // default at each transaction start.
    (c"default_transaction_read_only", c"off"),
    // The upserts add to the rows as they are when written: under repeatable read or
    // serializable, a row another transaction changed meanwhile (an ALTER, a reset, a
    // superuser's UPDATE) fails the flush with a serialization error instead.
    (c"default_transaction_isolation", c"read committed"),
    // No effect once read-write; pinned so that no transaction of ours waits for a safe
    // snapshot.
    (c"default_transaction_deferrable", c"off"),
    // Not armed for SPI in a background worker (postgres.c arms it per client statement), and
    // pinned so that it stays so: our waits are bounded by lock_timeout alone.
    (c"statement_timeout", c"0"),
    // Long enough not to fail at a moment's contention (a database's 1 ms would), short
    // enough that a table locked for long does not stall the other databases' flushes.
    (c"lock_timeout", WORKER_LOCK_TIMEOUT),
    // Enforced only in a client backend's command loop; pinned so that a flusher never ends
    // mid-transaction should that change.
    (c"idle_in_transaction_session_timeout", c"0"),
    (c"idle_session_timeout", c"0"),
    // `replica` skips ordinary triggers and rules (and foreign-key checks): an audit or
    // replication trigger a DBA put on the counter or horizon table would not see our writes.
    (c"session_replication_role", c"origin"),
    // Off makes any query a policy would affect fail; the workers' role bypasses policies,
    // but it is what a table with row security is written under.
    (c"row_security", c"on"),
    // A horizon is relied upon once published, so its commit must be durable (and a counter
    // flush as durable as the counts it replaces).
    (c"synchronous_commit", c"on"),
    // Temporary files (a hash over thousands of caps) go to the default place, not to a
    // tablespace the database's settings name.
    (c"temp_tablespaces", c""),
    // Not pinned: search_path (pinned around each statement, `pinned`); DateStyle,
    // IntervalStyle, TimeZone, extra_float_digits, bytea_output (every value crosses as a
    // binary datum: int8, interval, timestamptz, arrays of them; a journal as jsonb text, whose
    // form none of them changes); default_tablespace, default_table_access_method (nothing is
    // created); exit_on_error (an ERROR ends a worker anyway).
];

/// Pins [`WORKER_SETTINGS`] (and `transaction_timeout`, from PostgreSQL 17 on) for the rest of
/// this worker's life. Called once, right after connecting: session-level values rank above
/// the per-database and per-role ones InitPostgres applied (`PGC_S_SESSION` over
/// `PGC_S_DATABASE_USER` and below), so no later reload undoes them, and every transaction
/// starts from the pinned defaults (`transaction_read_only`, `transaction_isolation` and
/// `transaction_deferrable` are taken from them at transaction start). One place, rather than
/// `SET LOCAL` in each transaction, so that no transaction can be started without them.
pub fn pin_worker_settings() {
    for (name, value) in WORKER_SETTINGS {
        set_session(name, value);
    }
    // PostgreSQL 17's transaction_timeout ends the process (FATAL) in any transaction that
    // lasts longer, a flusher waiting for a lock included.
    #[cfg(feature = "pg18")]
    set_session(c"transaction_timeout", c"0");
}

/// `SET name = value` for the session, as a superuser, without SQL; an ERROR if refused.
fn set_session(name: &CStr, value: &CStr) {
    // SAFETY: as SET does (GUC_ACTION_SET, source session); the workers run as the bootstrap
    // superuser, so PGC_SUSET admits every setting above. Each check hook used here works
    // outside a transaction ("none" for role needs no catalog lookup).
    unsafe {
        pg_sys::set_config_option(
            name.as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_SET,
            true,
            pg_sys::PGERROR as i32,
            false,
        );
    }
}

/// The extension as installed in the current database.
pub struct Extension {
    /// Its schema, quoted for SQL (`names::sql_identifier`).
    pub schema: String,
    /// The version of its SQL objects (a database not yet updated keeps an older one).
    pub version: SchemaVersion,
    /// Its schema's OID.
    namespace: pg_sys::Oid,
}

impl Extension {
    /// The extension's table `name`, None if its schema has no such table.
    pub fn table(&self, name: &CStr) -> Option<Table> {
        // SAFETY: a syscache lookup inside a transaction.
        let oid = unsafe { pg_sys::get_relname_relid(name.as_ptr(), self.namespace) };
        (oid != pg_sys::InvalidOid).then(|| Table {
            schema: self.schema.clone(),
            oid,
        })
    }
}

/// One of the extension's tables: its schema (quoted) for the statement's text, and its OID,
/// whose owner reads it ([`as_owner`]).
pub struct Table {
    pub schema: String,
    oid: pg_sys::Oid,
}

/// The extension in the current database, or None when it is not installed here.
pub fn extension() -> Option<Extension> {
    read(|c| {
        let row = c
            .select(
                "SELECT pg_catalog.quote_ident(n.nspname), e.extversion::pg_catalog.text, n.oid \
                   FROM pg_catalog.pg_extension AS e \
                   JOIN pg_catalog.pg_namespace AS n \
                     ON n.oid OPERATOR(pg_catalog.=) e.extnamespace \
                  WHERE e.extname OPERATOR(pg_catalog.=) 'stage_e_slots'::pg_catalog.name",
                Some(1),
                &[],
            )?
            .first();
        let namespace = row.get::<pg_sys::Oid>(3)?.unwrap_or(pg_sys::InvalidOid);
        Ok(match (row.get::<Text>(1)?, row.get::<String>(2)?) {
            // A version this library does not know is a newer one whose library was replaced
            // by this older one: its objects have at least what the newest known version has.
            (Some(schema), Some(version)) => Some(Extension {
                schema: crate::names::sql_identifier(schema.0),
                version: SchemaVersion::parse(&version).unwrap_or(SchemaVersion::CURRENT),
                namespace,
            }),
            _ => None,
        })
    })
    .ok()
    .flatten()
}

/// A read of `query` with the latest snapshot, whatever the isolation level: it sees every
/// transaction committed before it began and this transaction's own writes, as the
/// referential-integrity triggers read (a trigger's own snapshot may predate a commit of another
/// session's that shared memory already shows). `each` reads the rows.
///
/// The plan is kept for the backend's life ([`kept_plan`]), as the referential-integrity
/// triggers keep theirs: a trigger that reads after every statement would otherwise parse and
/// plan its query every time (most of its cost for a restore of one INSERT per row).
pub fn read_latest(
    query: &str,
    args: &[DatumWithOid<'_>],
    mut each: impl FnMut(&SpiHeapTupleData<'_>) -> spi::Result<()>,
) -> Result<(), String> {
    let mut types: Vec<pg_sys::Oid> = args.iter().map(|a| a.oid()).collect();
    let mut values: Vec<pg_sys::Datum> = args
        .iter()
        .map(|a| {
            a.datum()
                .map_or(pg_sys::Datum::from(0), |d| d.sans_lifetime())
        })
        .collect();
    let nulls: Vec<std::ffi::c_char> = args
        .iter()
        .map(|a| if a.datum().is_some() { b' ' } else { b'n' } as std::ffi::c_char)
        .collect();
    gucs::pinned(|| {
        Spi::connect(|_| {
            let plan = kept_plan(query, &mut types)?;
            // SAFETY: inside the SPI connection just made, with a kept plan of `types.len()`
            // parameters and `values` and `nulls` one per parameter; the rows it returns live
            // in the connection's memory, freed when it ends, and are read before.
            unsafe {
                // read_only = false: the snapshot's command id is advanced first, so the rows
                // this statement wrote are seen (as `ri_PerformCheck` does).
                let rc = pg_sys::SPI_execute_snapshot(
                    plan,
                    values.as_mut_ptr(),
                    nulls.as_ptr(),
                    pg_sys::GetLatestSnapshot(),
                    std::ptr::null_mut(),
                    false,
                    false,
                    0,
                );
                let table = pg_sys::SPI_tuptable;
                if rc != pg_sys::SPI_OK_SELECT as i32 || table.is_null() {
                    return Err(format!("SPI_execute_snapshot returned {rc}"));
                }
                for i in 0..pg_sys::SPI_processed as usize {
                    let row = SpiHeapTupleData::new((*table).tupdesc, *(*table).vals.add(i))
                        .map_err(|e| e.to_string())?
                        .ok_or("a row without a tuple descriptor")?;
                    each(&row).map_err(|e| e.to_string())?;
                }
                Ok(())
            }
        })
    })
}

/// The plan of `query` (with parameters of `types`), prepared at its first use in this backend
/// and kept (`SPI_keepplan`). PostgreSQL's plan cache revalidates it: DDL on the table it reads
/// (an update of the extension, a dropped index) or another search path has it parsed and
/// planned again at its next execution. One plan is kept: a different text (the extension moved
/// to another schema) frees the old one. Called inside an SPI connection.
fn kept_plan(query: &str, types: &mut [pg_sys::Oid]) -> Result<pg_sys::SPIPlanPtr, String> {
    if let Some(plan) = KEPT.with_borrow(|k| {
        k.as_ref()
            .filter(|(text, _)| text == query)
            .map(|&(_, plan)| plan)
    }) {
        return Ok(plan);
    }
    let text = CString::new(query).map_err(|e| e.to_string())?;
    // SAFETY: inside the caller's SPI connection, with `types` one per parameter. A kept plan
    // lives in its own memory context under CacheMemoryContext until SPI_freeplan, and is
    // stored only once kept; the old one is freed only after the new one is kept, so an ERROR
    // on the way leaves the old one stored and valid.
    unsafe {
        let plan = pg_sys::SPI_prepare(text.as_ptr(), types.len() as i32, types.as_mut_ptr());
        if plan.is_null() {
            let code = std::ptr::addr_of!(pg_sys::SPI_result).read();
            return Err(format!("SPI_prepare failed: {code}"));
        }
        if pg_sys::SPI_keepplan(plan) != 0 {
            return Err("SPI_keepplan failed".into());
        }
        if let Some((_, old)) = KEPT.with_borrow_mut(|k| k.replace((query.to_owned(), plan))) {
            pg_sys::SPI_freeplan(old);
        }
        Ok(plan)
    }
}

/// [`kept_plan`]'s plan and the query text it is of.
static KEPT: BackendLocal<RefCell<Option<(String, pg_sys::SPIPlanPtr)>>> =
    BackendLocal::new(RefCell::new(None));

/// Whether transaction id `xid` (a row's `xmin`) is this transaction's, or one of its
/// subtransactions' not rolled back: the row was written here.
pub fn written_here(xid: u32) -> bool {
    // SAFETY: reads this backend's transaction state.
    unsafe { pg_sys::TransactionIdIsCurrentTransactionId(pg_sys::TransactionId::from(xid)) }
}

/// Table `table`, if it is the table `name` of trigger function `function`'s schema: the
/// extension's own table for one of its trigger functions, which live in the extension's schema
/// (moved with it by `ALTER EXTENSION ... SET SCHEMA`). None for any other table, as when a
/// role attached the function to a table of its own. Catalog caches only, no SQL: the triggers
/// run after every statement that writes their tables.
pub fn own_table(function: pg_sys::Oid, table: pg_sys::Oid, name: &CStr) -> Option<Table> {
    // SAFETY: syscache lookups inside a transaction (a trigger runs in one); the palloc'd
    // strings are copied at once. get_func_namespace returns InvalidOid for a function gone.
    unsafe {
        let schema = pg_sys::get_func_namespace(function);
        if schema == pg_sys::InvalidOid || pg_sys::get_relname_relid(name.as_ptr(), schema) != table
        {
            return None;
        }
        let plain = pg_sys::get_namespace_name(schema);
        (!plain.is_null()).then(|| Table {
            schema: owned(pg_sys::quote_identifier(plain)),
            oid: table,
        })
    }
}

/// Runs `f` (reads of `table`) as the table's owner, with row-level security not forced, as
/// PostgreSQL's referential-integrity checks read: a policy table binds every role of a cap, so
/// what it says must not depend on which rows the calling role may see, nor on whether it may
/// read the table at all (the owner may hide rows from roles with a row-level policy, or
/// revoke SELECT). The caller's identity is back when `f` returns, and when it raises (the
/// guard's drop; a (sub)transaction's abort restores it too).
pub fn as_owner<R>(table: &Table, f: impl FnOnce() -> R) -> R {
    struct Restore(pg_sys::Oid, i32);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: puts back the identity saved below.
            unsafe { pg_sys::SetUserIdAndSecContext(self.0, self.1) }
        }
    }
    let mut user = pg_sys::InvalidOid;
    let mut context = 0;
    // SAFETY: inside a transaction: the relation is opened under AccessShareLock (the read
    // takes it anyway; held to the transaction's end) for its owner, then the identity is saved
    // and switched as ri_PerformCheck switches it.
    let _restore = unsafe {
        let rel = pg_sys::table_open(table.oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let owner = (*(*rel).rd_rel).relowner;
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        pg_sys::GetUserIdAndSecContext(&mut user, &mut context);
        pg_sys::SetUserIdAndSecContext(
            owner,
            context
                | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32
                | pg_sys::SECURITY_NOFORCE_RLS as i32,
        );
        Restore(user, context)
    };
    f()
}

/// `current_database()`, without SQL.
pub fn current_database() -> String {
    // SAFETY: a syscache lookup of our own database inside a transaction; the palloc'd copy is
    // read at once.
    unsafe { owned(pg_sys::get_database_name(pg_sys::MyDatabaseId)) }
}

/// The name of database `db`, None if it does not exist; inside a transaction (a shared
/// catalog: the launcher, connected to none, may look).
pub fn database_name(db: u32) -> Option<String> {
    // SAFETY: a syscache lookup on pg_database; the palloc'd copy is read at once.
    let p = unsafe { pg_sys::get_database_name(pg_sys::Oid::from(db)) };
    // SAFETY: NULL or a valid C string.
    (!p.is_null()).then(|| unsafe { owned(p) })
}

/// `current_user`, without SQL.
pub fn current_role() -> String {
    // SAFETY: as above; noerr = true returns NULL for a dropped role instead of an ERROR.
    unsafe { owned(pg_sys::GetUserNameFromId(pg_sys::GetUserId(), true)) }
}

/// # Safety
/// `p` is NULL or a valid C string.
unsafe fn owned(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: per the caller.
        crate::names::from_server_lossy(unsafe { CStr::from_ptr(p) })
    }
}

/// A time counted in microseconds, as the `interval` SQL shows.
pub fn interval_us(us: u64) -> pgrx::prelude::Interval {
    let us = us.min(i64::MAX as u64) as i64;
    pgrx::prelude::Interval::new(0, 0, us)
        .unwrap_or_else(|_| pgrx::prelude::Interval::from_micros(0))
}

// -- the statements --------------------------------------------------------------------------

/// Every row of the lease horizon table: cap, horizon, token floor, n, the journal as text.
pub fn horizon_rows_query(ext: &Extension) -> String {
    format!(
        "SELECT h.cap, h.horizon, h.token_floor, h.n, h.leases::pg_catalog.text \
           FROM {}.stage_e_lease_horizon AS h",
        ext.schema
    )
}

/// The caps that have a counter row.
pub fn counter_caps_query(ext: &Extension) -> String {
    format!(
        "SELECT c.cap FROM {}.stage_e_throttle_counter AS c",
        ext.schema
    )
}

/// The counter rows with a policy, and those of the caps in `$1` (text[]), for a write by hand
/// (`slots::edited`): `(cap, xmin as int8, adapt min, max, enforce, rate count, per in µs,
/// burst)`. Both parts use an index (the partial one on policy rows, the primary key), so a
/// restore of one INSERT per row reads no more than the policies at each.
pub fn policy_rows_query(schema: &str) -> String {
    let columns = "t.cap, (t.xmin::pg_catalog.text)::pg_catalog.int8, \
                   t.adapt_min, t.adapt_max, t.adapt_enforce, t.rate_count, \
                   (pg_catalog.date_part('epoch', t.rate_per) \
                      OPERATOR(pg_catalog.*) 1000000.0::pg_catalog.float8)::pg_catalog.int8, \
                   t.rate_burst";
    let policy = "(t.adapt_max IS NOT NULL OR t.rate_count IS NOT NULL)";
    format!(
        "SELECT {columns} FROM {schema}.stage_e_throttle_counter AS t WHERE {policy} \
         UNION ALL \
         SELECT {columns} FROM {schema}.stage_e_throttle_counter AS t \
          WHERE t.cap OPERATOR(pg_catalog.=) ANY ($1::pg_catalog.text[]) AND NOT {policy}"
    )
}

/// One statement writing the horizon rows of several caps: `$1` caps, `$2` horizons, `$3`
/// floors, `$4` n, `$5` journals (jsonb text). The floor never goes back (a row may already be
/// ahead of this server's view); the horizon is lowered only for a quiet cap (`shmem`'s
/// durable fields decide). Returns each row as written.
pub fn horizon_write_query(ext: &Extension) -> String {
    format!(
        "INSERT INTO {}.stage_e_lease_horizon AS h \
                (cap, horizon, token_floor, n, leases, written_at) \
         SELECT u.cap, u.horizon, u.token_floor, u.n, u.leases::pg_catalog.jsonb, \
                pg_catalog.now() \
           FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.text[]), \
                           pg_catalog.unnest($2::pg_catalog.timestamptz[]), \
                           pg_catalog.unnest($3::pg_catalog.int8[]), \
                           pg_catalog.unnest($4::pg_catalog.int4[]), \
                           pg_catalog.unnest($5::pg_catalog.text[])) \
                AS u (cap, horizon, token_floor, n, leases) \
         ON CONFLICT (cap) DO UPDATE SET \
                horizon = excluded.horizon, \
                token_floor = GREATEST(h.token_floor, excluded.token_floor), \
                n = excluded.n, leases = excluded.leases, written_at = excluded.written_at \
         RETURNING h.cap, h.horizon, h.token_floor",
        ext.schema
    )
}

/// The retention rule (`stage_e_slots.counter_retention`): deletes at most `$3` counter rows
/// flushed before `now() - $1` (an interval) whose cap is not in `$2` (text[], the caps in use),
/// and at most `$3` lease horizon rows of caps not in use, without a counter row (or losing it
/// now), written before `now() - $1` and whose horizon has passed: never one whose horizon is
/// ahead (it protects leases across a crash), nor the row with the database's highest token
/// floor (tokens after a crash start above it). Returns the numbers of rows deleted.
pub fn retention_query(ext: &Extension) -> String {
    let schema = &ext.schema;
    let old = "(pg_catalog.now() OPERATOR(pg_catalog.-) $1::pg_catalog.interval)";
    let (horizon, horizons) = if ext.version.has_lease_horizon() {
        (
            format!(
                ", quiet AS ( \
                   DELETE FROM {schema}.stage_e_lease_horizon AS h \
                    WHERE h.cap IN ( \
                      SELECT q.cap FROM {schema}.stage_e_lease_horizon AS q \
                       WHERE q.horizon OPERATOR(pg_catalog.<) pg_catalog.now() \
                         AND q.written_at OPERATOR(pg_catalog.<) {old} \
                         AND q.token_floor OPERATOR(pg_catalog.<) \
                             (SELECT pg_catalog.max(m.token_floor) \
                                FROM {schema}.stage_e_lease_horizon AS m) \
                         AND NOT EXISTS (SELECT FROM busy WHERE busy.cap OPERATOR(pg_catalog.=) q.cap) \
                         AND (EXISTS (SELECT FROM gone WHERE gone.cap OPERATOR(pg_catalog.=) q.cap) \
                              OR NOT EXISTS (SELECT FROM {schema}.stage_e_throttle_counter AS k \
                                              WHERE k.cap OPERATOR(pg_catalog.=) q.cap)) \
                       LIMIT $3) \
                   RETURNING h.cap)"
            ),
            "(SELECT pg_catalog.count(*) FROM quiet)",
        )
    } else {
        (String::new(), "0::pg_catalog.int8")
    };
    // An adaptive or rate-limited cap's row keeps its policy: never deleted while it has one.
    let policy = if ext.version.has_rates() {
        " AND c.adapt_max IS NULL AND c.rate_count IS NULL"
    } else if ext.version.has_adaptive() {
        " AND c.adapt_max IS NULL"
    } else {
        ""
    };
    format!(
        "WITH busy AS (SELECT b.cap FROM pg_catalog.unnest($2::pg_catalog.text[]) AS b (cap)), \
         old AS ( \
           SELECT c.cap FROM {schema}.stage_e_throttle_counter AS c \
            WHERE c.flushed_at OPERATOR(pg_catalog.<) {old}{policy} \
              AND NOT EXISTS (SELECT FROM busy WHERE busy.cap OPERATOR(pg_catalog.=) c.cap) \
            LIMIT $3), \
         gone AS ( \
           DELETE FROM {schema}.stage_e_throttle_counter AS t USING old \
            WHERE t.cap OPERATOR(pg_catalog.=) old.cap \
              AND t.flushed_at OPERATOR(pg_catalog.<) {old} \
           RETURNING t.cap){horizon} \
         SELECT (SELECT pg_catalog.count(*) FROM gone), {horizons}"
    )
}

/// The counter columns the database's table has.
fn counter_names(ext: &Extension) -> &'static [&'static str] {
    &CounterValues::NAMES[..ext.version.counter_columns()]
}

/// `c = t.c + excluded.c` for each counter column.
fn added_columns(ext: &Extension) -> String {
    counter_names(ext)
        .iter()
        .map(|c| format!("{c} = t.{c} OPERATOR(pg_catalog.+) excluded.{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One statement adding every cap's delta to its row (inserted on a cap's first flush).
/// Parameters: at 0.1.0 (one row, no cap column) `$1..$n` the counters and `$n+1` the flush
/// id; since, `$1` the caps (text[]), `$2..$n+1` one array per counter, `$n+2` the flush id.
pub fn counter_add_query(ext: &Extension) -> String {
    let names = counter_names(ext);
    let n = names.len();
    let cols = names.join(", ");
    let schema = &ext.schema;
    let set = added_columns(ext);
    if !ext.version.has_named_caps() {
        let params: Vec<String> = (1..=n).map(|i| format!("${i}")).collect();
        format!(
            "INSERT INTO {schema}.stage_e_throttle_counter AS t (id, {cols}, flushed_at, flush_id) \
             VALUES (true, {}, pg_catalog.now(), ${}) \
             ON CONFLICT (id) DO UPDATE SET {set}, flushed_at = excluded.flushed_at, \
               flush_id = excluded.flush_id",
            params.join(", "),
            n + 1,
        )
    } else {
        // ROWS FROM with one unnest per array: the multi-argument unnest shorthand only
        // exists unqualified.
        let mut arrays: Vec<String> = (1..=n + 1)
            .map(|i| format!("pg_catalog.unnest(${i})"))
            .collect();
        // Since 0.7.0 the row records its cap's lock key too (`$n+3`, see src/keys.rs).
        let (key_col, key_value, key_set) = if ext.version.has_key_records() {
            arrays.push(format!("pg_catalog.unnest(${})", n + 3));
            (
                ", lock_key",
                ", u.lock_key",
                ", lock_key = excluded.lock_key",
            )
        } else {
            ("", "", "")
        };
        let values: Vec<String> = names.iter().map(|c| format!("u.{c}")).collect();
        // Since 0.8.0 the histograms too: `$n+4` and `$n+5` hold every cap's buckets, cap after
        // cap (`BUCKETS` each, in the order of `$1`), and each row's are added bucket by bucket.
        let (hist_col, hist_value, hist_set, ord) = if ext.version.has_histograms() {
            let slice = |p: usize| {
                format!(
                    "(${p}::pg_catalog.int8[])[\
                       ((u.ord OPERATOR(pg_catalog.-) 1) OPERATOR(pg_catalog.*) {BUCKETS} \
                         OPERATOR(pg_catalog.+) 1)::pg_catalog.int4 \
                       : (u.ord OPERATOR(pg_catalog.*) {BUCKETS})::pg_catalog.int4]"
                )
            };
            let add = |c: &str| {
                format!(
                    "{c} = ARRAY(SELECT COALESCE(z.a, 0) OPERATOR(pg_catalog.+) COALESCE(z.b, 0) \
                       FROM ROWS FROM (pg_catalog.unnest(t.{c}), pg_catalog.unnest(excluded.{c})) \
                         WITH ORDINALITY AS z (a, b, i) ORDER BY z.i)"
                )
            };
            (
                ", hold_buckets, wait_buckets".to_string(),
                format!(", {}, {}", slice(n + 4), slice(n + 5)),
                format!(", {}, {}", add("hold_buckets"), add("wait_buckets")),
                " WITH ORDINALITY",
            )
        } else {
            (String::new(), String::new(), String::new(), "")
        };
        let ord_col = if ord.is_empty() { "" } else { ", ord" };
        format!(
            "INSERT INTO {schema}.stage_e_throttle_counter AS t \
               (cap, {cols}, flushed_at, flush_id{key_col}{hist_col}) \
             SELECT u.cap, {}, pg_catalog.now(), ${}{key_value}{hist_value} \
               FROM ROWS FROM ({}){ord} AS u (cap, {cols}{key_col}{ord_col}) \
             ON CONFLICT (cap) DO UPDATE SET {set}, flushed_at = excluded.flushed_at, \
               flush_id = excluded.flush_id{key_set}{hist_set}",
            values.join(", "),
            n + 2,
            arrays.join(", "),
        )
    }
}

/// Since 0.7.0: the keys counter rows record for cap `$1`, and which rows record any of the
/// keys `$2` (int4[]): `(cap, lock_key)`. The index on `lock_key` serves the second half.
pub fn key_book_query(ext: &Extension) -> String {
    format!(
        "SELECT cap, lock_key FROM {}.stage_e_throttle_counter \
          WHERE cap OPERATOR(pg_catalog.=) $1 OR lock_key OPERATOR(pg_catalog.=) ANY ($2)",
        ext.schema
    )
}

/// `stage_e_adapt`'s write, in the caller's transaction: the policy into the cap's row
/// (inserted if the cap has none), `$1` the cap, `$2` min_slots, `$3` max_slots, `$4` enforce,
/// `$5` the limit the cap has learned, clamped to the new bounds (NULL for a new policy).
pub fn adapt_write_query(ext: &Extension) -> String {
    format!(
        "INSERT INTO {}.stage_e_throttle_counter AS t \
                (cap, adapt_min, adapt_max, adapt_enforce, adapt_limit) \
         VALUES ($1::pg_catalog.text, $2::pg_catalog.int4, $3::pg_catalog.int4, \
                 $4::pg_catalog.bool, $5::pg_catalog.int4) \
         ON CONFLICT (cap) DO UPDATE SET \
                adapt_min = excluded.adapt_min, adapt_max = excluded.adapt_max, \
                adapt_enforce = excluded.adapt_enforce, adapt_limit = excluded.adapt_limit, \
                adapt_baseline = CASE WHEN t.adapt_max IS NULL THEN NULL \
                    ELSE t.adapt_baseline END",
        ext.schema
    )
}

/// `stage_e_adapt_off`'s write: the cap's row keeps no policy; `$1` the cap.
pub fn adapt_off_query(ext: &Extension) -> String {
    format!(
        "UPDATE {}.stage_e_throttle_counter SET adapt_min = NULL, adapt_max = NULL, \
                adapt_enforce = NULL, adapt_limit = NULL, adapt_baseline = NULL \
          WHERE cap OPERATOR(pg_catalog.=) $1::pg_catalog.text",
        ext.schema
    )
}

/// The flusher's write of learned limits: `$1` caps, `$2` limits, `$3` baselines (µs, NULL for
/// none), into the rows that still have a policy.
pub fn adapt_limits_query(ext: &Extension) -> String {
    format!(
        "UPDATE {}.stage_e_throttle_counter AS t \
            SET adapt_limit = LEAST(GREATEST(u.lim, t.adapt_min), t.adapt_max), \
                adapt_baseline = pg_catalog.make_interval(secs => \
                    u.baseline OPERATOR(pg_catalog./) 1000000.0::pg_catalog.float8) \
           FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.text[]), \
                           pg_catalog.unnest($2::pg_catalog.int4[]), \
                           pg_catalog.unnest($3::pg_catalog.float8[])) \
                AS u (cap, lim, baseline) \
          WHERE t.cap OPERATOR(pg_catalog.=) u.cap AND t.adapt_max IS NOT NULL",
        ext.schema
    )
}

/// `stage_e_rate_limit`'s write, in the caller's transaction: `$1` the cap (or pattern), `$2`
/// count, `$3` per, `$4` burst.
pub fn rate_write_query(ext: &Extension) -> String {
    format!(
        "INSERT INTO {}.stage_e_throttle_counter AS t (cap, rate_count, rate_per, rate_burst) \
         VALUES ($1::pg_catalog.text, $2::pg_catalog.int4, $3::pg_catalog.interval, \
                 $4::pg_catalog.int4) \
         ON CONFLICT (cap) DO UPDATE SET rate_count = excluded.rate_count, \
                rate_per = excluded.rate_per, rate_burst = excluded.rate_burst",
        ext.schema
    )
}

/// `stage_e_rate_limit_off`'s write: the row keeps no rate policy; `$1` the cap (or pattern).
pub fn rate_off_query(ext: &Extension) -> String {
    format!(
        "UPDATE {}.stage_e_throttle_counter \
            SET rate_count = NULL, rate_per = NULL, rate_burst = NULL \
          WHERE cap OPERATOR(pg_catalog.=) $1::pg_catalog.text",
        ext.schema
    )
}

/// `stage_e_share`'s write, in the caller's transaction: `$1` the cap, `$2` the share (or
/// `'*'`), `$3` the weight, `$4` max_slots (NULL: none).
pub fn share_write_query(ext: &Extension) -> String {
    format!(
        "INSERT INTO {}.stage_e_share_policy AS p (cap, share, weight, max_slots) \
         VALUES ($1::pg_catalog.text, $2::pg_catalog.text, $3::pg_catalog.int4, \
                 $4::pg_catalog.int4) \
         ON CONFLICT (cap, share) DO UPDATE SET weight = excluded.weight, \
                max_slots = excluded.max_slots",
        ext.schema
    )
}

/// A cap's share policies, for the acquisitions of its shares: `(share, weight, max_slots)`;
/// `$1` the cap.
pub fn share_policies_query(ext: &Extension) -> String {
    format!(
        "SELECT p.share, p.weight, p.max_slots \
           FROM {}.stage_e_share_policy AS p \
          WHERE p.cap OPERATOR(pg_catalog.=) $1::pg_catalog.text",
        ext.schema
    )
}

/// The rate policies to restore at a load: `(cap, count, per in µs, burst)`.
pub fn rate_rows_query(ext: &Extension) -> String {
    format!(
        "SELECT t.cap, t.rate_count, \
                (pg_catalog.date_part('epoch', t.rate_per) \
                   OPERATOR(pg_catalog.*) 1000000.0::pg_catalog.float8)::pg_catalog.int8, \
                t.rate_burst \
           FROM {}.stage_e_throttle_counter AS t \
          WHERE t.rate_count IS NOT NULL",
        ext.schema
    )
}

/// The policies to restore at a load: `(cap, min, max, enforce, limit, baseline µs)`.
pub fn adapt_rows_query(ext: &Extension) -> String {
    format!(
        "SELECT t.cap, t.adapt_min, t.adapt_max, t.adapt_enforce, t.adapt_limit, \
                pg_catalog.date_part('epoch', t.adapt_baseline) \
                   OPERATOR(pg_catalog.*) 1000000.0::pg_catalog.float8 \
           FROM {}.stage_e_throttle_counter AS t \
          WHERE t.adapt_max IS NOT NULL AND t.adapt_min IS NOT NULL",
        ext.schema
    )
}

/// Zeroes the rows: `$1` the flush id; with `one_cap` (since 0.2.0), `$2` the cap.
pub fn counter_reset_query(ext: &Extension, one_cap: bool) -> String {
    let zero: Vec<String> = counter_names(ext)
        .iter()
        .enumerate()
        .map(|(i, c)| {
            if CounterValues::is_time(i) {
                format!("{c} = '0'::pg_catalog.interval")
            } else {
                format!("{c} = 0")
            }
        })
        .collect();
    let only = if one_cap && ext.version.has_named_caps() {
        " WHERE cap OPERATOR(pg_catalog.=) $2"
    } else {
        ""
    };
    let mut zero = zero;
    if ext.version.has_histograms() {
        let empty = format!("'{{{}}}'::pg_catalog.int8[]", vec!["0"; BUCKETS].join(","));
        zero.push(format!("hold_buckets = {empty}, wait_buckets = {empty}"));
    }
    format!(
        "UPDATE {}.stage_e_throttle_counter SET {}, flushed_at = pg_catalog.now(), \
         flush_id = $1{only}",
        ext.schema,
        zero.join(", ")
    )
}

/// The counter rows as `(cap, counters…, flushed_at text, flush_id, lock_key)`, times as
/// microseconds (bigint), ordered by cap. A database at 0.1.0 has one row and no cap column:
/// `default`; before 0.7.0 `lock_key` is NULL.
pub fn counter_rows_query(ext: &Extension) -> String {
    let cols: Vec<String> = counter_names(ext)
        .iter()
        .enumerate()
        .map(|(i, c)| {
            if CounterValues::is_time(i) {
                format!(
                    "(pg_catalog.date_part('epoch', {c}) OPERATOR(pg_catalog.*) 1000000)::pg_catalog.int8"
                )
            } else {
                c.to_string()
            }
        })
        .collect();
    let key = if ext.version.has_key_records() {
        "lock_key"
    } else {
        "NULL::pg_catalog.int4"
    };
    format!(
        "SELECT {}, {}, flushed_at::pg_catalog.text, flush_id, {key} \
           FROM {}.stage_e_throttle_counter ORDER BY 1",
        cap_column(ext),
        cols.join(", "),
        ext.schema
    )
}

/// The holders view as `(cap, slot, pid, acquired_at text, application_name, state, token,
/// expires_at text)`; before 0.4.0 it has no lease columns.
pub fn holders_query(ext: &Extension) -> String {
    let lease_cols = if ext.version.has_leases() {
        "token, expires_at::pg_catalog.text"
    } else {
        "NULL::pg_catalog.int8, NULL::pg_catalog.text"
    };
    format!(
        "SELECT {}, slot, pid, acquired_at::pg_catalog.text, application_name, state, \
                {lease_cols} \
           FROM {}.stage_e_slot_holders",
        cap_column(ext),
        ext.schema
    )
}

fn cap_column(ext: &Extension) -> &'static str {
    if ext.version.has_named_caps() {
        "cap"
    } else {
        "'default'::pg_catalog.text"
    }
}
