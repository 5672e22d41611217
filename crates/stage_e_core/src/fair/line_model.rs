//! Model checks of the fair line ([`super::line`]): a waiter that sleeps is always woken (a
//! lost wake-up leaves every thread parked, which loom reports as a deadlock), whether its
//! slot frees under it or its share falls back under its ceiling.

use super::line::{Line, Locked, Server};
use super::*;
use crate::front::Seats;
use crate::sync::{Ordering, SpinLock};
use loom::sync::Arc;
use loom::thread;

struct Cap {
    line: Line,
    locked: SpinLock<Locked>,
    /// Process i's latch (its thread), registered before it queues.
    latches: std::sync::Mutex<Vec<Option<thread::Thread>>>,
}

impl Server for Cap {
    fn lock(&self, f: &mut dyn FnMut(&mut Locked)) {
        self.locked.with(|l| f(l))
    }

    fn park(&self) {
        thread::park();
    }

    fn wake(&self, seats: &Seats) {
        let latches = self.latches.lock().unwrap();
        for s in seats.iter() {
            latches[s.process].as_ref().expect("registered").unpark();
        }
    }
}

fn sh(digest: u64, ceiling: u32) -> Share {
    Share {
        digest,
        weight: digest as u32,
        ceiling,
    }
}

/// A cap of `n` slots whose slot 0 share `holder` holds.
fn cap(n: u32, holder: Share) -> Arc<Cap> {
    let c = Cap {
        line: Line::new(n),
        locked: SpinLock::new(Locked::new(4)),
        latches: std::sync::Mutex::new(vec![None; 3]),
    };
    assert_eq!(c.line.acquire(0, holder, false, &|| false, &c), Some(0));
    Arc::new(c)
}

/// Process `me` of share `s` waits for a slot, holds it, gives it back.
fn waiter(c: Arc<Cap>, me: usize, s: Share) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        c.latches.lock().unwrap()[me] = Some(thread::current());
        let slot = c.line.acquire(me, s, true, &|| false, &*c).expect("waits");
        c.line.release(s, slot, &*c);
    })
}

fn idle(c: &Cap) {
    assert_eq!(c.line.waiters.count(), 0);
    assert_eq!(c.line.bits[0].load(Ordering::Relaxed), 0);
    c.locked.with(|l| {
        let f = l.fair();
        assert_eq!((f.live(), f.waiting()), (0, 0));
    });
}

/// The holder of the one slot (a share of its own) has queued for another slot with a second
/// share (the waiter it is before its release); a waiter of a third share queues meanwhile;
/// then the holder gives the slot back and waits for its turn. Both waiters get the slot, in
/// the order of the fair queue, whatever the interleaving.
#[test]
fn no_wake_up_is_lost_between_a_release_and_two_shares_waiters() {
    crate::sync::model(|| {
        let holder = sh(3, NO_CEILING);
        let c = cap(1, holder);
        c.latches.lock().unwrap()[2] = Some(thread::current());
        let mine = sh(2, NO_CEILING);
        let ticket = c.line.take_or_join(2, mine, true, &*c).expect_err("queued");
        let other = waiter(c.clone(), 1, sh(1, NO_CEILING));
        c.line.release(holder, 0, &*c);
        let slot = c.line.wait(ticket, mine, &|| false, &*c).expect("waits");
        c.line.release(mine, slot, &*c);
        other.join().unwrap();
        idle(&c);
    });
}

/// A share at its ceiling of one holds slot 0 of two; its waiter queues while it gives the
/// slot back: the waiter is seated and woken by the release, or finds itself under the
/// ceiling when it joins.
#[test]
fn no_wake_up_is_lost_when_a_share_falls_back_under_its_ceiling() {
    crate::sync::model(|| {
        let s = sh(1, 1);
        let c = cap(2, s);
        let w = waiter(c.clone(), 1, s);
        c.line.release(s, 0, &*c);
        w.join().unwrap();
        idle(&c);
    });
}
