//! A cap's queue of waiters: its count ([`Waiters`]), its next ticket and its front seats
//! ([`WaitLine`]), and the steps by which waiters join and leave and releases wake them.
//!
//! **Who writes.** Joining and leaving run under the caller's queue lock (the extension's waits
//! LWLock, which also guards its list of waiter records): they take a ticket, seat the waiter,
//! count it, or uncount it and reseat the others ([`Front::join`], [`Front::reseat`]). Nothing
//! else writes the count, the tail or the seats. Every call reads the count; waiters and the
//! release path read the seats without the lock, through the front's seqlock.
//!
//! **No lost wake-up.** A waiter sleeps on its latch (sticky: a wake between its check and its
//! sleep is not lost) after this order of steps: seated, counted ([`WaitLine::join`]), then it
//! reads the bits ([`WaitLine::may_take`]) and sleeps only if it may not take. A releaser
//! clears its bits (`occupancy::clear`, SeqCst), then reads the count and, if nonzero, the seats
//! and the bits, and sets the latches of the head and of every seat that may take
//! ([`WaitLine::released`]). A waiter that leaves its seat (served, or timed out) reseats the
//! others, then reads the bits and wakes the seats that may take now ([`WaitLine::leave`]).
//! Each is a Dekker pair, one store then one load of another location on each side: the
//! waiter's count (SeqCst RMW) then bits (SeqCst load), against the releaser's bits (SeqCst RMW)
//! then count and seats (SeqCst loads); the leaver's seats (SeqCst stores) then bits, against
//! the releaser's bits then seats. SeqCst's single total order makes one side of each pair see
//! the other: the releaser sees the waiter seated and wakes it, or the waiter (the leaver) sees
//! the bit clear and takes (wakes). With Acquire/Release alone both sides may read the old
//! values and the waiter sleeps with a free slot nobody wakes it for. (Under loom the pairs get
//! the SeqCst fence `sync::seqcst_pair` that stands for that order: loom models SeqCst accesses
//! as AcqRel.)
//!
//! **Seen counts.** A call that reads the count (SeqCst) nonzero synchronizes with the joining
//! `fetch_add`, which follows the waiter's seat and its n in `widest`: so such a call sees them.

use crate::front::{Front, Seated, Seats};
use crate::sync::{seqcst_pair, AtomicU32, AtomicU64, Ordering::SeqCst};

/// How many waiters a cap has (zeroed memory: none). Every call reads it, so the extension keeps
/// it in its entry's first line, apart from the [`WaitLine`].
#[repr(transparent)]
#[derive(Default)]
pub struct Waiters(AtomicU32);

impl Waiters {
    pub fn count(&self) -> u32 {
        self.0.load(SeqCst)
    }
}

/// The next ticket of a cap's queue and its front seats (zeroed memory: empty).
#[repr(C)]
#[derive(Default)]
pub struct WaitLine {
    tail: AtomicU64,
    front: Front,
}

impl WaitLine {
    /// The front seats (to read them, `widest`).
    pub fn front(&self) -> &Front {
        &self.front
    }

    /// Under the queue lock: takes the next ticket, gives it to `record` (which writes the
    /// caller's waiter record and returns the seat), seats the waiter if one of the first
    /// [`crate::front::FRONT`], and counts it. The waiter must then check
    /// [`WaitLine::may_take`] before it sleeps.
    pub fn join(&self, waiters: &Waiters, record: impl FnOnce(u64) -> Seated) -> u64 {
        self.enter(waiters, |ticket, front| {
            let before = waiters.0.load(SeqCst) as usize;
            front.join(before, record(ticket));
        })
    }

    /// Takes the next ticket, runs `seat` (the caller's record written and the front changed
    /// for it), then counts the waiter: seated (and its n in the widest) before the count
    /// shows it, so that a call that sees the count sees its n.
    fn enter(&self, waiters: &Waiters, seat: impl FnOnce(u64, &Front)) -> u64 {
        let ticket = self.tail.fetch_add(1, SeqCst);
        seat(ticket, &self.front);
        waiters.0.fetch_add(1, SeqCst);
        seqcst_pair(); // counted, then the caller reads the bits
        ticket
    }

