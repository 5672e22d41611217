//! What must hold across a restart, a crash or a promotion (`docs/lifecycle.md`): the rules of
//! the durable lease horizon and token floor, how a start is classified, and how long a cap is
//! held back after it. The files and the journal that carry leases over are `lease_file`.
//!
//! **Horizon.** A lease (or a renewal) with expiry `E` may be granted only while
//! `E + margin ≤ horizon`, where `horizon` is the last *committed* value of the cap's row: so
//! after a crash or a promotion, holding the cap back until `horizon` outlasts every lease the
//! old server granted. The row is written ahead of need ([`advance_target`]): a grant that finds
//! less than half a step of room asks for the next advance ([`Room::Ask`]) and goes on; only one
//! that finds none waits for it ([`Room::Wait`]).
//!
//! **Token floor.** Every token a lease got is ≤ the committed floor, written [`TOKEN_RESERVE`]
//! ahead of the cap's counter; after any start a cap's counter begins above the floor and the
//! clock-based base, whichever is higher ([`token_start`]), so tokens keep growing also when the
//! new server's clock is behind the old one's.

use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};

/// How far ahead of need the horizon is written: a cap with steady leases gets one row write
/// per half step.
pub const HORIZON_STEP_US: i64 = 4_000_000;

/// A cap with no lease for this long (after its journal said so) has its horizon lowered to the
/// present: after a crash, nothing holds it back.
pub const QUIET_AFTER_US: i64 = 2_000_000;

/// Tokens reserved ahead of a cap's counter by each floor write (2^40: about 18 minutes of the
/// clock-based base's rate of 1,024 tokens per microsecond, and days of acquisitions at any
/// rate a server reaches).
pub const TOKEN_RESERVE: u64 = 1 << 40;

/// Whether a grant may go ahead against the committed horizon and floor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Room {
    /// Granted; plenty of room left.
    Enough,
    /// Granted, but ask for the next advance now (less than half a step left).
    Ask,
    /// Not granted until an advance commits.
    Wait,
}

/// Whether a lease with expiry `expires_at` and token `token` fits under the committed
/// `horizon` and `floor`.
pub fn room(expires_at: i64, margin_us: i64, token: u64, horizon: i64, floor: u64) -> Room {
    let need = expires_at.saturating_add(margin_us);
    if need > horizon || token > floor {
        Room::Wait
    } else if need.saturating_add(HORIZON_STEP_US / 2) > horizon
        || token.saturating_add(TOKEN_RESERVE / 2) > floor
    {
        Room::Ask
    } else {
        Room::Enough
    }
}

/// The horizon to write for a lease that needs `expires_at`: a step beyond it and the margin.
pub fn advance_target(expires_at: i64, margin_us: i64) -> i64 {
    expires_at
        .saturating_add(margin_us)
        .saturating_add(HORIZON_STEP_US)
}

/// The floor to write for a cap whose counter is at `last_token`.
pub fn floor_target(last_token: u64) -> u64 {
    last_token
        .saturating_add(TOKEN_RESERVE)
        .min(i64::MAX as u64)
}

/// Whether the floor must be written again (less than half a reserve left).
pub fn floor_due(last_token: u64, floor: u64) -> bool {
    last_token.saturating_add(TOKEN_RESERVE / 2) > floor
}

/// The server's fencing-token counter: every acquisition of any cap takes the next value. It
/// starts at the clock-based base (`lease::token_base`) and is raised above every saved or
/// durable floor before a token is handed out where that floor applies, so tokens keep
/// growing across a restart also when the new server's clock is behind the old one's.
/// A cache line of its own: every acquisition writes it.
#[repr(C, align(64))]
#[derive(Default)]
pub struct TokenCounter(std::sync::atomic::AtomicU64);

impl TokenCounter {
    /// When the segment is made.
    pub fn start(&self, clock_base: u64) {
        self.0.store(clock_base, Ordering::Relaxed);
    }

    /// Tokens go on above `floor`.
    pub fn raise(&self, floor: u64) {
        self.0.fetch_max(floor, Ordering::AcqRel);
    }

