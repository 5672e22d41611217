//! The front of a cap's queue of waiters (the first [`FRONT`] waiters in ticket order, the only
//! ones that take slots), and where a call may take slots while the cap has waiters.
//!
//! **Who may take what.** Every call asks for k slots of `[0, n)` and claims the lowest free ones
//! from some slot up. While the cap has waiters a call takes only slots that no waiter ahead of
//! it could use, or slots the free ones leave over once everyone ahead is served:
//!
//! - A *newcomer* (a call not in the queue, whether it would wait or not) is behind every waiter.
//!   It takes only from [`Front::widest`] up, the largest n of all the waiters (seated or not):
//!   slots no waiter can take. So a try on n = 4 gets slots 1..3 while a waiter on n = 1 waits for
//!   slot 0, and a try on n = 1 is throttled as long as the waiter is there ([`Front::newcomer`]).
//! - A *seated waiter* takes from the largest n of the seats ahead of it up, if enough of those
//!   slots are free: the waiters ahead cannot use them, so it overtakes nobody it competes with.
//!   It may also take lowest-first from slot 0 while the free slots cover it and every seat
//!   ahead of it ([`crate::occupancy::covered_front`]) and every seat ahead asks for its n:
//!   then enough is left for all of them, so slots freed together serve several waiters at once
//!   (across different n, claims in any order could leave one of them with nothing). A head asking for k slots is not
//!   overtaken: nobody behind it takes below its n until it is served ([`plans`]).
//!
//! So a waiter gets its slots from the very next releases it can use, FIFO among the waiters
//! that could use the same slots, whatever the traffic of tries: nothing that arrived after it
//! takes a slot of its range, unless enough free ones are left for it and everyone ahead.
//!
//! **Seats** change under the caller's queue lock (joining, leaving); the release path and the
//! waiters read them without it, through a seqlock (`version`, odd while seats are written), so
//! a reader never acts on a torn front. The widest n is written under the queue lock too and
//! read alone.
//!
//! **No wake-up is lost.** A releaser clears its bit and then reads the seats ([`Front::to_wake`]);
//! a waiter is seated and then reads the bits ([`Front::may_take`]); a seat change is published
//! before the bits are read to wake the seats that may now take. All SeqCst, so of each pair one
//! sees the other. A process is named by a nonzero `usize` (the server stores a PGPROC's
//! address); 0 is an empty seat.

use crate::occupancy;
use crate::sync::{spin_loop, yield_now, AtomicU32, AtomicU64, AtomicUsize, Ordering::SeqCst};

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

/// The seats of one cap, and the widest n of its whole queue (zeroed memory: all empty).
#[repr(C)]
#[derive(Default)]
pub struct Front {
    seats: [Seat; FRONT],
    /// Bumped before and after each change of the seats: odd while one is being written.
    version: AtomicU32,
    /// The largest n of the queued waiters, seated or not (0: none).
    widest: AtomicU32,
}

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

impl Seats {
    fn push(&mut self, s: Seated) {
        self.seated[self.len] = s;
        self.len += 1;
    }
}

/// The first [`FRONT`] of an order of waiters (a cap with shares: `fair::Fair::order`).
impl FromIterator<Seated> for Seats {
    fn from_iter<I: IntoIterator<Item = Seated>>(order: I) -> Self {
        let mut out = Seats::default();
        for s in order.into_iter().take(FRONT) {
            out.push(s);
        }
        out
    }
}

