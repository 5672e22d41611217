//! The caps themselves: acquiring (with the wait policy in `waiting`), releasing, leases (taken,
//! renewed, released and expired: `leases`), and what the views read, over the lock manager (`locks`), shared memory (`shmem`) and this
//! backend's state (`session`). What happens to held slots whose lock went away is `held`;
//! what the views read is `views`.
//! The SQL functions in `api` only translate arguments and map [`SlotError`] to ERRORs.
//!
//! Invariants:
//! - A slot is returned only after `LockAcquire` granted this session a *new* lock on it, so
//!   the lock manager alone bounds holders of a cap's `[0, n)` by n, whatever shared memory says.
//!   An adaptive cap (`adapt`) searches `[0, least(n, limit))` only, and gives back a claim that
//!   would make more than `limit` bits set (slots taken above a limit that fell count too).
//! - A slot's occupancy bit is set while a backend holds it through the extension (or is
//!   probing it), and cleared only by that backend: on release, at transaction end if the lock
//!   vanished, at exit. So a set bit never outlives its lock past the holder's transaction.
//! - Shared memory is touched only with the cap pinned (`shmem::Cap`), so a cap is never
//!   reclaimed or moved under a backend that is using it.
//! - No pin is kept across a wait for another process (a release, the flusher's advance): a
//!   grow waits for the cap's pins, and the process waited for may be waiting behind the grow
//!   (`admission` names the cycle a waiting lease made). The waiter pins again after, and
//!   checks again. Left pinned: a flush's wait for another's (`flush`); a grow meanwhile
//!   fails, `CapError::Busy`.

pub mod admission;
pub mod edited;
pub mod held;
mod leases;
pub mod limits;
pub mod rates;
pub mod shares;
pub mod views;
pub mod waiting;

pub use crate::failures::{NamedError, SlotError};
use leases::{expire_due, grant_lease};
pub use leases::{expire_leases_everywhere, lease, settle_lease, LeaseAction, LeaseOutcome};
pub use views::{held_back, holders, load, stats, waiters};

use crate::gucs;
use crate::locks::{self, Probe};
use crate::session::{self, Held};
use crate::shmem::{self, Cap, Counter};
use stage_e_core::directory;
use stage_e_core::occupancy;
use stage_e_core::wait::Wait;

pub enum Release {
    Released,
    /// Not this session's: the session holding its lock, if any, and whether a lease holds it.
    NotHeld {
        holder: Option<i32>,
        leased: bool,
    },
}

/// Who holds what a call takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// This session, through a session advisory lock.
    Session,
    /// A token, for `ttl_us` microseconds from the moment it is taken.
    Lease { ttl_us: i64 },
}

/// A slot taken, with its fencing token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Got {
    pub slot: u32,
    pub token: u64,
}

/// Refuses to run without the cap's shared state, on a standby (whose locks do not coordinate
/// with the primary's) or in parallel mode: fail closed, never an uncapped slot.
#[inline]
pub fn ready() -> Result<(), SlotError> {
    if !shmem::attached() {
        return Err(SlotError::NotPreloaded);
    }
    if session::in_recovery() {
        return Err(SlotError::Standby);
    }
    // A parallel worker's session locks die with the worker at the end of the query (and the
    // leader's locks are not the worker's): a slot taken there would be held by nobody. Core
    // refuses advisory locks in parallel mode for the same reason.
    if session::in_parallel_mode() {
        return Err(SlotError::ParallelMode);
    }
    Ok(())
}

/// Reading needs the shared state only (it works on a standby).
pub fn attached() -> Result<(), SlotError> {
    if shmem::attached() {
        Ok(())
    } else {
        Err(SlotError::NotPreloaded)
    }
}

#[inline]
fn check_name(cap: Option<&str>) -> Result<&str, SlotError> {
    let cap = cap.ok_or(SlotError::NullArgument { name: "cap" })?;
    directory::check_name(cap).map_err(SlotError::BadCapName)?;
    Ok(cap)
}

