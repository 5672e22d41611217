//! Rate keys: `stage_e_core::rate`'s table placed in the segment, its room counted per database
//! (`stage_e_slots.max_rate_keys`, `database_share`), and the clock and secret it runs on; and
//! the rate policies of caps (`stage_e_rate_limit`), on a cap or on every cap of a prefix.
//!
//! Policies: one record each (`stage_e_slots.max_rate_policies`), written under the adapt
//! LWLock by the commit that sets or removes it (its record reserved at the pre-commit, as
//! adaptive policies' are), by a load from the rows, or by the end of a database; read by every
//! acquisition without a lock, as a seqlock (`version` odd while a write is under way), and
//! not at all while `RateHeader::policies` is 0. A cap's policy is its own, else the longest
//! prefix of its name; its key is the cap's name in the table's cap space, so each cap under a
//! prefix has a rate of its own.
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
use super::records::{store_name, RatePolicyRecord, NAME_WORDS};
use super::segment::{adapt_locked, segment, Segment, EXCLUSIVE, SHARED};
use crate::ffi;
use stage_e_core::rate::{self, Call, Decision, Full, Rate, Room, Space, Table};
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

/// A call of `cost` on key `name` of database `db` (in `space`: a key of `stage_e_try_rate`,
/// or a cap's own rate): allowed and charged, or denied, in one step (`peek`: told what a
/// charge would be told, charging nothing). `share` is the database's `database_share`.
pub fn try_rate(
    db: u32,
    space: Space,
    name: &[u8],
    rate: Rate,
    cost: u32,
    share: u32,
) -> Result<Decision, NoRoom> {
    let seg = segment().expect("callers check that the segment is attached");
    let call = call(seg, db, space, name, rate, cost);
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

/// What [`try_rate`] would answer now, charging nothing.
pub fn peek_rate(db: u32, space: Space, name: &[u8], rate: Rate, cost: u32) -> Decision {
    let seg = segment().expect("callers check that the segment is attached");
    table(seg).peek(&call(seg, db, space, name, rate, cost))
}

fn secret(seg: &Segment) -> [u64; 2] {
    let h = &seg.header.rates;
    [
        h.secret[0].load(Ordering::Relaxed),
        h.secret[1].load(Ordering::Relaxed),
    ]
}

/// The digest of share `name` of database `db` (`stage_e_core::fair::Share::digest`): keyed
/// with the server's secret, as rate keys are, so that no tenant can pick a name whose digest
/// is another's (it would share the other's place and ceiling).
pub fn share_digest(db: u32, name: &str) -> u64 {
    let seg = segment().expect("callers check that the segment is attached");
    // Above the unnamed share's digest (1), which no name may have.
    rate::digest(secret(seg), db, Space::Share, name.as_bytes())
        .max(stage_e_core::fair::UNNAMED + 1)
}

fn call(seg: &Segment, db: u32, space: Space, name: &[u8], rate: Rate, cost: u32) -> Call {
    let h = &seg.header.rates;
    let secret = secret(seg);
    let now = now();
    let spent = h.spent_since.load(Ordering::Acquire);
    let fresh = if spent == 0 {
        now
    } else {
        rate.spent_at(spent)
    };
    Call::new(rate::digest(secret, db, space, name), db, now, rate)
        .cost(cost)
        .fresh(fresh)
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

// -- rate policies ---------------------------------------------------------------------------------

/// A cap's rate policy: its rate, and the name it was set on (the cap's own, or `prefix*`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RatePolicy {
    pub count: u32,
    pub per_ns: u64,
    pub burst: u32,
    /// The name or the pattern the policy was set on (`tenant:*`).
    pub on: String,
}

impl RatePolicy {
    pub fn rate(&self) -> Rate {
        Rate::new(self.count as i32, self.per_ns as i64, self.burst as i32)
            .expect("a policy's rate was checked when it was set")
    }
}

/// Every rate policy record is in use (`stage_e_slots.max_rate_policies`).
#[derive(Debug, PartialEq, Eq)]
pub struct NoRatePolicyRecord {
    pub max: u32,
}

/// A policy's name as stored: the pattern without its `*`, and whether it is one.
fn stored(on: &str) -> (&str, bool) {
    match on.strip_suffix('*') {
        Some(prefix) => (prefix, true),
        None => (on, false),
    }
}

fn name_bytes(r: &RatePolicyRecord) -> ([u8; NAME_WORDS * 8], usize) {
    let mut bytes = [0u8; NAME_WORDS * 8];
    for (chunk, w) in bytes.chunks_mut(8).zip(&r.name) {
        chunk.copy_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
    }
    let len = (r.name_len.load(Ordering::Relaxed) as usize).min(bytes.len());
    (bytes, len)
}

/// One record as a reader sees it, whole (a seqlock read): `(db, prefix, name, policy)`.
fn read(r: &RatePolicyRecord) -> (u32, bool, [u8; NAME_WORDS * 8], usize, u32, u64, u32) {
    loop {
        let v = r.version.load(Ordering::Acquire);
        if v % 2 == 1 {
            std::hint::spin_loop();
            continue;
        }
        let db = r.db.load(Ordering::Relaxed);
        let prefix = r.prefix.load(Ordering::Relaxed) == 1;
        let (name, len) = name_bytes(r);
        let count = r.count.load(Ordering::Relaxed);
        let per = r.per_ns.load(Ordering::Relaxed);
        let burst = r.burst.load(Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Acquire);
        if r.version.load(Ordering::Relaxed) == v {
            return (db, prefix, name, len, count, per, burst);
        }
    }
}

/// Writes record `r` (under the adapt lock): readers see the old fields or the new ones whole.
fn write(r: &RatePolicyRecord, db: u32, on: &str, count: u32, per_ns: u64, burst: u32) {
    let (name, prefix) = stored(on);
    r.version.fetch_add(1, Ordering::AcqRel);
    std::sync::atomic::fence(Ordering::Release);
    r.db.store(db, Ordering::Relaxed);
    r.prefix.store(prefix as u32, Ordering::Relaxed);
    store_name(&r.name, &r.name_len, name);
    r.count.store(count, Ordering::Relaxed);
    r.per_ns.store(per_ns, Ordering::Relaxed);
    r.burst.store(burst, Ordering::Relaxed);
    r.version.fetch_add(1, Ordering::Release);
}

/// Whether any database has a rate policy (the hot path's one question while none has).
#[inline(always)]
pub fn any_rate_policy() -> bool {
    segment().is_some_and(|seg| seg.header.rates.policies.load(Ordering::Relaxed) != 0)
}

/// The rate policy of cap `name` of database `db`: its own, else the longest prefix that
/// matches it. One load when no database has a rate policy (the hot path of every cap then).
#[inline]
pub fn rate_policy(db: u32, name: &str) -> Option<RatePolicy> {
    let seg = segment()?;
    if seg.header.rates.policies.load(Ordering::Acquire) == 0 {
        return None;
    }
    find_policy(seg, db, name)
}

#[inline(never)]
fn find_policy(seg: &Segment, db: u32, name: &str) -> Option<RatePolicy> {
    let mut best: Option<(usize, RatePolicy)> = None;
    for r in seg.rate_policies {
        if r.db.load(Ordering::Relaxed) != db {
            continue;
        }
        let (rdb, prefix, bytes, len, count, per_ns, burst) = read(r);
        let stored = &bytes[..len];
        if rdb != db || count == 0 {
            continue;
        }
        let matched = if prefix {
            name.as_bytes().starts_with(stored)
        } else {
            name.as_bytes() == stored
        };
        if !matched {
            continue;
        }
        // The cap's own policy wins; among prefixes, the longest.
        let rank = if prefix { len } else { usize::MAX };
        if best.as_ref().is_none_or(|(b, _)| rank > *b) {
            let on = String::from_utf8_lossy(stored).into_owned() + if prefix { "*" } else { "" };
            best = Some((
                rank,
                RatePolicy {
                    count,
                    per_ns,
                    burst,
                    on,
                },
            ));
        }
    }
    best.map(|(_, p)| p)
}

/// The record of policy `on` of database `db` (under the adapt lock).
fn record_of(seg: &Segment, db: u32, on: &str) -> Option<&'static RatePolicyRecord> {
    let (name, prefix) = stored(on);
    seg.rate_policies.iter().find(|r| {
        r.db.load(Ordering::Relaxed) == db && (r.prefix.load(Ordering::Relaxed) == 1) == prefix && {
            let (bytes, len) = name_bytes(r);
            &bytes[..len] == name.as_bytes()
        }
    })
}

