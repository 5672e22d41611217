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
//! ERROR in the log; its delta stays pending and the launcher tries again next interval. A
//! database whose counts fail to flush round after round for `stage_e_slots.flush_give_up` has
//! them dropped, with a LOG line ([`Failing`]): they would keep its caps from being reclaimed.
//! Nothing a database owner or a role sets for the database makes a flusher fail or write
//! differently: each worker pins its settings (`sql::pin_worker_settings`), and a database
//! closed to new connections is flushed all the same (`BGWORKER_BYPASS_ALLOWCONN`).
//!
//! Flushers also keep the durable lease state (`horizons`, `docs/lifecycle.md`): a flusher loads
//! its database after a start, and writes the lease horizons, token floors and journals that
//! are due. Those are asked for by backends (an advance, a load: the launcher runs at once) and
//! looked for every second while any lease is live; counters keep their own interval.

use crate::flush::{self, Write};
use crate::gucs;
use crate::horizons;
use crate::report;
use crate::session;
use crate::shmem;
use crate::slots;
use crate::sql;
use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, SignalWakeFlags};
use pgrx::prelude::*;
use std::time::{Duration, Instant};

const LIBRARY: &str = "stage_e_slots";
/// How often the launcher samples the caps' load (held slots, throttles) at most.
const LOAD_SAMPLE: Duration = Duration::from_secs(5);
/// How often adaptive caps learn from their windows, while there are any
/// (`stage_e_core::adapt::WINDOW_US`).
const ADAPT_EVERY: Duration = Duration::from_micros(stage_e_core::adapt::WINDOW_US as u64);
/// With `stage_e_slots.counter_retention` on, each database is swept (its old counter rows
/// deleted) every retention, but at most every minute and at least every flush interval.
const SWEEP_MAX: Duration = Duration::from_secs(60);

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
    // Its transactions read only, but a role's timeouts (transaction_timeout) apply here too.
    sql::pin_worker_settings();
    log!(
        "stage_e_slots launcher started: flushing counters every {} ms",
        gucs::flush_interval().as_millis()
    );
    let mut last_round = Instant::now();
    let mut last_sample: Option<Instant> = None;
    let mut last_sweep: Option<Instant> = None;
    let mut last_adapt: Option<Instant> = None;
    let mut first = true;
    let mut backoff = Backoff::default();
    let mut failing = Failing::default();
    shmem::launcher_wakeup(true);
    shmem::note_recovered(session::now());
    shmem::note_rates_recovered();
    if shmem::start_kind().holds() {
        // After a crash or a promotion, every database is loaded now, so that the caps held
        // back are held (and logged) from the start, not at their first use.
        BackgroundWorker::transaction(|| {
            let mut taken = true;
            for db in session::connectable_databases() {
                taken &= shmem::request_load(db);
            }
            // Once they are loaded, a clean shutdown may carry the holds over (`persist`).
            if taken {
                shmem::note_loads_requested();
            }
        });
    }
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
        let adaptive = slots::limits::any();
        if adaptive && last_adapt.is_none_or(|t| now >= t + ADAPT_EVERY) {
            slots::limits::tick();
            last_adapt = Some(now);
        }
        let due = last_round + interval;
        // A backend that found the caps crowded asks for a round now (shmem::request_flush);
        // one that needs a horizon advance or a load asks for those (shmem::request_advance).
        let asked = shmem::launcher_wakeup(false);
        shmem::advance_requested();
        // Work still due right after a round for it means its flusher failed (the log says
        // why): that database backs off, so that it neither keeps the launcher forking nor
        // delays the others.
        let work = durable_work();
        let (ready, retry_at) = backoff.ready(&work, now);
        let durable_now = !ready.is_empty();
        if !first && !asked && now < due && !durable_now {
            let next_sample = last_sample.map_or(now, |t| t + sample_every);
            let mut wake = due.min(next_sample).max(now);
            if shmem::durable_watch() {
                wake = wake.min(now + JOURNAL_LOOK);
            }
            if adaptive {
                wake = wake.min(last_adapt.map_or(now, |t| t + ADAPT_EVERY));
            }
            if let Some(at) = retry_at {
                wake = wake.min(at.max(now));
            }
            if !BackgroundWorker::wait_latch(Some(wake - now)) {
                break;
            }
            if BackgroundWorker::sighup_received() {
                // SAFETY: the documented way for a worker to apply a reload (as pg_cron does).
                unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
            }
            continue;
        }
        let counters = first || asked || now >= due;
        first = false;
        if counters {
            last_round = now;
        }
        let sweep = counters
            && gucs::counter_retention().is_some_and(|r| {
                let every = r.min(SWEEP_MAX).max(interval);
                last_sweep.is_none_or(|t| now >= t + every)
            });
        if sweep {
            last_sweep = Some(now);
        }
        let failed = flush_round(counters, sweep, ready.clone(), &mut failing);
        backoff.after_round(&ready, &failed, Instant::now());
    }
    // Counts still pending now are saved by the postmaster at shutdown (see shmem).
}

