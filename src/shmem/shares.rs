//! Fair shares of caps (issue 38), placed in shared memory: `stage_e_core::fair`'s clock in
//! each cap entry, its share records in one pool of `stage_e_slots.max_shares` records that
//! every cap draws on, the pool's head in the segment header and each database's count of
//! records in its database record (its `database_share` of the pool).
//!
//! Interface:
//!
//! - [`Cap::has_shares`]: whether the cap has live shares (one load, without a lock: a cap
//!   that never had a share keeps its path);
//! - [`Cap::fair`]: one step of the cap's fair queue (`stage_e_core::fair::Fair`), under the
//!   exclusive waits lock;
//! - [`Cap::give_back_share`]: slots taken in a share are given back (every release path
//!   reads the slot's share from its holder record before clearing it);
//! - [`shares_of`]: the live shares of a database's caps, for the views.
//!
//! Protocol: everything here (the clock, the records, the pool's head, the databases' counts)
//! is changed only under the exclusive waits lock, the lock that also guards the caps' queues,
//! so one step sees a cap's shares and its waiters together. The clock is kept in atomics so
//! that [`Cap::has_shares`] may read its chain link without the lock: a cap whose chain was
//! empty at that look takes the path of a cap without shares, which is what it was an instant
//! before (as a call that came an instant earlier would have). The records are plain data;
//! `&mut` to them exists only inside [`Cap::fair`], under the exclusive lock, so there is no
//! other reference in this process, and other processes touch them only under the same lock.

use super::databases;
use super::entry::CapEntry;
use super::segment::{segment, waits_locked, Segment, EXCLUSIVE, SHARED};
use super::Cap;
use crate::gucs;
use stage_e_core::fair::{Clock, Fair, Pool, PoolHead, ShareAt, ShareRecord};
use std::sync::atomic::Ordering;

impl CapEntry {
    fn set_clock(&self, c: Clock) {
        let [v, rest] = c.pack();
        self.clock[0].store(v, Ordering::Relaxed);
        // Release: pairs with `has_shares`' Acquire (a chain seen is a chain written).
        self.clock[1].store(rest, Ordering::Release);
    }
}

impl Segment {
    /// The share records, for one step under the exclusive waits lock.
    ///
    /// # Safety
    /// The caller holds the waits lock exclusively, and no other reference to the records
    /// lives in this process meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn share_records(&self) -> &mut [ShareRecord] {
        // SAFETY: the part is `shares_len` records inside the segment, 8-aligned, valid zeroed
        // (`attach`); exclusivity per the caller.
        unsafe { std::slice::from_raw_parts_mut(self.shares, self.shares_len) }
    }

    /// The share records, read under the waits lock (either mode).
    #[cfg_attr(not(feature = "pg_test"), allow(dead_code))] // until the SQL surface uses it
    fn share_records_shared(&self) -> &[ShareRecord] {
        // SAFETY: as `share_records`; writers hold the lock exclusively, so under it (shared)
        // nothing changes them.
        unsafe { std::slice::from_raw_parts(self.shares, self.shares_len) }
    }
}

impl Cap {
    /// Whether the cap has live shares (its chain of records is not empty), without a lock.
    pub fn has_shares(&self) -> bool {
        self.entry().has_shares()
    }

    /// Runs one step of the cap's fair queue under the exclusive waits lock; what the step
    /// changed (the clock, the records, the pool's head, the database's count) is stored
    /// before the lock is released. The database may hold `database_share` percent of the
    /// pool (as this backend's setting says).
    pub fn fair<R>(&self, f: impl FnOnce(&mut Fair) -> R) -> R {
        let seg = segment().expect("a pinned cap implies the segment");
        let limit = stage_e_core::share::limit(seg.shares_len as u64, gucs::database_share());
        waits_locked(EXCLUSIVE, || {
            fair_locked(seg, self.entry(), limit as u32, f)
        })
    }

    /// Slots of this cap taken in the share at `at` (from their holder records; 0: none) are
    /// given back: `k` of them.
    pub fn give_back_share(&self, at: u32, k: u32) {
        if at != 0 {
            self.fair(|f| f.released_at(ShareAt(at), k));
        }
    }
}

/// [`Cap::fair`] with the waits lock held exclusively (by the caller).
pub(super) fn fair_locked<R>(
    seg: &Segment,
    e: &CapEntry,
    limit: u32,
    f: impl FnOnce(&mut Fair) -> R,
) -> R {
    let mut clock = e.clock();
    let mut head = PoolHead::unpack(seg.header.share_pool.load(Ordering::Relaxed));
    let db = e.database();
    let mut used = databases::shares_of_database(db);
    // SAFETY: the caller holds the waits lock exclusively; the records are borrowed for this
    // step only.
    let records = unsafe { seg.share_records() };
    let before = (clock, head, used);
    let out = f(&mut Fair::new(
        &mut clock,
        Pool {
            records,
            head: &mut head,
            used: &mut used,
            limit,
        },
    ));
    if (clock, head, used) != before {
        e.set_clock(clock);
        seg.header.share_pool.store(head.pack(), Ordering::Relaxed);
        databases::set_shares_of_database(db, used);
    }
    out
}

/// A live share of a cap, as the views show it (the in-server tests read it until the views
/// do).
#[cfg_attr(not(feature = "pg_test"), allow(dead_code))] // until the SQL surface uses it
pub struct ShareInfo {
    pub cap: String,
    pub digest: u64,
    pub weight: u32,
    pub ceiling: Option<u32>,
    pub held: u32,
    pub waiting: u32,
}

/// The live shares of database `db`'s caps.
#[cfg_attr(not(feature = "pg_test"), allow(dead_code))] // until the SQL surface uses it
pub fn shares_of(db: u32) -> Vec<ShareInfo> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    waits_locked(SHARED, || {
        let records = seg.share_records_shared();
        seg.live()
            .filter(|e| e.database() == db && e.has_shares())
            .flat_map(|e| {
                let name = e.name();
                stage_e_core::fair::live_shares(&e.clock(), records)
                    .map(move |s| ShareInfo {
                        cap: name.clone(),
                        digest: s.digest,
                        weight: s.weight,
                        ceiling: (s.ceiling != stage_e_core::fair::NO_CEILING).then_some(s.ceiling),
                        held: s.held,
                        waiting: s.waiting,
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    })
}
