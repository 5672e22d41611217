//! What happens to the slots this backend holds when their lock goes away without
//! `stage_e_release`: the extension's bookkeeping (holder record, bit, hold time) is dropped,
//! the cap's waiters are woken, and the loss is counted and logged. Called by the release
//! paths of `slots` and by the transaction-end and exit hooks (`hooks`).
//!
//! A slot's bit is cleared only by the backend that holds it (`slots`' invariants), so these run
//! in that backend: `reconcile` at transaction end (a lock dropped by `DISCARD ALL`,
//! `pg_advisory_unlock_all()` or `pg_advisory_unlock()`, which only the holder can run), and
//! `release_on_exit` before the lock manager releases the session's locks at exit.

use crate::locks;
use crate::session::{self, Held};
use crate::shmem::{self, Cap, Counter};
use stage_e_core::histogram::Metric;
use stage_e_core::occupancy;

/// Runs `f` on the cap of `held`: `near` when the caller has that cap pinned already (the
/// hot path pins once), else a pin of its own.
#[inline]
pub(super) fn with_cap<R>(near: Option<&Cap>, held: Held, f: impl FnOnce(&Cap) -> R) -> Option<R> {
    match near {
        Some(cap) if cap.at == held.cap => Some(f(cap)),
        _ => shmem::pin(held.cap).map(|cap| f(&cap)),
    }
}

/// Drops the extension's bookkeeping for a slot this backend tracked and wakes the cap's first
/// waiter; with `released_at`, counts how long the slot was held.
pub(super) fn forget(near: Option<&Cap>, held: Held, released_at: Option<i64>) {
    drop_bookkeeping(near, held, released_at);
    session::untrack(held);
}

/// [`forget`] of a slot no longer tracked (`session::take_tracked`).
#[inline]
pub(super) fn drop_bookkeeping(near: Option<&Cap>, held: Held, released_at: Option<i64>) {
    with_cap(near, held, |cap| {
        let (records, bits) = cap.block();
        let record = &records[held.slot as usize];
        let acquired_at = record.get().1;
        let share = record.share();
        record.clear();
        occupancy::clear(bits, held.slot);
        // After the bit: a share at its ceiling takes no slot before its own is free.
        cap.give_back_share(share, 1);
        cap.wake_front();
        if let Some(now) = released_at.filter(|_| acquired_at != 0) {
            // Adding 0 (taken and given back in one statement) would cost a locked add on a
            // shared line for nothing.
            let held = (now - acquired_at).max(0) as u64;
            cap.observe(Metric::Hold, held);
            if held > 0 {
                cap.counters().bump(Counter::HoldTime, held);
            }
        }
    });
}

pub(super) fn bump(near: Option<&Cap>, held: Held, which: Counter, by: u64) {
    with_cap(near, held, |cap| cap.counters().bump(which, by));
}

/// A tracked slot whose lock this session no longer has: it was dropped behind the extension's
/// back. Clear it so it is usable again, count it as released, and say so in the log.
pub(super) fn lost(near: Option<&Cap>, held: Held) {
    let name = with_cap(near, held, |c| c.name()).unwrap_or_default();
    bump(near, held, Counter::Released, 1);
    forget(near, held, Some(session::statement_start()));
    let name = crate::names::quoted(&name);
    crate::report::log(format!(
        "stage_e_slots: slot {} of cap {name} of pid {} was released outside stage_e_release \
         (DISCARD ALL, pg_advisory_unlock_all() or pg_advisory_unlock()); it is free again",
        held.slot,
        session::pid()
    ));
}

/// Transaction end in a backend that tracks slots: clear any whose lock has gone.
pub fn reconcile() {
    for held in session::tracked_where(|h| !locks::held_by_me(h.key, h.slot)) {
        lost(None, held);
    }
}

/// Clears this backend's tracked slots of the cap with key `key` whose lock it no longer holds
/// (a local lookup each); returns how many.
pub(super) fn reconcile_cap(cap: &Cap) -> usize {
    let key = cap.key();
    let gone = session::tracked_where(|h| h.key == key && !locks::held_by_me(h.key, h.slot));
    for &held in &gone {
        lost(Some(cap), held);
    }
    gone.len()
}

/// Runs `f` on each of `tracked` (sorted by cap, as `session::tracked` returns them) with its
/// cap pinned, one pin per cap (None if the cap is gone).
pub(super) fn each_with_cap(tracked: Vec<Held>, mut f: impl FnMut(Option<&Cap>, Held)) {
    let mut pinned: Option<Cap> = None;
    for held in tracked {
        if pinned.as_ref().map(|c| c.at) != Some(held.cap) {
            drop(pinned.take()); // frees this backend's hazard slot for the next pin
            pinned = shmem::pin(held.cap);
        }
        f(pinned.as_ref(), held);
    }
}

/// Backend exit (disconnect, pg_terminate_backend, client killed): release held slots now,
/// count them, and log the incident's signature.
pub fn release_on_exit() {
    let mut released: Vec<(String, Vec<u32>)> = Vec::new();
    let now = session::now();
    each_with_cap(session::tracked(None), |pinned, held| {
        if locks::held_by_me(held.key, held.slot) {
            locks::unlock(held.key, held.slot);
            let name = pinned.map(|c| c.name()).unwrap_or_default();
            match released.iter_mut().find(|(n, _)| *n == name) {
                Some((_, slots)) => slots.push(held.slot),
                None => released.push((name, vec![held.slot])),
            }
            bump(pinned, held, Counter::ReleasedByExit, 1);
        }
        forget(pinned, held, Some(now));
    });
    if released.is_empty() {
        return;
    }
    let what: Vec<String> = released
        .iter()
        .map(|(name, slots)| {
            let list: Vec<String> = slots.iter().map(u32::to_string).collect();
            format!("{} of cap \"{name}\"", list.join(", "))
        })
        .collect();
    crate::report::log(format!(
        "stage_e_slots: backend pid {} (application_name \"{}\") exited holding slot(s) {}; released",
        session::pid(),
        session::application_name(),
        what.join("; ")
    ));
}
