//! The cap itself, in plain Rust over the lock manager (`locks`), shared memory (`shmem`) and
//! this backend's state (`session`). The SQL functions in `api` only translate arguments and
//! map [`SlotError`] to ERRORs.
//!
//! Invariants:
//! - A slot is returned only after `LockAcquire` granted this session a *new* lock on it, so
//!   the lock manager alone bounds holders of `[0, n)` by n, whatever shared memory says.
//! - A slot's occupancy bit is set while a backend holds it through the extension (or is
//!   probing it), and cleared only by that backend: on release, at transaction end if the lock
//!   vanished, at exit. So a set bit never outlives its lock past the holder's transaction.

use crate::counters::CounterValues;
use crate::gucs;
use crate::locks::{self, Probe};
use crate::occupancy;
use crate::session;
use crate::shmem::{self, Counters, Pool};
use std::cell::Cell;
use std::sync::atomic::AtomicU64;

#[derive(Debug, PartialEq)]
pub enum SlotError {
    NotPreloaded,
    Standby,
    ParallelMode,
    NullArgument { name: &'static str },
    CapOutOfRange { n: i32, max_slots: u32 },
    SlotOutOfRange { slot: i32, max_slots: u32 },
    DatabasesFull { max_databases: u32 },
}

pub enum Release {
    Released,
    NotHeld { holder: Option<i32> },
}

pub struct Stats {
    pub max_slots: u32,
    pub held: u32,
    pub counts: CounterValues,
}

pub struct Holder {
    pub slot: u32,
    pub pid: i32,
    /// None for a slot locked with raw `pg_advisory_lock` rather than through the extension.
    pub acquired_at: Option<i64>,
}

thread_local! {
    /// This backend's pool: its database never changes, so look it up once.
    static MY_POOL: Cell<Option<Pool>> = const { Cell::new(None) };
}

/// Refuses to run without the cap's shared state or on a standby (whose locks do not
/// coordinate with the primary's): fail closed, never an uncapped slot.
pub fn ready() -> Result<(), SlotError> {
    if !shmem::attached() {
        return Err(SlotError::NotPreloaded);
    }
    if session::in_recovery() {
        return Err(SlotError::Standby);
    }
    // A parallel worker's session locks die with the worker at the end of the query (and the
    // leader's locks are not the worker's): a slot taken there would be held by nobody. Core
    // refuses advisory locks in parallel mode for the same reason.
    if session::in_parallel_mode() {
        return Err(SlotError::ParallelMode);
    }
    Ok(())
}

/// This database's pool, if it has used the extension since start.
fn my_pool() -> Option<Pool> {
    if let Some(p) = MY_POOL.get() {
        return Some(p);
    }
    let found = shmem::pool(session::database());
    if found.is_some() {
        MY_POOL.set(found);
    }
    found
}

/// The current database's pool for the flush and stats paths; never takes an entry.
pub fn pool_of_this_database() -> Result<Option<Pool>, SlotError> {
    if !shmem::attached() {
        return Err(SlotError::NotPreloaded);
    }
    Ok(my_pool())
}

/// This database's pool, taking an entry on first use: only `stage_e_try_slot` does this, so
/// reading, releasing or flushing in a database never uses one up.
fn pool_for_acquire() -> Result<Pool, SlotError> {
    if let Some(p) = my_pool() {
        return Ok(p);
    }
    let created = shmem::create_pool(session::database(), session::database_exists)
        .map_err(|e| SlotError::DatabasesFull {
            max_databases: e.max_databases,
        })?
        .ok_or(SlotError::NotPreloaded)?;
    MY_POOL.set(Some(created));
    Ok(created)
}

fn check_cap(n: Option<i32>) -> Result<u32, SlotError> {
    let n = n.ok_or(SlotError::NullArgument { name: "n" })?;
    let max_slots = gucs::max_slots();
    if n < 1 || n as u32 > max_slots {
        return Err(SlotError::CapOutOfRange { n, max_slots });
    }
    Ok(n as u32)
}

fn check_slot(slot: Option<i32>) -> Result<u32, SlotError> {
    let slot = slot.ok_or(SlotError::NullArgument { name: "slot" })?;
    let max_slots = gucs::max_slots();
    if slot < 0 || slot as u32 >= max_slots {
        return Err(SlotError::SlotOutOfRange { slot, max_slots });
    }
    Ok(slot as u32)
}

/// Drops the extension's bookkeeping for a slot this backend tracked.
fn forget(pool: Pool, slot: u32) {
    pool.record(slot).clear();
    occupancy::clear(pool.bits(), slot);
    session::untrack(slot);
}

/// `stage_e_try_slot(n)`: the lowest free slot in `[0, n)`, now held by this session, or
/// None (throttled, counted once).
pub fn try_slot(n: Option<i32>) -> Result<Option<u32>, SlotError> {
    ready()?;
    let n = check_cap(n)?;
    let pool = pool_for_acquire()?;
    session::ensure_hooks();
    let counters = pool.counters();
    if let Some(slot) = search(pool, n) {
        Counters::bump(&counters.acquired, 1);
        return Ok(Some(slot));
    }
    // Before saying "throttled": this session may have dropped one of its own slots' locks
    // earlier in this very transaction (transaction end would clear it). Clear such slots now
    // and look once more; a session holding no slot skips this.
    if session::tracks_any() && reconcile_with(pool) > 0 {
        if let Some(slot) = search(pool, n) {
            Counters::bump(&counters.acquired, 1);
            return Ok(Some(slot));
        }
    }
    Counters::bump(&counters.throttled, 1);
    Ok(None)
}

/// Takes the lowest slot of `[0, n)` that is clear in the bitmap and free in the lock manager.
fn search(pool: Pool, n: u32) -> Option<u32> {
    let mut from = 0;
    while let Some(claim) = occupancy::claim_first_free(pool.bits(), from, n) {
        let slot = claim.slot();
        match locks::try_lock(slot) {
            Probe::Acquired => {
                pool.record(slot)
                    .set(session::pid(), session::statement_start());
                session::track(slot);
                return Some(claim.keep());
            }
            // Held by this very session through a raw advisory lock: giving it out again would
            // count one lock twice. Undo the re-entrant count and look further.
            Probe::AlreadyMine => {
                locks::unlock(slot);
            }
            // Held through a raw advisory lock by another session: it counts as taken.
            Probe::Busy => {}
        }
        from = slot + 1; // dropping `claim` clears the bit
    }
    None
}

/// `stage_e_release(slot)`: releases the slot if this session holds it; otherwise changes
/// nothing but the foreign-release count and reports who does hold it.
pub fn release(slot: Option<i32>) -> Result<Release, SlotError> {
    ready()?;
    let slot = check_slot(slot)?;
    // No pool: nobody in this database took a slot through the extension since start. The
    // call still answers truthfully, but there is nowhere to count it.
    let pool = my_pool();
    let count = |c: fn(&Counters) -> &AtomicU64| {
        if let Some(p) = pool {
            Counters::bump(c(p.counters()), 1);
        }
    };
    // A tracked slot is held unless its lock was dropped behind our back earlier in this
    // transaction (transaction end reconciles), so go straight to the lock manager; an untracked
    // one is checked first, so that a foreign release does not draw core's WARNING too.
    let tracked = session::is_tracked(slot);
    if (tracked || locks::held_by_me(slot)) && locks::unlock(slot) {
        if let (true, Some(p)) = (tracked, pool) {
            forget(p, slot);
        }
        count(|c| &c.released);
        return Ok(Release::Released);
    }
    if let (true, Some(p)) = (tracked, pool) {
        lost(p, slot);
    }
    count(|c| &c.foreign_releases);
    Ok(Release::NotHeld {
        holder: locks::holder_of(slot),
    })
}

/// `stage_e_release_all()`: releases every slot this session took through the extension.
pub fn release_all() -> Result<u32, SlotError> {
    ready()?;
    let Some(pool) = my_pool() else {
        return Ok(0); // nothing can be tracked without a pool
    };
    let mut released = 0;
    for slot in session::tracked() {
        if locks::held_by_me(slot) {
            locks::unlock(slot);
            forget(pool, slot);
            released += 1;
        } else {
            lost(pool, slot);
        }
    }
    Counters::bump(&pool.counters().released, released as u64);
    Ok(released)
}

/// `stage_e_holding(slot)`: whether this session holds the slot's lock right now.
pub fn holding(slot: Option<i32>) -> Result<bool, SlotError> {
    ready()?;
    let slot = check_slot(slot)?;
    let held = locks::held_by_me(slot);
    if !held && session::is_tracked(slot) {
        if let Some(pool) = my_pool() {
            lost(pool, slot);
        }
    }
    Ok(held)
}

/// A tracked slot whose lock this session no longer has: it was dropped behind the extension's
/// back. Clear it so it is usable again, count it as released, and say so in the log.
fn lost(pool: Pool, slot: u32) {
    forget(pool, slot);
    Counters::bump(&pool.counters().released, 1);
    pgrx::log!(
        "stage_e_slots: slot {slot} of pid {} was released outside stage_e_release \
         (DISCARD ALL, pg_advisory_unlock_all() or pg_advisory_unlock()); it is free again",
        session::pid()
    );
}

/// Transaction end in a backend that tracks slots: clear any whose lock has gone.
pub fn reconcile() {
    if let Some(pool) = my_pool() {
        reconcile_with(pool);
    }
}

/// Clears this backend's tracked slots whose lock it no longer holds (a local lookup each);
/// returns how many.
fn reconcile_with(pool: Pool) -> usize {
    let gone = session::tracked_where(|s| !locks::held_by_me(s));
    for &slot in &gone {
        lost(pool, slot);
    }
    gone.len()
}

/// Backend exit (disconnect, pg_terminate_backend, client killed): release held slots now,
/// count them, and log the incident's signature.
pub fn release_on_exit() {
    let Some(pool) = my_pool() else {
        return;
    };
    let mut released = Vec::new();
    for slot in session::tracked() {
        if locks::held_by_me(slot) {
            locks::unlock(slot);
            released.push(slot.to_string());
        }
        forget(pool, slot);
    }
    if released.is_empty() {
        return;
    }
    Counters::bump(&pool.counters().released_by_exit, released.len() as u64);
    pgrx::log!(
        "stage_e_slots: backend pid {} (application_name \"{}\") exited holding slot(s) {}; released",
        session::pid(),
        session::application_name(),
        released.join(", ")
    );
}

/// `stage_e_stats()` for the current database. `held` comes from the lock manager.
pub fn stats() -> Result<Stats, SlotError> {
    let counts = pool_of_this_database()?
        .map(|p| p.counters().load())
        .unwrap_or_default();
    let max_slots = gucs::max_slots();
    Ok(Stats {
        max_slots,
        held: locks::granted_holders(max_slots).len() as u32,
        counts,
    })
}

/// Held slots of the current database per the lock manager, with the acquisition time where
/// the extension recorded it.
pub fn holders() -> Result<Vec<Holder>, SlotError> {
    let pool = pool_of_this_database()?;
    Ok(locks::granted_holders(gucs::max_slots())
        .into_iter()
        .map(|(slot, pid)| {
            let acquired_at = pool
                .map(|p| p.record(slot).get())
                .filter(|&(recorded, _)| recorded == pid)
                .map(|(_, at)| at);
            Holder {
                slot,
                pid,
                acquired_at,
            }
        })
        .collect())
}
