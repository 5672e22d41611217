//! The SQL surface of 0.5.0: each function translates arguments, calls `slots` or `flush`, and
//! maps errors (`errors`). Slot functions are VOLATILE and PARALLEL UNSAFE (advisory locks are
//! refused in parallel workers). Arguments are `Option` so a NULL reaches us and becomes a
//! class-22 ERROR rather than a silent NULL from a STRICT function. The one-argument forms are
//! the cap `default`. No two functions of one name take the same number of arguments, so a call
//! whose parameters are all untyped (as node-postgres and asyncpg send them) resolves to exactly
//! one (tests/test_overloads.py). Tables and views are in `sql/schema/`; functions of earlier
//! versions whose shape changed, or that were retired, keep their C symbols in `compat`.

use crate::counters::CounterValues;
use crate::directory::DEFAULT_CAP;
use crate::errors::{
    raise, raise_flush, raise_internal, raise_not_installed, warn_expired, warn_not_current,
    warn_not_held,
};
use crate::flush::{self, Write};
use crate::gucs;
use crate::shmem;
use crate::slots::{self, Release, SlotError};
use crate::sql;
use crate::waiting::{self, Wait};
use pgrx::datetime::TimestampWithTimeZone;
use pgrx::prelude::*;
use serde::Serialize;

/// Defines a `#[pg_extern]` returning rows of some leading columns followed by the counters,
/// so the counter columns are listed in one place ([`crate::counters`]'s list, passed in by
/// `for_each_counter!`). The body yields `(leading columns, CounterValues)` pairs.
macro_rules! counter_table_fn {
    ([$($c:ident: $cty:tt),*]
     $(#[$attr:meta])*
     fn $name:ident($($args:tt)*) -> ($($lead:ident: $lty:tt),*) $body:block) => {
        $(#[$attr])*
        #[allow(clippy::type_complexity)]
        fn $name($($args)*) -> TableIterator<'static, ($(name!($lead, $lty),)* $(name!($c, $cty),)*)> {
            let rows: Vec<(($($lty,)*), CounterValues)> = $body;
            TableIterator::new(rows.into_iter().map(|(($($lead,)*), v)| {
                ($($lead,)* $(<$cty as FromCounter>::from_counter(v.$c),)*)
            }))
        }
    };
}

/// A counter as SQL shows it: a count as bigint, a time (microseconds) as interval.
pub trait FromCounter {
    fn from_counter(v: u64) -> Self;
}

impl FromCounter for i64 {
    fn from_counter(v: u64) -> Self {
        v as i64
    }
}

impl FromCounter for Interval {
    fn from_counter(us: u64) -> Self {
        sql::interval_us(us)
    }
}

// -- slots ---------------------------------------------------------------------------------------

/// A slot in `[0, n)` of the cap `default` that this session now holds, or NULL when all n are
/// taken.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_try_slot(n: Option<i32>) -> Option<i32> {
    try_slot(Some(DEFAULT_CAP), n)
}

/// A slot in `[0, n)` of cap `cap` that this session now holds, or NULL when all n are taken.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_try_slot")]
fn stage_e_try_slot_cap(cap: Option<&str>, n: Option<i32>) -> Option<i32> {
    try_slot(cap, n)
}

/// A slot in `[0, n)` of cap `cap`, waiting up to `wait` for one (in arrival order); NULL
/// once `wait` has passed.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_try_slot")]
fn stage_e_try_slot_wait_cap(
    cap: Option<&str>,
    n: Option<i32>,
    wait: Option<Interval>,
) -> Option<i32> {
    try_slots(cap, n, Some(1), wait).map(|s| s[0])
}

/// k distinct slots of `[0, n)` of cap `cap`, all or none, waiting up to `wait` for them;
/// NULL when they could not all be had in time.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_try_slots(
    cap: Option<&str>,
    n: Option<i32>,
    k: Option<i32>,
    wait: default!(Option<Interval>, "'0'"),
) -> Option<Vec<i32>> {
    try_slots(cap, n, k, wait)
}

