//! Adaptive caps: the limit learned from the hold times of released slots.
//!
//! A cap made adaptive (`stage_e_adapt(cap, min_slots, max_slots)`) hands out slots only while
//! fewer than `least(n, limit)` are held; this file decides `limit`, from windows of the cap's
//! own counters, read by the launcher off the hot path (which pays nothing for it: the hold
//! time and release counts are the ones every release already adds).
//!
//! The anchors' lessons, and how each is kept:
//! - **Signal.** The mean hold time of the slots released in a window: the protected work's
//!   service time. Wait time and throttle rate are outputs (both rise whenever the cap binds),
//!   never inputs. An expired lease is a loss: the limit drops by [`EXPIRED_SHRINK`].
//! - **Baseline, not a minimum** (Netflix Gradient2: a minimum biases toward an impractically
//!   low base). The first window's mean, then a moving average that falls fast (half way) when
//!   hold times fall, and rises slowly ([`BASELINE_UP`]) only when the cap is lightly used or at
//!   its minimum: then a longer hold time is the work's, not the queue behind the cap. So a
//!   loaded cap's baseline never drifts up with its own queueing (Netflix #34).
//! - **Grow only when used** (Netflix's app-limited guard): by `GROWTH * sqrt(limit)` per
//!   window, when at least half the limit is in use (held now, or on average by Little's law:
//!   hold time per second), and hold times are within [`TOLERANCE`] of the baseline. From a cold
//!   start (the limit at `min_slots`, so the first baseline is uncongested) the limit grows to
//!   twice what is used each window until the first congestion (slow start: doubling, while
//!   all of it is used), so a cold start takes seconds.
//! - **Shrink multiplicatively** when the recent hold time exceeds `TOLERANCE x baseline`:
//!   toward `limit x TOLERANCE x baseline / recent` (where a resource of capacity k settles:
//!   at k the queue is empty), by at most [`MAX_SHRINK`] per window, so a short spike does
//!   not collapse the limit to the minimum (CockroachDB's 40 -> 1).
//! - **Bounded.** Always within `[min_slots, max_slots]`; growth needs use and tolerable hold
//!   times, so modest overload does not grow it (Netflix #134). The enforced limit is the
//!   learned value rounded down.
//!
//! The model tests below run these rules against a resource of known capacity (hold time `s`
//! up to k holders, `s x c / k` above) and check each failure mode.

/// A window is at least this long (µs): the launcher's tick.
pub const WINDOW_US: i64 = 500_000;
/// A window is extended until it has this many releases...
pub const MIN_RELEASES: u64 = 4;
/// ... or is this long (µs); then it counts as idle and starts over.
pub const MAX_WINDOW_US: i64 = 10_000_000;
/// Hold times up to this multiple of the baseline are not congestion.
pub const TOLERANCE: f64 = 1.35;
/// The most a congested window takes off the limit.
pub const MAX_SHRINK: f64 = 0.10;
/// Growth per window, times the square root of the limit (the queue term).
pub const GROWTH: f64 = 0.25;
/// The limit's factor for a window in which leases expired.
pub const EXPIRED_SHRINK: f64 = 0.9;
/// How far the baseline moves toward a shorter hold time, per window.
pub const BASELINE_DOWN: f64 = 0.5;
/// How far the baseline moves toward a longer hold time, per window, when the cap is lightly
/// used or at its minimum.
pub const BASELINE_UP: f64 = 0.05;

/// An adaptive cap's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    pub min: u32,
    pub max: u32,
}

/// Why bounds were refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BoundsError {
    /// `min_slots` below 1.
    MinBelowOne { min: i32 },
    /// `max_slots` below `min_slots`.
    MaxBelowMin { min: i32, max: i32 },
    /// `max_slots` above `stage_e_slots.max_slots`.
    MaxAboveMaxSlots { max: i32, max_slots: u32 },
}

