//! The records shared memory is made of, field by field: a cap entry's parts (its counters,
//! histograms and committed state) and the segment's tables (waiters, leases, policies, hazard
//! slots, the launcher's and the lifecycle's header fields). Only their fields are here, at the
//! bottom, so that the layout (`entry`, `segment`) needs nothing above it; each record's
//! protocol (which lock or atomic guards which field) is in the file of its concern, named on
//! the record.

use pgrx::pg_sys;
use stage_e_core::flush::Counters;
use stage_e_core::histogram::VALUES;
use stage_e_core::lease::{ExpiryBound, LiveLeases};
use stage_e_core::load::Averages;
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicPtr, AtomicU32, AtomicU64, Ordering};

/// Bytes of a cap's name at most (`directory::MAX_NAME`, rounded up to words).
pub(super) const NAME_WORDS: usize = 8;

/// A name (at most `NAME_WORDS * 8` bytes) into words, as entries and policies keep it.
pub(super) fn store_name(words: &[AtomicU64; NAME_WORDS], len: &AtomicU32, name: &str) {
    let mut bytes = [0u8; NAME_WORDS * 8];
    let n = name.len().min(bytes.len());
    bytes[..n].copy_from_slice(&name.as_bytes()[..n]);
    for (w, chunk) in words.iter().zip(bytes.chunks(8)) {
        w.store(
            u64::from_le_bytes(chunk.try_into().expect("8 bytes")),
            Ordering::Relaxed,
        );
    }
    len.store(n as u32, Ordering::Relaxed);
}

/// The name [`store_name`] stored.
pub(super) fn load_name(words: &[AtomicU64; NAME_WORDS], len: &AtomicU32) -> String {
    let len = len.load(Ordering::Relaxed) as usize;
    let bytes: Vec<u8> = words
        .iter()
        .flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes())
        .take(len.min(NAME_WORDS * 8))
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

// -- a cap entry's parts --------------------------------------------------------------------------

/// The counters every call bumps, on cache lines of their own, with the other fields that
/// change as slots are taken.
///
/// Protocol: `counters`.
#[repr(C, align(64))]
pub(super) struct HotCounters {
    pub(super) counts: Counters,
    /// Live leases, and no lease expires before `lease_due` (a lower bound; `leases`).
    pub(super) leases: LiveLeases,
    /// Lease grants between their room check and their lease record (`committed`'s "Quiet").
    pub(super) granting: AtomicU32,
    pub(super) lease_due: ExpiryBound,
    /// The cap's throttle rate over 1, 5 and 15 minutes, written by the launcher once a second
    /// (`load`): here because the two lines had 24 bytes to spare, and the entry none.
    pub(super) load_throttles: Averages,
}

// Two cache lines, full.
const _: () = assert!(size_of::<HotCounters>() == 128);

/// Protocol: `histograms`.
#[repr(C, align(64))]
pub(super) struct Histograms {
    pub(super) counts: [AtomicU64; VALUES],
    pub(super) base: [AtomicU64; VALUES],
}

/// A cap's durable bookkeeping: one cache line, read by every acquisition (the hold) and lease
/// grant. (The n of the latest acquisition is in the entry's first line, the grant fence with
/// the lease counters.)
///
/// Protocol: `committed`.
#[repr(C, align(64))]
pub(super) struct Durable {
    /// The committed lease horizon (µs; 0 = none yet).
    pub(super) horizon: AtomicI64,
    /// The horizon a grant asked for.
    pub(super) horizon_wanted: AtomicI64,
    /// The committed token floor.
    pub(super) floor: AtomicU64,
    /// Held back until then (0 = not held), and why (`HoldReason`).
    pub(super) held_until: AtomicI64,
    pub(super) held_reason: AtomicU32,
    /// An adaptive cap's enforced limit; 0 = none (`policies`).
    pub(super) limit: AtomicU32,
    /// Bumped by every lease change; the value the last committed journal write saw, and when.
    pub(super) lease_changes: AtomicU64,
    pub(super) journal_written: AtomicU64,
    pub(super) journal_at: AtomicI64,
}

// -- the segment's tables and header fields ------------------------------------------------------

