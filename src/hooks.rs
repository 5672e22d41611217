//! The backend's exit, transaction-end and subtransaction-end hooks.
//!
//! - At backend exit, held slots are released at once and reported, and a waiter leaves its
//!   queue (`slots::held::release_on_exit`).
//! - At transaction end, a counter flush is settled (`flush`: the cap advances only if the
//!   transaction that wrote its row committed), and slots whose lock was dropped behind the
//!   extension's back (`DISCARD ALL`, `pg_advisory_unlock_all()`, `pg_advisory_unlock(key,
//!   slot)`; all of which only the holder itself can run) are cleared from shared memory
//!   (`slots::held::reconcile`).
//! - At subtransaction end, a flush made in it is settled or handed to its parent, and so are
//!   the adaptive policy changes made in it.
//! - At pre-commit, a transaction that sets policies reserves their records (an ERROR there
//!   rolls its rows back: `slots::limits::reserve_committing`); at commit, the policy changes of
//!   `stage_e_adapt` / `stage_e_adapt_off` (whose rows the transaction wrote) reach shared
//!   memory (`slots::limits::apply_committed`); an abort drops them with the rows. Either end
//!   releases the reservations.
//! - `DROP EXTENSION stage_e_slots` (also through `DROP SCHEMA ... CASCADE` or `DROP OWNED`) is
//!   noticed by an object-access hook, installed in `_PG_init` (the one hook every backend
//!   inherits), and remembered with its subtransaction; when the dropping transaction commits,
//!   the database's caps end (`slots::end_database`): leases freed, pending counts dropped.
//!   A rolled-back drop changes nothing.
//!
//! Registered lazily (`ensure`), before they act, by the SQL functions that acquire, flush or
//! change a policy (`api`, `compat`) and by the flushers (`worker`): `_PG_init` runs in the
//! postmaster, whose exit callbacks children discard, and a backend that never takes a slot pays
//! nothing. So this module sits above `slots` (whose `held` it calls) and `session` (whose state
//! it settles), and only the floors above it call it (`src/lib.rs`).

use crate::backend::BackendLocal;
use crate::session;
use crate::shmem;
use crate::slots::held;
use pgrx::pg_sys;
use std::cell::Cell;

static REGISTERED: BackendLocal<Cell<bool>> = BackendLocal::new(Cell::new(false));
/// The hook installed before ours, called first.
static PREV_OBJECT_ACCESS: BackendLocal<Cell<pg_sys::object_access_hook_type>> =
    BackendLocal::new(Cell::new(None));
/// The subtransaction that dropped the extension, until its transaction ends.
static DROPPED_IN: BackendLocal<Cell<Option<pg_sys::SubTransactionId>>> =
    BackendLocal::new(Cell::new(None));

