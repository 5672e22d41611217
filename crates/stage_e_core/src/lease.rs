//! A lease record's states, and fencing-token arithmetic.
//!
//! **States.** A record is FREE, LIVE (a lease on one slot of one cap) or BUSY (one process is
//! reading and changing it). Every change goes through BUSY, entered by a CAS: FREE → BUSY by
//! the taker ([`LeaseState::claim`]), which writes the fields and publishes LIVE; LIVE → BUSY
//! by a renewal, a release by token or an expiry sweep ([`LeaseState::lock`]), which then puts
//! it back to LIVE or ends it (FREE). So those three never act on one lease at once, and a
//! reader that locked a LIVE record sees every field its last writer stored (Release/Acquire).
//! BUSY lasts a few stores, so a process that finds a record BUSY spins.
//!
//! **Records** ([`LeaseRecord`]). The taker claims a FREE record, stores its fields (Relaxed),
//! counts the lease in the cap's [`LiveLeases`], publishes LIVE (Release), and only then names
//! the record in the slot's holder record (`holder::SlotRecord::set`, Release) and lowers the
//! cap's [`ExpiryBound`] ([`LeaseRecord::start`]). A process that finds the record through the
//! slot (Acquire) and locks it (AcqRel CAS from LIVE) sees every field. The lease ends
//! ([`LeaseRecord::end`]) with its record locked: the slot's holder record and bit are cleared
//! first, the count goes down, the record is freed last (Release), so a new taker of the record
//! never races the old lease's cleanup. A record names its cap as (entry, generation) and its
//! slot: a process that reaches a record through a stale holder record locks it and checks
//! that it is still the lease of that cap's slot ([`LeaseRecord::lock_for`]).
//!
//! **Expiry bound** ([`ExpiryBound`]). A lower bound of the cap's expiries, so a call checks
//! for expired leases with two loads. A sweep resets it to "none" (a SeqCst swap) *before* its
//! scan, and lowers it again (SeqCst `fetch_min`) for every lease it keeps; every lease started
//! or extended meanwhile lowers it after its holder record is set. All writes are RMWs of one
//! location, so they are totally ordered and each reads the one before: a start whose
//! `fetch_min` precedes the sweep's reset is read by the reset (Release/Acquire), so its
//! holder record, set before, is visible to the scan that follows, which keeps it; a start
//! whose `fetch_min` follows the reset lowers the reset bound itself. Either way no live lease
//! is left out of the bound once the sweep is done.
//!
//! **Markers.** A leased slot's holder record names its lease record instead of a backend:
//! pid `-(index + 1)`, never 0 (no holder) nor positive (a backend).
//!
//! **Tokens.** Every acquisition of any cap takes the next value of the server's counter
//! (`lifecycle::TokenCounter`), which starts at the clock in microseconds times 1,024
//! ([`token_base`]) and is raised above every saved or durable floor: so tokens keep growing
//! across a restart, a crash or a promotion, also when the new server's clock is behind.

use crate::state::CapRef;
use crate::sync::{spin_loop, AtomicI32, AtomicI64, AtomicU32, AtomicU64, Ordering};

const FREE: u32 = 0;
const LIVE: u32 = 1;
const BUSY: u32 = 2;

/// The state word of a lease record (zeroed memory is FREE).
#[repr(transparent)]
#[derive(Default)]
pub struct LeaseState(AtomicU32);