    /// The next token.
    pub fn next(&self) -> u64 {
        self.0.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The last token handed out.
    pub fn last(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

/// A lease grant between its room check and its lease record: a close waits for it
/// ([`close`]). Made by [`begin_grant`] before the grant reads the horizon.
#[must_use]
pub struct Granting<'a>(&'a AtomicU32);

/// A grant begins: raise `granting` (SeqCst) before reading the committed horizon.
pub fn begin_grant(granting: &AtomicU32) -> Granting<'_> {
    granting.fetch_add(1, Ordering::SeqCst);
    Granting(granting)
}

impl Drop for Granting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Closes a quiet cap so that its durable horizon may be lowered: the committed `horizon` (in
/// shared memory) becomes 0, so every later grant waits for an advance; then the grants that
/// read it before wait out (`granting`, Dekker-style: the grant's increment precedes its read
/// of the horizon, the close's store precedes its read of the count, all SeqCst, so a grant
/// either is counted here or reads 0). True if no lease is live then (`leases`); otherwise the
/// horizon is put back and the cap stays open. `nap` waits a moment between looks.
pub fn close(
    horizon: &AtomicI64,
    granting: &AtomicU32,
    leases: impl Fn() -> u32,
    nap: impl FnMut(),
) -> bool {
    let before = horizon.swap(0, Ordering::SeqCst);
    if drained(granting, nap) && leases() == 0 {
        return true;
    }
    horizon.fetch_max(before, Ordering::AcqRel);
    false
}

/// The horizon a cap's row may come down to while it has live leases, the latest of whose
/// expiries is `latest_expiry`: what an advance for that lease writes. Some only when the
/// committed `horizon` is more than a step above it (a longer lease has ended since): the row
/// then follows the leases that may be live, not the longest ever granted, so that a crash
/// holds the cap back no longer than they may live.
pub fn lowered(horizon: i64, latest_expiry: i64, margin_us: i64) -> Option<i64> {
    let to = advance_target(latest_expiry, margin_us);
    (horizon > to.saturating_add(HORIZON_STEP_US)).then_some(to)
}

/// Lowers the committed `horizon` (in shared memory) from `from` to `to`, so that the row may
/// be written down to `to`: every later grant or renewal checks against `to`, and those that
/// read `from` are waited out (`granting`, Dekker-style as in [`close`]). True then: every
/// lease that relied on `from` is recorded, so the caller reads the live leases *after* this
/// and writes a row no lower than `to` nor than any of them. False, with `from` back, if the
/// horizon moved meanwhile or a grant stalled mid-way.
pub fn lower(
    horizon: &AtomicI64,
    granting: &AtomicU32,
    from: i64,
    to: i64,
    nap: impl FnMut(),
) -> bool {
    if horizon
        .compare_exchange(from, to, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        return false;
    }
    if drained(granting, nap) {
        return true;
    }
    horizon.fetch_max(from, Ordering::AcqRel);
    false
}

/// Waits until no grant is between its room check and its lease record; false if one stalls
/// mid-way (it is a few stores: give up rather than wait on it).
fn drained(granting: &AtomicU32, mut nap: impl FnMut()) -> bool {
    let mut looks = 0;
    while granting.load(Ordering::SeqCst) > 0 {
        looks += 1;
        if looks > 100_000 {
            return false;
        }
        nap();
    }
    true
}

/// How this server's shared memory began (decided once per initialisation by the postmaster).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum StartKind {
    /// The lease file of a clean shutdown was read: leases and tokens are exact.
    Clean = 1,
    /// Anything else on a primary: a crash, an immediate shutdown, a missing or bad file.
    Crash = 2,
    /// `standby.signal` or `recovery.signal`: a standby or an archive recovery; its end is a
    /// promotion.
    Standby = 3,
}

impl StartKind {
    pub fn from_u32(v: u32) -> Option<StartKind> {
        match v {
            1 => Some(StartKind::Clean),
            2 => Some(StartKind::Crash),
            3 => Some(StartKind::Standby),
            _ => None,
        }
    }

    /// Whether the caps must be held back until their horizon once loaded.
    pub fn holds(self) -> bool {
        self != StartKind::Clean
    }

    /// The reason a hold gives in `stage_e_held_back`.
    pub fn reason(self) -> HoldReason {
        match self {
            StartKind::Standby => HoldReason::Promotion,
            _ => HoldReason::Crash,
        }
    }
}

/// Why a cap is held back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum HoldReason {
    Crash = 1,
    Promotion = 2,
    RecoveryHold = 3,
}

impl HoldReason {
    pub fn from_u32(v: u32) -> Option<HoldReason> {
        match v {
            1 => Some(HoldReason::Crash),
            2 => Some(HoldReason::Promotion),
            3 => Some(HoldReason::RecoveryHold),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            HoldReason::Crash => "crash",
            HoldReason::Promotion => "promotion",
            HoldReason::RecoveryHold => "recovery_hold",
        }
    }
}

