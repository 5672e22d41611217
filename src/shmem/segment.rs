//! The segment: its header, where its parts are, and how a process attaches to it.
//!
//! Sized from postmaster settings at start (the pg_stat_statements pattern: a request hook, and a
//! startup hook, which is `persist`'s: it attaches here, then restores what was saved). One
//! `Layout` (`stage_e_core::layout`) both sizes the segment and finds its parts, from counts the
//! creator writes into the header. The startup hook runs in the postmaster at start and after every
//! crash reset (when the segment may move); children inherit the attached view through fork. The
//! first process to create the segment zeroes it, which is a valid state for every field (atomics;
//! database 0 = a free entry), then frees the arena.
//!
//! Three LWLocks of our tranche: the *directory* lock (shared to look a cap up on a cache miss,
//! exclusive to create, grow or reclaim one: `caps`), the *waits* lock (joining and leaving
//! a cap's queue: `waitq`) and the *adapt* lock (the policies of caps: adaptive ones, `policies`, and rate policies, `rates`). The hot
//! path takes none.

use super::entry::{CapEntry, SlotRecord};
use super::records::{
    HazardSlot, Launcher, Lifecycle, PolicyRecord, RateHeader, RatePolicyRecord, ShareNote,
    WaiterRecord, POLICY_SIZE, RATE_POLICY_SIZE,
};
use crate::gucs;
use pgrx::pg_sys;
use stage_e_core::arena::{self, Buddy};
use stage_e_core::directory::{self, Index};
use stage_e_core::fair::ShareRecord;
use stage_e_core::layout::{self, Counts, Layout, Sizes};
use stage_e_core::lease::{token_base, LeaseRecord};
use stage_e_core::lifecycle::TokenCounter;
use stage_e_core::occupancy;
use stage_e_core::rate::{self, RateRecord};
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering};

const SEGMENT_NAME: &std::ffi::CStr = c"stage_e_slots";
const LOCK_TRANCHE: &std::ffi::CStr = c"stage_e_slots";

/// Written once by the segment's creator, then read-only; but for the launcher's fields.
/// Cache-line aligned, so that the cap entries after it are too.
#[repr(C, align(64))]
pub(super) struct Header {
    counts: Counts,
    pub(super) top_order: u32,
    /// The last flush id handed out (ids increase across the server).
    pub(super) last_flush_id: AtomicU64,
    pub(super) launcher: Launcher,
    pub(super) lifecycle: Lifecycle,
    /// The last fencing token handed out, of any cap (`leases`).
    pub(super) tokens: TokenCounter,
    pub(super) rates: RateHeader,
    /// The pool of share records' head (`stage_e_core::fair::PoolHead::pack`; `shares`).
    pub(super) share_pool: AtomicU64,
}

const _: () = assert!(size_of::<Header>().is_multiple_of(layout::CACHE_LINE));

const SIZES: Sizes = Sizes {
    header: size_of::<Header>(),
    entry: size_of::<CapEntry>(),
    waiter: size_of::<WaiterRecord>(),
    lease: size_of::<LeaseRecord>(),
    // A live share: its state (`stage_e_core::fair`) and its note, in two arrays.
    share: size_of::<ShareRecord>() + size_of::<ShareNote>(),
    policy: POLICY_SIZE,
    rate_policy: RATE_POLICY_SIZE,
    rate: size_of::<RateRecord>(),
    hazard: size_of::<HazardSlot>(),
};

/// The counts the current settings ask for.
fn counts_from_settings() -> (Counts, u32) {
    let top_order = arena::order_for(gucs::max_slots());
    // One waiter record and one hazard slot per PGPROC of a backend or background worker (they
    // come first in the PGPROC array, MaxBackends of them); any other process pins by counting.
    // SAFETY: MaxBackends is final when shared memory is requested (PG 15+).
    let backends = unsafe { pg_sys::MaxBackends }.max(1) as u32;
    let counts = Counts {
        caps: gucs::max_caps(),
        waiters: backends,
        leases: gucs::max_leases(),
        shares: gucs::max_shares(),
        policies: gucs::max_adaptive_caps(),
        rate_policies: gucs::max_rate_policies(),
        rate_records: rate::records_for(gucs::max_rate_keys()) as u32,
        hazards: backends,
        index_len: directory::index_len(gucs::max_caps()) as u32,
        pages: arena::pages_for(gucs::slot_memory_bytes(), top_order),
    };
    (counts, top_order)
}

