//! Fair shares of caps (issue 38), placed in shared memory: `stage_e_core::fair`'s clock in
//! each cap entry, its share records in one pool of `stage_e_slots.max_shares` records that
//! every cap draws on, the pool's head in the segment header and each database's count of
//! records in its database record (its `database_share` of the pool).
//!
//! Interface:
//!
//! - [`Cap::has_shares`]: whether the cap has live shares (one load, without a lock: a cap
//!   that never had a share keeps its path);
//! - [`Cap::fair`]: one step of the cap's fair queue (`stage_e_core::fair::Fair`), under the
//!   exclusive waits lock;
//! - [`Cap::give_back_share`]: slots taken in a share are given back (every release path
//!   reads the slot's share from its holder record before clearing it);
//! - [`shares_of`]: the live shares of a database's caps, for the views.
//!
//! Protocol: everything here (the clock, the records, the pool's head, the databases' counts)
//! is changed only under the exclusive waits lock, the lock that also guards the caps' queues,
//! so one step sees a cap's shares and its waiters together. The clock is kept in atomics so
//! that [`Cap::has_shares`] may read its chain link without the lock: a cap whose chain was
//! empty at that look takes the path of a cap without shares, which is what it was an instant
//! before (as a call that came an instant earlier would have). The records are plain data;
//! `&mut` to them exists only inside [`Cap::fair`], under the exclusive lock, so there is no
//! other reference in this process, and other processes touch them only under the same lock.

use super::databases;
use super::entry::CapEntry;
use super::records::{ShareNote, WaiterRecord, NAME_WORDS};
use super::segment::{segment, waits_locked, Segment, EXCLUSIVE, SHARED};
use super::waitq::{self, fill, free_record, queue_of, queued, wake, Ticket};
use super::Cap;
use crate::gucs;
use stage_e_core::fair::{
    Clock, Fair, Pool, PoolHead, Refused, Share, ShareAt, ShareRecord, Waiter, NO_CEILING, UNNAMED,
};
use stage_e_core::front::{Seated, Seats};
use stage_e_core::lease_file::LeaseShare;
use stage_e_core::occupancy;
use stage_e_core::state::CapRef;
use std::sync::atomic::Ordering;

impl CapEntry {
    fn set_clock(&self, c: Clock) {
        let [v, rest] = c.pack();
        self.clock[0].store(v, Ordering::Relaxed);
        // Release: pairs with `has_shares`' Acquire (a chain seen is a chain written).
        self.clock[1].store(rest, Ordering::Release);
    }
}

impl Segment {
    /// The share records, for one step under the exclusive waits lock.
    ///
    /// # Safety
    /// The caller holds the waits lock exclusively, and no other reference to the records
    /// lives in this process meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn share_records(&self) -> &mut [ShareRecord] {
        // SAFETY: the part is `shares_len` records inside the segment, 8-aligned, valid zeroed
        // (`attach`); exclusivity per the caller.
        unsafe { std::slice::from_raw_parts_mut(self.shares, self.shares_len) }
    }
}

/// The records this backend's database may hold: its `database_share` of the pool.
fn limit(seg: &Segment) -> u32 {
    stage_e_core::share::limit(seg.shares_len as u64, gucs::database_share()) as u32
}

impl Cap {
    /// Whether the cap has live shares (its chain of records is not empty), without a lock.
    pub fn has_shares(&self) -> bool {
        self.entry().has_shares()
    }

    /// Runs one step of the cap's fair queue under the exclusive waits lock; what the step
    /// changed (the clock, the records, the pool's head, the database's count) is stored
    /// before the lock is released. The database may hold `database_share` percent of the
    /// pool (as this backend's setting says).
    pub fn fair<R>(&self, f: impl FnOnce(&mut Fair) -> R) -> R {
        let seg = segment().expect("a pinned cap implies the segment");
        let limit = stage_e_core::share::limit(seg.shares_len as u64, gucs::database_share());
        waits_locked(EXCLUSIVE, || {
            fair_locked(seg, self.entry(), limit as u32, f)
        })
    }

