//! Shared memory: per-database pools of slot records, occupancy bitmaps and counters.
//!
//! Sized from the postmaster GUCs at start-up, so it cannot be a compile-time `PgLwLock<[T; N]>`:
//! the request and startup hooks below are the pg_stat_statements pattern. Everything in the
//! segment is an atomic, so the hot path takes no LWLock; each field's comment says who writes it.
//!
//! Layout (all 8-byte aligned):
//! `Header | PoolHeader × max_databases | bitmap words × max_databases | SlotRecord × max_slots × max_databases`
//!
//! The directory of pools is keyed by database OID. Lookups take no lock; taking a free entry
//! (a database's first `stage_e_try_slot`) and reclaiming the entry of a dropped database take
//! the directory's LWLock, so two backends of one database never create two pools.

use crate::counters::{self, CounterValues, FlushState};
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

/// A set of counters, one per column of `stage_e_stats()`. Incremented with relaxed atomics:
/// each is an independent monotonic tally, read only for reporting and flushing.
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

    fn cells(&self) -> [&AtomicU64; 5] {
        [
            &self.acquired,
            &self.throttled,
            &self.released,
            &self.foreign_releases,
            &self.released_by_exit,
        ]
    }

    pub fn load(&self) -> CounterValues {
        CounterValues::from_array(self.cells().map(|c| c.load(Ordering::Relaxed)))
    }

    fn store(&self, v: CounterValues) {
        for (c, x) in self.cells().into_iter().zip(v.to_array()) {
            c.store(x, Ordering::Relaxed);
        }
    }
}

#[repr(C)]
struct PoolHeader {
    /// 0 = free. Set to a database OID under the directory lock by its first `stage_e_try_slot`,
    /// and back to 0 (by [`reclaim`]) only once that database has been dropped.
    dboid: AtomicU32,
    /// Pid of the process whose open transaction is flushing this pool; 0 = none. Only that
    /// process writes the fields below it, so they need no lock among writers.
    flusher: AtomicI32,
    /// Counted since server start (the hot path writes only these).
    counters: Counters,
    /// Pending counts saved at the last clean shutdown, not yet in the table.
    carried: Counters,
    /// Value of `counters` at the last committed flush.
    flushed: Counters,
    /// Delta written by the flush in progress, under the id `inflight_id` (0 = none).
    inflight: Counters,
    inflight_id: AtomicU64,
    last_flush_id: AtomicU64,
    /// Seqlock over carried/flushed/inflight: odd while the flusher updates them.
    version: AtomicU64,
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

    pub fn database(&self) -> u32 {
        self.header.dboid.load(Ordering::Acquire)
    }

    pub fn flush_state(&self) -> FlushState {
        let h = self.header;
        loop {
            let before = h.version.load(Ordering::Acquire);
            if before % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let state = FlushState {
                counters: h.counters.load(),
                carried: h.carried.load(),
                flushed: h.flushed.load(),
                inflight: h.inflight.load(),
                inflight_id: h.inflight_id.load(Ordering::Relaxed),
            };
            std::sync::atomic::fence(Ordering::Acquire);
            if h.version.load(Ordering::Relaxed) == before {
                return state;
            }
        }
    }

    /// Pid of the process flushing this pool now, if any.
    pub fn flusher(&self) -> Option<i32> {
        Some(self.header.flusher.load(Ordering::Acquire)).filter(|&p| p != 0)
    }