/// Bytes of shared memory the extension requests with the current settings.
fn requested_bytes() -> usize {
    Layout::new(counts_from_settings().0, SIZES).size()
}

/// The parts of the attached segment, found once per attach (the hot path asks for them
/// several times per call).
pub(super) struct Segment {
    pub(super) header: &'static Header,
    pub(super) entries: &'static [CapEntry],
    pub(super) waiters: &'static [WaiterRecord],
    pub(super) leases: &'static [LeaseRecord],
    /// The share records (plain data, not atomics: changed only under the exclusive waits
    /// lock, read under it; `shares`), and how many.
    pub(super) shares: *mut ShareRecord,
    pub(super) shares_len: usize,
    /// Each share record's note (name and counts), same index.
    pub(super) share_notes: &'static [ShareNote],
    pub(super) policies: &'static [PolicyRecord],
    pub(super) rate_policies: &'static [RatePolicyRecord],
    pub(super) rate_records: &'static [RateRecord],
    pub(super) rate_locks: &'static [AtomicU32],
    pub(super) hazards: &'static [HazardSlot],
    index: &'static [AtomicU32],
    meta: &'static [AtomicU32],
    arena: *mut u8,
}

// SAFETY: every part is shared memory made of atomics, or the arena's base address, which never
// changes; a backend is single-threaded, and the unit tests do not touch the segment.
unsafe impl Sync for Segment {}
// SAFETY: as above.
unsafe impl Send for Segment {}

/// Set by the startup hook each time shared memory is (re)created, inherited by children. Null
/// means the library was not preloaded, and every SQL function refuses to run.
static VIEW: AtomicPtr<Segment> = AtomicPtr::new(std::ptr::null_mut());
/// The directory LWLock (looking up, creating, growing and reclaiming caps).
static DIRECTORY_LOCK: AtomicPtr<pg_sys::LWLock> = AtomicPtr::new(std::ptr::null_mut());
/// The waits LWLock (joining and leaving a cap's queue of waiters).
static WAITS_LOCK: AtomicPtr<pg_sys::LWLock> = AtomicPtr::new(std::ptr::null_mut());
/// The adapt LWLock (adaptive caps' policy records).
static ADAPT_LOCK: AtomicPtr<pg_sys::LWLock> = AtomicPtr::new(std::ptr::null_mut());

static mut PREV_SHMEM_REQUEST_HOOK: pg_sys::shmem_request_hook_type = None;

/// The attached segment, if any.
pub(super) fn segment() -> Option<&'static Segment> {
    // SAFETY: VIEW is null or a leaked Segment for the current segment (see `attach`).
    unsafe { VIEW.load(Ordering::Acquire).as_ref() }
}

/// Whether this process is attached to the segment (false when not preloaded).
pub fn attached() -> bool {
    !VIEW.load(Ordering::Acquire).is_null()
}

