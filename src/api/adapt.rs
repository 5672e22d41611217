//! Adaptive caps: `stage_e_adapt`, `stage_e_adapt_off`, and the function behind the view
//! `stage_e_cap_limits` (`sql/schema/views.sql`). Both changes are restricted (EXECUTE revoked
//! from PUBLIC, `sql/schema/privileges.sql`): a cap's limit binds every role that uses it.

use super::CapArg;
use crate::errors::raise;
use crate::hooks;
use crate::names::Text;
use crate::slots;
use crate::sql;
use pgrx::datetime::TimestampWithTimeZone;
use pgrx::prelude::*;

/// Makes cap `cap` adaptive: it hands out slots only while fewer than least(n, limit) are
/// held, the limit learned from its hold times between min_slots and max_slots (with
/// `enforce => false`, learned and shown only). From the commit of the calling transaction.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_adapt(
    cap: Option<CapArg<'_>>,
    min_slots: Option<i32>,
    max_slots: Option<i32>,
    enforce: default!(Option<bool>, "true"),
) {
    let _call = crate::report::calling("stage_e_adapt");
    hooks::ensure(); // applies the change at the commit
    slots::limits::adapt(cap.as_deref(), min_slots, max_slots, enforce).unwrap_or_else(|e| raise(e))
}

/// Returns cap `cap` to the caller's n alone, from the commit of the calling transaction.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_adapt_off(cap: Option<CapArg<'_>>) {
    let _call = crate::report::calling("stage_e_adapt_off");
    hooks::ensure(); // applies the change at the commit
    slots::limits::adapt_off(cap.as_deref()).unwrap_or_else(|e| raise(e))
}

/// After every statement that writes the policies of `stage_e_throttle_counter` (the trigger of
/// the same name): one not made by the extension (the owner's UPDATE or DELETE, a restore's COPY
/// into a database in use, a TRUNCATE) binds the adaptive and rate policies its rows now say
/// from its commit, as a restart would.
#[pg_trigger]
fn stage_e_throttle_counter_written<'a>(
    trigger: &'a PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, PgTriggerError> {
    let op = trigger.op()?;
    let table = super::own_table(
        trigger,
        c"stage_e_throttle_counter",
        "stage_e_throttle_counter_written",
    );
    hooks::ensure(); // applies the changes at the commit
    slots::edited::written(&op.to_string(), &table).unwrap_or_else(|e| raise(e));
    Ok(None)
}

/// One row per adaptive cap of the current database: its limit, bounds, what it learned, and
/// why the limit last moved.
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::type_complexity)]
fn stage_e_cap_limits_internal() -> TableIterator<
    'static,
    (
        name!(cap, Text),
        name!(limit, i32),
        name!(min_slots, i32),
        name!(max_slots, i32),
        name!(enforce, bool),
        name!(baseline_hold, Option<Interval>),
        name!(recent_hold, Option<Interval>),
        name!(held, i32),
        name!(changed_at, Option<TimestampWithTimeZone>),
        name!(reason, Text),
    ),
> {
    let _call = crate::report::calling("stage_e_cap_limits_internal");
    let rows = slots::limits::cap_limits().unwrap_or_else(|e| raise(e));
    let us = |x: Option<f64>| x.map(|us| sql::interval_us(us.round() as u64));
    TableIterator::new(rows.into_iter().map(move |r| {
        (
            Text(r.cap),
            r.limit as i32,
            r.bounds.min as i32,
            r.bounds.max as i32,
            r.enforce,
            us(r.baseline_us),
            us(r.recent_us),
            r.held as i32,
            TimestampWithTimeZone::try_from(r.changed_at).ok(),
            Text(r.reason),
        )
    }))
}