    /// Makes `pid` this pool's only flusher; false if another flush is in progress.
    pub fn try_begin_flush(&self, pid: i32) -> bool {
        self.header
            .flusher
            .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// A unique, increasing id for the next flush (microseconds, bumped past the last id).
    pub fn next_flush_id(&self, now_us: u64) -> u64 {
        let last = self.header.last_flush_id.load(Ordering::Relaxed);
        let id = now_us.max(last + 1);
        self.header.last_flush_id.store(id, Ordering::Relaxed);
        id
    }

    /// Runs `f` on the bookkeeping fields as one seqlock write. Only the flusher calls this.
    fn write(&self, f: impl FnOnce(&PoolHeader)) {
        let h = self.header;
        h.version.fetch_add(1, Ordering::AcqRel);
        f(h);
        h.version.fetch_add(1, Ordering::Release);
    }

    pub fn set_inflight(&self, id: u64, delta: CounterValues) {
        self.write(|h| {
            h.inflight.store(delta);
            h.inflight_id.store(id, Ordering::Relaxed);
        });
    }

    /// The flush's transaction committed: what it read is now in the table.
    pub fn commit_flush(&self, read: &FlushState) {
        self.write(|h| {
            h.flushed.store(read.counters);
            h.carried.store(h.carried.load().minus(read.carried));
            h.inflight.store(CounterValues::default());
            h.inflight_id.store(0, Ordering::Relaxed);
        });
        self.header.flusher.store(0, Ordering::Release);
    }

    /// The flush's transaction aborted: its delta is still pending.
    pub fn abort_flush(&self) {
        self.write(|h| {
            h.inflight.store(CounterValues::default());
            h.inflight_id.store(0, Ordering::Relaxed);
        });
        self.header.flusher.store(0, Ordering::Release);
    }

    /// Returns the entry to its zeroed, free state. Only [`reclaim`] calls this, holding the
    /// directory lock and the flusher role, for a database nobody can be connected to.
    fn wipe(&self) {
        for w in self.bits {
            w.store(0, Ordering::Relaxed);
        }
        for r in self.records {
            r.clear();
        }
        let zero = CounterValues::default();
        let h = self.header;
        h.counters.store(zero);
        self.write(|h| {
            h.carried.store(zero);
            h.flushed.store(zero);
            h.inflight.store(zero);
            h.inflight_id.store(0, Ordering::Relaxed);
        });
        h.last_flush_id.store(0, Ordering::Relaxed);
        h.flusher.store(0, Ordering::Relaxed);
        h.dboid.store(0, Ordering::Release);
    }

    /// Counts restored from the pending file of the last clean shutdown.
    fn carry(&self, v: CounterValues) {
        self.write(|h| h.carried.store(h.carried.load().plus(v)));
    }
}

/// Every pool in use, for the flush launcher and the shutdown file.
pub fn pools() -> Vec<Pool> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    (0..seg.pools.len())
        .filter(|&i| seg.pools[i].dboid.load(Ordering::Acquire) != 0)
        .map(|i| seg.pool_at(i))
        .collect()
}

/// Every database entry is taken.
#[derive(Debug)]
pub struct PoolsFull {
    pub max_databases: u32,
}

/// Set in every process by the startup hook (children inherit it through fork). Null means
/// the library was not preloaded, and every SQL function refuses to run.
static SEGMENT: AtomicPtr<Header> = AtomicPtr::new(std::ptr::null_mut());

/// The lock of the database directory (taking and reclaiming entries; never the acquire path).
static DIRECTORY_LOCK: AtomicPtr<pg_sys::LWLock> = AtomicPtr::new(std::ptr::null_mut());
const LOCK_TRANCHE: &std::ffi::CStr = c"stage_e_slots";

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
        pg_sys::RequestNamedLWLockTranche(LOCK_TRANCHE.as_ptr(), 1);
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
        let directory = &raw mut (*pg_sys::GetNamedLWLockTranche(LOCK_TRANCHE.as_ptr())).lock;
        DIRECTORY_LOCK.store(directory, Ordering::Release);
        SEGMENT.store(base, Ordering::Release);
        if !pg_sys::IsUnderPostmaster {
            // The postmaster (at start and after a crash reset): take back the counts saved at
            // the last clean shutdown, and save them again at the next one.
            restore_pending();
            pg_sys::on_shmem_exit(Some(save_pending), pg_sys::Datum::from(0));
        }
    }
}

/// Pending counts survive a clean shutdown here, in the data directory (the postmaster's
/// working directory), as pg_stat_statements keeps its dump in pg_stat/.
const PENDING_FILE: &str = "pg_stat/stage_e_slots.pending";

fn restore_pending() {
    let Ok(text) = std::fs::read_to_string(PENDING_FILE) else {
        return;
    };
    // Read once: after a crash the file must not be applied a second time.
    let _ = std::fs::remove_file(PENDING_FILE);
    let Some(entries) = counters::decode(&text) else {
        pgrx::log!("stage_e_slots: ignoring {PENDING_FILE}: not in the expected format");
        return;
    };
    for (db, values) in entries {
        // The postmaster, before any backend: every database in the file is kept (a dropped one
        // is reclaimed by the launcher's first round).
        if let Ok(Some(pool)) = create_pool(pg_sys::Oid::from(db), |_| true) {
            pool.carry(values);
        }
    }
}

