//! What shared memory knows of the durable state that outlives it (`docs/lifecycle.md`): each
//! cap's committed lease horizon and token floor, its hold after a crash or a promotion, the
//! lease journal's bookkeeping. (Per database, whether its rows are loaded is `databases`'.)
//!
//! **Committed values only.** `horizon` and `floor` are stored only by the flusher after the
//! transaction that wrote them committed (`publish`), and only grow, so a grant that checked
//! against them (`stage_e_core::lifecycle::room`) is covered by what is on disk. Wishes
//! (`horizon_wanted`) are raised by any backend with `fetch_max` and read by the flusher.
//!
//! **Quiet.** A cap whose leases have all ended, and stayed so for `lifecycle::QUIET_AFTER_US`, has
//! its durable horizon lowered to the present, so that a crash or a promotion holds back nothing
//! for it. The flusher first *closes* it (the committed horizon in shared memory becomes 0, so
//! every new grant waits for an advance), then waits until no grant is between its room check and
//! its lease record (`granting`, with the lease counters, a Dekker-style fence: the grant
//! increments it before reading the horizon, the flusher reads it after zeroing the horizon, both
//! SeqCst), and only if the cap still has no lease writes the lowered row. The next lease asks for
//! an advance and waits for its commit. The row's horizon is never written below a live lease's
//! expiry plus the margin, nor below the cap's hold.
//!
//! **Lowered.** While leases are live, the row follows them, not the longest lease ever granted:
//! when the flusher writes a cap's row anyway (its journal, after a lease changed) and the
//! committed horizon is more than a step above what the live leases need
//! (`lifecycle::lowered`: the latest expiry plus the margin and a step), it first lowers the
//! committed horizon in shared memory to that (`lifecycle::lower`: every later grant or renewal
//! checks against the lower value, and those that read the higher one are waited out through
//! `granting`, which renewals raise too), then reads the live leases and writes a row no lower
//! than the lowered value nor any of them. So a crash holds a cap back about as long as its
//! live leases may live, and lowering adds no row write of its own. A held cap, or one with an
//! advance asked for, is not lowered; in doubt (a grant stalled mid-way) the horizon stays.
//!
//! **Holds.** `held_until` is set once, by the loader, before the database is marked loaded
//! (or at start, from the lease file, when a clean shutdown carried a hold over: `persist`);
//! no backend acquires in a database before it is loaded (`loaded`), so every acquisition sees
//! the hold. A held cap is not idle, so it is not reclaimed while held.

use super::databases::{databases_to_load, loaded, request_advance, sorted};
use super::entry::CapEntry;
use super::segment::last_token;
use super::segment::segment;
use super::Cap;
use stage_e_core::lifecycle::{self, HoldReason, Room};
use std::sync::atomic::Ordering;

/// What the flusher writes for one cap.
#[derive(Clone, Debug)]
pub struct HorizonWrite {
    pub horizon: i64,
    pub floor: u64,
    pub n: u32,
    /// The journal of the cap's live leases, and the change count it covers.
    pub journal: (Vec<stage_e_core::lease_file::JournalLease>, u64),
}

impl CapEntry {
    /// Under the exclusive directory lock, creating: nothing durable is known yet.
    pub(super) fn clear_durable(&self) {
        let d = &self.durable;
        for a in [&d.horizon, &d.horizon_wanted, &d.held_until, &d.journal_at] {
            a.store(0, Ordering::Relaxed);
        }
        for a in [&d.floor, &d.lease_changes, &d.journal_written] {
            a.store(0, Ordering::Relaxed);
        }
        self.counters.granting.store(0, Ordering::Relaxed);
        self.latest_n.store(0, Ordering::Relaxed);
        d.held_reason.store(0, Ordering::Relaxed);
    }

    /// Held back at `now`: not idle, so never reclaimed while the hold lasts.
    pub(super) fn held_at(&self, now: i64) -> bool {
        self.durable.held_until.load(Ordering::Acquire) > now
    }

    /// Whether the flusher has something to write for this cap at `now`.
    pub(super) fn horizon_due(&self, now: i64, journal_every_us: i64) -> bool {
        let d = &self.durable;
        d.horizon_wanted.load(Ordering::Acquire) > d.horizon.load(Ordering::Acquire)
            || lifecycle::floor_due(last_token(), d.floor.load(Ordering::Acquire))
            || (d.lease_changes.load(Ordering::Acquire)
                != d.journal_written.load(Ordering::Acquire)
                && now - d.journal_at.load(Ordering::Relaxed) >= journal_every_us)
            || self.may_quiet(now)
    }