/// Where each seat of `seats` (head first) may take its slots now: `Some(from)`, claiming the
/// lowest free slots from `from` up, or None (it waits). A seat takes from the largest n of the
/// seats ahead of it up when enough of those slots are free (none of them is any use to those
/// ahead), else from 0 while it is in the covered front (the free slots below the smallest n up
/// to it cover it and everyone ahead) and every seat ahead asks for the same n. The head's two
/// ways are one: from 0 while its k are free.
///
/// Why the same n: seats that take at once claim first-fit, in any order. On one range that
/// always works when the free slots cover them all; across ranges it does not (seats n = 4,
/// k = 2 and n = 2, k = 1 with slots 0..2 free: the first, claiming first, takes 0 and 1, and
/// the second finds nothing below 2). A covered seat of another n waits for those ahead to take
/// and leave, whose leaving wakes it.
pub fn plans(seats: &[Seated], bits: &[AtomicU64]) -> [Option<u32>; FRONT] {
    let mut out = [None; FRONT];
    let covered = covered(seats, bits);
    let mut floor = 0u32;
    // The n every seat so far asks for, None once two differ.
    let mut same_n = seats.first().map(|s| s.n);
    for (i, s) in seats.iter().enumerate().take(FRONT) {
        same_n = same_n.filter(|&n| n == s.n);
        if floor < s.n && occupancy::free_between(bits, floor, s.n) >= s.k {
            out[i] = Some(floor);
        } else if i < covered && same_n.is_some() {
            out[i] = Some(0);
        }
        floor = floor.max(s.n);
    }
    out
}

impl Front {
    /// Runs `write` on the seats as one change, for readers of the seqlock.
    fn change(&self, write: impl FnOnce(&[Seat; FRONT])) {
        self.version.fetch_add(1, SeqCst);
        write(&self.seats);
        self.version.fetch_add(1, SeqCst);
    }

    /// Publishes `w` in `seat`: its process last, so that a reader of the raw seats that sees
    /// the process sees what it asks for.
    fn fill(seat: &Seat, w: Seated) {
        seat.ticket.store(w.ticket, SeqCst);
        seat.n.store(w.n, SeqCst);
        seat.k.store(w.k, SeqCst);
        seat.process.store(w.process, SeqCst);
    }

    /// A newcomer joins after `before` waiters (queue lock held; before the waiter count
    /// shows it, so that a call that sees the count sees its n in [`Front::widest`]): the seats
    /// hold the first min(waiters, FRONT) of them, so its seat, if any, is the next one.
    pub fn join(&self, before: usize, w: Seated) {
        self.widest.fetch_max(w.n, SeqCst);
        if before < FRONT {
            self.change(|seats| Self::fill(&seats[before], w));
        }
    }

    /// After a waiter left (queue lock held): seats the first [`FRONT`] by ticket of `queue`,
    /// the waiters still queued (in any order), and takes the widest n from all of them. One
    /// pass, no allocation: the caller walks its list of waiters once.
    pub fn reseat(&self, queue: impl IntoIterator<Item = Seated>) {
        let mut first = Seats::default();
        let mut widest = 0;
        for w in queue {
            widest = widest.max(w.n);
            let at = first
                .iter()
                .position(|s| s.ticket > w.ticket)
                .unwrap_or(first.len);
            if at < FRONT {
                let kept = first.len.min(FRONT - 1);
                first.seated.copy_within(at..kept, at + 1);
                first.seated[at] = w;
                first.len = kept + 1;
            }
        }
        self.seat_in_order(&first, widest);
    }

    /// Queue lock held: seats `order` (head first) and sets the widest n of the whole queue.
    /// A cap with shares seats its waiters in the order they are to be served
    /// (`fair::Fair::order`), not by ticket; the rules of [`plans`] apply to that order.
    pub fn seat_in_order(&self, order: &Seats, widest: u32) {
        self.change(|seats| {
            for (i, seat) in seats.iter().enumerate() {
                match order.get(i) {
                    Some(&w) => Self::fill(seat, w),
                    None => seat.process.store(0, SeqCst),
                }
            }
        });
        self.widest.store(widest, SeqCst);
    }

    /// The largest n of the queued waiters (0: none): slots from here up are no waiter's.
    pub fn widest(&self) -> u32 {
        self.widest.load(SeqCst)
    }

    /// The seats as they are, torn if a change is under way.
    fn read_raw(&self) -> Seats {
        let mut out = Seats::default();
        for seat in &self.seats {
            let process = seat.process.load(SeqCst);
            if process == 0 {
                break;
            }
            out.push(Seated {
                process,
                ticket: seat.ticket.load(SeqCst),
                n: seat.n.load(SeqCst),
                k: seat.k.load(SeqCst),
            });
        }
        out
    }