impl LeaseState {
    /// FREE → BUSY: this process may now fill the record, then [`publish`](Self::publish) it.
    pub fn claim(&self) -> bool {
        self.0
            .compare_exchange(FREE, BUSY, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    /// LIVE → BUSY; false if the record is not live (free, or freed meanwhile). Waits out
    /// another process's BUSY.
    pub fn lock(&self) -> bool {
        loop {
            match self
                .0
                .compare_exchange(LIVE, BUSY, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(BUSY) => spin_loop(),
                Err(_) => return false,
            }
        }
    }

    /// BUSY → LIVE: what this process wrote is now the lease (after a claim or a lock).
    pub fn publish(&self) {
        self.0.store(LIVE, Ordering::Release);
    }

    /// BUSY → FREE: the lease is over and the record may be claimed again.
    pub fn free(&self) {
        self.0.store(FREE, Ordering::Release);
    }

    pub fn is_live(&self) -> bool {
        self.0.load(Ordering::Acquire) == LIVE
    }

    pub fn is_free(&self) -> bool {
        self.0.load(Ordering::Acquire) == FREE
    }
}

/// A live lease as the holders view and the sweeps see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseInfo {
    pub slot: u32,
    pub token: u64,
    pub pid: i32,
    /// The role that took the lease.
    pub owner: u32,
    pub acquired_at: i64,
    pub expires_at: i64,
}

/// A lease record: FREE, or LIVE on slot `slot` of the cap `(entry, generation)`, or BUSY
/// while one process reads and changes it (zeroed memory: FREE).
#[repr(C)]
#[derive(Default)]
pub struct LeaseRecord {
    state: LeaseState,
    entry: AtomicU32,
    generation: AtomicU32,
    slot: AtomicU32,
    pid: AtomicI32,
    owner: AtomicU32,
    token: AtomicU64,
    acquired_at: AtomicI64,
    expires_at: AtomicI64,
}

/// A cap's live leases (zeroed memory: none).
#[repr(transparent)]
#[derive(Default)]
pub struct LiveLeases(AtomicU32);

impl LiveLeases {
    pub fn count(&self) -> u32 {
        self.0.load(Ordering::Acquire)
    }

    /// Creating the cap (exclusive directory lock): none.
    pub fn reset(&self) {
        self.0.store(0, Ordering::Relaxed);
    }
}

/// No lease of the cap expires before this (a lower bound; `i64::MAX`: none). Zeroed memory
/// is "due now": the cap's creation calls [`ExpiryBound::reset`].
#[repr(transparent)]
#[derive(Default)]
pub struct ExpiryBound(AtomicI64);

impl ExpiryBound {
    /// Creating the cap (exclusive directory lock): no lease.
    pub fn reset(&self) {
        self.0.store(i64::MAX, Ordering::Relaxed);
    }

    /// Whether a lease of the cap may have expired by `now` (two loads; a hint for the caller
    /// to sweep).
    pub fn due(&self, live: &LiveLeases, now: i64) -> bool {
        live.count() > 0 && self.0.load(Ordering::Acquire) <= now
    }

    /// A lease expires at `t` (started, extended, or kept by a sweep).
    pub fn lower(&self, t: i64) {
        self.0.fetch_min(t, Ordering::SeqCst);
    }

    /// A sweep starts: the bound is "none" until the leases it keeps lower it.
    pub fn begin_sweep(&self) {
        self.0.swap(i64::MAX, Ordering::SeqCst);
    }

    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Acquire)
    }
}

impl LeaseRecord {
    pub fn is_live(&self) -> bool {
        self.state.is_live()
    }

    pub fn is_free(&self) -> bool {
        self.state.is_free()
    }

    /// FREE → BUSY: this process may now [`start`](Self::start) a lease in the record.
    pub fn claim(&self) -> bool {
        self.state.claim()
    }

    /// After [`claim`](Self::claim), the slot's bit claimed: fills the record with the lease
    /// `l` of `cap`, counts it in `live`, publishes it, then runs `mark` (which names the record
    /// in the slot's holder record) and lowers `due` (last: see "Expiry bound").
    pub fn start(
        &self,
        cap: CapRef,
        l: &LeaseInfo,
        live: &LiveLeases,
        mark: impl FnOnce(),
        due: &ExpiryBound,
    ) {
        self.entry.store(cap.entry, Ordering::Relaxed);
        self.generation.store(cap.generation, Ordering::Relaxed);
        self.slot.store(l.slot, Ordering::Relaxed);
        self.pid.store(l.pid, Ordering::Relaxed);
        self.owner.store(l.owner, Ordering::Relaxed);
        self.token.store(l.token, Ordering::Relaxed);
        self.acquired_at.store(l.acquired_at, Ordering::Relaxed);
        self.expires_at.store(l.expires_at, Ordering::Relaxed);
        live.0.fetch_add(1, Ordering::AcqRel);
        self.state.publish();
        mark();
        due.lower(l.expires_at);
    }

