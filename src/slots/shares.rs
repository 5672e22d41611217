//! Acquiring in a fair share (issue 38): a call that names a share, and every call on a cap
//! that has live shares (a call without a name is in the cap's unnamed share), takes its
//! slots through the cap's fair queue (`stage_e_core::fair`, placed by `shmem::shares`).
//! A cap that never had a share keeps the path of `super::acquire` (one load more).
//!
//! Protocol of a call that does not wait (`take_now`):
//! 1. under the waits lock: the fair queue says whether the call's share may take `k` of the
//!    free slots now (within its ceiling; while the cap has waiters in shares, only if its
//!    share would be served first), and if so reserves them in the share (charged, counted
//!    held): so two calls of one share at its ceiling cannot both pass;
//! 2. without the lock, as any call: the slots claimed and locked (`super::take`), the rate
//!    charged;
//! 3. taken: each slot's holder record names the share, so that whoever ends the slot (a
//!    release, the session's end, a lease's release or expiry) gives it back to the share
//!    (`held::drop_bookkeeping`, `shmem::leases`). Not taken (a raw lock, a waiter that
//!    claimed first, the rate): the reservation is given back under the lock.
//!
//! The share of a slot is written after its holder record and read by its release before the
//! record is cleared; only the holder releases a session slot, and a lease's slot is ended
//! under its lease record's lock, so no release misses it.
//!
//! A call that waits (`waiting`) joins the cap's queue in its share (`Cap::enqueue_in_share`):
//! the front seats are in the fair queue's order of service, and a seated waiter, woken, takes
//! its slots under the waits lock (`Cap::take_in_line`), so that its grant is counted in its
//! share before any release of those slots can give them back.

use super::{Kind, SlotError, Taken};
use crate::gucs;
use crate::session;
use crate::shmem::{self, Cap};
use stage_e_core::directory;
pub use stage_e_core::fair::Share;
use stage_e_core::fair::{Refused, MAX_WEIGHT, NO_CEILING};

/// The share named `name` of this database (the in-server tests name shares until the SQL
/// surface does), with its weight (1 to 16) and ceiling (None: no
/// ceiling; at least 1): class 22 for a bad name, weight or ceiling.
#[cfg_attr(not(feature = "pg_test"), allow(dead_code))] // until the SQL surface uses it
pub fn named(name: &str, weight: i32, ceiling: Option<i32>) -> Result<Share, SlotError> {
    directory::check_name(name).map_err(SlotError::BadShareName)?;
    if !(1..=MAX_WEIGHT as i32).contains(&weight) {
        return Err(SlotError::BadShareWeight { weight });
    }
    let ceiling = match ceiling {
        None => NO_CEILING,
        Some(c) if c >= 1 => c as u32,
        Some(c) => return Err(SlotError::BadShareCeiling { ceiling: c }),
    };
    Ok(Share {
        digest: shmem::share_digest(session::database(), name),
        weight: weight as u32,
        ceiling,
    })
}

/// The cap's unnamed share: where a call without a share is, on a cap with shares.
pub fn unnamed() -> Share {
    Share {
        digest: shmem::share_digest(session::database(), ""),
        weight: 1,
        ceiling: NO_CEILING,
    }
}

/// What a refusal of the fair queue says to the caller, for a call of `k` slots in `share`.
pub(super) fn refused(r: Refused, share: Share, k: u32) -> SlotError {
    match r {
        Refused::Full => SlotError::NoShareRecord {
            max: gucs::max_shares(),
            share: gucs::database_share(),
        },
        Refused::Ceiling => SlotError::MoreThanCeiling {
            k,
            ceiling: share.ceiling,
        },
        Refused::Weight => SlotError::BadShareWeight {
            weight: share.weight as i32,
        },
    }
}

/// A call that does not wait takes `k` slots of `[0, n)` in `share` now, or None (throttled:
/// the slots are not free, the share is at its ceiling, or another share is to be served
/// first). `at` is the slots' acquisition time.
pub(super) fn take_now(
    cap: &Cap,
    n: u32,
    k: u32,
    at: i64,
    kind: Kind,
    gate: Option<&super::rates::Gate>,
    share: Share,
) -> Result<Option<Taken>, SlotError> {
    if k > share.ceiling {
        return Err(refused(Refused::Ceiling, share, k));
    }
    let Some(place) = cap
        .reserve_now(share, n, k)
        .map_err(|r| refused(r, share, k))?
    else {
        return Ok(None);
    };
    // Served first: from the slots no waiter can use if there are such, else from slot 0
    // (seated waiters are served in the same order, so none of them is passed over).
    let from = if cap.waiters() == 0 {
        0
    } else {
        cap.newcomer(n, k).unwrap_or(0)
    };
    let taken = super::take(cap, n, k, from, at, kind, gate, place.0);
    if !matches!(taken, Ok(Some(_))) {
        cap.give_back_share(place.0, k); // reserved, not taken
    }
    taken
}