/// A backend waiting for slots of a cap (one per backend at most). Changed under the waits
/// lock.
///
/// Protocol: `waitq`.
#[repr(C)]
pub(super) struct WaiterRecord {
    pub(super) active: AtomicU32,
    pub(super) entry: AtomicU32,
    pub(super) pid: AtomicI32,
    pub(super) n: AtomicU32,
    pub(super) k: AtomicU32,
    pub(super) _pad: u32,
    pub(super) ticket: AtomicU64,
    pub(super) since: AtomicI64,
    pub(super) proc_: AtomicU64,
    /// The digest of the share it waits in (`stage_e_core::fair`; 0: none, a cap without
    /// shares).
    pub(super) share: AtomicU64,
}

/// A live share's name and its counts since it became live, beside its state record in the
/// pool (`stage_e_core::fair::ShareRecord`, same index): the views' and the exporter's. A
/// record reused for another share gets its name, and its counts restart.
///
/// Protocol: `shares` (written under the exclusive waits lock, read under it).
#[repr(C)]
pub(super) struct ShareNote {
    /// The name's length in its first byte, then its bytes (63 at most: a share name follows
    /// the cap-name rules).
    pub(super) name: [AtomicU64; NAME_WORDS],
    /// Slots granted to the share, and the microseconds its waiters waited for them.
    pub(super) granted: AtomicU64,
    pub(super) wait_us: AtomicU64,
}

impl ShareNote {
    /// The share's name; None for the cap's unnamed share.
    pub(super) fn name(&self) -> Option<String> {
        let bytes: Vec<u8> = self
            .name
            .iter()
            .flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes())
            .collect();
        let len = (bytes[0] as usize).min(bytes.len() - 1);
        (len > 0).then(|| String::from_utf8_lossy(&bytes[1..1 + len]).into_owned())
    }
}

/// Bytes of a reason at most (`stage_e_cap_limits.reason`).
pub(super) const REASON_WORDS: usize = 8;

/// One adaptive cap's policy and learning (all under the adapt lock). 8-byte aligned, as the
/// layout places it after the lease records.
///
/// Protocol: `policies`.
#[repr(C)]
pub(super) struct PolicyRecord {
    /// 0 = free.
    pub(super) db: AtomicU32,
    pub(super) name_len: AtomicU32,
    pub(super) name: [AtomicU64; NAME_WORDS],
    pub(super) min: AtomicU32,
    pub(super) max: AtomicU32,
    pub(super) enforce: AtomicU32,
    /// `Learned`'s slow start (bit 0), low windows (bits 1-15) and windows (bits 16-31).
    pub(super) slow_start: AtomicU32,
    /// `Learned`'s limit, baseline and recent hold time (f64 bits).
    pub(super) limit: AtomicU64,
    pub(super) baseline_us: AtomicU64,
    pub(super) recent_us: AtomicU64,
    /// When the limit or the policy last changed.
    pub(super) changed_at: AtomicI64,
    pub(super) reason_len: AtomicU32,
    /// The enforced limit last written to the cap's row by a flusher (u32::MAX = never).
    pub(super) written: AtomicU32,
    pub(super) reason: [AtomicU64; REASON_WORDS],
    /// The window being counted: the cap it counts (entry + 1 and generation; 0 = none), when
    /// it began, and the cap's counters then.
    pub(super) window_cap: AtomicU64,
    pub(super) window_start: AtomicI64,
    pub(super) window_ended: AtomicU64,
    pub(super) window_hold_us: AtomicU64,
    pub(super) window_expired: AtomicU64,
    /// The last LOG line, and the changes made since that were not logged.
    pub(super) logged_at: AtomicI64,
    pub(super) unlogged: AtomicU32,
    /// The pid of a backend whose committing transaction holds this record for a policy it
    /// sets (0 = none): a record with `db` 0 is free only while this is 0 too.
    pub(super) reserved: AtomicU32,
    /// Leases of the window that expired as losses (`stage_e_core::adapt::is_loss`).
    pub(super) window_lost: AtomicU32,
    pub(super) _pad: u32,
}

/// One backend's hazard slot, alone on its cache line: each backend writes its own twice per
/// call, and must not slow its neighbours down doing so.
///
/// Protocol: `pin`.
#[repr(C, align(64))]
pub(super) struct HazardSlot(pub(super) AtomicU64);

