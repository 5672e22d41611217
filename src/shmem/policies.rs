//! Adaptive caps' policies: bounds, what the controller learned (`stage_e_core::adapt`), and
//! the window it is counting, one record per adaptive cap of any database.
//!
//! Protocol:
//! - Every field of a record is read and written under the *adapt* LWLock (shared to read,
//!   exclusive to write); the hot path never takes it. A record is free while its database is 0.
//! - Records are keyed by (database, name), apart from the caps' entries, so that a policy
//!   outlives its cap's reclaim; the rows of `stage_e_throttle_counter` keep it across restarts.
//! - The enforced limit reaches the hot path through the cap's entry (`Durable::limit`, in the
//!   line every acquisition reads; 0 = not adaptive, or monitor mode). It is written only under
//!   the adapt lock, on a pinned entry: at the entry's creation (under the directory lock, which
//!   is taken before the adapt lock, never after), and by whoever changes a record (the commit
//!   of `stage_e_adapt`, the launcher's tick, a load), who looks the cap up before taking the
//!   adapt lock. So the entry's limit is always the one of the record's latest write.
//! - One exception: `window_lost` is added to under the shared lock (`note_expiry`: an atomic
//!   add, on the rare path of an expiry); only the exclusive holder resets it, at a window's
//!   start, which no shared holder can overlap.
//! - Lock order: directory, then adapt. Nobody takes the directory lock holding the adapt lock.
//! - A transaction that sets policies reserves their records at its pre-commit (`reserve`: its
//!   pid in `reserved`, on the cap's record or on a free one), where an ERROR still rolls its
//!   rows back; so the commit always finds a record, and a committed row always has one in
//!   memory. A record is free while `db` and `reserved` are both 0; whoever reserved releases
//!   at the end of its transaction (`unreserve`, commit or abort). A crash resets the segment.

use super::entry::CapEntry;
use super::records::{load_name, store_name, PolicyRecord, REASON_WORDS};
use super::segment::{adapt_locked, segment, EXCLUSIVE, SHARED};
use super::{caps, Cap};
use pgrx::pg_sys;
use stage_e_core::adapt::{is_loss, Bounds, Learned, Step, Verdict, Window};
use stage_e_core::state::CapRef;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// At most one LOG line per cap this often (µs).
const LOG_EVERY_US: i64 = 10_000_000;

/// What `stage_e_adapt` (or `stage_e_adapt_off`) asks for, applied at its commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyChange {
    Set { bounds: Bounds, enforce: bool },
    Off,
}

/// One row of `stage_e_cap_limits`.
pub struct PolicyView {
    pub cap: String,
    pub limit: u32,
    pub bounds: Bounds,
    pub enforce: bool,
    /// µs; None before the first window with releases.
    pub baseline_us: Option<f64>,
    pub recent_us: Option<f64>,
    pub held: u32,
    pub changed_at: i64,
    pub reason: String,
}

/// A limit's move to log.
pub struct Moved {
    pub db: u32,
    pub cap: String,
    pub step: Step,
    /// Moves since the last line that were not logged.
    pub unlogged: u32,
}

/// The learned limit of a cap, to write to its row.
pub struct ToWrite {
    pub cap: String,
    pub limit: u32,
    pub baseline_us: Option<f64>,
}

/// The record is full: `stage_e_slots.max_adaptive_caps` of them are in use.
#[derive(Debug, PartialEq, Eq)]
pub struct NoPolicyRecord {
    pub max: u32,
}

fn f(a: &AtomicU64) -> f64 {
    f64::from_bits(a.load(Relaxed))
}

fn set_f(a: &AtomicU64, x: f64) {
    a.store(x.to_bits(), Relaxed);
}

impl PolicyRecord {
    fn is(&self, db: u32, name: &str) -> bool {
        self.db.load(Relaxed) == db
            && self.name_len.load(Relaxed) as usize == name.len()
            && load_name(&self.name, &self.name_len) == name
    }

    fn bounds(&self) -> Bounds {
        Bounds {
            min: self.min.load(Relaxed),
            max: self.max.load(Relaxed),
        }
    }

    fn learned(&self) -> Learned {
        Learned {
            limit: f(&self.limit),
            baseline_us: f(&self.baseline_us),
            recent_us: f(&self.recent_us),
            slow_start: self.slow_start.load(Relaxed) & 1 != 0,
            low_windows: (self.slow_start.load(Relaxed) >> 1) & 0x7fff,
            windows: self.slow_start.load(Relaxed) >> 16,
        }
    }

