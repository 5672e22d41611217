//! Finding, creating, growing and reclaiming caps.
//!
//! Caps are keyed by (database, name) through the open-addressing index (`directory`). A lookup
//! on a backend's cache miss takes the directory lock shared, which keeps the cap from being
//! reclaimed or grown meanwhile, so its pin is immediate. Creating, growing and reclaiming take
//! it exclusive, and act on an entry only after setting its LOCKED bit with no pin left
//! (`stage_e_core::state`).
//!
//! **Size classes.** A cap's block is a power of two pages, the smallest that holds the largest
//! `n` it has been used with (`arena::capacity`). A cap used later with a larger `n` moves to a
//! larger block; its holders keep their slots.
//!
//! **Reclaiming.** A cap with no pin, no occupied slot, no waiter, nothing pending for the table
//! and no flush in progress, not held back (`committed`), is idle, and is reclaimed when room is
//! needed (an entry or a block); its counts are already in its counter row. A cap of a dropped
//! database is reclaimed with its pending counts (logged). Only when the caps truly in use fill
//! `max_caps` or the arena does a create fail; a create that finds everything in use asks the
//! launcher for a flush round (so idle caps' counts reach their rows) and waits up to [`ROOM_WAIT`]
//! for it.

use super::databases::{self, sorted};
use super::entry::{CapEntry, Identity};
use super::launcher::request_flush;
use super::segment::{directory_locked, segment, Segment, EXCLUSIVE, SHARED};
use super::Cap;
use crate::failures::{CapError, Pool};
use crate::gucs;
use pgrx::pg_sys;
use stage_e_core::arena;
use stage_e_core::directory;
use stage_e_core::share;
use stage_e_core::state::{CapRef, Refused};
use std::sync::atomic::Ordering;

/// How long a create waits for a flush round to make idle caps reclaimable.
const ROOM_WAIT: std::time::Duration = std::time::Duration::from_millis(1_000);
/// How long a create retries a cap on its key that is idle but busy for a moment.
const COLLISION_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// How a create finds the new cap's lock key (see `src/keys.rs`).
#[derive(Clone, Copy)]
pub enum KeyChoice<'a> {
    /// This key, refused if another cap uses it unless that cap is idle (then it goes): the
    /// `default` cap, a database not yet updated to 0.7.0, a cap restored from a file.
    Fixed(i32),
    /// The key `directory::pick_key` picks from this book and the live caps.
    Book(&'a directory::KeyBook),
}

/// The first lock key of cap `name` before its book is read: `stage_e_slots.lock_key` for
/// `default`, else the first key of the name's probe sequence (its key in a database before
/// 0.7.0, and in every database unless it collided).
pub fn first_key(name: &str) -> i32 {
    if name == directory::DEFAULT_CAP {
        gucs::lock_key()
    } else {
        directory::name_key(name)
    }
}

/// The lock key of the live cap `(db, name)`, else the one a create would pick now from
/// `book` (None: the name's key is fixed, [`first_key`]).
pub fn key_now(db: u32, name: &str, book: &dyn Fn(u32) -> Option<directory::KeyBook>) -> i32 {
    let Some(seg) = segment() else {
        return first_key(name);
    };
    let live = |seg: &Segment| seg.find(db, name).map(|i| seg.entry(i).key());
    if let Some(k) = directory_locked(SHARED, || live(seg)) {
        return k; // no book to read
    }
    let mut covered = KEYS_COVERED_FIRST;
    loop {
        let Some(book) = book(covered) else {
            return first_key(name);
        };
        let found = directory_locked(SHARED, || match live(seg) {
            Some(k) => directory::Pick::Key(k),
            None => directory::pick_key(name, &book, |k| seg.key_taken(db, name, k)),
        });
        match found {
            directory::Pick::Key(k) => return k,
            directory::Pick::Exhausted => covered = covered.saturating_mul(4),
        }
    }
}

/// How many probe keys a book covers at first: a name collides rarely, and each key a
/// squatter holds took it a brute-force search.
const KEYS_COVERED_FIRST: u32 = 16;

/// Past this many probe keys, a create gives up (every one held: see `src/keys.rs`).
const MAX_KEYS_COVERED: u32 = 1 << 20;