/// The header's launcher fields.
///
/// Protocol: `launcher`.
#[repr(C)]
pub(super) struct Launcher {
    /// Set when a create found the directory crowded: the launcher flushes at once, so that
    /// idle caps' counts reach their rows and the caps become reclaimable.
    pub(super) flush_requested: AtomicU32,
    /// The launcher's PGPROC, to set its latch; null when it is not running.
    pub(super) proc_: AtomicPtr<pg_sys::PGPROC>,
}

/// One database's record.
///
/// Protocol: `committed`.
#[repr(C)]
pub(super) struct DbRecord {
    pub(super) oid: AtomicU32,
    pub(super) state: AtomicU32,
    /// Flusher transactions of this database that committed (the launcher tells a failed
    /// flusher by this not moving).
    pub(super) commits: AtomicU32,
    /// Live leases of this database's caps (its share of `stage_e_slots.max_leases`).
    pub(super) leases: AtomicU32,
    /// Rate keys of this database in the table (its share of `stage_e_slots.max_rate_keys`).
    pub(super) rate_keys: AtomicU32,
    /// Share records this database's caps hold (its share of `stage_e_slots.max_shares`;
    /// changed under the waits lock, `shares`).
    pub(super) shares: AtomicU32,
    /// Bumped by every commit that changed a share policy of this database
    /// (`stage_e_share`), and when (µs): backends keep the policies they read until it moves.
    pub(super) share_policies: AtomicU64,
    pub(super) share_policies_at: AtomicI64,
}

/// A rate policy on a cap, or on every cap whose name starts with a prefix (`rates`).
///
/// Protocol: `rates` (written under the adapt lock; read by every acquisition without it, as a
/// seqlock on `version`).
#[repr(C)]
pub(super) struct RatePolicyRecord {
    /// Odd while being written.
    pub(super) version: AtomicU64,
    /// 0 = free.
    pub(super) db: AtomicU32,
    /// The pid of a backend whose committing transaction holds it for a policy it sets.
    pub(super) reserved: AtomicU32,
    pub(super) name_len: AtomicU32,
    /// 1: `name` is a prefix (the policy was set on `name*`).
    pub(super) prefix: AtomicU32,
    pub(super) name: [AtomicU64; NAME_WORDS],
    pub(super) count: AtomicU32,
    pub(super) burst: AtomicU32,
    pub(super) per_ns: AtomicU64,
    pub(super) _pad: [u64; 3],
}

pub(super) const RATE_POLICY_SIZE: usize = 128;
const _: () = assert!(size_of::<RatePolicyRecord>() == RATE_POLICY_SIZE);

/// The header's rate fields.
///
/// Protocol: `rates`.
#[repr(C)]
pub(super) struct RateHeader {
    /// The digests' SipHash key: random when the segment is made, or the saved one.
    pub(super) secret: [AtomicU64; 2],
    /// After a crash or a promotion: when (ns of the boot-time clock) every key's burst counts
    /// as spent; 0 after a clean start.
    pub(super) spent_since: AtomicU64,
    /// Rate keys in the table, of all databases.
    pub(super) keys: AtomicU32,
    /// Rate policies in use, of all databases (0: no acquisition looks for one).
    pub(super) policies: AtomicU32,
}

/// The header's lifecycle fields.
///
/// Protocol: `committed`.
#[repr(C)]
pub(super) struct Lifecycle {
    pub(super) start_kind: AtomicU32,
    /// Set when a backend asks for an advance or a load: the launcher runs flushers at once.
    pub(super) requested: AtomicU32,
    /// When recovery ended (the launcher's first start on this segment): a crash's or a
    /// promotion's time for `stage_e_slots.recovery_hold`.
    pub(super) recovered_at: AtomicI64,
    /// Set by the launcher once it has asked for every database to be loaded after a start
    /// that holds caps back (`databases::all_loaded`).
    pub(super) loads_requested: AtomicU32,
    pub(super) dbs: [DbRecord; MAX_DATABASES],
}

pub(super) const POLICY_SIZE: usize = 256;
const _: () = assert!(size_of::<PolicyRecord>() == POLICY_SIZE);

/// Databases that can use the extension at once on one server.
pub const MAX_DATABASES: usize = 128;
