//! Leases: slots held by a token, not a session; and the fencing tokens of every acquisition.
//!
//! A lease's bit is set like a session slot's, and its slot record names a lease record
//! (`stage_e_core::lease::marker`) instead of a backend. There is no advisory lock (no session
//! holds it), so shared memory is the truth for leases: the bit keeps session tries and other
//! leases off the slot, and only the lease record frees it. A record changes only in the process
//! that moved it to BUSY, so a renewal, a release by token and an expiry never act on one lease
//! at once. A lease is taken with the cap pinned, and every operation on one pins its cap, so
//! the record's (entry, generation, slot) tells a stale lease from a live one.
//!
//! The protocols are `stage_e_core::lease`'s (model-checked there): the records' states, claim,
//! start, lock, extend, sweep and end (`LeaseRecord`), the cap's count of live leases
//! (`LiveLeases`) and its expiry bound (`ExpiryBound`: a lower bound of the cap's expiries,
//! reset by a sweep *before* its scan and lowered by every lease it keeps and every lease
//! started meanwhile, so that no lease is ever left out of it). This file places them (the
//! records in the segment, the count and the bound in the entry's hot lines) and ties them to
//! the slots' holder records, the bits, the databases' shares and the wake-ups.
//!
//! **Tokens.** Every acquisition, session slot or lease, of any cap, takes the next value of
//! one server-wide counter, so a token names one acquisition on the server whatever the cap
//! (a token of one cap never matches another's lease). The counter starts at the clock-based
//! base when the segment is made and is raised above every saved or durable floor before any
//! cap of a database hands out a token (`stage_e_core::lease`, `stage_e_core::lifecycle`).
//! It is a cache line of its own in the header (`lifecycle::TokenCounter`).
//!
//! **Restored leases.** A lease an earlier server granted is put back on its own slot with its
//! own token (`restore_lease`): at start from the lease file of a clean shutdown, by the loader
//! from the journal after a crash or a promotion. Its record names pid 0 (no live backend).

use super::databases;
use super::entry::CapEntry;
use super::pin::pin;
use super::segment::{raise_tokens, segment};
use super::Cap;
use pgrx::pg_sys;
use stage_e_core::lease::{self, LeaseRecord};
use stage_e_core::occupancy;
use stage_e_core::state::CapRef;

/// A live lease as the holders view and the sweeps see it.
pub use stage_e_core::lease::LeaseInfo;

/// Who takes a lease: the backend (0 for one restored from an earlier server) and its role.
struct Taker {
    pid: i32,
    owner: u32,
}

/// Why a lease could not be recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseRefused {
    /// Every lease record is live.
    NoRecord,
    /// The cap's database holds its share of the lease records.
    OverShare,
}

/// What a lease operation found (the lease as it was), for its caller to count and report.
#[derive(Clone, Copy, Debug)]
pub enum LeaseCheck {
    /// The token is the slot's current lease, live at `now`.
    Live(LeaseInfo),
    /// The token was the slot's lease, but it expired (it has now been freed as expired).
    Expired(LeaseInfo),
    /// The slot has a lease with another token.
    Other(LeaseInfo),
    /// The slot has no lease.
    None,
}

impl CapEntry {
    /// Under the exclusive directory lock, creating: no lease.
    pub(super) fn start_leases(&self) {
        self.counters.leases.reset();
        self.counters.lease_due.reset();
    }
}

impl Cap {
    /// The next fencing token (server-wide).
    pub fn next_token(&self) -> u64 {
        match segment() {
            Some(seg) => seg.header.tokens.next(),
            None => 0,
        }
    }

    /// Live leases of this cap.
    pub fn lease_count(&self) -> u32 {
        self.entry().counters.leases.count()
    }

    /// Whether a lease of this cap may have expired by `now`.
    pub fn lease_due(&self, now: i64) -> bool {
        let c = &self.entry().counters;
        c.lease_due.due(&c.leases, now)
    }

    /// Records a lease of role `owner` on `slot`, whose bit the caller has claimed, if this
    /// cap's database holds fewer than `share_limit` live leases.
    pub fn start_lease(
        &self,
        slot: u32,
        token: u64,
        now: i64,
        expires_at: i64,
        owner: u32,
        share_limit: u64,
    ) -> Result<(), LeaseRefused> {
        let db = self.database();
        if !databases::take_lease_share(db, Some(share_limit)) {
            return Err(LeaseRefused::OverShare);
        }
        // SAFETY: this process's pid, set at start.
        let pid = unsafe { pg_sys::MyProcPid };
        if !self.record_lease(Taker { pid, owner }, slot, token, now, expires_at) {
            databases::give_lease_share(db);
            return Err(LeaseRefused::NoRecord);
        }
        Ok(())
    }

    /// Puts back a lease an earlier server granted (from the lease file, or the journal after a
    /// crash): its slot, token and expiry, taken by no live backend (pid 0). False if the slot
    /// is beyond the cap's block, already taken, or every lease record is in use.
    pub fn restore_lease(
        &self,
        slot: u32,
        token: u64,
        acquired_at: i64,
        expires_at: i64,
        owner: u32,
    ) -> bool {
        if slot >= self.capacity() {
            return false;
        }
        let Some(claim) = occupancy::claim_first_free(self.bits(), slot, slot + 1) else {
            return false;
        };
        databases::take_lease_share(self.database(), None);
        if !self.record_lease(
            Taker { pid: 0, owner },
            slot,
            token,
            acquired_at,
            expires_at,
        ) {
            databases::give_lease_share(self.database());
            return false; // dropping the claim clears the bit
        }
        claim.keep();
        raise_tokens(token);
        true
    }

