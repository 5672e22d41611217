//! `stage_e_snapshot()`: configuration, per-cap totals and pending counts, and current holders
//! as one jsonb document, for monitoring agents.

use crate::errors::{raise, raise_internal, raise_not_installed};
use crate::flush;
use crate::gucs;
use crate::shmem;
use crate::slots;
use crate::sql;
use pgrx::prelude::*;
use serde::Serialize;
use stage_e_core::counters::{CounterValues, COUNT};

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
                    row.get::<String>(1)?.unwrap_or_default(),
                    CounterValues::from_array(v),
                    row.get::<String>(n + 2)?,
                    row.get::<i64>(n + 3)?.unwrap_or(0),
                ))
            })
            .collect::<Result<Vec<_>, pgrx::spi::Error>>()?;
        let holders = c
            .select(&sql::holders_query(&ext), None, &[])?
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
        caps,
        holders,
    };
    serde_json::to_value(snapshot)
        .unwrap_or_else(|e| raise_internal(format!("could not build the snapshot: {e}")))
}