    /// The occupied seats, head first, as of one moment (a change under way is waited out: it
    /// is a few stores under the queue lock).
    pub fn read(&self) -> Seats {
        let mut tries = 0u32;
        loop {
            let before = self.version.load(SeqCst);
            if before & 1 == 0 {
                let seats = self.read_raw();
                if self.version.load(SeqCst) == before {
                    return seats;
                }
            }
            tries += 1;
            if tries.is_multiple_of(64) {
                yield_now(); // the writer may have been preempted
            } else {
                spin_loop();
            }
        }
    }

    /// Whether ticket `ticket` is seated.
    pub fn holds(&self, ticket: u64) -> bool {
        self.read().iter().any(|s| s.ticket == ticket)
    }

    /// Where the waiter with `ticket` may take its slots now ([`plans`]): None if it is not
    /// seated or must wait.
    pub fn may_take(&self, ticket: u64, bits: &[AtomicU64]) -> Option<u32> {
        let seats = self.read();
        let place = seats.iter().position(|s| s.ticket == ticket)?;
        plans(&seats, bits)[place]
    }

    /// Where a newcomer asking for `k` slots of `[0, n)` may take them while the cap has
    /// waiters: from the widest n of the queue up, if `k` of those slots are free; else None
    /// (what is free, a waiter could use).
    pub fn newcomer(&self, n: u32, k: u32, bits: &[AtomicU64]) -> Option<u32> {
        let floor = self.widest();
        (floor < n && occupancy::free_between(bits, floor, n) >= k).then_some(floor)
    }

    /// Who to wake after slots of `bits` were freed (or a seat changed): the seats that may take
    /// now ([`plans`]) and, with `head`, the head in any case (a release wakes it, as
    /// PostgreSQL's lock manager would). Returns their processes.
    pub fn to_wake(&self, bits: &[AtomicU64], head: bool) -> Seats {
        let seats = self.read();
        let plans = plans(&seats, bits);
        let mut out = Seats::default();
        for (i, s) in seats.iter().enumerate() {
            if plans[i].is_some() || (head && i == 0) {
                out.push(*s);
            }
        }
        out
    }
}

fn covered(seats: &[Seated], bits: &[AtomicU64]) -> usize {
    let mut asks = [(0u32, 0u32); FRONT];
    for (a, s) in asks.iter_mut().zip(seats) {
        *a = (s.n, s.k);
    }
    occupancy::covered_front(&asks[..seats.len()], |n| occupancy::free_below(bits, n))
}

#[cfg(all(test, not(loom)))]
mod unit {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
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

    fn bitmap(mask: u64) -> Vec<AtomicU64> {
        vec![AtomicU64::new(mask)]
    }

    /// Claims `k` of the lowest free slots of `[from, n)`, all or none.
    fn claim(bits: &[AtomicU64], from: u32, n: u32, k: u32) -> Option<Vec<u32>> {
        let mut got = Vec::new();
        while got.len() < k as usize {
            match occupancy::claim_first_free(bits, from, n) {
                Some(c) => got.push(c.keep()),
                None => {
                    for &s in &got {
                        occupancy::clear(bits, s);
                    }
                    return None;
                }
            }
        }
        Some(got)
    }