impl Bounds {
    /// The bounds `min ..= max`, if they are valid under `stage_e_slots.max_slots`.
    pub fn new(min: i32, max: i32, max_slots: u32) -> Result<Bounds, BoundsError> {
        if min < 1 {
            return Err(BoundsError::MinBelowOne { min });
        }
        if max < min {
            return Err(BoundsError::MaxBelowMin { min, max });
        }
        if max as u32 > max_slots {
            return Err(BoundsError::MaxAboveMaxSlots { max, max_slots });
        }
        Ok(Bounds {
            min: min as u32,
            max: max as u32,
        })
    }

    fn clamp(self, x: f64) -> f64 {
        x.clamp(self.min as f64, self.max as f64)
    }
}

/// What a cap's counters say about one window (deltas since the window began).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Window {
    /// Slots released (session slots, leases, slots freed at exit), and their hold time (µs).
    pub releases: u64,
    pub hold_us: u64,
    /// Leases that expired.
    pub expired: u64,
    /// Slots held at the window's end.
    pub held: u32,
    /// The window's length (µs).
    pub elapsed_us: i64,
}

/// Whether a window is ready to learn from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Learn from it, and start the next window.
    Ready,
    /// Too short or too few releases: keep counting.
    Extend,
    /// Too long without enough releases: start over, learning nothing.
    Idle,
}

impl Window {
    pub fn verdict(&self) -> Verdict {
        if self.elapsed_us < WINDOW_US {
            Verdict::Extend
        } else if self.releases >= MIN_RELEASES || self.expired > 0 {
            Verdict::Ready
        } else if self.elapsed_us >= MAX_WINDOW_US {
            Verdict::Idle
        } else {
            Verdict::Extend
        }
    }

    /// Slots in use over the window: held at its end, or on average (hold time per second,
    /// Little's law), whichever is more.
    fn used(&self) -> f64 {
        let average = self.hold_us as f64 / self.elapsed_us.max(1) as f64;
        average.max(self.held as f64)
    }
}

/// Why the limit moved (or did not).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Why {
    /// Hold times were `ratio` times the baseline.
    Congested { ratio: f64 },
    /// At least half used (`used` slots), hold times within tolerance.
    Grew { used: f64, ratio: f64 },
    /// `n` leases expired.
    Expired { n: u64 },
    /// Neither congested nor used enough to grow.
    Kept,
}

/// One window's outcome: the enforced limit before and after.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Step {
    pub from: u32,
    pub to: u32,
    pub why: Why,
}

impl Step {
    pub fn moved(&self) -> bool {
        self.from != self.to
    }

    /// In words, for `stage_e_cap_limits.reason` and the log.
    pub fn describe(&self) -> String {
        let (from, to) = (self.from, self.to);
        match self.why {
            Why::Congested { ratio } => format!("hold time {ratio:.1}x baseline: {from} -> {to}"),
            Why::Grew { used, ratio } => format!(
                "used {:.0} of {from}, hold time {ratio:.1}x baseline: {from} -> {to}",
                used.min(from as f64)
            ),
            Why::Expired { n } => {
                let s = if n == 1 { "" } else { "s" };
                format!("{n} lease{s} expired: {from} -> {to}")
            }
            Why::Kept => format!("kept: {to}"),
        }
    }
}

/// What an adaptive cap has learned.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Learned {
    /// The learned limit, unrounded.
    pub limit: f64,
    /// The baseline and the last window's mean hold time (µs); 0 = none yet.
    pub baseline_us: f64,
    pub recent_us: f64,
    /// Doubling each window until the first congestion.
    pub slow_start: bool,
}

impl Learned {
    /// A cold start: at the minimum, so the first baseline is measured uncongested.
    pub fn start(b: Bounds) -> Learned {
        Learned {
            limit: b.min as f64,
            baseline_us: 0.0,
            recent_us: 0.0,
            slow_start: true,
        }
    }