impl CapEntry {
    /// Nothing refers to the cap but its entry: no flush, no waiter, nothing pending, no hold.
    fn idle(&self) -> bool {
        self.flush.idle()
            && self.waiters.count() == 0
            && !self.has_shares()
            && self.pending().is_zero()
            && !self.held_at(now())
    }
}

impl Segment {
    fn find(&self, db: u32, name: &str) -> Option<u32> {
        let hash = directory::index_hash(db, name);
        self.index().find(hash, |i| self.entry(i).is(db, name))
    }

    fn cap_ref(&self, i: u32) -> CapRef {
        self.entry(i).state.cap_ref(i)
    }

    fn free_entry(&self) -> Option<usize> {
        self.entries.iter().position(|e| !e.in_use())
    }

    fn occupied(&self, e: &CapEntry) -> bool {
        self.block(e)
            .1
            .iter()
            .any(|w| w.load(Ordering::Acquire) != 0)
    }

    /// Under the directory lock: whether key `k` is taken for cap `name` of database `db` (a
    /// live cap of `db` uses it, or it is the `default` cap's).
    fn key_taken(&self, db: u32, name: &str, k: i32) -> bool {
        (name != directory::DEFAULT_CAP && k == gucs::lock_key())
            || self
                .entries
                .iter()
                .any(|e| e.database() == db && e.key() == k)
    }

    /// Under the exclusive lock: the key of the new cap `(db, name)`. Two caps of one database
    /// on one lock key would share slots, so no key is ever given twice.
    fn new_key(&self, db: u32, name: &str, choice: KeyChoice) -> Result<i32, CapError> {
        let key = match choice {
            KeyChoice::Book(book) => {
                return match directory::pick_key(name, book, |k| self.key_taken(db, name, k)) {
                    directory::Pick::Key(k) => Ok(k),
                    directory::Pick::Exhausted => Err(CapError::KeysExhausted {
                        covered: book.covered,
                    }),
                };
            }
            KeyChoice::Fixed(key) => key,
        };
        // A key that cannot move: refuse the newcomer, unless the other cap is idle (then it
        // goes, and comes back refused if used again).
        let same_key = (0..self.entries.len() as u32).find(|&i| {
            let e = self.entry(i);
            e.database() == db && e.key() == key
        });
        if let Some(j) = same_key {
            let other = self.entry(j);
            if !(other.idle() && self.try_reclaim(j, false)) {
                return Err(CapError::KeyCollision {
                    other: other.name(),
                    key,
                });
            }
        }
        if name != directory::DEFAULT_CAP && key == gucs::lock_key() {
            return Err(CapError::KeyCollision {
                other: directory::DEFAULT_CAP.to_string(),
                key,
            });
        }
        Ok(key)
    }

    /// Under the exclusive lock: the cap `(db, name)`, created with room for `slots` slots and
    /// the key `choice` gives. `exists` says whether a database still exists.
    pub(super) fn create(
        &self,
        db: u32,
        name: &str,
        choice: KeyChoice,
        slots: u32,
        share: u32,
        exists: &dyn Fn(u32) -> bool,
    ) -> Result<CapRef, CapError> {
        if let Some(i) = self.find(db, name) {
            return Ok(self.cap_ref(i));
        }
        let key = self.new_key(db, name, choice)?;
        let order = arena::order_for(slots.max(1));
        self.within_share(db, 1, 1 << order, 0, share)?;
        let mut entry = self.free_entry();
        let mut block = self.buddy().alloc(order);
        if entry.is_none() || block.is_none() {
            self.reclaim_idle(exists, order);
            entry = entry.or_else(|| self.free_entry());
            block = block.or_else(|| self.buddy().alloc(order));
        }
        let Some(i) = entry else {
            if let Some(b) = block {
                self.buddy().free(b);
            }
            request_flush();
            return Err(CapError::NoEntry {
                max_caps: self.max_caps(),
                held: self
                    .live()
                    .filter(|e| !e.idle() || self.occupied(e))
                    .count() as u32,
            });
        };
        let Some(block) = block else {
            request_flush();
            return Err(CapError::NoMemory { slots });
        };
        let i = i as u32;
        let e = self.entry(i);
        // A free entry has no pins and a generation above any reference to its last cap.
        e.state.lock();
        e.set_block(block, arena::capacity(order));
        self.clear_block(e);
        e.clear_durable();
        e.start_limit(db, name);
        e.start_leases();
        let hash = directory::index_hash(db, name);
        e.set_identity(Identity {
            database: db,
            name,
            key,
            hash,
        });
        self.index().insert(hash, i);
        e.state.unlock();
        if self.live().count() as u32 * 4 >= self.max_caps() * 3 {
            request_flush(); // crowded: get idle caps' counts into their rows
        }
        Ok(self.cap_ref(i))
    }

