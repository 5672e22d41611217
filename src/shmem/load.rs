//! Load averages of each cap: slots held and throttles per minute over 1, 5 and 15 minutes
//! (`stage_e_core::load`). Only the launcher samples them (every few seconds), so the fields
//! have one writer; readers may see one average of a sample before the next.

use super::caps::caps;
use super::entry::CapEntry;
use stage_e_core::load;
use std::sync::atomic::Ordering;

/// A cap's load: slots held and throttles per minute, averaged over `load::WINDOWS`.
pub struct Load {
    pub cap: String,
    pub held: [f64; 3],
    pub throttles_per_min: [f64; 3],
}

impl CapEntry {
    /// Under the exclusive directory lock, reclaiming.
    pub(super) fn clear_load(&self) {
        self.load_held.clear();
        self.counters.load_throttles.clear();
        self.load_last_us.store(0, Ordering::Relaxed);
        self.load_last_throttled.store(0, Ordering::Relaxed);
    }
}

/// Takes one load sample of every cap: averages decayed by the real time since the last sample.
pub fn sample_load(now_us: i64) {
    for cap in caps(None) {
        let e = cap.entry();
        let held = super::policies::held_bits(&cap);
        let throttled = e.counters.counts.load().throttled;
        let last_us = e.load_last_us.swap(now_us, Ordering::Relaxed);
        let last_throttled = e.load_last_throttled.swap(throttled, Ordering::Relaxed);
        if last_us == 0 || now_us <= last_us {
            // The first sample of a cap sets the baseline: the averages start from it.
            e.load_held.start(held as f64);
            e.counters.load_throttles.start(0.0);
            continue;
        }
        let dt = (now_us - last_us) as f64 / 1e6;
        // The counts restarted (`counters`) since the last sample: those since the restart.
        let new = throttled.checked_sub(last_throttled).unwrap_or(throttled);
        let rate = load::per_minute(new, dt);
        e.load_held.sample(held as f64, dt);
        e.counters.load_throttles.sample(rate, dt);
    }
}

/// The load figures of database `db`'s caps.
pub fn load_of(db: u32) -> Vec<Load> {
    caps(Some(db))
        .into_iter()
        .map(|cap| Load {
            cap: cap.name(),
            held: cap.entry().load_held.read(),
            throttles_per_min: cap.entry().counters.load_throttles.read(),
        })
        .collect()
}
