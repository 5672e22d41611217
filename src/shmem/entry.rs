//! A cap's entry in shared memory, and the holder records of its slots.
//!
//! An entry is free (database 0) or holds one cap of one database. Its identity (database,
//! name, lock key, hash) and its slot block (first page, capacity) are written only under the
//! exclusive directory lock with the entry LOCKED (`caps`), so a process holding a pin (`pin`)
//! reads them without a lock. The other fields have protocols of their own, each in the file of
//! its concern: the counters and the flush seqlock (`counters`), the waiters and the front
//! seats (`waitq`), the lease fields (`leases`), the load averages (`load`), the durable
//! horizon, floor and hold (`committed`), the adaptive limit (`policies`, kept in the durable
//! line, which every acquisition reads), the histograms (`histograms`).
//!
//! Field order is layout: the fields every call reads fill the first cache line, the counters
//! every call bumps (with the fencing token and the lease fields) have lines of their own.

use super::records::{load_name, store_name, Durable, Histograms, HotCounters, NAME_WORDS};
use stage_e_core::fair::Clock;
use stage_e_core::flush::FlushBook;
use stage_e_core::load::Averages;
use stage_e_core::queue::{WaitLine, Waiters};
use stage_e_core::state::State;
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicU32, AtomicU64, Ordering};

#[repr(C)]
pub(super) struct CapEntry {
    /// Generation, LOCKED, counted pins (`stage_e_core::state`).
    pub(super) state: State,
    /// 0 = free entry.
    dboid: AtomicU32,
    /// First int4 of the cap's advisory locks.
    key: AtomicI32,
    /// First page of the slot block, and how many slots it holds.
    block: AtomicU32,
    capacity: AtomicU32,
    name_len: AtomicU32,
    hash: AtomicU64,
    name: [AtomicU64; NAME_WORDS],
    /// Waiters in the queue (read by every call; `waitq`).
    pub(super) waiters: Waiters,
    /// The n of the cap's latest acquisition (written only when it changes; `committed`).
    pub(super) latest_n: AtomicU32,
    /// When the launcher last sampled the load, and the throttled count it saw then (`load`):
    /// in the first line's last 16 bytes, which were padding, written once a second.
    pub(super) load_last_throttled: AtomicU64,
    pub(super) load_last_us: AtomicI64,
    /// Counted since the cap was created (the hot path writes only these).
    pub(super) counters: HotCounters,
    /// The flush bookkeeping (carried, flushed and in-flight counts under their seqlock) and
    /// the flusher role (`counters`, `stage_e_core::flush`).
    pub(super) flush: FlushBook,
    /// The next ticket of the queue, and its first waiters (`waitq`).
    pub(super) line: WaitLine,
    /// Load averages over 1, 5 and 15 minutes, written by the launcher only (`load`); the
    /// throttle average is in the hot counters' lines, where there was room.
    pub(super) load_held: Averages,
    /// The cap's fair-share clock (`stage_e_core::fair::Clock::pack`): its virtual time, its
    /// waiters in shares and its chain of share records, written under the waits lock
    /// (`shares`); in 16 bytes that were padding before the durable line.
    pub(super) clock: [AtomicU64; 2],
    /// The committed lease horizon and token floor, the hold, the journal (`committed`).
    pub(super) durable: Durable,
    /// The hold and wait histograms, and what of them is flushed (`histograms`).
    pub(super) hist: Histograms,
}

/// 1,216 bytes: nineteen cache lines (twelve, and seven of histograms). A change here is a
/// change of the memory budget (README, `make bench`: a live cap of n = 8, with its slot block,
/// at most 1,536 bytes). 0.10.0's eleventh counter grew the flush book by 24 bytes and pushed
/// the durable line, and so the histograms, one line down (1,280 bytes); the launcher's fields
/// moved into room that was padding brought it back.
const _: () = assert!(size_of::<CapEntry>() == 1216);

/// The mark itself, so that a field that grows the entry past it fails the build rather than a
/// benchmark run: a live cap of n <= 15 costs its entry, its part of the directory's index (at
/// most 16 bytes: `directory::index_len` gives each entry 2 to 4 words) and a 256-byte slot
/// page with the arena's bookkeeping of it (under 5%: 12 bytes).
const _: () = assert!(size_of::<CapEntry>() + 16 + 256 + 12 <= 1536);

/// An entry's identity, as `caps` writes it.
pub(super) struct Identity<'a> {
    pub(super) database: u32,
    pub(super) name: &'a str,
    pub(super) key: i32,
    pub(super) hash: u64,
}

impl CapEntry {
    pub(super) fn in_use(&self) -> bool {
        self.dboid.load(Ordering::Acquire) != 0
    }

    pub(super) fn database(&self) -> u32 {
        self.dboid.load(Ordering::Relaxed)
    }

    pub(super) fn key(&self) -> i32 {
        self.key.load(Ordering::Relaxed)
    }

    pub(super) fn hash(&self) -> u64 {
        self.hash.load(Ordering::Relaxed)
    }

    /// (first page, capacity) of the slot block.
    pub(super) fn block(&self) -> (u32, u32) {
        (
            self.block.load(Ordering::Acquire),
            self.capacity.load(Ordering::Acquire),
        )
    }

    pub(super) fn capacity(&self) -> u32 {
        self.capacity.load(Ordering::Acquire)
    }

    /// Under the exclusive directory lock, LOCKED: the slot block.
    pub(super) fn set_block(&self, page: u32, capacity: u32) {
        self.block.store(page, Ordering::Relaxed);
        self.capacity.store(capacity, Ordering::Relaxed);
    }

    /// The fair-share clock (`shares`, which writes it under the waits lock).
    pub(super) fn clock(&self) -> Clock {
        Clock::unpack([
            self.clock[0].load(Ordering::Relaxed),
            self.clock[1].load(Ordering::Relaxed),
        ])
    }

    /// Whether the cap has a chain of share records (without a lock: `shares`). A cap with one
    /// is not reclaimed (the records would be lost to the pool).
    pub(super) fn has_shares(&self) -> bool {
        Clock::has_shares(self.clock[1].load(Ordering::Acquire))
    }

    pub(super) fn name(&self) -> String {
        load_name(&self.name, &self.name_len)
    }

    pub(super) fn is(&self, db: u32, name: &str) -> bool {
        self.dboid.load(Ordering::Relaxed) == db
            && self.name_len.load(Ordering::Relaxed) as usize == name.len()
            && self.name() == name
    }

    /// Under the exclusive directory lock, LOCKED: makes this free entry the cap `id`; the
    /// database is stored last (Release), so a reader that sees it sees the rest.
    pub(super) fn set_identity(&self, id: Identity) {
        store_name(&self.name, &self.name_len, id.name);
        self.key.store(id.key, Ordering::Relaxed);
        self.hash.store(id.hash, Ordering::Relaxed);
        self.dboid.store(id.database, Ordering::Release);
    }

    /// Under the exclusive directory lock, LOCKED, unpinned: the entry is free again.
    pub(super) fn clear_identity(&self) {
        self.capacity.store(0, Ordering::Relaxed);
        self.dboid.store(0, Ordering::Release);
    }
}

/// Who holds a slot through the extension (its protocol: `stage_e_core::holder`). A negative
/// pid names a lease record (`stage_e_core::lease`).
pub use stage_e_core::holder::SlotRecord;