/// Registers the request hook (the startup hook, which attaches and then restores what the last
/// clean shutdown saved, is `persist`'s); called from `persist::init`.
pub(super) fn install_request_hook() {
    // SAFETY: _PG_init runs single-threaded in the postmaster; chaining the previous hook keeps
    // other extensions' shared memory working.
    unsafe {
        PREV_SHMEM_REQUEST_HOOK = pg_sys::shmem_request_hook;
        pg_sys::shmem_request_hook = Some(shmem_request);
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn shmem_request() {
    // SAFETY: called once by the postmaster after postmaster GUCs are final.
    unsafe {
        if let Some(prev) = PREV_SHMEM_REQUEST_HOOK {
            prev();
        }
        pg_sys::RequestAddinShmemSpace(requested_bytes());
        pg_sys::RequestNamedLWLockTranche(LOCK_TRANCHE.as_ptr(), 3);
    }
}

/// Creates or attaches the segment, from the startup hook (`persist`): at start and after every
/// crash reset in the postmaster, and in a process not forked from it. Returns it.
pub(super) fn attach_at_startup() -> &'static Segment {
    let (counts, top_order) = counts_from_settings();
    let size = Layout::new(counts, SIZES).size();
    // SAFETY: ShmemInitStruct under AddinShmemInitLock is the documented way to create or attach
    // an add-in segment; the first process to get it (found = false) zeroes it and writes the
    // header before anyone else can look (they wait for the lock), and the header never changes.
    let (base, found) = unsafe {
        let lock = &raw mut (*pg_sys::MainLWLockArray.add(21)).lock; // AddinShmemInitLock
        pg_sys::LWLockAcquire(lock, pg_sys::LWLockMode::LW_EXCLUSIVE);
        let mut found = false;
        let raw = pg_sys::ShmemInitStruct(SEGMENT_NAME.as_ptr(), size, &mut found) as *mut u8;
        let base = raw.add(layout::to_cache_line(raw as usize));
        if !found {
            std::ptr::write_bytes(raw, 0, size);
            let header = base as *mut Header;
            (*header).counts = counts;
            (*header).top_order = top_order;
        }
        pg_sys::LWLockRelease(lock);
        let locks = pg_sys::GetNamedLWLockTranche(LOCK_TRANCHE.as_ptr());
        DIRECTORY_LOCK.store(&raw mut (*locks).lock, Ordering::Release);
        WAITS_LOCK.store(&raw mut (*locks.add(1)).lock, Ordering::Release);
        ADAPT_LOCK.store(&raw mut (*locks.add(2)).lock, Ordering::Release);
        (base, found)
    };
    // SAFETY: `base` is the segment just sized for its header's counts.
    let view = unsafe { Segment::at(base) };
    // Leaked on purpose: it lives as long as the segment, and one is made per crash reset.
    VIEW.store(Box::into_raw(Box::new(view)), Ordering::Release);
    let seg = segment().expect("just attached");
    if !found {
        seg.buddy().reset();
        seg.header.tokens.start(token_base(now()));
    }
    seg
}

impl Segment {
    /// The parts of the segment at `base`.
    ///
    /// # Safety
    /// `base` is the cache-line aligned start of a segment sized by `Layout::new` for the counts
    /// in its header, which are written and never change again; it lives for the process.
    unsafe fn at(base: *mut u8) -> Segment {
        // SAFETY: per the caller, every part lies inside the segment at the offset the layout
        // gives, which is aligned for its type (the header and hazards to a cache line, the
        // rest to 8 bytes; the rate locks, after 24-byte records, to 4), and is valid zeroed
        // or as last written (atomics only, but the share records, plain data that only the
        // waits lock's holder touches).
        unsafe {
            let header = &*(base as *const Header);
            let c = header.counts;
            let l = Layout::new(c, SIZES);
            let part = |offset: usize| base.add(offset);
            Segment {
                header,
                entries: std::slice::from_raw_parts(part(l.entries).cast(), c.caps as usize),
                waiters: std::slice::from_raw_parts(part(l.waiters).cast(), c.waiters as usize),
                leases: std::slice::from_raw_parts(part(l.leases).cast(), c.leases as usize),
                shares: part(l.shares).cast(),
                shares_len: c.shares as usize,
                share_notes: std::slice::from_raw_parts(
                    part(l.shares + c.shares as usize * size_of::<ShareRecord>()).cast(),
                    c.shares as usize,
                ),
                policies: std::slice::from_raw_parts(part(l.policies).cast(), c.policies as usize),
                rate_policies: std::slice::from_raw_parts(
                    part(l.rate_policies).cast(),
                    c.rate_policies as usize,
                ),
                rate_records: std::slice::from_raw_parts(
                    part(l.rates).cast(),
                    c.rate_records as usize,
                ),
                rate_locks: std::slice::from_raw_parts(
                    part(l.rate_locks).cast(),
                    c.rate_records as usize / rate::BUCKET,
                ),
                hazards: std::slice::from_raw_parts(part(l.hazards).cast(), c.hazards as usize),
                index: std::slice::from_raw_parts(part(l.index).cast(), c.index_len as usize),
                meta: std::slice::from_raw_parts(part(l.meta).cast(), l.meta_words),
                arena: part(l.arena),
            }
        }
    }

    pub(super) fn max_caps(&self) -> u32 {
        self.header.counts.caps
    }

    pub(super) fn pages(&self) -> u32 {
        self.header.counts.pages
    }

    /// The share records, read under the waits lock (either mode; `shares` changes them under
    /// it, exclusively).
    pub(super) fn share_records_shared(&self) -> &[ShareRecord] {
        // SAFETY: `shares_len` records inside the segment, 8-aligned, valid zeroed (`attach`);
        // writers hold the waits lock exclusively, so under it nothing changes them.
        unsafe { std::slice::from_raw_parts(self.shares, self.shares_len) }
    }

    /// The name of the live share `digest` of the cap in entry `e`, under the waits lock
    /// (either mode); None for the unnamed share or one not live.
    pub(super) fn share_name(&self, e: &CapEntry, digest: u64) -> Option<String> {
        stage_e_core::fair::live_shares(&e.clock(), self.share_records_shared())
            .find(|(_, s)| s.digest == digest)
            .and_then(|(i, _)| self.share_notes[i].name())
    }

    pub(super) fn entry(&self, i: u32) -> &'static CapEntry {
        &self.entries[i as usize]
    }

    pub(super) fn buddy(&self) -> Buddy<'static> {
        Buddy::over(self.meta, self.pages(), self.header.top_order)
    }

    pub(super) fn index(&self) -> Index<'static> {
        Index::over(self.index)
    }

    /// Entries in use.
    pub(super) fn live(&self) -> impl Iterator<Item = &'static CapEntry> {
        self.entries.iter().filter(|e| e.in_use())
    }

    /// The holder records and occupancy bitmap of `e`'s block (pinned, or under the exclusive
    /// directory lock).
    pub(super) fn block(&self, e: &CapEntry) -> (&'static [SlotRecord], &'static [AtomicU64]) {
        let (page, capacity) = e.block();
        // SAFETY: the block was allocated for `capacity` slots (see `arena::capacity`) and stays
        // allocated while the entry is pinned; records are 8-aligned, the bitmap follows them.
        unsafe {
            let start = self.arena.add(page as usize * arena::PAGE);
            let records = std::slice::from_raw_parts(start as *const SlotRecord, capacity as usize);
            let bits = std::slice::from_raw_parts(
                start.add(capacity as usize * arena::RECORD) as *const AtomicU64,
                occupancy::words_for(capacity),
            );
            (records, bits)
        }
    }
}

