//! The SQL surface: each function translates arguments, calls `slots`, and maps errors.
//! Every function is VOLATILE and PARALLEL UNSAFE (advisory locks are refused in parallel
//! workers). Arguments are `Option` so a NULL reaches us and becomes a class-22 ERROR rather
//! than a silent NULL from a STRICT function.

use crate::counters::CounterValues;
use crate::flush::{self, FlushError, Write};
use crate::gucs;
use crate::slots::{self, Release, SlotError};
use crate::sql;
use pgrx::datetime::TimestampWithTimeZone;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::{PgLogLevel, PgSqlErrorCode};
use serde::Serialize;

const HINT_PRELOAD: &str = "Add stage_e_slots to shared_preload_libraries in postgresql.conf \
     (shared_preload_libraries = 'stage_e_slots') and restart the server.";
const HINT_SAME_CONNECTION: &str = "A slot is a session-level lock: it belongs to the \
     connection that took it and is gone when that connection closes. Acquire and release on \
     one dedicated connection, and check stage_e_holding(slot) before committing work.";

/// Raises `e` as an ERROR with what happened, what was expected, and how to fix it.
fn raise(e: SlotError) -> ! {
    let (code, message, detail, hint) = match e {
        SlotError::NotPreloaded => (
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            "stage_e_slots must be loaded via shared_preload_libraries".to_string(),
            "Without its shared memory the cap cannot be enforced, so no slot is handed out."
                .to_string(),
            HINT_PRELOAD.to_string(),
        ),
        SlotError::Standby => (
            PgSqlErrorCode::ERRCODE_READ_ONLY_SQL_TRANSACTION,
            "stage_e_slots cannot be used on a standby".to_string(),
            "Advisory locks on a standby do not coordinate with the primary, so a cap here would \
             not bind."
                .to_string(),
            "Take and release slots on the primary.".to_string(),
        ),
        SlotError::ParallelMode => (
            PgSqlErrorCode::ERRCODE_INVALID_TRANSACTION_STATE,
            "stage_e_slots cannot be used during a parallel operation".to_string(),
            "A slot is a session lock: one taken in a parallel worker would end with the worker, \
             and the leader would not hold it."
                .to_string(),
            "Call the stage_e_slots functions outside parallel queries: do not wrap them in \
             functions marked PARALLEL SAFE or RESTRICTED."
                .to_string(),
        ),
        SlotError::NullArgument { name } => (
            PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
            format!("{name} must not be NULL"),
            bounds_detail(name),
            "Pass an integer.".to_string(),
        ),
        SlotError::CapOutOfRange { n, max_slots } => (
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!("cap n = {n} is out of range"),
            format!("n must be between 1 and stage_e_slots.max_slots ({max_slots})."),
            "For a larger cap, raise stage_e_slots.max_slots in postgresql.conf and restart."
                .to_string(),
        ),
        SlotError::SlotOutOfRange { slot, max_slots } => (
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!("slot {slot} is out of range"),
            format!(
                "Slots are numbered 0 to {} (stage_e_slots.max_slots - 1).",
                max_slots - 1
            ),
            "Pass a slot number returned by stage_e_try_slot.".to_string(),
        ),
        SlotError::DatabasesFull { max_databases } => (
            PgSqlErrorCode::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            "stage_e_slots has no room for another database".to_string(),
            format!(
                "All {max_databases} database entries (stage_e_slots.max_databases) are in use \
                 since server start."
            ),
            "Raise stage_e_slots.max_databases in postgresql.conf and restart.".to_string(),
        ),
    };
    ErrorReport::new(code, message, "stage_e_slots")
        .set_detail(detail)
        .set_hint(hint)
        .report(PgLogLevel::ERROR);
    unreachable!("ereport(ERROR) does not return")
}

fn raise_flush(e: FlushError) -> ! {
    match e {
        FlushError::Slots(e) => raise(e),
        FlushError::Spi(e) => {
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
                format!("stage_e_slots could not write the counter row: {e}"),
                "stage_e_slots",
            )
            .set_detail("The counts stay pending and are written by the next flush.")
            .report(PgLogLevel::ERROR);
            unreachable!("ereport(ERROR) does not return")
        }
        FlushError::Busy | FlushError::AgainInThisTransaction => {
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_OBJECT_IN_USE,
                "stage_e_slots counters were already flushed in this transaction",
                "stage_e_slots",
            )
            .set_detail("The row is settled when this transaction commits or aborts.")
            .set_hint("Call stage_e_flush() or stage_e_reset_stats() once per transaction.")
            .report(PgLogLevel::ERROR);
            unreachable!("ereport(ERROR) does not return")
        }
    }
}

