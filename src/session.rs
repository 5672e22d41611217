//! This backend: who it is, which slots it took through the extension, which caps it knows by
//! name, where it waits, and the counter flush its transaction is making.
//!
//! It keeps state and answers questions about this process, using only the floors below it
//! (shared memory's handles, names, settings); the hooks that act on this state at transaction
//! end and exit are in `hooks`, what they do to held slots in `slots::held`. All state is in
//! [`BackendLocal`] statics: a backend is one thread.

use crate::backend::BackendLocal;
use crate::ffi;
use crate::shmem::{CapRef, Flushed, PolicyChange, Ticket};
use pgrx::pg_sys;
use stage_e_core::counters::FlushState;
use stage_e_core::directory::{NameHash, DEFAULT_CAP, MAX_NAME};
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

/// The flush this transaction is making: per cap, the role that settles it and what it read;
/// and the subtransaction that owns it.
struct Flush {
    caps: Vec<(Flushed, FlushState)>,
    subxact: pg_sys::SubTransactionId,
}

/// Slots this backend acquired through the extension and has not released.
static TRACKED: BackendLocal<RefCell<Vec<Held>>> = BackendLocal::new(RefCell::new(Vec::new()));
/// Caps this backend has used, by name (a backend's database never changes); the entry's
/// generation tells a stale reference. `default` has a cell of its own (no hashing).
static CAPS: BackendLocal<RefCell<Option<HashMap<String, CapRef, NameHash>>>> =
    BackendLocal::new(RefCell::new(None));
static DEFAULT: BackendLocal<Cell<Option<CapRef>>> = BackendLocal::new(Cell::new(None));
/// The named cap this backend used last, also in `CAPS`: a pair, or a loop on one tenant,
/// names the same cap call after call, and comparing the name is cheaper than hashing it.
static LAST: BackendLocal<RefCell<Last>> = BackendLocal::new(RefCell::new(Last {
    name: [0; MAX_NAME],
    len: 0,
    cap: None,
}));
/// The queue this backend waits in, if it is waiting (for the exit hook).
static WAITING: BackendLocal<Cell<Option<(CapRef, Ticket)>>> = BackendLocal::new(Cell::new(None));
static RECOVERY_DONE: BackendLocal<Cell<bool>> = BackendLocal::new(Cell::new(false));
/// Whether this backend has seen its database's durable state loaded (`slots::admission`): once
/// loaded, it stays loaded for the life of the segment, which outlives this backend.
static DATABASE_LOADED: BackendLocal<Cell<bool>> = BackendLocal::new(Cell::new(false));
static FLUSH: BackendLocal<RefCell<Option<Flush>>> = BackendLocal::new(RefCell::new(None));
/// Policy changes this transaction made (`stage_e_adapt`, `stage_e_adapt_off`), by the
/// subtransaction that made each, applied at its commit.
static POLICIES: BackendLocal<RefCell<Vec<PendingPolicy>>> =
    BackendLocal::new(RefCell::new(Vec::new()));

// -- who this backend is ---------------------------------------------------------------------

pub fn pid() -> i32 {
    // SAFETY: set once at process start.
    unsafe { pg_sys::MyProcPid }
}