    fn clear_block(&self, e: &CapEntry) {
        let (records, bits) = self.block(e);
        for r in records {
            r.clear();
        }
        for w in bits {
            w.store(0, Ordering::Relaxed);
        }
    }

    /// Under the exclusive lock: caps and slot-memory pages database `db` holds.
    fn held_by(&self, db: u32) -> (u64, u64) {
        self.live()
            .filter(|e| e.database() == db)
            .fold((0, 0), |(caps, pages), e| {
                (caps + 1, pages + self.pages_of(e))
            })
    }

    fn pages_of(&self, e: &CapEntry) -> u64 {
        1 << self.buddy().order_of(e.block().0)
    }

    /// Under the exclusive lock: whether database `db` may take `caps` more caps and `pages`
    /// more pages of slot memory (giving back `freed` pages) within its share; if not, its own
    /// idle caps go first, then it is refused.
    fn within_share(
        &self,
        db: u32,
        caps: u64,
        pages: u64,
        freed: u64,
        share: u32,
    ) -> Result<(), CapError> {
        if share >= 100 {
            return Ok(());
        }
        let over = |(held_caps, held_pages): (u64, u64)| {
            let caps_limit = share::limit(self.max_caps() as u64, share);
            let pages_limit = share::limit(self.pages() as u64, share);
            if !share::fits(held_caps, caps, self.max_caps() as u64, share) {
                Some(CapError::OverShare {
                    pool: Pool::Caps,
                    share,
                    limit: caps_limit,
                })
            } else if !share::fits(
                held_pages.saturating_sub(freed),
                pages,
                self.pages() as u64,
                share,
            ) {
                Some(CapError::OverShare {
                    pool: Pool::SlotMemory,
                    share,
                    limit: pages_limit,
                })
            } else {
                None
            }
        };
        if over(self.held_by(db)).is_none() {
            return Ok(());
        }
        for i in 0..self.entries.len() as u32 {
            let e = self.entry(i);
            if e.database() == db
                && e.idle()
                && self.try_reclaim(i, false)
                && over(self.held_by(db)).is_none()
            {
                return Ok(());
            }
        }
        match over(self.held_by(db)) {
            None => Ok(()),
            Some(e) => {
                request_flush(); // its caps with pending counts become idle once flushed
                Err(e)
            }
        }
    }

    /// Under the exclusive lock: reclaims idle caps (and those of dropped databases, which
    /// `exists` denies) until an entry is free and a block of `order` can be had.
    fn reclaim_idle(&self, exists: &dyn Fn(u32) -> bool, order: u32) {
        for i in 0..self.entries.len() as u32 {
            let e = self.entry(i);
            let db = e.database();
            if db == 0 {
                continue;
            }
            let dropped = !exists(db);
            if (dropped || e.idle()) && self.try_reclaim(i, dropped) && self.buddy_has(order) {
                return;
            }
        }
    }

    fn buddy_has(&self, order: u32) -> bool {
        match self.buddy().alloc(order) {
            Some(b) => {
                self.buddy().free(b);
                true
            }
            None => false,
        }
    }

    /// Under the exclusive lock: frees entry `i` if nothing refers to it. With `dropped`, its
    /// pending counts go too (its database no longer exists), and the log says so.
    fn try_reclaim(&self, i: u32, dropped: bool) -> bool {
        let e = self.entry(i);
        let Some(before) = e.state.lock_unpinned(i, self.hazards.iter().map(|h| &h.0)) else {
            return false;
        };
        let busy = self.occupied(e)
            || !e.flush.idle()
            || e.waiters.count() != 0
            || e.has_shares()
            || (!dropped && (!e.pending().is_zero() || e.held_at(now())));
        if busy {
            e.state.unlock();
            return false;
        }
        if dropped {
            let p = e.pending();
            let counts = if p.is_zero() {
                String::new()
            } else {
                format!(
                    "; dropped its pending counters ({} acquired, {} throttled)",
                    p.acquired, p.throttled
                )
            };
            crate::report::log(format!(
                "stage_e_slots: reclaimed cap \"{}\" of dropped database {}{counts}",
                e.name(),
                e.database(),
            ));
        }
        self.index().remove(e.hash(), i, |o| self.entry(o).hash());
        self.buddy().free(e.block().0);
        e.clear_counters();
        e.clear_load();
        e.clear_identity();
        // New generation, unlocked, no pins: every cached reference to the old cap now fails.
        e.state.retire(before);
        true
    }

