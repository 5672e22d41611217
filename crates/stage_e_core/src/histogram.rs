//! Hold and wait histograms as plain numbers: fixed log-spaced buckets, the bucket of a
//! duration, the cumulative shape Prometheus reads, and quantiles computed as PromQL's
//! `histogram_quantile` computes them.
//!
//! A cap counts, per metric ([`Metric`]), how many durations fell in each bucket: twelve with
//! upper bounds 1 ms × 4^i (1 ms to 4,194 s, about 70 minutes) and one above them all. Four per
//! step keeps a cap's histograms within its memory budget (two metrics × 13 buckets × 8 bytes,
//! plus their flush bookkeeping: 416 bytes) while spanning a millisecond to an hour; a quantile
//! is exact to within its bucket (a factor of four), as any fixed-bucket histogram is. The
//! sums are the `hold_time` and `wait_time` counters, observed at the same moments.

/// Finite upper bounds.
pub const BOUNDS: usize = 12;
/// Buckets per metric: one per bound, and one above the last.
pub const BUCKETS: usize = BOUNDS + 1;
/// Values of a cap's histograms: every bucket of every metric.
pub const VALUES: usize = Metric::ALL.len() * BUCKETS;

/// Upper bounds in microseconds: 1 ms × 4^i. A duration equal to a bound falls in its bucket
/// (Prometheus's `le`, less than or equal).
pub const BOUNDS_US: [u64; BOUNDS] = {
    let mut b = [0u64; BOUNDS];
    let mut i = 0;
    while i < BOUNDS {
        b[i] = 1_000 << (2 * i);
        i += 1;
    }
    b
};

/// What a histogram measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// Acquire to release of a slot or a lease (or the lease's expiry), both kinds.
    Hold,
    /// A waiting acquisition, from joining the queue to being served or timing out.
    Wait,
}

impl Metric {
    pub const ALL: [Metric; 2] = [Metric::Hold, Metric::Wait];

    /// As `stage_e_histograms()` names it.
    pub const fn name(self) -> &'static str {
        match self {
            Metric::Hold => "hold",
            Metric::Wait => "wait",
        }
    }
}

/// The bucket of a duration of `us` microseconds: the first whose bound is at least `us`, or
/// [`BOUNDS`] (the one above them all).
pub fn bucket_of(us: u64) -> usize {
    BOUNDS_US.partition_point(|&bound| bound < us)
}

/// Where the count of `metric`'s bucket for `us` is among a cap's [`VALUES`].
pub fn index(metric: Metric, us: u64) -> usize {
    metric as usize * BUCKETS + bucket_of(us)
}

/// A cap's histogram counts, every metric's buckets in [`Metric::ALL`] order (not cumulative).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistValues(pub [u64; VALUES]);

impl Default for HistValues {
    fn default() -> Self {
        HistValues([0; VALUES])
    }
}

impl HistValues {
    fn zip(self, other: Self, f: impl Fn(u64, u64) -> u64) -> Self {
        HistValues(std::array::from_fn(|i| f(self.0[i], other.0[i])))
    }

    pub fn plus(self, other: Self) -> Self {
        self.zip(other, u64::wrapping_add)
    }

    pub fn minus(self, other: Self) -> Self {
        self.zip(other, u64::wrapping_sub)
    }

    pub fn is_zero(&self) -> bool {
        self.0.iter().all(|&v| v == 0)
    }

    /// `metric`'s counts per bucket.
    pub fn of(&self, metric: Metric) -> [u64; BUCKETS] {
        let at = metric as usize * BUCKETS;
        std::array::from_fn(|i| self.0[at + i])
    }

    /// `metric` as Prometheus reads a histogram: the count at or below each bound, and the count
    /// of every observation.
    pub fn cumulative(&self, metric: Metric) -> ([u64; BOUNDS], u64) {
        let buckets = self.of(metric);
        let mut below = [0u64; BOUNDS];
        let mut sum = 0u64;
        for (i, b) in buckets.iter().enumerate() {
            sum = sum.wrapping_add(*b);
            if i < BOUNDS {
                below[i] = sum;
            }
        }
        (below, sum)
    }
}

/// The bounds in seconds, as `stage_e_histograms()` shows them.
pub fn bounds_seconds() -> [f64; BOUNDS] {
    BOUNDS_US.map(|us| us as f64 / 1e6)
}

