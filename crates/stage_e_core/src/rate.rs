//! Rate limits: the generic cell rate algorithm (GCRA) over a table of keys in shared memory.
//!
//! **The algorithm.** A key's whole state is one *theoretical arrival time* (TAT, nanoseconds of
//! a clock that never steps back). With the emission interval `T = per / count` (rounded up, so
//! rounding never admits more) and a burst of `b`, a call of cost `c` at `now` computes
//! `tat' = max(tat, now) + c·T` and is allowed iff `tat' ≤ now + b·T`; only an allowed call
//! stores `tat'` (a denied call charges nothing). A key whose TAT has passed is the same as a
//! key never seen, which is what lets idle keys be reclaimed. No windows: no 2x burst at a
//! window's edge, and the parameters may differ from call to call (the state is a time).
//!
//! **The table.** Records of 24 bytes `(tag, tat, db)` in buckets of [`BUCKET`]; a key is a
//! 64-bit SipHash digest of its database and name under a secret of the segment ([`digest`],
//! never 0, which marks an empty record), and may live in either of two buckets (two-choice
//! hashing: at the table's load of at most one half, a full pair is not a practical event).
//! The table has two records per key the setting allows; a key costs 48 bytes and a lock word
//! of 4 per 8 records.
//!
//! **Protocol.** Every store to a record's `tat` is strictly greater than the last value that
//! was not [`BUSY`] (a charge adds at least 1 ns; a claim and an emptying store more than the
//! old value), so a CAS from a value read is an ABA-free proof that nothing touched the record
//! since: that value, and the tag read after it, are still the record's.
//! - *charge* (lock-free, the hot path): read `tag == d`, read `tat` (Acquire), read `tag`
//!   again; CAS `tat → tat'`. `BUSY` or a changed tag: look the key up again.
//! - *claim* (a key not found, whose first call is allowed): under the claim locks of both its
//!   buckets (taken in index order; every claim of one key takes the same two, so a key is never
//!   in two records), look again, then take an empty record, else an idle one (`tat ≤ now`),
//!   by CAS `tat → BUSY`; write `db`, `tag`, then `tat` (Release).
//! - *emptying* (idle records, when the table or a database's share is full): CAS `tat → BUSY`
//!   from an idle value, write tag 0, then `tat + 1` (Release). Needs no lock: it adds no key.
//!
//! Room: [`Room`] counts records per database (the server's `database_share`) and in all;
//! a claim that would take more is refused after idle records are emptied ([`Full`]).

use crate::sync::{spin_loop, yield_now, AtomicU32, AtomicU64, Ordering};

/// Records per bucket (a key looks at two buckets: 16 records).
pub const BUCKET: usize = 8;
/// A record being claimed or emptied: chargers wait and look again.
pub const BUSY: u64 = u64::MAX;
/// Nanoseconds in a day: the longest `per`.
pub const MAX_PER_NS: u64 = 86_400_000_000_000;

/// One key's record: 24 bytes, no padding (`#[repr(C)]`: its size is the table's budget).
#[repr(C)]
#[derive(Default)]
pub struct RateRecord {
    /// The key's digest; 0: empty.
    pub tag: AtomicU64,
    /// Theoretical arrival time, ns of the monotonic clock; [`BUSY`] while claimed or emptied.
    pub tat: AtomicU64,
    /// The key's database (what its room is counted against).
    pub db: AtomicU32,
    _spare: AtomicU32,
}

/// Records for a setting of `keys` keys: two per key, in whole buckets (at least two).
pub fn records_for(keys: u32) -> usize {
    (2 * keys as usize).next_multiple_of(BUCKET).max(2 * BUCKET)
}

/// Whose key a digest names: a key of `stage_e_try_rate`, or a cap's own rate (a policy's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Space {
    Key = 0,
    Cap = 1,
    /// A fair share's name (`fair::Share::digest`).
    Share = 2,
}

