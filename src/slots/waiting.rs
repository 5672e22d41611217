//! Waiting for slots: the policy (who waits, when a waiter looks, what ends a wait) and this
//! backend's sleep. The queue itself is `shmem::waitq`. On a rate-limited cap a waiter at the
//! front whose slots were free but whose rate refused sleeps until the instant the rate allows
//! it (a timer, `rates::Gate::take_retry_after`), or a release, or its deadline.
//!
//! A call that waits joins its cap's queue and sleeps on its own latch, set by a release of its
//! cap while it is at the front of the queue and may take (`stage_e_core::front`), and wakes
//! at least every [`RECHECK`] to look again: the only wake-up the extension cannot send is for
//! a slot freed by a raw `pg_advisory_unlock`. Each wake-up first frees the cap's expired leases.
//! Interrupts are answered as everywhere in Postgres: `CHECK_FOR_INTERRUPTS` after each sleep
//! raises the ERROR of a cancel or `statement_timeout` (the queue guard then leaves the queue
//! while the ERROR unwinds) or exits for `pg_terminate_backend` (the exit hook leaves it), and
//! the client's socket is checked at every timed-out sleep (at least every [`RECHECK`] or two),
//! so a client that went away ends the wait too.

use super::shares::CallShare;
use super::{Kind, SlotError, Taken};
use crate::backend::BackendLocal;
use crate::ffi;
use crate::session;
use crate::shmem::{self, Cap, CapRef, Counter, Ticket};
use pgrx::pg_sys;
use stage_e_core::histogram::Metric;
use std::cell::Cell;
use std::time::Duration;

/// How long a waiter sleeps at most before looking again by itself.
pub const RECHECK: Duration = Duration::from_millis(100);

static WAIT_EVENT: BackendLocal<Cell<u32>> = BackendLocal::new(Cell::new(0));

/// The wait event a waiter shows: `Extension`, named `StageESlotWait` on PostgreSQL 17+.
fn wait_event() -> u32 {
    let cached = WAIT_EVENT.get();
    if cached != 0 {
        return cached;
    }
    #[cfg(feature = "pg18")]
    // SAFETY: registers (or finds) the name in shared memory; called in a backend.
    let event = unsafe { pg_sys::WaitEventExtensionNew(c"StageESlotWait".as_ptr()) };
    #[cfg(not(feature = "pg18"))]
    let event = pg_sys::PG_WAIT_EXTENSION;
    WAIT_EVENT.set(event);
    event
}

/// Clears this backend's latch, before looking at the queue (so a wake-up set after the look
/// ends the next sleep at once).
pub fn reset_latch() {
    // SAFETY: MyLatch is this backend's own latch.
    unsafe { pg_sys::ResetLatch(pg_sys::MyLatch) };
}