#[inline]
fn check_cap(n: Option<i32>) -> Result<u32, SlotError> {
    let n = n.ok_or(SlotError::NullArgument { name: "n" })?;
    let max_slots = gucs::max_slots();
    if n < 1 || n as u32 > max_slots {
        return Err(SlotError::CapOutOfRange { n, max_slots });
    }
    Ok(n as u32)
}

#[inline]
fn check_count(k: Option<i32>, n: u32) -> Result<u32, SlotError> {
    let k = k.ok_or(SlotError::NullArgument { name: "k" })?;
    if k < 1 || k as u32 > n {
        return Err(SlotError::CountOutOfRange { k, n });
    }
    Ok(k as u32)
}

#[inline]
fn check_slot(slot: Option<i32>) -> Result<u32, SlotError> {
    let slot = slot.ok_or(SlotError::NullArgument { name: "slot" })?;
    let max_slots = gucs::max_slots();
    if slot < 0 || slot as u32 >= max_slots {
        return Err(SlotError::SlotOutOfRange { slot, max_slots });
    }
    Ok(slot as u32)
}

/// `stage_e_cap_key(cap)`: the first int4 of the cap's advisory locks (`keys`).
pub fn cap_key(cap: Option<&str>) -> Result<i32, SlotError> {
    attached()?;
    Ok(crate::keys::key_of(check_name(cap)?))
}

/// `cap` if it is a valid cap name and shared memory is attached (`stage_e_reset_stats(cap)`).
pub fn valid_cap(cap: Option<&str>) -> Result<&str, SlotError> {
    attached()?;
    check_name(cap)
}

/// The live cap `name` pinned, and its key; None when it does not exist here (then this
/// session holds none of its slots: a held slot keeps its cap).
#[inline]
fn existing_key(name: &str) -> Option<(Cap, i32)> {
    existing(name).map(|cap| {
        let key = cap.key();
        (cap, key)
    })
}

/// The cap named `name` pinned, if it exists: through this backend's cache, else a lookup.
/// Never creates one.
#[inline]
fn existing(name: &str) -> Option<Cap> {
    if let Some(r) = session::cached_cap(name) {
        if let Some(cap) = shmem::pin(r) {
            return Some(cap);
        }
        session::cache_cap(name, None); // reclaimed since
    }
    let cap = shmem::lookup(session::database(), name)?;
    session::cache_cap(name, Some(cap.at));
    Some(cap)
}

/// The cap named `name` pinned, created on first use and grown to hold `n` slots: only
/// `stage_e_try_slot` does this, so reading or releasing never uses up an entry.
fn for_acquire(name: &str, n: u32) -> Result<Cap, SlotError> {
    let fail = |error| SlotError::named(name, NamedError::Cap(error));
    loop {
        let cap = match existing(name) {
            Some(cap) => cap,
            None => {
                let cap = shmem::create(
                    session::database(),
                    name,
                    n,
                    session::database_exists,
                    &|covered| crate::keys::book(name, covered),
                )
                .map_err(fail)?
                .ok_or(SlotError::NotPreloaded)?;
                session::cache_cap(name, Some(cap.at));
                cap
            }
        };
        if cap.capacity() >= n {
            return Ok(cap);
        }
        let r = cap.at;
        drop(cap); // growing waits for pins to end, ours included
        shmem::grow(r, n).map_err(fail)?;
    }
}

/// `stage_e_try_slot(cap, n)`: the lowest free slot in `[0, n)` of the cap (while it has
/// waiters, of those no waiter can use), now held by this session, or None (throttled, counted
/// once).
pub fn try_slot(cap: Option<&str>, n: Option<i32>) -> Result<Option<u32>, SlotError> {
    Ok(try_slots(cap, n, Some(1), Wait::No, None)?.map(|t| t.first().slot))
}

/// Slots taken by one call: one (the common case, without an allocation) or several.
pub enum Taken {
    One(Got),
    Many(Vec<Got>),
}

impl Taken {
    pub fn first(&self) -> Got {
        match self {
            Taken::One(g) => *g,
            Taken::Many(v) => v[0],
        }
    }