    /// Under the queue lock, the caller's record already gone from `queue` (the waiters still
    /// queued on this cap, in any order): the waiter with `ticket`, asking for slots of
    /// `[0, n)`, leaves. If it had a seat the seats behind it move up and the next waiter is
    /// seated; the widest n is taken again if it may have been this one's. Returns the seats
    /// to wake: those that may take now, if it had a seat (the release that frees the others'
    /// slots wakes them: waking in vain would cost every hand-off a context switch).
    pub fn leave(
        &self,
        waiters: &Waiters,
        ticket: u64,
        n: u32,
        queue: impl IntoIterator<Item = Seated>,
        bits: &[AtomicU64],
    ) -> Seats {
        waiters.0.fetch_sub(1, SeqCst);
        let seated = self.front.holds(ticket);
        if !seated && n < self.front.widest() {
            return Seats::default(); // neither the seats nor the widest n change
        }
        self.front.reseat(queue);
        if !seated {
            return Seats::default();
        }
        seqcst_pair(); // reseated, then the bits
        self.front.to_wake(bits, false)
    }

    /// A cap with shares (`fair`), under the queue lock: as [`WaitLine::join`], but `record`
    /// (which writes the caller's waiter record and enters it in the cap's fair queue) returns
    /// the front in the order of service (`fair::Fair::order`) and the widest n of the queue,
    /// which are seated before the count shows the waiter; or None when they stand as they are
    /// (the waiter comes after every seat, and its n is within the widest). The waiter must
    /// then check [`WaitLine::may_take`] before it sleeps.
    pub fn join_in_order(
        &self,
        waiters: &Waiters,
        record: impl FnOnce(u64) -> Option<(Seats, u32)>,
    ) -> u64 {
        self.enter(waiters, |ticket, front| {
            if let Some((order, widest)) = record(ticket) {
                front.seat_in_order(&order, widest);
            }
        })
    }

    /// A cap with shares, under the queue lock, after a waiter left its fair queue (served or
    /// not): uncounts it and seats `order` (the waiters still queued, in the order of service).
    /// Returns the seats to wake: those that may take now. Unlike [`WaitLine::leave`] this
    /// reseats whether or not the leaver had a seat: who is served next depends on every
    /// share's head and ceiling, not on the tickets alone.
    pub fn leave_in_order(
        &self,
        waiters: &Waiters,
        order: &Seats,
        widest: u32,
        bits: &[AtomicU64],
    ) -> Seats {
        waiters.0.fetch_sub(1, SeqCst);
        self.reorder(order, widest, bits)
    }

    /// A cap with shares, under the queue lock, when the order of service changed with no
    /// waiter joining or leaving (a share at its ceiling gave slots back, so its head competes
    /// again): seats `order` and returns the seats that may take now.
    pub fn reorder(&self, order: &Seats, widest: u32, bits: &[AtomicU64]) -> Seats {
        self.front.seat_in_order(order, widest);
        seqcst_pair(); // reseated, then the bits
        self.front.to_wake(bits, false)
    }

    /// Where the waiter holding `ticket` may take its slots now, from which slot up: None
    /// unless it is seated and the free slots serve it ([`crate::front::plans`]).
    pub fn may_take(&self, ticket: u64, bits: &[AtomicU64]) -> Option<u32> {
        self.front.may_take(ticket, bits)
    }

    /// Where a call that is not queued may take `k` slots of `[0, n)` while the cap has
    /// waiters ([`Front::newcomer`]).
    pub fn newcomer(&self, n: u32, k: u32, bits: &[AtomicU64]) -> Option<u32> {
        self.front.newcomer(n, k, bits)
    }

    /// After slots were freed (their bits cleared): the seats to wake, the head and every seat
    /// that may take now; none if the cap has no waiters.
    pub fn released(&self, waiters: &Waiters, bits: &[AtomicU64]) -> Seats {
        seqcst_pair(); // the bits cleared, then the count and the seats
        if waiters.count() == 0 {
            return Seats::default();
        }
        self.front.to_wake(bits, true)
    }
}

/// The waiter's and the releaser's steps as the extension runs them (`slots::waiting`,
/// `shmem::waitq`), over `Q` (the queue lock and its list of waiter records), `park` (sleep on
/// the latch) and `wake` (set latches). For the tests.
#[cfg(test)]
mod run {
    use super::*;
    use crate::occupancy;

    /// Runs its argument under the queue lock with the list of queued seats.
    pub(super) type Locked<'a> = &'a dyn Fn(&mut dyn FnMut(&mut Vec<Seated>));

