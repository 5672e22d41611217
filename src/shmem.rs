//! Shared memory: every database's caps, their slots and their counters.
//!
//! Sized from postmaster settings at start (the pg_stat_statements pattern: a request hook and
//! a startup hook). Layout, all 8-byte aligned:
//!
//! ```text
//! Header
//! CapEntry × max_caps        a cap's fixed part: database, name, lock key, pin state, where its
//!                            slots are, counters and flush bookkeeping, the waiters' queue and
//!                            load averages (712 bytes)
//! WaiterRecord × MaxBackends who waits for which cap (see "Waiting")
//! LeaseRecord × max_leases   slots held by a token, not a session (see "Leases and tokens")
//! 64 B × MaxBackends         one hazard slot per backend (see "Concurrency")
//! u32 × index_len            the (database, name) → entry index (`directory`), 2 × max_caps rounded
//!                            up to a power of two
//! u32 × 3 × pages + 25       the arena allocator's state (`arena`)
//! 256 B × pages              the arena: one block per cap holding its slots: a 16-byte holder
//!                            record per slot, then one occupancy bit per slot
//! ```
//!
//! **Size classes.** A cap's block is a power of two pages, the smallest that holds the largest
//! `n` it has been used with: n ≤ 15 takes one page (256 B), n ≤ 31 two, n ≤ 1,023 128 pages
//! (32 KiB, see `arena::capacity`). A cap used later with a larger `n` moves to a larger block
//! (its holders keep their slots). Blocks come from a buddy allocator, so the memory of
//! reclaimed caps serves caps of any size. `pages` is `stage_e_slots.slot_memory` rounded up to
//! whole blocks of `max_slots` slots (at least one).
//!
//! **Budget** at the defaults (max_caps 4096, slot_memory 2 MB, max_slots 1024): 2.9 MB of
//! entries (712 bytes each), 32 kB of index, 192 kB of lease records (max_leases 4096, 48 bytes
//! each), a waiter record and a 64-byte hazard slot per backend, 2 MB of arena and 100 kB of
//! allocator state: 5.3 MB in all (`make bench` measures it); 4,096 caps of n ≤ 15 fit at
//! once (8,192 pages), or 64 caps of n = 1,024, or any mix.
//!
//! **Concurrency.** The hot path takes no LWLock: a backend finds a cap through its local cache
//! (`session`), *pins* the entry, claims a slot bit with a CAS, asks the lock manager, and
//! unpins. A pin is published in the backend's own hazard slot (one per PGPROC): a SeqCst store
//! of (entry, generation) and a load of the entry's state word, so pinning writes nothing
//! shared, and a cached reference to a cap since reclaimed (another generation) fails and is
//! looked up again. A backend holding several pins at once (`caps`) counts them in the state
//! word instead. The directory LWLock is taken in shared mode to look a cap up on a cache miss,
//! and in exclusive mode to create, grow or reclaim one; growing and reclaiming first set the
//! entry's LOCKED bit, which stops new pins, and act only once no counted pin is left and no
//! hazard slot names the entry (the SeqCst store-then-load on both sides means one always sees
//! the other).
//!
//! **Reclaiming.** A cap with no pin, no occupied slot, nothing pending for the table and no
//! flush in progress may be reclaimed when room is needed (an entry or a block); its counts are
//! already in its counter row. A cap of a dropped database is reclaimed with its pending counts
//! (logged). Only when the caps truly in use fill `max_caps` or the arena does a create fail.

use crate::arena::{self, Buddy};
use crate::counters::{self, Carried, CounterValues, FlushState, COUNT};
use crate::directory::{self, Index};
use crate::gucs;
use crate::occupancy;
use pgrx::pg_sys;
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicPtr, AtomicU32, AtomicU64, Ordering};

const SEGMENT_NAME: &std::ffi::CStr = c"stage_e_slots";
const LOCK_TRANCHE: &std::ffi::CStr = c"stage_e_slots";

/// Cache-line aligned, so that the cap entries after it are too.
#[repr(C, align(64))]
struct Header {
    max_caps: u32,
    max_slots: u32,
    index_len: u32,
    pages: u32,
    top_order: u32,
    _pad: u32,
    /// The last flush id handed out (ids increase across the server).
    last_flush_id: AtomicU64,
    /// Set when a create found the directory crowded: the launcher flushes at once, so that
    /// idle caps' counts reach their rows and the caps become reclaimable.
    flush_requested: AtomicU32,
    /// The launcher's PGPROC, to set its latch; null when it is not running.
    launcher: AtomicPtr<pg_sys::PGPROC>,
    max_waiters: u32,
    max_hazards: u32,
    max_leases: u32,
    _pad2: u32,
}

/// One value per counter, in `CounterValues::NAMES` order. Relaxed atomics: each is an
/// independent monotonic tally, read only for reporting and flushing.
#[repr(C)]
pub struct Counters([AtomicU64; COUNT]);

/// The counters every call bumps, on cache lines of their own, with the other fields that
/// change as slots are taken: the fencing token (bumped with `acquired`) and the leases.
#[repr(C, align(64))]
struct HotCounters {
    counts: Counters,
    /// The last fencing token handed out (see "Leases and tokens").
    last_token: AtomicU64,
    /// Live leases, and no lease expires before `lease_due` (a lower bound).
    leases: AtomicU32,
    _pad: u32,
    lease_due: AtomicI64,
}

impl std::ops::Deref for HotCounters {
    type Target = Counters;
    fn deref(&self) -> &Counters {
        &self.counts
    }
}

/// Which counter to bump.
#[derive(Clone, Copy)]
pub enum Counter {
    Acquired = 0,
    Throttled = 1,
    Released = 2,
    ForeignReleases = 3,
    ReleasedByExit = 4,
    Waits = 5,
    WaitTimeouts = 6,
    /// Microseconds.
    WaitTime = 7,
    /// Microseconds.
    HoldTime = 8,
    Expired = 9,
}

impl Counters {
    pub fn bump(&self, which: Counter, by: u64) {
        self.0[which as usize].fetch_add(by, Ordering::Relaxed);
    }

    pub fn load(&self) -> CounterValues {
        CounterValues::from_array(std::array::from_fn(|i| self.0[i].load(Ordering::Relaxed)))
    }

    fn store(&self, v: CounterValues) {
        for (c, x) in self.0.iter().zip(v.to_array()) {
            c.store(x, Ordering::Relaxed);
        }
    }
}

/// The state word: generation (high 32 bits), LOCKED (bit 31), pins (bits 0-30).
const LOCKED: u64 = 1 << 31;
const PINS: u64 = LOCKED - 1;

fn generation(state: u64) -> u32 {
    (state >> 32) as u32
}

#[repr(C)]
pub struct CapEntry {
    state: AtomicU64,
    /// 0 = free entry. Written under the exclusive directory lock while LOCKED.
    dboid: AtomicU32,
    /// First int4 of the cap's advisory locks.
    key: AtomicI32,
    /// First page of the slot block, and how many slots it holds.
    block: AtomicU32,
    capacity: AtomicU32,
    name_len: AtomicU32,
    /// Pid of the process whose open transaction is flushing this cap; 0 = none, -1 = being
    /// reclaimed. Only that process writes the flush bookkeeping below.
    flusher: AtomicI32,
    hash: AtomicU64,
    name: [AtomicU64; 8],
    /// Waiters (see "Waiting" below): how many (read by every call), then the next ticket and
    /// the first [`FRONT`] of them in ticket order (the ones that may take slots). Changed
    /// under the waits lock.
    waiters: AtomicU32,
    _pad: u32,
    /// Id of the flush in progress (0 = none; its delta is `inflight`), and the seqlock over
    /// carried/flushed/inflight (odd while the flusher updates them). Rarely written; here,
    /// they fill the first cache line.
    inflight_id: AtomicU64,
    version: AtomicU64,
    /// Counted since the cap was created (the hot path writes only these), on cache lines of
    /// their own: every call bumps one, and the fields above are read by every call.
    counters: HotCounters,
    /// Pending counts saved at the last clean shutdown, not yet in the table.
    carried: Counters,
    /// Value of `counters` at the last committed flush.
    flushed: Counters,
    /// Delta written by the flush in progress.
    inflight: Counters,
    tail: AtomicU64,
    front: [Seat; FRONT],
    /// Load averages over 1, 5 and 15 minutes (f64 bits), written by the launcher only.
    load_held: [AtomicU64; 3],
    load_throttles: [AtomicU64; 3],
    load_last_throttled: AtomicU64,
    load_last_us: AtomicI64,
}

