//! Making the counters durable: each cap's pending counts are added to its row of
//! `stage_e_throttle_counter` (one row per cap, keyed by name) in one committed transaction, by
//! the background flusher (see `worker`) or by `stage_e_flush()`. One statement per database
//! and flush, writing only the caps with new counts.
//!
//! Exactly once: a flush takes each cap's flusher role, reads its bookkeeping, writes the
//! deltas in its transaction and marks each cap's in-flight delta with the flush id it also
//! writes into the rows. Only when that transaction commits does a cap advance (`hooks`'
//! transaction-end hook); if it aborts, the deltas simply stay pending.
//!
//! Savepoints: a flush made in a subtransaction is settled when that subtransaction aborts
//! (`ROLLBACK TO`, a PL/pgSQL EXCEPTION block): the row changes are undone, so the deltas are
//! pending again. If the subtransaction commits, the flush belongs to its parent.
//!
//! A database still at version 0.1.0 (its library updated, `ALTER EXTENSION UPDATE` not yet
//! run) has the old one-row table: its `default` cap is written there, as 0.1.0 did.

use crate::failures::SlotError;
use crate::names::Text;
use crate::session;
use crate::shmem::{self, Cap, Flushed};
use crate::sql::{self, Extension};
use stage_e_core::counters::CounterValues;
use stage_e_core::directory::DEFAULT_CAP;
use stage_e_core::histogram::{HistValues, Metric};

#[derive(Debug)]
pub enum FlushError {
    Slots(SlotError),
    /// This transaction already flushed: a second flush would wait for itself.
    AgainInThisTransaction,
    /// SPI refused the statement (not an ERROR, which propagates as one).
    Spi(pgrx::spi::Error),
}

impl From<SlotError> for FlushError {
    fn from(e: SlotError) -> Self {
        FlushError::Slots(e)
    }
}

/// What a flush writes into the rows.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Write {
    /// Add the pending counts (stage_e_flush, the background flusher).
    Add,
    /// Zero the rows and drop the pending counts (stage_e_reset_stats).
    Reset,
}

/// Flushes (or resets) the current database's caps (or only `only`) in the current
/// transaction. Returns the counts written per cap, or None when the extension is not
/// installed here. With `wait`, waits for another process's flush of a cap to end; without,
/// leaves that cap to it. The caller registers the transaction-end hooks first
/// (`hooks::ensure`): they settle the flush, whichever way the transaction ends.
pub fn flush(
    write: Write,
    only: Option<&str>,
    wait: bool,
) -> Result<Option<Vec<(String, CounterValues)>>, FlushError> {
    let Some(ext) = sql::extension() else {
        return Ok(None);
    };
    if session::flushing() {
        return Err(FlushError::AgainInThisTransaction);
    }
    let me = session::pid();
    let mut taken = Vec::new();
    for r in shmem::cap_refs(session::database()) {
        // Pinned only while taking the role (a flush must not keep creators from reclaiming
        // other caps); the role then keeps the cap from being reclaimed.
        let Some((role, name, key)) = shmem::pin(r).and_then(|cap| {
            let (name, key) = (cap.name(), cap.key());
            let skip = only.is_some_and(|o| o != name)
                || (!ext.version.has_named_caps() && name != DEFAULT_CAP);
            if skip {
                return None;
            }
            become_flusher(&cap, me, wait).map(|role| (role, name, key))
        }) else {
            continue;
        };
        let read = role.flush_state();
        let delta = read.pending(None);
        // (A table without histograms, before 0.8.0, drops theirs at the commit.)
        let nothing =
            delta.is_zero() && (read.pending_hist().is_zero() || !ext.version.has_histograms());
        if write == Write::Add && nothing {
            role.abort(); // nothing new: give the role back, write no row
            continue;
        }
        taken.push((role, (name, key), read, delta));
    }
    let id = shmem::next_flush_id(session::statement_start().max(0) as u64);
    for (role, _, _, delta) in &taken {
        role.set_inflight(id, *delta);
    }
    let keys: Vec<i32> = taken.iter().map(|(_, (_, key), _, _)| *key).collect();
    let hists: Vec<HistValues> = taken
        .iter()
        .map(|(_, _, read, _)| read.pending_hist())
        .collect();
    // From here on the transaction's end settles the flush, whichever way it ends (the
    // caller registered the hooks that do: `hooks::ensure`).
    let written: Vec<(String, CounterValues)> = taken
        .iter()
        .map(|(_, (name, _), _, delta)| (name.clone(), *delta))
        .collect();
    session::flush_started(
        taken
            .into_iter()
            .map(|(role, _, read, _)| (role, read))
            .collect(),
    );
    match write {
        Write::Add if !written.is_empty() => add(&ext, &written, &keys, &hists, id)?,
        Write::Add => {}
        Write::Reset => reset(&ext, only, id)?,
    }
    Ok(Some(written))
}

/// The cap's flusher role, waiting for another process's flush to end with `wait`.
fn become_flusher(cap: &Cap, me: i32, wait: bool) -> Option<Flushed> {
    loop {
        if let Some(role) = cap.begin_flush(me) {
            return Some(role);
        }
        if !wait {
            return None;
        }
        session::nap_ms(10);
    }
}

