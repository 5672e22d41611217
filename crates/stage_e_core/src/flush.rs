//! A cap's counters and the flush bookkeeping that makes them durable exactly once: the hot
//! counters ([`Counters`]), the seqlock ([`SeqLock`]) and the flush book ([`FlushBook`]) it
//! guards. The extension places one `Counters` and one `FlushBook` in each cap entry.
//!
//! **Hot counters.** One relaxed atomic per counter, bumped by every call: each is an
//! independent monotonic tally, read only to report and to flush. No ordering is needed: a
//! flush reads some value of each, and what it read is what it moves into the table
//! (`flushed`); later bumps stay pending. (A reader that synchronized with the flusher's write
//! reads each counter at or after the value the flusher read, by coherence, so
//! `counters - flushed` never goes below zero.)
//!
//! **Who writes the book.** `carried`, `flushed`, `inflight`, `inflight_id` and `settled_id`
//! change only in the process that holds the cap's flusher role (`flusher`: a CAS from 0 to its
//! pid, AcqRel, so a role taker sees everything the last holder wrote before its Release end),
//! or in the postmaster before any backend, or under the exclusive directory lock while the
//! entry is reclaimed. Each change is one seqlock write. Readers ([`FlushBook::read`]) are any
//! backend, lock-free; they retry until they read an even, unchanged version, so the pending
//! counts they compute come from one state of the book (with the hot counters as of then).
//!
//! **The seqlock's orderings.** Writer: `version += 1` (odd), `fence(Release)`, relaxed stores,
//! `version += 1` (even, Release). Reader: `v1 = version` (Acquire; odd: retry), relaxed loads,
//! `fence(Acquire)`, `v2 = version` (Relaxed); the read stands if `v1 == v2`.
//!
//! - The closing Release increment pairs with the reader's Acquire `v1`: a reader that reads
//!   the even version a write ended with sees every store of that write.
//! - The writer's `fence(Release)` *after* its opening increment pairs with the reader's
//!   `fence(Acquire)` before `v2`: if a relaxed load of the reader read a store of the write
//!   (sequenced after the writer's fence), the fences synchronize (C++ [atomics.fences]/2), so
//!   the opening increment happens before `v2`, which then reads it (or later) and the read is
//!   retried. Without that fence nothing orders the opening increment before the data stores
//!   *for another thread*: the Release half of an RMW orders only what precedes it, so the
//!   reader may see a new value and still read the old even version at `v2`, a torn state.
//!   This is crossbeam's `SeqLock::write` (`swap(1, Acquire)` then `fence(Release)`) and Boehm's
//!   "Can seqlocks get along with programming language memory models?" (2012). The extension's
//!   writer before this crate (`fetch_add(1, AcqRel)`, no fence) had the flaw; the loom test
//!   `flush::model::a_reader_never_sees_a_torn_write` finds the torn read when the fence is
//!   left out, and x86 hides it only because its locked RMW is a full barrier.
//! - The opening increment itself may be Relaxed for the model's sake (one writer at a time:
//!   the flusher role is the writers' lock); it stays AcqRel as the extension had it.
//!
//! **Restart.** A cap's counts, and with them its pending counts, can start again from zero
//! (`DROP EXTENSION`: the table they were flushed into is gone, and the new extension's
//! statistics and table start clean) while the cap lives on, its slots held. The holder of the
//! role makes it in one seqlock write ([`FlushBook::restart`]): it subtracts from each hot
//! counter the value it reads (an RMW, so a bump made meanwhile stays, and is all that is
//! pending after), and zeroes the rest of the book (`flushed`, `carried`, the settled flush:
//! none is in flight when the role is given back), so `counters - flushed` never goes below
//! zero and no count of before reaches a table. A process that asks for a
//! restart while another holds the role leaves the request ([`FlushBook::ask_restart`]: store
//! the request, then try the role) for the holder, who looks for one after giving the role back
//! ([`FlushBook::end`]: release, then load the request) and takes the role again to make it. A
//! Dekker pair (SeqCst, `seqcst_pair`): either the asker takes the role, or the process whose
//! role made its attempt fail sees the request; a request is consumed (swapped to 0) under the
//! role, so it is made once.

use crate::counters::{Counter, CounterValues, FlushState, COUNT};
use crate::histogram::HistValues;
use crate::sync::{fence, seqcst_pair, spin_loop, AtomicI32, AtomicU32, AtomicU64, Ordering};

