//! A cap's counters, and the flush bookkeeping that makes them durable exactly once.
//!
//! **Hot counters.** One relaxed atomic per counter (`stage_e_core::counters::Counter`), bumped
//! by every call: each is an independent monotonic tally, read only to report and to flush.
//! They share their cache lines with the other fields that change as slots are taken (the
//! fencing token and the lease fields, `leases`), away from the fields every call only reads.
//!
//! **Flush seqlock.** `carried`, `flushed`, `inflight`, `inflight_id` and `settled_id` change only
//! in the process that holds the cap's flusher role (a CAS on `flusher`, taken by `flush`), as one
//! seqlock write: `version` is odd while they change. Readers ([`CapEntry::flush_state`]) retry
//! until they read an even, unchanged version, so the pending counts they compute are from one
//! consistent state. A cap whose role is held is never reclaimed, so the role needs no pin.

use super::entry::CapEntry;
use super::records::Counters;
use super::Cap;
use stage_e_core::counters::{Counter, CounterValues, FlushState};
use stage_e_core::histogram::HistValues;
use std::sync::atomic::Ordering;

impl Counters {
    pub fn bump(&self, which: Counter, by: u64) {
        self.0[which as usize].fetch_add(by, Ordering::Relaxed);
    }

    pub fn load(&self) -> CounterValues {
        CounterValues::from_array(std::array::from_fn(|i| self.0[i].load(Ordering::Relaxed)))
    }

    pub(super) fn store(&self, v: CounterValues) {
        for (c, x) in self.0.iter().zip(v.to_array()) {
            c.store(x, Ordering::Relaxed);
        }
    }
}

impl CapEntry {
    /// The flush bookkeeping, read consistently.
    pub(super) fn flush_state(&self) -> FlushState {
        loop {
            let before = self.version.load(Ordering::Acquire);
            if before % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let state = FlushState {
                counters: self.counters.counts.load(),
                carried: self.carried.load(),
                flushed: self.flushed.load(),
                inflight: self.inflight.load(),
                inflight_id: self.inflight_id.load(Ordering::Relaxed),
                settled_id: self.settled_id.load(Ordering::Relaxed),
                // Not under the seqlock: only the flusher moves their base (`histograms`).
                hist: self.hist.counts(),
                hist_base: self.hist.base(),
            };
            std::sync::atomic::fence(Ordering::Acquire);
            if self.version.load(Ordering::Relaxed) == before {
                return state;
            }
        }
    }

    /// Runs `f` on the bookkeeping fields as one seqlock write. Only the flusher (or the
    /// postmaster, before any backend) calls this.
    fn write(&self, f: impl FnOnce(&CapEntry)) {
        self.version.fetch_add(1, Ordering::AcqRel);
        // The Release half of the increment orders only what came before it: without this
        // fence a reader could see a new field value and still read the old even version at
        // its check (a torn read; loom finds it: stage_e_core::flush's model). The fence pairs
        // with the reader's fence(Acquire) before its check, as crossbeam's SeqLock::write.
        std::sync::atomic::fence(Ordering::Release);
        f(self);
        self.version.fetch_add(1, Ordering::Release);
    }

    /// Adds counts saved at the last clean shutdown (`persist`).
    pub(super) fn carry(&self, v: CounterValues, hist: HistValues) {
        self.write(|e| e.carried.store(e.carried.load().plus(v)));
        self.hist.carry(hist);
    }

    /// Counts not yet in the table.
    pub(super) fn pending(&self) -> CounterValues {
        self.flush_state().pending(None)
    }

    /// Under the exclusive directory lock, reclaiming: every count back to zero.
    pub(super) fn clear_counters(&self) {
        let zero = CounterValues::default();
        self.counters.counts.store(zero);
        self.carried.store(zero);
        self.flushed.store(zero);
        self.inflight.store(zero);
        self.inflight_id.store(0, Ordering::Relaxed);
        self.settled_id.store(0, Ordering::Relaxed);
        self.hist.clear();
    }
}

/// The flusher role of one cap: settles its flush at transaction end.
pub struct Flushed(&'static CapEntry);

impl Flushed {
    /// The flush `id` writes `delta`: the last settled flush's delta is given up for it.
    pub fn set_inflight(&self, id: u64, delta: CounterValues) {
        self.0.write(|e| {
            e.inflight.store(delta);
            e.inflight_id.store(id, Ordering::Relaxed);
            e.settled_id.store(0, Ordering::Relaxed);
        });
    }

    pub fn flush_state(&self) -> FlushState {
        self.0.flush_state()
    }

    /// The flush's transaction committed: what it read is now in the table. Its delta stays in
    /// `inflight`, under `settled_id`, for readers whose snapshot predates the commit.
    pub fn commit(&self, read: &FlushState) {
        let e = self.0;
        e.write(|e| {
            e.flushed.store(read.counters);
            e.carried.store(e.carried.load().minus(read.carried));
            let id = e.inflight_id.swap(0, Ordering::Relaxed);
            if id == 0 {
                e.inflight.store(CounterValues::default());
            }
            e.settled_id.store(id, Ordering::Relaxed);
        });
        e.hist.advance(read.pending_hist());
        e.flusher.store(0, Ordering::Release);
    }

    /// The flush's transaction (or subtransaction) aborted: its delta is still pending.
    /// A role taken for a cap with nothing new (no delta set) keeps the last settled flush.
    pub fn abort(&self) {
        let e = self.0;
        e.write(|e| {
            // A flush that set its delta had given up the settled one (`set_inflight`).
            if e.inflight_id.swap(0, Ordering::Relaxed) != 0 {
                e.inflight.store(CounterValues::default());
            }
        });
        e.flusher.store(0, Ordering::Release);
    }
}

impl Cap {
    pub fn counters(&self) -> &'static Counters {
        &self.entry().counters.counts
    }

    pub fn flush_state(&self) -> FlushState {
        self.entry().flush_state()
    }

    /// Makes `pid` this cap's only flusher and returns the role; None if another flush is in
    /// progress.
    pub fn begin_flush(&self, pid: i32) -> Option<Flushed> {
        self.entry()
            .flusher
            .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            .then(|| Flushed(self.entry()))
    }
}
