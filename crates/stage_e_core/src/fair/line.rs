//! The fair queue run with the wait line's protocol, the way the server runs a cap with shares
//! (`shmem::shares`, `slots::shares`): under the queue lock a waiter joins both
//! (`queue::WaitLine::join_in_order` seats the front in [`Fair::order`]); a seated waiter that
//! sees a slot it may take claims it without the lock, then records its grant and reseats
//! under it ([`Fair::granted`], `leave_in_order`); a waiter that gives up leaves both; a call
//! that does not wait reserves a slot in its share under the lock only if its share is to be
//! served first ([`Fair::may_take_now`], [`Fair::took_now`]), claims it without the lock and
//! gives the reservation back if it lost the claim; a release clears its bit, gives the slot
//! back to its share, reseats only if that may move the order (its share has waiters and a
//! ceiling: a share at its ceiling competes again), and then the line wakes whom the free
//! slots serve. The steps are written once here, over what
//! the server supplies ([`Server`]), for the thread tests (`line_threads`) and the loom models
//! (`line_model`).

use super::*;
use crate::front::{Seated, Seats};
use crate::occupancy;
use crate::queue::{WaitLine, Waiters};
use crate::sync::AtomicU64;

/// What the queue lock guards: the waiter records (each with its share) and the fair queue.
pub(super) struct Locked {
    pub(super) queue: Vec<(Seated, u64)>,
    pub(super) clock: Clock,
    pub(super) table: Shares,
}

impl Locked {
    pub(super) fn new(shares: usize) -> Self {
        Locked {
            queue: Vec::new(),
            clock: Clock::default(),
            table: Shares::new(shares),
        }
    }

    pub(super) fn fair(&mut self) -> Fair<'_> {
        Fair::new(&mut self.clock, self.table.pool())
    }

    /// The front in the order of service, and the widest n.
    fn seats(&mut self) -> (Seats, u32) {
        let mut f = Fair::new(&mut self.clock, self.table.pool());
        f.seats(self.queue.iter().copied())
    }

    fn rest(&self) -> impl Iterator<Item = Waiter> + '_ {
        self.queue.iter().map(|(s, d)| Waiter {
            share: *d,
            ticket: s.ticket,
            k: s.k,
        })
    }
}

/// What the server supplies: the queue lock, sleeping on the latch, setting latches.
pub(super) trait Server {
    fn lock(&self, f: &mut dyn FnMut(&mut Locked));
    fn park(&self);
    fn wake(&self, seats: &Seats);
}

/// One cap of `n` slots (n <= 64), its wait line and its slots.
#[derive(Default)]
pub(super) struct Line {
    pub(super) n: u32,
    pub(super) line: WaitLine,
    pub(super) waiters: Waiters,
    pub(super) bits: [AtomicU64; 1],
}

impl Line {
    pub(super) fn new(n: u32) -> Self {
        Line {
            n,
            ..Line::default()
        }
    }

    /// A call of `sh` for one slot as process `me`: takes one if its share is served first,
    /// else (if `wait`) waits until it gets one or, woken, `gives_up`.
    pub(super) fn acquire(
        &self,
        me: usize,
        sh: Share,
        wait: bool,
        gives_up: &dyn Fn() -> bool,
        s: &dyn Server,
    ) -> Option<u32> {
        match self.take_or_join(me, sh, wait, s) {
            Ok(took) => took,
            Err(ticket) => self.wait(ticket, sh, gives_up, s),
        }
    }