    /// What a restart or a reload found in the cap's row: no slow start, the limit clamped.
    pub fn restored(b: Bounds, limit: u32, baseline_us: f64) -> Learned {
        Learned {
            limit: b.clamp(limit as f64),
            baseline_us: baseline_us.max(0.0),
            recent_us: 0.0,
            slow_start: false,
        }
    }

    /// New bounds for the same cap: what was learned stays, clamped.
    pub fn rebound(&mut self, b: Bounds) {
        self.limit = b.clamp(self.limit);
    }

    /// The enforced limit: the learned one rounded down, within the bounds.
    pub fn limit(&self, b: Bounds) -> u32 {
        (self.limit.floor() as u32).clamp(b.min, b.max)
    }

    /// Learns from a ready window.
    pub fn step(&mut self, b: Bounds, w: Window) -> Step {
        let from = self.limit(b);
        let before = self.limit;
        let mut why = Why::Kept;
        if w.expired > 0 {
            self.limit *= EXPIRED_SHRINK;
            self.slow_start = false;
            why = Why::Expired { n: w.expired };
        }
        if w.releases > 0 {
            let recent = w.hold_us as f64 / w.releases as f64;
            self.recent_us = recent;
            if self.baseline_us <= 0.0 {
                self.baseline_us = recent.max(1.0);
            }
            let ratio = recent / self.baseline_us;
            let used = w.used();
            if ratio > TOLERANCE {
                if w.expired == 0 {
                    let target = self.limit * TOLERANCE / ratio;
                    self.limit = target.max(self.limit * (1.0 - MAX_SHRINK));
                    self.slow_start = false;
                    why = Why::Congested { ratio };
                }
            } else if w.expired == 0 && used >= before / 2.0 {
                // Slow start: up to twice what is used (so doubling, when all of it is).
                self.limit = if self.slow_start {
                    self.limit.max(2.0 * used.min(self.limit))
                } else {
                    self.limit + GROWTH * self.limit.sqrt()
                };
                why = Why::Grew { used, ratio };
            }
            let baseline = self.baseline_us;
            if recent < baseline {
                self.baseline_us += BASELINE_DOWN * (recent - baseline);
            } else if used < before / 2.0 || before <= b.min as f64 {
                self.baseline_us += BASELINE_UP * (recent - baseline);
            }
        }
        self.limit = b.clamp(self.limit);
        Step {
            from,
            to: self.limit(b),
            why,
        }
    }
}

#[cfg(test)]
mod unit {
    use super::*;

    const B: Bounds = Bounds { min: 1, max: 16 };
    /// The model's service time (µs): 20 ms.
    const S: f64 = 20_000.0;

    /// A resource of capacity `k` worked by `clients` callers that always want a slot: a
    /// window of `WINDOW_US` at the enforced limit, hold time `s` up to k holders and
    /// `s x holders / k` above, with a deterministic ±`noise` jitter.
    struct Model {
        k: f64,
        s: f64,
        clients: u32,
        noise: f64,
        seed: u64,
    }

    impl Model {
        fn new(k: u32) -> Model {
            Model {
                k: k as f64,
                s: S,
                clients: 16,
                noise: 0.0,
                seed: 42,
            }
        }

        fn jitter(&mut self) -> f64 {
            self.seed = self.seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            let u = (self.seed >> 11) as f64 / (1u64 << 53) as f64;
            1.0 + self.noise * (2.0 * u - 1.0)
        }

        fn window(&mut self, limit: u32) -> Window {
            let holders = limit.min(self.clients) as f64;
            let hold = self.s * (holders / self.k).max(1.0) * self.jitter();
            let releases = (holders * WINDOW_US as f64 / hold) as u64;
            Window {
                releases,
                hold_us: (releases as f64 * hold) as u64,
                expired: 0,
                held: holders as u32,
                elapsed_us: WINDOW_US,
            }
        }
    }

