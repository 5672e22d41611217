//! This backend: who it is, which slots it took through the extension, and the two hooks that
//! keep shared memory honest when its locks go away without `stage_e_release`:
//!
//! - at transaction end, slots whose lock was dropped behind the extension's back
//!   (`DISCARD ALL`, `pg_advisory_unlock_all()`, `pg_advisory_unlock(key, slot)`; all of which
//!   can only be run by the holder itself) are cleared from shared memory;
//! - at backend exit, held slots are released at once and reported.
//!
//! The transaction-end hook also settles a counter flush (see `flush`): the pool advances only
//! if the transaction that wrote the row committed.
//!
//! Both are registered lazily on first use: `_PG_init` runs in the postmaster, whose exit
//! callbacks children discard, and a backend that never takes a slot pays nothing.

use crate::counters::FlushState;
use crate::shmem::{self, CapRef, Flushed, Ticket};
use pgrx::pg_sys;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::CStr;

/// A slot this backend holds through the extension: its cap, the cap's lock key, the slot,
/// and the fencing token it was acquired with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub cap: CapRef,
    pub key: i32,
    pub slot: u32,
    pub token: u64,
}

impl Held {
    fn same_slot(&self, other: &Held) -> bool {
        (self.cap, self.key, self.slot) == (other.cap, other.key, other.slot)
    }
}

/// The flush this transaction is making: per cap, the handle that settles it and what it read;
/// and the subtransaction that owns it.
struct Flush {
    caps: Vec<(Flushed, FlushState)>,
    subxact: pg_sys::SubTransactionId,
}

thread_local! {
    /// Slots this backend acquired through the extension and has not released.
    static TRACKED: RefCell<Vec<Held>> = const { RefCell::new(Vec::new()) };
    /// Caps this backend has used, by name (a backend's database never changes); the entry's
    /// generation tells a stale reference. `default` has a cell of its own (no hashing).
    static CAPS: RefCell<Option<HashMap<String, CapRef>>> = const { RefCell::new(None) };
    static DEFAULT: Cell<Option<CapRef>> = const { Cell::new(None) };
    /// The queue this backend waits in, if it is waiting (for the exit hook).
    static WAITING: Cell<Option<(CapRef, Ticket)>> = const { Cell::new(None) };
    static HOOKS_REGISTERED: Cell<bool> = const { Cell::new(false) };
    static RECOVERY_DONE: Cell<bool> = const { Cell::new(false) };
    /// The flush this transaction is making: the pool, what it read, and the subtransaction
    /// that owns it (settled when that subtransaction aborts, or by the transaction's end).
    static FLUSH: RefCell<Option<Flush>> = const { RefCell::new(None) };
}

pub fn pid() -> i32 {
    // SAFETY: set once at process start.
    unsafe { pg_sys::MyProcPid }
}

pub fn database() -> pg_sys::Oid {
    // SAFETY: set once at backend start-up, before any SQL runs.
    unsafe { pg_sys::MyDatabaseId }
}

/// Whether database `db` exists (a syscache probe; call inside a transaction).
pub fn database_exists(db: u32) -> bool {
    // SAFETY: a syscache lookup on the shared catalog pg_database, as the launcher does.
    unsafe {
        pg_sys::SearchSysCacheExists(
            pg_sys::SysCacheIdentifier::DATABASEOID as i32,
            pg_sys::Datum::from(db),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
        )
    }
}

/// Whether this process is a parallel worker or a leader running a parallel query.
pub fn in_parallel_mode() -> bool {
    unsafe extern "C" {
        fn IsInParallelMode() -> bool;
    }
    // SAFETY: returns a field of the current transaction state and cannot raise an ERROR, so
    // it is called without pgrx's setjmp guard (it runs twice per acquire+release pair).
    unsafe { IsInParallelMode() }
}

