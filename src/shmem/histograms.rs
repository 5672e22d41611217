//! A cap's hold and wait histograms (the buckets are `stage_e_core::histogram`'s).
//!
//! **Counts.** One relaxed atomic per bucket, bumped once per observation (a release, a lease's
//! expiry, the end of a wait) next to the `hold_time` or `wait_time` counter that is its sum:
//! no lock, no allocation. Like the counters they count since the cap was made, or since its
//! database's extension was last dropped (a restart, `counters`).
//!
//! **Durability.** `base` is what the counts were at the cap's last committed flush, less what
//! the pending file carried in at start: the pending counts are `counts - base` (wrapping, as
//! the counts are monotonic but for a restart). Only the holder of the cap's flusher role
//! (`counters`) moves `base`, when its flush commits or the counts restart (inside the flush
//! seqlock's write: the counts lose what was read of them, the base goes to zero, so only
//! what is observed after is pending);
//! otherwise only the postmaster at start (the carry) and a reclaim (under the exclusive
//! directory lock, no pin) write it. So it needs no seqlock of its own. No
//! reader adds these counts to table rows (the totals view does that for the counters only), so
//! no in-flight delta is kept either.

use super::entry::CapEntry;
use super::records::Histograms;
use super::Cap;
use stage_e_core::histogram::{self, HistValues, Metric, VALUES};
use std::sync::atomic::{AtomicU64, Ordering};

fn load(a: &[AtomicU64; VALUES]) -> HistValues {
    HistValues(std::array::from_fn(|i| a[i].load(Ordering::Relaxed)))
}

fn store(a: &[AtomicU64; VALUES], v: HistValues) {
    for (a, v) in a.iter().zip(v.0) {
        a.store(v, Ordering::Relaxed);
    }
}

impl Histograms {
    pub(super) fn counts(&self) -> HistValues {
        load(&self.counts)
    }

    pub(super) fn base(&self) -> HistValues {
        load(&self.base)
    }

    /// The flusher's flush committed having read `pending`: those counts are in the table now.
    pub(super) fn advance(&self, pending: HistValues) {
        store(&self.base, self.base().plus(pending));
    }

    /// At start: counts saved at the last clean shutdown are pending again.
    pub(super) fn carry(&self, pending: HistValues) {
        store(&self.base, self.base().minus(pending));
    }

    /// Holding the flusher role, inside the flush seqlock's write: each count loses the value
    /// read of it (an observation made meanwhile stays, and is all that is pending after) and
    /// the base goes to zero (`stage_e_core::flush`, "Restart").
    pub(super) fn restart(&self) {
        for (c, b) in self.counts.iter().zip(&self.base) {
            c.fetch_sub(c.load(Ordering::Relaxed), Ordering::Relaxed);
            b.store(0, Ordering::Relaxed);
        }
    }

    /// Reclaiming (exclusive directory lock, no pin): back to zero.
    pub(super) fn clear(&self) {
        store(&self.counts, HistValues::default());
        store(&self.base, HistValues::default());
    }
}

impl CapEntry {
    /// The histogram counts not yet in the table (at shutdown, with no flusher left).
    pub(super) fn pending_hist(&self) -> HistValues {
        self.hist.counts().minus(self.hist.base())
    }
}

impl Cap {
    /// Counts a duration of `us` microseconds in `metric`'s histogram.
    #[inline]
    pub fn observe(&self, metric: Metric, us: u64) {
        self.entry().hist.counts[histogram::index(metric, us)].fetch_add(1, Ordering::Relaxed);
    }
}