    /// A call that does not wait first: under the lock, if its share is served first, a slot
    /// is reserved in the share (charged, counted held); then it is claimed without the lock,
    /// and given back under the lock if a seated waiter claimed the last free one first
    /// (`Ok(Some)` when taken). Not served first, or not taken, a call that may `wait` joins
    /// the queue (`Err(ticket)`), else `Ok(None)`. The server's `Cap::reserve_now` and
    /// `slots::shares::take_now`.
    pub(super) fn take_or_join(
        &self,
        me: usize,
        sh: Share,
        wait: bool,
        s: &dyn Server,
    ) -> Result<Option<u32>, u64> {
        let (mut reserved, mut woken) = (false, Seats::default());
        s.lock(&mut |l| {
            let free = occupancy::free_below(&self.bits, self.n);
            if l.fair().may_take_now(sh, 1, free) {
                l.fair().took_now(sh, 1).unwrap();
                reserved = true;
                if l.clock.waiting > 0 {
                    // A charge moves V, which may reorder the heads.
                    let (seats, widest) = l.seats();
                    woken = self.line.reorder(&seats, widest, &self.bits);
                }
            }
        });
        s.wake(&woken);
        if reserved {
            if let Some(slot) = occupancy::claim_first_free(&self.bits, 0, self.n) {
                return Ok(Some(slot.keep()));
            }
            // A seated waiter took the last free slot between the lock and the claim.
            self.give_back(sh, s);
        }
        if !wait {
            return Ok(None);
        }
        let mut ticket = 0;
        s.lock(&mut |l| {
            ticket = self.line.join_in_order(&self.waiters, |ticket| {
                let seated = Seated {
                    process: me,
                    ticket,
                    n: self.n,
                    k: 1,
                };
                l.queue.push((seated, sh.digest));
                // Behind every seat (and of the cap's one n): the seats stand.
                if !l.fair().join(sh, ticket, 1).unwrap() {
                    return None;
                }
                Some(l.seats())
            });
        });
        Err(ticket)
    }

    /// Queued with `ticket`: waits until the front lets it take a slot, or, woken, it
    /// `gives_up` (None). Seated and seeing a free slot it may take, it claims it without the
    /// lock, as a waiter of a cap without shares does, then records its grant under the lock
    /// (the server's `Cap::granted_in_line`). Only its own thread releases the slot, after
    /// that, so no release gives it back to the share before the grant counted it. (A lease,
    /// which another session may release, is taken under the lock: `Cap::take_in_line`.)
    pub(super) fn wait(
        &self,
        ticket: u64,
        sh: Share,
        gives_up: &dyn Fn() -> bool,
        s: &dyn Server,
    ) -> Option<u32> {
        let me = Waiter {
            share: sh.digest,
            ticket,
            k: 1,
        };
        loop {
            let claimed = self
                .line
                .may_take(ticket, &self.bits)
                .and_then(|from| occupancy::claim_first_free(&self.bits, from, self.n));
            if let Some(claim) = claimed {
                let slot = claim.keep();
                let mut woken = Seats::default();
                s.lock(&mut |l| woken = self.leave(l, me, true));
                s.wake(&woken);
                return Some(slot);
            }
            s.park();
            if gives_up() {
                let mut woken = Seats::default();
                let mut left = false;
                s.lock(&mut |l| {
                    // Still queued: served only in this waiter's own round, so it leaves unserved.
                    left = l.queue.iter().any(|(q, _)| q.ticket == ticket);
                    if left {
                        woken = self.leave(l, me, false);
                    }
                });
                s.wake(&woken);
                debug_assert!(left);
                return None;
            }
        }
    }

    /// Under the lock: waiter `me` leaves both queues, `granted` or not; the front is seated
    /// again, and the seats that may take now are returned, to wake.
    fn leave(&self, l: &mut Locked, me: Waiter, granted: bool) -> Seats {
        l.queue.retain(|(q, _)| q.ticket != me.ticket);
        let rest: Vec<Waiter> = l.rest().collect();
        if granted {
            l.fair().granted(me, rest);
        } else {
            l.fair().leave(me, rest);
        }
        let (seats, widest) = l.seats();
        self.line
            .leave_in_order(&self.waiters, &seats, widest, &self.bits)
    }

    /// A reservation that was not taken goes back to its share, which may reseat the front.
    fn give_back(&self, sh: Share, s: &dyn Server) {
        let mut woken = Seats::default();
        s.lock(&mut |l| {
            // The order moves only if the share has waiters and a ceiling (the server's
            // `give_back_share`); else the line's own release wakes what the slot serves.
            if l.fair().released(sh.digest, 1) {
                let (seats, widest) = l.seats();
                woken = self.line.reorder(&seats, widest, &self.bits);
            }
        });
        s.wake(&woken);
    }

    /// Share `sh` gives `slot` back.
    pub(super) fn release(&self, sh: Share, slot: u32, s: &dyn Server) {
        occupancy::clear(&self.bits, slot);
        let mut woken = Seats::default();
        s.lock(&mut |l| {
            // The order moves only if the share has waiters and a ceiling (the server's
            // `give_back_share`); else the line's own release wakes what the slot serves.
            if l.fair().released(sh.digest, 1) {
                let (seats, widest) = l.seats();
                woken = self.line.reorder(&seats, widest, &self.bits);
            }
        });
        s.wake(&woken);
        s.wake(&self.line.released(&self.waiters, &self.bits));
    }
}