    pub fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        let (one, many) = match self {
            Taken::One(g) => (Some(g.slot), &[][..]),
            Taken::Many(v) => (None, &v[..]),
        };
        one.into_iter().chain(many.iter().map(|g| g.slot))
    }

    pub fn into_vec(self) -> Vec<u32> {
        match self {
            Taken::One(g) => vec![g.slot],
            Taken::Many(v) => v.into_iter().map(|g| g.slot).collect(),
        }
    }
}

/// `stage_e_try_slots(cap, n, k, wait)` (and `stage_e_try_slot` with a wait): k distinct slots
/// of `[0, n)`, all or none; waiting up to `wait` for them, in arrival order.
///
/// Fairness: while a cap has waiters, a call takes only slots that no waiter can use (from the
/// largest n of the queue up), and a call that waits and finds none queues behind them; only
/// waiters at the front of the queue take slots, each only slots that no waiter ahead of it
/// could use, or while the free slots cover it and everyone ahead of it
/// (`stage_e_core::front`). So a waiter gets its slots from the very next releases it can use,
/// whatever the traffic of other calls, and a call on slots no waiter wants is not held back.
///
/// In `share` (`shares`; None: the cap's unnamed share, once the cap has shares), the order
/// is the cap's fair queue's instead of arrival order.
pub fn try_slots(
    cap: Option<&str>,
    n: Option<i32>,
    k: Option<i32>,
    wait: Wait,
    share: Option<&str>,
) -> Result<Option<Taken>, SlotError> {
    acquire(cap, n, k, wait, Kind::Session, share)
}

/// The acquisition pipeline, one named stage per concern, so that a new check is one more
/// stage, not another thread through this file:
///
/// 1. admission (`admit`): the arguments and this session's own limit; the cap made or grown;
///    held back after a crash or a promotion (`wait_out_hold`); the adaptive limit
///    (`within_limit`);
/// 2. search and take (`take`): the lowest free slots, from slot 0 while the cap has no waiters
///    (the hot path); else `not_taken`: the slots no waiter can use, a second look after
///    freeing what expired, then the line (`waiting`). A lease's room under the committed
///    horizon is checked as it is granted (`grant_lease`), when its token and expiry are known;
/// 3. record (`record`): the slots counted as acquired (they were tracked as they were taken).
fn acquire(
    cap: Option<&str>,
    n: Option<i32>,
    k: Option<i32>,
    wait: Wait,
    kind: Kind,
    share: Option<&str>,
) -> Result<Option<Taken>, SlotError> {
    shares::check_share_name(share)?;
    let name = cap;
    // A named share's policy is read (by SPI, on a miss of this backend's cache) before
    // admission pins the cap: a lock held on the policy table then holds up this call alone,
    // never a grow of its cap, which waits for every pin to go.
    let call = match share {
        Some(_) => {
            ready()?;
            Some(shares::resolve(check_name(name)?, share)?)
        }
        None => None,
    };
    let Some(Admitted {
        cap,
        n,
        k,
        wait,
        gate,
    }) = admit(cap, n, k, wait, kind)?
    else {
        return Ok(None); // throttled, counted
    };
    let gate = gate.as_deref();
    // A call in a share, or on a cap with shares (one load), through the cap's fair queue.
    if call.is_some() || cap.has_shares() {
        return in_share(cap, name, n, k, wait, kind, gate, call);
    }
    // Without waiters (one load: the hot path), from slot 0; with waiters, `not_taken` looks
    // at the slots no waiter can use.
    if cap.waiters() == 0 {
        if let Some(got) = take(&cap, n, k, 0, session::statement_start(), kind, gate, 0)? {
            return Ok(Some(record(&cap, k, got)));
        }
    }
    not_taken(cap, n, k, wait, kind, gate)
}