    /// The fields (read with the record BUSY, by the process that locked it).
    pub fn info(&self) -> LeaseInfo {
        LeaseInfo {
            slot: self.slot.load(Ordering::Relaxed),
            token: self.token.load(Ordering::Relaxed),
            pid: self.pid.load(Ordering::Relaxed),
            owner: self.owner.load(Ordering::Relaxed),
            acquired_at: self.acquired_at.load(Ordering::Relaxed),
            expires_at: self.expires_at.load(Ordering::Relaxed),
        }
    }

    /// The cap the record names.
    pub fn cap(&self) -> CapRef {
        CapRef {
            entry: self.entry.load(Ordering::Relaxed),
            generation: self.generation.load(Ordering::Relaxed),
        }
    }

    /// LIVE → BUSY; false if the record is not live. Waits out another process's BUSY.
    pub fn lock(&self) -> bool {
        self.state.lock()
    }

    /// Locks the record if it is the live lease of `cap`'s `slot` (found through the slot's
    /// holder record, which may be stale); false, the record left as it was, if not.
    pub fn lock_for(&self, cap: CapRef, slot: u32) -> bool {
        if !self.state.lock() {
            return false;
        }
        if self.cap() != cap || self.slot.load(Ordering::Relaxed) != slot {
            self.state.publish();
            return false;
        }
        true
    }

    /// BUSY → LIVE, unchanged.
    pub fn publish(&self) {
        self.state.publish();
    }

    /// BUSY → FREE without a lease to end (a record whose cap is gone).
    pub fn free(&self) {
        self.state.free();
    }

    /// Locked: the lease now expires at `t`; lowers `due` and publishes.
    pub fn extend(&self, t: i64, due: &ExpiryBound) {
        self.expires_at.store(t, Ordering::Relaxed);
        due.lower(t);
        self.state.publish();
    }

    /// Locked, a sweep at `now`: true if the lease expired (the caller ends it); else it stays,
    /// in `due`, published.
    pub fn sweep(&self, now: i64, due: &ExpiryBound) -> bool {
        let expires_at = self.expires_at.load(Ordering::Relaxed);
        if expires_at <= now {
            return true;
        }
        due.lower(expires_at);
        self.state.publish();
        false
    }

    /// Locked: ends the lease. `unmark` clears the slot's holder record and its bit; the
    /// count goes down; `then` runs (the database's share), and the record is freed last.
    /// Returns the lease as it was.
    pub fn end(
        &self,
        live: &LiveLeases,
        unmark: impl FnOnce(&LeaseInfo),
        then: impl FnOnce(),
    ) -> LeaseInfo {
        let info = self.info();
        unmark(&info);
        live.0.fetch_sub(1, Ordering::AcqRel);
        then();
        self.state.free();
        info
    }
}

/// The holder "pid" that marks a slot as leased through record `index`.
pub fn marker(index: usize) -> i32 {
    -(index as i32) - 1
}

/// The lease record a holder pid names, if it is a lease marker.
pub fn record_of(pid: i32) -> Option<usize> {
    (pid < 0).then(|| (-(pid as i64) - 1) as usize)
}

/// Tokens per microsecond of the clock, as a shift.
pub const TOKENS_PER_MICROSECOND_LOG2: u32 = 10;

/// The clock-based start of the token counter at `now_us` (microseconds of the server's clock).
pub fn token_base(now_us: i64) -> u64 {
    (now_us.max(0) as u64) << TOKENS_PER_MICROSECOND_LOG2
}