fn to_wait(wait: Option<Interval>) -> Wait {
    wait.ok_or(SlotError::NullArgument { name: "wait" })
        .and_then(|w| {
            Wait::from_interval(w.months(), w.days(), w.micros()).ok_or(SlotError::NegativeWait)
        })
        .unwrap_or_else(|e| raise(e))
}

/// An interval as microseconds, saturating, so 'infinity' is a very long time.
fn to_micros(i: Interval) -> i64 {
    let us = waiting::interval_micros(i.months(), i.days(), i.micros());
    us.clamp(i64::MIN as i128, i64::MAX as i128) as i64
}

pub fn try_slots(
    cap: Option<&str>,
    n: Option<i32>,
    k: Option<i32>,
    wait: Option<Interval>,
) -> Option<Vec<i32>> {
    slots::try_slots(cap, n, k, to_wait(wait))
        .unwrap_or_else(|e| raise(e))
        .map(|t| t.into_vec().into_iter().map(|s| s as i32).collect())
}

fn try_slot(cap: Option<&str>, n: Option<i32>) -> Option<i32> {
    slots::try_slot(cap, n)
        .unwrap_or_else(|e| raise(e))
        .map(|s| s as i32)
}

/// True when this session held the slot of `default` and no longer does; false with a WARNING
/// otherwise.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_release(slot: Option<i32>) -> bool {
    release(Some(DEFAULT_CAP), slot)
}

/// True when this session held the slot of `cap` and no longer does; false with a WARNING
/// otherwise.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_release")]
fn stage_e_release_cap(cap: Option<&str>, slot: Option<i32>) -> bool {
    release(cap, slot)
}

fn release(cap: Option<&str>, slot: Option<i32>) -> bool {
    match slots::release(cap, slot).unwrap_or_else(|e| raise(e)) {
        Release::Released => true,
        Release::NotHeld { holder } => {
            warn_not_held(cap.unwrap_or_default(), slot.unwrap_or_default(), holder);
            false
        }
    }
}

/// Releases every slot this session took with stage_e_try_slot, of every cap; returns how many.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_release_all() -> i32 {
    slots::release_all(None).unwrap_or_else(|e| raise(e)) as i32
}

/// Releases every slot of `cap` this session took; returns how many.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_release_all")]
fn stage_e_release_all_cap(cap: Option<&str>) -> i32 {
    slots::release_all(Some(cap)).unwrap_or_else(|e| raise(e)) as i32
}

/// Whether this session holds the slot of `default` right now.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_holding(slot: Option<i32>) -> bool {
    slots::holding(Some(DEFAULT_CAP), slot).unwrap_or_else(|e| raise(e))
}

/// Whether this session holds the slot of `cap` right now.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_holding")]
fn stage_e_holding_cap(cap: Option<&str>, slot: Option<i32>) -> bool {
    slots::holding(cap, slot).unwrap_or_else(|e| raise(e))
}

// -- leases and tokens ---------------------------------------------------------------------------

extension_sql!(
    "CREATE TYPE stage_e_lease_slot AS (slot integer, token bigint);\n\
     COMMENT ON TYPE stage_e_lease_slot IS 'A leased slot and its fencing token.';",
    name = "lease_slot_type",
    bootstrap
);

/// A slot of `[0, n)` of cap `cap` held by a token for `ttl` (not by this session, so it
/// survives transaction poolers): `(slot, token)`, or NULL when all n are taken after waiting
/// up to `wait`. Renew it with stage_e_renew, free it with stage_e_release_lease.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_lease(
    cap: Option<&str>,
    n: Option<i32>,
    ttl: Option<Interval>,
    wait: default!(Option<Interval>, "'0'"),
    fcinfo: pg_sys::FunctionCallInfo,
) -> Option<pgrx::composite_type!('static, "stage_e_lease_slot")> {
    let wait = to_wait(wait);
    let got = slots::lease(cap, n, ttl.map(to_micros), wait).unwrap_or_else(|e| raise(e))?;
    // The result type is this function's own (in the extension's schema), found through the
    // call rather than by name, so search_path plays no part.
    // SAFETY: fcinfo and its flinfo are the live call's; get_func_rettype reads the syscache.
    let type_oid = unsafe { pg_sys::get_func_rettype((*(*fcinfo).flinfo).fn_oid) };
    let desc = pgrx::PgTupleDesc::for_composite_type_by_oid(type_oid)
        .unwrap_or_else(|| raise_internal("stage_e_lease's result type is not a row".into()));
    let values = [
        (got.slot as i32).into_datum(),
        (got.token as i64).into_datum(),
    ];
    // SAFETY: two datums for the type's two attributes (slot integer, token bigint), by value.
    let row = unsafe { PgHeapTuple::from_datums(desc, values) }
        .unwrap_or_else(|e| raise_internal(format!("stage_e_lease's result: {e}")));
    Some(row)
}