    /// What the server supplies: the queue lock, sleeping on the latch, setting latches.
    pub(super) struct Server<'a> {
        pub(super) lock: Locked<'a>,
        pub(super) park: &'a dyn Fn(),
        pub(super) wake: &'a dyn Fn(&Seats),
    }

    /// Waits in `line` for one slot of `[0, n)` as process `me`, holds it, gives it back.
    pub(super) fn wait_take_release(
        line: &WaitLine,
        waiters: &Waiters,
        bits: &[AtomicU64],
        me: usize,
        n: u32,
        server: Server,
    ) {
        let Server { lock, park, wake } = server;
        let mut ticket = 0;
        lock(&mut |q| {
            ticket = line.join(waiters, |t| {
                let s = Seated {
                    process: me,
                    ticket: t,
                    n,
                    k: 1,
                };
                q.push(s);
                s
            })
        });
        loop {
            let slot = line
                .may_take(ticket, bits)
                .and_then(|from| occupancy::claim_first_free(bits, from, n))
                .map(|c| c.keep());
            if let Some(slot) = slot {
                let mut woken = Seats::default();
                lock(&mut |q| {
                    q.retain(|s| s.ticket != ticket);
                    woken = line.leave(waiters, ticket, n, q.iter().copied(), bits);
                });
                wake(&woken);
                occupancy::clear(bits, slot);
                wake(&line.released(waiters, bits));
                return;
            }
            park();
        }
    }
}

/// Model checks: a waiter that sleeps is always woken (a lost wake-up leaves every thread
/// parked, which loom reports as a deadlock).
#[cfg(all(test, loom))]
mod model {
    use super::*;
    use crate::occupancy;
    use crate::sync::{Ordering, SpinLock as Lock};
    use loom::sync::Arc;
    use loom::thread;

    struct Cap {
        line: WaitLine,
        waiters: Waiters,
        /// One slot, held at the start by the releaser.
        bits: [AtomicU64; 1],
        queue: Lock<Vec<Seated>>,
        /// Process i's latch (its thread), registered before it queues.
        latches: std::sync::Mutex<Vec<Option<thread::Thread>>>,
    }

    fn cap() -> Arc<Cap> {
        Arc::new(Cap {
            line: WaitLine::default(),
            waiters: Waiters::default(),
            bits: [AtomicU64::new(1)],
            queue: Lock::new(Vec::new()),
            latches: std::sync::Mutex::new(vec![None; 3]),
        })
    }

    fn wake(c: &Cap, seats: &Seats) {
        let latches = c.latches.lock().unwrap();
        for s in seats.iter() {
            latches[s.process].as_ref().expect("registered").unpark();
        }
    }

    fn waiter(c: Arc<Cap>, me: usize) -> thread::JoinHandle<()> {
        thread::spawn(move || {
            c.latches.lock().unwrap()[me] = Some(thread::current());
            run::wait_take_release(
                &c.line,
                &c.waiters,
                &c.bits,
                me,
                1,
                run::Server {
                    lock: &|f| c.queue.with(|q| f(q)),
                    park: &thread::park,
                    wake: &|s| wake(&c, s),
                },
            );
        })
    }

    /// Two waiters queue for the one slot while its holder releases it: both get it in turn.
    #[test]
    fn no_wake_up_is_lost_between_a_release_and_two_waiters() {
        crate::sync::model(|| {
            let c = cap();
            let ws = [waiter(c.clone(), 1), waiter(c.clone(), 2)];
            occupancy::clear(&c.bits, 0);
            wake(&c, &c.line.released(&c.waiters, &c.bits));
            for w in ws {
                w.join().unwrap();
            }
            assert_eq!(c.waiters.count(), 0);
            assert_eq!(c.bits[0].load(Ordering::Relaxed), 0);
        });
    }

    /// The head leaves (it timed out) while the holder releases: the waiter behind it, now the
    /// head, is woken by one or the other.
    #[test]
    fn no_wake_up_is_lost_when_the_head_leaves_during_a_release() {
        crate::sync::model(|| {
            let c = cap();
            c.latches.lock().unwrap()[1] = Some(thread::current());
            let ticket = c.queue.with(|q| {
                c.line.join(&c.waiters, |t| {
                    let s = Seated {
                        process: 1,
                        ticket: t,
                        n: 1,
                        k: 1,
                    };
                    q.push(s);
                    s
                })
            });
            let behind = waiter(c.clone(), 2);
            let releaser = {
                let c = c.clone();
                thread::spawn(move || {
                    occupancy::clear(&c.bits, 0);
                    wake(&c, &c.line.released(&c.waiters, &c.bits));
                })
            };
            // Timed out: leaves without taking.
            let woken = c.queue.with(|q| {
                q.retain(|s| s.ticket != ticket);
                c.line
                    .leave(&c.waiters, ticket, 1, q.iter().copied(), &c.bits)
            });
            wake(&c, &woken);
            releaser.join().unwrap();
            behind.join().unwrap();
            assert_eq!(c.waiters.count(), 0);
        });
    }
}

