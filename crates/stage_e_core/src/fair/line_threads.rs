//! The fair line ([`super::line`]) with threads for backends: park for the latch, a mutex for
//! the queue lock, and an observer that counts what each share holds.

use super::line::{Line, Locked, Server};
use super::model::share;
use super::*;
use crate::front::Seats;
use crate::occupancy;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

struct Cap {
    line: Line,
    locked: Mutex<Locked>,
    latches: Mutex<Vec<Option<std::thread::Thread>>>,
    /// Slots each share holds, counted by the holders themselves (the observer).
    held: Vec<AtomicU32>,
    most_held: Vec<AtomicU32>,
    took: Vec<AtomicUsize>,
    /// Parks of 2 s that nobody ended: lost wake-ups.
    lost: AtomicUsize,
}

fn cap(n: u32, threads: usize) -> Arc<Cap> {
    let counters = || (0..4).map(|_| AtomicU32::new(0)).collect();
    Arc::new(Cap {
        line: Line::new(n),
        locked: Mutex::new(Locked::new(8)),
        latches: Mutex::new(vec![None; threads + 1]),
        held: counters(),
        most_held: counters(),
        took: (0..4).map(|_| AtomicUsize::new(0)).collect(),
        lost: AtomicUsize::new(0),
    })
}

impl Server for Cap {
    fn lock(&self, f: &mut dyn FnMut(&mut Locked)) {
        f(&mut self.locked.lock().unwrap())
    }

    fn park(&self) {
        let before = Instant::now();
        std::thread::park_timeout(Duration::from_secs(2));
        if before.elapsed() >= Duration::from_secs(2) {
            self.lost.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn wake(&self, seats: &Seats) {
        let latches = self.latches.lock().unwrap();
        for s in seats.iter() {
            if let Some(t) = &latches[s.process] {
                t.unpark();
            }
        }
    }
}

impl Cap {
    /// A call of `sh` as thread `me`: None does not wait, Some waits at most that long.
    fn acquire(&self, me: usize, sh: Share, patience: Option<Duration>) -> Option<u32> {
        let deadline = Instant::now() + patience.unwrap_or_default();
        let gives_up = || Instant::now() >= deadline;
        let slot = self
            .line
            .acquire(me, sh, patience.is_some(), &gives_up, self)?;
        let i = sh.digest as usize;
        let now = self.held[i].fetch_add(1, Ordering::SeqCst) + 1;
        self.most_held[i].fetch_max(now, Ordering::SeqCst);
        self.took[i].fetch_add(1, Ordering::Relaxed);
        Some(slot)
    }

    fn release(&self, sh: Share, slot: u32) {
        self.held[sh.digest as usize].fetch_sub(1, Ordering::SeqCst);
        self.line.release(sh, slot, self);
    }
}

/// A share at its ceiling has a waiter and the cap a free slot: the waiter has no seat (it
/// may not take). When its share gives a slot back, the release seats it and wakes it.
#[test]
fn a_release_under_the_ceiling_seats_and_wakes_the_shares_waiter() {
    let c = cap(2, 2);
    let sh = share(3, 1, 1);
    let slot = c.acquire(1, sh, None).expect("a free cap");
    let waiter = {
        let c = c.clone();
        std::thread::spawn(move || {
            c.latches.lock().unwrap()[2] = Some(std::thread::current());
            c.acquire(2, sh, Some(Duration::from_secs(3)))
        })
    };
    while c.line.waiters.count() == 0 {
        std::thread::yield_now();
    }
    assert!(
        c.line.line.front().read().is_empty(),
        "at its ceiling: no seat"
    );
    assert_eq!(occupancy::free_below(&c.line.bits, 2), 1);
    c.release(sh, slot);
    let got = waiter.join().unwrap();
    assert_eq!(c.lost.load(Ordering::Relaxed), 0, "the release woke nobody");
    c.release(sh, got.expect("served"));
}

/// Shares 1, 2 and 3 (weights 1, 2, 3; share 3 at most one slot) on a cap of two slots, two
/// threads each, take, hold, give back, many times over: some calls do not wait, some give up
/// at once. No wake-up is lost, no share holds over its ceiling, and at the end the line, the
/// slots and the fair queue are all empty.
#[test]
fn threads_through_the_fair_line_lose_no_wake_up_and_keep_the_ceilings() {
    const ROUNDS: usize = 400;
    let shares = [
        share(1, 1, NO_CEILING),
        share(2, 2, NO_CEILING),
        share(3, 3, 1),
    ];
    let threads = 6;
    let cap = cap(2, threads);
    let waited = Arc::new(AtomicUsize::new(0));
    // Every thread starts its rounds together: started one after the other, a thread could
    // run all its rounds alone (the cap without waiters) before the next one began.
    let start = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (1..=threads)
        .map(|me| {
            let (cap, waited, start) = (cap.clone(), waited.clone(), start.clone());
            let sh = shares[(me - 1) % shares.len()];
            std::thread::spawn(move || {
                cap.latches.lock().unwrap()[me] = Some(std::thread::current());
                start.wait();
                // The rounds go on (up to ten times as many) until the cap has had waiters:
                // on a loaded machine the threads may still have run mostly one at a time.
                for round in 0..ROUNDS * 10 {
                    if round >= ROUNDS && waited.load(Ordering::Relaxed) > 100 {
                        break;
                    }
                    let patience = match round % 10 {
                        0 => None,
                        1 => Some(Duration::ZERO),
                        _ => Some(Duration::from_secs(30)),
                    };
                    if let Some(slot) = cap.acquire(me, sh, patience) {
                        if cap.line.waiters.count() > 0 {
                            waited.fetch_add(1, Ordering::Relaxed);
                        }
                        if round % 3 == 0 {
                            std::thread::yield_now();
                        }
                        cap.release(sh, slot);
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(cap.lost.load(Ordering::Relaxed), 0, "a wake-up was lost");
    assert!(waited.load(Ordering::Relaxed) > 100, "the cap had waiters");
    assert_eq!(
        cap.most_held[3].load(Ordering::SeqCst),
        1,
        "share 3 over its ceiling"
    );
    for s in 1..=3 {
        assert!(
            cap.took[s].load(Ordering::Relaxed) > 0,
            "share {s} was served"
        );
    }
    assert_eq!(cap.line.waiters.count(), 0);
    let front = cap.line.line.front();
    assert!(front.read().is_empty() && front.widest() == 0);
    assert_eq!(cap.line.bits[0].load(Ordering::SeqCst), 0);
    let mut l = cap.locked.lock().unwrap();
    assert!(l.queue.is_empty());
    let f = l.fair();
    assert_eq!((f.live(), f.waiting(), f.virtual_time()), (0, 0, 0));
}
