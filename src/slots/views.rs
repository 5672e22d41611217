//! What the views and statistics functions read: per cap of the current database, its counts
//! and holders (the lock manager's granted locks joined with the extension's records and
//! leases), its hold, its waiters and its load. Read-only: nothing here takes, frees or counts.
//!
//! **One holder, one row.** A slot's holders live in two places: a session slot is a lock in the
//! lock manager, a lease is a record in shared memory. A slot passes from one to the other in a
//! fixed order: a session's release unlocks, then clears the slot's bit; a lease grant claims
//! the bit, probes the lock (lock, unlock), and only then starts its record; a lease's end
//! (under its record's lock) clears the bit, and a session takes the slot by claiming the bit,
//! then locking. So no instant has one slot both locked by a session through the extension and
//! leased; only a raw `pg_advisory_lock` on a leased slot (a real double admission) is both.
//! But `pg_locks` and the lease records cannot be read at one instant, and reading one then the
//! other counted a slot that passed between them in between twice (held > n, two rows).
//! So [`holders_now`] reads the leases, then the lock manager (one snapshot under every lock
//! partition, at an instant T), then the leases again, and keeps only the leases read live in
//! both reads (same cap, slot and token). A token names one acquisition and a lease never comes
//! back once ended, so such a lease was live from the first read to the second, hence at T: its
//! slot and the locks of T were truly held together. A lease that started or ended meanwhile is
//! left out of this reading (reads are retried while the two lease reads differ, at most
//! [`READS`] times), so a reading may miss a lease that came or went during it, never count a
//! holder twice.

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
    /// The fair share the slot was taken in (None: none, or the cap's unnamed share).
    pub share: Option<String>,
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

/// How many times [`holders_now`] reads at most before it keeps what two reads agree on.
const READS: usize = 8;

/// A lease as one reading saw it: its cap's lock key and the lease.
type KeyedLease = (i32, shmem::LeaseInfo);

/// The live leases of `caps` (pinned, with their lock keys), in cap and slot order.
fn leases_of(caps: &[(i32, &Cap)]) -> Vec<KeyedLease> {
    caps.iter()
        .flat_map(|&(key, cap)| cap.leases().into_iter().map(move |l| (key, l)))
        .collect()
}

/// One lease, as the two reads compare them: cap, slot, token (a renewal changes its expiry,
/// not who holds the slot).
fn same_lease(a: &KeyedLease, b: &KeyedLease) -> bool {
    (a.0, a.1.slot, a.1.token) == (b.0, b.1.slot, b.1.token)
}

/// The granted slot locks of the current database at one instant, and the leases of `caps`
/// live throughout a span that contains that instant: a slot passing between a session and a
/// lease during the reading is not seen twice (the module note).
fn holders_now(caps: &[(i32, &Cap)]) -> (Vec<locks::Granted>, Vec<KeyedLease>) {
    let max_slots = gucs::max_slots();
    let mut before = leases_of(caps);
    let mut reads = 1;
    loop {
        let granted = locks::granted(max_slots);
        let after = leases_of(caps);
        reads += 1;
        let agree =
            before.len() == after.len() && before.iter().zip(&after).all(|(a, b)| same_lease(a, b));
        if agree || reads >= READS {
            let kept = after
                .into_iter()
                .filter(|l| before.iter().any(|b| same_lease(b, l)))
                .collect();
            return (granted, kept);
        }
        before = after;
    }
}

/// The pinned caps of `by_key`, with their keys.
fn live(by_key: &HashMap<i32, (String, Option<Cap>)>) -> Vec<(i32, &Cap)> {
    by_key
        .iter()
        .filter_map(|(&key, (_, cap))| Some((key, cap.as_ref()?)))
        .collect()
}

/// `stage_e_stats()`: one row per cap in use in the current database, counted since the cap
/// was created (server start, or its reclaim) or its database's extension was last dropped; `held` is its slots locked in the lock manager
/// plus its live leases, read as one reading (`holders_now`), so never a holder twice.
pub fn stats() -> Result<Vec<CapStats>, SlotError> {
    attached()?;
    let by_key = caps_by_key();
    let (granted, leases) = holders_now(&live(&by_key));
    let mut out: Vec<CapStats> = by_key
        .into_iter()
        .filter_map(|(key, (name, cap))| {
            let cap = cap?;
            let held = granted.iter().filter(|g| g.key == key).count()
                + leases.iter().filter(|l| l.0 == key).count();
            // Counts and histograms as one read of the flush seqlock: a restart (`DROP
            // EXTENSION`) shows whole.
            let counted = cap.flush_state();
            Some(CapStats {
                cap: name,
                key,
                held: held as u32,
                n: cap.latest_n(),
                counts: counted.counters,
                hist: counted.hist,
            })
        })
        .collect();
    out.sort_by(|a, b| a.cap.cmp(&b.cap));
    Ok(out)
}

/// Held slots of the current database per the lock manager (caps this server knows by name,
/// and `default`), with the acquisition time where the extension recorded it; and leases. One
/// reading (`holders_now`): a slot passing between a session and a lease shows once.
pub fn holders() -> Result<Vec<Holder>, SlotError> {
    attached()?;
    let by_key = caps_by_key();
    let (granted, leases) = holders_now(&live(&by_key));
    let mut out: Vec<Holder> = granted
        .into_iter()
        .filter_map(|g| {
            let (name, cap) = by_key.get(&g.key)?;
            let ours = cap
                .as_ref()
                .filter(|c| g.slot < c.capacity())
                .filter(|c| c.record(g.slot).get().0 == g.pid);
            Some(Holder {
                cap: name.clone(),
                slot: g.slot,
                pid: g.pid,
                acquired_at: ours.map(|c| c.record(g.slot).get().1),
                token: None,
                expires_at: None,
                share: ours.and_then(|c| c.share_of(g.slot)),
            })
        })
        .collect();
    out.extend(leases.into_iter().filter_map(|(key, l)| {
        let (name, cap) = by_key.get(&key)?;
        Some(Holder {
            cap: name.clone(),
            slot: l.slot,
            pid: l.pid,
            acquired_at: Some(l.acquired_at),
            // Another role's token is a key to its slot: shown only to who may see it.
            token: session::may_see_token_of(l.owner).then_some(l.token),
            expires_at: Some(l.expires_at),
            share: cap
                .as_ref()
                .filter(|c| l.slot < c.capacity())
                .and_then(|c| c.share_of(l.slot)),
        })
    }));
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