#[cfg(all(test, not(loom)))]
mod unit {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// Waiters on a cap of two slots queue, take one, give it back, many times over, each
    /// sleeping on its own latch (park) with a long timeout: a lost wake-up shows as a
    /// timeout, and none may happen. At the end the queue is empty and the slots free.
    #[test]
    fn waiters_through_the_line_lose_no_wake_up_with_threads() {
        const WAITERS: usize = 6;
        const ROUNDS: usize = 300;
        let line = Arc::new((WaitLine::default(), Waiters::default()));
        let bits: Arc<Vec<AtomicU64>> = Arc::new(vec![AtomicU64::new(0)]);
        let queue: Arc<Mutex<Vec<Seated>>> = Arc::default();
        let latches: Arc<Mutex<Vec<Option<std::thread::Thread>>>> =
            Arc::new(Mutex::new(vec![None; WAITERS + 1]));
        let timeouts = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (1..=WAITERS)
            .map(|me| {
                let (line, bits, queue, latches, timeouts) = (
                    line.clone(),
                    bits.clone(),
                    queue.clone(),
                    latches.clone(),
                    timeouts.clone(),
                );
                std::thread::spawn(move || {
                    latches.lock().unwrap()[me] = Some(std::thread::current());
                    let wake = |seats: &Seats| {
                        let l = latches.lock().unwrap();
                        for s in seats.iter() {
                            if let Some(t) = &l[s.process] {
                                t.unpark();
                            }
                        }
                    };
                    let park = || {
                        let before = std::time::Instant::now();
                        std::thread::park_timeout(Duration::from_secs(2));
                        if before.elapsed() >= Duration::from_secs(2) {
                            timeouts.fetch_add(1, Ordering::Relaxed);
                        }
                    };
                    for _ in 0..ROUNDS {
                        run::wait_take_release(
                            &line.0,
                            &line.1,
                            &bits,
                            me,
                            2,
                            run::Server {
                                lock: &|f| f(&mut queue.lock().unwrap()),
                                park: &park,
                                wake: &wake,
                            },
                        );
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(timeouts.load(Ordering::Relaxed), 0, "a wake-up was lost");
        assert_eq!(line.1.count(), 0);
        assert!(line.0.front().read().is_empty() && line.0.front().widest() == 0);
        assert_eq!(bits[0].load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_release_with_no_waiters_wakes_nobody_and_a_leaving_head_wakes_the_next() {
        let (line, waiters) = (WaitLine::default(), Waiters::default());
        let bits = [AtomicU64::new(0b1)];
        assert!(line.released(&waiters, &bits).is_empty());
        let seat = |process, ticket| Seated {
            process,
            ticket,
            n: 1,
            k: 1,
        };
        let a = line.join(&waiters, |t| seat(1, t));
        let b = line.join(&waiters, |t| seat(2, t));
        assert_eq!((a, b, waiters.count()), (0, 1, 2));
        assert_eq!(line.may_take(a, &bits), None, "slot 0 is held");
        bits[0].store(0, Ordering::SeqCst);
        assert_eq!(line.may_take(a, &bits), Some(0));
        assert_eq!(line.may_take(b, &bits), None, "behind the head");
        let woken = line.released(&waiters, &bits);
        assert_eq!(woken.iter().map(|s| s.process).collect::<Vec<_>>(), [1]);
        // The head times out and leaves: the next is seated at the head and may take.
        let woken = line.leave(&waiters, a, 1, [seat(2, b)], &bits);
        assert_eq!(woken.iter().map(|s| s.process).collect::<Vec<_>>(), [2]);
        assert_eq!(line.may_take(b, &bits), Some(0));
        assert_eq!(line.newcomer(1, 1, &bits), None, "slot 0 is the waiter's");
        assert!(line.leave(&waiters, b, 1, [], &bits).is_empty());
        assert_eq!(waiters.count(), 0);
    }
}

// Layout, for the extension's cap entry: the count is a u32, the line a ticket and the seats.
#[cfg(not(all(test, loom)))]
const _: () = assert!(size_of::<Waiters>() == 4 && size_of::<WaitLine>() == 112);