    /// Slots of this cap taken in the share at `at` (from their holder records; 0: none) are
    /// given back: `k` of them. If that may move the order of service (the share has waiters
    /// and a ceiling: back under it, it competes again), the front is seated again and the
    /// seats that may take now are woken; else the caller's `wake_front` wakes them.
    #[inline]
    pub fn give_back_share(&self, at: u32, k: u32) {
        // Every release of a cap without shares passes here: one compare, then out of line.
        if at != 0 {
            self.give_back_share_at(ShareAt(at), k);
        }
    }

    #[cold]
    #[inline(never)]
    fn give_back_share_at(&self, at: ShareAt, k: u32) {
        let line = Line::of(self);
        let woken = self.fair(|f| {
            // A share at its ceiling competes again: the front in the new order of service.
            // Else the order is as it was, and the release's `wake_front` wakes the seats the
            // freed slot serves.
            match &line {
                Some(line) if f.released_at(at, k) => line.reseat(f),
                _ => Seats::default(),
            }
        });
        wake(woken);
    }
}

/// [`Cap::fair`] with the waits lock held exclusively (by the caller). What the step changed is
/// stored even if it unwinds (an ERROR of a take under the lock, `Cap::take_in_line`): the
/// records are changed in place, so the clock, the pool's head and the count must follow them.
pub(super) fn fair_locked<R>(
    seg: &'static Segment,
    e: &'static CapEntry,
    limit: u32,
    f: impl FnOnce(&mut Fair) -> R,
) -> R {
    struct Copies {
        seg: &'static Segment,
        e: &'static CapEntry,
        db: u32,
        clock: Clock,
        head: PoolHead,
        used: u32,
        before: (Clock, PoolHead, u32),
    }
    impl Drop for Copies {
        fn drop(&mut self) {
            if (self.clock, self.head, self.used) != self.before {
                self.e.set_clock(self.clock);
                self.seg
                    .header
                    .share_pool
                    .store(self.head.pack(), Ordering::Relaxed);
                databases::set_shares_of_database(self.db, self.used);
            }
        }
    }
    let db = e.database();
    let (clock, head, used) = (
        e.clock(),
        PoolHead::unpack(seg.header.share_pool.load(Ordering::Relaxed)),
        databases::shares_of_database(db),
    );
    let mut c = Copies {
        seg,
        e,
        db,
        clock,
        head,
        used,
        before: (clock, head, used),
    };
    // SAFETY: the caller holds the waits lock exclusively; the records are borrowed for this
    // step only.
    let records = unsafe { seg.share_records() };
    let mut fair = Fair::new(
        &mut c.clock,
        Pool {
            records,
            head: &mut c.head,
            used: &mut c.used,
            limit,
        },
    );
    f(&mut fair)
}

impl ShareNote {
    /// Under the exclusive lock: the note is share `name`'s (`""`: the unnamed share); a
    /// record that was another share's gets the name, and its counts restart.
    fn set(&self, name: &str) {
        let mut bytes = [0u8; NAME_WORDS * 8];
        let n = name.len().min(bytes.len() - 1);
        bytes[0] = n as u8;
        bytes[1..1 + n].copy_from_slice(&name.as_bytes()[..n]);
        let same =
            self.name.iter().zip(bytes.chunks(8)).all(|(w, c)| {
                w.load(Ordering::Relaxed) == u64::from_le_bytes(c.try_into().unwrap())
            });
        if same {
            return;
        }
        for (w, c) in self.name.iter().zip(bytes.chunks(8)) {
            w.store(
                u64::from_le_bytes(c.try_into().expect("8 bytes")),
                Ordering::Relaxed,
            );
        }
        self.granted.store(0, Ordering::Relaxed);
        self.wait_us.store(0, Ordering::Relaxed);
    }

    /// Under the exclusive lock: `k` slots granted, after `waited` µs.
    fn granted(&self, k: u32, waited: u64) {
        self.granted.fetch_add(k as u64, Ordering::Relaxed);
        self.wait_us.fetch_add(waited, Ordering::Relaxed);
    }
}

/// The note of the record at `at` (`ShareAt`: index + 1).
fn note(seg: &Segment, at: ShareAt) -> Option<&'static ShareNote> {
    at.0.checked_sub(1)
        .and_then(|i| seg.share_notes.get(i as usize))
}

/// The share that waiters who joined without one are adopted into once their cap has shares:
/// the unnamed share, weight 1, no ceiling.
const UNNAMED_SHARE: Share = Share {
    digest: UNNAMED,
    weight: 1,
    ceiling: NO_CEILING,
};