/// A lease (see "Leases and tokens"): FREE, or LIVE on slot `slot` of the cap in entry `entry`
/// at `generation`, or BUSY while one process reads and changes it.
#[repr(C)]
struct LeaseRecord {
    state: AtomicU32,
    entry: AtomicU32,
    generation: AtomicU32,
    slot: AtomicU32,
    pid: AtomicI32,
    _pad: u32,
    token: AtomicU64,
    acquired_at: AtomicI64,
    expires_at: AtomicI64,
}

const FREE: u32 = 0;
const LIVE: u32 = 1;
const BUSY: u32 = 2;

/// How many waiters at the front of a cap's queue may take slots at the same time.
const FRONT: usize = 4;

/// A waiter at the front of a cap's queue: its process (null = an empty seat), its ticket and
/// what it asks for. Written under the waits lock, read without it by the release path.
#[repr(C)]
struct Seat {
    proc_: AtomicPtr<pg_sys::PGPROC>,
    ticket: AtomicU64,
    n: AtomicU32,
    k: AtomicU32,
}

/// A backend waiting for slots of a cap, in the shared list of waiters (one per backend at
/// most). Changed under the waits lock.
#[repr(C)]
struct WaiterRecord {
    active: AtomicU32,
    entry: AtomicU32,
    pid: AtomicI32,
    n: AtomicU32,
    k: AtomicU32,
    _pad: u32,
    ticket: AtomicU64,
    since: AtomicI64,
    proc_: AtomicPtr<pg_sys::PGPROC>,
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

const _: () = assert!(size_of::<SlotRecord>() == arena::RECORD);
const _: () = assert!(size_of::<Header>().is_multiple_of(8));
const _: () = assert!(size_of::<CapEntry>().is_multiple_of(8));

/// A cap as a backend remembers it: its entry and the entry's generation at the time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CapRef {
    pub entry: u32,
    pub generation: u32,
}

/// A pinned cap: while this lives, the entry keeps its identity and its slot block.
pub struct Cap {
    entry: &'static CapEntry,
    pub cap: CapRef,
    /// This backend's hazard slot when the pin is published there; None for a counted pin.
    hazard: Option<&'static AtomicU64>,
}

