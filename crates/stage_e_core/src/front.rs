//! The front of a cap's queue of waiters: the first [`FRONT`] waiters in ticket order, the only
//! ones that take slots.
//!
//! A seated waiter takes slots only while the free slots cover its k and the k of every seat
//! ahead of it ([`crate::occupancy::covered_front`]), so waiters are served in arrival order, a
//! waiter asking for k slots at the head is not overtaken, and slots freed together serve
//! several waiters at once. Seats change under the caller's queue lock (joining, leaving); the
//! release path reads them without it.
//!
//! **No wake-up is lost.** A releaser clears its bit and then reads the seats ([`Front::to_wake`]);
//! a waiter is seated and then reads the bits ([`Front::may_take`]); a seat change is published
//! before the bits are read to wake the covered seats. All SeqCst, so of each pair one sees the
//! other. A torn read of seats being moved can only wake someone in vain, or miss someone whom
//! the mover then wakes. A process is named by a nonzero `usize` (the server stores a PGPROC's
//! address); 0 is an empty seat.

use crate::occupancy;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::SeqCst};

/// How many waiters at the front of a cap's queue may take slots at the same time.
pub const FRONT: usize = 4;

/// A waiter as the front knows it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Seated {
    /// Nonzero: who to wake.
    pub process: usize,
    pub ticket: u64,
    pub n: u32,
    pub k: u32,
}

#[repr(C)]
#[derive(Default)]
struct Seat {
    process: AtomicUsize,
    ticket: AtomicU64,
    n: AtomicU32,
    k: AtomicU32,
}

/// The seats of one cap (zeroed memory: all empty).
#[repr(C)]
#[derive(Default)]
pub struct Front([Seat; FRONT]);

/// Up to [`FRONT`] seated waiters, head first, without an allocation.
#[derive(Clone, Copy, Default)]
pub struct Seats {
    seated: [Seated; FRONT],
    len: usize,
}

impl std::ops::Deref for Seats {
    type Target = [Seated];
    fn deref(&self) -> &[Seated] {
        &self.seated[..self.len]
    }
}

impl Front {
    /// Publishes `w` in seat `i`: its process last, so a reader that sees the process sees what
    /// it asks for.
    fn fill(&self, i: usize, w: Seated) {
        let seat = &self.0[i];
        seat.ticket.store(w.ticket, SeqCst);
        seat.n.store(w.n, SeqCst);
        seat.k.store(w.k, SeqCst);
        seat.process.store(w.process, SeqCst);
    }

    /// Seats a newcomer after `before` waiters (queue lock held): the seats hold the first
    /// min(waiters, FRONT) of them, so its seat, if any, is the next one.
    pub fn join(&self, before: usize, w: Seated) {
        if before < FRONT {
            self.fill(before, w);
        }
    }

    /// After a seated waiter left (queue lock held): seats the first [`FRONT`] of `queue`, the
    /// waiters still queued, in ticket order.
    pub fn reseat(&self, queue: &[Seated]) {
        for i in 0..FRONT {
            match queue.get(i) {
                Some(&w) => self.fill(i, w),
                None => self.0[i].process.store(0, SeqCst),
            }
        }
    }

    /// The occupied seats, head first.
    pub fn read(&self) -> Seats {
        let mut out = Seats::default();
        for seat in &self.0 {
            let process = seat.process.load(SeqCst);
            if process == 0 {
                break;
            }
            out.seated[out.len] = Seated {
                process,
                ticket: seat.ticket.load(SeqCst),
                n: seat.n.load(SeqCst),
                k: seat.k.load(SeqCst),
            };
            out.len += 1;
        }
        out
    }

    /// Whether ticket `ticket` is seated.
    pub fn holds(&self, ticket: u64) -> bool {
        self.read().iter().any(|s| s.ticket == ticket)
    }

    /// Whether the waiter with `ticket` is seated and the free slots of `bits` cover it and
    /// every seat ahead of it (who may be taking at this moment).
    pub fn may_take(&self, ticket: u64, bits: &[AtomicU64]) -> bool {
        let seats = self.read();
        let Some(place) = seats.iter().position(|s| s.ticket == ticket) else {
            return false;
        };
        covered(&seats[..=place], bits) > place
    }

    /// Who to wake after slots of `bits` were freed (or a seat changed): the seats the free
    /// slots cover and, with `head`, the head in any case (a release wakes it, as PostgreSQL's
    /// lock manager would). Returns their processes.
    pub fn to_wake(&self, bits: &[AtomicU64], head: bool) -> Seats {
        let mut seats = self.read();
        let covered = covered(&seats, bits);
        seats.len = if head {
            covered.max(seats.len.min(1))
        } else {
            covered
        };
        seats
    }
}

fn covered(seats: &[Seated], bits: &[AtomicU64]) -> usize {
    let mut asks = [(0u32, 0u32); FRONT];
    for (a, s) in asks.iter_mut().zip(seats) {
        *a = (s.n, s.k);
    }
    occupancy::covered_front(&asks[..seats.len()], |n| occupancy::free_below(bits, n))
}

#[cfg(test)]
mod unit {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    fn w(process: usize, ticket: u64, n: u32, k: u32) -> Seated {
        Seated {
            process,
            ticket,
            n,
            k,
        }
    }