    /// Runs `windows` windows; returns the enforced limit after each.
    fn run(l: &mut Learned, m: &mut Model, windows: usize) -> Vec<u32> {
        (0..windows)
            .map(|_| {
                let w = m.window(l.limit(B));
                l.step(B, w).to
            })
            .collect()
    }

    /// The first window (of 500 ms) from which the limit stays within [lo, hi].
    fn settled(series: &[u32], lo: u32, hi: u32) -> Option<usize> {
        let last_out = series.iter().rposition(|&x| x < lo || x > hi);
        match last_out {
            None => Some(0),
            Some(i) if i + 1 < series.len() => Some(i + 1),
            Some(_) => None,
        }
    }

    #[test]
    fn bounds_are_checked() {
        assert_eq!(Bounds::new(1, 16, 1024), Ok(B));
        assert_eq!(
            Bounds::new(0, 4, 1024),
            Err(BoundsError::MinBelowOne { min: 0 })
        );
        assert_eq!(
            Bounds::new(5, 4, 1024),
            Err(BoundsError::MaxBelowMin { min: 5, max: 4 })
        );
        assert_eq!(
            Bounds::new(1, 2000, 1024),
            Err(BoundsError::MaxAboveMaxSlots {
                max: 2000,
                max_slots: 1024
            })
        );
        assert_eq!(Bounds::new(3, 3, 3), Ok(Bounds { min: 3, max: 3 }));
    }

    #[test]
    fn a_cold_start_settles_within_k_and_one_and_a_half_k_within_30_s() {
        for k in [2u32, 6] {
            let mut l = Learned::start(B);
            let series = run(&mut l, &mut Model::new(k), 240);
            let hi = (k as f64 * 1.5).floor() as u32;
            let at = settled(&series, k, hi).expect("settles");
            assert!(at <= 60, "k = {k}: settled after {at} windows: {series:?}");
            assert!(
                (l.baseline_us - S).abs() < 1.0,
                "k = {k}: the baseline is the uncongested hold time: {}",
                l.baseline_us
            );
        }
    }

    #[test]
    fn the_limit_follows_a_capacity_change_both_ways() {
        let mut l = Learned::start(B);
        let mut m = Model::new(6);
        run(&mut l, &mut m, 60);
        for (k, hi) in [(2u32, 3u32), (6, 9)] {
            m.k = k as f64;
            let series = run(&mut l, &mut m, 120);
            let at = settled(&series, k, hi).expect("follows");
            assert!(at <= 60, "to k = {k}: after {at} windows: {series:?}");
        }
    }

    #[test]
    fn steady_state_spread_stays_within_one_of_the_median() {
        for (k, noise) in [(2u32, 0.0), (6, 0.0), (6, 0.05), (12, 0.05)] {
            let mut m = Model::new(k);
            m.noise = noise;
            m.clients = 32;
            let mut l = Learned::start(Bounds { min: 1, max: 32 });
            let b = Bounds { min: 1, max: 32 };
            let mut series = Vec::new();
            for _ in 0..360 {
                let w = m.window(l.limit(b));
                series.push(l.step(b, w).to);
            }
            let last = &mut series[240..].to_vec();
            last.sort();
            let median = last[last.len() / 2];
            let (lo, hi) = (last[0], last[last.len() - 1]);
            assert!(
                lo + 1 >= median && hi <= median + 1,
                "k = {k}, noise {noise}: {lo}..{hi} around {median}"
            );
        }
    }

    #[test]
    fn a_short_spike_does_not_collapse_the_limit() {
        let mut l = Learned::start(B);
        let mut m = Model::new(6);
        run(&mut l, &mut m, 60);
        let settled_at = l.limit(B);
        // Hold times three times longer for 2 s (four windows).
        m.s = 3.0 * S;
        let spike = run(&mut l, &mut m, 4);
        assert!(
            spike.iter().all(|&x| x * 3 >= settled_at * 2 - 2),
            "from {settled_at}: {spike:?}"
        );
        m.s = S;
        let after = run(&mut l, &mut m, 60);
        assert!(
            settled(&after, 6, 9).is_some_and(|at| at <= 40),
            "{after:?}"
        );
    }