impl Drop for Cap {
    fn drop(&mut self) {
        match self.hazard {
            Some(h) => h.store(0, Ordering::Release),
            None => {
                self.entry.state.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

impl Cap {
    pub fn key(&self) -> i32 {
        self.entry.key.load(Ordering::Relaxed)
    }

    pub fn database(&self) -> u32 {
        self.entry.dboid.load(Ordering::Relaxed)
    }

    pub fn name(&self) -> String {
        self.entry.name()
    }

    pub fn capacity(&self) -> u32 {
        self.entry.capacity.load(Ordering::Acquire)
    }

    pub fn counters(&self) -> &'static Counters {
        &self.entry.counters
    }

    /// The occupancy bitmap of the cap's slots.
    pub fn bits(&self) -> &'static [AtomicU64] {
        let seg = segment().expect("a pinned cap implies the segment");
        let (_, bits) = seg.block(self.entry);
        bits
    }

    pub fn record(&self, slot: u32) -> &'static SlotRecord {
        let seg = segment().expect("a pinned cap implies the segment");
        let (records, _) = seg.block(self.entry);
        &records[slot as usize]
    }

    pub fn flush_state(&self) -> FlushState {
        self.entry.flush_state()
    }

    /// Makes `pid` this cap's only flusher; false if another flush is in progress.
    pub fn try_begin_flush(&self, pid: i32) -> bool {
        self.entry
            .flusher
            .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

impl CapEntry {
    fn name(&self) -> String {
        let len = self.name_len.load(Ordering::Relaxed) as usize;
        let bytes: Vec<u8> = self
            .name
            .iter()
            .flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes())
            .take(len.min(64))
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn is(&self, db: u32, name: &str) -> bool {
        self.dboid.load(Ordering::Relaxed) == db
            && self.name_len.load(Ordering::Relaxed) as usize == name.len()
            && self.name() == name
    }

    fn set_name(&self, name: &str) {
        let mut bytes = [0u8; 64];
        bytes[..name.len()].copy_from_slice(name.as_bytes());
        for (w, chunk) in self.name.iter().zip(bytes.chunks(8)) {
            w.store(
                u64::from_le_bytes(chunk.try_into().expect("8 bytes")),
                Ordering::Relaxed,
            );
        }
        self.name_len.store(name.len() as u32, Ordering::Relaxed);
    }

    /// Pins the entry if it still has generation `generation` and is not LOCKED: in this
    /// backend's hazard slot when it is free (a store and a load, no shared write: the hot
    /// path), else by counting in the state word.
    fn pin(&'static self, cap: CapRef) -> Option<Cap> {
        let Some(hazard) = my_hazard().filter(|h| h.load(Ordering::Relaxed) == 0) else {
            return self.pin_counted(cap);
        };
        let mine = hazard_value(cap);
        let mut spins = 0u32;
        loop {
            // Publish, then look (SeqCst both): a grower or reclaimer that sets LOCKED and then
            // scans the hazard slots either sees this pin or is seen here.
            hazard.store(mine, Ordering::SeqCst);
            let s = self.state.load(Ordering::SeqCst);
            if generation(s) != cap.generation {
                hazard.store(0, Ordering::Release);
                return None;
            }
            if s & LOCKED == 0 {
                return Some(Cap {
                    entry: self,
                    cap,
                    hazard: Some(hazard),
                });
            }
            hazard.store(0, Ordering::Release);
            spins = wait_unlocked(spins);
        }
    }

    /// Pins the entry by counting in its state word (several pins at once, as `caps` takes).
    fn pin_counted(&'static self, cap: CapRef) -> Option<Cap> {
        let mut spins = 0u32;
        loop {
            let s = self.state.load(Ordering::Acquire);
            if generation(s) != cap.generation {
                return None;
            }
            if s & LOCKED != 0 {
                spins = wait_unlocked(spins);
                continue;
            }
            if self
                .state
                .compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Some(Cap {
                    entry: self,
                    cap,
                    hazard: None,
                });
            }
        }
    }

    fn flush_state(&self) -> FlushState {
        loop {
            let before = self.version.load(Ordering::Acquire);
            if before % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let state = FlushState {
                counters: self.counters.load(),
                carried: self.carried.load(),
                flushed: self.flushed.load(),
                inflight: self.inflight.load(),
                inflight_id: self.inflight_id.load(Ordering::Relaxed),
            };
            std::sync::atomic::fence(Ordering::Acquire);
            if self.version.load(Ordering::Relaxed) == before {
                return state;
            }
        }
    }

    /// Runs `f` on the bookkeeping fields as one seqlock write. Only the flusher calls this.
    fn write(&self, f: impl FnOnce(&CapEntry)) {
        self.version.fetch_add(1, Ordering::AcqRel);
        f(self);
        self.version.fetch_add(1, Ordering::Release);
    }

    fn idle(&self) -> bool {
        self.flusher.load(Ordering::Acquire) == 0
            && self.waiters.load(Ordering::Acquire) == 0
            && self.flush_state().pending(None).is_zero()
    }
}

/// Settles flushes. A cap whose flusher role this process holds is never reclaimed, so the
/// entry needs no pin here.
pub struct Flushed(&'static CapEntry);

impl Flushed {
    pub fn set_inflight(&self, id: u64, delta: CounterValues) {
        self.0.write(|e| {
            e.inflight.store(delta);
            e.inflight_id.store(id, Ordering::Relaxed);
        });
    }

    pub fn flush_state(&self) -> FlushState {
        self.0.flush_state()
    }

    /// The flush's transaction committed: what it read is now in the table.
    pub fn commit(&self, read: &FlushState) {
        let e = self.0;
        e.write(|e| {
            e.flushed.store(read.counters);
            e.carried.store(e.carried.load().minus(read.carried));
            e.inflight.store(CounterValues::default());
            e.inflight_id.store(0, Ordering::Relaxed);
        });
        e.flusher.store(0, Ordering::Release);
    }

    /// The flush's transaction (or subtransaction) aborted: its delta is still pending.
    pub fn abort(&self) {
        let e = self.0;
        e.write(|e| {
            e.inflight.store(CounterValues::default());
            e.inflight_id.store(0, Ordering::Relaxed);
        });
        e.flusher.store(0, Ordering::Release);
    }
}

impl Cap {
    /// The handle that settles this cap's flush at transaction end.
    pub fn flushed(&self) -> Flushed {
        Flushed(self.entry)
    }
}

/// Why a cap could not be created or grown.
#[derive(Debug, PartialEq)]
pub enum CapError {
    /// `max_caps` caps are in use (held slots, or counts not yet flushed).
    NoEntry { max_caps: u32, held: u32 },
    /// The arena has no block large enough.
    NoMemory { slots: u32 },
    /// Another cap of this database uses the same lock key.
    KeyCollision { other: String, key: i32 },
    /// The cap stayed pinned too long to be grown (a backend died mid-call).
    Busy,
}

/// The entry is being grown (quick) or reclaimed (then the generation changes): wait a little.
fn wait_unlocked(spins: u32) -> u32 {
    if (spins + 1).is_multiple_of(64) {
        // SAFETY: a plain sleep; no lock or pin is held here.
        unsafe { pg_sys::pg_usleep(50) };
    }
    std::hint::spin_loop();
    spins + 1
}

/// One backend's hazard slot, alone on its cache line: each backend writes its own twice per
/// call, and must not slow its neighbours down doing so.
#[repr(C, align(64))]
struct HazardSlot(AtomicU64);

/// What a hazard slot holds while it pins `cap`: never 0.
fn hazard_value(cap: CapRef) -> u64 {
    ((cap.entry as u64 + 1) << 32) | cap.generation as u64
}

/// This process's hazard slot: one per PGPROC, so each backend has its own.
fn my_hazard() -> Option<&'static AtomicU64> {
    let seg = segment()?;
    #[cfg(feature = "pg15")]
    // SAFETY: MyProc is this process's PGPROC, set at start-up (null in the postmaster).
    let procno = unsafe { pg_sys::MyProc.as_ref().map(|p| p.pgprocno as usize) };
    #[cfg(feature = "pg18")]
    // SAFETY: MyProcNumber is set at start-up (-1 without a PGPROC).
    let procno = usize::try_from(unsafe { pg_sys::MyProcNumber }).ok();
    seg.hazards.get(procno?).map(|h| &h.0)
}

/// Bytes from `addr` to the next 64-byte boundary: the segment and the hazard slots start on
/// one (the layout reserves 64 bytes for each).
fn to_cache_line(addr: usize) -> usize {
    addr.next_multiple_of(64) - addr
}

/// Whether some backend's hazard slot pins entry `i` at its generation in `state`.
impl Segment {
    fn hazard_pinned(&self, i: u32, state: u64) -> bool {
        let v = hazard_value(CapRef {
            entry: i,
            generation: generation(state),
        });
        self.hazards.iter().any(|h| h.0.load(Ordering::SeqCst) == v)
    }
}

/// Set in every process by the startup hook (children inherit it through fork). Null means
/// the library was not preloaded, and every SQL function refuses to run.
static SEGMENT: AtomicPtr<Header> = AtomicPtr::new(std::ptr::null_mut());
/// The directory LWLock (looking up, creating, growing and reclaiming caps).
static DIRECTORY_LOCK: AtomicPtr<pg_sys::LWLock> = AtomicPtr::new(std::ptr::null_mut());
/// The waits LWLock (joining and leaving a cap's queue of waiters).
static WAITS_LOCK: AtomicPtr<pg_sys::LWLock> = AtomicPtr::new(std::ptr::null_mut());

static mut PREV_SHMEM_REQUEST_HOOK: pg_sys::shmem_request_hook_type = None;
static mut PREV_SHMEM_STARTUP_HOOK: pg_sys::shmem_startup_hook_type = None;

struct Layout {
    max_caps: u32,
    max_leases: u32,
    max_waiters: u32,
    max_hazards: u32,
    index_len: usize,
    pages: u32,
    top_order: u32,
}

impl Layout {
    fn from_settings() -> Self {
        let max_slots = gucs::max_slots();
        let top_order = arena::order_for(max_slots);
        Layout {
            max_caps: gucs::max_caps(),
            max_leases: gucs::max_leases(),
            // SAFETY: MaxBackends is final when shared memory is requested (PG 15+).
            max_waiters: unsafe { pg_sys::MaxBackends }.max(1) as u32,
            // One hazard slot per PGPROC of a backend or background worker (they come first
            // in the PGPROC array, MaxBackends of them); any other process pins by counting.
            // SAFETY: as above.
            max_hazards: unsafe { pg_sys::MaxBackends }.max(1) as u32,
            index_len: directory::index_len(gucs::max_caps()),
            pages: arena::pages_for(gucs::slot_memory_bytes(), top_order),
            top_order,
        }
    }

    fn size(&self) -> usize {
        // 64 bytes to align the start to a cache line (ShmemInitStruct aligns to 8 only).
        64 + size_of::<Header>()
            + self.max_caps as usize * size_of::<CapEntry>()
            + self.max_waiters as usize * size_of::<WaiterRecord>()
            + self.max_leases as usize * size_of::<LeaseRecord>()
            + 64
            + self.max_hazards as usize * size_of::<HazardSlot>()
            + (self.index_len + arena::meta_words(self.pages)).next_multiple_of(2) * 4
            + self.pages as usize * arena::PAGE
    }
}

/// Bytes of shared memory the extension requests with the current settings.
pub fn requested_bytes() -> usize {
    Layout::from_settings().size()
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
        pg_sys::RequestNamedLWLockTranche(LOCK_TRANCHE.as_ptr(), 2);
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn shmem_startup() {
    // SAFETY: ShmemInitStruct under AddinShmemInitLock is the documented way to create or
    // attach an add-in segment; the first process to get it (found = false) zeroes it, which
    // is a valid state for every field (atomics; dboid 0 = free entry), then frees the arena.
    unsafe {
        if let Some(prev) = PREV_SHMEM_STARTUP_HOOK {
            prev();
        }
        let layout = Layout::from_settings();
        let size = layout.size();
        let lock = &raw mut (*pg_sys::MainLWLockArray.add(21)).lock; // AddinShmemInitLock
        pg_sys::LWLockAcquire(lock, pg_sys::LWLockMode::LW_EXCLUSIVE);
        let mut found = false;
        let raw = pg_sys::ShmemInitStruct(SEGMENT_NAME.as_ptr(), size, &mut found) as *mut u8;
        let base = raw.add(to_cache_line(raw as usize)) as *mut Header;
        if !found {
            std::ptr::write_bytes(raw, 0, size);
            (*base).max_caps = layout.max_caps;
            (*base).max_waiters = layout.max_waiters;
            (*base).max_hazards = layout.max_hazards;
            (*base).max_leases = layout.max_leases;
            (*base).max_slots = gucs::max_slots();
            (*base).index_len = layout.index_len as u32;
            (*base).pages = layout.pages;
            (*base).top_order = layout.top_order;
        }
        pg_sys::LWLockRelease(lock);
        let locks = pg_sys::GetNamedLWLockTranche(LOCK_TRANCHE.as_ptr());
        DIRECTORY_LOCK.store(&raw mut (*locks).lock, Ordering::Release);
        WAITS_LOCK.store(&raw mut (*locks.add(1)).lock, Ordering::Release);
        SEGMENT.store(base, Ordering::Release);
        attach_view();
        if !found {
            segment().expect("just attached").buddy().reset();
        }
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
    let seg = segment().expect("attached");
    for c in entries {
        // The postmaster, before any backend: no lock is contended. A database dropped since
        // is reclaimed by the launcher's first round.
        let key = cap_key(&c.cap);
        match seg.create(c.database, &c.cap, key, 1, &|_| true) {
            Ok(cap) => seg.entry(cap.entry).carry(c.values),
            Err(e) => pgrx::log!(
                "stage_e_slots: dropped the saved counts of cap \"{}\" of database {}: {e:?}",
                c.cap,
                c.database
            ),
        }
    }
}

/// Postmaster exit: at a clean shutdown (code 0) every backend and worker is gone, so each
/// cap's pending counts are final; write them for the next start. A crash (code != 0) writes
/// nothing: at most one flush interval of counts is lost, as documented.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn save_pending(code: i32, _arg: pg_sys::Datum) {
    if code != 0 {
        return;
    }
    let Some(seg) = segment() else { return };
    let pending: Vec<Carried> = seg
        .live()
        .map(|e| Carried {
            database: e.dboid.load(Ordering::Relaxed),
            cap: e.name(),
            values: e.flush_state().pending(None),
        })
        .filter(|c| !c.values.is_zero())
        .collect();
    if pending.is_empty() {
        return;
    }
    let tmp = format!("{PENDING_FILE}.tmp");
    let written = std::fs::write(&tmp, counters::encode(&pending))
        .and_then(|()| std::fs::rename(&tmp, PENDING_FILE));
    match written {
        Ok(()) => pgrx::log!(
            "stage_e_slots: saved pending counters of {} cap(s) to {PENDING_FILE}",
            pending.len()
        ),
        Err(e) => pgrx::warning!("stage_e_slots: could not write {PENDING_FILE}: {e}"),
    }
}

impl CapEntry {
    fn carry(&self, v: CounterValues) {
        self.write(|e| e.carried.store(e.carried.load().plus(v)));
    }
}

/// Whether this process is attached to the segment (false when not preloaded).
pub fn attached() -> bool {
    !SEGMENT.load(Ordering::Acquire).is_null()
}

/// The lock key of cap `name`: `stage_e_slots.lock_key` for `default`, else the name's hash.
pub fn cap_key(name: &str) -> i32 {
    if name == directory::DEFAULT_CAP {
        gucs::lock_key()
    } else {
        directory::name_key(name)
    }
}

struct Segment {
    header: &'static Header,
    entries: &'static [CapEntry],
    waiters: &'static [WaiterRecord],
    leases: &'static [LeaseRecord],
    hazards: &'static [HazardSlot],
    index: &'static [AtomicU32],
    meta: &'static [AtomicU32],
    arena: *mut u8,
}

/// The segment's parts, computed when it is attached (the hot path asks for them several
/// times per call).
fn segment() -> Option<&'static Segment> {
    // SAFETY: VIEW is null or a leaked Segment for the current segment (see `attach_view`).
    unsafe { VIEW.load(Ordering::Acquire).as_ref() }
}

/// The parts of the attached segment. Set by the startup hook each time shared memory is
/// (re)created (at start and after a crash reset, when it may move), and inherited by children.
static VIEW: AtomicPtr<Segment> = AtomicPtr::new(std::ptr::null_mut());

fn attach_view() {
    if let Some(view) = compute_segment() {
        // Leaked on purpose: it lives as long as the segment, and one is made per crash reset.
        VIEW.store(Box::into_raw(Box::new(view)), Ordering::Release);
    }
}

// SAFETY: every part is shared memory made of atomics, or the arena base address, which never
// changes; a backend is single-threaded, and the unit tests do not touch the segment.
unsafe impl Sync for Segment {}
unsafe impl Send for Segment {}

fn compute_segment() -> Option<Segment> {
    let base = SEGMENT.load(Ordering::Acquire);
    if base.is_null() {
        return None;
    }
    // SAFETY: the startup hook sized the segment from these same header fields, the header is
    // written before SEGMENT is published and never changes, and the segment outlives us.
    unsafe {
        let header = &*base;
        let caps = header.max_caps as usize;
        let entries = (base as *mut u8).add(size_of::<Header>()) as *const CapEntry;
        let waiters = entries.add(caps) as *const WaiterRecord;
        let leases = waiters.add(header.max_waiters as usize) as *const LeaseRecord;
        let after = leases.add(header.max_leases as usize) as *const u8;
        let hazards = after.add(to_cache_line(after as usize)) as *const HazardSlot;
        let index = hazards.add(header.max_hazards as usize) as *const AtomicU32;
        let meta = index.add(header.index_len as usize);
        let meta_len = arena::meta_words(header.pages);
        let words = (header.index_len as usize + meta_len).next_multiple_of(2);
        let arena = (index as *mut u8).add(words * 4);
        Some(Segment {
            header,
            entries: std::slice::from_raw_parts(entries, caps),
            waiters: std::slice::from_raw_parts(waiters, header.max_waiters as usize),
            leases: std::slice::from_raw_parts(leases, header.max_leases as usize),
            hazards: std::slice::from_raw_parts(hazards, header.max_hazards as usize),
            index: std::slice::from_raw_parts(index, header.index_len as usize),
            meta: std::slice::from_raw_parts(meta, meta_len),
            arena,
        })
    }
}

/// Runs `f` holding the directory lock in `mode`.
fn locked<R>(mode: pg_sys::LWLockMode::Type, f: impl FnOnce() -> R) -> R {
    locked_by(&DIRECTORY_LOCK, mode, f)
}

/// Runs `f` holding `which` lock in `mode`.
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

const SHARED: pg_sys::LWLockMode::Type = pg_sys::LWLockMode::LW_SHARED;
const EXCLUSIVE: pg_sys::LWLockMode::Type = pg_sys::LWLockMode::LW_EXCLUSIVE;

impl Segment {
    fn entry(&self, i: u32) -> &'static CapEntry {
        &self.entries[i as usize]
    }

    fn buddy(&self) -> Buddy<'static> {
        Buddy::over(self.meta, self.header.pages, self.header.top_order)
    }