/// A free record: one this backend reserved first, else one nobody did.
fn free_record(seg: &Segment, me: u32) -> Option<&'static RatePolicyRecord> {
    let free = |holder: u32| {
        seg.rate_policies.iter().find(move |r| {
            r.db.load(Ordering::Relaxed) == 0 && r.reserved.load(Ordering::Relaxed) == holder
        })
    };
    free(me).or_else(|| free(0))
}

fn my_pid() -> u32 {
    // SAFETY: this process's pid, set at its start.
    unsafe { pgrx::pg_sys::MyProcPid as u32 }
}

/// Whether policy `on` of database `db` could be set now: it has a record, or a free one is
/// left (the pre-commit reserves it: [`reserve_rate_policies`]).
pub fn rate_policy_room(db: u32, on: &str) -> Result<(), NoRatePolicyRecord> {
    let Some(seg) = segment() else { return Ok(()) };
    adapt_locked(SHARED, || {
        match record_of(seg, db, on).or_else(|| free_record(seg, my_pid())) {
            Some(_) => Ok(()),
            None => Err(NoRatePolicyRecord {
                max: seg.rate_policies.len() as u32,
            }),
        }
    })
}

/// A committing transaction's pre-commit: a record for each policy it sets, held for it
/// until it ends ([`unreserve_rate_policies`]).
pub fn reserve_rate_policies(db: u32, on: &[&str]) -> Result<(), NoRatePolicyRecord> {
    let Some(seg) = segment() else { return Ok(()) };
    let me = my_pid();
    adapt_locked(EXCLUSIVE, || {
        for name in on {
            if record_of(seg, db, name).is_some() {
                continue;
            }
            match seg.rate_policies.iter().find(|r| {
                r.db.load(Ordering::Relaxed) == 0 && r.reserved.load(Ordering::Relaxed) == 0
            }) {
                Some(r) => r.reserved.store(me, Ordering::Relaxed),
                None => {
                    return Err(NoRatePolicyRecord {
                        max: seg.rate_policies.len() as u32,
                    })
                }
            }
        }
        Ok(())
    })
}