/// Extends the live lease of `slot` of `cap` to `ttl` from now, if `token` is its current
/// one; false with a WARNING when it expired or the token is not the slot's current one.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_renew(
    cap: Option<&str>,
    slot: Option<i32>,
    token: Option<i64>,
    ttl: Option<Interval>,
) -> bool {
    settle_lease("stage_e_renew", cap, slot, token, Some(ttl.map(to_micros)))
}

/// Frees the lease of `slot` of `cap` if `token` is its current one; false with a WARNING
/// (and a foreign release counted) otherwise, so a stale holder never frees a later one's slot.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_release_lease(cap: Option<&str>, slot: Option<i32>, token: Option<i64>) -> bool {
    settle_lease("stage_e_release_lease", cap, slot, token, None)
}

fn settle_lease(
    what: &str,
    cap: Option<&str>,
    slot: Option<i32>,
    token: Option<i64>,
    ttl_us: Option<Option<i64>>,
) -> bool {
    let name = cap.unwrap_or_default();
    let s = slot.unwrap_or_default();
    match slots::settle_lease(cap, slot, token, ttl_us).unwrap_or_else(|e| raise(e)) {
        slots::LeaseOutcome::Done => true,
        slots::LeaseOutcome::Expired { held_us } => {
            warn_expired(what, name, s, held_us);
            false
        }
        slots::LeaseOutcome::NotCurrent { current } => {
            warn_not_current(what, name, s, current);
            false
        }
    }
}

/// The fencing token of slot `slot` of `cap` if this session holds it (NULL otherwise): larger
/// than every earlier token of the cap, leases included, also across restarts.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_slot_token(cap: Option<&str>, slot: Option<i32>) -> Option<i64> {
    slots::slot_token(cap, slot)
        .unwrap_or_else(|e| raise(e))
        .map(|t| t as i64)
}

/// The first int4 of the advisory locks of `cap`: slot s of the cap is the lock
/// `(stage_e_cap_key(cap), s)`. The same on every server and after every restart.
#[pg_extern(stable, parallel_safe)]
fn stage_e_cap_key(cap: Option<&str>) -> i32 {
    slots::cap_key(cap).unwrap_or_else(|e| raise(e))
}

// -- statistics and counters ---------------------------------------------------------------------

for_each_counter!(counter_table_fn,
    /// One row per cap in use in the current database: counters since the cap was created,
    /// and the slots held now (from the lock manager).
    #[pg_extern(volatile, parallel_unsafe, name = "stage_e_stats")]
    fn stage_e_stats_v4() -> (cap: String, max_slots: i32, held: i32) {
        stats_rows()
    }
);

/// The rows of `stage_e_stats()` (since 0.2.0; each version shows its own counters).
pub fn stats_rows() -> Vec<((String, i32, i32), CounterValues)> {
    let max_slots = gucs::max_slots() as i32;
    slots::stats()
        .unwrap_or_else(|e| raise(e))
        .into_iter()
        .map(|s| ((s.cap, max_slots, s.held as i32), s.counts))
        .collect()
}

/// Held slots of the current database (lock manager truth) and leases (with their token and
/// expiry); the view adds session columns.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_slot_holders_internal")]
#[allow(clippy::type_complexity)]
fn stage_e_slot_holders_internal_v3() -> TableIterator<
    'static,
    (
        name!(cap, String),
        name!(slot, i32),
        name!(pid, i32),
        name!(acquired_at, Option<TimestampWithTimeZone>),
        name!(token, Option<i64>),
        name!(expires_at, Option<TimestampWithTimeZone>),
    ),