/// A call in share `call` (None: the cap's unnamed share, whose policy is found here) of cap
/// `name` (`shares`): taken now through the fair queue, or (after freeing what expired, as
/// `not_taken` does) in line in its share, or throttled.
#[cold]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn in_share(
    cap: Cap,
    name: Option<&str>,
    n: u32,
    k: u32,
    wait: Wait,
    kind: Kind,
    gate: Option<&rates::Gate>,
    call: Option<shares::CallShare>,
) -> Result<Option<Taken>, SlotError> {
    let call = match call {
        Some(call) => call,
        None => shares::resolve(check_name(name)?, None)?,
    };
    let now = session::statement_start();
    // A call that may wait, on a cap with waiters, goes in line at once. Its join seats the
    // front in the order of service, so if its share is to be served first it is seated and
    // takes at once, as `take_now` would have let it; if not (nearly every call while the cap
    // is saturated), it is spared a step under the exclusive waits lock only to be refused.
    let in_line_at_once =
        !matches!(wait, Wait::No) && cap.waiters() > 0 && !waits_for_itself(&cap, n, k);
    if !in_line_at_once {
        if let Some(got) = shares::take_now(&cap, n, k, now, kind, gate, &call)? {
            return Ok(Some(record(&cap, k, got)));
        }
    }
    let again = || shares::take_now(&cap, n, k, now, kind, gate, &call);
    if let Some(got) = again_once_freed(&cap, k, again)? {
        return Ok(Some(got));
    }
    in_line_or_throttled(cap, n, k, wait, kind, gate, Some(&call))
}

/// A call admitted to search: its cap pinned, the n it may search (the adaptive limit
/// applied), its k, the wait left once a hold has ended, and the cap's rate, if it has one.
struct Admitted {
    cap: Cap,
    n: u32,
    k: u32,
    wait: Wait,
    gate: Option<Box<rates::Gate>>,
}

/// Admission: None when the call is throttled (counted) before any search.
#[inline]
fn admit(
    cap: Option<&str>,
    n: Option<i32>,
    k: Option<i32>,
    wait: Wait,
    kind: Kind,
) -> Result<Option<Admitted>, SlotError> {
    ready()?;
    admission::ensure_loaded()?;
    let name = check_name(cap)?;
    let n = check_cap(n)?;
    let k = check_count(k, n)?;
    if kind == Kind::Session {
        let (held, max) = (session::tracked_count(), gucs::max_session_slots());
        if held.saturating_add(k) > max {
            return Err(SlotError::TooManySessionSlots { held, k, max });
        }
    }
    let mut wait = wait;
    // Held back at the statement's start; after waiting the hold out, at the clock's now.
    let mut at = session::statement_start();
    loop {
        let cap = for_acquire(name, n)?;
        cap.note_n(n);
        let Some(limited) = within_limit(&cap, n, k) else {
            return Ok(None);
        };
        if cap.held_until(at).is_none() {
            let gate = rates::Gate::of(name);
            if let Some(g) = &gate {
                if !rate_admits(&cap, g, k, wait)? {
                    return Ok(None);
                }
            }
            return Ok(Some(Admitted {
                cap,
                n: limited,
                k,
                wait,
                gate,
            }));
        }
        // Waited out unpinned (a grow of the cap goes on meanwhile), then admitted afresh.
        let r = cap.at;
        drop(cap);
        match wait_out_hold(r, wait) {
            Some(left) => wait = left,
            None => return Ok(None),
        }
        at = session::now();
    }
}

/// A rate-limited cap (`rates`): more slots than the burst can never be had (class 22); a call
/// that does not wait and that the rate refuses now is throttled (counted) before any search.
#[cold]
#[inline(never)]
fn rate_admits(cap: &Cap, gate: &rates::Gate, k: u32, wait: Wait) -> Result<bool, SlotError> {
    if k > gate.burst() {
        return Err(SlotError::MoreThanBurst {
            k,
            burst: gate.burst(),
        });
    }
    if matches!(wait, Wait::No) && !gate.peek(k).allowed {
        rates::count_throttled(cap.counters(), Some(gate));
        return Ok(false);
    }
    Ok(true)
}

/// An adaptive cap (`shmem::policies`): slots of [0, least(n, limit)) only, and `search` stops
/// at the limit held. More slots than the limit cannot be had until it grows: None, throttled
/// (counted).
#[inline]
fn within_limit(cap: &Cap, n: u32, k: u32) -> Option<u32> {
    let limit = cap.limit();
    let n = if limit != 0 { n.min(limit) } else { n };
    if k > n {
        cap.counters().bump(Counter::Throttled, 1);
        return None;
    }
    Some(n)
}