pub fn database() -> u32 {
    // SAFETY: set once at backend start-up, before any SQL runs.
    unsafe { pg_sys::MyDatabaseId }.to_u32()
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

/// The databases that accept connections and are not templates (a scan of the shared catalog
/// pg_database, as autovacuum lists them; call inside a transaction).
pub fn connectable_databases() -> Vec<u32> {
    let mut out = Vec::new();
    // SAFETY: autovacuum's get_database_list: a catalog scan of pg_database (a heap) under
    // AccessShareLock inside the caller's transaction; each tuple's fixed part is read while
    // the scan holds it, and the scan and the relation are closed before returning.
    unsafe {
        let rel = pg_sys::table_open(
            pg_sys::DatabaseRelationId,
            pg_sys::AccessShareLock as pg_sys::LOCKMODE,
        );
        let scan = pg_sys::table_beginscan_catalog(rel, 0, std::ptr::null_mut());
        loop {
            let tuple = pg_sys::heap_getnext(scan, pg_sys::ScanDirection::ForwardScanDirection);
            if tuple.is_null() {
                break;
            }
            let form = &*pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_database>(tuple);
            if form.datallowconn && !form.datistemplate {
                out.push(form.oid.to_u32());
            }
        }
        pg_sys::heap_endscan(scan);
        pg_sys::table_close(rel, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
    }
    out
}

// -- whose leases it may touch and see (PostgreSQL's own rules for other sessions) ---------

/// The current role (a SECURITY DEFINER function's owner inside it, as PostgreSQL checks).
pub fn user_id() -> u32 {
    // SAFETY: a backend-local variable set by authentication and SET ROLE.
    unsafe { pg_sys::GetUserId() }.to_u32()
}

/// Whether the current role may renew or release a lease `owner` took: as `pg_terminate_backend`
/// decides for another session: the owner's privileges, or `pg_signal_backend`'s for a lease
/// not taken by a superuser.
pub fn may_act_for(owner: u32) -> bool {
    if owner == user_id() {
        return true; // the common case, without a catalog lookup
    }
    let me = pg_sys::Oid::from(user_id());
    let owner = pg_sys::Oid::from(owner);
    // SAFETY: catalog lookups of role membership, inside the caller's transaction.
    unsafe {
        pg_sys::has_privs_of_role(me, owner)
            || (!pg_sys::superuser_arg(owner)
                && pg_sys::has_privs_of_role(me, pg_sys::Oid::from(pg_sys::ROLE_PG_SIGNAL_BACKEND)))
    }
}

/// This backend's database's name, for a message (call inside a transaction).
pub fn database_name() -> String {
    // SAFETY: a syscache lookup on pg_database; the palloc'd name is copied at once (NULL if
    // the database was dropped meanwhile).
    unsafe {
        let p = pg_sys::get_database_name(pg_sys::MyDatabaseId);
        if p.is_null() {
            format!("with oid {}", database())
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

/// A role's name, for a message (its oid if it was dropped).
pub fn role_name(role: u32) -> String {
    // SAFETY: a syscache lookup; GetUserNameFromId with noerr returns NULL for a dropped role,
    // and the palloc'd name is copied at once.
    unsafe {
        let p = pg_sys::GetUserNameFromId(pg_sys::Oid::from(role), true);
        if p.is_null() {
            format!("with oid {role}")
        } else {
            format!("\"{}\"", crate::names::from_server_lossy(CStr::from_ptr(p)))
        }
    }
}

/// Whether the current role may see the token of a lease `owner` took: as
/// `pg_stat_activity` shows another session's query, the owner's privileges or
/// `pg_read_all_stats`'.
pub fn may_see_token_of(owner: u32) -> bool {
    if owner == user_id() {
        return true;
    }
    let me = pg_sys::Oid::from(user_id());
    // SAFETY: catalog lookups of role membership, inside the caller's transaction.
    unsafe {
        pg_sys::has_privs_of_role(me, pg_sys::Oid::from(owner))
            || pg_sys::has_privs_of_role(me, pg_sys::Oid::from(pg_sys::ROLE_PG_READ_ALL_STATS))
    }
}

/// Whether this process is a parallel worker or a leader running a parallel query.
pub fn in_parallel_mode() -> bool {
    ffi::is_in_parallel_mode()
}

/// Start of the current statement as a TimestampTz: when a slot was acquired, to the
/// statement (as pg_stat_activity.query_start), without a clock read on the acquire path.
pub fn statement_start() -> i64 {
    ffi::statement_start_timestamp()
}

/// When this transaction started (its snapshot is no older).
pub fn transaction_start() -> i64 {
    ffi::transaction_start_timestamp()
}

/// Now, as a TimestampTz (microseconds since 2000-01-01).
pub fn now() -> i64 {
    // SAFETY: reads the clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// Whether this server is a standby. Once recovery has ended it never resumes in this
/// process (a promoted standby stays a primary), so a `false` is cached.
#[inline]
pub fn in_recovery() -> bool {
    !RECOVERY_DONE.get() && ask_recovery()
}

/// Out of line: the guarded call's frame would otherwise be set up on every call.
#[cold]
#[inline(never)]
fn ask_recovery() -> bool {
    // SAFETY: reads shared recovery state under its own spinlock.
    let in_recovery = unsafe { pg_sys::RecoveryInProgress() };
    RECOVERY_DONE.set(!in_recovery);
    in_recovery
}

/// Whether this process runs under a postmaster (false in a single-user backend).
pub fn under_postmaster() -> bool {
    // SAFETY: a flag set once at process start.
    unsafe { pg_sys::IsUnderPostmaster }
}

/// Whether this backend has seen its database loaded.
#[inline]
pub fn database_loaded() -> bool {
    DATABASE_LOADED.get()
}

pub fn set_database_loaded() {
    DATABASE_LOADED.set(true);
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

/// Sleeps `ms` milliseconds, answering a cancel or terminate request.
pub fn nap_ms(ms: i64) {
    // SAFETY: plain sleep; CHECK_FOR_INTERRUPTS may raise an ERROR, which pgrx's guard turns
    // into a Rust panic that unwinds to the SQL function's boundary.
    unsafe { pg_sys::pg_usleep(ms * 1000) };
    pgrx::check_for_interrupts!();
}

// -- caps it knows by name -------------------------------------------------------------------

/// A name and its cap, inline (a name is at most `MAX_NAME` bytes), so remembering it never
/// allocates.
struct Last {
    name: [u8; MAX_NAME],
    len: u8,
    cap: Option<CapRef>,
}

impl Last {
    #[inline]
    fn is(&self, name: &str) -> bool {
        self.cap.is_some() && &self.name[..self.len as usize] == name.as_bytes()
    }

    fn remember(&mut self, name: &str, cap: Option<CapRef>) {
        // A longer name is not one (`directory::check_name`): not remembered.
        if let (Some(dst), Some(_)) = (self.name.get_mut(..name.len()), cap) {
            dst.copy_from_slice(name.as_bytes());
            self.len = name.len() as u8;
            self.cap = cap;
        } else {
            self.cap = None;
        }
    }
}

/// The cap this backend last knew as `name`, if any.
#[inline]
pub fn cached_cap(name: &str) -> Option<CapRef> {
    if name == DEFAULT_CAP {
        return DEFAULT.get();
    }
    if let Some(cap) = LAST.with_borrow(|l| l.is(name).then_some(l.cap).flatten()) {
        return Some(cap);
    }
    let cap = CAPS.with_borrow(|m| m.as_ref().and_then(|m| m.get(name).copied()));
    if cap.is_some() {
        LAST.with_borrow_mut(|l| l.remember(name, cap));
    }
    cap
}

/// Remembers (or, with None, forgets) the cap named `name`.
pub fn cache_cap(name: &str, cap: Option<CapRef>) {
    if name == DEFAULT_CAP {
        return DEFAULT.set(cap);
    }
    LAST.with_borrow_mut(|l| {
        if cap.is_some() || l.is(name) {
            l.remember(name, cap);
        }
    });
    CAPS.with_borrow_mut(|m| {
        let m = m.get_or_insert_with(HashMap::default);
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

// -- where it waits --------------------------------------------------------------------------

/// This backend waits in `place` (Some) or no longer waits (None).
pub fn set_waiting(place: Option<(CapRef, Ticket)>) {
    WAITING.set(place);
}

/// Where this backend waits, if it does; it then no longer does (for the exit hook).
pub fn take_waiting() -> Option<(CapRef, Ticket)> {
    WAITING.take()
}

// -- the slots it holds ----------------------------------------------------------------------

pub fn track(held: Held) {
    TRACKED.with_borrow_mut(|t| t.push(held));
}

/// How many session slots this backend holds through the extension.
pub fn tracked_count() -> u32 {
    TRACKED.with_borrow(|t| t.len() as u32)
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

/// Stops tracking slot `slot` of the cap with lock key `key`, if this backend tracked it: the
/// release path, which then drops its bookkeeping (`held::drop_bookkeeping`) or reports it lost.
#[inline]
pub fn take_tracked(key: i32, slot: u32) -> Option<Held> {
    TRACKED.with_borrow_mut(|t| {
        let i = t.iter().position(|h| h.key == key && h.slot == slot)?;
        Some(t.swap_remove(i))
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

/// Whether a transaction's end has nothing of this backend's to settle: no slot tracked, no
/// flush, no policy change. Never panics (it runs outside pgrx's guard): a state borrowed at
/// the moment counts as something to settle.
pub fn nothing_to_settle() -> bool {
    TRACKED.try_with_borrow(Vec::is_empty) == Some(true)
        && FLUSH.try_with_borrow(Option::is_none) == Some(true)
        && POLICIES.try_with_borrow(Vec::is_empty) == Some(true)
}

// -- the flush its transaction makes ---------------------------------------------------------

/// Whether this transaction has a flush to settle.
pub fn flushing() -> bool {
    FLUSH.with_borrow(Option::is_some)
}

/// This transaction (its current subtransaction) now makes a flush of `caps`, settled when it
/// ends (`hooks`, which the caller has registered).
pub fn flush_started(caps: Vec<(Flushed, FlushState)>) {
    // SAFETY: reads the current transaction state; we are inside a transaction.
    let subxact = unsafe { pg_sys::GetCurrentSubTransactionId() };
    FLUSH.set(Some(Flush { caps, subxact }));
}

/// The transaction ended: its flush (if any) advances each cap (commit) or stays pending.
pub fn settle_flush(commit: bool) {
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

// -- the policy changes its transaction makes ------------------------------------------------

/// What a policy change asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// `stage_e_adapt` or `stage_e_adapt_off`.
    Adapt(PolicyChange),
    /// `stage_e_rate_limit` (count, per in ns, burst) or `stage_e_rate_limit_off` (None); on a
    /// cap or a pattern (`tenant:*`).
    Rate(Option<(u32, u64, u32)>),
    /// `stage_e_share`: a share policy of the cap (kept in `stage_e_share_policy`, read by each
    /// backend; the commit moves the database's generation of them).
    Share,
}

/// A policy change made in subtransaction `subxact`, for the cap `cap` of this database.
pub struct PendingPolicy {
    pub subxact: pg_sys::SubTransactionId,
    pub cap: String,
    pub change: Change,
    /// The LOG line to write once it is applied (made while catalogs can be read).
    pub log: String,
}

/// This transaction (its current subtransaction) changed `cap`'s policy; applied at its commit
/// (`hooks`, which the caller has registered). A later change of the same cap replaces it.
pub fn policy_changed(cap: &str, change: Change, log: String) {
    // SAFETY: reads the current transaction state; we are inside a transaction.
    let subxact = unsafe { pg_sys::GetCurrentSubTransactionId() };
    POLICIES.with_borrow_mut(|p| {
        p.push(PendingPolicy {
            subxact,
            cap: cap.to_string(),
            change,
            log,
        })
    });
}

/// Whether this transaction changed a policy (PREPARE refuses it: the change would have to
/// follow a commit made later, by another session).
pub fn changes_policies() -> bool {
    POLICIES.with_borrow(|p| !p.is_empty())
}

/// The changes made so far (the pre-commit reserves their records), oldest first.
pub fn pending_policies() -> Vec<PendingPolicy> {
    POLICIES.with_borrow(|p| {
        p.iter()
            .map(|c| PendingPolicy {
                subxact: c.subxact,
                cap: c.cap.clone(),
                change: c.change,
                log: String::new(),
            })
            .collect()
    })
}

/// The transaction ended: the changes to apply (commit), in the order they were made; none
/// when it aborted.
pub fn take_policies(commit: bool) -> Vec<PendingPolicy> {
    let all = POLICIES.take();
    if commit {
        all
    } else {
        Vec::new()
    }
}

/// Subtransaction `mine` ended: its policy changes belong to `parent` (commit) or are undone
/// with its row changes (abort).
fn policies_subxact_ended(
    mine: pg_sys::SubTransactionId,
    parent: pg_sys::SubTransactionId,
    commit: bool,
) {
    POLICIES.with_borrow_mut(|p| {
        if commit {
            p.iter_mut()
                .filter(|c| c.subxact == mine)
                .for_each(|c| c.subxact = parent);
        } else {
            p.retain(|c| c.subxact != mine);
        }
    });
}

/// Subtransaction `mine` ended. If it made the flush: aborted, its row change is undone, so the
/// delta is pending again (and this transaction may flush anew); committed, the flush belongs
/// to `parent` now.
pub fn subxact_ended(
    mine: pg_sys::SubTransactionId,
    parent: pg_sys::SubTransactionId,
    commit: bool,
) {
    policies_subxact_ended(mine, parent, commit);
    let owns = FLUSH.with_borrow(|f| f.as_ref().is_some_and(|f| f.subxact == mine));
    if !owns {
        return;
    }
    if commit {
        FLUSH.with_borrow_mut(|f| {
            if let Some(f) = f {
                f.subxact = parent;
            }
        });
    } else {
        settle_flush(false);
    }
}