/// The server's last token (0 when not attached).
pub(super) fn last_token() -> u64 {
    segment().map_or(0, |seg| seg.header.tokens.last())
}

/// Tokens go on above `floor`.
pub(super) fn raise_tokens(floor: u64) {
    if let Some(seg) = segment() {
        seg.header.tokens.raise(floor);
    }
}

/// LWLock modes.
pub(super) const SHARED: pg_sys::LWLockMode::Type = pg_sys::LWLockMode::LW_SHARED;
pub(super) const EXCLUSIVE: pg_sys::LWLockMode::Type = pg_sys::LWLockMode::LW_EXCLUSIVE;

/// Runs `f` holding the directory lock in `mode`.
pub(super) fn directory_locked<R>(mode: pg_sys::LWLockMode::Type, f: impl FnOnce() -> R) -> R {
    locked_by(&DIRECTORY_LOCK, mode, f)
}

/// Runs `f` holding the waits lock in `mode`.
pub(super) fn waits_locked<R>(mode: pg_sys::LWLockMode::Type, f: impl FnOnce() -> R) -> R {
    locked_by(&WAITS_LOCK, mode, f)
}

/// Runs `f` holding the adapt lock in `mode`.
pub(super) fn adapt_locked<R>(mode: pg_sys::LWLockMode::Type, f: impl FnOnce() -> R) -> R {
    locked_by(&ADAPT_LOCK, mode, f)
}

fn locked_by<R>(
    which: &AtomicPtr<pg_sys::LWLock>,
    mode: pg_sys::LWLockMode::Type,
    f: impl FnOnce() -> R,
) -> R {
    struct Guard(*mut pg_sys::LWLock);
    impl Drop for Guard {
        fn drop(&mut self) {
            // SAFETY: acquired below by this process; also released if `f` unwinds.
            unsafe { pg_sys::LWLockRelease(self.0) };
        }
    }
    let lock = which.load(Ordering::Acquire);
    // SAFETY: the tranche's lock lives in the main LWLock array for the server's lifetime.
    unsafe { pg_sys::LWLockAcquire(lock, mode) };
    let _guard = Guard(lock);
    f()
}

fn now() -> i64 {
    // SAFETY: reads the clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// A plain sleep of `us` microseconds (no lock or pin may be held by the caller that another
/// process needs to make progress).
pub(super) fn nap(us: i64) {
    // SAFETY: pg_usleep only sleeps.
    unsafe { pg_sys::pg_usleep(us as _) };
}
