//! A cap entry's state word and the pins that keep an entry's identity and slot block while a
//! backend uses them.
//!
//! **The word.** Generation (high 32 bits), LOCKED (bit 31), counted pins (bits 0-30). A backend
//! remembers a cap as `(entry, generation)` ([`CapRef`]); reclaiming the entry bumps the
//! generation, so every remembered reference to the old cap fails to pin and is looked up again.
//!
//! **Pins.** The hot path pins through the backend's own *hazard slot* ([`State::pin_hazard`]):
//! a SeqCst store of `(entry, generation)` into the slot, then a SeqCst load of the word. No
//! shared write, so pinning costs no cache-line transfer. A backend that needs several pins at
//! once counts them in the word instead ([`State::pin_counted`], a CAS).
//!
//! **Growing and reclaiming** (under the caller's exclusive directory lock) first set LOCKED,
//! which stops new pins, then act only once no counted pin is left and no hazard slot names the
//! entry at its generation. SeqCst on both sides (the pinner stores its hazard then loads the
//! word; the locker stores LOCKED then loads the hazards), so of each pair one sees the other:
//! either the pinner sees LOCKED and backs off, or the locker sees the pin and waits or gives up.

use std::sync::atomic::{AtomicU64, Ordering};

/// Set while the entry is being grown or reclaimed.
pub const LOCKED: u64 = 1 << 31;
/// The counted pins.
pub const PINS: u64 = LOCKED - 1;

/// The generation in a state word.
pub fn generation(state: u64) -> u32 {
    (state >> 32) as u32
}

/// A cap as a backend remembers it: its entry and the entry's generation at the time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CapRef {
    pub entry: u32,
    pub generation: u32,
}

/// What a hazard slot holds while it pins `cap`: never 0 (an empty slot).
pub fn hazard_value(cap: CapRef) -> u64 {
    ((cap.entry as u64 + 1) << 32) | cap.generation as u64
}

/// Whether one of `hazards` pins `cap`.
pub fn hazard_pinned<'a>(hazards: impl IntoIterator<Item = &'a AtomicU64>, cap: CapRef) -> bool {
    let v = hazard_value(cap);
    hazards.into_iter().any(|h| h.load(Ordering::SeqCst) == v)
}

/// Ends a hazard pin.
fn unpin_hazard(hazard: &AtomicU64) {
    hazard.store(0, Ordering::Release);
}

/// A pin that took: while it lives the entry keeps its generation and is not LOCKED by a grow
/// or reclaim; dropping it unpins. Only [`State::pin_hazard`] and [`State::pin_counted`] make
/// one, and only when the pin took, so an unpin always matches a pin.
#[must_use]
pub struct Pin<'a>(Pinned<'a>);

enum Pinned<'a> {
    Hazard(&'a AtomicU64),
    Counted(&'a State),
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        match self.0 {
            Pinned::Hazard(h) => unpin_hazard(h),
            Pinned::Counted(s) => s.unpin_counted(),
        }
    }
}

/// Spins while an entry is LOCKED; every 64 spins, `nap` (a short sleep: growing is quick, and
/// a reclaim changes the generation, after which the pin fails).
fn backoff(spins: &mut u32, nap: &mut impl FnMut()) {
    *spins += 1;
    if spins.is_multiple_of(64) {
        nap();
    }
    std::hint::spin_loop();
}

/// Why a pin was not had.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The entry has another generation: the cap was reclaimed.
    Gone,
    /// The entry is LOCKED (being grown or reclaimed) for now.
    Locked,
}

/// An entry's state word (zeroed memory: generation 0, unlocked, unpinned).
#[repr(transparent)]
#[derive(Default)]
pub struct State(AtomicU64);

