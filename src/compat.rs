//! Functions of earlier versions whose result changed shape since. A database created at an
//! earlier version keeps calling them by their C symbols until it runs `ALTER EXTENSION
//! stage_e_slots UPDATE`, so they stay in the library, answering as that version did. They are
//! not part of a fresh install (`sql = false`); functions whose shape did not change share their
//! symbols with the current version (`api`). What each version's objects have (counters, named
//! caps, lease columns) is `stage_e_core::version::SchemaVersion`; which symbol serves whom:
//!
//! | SQL function                     | C symbol (`…_wrapper`)               | versions     |
//! |----------------------------------|--------------------------------------|--------------|
//! | `stage_e_stats()`                | `stage_e_stats`                      | 0.1.0        |
//! |                                  | `stage_e_stats_v2`                   | 0.2.0        |
//! |                                  | `stage_e_stats_v3`                   | 0.3.0        |
//! |                                  | `stage_e_stats_v4`                   | 0.4.0–0.7.0  |
//! |                                  | `stage_e_stats_v5`                   | 0.8.0, 0.9.0 |
//! | `stage_e_slot_holders_internal()`| `stage_e_slot_holders_internal`      | 0.1.0        |
//! |                                  | `stage_e_slot_holders_internal_v2`   | 0.2.0, 0.3.0 |
//! |                                  | `stage_e_slot_holders_internal_v3`   | 0.4.0–0.10.0 |
//! | `stage_e_slot_waiters_internal()`| `stage_e_slot_waiters_internal`      | 0.3.0–0.10.0 |
//! | `stage_e_flush()`                | `stage_e_flush`                      | 0.1.0        |
//! |                                  | `stage_e_flush_v2`                   | 0.2.0        |
//! |                                  | `stage_e_flush_v3`                   | 0.3.0        |
//! |                                  | `stage_e_flush_v4`                   | 0.4.0–0.9.0  |
//! | `stage_e_pending(bigint)`        | `stage_e_pending`                    | 0.1.0        |
//! |                                  | `stage_e_pending_v2`                 | 0.2.0        |
//! |                                  | `stage_e_pending_v3`                 | 0.3.0        |
//! |                                  | `stage_e_pending_v4`                 | 0.4.0–0.9.0  |
//! | `stage_e_snapshot()`             | `stage_e_snapshot`                   | 0.1.0        |
//! | `stage_e_try_slot(int, interval)`| `stage_e_try_slot_wait`              | 0.3.0, 0.4.0 |
//!
//! The 0.1.0 functions answer for the cap `default` only (0.1.0 had one anonymous cap). 0.5.0
//! retired `stage_e_try_slot(n integer, wait interval)`: with two untyped parameters it tied
//! with `stage_e_try_slot(cap text, n integer)`.

use crate::api::{self, CurrentN};
use crate::errors::{raise, raise_flush};
use crate::flush::{self, Write};
use crate::gucs;
use crate::names::{Json, Text};
use crate::report::raise_internal;
use crate::slots;
use pgrx::datetime::TimestampWithTimeZone;
use pgrx::prelude::*;
use serde_json::json;
use stage_e_core::counters::CounterValues;
use stage_e_core::directory::DEFAULT_CAP;
use stage_e_core::{for_each_counter_0_2_0, for_each_counter_0_3_0, for_each_counter_0_9_0};

fn default_of(rows: Vec<(String, CounterValues)>) -> CounterValues {
    rows.into_iter()
        .find(|(c, _)| c == DEFAULT_CAP)
        .map(|(_, v)| v)
        .unwrap_or_default()
}

// -- 0.1.0: one anonymous cap, five counters ---------------------------------------------------

for_each_counter_0_2_0!(counter_table_fn,
    #[pg_extern(sql = false)]
    fn stage_e_stats() -> (max_slots: i32, held: i32) {
        let _call = crate::report::calling("stage_e_stats");
        let stats = slots::stats().unwrap_or_else(|e| raise(e));
        let counts = stats
            .iter()
            .find(|s| s.cap == DEFAULT_CAP)
            .map(|s| s.counts)
            .unwrap_or_default();
        let held = slots::holders()
            .unwrap_or_else(|e| raise(e))
            .iter()
            .filter(|h| h.cap == DEFAULT_CAP)
            .count() as i32;
        vec![((gucs::max_slots() as i32, held), counts)]
    }
);

#[pg_extern(sql = false)]
fn stage_e_slot_holders_internal() -> TableIterator<
    'static,
    (
        name!(slot, i32),
        name!(pid, i32),
        name!(acquired_at, Option<TimestampWithTimeZone>),
    ),