/// Sleeps until the latch is set or `timeout` passes, then answers interrupts and, when the
/// sleep ran out or `checked` (when the client was last looked at) is [`RECHECK`] old, checks
/// that the client is still there. A waiter woken by a release does not poll its socket (two
/// `epoll_ctl` and an `epoll_wait`, a fifth of a hand-off's system calls); one left alone times
/// out every [`RECHECK`] and looks, and one woken in vain again and again looks at least every
/// second [`RECHECK`].
pub fn sleep(timeout: Duration, checked: &mut std::time::Instant) {
    let ms = timeout.as_millis().clamp(1, RECHECK.as_millis()) as std::ffi::c_long;
    let events = (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32;
    // SAFETY: WaitLatch on our own latch; it may exit the process on postmaster death, which
    // runs the exit hook. An ERROR inside arrives as a Rust panic and unwinds the caller's guard.
    let rc = unsafe { pg_sys::WaitLatch(pg_sys::MyLatch, events, ms, wait_event()) };
    let now = std::time::Instant::now();
    if rc & pg_sys::WL_TIMEOUT as i32 != 0 || now.duration_since(*checked) >= RECHECK {
        *checked = now;
        // SAFETY: the poll runs only with a client connection. A client that went away is
        // reported the way client_connection_check_interval does, by CHECK_FOR_INTERRUPTS
        // below (FATAL: connection to client lost).
        unsafe {
            if !pg_sys::MyProcPort.is_null() && !ffi::client_connected() {
                pg_sys::ClientConnectionLost = 1;
                pg_sys::InterruptPending = 1;
            }
        }
    }
    pgrx::check_for_interrupts!();
}
/// Queues for `k` slots of `cap` until they are had or `deadline` passes. In `share` (or, on a
/// cap with shares, in its unnamed share) the queue is the cap's fair queue (`shares`): the
/// front is seated in its order, and a seated waiter takes under the waits lock.
pub(super) fn wait_in_line(
    cap: Cap,
    n: u32,
    k: u32,
    deadline: Option<std::time::Instant>,
    kind: Kind,
    gate: Option<&super::rates::Gate>,
    share: Option<&CallShare>,
) -> Result<Option<Taken>, SlotError> {
    let started = session::now();
    let counters = cap.counters();
    // A cap that has shares since this call looked: its unnamed share.
    let unnamed = match share {
        None if cap.has_shares() => Some(super::shares::resolve(&cap.name(), None)?),
        _ => None,
    };
    let ticket = match share.or(unnamed.as_ref()) {
        None => cap.enqueue(n, k, started),
        Some(s) => cap
            .enqueue_in_share(s.share, &s.name, n, k, started)
            .map_err(|r| super::shares::refused(r, s.share, k))?,
    }
    .ok_or(SlotError::NoWaiterRecord)?;
    // Counted as a wait (`waits`, its time and histogram) only once its first look in line
    // did not take: a call served at that look (on a cap with waiters, one that goes in line
    // at once and whose turn it is) did not wait.
    let mut waiting = false;
    let place = cap.at;
    drop(cap); // a waiter holds no pin while it sleeps (its cap is not reclaimed meanwhile)

    // Leaves the queue however this ends: returning, an ERROR unwinding, or (through the exit
    // hook) the process exiting.
    let queued = Queued::new(place, ticket);
    let waited = || (session::now() - started).max(0) as u64;
    let mut checked = std::time::Instant::now();
    loop {
        reset_latch();
        let cap = shmem::pin(place).expect("a cap with waiters is never reclaimed");
        super::expire_due(&cap); // wakes the waiters that the freed slots serve, us included
        let mut rate_wait = None;
        if let Some(from) = cap.may_take(ticket) {
            // Without the lock, from where the front says. On a cap with shares (ours, or
            // shares that came since we joined) the grant is then counted in the share, under
            // the lock; a lease, which another session may release, is taken under it.
            let got = match kind {
                Kind::Lease { .. } if cap.has_shares() => {
                    cap.take_in_line(ticket, session::now(), |from, at| {
                        super::take(&cap, n, k, from, session::now(), kind, gate, at)
                    })?
                }
                _ => {
                    let got = super::take(&cap, n, k, from, session::now(), kind, gate, 0)?;
                    if let Some(got) = got.as_ref().filter(|_| cap.has_shares()) {
                        cap.granted_in_line(ticket, session::now(), got.slots());
                    }
                    got
                }
            };
            if let Some(got) = got {
                drop(queued); // moves the front up, and wakes whom the free slots cover
                counters.bump(Counter::Acquired, k as u64);
                if waiting {
                    let waited = waited();
                    counters.bump(Counter::WaitTime, waited);
                    cap.observe(Metric::Wait, waited);
                }
                return Ok(Some(got));
            }
            // The rate refused (the slots were free): a timer for the instant it allows,
            // keeping this waiter's place (no later arrival takes the rate first).
            rate_wait = gate.and_then(|g| g.take_retry_after());
        }
        if !waiting {
            waiting = true;
            counters.bump(Counter::Waits, 1);
        }
        let left = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
        if left.is_some_and(|l| l.is_zero()) {
            let waited = waited();
            cap.observe(Metric::Wait, waited);
            drop(cap);
            drop(queued);
            counters.bump(Counter::WaitTimeouts, 1);
            super::rates::count_throttled(counters, gate);
            counters.bump(Counter::WaitTime, waited);
            return Ok(None);
        }
        drop(cap);
        let nap = left.unwrap_or(RECHECK).min(RECHECK);
        sleep(rate_wait.map_or(nap, |r| nap.min(r)), &mut checked);
    }
}

/// This backend's place in a cap's queue while it waits: leaving the scope (a return, or an
/// ERROR unwinding) leaves the queue; a process exit leaves it through the exit hook.
struct Queued {
    place: (CapRef, Ticket),
}

impl Queued {
    fn new(cap: CapRef, ticket: Ticket) -> Self {
        session::set_waiting(Some((cap, ticket)));
        Queued {
            place: (cap, ticket),
        }
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        session::set_waiting(None);
        shmem::dequeue(self.place.0, self.place.1);
    }
}
