//! A cap's counters, and the flush bookkeeping that makes them durable exactly once.
//!
//! **Hot counters.** One relaxed atomic per counter (`stage_e_core::counters::Counter`), bumped
//! by every call: each is an independent monotonic tally, read only to report and to flush.
//! They share their cache lines with the other fields that change as slots are taken (the
//! fencing token and the lease fields, `leases`), away from the fields every call only reads.
//!
//! **Flush seqlock.** The carried, flushed and in-flight counts and the flush ids change only in
//! the process that holds the cap's flusher role (taken by `flush`), as one seqlock write;
//! readers ([`CapEntry::flush_state`]) retry until they read one consistent state. The protocol
//! and its orderings are `stage_e_core::flush` (`FlushBook`, model-checked there); this file
//! only places the book in the entry and adds the histograms, which are not under the seqlock
//! (only the flusher moves their base: `histograms`). A cap whose role is held is never
//! reclaimed, so the role needs no pin.
//!
//! **Restart.** When its database's extension is dropped, a cap's counts and histograms restart
//! at zero, their pending counts with them (`stage_e_core::flush`, "Restart"), made by the
//! holder of the role: the dropping backend if the role is free, else the process holding it,
//! as it gives the role back ([`CapEntry::end_flush`], the one way the role is given back):
//! nothing counted before the drop reaches the new extension's table.

use super::entry::CapEntry;
use super::Cap;
use stage_e_core::counters::{CounterValues, FlushState};
use stage_e_core::flush::Counters;
use stage_e_core::histogram::HistValues;

impl CapEntry {
    /// The flush bookkeeping, read consistently (the histograms inside the same read).
    pub(super) fn flush_state(&self) -> FlushState {
        self.flush.read(&self.counters.counts, || {
            (self.hist.counts(), self.hist.base())
        })
    }

    /// Adds counts saved at the last clean shutdown (`persist`).
    pub(super) fn carry(&self, v: CounterValues, hist: HistValues) {
        self.flush.carry(v);
        self.hist.carry(hist);
    }

    /// Counts not yet in the table.
    pub(super) fn pending(&self) -> CounterValues {
        self.flush_state().pending(None)
    }

    /// Gives the flusher role back, making any restart asked for meanwhile first.
    fn end_flush(&self) {
        while self.flush.end() {
            self.flush
                .restart(&self.counters.counts, || self.hist.restart());
        }
    }

    /// Under the exclusive directory lock, reclaiming: every count back to zero.
    pub(super) fn clear_counters(&self) {
        self.flush.clear(&self.counters.counts);
        self.hist.clear();
    }
}

/// The flusher role of one cap: settles its flush at transaction end.
pub struct Flushed(&'static CapEntry);

impl Flushed {
    /// The flush `id` writes `delta`: the last settled flush's delta is given up for it.
    pub fn set_inflight(&self, id: u64, delta: CounterValues) {
        self.0.flush.set_inflight(id, delta);
    }

    pub fn flush_state(&self) -> FlushState {
        self.0.flush_state()
    }

    /// The flush's transaction committed: what it read is now in the table. Its delta stays in
    /// `inflight`, under `settled_id`, for readers whose snapshot predates the commit.
    pub fn commit(&self, read: &FlushState) {
        let e = self.0;
        e.flush.commit(read);
        e.hist.advance(read.pending_hist());
        e.end_flush();
    }

    /// The flush's transaction (or subtransaction) aborted: its delta is still pending.
    /// A role taken for a cap with nothing new (no delta set) keeps the last settled flush.
    pub fn abort(&self) {
        let e = self.0;
        e.flush.abort();
        e.end_flush();
    }
}

impl Cap {
    pub fn counters(&self) -> &'static Counters {
        &self.entry().counters.counts
    }

    pub fn flush_state(&self) -> FlushState {
        self.entry().flush_state()
    }

    /// The cap's counts and histograms (what `stage_e_stats()` shows) restart at zero, and
    /// its pending counts with them: now if no process holds the flusher role, else as its
    /// holder gives the role back. `pid` is this process's.
    pub fn restart_counts(&self, pid: i32) {
        let e = self.entry();
        if e.flush.ask_restart(pid) {
            e.flush.restart(&e.counters.counts, || e.hist.restart());
            e.end_flush();
        }
    }

    /// Makes `pid` this cap's only flusher and returns the role; None if another flush is in
    /// progress.
    pub fn begin_flush(&self, pid: i32) -> Option<Flushed> {
        self.entry().flush.begin(pid).then(|| Flushed(self.entry()))
    }
}
