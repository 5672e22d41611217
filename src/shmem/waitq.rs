//! A cap's queue of waiters.
//!
//! A FIFO of tickets per cap, with one record per waiting backend in the segment's list of
//! waiters (a backend's own: the one of its PGPROC number). The first `FRONT` waiters in ticket
//! order sit in the entry's front seats and only they take slots; while a cap has waiters, a
//! call that is not queued takes only the slots no waiter can use (`stage_e_core::front`, which
//! states the rule). The count of waiters, the next ticket and the seats, and the steps by
//! which waiters join and leave and releases wake them (and why no wake-up is lost), are
//! `stage_e_core::queue`'s `Waiters` and `WaitLine`; this file places them in the entry and
//! keeps the list of waiter records. Joining and leaving take the waits LWLock; waiters and the
//! release path read the seats without it (a seqlock) and set the latches of the seats that may
//! take.
//!
//! A cap with waiters is never reclaimed (`caps`), so a waiter holds no pin while it sleeps and
//! leaves the queue by its entry alone. The policy (who waits, for how long, what a wake-up
//! does) is in `slots::waiting`.

use super::entry::CapEntry;
use super::pin::my_procno;
use super::records::WaiterRecord;
use super::segment::{segment, waits_locked, Segment, EXCLUSIVE, SHARED};
use super::Cap;
use pgrx::pg_sys;
use stage_e_core::front::{Seated, Seats};
use std::sync::atomic::Ordering;

impl WaiterRecord {
    pub(super) fn seated(&self) -> Seated {
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
    pub(super) record: u32,
    pub(super) ticket: u64,
}

/// A waiter as the waiters view shows it.
pub struct WaiterInfo {
    pub cap: String,
    pub pid: i32,
    pub n: u32,
    pub k: u32,
    pub since: i64,
    pub position: u32,
    /// The share it waits in (None: none, or the cap's unnamed share).
    pub share: Option<String>,
}

/// The waiter records of the cap in entry `entry`, under the waits lock.
pub(super) fn queue_of(
    seg: &'static Segment,
    entry: u32,
) -> impl Iterator<Item = &'static WaiterRecord> + Clone {
    seg.waiters.iter().filter(move |w| {
        w.active.load(Ordering::Relaxed) == 1 && w.entry.load(Ordering::Relaxed) == entry
    })
}

/// Sets the latches of `seats`.
pub(super) fn wake(seats: Seats) {
    for s in seats.iter() {
        let p = s.process as *mut pg_sys::PGPROC;
        // SAFETY: a seat names a PGPROC, which lives in shared memory for the server's
        // lifetime; a stale one (its waiter has left) is woken in vain.
        unsafe { pg_sys::SetLatch(&raw mut (*p).procLatch) };
    }
}

impl Cap {
    pub fn waiters(&self) -> u32 {
        self.entry().waiters.count()
    }

    /// Where the waiter holding `t` may take its slots now, from which slot up: None unless it
    /// is seated and the free slots serve it without taking any a waiter ahead of it could use
    /// (`stage_e_core::front::plans`).
    pub fn may_take(&self, t: Ticket) -> Option<u32> {
        self.entry().line.may_take(t.ticket, self.bits())
    }

    /// Where a call that is not queued may take `k` slots of `[0, n)` while the cap has
    /// waiters: from the widest n of the queue up, if k of those are free; else None.
    pub fn newcomer(&self, n: u32, k: u32) -> Option<u32> {
        self.entry().line.newcomer(n, k, self.bits())
    }

    /// After freeing slots: sets the latch of the head, and of every seat behind it that may
    /// take now.
    pub fn wake_front(&self) {
        let e = self.entry();
        wake(e.line.released(&e.waiters, self.bits()));
    }

    /// Joins the cap's queue; None if the list of waiters is full (it has a record for every
    /// backend, so only a bug gets None).
    pub fn enqueue(&self, n: u32, k: u32, since: i64) -> Option<Ticket> {
        let seg = segment()?;
        let e = self.entry();
        waits_locked(EXCLUSIVE, || {
            let record = free_record(seg)?;
            let w = &seg.waiters[record as usize];
            // Seated (and its n in the widest) before the count shows it: a call that sees the
            // count sees its n (`stage_e_core::queue`).
            let ticket = e.line.join(&e.waiters, |ticket| {
                fill(w, self.at.entry, n, k, since, ticket, 0);
                w.seated()
            });
            Some(Ticket { record, ticket })
        })
    }
}

/// With the waits lock held: this backend's own waiter record; were it taken (a bug), any
/// free one.
pub(super) fn free_record(seg: &Segment) -> Option<u32> {
    let free = |i: &usize| seg.waiters[*i].active.load(Ordering::Relaxed) == 0;
    my_procno()
        .filter(|i| *i < seg.waiters.len() && free(i))
        .or_else(|| (0..seg.waiters.len()).find(free))
        .map(|i| i as u32)
}

/// With the waits lock held: writes this backend's waiter record `w`, waiting for `k` slots of
/// `[0, n)` of the cap in entry `entry` with `ticket` (in share `share`, 0: none), and makes it
/// active last.
pub(super) fn fill(
    w: &WaiterRecord,
    entry: u32,
    n: u32,
    k: u32,
    since: i64,
    ticket: u64,
    share: u64,
) {
    // SAFETY: this backend's PGPROC and pid, set at start-up.
    let (me, pid) = unsafe { (pg_sys::MyProc, pg_sys::MyProcPid) };
    w.entry.store(entry, Ordering::Relaxed);
    w.pid.store(pid, Ordering::Relaxed);
    w.n.store(n, Ordering::Relaxed);
    w.k.store(k, Ordering::Relaxed);
    w.ticket.store(ticket, Ordering::Relaxed);
    w.since.store(since, Ordering::Relaxed);
    w.proc_.store(me as u64, Ordering::Relaxed);
    w.share.store(share, Ordering::Relaxed);
    w.active.store(1, Ordering::Release);
}

/// With the waits lock held exclusively: the waiter holding `t` (its record `w`, made
/// inactive by the caller), of a cap without shares, leaves the queue of the cap in entry
/// `entry` (`shares::dequeue` is the entry point; no pin needed: a cap with waiters is never
/// reclaimed). If `t` had a front seat, the seats behind it move up and the next waiter is
/// seated; the widest n of the queue is taken again if `t` may have been it. Returns the
/// seats that may take now, for the caller to wake once the lock is released.
pub(super) fn leave_locked(
    seg: &'static Segment,
    e: &CapEntry,
    entry: u32,
    t: Ticket,
    w: &WaiterRecord,
) -> Seats {
    let queued = queue_of(seg, entry).map(WaiterRecord::seated);
    // Only the seats that may take now, if `t` had one: the release that frees the others'
    // slots wakes them (waking in vain would cost every hand-off a second context switch).
    e.line.leave(
        &e.waiters,
        t.ticket,
        w.n.load(Ordering::Relaxed),
        queued,
        seg.block(e).1,
    )
}

/// The record of the waiter holding `t`, if it is still queued: under the waits lock, or by
/// the waiter itself without it, to see that it has left (`shares::dequeue`).
pub(super) fn queued(seg: &'static Segment, t: Ticket) -> Option<&'static WaiterRecord> {
    let w = &seg.waiters[t.record as usize];
    (w.active.load(Ordering::Relaxed) == 1 && w.ticket.load(Ordering::Relaxed) == t.ticket)
        .then_some(w)
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
                        share: match w.share.load(Ordering::Relaxed) {
                            0 => None,
                            digest => seg.share_name(e, digest),
                        },
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