    fn set_learned(&self, l: Learned) {
        set_f(&self.limit, l.limit);
        set_f(&self.baseline_us, l.baseline_us);
        set_f(&self.recent_us, l.recent_us);
        let packed =
            l.slow_start as u32 | (l.low_windows.min(0x7fff) << 1) | (l.windows.min(0xffff) << 16);
        self.slow_start.store(packed, Relaxed);
    }

    /// Whether the learned limit differs from what a flusher last wrote to the cap's row.
    fn unwritten(&self) -> bool {
        self.written.load(Relaxed) != self.learned().limit(self.bounds())
    }

    fn enforce(&self) -> bool {
        self.enforce.load(Relaxed) != 0
    }

    /// The limit the hot path applies: 0 in monitor mode.
    fn enforced(&self) -> u32 {
        if self.enforce() {
            self.learned().limit(self.bounds())
        } else {
            0
        }
    }

    fn set_reason(&self, text: &str, now: i64) {
        let mut cut = text.len().min(REASON_WORDS * 8);
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        store_name(&self.reason, &self.reason_len, &text[..cut]);
        self.changed_at.store(now, Relaxed);
    }

    fn start_window(&self, cap: Option<&Cap>, now: i64) {
        let (at, ended, hold, expired) = match cap {
            Some(c) => {
                let (ended, hold, expired) = totals(c);
                (cap_word(c.at), ended, hold, expired)
            }
            None => (0, 0, 0, 0),
        };
        self.window_cap.store(at, Relaxed);
        self.window_start.store(now, Relaxed);
        self.window_ended.store(ended, Relaxed);
        self.window_hold_us.store(hold, Relaxed);
        self.window_expired.store(expired, Relaxed);
        self.window_lost.store(0, Relaxed);
    }

    fn view(&self, held: u32) -> PolicyView {
        let l = self.learned();
        let some = |x: f64| (x > 0.0).then_some(x);
        PolicyView {
            cap: load_name(&self.name, &self.name_len),
            limit: l.limit(self.bounds()),
            bounds: self.bounds(),
            enforce: self.enforce(),
            baseline_us: some(l.baseline_us),
            recent_us: some(l.recent_us),
            held,
            changed_at: self.changed_at.load(Relaxed),
            reason: load_name(&self.reason, &self.reason_len),
        }
    }
}

fn cap_word(at: CapRef) -> u64 {
    ((at.entry as u64 + 1) << 32) | at.generation as u64
}

/// Holds ended (released, released at exit, expired), their hold time, and expiries, since the
/// cap was made.
fn totals(cap: &Cap) -> (u64, u64, u64) {
    let v = cap.counters().load();
    (
        v.released + v.released_by_exit + v.expired,
        v.hold_time,
        v.expired,
    )
}

/// Slots of `cap` held now (or being probed), by its bitmap.
pub(super) fn held_bits(cap: &Cap) -> u32 {
    cap.bits()
        .iter()
        .map(|w| w.load(Relaxed).count_ones())
        .sum()
}

fn records() -> &'static [PolicyRecord] {
    segment().map_or(&[], |s| s.policies)
}

fn find(db: u32, name: &str) -> Option<&'static PolicyRecord> {
    records().iter().find(|r| r.is(db, name))
}

impl PolicyRecord {
    fn is_free(&self) -> bool {
        self.db.load(Relaxed) == 0 && self.reserved.load(Relaxed) == 0
    }
}

/// A free record, or the one this backend reserved (`me`) that has no policy on it now.
fn free_record(me: u32) -> Option<&'static PolicyRecord> {
    let mine = |r: &&PolicyRecord| r.db.load(Relaxed) == 0 && r.reserved.load(Relaxed) == me;
    records()
        .iter()
        .find(|r| me != 0 && mine(r))
        .or_else(|| records().iter().find(|r| r.is_free()))
}

fn my_pid() -> u32 {
    // SAFETY: reads a value set once at process start.
    unsafe { pg_sys::MyProcPid as u32 }
}