    fn record_lease(&self, by: Taker, slot: u32, token: u64, now: i64, expires_at: i64) -> bool {
        let Some(seg) = segment() else { return false };
        let len = seg.leases.len();
        let from = by.pid.unsigned_abs() as usize % len.max(1);
        let Some(i) = (from..len).chain(0..from).find(|&i| seg.leases[i].claim()) else {
            return false;
        };
        let counters = &self.entry().counters;
        let info = LeaseInfo {
            slot,
            token,
            pid: by.pid,
            owner: by.owner,
            acquired_at: now,
            expires_at,
        };
        // Counted and published, then named in the slot's holder record, then in the expiry
        // bound (`stage_e_core::lease`).
        seg.leases[i].start(
            self.at,
            &info,
            &counters.leases,
            || self.record(slot).set(lease::marker(i), now),
            &counters.lease_due,
        );
        self.note_lease_change();
        true
    }

    /// The lease record of `slot`, if the slot is leased.
    fn lease_record(&self, slot: u32) -> Option<&'static LeaseRecord> {
        if slot >= self.capacity() {
            return None;
        }
        let i = lease::record_of(self.record(slot).get().0)?;
        segment()?.leases.get(i)
    }

    /// Runs `f` on the live lease of `slot` with its record locked (BUSY); `f` must publish or
    /// free it. None if the slot has no live lease.
    fn with_lease<R>(&self, slot: u32, f: impl FnOnce(&LeaseRecord) -> R) -> Option<R> {
        let r = self.lease_record(slot)?;
        r.lock_for(self.at, slot).then(|| f(r))
    }

    /// Frees the lease in `r` (locked by the caller): the slot record, the bit, the record, and
    /// the slot's share (`shares`); wakes the waiters the slot may serve.
    fn end_lease(&self, r: &LeaseRecord) -> LeaseInfo {
        let bits = self.bits();
        let mut share = 0;
        let info = r.end(
            &self.entry().counters.leases,
            |l| {
                let record = self.record(l.slot);
                share = record.share();
                record.clear();
                occupancy::clear(bits, l.slot);
            },
            || databases::give_lease_share(self.database()),
        );
        // The record is free again (no lease lock is held across the waits lock).
        self.give_back_share(share, 1);
        self.note_lease_change();
        self.wake_front();
        info
    }

    /// Checks `token` against the lease of `slot` at `now`: a live one is extended to
    /// `extend_to` (with Some) or ended (with None); an expired one is ended as expired.
    pub fn settle_lease(
        &self,
        slot: u32,
        token: u64,
        now: i64,
        extend_to: Option<i64>,
    ) -> LeaseCheck {
        self.with_lease(slot, |r| {
            let info = r.info();
            if info.token != token {
                r.publish();
                return LeaseCheck::Other(info);
            }
            if info.expires_at <= now {
                return LeaseCheck::Expired(self.end_lease(r));
            }
            match extend_to {
                Some(t) => {
                    r.extend(t, &self.entry().counters.lease_due);
                    self.note_lease_change();
                    LeaseCheck::Live(info)
                }
                None => LeaseCheck::Live(self.end_lease(r)),
            }
        })
        .unwrap_or(LeaseCheck::None)
    }

    /// The live lease of `slot`, if any (a copy; for reporting).
    pub fn lease_of(&self, slot: u32) -> Option<LeaseInfo> {
        self.with_lease(slot, |r| {
            let info = r.info();
            r.publish();
            info
        })
    }

    /// Live leases of this cap (for the holders view).
    pub fn leases(&self) -> Vec<LeaseInfo> {
        if self.lease_count() == 0 {
            return Vec::new();
        }
        (0..self.capacity())
            .filter_map(|slot| self.lease_of(slot))
            .collect()
    }

    /// Ends every lease of this cap that expired by `now`; returns them (for the caller to
    /// count and log) and sets `lease_due` to the next expiry (`stage_e_core::lease`, "Expiry
    /// bound").
    pub fn expire_leases(&self, now: i64) -> Vec<LeaseInfo> {
        let due = &self.entry().counters.lease_due;
        due.begin_sweep();
        let mut expired = Vec::new();
        for slot in 0..self.capacity() {
            let got = self.with_lease(slot, |r| r.sweep(now, due).then(|| self.end_lease(r)));
            if let Some(Some(info)) = got {
                expired.push(info);
            }
        }
        expired
    }
}

/// The background worker's round: frees lease records whose cap is gone (reclaimed with its
/// dropped database), and returns the caps with a lease due by `now`.
pub fn caps_with_leases_due(now: i64) -> Vec<CapRef> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    let mut due: Vec<CapRef> = Vec::new();
    for r in seg.leases {
        if !r.is_live() {
            continue;
        }
        let cap = r.cap();
        if due.contains(&cap) {
            continue; // one look per cap
        }
        match pin(cap) {
            Some(c) => {
                if c.lease_due(now) {
                    due.push(cap);
                }
            }
            None => {
                // A live lease keeps its slot's bit set, so its cap is not reclaimed: the record
                // was ended (and maybe reused) since it was read. Look again with it locked,
                // and free it only if its cap is truly gone (defensive: nothing else could).
                if r.lock() {
                    if pin(r.cap()).is_none() {
                        r.free();
                    } else {
                        r.publish();
                    }
                }
            }
        }
    }
    due
}