/// How often the launcher looks for journals to write while a lease is live.
const JOURNAL_LOOK: Duration = Duration::from_millis(1_000);
/// The backoff after a round whose durable work is still due, doubled up to the maximum.
const MIN_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Per database whose flusher failed: when to try again, and
/// the backoff (doubled each time, from [`MIN_BACKOFF`] to [`MAX_BACKOFF`]).
#[derive(Default)]
struct Backoff(std::collections::HashMap<u32, (Instant, Duration)>);

impl Backoff {
    /// The databases of `work` that may run now, and the earliest retry of the others.
    fn ready(&self, work: &[u32], now: Instant) -> (Vec<u32>, Option<Instant>) {
        let mut ready = Vec::new();
        let mut later: Option<Instant> = None;
        for &db in work {
            match self.0.get(&db) {
                Some(&(at, _)) if at > now => later = Some(later.map_or(at, |l| l.min(at))),
                _ => ready.push(db),
            }
        }
        (ready, later)
    }

    fn after_round(&mut self, ran: &[u32], failed: &[u32], now: Instant) {
        for db in ran {
            if failed.contains(db) {
                let next = self
                    .0
                    .get(db)
                    .map_or(MIN_BACKOFF, |&(_, b)| (b * 2).min(MAX_BACKOFF));
                self.0.insert(*db, (now + next, next));
            } else {
                self.0.remove(db);
            }
        }
    }
}

/// At least this many rounds in a row must have failed to write a database's counts before
/// they are dropped (`stage_e_slots.flush_give_up` says for how long): a single slow round, at
/// an interval of an hour, is not a failing database.
const GIVE_UP_ROUNDS: u32 = 3;

/// Per database whose counts could not be flushed in the last rounds: how many rounds in a
/// row, and when the first of them failed.
///
/// Counts a database cannot write keep its caps from being idle, so from being reclaimed:
/// unbounded, they would fill `stage_e_slots.max_caps` for every database. So after
/// [`GIVE_UP_ROUNDS`] and `stage_e_slots.flush_give_up` of failures they are dropped, with a LOG
/// line; its caps are then reclaimable as any idle cap. The counts are statistics (a cap's
/// enforcement is its locks), and each failed round's ERROR is in the log. Kept in the
/// launcher's memory only: a new launcher (or a restart, which restores the counts from the
/// pending file) starts the count again, so such counts are retried for at least that long
/// once more, then dropped by the same rule.
#[derive(Default)]
struct Failing(std::collections::HashMap<u32, (u32, Instant)>);

impl Failing {
    /// After a counters round that tried `tried` (the databases with pending counts) and
    /// failed in `failed`: drops the counts of those failing for too long.
    fn after_round(&mut self, tried: &[u32], failed: &[u32], now: Instant) {
        // A database with nothing pending now is failing nothing.
        self.0.retain(|db, _| tried.contains(db));
        for &db in tried {
            if !failed.contains(&db) {
                self.0.remove(&db);
                continue;
            }
            let (rounds, since) = self.0.entry(db).or_insert((0, now));
            *rounds += 1;
            let (rounds, since) = (*rounds, *since);
            let give_up = gucs::flush_give_up();
            if rounds >= GIVE_UP_ROUNDS && now.duration_since(since) >= give_up {
                self.0.remove(&db);
                give_up_on(db, rounds, now.duration_since(since), give_up);
            }
        }
    }
}

/// Drops the pending counts of database `db`, whose flush failed `rounds` times in a row over
/// `failing`, with one LOG line.
fn give_up_on(db: u32, rounds: u32, failing: Duration, give_up: Duration) {
    let (caps, dropped) = flush::discard_pending(db);
    if caps == 0 {
        return;
    }
    let name = BackgroundWorker::transaction(|| sql::database_name(db))
        .map_or_else(|| format!("with oid {db}"), |n| format!("\"{n}\""));
    // Times (wait_time, hold_time) are not counts.
    let counts: u64 = dropped
        .to_array()
        .iter()
        .enumerate()
        .filter(|&(i, _)| !stage_e_core::counters::CounterValues::is_time(i))
        .map(|(_, v)| *v)
        .sum();
    log!(
        "stage_e_slots: dropped {counts} pending count(s) ({} acquired, {} throttled) of {caps} \
         cap(s) of database {name}, because its flush has failed in each of the last {rounds} \
         rounds, for {} s (stage_e_slots.flush_give_up is {} s; each round's ERROR is in the \
         log): counts that cannot be written would keep its caps from ever being reclaimed",
        dropped.acquired,
        dropped.throttled,
        failing.as_secs(),
        give_up.as_secs_f64(),
    );
}