/// Record: `got` (k slots) counted as acquired.
#[inline]
fn record(cap: &Cap, k: u32, got: Taken) -> Taken {
    cap.counters().bump(Counter::Acquired, k as u64);
    got
}

/// Held back after a crash or a promotion: nothing is handed out until the hold ends. The wait
/// left once it has (None: throttled, counted).
#[cold]
#[inline(never)]
fn wait_out_hold(cap: shmem::CapRef, wait: Wait) -> Option<Wait> {
    let started = std::time::Instant::now();
    let deadline = match wait {
        Wait::No => Some(started),
        Wait::For(d) => Some(started + d),
        Wait::Forever => None,
    };
    if let admission::Hold::Throttled = admission::through_hold(cap, deadline) {
        // A held cap is not idle, so it is still there to count on.
        if let Some(cap) = shmem::pin(cap) {
            cap.counters().bump(Counter::Throttled, 1);
        }
        return None;
    }
    Some(match wait {
        Wait::For(d) => Wait::For(d.saturating_sub(started.elapsed())),
        other => other,
    })
}

/// No slot at first look (or waiters go first): throttled, or in line. Out of `acquire`'s
/// frame, which the common case then keeps small.
#[inline(never)]
fn not_taken(
    cap: Cap,
    n: u32,
    k: u32,
    wait: Wait,
    kind: Kind,
    gate: Option<&rates::Gate>,
) -> Result<Option<Taken>, SlotError> {
    let now = session::statement_start();
    // With waiters, only the slots no waiter can use, if any of those are free; none on a
    // rate-limited cap, whose waiters keep their turn at the rate too.
    let waiters = cap.waiters() != 0;
    let from = match (waiters, gate) {
        (false, _) => Some(0),
        (true, None) => cap.newcomer(n, k),
        (true, Some(_)) => None,
    };
    if let Some(from) = from {
        if waiters {
            if let Some(got) = take(&cap, n, k, from, now, kind, gate, 0)? {
                return Ok(Some(record(&cap, k, got)));
            }
        }
        if let Some(got) = again_once_freed(&cap, k, || take(&cap, n, k, from, now, kind, gate, 0))?
        {
            return Ok(Some(got));
        }
    }
    in_line_or_throttled(cap, n, k, wait, kind, gate, None)
}

/// Before saying "throttled": this session may have dropped one of its own slots' locks
/// earlier in this very transaction (transaction end would clear it), and leases may have
/// expired. Frees those and, if there were any, takes with `take` once more (recorded); without
/// either, this costs two loads.
#[inline(always)]
fn again_once_freed(
    cap: &Cap,
    k: u32,
    take: impl FnOnce() -> Result<Option<Taken>, SlotError>,
) -> Result<Option<Taken>, SlotError> {
    let expired = expire_due(cap);
    if held::reconcile_cap(cap) + expired > 0 {
        if let Some(got) = take()? {
            return Ok(Some(record(cap, k, got)));
        }
    }
    Ok(None)
}

/// Nothing taken now: in line (in `share`, if any) until `wait` passes, or throttled at once
/// (counted) when the call does not wait or would wait for itself.
#[inline(always)]
fn in_line_or_throttled(
    cap: Cap,
    n: u32,
    k: u32,
    wait: Wait,
    kind: Kind,
    gate: Option<&rates::Gate>,
    share: Option<&shares::CallShare>,
) -> Result<Option<Taken>, SlotError> {
    let deadline = match wait {
        Wait::No => None,
        Wait::For(d) => Some(Some(std::time::Instant::now() + d)),
        Wait::Forever => Some(None),
    };
    match deadline {
        Some(deadline) if !waits_for_itself(&cap, n, k) => {
            waiting::wait_in_line(cap, n, k, deadline, kind, gate, share)
        }
        _ => {
            rates::count_throttled(cap.counters(), gate);
            Ok(None)
        }
    }
}

