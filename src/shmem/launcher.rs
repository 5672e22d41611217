//! Waking the background launcher, and flush ids.
//!
//! The launcher registers its PGPROC in the header; a backend that finds the caps crowded sets
//! `flush_requested` and then the launcher's latch, and the launcher swaps the flag back to 0
//! after each wake-up, so a request made while it works is seen at its next look. Flush ids
//! increase across the server: each is the clock in microseconds, bumped past the last id.

use super::segment::segment;
use pgrx::pg_sys;
use std::sync::atomic::Ordering;

/// A unique, increasing id for the next flush.
pub fn next_flush_id(now_us: u64) -> u64 {
    let Some(seg) = segment() else { return now_us };
    let last = &seg.header.last_flush_id;
    let mut cur = last.load(Ordering::Relaxed);
    loop {
        let id = now_us.max(cur + 1);
        match last.compare_exchange_weak(cur, id, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return id,
            Err(now) => cur = now,
        }
    }
}

/// Asks the launcher for a flush round now.
pub fn request_flush() {
    let Some(seg) = segment() else { return };
    let l = &seg.header.launcher;
    l.flush_requested.store(1, Ordering::Release);
    wake();
}

/// Sets the launcher's latch.
pub(super) fn wake() {
    let Some(seg) = segment() else { return };
    let proc_ = seg.header.launcher.proc_.load(Ordering::Acquire);
    if !proc_.is_null() {
        // SAFETY: a PGPROC lives in shared memory for the server's lifetime; setting the latch
        // of a process that has since exited wakes at worst an unrelated process once.
        unsafe { pg_sys::SetLatch(&raw mut (*proc_).procLatch) };
    }
}

/// The launcher registers itself to be woken by [`request_flush`]; returns whether a flush
/// was requested since the last call.
pub fn launcher_wakeup(register: bool) -> bool {
    let Some(seg) = segment() else { return false };
    let l = &seg.header.launcher;
    if register {
        // SAFETY: MyProc is this process's PGPROC, set at start-up.
        l.proc_.store(unsafe { pg_sys::MyProc }, Ordering::Release);
    }
    l.flush_requested.swap(0, Ordering::AcqRel) != 0
}