    fn index(&self) -> Index<'static> {
        Index::over(self.index)
    }

    /// Entries in use.
    fn live(&self) -> impl Iterator<Item = &'static CapEntry> {
        self.entries
            .iter()
            .filter(|e| e.dboid.load(Ordering::Acquire) != 0)
    }

    /// The records and bitmap of `e`'s block (pinned, or under the exclusive lock).
    fn block(&self, e: &CapEntry) -> (&'static [SlotRecord], &'static [AtomicU64]) {
        let page = e.block.load(Ordering::Acquire) as usize;
        let capacity = e.capacity.load(Ordering::Acquire) as usize;
        // SAFETY: the block was allocated for `capacity` slots (see `arena::capacity`) and stays
        // allocated while the entry is pinned; records are 16-aligned, the bitmap follows them.
        unsafe {
            let start = self.arena.add(page * arena::PAGE);
            let records = std::slice::from_raw_parts(start as *const SlotRecord, capacity);
            let bits = std::slice::from_raw_parts(
                start.add(capacity * arena::RECORD) as *const AtomicU64,
                occupancy::words_for(capacity as u32),
            );
            (records, bits)
        }
    }

    fn find(&self, db: u32, name: &str) -> Option<u32> {
        let hash = directory::index_hash(db, name);
        self.index().find(hash, |i| self.entry(i).is(db, name))
    }

    /// Under the exclusive lock: the cap `(db, name)`, created with room for `slots` slots.
    fn create(
        &self,
        db: u32,
        name: &str,
        key: i32,
        slots: u32,
        exists: &dyn Fn(u32) -> bool,
    ) -> Result<CapRef, CapError> {
        if let Some(i) = self.find(db, name) {
            return Ok(self.cap_ref(i));
        }
        // Two caps of one database on one lock key would share slots: refuse the newcomer,
        // unless the other cap is idle (then it goes, and comes back refused if used again).
        let same_key = (0..self.entries.len() as u32).find(|&i| {
            let e = self.entry(i);
            e.dboid.load(Ordering::Relaxed) == db && e.key.load(Ordering::Relaxed) == key
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
        let order = arena::order_for(slots.max(1));
        let mut entry = self
            .entries
            .iter()
            .position(|e| e.dboid.load(Ordering::Relaxed) == 0);
        let mut block = self.buddy().alloc(order);
        if entry.is_none() || block.is_none() {
            self.reclaim_idle(exists, order);
            entry = entry.or_else(|| {
                self.entries
                    .iter()
                    .position(|e| e.dboid.load(Ordering::Relaxed) == 0)
            });
            block = block.or_else(|| self.buddy().alloc(order));
        }
        let Some(i) = entry else {
            if let Some(b) = block {
                self.buddy().free(b);
            }
            request_flush();
            return Err(CapError::NoEntry {
                max_caps: self.header.max_caps,
                held: self
                    .live()
                    .filter(|e| {
                        !e.idle()
                            || self
                                .block(e)
                                .1
                                .iter()
                                .any(|w| w.load(Ordering::Relaxed) != 0)
                    })
                    .count() as u32,
            });
        };
        let Some(block) = block else {
            request_flush();
            return Err(CapError::NoMemory { slots });
        };
        let e = self.entry(i as u32);
        // A free entry has no pins and a generation above any reference to its last cap.
        e.state.fetch_or(LOCKED, Ordering::AcqRel);
        e.block.store(block, Ordering::Relaxed);
        e.capacity.store(arena::capacity(order), Ordering::Relaxed);
        self.clear_block(e);
        e.key.store(key, Ordering::Relaxed);
        e.set_name(name);
        e.counters.last_token.store(token_base(), Ordering::Relaxed);
        e.counters.leases.store(0, Ordering::Relaxed);
        e.counters.lease_due.store(i64::MAX, Ordering::Relaxed);
        let hash = directory::index_hash(db, name);
        e.hash.store(hash, Ordering::Relaxed);
        e.dboid.store(db, Ordering::Release);
        self.index().insert(hash, i as u32);
        e.state.fetch_and(!LOCKED, Ordering::AcqRel);
        if self.live().count() as u32 * 4 >= self.header.max_caps * 3 {
            request_flush(); // crowded: get idle caps' counts into their rows
        }
        Ok(self.cap_ref(i as u32))
    }

    fn cap_ref(&self, i: u32) -> CapRef {
        CapRef {
            entry: i,
            generation: generation(self.entry(i).state.load(Ordering::Acquire)),
        }
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

    /// Under the exclusive lock: reclaims idle caps (and those of dropped databases, which
    /// `exists` denies) until an entry is free and a block of `order` can be had.
    fn reclaim_idle(&self, exists: &dyn Fn(u32) -> bool, order: u32) {
        for i in 0..self.entries.len() as u32 {
            let e = self.entry(i);
            let db = e.dboid.load(Ordering::Relaxed);
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
        let s = e.state.fetch_or(LOCKED, Ordering::AcqRel);
        let (_, bits) = self.block(e);
        let busy = s & LOCKED != 0
            || s & PINS != 0
            || self.hazard_pinned(i, s)
            || bits.iter().any(|w| w.load(Ordering::Acquire) != 0)
            || e.flusher.load(Ordering::Acquire) != 0
            || e.waiters.load(Ordering::Acquire) != 0
            || (!dropped && !e.flush_state().pending(None).is_zero());
        if busy {
            if s & LOCKED == 0 {
                e.state.fetch_and(!LOCKED, Ordering::AcqRel);
            }
            return false;
        }
        if dropped {
            let p = e.flush_state().pending(None);
            let counts = if p.is_zero() {
                String::new()
            } else {
                format!(
                    "; dropped its pending counters ({} acquired, {} throttled)",
                    p.acquired, p.throttled
                )
            };
            pgrx::log!(
                "stage_e_slots: reclaimed cap \"{}\" of dropped database {}{counts}",
                e.name(),
                e.dboid.load(Ordering::Relaxed),
            );
        }
        let hash = e.hash.load(Ordering::Relaxed);
        self.index()
            .remove(hash, i, |o| self.entry(o).hash.load(Ordering::Relaxed));
        self.buddy().free(e.block.load(Ordering::Relaxed));
        let zero = CounterValues::default();
        e.counters.store(zero);
        e.carried.store(zero);
        e.flushed.store(zero);
        e.inflight.store(zero);
        e.inflight_id.store(0, Ordering::Relaxed);
        e.capacity.store(0, Ordering::Relaxed);
        for a in e.load_held.iter().chain(&e.load_throttles) {
            a.store(0, Ordering::Relaxed);
        }
        e.load_last_us.store(0, Ordering::Relaxed);
        e.load_last_throttled.store(0, Ordering::Relaxed);
        e.dboid.store(0, Ordering::Release);
        // New generation, unlocked, no pins: every cached reference to the old cap now fails.
        let next = (generation(s) as u64 + 1) << 32;
        e.state.store(next, Ordering::Release);
        true
    }

    /// Under the exclusive lock: moves the cap to a block of at least `slots` slots.
    fn grow(&self, cap: CapRef, slots: u32) -> Result<(), CapError> {
        let e = self.entry(cap.entry);
        let s = e.state.fetch_or(LOCKED, Ordering::AcqRel);
        if generation(s) != cap.generation || s & LOCKED != 0 {
            if s & LOCKED == 0 {
                e.state.fetch_and(!LOCKED, Ordering::AcqRel);
            }
            return Ok(()); // reclaimed meanwhile: the caller looks it up again
        }
        let unlock = || e.state.fetch_and(!LOCKED, Ordering::AcqRel);
        if e.capacity.load(Ordering::Relaxed) >= slots {
            unlock();
            return Ok(());
        }
        // No new pin can start; wait (briefly) for the current ones to end.
        let mut waited = 0;
        while e.state.load(Ordering::SeqCst) & PINS != 0 || self.hazard_pinned(cap.entry, s) {
            if waited > 20_000 {
                unlock();
                return Err(CapError::Busy);
            }
            // SAFETY: a plain sleep.
            unsafe { pg_sys::pg_usleep(50) };
            waited += 1;
        }
        let order = arena::order_for(slots);
        let new = match self.buddy().alloc(order) {
            Some(b) => b,
            None => {
                unlock();
                return Err(CapError::NoMemory { slots });
            }
        };
        let (old_records, old_bits) = self.block(e);
        let old_block = e.block.load(Ordering::Relaxed);
        e.block.store(new, Ordering::Relaxed);
        e.capacity.store(arena::capacity(order), Ordering::Relaxed);
        self.clear_block(e);
        let (records, bits) = self.block(e);
        for (to, from) in records.iter().zip(old_records) {
            let (pid, at) = from.get();
            to.set(pid, at);
        }
        for (to, from) in bits.iter().zip(old_bits) {
            to.store(from.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        self.buddy().free(old_block);
        e.state.fetch_and(!LOCKED, Ordering::AcqRel);
        Ok(())
    }
}

/// Pins cap `cap` (a reference cached by this backend); None if it was reclaimed since.
pub fn pin(cap: CapRef) -> Option<Cap> {
    segment()?.entry(cap.entry).pin(cap)
}

/// The cap `(db, name)` pinned, if it exists: a lookup under the shared directory lock (which
/// keeps it from being reclaimed or grown meanwhile, so the pin is immediate).
pub fn lookup(db: u32, name: &str) -> Option<Cap> {
    let seg = segment()?;
    locked(SHARED, || {
        let i = seg.find(db, name)?;
        seg.entry(i).pin(seg.cap_ref(i))
    })
}

/// The cap `(db, name)` pinned, created (with room for `slots` slots) if it does not exist.
/// `exists` says whether a database still exists (a catalog lookup, made only when full).
pub fn create(
    db: u32,
    name: &str,
    slots: u32,
    exists: impl Fn(u32) -> bool,
) -> Result<Option<Cap>, CapError> {
    let Some(seg) = segment() else {
        return Ok(None);
    };
    let key = cap_key(name);
    // Which full caps belong to dropped databases is a catalog lookup, made before taking the
    // lock (and only when the directory is crowded).
    let crowded = seg.live().count() as u32 >= seg.header.max_caps;
    let gone: Vec<u32> = if crowded {
        let mut dbs: Vec<u32> = seg
            .live()
            .map(|e| e.dboid.load(Ordering::Relaxed))
            .collect();
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
        let made = locked(EXCLUSIVE, || {
            let cap = seg.create(db, name, key, slots, &|d| !gone.contains(&d))?;
            Ok(seg.entry(cap.entry).pin(cap))
        });
        match made {
            Err(CapError::NoEntry { .. } | CapError::NoMemory { .. })
                if started.elapsed() < ROOM_WAIT =>
            {
                // SAFETY: a plain sleep, holding no lock or pin; then answer a cancel.
                unsafe { pg_sys::pg_usleep(2_000) };
                pgrx::check_for_interrupts!();
            }
            other => return other,
        }
    }
}

/// How long a create waits for a flush round to make idle caps reclaimable.
const ROOM_WAIT: std::time::Duration = std::time::Duration::from_millis(1_000);

/// Moves `cap` to a block with room for `slots` slots (its holders keep theirs).
pub fn grow(cap: CapRef, slots: u32) -> Result<(), CapError> {
    let Some(seg) = segment() else { return Ok(()) };
    locked(EXCLUSIVE, || seg.grow(cap, slots))
}

/// Reclaims every cap of database `db`, which no longer exists (the launcher's round).
pub fn reclaim_database(db: u32) {
    let Some(seg) = segment() else { return };
    locked(EXCLUSIVE, || {
        for i in 0..seg.entries.len() as u32 {
            if seg.entry(i).dboid.load(Ordering::Relaxed) == db {
                seg.try_reclaim(i, true);
            }
        }
    });
}

/// The caps of database `db`, unpinned: pin each with [`pin`] while using it.
pub fn cap_refs(db: u32) -> Vec<CapRef> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    (0..seg.entries.len() as u32)
        .filter(|&i| seg.entry(i).dboid.load(Ordering::Acquire) == db)
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
            let d = e.dboid.load(Ordering::Acquire);
            if d == 0 || db.is_some_and(|want| want != d) {
                return None;
            }
            let cap = seg.cap_ref(i);
            let pinned = e.pin_counted(cap)?;
            // Re-check under the pin: the entry may have been reclaimed and reused.
            (pinned.database() == d).then_some(pinned)
        })
        .collect()
}

/// Databases that have caps with counts pending, for the launcher.
pub fn databases_with_pending() -> Vec<u32> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    let mut dbs: Vec<u32> = seg
        .live()
        .filter(|e| {
            e.flusher.load(Ordering::Acquire) == 0 && !e.flush_state().pending(None).is_zero()
        })
        .map(|e| e.dboid.load(Ordering::Relaxed))
        .filter(|&d| d != 0)
        .collect();
    dbs.sort_unstable();
    dbs.dedup();
    dbs
}

/// Every database with a live cap.
pub fn databases() -> Vec<u32> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    let mut dbs: Vec<u32> = seg
        .live()
        .map(|e| e.dboid.load(Ordering::Relaxed))
        .collect();
    dbs.sort_unstable();
    dbs.dedup();
    dbs
}

