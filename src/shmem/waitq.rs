//! A cap's queue of waiters.
//!
//! A FIFO of tickets per cap (`tail` is the next one), with one record per waiting backend in
//! the segment's list of waiters. The first `FRONT` waiters in ticket order sit in the entry's
//! front seats and only they take slots (`stage_e_core::front`, which also states why no
//! wake-up is lost). Joining and leaving take the waits LWLock; the release path reads the
//! seats without it and sets the latches of the seats the free slots cover.
//!
//! A cap with waiters is never reclaimed (`caps`), so a waiter holds no pin while it sleeps and
//! leaves the queue by its entry alone. The policy (who waits, for how long, what a wake-up
//! does) is in `slots::waiting`.

use super::entry::CapEntry;
use super::segment::{segment, waits_locked, EXCLUSIVE, SHARED};
use super::Cap;
use pgrx::pg_sys;
use stage_e_core::front::{Seated, Seats};
use stage_e_core::state::CapRef;
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicU32, AtomicU64, Ordering};

/// A backend waiting for slots of a cap (one per backend at most). Changed under the waits
/// lock.
#[repr(C)]
pub(super) struct WaiterRecord {
    active: AtomicU32,
    entry: AtomicU32,
    pid: AtomicI32,
    n: AtomicU32,
    k: AtomicU32,
    _pad: u32,
    ticket: AtomicU64,
    since: AtomicI64,
    proc_: AtomicU64,
}

impl WaiterRecord {
    fn seated(&self) -> Seated {
        Seated {
            process: self.proc_.load(Ordering::Relaxed) as usize,
            ticket: self.ticket.load(Ordering::Relaxed),
            n: self.n.load(Ordering::Relaxed),
            k: self.k.load(Ordering::Relaxed),
        }
    }
}

/// This backend's place in a cap's queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    record: u32,
    ticket: u64,
}

/// A waiter as the waiters view shows it.
pub struct WaiterInfo {
    pub cap: String,
    pub pid: i32,
    pub n: u32,
    pub k: u32,
    pub since: i64,
    pub position: u32,
}

/// Sets the latches of `seats`.
fn wake(seats: Seats) {
    for s in seats.iter() {
        let p = s.process as *mut pg_sys::PGPROC;
        // SAFETY: a seat names a PGPROC, which lives in shared memory for the server's
        // lifetime; a stale one (its waiter has left) is woken in vain.
        unsafe { pg_sys::SetLatch(&raw mut (*p).procLatch) };
    }
}

impl Cap {
    pub fn waiters(&self) -> u32 {
        self.entry().waiters.load(Ordering::SeqCst)
    }

    /// Whether the waiter holding `t` is at the front and the free slots cover it and every
    /// seat ahead of it.
    pub fn may_take(&self, t: Ticket) -> bool {
        let bits = self.bits();
        waits_locked(SHARED, || self.entry().front.may_take(t.ticket, bits))
    }

    /// After freeing slots: sets the latch of the head, and of every seat behind it that the
    /// free slots cover.
    pub fn wake_front(&self) {
        let e = self.entry();
        if e.waiters.load(Ordering::SeqCst) == 0 {
            return;
        }
        wake(e.front.to_wake(self.bits(), true));
    }

    /// Joins the cap's queue; None if the list of waiters is full (it has a record for every
    /// backend, so only a bug gets None).
    pub fn enqueue(&self, n: u32, k: u32, since: i64) -> Option<Ticket> {
        let seg = segment()?;
        let e = self.entry();
        waits_locked(EXCLUSIVE, || {
            let record =
                seg.waiters
                    .iter()
                    .position(|w| w.active.load(Ordering::Relaxed) == 0)? as u32;
            let w = &seg.waiters[record as usize];
            let ticket = e.tail.fetch_add(1, Ordering::SeqCst);
            // SAFETY: this backend's PGPROC and pid, set at start-up.
            let (me, pid) = unsafe { (pg_sys::MyProc, pg_sys::MyProcPid) };
            w.entry.store(self.at.entry, Ordering::Relaxed);
            w.pid.store(pid, Ordering::Relaxed);
            w.n.store(n, Ordering::Relaxed);
            w.k.store(k, Ordering::Relaxed);
            w.ticket.store(ticket, Ordering::Relaxed);
            w.since.store(since, Ordering::Relaxed);
            w.proc_.store(me as u64, Ordering::Relaxed);
            w.active.store(1, Ordering::Release);
            let before = e.waiters.fetch_add(1, Ordering::SeqCst) as usize;
            e.front.join(before, w.seated());
            Some(Ticket { record, ticket })
        })
    }
}

/// Leaves the queue of the cap in entry `cap.entry` (no pin needed: a cap with waiters is
/// never reclaimed). If `t` had a front seat, the seats behind it move up, the next waiter is
/// seated, and the seats the free slots now cover are woken.
pub fn dequeue(cap: CapRef, t: Ticket) {
    let Some(seg) = segment() else { return };
    let e: &CapEntry = seg.entry(cap.entry);
    waits_locked(EXCLUSIVE, || {
        let w = &seg.waiters[t.record as usize];
        if w.active.load(Ordering::Relaxed) == 0 || w.ticket.load(Ordering::Relaxed) != t.ticket {
            return; // already left
        }
        w.active.store(0, Ordering::Release);
        e.waiters.fetch_sub(1, Ordering::SeqCst);
        if !e.front.holds(t.ticket) {
            return;
        }
        let mut queue: Vec<Seated> = seg
            .waiters
            .iter()
            .filter(|o| {
                o.active.load(Ordering::Relaxed) == 1
                    && o.entry.load(Ordering::Relaxed) == cap.entry
            })
            .map(WaiterRecord::seated)
            .collect();
        queue.sort_by_key(|o| o.ticket);
        e.front.reseat(&queue);
        // Only the seats whose slots may be free now: the release that frees the others' wakes
        // them. Waking in vain would cost every hand-off a second context switch.
        wake(e.front.to_wake(seg.block(e).1, false));
    });
}

/// The waiters of database `db`'s caps, in queue order per cap (`position` 1 is the head).
pub fn waiters_of(db: u32) -> Vec<WaiterInfo> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    let mut found: Vec<(u32, u64, WaiterInfo)> = waits_locked(SHARED, || {
        seg.waiters
            .iter()
            .filter(|w| w.active.load(Ordering::Relaxed) == 1)
            .filter_map(|w| {
                let i = w.entry.load(Ordering::Relaxed);
                let e = seg.entry(i);
                (e.database() == db).then(|| {
                    let info = WaiterInfo {
                        cap: e.name(),
                        pid: w.pid.load(Ordering::Relaxed),
                        n: w.n.load(Ordering::Relaxed),
                        k: w.k.load(Ordering::Relaxed),
                        since: w.since.load(Ordering::Relaxed),
                        position: 0,
                    };
                    (i, w.ticket.load(Ordering::Relaxed), info)
                })
            })
            .collect()
    });
    found.sort_by_key(|(i, t, _)| (*i, *t));
    let mut out: Vec<WaiterInfo> = Vec::with_capacity(found.len());
    let mut previous = None;
    let mut position = 0;
    for (entry, _, mut w) in found {
        if previous != Some(entry) {
            previous = Some(entry);
            position = 0;
        }
        position += 1;
        w.position = position;
        out.push(w);
    }
    out.sort_by(|a, b| (&a.cap, a.position).cmp(&(&b.cap, b.position)));
    out
}
