//! Shared memory: per-database pools of slot records, occupancy bitmaps and counters.
//!
//! Sized from the postmaster GUCs at start-up, so it cannot be a compile-time `PgLwLock<[T; N]>`:
//! the request and startup hooks below are the pg_stat_statements pattern. Everything in the
//! segment is an atomic, so the hot path takes no LWLock; each field's comment says who writes it.
//!
//! Layout (all 8-byte aligned):
//! `Header | PoolHeader × max_databases | bitmap words × max_databases | SlotRecord × max_slots × max_databases`
//!
//! A pool is keyed by database OID today. Named caps will key pools by (database, name) and add
//! entries to the same directory; nothing below assumes one pool per database beyond the key.

use crate::gucs;
use crate::occupancy;
use pgrx::pg_sys;
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicPtr, AtomicU32, AtomicU64, Ordering};

const SEGMENT_NAME: &std::ffi::CStr = c"stage_e_slots";

#[repr(C)]
struct Header {
    max_slots: u32,
    max_databases: u32,
    words_per_pool: u32,
    _pad: u32,
}

/// Counted since server start, per pool. Incremented with relaxed atomics: each is an
/// independent tally, read only for reporting.
#[repr(C)]
#[derive(Default)]
pub struct Counters {
    pub acquired: AtomicU64,
    pub throttled: AtomicU64,
    pub released: AtomicU64,
    pub foreign_releases: AtomicU64,
    pub released_by_exit: AtomicU64,
}

impl Counters {
    pub fn bump(counter: &AtomicU64, by: u64) {
        counter.fetch_add(by, Ordering::Relaxed);
    }
}

#[repr(C)]
struct PoolHeader {
    /// 0 = unused. Goes from 0 to a database OID once (CAS) and never back until restart.
    dboid: AtomicU32,
    _pad: u32,
    counters: Counters,
}

/// Who holds a slot through the extension. Written only by the backend whose claim set the
/// slot's bit, before the bit is cleared, so a reader that sees the bit set sees its owner's
/// record (or zeros while the owner is between claim and lock).
#[repr(C)]
pub struct SlotRecord {
    pid: AtomicI32,
    _pad: u32,
    acquired_at: AtomicI64,
}

impl SlotRecord {
    pub fn set(&self, pid: i32, acquired_at: i64) {
        self.acquired_at.store(acquired_at, Ordering::Relaxed);
        self.pid.store(pid, Ordering::Release);
    }

    pub fn clear(&self) {
        self.pid.store(0, Ordering::Release);
        self.acquired_at.store(0, Ordering::Relaxed);
    }

    /// `(pid, acquired_at)`, pid 0 when nobody holds the slot through the extension.
    pub fn get(&self) -> (i32, i64) {
        let pid = self.pid.load(Ordering::Acquire);
        (pid, self.acquired_at.load(Ordering::Relaxed))
    }
}

/// One database's slots, bitmap and counters; `'static` because the segment lives until the
/// postmaster exits.
#[derive(Clone, Copy)]
pub struct Pool {
    header: &'static PoolHeader,
    bits: &'static [AtomicU64],
    records: &'static [SlotRecord],
}

impl Pool {
    pub fn bits(&self) -> &'static [AtomicU64] {
        self.bits
    }

    pub fn counters(&self) -> &'static Counters {
        &self.header.counters
    }

    pub fn record(&self, slot: u32) -> &'static SlotRecord {
        &self.records[slot as usize]
    }
}

/// Every database entry is taken.
#[derive(Debug)]
pub struct PoolsFull {
    pub max_databases: u32,
}

/// Set in every process by the startup hook (children inherit it through fork). Null means
/// the library was not preloaded, and every SQL function refuses to run.
static SEGMENT: AtomicPtr<Header> = AtomicPtr::new(std::ptr::null_mut());

static mut PREV_SHMEM_REQUEST_HOOK: pg_sys::shmem_request_hook_type = None;
static mut PREV_SHMEM_STARTUP_HOOK: pg_sys::shmem_startup_hook_type = None;

fn segment_size(max_slots: u32, max_databases: u32) -> usize {
    let words = occupancy::words_for(max_slots);
    let dbs = max_databases as usize;
    size_of::<Header>()
        + dbs * size_of::<PoolHeader>()
        + dbs * words * size_of::<AtomicU64>()
        + dbs * max_slots as usize * size_of::<SlotRecord>()
}

/// Bytes of shared memory the extension requests with the current settings.
pub fn requested_bytes() -> usize {
    segment_size(gucs::max_slots(), gucs::max_databases())
}