#[cfg(all(test, not(loom)))]
mod unit {
    use super::*;
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize};
    use std::sync::{Arc, Mutex};

    #[test]
    fn markers_are_negative_and_round_trip() {
        for i in [0usize, 1, 4095, 1 << 20] {
            let pid = marker(i);
            assert!(pid < 0);
            assert_eq!(record_of(pid), Some(i));
        }
        // A backend's pid (positive) or no holder (0) is not a lease.
        assert_eq!(record_of(0), None);
        assert_eq!(record_of(12345), None);
    }

    #[test]
    fn a_later_clock_base_starts_above_an_earlier_ones_tokens() {
        let earlier = token_base(1_000_000);
        // 1,023 acquisitions per microsecond for a whole second still stay below.
        let taken = earlier + 1_000_000 * 1_023;
        assert!(token_base(2_000_000) > taken);
        assert_eq!(token_base(-5), 0);
    }

    #[test]
    fn transitions() {
        let s = LeaseState::default();
        assert!(s.is_free() && !s.lock(), "a free record cannot be locked");
        assert!(s.claim() && !s.claim(), "one taker");
        s.publish();
        assert!(s.is_live() && !s.claim());
        assert!(s.lock());
        s.publish();
        assert!(s.lock());
        s.free();
        assert!(s.is_free() && !s.lock());
    }

    /// A lease record: state, token and expiry (the fields a renewal and a sweep read together).
    #[derive(Default)]
    struct Record {
        state: LeaseState,
        token: AtomicU64,
        expires_at: AtomicI64,
    }

    /// Takers start leases and later release or renew them by token; a sweeper frees expired
    /// ones; the clock runs. Every lease must end exactly once (by its release or by the
    /// sweep, never both, never neither), a renewal must never revive a lease already ended,
    /// and a locked record's token and expiry must be the pair its writer stored.
    #[test]
    fn renew_release_and_sweep_race_without_losing_or_doubling_a_lease() {
        const RECORDS: usize = 6;
        const TAKERS: usize = 4;
        const ROUNDS: usize = 3_000;
        let records: Arc<Vec<Record>> = Arc::new((0..RECORDS).map(|_| Record::default()).collect());
        let clock = Arc::new(AtomicI64::new(0));
        let next_token = Arc::new(AtomicU64::new(token_base(1)));
        let ended: Arc<Mutex<HashSet<u64>>> = Arc::default();
        let started = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        // The expiry is derived from the token, so a torn pair is visible.
        let expiry_of = |token: u64, at: i64| at + (token % 7) as i64 + 1;

        let sweeper = {
            let (records, clock, ended, stop) =
                (records.clone(), clock.clone(), ended.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    clock.fetch_add(1, Ordering::Relaxed);
                    let now = clock.load(Ordering::Relaxed);
                    for r in records.iter() {
                        if !r.state.lock() {
                            continue;
                        }
                        if r.expires_at.load(Ordering::Relaxed) <= now {
                            let t = r.token.load(Ordering::Relaxed);
                            assert!(ended.lock().unwrap().insert(t), "token {t} ended twice");
                            r.state.free();
                        } else {
                            r.state.publish();
                        }
                    }
                }
            })
        };
        let takers: Vec<_> = (0..TAKERS)
            .map(|me| {
                let (records, clock, next_token, ended, started) = (
                    records.clone(),
                    clock.clone(),
                    next_token.clone(),
                    ended.clone(),
                    started.clone(),
                );
                std::thread::spawn(move || {
                    for round in 0..ROUNDS {
                        let Some(i) = (0..RECORDS).find(|&i| records[i].state.claim()) else {
                            std::thread::yield_now();
                            continue;
                        };
                        let r = &records[i];
                        let token = next_token.fetch_add(1, Ordering::Relaxed) + 1;
                        let at = clock.load(Ordering::Relaxed);
                        r.token.store(token, Ordering::Relaxed);
                        r.expires_at.store(expiry_of(token, at), Ordering::Relaxed);
                        r.state.publish();
                        started.fetch_add(1, Ordering::Relaxed);
                        for _ in 0..(round + me) % 5 {
                            std::thread::yield_now();
                        }
                        // Renew once in a while, then release by token.
                        for renew in [round % 3 == 0, false] {
                            if !r.state.lock() {
                                break; // swept (and maybe reused): not ours any more
                            }
                            let (t, e) = (
                                r.token.load(Ordering::Relaxed),
                                r.expires_at.load(Ordering::Relaxed),
                            );
                            if t != token {
                                r.state.publish(); // someone else's lease now
                                break;
                            }
                            assert!(e > 0 && (e - 1 - (t % 7) as i64) >= 0, "torn record");
                            if renew {
                                let now = clock.load(Ordering::Relaxed);
                                r.expires_at.store(expiry_of(t, now), Ordering::Relaxed);
                                r.state.publish();
                            } else {
                                assert!(ended.lock().unwrap().insert(t), "token {t} ended twice");
                                r.state.free();
                            }
                        }
                    }
                })
            })
            .collect();
        for t in takers {
            t.join().unwrap();
        }
        // Let the sweeper end what is left, then stop it.
        while records.iter().any(|r| !r.state.is_free()) {
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
        sweeper.join().unwrap();
        let started = started.load(Ordering::Relaxed);
        assert!(started > ROUNDS, "the race ran ({started} leases)");
        assert_eq!(
            ended.lock().unwrap().len(),
            started,
            "every lease ended exactly once"
        );
    }
}

