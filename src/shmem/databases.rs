//! The table of databases in the header, claimed by CAS: per database, whether its durable rows
//! are loaded since this segment was made, its flushers' commits and its share of the lease
//! records; and the launcher's requests (an advance or a load asked for), how the segment began,
//! when recovery ended.
//!
//! **Databases.** A fixed table of `MAX_DATABASES` records in the header: a record is claimed
//! by CAS on its oid (0 = free) and freed by the launcher when its database is dropped. A
//! database's state goes UNLOADED → REQUESTED (a backend asks) → LOADED (the flusher loaded its
//! rows, or found it has no table), and never back while the segment lives.

use super::records::DbRecord;
use super::segment::{raise_tokens, segment};
use stage_e_core::lifecycle::StartKind;
use std::sync::atomic::Ordering;

const UNLOADED: u32 = 0;
const REQUESTED: u32 = 1;
const LOADED: u32 = 2;
/// LOADED, and the database has the durable table (its version is 0.6.0 or later).
const LOADED_WITH_TABLE: u32 = 3;

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

/// Counts a rate key of database `db` taken, if the database holds fewer than `limit` (None:
/// no limit, at start); false when it holds its share.
pub(super) fn take_rate_share(db: u32, limit: Option<u64>) -> bool {
    let Some(r) = record(db, true) else {
        return limit.is_none();
    };
    r.rate_keys
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            limit.is_none_or(|l| (n as u64) < l).then_some(n + 1)
        })
        .is_ok()
}

/// A rate key of database `db` was reclaimed.
pub(super) fn give_rate_share(db: u32) {
    if let Some(r) = record(db, false) {
        let _ = r
            .rate_keys
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }
}

/// Share records database `db`'s caps hold (`shares`, under the waits lock).
pub(super) fn shares_of_database(db: u32) -> u32 {
    record(db, false).map_or(0, |r| r.shares.load(Ordering::Relaxed))
}

/// Under the exclusive waits lock: database `db`'s caps hold `used` share records. A database
/// without a record (the table full: a bug, it has one per database) is not counted.
pub(super) fn set_shares_of_database(db: u32, used: u32) {
    if let Some(r) = record(db, used != 0) {
        r.shares.store(used, Ordering::Relaxed);
    }
}

/// The generation of database `db`'s share policies, and when it last moved (µs; 0: never
/// since the server started): a backend keeps the policies it read while the generation
/// stays, and caches nothing read by a transaction that began before that moment (its
/// snapshot may predate the commit).
pub fn share_policies_generation(db: u32) -> (u64, i64) {
    record(db, false).map_or((0, 0), |r| {
        (
            r.share_policies.load(Ordering::Acquire),
            r.share_policies_at.load(Ordering::Acquire),
        )
    })
}

/// A transaction that changed share policies of database `db` committed at `now` (µs).
pub fn share_policies_changed(db: u32, now: i64) {
    if let Some(r) = record(db, true) {
        r.share_policies_at.store(now, Ordering::Release);
        r.share_policies.fetch_add(1, Ordering::AcqRel);
    }
}

/// Rate keys database `db` holds in the table (idle ones not yet reclaimed too).
pub(super) fn rate_keys_of(db: u32) -> u32 {
    record(db, false).map_or(0, |r| r.rate_keys.load(Ordering::Acquire))
}

/// Whether database `db` has been loaded: Some(has the durable table) once it is.
pub fn loaded(db: u32) -> Option<bool> {
    match record(db, false)?.state.load(Ordering::Acquire) {
        LOADED => Some(false),
        LOADED_WITH_TABLE => Some(true),
        _ => None,
    }
}

/// The launcher, after a start that holds caps back: it has asked for every database to be
/// loaded (each request was taken).
pub fn note_loads_requested() {
    if let Some(seg) = segment() {
        seg.header
            .lifecycle
            .loads_requested
            .store(1, Ordering::Release);
    }
}

/// Whether every database has been loaded since the segment was made, after the launcher
/// asked for all of them: then every hold there is to be is in shared memory.
pub(super) fn all_loaded() -> bool {
    segment().is_some_and(|seg| {
        let l = &seg.header.lifecycle;
        l.loads_requested.load(Ordering::Acquire) == 1
            && l.dbs.iter().all(|r| {
                r.oid.load(Ordering::Acquire) == 0
                    || matches!(r.state.load(Ordering::Acquire), LOADED | LOADED_WITH_TABLE)
            })
    })
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

/// Database `db` was dropped: its record is free again.
pub(super) fn forget_database(db: u32) {
    if let Some(r) = record(db, false) {
        r.state.store(UNLOADED, Ordering::Relaxed);
        r.leases.store(0, Ordering::Relaxed);
        r.rate_keys.store(0, Ordering::Relaxed);
        r.shares.store(0, Ordering::Relaxed);
        r.share_policies.fetch_add(1, Ordering::AcqRel);
        r.oid.store(0, Ordering::Release);
    }
}

/// Sorted, each once.
pub(super) fn sorted(mut dbs: Vec<u32>) -> Vec<u32> {
    dbs.sort_unstable();
    dbs.dedup();
    dbs
}