/// One statement adding every cap's delta to its row (`sql::counter_add_query`). Only the
/// counter columns the database's table has are written (`SchemaVersion::counter_columns`),
/// since 0.7.0 each cap's lock key (`keys`, in the order of `deltas`), which `keys` reads
/// back, and since 0.8.0 its histograms' deltas (`hists`, likewise).
fn add(
    ext: &Extension,
    deltas: &[(String, CounterValues)],
    keys: &[i32],
    hists: &[HistValues],
    id: u64,
) -> Result<(), FlushError> {
    let n = ext.version.counter_columns();
    let query = sql::counter_add_query(ext);
    let id = id as i64;
    let args: Vec<pgrx::datum::DatumWithOid> = if !ext.version.has_named_caps() {
        let v = deltas[0].1.to_array();
        let mut args: Vec<pgrx::datum::DatumWithOid> = (0..n)
            .map(|i| {
                if CounterValues::is_time(i) {
                    sql::interval_us(v[i]).into()
                } else {
                    (v[i] as i64).into()
                }
            })
            .collect();
        args.push(id.into());
        args
    } else {
        let caps: Vec<Text> = deltas.iter().map(|(c, _)| Text(c.clone())).collect();
        let mut args: Vec<pgrx::datum::DatumWithOid> = vec![caps.into()];
        for i in 0..n {
            if CounterValues::is_time(i) {
                let col: Vec<pgrx::prelude::Interval> = deltas
                    .iter()
                    .map(|(_, v)| sql::interval_us(v.to_array()[i]))
                    .collect();
                args.push(col.into());
            } else {
                let col: Vec<i64> = deltas.iter().map(|(_, v)| v.to_array()[i] as i64).collect();
                args.push(col.into());
            }
        }
        args.push(id.into());
        if ext.version.has_key_records() {
            args.push(keys.to_vec().into());
        }
        if ext.version.has_histograms() {
            for metric in Metric::ALL {
                let flat: Vec<i64> = hists
                    .iter()
                    .flat_map(|h| h.of(metric))
                    .map(|v| v as i64)
                    .collect();
                args.push(flat.into());
            }
        }
        args
    };
    sql::write(&query, &args).map_err(FlushError::Spi)
}

/// Zeroes the rows (all, or `only`'s; a database at 0.1.0 has one).
fn reset(ext: &Extension, only: Option<&str>, id: u64) -> Result<(), FlushError> {
    let id = id as i64;
    let result = match only {
        Some(cap) if ext.version.has_named_caps() => sql::write(
            &sql::counter_reset_query(ext, true),
            &[id.into(), Text(cap.to_string()).into()],
        ),
        _ => sql::write(&sql::counter_reset_query(ext, false), &[id.into()]),
    };
    result.map_err(FlushError::Spi)
}

/// Pending counts of the current database's caps, as seen by a reader whose newest row has
/// flush id `row_flush_id` (the totals view passes it: a flush that reader already sees is
/// not counted twice). One entry per cap in use, zeros included.
pub fn pending(row_flush_id: Option<i64>) -> Vec<(String, CounterValues)> {
    let mut out: Vec<(String, CounterValues)> = shmem::caps(Some(session::database()))
        .into_iter()
        .map(|cap| {
            let p = cap.flush_state().pending(row_flush_id.map(|id| id as u64));
            (cap.name(), p)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Drops the pending counts of database `db`'s caps (its extension is gone, and the table with
/// it; or its flush kept failing: the launcher's give-up). A cap another process is flushing is
/// left to that flush. Returns how many caps had some, and their sum.
pub fn discard_pending(db: u32) -> (usize, CounterValues) {
    let me = session::pid();
    let mut dropped = 0;
    let mut sum = CounterValues::default();
    for r in shmem::cap_refs(db) {
        let Some(role) = shmem::pin(r).and_then(|cap| cap.begin_flush(me)) else {
            continue;
        };
        let read = role.flush_state();
        let pending = read.pending(None);
        if !pending.is_zero() {
            dropped += 1;
            sum = sum.plus(pending);
        }
        // As a committed flush of what was read: later counts stay pending.
        role.commit(&read);
    }
    (dropped, sum)
}

/// At most this many counter rows are deleted per database and round by the retention rule.
pub const RETENTION_BATCH: i64 = 10_000;

/// The retention rule (`stage_e_slots.counter_retention`), in the flusher's transaction: deletes
/// the counter rows of caps unused for longer than `retention` (flushed before, and not in use
/// in shared memory now: no held slot, lease, waiter, hold, flush or pending count), at most
/// [`RETENTION_BATCH`], and their lease horizon rows whose horizon has passed. `keep` are caps
/// this transaction wrote a horizon for. Returns (counter rows, horizon rows) deleted.
///
/// A cap that comes into use while the statement runs may lose its old row (its history older
/// than the retention): its new counts are flushed into a fresh row, none is lost.
pub fn expire(
    ext: &Extension,
    retention: std::time::Duration,
    keep: Vec<String>,
) -> Result<(i64, i64), pgrx::spi::Error> {
    if !ext.version.has_named_caps() {
        return Ok((0, 0)); // 0.1.0's one row
    }
    let mut busy = shmem::busy_caps(session::database());
    busy.extend(keep);
    let query = sql::retention_query(ext);
    let args: Vec<pgrx::datum::DatumWithOid> = vec![
        sql::interval_us(retention.as_micros() as u64).into(),
        busy.into_iter().map(Text).collect::<Vec<_>>().into(),
        RETENTION_BATCH.into(),
    ];
    sql::write_returning(&query, &args, |rows| {
        let row = rows.first();
        Ok((
            row.get::<i64>(1)?.unwrap_or(0),
            row.get::<i64>(2)?.unwrap_or(0),
        ))
    })
}