/// The lease steps as the extension runs them (`shmem::leases`), over one cap's bits, holder
/// records, lease records, count and bound. For the tests.
#[cfg(test)]
mod run {
    use super::*;
    use crate::holder::SlotRecord;
    use crate::occupancy;

    pub(super) struct Cap {
        pub(super) at: CapRef,
        pub(super) bits: Vec<AtomicU64>,
        pub(super) holders: Vec<SlotRecord>,
        pub(super) records: Vec<LeaseRecord>,
        pub(super) live: LiveLeases,
        pub(super) due: ExpiryBound,
        /// The checks: per slot the token of its lease (0: none), set when the holder record
        /// is set and taken back when it is cleared; per token how often its lease ended.
        owner: Vec<AtomicU64>,
        pub(super) ended: Vec<AtomicU32>,
    }

    impl Cap {
        pub(super) fn new(slots: u32, records: usize, tokens: usize) -> Cap {
            let c = Cap {
                at: CapRef {
                    entry: 3,
                    generation: 1,
                },
                bits: (0..crate::occupancy::words_for(slots))
                    .map(|_| AtomicU64::new(0))
                    .collect(),
                holders: (0..slots).map(|_| SlotRecord::default()).collect(),
                records: (0..records).map(|_| LeaseRecord::default()).collect(),
                live: LiveLeases::default(),
                due: ExpiryBound::default(),
                owner: (0..slots).map(|_| AtomicU64::new(0)).collect(),
                ended: (0..tokens).map(|_| AtomicU32::new(0)).collect(),
            };
            c.live.reset();
            c.due.reset();
            c
        }

        /// `stage_e_lease`: a free slot of `[0, n)` and a record, or None.
        pub(super) fn take(&self, n: u32, pid: i32, token: u64, expires_at: i64) -> Option<u32> {
            let claim = occupancy::claim_first_free(&self.bits, 0, n)?;
            let len = self.records.len();
            let from = pid.unsigned_abs() as usize % len;
            let i = (from..len)
                .chain(0..from)
                .find(|&i| self.records[i].claim())?;
            let slot = claim.keep();
            let l = LeaseInfo {
                slot,
                token,
                pid,
                owner: 10,
                acquired_at: 0,
                expires_at,
            };
            self.records[i].start(
                self.at,
                &l,
                &self.live,
                || {
                    let was = self.owner[slot as usize].swap(token, Ordering::SeqCst);
                    assert_eq!(was, 0, "slot {slot} leased by {token} while {was} held it");
                    self.holders[slot as usize].set(marker(i), 0);
                },
                &self.due,
            );
            Some(slot)
        }

        /// The live lease of `slot`, locked, if any (`with_lease`).
        pub(super) fn locked(&self, slot: u32) -> Option<&LeaseRecord> {
            let i = record_of(self.holders[slot as usize].get().0)?;
            let r = self.records.get(i)?;
            r.lock_for(self.at, slot).then_some(r)
        }

        /// `end_lease`.
        pub(super) fn end(&self, r: &LeaseRecord) -> LeaseInfo {
            r.end(
                &self.live,
                |l| {
                    let was = self.owner[l.slot as usize].swap(0, Ordering::SeqCst);
                    assert_eq!(was, l.token, "slot {} ended for another lease", l.slot);
                    let times = self.ended[l.token as usize].fetch_add(1, Ordering::SeqCst);
                    assert_eq!(times, 0, "lease {} ended twice", l.token);
                    self.holders[l.slot as usize].clear();
                    occupancy::clear(&self.bits, l.slot);
                },
                || {},
            )
        }