/// A unique, increasing id for the next flush (microseconds, bumped past the last id).
pub fn next_flush_id(now_us: u64) -> u64 {
    let Some(seg) = segment() else { return now_us };
    let last = &seg.header.last_flush_id;
    let mut cur = last.load(Ordering::Relaxed);
    loop {
        let id = now_us.max(cur + 1);
        match last.compare_exchange_weak(cur, id, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return id,
            Err(now) => cur = now,
        }
    }
}

/// How full the directory and the arena are: (live caps, max_caps, free pages, pages).
pub fn usage() -> (u32, u32, u64, u32) {
    let Some(seg) = segment() else {
        return (0, 0, 0, 0);
    };
    let pages = locked(SHARED, || seg.buddy().free_pages());
    (
        seg.live().count() as u32,
        seg.header.max_caps,
        pages,
        seg.header.pages,
    )
}

/// Asks the launcher for a flush round now.
pub fn request_flush() {
    let Some(seg) = segment() else { return };
    seg.header.flush_requested.store(1, Ordering::Release);
    let proc_ = seg.header.launcher.load(Ordering::Acquire);
    if !proc_.is_null() {
        // SAFETY: a PGPROC lives in shared memory for the server's lifetime; setting the latch
        // of a process that has since exited wakes at worst an unrelated process once.
        unsafe { pg_sys::SetLatch(&raw mut (*proc_).procLatch) };
    }
}