    #[test]
    fn modest_overload_neither_grows_the_limit_nor_drifts_the_baseline() {
        // 12 clients on k = 6 with 5% jitter, for 10 minutes.
        let mut l = Learned::start(B);
        let mut m = Model::new(6);
        m.clients = 12;
        m.noise = 0.05;
        let series = run(&mut l, &mut m, 1200);
        assert!(series[60..].iter().all(|&x| x <= 10), "{:?}", &series[60..]);
        assert!(
            l.baseline_us < S * 1.06,
            "the baseline drifted up: {}",
            l.baseline_us
        );
    }

    #[test]
    fn a_cap_used_by_few_does_not_grow() {
        // Two callers only: the limit grows while they use half of it, no further.
        let mut l = Learned::start(B);
        let mut m = Model::new(16);
        m.clients = 2;
        let series = run(&mut l, &mut m, 100);
        assert!(series.iter().all(|&x| x <= 4), "{series:?}");
    }

    #[test]
    fn work_that_got_slower_for_good_is_relearned() {
        // The work itself takes twice as long (not the queue): the limit first falls, then the
        // baseline rises at the minimum and the limit climbs back to the capacity.
        let mut l = Learned::start(B);
        let mut m = Model::new(6);
        run(&mut l, &mut m, 60);
        m.s = 2.0 * S;
        let series = run(&mut l, &mut m, 240);
        let at = settled(&series, 6, 9).expect("relearns");
        assert!(at <= 160, "after {at} windows: {series:?}");
    }

    #[test]
    fn expired_leases_shrink_the_limit() {
        let mut l = Learned::restored(B, 10, S);
        let step = l.step(
            B,
            Window {
                releases: 0,
                hold_us: 0,
                expired: 2,
                held: 10,
                elapsed_us: WINDOW_US,
            },
        );
        assert_eq!((step.from, step.to), (10, 9));
        assert_eq!(step.describe(), "2 leases expired: 10 -> 9");
    }

    #[test]
    fn windows_wait_for_releases_and_give_up_when_idle() {
        let w = |releases, elapsed_us| Window {
            releases,
            elapsed_us,
            ..Window::default()
        };
        assert_eq!(w(100, WINDOW_US - 1).verdict(), Verdict::Extend);
        assert_eq!(w(4, WINDOW_US).verdict(), Verdict::Ready);
        assert_eq!(w(3, WINDOW_US).verdict(), Verdict::Extend);
        assert_eq!(w(3, MAX_WINDOW_US).verdict(), Verdict::Idle);
    }

    #[test]
    fn restored_and_rebound_limits_stay_in_bounds() {
        let mut l = Learned::restored(B, 40, S);
        assert_eq!(l.limit(B), 16);
        l.rebound(Bounds { min: 2, max: 8 });
        assert_eq!(l.limit(Bounds { min: 2, max: 8 }), 8);
        l.rebound(Bounds { min: 12, max: 14 });
        assert_eq!(l.limit(Bounds { min: 12, max: 14 }), 12);
    }

    #[test]
    fn reasons_read_as_words() {
        let s = |from, to, why| Step { from, to, why }.describe();
        assert_eq!(
            s(12, 9, Why::Congested { ratio: 2.08 }),
            "hold time 2.1x baseline: 12 -> 9"
        );
        assert_eq!(
            s(
                8,
                9,
                Why::Grew {
                    used: 8.0,
                    ratio: 1.0
                }
            ),
            "used 8 of 8, hold time 1.0x baseline: 8 -> 9"
        );
        assert_eq!(s(3, 3, Why::Kept), "kept: 3");
    }
}
