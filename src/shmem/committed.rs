//! What shared memory knows of the durable state that outlives it (`docs/lifecycle.md`): each
//! cap's committed lease horizon and token floor, its hold after a crash or a promotion, the
//! lease journal's bookkeeping; and per database, whether its rows have been loaded since this
//! segment was made.
//!
//! **Committed values only.** `horizon` and `floor` are stored only by the flusher after the
//! transaction that wrote them committed (`publish`), and only grow, so a grant that checked
//! against them (`stage_e_core::lifecycle::room`) is covered by what is on disk. Wishes
//! (`horizon_wanted`) are raised by any backend with `fetch_max` and read by the flusher.
//!
//! **Quiet.** A cap whose leases have all ended, and stayed so for
//! `lifecycle::QUIET_AFTER_US`, has its durable horizon lowered to the present, so that a crash
//! or a promotion holds back nothing for it. The flusher first *closes* it (the committed
//! horizon in shared memory becomes 0, so every new grant waits for an advance), then waits
//! until no grant is between its room check and its lease record (`granting`, with the lease
//! counters, a Dekker-style
//! fence: the grant increments it before reading the horizon, the flusher reads it after
//! zeroing the horizon, both SeqCst), and only if the cap still has no lease writes the lowered
//! row. The next lease asks for an advance and waits for its commit. The row's horizon is never
//! written below a live lease's expiry plus the margin, nor below the cap's hold.
//!
//! **Holds.** `held_until` is set once, by the loader, before the database is marked loaded;
//! no backend acquires in a database before it is loaded (`loaded`), so every acquisition sees
//! the hold. A held cap is not idle, so it is not reclaimed while held.
//!
//! **Databases.** A fixed table of [`MAX_DATABASES`] records in the header: a record is claimed
//! by CAS on its oid (0 = free) and freed by the launcher when its database is dropped. A
//! database's state goes UNLOADED → REQUESTED (a backend asks) → LOADED (the flusher loaded its
//! rows, or found it has no table), and never back while the segment lives.

use super::caps::sorted;
use super::entry::CapEntry;
use super::leases::{last_token, raise_tokens};
use super::segment::segment;
use super::Cap;
use stage_e_core::lifecycle::{self, HoldReason, Room, StartKind};
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};

/// Databases that can use the extension at once on one server.
pub const MAX_DATABASES: usize = 128;

const UNLOADED: u32 = 0;
const REQUESTED: u32 = 1;
const LOADED: u32 = 2;
/// LOADED, and the database has the durable table (its version is 0.6.0 or later).
const LOADED_WITH_TABLE: u32 = 3;

/// A cap's durable bookkeeping: one cache line, read by every acquisition (the hold) and lease
/// grant. (The n of the latest acquisition is in the entry's first line, the grant fence with
/// the lease counters.)
#[repr(C, align(64))]
pub(super) struct Durable {
    /// The committed lease horizon (µs; 0 = none yet).
    horizon: AtomicI64,
    /// The horizon a grant asked for.
    horizon_wanted: AtomicI64,
    /// The committed token floor.
    floor: AtomicU64,
    /// Held back until then (0 = not held), and why (`HoldReason`).
    held_until: AtomicI64,
    held_reason: AtomicU32,
    /// An adaptive cap's enforced limit; 0 = none (`adaptive`).
    pub(super) limit: AtomicU32,
    /// Bumped by every lease change; the value the last committed journal write saw, and when.
    lease_changes: AtomicU64,
    journal_written: AtomicU64,
    journal_at: AtomicI64,
}

/// One database's record.
#[repr(C)]
pub(super) struct DbRecord {
    oid: AtomicU32,
    state: AtomicU32,
    /// Flusher transactions of this database that committed (the launcher tells a failed
    /// flusher by this not moving).
    commits: AtomicU32,
    /// Live leases of this database's caps (its share of `stage_e_slots.max_leases`).
    leases: AtomicU32,
}

/// The header's lifecycle fields.
#[repr(C)]
pub(super) struct Lifecycle {
    start_kind: AtomicU32,
    /// Set when a backend asks for an advance or a load: the launcher runs flushers at once.
    requested: AtomicU32,
    /// When recovery ended (the launcher's first start on this segment): a crash's or a
    /// promotion's time for `stage_e_slots.recovery_hold`.
    recovered_at: AtomicI64,
    dbs: [DbRecord; MAX_DATABASES],
}