/// Databases to load, or with a horizon, floor or journal due.
fn durable_work() -> Vec<u32> {
    let mut dbs = shmem::databases_to_load();
    dbs.extend(shmem::databases_with_horizon_work(
        session::now(),
        horizons::JOURNAL_EVERY_US,
    ));
    dbs.sort_unstable();
    dbs.dedup();
    dbs
}

/// One flusher per database with work, one after another: the durable lease state of `horizons`
/// databases, with `counters` the pending counts of every database that has some, and with
/// `sweep` the retention rule in every database with caps or loaded since the start. Returns
/// the databases whose flusher did not commit; `failing` learns whose counts could not be
/// written.
fn flush_round(counters: bool, sweep: bool, durable: Vec<u32>, failing: &mut Failing) -> Vec<u32> {
    if counters {
        reclaim_dropped();
    }
    let mut dbs: Vec<(u32, u64)> = durable.into_iter().map(|d| (d, 0)).collect();
    let mut add = |db: u32, bit: u64| match dbs.iter_mut().find(|(d, _)| *d == db) {
        Some(entry) => entry.1 |= bit,
        None => dbs.push((db, bit)),
    };
    if counters {
        for db in shmem::databases_to_recheck() {
            add(db, 0);
        }
        for db in shmem::databases_with_pending() {
            add(db, COUNTERS_BIT);
        }
        // Learned limits are written by any flusher of their database (`slots::limits`).
        for db in shmem::databases_with_limits_to_write() {
            add(db, 0);
        }
    }
    if sweep {
        // Dropped databases' records are gone (reclaim_dropped, just above).
        let mut known = shmem::databases();
        known.extend(shmem::recorded_databases());
        for db in known.into_iter().filter(|&d| d != 0) {
            add(db, SWEEP_BIT);
        }
    }
    let mut served: Vec<u32> = Vec::new();
    let mut failed: Vec<u32> = Vec::new();
    // The databases whose counts this round tried to write, and those it could not.
    let (mut counted, mut uncounted) = (Vec::new(), Vec::new());
    for (db, work) in dbs {
        if served.contains(&db) && work == 0 {
            continue;
        }
        let committed = run_flusher(db, work);
        if !committed {
            failed.push(db);
        }
        if work & COUNTERS_BIT != 0 {
            counted.push(db);
            if !committed {
                uncounted.push(db);
            }
        }
        // A lease (or a first call after a start) waits on a flusher: serve it before the
        // next database's counters, however many there are.
        if shmem::advance_requested() {
            for waiting in shmem::databases_with_waiting_calls() {
                if !run_flusher(waiting, 0) {
                    failed.push(waiting);
                }
                served.push(waiting);
            }
        }
    }
    if counters {
        failing.after_round(&counted, &uncounted, Instant::now());
    }
    failed
}

/// Frees the caps of dropped databases (their pending counts have nowhere to go; see
/// `shmem::reclaim_database`).
fn reclaim_dropped() {
    let mut dbs = shmem::databases();
    dbs.extend(shmem::recorded_databases());
    dbs.extend(shmem::policy_databases());
    dbs.sort_unstable();
    dbs.dedup();
    for db in dbs {
        if !BackgroundWorker::transaction(|| session::database_exists(db)) {
            shmem::reclaim_database(db);
            slots::limits::end_database(db);
        }
    }
}

/// The flusher's argument: the database's oid, whether to flush its counters, and whether to
/// apply the retention rule.
const COUNTERS_BIT: u64 = 1 << 32;
const SWEEP_BIT: u64 = 1 << 33;

