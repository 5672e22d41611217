//! Waiting for a slot: this backend's sleep on its latch, with a timeout, the wait event that
//! `pg_stat_activity` shows, and the answers to interrupts while asleep.
//!
//! A waiter sleeps on its own latch, set by a release of its cap while it is at the front of
//! the queue and covered by the free slots (`shmem`'s "Waiting"), and wakes at least every [`RECHECK`] to look again: the only
//! wake-up the extension cannot send is for a slot freed by a raw `pg_advisory_unlock`.
//! Interrupts are answered as everywhere in Postgres: `CHECK_FOR_INTERRUPTS` after each sleep
//! raises the ERROR of a cancel or `statement_timeout` (the queue guard then leaves the queue
//! while the ERROR unwinds) or exits for `pg_terminate_backend` (the exit hook leaves it), and
//! the client's socket is checked each time, so a client that went away ends the wait too.

use pgrx::pg_sys;
use std::cell::Cell;
use std::time::Duration;

/// How long a waiter sleeps at most before looking again by itself.
pub const RECHECK: Duration = Duration::from_millis(100);

/// How long a call may wait for its slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Not at all: today's try.
    No,
    For(Duration),
    /// `'infinity'` (PostgreSQL 17+): until a slot frees or the statement is cancelled.
    Forever,
}

impl Wait {
    /// From an interval's months, days and microseconds: None when negative.
    pub fn from_interval(months: i32, days: i32, micros: i64) -> Option<Wait> {
        if months == i32::MAX && days == i32::MAX && micros == i64::MAX {
            return Some(Wait::Forever);
        }
        match interval_micros(months, days, micros) {
            ..0 => None,
            0 => Some(Wait::No),
            us => Some(Wait::For(Duration::from_micros(
                us.min(u64::MAX as i128) as u64
            ))),
        }
    }
}

/// An interval's months, days and microseconds as microseconds (a month as 30 days, as
/// PostgreSQL's interval arithmetic does), without overflow.
pub fn interval_micros(months: i32, days: i32, micros: i64) -> i128 {
    micros as i128 + days as i128 * 86_400_000_000 + months as i128 * 2_592_000_000_000
}

thread_local! {
    static WAIT_EVENT: Cell<u32> = const { Cell::new(0) };
}

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

/// Sleeps until the latch is set or `timeout` passes, then answers interrupts and checks that
/// the client is still there.
pub fn sleep(timeout: Duration) {
    let ms = timeout.as_millis().clamp(1, RECHECK.as_millis()) as std::ffi::c_long;
    let events = (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32;
    // SAFETY: WaitLatch on our own latch; it may exit the process on postmaster death, which
    // runs the exit hook. An ERROR inside arrives as a Rust panic and unwinds the caller's guard.
    unsafe { pg_sys::WaitLatch(pg_sys::MyLatch, events, ms, wait_event()) };
    unsafe extern "C" {
        fn pq_check_connection() -> bool;
    }
    // SAFETY: polls the client socket without blocking and cannot raise an ERROR. A client that
    // went away is reported the way client_connection_check_interval does, by
    // CHECK_FOR_INTERRUPTS below (FATAL: connection to client lost).
    unsafe {
        if !pg_sys::MyProcPort.is_null() && !pq_check_connection() {
            pg_sys::ClientConnectionLost = 1;
            pg_sys::InterruptPending = 1;
        }
    }
    pgrx::check_for_interrupts!();
}

/// Now, as a TimestampTz (microseconds since 2000-01-01).
pub fn now() -> i64 {
    // SAFETY: reads the clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn intervals_become_waits() {
        assert_eq!(Wait::from_interval(0, 0, 0), Some(Wait::No));
        assert_eq!(
            Wait::from_interval(0, 0, 1_500_000),
            Some(Wait::For(Duration::from_millis(1500)))
        );
        assert_eq!(
            Wait::from_interval(0, 1, -3_600_000_000),
            Some(Wait::For(Duration::from_secs(23 * 3600)))
        );
        assert_eq!(Wait::from_interval(0, 0, -1), None);
        assert_eq!(Wait::from_interval(-1, 0, 0), None);
        assert_eq!(
            Wait::from_interval(i32::MAX, i32::MAX, i64::MAX),
            Some(Wait::Forever)
        );
    }
}
