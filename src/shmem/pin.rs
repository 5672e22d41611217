//! Pinning a cap's entry, and the pinned handle through which the rest of the extension reaches
//! shared memory.
//!
//! While a [`Cap`] lives, its entry keeps its identity and its slot block: a reclaim or a grow
//! waits for (or gives up on) pinned entries. The protocol is `stage_e_core::state`'s: a pin is
//! published in this backend's own hazard slot (one per PGPROC, each on its own cache line: a
//! SeqCst store and a load, nothing shared written), or counted in the entry's state word when
//! the hazard slot is taken (a backend holding several pins, as `caps` does) or the process has
//! none.

use super::entry::{CapEntry, SlotRecord};
use super::segment::{self, segment};
use super::Cap;
use crate::backend::BackendLocal;
use pgrx::pg_sys;
use stage_e_core::state::{CapRef, Refused};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// The entry is being grown (quick) or reclaimed (then the generation changes): wait a little.
fn nap() {
    segment::nap(50);
}

/// This process's hazard slot, once found: a process keeps its PGPROC, and the segment, for life
/// (a crash reset restarts every backend).
static MY_HAZARD: BackendLocal<Cell<Option<&'static AtomicU64>>> =
    BackendLocal::new(Cell::new(None));

/// This process's hazard slot: one per PGPROC, so each backend has its own.
#[inline]
fn my_hazard() -> Option<&'static AtomicU64> {
    if let Some(h) = MY_HAZARD.get() {
        return Some(h);
    }
    let h = find_my_hazard()?;
    MY_HAZARD.set(Some(h));
    Some(h)
}

#[cold]
#[inline(never)]
fn find_my_hazard() -> Option<&'static AtomicU64> {
    segment()?.hazards.get(my_procno()?).map(|h| &h.0)
}

/// This process's PGPROC number (None without one): the index of its hazard slot and of its
/// waiter record.
pub(super) fn my_procno() -> Option<usize> {
    #[cfg(feature = "pg15")]
    // SAFETY: MyProc is this process's PGPROC, set at start-up (null in the postmaster).
    let procno = unsafe { pg_sys::MyProc.as_ref().map(|p| p.pgprocno as usize) };
    #[cfg(feature = "pg18")]
    // SAFETY: MyProcNumber is set at start-up (-1 without a PGPROC).
    let procno = usize::try_from(unsafe { pg_sys::MyProcNumber }).ok();
    procno
}

impl CapEntry {
    /// Pins the entry if it still holds `cap`: in this backend's hazard slot when it is free
    /// (the hot path), else by counting.
    #[inline]
    pub(super) fn pin(&'static self, cap: CapRef) -> Option<Cap> {
        let Some(hazard) = my_hazard().filter(|h| h.load(Ordering::Relaxed) == 0) else {
            return self.pin_counted(cap);
        };
        let pin = match self.state.try_pin_hazard(hazard, cap) {
            Ok(pin) => pin,
            Err(Refused::Gone) => return None,
            Err(Refused::Locked) => return self.pin_when_unlocked(hazard, cap),
        };
        Some(Cap {
            entry: self,
            at: cap,
            _pin: pin,
        })
    }

    /// The entry is being grown or reclaimed: wait for it, out of the hot path's frame.
    #[cold]
    #[inline(never)]
    fn pin_when_unlocked(&'static self, hazard: &'static AtomicU64, cap: CapRef) -> Option<Cap> {
        let pin = self.state.pin_hazard(hazard, cap, nap)?;
        Some(Cap {
            entry: self,
            at: cap,
            _pin: pin,
        })
    }

    /// Pins the entry by counting in its state word (several pins at once).
    #[inline(never)]
    pub(super) fn pin_counted(&'static self, cap: CapRef) -> Option<Cap> {
        let pin = self.state.pin_counted(cap.generation, nap)?;
        Some(Cap {
            entry: self,
            at: cap,
            _pin: pin,
        })
    }
}

impl CapEntry {
    /// Pins the entry if it holds `cap` and is not LOCKED, without waiting: for a caller
    /// holding the directory lock, which a grower of the LOCKED entry may need.
    pub(super) fn try_pin(&'static self, cap: CapRef) -> Result<Cap, Refused> {
        let pin = match my_hazard().filter(|h| h.load(Ordering::Relaxed) == 0) {
            Some(hazard) => self.state.try_pin_hazard(hazard, cap)?,
            None => self.state.try_pin_counted(cap.generation)?,
        };
        Ok(Cap {
            entry: self,
            at: cap,
            _pin: pin,
        })
    }
}

/// Pins cap `cap` (a reference cached by this backend); None if it was reclaimed since.
pub fn pin(cap: CapRef) -> Option<Cap> {
    segment()?.entry(cap.entry).pin(cap)
}

impl Cap {
    pub(super) fn entry(&self) -> &'static CapEntry {
        self.entry
    }

    pub fn key(&self) -> i32 {
        self.entry.key()
    }

    pub fn database(&self) -> u32 {
        self.entry.database()
    }

    pub fn name(&self) -> String {
        self.entry.name()
    }

    pub fn capacity(&self) -> u32 {
        self.entry.capacity()
    }

    /// The occupancy bitmap of the cap's slots.
    pub fn bits(&self) -> &'static [AtomicU64] {
        self.block().1
    }

    /// The holder records and the occupancy bitmap of the cap's slots, found once.
    pub fn block(&self) -> (&'static [SlotRecord], &'static [AtomicU64]) {
        let seg = segment().expect("a pinned cap implies the segment");
        seg.block(self.entry)
    }

    /// The holder record of `slot` (below [`Cap::capacity`]).
    pub fn record(&self, slot: u32) -> &'static SlotRecord {
        &self.block().0[slot as usize]
    }
}