/// The pre-commit of a transaction that sets the policies of `caps` (of database `db`): a
/// record for each, reserved for this backend until its transaction ends. A cap's own record
/// is reserved if no other committing backend has; else a free one. Err (nothing is kept
/// reserved, the caller raises, and the abort releases) when no record is left.
pub fn reserve(db: u32, caps: &[&str]) -> Result<(), NoPolicyRecord> {
    let me = my_pid();
    let max = records().len() as u32;
    adapt_locked(EXCLUSIVE, || {
        for name in caps {
            if let Some(r) = find(db, name) {
                let held = r.reserved.load(Relaxed);
                if held == 0 || held == me {
                    r.reserved.store(me, Relaxed);
                    continue;
                }
            }
            let r = records()
                .iter()
                .find(|r| r.is_free())
                .ok_or(NoPolicyRecord { max })?;
            r.reserved.store(me, Relaxed);
        }
        Ok(())
    })
}

/// This backend's transaction ended: the records it reserved are released (a record with no
/// policy left on it is free again).
pub fn unreserve() {
    if records().is_empty() || !has_proc() {
        return;
    }
    let me = my_pid();
    adapt_locked(EXCLUSIVE, || {
        for r in records().iter().filter(|r| r.reserved.load(Relaxed) == me) {
            r.reserved.store(0, Relaxed);
        }
    });
}

/// Whether this process may take LWLocks (the postmaster, restoring caps at start, may not:
/// nothing else runs then, and no policy is loaded yet).
fn has_proc() -> bool {
    // SAFETY: reads a pointer set once at process start.
    unsafe { !pg_sys::MyProc.is_null() }
}

impl CapEntry {
    /// Creating the entry of `(db, name)`, under the exclusive directory lock: its policy's
    /// enforced limit (0 = none).
    pub(super) fn start_limit(&self, db: u32, name: &str) {
        let limit = if has_proc() {
            adapt_locked(SHARED, || find(db, name).map_or(0, |r| r.enforced()))
        } else {
            0
        };
        self.durable.limit.store(limit, Relaxed);
    }
}

impl Cap {
    /// The enforced limit of an adaptive cap, 0 when it is not (the hot path: one load).
    #[inline]
    pub fn limit(&self) -> u32 {
        self.entry().durable.limit.load(Relaxed)
    }
}

/// The limit `(db, name)` has learned, clamped to `bounds`; None without a policy.
pub fn learned_limit(db: u32, name: &str, bounds: Bounds) -> Option<u32> {
    adapt_locked(SHARED, || {
        find(db, name).map(|r| {
            let mut l = r.learned();
            l.rebound(bounds);
            l.limit(bounds)
        })
    })
}

/// A lease of `cap` expired after holding its slot `held_us`: a loss for its policy, if it has
/// one and the lease held its slot long enough to matter (`stage_e_core::adapt::is_loss`).
pub fn note_expiry(cap: &Cap, held_us: i64) {
    if records().is_empty() || !has_proc() {
        return;
    }
    let (db, name) = (cap.database(), cap.name());
    adapt_locked(SHARED, || {
        if let Some(r) = find(db, &name) {
            if is_loss(held_us, f(&r.baseline_us)) {
                r.window_lost.fetch_add(1, Relaxed);
            }
        }
    });
}

/// The databases with learned limits not yet written to their rows.
pub fn databases_with_limits_to_write() -> Vec<u32> {
    databases_where(PolicyRecord::unwritten)
}

/// The databases of the records in use for which `keep` is true, once each.
fn databases_where(keep: impl Fn(&PolicyRecord) -> bool) -> Vec<u32> {
    if records().is_empty() {
        return Vec::new();
    }
    let mut dbs: Vec<u32> = adapt_locked(SHARED, || {
        records()
            .iter()
            .filter(|r| r.db.load(Relaxed) != 0 && keep(r))
            .map(|r| r.db.load(Relaxed))
            .collect()
    });
    dbs.sort_unstable();
    dbs.dedup();
    dbs
}

/// Whether `(db, name)` has a policy, or a free record for one.
pub fn policy_room(db: u32, name: &str) -> Result<(), NoPolicyRecord> {
    let max = records().len() as u32;
    adapt_locked(SHARED, || {
        let ok = find(db, name).is_some() || records().iter().any(|r| r.is_free());
        if ok {
            Ok(())
        } else {
            Err(NoPolicyRecord { max })
        }
    })
}