        /// Release by token (`settle_lease` with no extension): the lease if it was ours.
        pub(super) fn release(&self, slot: u32, token: u64) -> Option<LeaseInfo> {
            let r = self.locked(slot)?;
            if r.info().token != token {
                r.publish();
                return None;
            }
            Some(self.end(r))
        }

        /// `expire_leases`: ends those expired by `now`.
        pub(super) fn sweep(&self, now: i64) -> Vec<LeaseInfo> {
            self.due.begin_sweep();
            let mut out = Vec::new();
            for slot in 0..self.holders.len() as u32 {
                if let Some(r) = self.locked(slot) {
                    if r.sweep(now, &self.due) {
                        out.push(self.end(r));
                    }
                }
            }
            out
        }
    }
}

/// Model checks: no slot or record is claimed twice, every lease ends exactly once, and the
/// expiry bound never leaves a live lease out.
#[cfg(all(test, loom))]
mod model {
    use super::run::Cap;
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// Two takers lease the one slot (each then releases by token) while a sweeper at time 15
    /// ends what expired (the first taker's lease expires at 10, the second's at 20). The slot
    /// never has two leases, every lease ends once (by its release or by the sweep), and at
    /// the end the slot, the records and the count are free.
    #[test]
    fn no_slot_is_leased_twice_and_every_lease_ends_once() {
        crate::sync::model(|| {
            let c = Arc::new(Cap::new(1, 2, 3));
            let takers: Vec<_> = [1u64, 2]
                .map(|token| {
                    let c = c.clone();
                    thread::spawn(move || {
                        let taken = c.take(1, token as i32, token, 10 * token as i64);
                        if let Some(slot) = taken {
                            c.release(slot, token);
                        }
                        (token, taken.is_some())
                    })
                })
                .into_iter()
                .collect();
            for l in c.sweep(15) {
                assert!(l.expires_at <= 15);
            }
            for t in takers {
                // Every lease taken ended exactly once (`end` checks "not twice").
                let (token, taken) = t.join().unwrap();
                let ended = c.ended[token as usize].load(Ordering::SeqCst);
                assert_eq!(ended, u32::from(taken), "lease {token} ended {ended} times");
            }
            assert_eq!(c.bits[0].load(Ordering::SeqCst), 0);
            assert_eq!(c.live.count(), 0);
            assert!(c.records.iter().all(LeaseRecord::is_free));
            assert_eq!(c.holders[0].get().0, 0);
        });
    }

    /// A lease starts (expiring at 10) and another is extended (to 30) while a sweep at 5
    /// runs: when all is done the bound is at most every live lease's expiry.
    #[test]
    fn the_expiry_bound_never_leaves_a_live_lease_out() {
        crate::sync::model(|| {
            let c = Arc::new(Cap::new(2, 2, 3));
            assert_eq!(c.take(2, 1, 1, 20), Some(0));
            let starter = {
                let c = c.clone();
                thread::spawn(move || assert_eq!(c.take(2, 2, 2, 10), Some(1)))
            };
            let extender = {
                let c = c.clone();
                thread::spawn(move || {
                    let r = c.locked(0).expect("live");
                    r.extend(30, &c.due);
                })
            };
            assert!(c.sweep(5).is_empty());
            starter.join().unwrap();
            extender.join().unwrap();
            let due = c.due.get();
            for r in c.records.iter().filter(|r| r.is_live()) {
                let e = r.info().expires_at;
                assert!(due <= e, "bound {due} leaves out a lease expiring at {e}");
            }
        });
    }
}