/// One value per counter, in `CounterValues::NAMES` order (zeroed memory: all zero). `N` is
/// [`COUNT`] but in the model checks, which use one counter: loom explores every value each
/// relaxed load may read, and a state of ten counters is more than it can walk.
#[repr(C)]
pub struct Counters<const N: usize = COUNT>([AtomicU64; N]);

impl<const N: usize> Default for Counters<N> {
    fn default() -> Self {
        Counters(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl Counters {
    /// The hot path: one relaxed add.
    pub fn bump(&self, which: Counter, by: u64) {
        self.add(which as usize, by);
    }

    pub fn load(&self) -> CounterValues {
        CounterValues::from_array(self.values())
    }

    /// Inside a seqlock write, or with no other process about (start, reclaim).
    pub fn store(&self, v: CounterValues) {
        self.set(v.to_array());
    }
}

impl<const N: usize> Counters<N> {
    /// Counter `i`: one relaxed add.
    pub fn add(&self, i: usize, by: u64) {
        self.0[i].fetch_add(by, Ordering::Relaxed);
    }

    pub fn values(&self) -> [u64; N] {
        std::array::from_fn(|i| self.0[i].load(Ordering::Relaxed))
    }

    pub fn set(&self, v: [u64; N]) {
        for (c, x) in self.0.iter().zip(v) {
            c.store(x, Ordering::Relaxed);
        }
    }
}

/// A seqlock's version word: odd while a write is under way (zeroed memory: no write). One
/// writer at a time (the caller's lock or role); readers never block it. See the module note
/// for the orderings and why the writer fences.
#[repr(transparent)]
#[derive(Default)]
pub struct SeqLock(AtomicU64);

impl SeqLock {
    /// Runs `write` (relaxed stores of the guarded fields) as one write.
    pub fn write<R>(&self, write: impl FnOnce() -> R) -> R {
        self.0.fetch_add(1, Ordering::AcqRel);
        // Orders the opening increment before the stores of `write` for a reader that sees
        // one of them (pairs with the reader's fence(Acquire)): the module note.
        fence(Ordering::Release);
        let r = write();
        self.0.fetch_add(1, Ordering::Release);
        r
    }

    /// Runs `read` (relaxed loads of the guarded fields) until it ran with no write under way
    /// or in between, and returns what that run read.
    pub fn read<T>(&self, mut read: impl FnMut() -> T) -> T {
        loop {
            let before = self.0.load(Ordering::Acquire);
            if before % 2 == 1 {
                spin_loop();
                continue;
            }
            let got = read();
            fence(Ordering::Acquire);
            if self.0.load(Ordering::Relaxed) == before {
                return got;
            }
            spin_loop();
        }
    }
}

/// A cap's flush bookkeeping and its flusher role (zeroed memory: no flush, nothing carried).
///
/// A flush in progress has `inflight_id` (its id) and `inflight` (the delta it writes). Once
/// its transaction commits and the cap advances, `inflight_id` is 0 and `settled_id` is its id,
/// with `inflight` still its delta (for readers whose snapshot predates the commit), until the
/// next flush of the cap starts ([`FlushState::pending`]).
#[repr(C)]
pub struct FlushBook<const N: usize = COUNT> {
    version: SeqLock,
    inflight_id: AtomicU64,
    settled_id: AtomicU64,
    /// Pending counts saved at the last clean shutdown, not yet in the table.
    carried: Counters<N>,
    /// Value of the hot counters at the last committed flush.
    flushed: Counters<N>,
    /// Delta written by the flush in progress (or by the last settled one).
    inflight: Counters<N>,
    /// Pid of the process whose open transaction is flushing this cap; 0 = none.
    flusher: AtomicI32,
    /// 1 while a restart of the counts is asked for and not yet made (module note).
    restart: AtomicU32,
}

impl<const N: usize> Default for FlushBook<N> {
    fn default() -> Self {
        FlushBook {
            version: SeqLock::default(),
            inflight_id: AtomicU64::new(0),
            settled_id: AtomicU64::new(0),
            carried: Counters::default(),
            flushed: Counters::default(),
            inflight: Counters::default(),
            flusher: AtomicI32::new(0),
            restart: AtomicU32::new(0),
        }
    }
}

/// A [`FlushBook`] and hot counters as one read saw them, as arrays (what [`FlushState`] holds
/// as counter values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BookRead<const N: usize> {
    pub counters: [u64; N],
    pub carried: [u64; N],
    pub flushed: [u64; N],
    pub inflight: [u64; N],
    pub inflight_id: u64,
    pub settled_id: u64,
}

impl<const N: usize> BookRead<N> {
    /// [`FlushState::pending`], per counter (which calls this).
    pub fn pending(&self, row_flush_id: Option<u64>) -> [u64; N] {
        let at = |a: &[u64; N], i: usize| a[i];
        std::array::from_fn(|i| {
            let pending = at(&self.carried, i)
                .wrapping_add(at(&self.counters, i))
                .wrapping_sub(at(&self.flushed, i));
            match row_flush_id {
                Some(id) if id != 0 && id == self.inflight_id => {
                    pending.wrapping_sub(at(&self.inflight, i))
                }
                Some(id) if self.settled_id != 0 && id < self.settled_id => {
                    pending.wrapping_add(at(&self.inflight, i))
                }
                _ => pending,
            }
        })
    }
}

impl FlushBook {
    /// The book with the hot counters `counts`, read consistently. `hist` runs inside the read
    /// (the histograms' counts and base, which are not under the seqlock: only the flusher
    /// moves their base).
    pub fn read(
        &self,
        counts: &Counters,
        hist: impl Fn() -> (HistValues, HistValues),
    ) -> FlushState {
        let (r, (h, base)) = self.read_with(counts, hist);
        let v = CounterValues::from_array;
        FlushState {
            counters: v(r.counters),
            carried: v(r.carried),
            flushed: v(r.flushed),
            inflight: v(r.inflight),
            inflight_id: r.inflight_id,
            settled_id: r.settled_id,
            hist: h,
            hist_base: base,
        }
    }

    /// Adds counts saved at the last clean shutdown (the postmaster, before any backend).
    pub fn carry(&self, v: CounterValues) {
        self.carry_values(v.to_array());
    }

    /// The flusher: its flush `id` writes `delta`; the last settled flush's delta is given up
    /// for it.
    pub fn set_inflight(&self, id: u64, delta: CounterValues) {
        self.set_inflight_values(id, delta.to_array());
    }

    /// The flusher's transaction committed having read `read`: that is in the table now. Its
    /// delta stays in `inflight`, under `settled_id`, for readers whose snapshot predates the
    /// commit. The caller then moves the histograms' base and calls [`FlushBook::end`].
    pub fn commit(&self, read: &FlushState) {
        self.commit_values(read.counters.to_array(), read.carried.to_array());
    }
}

impl<const N: usize> FlushBook<N> {
    /// Makes `pid` (nonzero) the cap's only flusher; false if another flush is in progress.
    /// Acquire on success: this flusher sees what the previous one wrote.
    pub fn begin(&self, pid: i32) -> bool {
        self.flusher
            .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Whether no process holds the flusher role (a cap whose role is held is not reclaimed).
    pub fn idle(&self) -> bool {
        self.flusher.load(Ordering::Acquire) == 0
    }

    /// [`FlushBook::read`] as arrays, with what `also` read inside the same read.
    pub fn read_with<T>(&self, counts: &Counters<N>, also: impl Fn() -> T) -> (BookRead<N>, T) {
        self.version.read(|| {
            let t = also();
            let r = BookRead {
                counters: counts.values(),
                carried: self.carried.values(),
                flushed: self.flushed.values(),
                inflight: self.inflight.values(),
                inflight_id: self.inflight_id.load(Ordering::Relaxed),
                settled_id: self.settled_id.load(Ordering::Relaxed),
            };
            (r, t)
        })
    }

    /// [`FlushBook::carry`], as an array.
    pub fn carry_values(&self, v: [u64; N]) {
        self.version.write(|| {
            let c = self.carried.values();
            self.carried
                .set(std::array::from_fn(|i| c[i].wrapping_add(v[i])));
        });
    }

    /// [`FlushBook::set_inflight`], as an array.
    pub fn set_inflight_values(&self, id: u64, delta: [u64; N]) {
        self.version.write(|| {
            self.inflight.set(delta);
            self.inflight_id.store(id, Ordering::Relaxed);
            self.settled_id.store(0, Ordering::Relaxed);
        });
    }

    /// [`FlushBook::commit`] of a read that saw `counters` and `carried`.
    pub fn commit_values(&self, counters: [u64; N], carried: [u64; N]) {
        self.version.write(|| {
            self.flushed.set(counters);
            let c = self.carried.values();
            self.carried
                .set(std::array::from_fn(|i| c[i].wrapping_sub(carried[i])));
            let id = self.inflight_id.swap(0, Ordering::Relaxed);
            if id == 0 {
                self.inflight.set([0; N]);
            }
            self.settled_id.store(id, Ordering::Relaxed);
        });
    }

    /// The flusher's transaction (or subtransaction) aborted: its delta is still pending. A
    /// role taken for a cap with nothing new (no delta set) keeps the last settled flush. The
    /// caller then calls [`FlushBook::end`].
    pub fn abort(&self) {
        self.version.write(|| {
            // A flush that set its delta had given up the settled one (`set_inflight`).
            if self.inflight_id.swap(0, Ordering::Relaxed) != 0 {
                self.inflight.set([0; N]);
            }
        });
    }

    /// Gives the flusher role back (Release: the next flusher sees this one's writes). True if
    /// a restart was asked for meanwhile and this process took the role again to make it: it
    /// calls [`FlushBook::restart`], then `end` again (module note, "Restart").
    #[must_use]
    pub fn end(&self) -> bool {
        let me = self.flusher.load(Ordering::Relaxed);
        self.flusher.store(0, Ordering::SeqCst);
        seqcst_pair();
        self.restart.load(Ordering::SeqCst) != 0 && self.begin(me)
    }

    /// Asks for the counts to restart at zero. True if `pid` (nonzero) took the role: it calls
    /// [`FlushBook::restart`] (which finds the restart made already if the last holder saw the
    /// request as it gave the role back), then [`FlushBook::end`]. False if another process
    /// holds the role: it makes the restart as it gives the role back.
    #[must_use]
    pub fn ask_restart(&self, pid: i32) -> bool {
        self.restart.store(1, Ordering::SeqCst);
        seqcst_pair();
        self.flusher
            .compare_exchange(0, pid, Ordering::SeqCst, Ordering::Acquire)
            .is_ok()
    }

    /// Holding the role, with no flush in flight (a flush's commit or abort settled it): makes
    /// the restart asked for, if one still is, and returns the pending counts it dropped (None
    /// if none was asked for). In one seqlock write, each hot counter of `counts` loses the
    /// value read of it (a bump made meanwhile stays: pending from now on) and the book goes
    /// back to zero; `also` runs inside the same write (the extension restarts its histograms
    /// there likewise).
    pub fn restart(&self, counts: &Counters<N>, also: impl FnOnce()) -> Option<[u64; N]> {
        if self.restart.swap(0, Ordering::AcqRel) == 0 {
            return None;
        }
        Some(self.version.write(|| {
            let now = counts.values();
            let (carried, flushed) = (self.carried.values(), self.flushed.values());
            for (c, v) in counts.0.iter().zip(now) {
                c.fetch_sub(v, Ordering::Relaxed);
            }
            for a in [&self.carried, &self.flushed, &self.inflight] {
                a.set([0; N]);
            }
            self.settled_id.store(0, Ordering::Relaxed);
            also();
            std::array::from_fn(|i| carried[i].wrapping_add(now[i]).wrapping_sub(flushed[i]))
        }))
    }

    /// Whether a restart is asked for and not yet made.
    pub fn restart_asked(&self) -> bool {
        self.restart.load(Ordering::Acquire) != 0
    }

    /// Under the exclusive directory lock, reclaiming (no reader, no flusher): every count
    /// back to zero, the hot `counts` too.
    pub fn clear(&self, counts: &Counters<N>) {
        counts.set([0; N]);
        self.carried.set([0; N]);
        self.flushed.set([0; N]);
        self.inflight.set([0; N]);
        self.inflight_id.store(0, Ordering::Relaxed);
        self.settled_id.store(0, Ordering::Relaxed);
        self.restart.store(0, Ordering::Relaxed);
    }
}

#[cfg(all(test, not(loom)))]
mod unit {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    fn no_hist() -> (HistValues, HistValues) {
        (HistValues::default(), HistValues::default())
    }

    /// A cap's counters with `live` acquisitions counted since the last flush, and a book with
    /// `carried` more pending from before (the pending file of a clean start).
    fn acquired(live: u64, carried: u64) -> (Counters, FlushBook) {
        let (counts, book) = (Counters::default(), FlushBook::default());
        counts.bump(Counter::Acquired, live);
        book.carry(CounterValues {
            acquired: carried,
            ..Default::default()
        });
        (counts, book)
    }

    #[test]
    fn a_flush_moves_what_it_read_and_later_counts_stay_pending() {
        let (counts, book) = acquired(5, 2);
        assert!(book.begin(7) && !book.begin(8) && !book.idle());
        let read = book.read(&counts, no_hist);
        assert_eq!(read.pending(None).acquired, 7);
        book.set_inflight(1, read.pending(None));
        counts.bump(Counter::Acquired, 1);
        // Before the cap advances: a reader that sees row 1 has the 7 in it.
        let s = book.read(&counts, no_hist);
        assert_eq!(s.pending(Some(1)).acquired, 1);
        assert_eq!(s.pending(Some(0)).acquired, 8);
        book.commit(&read);
        assert!(!book.end(), "no restart was asked for");
        assert!(book.idle());
        let s = book.read(&counts, no_hist);
        assert_eq!(s.pending(None).acquired, 1);
        assert_eq!(s.pending(Some(1)).acquired, 1);
        assert_eq!(s.pending(Some(0)).acquired, 8, "a snapshot before row 1");
        // An aborted flush leaves everything pending.
        assert!(book.begin(7));
        let read = book.read(&counts, no_hist);
        book.set_inflight(2, read.pending(None));
        book.abort();
        assert!(!book.end(), "no restart was asked for");
        assert_eq!(book.read(&counts, no_hist).pending(Some(1)).acquired, 1);
        book.clear(&counts);
        assert!(book.read(&counts, no_hist).pending(None).is_zero());
    }

    #[test]
    fn a_restart_zeroes_the_counts_and_drops_what_is_pending() {
        let (counts, book) = acquired(5, 4);
        assert!(book.begin(7));
        let read = book.read(&counts, no_hist);
        book.set_inflight(1, read.pending(None));
        book.commit(&read);
        assert!(!book.end());
        counts.bump(Counter::Acquired, 2);
        // Asked with the role free: the asker makes it at once.
        assert!(book.ask_restart(9));
        assert_eq!(book.restart(&counts, || {}).map(|d| d[0]), Some(2));
        assert!(!book.end());
        let s = book.read(&counts, no_hist);
        assert_eq!((s.counters.acquired, s.pending(None).acquired), (0, 0));
        assert_eq!(
            s.pending(Some(0)).acquired,
            0,
            "no settled flush is added back"
        );
        // Asked while a flush holds the role: its holder makes it as it gives the role back.
        counts.bump(Counter::Acquired, 3);
        assert!(book.begin(7));
        assert!(!book.ask_restart(9));
        assert!(book.restart_asked());
        assert!(book.end(), "the holder takes the role back to restart");
        assert_eq!(book.restart(&counts, || {}).map(|d| d[0]), Some(3));
        assert_eq!(book.restart(&counts, || {}), None, "made once");
        assert!(!book.end());
        // Counting goes on from zero, and a flush moves exactly that.
        counts.bump(Counter::Acquired, 1);
        assert!(book.begin(7));
        let read = book.read(&counts, no_hist);
        assert_eq!(
            (read.counters.acquired, read.pending(None).acquired),
            (1, 1)
        );
        book.set_inflight(2, read.pending(None));
        book.commit(&read);
        assert!(!book.end());
        assert!(book.read(&counts, no_hist).pending(None).is_zero());
    }

    /// A writer writes (i, i) pairs as fast as it can; readers must never see two different
    /// halves of a pair.
    #[test]
    fn seqlock_readers_never_see_a_torn_pair_with_threads() {
        // The lock, the pair, and how many reads were made.
        let lock = Arc::new((
            SeqLock::default(),
            AtomicU64::new(0),
            AtomicU64::new(0),
            AtomicU64::new(0),
        ));
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let (lock, stop) = (lock.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let (a, b) = lock.0.read(|| {
                            (
                                lock.1.load(Ordering::Relaxed),
                                lock.2.load(Ordering::Relaxed),
                            )
                        });
                        assert_eq!(a, b, "torn read");
                        lock.3.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        // Writes until the readers have read a while (on a loaded machine they may start late).
        let mut i = 0u64;
        while i < 100_000 || lock.3.load(Ordering::Relaxed) < 30_000 {
            i += 1;
            lock.0.write(|| {
                lock.1.store(i, Ordering::Relaxed);
                lock.2.store(i, Ordering::Relaxed);
            });
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join().unwrap();
        }
    }

    /// Bumpers count, flushers flush into a "table" (its total and newest flush id, made
    /// visible at "commit" before the cap advances, as a transaction's row is) and readers read
    /// table plus pending with the id of the row they saw: no reader ever sees more than was
    /// counted, nor fewer than the counts it made itself before reading, and at the end the
    /// table plus pending is exactly what was counted.
    #[test]
    fn no_count_is_lost_or_doubled_across_flushes_with_threads() {
        const BUMPS: u64 = 20_000;
        let cap = Arc::new((Counters::default(), FlushBook::default()));
        // (total << 32) | flush id, as one snapshot.
        let table = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let ids = Arc::new(AtomicU64::new(0));
        // A statement's total, unless the book it read is two flushes past its row (ids are
        // given in order): a statement spans at most one flush's commit (`FlushState::pending`).
        let total = |cap: &(Counters, FlushBook), table: &AtomicU64| {
            let row = table.load(Ordering::Acquire);
            let s = cap.1.read(&cap.0, no_hist);
            let id = row & 0xffff_ffff;
            let t = (row >> 32) + s.pending(Some(id)).acquired;
            (s.inflight_id.max(s.settled_id) <= id + 1).then_some(t)
        };
        let bumpers: Vec<_> = (0..2)
            .map(|_| {
                let (cap, table) = (cap.clone(), table.clone());
                std::thread::spawn(move || {
                    for i in 1..=BUMPS {
                        cap.0.bump(Counter::Acquired, 1);
                        if i % 64 == 0 {
                            if let Some(t) = total(&cap, &table) {
                                assert!(t >= i && t <= 2 * BUMPS, "{t} after {i} of mine");
                            }
                        }
                    }
                })
            })
            .collect();
        let flushers: Vec<_> = (0..2)
            .map(|me| {
                let (cap, table, stop, ids) =
                    (cap.clone(), table.clone(), stop.clone(), ids.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if !cap.1.begin(me + 1) {
                            continue;
                        }
                        let read = cap.1.read(&cap.0, no_hist);
                        let delta = read.pending(None);
                        let id = ids.fetch_add(1, Ordering::Relaxed) + 1;
                        cap.1.set_inflight(id, delta);
                        if id % 3 == 0 {
                            cap.1.abort(); // the transaction failed
                        } else {
                            let row = table.load(Ordering::Acquire);
                            table.store(
                                (((row >> 32) + delta.acquired) << 32) | id,
                                Ordering::Release,
                            );
                            cap.1.commit(&read);
                        }
                        assert!(!cap.1.end(), "no restart was asked for");
                    }
                })
            })
            .collect();
        for b in bumpers {
            b.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        for f in flushers {
            f.join().unwrap();
        }
        assert_eq!(total(&cap, &table), Some(2 * BUMPS));
    }

    /// Gives the role back, making every restart asked for meanwhile; how many it made, and
    /// the counts they dropped.
    fn end_restarting(cap: &(Counters, FlushBook)) -> (u64, u64) {
        let (mut made, mut dropped) = (0, 0);
        while cap.1.end() {
            if let Some(d) = cap.1.restart(&cap.0, || {}) {
                made += 1;
                dropped += d[0];
            }
        }
        (made, dropped)
    }

    /// Bumpers count and flushers flush (some flushes abort) while an asker asks for restarts
    /// again and again: no request is left unmade once all stop, and every count is in exactly
    /// one of the table, pending, or what a restart dropped.
    #[test]
    fn restarts_asked_while_flushing_are_all_made_and_lose_no_count_with_threads() {
        const BUMPS: u64 = 20_000;
        let cap = Arc::new((Counters::default(), FlushBook::default()));
        let table = Arc::new(AtomicU64::new(0));
        // Restarts made, and the counts they dropped.
        let made = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
        let note = |made: &(AtomicU64, AtomicU64), (m, d): (u64, u64)| {
            made.0.fetch_add(m, Ordering::Relaxed);
            made.1.fetch_add(d, Ordering::Relaxed);
        };
        let stop = Arc::new(AtomicBool::new(false));
        let bumpers: Vec<_> = (0..2)
            .map(|_| {
                let cap = cap.clone();
                std::thread::spawn(move || {
                    for _ in 0..BUMPS {
                        cap.0.bump(Counter::Acquired, 1);
                    }
                })
            })
            .collect();
        let flushers: Vec<_> = (0..2)
            .map(|me| {
                let (cap, table, made, stop) =
                    (cap.clone(), table.clone(), made.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut id = 0;
                    while !stop.load(Ordering::Relaxed) {
                        if !cap.1.begin(me + 1) {
                            continue;
                        }
                        let read = cap.1.read(&cap.0, no_hist);
                        let delta = read.pending(None);
                        id += 1;
                        cap.1.set_inflight(id, delta);
                        if id % 3 == 0 {
                            cap.1.abort();
                        } else {
                            table.fetch_add(delta.acquired, Ordering::Relaxed);
                            cap.1.commit(&read);
                        }
                        note(&made, end_restarting(&cap));
                    }
                })
            })
            .collect();
        let asker = {
            let (cap, made) = (cap.clone(), made.clone());
            std::thread::spawn(move || {
                for _ in 0..2_000 {
                    if cap.1.ask_restart(9) {
                        if let Some(d) = cap.1.restart(&cap.0, || {}) {
                            note(&made, (1, d[0]));
                        }
                        note(&made, end_restarting(&cap));
                    }
                    std::thread::yield_now();
                }
            })
        };
        for b in bumpers {
            b.join().unwrap();
        }
        asker.join().unwrap();
        stop.store(true, Ordering::Relaxed);
        for f in flushers {
            f.join().unwrap();
        }
        assert!(
            !cap.1.restart_asked(),
            "a restart was asked for and never made"
        );
        assert!(made.0.load(Ordering::Relaxed) > 0);
        let s = cap.1.read(&cap.0, no_hist);
        assert_eq!(
            table.load(Ordering::Relaxed)
                + s.pending(None).acquired
                + made.1.load(Ordering::Relaxed),
            2 * BUMPS
        );
    }
}

/// Model checks (`RUSTFLAGS="--cfg loom" cargo test -p stage_e_core --release`): every
/// interleaving of the threads, with every value a weak load may read.
#[cfg(all(test, loom))]
mod model {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// A writer writes the pairs (1, 1) then (2, 2); a reader must read one whole pair. This
    /// is the test that settles the writer's `fence(Release)` (module note): without it loom
    /// finds a read of (1, 0) or (2, 1) that validates.
    #[test]
    fn a_reader_never_sees_a_torn_write() {
        crate::sync::model(|| {
            let s = Arc::new((SeqLock::default(), AtomicU64::new(0), AtomicU64::new(0)));
            let writer = {
                let s = s.clone();
                thread::spawn(move || {
                    for i in 1..=2 {
                        s.0.write(|| {
                            s.1.store(i, Ordering::Relaxed);
                            s.2.store(i, Ordering::Relaxed);
                        });
                    }
                })
            };
            let (a, b) =
                s.0.read(|| (s.1.load(Ordering::Relaxed), s.2.load(Ordering::Relaxed)));
            assert_eq!(a, b, "torn read");
            writer.join().unwrap();
        });
    }

    /// A statement's total: the table's rows (total, newest flush id; made visible at
    /// "commit" before the cap advances) plus what is pending for a reader of that row. None
    /// if the book it read is two flushes past its row (ids are given in order): a statement
    /// spans at most one flush's commit (`FlushState::pending`).
    fn total(c: &Cap) -> Option<u64> {
        let row = c.table.load(Ordering::Acquire);
        let (s, ()) = c.book.read_with(&c.counts, || ());
        let id = row & 0xffff_ffff;
        let t = (row >> 32) + s.pending(Some(id))[0];
        (s.inflight_id.max(s.settled_id) <= id + 1).then_some(t)
    }

    /// A cap with one counter (see [`Counters`]).
    #[derive(Default)]
    struct Cap {
        counts: Counters<1>,
        book: FlushBook<1>,
        table: AtomicU64,
        ids: AtomicU64,
        /// Counts dropped by restarts.
        dropped: AtomicU64,
    }

    /// One flush as the extension runs it (`flush::run`, `session::settle_flush`): take the
    /// role, read, write the delta as flush `id` (nothing new: give the role back), commit
    /// the row, advance the cap, give the role back.
    fn flush(c: &Cap, pid: i32) {
        if !c.book.begin(pid) {
            return;
        }
        let (read, ()) = c.book.read_with(&c.counts, || ());
        let delta = read.pending(None);
        if delta == [0] {
            c.book.abort();
            end_restarting(c);
            return;
        }
        let id = c.ids.fetch_add(1, Ordering::Relaxed) + 1;
        c.book.set_inflight_values(id, delta);
        let row = c.table.load(Ordering::Relaxed);
        c.table
            .store((((row >> 32) + delta[0]) << 32) | id, Ordering::Release);
        c.book.commit_values(read.counters, read.carried);
        end_restarting(c);
    }

    /// Gives the role back, making every restart asked for meanwhile.
    fn end_restarting(c: &Cap) {
        while c.book.end() {
            restart(c);
        }
    }

    /// Holding the role: makes the restart asked for, if one still is, noting what it dropped.
    fn restart(c: &Cap) {
        if let Some(d) = c.book.restart(&c.counts, || ()) {
            c.dropped.fetch_add(d[0], Ordering::Relaxed);
        }
    }

    /// A backend counts twice and reads its total after each count while two flushers flush:
    /// it never reads more than was counted (a count flushed and still pending), nor less than
    /// it counted itself (a count in neither), and at the end table plus pending is exact.
    #[test]
    fn no_count_is_lost_or_counted_twice_across_a_flush() {
        crate::sync::model(|| {
            let c = Arc::new(Cap::default());
            let flushers: Vec<_> = [1, 2]
                .map(|pid| {
                    let c = c.clone();
                    thread::spawn(move || flush(&c, pid))
                })
                .into_iter()
                .collect();
            for mine in 1..=2 {
                c.counts.add(0, 1);
                if let Some(t) = total(&c) {
                    assert!(t >= mine && t <= 2, "total {t} after {mine} counts");
                }
            }
            for f in flushers {
                f.join().unwrap();
            }
            assert_eq!(total(&c), Some(2));
        });
    }

    /// A restart asked for while a flush may hold the role is made, once: by the asker if it
    /// takes the role, else by the flush as it gives the role back. The count made before it
    /// is gone from the counters, and in exactly one of the table and what the restart dropped.
    #[test]
    fn a_restart_asked_during_a_flush_is_made() {
        crate::sync::model(|| {
            let c = Arc::new(Cap::default());
            c.counts.add(0, 1);
            let flusher = {
                let c = c.clone();
                thread::spawn(move || flush(&c, 1))
            };
            if c.book.ask_restart(2) {
                // The flush may have made it already, between the request and the role.
                restart(&c);
                end_restarting(&c);
            }
            flusher.join().unwrap();
            assert!(!c.book.restart_asked(), "the request was lost");
            assert_eq!(c.counts.values(), [0]);
            let (table, dropped) = (
                c.table.load(Ordering::Relaxed) >> 32,
                c.dropped.load(Ordering::Relaxed),
            );
            assert_eq!(total(&c).map(|t| t + dropped), Some(1), "table {table}");
        });
    }

    /// A flush that aborts leaves its delta pending; a reader meanwhile never counts it
    /// twice, and a flush after it moves everything.
    #[test]
    fn an_aborted_flush_leaves_its_counts_pending() {
        crate::sync::model(|| {
            let c = Arc::new(Cap::default());
            c.counts.add(0, 1);
            let aborting = {
                let c = c.clone();
                thread::spawn(move || {
                    assert!(c.book.begin(1));
                    let (read, ()) = c.book.read_with(&c.counts, || ());
                    c.book.set_inflight_values(1, read.pending(None));
                    c.book.abort();
                    assert!(!c.book.end(), "no restart was asked for");
                })
            };
            let reader = {
                let c = c.clone();
                thread::spawn(move || {
                    let t = total(&c).expect("no row is committed");
                    assert!((1..=2).contains(&t), "total {t}");
                })
            };
            c.counts.add(0, 1);
            aborting.join().unwrap();
            reader.join().unwrap();
            assert_eq!(total(&c), Some(2));
            flush(&c, 3);
            assert_eq!(c.table.load(Ordering::Relaxed) >> 32, 2);
            assert_eq!(total(&c), Some(2));
        });
    }
}

// Layout, for the extension's cap entry (its size is a memory budget): the hot counters are
// 88 bytes, the book 296 (the version, two ids, three counter sets, the flusher's pid and the
// restart request).
#[cfg(not(all(test, loom)))]
const _: () = assert!(size_of::<Counters>() == 88 && size_of::<FlushBook>() == 296);