/// The digest of key `name` of database `db` in `space` under `secret` (SipHash-1-3): never 0.
pub fn digest(secret: [u64; 2], db: u32, space: Space, name: &[u8]) -> u64 {
    use siphasher::sip::SipHasher13;
    use std::hash::Hasher;
    let mut h = SipHasher13::new_with_keys(secret[0], secret[1]);
    h.write(&db.to_le_bytes());
    h.write_u8(space as u8);
    h.write(name);
    h.finish().max(1)
}

/// A rate: the emission interval `T` and the burst, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    /// `per / count`, rounded up, in ns (at least 1).
    pub interval: u64,
    pub burst: u32,
}

/// Why a rate or a call's cost is refused (the server's SQLSTATE 22023 and its words).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadRate {
    Count,
    Per,
    Burst,
    Cost,
    /// `cost > burst`: such a call could never be allowed.
    CostAboveBurst,
}

impl Rate {
    /// `count` calls per `per_ns`, with a burst of `burst`.
    pub fn new(count: i32, per_ns: i64, burst: i32) -> Result<Rate, BadRate> {
        if count < 1 {
            return Err(BadRate::Count);
        }
        if per_ns < 1 || per_ns as u64 > MAX_PER_NS {
            return Err(BadRate::Per);
        }
        if burst < 1 {
            return Err(BadRate::Burst);
        }
        Ok(Rate {
            interval: (per_ns as u64).div_ceil(count as u64).max(1),
            burst: burst as u32,
        })
    }

    /// A call's cost, checked against this rate.
    pub fn cost(&self, cost: i32) -> Result<u32, BadRate> {
        match cost {
            c if c < 1 => Err(BadRate::Cost),
            c if c as u32 > self.burst => Err(BadRate::CostAboveBurst),
            c => Ok(c as u32),
        }
    }

    /// `k · T`, saturating below [`BUSY`].
    fn times(&self, k: u64) -> u64 {
        (k as u128 * self.interval as u128).min((BUSY - 1) as u128) as u64
    }

    /// The TAT of a key that spent its whole burst at `since` (a start after a crash).
    pub fn spent_at(&self, since: u64) -> u64 {
        since
            .saturating_add(self.times(self.burst as u64))
            .min(BUSY - 1)
    }
}

/// What a call learns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    /// Calls of cost 1 allowed right after this one (at most the burst).
    pub remaining: u32,
    /// Denied: ns until this call would be allowed.
    pub retry_after: Option<u64>,
    /// ns until the key is back to a full burst.
    pub reset_after: u64,
    /// The TAT to store when allowed.
    tat: u64,
}

/// GCRA: a call of `cost` at `now` on a key whose TAT is `tat`.
pub fn decide(tat: u64, now: u64, rate: Rate, cost: u32) -> Decision {
    let start = tat.max(now);
    let next = start.saturating_add(rate.times(cost as u64)).min(BUSY - 1);
    let horizon = now.saturating_add(rate.times(rate.burst as u64));
    // `next > start`: a TAT at the ceiling of the clock admits nothing (fail closed).
    let allowed = next <= horizon && next > start;
    let after = if allowed { next } else { start };
    Decision {
        allowed,
        remaining: (horizon.saturating_sub(after) / rate.interval).min(rate.burst as u64) as u32,
        retry_after: (!allowed).then(|| next.saturating_sub(horizon).max(1)),
        reset_after: after.saturating_sub(now),
        tat: next,
    }
}

/// A call on a key of the table.
#[derive(Clone, Copy, Debug)]
pub struct Call {
    /// The key's [`digest`].
    pub key: u64,
    pub db: u32,
    /// ns of the clock that never steps back.
    pub now: u64,
    pub rate: Rate,
    /// Checked by [`Rate::cost`].
    pub cost: u32,
    /// The TAT of a key not in the table: `now`, or a spent burst after a crash
    /// ([`Rate::spent_at`]).
    pub fresh: u64,
}

impl Call {
    /// A call of cost 1 on a key whose absence means a full burst.
    pub fn new(key: u64, db: u32, now: u64, rate: Rate) -> Call {
        Call {
            key,
            db,
            now,
            rate,
            cost: 1,
            fresh: now,
        }
    }

