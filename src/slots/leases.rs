//! Leases: a slot held by a token for a ttl rather than by a session (`stage_e_lease`), renewed
//! or released by whoever presents the token (`settle_lease`), and freed when its ttl passes
//! (`expire_due` on the cap's calls, `expire_leases_everywhere` from the background worker).
//!
//! Protocol: a lease is granted (`grant_lease`) only once the cap's committed horizon covers
//! its expiry (`admission::check_room`), counted in the cap's `granting` from that check to its
//! record, so that a lowering of the horizon waits for it; a renewal keeps the same rule. A
//! call that needs more room waits for the launcher's advance unpinned (`admission`), then
//! pins again and checks everything again. Tokens only grow: a token older than the slot's
//! lease is a stale one, lost whoever holds the slot now; only a live lease of another role
//! refuses its token (42501).

use super::{
    acquire, admission, check_name, check_slot, existing, ready, Got, Kind, NamedError, SlotError,
};
use crate::failures::CapError;
use crate::gucs;
use crate::locks;
use crate::session;
use crate::shmem::{self, Cap, Counter};
use stage_e_core::histogram::Metric;
use stage_e_core::share;
use stage_e_core::wait::Wait;

/// What a renewal or a release by token found.
pub enum LeaseOutcome {
    /// Renewed, or released.
    Done,
    /// The lease had expired: it is now freed, counted as expired.
    Expired { held_us: i64 },
    /// The slot has no live lease with this token (the current holder, if any, keeps it).
    NotCurrent { current: Option<shmem::LeaseInfo> },
}

/// `stage_e_lease(cap, n, ttl, wait)`: a slot of `[0, n)` held by a token for `ttl`, waiting up
/// to `wait` for one like a session slot; None when throttled. In `share` (`super::shares`),
/// if given.
pub fn lease(
    cap: Option<&str>,
    n: Option<i32>,
    ttl_us: Option<i64>,
    wait: Wait,
    share: Option<&str>,
) -> Result<Option<Got>, SlotError> {
    let ttl_us = check_ttl(ttl_us)?;
    let kind = Kind::Lease { ttl_us };
    // A lease whose expiry the committed horizon does not cover gives its slot back and waits
    // for the launcher's advance (the first lease of a cap, a longer ttl than before), holding
    // no pin of the cap (`admission`: a grow of the cap would wait for it, and the advance for
    // the grow); the advance leaves a step of room, so the second try fits.
    for _ in 0..3 {
        let got = match acquire(cap, n, Some(1), wait, kind, share) {
            // Every lease record is live: free the expired ones of every cap, and try once more.
            Err(SlotError::NoLeaseRecord { .. }) if expire_leases_everywhere() > 0 => {
                acquire(cap, n, Some(1), wait, kind, share)
            }
            other => other,
        };
        match got {
            Err(SlotError::NeedsRoom { expires_at, token }) => {
                let name = check_name(cap)?;
                // Reclaimed meanwhile (now or during the wait): a new cap starts over.
                let Some(at) = existing(name).map(|pinned| pinned.at) else {
                    continue;
                };
                admission::wait_for_room(at, name, expires_at, token)?;
            }
            other => return Ok(other?.map(|t| t.first())),
        }
    }
    Err(SlotError::named(
        cap.unwrap_or_default(),
        NamedError::NoDurableRoom,
    ))
}

fn check_ttl(ttl_us: Option<i64>) -> Result<i64, SlotError> {
    match ttl_us {
        None => Err(SlotError::NullArgument { name: "ttl" }),
        Some(t) if t <= 0 => Err(SlotError::BadTtl),
        Some(t) if t > gucs::max_lease_ttl_us() => Err(SlotError::TtlTooLong {
            ttl_us: t,
            max_us: gucs::max_lease_ttl_us(),
        }),
        Some(t) => Ok(t),
    }
}