fn bounds_detail(name: &str) -> String {
    let max = crate::gucs::max_slots();
    match name {
        "n" => format!("n must be between 1 and stage_e_slots.max_slots ({max})."),
        _ => format!("Slots are numbered 0 to {}.", max - 1),
    }
}

/// A slot in `[0, n)` that this session now holds, or NULL when all n are taken.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_try_slot(n: Option<i32>) -> Option<i32> {
    slots::try_slot(n)
        .unwrap_or_else(|e| raise(e))
        .map(|s| s as i32)
}

/// True when this session held the slot and no longer does; false with a WARNING otherwise.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_release(slot: Option<i32>) -> bool {
    match slots::release(slot).unwrap_or_else(|e| raise(e)) {
        Release::Released => true,
        Release::NotHeld { holder } => {
            let slot = slot.unwrap_or_default();
            let detail = match holder {
                Some(pid) => format!("Slot {slot} is held by pid {pid}; it keeps the slot."),
                None => format!("No session holds slot {slot}."),
            };
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_WARNING,
                format!("slot {slot} was not held by this connection"),
                "stage_e_slots",
            )
            .set_detail(detail)
            .set_hint(HINT_SAME_CONNECTION)
            .report(PgLogLevel::WARNING);
            false
        }
    }
}

/// Releases every slot this session took with stage_e_try_slot; returns how many.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_release_all() -> i32 {
    slots::release_all().unwrap_or_else(|e| raise(e)) as i32
}

/// Whether this session holds the slot right now.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_holding(slot: Option<i32>) -> bool {
    slots::holding(slot).unwrap_or_else(|e| raise(e))
}

/// Counters for the current database since server start, and the slots held now.
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::type_complexity)]
fn stage_e_stats() -> TableIterator<
    'static,
    (
        name!(max_slots, i32),
        name!(held, i32),
        name!(acquired, i64),
        name!(throttled, i64),
        name!(released, i64),
        name!(foreign_releases, i64),
        name!(released_by_exit, i64),
    ),
> {
    let s = slots::stats().unwrap_or_else(|e| raise(e));
    let [a, t, r, f, x] = s.counts.to_array().map(|v| v as i64);
    TableIterator::once((s.max_slots as i32, s.held as i32, a, t, r, f, x))
}

/// Held slots of the current database (lock manager truth); the view below adds session columns.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_slot_holders_internal() -> TableIterator<
    'static,
    (
        name!(slot, i32),
        name!(pid, i32),
        name!(acquired_at, Option<TimestampWithTimeZone>),
    ),
> {
    let rows = slots::holders().unwrap_or_else(|e| raise(e));
    TableIterator::new(rows.into_iter().map(|h| {
        let at = h
            .acquired_at
            .and_then(|t| TimestampWithTimeZone::try_from(t).ok());
        (h.slot as i32, h.pid, at)
    }))
}

extension_sql!(
    r#"
CREATE VIEW stage_e_slot_holders AS
SELECT h.slot,
       h.pid,
       h.acquired_at,
       pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) h.acquired_at AS held_for,
       a.application_name,
       a.client_addr,
       a.state
  FROM @extschema@.stage_e_slot_holders_internal() AS h
  LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid OPERATOR(pg_catalog.=) h.pid
 ORDER BY h.slot;
COMMENT ON VIEW stage_e_slot_holders IS
  'One row per held slot in the current database, from the lock manager, with the holder''s session.';
GRANT SELECT ON stage_e_slot_holders TO PUBLIC;
"#,
    name = "stage_e_slot_holders_view",
    requires = [stage_e_slot_holders_internal],
);

/// The counter columns, in `CounterValues::NAMES` order. (pgrx needs the tuple spelt out in
/// each signature, so the two functions below repeat it.)
type CounterRow = (
    name!(acquired, i64),
    name!(throttled, i64),
    name!(released, i64),
    name!(foreign_releases, i64),
    name!(released_by_exit, i64),
);