impl State {
    pub fn load(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    /// The entry as a reference at its current generation.
    pub fn cap_ref(&self, entry: u32) -> CapRef {
        CapRef {
            entry,
            generation: generation(self.load()),
        }
    }

    /// Pins `cap` through `hazard` (this backend's own, empty): the pin if the entry still has
    /// `cap`'s generation; None, with the slot empty again, if not.
    #[inline]
    pub fn pin_hazard<'a>(
        &'a self,
        hazard: &'a AtomicU64,
        cap: CapRef,
        mut nap: impl FnMut(),
    ) -> Option<Pin<'a>> {
        let mut spins = 0;
        loop {
            match self.try_pin_hazard(hazard, cap) {
                Ok(pin) => return Some(pin),
                Err(Refused::Gone) => return None,
                Err(Refused::Locked) => backoff(&mut spins, &mut nap),
            }
        }
    }

    /// One attempt at [`State::pin_hazard`], without waiting while the entry is LOCKED: for a
    /// caller that holds a lock the LOCKED entry's owner may need (it lets go, then retries).
    #[inline]
    pub fn try_pin_hazard<'a>(
        &'a self,
        hazard: &'a AtomicU64,
        cap: CapRef,
    ) -> Result<Pin<'a>, Refused> {
        // Publish, then look (SeqCst both): see the module note.
        hazard.store(hazard_value(cap), Ordering::SeqCst);
        let s = self.0.load(Ordering::SeqCst);
        if generation(s) != cap.generation {
            unpin_hazard(hazard);
            return Err(Refused::Gone);
        }
        if s & LOCKED != 0 {
            unpin_hazard(hazard);
            return Err(Refused::Locked);
        }
        Ok(Pin(Pinned::Hazard(hazard)))
    }

    /// Pins the entry at `generation` by counting in the word; None if it has another.
    pub fn pin_counted(&self, generation_: u32, mut nap: impl FnMut()) -> Option<Pin<'_>> {
        let mut spins = 0;
        loop {
            match self.try_pin_counted(generation_) {
                Ok(pin) => return Some(pin),
                Err(Refused::Gone) => return None,
                Err(Refused::Locked) => backoff(&mut spins, &mut nap),
            }
        }
    }

    /// One attempt at [`State::pin_counted`], without waiting while the entry is LOCKED.
    pub fn try_pin_counted(&self, generation_: u32) -> Result<Pin<'_>, Refused> {
        loop {
            let s = self.0.load(Ordering::Acquire);
            if generation(s) != generation_ {
                return Err(Refused::Gone);
            }
            if s & LOCKED != 0 {
                return Err(Refused::Locked);
            }
            if self
                .0
                .compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Ok(Pin(Pinned::Counted(self)));
            }
        }
    }

    fn unpin_counted(&self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }

    /// Whether any pin holds the entry in state `s`: counted, or a hazard slot naming it.
    pub fn pinned<'a>(
        &self,
        entry: u32,
        s: u64,
        hazards: impl IntoIterator<Item = &'a AtomicU64>,
    ) -> bool {
        self.0.load(Ordering::SeqCst) & PINS != 0
            || hazard_pinned(
                hazards,
                CapRef {
                    entry,
                    generation: generation(s),
                },
            )
    }

    /// Sets LOCKED (new pins wait); returns the word before. If it was LOCKED already,
    /// another process holds the lock and the caller must leave the word alone.
    pub fn lock(&self) -> u64 {
        self.0.fetch_or(LOCKED, Ordering::SeqCst)
    }

    pub fn unlock(&self) {
        self.0.fetch_and(!LOCKED, Ordering::AcqRel);
    }

    /// Locks the entry if it is unlocked and nothing pins it; returns the word before, or None
    /// with the word as it was.
    pub fn lock_unpinned<'a>(
        &self,
        entry: u32,
        hazards: impl IntoIterator<Item = &'a AtomicU64>,
    ) -> Option<u64> {
        let s = self.lock();
        if s & LOCKED != 0 {
            return None;
        }
        if s & PINS != 0 || self.pinned(entry, s, hazards) {
            self.unlock();
            return None;
        }
        Some(s)
    }

    /// Locks the entry if it is unlocked and still at `generation_`; returns the word before.
    pub fn lock_at(&self, generation_: u32) -> Option<u64> {
        let s = self.lock();
        if s & LOCKED != 0 {
            return None;
        }
        if generation(s) != generation_ {
            self.unlock();
            return None;
        }
        Some(s)
    }

    /// Ends the entry's generation (it was locked, with no pin, from state `before`): the next
    /// generation, unlocked, unpinned. Every reference to the old cap now fails to pin.
    pub fn retire(&self, before: u64) {
        let next = (generation(before) as u64 + 1) << 32;
        self.0.store(next, Ordering::Release);
    }
}

