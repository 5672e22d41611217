//! stage_e_slots: a concurrency cap enforced inside PostgreSQL.
//!
//! `stage_e_try_slot(cap, n)` hands this session one of n slots of a named cap, each a
//! session-level advisory lock, or NULL when all are taken; `stage_e_release(cap, slot)` gives it
//! back and proves the caller held it. Modules, each depending only on those below it:
//!
//! - the SQL surface: `api` (by surface: slots, leases, stats, snapshot), `compat` (earlier
//!   versions' symbols), `errors` (how failures are reported);
//! - the logic: `slots` (acquire, release, leases; `slots::waiting`, the wait policy;
//!   `slots::adapt`, adaptive caps;
//!   `slots::held`, what happens to slots whose lock went away; `slots::durable`, the lifecycle
//!   rules a call keeps; `slots::views`, what the views read), `flush` (durable counts),
//!   `durable` (loading and advancing the lease horizons), `worker` (the launcher and
//!   flushers), `hooks` (exit and transaction-end callbacks, and `DROP EXTENSION`);
//! - this backend and Postgres: `session` (this backend's state, a leaf), `locks` (the lock
//!   manager), `keys` (which advisory locks are a cap's slots), `shmem` (shared state, one
//!   file per concern), `sql` (every statement we run),
//!   `gucs` (settings), `ffi` (calls made without pgrx's guard), `names` (text in the server
//!   encoding: names are UTF-8 inside, converted at the edge);
//! - no server at all: the `stage_e_core` crate (slot bitmap, arena, directory, counters, the
//!   segment layout and the lock-free protocols of shared memory, tested with threads).

#[macro_use]
mod api;
mod compat;
mod durable;
mod errors;
mod ffi;
mod flush;
mod gucs;
mod hooks;
mod keys;
mod locks;
mod names;
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