/// Whether this session's own session slots leave fewer than `k` of `[0, n)` for anyone else
/// to free: only this session can release them (or its end), so a wait would wait for itself
/// for all of its time. Such a call is answered at once, throttled, as a plain try is.
fn waits_for_itself(cap: &Cap, n: u32, k: u32) -> bool {
    let mine = session::tracked(Some(cap.key()))
        .iter()
        .filter(|h| h.slot < n)
        .count() as u32;
    n.saturating_sub(mine) < k
}

/// Takes `k` slots of `[from, n)`, all or none, the lowest free ones; `at` is their
/// acquisition time. Leases are taken one at a time. On a rate-limited cap (`gate`), the rate
/// is charged once the slots are taken and before they are handed out; they are given back
/// when it refuses (both or neither). `share` is where the slots' share is (`shares`; 0:
/// none), written into their holder records before they are published.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn take(
    cap: &Cap,
    n: u32,
    k: u32,
    from: u32,
    at: i64,
    kind: Kind,
    gate: Option<&rates::Gate>,
    share: u32,
) -> Result<Option<Taken>, SlotError> {
    if k == 1 {
        // The common case, without the bookkeeping below.
        return Ok(search(cap, from, n, at, kind, gate, share)?.map(Taken::One));
    }
    take_many(cap, n, k, from, at, gate, share)
}

#[inline(never)]
fn take_many(
    cap: &Cap,
    n: u32,
    k: u32,
    from: u32,
    at: i64,
    gate: Option<&rates::Gate>,
    share: u32,
) -> Result<Option<Taken>, SlotError> {
    let mut got = Vec::with_capacity(k as usize);
    while got.len() < k as usize {
        match search(cap, from, n, at, Kind::Session, None, share)? {
            Some(g) => got.push(g),
            None => break,
        }
    }
    if got.len() == k as usize {
        match gate.map(|g| g.charge(k)).unwrap_or(Ok(true)) {
            Ok(true) => return Ok(Some(Taken::Many(got))),
            Ok(false) => {
                give_back(cap, got);
                return Ok(None);
            }
            Err(e) => {
                give_back(cap, got);
                return Err(e);
            }
        }
    }
    give_back(cap, got);
    Ok(None)
}

/// Not all of them, or the rate refused: gives back the slots taken, as if never taken
/// (nothing is counted). Nobody is woken: the free slots covered this call and those ahead
/// of it, so what failed it is a raw lock the bitmap cannot see (or the rate, which a release
/// does not change), and waking the others would only make them fail the same way and wake us
/// back, round and round; the next release or recheck serves them.
fn give_back(cap: &Cap, got: Vec<Got>) {
    let key = cap.key();
    for g in got {
        locks::unlock(key, g.slot);
        cap.record(g.slot).clear();
        occupancy::clear(cap.bits(), g.slot);
        session::untrack(Held {
            cap: cap.at,
            key,
            slot: g.slot,
            token: g.token,
        });
    }
}

