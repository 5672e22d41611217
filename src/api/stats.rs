//! Counters and what is held and waited for: `stage_e_stats`, the holders', waiters' and load
//! views' functions, `stage_e_flush`, `stage_e_reset_stats`, `stage_e_pending`.

use super::CapArg;
use crate::errors::{raise, raise_flush, raise_not_installed};
use crate::flush::{self, Write};
use crate::gucs;
use crate::hooks;
use crate::names::Text;
use crate::slots;
use crate::sql;
use pgrx::datetime::TimestampWithTimeZone;
use pgrx::prelude::*;
use stage_e_core::counters::CounterValues;
use stage_e_core::for_each_counter;
use stage_e_core::histogram::{self, Metric};

/// A cap's current n as SQL shows it: NULL before its first acquisition.
pub type CurrentN = Option<i32>;

for_each_counter!(counter_table_fn,
    /// One row per cap in use in the current database: counters since the cap was created,
    /// the slots held now (from the lock manager) and the cap's current n.
    #[pg_extern(volatile, parallel_unsafe, name = "stage_e_stats")]
    fn stage_e_stats_v6() -> (cap: Text, max_slots: i32, held: i32, n: CurrentN) {
        let _call = crate::report::calling("stage_e_stats");
        stats_rows_with_n()
    }
);

/// The rows of `stage_e_stats()` since 0.8.0 (each version shows its own counters).
#[allow(clippy::type_complexity)]
pub fn stats_rows_with_n() -> Vec<((Text, i32, i32, CurrentN), CounterValues)> {
    let max_slots = gucs::max_slots() as i32;
    slots::stats()
        .unwrap_or_else(|e| raise(e))
        .into_iter()
        .map(|s| {
            let n = s.n.map(|n| n as i32);
            ((Text(s.cap), max_slots, s.held as i32, n), s.counts)
        })
        .collect()
}

/// The rows of `stage_e_stats()` from 0.2.0 to 0.7.0 (each version shows its own counters).
pub fn stats_rows() -> Vec<((Text, i32, i32), CounterValues)> {
    let max_slots = gucs::max_slots() as i32;
    slots::stats()
        .unwrap_or_else(|e| raise(e))
        .into_iter()
        .map(|s| ((Text(s.cap), max_slots, s.held as i32), s.counts))
        .collect()
}

/// Per cap in use in the current database and metric (`hold`, `wait`), its histogram since the
/// cap was made, in the shape postgres_exporter's HISTOGRAM usage reads: the upper bounds in
/// seconds, the count at or below each, the sum in seconds, the count of all.
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::type_complexity)]
fn stage_e_histograms() -> TableIterator<
    'static,
    (
        name!(cap, Text),
        name!(metric, Text),
        name!(seconds, Vec<f64>),
        name!(seconds_bucket, Vec<i64>),
        name!(seconds_sum, f64),
        name!(seconds_count, i64),
    ),
> {
    let _call = crate::report::calling("stage_e_histograms");
    let bounds = histogram::bounds_seconds().to_vec();
    let rows = slots::stats().unwrap_or_else(|e| raise(e));
    TableIterator::new(rows.into_iter().flat_map(move |s| {
        let bounds = bounds.clone();
        Metric::ALL.map(move |m| {
            let (below, count) = s.hist.cumulative(m);
            let sum_us = match m {
                Metric::Hold => s.counts.hold_time,
                Metric::Wait => s.counts.wait_time,
            };
            (
                Text(s.cap.clone()),
                Text(m.name().to_string()),
                bounds.clone(),
                below.iter().map(|&c| c as i64).collect(),
                sum_us as f64 / 1e6,
                count as i64,
            )
        })
    }))
}

/// Per cap and metric: the count since the cap was made, and its 50th, 90th and 99th
/// percentiles (`stage_e_histogram_quantiles` shows them; NULL without observations).
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::type_complexity)]
fn stage_e_histogram_quantiles_internal() -> TableIterator<
    'static,
    (
        name!(cap, Text),
        name!(metric, Text),
        name!(count, i64),
        name!(p50, Option<Interval>),
        name!(p90, Option<Interval>),
        name!(p99, Option<Interval>),
    ),
> {
    let _call = crate::report::calling("stage_e_histogram_quantiles_internal");
    let rows = slots::stats().unwrap_or_else(|e| raise(e));
    let at = |q: f64, b: &[u64; histogram::BUCKETS]| {
        histogram::quantile(q, b).map(|s| sql::interval_us((s * 1e6).round() as u64))
    };
    TableIterator::new(rows.into_iter().flat_map(move |s| {
        Metric::ALL.map(move |m| {
            let b = s.hist.of(m);
            (
                Text(s.cap.clone()),
                Text(m.name().to_string()),
                b.iter().sum::<u64>() as i64,
                at(0.5, &b),
                at(0.9, &b),
                at(0.99, &b),
            )
        })
    }))
}

/// Held slots of the current database (lock manager truth) and leases (with their token and
/// expiry), with the fair share each was taken in; the view adds session columns.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_slot_holders_internal")]
#[allow(clippy::type_complexity)]
fn stage_e_slot_holders_internal_v4() -> TableIterator<
    'static,
    (
        name!(cap, Text),
        name!(slot, i32),
        name!(pid, i32),
        name!(acquired_at, Option<TimestampWithTimeZone>),
        name!(token, Option<i64>),
        name!(expires_at, Option<TimestampWithTimeZone>),
        name!(share, Option<Text>),
    ),