    /// Locks the entry of `cap` (no new pin starts) and waits, holding no LWLock, for its pins
    /// to end; None if it was reclaimed or is locked by another process meanwhile (the caller
    /// looks it up again). The caller moves it (`move_block`) and unlocks it. A pin that waits
    /// on another process would stall this (that process may be waiting to pin the entry), so
    /// none does (`slots`' invariants); one that stays is refused, `Busy`, after about 2 s.
    fn lock_for_growing(&self, cap: CapRef) -> Result<Option<u64>, CapError> {
        let e = self.entry(cap.entry);
        let Some(before) = e.state.lock_at(cap.generation) else {
            return Ok(None);
        };
        let mut waited = 0;
        while e
            .state
            .pinned(cap.entry, before, self.hazards.iter().map(|h| &h.0))
        {
            if waited > 20_000 {
                e.state.unlock();
                return Err(CapError::Busy);
            }
            super::segment::nap(50);
            waited += 1;
        }
        Ok(Some(before))
    }

    /// Under the exclusive lock, with the entry locked and unpinned: moves the cap to a block
    /// of at least `slots` slots (its holders keep theirs), and unlocks the entry.
    fn move_block(&self, cap: CapRef, slots: u32, share: u32) -> Result<(), CapError> {
        let e = self.entry(cap.entry);
        let result = self.move_locked(e, slots, share);
        e.state.unlock();
        result
    }