/// The launcher registers itself to be woken by [`request_flush`]; returns whether a flush
/// was requested since the last call.
pub fn launcher_wakeup(register: bool) -> bool {
    let Some(seg) = segment() else { return false };
    if register {
        // SAFETY: MyProc is this process's PGPROC, set at start-up.
        seg.header
            .launcher
            .store(unsafe { pg_sys::MyProc }, Ordering::Release);
    }
    seg.header.flush_requested.swap(0, Ordering::AcqRel) != 0
}

// -- Waiting ---------------------------------------------------------------------------------
//
// A cap's waiters form a FIFO queue of tickets (`tail` is the next one). The first [`FRONT`]
// of them, in ticket order, sit in the entry's `front` seats, and only they take slots: the
// waiter in a seat only while the free slots cover its k and the k of every seat ahead of it
// (`occupancy::covered_front`). So waiters get slots in arrival order, one asking for k slots
// at the head is not overtaken by smaller requests behind it, and when several slots free at
// once several waiters are served at once, not one after the other as each is scheduled.
// Every release of a cap with waiters sets the latch of the head and of each seat the free
// slots cover; a waiter that leaves the front (served, timed out, cancelled, exited) moves the
// seats behind it up, seats the next waiter and wakes the seats now covered. Queue changes take
// the waits LWLock; the release path reads the seats without it.
//
// No wake-up is lost: a releaser clears its bit and then reads the seats; a waiter publishes
// its seat and then reads the bits, and a seat change is published before the bits are read to
// wake the covered seats; all SeqCst, so of each pair, one sees the other. A torn read of seats
// being moved can only wake someone in vain or miss someone whom the mover then wakes.

/// This backend's place in a cap's queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    record: u32,
    ticket: u64,
}

/// A waiter as the waiters view shows it.
pub struct WaiterInfo {
    pub cap: String,
    pub pid: i32,
    pub n: u32,
    pub k: u32,
    pub since: i64,
    pub position: u32,
}

impl Cap {
    pub fn waiters(&self) -> u32 {
        self.entry.waiters.load(Ordering::SeqCst)
    }

    /// Whether the waiter holding `t` is at the front and the free slots cover it and every
    /// seat ahead of it (who may be taking at this moment).
    pub fn may_take(&self, t: Ticket) -> bool {
        let seats = locked_by(&WAITS_LOCK, SHARED, || self.entry.seats());
        let Some(place) = seats.iter().position(|s| s.ticket == t.ticket) else {
            return false;
        };
        let asks: Vec<(u32, u32)> = seats[..=place].iter().map(|s| (s.n, s.k)).collect();
        let bits = self.bits();
        occupancy::covered_front(&asks, |n| occupancy::free_below(bits, n)) > place
    }

    /// After freeing slots: sets the latch of the head, and of every seat behind it that the
    /// free slots cover. The SeqCst loads pair with a waiter's SeqCst seat, so a waiter that
    /// missed the freed bit is seen here, and woken.
    pub fn wake_front(&self) {
        if self.entry.waiters.load(Ordering::SeqCst) == 0 {
            return;
        }
        wake_covered(self.entry, self.bits(), true);
    }

    /// Joins the cap's queue; None if the list of waiters is full (it has a record for every
    /// backend, so only a bug gets None).
    pub fn enqueue(&self, n: u32, k: u32, since: i64) -> Option<Ticket> {
        let seg = segment()?;
        let e = self.entry;
        locked_by(&WAITS_LOCK, EXCLUSIVE, || {
            let record =
                seg.waiters
                    .iter()
                    .position(|w| w.active.load(Ordering::Relaxed) == 0)? as u32;
            let w = &seg.waiters[record as usize];
            let ticket = e.tail.fetch_add(1, Ordering::SeqCst);
            // SAFETY: this backend's PGPROC and pid, set at start-up.
            let (me, pid) = unsafe { (pg_sys::MyProc, pg_sys::MyProcPid) };
            w.entry.store(self.cap.entry, Ordering::Relaxed);
            w.pid.store(pid, Ordering::Relaxed);
            w.n.store(n, Ordering::Relaxed);
            w.k.store(k, Ordering::Relaxed);
            w.ticket.store(ticket, Ordering::Relaxed);
            w.since.store(since, Ordering::Relaxed);
            w.proc_.store(me, Ordering::Relaxed);
            w.active.store(1, Ordering::Release);
            // The seats hold the first min(waiters, FRONT) waiters, so a newcomer's seat, if
            // any, is the first empty one.
            let before = e.waiters.fetch_add(1, Ordering::SeqCst) as usize;
            if let Some(seat) = e.front.get(before) {
                seat.fill(me, ticket, n, k);
            }
            Some(Ticket { record, ticket })
        })
    }
}

/// A front seat as read under the waits lock.
#[derive(Clone, Copy)]
struct SeatCopy {
    ticket: u64,
    n: u32,
    k: u32,
}

impl Seat {
    /// Publishes a waiter in this seat: its process last, so a reader that sees the process
    /// sees what it asks for.
    fn fill(&self, p: *mut pg_sys::PGPROC, ticket: u64, n: u32, k: u32) {
        self.ticket.store(ticket, Ordering::SeqCst);
        self.n.store(n, Ordering::SeqCst);
        self.k.store(k, Ordering::SeqCst);
        self.proc_.store(p, Ordering::SeqCst);
    }
}

impl CapEntry {
    /// The occupied front seats, head first (under the waits lock).
    fn seats(&self) -> Vec<SeatCopy> {
        self.front
            .iter()
            .take_while(|s| !s.proc_.load(Ordering::SeqCst).is_null())
            .map(|s| SeatCopy {
                ticket: s.ticket.load(Ordering::SeqCst),
                n: s.n.load(Ordering::SeqCst),
                k: s.k.load(Ordering::SeqCst),
            })
            .collect()
    }
}

/// Sets the latches of the front seats of `e` that the free slots in `bits` cover, and with
/// `head` the head's in any case (a release wakes it, as PostgreSQL's lock manager would).
fn wake_covered(e: &CapEntry, bits: &[AtomicU64], head: bool) {
    let mut asks = [(0u32, 0u32); FRONT];
    let mut procs = [std::ptr::null_mut::<pg_sys::PGPROC>(); FRONT];
    let mut seated = 0;
    for seat in &e.front {
        let p = seat.proc_.load(Ordering::SeqCst);
        if p.is_null() {
            break;
        }
        asks[seated] = (seat.n.load(Ordering::SeqCst), seat.k.load(Ordering::SeqCst));
        procs[seated] = p;
        seated += 1;
    }
    let covered = occupancy::covered_front(&asks[..seated], |n| occupancy::free_below(bits, n));
    let wake = if head {
        covered.max(seated.min(1))
    } else {
        covered
    };
    for &p in &procs[..wake] {
        // SAFETY: a PGPROC lives for the server's lifetime; a stale one is woken in vain.
        unsafe { pg_sys::SetLatch(&raw mut (*p).procLatch) };
    }
}

