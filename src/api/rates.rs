//! Rate limits: `stage_e_try_rate`, a rate on its own, no slot (GCRA, `stage_e_core::rate`);
//! `stage_e_rate_limit` and `stage_e_rate_limit_off`, a rate on a cap's acquisitions, both
//! restricted (EXECUTE revoked from PUBLIC, `sql/schema/privileges.sql`): a cap's rate binds
//! every role that uses it.

use super::{one_row, CapArg};
use crate::errors::raise;
use crate::hooks;
use crate::names::Text;
use crate::slots;
use crate::sql;
use pgrx::datetime::TimestampWithTimeZone;
use pgrx::prelude::*;

/// Whether a call on rate `key` (`count` calls per `per`, bursts of `burst`) of weight `cost`
/// is allowed now, and if so counted, in one step; with how many calls of cost 1 remain, how
/// long until this call would be allowed (NULL when it is) and until the key is back to a full
/// burst. A denied call counts for nothing.
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::type_complexity)]
fn stage_e_try_rate(
    key: Option<CapArg<'_>>,
    count: Option<i32>,
    per: Option<Interval>,
    burst: default!(Option<i32>, "1"),
    cost: default!(Option<i32>, "1"),
) -> one_row::TableIterator<
    'static,
    (
        name!(allowed, bool),
        name!(remaining, i32),
        name!(retry_after, Option<Interval>),
        name!(reset_after, Interval),
    ),
> {
    let _call = crate::report::calling("stage_e_try_rate");
    let d = slots::rates::try_rate(key.as_deref(), count, per.map(per_ns), burst, cost)
        .unwrap_or_else(|e| raise(e));
    let interval = |ns: u64| sql::interval_us(ns.div_ceil(1_000));
    one_row::TableIterator::once((
        d.allowed,
        d.remaining as i32,
        d.retry_after.map(interval),
        interval(d.reset_after),
    ))
}

/// From the commit of the calling transaction, every acquisition of cap `cap` (`'tenant:*'`:
/// of every cap starting with `tenant:` that has no policy of its own, each at its own rate)
/// is granted only when a slot is free and `count` per `per` (in bursts of `burst`) allows
/// it, and charges both or neither.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_rate_limit(
    cap: Option<CapArg<'_>>,
    count: Option<i32>,
    per: Option<Interval>,
    burst: default!(Option<i32>, "1"),
) {
    let _call = crate::report::calling("stage_e_rate_limit");
    hooks::ensure(); // applies the change at the commit
    slots::rates::rate_limit(cap.as_deref(), count, per.map(per_ns), burst)
        .unwrap_or_else(|e| raise(e))
}

/// From the commit of the calling transaction, cap `cap` (or the pattern) has no rate policy.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_rate_limit_off(cap: Option<CapArg<'_>>) {
    let _call = crate::report::calling("stage_e_rate_limit_off");
    hooks::ensure(); // applies the change at the commit
    slots::rates::rate_limit_off(cap.as_deref()).unwrap_or_else(|e| raise(e))
}

/// One row per rate policy of the current database (a prefix policy's pattern, then each live
/// cap under it): its rate, and for a cap how many acquisitions of one slot the rate allows
/// now and when the next one is allowed. Behind the view `stage_e_rate_limits`.
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::type_complexity)]
fn stage_e_rate_limits_internal() -> TableIterator<
    'static,
    (
        name!(cap, Text),
        name!(count, i32),
        name!(per, Interval),
        name!(burst, i32),
        name!(remaining, Option<i32>),
        name!(next_at, Option<TimestampWithTimeZone>),
    ),
> {
    let _call = crate::report::calling("stage_e_rate_limits_internal");
    let rows = slots::rates::rate_limits().unwrap_or_else(|e| raise(e));
    TableIterator::new(rows.into_iter().map(|r| {
        (
            Text(r.cap),
            r.count as i32,
            sql::interval_us(r.per_us),
            r.burst as i32,
            r.remaining.map(|n| n as i32),
            r.next_at
                .and_then(|t| TimestampWithTimeZone::try_from(t).ok()),
        )
    }))
}

/// An interval of fixed length in ns (None: months, or too long to count in ns).
fn per_ns(i: Interval) -> Option<i64> {
    if i.months() != 0 {
        return None;
    }
    (i.days() as i64)
        .checked_mul(86_400_000_000)?
        .checked_add(i.micros())?
        .checked_mul(1_000)
}