    /// Open (a horizon ahead), with no lease, no change since the last journal write for a
    /// while, no hold and no wish pending: its horizon can be lowered (see "Quiet").
    fn may_quiet(&self, now: i64) -> bool {
        let d = &self.durable;
        let horizon = d.horizon.load(Ordering::Acquire);
        // Only a horizon still ahead has anything to come down from (a row written for its
        // floor alone says "now", which holds nothing back).
        horizon > now
            && self.counters.leases.count() == 0
            && d.horizon_wanted.load(Ordering::Acquire) <= horizon
            && d.lease_changes.load(Ordering::Acquire) == d.journal_written.load(Ordering::Acquire)
            && now - d.journal_at.load(Ordering::Relaxed) >= lifecycle::QUIET_AFTER_US
            && !self.held_at(now)
    }
}

impl Cap {
    /// Until when (and why) the cap is held back, if it is at `now`.
    #[inline]
    pub fn held_until(&self, now: i64) -> Option<(i64, HoldReason)> {
        let d = &self.entry().durable;
        let until = d.held_until.load(Ordering::Acquire);
        if until <= now {
            return None;
        }
        let reason = HoldReason::from_u32(d.held_reason.load(Ordering::Relaxed))?;
        Some((until, reason))
    }

    /// The loader: holds the cap back until `until` (the later hold wins).
    pub fn hold(&self, until: i64, reason: HoldReason) {
        let d = &self.entry().durable;
        if until > d.held_until.load(Ordering::Relaxed) {
            d.held_reason.store(reason as u32, Ordering::Relaxed);
            d.held_until.store(until, Ordering::Release);
        }
    }

    /// A lease grant begins: until the guard goes (after its lease record is made), a close
    /// waits for it (see "Quiet").
    pub fn begin_grant(&self) -> lifecycle::Granting<'static> {
        lifecycle::begin_grant(&self.entry().counters.granting)
    }

    /// Whether a lease to `expires_at` with `token` fits under the committed horizon and floor;
    /// asks for an advance when it (nearly) does not.
    pub fn room(&self, expires_at: i64, token: u64, margin_us: i64) -> Room {
        let d = &self.entry().durable;
        let room = lifecycle::room(
            expires_at,
            margin_us,
            token,
            d.horizon.load(Ordering::SeqCst),
            d.floor.load(Ordering::Acquire),
        );
        if room != Room::Enough {
            d.horizon_wanted.fetch_max(
                lifecycle::advance_target(expires_at, margin_us),
                Ordering::AcqRel,
            );
            request_advance();
        }
        room
    }

    /// The n of the cap's latest acquisition (None before the first since it was made).
    pub fn latest_n(&self) -> Option<u32> {
        Some(self.entry().latest_n.load(Ordering::Relaxed)).filter(|&n| n > 0)
    }

    /// Records the n of an acquisition (for the row's `n`).
    #[inline]
    pub fn note_n(&self, n: u32) {
        let latest = &self.entry().latest_n;
        if latest.load(Ordering::Relaxed) != n {
            latest.store(n, Ordering::Relaxed);
        }
    }

    /// A lease of this cap started, changed or ended: the journal is stale.
    pub(super) fn note_lease_change(&self) {
        self.entry()
            .durable
            .lease_changes
            .fetch_add(1, Ordering::AcqRel);
    }

    /// The flusher: what to write for this cap at `now`, if anything. A quiet cap is closed
    /// here (see "Quiet"): its write lowers the horizon to `now`.
    pub fn horizon_write(
        &self,
        now: i64,
        journal_every_us: i64,
        margin_us: i64,
    ) -> Option<HorizonWrite> {
        let e = self.entry();
        if !e.horizon_due(now, journal_every_us) {
            return None;
        }
        let d = &e.durable;
        let quiet = e.may_quiet(now) && self.close();
        // The count first: a change made while the leases are read is written next time.
        let changes = d.lease_changes.load(Ordering::Acquire);
        let mut live = self.leases();
        if !quiet && self.lower(now, &live, margin_us) {
            // Read again: every lease that relied on the higher horizon is recorded now.
            live = self.leases();
        }
        let last = last_token();
        let floor = d.floor.load(Ordering::Acquire);
        let horizon = if quiet {
            now
        } else {
            // Never below what grants relied on, a live lease's expiry, or the hold.
            live.iter()
                .map(|l| l.expires_at.saturating_add(margin_us))
                .chain([
                    d.horizon_wanted.load(Ordering::Acquire),
                    d.horizon.load(Ordering::Acquire),
                    d.held_until.load(Ordering::Acquire),
                    now,
                ])
                .max()
                .unwrap_or(now)
        };
        let leases = live
            .into_iter()
            .map(|l| stage_e_core::lease_file::JournalLease {
                slot: l.slot,
                token: l.token,
                expires_at: l.expires_at,
                owner: l.owner,
            })
            .collect();
        Some(HorizonWrite {
            horizon,
            floor: if lifecycle::floor_due(last, floor) {
                lifecycle::floor_target(last)
            } else {
                floor
            },
            n: e.latest_n.load(Ordering::Relaxed).max(1),
            journal: (leases, changes),
        })
    }

    /// Closes a quiet cap (`stage_e_core::lifecycle::close`): no grant can rely on its
    /// horizon any more. False (and open again) if a lease was granted meanwhile.
    fn close(&self) -> bool {
        let e = self.entry();
        e.durable.horizon_wanted.store(0, Ordering::SeqCst);
        lifecycle::close(
            &e.durable.horizon,
            &e.counters.granting,
            || self.lease_count(),
            std::hint::spin_loop,
        )
    }

    /// Lowers the committed horizon (see "Lowered") if the leases `live` at `now` need much
    /// less; true if it did (the caller reads the live leases again before writing).
    fn lower(&self, now: i64, live: &[super::LeaseInfo], margin_us: i64) -> bool {
        let e = self.entry();
        let d = &e.durable;
        let Some(latest) = live.iter().map(|l| l.expires_at).max() else {
            return false; // no lease: a quiet cap's case
        };
        let from = d.horizon.load(Ordering::Acquire);
        if e.held_at(now) || d.horizon_wanted.load(Ordering::Acquire) > from {
            return false;
        }
        let Some(to) = lifecycle::lowered(from, latest, margin_us) else {
            return false;
        };
        // Wishes met by the higher horizon go; one raised meanwhile is read after the wait.
        let asked = d.horizon_wanted.swap(0, Ordering::SeqCst);
        if lifecycle::lower(
            &d.horizon,
            &e.counters.granting,
            from,
            to,
            std::hint::spin_loop,
        ) {
            return true;
        }
        d.horizon_wanted.fetch_max(asked, Ordering::AcqRel);
        false
    }

    /// The flusher, after its transaction committed: the row now holds `horizon` and `floor`
    /// (and the journal of change count `journal`, written at `now`).
    pub fn publish(&self, horizon: i64, floor: u64, journal: u64, now: i64) {
        let d = &self.entry().durable;
        d.floor.fetch_max(floor, Ordering::AcqRel);
        d.horizon.fetch_max(horizon, Ordering::AcqRel);
        d.journal_written.fetch_max(journal, Ordering::AcqRel);
        d.journal_at.store(now, Ordering::Relaxed);
    }

    /// The extension was dropped from the cap's database: the rows that held its horizon and
    /// floor are gone, so no grant may rely on them (the next one waits for a new row).
    pub fn forget_horizon(&self) {
        let d = &self.entry().durable;
        d.horizon.store(0, Ordering::SeqCst);
        d.floor.store(0, Ordering::SeqCst);
    }

    /// The loader: the cap's committed row says its tokens reached at most `floor` and its
    /// horizon is `horizon`; later writes keep both.
    pub fn load_row(&self, floor: u64, horizon: i64) {
        let e = self.entry();
        e.durable.floor.fetch_max(floor, Ordering::AcqRel);
        e.durable.horizon.fetch_max(horizon, Ordering::AcqRel);
    }
}