/// Leaves the queue of the cap in entry `cap.entry` (no pin needed: a cap with waiters is
/// never reclaimed). If `t` had a front seat, the seats behind it move up, the next waiter is
/// seated, and the seats the free slots now cover are woken.
pub fn dequeue(cap: CapRef, t: Ticket) {
    let Some(seg) = segment() else { return };
    let e = seg.entry(cap.entry);
    locked_by(&WAITS_LOCK, EXCLUSIVE, || {
        let w = &seg.waiters[t.record as usize];
        if w.active.load(Ordering::Relaxed) == 0 || w.ticket.load(Ordering::Relaxed) != t.ticket {
            return; // already left
        }
        w.active.store(0, Ordering::Release);
        e.waiters.fetch_sub(1, Ordering::SeqCst);
        if !e.seats().iter().any(|s| s.ticket == t.ticket) {
            return;
        }
        let mut queue: Vec<&WaiterRecord> = seg
            .waiters
            .iter()
            .filter(|o| {
                o.active.load(Ordering::Relaxed) == 1
                    && o.entry.load(Ordering::Relaxed) == cap.entry
            })
            .collect();
        queue.sort_by_key(|o| o.ticket.load(Ordering::Relaxed));
        for (i, seat) in e.front.iter().enumerate() {
            match queue.get(i) {
                Some(o) => seat.fill(
                    o.proc_.load(Ordering::Relaxed),
                    o.ticket.load(Ordering::Relaxed),
                    o.n.load(Ordering::Relaxed),
                    o.k.load(Ordering::Relaxed),
                ),
                None => seat.proc_.store(std::ptr::null_mut(), Ordering::SeqCst),
            }
        }
        // Only the seats whose slots may be free now: the release that frees the others' wakes
        // them. Waking in vain would cost every hand-off a second context switch.
        let (_, bits) = seg.block(e);
        wake_covered(e, bits, false);
    });
}

/// The waiters of database `db`'s caps, in queue order per cap (`position` 1 is the head).
pub fn waiters_of(db: u32) -> Vec<WaiterInfo> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    let mut found: Vec<(u32, u64, WaiterInfo)> = locked_by(&WAITS_LOCK, SHARED, || {
        seg.waiters
            .iter()
            .filter(|w| w.active.load(Ordering::Relaxed) == 1)
            .filter_map(|w| {
                let i = w.entry.load(Ordering::Relaxed);
                let e = seg.entry(i);
                (e.dboid.load(Ordering::Relaxed) == db).then(|| {
                    let info = WaiterInfo {
                        cap: e.name(),
                        pid: w.pid.load(Ordering::Relaxed),
                        n: w.n.load(Ordering::Relaxed),
                        k: w.k.load(Ordering::Relaxed),
                        since: w.since.load(Ordering::Relaxed),
                        position: 0,
                    };
                    (i, w.ticket.load(Ordering::Relaxed), info)
                })
            })
            .collect()
    });
    found.sort_by_key(|(i, t, _)| (*i, *t));
    let mut out: Vec<WaiterInfo> = Vec::with_capacity(found.len());
    let mut previous = None;
    let mut position = 0;
    for (entry, _, mut w) in found {
        if previous != Some(entry) {
            previous = Some(entry);
            position = 0;
        }
        position += 1;
        w.position = position;
        out.push(w);
    }
    out.sort_by(|a, b| (&a.cap, a.position).cmp(&(&b.cap, b.position)));
    out
}

// -- Load averages ---------------------------------------------------------------------------

/// Averaging windows of the load figures, in seconds (as the Unix load average).
pub const LOAD_WINDOWS: [f64; 3] = [60.0, 300.0, 900.0];

/// A cap's load: slots held and throttles per minute, averaged over [`LOAD_WINDOWS`].
pub struct Load {
    pub cap: String,
    pub held: [f64; 3],
    pub throttles_per_min: [f64; 3],
}

/// Takes one load sample of every cap (the launcher, every few seconds): exponentially
/// weighted averages, decayed by the real time since the last sample.
pub fn sample_load(now_us: i64) {
    for cap in caps(None) {
        let e = cap.entry;
        let held: u32 = cap
            .bits()
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones())
            .sum();
        let throttled = e.counters.load().throttled;
        let last_us = e.load_last_us.swap(now_us, Ordering::Relaxed);
        let last_throttled = e.load_last_throttled.swap(throttled, Ordering::Relaxed);
        if last_us == 0 || now_us <= last_us {
            // The first sample of a cap sets the baseline: the averages start from it.
            for (h, t) in e.load_held.iter().zip(&e.load_throttles) {
                h.store((held as f64).to_bits(), Ordering::Relaxed);
                t.store(0f64.to_bits(), Ordering::Relaxed);
            }
            continue;
        }
        let dt = (now_us - last_us) as f64 / 1e6;
        let rate = throttled.wrapping_sub(last_throttled) as f64 / dt * 60.0;
        for (i, window) in LOAD_WINDOWS.iter().enumerate() {
            let keep = (-dt / window).exp();
            let blend = |a: &AtomicU64, x: f64| {
                let old = f64::from_bits(a.load(Ordering::Relaxed));
                a.store((old * keep + x * (1.0 - keep)).to_bits(), Ordering::Relaxed);
            };
            blend(&e.load_held[i], held as f64);
            blend(&e.load_throttles[i], rate);
        }
    }
}

/// The load figures of database `db`'s caps.
pub fn load_of(db: u32) -> Vec<Load> {
    let read = |a: &[AtomicU64; 3]| {
        a.each_ref()
            .map(|x| f64::from_bits(x.load(Ordering::Relaxed)))
    };
    caps(Some(db))
        .into_iter()
        .map(|cap| Load {
            cap: cap.name(),
            held: read(&cap.entry.load_held),
            throttles_per_min: read(&cap.entry.load_throttles),
        })
        .collect()
}

// -- Leases and tokens -----------------------------------------------------------------------
//
// **Tokens.** Every acquisition of a cap, session slot or lease, takes the next value of the
// cap's `last_token`. A cap entry starts it at the clock in microseconds times 1,024 (the
// clock's microsecond, split 1,024 ways), so the tokens of a cap created again (after a
// restart, a crash or a reclaim) start above every earlier one as long as the cap took fewer
// than 1,024 slots per microsecond on average, which no server does, and the clock did not go
// back across the restart.
//
// **Leases.** A lease is a slot held by a token, not by a session: its bit is set like a
// session slot's, and its slot record names a lease record (pid `-(index + 1)`) instead of a
// backend. There is no advisory lock (no session holds it), so shared memory is the truth for
// leases: the bit keeps session tries and other leases off the slot, and only the lease record
// frees it. A lease record is changed only by the process that moved it from LIVE to BUSY
// (a CAS), so a renewal, a release by token and an expiry never act on one lease at once. A
// lease is taken with the cap pinned, and every operation on one pins its cap, so the record's
// (entry, generation, slot) tells a stale lease from a live one.

/// 1,024 tokens per microsecond of the clock: the first token of a cap created now.
fn token_base() -> u64 {
    // SAFETY: reads the clock.
    let now = unsafe { pg_sys::GetCurrentTimestamp() }.max(0) as u64;
    now << 10
}

/// A live lease as the holders view and the sweeps see it.
#[derive(Clone, Copy, Debug)]
pub struct LeaseInfo {
    pub slot: u32,
    pub token: u64,
    pub pid: i32,
    pub acquired_at: i64,
    pub expires_at: i64,
}

/// What a lease operation found (the lease as it was), for its caller to count and report.
#[derive(Clone, Copy, Debug)]
pub enum LeaseCheck {
    /// The token is the slot's current lease, live at `now`.
    Live(LeaseInfo),
    /// The token was the slot's lease, but it expired (it has now been freed as expired).
    Expired(LeaseInfo),
    /// The slot has no lease (None), or one with another token.
    Other(Option<LeaseInfo>),
}

fn lease_marker(index: usize) -> i32 {
    -(index as i32) - 1
}

fn lease_index(pid: i32) -> Option<usize> {
    (pid < 0).then(|| (-(pid as i64) - 1) as usize)
}