/// Applies a committed `stage_e_adapt` / `stage_e_adapt_off`. New bounds keep what was learned
/// (clamped); a new policy starts cold (at its minimum), on the record this backend reserved
/// at its pre-commit (`reserve`), or a free one.
pub fn apply_policy(
    db: u32,
    name: &str,
    change: PolicyChange,
    now: i64,
) -> Result<(), NoPolicyRecord> {
    let cap = caps::lookup(db, name);
    let max = records().len() as u32;
    adapt_locked(EXCLUSIVE, || {
        let found = find(db, name);
        match change {
            PolicyChange::Off => {
                if let Some(r) = found {
                    r.db.store(0, Relaxed);
                }
                if let Some(c) = &cap {
                    c.entry().durable.limit.store(0, Relaxed);
                }
                Ok(())
            }
            PolicyChange::Set { bounds, enforce } => {
                let r = match found {
                    Some(r) => {
                        let mut l = r.learned();
                        let from = l.limit(r.bounds());
                        l.rebound(bounds);
                        r.min.store(bounds.min, Relaxed);
                        r.max.store(bounds.max, Relaxed);
                        r.set_learned(l);
                        let to = l.limit(bounds);
                        r.set_reason(&format!("bounds changed: {from} -> {to}"), now);
                        // The row now has what the call wrote; the flusher writes it again.
                        r.written.store(u32::MAX, Relaxed);
                        r
                    }
                    None => {
                        let r = free_record(my_pid()).ok_or(NoPolicyRecord { max })?;
                        fill(r, db, name, bounds, Learned::start(bounds), now);
                        r.set_reason(&format!("started at min_slots: {}", bounds.min), now);
                        r.start_window(cap.as_ref(), now);
                        // The launcher may be asleep for a flush interval: its windows start now.
                        super::launcher::wake();
                        r
                    }
                };
                r.enforce.store(enforce as u32, Relaxed);
                if let Some(c) = &cap {
                    c.entry().durable.limit.store(r.enforced(), Relaxed);
                }
                Ok(())
            }
        }
    })
}

fn fill(r: &PolicyRecord, db: u32, name: &str, bounds: Bounds, l: Learned, now: i64) {
    store_name(&r.name, &r.name_len, name);
    r.min.store(bounds.min, Relaxed);
    r.max.store(bounds.max, Relaxed);
    r.set_learned(l);
    r.written.store(u32::MAX, Relaxed);
    r.logged_at.store(0, Relaxed);
    r.unlogged.store(0, Relaxed);
    r.changed_at.store(now, Relaxed);
    r.db.store(db, Relaxed);
}

/// A load (after a start, or an update): the policy and learned limit of a row. A policy this
/// server already runs keeps its learning (the row's limit is at most a flush interval old).
pub fn restore_policy(
    db: u32,
    name: &str,
    bounds: Bounds,
    enforce: bool,
    limit: Option<u32>,
    baseline_us: Option<f64>,
    now: i64,
) -> Result<(), NoPolicyRecord> {
    let cap = caps::lookup(db, name);
    let max = records().len() as u32;
    adapt_locked(EXCLUSIVE, || {
        let r = match find(db, name) {
            Some(r) => r,
            None => {
                let r = free_record(0).ok_or(NoPolicyRecord { max })?;
                let l = match limit {
                    Some(limit) => Learned::restored(bounds, limit, baseline_us.unwrap_or(0.0)),
                    None => Learned::start(bounds),
                };
                fill(r, db, name, bounds, l, now);
                r.written.store(limit.unwrap_or(u32::MAX), Relaxed);
                let reason = match limit {
                    Some(_) => format!("restored: {}", l.limit(bounds)),
                    None => format!("started at min_slots: {}", bounds.min),
                };
                r.set_reason(&reason, now);
                r.start_window(cap.as_ref(), now);
                r
            }
        };
        r.enforce.store(enforce as u32, Relaxed);
        if let Some(c) = &cap {
            c.entry().durable.limit.store(r.enforced(), Relaxed);
        }
        Ok(())
    })
}

/// Database `db` was dropped, or the extension in it: its policies end, and its caps bind with
/// their callers' n alone.
pub fn clear_policies(db: u32) {
    if records().is_empty() || !has_proc() {
        return;
    }
    // Pinned before the adapt lock (lock order); an entry made meanwhile finds no record.
    let live = caps::caps(Some(db));
    adapt_locked(EXCLUSIVE, || {
        for r in records().iter().filter(|r| r.db.load(Relaxed) == db) {
            r.db.store(0, Relaxed);
        }
        for c in &live {
            c.entry().durable.limit.store(0, Relaxed);
        }
    });
}

/// The databases that have adaptive caps.
pub fn policy_databases() -> Vec<u32> {
    databases_where(|_| true)
}

/// Adaptive caps in use, of any database (the launcher ticks while there are any).
pub fn policy_count() -> usize {
    if records().is_empty() {
        return 0;
    }
    adapt_locked(SHARED, || {
        records().iter().filter(|r| r.db.load(Relaxed) != 0).count()
    })
}

