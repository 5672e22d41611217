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
//! **Markers.** A leased slot's holder record names its lease record instead of a backend:
//! pid `-(index + 1)`, never 0 (no holder) nor positive (a backend).
//!
//! **Tokens.** Every acquisition of any cap takes the next value of the server's counter
//! (`lifecycle::TokenCounter`), which starts at the clock in microseconds times 1,024
//! ([`token_base`]) and is raised above every saved or durable floor: so tokens keep growing
//! across a restart, a crash or a promotion, also when the new server's clock is behind.

use crate::sync::{spin_loop, AtomicU32, Ordering};

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
