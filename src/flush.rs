//! Making the counters durable: each database's pending counts are added to its one-row table
//! `stage_e_throttle_counter` in one committed transaction, by the background flusher (see
//! `worker`) or by `stage_e_flush()`.
//!
//! Exactly once: a flush reads the pool's bookkeeping, writes the delta in its transaction and
//! marks the pool's in-flight delta with the flush id it also writes into the row. Only when
//! that transaction commits does the pool advance (`session`'s transaction-end hook calls
//! [`Pool::commit_flush`]); if it aborts, the delta simply stays pending. One flusher per pool
//! at a time (a pid in shared memory), so two flushes never take the same delta.
//!
//! Savepoints: a flush made in a subtransaction is settled when that subtransaction aborts
//! (`ROLLBACK TO`, a PL/pgSQL EXCEPTION block): the row change is undone, so the delta is pending
//! again. If the subtransaction commits, the flush belongs to its parent and is settled there.

use crate::counters::CounterValues;
use crate::session;
use crate::shmem::Pool;
use crate::slots::{self, SlotError};
use crate::sql;

#[derive(Debug)]
pub enum FlushError {
    Slots(SlotError),
    /// Another process is flushing this database and the caller chose not to wait.
    Busy,
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

/// What a flush writes into the row.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Write {
    /// Add the pending counts (stage_e_flush, the background flusher).
    Add,
    /// Zero the row and drop the pending counts (stage_e_reset_stats).
    Reset,
}

/// Flushes (or resets) the current database in the current transaction. Returns the counts
/// written, or None when the extension is not installed here. With `wait`, waits for another
/// process's flush of this database to end; without, returns `Busy`.
pub fn flush(write: Write, wait: bool) -> Result<Option<CounterValues>, FlushError> {
    let Some(schema) = sql::extension_schema() else {
        return Ok(None);
    };
    let Some(pool) = slots::pool_of_this_database()? else {
        // No activity since server start: nothing is pending. A reset still zeroes the row.
        if write == Write::Reset {
            upsert(&schema, write, CounterValues::default(), 0)?;
        }
        return Ok(Some(CounterValues::default()));
    };
    become_flusher(pool, wait)?;
    let read = pool.flush_state();
    let delta = read.pending(None);
    let id = pool.next_flush_id(session::statement_start().max(0) as u64);
    // From here on the transaction's end settles the flush, whichever way it ends.
    session::flush_started(pool, read);
    pool.set_inflight(id, delta);
    upsert(&schema, write, delta, id)?;
    Ok(Some(delta))
}

fn become_flusher(pool: Pool, wait: bool) -> Result<(), FlushError> {
    let me = session::pid();
    loop {
        if pool.try_begin_flush(me) {
            return Ok(());
        }
        match pool.flusher() {
            Some(pid) if pid == me => return Err(FlushError::AgainInThisTransaction),
            Some(_) if !wait => return Err(FlushError::Busy),
            _ => session::nap_ms(10),
        }
    }
}

fn upsert(schema: &str, write: Write, delta: CounterValues, id: u64) -> Result<(), FlushError> {
    let set = match write {
        Write::Add => CounterValues::NAMES
            .iter()
            .map(|c| format!("{c} = t.{c} OPERATOR(pg_catalog.+) excluded.{c}"))
            .collect::<Vec<_>>(),
        Write::Reset => CounterValues::NAMES
            .iter()
            .map(|c| format!("{c} = 0"))
            .collect(),
    };
    let query = format!(
        "INSERT INTO {schema}.stage_e_throttle_counter AS t \
           (id, {cols}, flushed_at, flush_id) \
         VALUES (true, $1, $2, $3, $4, $5, pg_catalog.now(), $6) \
         ON CONFLICT (id) DO UPDATE SET {set}, flushed_at = excluded.flushed_at, \
           flush_id = excluded.flush_id",
        cols = CounterValues::NAMES.join(", "),
        set = set.join(", "),
    );
    let v = match write {
        Write::Add => delta.to_array().map(|x| x as i64),
        Write::Reset => [0; 5],
    };
    sql::write(
        &query,
        &[
            v[0].into(),
            v[1].into(),
            v[2].into(),
            v[3].into(),
            v[4].into(),
            (id as i64).into(),
        ],
    )
    .map_err(FlushError::Spi)
}

/// Pending counts of the current database, as seen by a reader of the row with `row_flush_id`.
pub fn pending(row_flush_id: Option<i64>) -> Result<CounterValues, SlotError> {
    Ok(slots::pool_of_this_database()?
        .map(|p| p.flush_state().pending(row_flush_id.map(|id| id as u64)))
        .unwrap_or_default())
}

/// Drops a pool's pending counts (its database or its extension is gone). False if busy.
pub fn discard_pending(pool: Pool) -> bool {
    if !pool.try_begin_flush(session::pid()) {
        return false;
    }
    let read = pool.flush_state();
    pool.commit_flush(&read);
    true
}