/// The rows of `stage_e_cap_limits` for database `db`.
pub fn cap_limits(db: u32) -> Vec<PolicyView> {
    let names: Vec<String> = adapt_locked(SHARED, || {
        records()
            .iter()
            .filter(|r| r.db.load(Relaxed) == db)
            .map(|r| load_name(&r.name, &r.name_len))
            .collect()
    });
    let held: Vec<u32> = names
        .iter()
        .map(|n| caps::lookup(db, n).map_or(0, |c| held_bits(&c)))
        .collect();
    adapt_locked(SHARED, || {
        names
            .iter()
            .zip(held)
            .filter_map(|(n, h)| find(db, n).map(|r| r.view(h)))
            .collect()
    })
}

/// The launcher, every [`stage_e_core::adapt::WINDOW_US`]: each adaptive cap with a ready
/// window learns from it; the entries get the new limits. Returns the moves to log.
pub fn adapt_tick(now: i64) -> Vec<Moved> {
    let who: Vec<(u32, String)> = adapt_locked(SHARED, || {
        records()
            .iter()
            .filter(|r| r.db.load(Relaxed) != 0)
            .map(|r| (r.db.load(Relaxed), load_name(&r.name, &r.name_len)))
            .collect()
    });
    let mut moved = Vec::new();
    for (db, name) in who {
        // Looked up (and pinned) before the adapt lock: lock order.
        let cap = caps::lookup(db, &name);
        let step = adapt_locked(EXCLUSIVE, || {
            let r = find(db, &name)?;
            let step = learn(r, cap.as_ref(), now);
            if let Some(c) = &cap {
                c.entry().durable.limit.store(r.enforced(), Relaxed);
            }
            let step = step.filter(|s| s.moved())?;
            r.set_reason(&step.describe(), now);
            if now - r.logged_at.load(Relaxed) < LOG_EVERY_US {
                r.unlogged.fetch_add(1, Relaxed);
                return None;
            }
            r.logged_at.store(now, Relaxed);
            Some((step, r.unlogged.swap(0, Relaxed)))
        });
        if let Some((step, unlogged)) = step {
            moved.push(Moved {
                db,
                cap: name,
                step,
                unlogged,
            });
        }
    }
    moved
}

/// One record's window: learns from it if it is ready (under the exclusive adapt lock).
fn learn(r: &PolicyRecord, cap: Option<&Cap>, now: i64) -> Option<Step> {
    let Some(cap) = cap else {
        r.start_window(None, now); // no entry: nothing is held or released
        return None;
    };
    if r.window_cap.load(Relaxed) != cap_word(cap.at) {
        r.start_window(Some(cap), now); // made (again) since the window began
        return None;
    }
    let (ended, hold, expired) = totals(cap);
    let w = Window {
        releases: ended.wrapping_sub(r.window_ended.load(Relaxed)),
        hold_us: hold.wrapping_sub(r.window_hold_us.load(Relaxed)),
        expired: expired.wrapping_sub(r.window_expired.load(Relaxed)),
        lost: r.window_lost.load(Relaxed) as u64,
        held: held_bits(cap),
        elapsed_us: now - r.window_start.load(Relaxed),
    };
    match w.verdict() {
        Verdict::Extend => None,
        Verdict::Idle => {
            r.start_window(Some(cap), now);
            None
        }
        Verdict::Ready => {
            let mut l = r.learned();
            let step = l.step(r.bounds(), w);
            r.set_learned(l);
            r.start_window(Some(cap), now);
            Some(step)
        }
    }
}

/// The learned limits of database `db` not yet written to their rows.
pub fn limits_to_write(db: u32) -> Vec<ToWrite> {
    adapt_locked(SHARED, || {
        records()
            .iter()
            .filter(|r| r.db.load(Relaxed) == db && r.unwritten())
            .map(|r| {
                let l = r.learned();
                let limit = l.limit(r.bounds());
                ToWrite {
                    cap: load_name(&r.name, &r.name_len),
                    limit,
                    baseline_us: (l.baseline_us > 0.0).then_some(l.baseline_us),
                }
            })
            .collect()
    })
}

/// The flusher's write of `limits` committed.
pub fn limits_written(db: u32, limits: &[ToWrite]) {
    adapt_locked(EXCLUSIVE, || {
        for w in limits {
            if let Some(r) = find(db, &w.cap) {
                r.written.store(w.limit, Relaxed);
            }
        }
    });
}