impl WaiterRecord {
    fn waiter(&self) -> Waiter {
        Waiter {
            share: self.share.load(Ordering::Relaxed),
            ticket: self.ticket.load(Ordering::Relaxed),
            k: self.k.load(Ordering::Relaxed),
        }
    }
}

/// One step on the queue of the cap in entry `entry` (`e`), the waits lock held exclusively.
struct Line {
    seg: &'static Segment,
    e: &'static CapEntry,
    entry: u32,
}

impl Line {
    fn of(cap: &Cap) -> Option<Line> {
        Some(Line {
            seg: segment()?,
            e: cap.entry(),
            entry: cap.at.entry,
        })
    }

    fn bits(&self) -> &'static [std::sync::atomic::AtomicU64] {
        self.seg.block(self.e).1
    }

    /// The cap's waiters (each with its share's digest), read once for a step: one walk of
    /// every backend's waiter record, where the fair order would walk them once per seat.
    fn queue(&self) -> Vec<(Seated, u64)> {
        // Sized once (the count is exact under the lock, plus a joiner's own record).
        let mut queue = Vec::with_capacity(self.e.waiters.count() as usize + 1);
        queue.extend(
            queue_of(self.seg, self.entry).map(|w| (w.seated(), w.share.load(Ordering::Relaxed))),
        );
        queue
    }

    /// Waiters that joined without a share (before the cap had shares, or racing its first)
    /// join its unnamed share, in ticket order, keeping their tickets: the front is seated in
    /// the fair queue's order, which has no place for a waiter in no share.
    fn adopt(&self, f: &mut Fair) -> Result<(), Refused> {
        // Every waiter counted is in the fair queue (the usual case): nothing to walk.
        if self.e.waiters.count() == f.waiting() {
            return Ok(());
        }
        let mut plain: Vec<&WaiterRecord> = queue_of(self.seg, self.entry)
            .filter(|w| w.share.load(Ordering::Relaxed) == 0)
            .collect();
        if plain.is_empty() {
            return Ok(());
        }
        plain.sort_by_key(|w| w.ticket.load(Ordering::Relaxed));
        // The unnamed share keeps the policy its calls gave it ('*'); a new one starts with
        // weight 1 and no ceiling until its next call.
        let unnamed = f.share_of(UNNAMED).unwrap_or(UNNAMED_SHARE);
        f.admit(unnamed, 1)?;
        if let Some(n) = f.at_of(UNNAMED).and_then(|at| note(self.seg, at)) {
            n.set("");
        }
        for w in plain {
            let x = w.waiter();
            // One asking for more than the unnamed share's ceiling could never be served in
            // it: it stays in no share, served by its seat when the front reaches it.
            if f.join(unnamed, x.ticket, x.k).is_ok() {
                w.share.store(UNNAMED, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// The front seated again in the order of service (a grant or a release in a share moved
    /// it); returns the seats that may take now, for the caller to wake once the lock is
    /// released (a process woken while we hold the lock would run only to wait for it).
    fn reseat(&self, f: &mut Fair) -> Seats {
        if f.waiting() == 0 {
            return Seats::default();
        }
        let (order, widest) = f.seats(self.queue().iter().copied());
        self.e.line.reorder(&order, widest, self.bits())
    }

    /// Waiter `w` (its record already inactive) left the fair queue, `granted` or not: the
    /// count goes down, the front is seated again. Returns where its share's record is (if
    /// granted) and the seats that may take now, to wake once the lock is released.
    fn leave(&self, f: &mut Fair, w: Waiter, granted: bool) -> (Option<ShareAt>, Seats) {
        let queue = self.queue();
        let rest = queue.iter().map(|&(s, share)| Waiter {
            share,
            ticket: s.ticket,
            k: s.k,
        });
        let at = if granted {
            f.granted(w, rest)
        } else {
            f.leave(w, rest);
            None
        };
        let (order, widest) = f.seats(queue.iter().copied());
        let woken = self
            .e
            .line
            .leave_in_order(&self.e.waiters, &order, widest, self.bits());
        (at, woken)
    }
}

impl Cap {
    /// A call of `share` that does not wait, for `k` slots of `[0, n)`: if the fair queue lets
    /// it take now (within its ceiling; served first while the cap has waiters), its slots are
    /// reserved in its share (charged, counted held) and where its record is is returned, for
    /// the slots' holder records; the caller takes them without the lock, and gives the
    /// reservation back ([`Cap::give_back_share`]) if it could not. `name` is the share's name
    /// (`""`: the unnamed share), for the views.
    pub fn reserve_now(
        &self,
        share: Share,
        name: &str,
        n: u32,
        k: u32,
    ) -> Result<Option<ShareAt>, Refused> {
        let Some(line) = Line::of(self) else {
            return Ok(None);
        };
        let free = occupancy::free_below(line.bits(), n);
        if free < k {
            // Not enough free at this look: no step would let it take (`may_take_now`), so
            // the exclusive lock is not taken for nothing on a saturated cap.
            return Ok(None);
        }
        let (at, woken) = self.fair(|f| {
            line.adopt(f)?;
            f.refresh(share);
            if !f.may_take_now(share, k, free) {
                return Ok((None, Seats::default()));
            }
            let at = f.took_now(share, k)?;
            if let Some(n) = note(line.seg, at) {
                n.set(name);
                n.granted(k, 0);
            }
            // A charge moves V, which may reorder the heads.
            Ok((Some(at), line.reseat(f)))
        })?;
        wake(woken);
        Ok(at)
    }

    /// Joins the cap's queue in `share`, for `k` slots of `[0, n)`: the front is seated in the
    /// order of service. None if the list of waiters is full (only a bug: it has a record per
    /// backend); Err if the share has no record and the pool no room.
    pub fn enqueue_in_share(
        &self,
        share: Share,
        name: &str,
        n: u32,
        k: u32,
        since: i64,
    ) -> Result<Option<Ticket>, Refused> {
        let Some(line) = Line::of(self) else {
            return Ok(None);
        };
        let seg = line.seg;
        waits_locked(EXCLUSIVE, || {
            let Some(record) = free_record(seg) else {
                return Ok(None);
            };
            fair_locked(seg, line.e, limit(seg), |f| {
                line.adopt(f)?;
                f.admit(share, k)?;
                if let Some(n) = f.at_of(share.digest).and_then(|at| note(seg, at)) {
                    n.set(name);
                }
                let w = &seg.waiters[record as usize];
                let front = line.e.line.front();
                let ticket = line.e.line.join_in_order(&line.e.waiters, |ticket| {
                    fill(w, line.entry, n, k, since, ticket, share.digest);
                    let joined = f.join(share, ticket, k);
                    debug_assert!(joined.is_ok(), "admitted, yet refused: {joined:?}");
                    // Behind every seat, and of an n the front knows: the seats stand, and
                    // the queue is not walked (`Fair::join`).
                    if joined == Ok(false) && n <= front.widest() {
                        return None;
                    }
                    Some(f.seats(line.queue().iter().copied()))
                });
                Ok(Some(Ticket { record, ticket }))
            })
        })
    }

    /// A waiter of a cap with shares (`t`), woken, taking leases: under the waits lock, if it
    /// is seated and the free slots serve it, `take(from, share)` takes its slots (from slot
    /// `from` up, naming its share's record in their holder records: `share`, 0 for none);
    /// taken, the waiter is granted in its share and leaves the queue, and the front is seated
    /// again. The take is under the lock so that the grant is counted before any release of
    /// the slots can give them back: a lease may be released by another session (its token)
    /// or expire. None if it may not take now (or `take` found nothing). `now` is when, for the
    /// share's wait time. Session slots take without the lock ([`Cap::granted_in_line`]).
    pub fn take_in_line<T, E>(
        &self,
        t: Ticket,
        now: i64,
        take: impl FnOnce(u32, u32) -> Result<Option<T>, E>,
    ) -> Result<Option<T>, E> {
        let Some(line) = Line::of(self) else {
            return Ok(None);
        };
        let seg = line.seg;
        let mut woken = Seats::default();
        let got = waits_locked(EXCLUSIVE, || {
            fair_locked(seg, line.e, limit(seg), |f| {
                let Some(w) = queued(seg, t) else {
                    return Ok(None);
                };
                // Pool full: a waiter left in no share is served by its seat, counted in none.
                let _ = line.adopt(f);
                let Some(from) = line.e.line.may_take(t.ticket, line.bits()) else {
                    return Ok(None);
                };
                let me = w.waiter();
                let at = f.at_of(me.share).map_or(0, |a| a.0);
                let got = take(from, at)?;
                if got.is_some() {
                    w.active.store(0, Ordering::Release);
                    if me.share == 0 {
                        f.forget_cutoff();
                        woken = dequeue_plain(&line, t, w);
                    } else {
                        let at;
                        (at, woken) = line.leave(f, me, true);
                        let waited = (now - w.since.load(Ordering::Relaxed)).max(0) as u64;
                        if let Some(n) = at.and_then(|at| note(seg, at)) {
                            n.granted(me.k, waited);
                        }
                    }
                }
                Ok(got)
            })
        });
        wake(woken);
        got
    }
}

impl Cap {
    /// A waiter of a cap with shares (`t`) took session slots `slots` without the lock, as a
    /// waiter of a cap without shares does, in no share: under the waits lock it is granted in
    /// its share and leaves the queue, the front is seated again, and then the slots' holder
    /// records name the share. Until then a release of them gives nothing back to a share, and
    /// none comes: a session slot is released by its own session alone, which is here (its
    /// ERROR or exit before this step leaves the queue ungranted and frees the slots in no
    /// share, so the share's counts stay right either way). `now` is when, for the share's
    /// wait time. The lock is held for the accounting only: the lock manager's work (the
    /// slots' advisory locks) is done before it.
    pub fn granted_in_line(&self, t: Ticket, now: i64, slots: impl Iterator<Item = u32>) {
        let Some(line) = Line::of(self) else { return };
        let seg = line.seg;
        let woken = waits_locked(EXCLUSIVE, || {
            fair_locked(seg, line.e, limit(seg), |f| {
                let Some(w) = queued(seg, t) else {
                    debug_assert!(false, "a waiter that took left the queue before its grant");
                    return Seats::default();
                };
                // Pool full: a waiter left in no share is served by its seat, counted in none.
                let _ = line.adopt(f);
                let me = w.waiter();
                w.active.store(0, Ordering::Release);
                if me.share == 0 {
                    f.forget_cutoff();
                    return dequeue_plain(&line, t, w);
                }
                let (at, woken) = line.leave(f, me, true);
                if let Some(at) = at {
                    let waited = (now - w.since.load(Ordering::Relaxed)).max(0) as u64;
                    if let Some(n) = note(seg, at) {
                        n.granted(me.k, waited);
                    }
                    for slot in slots {
                        self.record(slot).set_share(at.0);
                    }
                }
                woken
            })
        });
        wake(woken);
    }
}

/// The waiter holding `t` leaves the queue of the cap in entry `cap.entry` unserved (timed
/// out, cancelled, terminated, or served by a take of its own without the lock, which counts
/// in no share): in a cap with shares, its share is where it would be had it never come
/// (`stage_e_core::fair::Fair::leave`), the front is seated again; else `waitq`'s leave. No
/// pin needed: a cap with waiters is never reclaimed.
pub fn dequeue(cap: CapRef, t: Ticket) {
    let Some(seg) = segment() else { return };
    let line = Line {
        seg,
        e: seg.entry(cap.entry),
        entry: cap.entry,
    };
    // A waiter granted (`Cap::take_in_line`, `Cap::granted_in_line`) has left already: its
    // own record says so (tickets are never reused, so a record another waiter took since
    // does not look like ours), and the exclusive lock is not taken again for nothing.
    if queued(seg, t).is_none() {
        return;
    }
    let woken = waits_locked(EXCLUSIVE, || {
        let Some(w) = queued(seg, t) else {
            return Seats::default(); // already left
        };
        let me = w.waiter();
        w.active.store(0, Ordering::Release);
        if me.share == 0 {
            // Outside a step of the fair queue: the entry's own clock (written only when it
            // has a cutoff, which a cap without shares never has).
            let before = line.e.clock();
            let mut clock = before;
            clock.forget_cutoff();
            if clock != before {
                line.e.set_clock(clock);
            }
            dequeue_plain(&line, t, w)
        } else {
            fair_locked(seg, line.e, limit(seg), |f| line.leave(f, me, false).1)
        }
    });
    wake(woken);
}

/// A waiter in no share leaves: the front is seated by its own rules, not the fair order, so
/// the caller forgets the clock's cutoff (a cutoff kept would let a join leave that front as it
/// is: `Fair::join`), through the clock it holds.
fn dequeue_plain(line: &Line, t: Ticket, w: &WaiterRecord) -> Seats {
    waitq::leave_locked(line.seg, line.e, line.entry, t, w)
}

/// A live share of a cap, as the views show it.
pub struct ShareInfo {
    pub cap: String,
    /// None: the cap's unnamed share.
    pub name: Option<String>,
    pub weight: u32,
    pub ceiling: Option<u32>,
    pub held: u32,
    pub waiting: u32,
    /// Slots granted since the share became live, and how long its waiters waited for them.
    pub granted: u64,
    pub wait_us: u64,
}

/// The live shares of database `db`'s caps.
pub fn shares_of(db: u32) -> Vec<ShareInfo> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    waits_locked(SHARED, || {
        let records = seg.share_records_shared();
        let mut out = Vec::new();
        for e in seg.live().filter(|e| e.database() == db && e.has_shares()) {
            let cap = e.name();
            for (i, s) in stage_e_core::fair::live_shares(&e.clock(), records) {
                let n = &seg.share_notes[i];
                out.push(ShareInfo {
                    cap: cap.clone(),
                    name: n.name(),
                    weight: s.weight,
                    ceiling: (s.ceiling != NO_CEILING).then_some(s.ceiling),
                    held: s.held,
                    waiting: s.waiting,
                    granted: n.granted.load(Ordering::Relaxed),
                    wait_us: n.wait_us.load(Ordering::Relaxed),
                });
            }
        }
        out
    })
}

impl Cap {
    /// The live share slot `slot` was taken in: None if none, `Some(None)` for the cap's
    /// unnamed share, else its name. The caller holds the waits lock (either mode), or is the
    /// postmaster, alone.
    fn slot_share(&self, seg: &Segment, slot: u32) -> Option<Option<String>> {
        let at = self.record(slot).share().checked_sub(1)? as usize;
        stage_e_core::fair::live_shares(&self.entry().clock(), seg.share_records_shared())
            .any(|(i, _)| i == at)
            .then(|| seg.share_notes[at].name())
    }

    /// The name of the share slot `slot` was taken in (None: none, or the unnamed share), for
    /// the holders view.
    pub fn share_of(&self, slot: u32) -> Option<String> {
        let seg = segment()?;
        waits_locked(SHARED, || self.slot_share(seg, slot)).flatten()
    }
}

/// A lease across a clean restart keeps its share (`persist`): read at shutdown, put back at
/// start. Both run in the postmaster, alone (every backend gone, or none yet), so they read and
/// change the records without the waits lock.
impl Cap {
    /// The share lease slot `slot` counts in, for the lease file.
    pub(super) fn lease_share(&self, slot: u32) -> LeaseShare {
        match segment().and_then(|seg| self.slot_share(seg, slot)) {
            None => LeaseShare::None,
            Some(None) => LeaseShare::Unnamed,
            Some(Some(name)) => LeaseShare::Named(name),
        }
    }

    /// Restored lease slot `slot` counts in share `digest` (named `name`; `""`: the unnamed
    /// share) again. The share has weight 1 and no ceiling until its next call brings its
    /// policy (the postmaster cannot read the table): only its own calls meet its ceiling, and
    /// each call brings the policy before it is admitted. False if the pool has no room: the
    /// lease then counts in no share.
    pub(super) fn restore_in_share(&self, slot: u32, digest: u64, name: &str) -> bool {
        let Some(seg) = segment() else { return false };
        let limit = stage_e_core::share::limit(seg.shares_len as u64, 100) as u32;
        let share = Share {
            digest,
            weight: 1,
            ceiling: NO_CEILING,
        };
        // No lock: the postmaster at start, alone.
        fair_locked(seg, self.entry(), limit, |f| {
            let Ok(at) = f.took_now(f.share_of(digest).unwrap_or(share), 1) else {
                return false;
            };
            if let Some(n) = note(seg, at) {
                n.set(name);
            }
            self.record(slot).set_share(at.0);
            true
        })
    }
}
