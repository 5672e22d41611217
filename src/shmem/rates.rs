//! Rate keys: `stage_e_core::rate`'s table placed in the segment, its room counted per database
//! (`stage_e_slots.max_rate_keys`, `database_share`), and the clock and secret it runs on.
//!
//! Protocol: the table's own (`stage_e_core::rate`: lock-free charges, claims under two bucket
//! locks that are words of the segment, not LWLocks). The header's `RateHeader`: `secret` is
//! written by the postmaster before any backend starts (at the segment's start, from the saved
//! file or at random), then only read; `spent_since` is stored by the postmaster at start and
//! by the launcher when recovery ends, and read by every call; `keys` and each database's
//! `rate_keys` are counters moved by CAS, never above their limit.
//!
//! Time: nanoseconds of CLOCK_BOOTTIME (`ffi::boottime_ns`), which never steps back. What is
//! stored is each key's arrival time, never a request.

use super::databases;
use super::segment::{segment, Segment};
use crate::ffi;
use stage_e_core::rate::{self, Call, Decision, Full, Rate, Room, Table};
use stage_e_core::share;
use std::sync::atomic::Ordering;

/// A new key refused: no room left for it even after idle keys were reclaimed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoRoom {
    /// `stage_e_slots.max_rate_keys` keys are in use.
    Pool { max: u32 },
    /// The database holds its share (`share` percent: `limit` keys).
    Share { share: u32, limit: u64 },
}

/// The clock rates decide by.
pub fn now() -> u64 {
    ffi::boottime_ns()
}

fn table(seg: &Segment) -> Table<'static> {
    Table::over(seg.rate_records, seg.rate_locks)
}

/// Room for keys: the pool, and a database's share of it (`None`: no share, at start).
struct Pool<'a> {
    seg: &'a Segment,
    max: u32,
    share_limit: Option<u64>,
}

impl Room for Pool<'_> {
    fn take(&self, db: u32) -> bool {
        let all = &self.seg.header.rates.keys;
        let max = self.max;
        if all
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_err()
        {
            return false;
        }
        if !databases::take_rate_share(db, self.share_limit) {
            saturating_dec(all);
            return false;
        }
        true
    }

    fn give(&self, db: u32) {
        saturating_dec(&self.seg.header.rates.keys);
        databases::give_rate_share(db);
    }
}

fn saturating_dec(n: &std::sync::atomic::AtomicU32) {
    let _ = n.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_sub(1));
}

/// A call of `cost` on key `name` of database `db`: allowed and charged, or denied, in one
/// step. `share` is the database's `database_share`.
pub fn try_rate(
    db: u32,
    name: &[u8],
    rate: Rate,
    cost: u32,
    share: u32,
) -> Result<Decision, NoRoom> {
    let seg = segment().expect("callers check that the segment is attached");
    let h = &seg.header.rates;
    let secret = [
        h.secret[0].load(Ordering::Relaxed),
        h.secret[1].load(Ordering::Relaxed),
    ];
    let now = now();
    let spent = h.spent_since.load(Ordering::Acquire);
    let fresh = if spent == 0 {
        now
    } else {
        rate.spent_at(spent)
    };
    let call = Call::new(rate::digest(secret, db, name), db, now, rate)
        .cost(cost)
        .fresh(fresh);
    let max = seg.rate_records.len() as u32 / 2;
    let limit = share::limit(max as u64, share);
    let pool = Pool {
        seg,
        max,
        share_limit: Some(limit),
    };
    table(seg).charge(&call, &pool).map_err(|Full| {
        if databases::rate_keys_of(db) as u64 >= limit && share < 100 {
            NoRoom::Share { share, limit }
        } else {
            NoRoom::Pool { max }
        }
    })
}

/// At the segment's start (the postmaster): the secret (the saved one, so that saved digests
/// still name their keys, or a new one) and since when every key's burst counts as spent
/// (`spent`: now after a crash, 0 for none).
pub(super) fn start(seg: &Segment, secret: Option<[u64; 2]>, spent: u64) {
    let h = &seg.header.rates;
    let secret = secret.unwrap_or_else(random_secret);
    h.secret[0].store(secret[0], Ordering::Relaxed);
    h.secret[1].store(secret[1], Ordering::Relaxed);
    h.spent_since.store(spent, Ordering::Release);
}

/// Every key not in the table counts as spent from `at` (restored keys that found no room).
pub(super) fn mark_spent(seg: &Segment, at: u64) {
    seg.header.rates.spent_since.store(at, Ordering::Release);
}

/// The spent mark of a segment that began as a standby: every new key is denied until the
/// launcher sees recovery end (a standby refuses the calls anyway).
pub(super) const PROMOTION_PENDING: u64 = u64::MAX - 1;

/// The launcher, when recovery has ended: on a segment that began as a standby, every key's
/// burst counts as spent from now (a promotion must not hand every key a full burst at once).
/// Once: a launcher that starts again leaves the mark alone.
pub fn note_recovered() {
    if let Some(seg) = segment() {
        let _ = seg.header.rates.spent_since.compare_exchange(
            PROMOTION_PENDING,
            now(),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }
}

fn random_secret() -> [u64; 2] {
    let mut bytes = [0u8; 16];
    // SAFETY: pg_strong_random fills the buffer it is given, of the length it is given.
    let ok = unsafe { pgrx::pg_sys::pg_strong_random(bytes.as_mut_ptr().cast(), bytes.len()) };
    if !ok {
        // Still distinct per start; only an attacker who can read the clock could aim keys at
        // one bucket pair, and a full pair refuses (53400), never admits.
        let t = now();
        return [t, t.rotate_left(29) ^ 0x9E37_79B9_7F4A_7C15];
    }
    [
        u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")),
        u64::from_le_bytes(bytes[8..].try_into().expect("8 bytes")),
    ]
}

/// What a clean shutdown saves: the secret, the spent mark and every key not idle
/// `(digest, db, tat)`.
pub(super) fn saved(seg: &Segment) -> ([u64; 2], u64, Vec<(u64, u32, u64)>) {
    let h = &seg.header.rates;
    let secret = [
        h.secret[0].load(Ordering::Relaxed),
        h.secret[1].load(Ordering::Relaxed),
    ];
    let spent = h.spent_since.load(Ordering::Acquire);
    (secret, spent, table(seg).live(now()).collect())
}

/// At start, after [`start`] with the saved secret: puts the saved keys back; returns how many
/// found no room (a smaller `max_rate_keys`).
pub(super) fn restore(seg: &Segment, keys: &[(u64, u32, u64)]) -> usize {
    let pool = Pool {
        seg,
        max: seg.rate_records.len() as u32 / 2,
        share_limit: None,
    };
    let t = table(seg);
    keys.iter()
        .filter(|&&(d, db, tat)| !t.restore(d, db, tat, &pool))
        .count()
}