/// Start of the current statement as a TimestampTz: when a slot was acquired, to the
/// statement (as pg_stat_activity.query_start), without a clock read on the acquire path.
pub fn statement_start() -> i64 {
    unsafe extern "C" {
        fn GetCurrentStatementStartTimestamp() -> pg_sys::TimestampTz;
    }
    // SAFETY: returns a backend-local static; cannot raise an ERROR, so no setjmp guard.
    unsafe { GetCurrentStatementStartTimestamp() }
}

/// Whether this server is a standby. Once recovery has ended it never resumes in this
/// process (a promoted standby stays a primary), so a `false` is cached.
pub fn in_recovery() -> bool {
    if RECOVERY_DONE.get() {
        return false;
    }
    // SAFETY: reads shared recovery state under its own spinlock.
    let in_recovery = unsafe { pg_sys::RecoveryInProgress() };
    RECOVERY_DONE.set(!in_recovery);
    in_recovery
}

pub fn application_name() -> String {
    // SAFETY: the GUC variable is a valid C string or null.
    unsafe {
        let p = pg_sys::application_name;
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

/// The cap this backend last knew as `name`, if any.
pub fn cached_cap(name: &str) -> Option<CapRef> {
    if name == crate::directory::DEFAULT_CAP {
        return DEFAULT.get();
    }
    CAPS.with_borrow(|m| m.as_ref().and_then(|m| m.get(name).copied()))
}

/// Remembers (or, with None, forgets) the cap named `name`.
pub fn cache_cap(name: &str, cap: Option<CapRef>) {
    if name == crate::directory::DEFAULT_CAP {
        return DEFAULT.set(cap);
    }
    CAPS.with_borrow_mut(|m| {
        let m = m.get_or_insert_with(HashMap::new);
        match cap {
            Some(c) => {
                // A backend cycling through many one-off names must not grow without bound.
                if m.len() >= 4 * crate::gucs::max_caps() as usize {
                    m.clear();
                }
                m.insert(name.to_string(), c);
            }
            None => {
                m.remove(name);
            }
        }
    });
}

/// This backend's place in a cap's queue while it waits: leaving the scope (a return, or an
/// ERROR unwinding) leaves the queue; a process exit leaves it through the exit hook.
pub struct Queued {
    place: (CapRef, Ticket),
}

impl Queued {
    pub fn new(cap: CapRef, ticket: Ticket) -> Self {
        WAITING.set(Some((cap, ticket)));
        Queued {
            place: (cap, ticket),
        }
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        WAITING.set(None);
        shmem::dequeue(self.place.0, self.place.1);
    }
}

pub fn track(held: Held) {
    TRACKED.with_borrow_mut(|t| t.push(held));
}

/// Forgets `held`; true if it was tracked.
pub fn untrack(held: Held) -> bool {
    TRACKED.with_borrow_mut(|t| match t.iter().position(|h| h.same_slot(&held)) {
        Some(i) => {
            t.swap_remove(i);
            true
        }
        None => false,
    })
}

/// The tracked slot `slot` of the cap with lock key `key`, if this backend holds it.
pub fn tracked_slot(key: i32, slot: u32) -> Option<Held> {
    TRACKED.with_borrow(|t| t.iter().copied().find(|h| h.key == key && h.slot == slot))
}

/// Tracked slots (of the cap with key `key`, or of every cap), sorted by key and slot.
pub fn tracked(key: Option<i32>) -> Vec<Held> {
    TRACKED.with_borrow(|t| {
        let mut v: Vec<Held> = t
            .iter()
            .copied()
            .filter(|h| key.is_none_or(|k| h.key == k))
            .collect();
        v.sort_unstable_by_key(|h| (h.key, h.slot));
        v
    })
}

/// Tracked slots for which `gone(held)` is true; allocates only when there are some.
pub fn tracked_where(gone: impl Fn(&Held) -> bool) -> Vec<Held> {
    TRACKED.with_borrow(|t| t.iter().copied().filter(|h| gone(h)).collect())
}

pub fn tracks_any() -> bool {
    TRACKED.with_borrow(|t| !t.is_empty())
}

/// Registers the exit and transaction-end hooks once per backend.
pub fn ensure_hooks() {
    if HOOKS_REGISTERED.get() {
        return;
    }
    // SAFETY: registered from a normal backend after InitPostgres, so before_shmem_exit
    // callbacks run LIFO *before* ShutdownPostgres releases all session locks: the hook still
    // sees (and itself releases) this backend's slots, with shared memory attached.
    unsafe {
        pg_sys::before_shmem_exit(Some(on_backend_exit), pg_sys::Datum::from(0));
        pg_sys::RegisterXactCallback(Some(on_xact_end), std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(Some(on_subxact_end), std::ptr::null_mut());
    }
    HOOKS_REGISTERED.set(true);
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_backend_exit(_code: i32, _arg: pg_sys::Datum) {
    // Terminated (or the client gone, or the postmaster) while waiting: leave the queue, so
    // the waiters behind are served.
    if let Some((cap, ticket)) = WAITING.take() {
        shmem::dequeue(cap, ticket);
    }
    if tracks_any() {
        crate::slots::release_on_exit();
    }
}

/// Whether this transaction has a flush to settle.
pub fn flushing() -> bool {
    FLUSH.with_borrow(Option::is_some)
}

/// Settles the caps' flush when this transaction (or the subtransaction making it) ends.
pub fn flush_started(caps: Vec<(Flushed, FlushState)>) {
    ensure_hooks();
    // SAFETY: reads the current transaction state; we are inside a transaction.
    let subxact = unsafe { pg_sys::GetCurrentSubTransactionId() };
    FLUSH.set(Some(Flush { caps, subxact }));
}

fn settle(commit: bool) {
    if let Some(f) = FLUSH.take() {
        for (cap, read) in &f.caps {
            if commit {
                cap.commit(read);
            } else {
                cap.abort();
            }
        }
    }
}

/// Sleeps `ms` milliseconds, answering a cancel or terminate request.
pub fn nap_ms(ms: i64) {
    // SAFETY: plain sleep; CHECK_FOR_INTERRUPTS may raise an ERROR, which pgrx's guard turns
    // into a Rust panic that unwinds to the SQL function's boundary.
    unsafe { pg_sys::pg_usleep(ms * 1000) };
    pgrx::check_for_interrupts!();
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_xact_end(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::XactEvent::*;
    match event {
        // The pool would have to follow a commit made later by another session.
        XACT_EVENT_PRE_PREPARE if FLUSH.with_borrow(Option::is_some) => {
            pgrx::error!("cannot PREPARE a transaction that flushed stage_e_slots counters")
        }
        XACT_EVENT_COMMIT | XACT_EVENT_PARALLEL_COMMIT => settle(true),
        XACT_EVENT_ABORT | XACT_EVENT_PARALLEL_ABORT => settle(false),
        _ => return,
    }
    if tracks_any() && !matches!(event, XACT_EVENT_PRE_PREPARE) {
        crate::slots::reconcile();
    }
}

/// A subtransaction that made a flush aborted: its row change is undone, so the delta is pending
/// again (and this transaction may flush anew). One that committed hands the flush to its parent.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_subxact_end(
    event: pg_sys::SubXactEvent::Type,
    mine: pg_sys::SubTransactionId,
    parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::SubXactEvent::*;
    let owner = FLUSH.with_borrow(|f| f.as_ref().map(|f| f.subxact));
    match owner {
        Some(id) if id == mine && event == SUBXACT_EVENT_ABORT_SUB => settle(false),
        Some(id) if id == mine && event == SUBXACT_EVENT_COMMIT_SUB => FLUSH.with_borrow_mut(|f| {
            if let Some(f) = f {
                f.subxact = parent;
            }
        }),
        _ => {}
    }
}
