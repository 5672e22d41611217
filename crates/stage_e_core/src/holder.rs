//! The holder record of one slot: who holds it through the extension (a backend's pid, or a
//! lease record's marker, `lease::marker`), and since when.
//!
//! **Protocol.** Written only by the process whose claim set the slot's bit (or, for a lease,
//! by the lease's taker and whoever ends it), before the bit is cleared: `set` stores the time
//! (Relaxed) then the pid (Release); `clear` stores pid 0 (Release) then the time. A reader
//! loads the pid (Acquire, pairing with `set`'s Release) then the time: so a reader that sees
//! the pid sees its time (or, racing a `clear`, zeros), and a reader that sees a lease marker
//! sees the lease record the taker published before it (`lease::LeaseRecord::start`). Readers
//! that see the bit set see the owner's record, or zeros while the owner is between its claim
//! and its `set`.

use crate::sync::{AtomicI32, AtomicI64, AtomicU32, Ordering};

/// One slot's holder (zeroed memory: nobody). The arena sizes blocks by its size
/// (`arena::RECORD`).
#[repr(C)]
#[derive(Default)]
pub struct SlotRecord {
    pid: AtomicI32,
    /// Where the share the slot was taken in is (`fair::ShareAt`: a pool index plus one), or
    /// 0 for none (a cap without shares). Written with the holder, read by its release.
    share: AtomicU32,
    acquired_at: AtomicI64,
}

impl SlotRecord {
    pub fn set(&self, pid: i32, acquired_at: i64) {
        self.acquired_at.store(acquired_at, Ordering::Relaxed);
        self.pid.store(pid, Ordering::Release);
    }

    pub fn clear(&self) {
        self.pid.store(0, Ordering::Release);
        self.acquired_at.store(0, Ordering::Relaxed);
        self.share.store(0, Ordering::Relaxed);
    }

    /// The share the slot was taken in (set by its holder after `set`, before anyone can
    /// release it, as it is the holder who releases).
    pub fn set_share(&self, at: u32) {
        self.share.store(at, Ordering::Relaxed);
    }

    /// The share the slot was taken in, 0 for none: read by the release before `clear`.
    pub fn share(&self) -> u32 {
        self.share.load(Ordering::Relaxed)
    }

    /// `(pid, acquired_at)`, pid 0 when nobody holds the slot through the extension.
    pub fn get(&self) -> (i32, i64) {
        let pid = self.pid.load(Ordering::Acquire);
        (pid, self.acquired_at.load(Ordering::Relaxed))
    }
}

#[cfg(not(all(test, loom)))]
const _: () = assert!(size_of::<SlotRecord>() == crate::arena::RECORD);