/// A cap's hold after loading its row: the later of its horizon (if leases may be live) and
/// the recovery hold (if it has a counter row), with the reason of the later one.
pub fn hold_for(
    kind: StartKind,
    now: i64,
    horizon: Option<i64>,
    recovery_hold_until: Option<i64>,
) -> Option<(i64, HoldReason)> {
    if !kind.holds() {
        return None;
    }
    let by_horizon = horizon.filter(|&h| h > now).map(|h| (h, kind.reason()));
    let by_setting = recovery_hold_until
        .filter(|&h| h > now)
        .map(|h| (h, HoldReason::RecoveryHold));
    match (by_horizon, by_setting) {
        (Some(a), Some(b)) => Some(if b.0 > a.0 { b } else { a }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod unit {
    use super::*;
    use crate::lease::token_base;

    const S: i64 = 1_000_000;

    #[test]
    fn a_grant_fits_under_the_horizon_with_its_margin_or_waits() {
        let (margin, floor) = (2 * S, 1_000);
        // Exactly at the horizon with the margin: granted, but the next advance is asked for.
        assert_eq!(room(100 * S, margin, 10, 102 * S, floor), Room::Ask);
        assert_eq!(room(100 * S + 1, margin, 10, 102 * S, floor), Room::Wait);
        assert_eq!(
            room(
                100 * S,
                margin,
                10,
                102 * S + HORIZON_STEP_US,
                TOKEN_RESERVE
            ),
            Room::Enough
        );
        // A token past the floor waits too, whatever the horizon.
        assert_eq!(room(0, 0, floor + 1, i64::MAX, floor), Room::Wait);
        // The target of an advance leaves a whole step of room.
        let e = 100 * S;
        let t = advance_target(e, margin);
        assert_eq!(room(e, margin, 10, t, TOKEN_RESERVE), Room::Enough);
        assert_eq!(
            room(e + HORIZON_STEP_US / 2 + 1, margin, 10, t, TOKEN_RESERVE),
            Room::Ask
        );
        // No overflow at the ends of the range.
        assert_eq!(room(i64::MAX, i64::MAX, 0, i64::MAX, 0), Room::Ask);
        assert_eq!(advance_target(i64::MAX - 1, S), i64::MAX);
    }

    #[test]
    fn the_floor_is_written_a_reserve_ahead_and_again_at_half_of_it() {
        let last = token_base(1_800_000_000 * S);
        let floor = floor_target(last);
        assert_eq!(floor - last, TOKEN_RESERVE);
        assert!(!floor_due(last, floor));
        assert!(!floor_due(last + TOKEN_RESERVE / 2, floor));
        assert!(floor_due(last + TOKEN_RESERVE / 2 + 1, floor));
        // Never past what an int8 column holds.
        assert_eq!(floor_target(u64::MAX - 5), i64::MAX as u64);
        // The reserve is under the headroom of the token range for centuries of clock.
        assert!(token_base(4_000_000_000 * S) + TOKEN_RESERVE < i64::MAX as u64);
    }

    /// The server issues tokens up to its committed floor, crashes, and a new one starts with a
    /// clock an hour *behind*: its first token is still above every earlier one.
    #[test]
    fn tokens_keep_growing_when_the_new_servers_clock_is_behind() {
        let old_clock = 1_800_000_000 * S;
        let old = TokenCounter::default();
        old.start(token_base(old_clock));
        let mut floor = 0;
        let mut issued = Vec::new();
        for _ in 0..10_000u64 {
            let t = old.next();
            if floor_due(t, floor) {
                floor = floor_target(t); // the committed write
            }
            assert!(t <= floor, "no token past the committed floor");
            issued.push(t);
        }
        // The crash: a new server whose clock is an hour behind loads the floor.
        let new = TokenCounter::default();
        new.start(token_base(old_clock - 3_600 * S));
        new.raise(floor);
        let next = new.next();
        assert!(
            issued.iter().all(|&t| t < next),
            "above every earlier token"
        );
        // With the clock ahead, the clock wins (tokens stay clock-like).
        let ahead = TokenCounter::default();
        ahead.start(token_base(old_clock + 3_600 * S));
        ahead.raise(floor);
        assert_eq!(ahead.last(), token_base(old_clock + 3_600 * S));
    }

    #[test]
    fn holds_come_from_the_horizon_or_the_recovery_hold_whichever_is_later() {
        let now = 1_000 * S;
        assert_eq!(
            hold_for(StartKind::Clean, now, Some(now + S), Some(now + S)),
            None
        );
        assert_eq!(
            hold_for(StartKind::Crash, now, Some(now + 5 * S), None),
            Some((now + 5 * S, HoldReason::Crash))
        );
        assert_eq!(
            hold_for(
                StartKind::Standby,
                now,
                Some(now + 5 * S),
                Some(now + 9 * S)
            ),
            Some((now + 9 * S, HoldReason::RecoveryHold))
        );
        assert_eq!(
            hold_for(StartKind::Standby, now, Some(now + 5 * S), Some(now + S)),
            Some((now + 5 * S, HoldReason::Promotion))
        );
        // A horizon already passed holds nothing: a cap with no lease outstanding is free.
        assert_eq!(hold_for(StartKind::Crash, now, Some(now - 1), None), None);
        assert_eq!(hold_for(StartKind::Crash, now, None, None), None);
        for r in [
            HoldReason::Crash,
            HoldReason::Promotion,
            HoldReason::RecoveryHold,
        ] {
            assert_eq!(HoldReason::from_u32(r as u32), Some(r));
        }
        for k in [StartKind::Clean, StartKind::Crash, StartKind::Standby] {
            assert_eq!(StartKind::from_u32(k as u32), Some(k));
        }
    }

    /// Grants and closes race: a lease must never be recorded while the cap is closed as
    /// quiet (that lease would have no durable horizon), and the race must actually run.
    #[test]
    fn a_close_never_lets_a_grant_record_a_lease_on_a_quiet_cap() {
        use std::sync::atomic::{AtomicBool, AtomicUsize};
        use std::sync::Arc;
        let horizon = Arc::new(AtomicI64::new(1));
        let granting = Arc::new(AtomicU32::new(0));
        let leases = Arc::new(AtomicU32::new(0));
        let quiet = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (granted, refused, closes) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        let grants: Vec<_> = (0..3)
            .map(|_| {
                let (horizon, granting, leases, quiet, stop, granted, refused) = (
                    horizon.clone(),
                    granting.clone(),
                    leases.clone(),
                    quiet.clone(),
                    stop.clone(),
                    granted.clone(),
                    refused.clone(),
                );
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let g = begin_grant(&granting);
                        if horizon.load(Ordering::SeqCst) == 0 {
                            refused.fetch_add(1, Ordering::Relaxed);
                            drop(g);
                            std::thread::yield_now();
                            continue;
                        }
                        std::thread::yield_now(); // preempted between the check and the record
                        leases.fetch_add(1, Ordering::SeqCst);
                        assert!(!quiet.load(Ordering::SeqCst), "a lease on a quiet cap");
                        drop(g);
                        granted.fetch_add(1, Ordering::Relaxed);
                        std::thread::yield_now();
                        leases.fetch_sub(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for _ in 0..20_000 {
            if close(
                &horizon,
                &granting,
                || leases.load(Ordering::SeqCst),
                std::thread::yield_now,
            ) {
                quiet.store(true, Ordering::SeqCst);
                closes.fetch_add(1, Ordering::Relaxed);
                for _ in 0..20 {
                    std::thread::yield_now(); // the quiet row being written and committed
                }
                // The advance that reopens it, after the quiet row would have committed.
                quiet.store(false, Ordering::SeqCst);
                horizon.store(1, Ordering::SeqCst);
            }
            // Stay open until some grant got through (briefly: the grants may be descheduled).
            let seen = granted.load(Ordering::Relaxed);
            for _ in 0..1_000 {
                if granted.load(Ordering::Relaxed) > seen {
                    break;
                }
                std::thread::yield_now();
            }
        }
        stop.store(true, Ordering::Relaxed);
        for g in grants {
            g.join().unwrap();
        }
        let (g, r, c) = (
            granted.load(Ordering::Relaxed),
            refused.load(Ordering::Relaxed),
            closes.load(Ordering::Relaxed),
        );
        assert!(
            g > 0 && r > 0 && c > 0,
            "the race ran: {g} grants, {r} refused, {c} closes"
        );
    }

    /// Issue 35: a horizon brought down to the leases that may be live (a long lease ended, a
    /// short one kept) races grants, each preempted between its room check and its lease
    /// record: the row is never below a live lease's expiry plus the margin (after a crash,
    /// that lease would outlive the hold), shared memory's horizon is never above the row,
    /// and the race actually runs.
    #[test]
    fn a_lowered_horizon_never_leaves_a_live_lease_uncovered() {
        use std::sync::atomic::{AtomicBool, AtomicUsize};
        use std::sync::{Arc, Mutex};
        const M: i64 = S / 5;
        let clock = Arc::new(AtomicI64::new(1_000 * S));
        let horizon = Arc::new(AtomicI64::new(0)); // committed, in shared memory
        let row = Arc::new(AtomicI64::new(0)); // on disk
        let wanted = Arc::new(AtomicI64::new(0));
        let granting = Arc::new(AtomicU32::new(0));
        let live = Arc::new(Mutex::new(Vec::<i64>::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let granted = Arc::new(AtomicUsize::new(0));
        let grants: Vec<_> = (0..3)
            .map(|t| {
                let (clock, horizon, row, wanted, granting, live, stop, granted) = (
                    clock.clone(),
                    horizon.clone(),
                    row.clone(),
                    wanted.clone(),
                    granting.clone(),
                    live.clone(),
                    stop.clone(),
                    granted.clone(),
                );
                std::thread::spawn(move || {
                    // The first takes leases of a minute, each ended at once; the others
                    // leases of a second.
                    let ttl = if t == 0 { 60 * S } else { S };
                    while !stop.load(Ordering::Relaxed) {
                        let e = clock.load(Ordering::Relaxed) + ttl;
                        let g = begin_grant(&granting);
                        if e + M > horizon.load(Ordering::SeqCst) {
                            drop(g);
                            wanted.fetch_max(advance_target(e, M), Ordering::AcqRel);
                            std::thread::yield_now();
                            continue;
                        }
                        for _ in 0..3 {
                            std::thread::yield_now(); // preempted between check and record
                        }
                        live.lock().unwrap().push(e);
                        drop(g);
                        assert!(
                            e + M <= row.load(Ordering::SeqCst),
                            "a live lease uncovered"
                        );
                        granted.fetch_add(1, Ordering::Relaxed);
                        std::thread::yield_now();
                        let mut l = live.lock().unwrap();
                        let at = l.iter().position(|&x| x == e).unwrap();
                        l.swap_remove(at);
                    }
                })
            })
            .collect();
        let (mut lowers, started) = (0, std::time::Instant::now());
        while lowers < 1_000 && started.elapsed() < std::time::Duration::from_secs(5) {
            clock.fetch_add(S / 1_000, Ordering::Relaxed); // a millisecond a round
                                                           // An advance: committed, then published.
            let w = wanted.load(Ordering::Acquire);
            if w > horizon.load(Ordering::Acquire) {
                row.fetch_max(w, Ordering::SeqCst);
                horizon.fetch_max(w, Ordering::AcqRel);
            }
            let latest = live.lock().unwrap().iter().copied().max();
            let from = horizon.load(Ordering::Acquire);
            let Some(to) = latest.and_then(|l| lowered(from, l, M)) else {
                std::thread::yield_now();
                continue;
            };
            let asked = wanted.swap(0, Ordering::SeqCst);
            if !lower(&horizon, &granting, from, to, std::thread::yield_now) {
                wanted.fetch_max(asked, Ordering::AcqRel);
                continue;
            }
            // The leases read after the lowering; the row written down to them, then published.
            let written = live
                .lock()
                .unwrap()
                .iter()
                .map(|e| e + M)
                .chain([to, wanted.load(Ordering::Acquire)])
                .max()
                .unwrap();
            row.store(written, Ordering::SeqCst);
            horizon.fetch_max(written, Ordering::AcqRel);
            // (Not lowered if a long grant asked for more meanwhile.)
            lowers += usize::from(written < from);
            assert!(horizon.load(Ordering::SeqCst) <= row.load(Ordering::SeqCst));
        }
        stop.store(true, Ordering::Relaxed);
        for g in grants {
            g.join().unwrap();
        }
        let g = granted.load(Ordering::Relaxed);
        assert!(
            g > 0 && lowers > 0,
            "the race ran: {g} grants, {lowers} lowerings"
        );
    }

    #[test]
    fn a_horizon_comes_down_only_well_above_the_live_leases() {
        let (margin, latest) = (2 * S, 100 * S);
        let to = advance_target(latest, margin);
        assert_eq!(lowered(to + HORIZON_STEP_US, latest, margin), None);
        assert_eq!(lowered(to + HORIZON_STEP_US + 1, latest, margin), Some(to));
        assert_eq!(lowered(latest + 120 * S, latest, margin), Some(to));
        // A horizon moved meanwhile is left alone.
        let (h, g) = (AtomicI64::new(5), AtomicU32::new(0));
        assert!(!lower(&h, &g, 4, 1, || ()));
        assert_eq!(h.load(Ordering::Relaxed), 5);
        assert!(lower(&h, &g, 5, 1, || ()));
        assert_eq!(h.load(Ordering::Relaxed), 1);
        // A grant that stalls between its check and its record: the horizon goes back up.
        g.store(1, Ordering::Relaxed);
        assert!(!lower(&h, &g, 1, 0, || ()));
        assert_eq!(h.load(Ordering::Relaxed), 1);
    }
}