> {
    let _call = crate::report::calling("stage_e_slot_holders_internal");
    let rows = slots::holders().unwrap_or_else(|e| raise(e));
    TableIterator::new(rows.into_iter().filter(|h| h.cap == DEFAULT_CAP).map(|h| {
        let at = h
            .acquired_at
            .and_then(|t| TimestampWithTimeZone::try_from(t).ok());
        (h.slot as i32, h.pid, at)
    }))
}

for_each_counter_0_2_0!(
    counter_table_fn,
    #[pg_extern(sql = false)]
    fn stage_e_flush() -> () {
        let _call = crate::report::calling("stage_e_flush");
        slots::ready().unwrap_or_else(|e| raise(e));
        crate::hooks::ensure();
        let added = flush::flush(Write::Add, Some(DEFAULT_CAP), true)
            .unwrap_or_else(|e| raise_flush(e))
            .unwrap_or_default();
        vec![((), default_of(added))]
    }
);

for_each_counter_0_2_0!(
    counter_table_fn,
    #[pg_extern(sql = false)]
    fn stage_e_pending(row_flush_id: default!(Option<i64>, "NULL")) -> () {
        let _call = crate::report::calling("stage_e_pending");
        slots::attached().unwrap_or_else(|e| raise(e));
        vec![((), default_of(flush::pending(row_flush_id)))]
    }
);

/// 0.1.0's document: the `default` cap's counts at the top level.
#[pg_extern(sql = false)]
fn stage_e_snapshot() -> Json {
    let _call = crate::report::calling("stage_e_snapshot");
    let doc = crate::api::snapshot_document();
    let cap = doc["caps"]
        .as_array()
        .and_then(|caps| caps.iter().find(|c| c["cap"] == DEFAULT_CAP).cloned())
        .unwrap_or_else(|| {
            let zero = serde_json::to_value(CounterValues::default()).unwrap_or_default();
            json!({"totals": zero, "flushed": zero, "pending": zero, "flushed_at": null})
        });
    let holders: Vec<serde_json::Value> = doc["holders"]
        .as_array()
        .map(|h| {
            h.iter()
                .filter(|h| h["cap"] == DEFAULT_CAP)
                .map(|h| {
                    json!({"slot": h["slot"], "pid": h["pid"], "acquired_at": h["acquired_at"],
                           "application_name": h["application_name"], "state": h["state"]})
                })
                .collect()
        })
        .unwrap_or_default();
    let config = &doc["config"];
    let out = json!({
        "database": doc["database"],
        "config": {"max_slots": config["max_slots"], "lock_key": config["lock_key"],
                   "flush_interval_ms": config["flush_interval_ms"]},
        "totals": cap["totals"], "flushed": cap["flushed"], "flushed_at": cap["flushed_at"],
        "pending": cap["pending"], "held": holders.len(), "holders": holders,
    });
    if out.is_null() {
        raise_internal("could not build the snapshot".into());
    }
    Json(out)
}

// -- 0.2.0: named caps, five counters ---------------------------------------------------------

for_each_counter_0_2_0!(counter_table_fn,
    #[pg_extern(sql = false)]
    fn stage_e_stats_v2() -> (cap: Text, max_slots: i32, held: i32) {
        let _call = crate::report::calling("stage_e_stats");
        api::stats_rows()
    }
);

for_each_counter_0_2_0!(counter_table_fn,
    #[pg_extern(sql = false)]
    fn stage_e_flush_v2() -> (cap: Text) {
        let _call = crate::report::calling("stage_e_flush");
        api::flush_rows()
    }
);

for_each_counter_0_2_0!(counter_table_fn,
    #[pg_extern(sql = false)]
    fn stage_e_pending_v2(row_flush_id: default!(Option<i64>, "NULL")) -> (cap: Text) {
        let _call = crate::report::calling("stage_e_pending");
        api::pending_rows(row_flush_id)
    }
);

// -- 0.3.0: nine counters (no `expired`), holders without token and expiry ---------------------

// Their rows are today's (`api`), shown with 0.3.0's counters only.
for_each_counter_0_3_0!(counter_table_fn,
    #[pg_extern(sql = false)]
    fn stage_e_stats_v3() -> (cap: Text, max_slots: i32, held: i32) {
        let _call = crate::report::calling("stage_e_stats");
        api::stats_rows()
    }
);