> {
    let _call = crate::report::calling("stage_e_slot_holders_internal");
    let rows = slots::holders().unwrap_or_else(|e| raise(e));
    let at = |t: Option<i64>| t.and_then(|t| TimestampWithTimeZone::try_from(t).ok());
    TableIterator::new(rows.into_iter().map(move |h| {
        (
            Text(h.cap),
            h.slot as i32,
            h.pid,
            at(h.acquired_at),
            h.token.map(|t| t as i64),
            at(h.expires_at),
            h.share.map(Text),
        )
    }))
}

for_each_counter!(counter_table_fn,
    /// Adds every cap's pending counts to its stage_e_throttle_counter row now; returns what it
    /// added, per cap. Restricted (EXECUTE revoked from PUBLIC): superusers and the owner.
    #[pg_extern(volatile, parallel_unsafe, name = "stage_e_flush")]
    fn stage_e_flush_v5() -> (cap: Text) {
        let _call = crate::report::calling("stage_e_flush");
        flush_rows()
    }
);

/// Flushes every cap now; the rows of `stage_e_flush()`: what it added, per cap.
pub fn flush_rows() -> Vec<((Text,), CounterValues)> {
    slots::ready().unwrap_or_else(|e| raise(e));
    hooks::ensure();
    flush::flush(Write::Add, None, true)
        .unwrap_or_else(|e| raise_flush(e))
        .unwrap_or_else(|| raise_not_installed())
        .into_iter()
        .map(|(cap, v)| ((Text(cap),), v))
        .collect()
}

/// Zeroes every cap's stage_e_throttle_counter row and pending counts. Restricted.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_reset_stats() {
    let _call = crate::report::calling("stage_e_reset_stats");
    reset(None)
}

/// Zeroes one cap's row and pending counts. Restricted.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_reset_stats")]
fn stage_e_reset_stats_cap(cap: Option<CapArg<'_>>) {
    let _call = crate::report::calling("stage_e_reset_stats");
    let cap = cap.as_deref();
    let cap = Some(slots::valid_cap(cap).unwrap_or_else(|e| raise(e)));
    reset(cap)
}

fn reset(cap: Option<&str>) {
    slots::ready().unwrap_or_else(|e| raise(e));
    hooks::ensure();
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
    crate::report::log(format!(
        "stage_e_slots: counters of {what} reset by role \"{}\" (table zeroed, {dropped} pending \
         throttles dropped)",
        sql::current_role()
    ));
}

for_each_counter!(counter_table_fn,
    /// Counts not yet in the table, per cap in use. `row_flush_id` is the newest flush_id among
    /// the rows the caller read (the view passes it) so that a flush committing at that moment
    /// is not counted twice.
    #[pg_extern(volatile, parallel_unsafe, name = "stage_e_pending")]
    fn stage_e_pending_v5(row_flush_id: default!(Option<i64>, "NULL")) -> (cap: Text) {
        let _call = crate::report::calling("stage_e_pending");
        pending_rows(row_flush_id)
    }
);

/// The rows of `stage_e_pending(row_flush_id)`: per cap, the counts not yet in the table.
pub fn pending_rows(row_flush_id: Option<i64>) -> Vec<((Text,), CounterValues)> {
    slots::attached().unwrap_or_else(|e| raise(e));
    flush::pending(row_flush_id)
        .into_iter()
        .map(|(cap, v)| ((Text(cap),), v))
        .collect()
}

/// Sessions waiting for slots in the current database (`stage_e_slot_waiters` adds session
/// columns), with the fair share each waits in: position 1 is the head of its cap's queue.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_slot_waiters_internal")]
#[allow(clippy::type_complexity)]
fn stage_e_slot_waiters_internal_v2() -> TableIterator<
    'static,
    (
        name!(cap, Text),
        name!(pid, i32),
        name!(n, i32),
        name!(k, i32),
        name!(waiting_since, Option<TimestampWithTimeZone>),
        name!(position, i32),
        name!(share, Option<Text>),
    ),
> {
    let _call = crate::report::calling("stage_e_slot_waiters_internal");
    let rows = slots::waiters().unwrap_or_else(|e| raise(e));
    TableIterator::new(rows.into_iter().map(|w| {
        let since = TimestampWithTimeZone::try_from(w.since).ok();
        (
            Text(w.cap),
            w.pid,
            w.n as i32,
            w.k as i32,
            since,
            w.position as i32,
            w.share.map(Text),
        )
    }))
}

/// Per cap, the slots held and the throttles per minute, averaged over 1, 5 and 15 minutes
/// from the launcher's samples (`stage_e_cap_load` shows them).
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_cap_load_internal() -> TableIterator<
    'static,
    (
        name!(cap, Text),
        name!(held_1m, f64),
        name!(held_5m, f64),
        name!(held_15m, f64),
        name!(throttled_per_min_1m, f64),
        name!(throttled_per_min_5m, f64),
        name!(throttled_per_min_15m, f64),
    ),
> {
    let _call = crate::report::calling("stage_e_cap_load_internal");
    let rows = slots::load().unwrap_or_else(|e| raise(e));
    TableIterator::new(rows.into_iter().map(|l| {
        let [h1, h5, h15] = l.held;
        let [t1, t5, t15] = l.throttles_per_min;
        (Text(l.cap), h1, h5, h15, t1, t5, t15)
    }))
}