> {
    let rows = slots::holders().unwrap_or_else(|e| raise(e));
    let at = |t: Option<i64>| t.and_then(|t| TimestampWithTimeZone::try_from(t).ok());
    TableIterator::new(rows.into_iter().map(move |h| {
        (
            h.cap,
            h.slot as i32,
            h.pid,
            at(h.acquired_at),
            h.token.map(|t| t as i64),
            at(h.expires_at),
        )
    }))
}

for_each_counter!(counter_table_fn,
    /// Adds every cap's pending counts to its stage_e_throttle_counter row now; returns what it
    /// added, per cap. Restricted (EXECUTE revoked from PUBLIC): superusers and the owner.
    #[pg_extern(volatile, parallel_unsafe, name = "stage_e_flush")]
    fn stage_e_flush_v4() -> (cap: String) {
        flush_rows()
    }
);

/// Flushes every cap now; the rows of `stage_e_flush()`: what it added, per cap.
pub fn flush_rows() -> Vec<((String,), CounterValues)> {
    slots::ready().unwrap_or_else(|e| raise(e));
    flush::flush(Write::Add, None, true)
        .unwrap_or_else(|e| raise_flush(e))
        .unwrap_or_else(|| raise_not_installed())
        .into_iter()
        .map(|(cap, v)| ((cap,), v))
        .collect()
}

/// Zeroes every cap's stage_e_throttle_counter row and pending counts. Restricted.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_reset_stats() {
    reset(None)
}

/// Zeroes one cap's row and pending counts. Restricted.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_reset_stats")]
fn stage_e_reset_stats_cap(cap: Option<&str>) {
    let cap = slots::cap_key(cap)
        .map(|_| cap)
        .unwrap_or_else(|e| raise(e));
    reset(cap)
}

fn reset(cap: Option<&str>) {
    slots::ready().unwrap_or_else(|e| raise(e));
    let dropped: u64 = flush::flush(Write::Reset, cap, true)
        .unwrap_or_else(|e| raise_flush(e))
        .unwrap_or_else(|| raise_not_installed())
        .iter()
        .map(|(_, v)| v.throttled)
        .sum();
    let what = match cap {
        Some(c) => format!("cap \"{c}\" of database \"{}\"", sql::current_database()),
        None => format!("database \"{}\"", sql::current_database()),
    };
    log!(
        "stage_e_slots: counters of {what} reset by role \"{}\" (table zeroed, {dropped} pending \
         throttles dropped)",
        sql::current_role()
    );
}

for_each_counter!(counter_table_fn,
    /// Counts not yet in the table, per cap in use. `row_flush_id` is the newest flush_id among
    /// the rows the caller read (the view passes it) so that a flush committing at that moment
    /// is not counted twice.
    #[pg_extern(volatile, parallel_unsafe, name = "stage_e_pending")]
    fn stage_e_pending_v4(row_flush_id: default!(Option<i64>, "NULL")) -> (cap: String) {
        pending_rows(row_flush_id)
    }
);

/// The rows of `stage_e_pending(row_flush_id)`: per cap, the counts not yet in the table.
pub fn pending_rows(row_flush_id: Option<i64>) -> Vec<((String,), CounterValues)> {
    slots::attached().unwrap_or_else(|e| raise(e));
    flush::pending(row_flush_id)
        .into_iter()
        .map(|(cap, v)| ((cap,), v))
        .collect()
}

/// Sessions waiting for slots in the current database (`stage_e_slot_waiters` adds session
/// columns): position 1 is the head of its cap's queue.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_slot_waiters_internal() -> TableIterator<
    'static,
    (
        name!(cap, String),
        name!(pid, i32),
        name!(n, i32),
        name!(k, i32),
        name!(waiting_since, Option<TimestampWithTimeZone>),
        name!(position, i32),
    ),
