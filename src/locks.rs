//! The lock manager side of a slot: slot `s` of a cap is the session-level advisory lock on the
//! int4 pair `(key, s)` in the current database, where `key` is the cap's lock key
//! (`stage_e_slots.lock_key` for `default`, `stage_e_cap_key(name)` for the others): the very
//! lock that `pg_try_advisory_lock(key, s)` takes, so raw clients and the extension contend both
//! ways.
//!
//! This module is the only place that builds a LOCKTAG or calls the lock manager.

use pgrx::pg_sys;

/// What `LockAcquire(dontWait)` found.
#[derive(Debug, PartialEq, Eq)]
pub enum Probe {
    /// The lock was free and this session now holds it.
    Acquired,
    /// This session already held it (advisory locks are re-entrant: the count went up by one).
    AlreadyMine,
    /// Another session holds it.
    Busy,
}

const MODE: pg_sys::LOCKMODE = pg_sys::ExclusiveLock as pg_sys::LOCKMODE;

/// `SET_LOCKTAG_INT32(tag, MyDatabaseId, key1, key2)` from lockfuncs.c: field4 = 2 marks the
/// int4-pair form (1 is the int8 form), which is why pg_locks shows objsubid = 2.
fn slot_tag(key: i32, slot: u32) -> pg_sys::LOCKTAG {
    pg_sys::LOCKTAG {
        // SAFETY: MyDatabaseId is set once at backend start-up, before any SQL function runs.
        locktag_field1: unsafe { pg_sys::MyDatabaseId }.to_u32(),
        locktag_field2: key as u32,
        locktag_field3: slot,
        locktag_field4: 2,
        locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
        locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
    }
}

/// Takes the slot's lock without waiting.
pub fn try_lock(key: i32, slot: u32) -> Probe {
    let tag = slot_tag(key, slot);
    // SAFETY: a session lock with dontWait never sleeps; an ERROR inside (lock table full)
    // arrives as a Rust panic through pgrx's FFI guard, and callers hold only RAII state.
    let r = unsafe { pg_sys::LockAcquire(&tag, MODE, true, true) };
    match r {
        pg_sys::LockAcquireResult::LOCKACQUIRE_OK => Probe::Acquired,
        pg_sys::LockAcquireResult::LOCKACQUIRE_ALREADY_HELD
        | pg_sys::LockAcquireResult::LOCKACQUIRE_ALREADY_CLEAR => Probe::AlreadyMine,
        _ => Probe::Busy,
    }
}

/// Drops one hold of the slot's lock. False (and a core WARNING) if this session has none,
/// so callers check [`held_by_me`] first.
pub fn unlock(key: i32, slot: u32) -> bool {
    let tag = slot_tag(key, slot);
    // SAFETY: a valid advisory tag and mode; releasing a session lock touches only this
    // backend's lock entries and the lock's partition (`ffi::lock_release` says why no guard).
    unsafe { crate::ffi::lock_release(&tag, MODE, true) }
}

/// Whether this session holds the slot's lock: a lookup in the backend-local lock table,
/// without pgrx's setjmp guard (`ffi`): it runs at every transaction end of a slot-holding
/// backend.
pub fn held_by_me(key: i32, slot: u32) -> bool {
    let tag = slot_tag(key, slot);
    // SAFETY: `tag` is a valid LOCKTAG on the stack.
    unsafe { crate::ffi::lock_held_by_me(&tag, MODE) }
}

/// A granted int4-pair advisory lock of the current database: `(key, slot, pid)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Granted {
    pub key: i32,
    pub slot: u32,
    pub pid: i32,
}

/// Every granted int4-pair advisory lock in the current database whose second int4 is below
/// `max_slots` (what pg_locks shows), sorted. Takes every lock-partition LWLock: for views,
/// stats and diagnostics, never the acquire path.
pub fn granted(max_slots: u32) -> Vec<Granted> {
    // SAFETY: as in pg_lock_status(): the snapshot is palloc'd in the current memory context,
    // `locks` has `nelements` entries, and nothing here keeps a pointer past this function.
    unsafe {
        let db = pg_sys::MyDatabaseId.to_u32();
        let data = pg_sys::GetLockStatusData();
        let locks = std::slice::from_raw_parts((*data).locks, (*data).nelements as usize);
        let mut out: Vec<Granted> = locks
            .iter()
            .filter(|l| {
                let t = &l.locktag;
                t.locktag_type == pg_sys::LockTagType::LOCKTAG_ADVISORY as u8
                    && t.locktag_field1 == db
                    && t.locktag_field4 == 2
                    && t.locktag_field3 < max_slots
                    && l.holdMask & (1 << MODE) != 0
            })
            .map(|l| Granted {
                key: l.locktag.locktag_field2 as i32,
                slot: l.locktag.locktag_field3,
                pid: l.pid,
            })
            .collect();
        out.sort_unstable();
        out
    }
}

/// The pid holding slot `slot` of the cap with lock key `key`, per the lock manager, if any.
pub fn holder_of(key: i32, slot: u32) -> Option<i32> {
    granted(slot + 1)
        .into_iter()
        .find(|g| g.key == key && g.slot == slot)
        .map(|g| g.pid)
}