    #[test]
    fn newcomers_fill_the_seats_in_order_and_leavers_move_them_up() {
        let f = Front::default();
        for t in 0..6u64 {
            f.join(t as usize, w(t as usize + 1, t, 4, 1));
        }
        assert_eq!(
            f.read().iter().map(|s| s.ticket).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        // Ticket 1 leaves: 2, 3 move up, 4 is seated.
        f.reseat(&[w(1, 0, 4, 1), w(3, 2, 4, 1), w(4, 3, 4, 1), w(5, 4, 4, 1)]);
        assert_eq!(
            f.read().iter().map(|s| s.ticket).collect::<Vec<_>>(),
            [0, 2, 3, 4]
        );
        f.reseat(&[w(5, 4, 4, 1)]);
        assert_eq!(f.read().len(), 1);
        f.reseat(&[]);
        assert!(f.read().is_empty() && !f.holds(4));
    }

    #[test]
    fn only_covered_seats_take_and_are_woken() {
        let bits: Vec<AtomicU64> = vec![AtomicU64::new(0b1111)]; // n = 4, all taken
        let f = Front::default();
        f.join(0, w(10, 0, 4, 2)); // head wants 2
        f.join(1, w(11, 1, 4, 1));
        assert!(!f.may_take(0, &bits) && !f.may_take(1, &bits));
        assert_eq!(f.to_wake(&bits, false).len(), 0);
        assert_eq!(
            f.to_wake(&bits, true)
                .iter()
                .map(|s| s.process)
                .collect::<Vec<_>>(),
            [10]
        );
        occupancy::clear(&bits, 0); // one free: the head (k = 2) is not covered, nor the second
        assert!(
            !f.may_take(0, &bits) && !f.may_take(1, &bits),
            "no overtaking the head"
        );
        occupancy::clear(&bits, 1);
        assert!(f.may_take(0, &bits) && !f.may_take(1, &bits));
        occupancy::clear(&bits, 2);
        assert!(f.may_take(1, &bits));
        assert_eq!(f.to_wake(&bits, false).len(), 2);
        assert!(!f.may_take(7, &bits), "not seated");
    }

    /// Waiters queue (under a "waits lock"), are seated, take a slot when covered, hold it a
    /// moment and free it; every release and every leave wakes whom the front says. A waiter
    /// sleeps on its own parking token (a latch) with a long timeout: a lost wake-up shows as
    /// a timeout, and the test requires none, with more waiters than seats and than slots.
    #[test]
    fn no_wake_up_is_lost_between_releases_and_the_queue() {
        const N: u32 = 3;
        const WAITERS: usize = 10;
        const ROUNDS: usize = 150;
        struct Queue {
            waiting: Vec<Seated>,
            tail: u64,
        }
        let bits: Arc<Vec<AtomicU64>> = Arc::new(vec![AtomicU64::new(0)]);
        let front = Arc::new(Front::default());
        let queue = Arc::new(Mutex::new(Queue {
            waiting: Vec::new(),
            tail: 0,
        }));
        let threads: Arc<Mutex<Vec<Option<std::thread::Thread>>>> =
            Arc::new(Mutex::new(vec![None; WAITERS + 1]));
        let timeouts = Arc::new(AtomicUsize::new(0));
        let served = Arc::new(AtomicUsize::new(0));
        let wake = {
            let threads = threads.clone();
            move |seats: &[Seated]| {
                let t = threads.lock().unwrap();
                for s in seats {
                    if let Some(th) = &t[s.process] {
                        th.unpark();
                    }
                }
            }
        };
        let handles: Vec<_> = (1..=WAITERS)
            .map(|me| {
                let (bits, front, queue, threads, timeouts, served, wake) = (
                    bits.clone(),
                    front.clone(),
                    queue.clone(),
                    threads.clone(),
                    timeouts.clone(),
                    served.clone(),
                    wake.clone(),
                );
                std::thread::spawn(move || {
                    threads.lock().unwrap()[me] = Some(std::thread::current());
                    for _ in 0..ROUNDS {
                        let ticket = {
                            let mut q = queue.lock().unwrap();
                            let t = q.tail;
                            q.tail += 1;
                            let seat = w(me, t, N, 1);
                            front.join(q.waiting.len(), seat);
                            q.waiting.push(seat);
                            t
                        };
                        loop {
                            if front.may_take(ticket, &bits) {
                                if let Some(claim) = occupancy::claim_first_free(&bits, 0, N) {
                                    let slot = claim.keep();
                                    {
                                        let mut q = queue.lock().unwrap();
                                        let seated = front.holds(ticket);
                                        q.waiting.retain(|s| s.ticket != ticket);
                                        if seated {
                                            front.reseat(&q.waiting);
                                            wake(&front.to_wake(&bits, false));
                                        }
                                    }
                                    served.fetch_add(1, Ordering::Relaxed);
                                    std::thread::yield_now();
                                    occupancy::clear(&bits, slot);
                                    wake(&front.to_wake(&bits, true));
                                    break;
                                }
                            }
                            let before = std::time::Instant::now();
                            std::thread::park_timeout(Duration::from_secs(2));
                            if before.elapsed() >= Duration::from_secs(2) {
                                timeouts.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(served.load(Ordering::Relaxed), WAITERS * ROUNDS);
        assert_eq!(timeouts.load(Ordering::Relaxed), 0, "a wake-up was lost");
        assert_eq!(bits[0].load(Ordering::Relaxed), 0);
        assert!(front.read().is_empty());
    }

    use std::sync::atomic::Ordering;
}