/// Registers the hooks; called from `_PG_init` while preloading, after the GUCs are defined.
pub fn init() {
    // SAFETY: _PG_init runs single-threaded in the postmaster; chaining the previous hooks
    // keeps other extensions' shared memory working.
    unsafe {
        PREV_SHMEM_REQUEST_HOOK = pg_sys::shmem_request_hook;
        pg_sys::shmem_request_hook = Some(shmem_request);
        PREV_SHMEM_STARTUP_HOOK = pg_sys::shmem_startup_hook;
        pg_sys::shmem_startup_hook = Some(shmem_startup);
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
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn shmem_startup() {
    // SAFETY: ShmemInitStruct under AddinShmemInitLock is the documented way to create or
    // attach an add-in segment; the first process to get it (found = false) zeroes it, which
    // is a valid state for every field (all atomics, OID 0 = unused entry).
    unsafe {
        if let Some(prev) = PREV_SHMEM_STARTUP_HOOK {
            prev();
        }
        let (max_slots, max_databases) = (gucs::max_slots(), gucs::max_databases());
        let size = segment_size(max_slots, max_databases);
        let lock = &raw mut (*pg_sys::MainLWLockArray.add(21)).lock; // AddinShmemInitLock
        pg_sys::LWLockAcquire(lock, pg_sys::LWLockMode::LW_EXCLUSIVE);
        let mut found = false;
        let base = pg_sys::ShmemInitStruct(SEGMENT_NAME.as_ptr(), size, &mut found) as *mut Header;
        if !found {
            std::ptr::write_bytes(base as *mut u8, 0, size);
            (*base).max_slots = max_slots;
            (*base).max_databases = max_databases;
            (*base).words_per_pool = occupancy::words_for(max_slots) as u32;
        }
        pg_sys::LWLockRelease(lock);
        SEGMENT.store(base, Ordering::Release);
    }
}

/// Whether this process is attached to the segment (false when not preloaded).
pub fn attached() -> bool {
    !SEGMENT.load(Ordering::Acquire).is_null()
}

struct Segment {
    header: &'static Header,
    pools: &'static [PoolHeader],
    words: &'static [AtomicU64],
    records: &'static [SlotRecord],
}

fn segment() -> Option<Segment> {
    let base = SEGMENT.load(Ordering::Acquire);
    if base.is_null() {
        return None;
    }
    // SAFETY: the startup hook sized the segment from these same header fields, the header is
    // written before SEGMENT is published and never changes, and the segment outlives us.
    unsafe {
        let header = &*base;
        let dbs = header.max_databases as usize;
        let words = header.words_per_pool as usize;
        let slots = header.max_slots as usize;
        let pools_ptr = (base as *mut u8).add(size_of::<Header>()) as *const PoolHeader;
        let words_ptr = pools_ptr.add(dbs) as *const AtomicU64;
        let records_ptr = words_ptr.add(dbs * words) as *const SlotRecord;
        Some(Segment {
            header,
            pools: std::slice::from_raw_parts(pools_ptr, dbs),
            words: std::slice::from_raw_parts(words_ptr, dbs * words),
            records: std::slice::from_raw_parts(records_ptr, dbs * slots),
        })
    }
}

impl Segment {
    fn pool_at(&self, i: usize) -> Pool {
        let words = self.header.words_per_pool as usize;
        let slots = self.header.max_slots as usize;
        Pool {
            header: &self.pools[i],
            bits: &self.words[i * words..(i + 1) * words],
            records: &self.records[i * slots..(i + 1) * slots],
        }
    }
}

/// The pool of database `dboid`. With `create`, takes a free entry on first use.
///
/// Creators always try the *first* free entry, and entries never return to free, so two
/// backends of one database racing here both land on the same entry: no duplicate pools.
pub fn pool(dboid: pg_sys::Oid, create: bool) -> Result<Option<Pool>, PoolsFull> {
    let Some(seg) = segment() else {
        return Ok(None);
    };
    let me = dboid.to_u32();
    for (i, entry) in seg.pools.iter().enumerate() {
        let mut owner = entry.dboid.load(Ordering::Acquire);
        if owner == 0 {
            if !create {
                return Ok(None);
            }
            owner = match entry
                .dboid
                .compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => me,
                Err(now) => now,
            };
        }
        if owner == me {
            return Ok(Some(seg.pool_at(i)));
        }
    }
    if !create {
        return Ok(None);
    }
    Err(PoolsFull {
        max_databases: seg.header.max_databases,
    })
}

// The benchmark's memory target is per slot per database: keep the record at 16 bytes.
const _: () = assert!(size_of::<SlotRecord>() == 16);
const _: () =
    assert!(size_of::<Header>().is_multiple_of(8) && size_of::<PoolHeader>().is_multiple_of(8));