#[cfg(test)]
mod unit {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize};
    use std::sync::{Arc, Mutex};

    #[test]
    fn a_try_pin_never_waits_on_a_locked_entry() {
        let state = State::default();
        let hazard = AtomicU64::new(0);
        let cap = state.cap_ref(3);
        let before = state.lock_at(cap.generation).expect("unlocked");
        assert_eq!(
            state.try_pin_hazard(&hazard, cap).err(),
            Some(Refused::Locked)
        );
        assert_eq!(
            hazard.load(Ordering::SeqCst),
            0,
            "the hazard slot is left empty"
        );
        assert_eq!(
            state.try_pin_counted(cap.generation).err(),
            Some(Refused::Locked)
        );
        assert_eq!(state.load() & PINS, 0);
        state.retire(before);
        assert_eq!(
            state.try_pin_hazard(&hazard, cap).err(),
            Some(Refused::Gone)
        );
        assert_eq!(
            state.try_pin_counted(cap.generation).err(),
            Some(Refused::Gone)
        );
        let next = state.cap_ref(3);
        assert!(state.try_pin_hazard(&hazard, next).is_ok());
        assert_eq!(hazard.load(Ordering::SeqCst), 0, "unpinned on drop");
        assert!(state.try_pin_counted(next.generation).is_ok());
        assert_eq!(state.load() & PINS, 0);
    }

    #[test]
    fn hazard_values_are_never_empty_and_tell_generations_apart() {
        let a = CapRef {
            entry: 0,
            generation: 0,
        };
        let b = CapRef {
            entry: 0,
            generation: 1,
        };
        assert_ne!(hazard_value(a), 0);
        assert_ne!(hazard_value(a), hazard_value(b));
        let h = [AtomicU64::new(hazard_value(b))];
        assert!(hazard_pinned(&h, b) && !hazard_pinned(&h, a));
    }

    #[test]
    fn a_retired_generation_no_longer_pins() {
        let s = State::default();
        let cap = s.cap_ref(3);
        let hazard = AtomicU64::new(0);
        let pin = s.pin_hazard(&hazard, cap, || {}).expect("pinned");
        assert!(
            s.lock_unpinned(3, [&hazard]).is_none(),
            "a hazard pin blocks reclaim"
        );
        drop(pin);
        assert_eq!(hazard.load(Ordering::Relaxed), 0);
        let pin = s.pin_counted(cap.generation, || {}).expect("pinned");
        assert!(
            s.lock_unpinned(3, [&hazard]).is_none(),
            "a counted pin blocks reclaim"
        );
        drop(pin);
        let before = s.lock_unpinned(3, [&hazard]).expect("unpinned");
        s.retire(before);
        let after = s.load();
        assert!(s.pin_hazard(&hazard, cap, || {}).is_none());
        assert_eq!(
            hazard.load(Ordering::Relaxed),
            0,
            "a failed pin leaves the slot empty"
        );
        assert!(s.pin_counted(cap.generation, || {}).is_none());
        assert_eq!(s.load(), after, "a failed pin leaves the word as it was");
        let pin = s.pin_counted(cap.generation + 1, || {}).expect("pinned");
        drop(pin);
        assert_eq!(s.load(), after);
    }

    /// The entry's identity (what a reclaim changes) and its block (what a grow moves), as a
    /// pinned reader sees them.
    #[derive(Default)]
    struct Entry {
        state: State,
        identity: AtomicU32,
        block: AtomicU32,
    }

    /// Readers pin (through their hazard slot, or counted) and check that neither the identity
    /// nor the block changes while they hold the pin; a reclaimer retires the entry and a grower
    /// moves its block, each under one "directory lock", as often as they can. Without the
    /// SeqCst handshake (or with the hazard scan left out) a reader sees a change under its pin.
    #[test]
    fn pins_hold_against_reclaim_and_grow_under_churn() {
        const READERS: usize = 4;
        let e = Arc::new(Entry::default());
        let hazards: Arc<Vec<AtomicU64>> =
            Arc::new((0..READERS).map(|_| AtomicU64::new(0)).collect());
        let directory = Arc::new(Mutex::new(()));
        let stop = Arc::new(AtomicBool::new(false));
        let (pins, reclaims, grows) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        let readers: Vec<_> = (0..READERS)
            .map(|i| {
                let (e, hazards, stop, pins) =
                    (e.clone(), hazards.clone(), stop.clone(), pins.clone());
                std::thread::spawn(move || {
                    let counted = i % 2 == 1;
                    while !stop.load(Ordering::Relaxed) {
                        let cap = e.state.cap_ref(0);
                        let pin = if counted {
                            e.state.pin_counted(cap.generation, std::thread::yield_now)
                        } else {
                            e.state.pin_hazard(&hazards[i], cap, std::thread::yield_now)
                        };
                        if pin.is_none() {
                            continue; // reclaimed since the look: look again
                        }
                        let (id, block) = (
                            e.identity.load(Ordering::Acquire),
                            e.block.load(Ordering::Acquire),
                        );
                        assert_eq!(id, cap.generation, "the pinned cap is the one looked up");
                        for _ in 0..16 {
                            std::hint::spin_loop();
                        }
                        assert_eq!(
                            e.identity.load(Ordering::Acquire),
                            id,
                            "reclaimed under a pin"
                        );
                        assert_eq!(e.block.load(Ordering::Acquire), block, "moved under a pin");
                        drop(pin);
                        pins.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        let reclaimer = {
            let (e, hazards, directory, stop, reclaims) = (
                e.clone(),
                hazards.clone(),
                directory.clone(),
                stop.clone(),
                reclaims.clone(),
            );
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let _lock = directory.lock().unwrap();
                    if let Some(before) = e.state.lock_unpinned(0, hazards.iter()) {
                        e.identity.store(generation(before) + 1, Ordering::Release);
                        e.state.retire(before);
                        reclaims.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        };
        let grower = {
            let (e, hazards, directory, stop, grows) = (
                e.clone(),
                hazards.clone(),
                directory.clone(),
                stop.clone(),
                grows.clone(),
            );
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let _lock = directory.lock().unwrap();
                    let cap = e.state.cap_ref(0);
                    let Some(before) = e.state.lock_at(cap.generation) else {
                        continue;
                    };
                    let mut waited = 0;
                    while e.state.pinned(0, before, hazards.iter()) && waited < 1_000 {
                        std::thread::yield_now();
                        waited += 1;
                    }
                    if !e.state.pinned(0, before, hazards.iter()) {
                        e.block.fetch_add(1, Ordering::AcqRel);
                        grows.fetch_add(1, Ordering::Relaxed);
                    }
                    e.state.unlock();
                }
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(1_500));
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join().unwrap();
        }
        reclaimer.join().unwrap();
        grower.join().unwrap();
        let (p, r, g) = (
            pins.load(Ordering::Relaxed),
            reclaims.load(Ordering::Relaxed),
            grows.load(Ordering::Relaxed),
        );
        assert!(
            p > 1_000 && r > 10 && g > 10,
            "the race ran: {p} pins, {r} reclaims, {g} grows"
        );
        assert_eq!(
            e.state.load() & (LOCKED | PINS),
            0,
            "no pin or lock left behind"
        );
    }
}