/// Takes the lowest slot of `[from, n)` that is clear in the bitmap and free in the lock
/// manager; `at` is recorded as a session slot's acquisition time (a lease's is the clock's
/// now), `share` as its share (0: none).
fn search(
    cap: &Cap,
    from: u32,
    n: u32,
    at: i64,
    kind: Kind,
    gate: Option<&rates::Gate>,
    share: u32,
) -> Result<Option<Got>, SlotError> {
    let key = cap.key();
    let (records, bits) = cap.block();
    let limit = cap.limit();
    let mut from = from;
    while let Some(claim) = occupancy::claim_first_free(bits, from, n) {
        // An adaptive cap holding its limit already (its slots above the limit, taken before
        // the limit fell, count too): none. Checked after the claim, so that two callers
        // claiming at once cannot both pass (`occupancy::more_than`).
        if limit != 0 && occupancy::more_than(bits, limit) {
            return Ok(None); // dropping `claim` clears the bit
        }
        let slot = claim.slot();
        match locks::try_lock(key, slot) {
            Probe::Acquired => {
                // A session slot is ours and not yet handed out: the rate now, or neither (a
                // lease is charged once its room under the horizon is known: `grant_lease`).
                if let (Some(g), Kind::Session) = (gate, kind) {
                    match g.charge(1) {
                        Ok(true) => {}
                        Ok(false) => {
                            locks::unlock(key, slot);
                            return Ok(None); // dropping `claim` clears the bit
                        }
                        Err(e) => {
                            locks::unlock(key, slot);
                            return Err(e);
                        }
                    }
                }
                let token = cap.next_token();
                // Ours (the bit is claimed) and not yet published: a release of the slot
                // reads its share only once its holder is set. A free slot's record names no
                // share (`clear`), so a call in none writes nothing.
                if share != 0 {
                    records[slot as usize].set_share(share);
                }
                match kind {
                    Kind::Session => {
                        records[slot as usize].set(session::pid(), at);
                        session::track(Held {
                            cap: cap.at,
                            key,
                            slot,
                            token,
                        });
                    }
                    // A lease is held by its token, not by this session: the lock only showed
                    // that no raw advisory lock holds the slot. The set bit keeps others off it;
                    // on an error, dropping `claim` clears it.
                    Kind::Lease { ttl_us } => {
                        let granted = grant_lease(cap, key, slot, token, ttl_us, gate);
                        if !matches!(granted, Ok(true)) {
                            if share != 0 {
                                records[slot as usize].set_share(0);
                            }
                            granted?;
                            return Ok(None); // the rate refused; dropping `claim` clears the bit
                        }
                    }
                }
                return Ok(Some(Got {
                    slot: claim.keep(),
                    token,
                }));
            }
            // Held by this very session through a raw advisory lock: giving it out again would
            // count one lock twice. Undo the re-entrant count and look further.
            Probe::AlreadyMine => {
                locks::unlock(key, slot);
            }
            // Held through a raw advisory lock by another session: it counts as taken.
            Probe::Busy => {}
        }
        from = slot + 1; // dropping `claim` clears the bit
    }
    Ok(None)
}

/// `DROP EXTENSION stage_e_slots` committed in this database: its caps end. Leases are freed
/// (their functions are gone, so nobody could renew or release them), pending counts are
/// dropped (their table is gone), each cap's committed horizon is forgotten, so that a
/// re-created extension's first lease waits for a row in its own, new table, and its counts
/// restart at zero, so that the new extension's `stage_e_stats()` starts clean like its table
/// (after the policies end: no adaptive window spans the restart). Session slots stay
/// with their sessions: they are the lock manager's locks, which a re-created extension sees
/// as taken until their sessions release them or end; the caps keep their keys and slots.
pub fn end_database() {
    limits::end_database(session::database());
    let mut leases = 0;
    for cap in shmem::caps(Some(session::database())) {
        leases += cap.expire_leases(i64::MAX).len();
        cap.forget_horizon();
    }
    let (pending, _) = crate::flush::discard_pending(session::database());
    // Counted by the LOG line below first. A cap whose flush holds its role (waiting for this
    // drop's lock on the table, and bound to fail) is restarted, its pending counts dropped,
    // as that flush gives the role back.
    for cap in shmem::caps(Some(session::database())) {
        cap.restart_counts(session::pid());
    }
    if leases + pending > 0 {
        crate::report::log(format!(
            "stage_e_slots: the extension was dropped from database {}: freed {leases} \
             lease(s) and dropped the pending counters of {pending} cap(s)",
            session::database()
        ));
    }
}

/// `stage_e_slot_token(cap, slot)`: the fencing token of the session slot this session holds,
/// or None.
pub fn slot_token(cap: Option<&str>, slot: Option<i32>) -> Result<Option<u64>, SlotError> {
    attached()?;
    let name = check_name(cap)?;
    let slot = check_slot(slot)?;
    let Some((_, key)) = existing_key(name) else {
        return Ok(None);
    };
    Ok(session::tracked_slot(key, slot)
        .filter(|h| locks::held_by_me(h.key, h.slot))
        .map(|h| h.token))
}

