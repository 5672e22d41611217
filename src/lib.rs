//! stage_e_slots: a concurrency cap enforced inside PostgreSQL.
//!
//! `stage_e_try_slot(cap, n)` hands this session one of n slots of a named cap, each a
//! session-level advisory lock, or NULL when all are taken; `stage_e_release(cap, slot)` gives it
//! back and proves the caller held it. Module map:
//! - plain Rust, unit-tested: `occupancy` (slot search), `arena` (slot memory), `directory`
//!   (cap names and keys), `counters` (counter arithmetic, the shutdown file);
//! - Postgres internals: `shmem` (shared state), `locks` (lock manager), `session` (this backend
//!   and its exit/transaction hooks), `worker` (the flush launcher and flushers);
//! - the logic: `slots` (caps), `flush` (durable counts), `sql` (every statement we run);
//! - the SQL surface: `api`, `compat` (earlier versions' symbols), `errors` (how failures are reported).

#[macro_use]
mod counters;
#[macro_use]
mod api;
mod arena;
mod compat;
mod directory;
mod errors;
mod flush;
mod gucs;
mod locks;
mod occupancy;
mod session;
mod shmem;
mod slots;
mod sql;
mod waiting;
mod worker;

use pgrx::prelude::*;

::pgrx::pg_module_magic!();

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    keep_backtraces_out_of_client_messages();
    // SAFETY: a flag the postmaster sets while loading shared_preload_libraries.
    if unsafe { !pg_sys::process_shared_preload_libraries_in_progress } {
        // Loaded by CREATE EXTENSION or a function call instead: there is no shared memory to
        // attach, so every function raises an ERROR with a HINT (fail closed), as
        // pg_stat_statements does.
        return;
    }
    gucs::init();
    gucs::reserve_prefix();
    shmem::init();
    // pg_upgrade starts both servers in binary-upgrade mode: no database work then (pg_cron).
    // SAFETY: a flag set from the command line before shared_preload_libraries is loaded.
    let binary_upgrade = unsafe { pg_sys::IsBinaryUpgrade };
    if !binary_upgrade {
        worker::register();
    }
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