    #[test]
    fn newcomers_fill_the_seats_in_order_and_leavers_move_them_up() {
        let f = Front::default();
        for t in 0..6u64 {
            f.join(
                t as usize,
                w(t as usize + 1, t, if t == 5 { 9 } else { 4 }, 1),
            );
        }
        assert_eq!(
            f.read().iter().map(|s| s.ticket).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        assert_eq!(f.widest(), 9, "the widest n counts waiters without a seat");
        // Ticket 1 leaves: 2, 3 move up, 4 is seated (the queue comes in any order).
        f.reseat([
            w(6, 5, 9, 1),
            w(4, 3, 4, 1),
            w(1, 0, 4, 1),
            w(5, 4, 4, 1),
            w(3, 2, 4, 1),
        ]);
        assert_eq!(
            f.read().iter().map(|s| s.ticket).collect::<Vec<_>>(),
            [0, 2, 3, 4]
        );
        assert_eq!(f.widest(), 9);
        let queue: Vec<Seated> = (0..9u64)
            .rev()
            .map(|t| w(t as usize + 1, t, t as u32 + 1, 1))
            .collect();
        f.reseat(queue.iter().copied());
        assert_eq!(
            f.read().iter().map(|s| s.ticket).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        assert_eq!(f.widest(), 9);
        f.reseat([w(5, 4, 4, 1)]);
        assert_eq!((f.read().len(), f.widest()), (1, 4));
        f.reseat([]);
        assert!(f.read().is_empty() && !f.holds(4));
        assert_eq!(f.widest(), 0);
    }

    #[test]
    fn only_covered_seats_take_and_are_woken() {
        let bits = bitmap(0b1111); // n = 4, all taken
        let f = Front::default();
        f.join(0, w(10, 0, 4, 2)); // head wants 2
        f.join(1, w(11, 1, 4, 1));
        assert!(f.may_take(0, &bits).is_none() && f.may_take(1, &bits).is_none());
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
            f.may_take(0, &bits).is_none() && f.may_take(1, &bits).is_none(),
            "no overtaking the head"
        );
        assert_eq!(f.newcomer(4, 1, &bits), None, "nor by a newcomer");
        occupancy::clear(&bits, 1);
        assert!(f.may_take(0, &bits) == Some(0) && f.may_take(1, &bits).is_none());
        occupancy::clear(&bits, 2);
        assert_eq!(f.may_take(1, &bits), Some(0));
        assert_eq!(f.to_wake(&bits, false).len(), 2);
        assert!(f.may_take(7, &bits).is_none(), "not seated");
    }

    #[test]
    fn waiters_and_newcomers_take_the_slots_no_waiter_ahead_of_them_could_use() {
        let bits = bitmap(0b0001); // slot 0 held, 1.. free
        let f = Front::default();
        f.join(0, w(10, 0, 1, 1)); // waits for slot 0
        assert_eq!(f.may_take(0, &bits), None);
        assert_eq!(
            f.newcomer(4, 1, &bits),
            Some(1),
            "slots 1..3 are no waiter's"
        );
        assert_eq!(f.newcomer(4, 3, &bits), Some(1));
        assert_eq!(f.newcomer(4, 4, &bits), None);
        assert_eq!(f.newcomer(1, 1, &bits), None, "slot 0 is the waiter's");
        f.join(1, w(11, 1, 4, 2)); // behind it, two of [0, 4): 1..3 are free
        assert_eq!(
            f.may_take(1, &bits),
            Some(1),
            "it overtakes nobody it competes with"
        );
        assert_eq!(
            f.newcomer(4, 1, &bits),
            None,
            "now slots 1..3 are a waiter's"
        );
        assert_eq!(f.newcomer(6, 1, &bits), Some(4));
        f.join(2, w(12, 2, 3, 1)); // behind a waiter of n = 4, on n = 3: nothing it may take
        assert_eq!(f.may_take(2, &bits), None);
        assert_eq!(
            f.to_wake(&bits, true)
                .iter()
                .map(|s| s.process)
                .collect::<Vec<_>>(),
            [10, 11],
            "the head, and the seat that may take"
        );
    }

    /// Every combination of a small cap (5 slots, every occupancy), up to three seats of every
    /// n and k, and newcomers of every n and k: the seats that may take do so in any order and
    /// with newcomers taking first, and each gets all it asked for; no seat takes a slot that a
    /// waiter ahead of it that does not take could use; no newcomer takes a slot any waiter
    /// could use, and a newcomer is held back only when what is free of its range is usable by
    /// a waiter.
    #[test]
    fn model_check_of_who_takes_what_with_mixed_n() {
        const SLOTS: u32 = 5;
        let asks: Vec<(u32, u32)> = (1..=SLOTS)
            .flat_map(|n| (1..=2.min(n)).map(move |k| (n, k)))
            .collect();
        let mut queues: Vec<Vec<(u32, u32)>> = asks.iter().map(|&a| vec![a]).collect();
        for _ in 0..2 {
            let longer: Vec<Vec<(u32, u32)>> = queues
                .iter()
                .filter(|q| q.len() == queues.last().unwrap().len())
                .flat_map(|q| {
                    asks.iter().map(move |&a| {
                        let mut q = q.clone();
                        q.push(a);
                        q
                    })
                })
                .collect();
            queues.extend(longer);
        }
        let mut checked = 0u64;
        for mask in 0..(1u64 << SLOTS) {
            for queue in &queues {
                let f = Front::default();
                for (i, &(n, k)) in queue.iter().enumerate() {
                    f.join(i, w(i + 1, i as u64, n, k));
                }
                let bits = bitmap(mask);
                let seats = f.read();
                let plans = plans(&seats, &bits);
                let free = |lo: u32, hi: u32| (lo..hi).filter(|s| mask & (1 << s) == 0).count();
                let widest = queue.iter().map(|q| q.0).max().unwrap();
                // The head may take whenever its k are free below its n.
                assert_eq!(
                    plans[0].is_some(),
                    free(0, queue[0].0) >= queue[0].1 as usize,
                    "head, {mask:#b} {queue:?}"
                );
                for (i, &(n, k)) in queue.iter().enumerate() {
                    let ahead = queue[..i].iter().map(|q| q.0).max().unwrap_or(0);
                    // A seat waits only if what it could take is some waiter's ahead of it,
                    // or short of its k.
                    if plans[i].is_none() {
                        assert!(
                            free(ahead.min(n), n) < k as usize,
                            "{mask:#b} {queue:?} {i}"
                        );
                    }
                    if let Some(from) = plans[i] {
                        assert!(from == 0 || from >= ahead);
                    }
                }
                let eligible: Vec<usize> =
                    (0..queue.len()).filter(|&i| plans[i].is_some()).collect();
                for (nn, nk) in asks.iter().copied().chain([(0, 0)]) {
                    for order in permutations(&eligible) {
                        let b = bitmap(mask);
                        // A newcomer (if any) goes first: the worst case for the seats.
                        if nn > 0 {
                            let got = f
                                .newcomer(nn, nk, &b)
                                .and_then(|from| claim(&b, from, nn, nk));
                            match &got {
                                Some(slots) => assert!(slots.iter().all(|&s| s >= widest)),
                                None => assert!(
                                    free(widest.min(nn), nn) < nk as usize,
                                    "newcomer ({nn}, {nk}) held back: {mask:#b} {queue:?}"
                                ),
                            }
                        }
                        let mut taken: Vec<(usize, Vec<u32>)> = Vec::new();
                        for &i in &order {
                            let (n, k) = queue[i];
                            let slots = claim(&b, plans[i].unwrap(), n, k).unwrap_or_else(|| {
                                panic!("{mask:#b} {queue:?} {order:?} ({nn}, {nk}): {i} not served")
                            });
                            taken.push((i, slots));
                        }
                        // Nobody took a slot a waiting seat ahead of it could use.
                        for (i, slots) in &taken {
                            for (j, &(n, _)) in queue[..*i].iter().enumerate() {
                                if plans[j].is_none() {
                                    assert!(
                                        slots.iter().all(|&s| s >= n),
                                        "{mask:#b} {queue:?}: {i} overtook {j}"
                                    );
                                }
                            }
                        }
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 100_000, "{checked}");
    }

    fn permutations(items: &[usize]) -> Vec<Vec<usize>> {
        if items.len() <= 1 {
            return vec![items.to_vec()];
        }
        let mut out = Vec::new();
        for (i, &first) in items.iter().enumerate() {
            let mut rest = items.to_vec();
            rest.remove(i);
            for mut p in permutations(&rest) {
                p.insert(0, first);
                out.push(p);
            }
        }
        out
    }

    /// The protocol with threads, as the server runs it: waiters of mixed n and k queue (under
    /// a "waits lock"), are seated, take where [`Front::may_take`] says, hold a moment and free
    /// their slots, while newcomers that do not wait try all the time where
    /// [`Front::newcomer`] says. Every release and every leave wakes whom the front says. A
    /// waiter sleeps on its own parking token (a latch) with a long timeout: a lost wake-up
    /// shows as a timeout, and the test requires none. Checked: a slot is never held twice, a
    /// seat that may take always gets all it asked for, and a newcomer never gets a slot that
    /// a waiter queued before it looked (and still queued after) could use.
    fn run_protocol(
        waiter_asks: &[(u32, u32)],
        newcomer_asks: &[(u32, u32)],
        rounds: usize,
    ) -> Vec<(u64, u64)> {
        const SLOTS: u32 = 8;
        struct Queue {
            waiting: Vec<Seated>,
            tail: u64,
        }
        let bits: Arc<Vec<AtomicU64>> = Arc::new(bitmap(0));
        let owner: Arc<Vec<AtomicU64>> = Arc::new((0..SLOTS).map(|_| AtomicU64::new(0)).collect());
        let front = Arc::new(Front::default());
        let queue = Arc::new(Mutex::new(Queue {
            waiting: Vec::new(),
            tail: 0,
        }));
        // How many have joined (after their n is in `widest`), and how many are queued.
        let joined = Arc::new(AtomicU64::new(0));
        let count = Arc::new(AtomicU32::new(0));
        let threads: Arc<Mutex<Vec<Option<std::thread::Thread>>>> =
            Arc::new(Mutex::new(vec![None; waiter_asks.len() + 1]));
        let timeouts = Arc::new(AtomicU64::new(0));
        let unserved = Arc::new(AtomicU64::new(0));
        // Per newcomer: the `joined` it saw when it looked, until it has given back what it
        // took (u64::MAX while idle). A newcomer that looked before a waiter joined may take
        // a slot that waiter then sees free: no rule can stop that (the look came first), and
        // the waiter is woken again by its release. Any other failed claim is a defect.
        let looks: Arc<Vec<AtomicU64>> = Arc::new(
            (0..newcomer_asks.len())
                .map(|_| AtomicU64::new(u64::MAX))
                .collect(),
        );
        let done = Arc::new(AtomicBool::new(false));
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
        let hold = {
            let owner = owner.clone();
            move |slots: &[u32], me: u64| {
                for &s in slots {
                    let prev = owner[s as usize].swap(me, Ordering::SeqCst);
                    assert_eq!(prev, 0, "slot {s} taken by {me} while {prev} held it");
                }
                std::thread::yield_now();
                for &s in slots {
                    owner[s as usize].store(0, Ordering::SeqCst);
                }
            }
        };
        let waiters: Vec<_> = waiter_asks
            .iter()
            .enumerate()
            .map(|(i, &(n, k))| {
                let me = i + 1;
                let looks = looks.clone();
                let (bits, front, queue, threads, timeouts, unserved, wake, hold, joined, count) = (
                    bits.clone(),
                    front.clone(),
                    queue.clone(),
                    threads.clone(),
                    timeouts.clone(),
                    unserved.clone(),
                    wake.clone(),
                    hold.clone(),
                    joined.clone(),
                    count.clone(),
                );
                std::thread::spawn(move || {
                    threads.lock().unwrap()[me] = Some(std::thread::current());
                    for _ in 0..rounds {
                        let ticket = {
                            let mut q = queue.lock().unwrap();
                            let t = q.tail;
                            q.tail += 1;
                            let seat = w(me, t, n, k);
                            front.join(q.waiting.len(), seat);
                            q.waiting.push(seat);
                            count.fetch_add(1, Ordering::SeqCst);
                            joined.store(q.tail, Ordering::SeqCst);
                            t
                        };
                        loop {
                            if let Some(from) = front.may_take(ticket, &bits) {
                                match claim(&bits, from, n, k) {
                                    Some(slots) => {
                                        {
                                            let mut q = queue.lock().unwrap();
                                            q.waiting.retain(|s| s.ticket != ticket);
                                            count.fetch_sub(1, Ordering::SeqCst);
                                            front.reseat(q.waiting.iter().copied());
                                            wake(&front.to_wake(&bits, false));
                                        }
                                        hold(&slots, me as u64);
                                        for &s in &slots {
                                            occupancy::clear(&bits, s);
                                        }
                                        wake(&front.to_wake(&bits, true));
                                        break;
                                    }
                                    None => {
                                        let stale = looks
                                            .iter()
                                            .any(|l| l.load(Ordering::SeqCst) <= ticket);
                                        if !stale {
                                            unserved.fetch_add(1, Ordering::Relaxed);
                                        }
                                    }
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
        let newcomers: Vec<_> = newcomer_asks
            .iter()
            .enumerate()
            .map(|(i, &(n, k))| {
                let me = 1000 + i as u64;
                let looks = looks.clone();
                let (bits, front, queue, wake, hold, joined, count, done) = (
                    bits.clone(),
                    front.clone(),
                    queue.clone(),
                    wake.clone(),
                    hold.clone(),
                    joined.clone(),
                    count.clone(),
                    done.clone(),
                );
                std::thread::spawn(move || {
                    let (mut got, mut throttled) = (0u64, 0u64);
                    while !done.load(Ordering::Relaxed) {
                        let seen = joined.load(Ordering::SeqCst);
                        looks[i].store(seen, Ordering::SeqCst);
                        let from = if count.load(Ordering::SeqCst) == 0 {
                            Some(0)
                        } else {
                            front.newcomer(n, k, &bits)
                        };
                        let Some(slots) = from.and_then(|from| claim(&bits, from, n, k)) else {
                            looks[i].store(u64::MAX, Ordering::SeqCst);
                            throttled += 1;
                            std::thread::yield_now();
                            continue;
                        };
                        {
                            let q = queue.lock().unwrap();
                            for wtr in q.waiting.iter().filter(|s| s.ticket < seen) {
                                assert!(
                                    slots.iter().all(|&s| s >= wtr.n),
                                    "newcomer ({n}, {k}) took {slots:?}, usable by {wtr:?}"
                                );
                            }
                        }
                        hold(&slots, me);
                        for &s in &slots {
                            occupancy::clear(&bits, s);
                        }
                        looks[i].store(u64::MAX, Ordering::SeqCst);
                        wake(&front.to_wake(&bits, true));
                        got += 1;
                    }
                    (got, throttled)
                })
            })
            .collect();
        for h in waiters {
            h.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        let tries: Vec<(u64, u64)> = newcomers.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(timeouts.load(Ordering::Relaxed), 0, "a wake-up was lost");
        assert_eq!(
            unserved.load(Ordering::Relaxed),
            0,
            "a seat that may take was not served"
        );
        assert_eq!(bits[0].load(Ordering::Relaxed), 0);
        assert!(front.read().is_empty() && front.widest() == 0);
        tries
    }

    #[test]
    fn no_wake_up_is_lost_between_releases_and_the_queue() {
        run_protocol(&[(3, 1); 10], &[], 150);
    }

    /// Waiters on n = 1 compete for slot 0 only: newcomers on n = 4 (two of them, so slots 1..3
    /// are never all theirs) are never throttled, and newcomers on n = 1 never get slot 0 from
    /// under a waiter.
    #[test]
    fn newcomers_on_slots_no_waiter_can_use_are_never_throttled() {
        let tries = run_protocol(&[(1, 1); 4], &[(4, 1), (4, 1), (1, 1)], 200);
        assert!(tries[0].0 > 0 && tries[1].0 > 0);
        assert_eq!(
            (tries[0].1, tries[1].1),
            (0, 0),
            "a try on n = 4 was throttled"
        );
    }

    #[test]
    fn mixed_n_and_k_waiters_with_newcomers_lose_no_wake_up_and_serve_everyone() {
        run_protocol(
            &[
                (1, 1),
                (4, 1),
                (4, 2),
                (2, 1),
                (8, 3),
                (1, 1),
                (6, 1),
                (4, 1),
            ],
            &[(4, 1), (8, 2), (1, 1), (6, 1)],
            150,
        );
    }
}