for_each_counter_0_3_0!(counter_table_fn,
    #[pg_extern(sql = false)]
    fn stage_e_flush_v3() -> (cap: Text) {
        let _call = crate::report::calling("stage_e_flush");
        api::flush_rows()
    }
);

for_each_counter_0_3_0!(counter_table_fn,
    #[pg_extern(sql = false)]
    fn stage_e_pending_v3(row_flush_id: default!(Option<i64>, "NULL")) -> (cap: Text) {
        let _call = crate::report::calling("stage_e_pending");
        api::pending_rows(row_flush_id)
    }
);

// -- 0.4.0 to 0.7.0: stats without the cap's current n ---------------------------------------

for_each_counter_0_9_0!(counter_table_fn,
    #[pg_extern(sql = false)]
    fn stage_e_stats_v4() -> (cap: Text, max_slots: i32, held: i32) {
        let _call = crate::report::calling("stage_e_stats");
        api::stats_rows()
    }
);

// -- 0.4.0 to 0.9.0: ten counters (no `rate_limited`); 0.8.0 and 0.9.0's stats with n --------

for_each_counter_0_9_0!(counter_table_fn,
    #[pg_extern(sql = false)]
    fn stage_e_stats_v5() -> (cap: Text, max_slots: i32, held: i32, n: CurrentN) {
        let _call = crate::report::calling("stage_e_stats");
        api::stats_rows_with_n()
    }
);

for_each_counter_0_9_0!(counter_table_fn,
    #[pg_extern(sql = false)]
    fn stage_e_flush_v4() -> (cap: Text) {
        let _call = crate::report::calling("stage_e_flush");
        api::flush_rows()
    }
);

for_each_counter_0_9_0!(counter_table_fn,
    #[pg_extern(sql = false)]
    fn stage_e_pending_v4(row_flush_id: default!(Option<i64>, "NULL")) -> (cap: Text) {
        let _call = crate::report::calling("stage_e_pending");
        api::pending_rows(row_flush_id)
    }
);

#[pg_extern(sql = false)]
fn stage_e_slot_holders_internal_v2() -> TableIterator<
    'static,
    (
        name!(cap, Text),
        name!(slot, i32),
        name!(pid, i32),
        name!(acquired_at, Option<TimestampWithTimeZone>),
    ),
> {
    let _call = crate::report::calling("stage_e_slot_holders_internal");
    let rows = slots::holders().unwrap_or_else(|e| raise(e));
    TableIterator::new(rows.into_iter().map(|h| {
        let at = h
            .acquired_at
            .and_then(|t| TimestampWithTimeZone::try_from(t).ok());
        (Text(h.cap), h.slot as i32, h.pid, at)
    }))
}

// -- 0.3.0 and 0.4.0: the cap-less waiting form, retired in 0.5.0 ------------------------------

/// `stage_e_try_slot(n integer, wait interval)`: a slot of the cap `default`, waiting up to
/// `wait`. 0.5.0 drops it (`stage_e_try_slot('default', n, wait)` replaces it); its symbol
/// (`stage_e_try_slot_wait_wrapper`) stays for databases not yet updated.
#[pg_extern(sql = false)]
fn stage_e_try_slot_wait(n: Option<i32>, wait: Option<Interval>) -> Option<i32> {
    let _call = crate::report::calling("stage_e_try_slot");
    api::slots::try_slots(Some(DEFAULT_CAP), n, Some(1), wait, None).map(|s| s[0])
}

// -- 0.4.0 to 0.10.0: holders and waiters without their fair share --------------------------

/// Held slots of the current database (lock manager truth) and leases (with their token and
/// expiry); the view adds session columns.
#[pg_extern(sql = false)]
#[allow(clippy::type_complexity)]
fn stage_e_slot_holders_internal_v3() -> TableIterator<
    'static,
    (
        name!(cap, Text),
        name!(slot, i32),
        name!(pid, i32),
        name!(acquired_at, Option<TimestampWithTimeZone>),
        name!(token, Option<i64>),
        name!(expires_at, Option<TimestampWithTimeZone>),
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
        )
    }))
}

/// Sessions waiting for slots in the current database (`stage_e_slot_waiters` adds session
/// columns): position 1 is the head of its cap's queue.
#[pg_extern(sql = false)]
fn stage_e_slot_waiters_internal() -> TableIterator<
    'static,
    (
        name!(cap, Text),
        name!(pid, i32),
        name!(n, i32),
        name!(k, i32),
        name!(waiting_since, Option<TimestampWithTimeZone>),
        name!(position, i32),
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
        )
    }))
}