fn counter_row(v: CounterValues) -> TableIterator<'static, CounterRow> {
    let [a, t, r, f, x] = v.to_array().map(|v| v as i64);
    TableIterator::once((a, t, r, f, x))
}

/// Adds this database's pending counts to stage_e_throttle_counter now; returns what it added.
/// Restricted (EXECUTE revoked from PUBLIC): superusers and the extension owner.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_flush() -> TableIterator<
    'static,
    (
        name!(acquired, i64),
        name!(throttled, i64),
        name!(released, i64),
        name!(foreign_releases, i64),
        name!(released_by_exit, i64),
    ),
> {
    slots::ready().unwrap_or_else(|e| raise(e));
    let added = flush::flush(Write::Add, true).unwrap_or_else(|e| raise_flush(e));
    counter_row(added.unwrap_or_default())
}

/// Zeroes this database's stage_e_throttle_counter row and its pending counts. Restricted.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_reset_stats() {
    slots::ready().unwrap_or_else(|e| raise(e));
    let dropped = flush::flush(Write::Reset, true)
        .unwrap_or_else(|e| raise_flush(e))
        .unwrap_or_default();
    log!(
        "stage_e_slots: counters of database \"{}\" reset by role \"{}\" (table zeroed, {} pending throttles dropped)",
        sql::current_database(),
        sql::current_role(),
        dropped.throttled
    );
}

/// Counts not yet flushed. `row_flush_id` is the flush_id of the row the caller read (the view
/// passes it) so that a flush committing at that moment is not counted twice.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_pending(
    row_flush_id: default!(Option<i64>, "NULL"),
) -> TableIterator<
    'static,
    (
        name!(acquired, i64),
        name!(throttled, i64),
        name!(released, i64),
        name!(foreign_releases, i64),
        name!(released_by_exit, i64),
    ),
> {
    counter_row(flush::pending(row_flush_id).unwrap_or_else(|e| raise(e)))
}

#[derive(Serialize)]
struct SnapshotConfig {
    max_slots: u32,
    lock_key: i32,
    max_databases: u32,
    flush_interval_ms: u64,
}

#[derive(Serialize)]
struct SnapshotHolder {
    slot: i32,
    pid: i32,
    acquired_at: Option<String>,
    application_name: Option<String>,
    state: Option<String>,
}

#[derive(Serialize)]
struct Snapshot {
    database: String,
    config: SnapshotConfig,
    /// flushed + pending: what stage_e_throttle_totals shows.
    totals: CounterValues,
    flushed: CounterValues,
    flushed_at: Option<String>,
    pending: CounterValues,
    held: u32,
    holders: Vec<SnapshotHolder>,
}

/// Configuration, totals, pending counts and current holders as one jsonb document, for
/// monitoring agents (postgres_exporter custom queries, Grafana).
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_snapshot() -> pgrx::JsonB {
    let stats = slots::stats().unwrap_or_else(|e| raise(e));
    let Some(schema) = sql::extension_schema() else {
        raise_not_installed()
    };
    // Read-only statements (no transaction id): this works on a standby and in a READ ONLY
    // transaction, like the views.
    let read = sql::read(|c| {
        let cols = CounterValues::NAMES.join(", ");
        let rows = c.select(
            &format!(
                "SELECT {cols}, flushed_at::pg_catalog.text, flush_id \
                   FROM {schema}.stage_e_throttle_counter"
            ),
            Some(1),
            &[],
        )?;
        let (flushed, flushed_at, flush_id) = match rows.into_iter().next() {
            None => (CounterValues::default(), None, None),
            Some(row) => {
                let mut v = [0u64; 5];
                for (i, x) in v.iter_mut().enumerate() {
                    *x = row.get::<i64>(i + 1)?.unwrap_or(0) as u64;
                }
                (
                    CounterValues::from_array(v),
                    row.get::<String>(6)?,
                    row.get::<i64>(7)?,
                )
            }
        };
        let holders = c
            .select(
                &format!(
                    "SELECT slot, pid, acquired_at::pg_catalog.text, application_name, \
                            state FROM {schema}.stage_e_slot_holders"
                ),
                None,
                &[],
            )?
            .map(|r| {
                Ok(SnapshotHolder {
                    slot: r.get::<i32>(1)?.unwrap_or_default(),
                    pid: r.get::<i32>(2)?.unwrap_or_default(),
                    acquired_at: r.get::<String>(3)?,
                    application_name: r.get::<String>(4)?,
                    state: r.get::<String>(5)?,
                })
            })
            .collect::<Result<Vec<_>, pgrx::spi::Error>>()?;
        Ok((flushed, flushed_at, flush_id, holders))
    });
    let (flushed, flushed_at, flush_id, holders) = read.unwrap_or_else(|e| raise_spi(e));
    let pending = flush::pending(flush_id).unwrap_or_else(|e| raise(e));
    let snapshot = Snapshot {
        database: sql::current_database(),
        config: SnapshotConfig {
            max_slots: gucs::max_slots(),
            lock_key: gucs::lock_key(),
            max_databases: gucs::max_databases(),
            flush_interval_ms: gucs::flush_interval().as_millis() as u64,
        },
        totals: flushed.plus(pending),
        flushed,
        flushed_at,
        pending,
        held: stats.held,
        holders,
    };
    match serde_json::to_value(snapshot) {
        Ok(v) => pgrx::JsonB(v),
        Err(e) => raise_spi_text(format!("could not build the snapshot: {e}")),
    }
}

