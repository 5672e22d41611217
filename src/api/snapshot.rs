//! `stage_e_snapshot()`: configuration, per-cap totals and pending counts, and current holders
//! as one jsonb document, for monitoring agents.

use crate::errors::{raise, raise_not_installed};
use crate::flush;
use crate::gucs;
use crate::names::{Json, Text};
use crate::report::raise_internal;
use crate::shmem;
use crate::slots;
use crate::sql;
use pgrx::prelude::*;
use serde::Serialize;
use stage_e_core::counters::{CounterValues, COUNT};
use std::collections::HashMap;

/// At most this many caps in the document: the busiest (most held, then most throttled), so
/// that a database with any number of counter rows gets a document of bounded size (far below
/// jsonb's limit), built in time linear in its rows.
pub const MAX_CAPS: usize = 1_000;

/// A cap's counter row (its index), pending counts and held slots, joined by name.
#[derive(Default, Clone, Copy)]
struct Joined {
    row: Option<usize>,
    pending: CounterValues,
    held: u32,
    /// The live cap's key.
    key: Option<i32>,
}

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
    /// How many caps the database has (a counter row, or in use); `caps` has at most
    /// [`MAX_CAPS`] of them, and `truncated` says it left some out.
    caps_total: usize,
    truncated: bool,
    caps: Vec<SnapshotCap>,
    holders: Vec<SnapshotHolder>,
}

/// Configuration, per-cap totals and pending counts, and current holders as one jsonb
/// document, for monitoring agents (postgres_exporter custom queries, Grafana).
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_snapshot")]
fn stage_e_snapshot_v2() -> Json {
    let _call = crate::report::calling("stage_e_snapshot");
    Json(snapshot_document())
}

/// The snapshot document (also behind 0.1.0's `stage_e_snapshot`, see `compat`).
pub fn snapshot_document() -> serde_json::Value {
    let stats = slots::stats().unwrap_or_else(|e| raise(e));
    let Some(ext) = sql::extension() else {
        raise_not_installed()
    };
    let read = sql::read(|c| {
        let n = ext.version.counter_columns();
        let rows = c
            .select(&sql::counter_rows_query(&ext), None, &[])?
            .map(|row| {
                let mut v = [0u64; COUNT];
                for (i, x) in v.iter_mut().enumerate().take(n) {
                    *x = row.get::<i64>(i + 2)?.unwrap_or(0) as u64;
                }
                Ok((
                    String::from(row.get::<Text>(1)?.unwrap_or_default()),
                    CounterValues::from_array(v),
                    row.get::<Text>(n + 2)?.map(String::from),
                    row.get::<i64>(n + 3)?.unwrap_or(0),
                    row.get::<i32>(n + 4)?,
                ))
            })
            .collect::<Result<Vec<_>, pgrx::spi::Error>>()?;
        let holders = c
            .select(&sql::holders_query(&ext), None, &[])?
            .map(|r| {
                Ok(SnapshotHolder {
                    cap: r.get::<Text>(1)?.unwrap_or_default().0,
                    slot: r.get::<i32>(2)?.unwrap_or_default(),
                    pid: r.get::<i32>(3)?.unwrap_or_default(),
                    acquired_at: r.get::<Text>(4)?.map(String::from),
                    application_name: r.get::<Text>(5)?.map(String::from),
                    state: r.get::<Text>(6)?.map(String::from),
                    token: r.get::<i64>(7)?,
                    expires_at: r.get::<Text>(8)?.map(String::from),
                })
            })
            .collect::<Result<Vec<_>, pgrx::spi::Error>>()?;
        Ok((rows, holders))
    });
    let (rows, holders) = read.unwrap_or_else(|e| raise_internal(format!("{e}")));
    let newest = rows.iter().map(|r| r.3).max();
    let pending = flush::pending(newest);
    // One map from name to (row, pending, held): linear in rows, whatever their number.
    let mut by_name: HashMap<&str, Joined> = HashMap::with_capacity(rows.len() + pending.len());
    for (i, r) in rows.iter().enumerate() {
        by_name.entry(&r.0).or_default().row = Some(i);
    }
    for (name, p) in &pending {
        by_name.entry(name).or_default().pending = *p;
    }
    for s in &stats {
        if let Some(j) = by_name.get_mut(s.cap.as_str()) {
            j.held = s.held;
            j.key = Some(s.key);
        }
    }
    let caps_total = by_name.len();
    let mut chosen: Vec<(&str, Joined)> = by_name.into_iter().collect();
    let truncated = chosen.len() > MAX_CAPS;
    if truncated {
        // The busiest: most held, then most throttled (flushed + pending), then by name.
        let throttled = |j: &Joined| j.row.map_or(0, |i| rows[i].1.throttled) + j.pending.throttled;
        chosen.select_nth_unstable_by(MAX_CAPS - 1, |a, b| {
            b.1.held
                .cmp(&a.1.held)
                .then_with(|| throttled(&b.1).cmp(&throttled(&a.1)))
                .then_with(|| a.0.cmp(b.0))
        });
        chosen.truncate(MAX_CAPS);
    }
    chosen.sort_unstable_by(|a, b| a.0.cmp(b.0));
    let caps = chosen
        .into_iter()
        .map(|(cap, j)| {
            let row = j.row.map(|i| &rows[i]);
            let flushed = row.map(|r| r.1).unwrap_or_default();
            SnapshotCap {
                // The live cap's key, else the one its row records (see src/keys.rs).
                key: j
                    .key
                    .or(row.and_then(|r| r.4))
                    .unwrap_or_else(|| shmem::first_key(cap)),
                held: j.held,
                totals: flushed.plus(j.pending),
                flushed,
                flushed_at: row.and_then(|r| r.2.clone()),
                pending: j.pending,
                cap: cap.to_string(),
            }
        })
        .collect();
    let usage = shmem::usage();
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
            caps_in_use: usage.caps,
            max_caps: usage.max_caps,
            slot_pages_free: usage.free_pages,
            slot_pages: usage.pages,
        },
        held: holders.len() as u32,
        caps_total,
        truncated,
        caps,
        holders,
    };
    serde_json::to_value(snapshot)
        .unwrap_or_else(|e| raise_internal(format!("could not build the snapshot: {e}")))
}