/// Records a lease of `slot` (claimed, and just probed free of raw locks) with `token`, if the
/// committed horizon covers it, the database has room in its share and the cap's rate (if it
/// has one) allows it: false when the rate refused.
#[inline(never)]
pub(super) fn grant_lease(
    cap: &Cap,
    key: i32,
    slot: u32,
    token: u64,
    ttl_us: i64,
    gate: Option<&super::rates::Gate>,
) -> Result<bool, SlotError> {
    locks::unlock(key, slot);
    let now = session::now();
    let expires_at = now.saturating_add(ttl_us);
    let _granting = cap.begin_grant();
    admission::check_room(cap, expires_at, token)?;
    // The rate once the lease's room is known (a lease that must wait for room first is
    // charged when it comes back), before its record: refused, the slot is not granted.
    if let Some(g) = gate {
        if !g.charge(1)? {
            return Ok(false);
        }
    }
    let share = gucs::database_share();
    let limit = share::limit(gucs::max_leases() as u64, share);
    match cap.start_lease(slot, token, now, expires_at, session::user_id(), limit) {
        Ok(()) => Ok(true),
        Err(shmem::LeaseRefused::NoRecord) => Err(SlotError::NoLeaseRecord {
            max_leases: gucs::max_leases(),
        }),
        Err(shmem::LeaseRefused::OverShare) => Err(SlotError::named(
            cap.name(),
            NamedError::Cap(CapError::OverShare {
                pool: crate::failures::Pool::Leases,
                share,
                limit,
            }),
        )),
    }
}

/// Frees the leases of `cap` that have expired, if one may have: counts and logs each; returns
/// how many. Two atomic loads when the cap has no lease.
pub(super) fn expire_due(cap: &Cap) -> usize {
    if cap.lease_count() == 0 {
        return 0;
    }
    let now = session::now();
    if !cap.lease_due(now) {
        return 0;
    }
    expire_and_count(cap, now)
}

/// Frees the leases of `cap` expired by `now`, counting and logging each; returns how many.
fn expire_and_count(cap: &Cap, now: i64) -> usize {
    let expired = cap.expire_leases(now);
    for lease in &expired {
        count_expired(cap, lease, now);
    }
    expired.len()
}

/// Counts an expired lease (expired, and its holding time; a loss for its cap's adaptive policy
/// if it held its slot long enough: `shmem::note_expiry`) and says so in the log.
fn count_expired(cap: &Cap, lease: &shmem::LeaseInfo, now: i64) {
    let held = (now - lease.acquired_at).max(0);
    cap.counters().bump(Counter::Expired, 1);
    cap.counters().bump(Counter::HoldTime, held as u64);
    cap.observe(Metric::Hold, held as u64);
    shmem::note_expiry(cap, held);
    // The token is a key to the slot: the server log only, never the client of this backend
    // (which may be another role's, with client_min_messages = log).
    crate::report::log_server_only(format!(
        "stage_e_slots: lease of slot {} of cap {} (token {}, taken by pid {}) expired; \
         freed after {:.3} s held, {:.3} s past its expiry",
        lease.slot,
        crate::names::quoted(&cap.name()),
        lease.token,
        lease.pid,
        held as f64 / 1e6,
        (now - lease.expires_at).max(0) as f64 / 1e6
    ));
}

/// Frees the expired leases of every database (the background worker's round, and a lease
/// that found every lease record live); returns how many.
pub fn expire_leases_everywhere() -> usize {
    let now = session::now();
    let mut freed = 0;
    for r in shmem::caps_with_leases_due(now) {
        if let Some(cap) = shmem::pin(r) {
            freed += expire_and_count(&cap, now);
        }
    }
    freed
}

/// What to do with a lease, if the token is its current one.
#[derive(Clone, Copy, Debug)]
pub enum LeaseAction {
    /// `stage_e_renew`: extend it to this ttl (microseconds; None when the argument was NULL).
    Renew { ttl_us: Option<i64> },
    /// `stage_e_release_lease`: free it.
    Release,
}