> {
    let rows = slots::waiters().unwrap_or_else(|e| raise(e));
    TableIterator::new(rows.into_iter().map(|w| {
        let since = TimestampWithTimeZone::try_from(w.since).ok();
        (
            w.cap,
            w.pid,
            w.n as i32,
            w.k as i32,
            since,
            w.position as i32,
        )
    }))
}

/// Per cap, the slots held and the throttles per minute, averaged over 1, 5 and 15 minutes
/// from the launcher's samples (`stage_e_cap_load` shows them).
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_cap_load_internal() -> TableIterator<
    'static,
    (
        name!(cap, String),
        name!(held_1m, f64),
        name!(held_5m, f64),
        name!(held_15m, f64),
        name!(throttled_per_min_1m, f64),
        name!(throttled_per_min_5m, f64),
        name!(throttled_per_min_15m, f64),
    ),
> {
    let rows = slots::load().unwrap_or_else(|e| raise(e));
    TableIterator::new(rows.into_iter().map(|l| {
        let [h1, h5, h15] = l.held;
        let [t1, t5, t15] = l.throttles_per_min;
        (l.cap, h1, h5, h15, t1, t5, t15)
    }))
}

// -- snapshot ------------------------------------------------------------------------------------

#[derive(Serialize)]
struct SnapshotConfig {
    max_slots: u32,
    lock_key: i32,
    max_caps: u32,
    slot_memory_kb: u64,
    max_leases: u32,
    flush_interval_ms: u64,
}

#[derive(Serialize)]
struct SnapshotMemory {
    caps_in_use: u32,
    max_caps: u32,
    slot_pages_free: u64,
    slot_pages: u32,
}

#[derive(Serialize)]
struct SnapshotCap {
    cap: String,
    key: i32,
    held: u32,
    /// flushed + pending: what stage_e_throttle_totals shows.
    totals: CounterValues,
    flushed: CounterValues,
    flushed_at: Option<String>,
    pending: CounterValues,
}

#[derive(Serialize)]
struct SnapshotHolder {
    cap: String,
    slot: i32,
    pid: i32,
    acquired_at: Option<String>,
    application_name: Option<String>,
    state: Option<String>,
    /// A lease's token and expiry (null for a session slot).
    token: Option<i64>,
    expires_at: Option<String>,
}

#[derive(Serialize)]
struct Snapshot {
    database: String,
    config: SnapshotConfig,
    memory: SnapshotMemory,
    held: u32,
    caps: Vec<SnapshotCap>,
    holders: Vec<SnapshotHolder>,
}

/// Configuration, per-cap totals and pending counts, and current holders as one jsonb
/// document, for monitoring agents (postgres_exporter custom queries, Grafana).
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_snapshot")]
fn stage_e_snapshot_v2() -> pgrx::JsonB {
    pgrx::JsonB(snapshot_document())
}