    pub fn cost(self, cost: u32) -> Call {
        Call { cost, ..self }
    }

    pub fn fresh(self, fresh: u64) -> Call {
        Call { fresh, ..self }
    }
}

/// Counts records per database: the server's pools and shares.
pub trait Room {
    /// A record for database `db` is taken; false when it is at its share or the pool is full.
    fn take(&self, db: u32) -> bool;
    /// A record of database `db` is given back.
    fn give(&self, db: u32);
}

/// The table is full, or the database at its share, even after idle keys were emptied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Full;

/// The table over a segment's records and bucket locks.
pub struct Table<'a> {
    records: &'a [RateRecord],
    locks: &'a [AtomicU32],
}

impl<'a> Table<'a> {
    /// `records.len()` is a multiple of [`BUCKET`] (at least two buckets), one lock a bucket.
    pub fn over(records: &'a [RateRecord], locks: &'a [AtomicU32]) -> Table<'a> {
        assert!(records.len() >= 2 * BUCKET && records.len().is_multiple_of(BUCKET));
        assert_eq!(locks.len(), records.len() / BUCKET);
        Table { records, locks }
    }

    /// The two buckets of digest `d`, in index order.
    fn buckets(&self, d: u64) -> [usize; 2] {
        let n = self.locks.len();
        let a = (d % n as u64) as usize;
        let mut b = (d.rotate_left(32).wrapping_mul(0x9E37_79B9_7F4A_7C15) % n as u64) as usize;
        if b == a {
            b = (a + 1) % n;
        }
        [a.min(b), a.max(b)]
    }

    fn bucket(&self, b: usize) -> &'a [RateRecord] {
        &self.records[b * BUCKET..(b + 1) * BUCKET]
    }

    fn find(&self, d: u64) -> Option<&'a RateRecord> {
        self.buckets(d)
            .into_iter()
            .flat_map(|b| self.bucket(b))
            .find(|r| r.tag.load(Ordering::Acquire) == d)
    }

    /// A call: decides and, when allowed, charges, in one step.
    pub fn charge(&self, call: &Call, room: &dyn Room) -> Result<Decision, Full> {
        let &Call {
            key: d,
            db,
            now,
            rate,
            cost,
            fresh,
        } = call;
        let mut emptied = false;
        loop {
            if let Some(r) = self.find(d) {
                match charge_record(r, d, now, rate, cost) {
                    Some(decision) => return Ok(decision),
                    None => continue, // claimed or emptied meanwhile: look again
                }
            }
            let decision = decide(fresh, now, rate, cost);
            if !decision.allowed {
                return Ok(decision); // a denied call makes no key
            }
            match self.claim(d, db, now, decision.tat, room) {
                Claimed::Done => return Ok(decision),
                Claimed::Exists => continue,
                Claimed::NoRoom if !emptied => {
                    self.empty_idle(now, room);
                    emptied = true;
                }
                Claimed::NoRoom => return Err(Full),
            }
        }
    }

    /// What a call would be told now, charging nothing (a key not in the table has `fresh`).
    /// The answer may be stale by the time of a charge: only [`Table::charge`] decides.
    pub fn peek(&self, call: &Call) -> Decision {
        let tat = loop {
            match self.find(call.key) {
                None => break call.fresh,
                Some(r) => {
                    let t = r.tat.load(Ordering::Acquire);
                    if t != BUSY && r.tag.load(Ordering::Relaxed) == call.key {
                        break t;
                    }
                    spin_loop(); // claimed or emptied meanwhile: look again
                }
            }
        };
        decide(tat, call.now, call.rate, call.cost)
    }

    fn claim(&self, d: u64, db: u32, now: u64, tat: u64, room: &dyn Room) -> Claimed {
        let [a, b] = self.buckets(d);
        let _locks = (self.lock(a), self.lock(b));
        if self.find(d).is_some() {
            return Claimed::Exists;
        }
        loop {
            // An empty record first, of the bucket with more of them (two-choice hashing
            // keeps the buckets even only if each key goes to the emptier); else an idle one.
            let empties = |b: usize| {
                self.bucket(b)
                    .iter()
                    .filter(|r| r.tag.load(Ordering::Relaxed) == 0)
                    .count()
            };
            let order = if empties(b) > empties(a) {
                [b, a]
            } else {
                [a, b]
            };
            let pick = order
                .into_iter()
                .flat_map(|b| self.bucket(b))
                .map(|r| {
                    (
                        r,
                        r.tat.load(Ordering::Acquire),
                        r.tag.load(Ordering::Acquire),
                    )
                })
                .filter(|&(_, t, tag)| t != BUSY && (tag == 0 || t <= now))
                .min_by_key(|&(_, _, tag)| tag != 0);
            let Some((r, old, _)) = pick else {
                return Claimed::NoRoom;
            };
            if r.tat
                .compare_exchange(old, BUSY, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                continue; // charged or emptied meanwhile: pick again
            }
            let (old_tag, old_db) = (r.tag.load(Ordering::Relaxed), r.db.load(Ordering::Relaxed));
            let same_db = old_tag != 0 && old_db == db;
            if !same_db && !room.take(db) {
                // Untouched (tag, db and TAT as they were): the same value back is no ABA.
                r.tat.store(old, Ordering::Release);
                return Claimed::NoRoom;
            }
            if old_tag != 0 && !same_db {
                room.give(old_db);
            }
            r.db.store(db, Ordering::Relaxed);
            r.tag.store(d, Ordering::Relaxed);
            r.tat.store(tat.max(old + 1), Ordering::Release);
            return Claimed::Done;
        }
    }

    /// Empties every record idle at `now`, giving its room back; returns how many.
    pub fn empty_idle(&self, now: u64, room: &dyn Room) -> usize {
        let mut n = 0;
        for r in self.records {
            let t = r.tat.load(Ordering::Acquire);
            if t == BUSY || t > now || r.tag.load(Ordering::Acquire) == 0 {
                continue;
            }
            if r.tat
                .compare_exchange(t, BUSY, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            let (tag, db) = (r.tag.load(Ordering::Relaxed), r.db.load(Ordering::Relaxed));
            if tag != 0 {
                r.tag.store(0, Ordering::Relaxed);
                room.give(db);
                n += 1;
            }
            r.tat.store(t + 1, Ordering::Release);
        }
        n
    }

    /// Every key not idle at `now`: `(digest, db, tat)` (what a clean shutdown saves).
    pub fn live(&self, now: u64) -> impl Iterator<Item = (u64, u32, u64)> + 'a {
        self.records.iter().filter_map(move |r| {
            let t = r.tat.load(Ordering::Acquire);
            let tag = r.tag.load(Ordering::Acquire);
            (tag != 0 && t != BUSY && t > now).then(|| (tag, r.db.load(Ordering::Relaxed), t))
        })
    }

    /// Puts back a saved key (at start, before any call; a key that finds no room is dropped:
    /// false).
    pub fn restore(&self, d: u64, db: u32, tat: u64, room: &dyn Room) -> bool {
        tat != BUSY && matches!(self.claim(d, db, 0, tat, room), Claimed::Done)
    }

    /// Live keys of database `db` (`None`: of all).
    pub fn count(&self, db: Option<u32>, now: u64) -> usize {
        self.live(now)
            .filter(|&(_, d, _)| db.is_none_or(|db| db == d))
            .count()
    }

    fn lock(&self, b: usize) -> BucketLock<'a> {
        let word = &self.locks[b];
        let mut spins = 0u32;
        while word
            .compare_exchange_weak(0, 1, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            spins += 1;
            if spins < 64 {
                spin_loop();
            } else {
                yield_now(); // its holder may be off the CPU
            }
        }
        BucketLock(word)
    }
}

