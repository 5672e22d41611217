//! PostgreSQL functions called without pgrx's FFI guard.
//!
//! pgrx wraps every `pg_sys` call in a `setjmp` guard so that an ERROR (a `longjmp`) becomes a
//! Rust panic instead of skipping Rust frames. The guard costs a few dozen nanoseconds, and the
//! functions below run on every acquire and release (or at every transaction end of a backend
//! that holds slots). Each of them provably cannot raise an ERROR: it reads backend-local or
//! shared state without allocating, and its only failure modes are return values. That is the
//! one rationale for declaring them here ourselves, and the only module that may; a function
//! that can raise an ERROR must go through `pg_sys`.

use pgrx::pg_sys::{LOCKMODE, LOCKTAG};

/// Whether this process is a parallel worker or a leader running a parallel query: a field of
/// the current transaction state.
pub fn is_in_parallel_mode() -> bool {
    unsafe extern "C" {
        fn IsInParallelMode() -> bool;
    }
    // SAFETY: returns a field of the current transaction state; cannot raise an ERROR.
    unsafe { IsInParallelMode() }
}

/// Start of the current statement (a backend-local static).
pub fn statement_start_timestamp() -> i64 {
    unsafe extern "C" {
        fn GetCurrentStatementStartTimestamp() -> pgrx::pg_sys::TimestampTz;
    }
    // SAFETY: returns a backend-local static; cannot raise an ERROR.
    unsafe { GetCurrentStatementStartTimestamp() }
}

/// When the current transaction started (µs since 2000-01-01): its snapshot, whatever the
/// isolation, was taken no earlier.
pub fn transaction_start_timestamp() -> i64 {
    // SAFETY: reads a backend-local static; cannot raise an ERROR.
    unsafe { pgrx::pg_sys::GetCurrentTransactionStartTimestamp() }
}

/// Whether the client's socket is still connected (false when it is gone); a non-blocking poll.
///
/// # Safety
/// Only in a backend with a client connection (`MyProcPort` not null).
pub unsafe fn client_connected() -> bool {
    unsafe extern "C" {
        fn pq_check_connection() -> bool;
    }
    // SAFETY: polls the client socket without blocking; reports failure by its return value.
    unsafe { pq_check_connection() }
}

/// Releases one hold of the session lock `tag` in `mode`; false (and a WARNING) if this session
/// holds none. LockRelease raises an ERROR only for an unknown lock method or mode (the callers'
/// are constants) or on a fast-path lock it cannot re-find (advisory locks never take the fast
/// path); a corrupted lock table is a PANIC, not an ERROR.
///
/// # Safety
/// `tag` points to a valid LOCKTAG of the user lock method, and `mode` is a valid lock mode.
pub unsafe fn lock_release(tag: *const LOCKTAG, mode: LOCKMODE, session_lock: bool) -> bool {
    unsafe extern "C" {
        fn LockRelease(locktag: *const LOCKTAG, lockmode: LOCKMODE, sessionLock: bool) -> bool;
    }
    // SAFETY: per the caller.
    unsafe { LockRelease(tag, mode, session_lock) }
}

/// Whether this session holds `tag` in `mode`: a probe of the backend-local lock hash
/// (HASH_FIND, which cannot raise an ERROR).
///
/// # Safety
/// `tag` points to a valid LOCKTAG.
pub unsafe fn lock_held_by_me(tag: *const LOCKTAG, mode: LOCKMODE) -> bool {
    #[cfg(feature = "pg15")]
    {
        unsafe extern "C" {
            fn LockHeldByMe(locktag: *const LOCKTAG, lockmode: LOCKMODE) -> bool;
        }
        // SAFETY: per the caller.
        unsafe { LockHeldByMe(tag, mode) }
    }
    #[cfg(feature = "pg18")]
    {
        unsafe extern "C" {
            fn LockHeldByMe(locktag: *const LOCKTAG, lockmode: LOCKMODE, orstronger: bool) -> bool;
        }
        // SAFETY: per the caller.
        unsafe { LockHeldByMe(tag, mode, false) }
    }
}

/// Nanoseconds of CLOCK_BOOTTIME: the clock rate limits decide by. It never steps back (a step
/// of the wall clock moves it not at all) and, unlike CLOCK_MONOTONIC, it counts a suspended
/// machine's time, which did pass for every key.
pub fn boottime_ns() -> u64 {
    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }
    unsafe extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_BOOTTIME: i32 = 7; // Linux
    let mut ts = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: libc's clock_gettime writes the struct it is given (64-bit time_t and long on the
    // 64-bit Linux targets this builds for); CLOCK_BOOTTIME exists since Linux 2.6.39.
    let rc = unsafe { clock_gettime(CLOCK_BOOTTIME, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_BOOTTIME) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