#[cfg(all(test, not(loom)))]
mod records {
    use super::run::Cap;
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicI64};
    use std::sync::Arc;

    /// Takers lease slots of a cap and release them by token (some after their expiry), a
    /// sweeper ends the expired ones, the clock runs: the checks of `run::Cap` (a slot never
    /// leased twice, a lease never ended twice) hold, every lease taken ends exactly once, and
    /// the bound never leaves a live lease out when the sweeper is done.
    #[test]
    fn takers_releases_and_sweeps_race_without_losing_or_doubling_a_lease() {
        const TAKERS: u64 = 4;
        const ROUNDS: u64 = 2_000;
        let c = Arc::new(Cap::new(3, 4, (TAKERS * ROUNDS + 1) as usize));
        let clock = Arc::new(AtomicI64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let sweeper = {
            let (c, clock, stop) = (c.clone(), clock.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut swept = 0;
                while !stop.load(Ordering::Relaxed) {
                    let now = clock.fetch_add(1, Ordering::Relaxed) + 1;
                    swept += c.sweep(now).len();
                }
                swept
            })
        };
        let takers: Vec<_> = (0..TAKERS)
            .map(|me| {
                let (c, clock) = (c.clone(), clock.clone());
                std::thread::spawn(move || {
                    let mut taken = Vec::new();
                    for round in 0..ROUNDS {
                        let token = me * ROUNDS + round + 1;
                        let expires = clock.load(Ordering::Relaxed) + (token % 3) as i64;
                        let Some(slot) = c.take(3, me as i32 + 1, token, expires) else {
                            std::thread::yield_now();
                            continue;
                        };
                        taken.push(token);
                        if round % 4 == 0 {
                            if let Some(r) = c.locked(slot) {
                                if r.info().token == token {
                                    r.extend(expires + 2, &c.due);
                                } else {
                                    r.publish();
                                }
                            }
                        }
                        std::thread::yield_now();
                        c.release(slot, token);
                    }
                    taken
                })
            })
            .collect();
        let taken: Vec<u64> = takers.into_iter().flat_map(|t| t.join().unwrap()).collect();
        stop.store(true, Ordering::Relaxed);
        let swept = sweeper.join().unwrap();
        assert!(
            taken.len() as u64 > ROUNDS,
            "the race ran ({} leases)",
            taken.len()
        );
        for t in &taken {
            assert_eq!(c.ended[*t as usize].load(Ordering::SeqCst), 1, "lease {t}");
        }
        let ended: u32 = c.ended.iter().map(|e| e.load(Ordering::SeqCst)).sum();
        assert_eq!(ended as usize, taken.len());
        assert!(swept > 0 || taken.len() as u64 == TAKERS * ROUNDS);
        assert_eq!(c.live.count(), 0);
        assert!(c.records.iter().all(LeaseRecord::is_free));
        assert_eq!(c.bits[0].load(Ordering::SeqCst), 0);
    }

    #[test]
    fn the_bound_follows_starts_extensions_and_sweeps() {
        let c = Cap::new(2, 2, 4);
        assert!(!c.due.due(&c.live, i64::MAX - 1), "no lease");
        assert_eq!(c.take(2, 1, 1, 50), Some(0));
        assert_eq!(c.take(2, 2, 2, 40), Some(1));
        assert_eq!(c.due.get(), 40);
        assert!(c.due.due(&c.live, 40) && !c.due.due(&c.live, 39));
        let r = c.locked(1).expect("live");
        assert_eq!(r.info().token, 2);
        r.extend(60, &c.due);
        assert!(c.sweep(45).is_empty());
        assert_eq!(
            c.due.get(),
            50,
            "the sweep set the bound to the next expiry"
        );
        assert_eq!(c.release(0, 9), None, "another token");
        let ended = c.sweep(55);
        assert_eq!(ended.iter().map(|l| l.token).collect::<Vec<_>>(), [1]);
        assert_eq!((c.live.count(), c.due.get()), (1, 60));
        assert_eq!(c.release(1, 2).map(|l| l.expires_at), Some(60));
        assert_eq!(c.live.count(), 0);
    }
}

// Layout, for the extension's segment (a lease record is 48 bytes) and cap entry.
#[cfg(not(all(test, loom)))]
const _: () = assert!(
    size_of::<LeaseRecord>() == 48 && size_of::<LiveLeases>() == 4 && size_of::<ExpiryBound>() == 8
);