impl LeaseRecord {
    fn info(&self) -> LeaseInfo {
        LeaseInfo {
            slot: self.slot.load(Ordering::Relaxed),
            token: self.token.load(Ordering::Relaxed),
            pid: self.pid.load(Ordering::Relaxed),
            acquired_at: self.acquired_at.load(Ordering::Relaxed),
            expires_at: self.expires_at.load(Ordering::Relaxed),
        }
    }

    fn is_of(&self, cap: CapRef, slot: u32) -> bool {
        self.entry.load(Ordering::Relaxed) == cap.entry
            && self.generation.load(Ordering::Relaxed) == cap.generation
            && self.slot.load(Ordering::Relaxed) == slot
    }

    /// LIVE → BUSY; false if the record is not live. Waits out another process's BUSY, which
    /// lasts a few stores.
    fn lock(&self) -> bool {
        loop {
            match self
                .state
                .compare_exchange(LIVE, BUSY, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(BUSY) => std::hint::spin_loop(),
                Err(_) => return false,
            }
        }
    }

    fn unlock(&self) {
        self.state.store(LIVE, Ordering::Release);
    }
}

impl Cap {
    /// The next fencing token of this cap.
    pub fn next_token(&self) -> u64 {
        self.entry
            .counters
            .last_token
            .fetch_add(1, Ordering::Relaxed)
            + 1
    }

    /// Live leases of this cap.
    pub fn lease_count(&self) -> u32 {
        self.entry.counters.leases.load(Ordering::Acquire)
    }

    /// Whether a lease of this cap may have expired by `now`.
    pub fn lease_due(&self, now: i64) -> bool {
        self.lease_count() > 0 && self.entry.counters.lease_due.load(Ordering::Acquire) <= now
    }

    /// Records a lease on `slot`, whose bit the caller has claimed; false when every lease
    /// record is in use.
    pub fn start_lease(&self, slot: u32, token: u64, now: i64, expires_at: i64) -> bool {
        let Some(seg) = segment() else { return false };
        // SAFETY: this process's pid, set at start.
        let pid = unsafe { pg_sys::MyProcPid };
        let len = seg.leases.len();
        let from = pid.unsigned_abs() as usize % len.max(1);
        for i in (from..len).chain(0..from) {
            let r = &seg.leases[i];
            if r.state
                .compare_exchange(FREE, BUSY, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            r.entry.store(self.cap.entry, Ordering::Relaxed);
            r.generation.store(self.cap.generation, Ordering::Relaxed);
            r.slot.store(slot, Ordering::Relaxed);
            r.pid.store(pid, Ordering::Relaxed);
            r.token.store(token, Ordering::Relaxed);
            r.acquired_at.store(now, Ordering::Relaxed);
            r.expires_at.store(expires_at, Ordering::Relaxed);
            self.entry.counters.leases.fetch_add(1, Ordering::AcqRel);
            r.state.store(LIVE, Ordering::Release);
            self.record(slot).set(lease_marker(i), now);
            // Last: a sweep that reset `lease_due` before this either sees the slot record
            // above (the swap there reads this RMW's value or a later one) or is followed by
            // this lowering of it.
            self.entry
                .counters
                .lease_due
                .fetch_min(expires_at, Ordering::SeqCst);
            return true;
        }
        false
    }

    /// The lease record of `slot`, if the slot is leased.
    fn lease_record(&self, slot: u32) -> Option<&'static LeaseRecord> {
        if slot >= self.capacity() {
            return None;
        }
        let i = lease_index(self.record(slot).get().0)?;
        segment()?.leases.get(i)
    }

    /// Runs `f` on the live lease of `slot` with its record locked; None if there is none.
    fn with_lease<R>(&self, slot: u32, f: impl FnOnce(&LeaseRecord) -> R) -> Option<R> {
        let r = self.lease_record(slot)?;
        if !r.lock() {
            return None;
        }
        if !r.is_of(self.cap, slot) {
            r.unlock();
            return None;
        }
        Some(f(r))
    }

    /// Frees the lease in `r` (locked by the caller): the slot record, the bit, the record;
    /// wakes the waiters the slot may serve.
    fn end_lease(&self, r: &LeaseRecord) -> LeaseInfo {
        let info = r.info();
        self.record(info.slot).clear();
        occupancy::clear(self.bits(), info.slot);
        self.entry.counters.leases.fetch_sub(1, Ordering::AcqRel);
        r.state.store(FREE, Ordering::Release);
        self.wake_front();
        info
    }

    /// Checks `token` against the lease of `slot` at `now`: a live one is extended to
    /// `extend_to` (with Some) or ended (with None); an expired one is ended as expired.
    pub fn settle_lease(
        &self,
        slot: u32,
        token: u64,
        now: i64,
        extend_to: Option<i64>,
    ) -> LeaseCheck {
        self.with_lease(slot, |r| {
            let info = r.info();
            if info.token != token {
                r.unlock();
                return LeaseCheck::Other(Some(info));
            }
            if info.expires_at <= now {
                return LeaseCheck::Expired(self.end_lease(r));
            }
            match extend_to {
                Some(t) => {
                    r.expires_at.store(t, Ordering::Relaxed);
                    self.entry.counters.lease_due.fetch_min(t, Ordering::SeqCst);
                    r.unlock();
                    LeaseCheck::Live(info)
                }
                None => LeaseCheck::Live(self.end_lease(r)),
            }
        })
        .unwrap_or(LeaseCheck::Other(None))
    }

    /// The live lease of `slot`, if any (a copy; for reporting).
    pub fn lease_of(&self, slot: u32) -> Option<LeaseInfo> {
        self.with_lease(slot, |r| {
            let info = r.info();
            r.unlock();
            info
        })
    }

    /// Live leases of this cap (for the holders view).
    pub fn leases(&self) -> Vec<LeaseInfo> {
        if self.lease_count() == 0 {
            return Vec::new();
        }
        (0..self.capacity())
            .filter_map(|slot| self.lease_of(slot))
            .collect()
    }

    /// Ends every lease of this cap that expired by `now`; returns them (for the caller to
    /// count and log) and sets `lease_due` to the next expiry. The bound is reset *before* the
    /// scan, and every lease the scan keeps lowers it again, as does every lease started
    /// meanwhile (after its slot record is set): so no lease is ever left out of it.
    pub fn expire_leases(&self, now: i64) -> Vec<LeaseInfo> {
        let due = &self.entry.counters.lease_due;
        due.swap(i64::MAX, Ordering::SeqCst);
        let mut expired = Vec::new();
        for slot in 0..self.capacity() {
            let got = self.with_lease(slot, |r| {
                let expires_at = r.expires_at.load(Ordering::Relaxed);
                if expires_at <= now {
                    Some(self.end_lease(r))
                } else {
                    due.fetch_min(expires_at, Ordering::SeqCst);
                    r.unlock();
                    None
                }
            });
            if let Some(Some(info)) = got {
                expired.push(info);
            }
        }
        expired
    }
}

/// The background worker's round: frees lease records whose cap is gone (reclaimed with its
/// dropped database), and returns the caps with a lease due by `now`.
pub fn caps_with_leases_due(now: i64) -> Vec<CapRef> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    let mut due: Vec<CapRef> = Vec::new();
    for r in seg.leases {
        if r.state.load(Ordering::Acquire) != LIVE {
            continue;
        }
        let cap = CapRef {
            entry: r.entry.load(Ordering::Relaxed),
            generation: r.generation.load(Ordering::Relaxed),
        };
        if due.contains(&cap) {
            continue; // one look per cap
        }
        match pin(cap) {
            Some(c) => {
                if c.lease_due(now) {
                    due.push(cap);
                }
            }
            None => {
                // A live lease keeps its slot's bit set, so its cap is not reclaimed: the record
                // was ended (and maybe reused) since it was read. Look again with it locked,
                // and free it only if its cap is truly gone (defensive: nothing else could).
                if r.lock() {
                    let again = CapRef {
                        entry: r.entry.load(Ordering::Relaxed),
                        generation: r.generation.load(Ordering::Relaxed),
                    };
                    if pin(again).is_none() {
                        r.state.store(FREE, Ordering::Release);
                    } else {
                        r.unlock();
                    }
                }
            }
        }
    }
    due
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn lease_markers_are_negative_and_round_trip() {
        for i in [0usize, 1, 4095, 1 << 20] {
            let pid = lease_marker(i);
            assert!(pid < 0);
            assert_eq!(lease_index(pid), Some(i));
        }
        // A backend's pid (positive) or no holder (0) is not a lease.
        assert_eq!(lease_index(0), None);
        assert_eq!(lease_index(12345), None);
    }
}