enum Claimed {
    Done,
    Exists,
    NoRoom,
}

struct BucketLock<'a>(&'a AtomicU32);

impl Drop for BucketLock<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Release);
    }
}

/// Charges record `r`, believed to be key `d`'s: None when it was claimed or emptied meanwhile.
fn charge_record(r: &RateRecord, d: u64, now: u64, rate: Rate, cost: u32) -> Option<Decision> {
    loop {
        let t = r.tat.load(Ordering::Acquire);
        if t == BUSY {
            spin_loop();
            return None;
        }
        if r.tag.load(Ordering::Relaxed) != d {
            return None;
        }
        let decision = decide(t, now, rate, cost);
        if !decision.allowed {
            return Some(decision);
        }
        if r.tat
            .compare_exchange(t, decision.tat, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return Some(decision);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize as StdCount;
    use std::sync::Mutex;

    const SEC: u64 = 1_000_000_000;

    pub(super) struct Pool {
        pub limit: usize,
        pub share: usize,
        pub per_db: Mutex<std::collections::HashMap<u32, usize>>,
        pub all: StdCount,
    }

    impl Pool {
        pub fn new(limit: usize, share: usize) -> Pool {
            Pool {
                limit,
                share,
                per_db: Mutex::default(),
                all: StdCount::new(0),
            }
        }
    }

    impl Room for Pool {
        fn take(&self, db: u32) -> bool {
            let mut m = self.per_db.lock().unwrap();
            let used = m.entry(db).or_default();
            if *used >= self.share || self.all.load(Ordering::Relaxed) >= self.limit {
                return false;
            }
            *used += 1;
            self.all.fetch_add(1, Ordering::Relaxed);
            true
        }
        fn give(&self, db: u32) {
            *self.per_db.lock().unwrap().get_mut(&db).unwrap() -= 1;
            self.all.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn table(keys: u32) -> (Vec<RateRecord>, Vec<AtomicU32>) {
        let n = records_for(keys);
        (
            (0..n).map(|_| RateRecord::default()).collect(),
            (0..n / BUCKET).map(|_| AtomicU32::new(0)).collect(),
        )
    }

    fn rate(count: i32, per_ns: i64, burst: i32) -> Rate {
        Rate::new(count, per_ns, burst).unwrap()
    }

    #[test]
    fn a_record_is_24_bytes() {
        assert_eq!(size_of::<RateRecord>(), 24);
        // Two records a key and a lock word per bucket: within 64 bytes a key.
        assert!(2 * size_of::<RateRecord>() + 2 * 4 / BUCKET <= 64);
    }

    #[test]
    fn bad_rates_and_costs_are_refused() {
        assert_eq!(Rate::new(0, SEC as i64, 1), Err(BadRate::Count));
        assert_eq!(Rate::new(1, 0, 1), Err(BadRate::Per));
        assert_eq!(Rate::new(1, MAX_PER_NS as i64 + 1, 1), Err(BadRate::Per));
        assert_eq!(Rate::new(1, SEC as i64, 0), Err(BadRate::Burst));
        let r = rate(10, SEC as i64, 3);
        assert_eq!(r.cost(0), Err(BadRate::Cost));
        assert_eq!(r.cost(4), Err(BadRate::CostAboveBurst));
        assert_eq!(r.cost(3), Ok(3));
        assert_eq!(rate(3, SEC as i64, 1).interval, 333_333_334, "rounded up");
        assert_eq!(rate(i32::MAX, 1, 1).interval, 1);
    }

    #[test]
    fn gcra_allows_the_burst_then_one_per_interval() {
        let r = rate(10, SEC as i64, 3); // T = 100 ms
        let mut tat = 0;
        let now = 10 * SEC;
        for left in [2, 1, 0] {
            let d = decide(tat, now, r, 1);
            assert!(d.allowed);
            assert_eq!(d.remaining, left);
            assert_eq!(d.retry_after, None);
            tat = d.tat;
        }
        assert_eq!(decide(tat, now, r, 1).reset_after, 300_000_000);
        let denied = decide(tat, now, r, 1);
        assert!(!denied.allowed);
        assert_eq!(denied.retry_after, Some(100_000_000));
        assert_eq!(denied.remaining, 0);
        assert!(!decide(tat, now + 99_999_999, r, 1).allowed);
        assert!(decide(tat, now + 100_000_000, r, 1).allowed);
        // A cost of 2 needs two intervals back; it is told how long.
        let d = decide(tat, now + 100_000_000, r, 2);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(100_000_000));
        assert_eq!(d.remaining, 1);
    }

    #[test]
    fn a_peek_charges_nothing_and_tells_what_a_charge_would() {
        let (recs, locks) = table(16);
        let t = Table::over(&recs, &locks);
        let pool = Pool::new(16, 16);
        let r = rate(1, SEC as i64, 2);
        let call = Call::new(11, 1, SEC, r);
        for _ in 0..3 {
            assert!(t.peek(&call).allowed, "a peek charged");
        }
        assert_eq!(t.peek(&call), t.charge(&call, &pool).unwrap());
        assert!(t.charge(&call, &pool).unwrap().allowed);
        assert!(!t.peek(&call).allowed);
        assert_eq!(t.peek(&call), t.charge(&call, &pool).unwrap());
    }

    #[test]
    fn a_key_whose_tat_has_passed_is_a_new_key() {
        let r = rate(5, SEC as i64, 4);
        assert_eq!(decide(3 * SEC, 100 * SEC, r, 1), decide(0, 100 * SEC, r, 1));
        assert_eq!(decide(0, 100 * SEC, r, 1).remaining, 3);
    }

    #[test]
    fn a_spent_burst_after_a_crash_allows_one_per_interval() {
        let r = rate(10, SEC as i64, 5);
        let start = 50 * SEC;
        let fresh = r.spent_at(start);
        assert!(!decide(fresh, start, r, 1).allowed);
        assert!(decide(fresh, start + r.interval, r, 1).allowed);
        assert_eq!(decide(fresh, start + 5 * r.interval, r, 1).remaining, 4);
    }

    #[test]
    fn huge_values_saturate_and_admit_nothing_at_the_ceiling() {
        let r = rate(1, MAX_PER_NS as i64, i32::MAX);
        let d = decide(0, 1, r, 1);
        assert!(d.allowed);
        let stuck = decide(BUSY - 1, 1, r, 1);
        assert!(
            !stuck.allowed,
            "a TAT at the clock's ceiling admits nothing"
        );
    }

    #[test]
    fn the_table_counts_each_key_apart_and_denied_calls_charge_nothing() {
        let (recs, locks) = table(64);
        let t = Table::over(&recs, &locks);
        let pool = Pool::new(64, 64);
        let r = rate(1, SEC as i64, 2);
        let now = 5 * SEC;
        for _ in 0..2 {
            assert!(t.charge(&Call::new(7, 1, now, r), &pool).unwrap().allowed);
        }
        for _ in 0..5 {
            assert!(!t.charge(&Call::new(7, 1, now, r), &pool).unwrap().allowed);
        }
        assert!(t.charge(&Call::new(8, 1, now, r), &pool).unwrap().allowed);
        assert_eq!(t.count(Some(1), now), 2);
        assert!(
            t.charge(&Call::new(7, 1, now + SEC, r).fresh(now), &pool)
                .unwrap()
                .allowed
        );
        assert!(
            !t.charge(&Call::new(7, 1, now + SEC, r).fresh(now), &pool)
                .unwrap()
                .allowed
        );
    }

    #[test]
    fn a_full_database_reclaims_its_idle_keys_then_is_refused() {
        let (recs, locks) = table(64);
        let t = Table::over(&recs, &locks);
        let pool = Pool::new(64, 4);
        let r = rate(1, SEC as i64, 1);
        for k in 1..=4 {
            assert!(t.charge(&Call::new(k, 9, 0, r), &pool).unwrap().allowed);
        }
        assert_eq!(t.charge(&Call::new(5, 9, 0, r), &pool), Err(Full));
        assert!(
            t.charge(&Call::new(50, 10, 0, r), &pool).unwrap().allowed,
            "another database"
        );
        // A second on, every key is idle: the fifth is made from an emptied record.
        assert!(t.charge(&Call::new(5, 9, SEC, r), &pool).unwrap().allowed);
        assert_eq!(t.count(Some(9), SEC), 1);
        assert_eq!(pool.per_db.lock().unwrap()[&9], 1);
    }

    /// Two-choice placement: a table filled to its setting (half its records) never finds a
    /// key's two buckets full, over many secrets.
    #[test]
    fn a_table_holds_its_setting_of_keys() {
        for keys in [16u32, 32, 1000] {
            for secret in 0..50u64 {
                let (recs, locks) = table(keys);
                let t = Table::over(&recs, &locks);
                let pool = Pool::new(keys as usize, keys as usize);
                let r = rate(1, SEC as i64, 1);
                for k in 0..keys {
                    let d = digest([secret, 7], 1, Space::Key, &k.to_le_bytes());
                    let got = t.charge(&Call::new(d, 1, 0, r), &pool);
                    assert!(
                        got.unwrap().allowed,
                        "{keys} keys, secret {secret}: key {k}"
                    );
                }
                let extra = digest([secret, 7], 1, Space::Key, b"one more");
                assert_eq!(t.charge(&Call::new(extra, 1, 0, r), &pool), Err(Full));
            }
        }
    }

    #[test]
    fn restore_puts_back_exactly() {
        let (recs, locks) = table(16);
        let t = Table::over(&recs, &locks);
        let pool = Pool::new(16, 16);
        let r = rate(1, SEC as i64, 1);
        assert!(t.charge(&Call::new(3, 1, 0, r), &pool).unwrap().allowed);
        let saved: Vec<_> = t.live(0).collect();
        assert_eq!(saved, vec![(3, 1, SEC)]);
        let (recs2, locks2) = table(16);
        let t2 = Table::over(&recs2, &locks2);
        let pool2 = Pool::new(16, 16);
        for (d, db, tat) in saved {
            assert!(t2.restore(d, db, tat, &pool2));
        }
        assert!(
            !t2.charge(&Call::new(3, 1, SEC - 1, r).fresh(0), &pool2)
                .unwrap()
                .allowed
        );
        assert!(
            t2.charge(&Call::new(3, 1, SEC, r).fresh(0), &pool2)
                .unwrap()
                .allowed
        );
    }

    /// 8 threads on one key at one instant: exactly the burst is admitted.
    #[test]
    fn threads_on_one_key_get_exactly_the_burst() {
        for _ in 0..50 {
            let (recs, locks) = table(64);
            let t = Table::over(&recs, &locks);
            let pool = Pool::new(64, 64);
            let r = rate(100, SEC as i64, 10);
            let admitted = StdCount::new(0);
            std::thread::scope(|s| {
                for _ in 0..8 {
                    s.spawn(|| {
                        for _ in 0..20 {
                            if t.charge(&Call::new(42, 1, SEC, r), &pool).unwrap().allowed {
                                admitted.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    });
                }
            });
            assert_eq!(admitted.load(Ordering::Relaxed), 10);
            assert_eq!(t.count(None, SEC), 1, "one record for the key");
        }
    }

    /// Threads on a shared advancing clock, many keys, the table emptied under them: never more
    /// than burst + elapsed / T per key.
    #[test]
    fn threads_on_many_keys_never_exceed_the_rate() {
        let (recs, locks) = table(64);
        let t = Table::over(&recs, &locks);
        let pool = Pool::new(64, 64);
        let r = rate(10, SEC as i64, 2); // T = 100 ms
        let clock = AtomicU64::new(SEC);
        let admitted: Vec<StdCount> = (0..32).map(|_| StdCount::new(0)).collect();
        std::thread::scope(|s| {
            for i in 0..4u64 {
                let (t, pool, clock, admitted) = (&t, &pool, &clock, &admitted);
                s.spawn(move || {
                    for step in 0..20_000u64 {
                        let now = clock.fetch_add(100_000, Ordering::Relaxed); // 100 µs a call
                        let key = (step * 7 + i) % 32;
                        if t.charge(&Call::new(key + 1, 1, now, r), pool)
                            .unwrap()
                            .allowed
                        {
                            admitted[key as usize].fetch_add(1, Ordering::Relaxed);
                        }
                        if step % 1000 == 0 {
                            t.empty_idle(now, pool);
                        }
                    }
                });
            }
        });
        let elapsed = clock.load(Ordering::Relaxed) - SEC;
        let bound = 2 + elapsed / r.interval + 1;
        for (k, a) in admitted.iter().enumerate() {
            let a = a.load(Ordering::Relaxed) as u64;
            assert!(a <= bound, "key {k}: {a} admitted, at most {bound}");
            assert!(
                a >= elapsed / r.interval / 2,
                "key {k}: {a} admitted, starved"
            );
        }
    }

    #[test]
    fn digests_differ_by_database_and_secret_and_are_never_zero() {
        let s = [1, 2];
        let d = |s, db, name: &[u8]| digest(s, db, Space::Key, name);
        assert_ne!(d(s, 1, b"k"), d(s, 2, b"k"));
        assert_ne!(d(s, 1, b"k"), d([3, 4], 1, b"k"));
        assert_eq!(d(s, 1, b"k"), d(s, 1, b"k"));
        assert_ne!(
            d(s, 1, b"k"),
            digest(s, 1, Space::Cap, b"k"),
            "a cap's rate is not a key's"
        );
        assert_ne!(d(s, 1, b""), 0);
    }
}

/// Model checks (`--cfg loom`): two calls on one new key make one record and admit the burst
/// once; a charge racing an emptying never lands on an emptied record.
#[cfg(all(test, loom))]
mod model {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    struct Count(AtomicU32);
    impl Room for Count {
        fn take(&self, _db: u32) -> bool {
            self.0.fetch_add(1, Ordering::Relaxed) < 4
        }
        fn give(&self, _db: u32) {
            self.0.fetch_sub(1, Ordering::Relaxed);
        }
    }

    struct Parts {
        recs: Vec<RateRecord>,
        locks: Vec<AtomicU32>,
        room: Count,
    }

    fn parts() -> Arc<Parts> {
        Arc::new(Parts {
            recs: (0..2 * BUCKET).map(|_| RateRecord::default()).collect(),
            locks: (0..2).map(|_| AtomicU32::new(0)).collect(),
            room: Count(AtomicU32::new(0)),
        })
    }

    #[test]
    fn two_first_calls_make_one_key_and_admit_one() {
        crate::sync::model(|| {
            let p = parts();
            let r = Rate::new(1, 1_000, 1).unwrap();
            let hs: Vec<_> = (0..2)
                .map(|_| {
                    let p = p.clone();
                    thread::spawn(move || {
                        let t = Table::over(&p.recs, &p.locks);
                        t.charge(&Call::new(5, 1, 10, r), &p.room).unwrap().allowed
                    })
                })
                .collect();
            let admitted = hs.into_iter().map(|h| h.join().unwrap());
            assert_eq!(admitted.filter(|&a| a).count(), 1);
            let t = Table::over(&p.recs, &p.locks);
            assert_eq!(t.count(None, 10), 1);
        });
    }

    #[test]
    fn a_charge_racing_an_emptying_is_never_lost() {
        crate::sync::model(|| {
            let p = parts();
            let r = Rate::new(1, 1_000, 1).unwrap();
            {
                let t = Table::over(&p.recs, &p.locks);
                assert!(t.charge(&Call::new(5, 1, 0, r), &p.room).unwrap().allowed);
                // TAT 1000
            }
            let p2 = p.clone();
            let emptier = thread::spawn(move || {
                Table::over(&p2.recs, &p2.locks).empty_idle(1_000, &p2.room);
            });
            let t = Table::over(&p.recs, &p.locks);
            let first = t
                .charge(&Call::new(5, 1, 1_000, r), &p.room)
                .unwrap()
                .allowed;
            emptier.join().unwrap();
            assert!(first, "an idle key is a new key");
            // Whatever the order, the charge is in the table: a second call now is denied.
            assert!(
                !t.charge(&Call::new(5, 1, 1_000, r), &p.room)
                    .unwrap()
                    .allowed
            );
        });
    }
}
