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
        let ticket = self.tail.fetch_add(1, SeqCst);
        let w = record(ticket);
        // Seated (and its n in the widest) before the count shows it: a call that sees the
        // count sees its n.
        let before = waiters.0.load(SeqCst) as usize;
        self.front.join(before, w);
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