/// `stage_e_release(cap, slot)`: releases the slot if this session holds it; otherwise changes
/// nothing but the foreign-release count and reports who does hold it.
pub fn release(cap: Option<&str>, slot: Option<i32>) -> Result<Release, SlotError> {
    ready()?;
    let name = check_name(cap)?;
    let slot = check_slot(slot)?;
    // Counted on the cap if it exists here; a release never creates one. Its key is the live
    // cap's (`keys`: a name's key is not always its hash).
    let (pinned, key) = match existing_key(name) {
        Some((cap, key)) => (Some(cap), key),
        None => (None, crate::keys::key_of(name)),
    };
    // Untracked at once: from here on, it is released (below) or reported lost
    // (`not_released`), and neither can fail in between.
    let tracked = session::take_tracked(key, slot);
    // A tracked slot is held unless its lock was dropped behind our back earlier in this
    // transaction (transaction end reconciles), so go straight to the lock manager; an untracked
    // one is checked first, so that a foreign release does not draw core's WARNING too.
    if (tracked.is_some() || locks::held_by_me(key, slot)) && locks::unlock(key, slot) {
        // Counted only if the extension handed it out: a raw pg_advisory_lock on the slot's key
        // released here was never acquired, and released must not pass acquired.
        if let Some(held) = tracked {
            held::drop_bookkeeping(pinned.as_ref(), held, Some(session::statement_start()));
            if let Some(cap) = &pinned {
                cap.counters().bump(Counter::Released, 1);
            }
        }
        return Ok(Release::Released);
    }
    not_released(pinned, tracked, key, slot)
}

/// The slot was not this session's (or its lock went behind the extension's back): counted
/// as a foreign release, and who holds it now, for the WARNING.
#[cold]
#[inline(never)]
fn not_released(
    pinned: Option<Cap>,
    tracked: Option<Held>,
    key: i32,
    slot: u32,
) -> Result<Release, SlotError> {
    if let Some(held) = tracked {
        held::lost(pinned.as_ref(), held);
    }
    if let Some(cap) = &pinned {
        cap.counters().bump(Counter::ForeignReleases, 1);
    }
    Ok(Release::NotHeld {
        holder: locks::holder_of(key, slot),
        leased: pinned.is_some_and(|cap| cap.lease_of(slot).is_some()),
    })
}

/// Which slots `release_all` releases.
#[derive(Clone, Copy, Debug)]
pub enum Caps<'a> {
    /// `stage_e_release_all()`: of every cap.
    Every,
    /// `stage_e_release_all(cap)`: of this one (None when the argument was NULL).
    One(Option<&'a str>),
}

/// `stage_e_release_all(cap)` or `stage_e_release_all()`: releases every slot this session took
/// through the extension (of that cap, or of every cap).
pub fn release_all(caps: Caps) -> Result<u32, SlotError> {
    ready()?;
    let key = match caps {
        // A cap that does not exist here has no slot of this session (a held slot keeps its
        // cap), so its key is no business of ours: nothing is released.
        Caps::One(name) => match existing_key(check_name(name)?) {
            Some((_, key)) => Some(key),
            None => return Ok(0),
        },
        Caps::Every => None,
    };
    let mut released = 0;
    let now = session::statement_start();
    held::each_with_cap(session::tracked(key), |pinned, held| {
        if locks::held_by_me(held.key, held.slot) {
            locks::unlock(held.key, held.slot);
            held::bump(pinned, held, Counter::Released, 1);
            held::forget(pinned, held, Some(now));
            released += 1;
        } else {
            held::lost(pinned, held);
        }
    });
    Ok(released)
}

/// `stage_e_holding(cap, slot)`: whether this session holds the slot's lock right now.
pub fn holding(cap: Option<&str>, slot: Option<i32>) -> Result<bool, SlotError> {
    ready()?;
    let name = check_name(cap)?;
    let slot = check_slot(slot)?;
    let key = match existing_key(name) {
        Some((_, key)) => key,
        None => crate::keys::key_of(name),
    };
    let held = locks::held_by_me(key, slot);
    if !held {
        if let Some(h) = session::tracked_slot(key, slot) {
            held::lost(None, h);
        }
    }
    Ok(held)
}