/// Postmaster exit: at a clean shutdown (code 0) every backend and worker is gone, so each
/// pool's pending counts are final; write them for the next start. A crash (code != 0) writes
/// nothing: at most one flush interval of counts is lost, as documented.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn save_pending(code: i32, _arg: pg_sys::Datum) {
    if code != 0 {
        return;
    }
    let pending: Vec<(u32, CounterValues)> = pools()
        .into_iter()
        .map(|p| (p.database(), p.flush_state().pending(None)))
        .filter(|(_, v)| !v.is_zero())
        .collect();
    if pending.is_empty() {
        return;
    }
    let tmp = format!("{PENDING_FILE}.tmp");
    let written = std::fs::write(&tmp, counters::encode(&pending))
        .and_then(|()| std::fs::rename(&tmp, PENDING_FILE));
    match written {
        Ok(()) => pgrx::log!(
            "stage_e_slots: saved pending counters of {} database(s) to {PENDING_FILE}",
            pending.len()
        ),
        Err(e) => pgrx::warning!("stage_e_slots: could not write {PENDING_FILE}: {e}"),
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
    /// The entry of database `db`: a scan of every entry, since reclaimed entries leave gaps.
    fn find(&self, db: u32) -> Option<usize> {
        self.pools
            .iter()
            .position(|e| e.dboid.load(Ordering::Acquire) == db)
    }

    /// Under the directory lock: the entry of `db`, or the first free one, now `db`'s. The
    /// lock is what keeps two backends of one database from taking two entries.
    fn find_or_take(&self, db: u32) -> Option<usize> {
        self.find(db).or_else(|| {
            let i = self.find(0)?;
            self.pools[i].dboid.store(db, Ordering::Release);
            Some(i)
        })
    }

    /// Runs `f` holding the directory lock, which serialises taking and reclaiming entries.
    fn locked<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Guard(*mut pg_sys::LWLock);
        impl Drop for Guard {
            fn drop(&mut self) {
                // SAFETY: acquired below by this process; also released if `f` unwinds.
                unsafe { pg_sys::LWLockRelease(self.0) };
            }
        }
        let lock = DIRECTORY_LOCK.load(Ordering::Acquire);
        // SAFETY: the tranche's lock lives in the main LWLock array for the server's lifetime.
        unsafe { pg_sys::LWLockAcquire(lock, pg_sys::LWLockMode::LW_EXCLUSIVE) };
        let _guard = Guard(lock);
        f()
    }

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

/// The pool of database `dboid`, found without a lock (the acquire path's lookup, once per
/// backend). None when the database has not used the extension since start.
pub fn pool(dboid: pg_sys::Oid) -> Option<Pool> {
    let seg = segment()?;
    seg.find(dboid.to_u32()).map(|i| seg.pool_at(i))
}

/// The pool of database `dboid`, taking a free entry on first use. When every entry is taken,
/// the entries of databases that no longer exist (`exists` says which) are reclaimed first.
pub fn create_pool(
    dboid: pg_sys::Oid,
    exists: impl Fn(u32) -> bool,
) -> Result<Option<Pool>, PoolsFull> {
    let Some(seg) = segment() else {
        return Ok(None);
    };
    let me = dboid.to_u32();
    if let Some(i) = seg.find(me) {
        return Ok(Some(seg.pool_at(i)));
    }
    if let Some(i) = seg.locked(|| seg.find_or_take(me)) {
        return Ok(Some(seg.pool_at(i)));
    }
    // Full. Which entries belong to dropped databases is a catalog lookup, made outside the
    // lock; each is then reclaimed under it only if it still belongs to that database.
    let dropped: Vec<u32> = seg
        .pools
        .iter()
        .map(|e| e.dboid.load(Ordering::Acquire))
        .filter(|&db| db != 0 && db != me && !exists(db))
        .collect();
    for db in dropped {
        reclaim(db);
    }
    match seg.locked(|| seg.find_or_take(me)) {
        Some(i) => Ok(Some(seg.pool_at(i))),
        None => Err(PoolsFull {
            max_databases: seg.header.max_databases,
        }),
    }
}

/// Frees the entry of database `db`, which no longer exists, dropping its pending counts with
/// a LOG line. False if it has no entry or a flush of it is in progress.
pub fn reclaim(db: u32) -> bool {
    let Some(seg) = segment() else {
        return false;
    };
    let dropped = seg.locked(|| {
        let i = seg.find(db)?;
        let pool = seg.pool_at(i);
        // Taking the flusher role shuts out a flush; nobody is connected to a dropped
        // database, so nothing else writes the entry.
        if !pool.try_begin_flush(-1) {
            return None;
        }
        let pending = pool.flush_state().pending(None);
        pool.wipe();
        Some(pending)
    });
    match dropped {
        Some(pending) => {
            pgrx::log!(
                "stage_e_slots: reclaimed the entry of dropped database {db}; dropped its pending \
                 counters ({} acquired, {} throttled)",
                pending.acquired,
                pending.throttled
            );
            true
        }
        None => false,
    }
}

// The benchmark's memory target is per slot per database: keep the record at 16 bytes.
const _: () = assert!(size_of::<SlotRecord>() == 16);
const _: () =
    assert!(size_of::<Header>().is_multiple_of(8) && size_of::<PoolHeader>().is_multiple_of(8));