/// The `q` quantile (0 to 1) of a metric's counts per bucket, in seconds, as PromQL's
/// `histogram_quantile` computes it: linear within the bucket the rank falls in, from 0 for the
/// first; the last finite bound when it falls above them all. None without observations.
pub fn quantile(q: f64, buckets: &[u64; BUCKETS]) -> Option<f64> {
    let count: u64 = buckets.iter().sum();
    if count == 0 || !(0.0..=1.0).contains(&q) {
        return None;
    }
    let rank = q * count as f64;
    let mut below = 0u64;
    for (i, &in_bucket) in buckets.iter().enumerate() {
        let through = below + in_bucket;
        if through as f64 >= rank && in_bucket > 0 {
            if i == BOUNDS {
                break; // above every bound: the last bound, as Prometheus answers
            }
            let lower = if i == 0 { 0.0 } else { BOUNDS_US[i - 1] as f64 };
            let upper = BOUNDS_US[i] as f64;
            let within = (rank - below as f64) / in_bucket as f64;
            return Some((lower + (upper - lower) * within) / 1e6);
        }
        below = through;
    }
    Some(BOUNDS_US[BOUNDS - 1] as f64 / 1e6)
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn bounds_are_a_millisecond_times_powers_of_four_up_to_about_an_hour() {
        assert_eq!(BOUNDS_US[0], 1_000);
        assert_eq!(BOUNDS_US[1], 4_000);
        assert_eq!(BOUNDS_US[BOUNDS - 1], 4_194_304_000);
        assert!(BOUNDS_US.windows(2).all(|w| w[1] == 4 * w[0]));
        assert_eq!(bounds_seconds()[5], 1.024);
    }

    #[test]
    fn a_duration_falls_in_the_first_bucket_whose_bound_is_at_least_it() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(1_000), 0, "a bound is in its own bucket (le)");
        assert_eq!(bucket_of(1_001), 1);
        assert_eq!(bucket_of(4_000), 1);
        assert_eq!(bucket_of(4_194_304_000), BOUNDS - 1);
        assert_eq!(bucket_of(4_194_304_001), BOUNDS);
        assert_eq!(bucket_of(u64::MAX), BOUNDS);
        assert_eq!(index(Metric::Hold, 2_000), 1);
        assert_eq!(index(Metric::Wait, 2_000), BUCKETS + 1);
        assert_eq!(index(Metric::Wait, u64::MAX), VALUES - 1);
    }

    #[test]
    fn cumulative_counts_end_below_the_total_when_some_fall_above_every_bound() {
        let mut v = HistValues::default();
        v.0[index(Metric::Wait, 500)] += 2;
        v.0[index(Metric::Wait, 3_000)] += 1;
        v.0[index(Metric::Wait, u64::MAX)] += 4;
        v.0[index(Metric::Hold, 3_000)] += 9;
        let (below, count) = v.cumulative(Metric::Wait);
        assert_eq!(&below[..3], &[2, 3, 3]);
        assert_eq!(below[BOUNDS - 1], 3);
        assert_eq!(count, 7);
        assert_eq!(v.cumulative(Metric::Hold).1, 9);
        let d = v.plus(v).minus(v);
        assert_eq!(d, v);
        assert!(v.minus(v).is_zero());
    }

    #[test]
    fn quantiles_interpolate_within_the_bucket_as_histogram_quantile_does() {
        let mut b = [0u64; BUCKETS];
        assert_eq!(quantile(0.5, &b), None);
        // 10 in (1 ms, 4 ms]: the median is halfway, 2.5 ms.
        b[1] = 10;
        assert!((quantile(0.5, &b).unwrap() - 0.0025).abs() < 1e-12);
        assert!((quantile(1.0, &b).unwrap() - 0.004).abs() < 1e-12);
        // 10 at or below 1 ms as well: the median is the first bucket's top.
        b[0] = 10;
        assert!((quantile(0.5, &b).unwrap() - 0.001).abs() < 1e-12);
        assert!((quantile(0.25, &b).unwrap() - 0.0005).abs() < 1e-12);
        // Most above every bound: the last bound.
        b[BOUNDS] = 100;
        assert_eq!(quantile(0.99, &b), Some(4194.304));
        assert_eq!(quantile(1.5, &b), None);
    }
}
