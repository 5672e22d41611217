//! stage_e_slots: a concurrency cap enforced inside PostgreSQL.
//!
//! `stage_e_try_slot(cap, n)` hands this session one of n slots of a named cap, each a
//! session-level advisory lock, or NULL when all are taken; `stage_e_release(cap, slot)` gives it
//! back and proves the caller held it.
//!
//! Floors, bottom to top: a module uses only modules on floors below its own, never one on its
//! own floor or above (`make layers` checks it against this list; `stage_e_core`, the crate with
//! no server at all, is below them all). Each line: what the floor holds (what it uses; the
//! bottom floor uses none of ours):
//!
//! 1. `backend`, `failures`, `ffi`, `gucs`: backend statics, errors as data, raw calls, settings
//! 2. `names`, `locks`: text at the encoding's edge, the lock manager (failures, gucs; ffi)
//! 3. `report`, `sql`: ereport plumbing (`log`, `fail`), every statement we run (names, gucs, backend)
//! 4. `shmem`: shared state, one file per concern (report, failures, gucs, backend)
//! 5. `session`: this backend's state and identity (shmem, names, gucs, ffi, backend)
//! 6. `keys`, `flush`: which advisory locks are a cap's slots; durable counts (session, sql, ...)
//! 7. `horizons`: loading and advancing the lease horizons (keys, session, shmem, sql, report)
//! 8. `slots`: acquire, release, leases, waiting, adaptive caps, rates, lifecycle (everything below)
//! 9. `hooks`: exit and transaction-end callbacks, `DROP EXTENSION` (slots, session, shmem)
//! 10. `errors`, `worker`: refusals in words (SQLSTATE, hint); the launcher, flushers (all below)
//! 11. `api`: the SQL surface by part: slots, leases, adapt, rates, held_back, stats, snapshot
//!     (all below)
//! 12. `compat`: earlier versions' C symbols (api's row macro, errors, slots)

#[macro_use]
mod api;
mod backend;
mod compat;
mod errors;
mod failures;
mod ffi;
mod flush;
mod gucs;
mod hooks;
mod horizons;
mod keys;
mod locks;
mod names;
mod report;
mod session;
mod shmem;
mod slots;
mod sql;
mod worker;

use pgrx::prelude::*;

::pgrx::pg_module_magic!();

/// Loaded by `shared_preload_libraries`: settings, shared memory, the background launcher.
#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    keep_backtraces_out_of_client_messages();
    if !preloading() {
        // Loaded by CREATE EXTENSION or a function call instead: there is no shared memory to
        // attach, so every function raises an ERROR with a HINT (fail closed), as
        // pg_stat_statements does.
        return;
    }
    gucs::init();
    gucs::reserve_prefix();
    shmem::init();
    hooks::install_object_access();
    // pg_upgrade starts both servers in binary-upgrade mode: no database work then (pg_cron).
    if !binary_upgrade() {
        worker::register();
    }
}

fn preloading() -> bool {
    // SAFETY: a flag the postmaster sets while loading shared_preload_libraries.
    unsafe { pg_sys::process_shared_preload_libraries_in_progress }
}

fn binary_upgrade() -> bool {
    // SAFETY: a flag set from the command line before shared_preload_libraries is loaded.
    unsafe { pg_sys::IsBinaryUpgrade }
}

/// pgrx puts a captured Rust backtrace into the DETAIL of any ERROR that crosses its FFI guard,
/// and captures one whenever RUST_BACKTRACE is set in the server's environment. A client must
/// never see our stack, so capture is turned off for this process and those it starts; the
/// error itself (message, detail, hint) is reported unchanged.
fn keep_backtraces_out_of_client_messages() {
    // SAFETY: _PG_init runs before the process starts any thread, so nothing reads the
    // environment concurrently.
    unsafe { std::env::set_var("RUST_LIB_BACKTRACE", "0") };
}

#[cfg(any(test, feature = "pg_test"))]
mod pg_tests;

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![
            "shared_preload_libraries = 'stage_e_slots'",
            "stage_e_slots.flush_interval = 200",
        ]
    }
}
