//! Background workers that make the counters durable.
//!
//! A backend can only write into the database it is connected to, and caps are per database,
//! so the design is pg_cron's and TimescaleDB's: one **launcher** (a static worker, started once
//! recovery has finished, so a standby runs none until promoted) wakes every
//! `stage_e_slots.flush_interval`, and for each database with pending counts starts a
//! short-lived **flusher** connected to that database, waiting for it to finish before the next.
//! So the extension uses at most two of `max_worker_processes` at once.
//!
//! A flusher that fails (table locked past its lock_timeout, dropped, anything) ends with the
//! ERROR in the log; its delta stays pending and the launcher tries again next interval.

use crate::flush::{self, Write};
use crate::gucs;
use crate::session;
use crate::shmem;
use crate::slots;
use crate::sql;
use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, SignalWakeFlags};
use pgrx::prelude::*;
use std::time::{Duration, Instant};

const LIBRARY: &str = "stage_e_slots";
/// A flusher waits at most this long for a lock on the counter row before giving up until
/// the next interval, so a locked table cannot stall the other databases' flushes.
const FLUSH_LOCK_TIMEOUT: &std::ffi::CStr = c"1s";
/// How often the launcher samples the caps' load (held slots, throttles) at most.
const LOAD_SAMPLE: Duration = Duration::from_secs(5);

/// Registers the launcher; called from `_PG_init` while preloading.
pub fn register() {
    BackgroundWorkerBuilder::new("stage_e_slots launcher")
        .set_type("stage_e_slots launcher")
        .set_library(LIBRARY)
        .set_function("stage_e_slots_launcher_main")
        .enable_spi_access()
        .set_restart_time(Some(Duration::from_secs(5)))
        .load();
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn stage_e_slots_launcher_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    // No database: the launcher reads shared memory and pg_database (a shared catalog) only.
    BackgroundWorker::connect_worker_to_spi(None, None);
    log!(
        "stage_e_slots launcher started: flushing counters every {} ms",
        gucs::flush_interval().as_millis()
    );
    let mut last_round = Instant::now();
    let mut last_sample: Option<Instant> = None;
    let mut first = true;
    shmem::launcher_wakeup(true);
    loop {
        let interval = gucs::flush_interval();
        // Load samples every 5 s (or every flush interval, if shorter).
        let sample_every = interval.min(LOAD_SAMPLE);
        let now = Instant::now();
        if last_sample.is_none_or(|t| now >= t + sample_every) {
            shmem::sample_load(session::now());
            slots::expire_leases_everywhere();
            last_sample = Some(now);
        }
        let due = last_round + interval;
        // A backend that found the caps crowded asks for a round now (shmem::request_flush).
        let asked = shmem::launcher_wakeup(false);
        if !first && !asked && now < due {
            let next_sample = last_sample.map_or(now, |t| t + sample_every);
            let wake = due.min(next_sample).max(now);
            if !BackgroundWorker::wait_latch(Some(wake - now)) {
                break;
            }
            if BackgroundWorker::sighup_received() {
                // SAFETY: the documented way for a worker to apply a reload (as pg_cron does).
                unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
            }
            continue;
        }
        first = false;
        last_round = now;
        flush_round();
    }
    // Counts still pending now are saved by the postmaster at shutdown (see shmem).
}

/// One flusher per database with pending counts, one after another.
fn flush_round() {
    reclaim_dropped();
    for db in shmem::databases_with_pending() {
        run_flusher(db);
    }
}

/// Frees the caps of dropped databases (their pending counts have nowhere to go; see
/// `shmem::reclaim_database`).
fn reclaim_dropped() {
    for db in shmem::databases() {
        if !BackgroundWorker::transaction(|| session::database_exists(db)) {
            shmem::reclaim_database(db);
        }
    }
}

fn run_flusher(db: u32) {
    let started = BackgroundWorkerBuilder::new(&format!("stage_e_slots flusher for database {db}"))
        .set_type("stage_e_slots flusher")
        .set_library(LIBRARY)
        .set_function("stage_e_slots_flusher_main")
        .enable_spi_access()
        .set_argument(Some(pg_sys::Datum::from(db)))
        // SAFETY: our own pid, so that we are told when the flusher starts and stops.
        .set_notify_pid(unsafe { pg_sys::MyProcPid })
        .load_dynamic();
    match started {
        Ok(worker) => {
            let _ = worker.wait_for_shutdown();
        }
        Err(_) => warning!(
            "stage_e_slots: could not start a flusher for database {db}; counters stay pending",
        ),
    }
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn stage_e_slots_flusher_main(arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGTERM);
    let db = pg_sys::Oid::from(arg.value() as u32);
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(db), None);
    BackgroundWorker::transaction(|| {
        sql::set_local(c"lock_timeout", FLUSH_LOCK_TIMEOUT);
        match flush::flush(Write::Add, None, false) {
            Ok(Some(_)) => {}
            Ok(None) => drop_orphaned(db),
            Err(e) => error!(
                "stage_e_slots: flush of database {} failed: {e:?}",
                db.to_u32()
            ),
        }
    });
}

/// The extension is no longer installed here: its table is gone with it, so the counts have
/// nowhere to go.
fn drop_orphaned(db: pg_sys::Oid) {
    let caps = flush::discard_pending();
    if caps > 0 {
        log!(
            "stage_e_slots: dropped pending counters of {caps} cap(s) of database {}, which no \
             longer has the extension",
            db.to_u32()
        );
    }
}
