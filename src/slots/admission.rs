//! The lifecycle rules a call keeps (`docs/lifecycle.md`): no acquisition in a database before
//! its durable state is loaded since the server started; none on a cap held back after a crash
//! or a promotion; no lease (or renewal) whose expiry the committed horizon does not cover.
//!
//! Each wait here is a poll of shared memory with a deadline (the launcher's flusher does the
//! work; it commits in its own transaction), answering cancels; none holds a lock or claims a
//! slot while it waits.
//!
//! **No pin across the wait for room.** A lease (or renewal) waiting for its horizon pins its
//! cap only to look, never while it naps. Pinned, it made a cycle with a grow of the same cap
//! (issue 35): the lease waited for the flusher's advance; the flusher's advance pins the cap,
//! so it waited while the grow held the entry LOCKED; the grow waited for the lease's pin to
//! end. Nothing moved until the grow gave up (`CapError::Busy`, after about 2 s). Unpinned
//! between looks, the lease lets the grow finish at once; the caller then takes the cap again
//! and checks everything anew under a fresh pin (a lease is searched for and granted again, a
//! renewal's room and owner are checked again), so the wait relaxes nothing. A call waiting
//! out a hold (which waits only for the clock) looks the same way, so that a grow of the cap
//! does not give up on it (55006), and is admitted afresh after.

use super::{NamedError, SlotError};
use crate::gucs;
use crate::session;
use crate::shmem::{self, Cap, CapRef};
use stage_e_core::lifecycle::Room;
use std::time::{Duration, Instant};

/// How long a call waits for the launcher to load its database or advance a horizon.
const DURABLE_WAIT: Duration = Duration::from_secs(10);

/// Before the first acquisition or lease operation of this backend: waits until the
/// database's rows have been loaded since the segment was made.
#[inline]
pub fn ensure_loaded() -> Result<(), SlotError> {
    if session::database_loaded() {
        return Ok(());
    }
    load()
}

#[cold]
fn load() -> Result<(), SlotError> {
    let db = session::database();
    if !session::under_postmaster() {
        // A single-user backend (`postgres --single`) has no launcher: it loads its database
        // itself (it is the superuser). Leases there still need a flusher, so they fail closed.
        crate::horizons::load(
            db,
            crate::sql::extension().as_ref(),
            &super::limits::restore,
        )
        .map_err(|_| SlotError::NotLoaded)?;
        session::set_database_loaded();
        return Ok(());
    }
    let deadline = Instant::now() + DURABLE_WAIT;
    let mut asked = false;
    loop {
        if shmem::loaded(db).is_some() {
            session::set_database_loaded();
            return Ok(());
        }
        if !asked {
            if !shmem::request_load(db) {
                return Err(SlotError::TooManyDatabases);
            }
            asked = true;
        } else {
            shmem::request_advance(); // in case the launcher restarted meanwhile
        }
        if Instant::now() >= deadline {
            return Err(SlotError::NotLoaded);
        }
        session::nap_ms(5);
    }
}

/// Whether leases of this database are covered by a durable horizon (it has the table).
pub fn has_horizon() -> bool {
    shmem::loaded(session::database()) == Some(true)
}

/// Whether a lease to `expires_at` with `token` may be granted now: `Err(NeedsRoom)` when the
/// horizon or the floor must be advanced first (the caller gives the slot back and waits).
#[inline]
pub fn check_room(cap: &Cap, expires_at: i64, token: u64) -> Result<(), SlotError> {
    if !has_horizon() {
        return Ok(());
    }
    match cap.room(expires_at, token, gucs::lease_horizon_margin_us()) {
        Room::Enough | Room::Ask => Ok(()),
        Room::Wait => Err(SlotError::NeedsRoom { expires_at, token }),
    }
}

/// Waits until a lease to `expires_at` with `token` fits under the committed horizon of the
/// cap `at` (named `name`), pinning it only to look (see the module note): false if the cap
/// was reclaimed meanwhile. The caller holds no pin of it either, and checks again after.
pub fn wait_for_room(
    at: CapRef,
    name: &str,
    expires_at: i64,
    token: u64,
) -> Result<bool, SlotError> {
    let deadline = Instant::now() + DURABLE_WAIT;
    let margin = gucs::lease_horizon_margin_us();
    loop {
        let Some(cap) = shmem::pin(at) else {
            return Ok(false);
        };
        if cap.room(expires_at, token, margin) != Room::Wait {
            return Ok(true);
        }
        drop(cap); // before the nap: a grow of the cap, and the advance behind it, go on
        if Instant::now() >= deadline {
            return Err(SlotError::named(name, NamedError::NoDurableRoom));
        }
        session::nap_ms(2);
    }
}

/// What the hold of a cap means for a call that may wait until `deadline` (None: forever).
pub enum Hold {
    /// Not held back (or the hold ended while waiting): go on.
    Free,
    /// Held back past the call's wait: throttled.
    Throttled,
}

/// Waits out the hold of the cap `at` if the call's wait allows; throttled otherwise. Pinned
/// only to look, as the wait for room is: a grow of the cap goes on meanwhile.
pub fn through_hold(at: CapRef, deadline: Option<Instant>) -> Hold {
    loop {
        let now = session::now();
        // Reclaimed: a held cap is not idle, so its hold has ended.
        let Some(held) = shmem::pin(at).map(|cap| cap.held_until(now)) else {
            return Hold::Free;
        };
        let Some((until, _)) = held else {
            return Hold::Free;
        };
        let left = Duration::from_micros((until - now).max(0) as u64);
        let can_wait = match deadline {
            None => true,
            Some(d) => Instant::now() < d,
        };
        if !can_wait {
            return Hold::Throttled;
        }
        let step = deadline
            .map_or(left, |d| {
                left.min(d.saturating_duration_since(Instant::now()))
            })
            .min(Duration::from_millis(50));
        session::nap_ms((step.as_millis() as i64).max(1));
    }
}