fn raise_not_installed() -> ! {
    ErrorReport::new(
        PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT,
        "extension \"stage_e_slots\" is not installed in this database",
        "stage_e_slots",
    )
    .set_hint("CREATE EXTENSION stage_e_slots;")
    .report(PgLogLevel::ERROR);
    unreachable!("ereport(ERROR) does not return")
}

fn raise_spi(e: pgrx::spi::Error) -> ! {
    raise_spi_text(format!("stage_e_slots could not read its tables: {e}"))
}

fn raise_spi_text(message: String) -> ! {
    ErrorReport::new(
        PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
        message,
        "stage_e_slots",
    )
    .report(PgLogLevel::ERROR);
    unreachable!("ereport(ERROR) does not return")
}

extension_sql!(
    r#"
CREATE TABLE stage_e_throttle_counter (
    id               boolean PRIMARY KEY DEFAULT true CHECK (id),
    acquired         bigint NOT NULL DEFAULT 0,
    throttled        bigint NOT NULL DEFAULT 0,
    released         bigint NOT NULL DEFAULT 0,
    foreign_releases bigint NOT NULL DEFAULT 0,
    released_by_exit bigint NOT NULL DEFAULT 0,
    flushed_at       timestamptz,
    flush_id         bigint NOT NULL DEFAULT 0
);
COMMENT ON TABLE stage_e_throttle_counter IS
  'Durable stage_e_slots counters of this database: one row, written by the first flush and added to once per flush interval.';
-- No row is inserted here: pg_dump keeps the table's data, and a restore (which runs
-- CREATE EXTENSION first) must find the table empty. The first flush inserts the row.
SELECT pg_catalog.pg_extension_config_dump('stage_e_throttle_counter', '');
GRANT SELECT ON stage_e_throttle_counter TO PUBLIC;

CREATE VIEW stage_e_throttle_totals AS
SELECT COALESCE(c.acquired, 0) OPERATOR(pg_catalog.+) p.acquired                 AS acquired,
       COALESCE(c.throttled, 0) OPERATOR(pg_catalog.+) p.throttled               AS throttled,
       COALESCE(c.released, 0) OPERATOR(pg_catalog.+) p.released                 AS released,
       COALESCE(c.foreign_releases, 0) OPERATOR(pg_catalog.+) p.foreign_releases AS foreign_releases,
       COALESCE(c.released_by_exit, 0) OPERATOR(pg_catalog.+) p.released_by_exit AS released_by_exit,
       p.throttled                                                               AS pending_throttled,
       c.flushed_at
  FROM (VALUES (true)) AS always (one_row)
  LEFT JOIN @extschema@.stage_e_throttle_counter AS c ON true
 CROSS JOIN LATERAL @extschema@.stage_e_pending(c.flush_id) AS p;
COMMENT ON VIEW stage_e_throttle_totals IS
  'Exact live totals: the flushed row plus the counts still pending in shared memory.';
GRANT SELECT ON stage_e_throttle_totals TO PUBLIC;

REVOKE EXECUTE ON FUNCTION stage_e_flush() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION stage_e_reset_stats() FROM PUBLIC;
"#,
    name = "stage_e_throttle_counter",
    requires = [stage_e_pending, stage_e_flush, stage_e_reset_stats],
);