    fn move_locked(&self, e: &CapEntry, slots: u32, share: u32) -> Result<(), CapError> {
        if e.capacity() >= slots {
            return Ok(());
        }
        let order = arena::order_for(slots);
        self.within_share(e.database(), 0, 1 << order, self.pages_of(e), share)?;
        let Some(new) = self.buddy().alloc(order) else {
            return Err(CapError::NoMemory { slots });
        };
        let (old_records, old_bits) = self.block(e);
        let old_block = e.block().0;
        e.set_block(new, arena::capacity(order));
        self.clear_block(e);
        let (records, bits) = self.block(e);
        for (to, from) in records.iter().zip(old_records) {
            let (pid, at) = from.get();
            to.set_share(from.share());
            to.set(pid, at);
        }
        for (to, from) in bits.iter().zip(old_bits) {
            to.store(from.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        self.buddy().free(old_block);
        Ok(())
    }
}

fn now() -> i64 {
    // SAFETY: reads the clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// The cap `(db, name)` pinned, if it exists: a lookup under the shared directory lock (which
/// keeps it from being reclaimed or grown meanwhile, so the pin is immediate).
pub fn lookup(db: u32, name: &str) -> Option<Cap> {
    let seg = segment()?;
    loop {
        let found = directory_locked(SHARED, || {
            let i = seg.find(db, name)?;
            Some(seg.entry(i).try_pin(seg.cap_ref(i)))
        });
        match found? {
            Ok(cap) => return Some(cap),
            Err(Refused::Gone) => return None,
            // Being grown: its grower may need the directory lock, so wait without it.
            Err(Refused::Locked) => nap_between_tries(),
        }
    }
}

/// A short sleep between two tries at a cap's entry, answering cancels.
fn nap_between_tries() {
    super::segment::nap(200);
    pgrx::check_for_interrupts!();
}

/// The cap `(db, name)` pinned, created (with room for `slots` slots) if it does not exist.
/// `exists` says whether a database still exists (a catalog lookup, made only when full);
/// `book(covered)` reads what the database records of the name's first `covered` probe keys
/// (None: its key is fixed, [`first_key`]). Both are read before taking the lock.
pub fn create(
    db: u32,
    name: &str,
    slots: u32,
    exists: impl Fn(u32) -> bool,
    book: &dyn Fn(u32) -> Option<directory::KeyBook>,
) -> Result<Option<Cap>, CapError> {
    let Some(seg) = segment() else {
        return Ok(None);
    };
    let mut covered = KEYS_COVERED_FIRST;
    let mut read = book(covered);
    let share = gucs::database_share();
    // Which full caps belong to dropped databases is a catalog lookup, made before taking the
    // lock (and only when the directory is full).
    let full = seg.live().count() as u32 >= seg.max_caps();
    let gone: Vec<u32> = if full {
        let mut dbs: Vec<u32> = seg.live().map(|e| e.database()).collect();
        dbs.sort_unstable();
        dbs.dedup();
        dbs.into_iter().filter(|&d| d != db && !exists(d)).collect()
    } else {
        Vec::new()
    };
    // Full of caps that become idle as soon as their counts are flushed: a flush round has
    // been asked for; wait for it (up to ROOM_WAIT), then fail closed.
    let started = std::time::Instant::now();
    loop {
        let choice = match &read {
            Some(book) => KeyChoice::Book(book),
            None => KeyChoice::Fixed(first_key(name)),
        };
        let made = directory_locked(EXCLUSIVE, || {
            let cap = seg.create(db, name, choice, slots, share, &|d| !gone.contains(&d))?;
            Ok(seg.entry(cap.entry).try_pin(cap))
        });
        match made {
            Ok(Ok(cap)) => return Ok(Some(cap)),
            Ok(Err(Refused::Gone)) => return Ok(None),
            // Being grown: its grower may need the directory lock, so wait without it.
            Ok(Err(Refused::Locked)) => nap_between_tries(),
            Err(
                CapError::NoEntry { .. } | CapError::NoMemory { .. } | CapError::OverShare { .. },
            ) if started.elapsed() < ROOM_WAIT => {
                super::segment::nap(2_000);
                pgrx::check_for_interrupts!();
            }
            // The cap on the same key may be idle but pinned for a moment (a flusher looking at
            // it): look again briefly before refusing.
            Err(CapError::KeyCollision { .. }) if started.elapsed() < COLLISION_WAIT => {
                super::segment::nap(1_000);
                pgrx::check_for_interrupts!();
            }
            // Squatters on every key the book covers: read further (each key cost them a
            // brute-force search; a read covering four times as many costs us one query).
            Err(CapError::KeysExhausted { covered: c }) if c < MAX_KEYS_COVERED => {
                covered = c.saturating_mul(4).max(covered);
                read = book(covered);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Restores a cap on the key it had, at start (the postmaster, before any backend: no lock is
/// contended).
pub(super) fn create_at_start(
    seg: &Segment,
    db: u32,
    name: &str,
    key: i32,
) -> Result<&'static CapEntry, CapError> {
    let cap = seg.create(db, name, KeyChoice::Fixed(key), 1, 100, &|_| true)?;
    Ok(seg.entry(cap.entry))
}

/// Restores a cap on the key it had at start with room for `slots` slots, pinned (counted: the
/// postmaster has no hazard slot).
pub(super) fn restore_at_start(
    seg: &Segment,
    db: u32,
    name: &str,
    key: i32,
    slots: u32,
) -> Result<Cap, CapError> {
    let cap = seg.create(db, name, KeyChoice::Fixed(key), slots.max(1), 100, &|_| {
        true
    })?;
    if seg.lock_for_growing(cap)?.is_some() {
        seg.move_block(cap, slots, 100)?;
    }
    seg.entry(cap.entry).pin_counted(cap).ok_or(CapError::Busy)
}

/// Moves `cap` to a block with room for `slots` slots (its holders keep theirs).
pub fn grow(cap: CapRef, slots: u32) -> Result<(), CapError> {
    let Some(seg) = segment() else { return Ok(()) };
    let share = gucs::database_share();
    // The wait for pins holds no LWLock: a flush pinning this cap must not stall every other
    // database's lookups behind the directory lock.
    if seg.lock_for_growing(cap)?.is_none() {
        return Ok(()); // reclaimed or being grown meanwhile: the caller looks it up again
    }
    directory_locked(EXCLUSIVE, || seg.move_block(cap, slots, share))
}

/// Reclaims every cap of database `db`, which no longer exists (the launcher's round).
pub fn reclaim_database(db: u32) {
    let Some(seg) = segment() else { return };
    // Its leases go first: nobody can renew or release them (their database is gone), and a
    // live lease keeps its slot's bit set, which would keep the cap, and the lease records and
    // slot memory every other database shares, taken until each lease's ttl passed.
    for cap in caps(Some(db)) {
        let ended = cap.expire_leases(i64::MAX);
        if !ended.is_empty() {
            crate::report::log(format!(
                "stage_e_slots: freed {} lease{} of cap \"{}\" of dropped database {db}",
                ended.len(),
                if ended.len() == 1 { "" } else { "s" },
                cap.name(),
            ));
        }
    }
    directory_locked(EXCLUSIVE, || {
        for i in 0..seg.entries.len() as u32 {
            if seg.entry(i).database() == db {
                seg.try_reclaim(i, true);
            }
        }
    });
    if !seg.live().any(|e| e.database() == db) {
        databases::forget_database(db);
    }
}

/// The caps of database `db`, unpinned: pin each with `pin` while using it.
pub fn cap_refs(db: u32) -> Vec<CapRef> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    (0..seg.entries.len() as u32)
        .filter(|&i| seg.entry(i).in_use() && seg.entry(i).database() == db)
        .map(|i| seg.cap_ref(i))
        .collect()
}

/// Pinned caps of database `db` (every cap when `db` is None), in entry order.
pub fn caps(db: Option<u32>) -> Vec<Cap> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    (0..seg.entries.len() as u32)
        .filter_map(|i| {
            let e = seg.entry(i);
            if !e.in_use() {
                return None;
            }
            let d = e.database();
            if db.is_some_and(|want| want != d) {
                return None;
            }
            let pinned = e.pin_counted(seg.cap_ref(i))?;
            // Re-check under the pin: the entry may have been reclaimed and reused.
            (pinned.database() == d).then_some(pinned)
        })
        .collect()
}

/// Names of the caps of database `db` in use now: a held slot or lease, a waiter, counts
/// pending, a flush in progress or a hold (what keeps a cap from being reclaimed but its pins).
/// The retention rule keeps their counter rows.
pub fn busy_caps(db: u32) -> Vec<String> {
    caps(Some(db))
        .into_iter()
        .filter(|cap| {
            !cap.entry().idle() || cap.bits().iter().any(|w| w.load(Ordering::Acquire) != 0)
        })
        .map(|cap| cap.name())
        .collect()
}

/// Databases that have caps with counts pending, for the launcher.
pub fn databases_with_pending() -> Vec<u32> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    sorted(
        seg.live()
            .filter(|e| e.flush.idle() && !e.pending().is_zero())
            .map(|e| e.database())
            .filter(|&d| d != 0)
            .collect(),
    )
}

/// Every database with a live cap.
pub fn databases() -> Vec<u32> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    sorted(seg.live().map(|e| e.database()).collect())
}

/// How full the directory and the arena are.
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    pub caps: u32,
    pub max_caps: u32,
    pub free_pages: u64,
    pub pages: u32,
}

pub fn usage() -> Usage {
    let Some(seg) = segment() else {
        return Usage::default();
    };
    Usage {
        caps: seg.live().count() as u32,
        max_caps: seg.max_caps(),
        free_pages: directory_locked(SHARED, || seg.buddy().free_pages()),
        pages: seg.pages(),
    }
}

/// Test support: reclaims the entry of `cap` now if nothing refers to it (its pending counts
/// go, as for a dropped database).
#[cfg(any(test, feature = "pg_test"))]
pub fn reclaim_now(cap: CapRef) -> bool {
    let Some(seg) = segment() else { return false };
    directory_locked(EXCLUSIVE, || {
        seg.entry(cap.entry).state.cap_ref(cap.entry) == cap && seg.try_reclaim(cap.entry, true)
    })
}

/// Test support: the counted pins of entry `entry`, and whether it is LOCKED.
#[cfg(any(test, feature = "pg_test"))]
pub fn pin_state(entry: u32) -> (u64, bool) {
    use stage_e_core::state::{LOCKED, PINS};
    let s = segment().map_or(0, |seg| seg.entry(entry).state.load());
    (s & PINS, s & LOCKED != 0)
}