/// The end of a transaction that reserved records: they are free again (those it filled are
/// in use by their database now).
pub fn unreserve_rate_policies() {
    let Some(seg) = segment() else { return };
    let me = my_pid();
    if !seg
        .rate_policies
        .iter()
        .any(|r| r.reserved.load(Ordering::Relaxed) == me)
    {
        return;
    }
    adapt_locked(EXCLUSIVE, || {
        for r in seg.rate_policies {
            if r.reserved.load(Ordering::Relaxed) == me {
                r.reserved.store(0, Ordering::Relaxed);
            }
        }
    });
}

/// Sets (`Some`) or removes (`None`) policy `on` of database `db`: at the commit of the
/// transaction that asked (its record reserved), or at a load from the rows. False when no
/// record was left (only a load, which reserves nothing, can meet that).
pub fn set_rate_policy(db: u32, on: &str, policy: Option<(u32, u64, u32)>) -> bool {
    let Some(seg) = segment() else { return true };
    let me = my_pid();
    adapt_locked(EXCLUSIVE, || {
        let existing = record_of(seg, db, on);
        match policy {
            Some((count, per_ns, burst)) => {
                let Some(r) = existing.or_else(|| free_record(seg, me)) else {
                    return false;
                };
                write(r, db, on, count, per_ns, burst);
                if existing.is_none() {
                    r.reserved.store(0, Ordering::Relaxed);
                    seg.header.rates.policies.fetch_add(1, Ordering::AcqRel);
                }
                true
            }
            None => {
                if let Some(r) = existing {
                    clear(seg, r);
                }
                true
            }
        }
    })
}

fn clear(seg: &Segment, r: &RatePolicyRecord) {
    write(r, 0, "", 0, 0, 0);
    let _ = seg
        .header
        .rates
        .policies
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
}

/// The extension was dropped from database `db`, or the database: its rate policies end.
pub fn clear_rate_policies(db: u32) {
    let Some(seg) = segment() else { return };
    adapt_locked(EXCLUSIVE, || {
        for r in seg.rate_policies {
            if r.db.load(Ordering::Relaxed) == db {
                clear(seg, r);
            }
        }
    });
}

/// The rate policies of database `db`, by name or pattern (`tenant:*`), sorted.
pub fn rate_policies(db: u32) -> Vec<RatePolicy> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    let mut out: Vec<RatePolicy> = seg
        .rate_policies
        .iter()
        .map(read)
        .filter(|p| p.0 == db && p.4 != 0)
        .map(|(_, prefix, bytes, len, count, per_ns, burst)| RatePolicy {
            count,
            per_ns,
            burst,
            on: String::from_utf8_lossy(&bytes[..len]).into_owned() + if prefix { "*" } else { "" },
        })
        .collect();
    out.sort_by(|a, b| a.on.cmp(&b.on));
    out
}