/// What the flusher writes for one cap.
#[derive(Clone, Debug)]
pub struct HorizonWrite {
    pub horizon: i64,
    pub floor: u64,
    pub n: u32,
    /// The journal of the cap's live leases, and the change count it covers.
    pub journal: (Vec<lifecycle::JournalLease>, u64),
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
            && self.counters.leases.load(Ordering::Acquire) == 0
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
        let live = self.leases();
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
            .map(|l| lifecycle::JournalLease {
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

/// Asks the launcher to run the flushers that advance horizons or load databases, now.
pub fn request_advance() {
    let Some(seg) = segment() else { return };
    seg.header.lifecycle.requested.store(1, Ordering::Release);
    super::launcher::wake();
}

/// The launcher: whether an advance or a load was asked for since the last call.
pub fn advance_requested() -> bool {
    segment().is_some_and(|seg| seg.header.lifecycle.requested.swap(0, Ordering::AcqRel) != 0)
}

/// How this segment began.
pub fn start_kind() -> StartKind {
    segment()
        .and_then(|seg| {
            StartKind::from_u32(seg.header.lifecycle.start_kind.load(Ordering::Acquire))
        })
        .unwrap_or(StartKind::Crash)
}

/// The postmaster, at start: how this segment began.
pub(super) fn set_start_kind(kind: StartKind) {
    if let Some(seg) = segment() {
        seg.header
            .lifecycle
            .start_kind
            .store(kind as u32, Ordering::Release);
    }
}

/// The launcher at its start: recovery has ended now (kept from the first start only).
pub fn note_recovered(now: i64) {
    if let Some(seg) = segment() {
        let _ = seg.header.lifecycle.recovered_at.compare_exchange(
            0,
            now,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }
}

/// When recovery ended (0 if the launcher has not started yet).
pub fn recovered_at() -> i64 {
    segment().map_or(0, |seg| {
        seg.header.lifecycle.recovered_at.load(Ordering::Acquire)
    })
}

fn record(db: u32, claim: bool) -> Option<&'static DbRecord> {
    let seg = segment()?;
    let dbs = &seg.header.lifecycle.dbs;
    if let Some(r) = dbs.iter().find(|r| r.oid.load(Ordering::Acquire) == db) {
        return Some(r);
    }
    if !claim {
        return None;
    }
    for r in dbs {
        match r
            .oid
            .compare_exchange(0, db, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return Some(r),
            Err(other) if other == db => return Some(r),
            Err(_) => {}
        }
    }
    None
}

/// Counts a lease of database `db` taken, if the database holds fewer than `limit` (None: no
/// limit, for leases put back at start); false when it holds its share.
pub(super) fn take_lease_share(db: u32, limit: Option<u64>) -> bool {
    let Some(r) = record(db, true) else {
        return limit.is_none(); // no room to count: only a restore goes on
    };
    let before = r.leases.fetch_add(1, Ordering::AcqRel);
    if limit.is_some_and(|l| before as u64 >= l) {
        r.leases.fetch_sub(1, Ordering::AcqRel);
        return false;
    }
    true
}

/// A lease of database `db` ended (or was never recorded after `take_lease_share`).
pub(super) fn give_lease_share(db: u32) {
    if let Some(r) = record(db, false) {
        // Saturating: a record claimed after the lease was counted starts at 0.
        let _ = r
            .leases
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }
}

/// Whether database `db` has been loaded: Some(has the durable table) once it is.
pub fn loaded(db: u32) -> Option<bool> {
    match record(db, false)?.state.load(Ordering::Acquire) {
        LOADED => Some(false),
        LOADED_WITH_TABLE => Some(true),
        _ => None,
    }
}

/// A backend asks for database `db` to be loaded; false when the table of databases is full.
pub fn request_load(db: u32) -> bool {
    let Some(r) = record(db, true) else {
        return false;
    };
    let _ = r
        .state
        .compare_exchange(UNLOADED, REQUESTED, Ordering::AcqRel, Ordering::Relaxed);
    request_advance();
    true
}

/// The flusher: database `db` is loaded (with or without the table); `min_token` is above
/// every token its caps issued before, so the server's tokens go on above it. Later flushers
/// refresh whether it has the table (it may have been updated since).
pub fn mark_loaded(db: u32, has_table: bool, min_token: u64) {
    let Some(r) = record(db, true) else { return };
    raise_tokens(min_token);
    r.state.store(
        if has_table { LOADED_WITH_TABLE } else { LOADED },
        Ordering::Release,
    );
}

/// How many flusher transactions of database `db` have committed.
pub fn flusher_commits(db: u32) -> u32 {
    record(db, false).map_or(0, |r| r.commits.load(Ordering::Acquire))
}

/// The flusher of database `db` committed.
pub fn note_flusher_commit(db: u32) {
    if let Some(r) = record(db, true) {
        r.commits.fetch_add(1, Ordering::AcqRel);
    }
}

/// Databases a backend asked to have loaded.
pub fn databases_to_load() -> Vec<u32> {
    let Some(seg) = segment() else {
        return Vec::new();
    };
    seg.header
        .lifecycle
        .dbs
        .iter()
        .filter(|r| r.state.load(Ordering::Acquire) == REQUESTED)
        .map(|r| r.oid.load(Ordering::Acquire))
        .filter(|&d| d != 0)
        .collect()
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

/// Databases with a record here (loaded or asked to be).
pub fn recorded_databases() -> Vec<u32> {
    segment().map_or_else(Vec::new, |seg| {
        seg.header
            .lifecycle
            .dbs
            .iter()
            .map(|r| r.oid.load(Ordering::Acquire))
            .filter(|&d| d != 0)
            .collect()
    })
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

/// Database `db` was dropped: its record is free again.
pub(super) fn forget_database(db: u32) {
    if let Some(r) = record(db, false) {
        r.state.store(UNLOADED, Ordering::Relaxed);
        r.leases.store(0, Ordering::Relaxed);
        r.oid.store(0, Ordering::Release);
    }
}
