//! What the views and statistics functions read: per cap of the current database, its counts
//! and holders (the lock manager's granted locks joined with the extension's records and
//! leases), its hold, its waiters and its load. Read-only: nothing here takes, frees or counts.

use super::{admission, attached, SlotError};
use crate::gucs;
use crate::locks;
use crate::session;
use crate::shmem::{self, Cap};
use stage_e_core::counters::CounterValues;
use stage_e_core::directory::DEFAULT_CAP;
use stage_e_core::histogram::HistValues;
use std::collections::HashMap;

pub struct CapStats {
    pub cap: String,
    /// The first int4 of its slots' advisory locks.
    pub key: i32,
    pub held: u32,
    /// The n of its latest acquisition (None before the first).
    pub n: Option<u32>,
    pub counts: CounterValues,
    /// Its hold and wait histograms' counts.
    pub hist: HistValues,
}

pub struct Holder {
    pub cap: String,
    pub slot: u32,
    /// For a lease, the backend that took it (which may be gone).
    pub pid: i32,
    /// None for a slot locked with raw `pg_advisory_lock` rather than through the extension.
    pub acquired_at: Option<i64>,
    /// A lease's token and expiry; None for a session slot.
    pub token: Option<u64>,
    pub expires_at: Option<i64>,
}

/// A cap held back after a crash or a promotion (`stage_e_held_back`).
pub struct HeldBack {
    pub cap: String,
    pub until: i64,
    pub reason: &'static str,
}

/// The live caps of the current database by lock key, and `default`'s key whether live or not
/// (a raw lock on `(lock_key, s)` is a holder of `default`).
fn caps_by_key() -> HashMap<i32, (String, Option<Cap>)> {
    let mut by_key: HashMap<i32, (String, Option<Cap>)> = shmem::caps(Some(session::database()))
        .into_iter()
        .map(|c| (c.key(), (c.name(), Some(c))))
        .collect();
    by_key
        .entry(gucs::lock_key())
        .or_insert_with(|| (DEFAULT_CAP.to_string(), None));
    by_key
}

/// `stage_e_stats()`: one row per cap in use in the current database, counted since the cap
/// was created (server start, or its reclaim); `held` comes from the lock manager, plus the
/// cap's live leases.
pub fn stats() -> Result<Vec<CapStats>, SlotError> {
    attached()?;
    let granted = locks::granted(gucs::max_slots());
    let mut out: Vec<CapStats> = caps_by_key()
        .into_iter()
        .filter_map(|(key, (name, cap))| {
            let cap = cap?;
            Some(CapStats {
                cap: name,
                key,
                held: granted.iter().filter(|g| g.key == key).count() as u32 + cap.lease_count(),
                n: cap.latest_n(),
                counts: cap.counters().load(),
                hist: cap.histograms(),
            })
        })
        .collect();
    out.sort_by(|a, b| a.cap.cmp(&b.cap));
    Ok(out)
}

/// Held slots of the current database per the lock manager (caps this server knows by name,
/// and `default`), with the acquisition time where the extension recorded it; and leases.
pub fn holders() -> Result<Vec<Holder>, SlotError> {
    attached()?;
    let by_key = caps_by_key();
    let mut out: Vec<Holder> = locks::granted(gucs::max_slots())
        .into_iter()
        .filter_map(|g| {
            let (name, cap) = by_key.get(&g.key)?;
            let acquired_at = cap
                .as_ref()
                .filter(|c| g.slot < c.capacity())
                .map(|c| c.record(g.slot).get())
                .filter(|&(pid, _)| pid == g.pid)
                .map(|(_, at)| at);
            Some(Holder {
                cap: name.clone(),
                slot: g.slot,
                pid: g.pid,
                acquired_at,
                token: None,
                expires_at: None,
            })
        })
        .collect();
    for (name, cap) in by_key.values() {
        let Some(cap) = cap else { continue };
        out.extend(cap.leases().into_iter().map(|l| Holder {
            cap: name.clone(),
            slot: l.slot,
            pid: l.pid,
            acquired_at: Some(l.acquired_at),
            // Another role's token is a key to its slot: shown only to who may see it.
            token: session::may_see_token_of(l.owner).then_some(l.token),
            expires_at: Some(l.expires_at),
        }));
    }
    out.sort_by(|a, b| (&a.cap, a.slot).cmp(&(&b.cap, b.slot)));
    Ok(out)
}

/// `stage_e_held_back`: the caps of the current database held back now; none on a standby
/// (nothing is handed out there at all).
pub fn held_back() -> Result<Vec<HeldBack>, SlotError> {
    attached()?;
    if session::in_recovery() {
        return Ok(Vec::new());
    }
    admission::ensure_loaded()?;
    let now = session::now();
    let mut out: Vec<HeldBack> = shmem::caps(Some(session::database()))
        .into_iter()
        .filter_map(|c| {
            let (until, reason) = c.held_until(now)?;
            Some(HeldBack {
                cap: c.name(),
                until,
                reason: reason.as_str(),
            })
        })
        .collect();
    out.sort_by(|a, b| a.cap.cmp(&b.cap));
    Ok(out)
}

/// `stage_e_slot_waiters`: sessions waiting for slots in the current database.
pub fn waiters() -> Result<Vec<shmem::WaiterInfo>, SlotError> {
    attached()?;
    Ok(shmem::waiters_of(session::database()))
}

/// `stage_e_cap_load`: the load averages of the current database's caps.
pub fn load() -> Result<Vec<shmem::Load>, SlotError> {
    attached()?;
    let mut out = shmem::load_of(session::database());
    out.sort_by(|a, b| a.cap.cmp(&b.cap));
    Ok(out)
}