/// From `_PG_init`, in the postmaster: every backend forks with the hook in place.
pub fn install_object_access() {
    // SAFETY: the postmaster loads shared_preload_libraries once, single-threaded; chaining the
    // previous hook is the documented protocol.
    unsafe {
        PREV_OBJECT_ACCESS.set(pg_sys::object_access_hook);
        pg_sys::object_access_hook = Some(on_object_access);
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_object_access(
    access: pg_sys::ObjectAccessType::Type,
    class_id: pg_sys::Oid,
    object_id: pg_sys::Oid,
    sub_id: std::ffi::c_int,
    arg: *mut std::ffi::c_void,
) {
    if let Some(prev) = PREV_OBJECT_ACCESS.get() {
        // SAFETY: the previous hook, with the arguments it was given.
        unsafe { prev(access, class_id, object_id, sub_id, arg) };
    }
    if access != pg_sys::ObjectAccessType::OAT_DROP
        || class_id != pg_sys::ExtensionRelationId
        || DROPPED_IN.get().is_some()
    {
        return;
    }
    // SAFETY: a catalog lookup inside the dropping transaction (the row is still visible to it
    // while its dependents are dropped).
    let ours = unsafe { pg_sys::get_extension_oid(c"stage_e_slots".as_ptr(), true) };
    if object_id == ours && shmem::attached() {
        ensure();
        // SAFETY: inside a transaction.
        DROPPED_IN.set(Some(unsafe { pg_sys::GetCurrentSubTransactionId() }));
    }
}

/// Registers the hooks once per backend (not without shared memory: then nothing is held).
#[inline]
pub fn ensure() {
    if !REGISTERED.get() {
        register();
    }
}

#[cold]
fn register() {
    if !shmem::attached() {
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
    REGISTERED.set(true);
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_backend_exit(_code: i32, _arg: pg_sys::Datum) {
    // Terminated (or the client gone, or the postmaster) while waiting: leave the queue, so
    // the waiters behind are served.
    if let Some((cap, ticket)) = session::take_waiting() {
        shmem::dequeue(cap, ticket);
    }
    if session::tracks_any() {
        held::release_on_exit();
    }
}

/// Transaction end. Most transactions of a backend that used the extension leave nothing to
/// settle (a throttled try, a read), and the guard's setjmp and unwind catch cost more than
/// the look: so the look comes first, outside the guard (it cannot fail or panic).
unsafe extern "C-unwind" fn on_xact_end(
    event: pg_sys::XactEvent::Type,
    arg: *mut std::ffi::c_void,
) {
    if session::nothing_to_settle() && DROPPED_IN.get().is_none() {
        return;
    }
    // SAFETY: the callback PostgreSQL called, with its arguments.
    unsafe { on_xact_end_guarded(event, arg) }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_xact_end_guarded(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::XactEvent::*;
    match event {
        // The caps would have to follow a commit made later by another session.
        XACT_EVENT_PRE_PREPARE if session::flushing() => {
            pgrx::error!("cannot PREPARE a transaction that flushed stage_e_slots counters")
        }
        XACT_EVENT_PRE_PREPARE if session::changes_policies() => crate::report::error(
            pgrx::PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            "cannot PREPARE a transaction that changed a stage_e_slots policy".into(),
            "It called stage_e_adapt, stage_e_adapt_off, stage_e_rate_limit, \
             stage_e_rate_limit_off or stage_e_share, or wrote the policies of \
             stage_e_throttle_counter or stage_e_share_policy by hand. A policy binds from its \
             transaction's commit, and COMMIT PREPARED may come later, in any session."
                .into(),
            Some("Change policies in a transaction that is not prepared.".into()),
        ),
        XACT_EVENT_PRE_COMMIT if session::changes_policies() => {
            crate::slots::limits::reserve_committing(&session::pending_policies());
            return;
        }
        XACT_EVENT_COMMIT | XACT_EVENT_PARALLEL_COMMIT => {
            session::settle_flush(true);
            let policies = session::take_policies(true);
            if !policies.is_empty() {
                crate::slots::limits::apply_committed(policies);
                shmem::unreserve();
                shmem::unreserve_rate_policies();
            }
            if DROPPED_IN.take().is_some() {
                crate::slots::end_database();
            }
        }
        XACT_EVENT_ABORT | XACT_EVENT_PARALLEL_ABORT => {
            session::settle_flush(false);
            if session::changes_policies() {
                session::take_policies(false);
                shmem::unreserve();
                shmem::unreserve_rate_policies();
            }
            DROPPED_IN.set(None);
        }
        _ => return,
    }
    if session::tracks_any() {
        held::reconcile();
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_subxact_end(
    event: pg_sys::SubXactEvent::Type,
    mine: pg_sys::SubTransactionId,
    parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::SubXactEvent::*;
    let committed = match event {
        SUBXACT_EVENT_ABORT_SUB => false,
        SUBXACT_EVENT_COMMIT_SUB => true,
        _ => return,
    };
    session::subxact_ended(mine, parent, committed);
    if DROPPED_IN.get() == Some(mine) {
        DROPPED_IN.set(committed.then_some(parent));
    }
}