/// The snapshot document (also behind 0.1.0's `stage_e_snapshot`, see `compat`).
pub fn snapshot_document() -> serde_json::Value {
    let stats = slots::stats().unwrap_or_else(|e| raise(e));
    let Some(ext) = sql::extension() else {
        raise_not_installed()
    };
    let schema = &ext.schema;
    // Before 0.4.0 the holders view has no lease columns.
    let lease_cols = if ext.has_leases() {
        "token, expires_at::pg_catalog.text"
    } else {
        "NULL::pg_catalog.int8, NULL::pg_catalog.text"
    };
    // A database still at 0.1.0 has one row and no cap column: it is the cap `default`.
    let cap_col = if ext.at_0_1_0() {
        "'default'::pg_catalog.text"
    } else {
        "cap"
    };
    // Read-only statements (no transaction id): this works on a standby and in a READ ONLY
    // transaction, like the views.
    let read = sql::read(|c| {
        // Times come back as microseconds; a table of before 0.3.0 has fewer counters.
        let n = ext.counter_columns();
        let cols: Vec<String> = CounterValues::NAMES[..n]
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
        let rows = c
            .select(
                &format!(
                    "SELECT {cap_col}, {}, flushed_at::pg_catalog.text, flush_id \
                       FROM {schema}.stage_e_throttle_counter ORDER BY 1",
                    cols.join(", ")
                ),
                None,
                &[],
            )?
            .map(|row| {
                let mut v = [0u64; crate::counters::COUNT];
                for (i, x) in v.iter_mut().enumerate().take(n) {
                    *x = row.get::<i64>(i + 2)?.unwrap_or(0) as u64;
                }
                Ok((
                    row.get::<String>(1)?.unwrap_or_default(),
                    CounterValues::from_array(v),
                    row.get::<String>(n + 2)?,
                    row.get::<i64>(n + 3)?.unwrap_or(0),
                ))
            })
            .collect::<Result<Vec<_>, pgrx::spi::Error>>()?;
        let holders = c
            .select(
                &format!(
                    "SELECT {cap_col}, slot, pid, acquired_at::pg_catalog.text, \
                            application_name, state, {lease_cols} \
                       FROM {schema}.stage_e_slot_holders"
                ),
                None,
                &[],
            )?
            .map(|r| {
                Ok(SnapshotHolder {
                    cap: r.get::<String>(1)?.unwrap_or_default(),
                    slot: r.get::<i32>(2)?.unwrap_or_default(),
                    pid: r.get::<i32>(3)?.unwrap_or_default(),
                    acquired_at: r.get::<String>(4)?,
                    application_name: r.get::<String>(5)?,
                    state: r.get::<String>(6)?,
                    token: r.get::<i64>(7)?,
                    expires_at: r.get::<String>(8)?,
                })
            })
            .collect::<Result<Vec<_>, pgrx::spi::Error>>()?;
        Ok((rows, holders))
    });
    let (rows, holders) = read.unwrap_or_else(|e| raise_internal(format!("{e}")));
    let newest = rows.iter().map(|r| r.3).max();
    let pending = flush::pending(newest);
    let mut names: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
    names.extend(pending.iter().map(|p| p.0.clone()));
    names.sort();
    names.dedup();
    let caps = names
        .into_iter()
        .map(|cap| {
            let row = rows.iter().find(|r| r.0 == cap);
            let flushed = row.map(|r| r.1).unwrap_or_default();
            let pending = pending
                .iter()
                .find(|p| p.0 == cap)
                .map(|p| p.1)
                .unwrap_or_default();
            SnapshotCap {
                key: shmem::cap_key(&cap),
                held: stats.iter().find(|s| s.cap == cap).map_or(0, |s| s.held),
                totals: flushed.plus(pending),
                flushed,
                flushed_at: row.and_then(|r| r.2.clone()),
                pending,
                cap,
            }
        })
        .collect();
    let (caps_in_use, max_caps, slot_pages_free, slot_pages) = shmem::usage();
    let snapshot = Snapshot {
        database: sql::current_database(),
        config: SnapshotConfig {
            max_slots: gucs::max_slots(),
            lock_key: gucs::lock_key(),
            max_caps: gucs::max_caps(),
            slot_memory_kb: gucs::slot_memory_bytes() as u64 / 1024,
            max_leases: gucs::max_leases(),
            flush_interval_ms: gucs::flush_interval().as_millis() as u64,
        },
        memory: SnapshotMemory {
            caps_in_use,
            max_caps,
            slot_pages_free,
            slot_pages,
        },
        held: holders.len() as u32,
        caps,
        holders,
    };
    serde_json::to_value(snapshot)
        .unwrap_or_else(|e| raise_internal(format!("could not build the snapshot: {e}")))
}

// -- tables and views (sql/schema/) --------------------------------------------------------------

extension_sql_file!("../sql/schema/counter_table.sql", name = "counter_table");

extension_sql_file!(
    "../sql/schema/views.sql",
    name = "views",
    requires = [
        "counter_table",
        stage_e_pending_v4,
        stage_e_slot_holders_internal_v3,
        stage_e_slot_waiters_internal,
        stage_e_cap_load_internal
    ],
);

extension_sql_file!(
    "../sql/schema/privileges.sql",
    name = "privileges",
    requires = [
        stage_e_flush_v4,
        stage_e_reset_stats,
        stage_e_reset_stats_cap
    ],
);
