//! The SQL surface: each function translates arguments, calls `slots`, and maps errors.
//! Every function is VOLATILE and PARALLEL UNSAFE (advisory locks are refused in parallel
//! workers). Arguments are `Option` so a NULL reaches us and becomes a class-22 ERROR rather
//! than a silent NULL from a STRICT function.

use crate::slots::{self, Release, SlotError};
use pgrx::datetime::TimestampWithTimeZone;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::{PgLogLevel, PgSqlErrorCode};

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
    TableIterator::once((
        s.max_slots as i32,
        s.held as i32,
        s.acquired as i64,
        s.throttled as i64,
        s.released as i64,
        s.foreign_releases as i64,
        s.released_by_exit as i64,
    ))
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
       pg_catalog.clock_timestamp() - h.acquired_at AS held_for,
       a.application_name,
       a.client_addr,
       a.state
  FROM stage_e_slot_holders_internal() AS h
  LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = h.pid
 ORDER BY h.slot;
COMMENT ON VIEW stage_e_slot_holders IS
  'One row per held slot in the current database, from the lock manager, with the holder''s session.';
"#,
    name = "stage_e_slot_holders_view",
    requires = [stage_e_slot_holders_internal],
);