/// The databases of the live caps `take` selects, loaded with (or without) the durable table,
/// sorted, each once.
fn databases_where(take: impl Fn(&CapEntry) -> bool, has_table: bool) -> Vec<u32> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    sorted(
        seg.live()
            .filter(|e| take(e))
            .map(|e| e.database())
            .filter(|&d| d != 0 && loaded(d) == Some(has_table))
            .collect(),
    )
}

/// Databases with the durable table and a cap whose horizon, floor or journal is due to be
/// written at `now` (a database not yet updated to 0.6.0 has nowhere to write them).
pub fn databases_with_horizon_work(now: i64, journal_every_us: i64) -> Vec<u32> {
    databases_where(|e| e.horizon_due(now, journal_every_us), true)
}

/// Databases loaded without the durable table that have caps in use: once per counters round
/// a flusher looks again, since `ALTER EXTENSION stage_e_slots UPDATE` may have made it.
pub fn databases_to_recheck() -> Vec<u32> {
    databases_where(|_| true, false)
}

/// Databases where a call waits on a flusher: to be loaded, or with a lease grant waiting for
/// an advance.
pub fn databases_with_waiting_calls() -> Vec<u32> {
    let mut dbs = databases_to_load();
    dbs.extend(databases_where(
        |e| {
            let d = &e.durable;
            d.horizon_wanted.load(Ordering::Acquire) > d.horizon.load(Ordering::Acquire)
        },
        true,
    ));
    sorted(dbs)
}

/// Whether any lease is live or any cap's horizon is ahead: the launcher then looks every
/// second for journals to write and caps gone quiet.
pub fn durable_watch() -> bool {
    // SAFETY: reads the clock.
    let now = unsafe { pgrx::pg_sys::GetCurrentTimestamp() };
    segment().is_some_and(|seg| {
        seg.leases.iter().any(|r| r.is_live())
            || seg
                .live()
                .any(|e| e.durable.horizon.load(Ordering::Relaxed) > now)
    })
}