/// `stage_e_renew(cap, slot, token, ttl)` or `stage_e_release_lease(cap, slot, token)`: acts on
/// the slot's lease only if `token` is its current one.
pub fn settle_lease(
    cap: Option<&str>,
    slot: Option<i32>,
    token: Option<i64>,
    action: LeaseAction,
) -> Result<LeaseOutcome, SlotError> {
    ready()?;
    admission::ensure_loaded()?;
    let name = check_name(cap)?;
    let slot = check_slot(slot)?;
    let token = token.ok_or(SlotError::NullArgument { name: "token" })?;
    let ttl_us = match action {
        LeaseAction::Renew { ttl_us } => Some(check_ttl(ttl_us)?),
        LeaseAction::Release => None,
    };
    let releasing = ttl_us.is_none();
    // Counted on the cap if it exists here; this never creates one.
    let Some(mut cap) = existing(name) else {
        return Ok(LeaseOutcome::NotCurrent { current: None });
    };
    // A live lease belongs to the role that took it: anyone else presenting its token, or a
    // guess at or past it, is refused before anything is counted. A token older than the
    // slot's lease is a stale one of the slot (tokens only grow): its holder's lease expired
    // and the slot was leased again, by whichever role; that holder lost it, false and a
    // WARNING, as for any stale token.
    let owner_check = |cap: &Cap| match cap.lease_of(slot) {
        Some(l) if token as u64 >= l.token && !session::may_act_for(l.owner) => {
            Err(SlotError::named(
                name,
                NamedError::NotLeaseOwner {
                    slot,
                    owner: l.owner,
                },
            ))
        }
        _ => Ok(()),
    };
    owner_check(&cap)?;
    let mut now = session::now();
    let mut extend_to = ttl_us.map(|t| now.saturating_add(t));
    // A renewal, too, only to an expiry the committed horizon covers; a renewal that will fail
    // (another token, an expired lease) waits for nothing. Like a grant, it counts in the cap's
    // `granting` from its check until its record (`_granting`, dropped on return, before the
    // pin), so that a lowering of the horizon waits for it (`shmem::committed`, "Lowered"). It
    // waits unpinned and out of `granting` (`admission`), so after each wait the cap is pinned
    // and every check made again, the room for the expiry the renewal will now have included.
    let mut _granting = None;
    let mut waits = 0;
    while let (Some(t), Some(ttl)) = (extend_to, ttl_us) {
        let guard = cap.begin_grant();
        let renewable = cap
            .lease_of(slot)
            .is_some_and(|l| l.token == token as u64 && l.expires_at > now);
        if !(admission::has_horizon() && renewable && admission::check_room(&cap, t, 0).is_err()) {
            _granting = Some(guard);
            break;
        }
        drop(guard);
        if waits == 3 {
            return Err(SlotError::named(name, NamedError::NoDurableRoom));
        }
        waits += 1;
        let at = cap.at;
        drop(cap);
        // Reclaimed meanwhile: it had no live lease left, so none of this token.
        let repinned = admission::wait_for_room(at, name, t, 0)?
            .then(|| shmem::pin(at))
            .flatten();
        let Some(pinned) = repinned else {
            return Ok(LeaseOutcome::NotCurrent { current: None });
        };
        cap = pinned;
        owner_check(&cap)?;
        now = session::now();
        extend_to = Some(now.saturating_add(ttl));
    }
    Ok(match cap.settle_lease(slot, token as u64, now, extend_to) {
        shmem::LeaseCheck::Live(info) => {
            if releasing {
                let held = (now - info.acquired_at).max(0) as u64;
                cap.counters().bump(Counter::Released, 1);
                cap.counters().bump(Counter::HoldTime, held);
                cap.observe(Metric::Hold, held);
            }
            LeaseOutcome::Done
        }
        shmem::LeaseCheck::Expired(info) => {
            count_expired(&cap, &info, now);
            // Its holder is no longer one: a release now is foreign, as it is once a sweep
            // has freed the lease first (whichever comes first, the counts are the same).
            if releasing {
                cap.counters().bump(Counter::ForeignReleases, 1);
            }
            LeaseOutcome::Expired {
                held_us: (now - info.acquired_at).max(0),
            }
        }
        shmem::LeaseCheck::Other(current) => {
            if releasing {
                cap.counters().bump(Counter::ForeignReleases, 1);
            }
            LeaseOutcome::NotCurrent {
                current: Some(current),
            }
        }
        shmem::LeaseCheck::None => {
            if releasing {
                cap.counters().bump(Counter::ForeignReleases, 1);
            }
            LeaseOutcome::NotCurrent { current: None }
        }
    })
}