/// Runs a flusher for `db` (with the work bits `work`) and waits for it; whether its
/// transaction committed.
fn run_flusher(db: u32, work: u64) -> bool {
    let commits = shmem::flusher_commits(db);
    let started = BackgroundWorkerBuilder::new(&format!("stage_e_slots flusher for database {db}"))
        .set_type("stage_e_slots flusher")
        .set_library(LIBRARY)
        .set_function("stage_e_slots_flusher_main")
        .enable_spi_access()
        .set_argument(Some(pg_sys::Datum::from(db as u64 | work)))
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
    shmem::flusher_commits(db) != commits
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn stage_e_slots_flusher_main(arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGTERM);
    let counters = arg.value() as u64 & COUNTERS_BIT != 0;
    let sweep = arg.value() as u64 & SWEEP_BIT != 0;
    let db = pg_sys::Oid::from(arg.value() as u32);
    // BGWORKER_BYPASS_ALLOWCONN: a database closed to new connections (ALTER DATABASE … WITH
    // ALLOW_CONNECTIONS false, while sessions made before still use its caps) is flushed all
    // the same, as autovacuum still vacuums it; otherwise its counts could never be written,
    // and its caps never reclaimed.
    // SAFETY: what BackgroundWorker::connect_worker_to_spi_by_oid does (once, in a registered
    // worker with a database connection, before any transaction), with that flag.
    unsafe {
        pg_sys::BackgroundWorkerInitializeConnectionByOid(
            db,
            pg_sys::InvalidOid,
            pg_sys::BGWORKER_BYPASS_ALLOWCONN,
        );
    }
    // Before the first transaction: what a database owner or a role set for this database
    // must not make the flush fail, wait or write differently (`sql::WORKER_SETTINGS`).
    sql::pin_worker_settings();
    let written = BackgroundWorker::transaction(|| {
        let ext = sql::extension();
        let loaded = shmem::loaded(db.to_u32());
        if loaded.is_none() {
            if let Err(e) = horizons::load(db.to_u32(), ext.as_ref(), &slots::limits::restore) {
                report::fail(format!(
                    "stage_e_slots: could not load database {}: {e}",
                    db.to_u32()
                ));
            }
        } else if loaded != Some(ext.as_ref().is_some_and(|e| e.version.has_lease_horizon())) {
            // Updated (or the extension dropped) since it was loaded.
            horizons::load(db.to_u32(), ext.as_ref(), &slots::limits::restore).ok();
        }
        let written = match &ext {
            Some(ext) => horizons::advance(ext).unwrap_or_else(|e| {
                report::fail(format!(
                    "stage_e_slots: could not write the lease horizons of database {}: {e}",
                    db.to_u32()
                ))
            }),
            None => Vec::new(),
        };
        if counters {
            crate::hooks::ensure(); // settles the flush at the transaction's end
            match flush::flush(Write::Add, None, false) {
                Ok(Some(_)) => {}
                Ok(None) => drop_orphaned(db),
                Err(e) => report::fail(format!(
                    "stage_e_slots: flush of database {} failed: {e}",
                    db.to_u32()
                )),
            }
        }
        // Adaptive caps' learned limits, so that a restart resumes from them.
        let limits = match &ext {
            Some(ext) => slots::limits::write_limits(ext).unwrap_or_else(|e| {
                report::fail(format!(
                    "stage_e_slots: could not write the adaptive limits of database {}: {e}",
                    db.to_u32()
                ))
            }),
            None => Vec::new(),
        };
        if let (true, Some(ext), Some(retention)) = (sweep, &ext, gucs::counter_retention()) {
            let keep = written.iter().filter_map(|w| w.name()).collect();
            match flush::expire(ext, retention, keep) {
                Ok((0, _)) => {}
                Ok((rows, horizons)) => report::log(format!(
                    "stage_e_slots: deleted the counter rows of {rows} cap(s) of database \"{}\" \
                     unused for longer than stage_e_slots.counter_retention ({} s){}{}",
                    sql::current_database(),
                    retention.as_secs(),
                    if horizons > 0 {
                        format!(", and {horizons} of their lease horizon rows")
                    } else {
                        String::new()
                    },
                    if rows >= flush::RETENTION_BATCH {
                        "; more are left for the next round"
                    } else {
                        ""
                    }
                )),
                Err(e) => report::fail(format!(
                    "stage_e_slots: the counter retention of database {} failed: {e}",
                    db.to_u32()
                )),
            }
        }
        (written, limits)
    });
    let (written, limits) = written;
    shmem::limits_written(db.to_u32(), &limits);
    // Committed: grants may now rely on it.
    horizons::publish(written);
    shmem::note_flusher_commit(db.to_u32());
}

/// The extension is no longer installed here: its table is gone with it, so the counts have
/// nowhere to go.
fn drop_orphaned(db: pg_sys::Oid) {
    let (caps, _) = flush::discard_pending(db.to_u32());
    if caps > 0 {
        log!(
            "stage_e_slots: dropped pending counters of {caps} cap(s) of database {}, which no \
             longer has the extension",
            db.to_u32()
        );
    }
}
