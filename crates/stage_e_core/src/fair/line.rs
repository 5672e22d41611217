//! The fair queue run with the wait line's protocol, the way the server is to run a cap with
//! shares: under the queue lock a waiter joins both (`queue::WaitLine::join_in_order` seats the
//! front in [`Fair::order`]); a seated waiter claims its slots without the lock
//! (`front::plans`), then records its grant and reseats ([`Fair::granted`], `leave_in_order`);
//! a waiter that gives up leaves both; a call that does not wait takes, under the lock, only
//! if its share is to be served first ([`Fair::may_take_now`]); a release clears its bit,
//! gives the slot back to its share and reseats (a share at its ceiling competes again), and
//! then the line wakes whom the free slots serve. The steps are written once here, over what
//! the server supplies ([`Server`]), for the thread tests (`line_threads`) and the loom models
//! (`line_model`).

use super::*;
use crate::front::Seated;
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
        let f = Fair::new(&mut self.clock, self.table.pool());
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

    /// One round of the queue lock: takes a slot now if the call's share is served first
    /// (`Ok(Some)`), else joins the queue if `wait` (`Err(ticket)`), else `Ok(None)`.
    pub(super) fn take_or_join(
        &self,
        me: usize,
        sh: Share,
        wait: bool,
        s: &dyn Server,
    ) -> Result<Option<u32>, u64> {
        // One round of the lock: takes now if its share is served first, else joins.
        let (mut took, mut ticket, mut woken) = (None, None, Seats::default());
        s.lock(&mut |l| {
            let free = occupancy::free_below(&self.bits, self.n);
            // The first free slot: a seated waiter may claim the same one without the lock,
            // and then this call waits (or gives up) like any other.
            if l.fair().may_take_now(sh, 1, free) {
                took = occupancy::claim_first_free(&self.bits, 0, self.n).map(|c| c.keep());
            }
            if took.is_some() {
                l.fair().took_now(sh, 1).unwrap();
                if l.clock.waiting > 0 {
                    // A charge moves V, which may reorder the heads.
                    let (seats, widest) = l.seats();
                    woken = self.line.reorder(&seats, widest, &self.bits);
                }
            } else if wait {
                ticket = Some(self.line.join_in_order(&self.waiters, |ticket| {
                    let seated = Seated {
                        process: me,
                        ticket,
                        n: self.n,
                        k: 1,
                    };
                    l.queue.push((seated, sh.digest));
                    l.fair().join(sh, ticket, 1).unwrap();
                    l.seats()
                }));
            }
        });
        s.wake(&woken);
        ticket.map_or(Ok(took), Err)
    }

    /// Queued with `ticket`: waits until the front lets it take a slot, or, woken, it
    /// `gives_up` (None).
    pub(super) fn wait(
        &self,
        ticket: u64,
        sh: Share,
        gives_up: &dyn Fn() -> bool,
        s: &dyn Server,
    ) -> Option<u32> {
        loop {
            let served = self
                .line
                .may_take(ticket, &self.bits)
                .and_then(|from| occupancy::claim_first_free(&self.bits, from, self.n))
                .map(|c| c.keep());
            if served.is_none() {
                s.park();
            }
            if served.is_some() || gives_up() {
                let mut woken = Seats::default();
                s.lock(&mut |l| {
                    l.queue.retain(|(q, _)| q.ticket != ticket);
                    let w = Waiter {
                        share: sh.digest,
                        ticket,
                        k: 1,
                    };
                    let rest: Vec<Waiter> = l.rest().collect();
                    if served.is_some() {
                        l.fair().granted(w, rest);
                    } else {
                        l.fair().leave(w, rest);
                    }
                    let (seats, widest) = l.seats();
                    woken = self
                        .line
                        .leave_in_order(&self.waiters, &seats, widest, &self.bits);
                });
                s.wake(&woken);
                return served;
            }
        }
    }

    /// Share `sh` gives `slot` back.
    pub(super) fn release(&self, sh: Share, slot: u32, s: &dyn Server) {
        occupancy::clear(&self.bits, slot);
        let mut woken = Seats::default();
        s.lock(&mut |l| {
            l.fair().released(sh.digest, 1);
            if l.clock.waiting > 0 {
                let (seats, widest) = l.seats();
                woken = self.line.reorder(&seats, widest, &self.bits);
            }
        });
        s.wake(&woken);
        s.wake(&self.line.released(&self.waiters, &self.bits));
    }
}
