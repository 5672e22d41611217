//! How long a call may wait for its slots, from the `interval` SQL passes, and intervals as
//! microseconds (a lease's ttl, a renewal).

use std::time::Duration;

/// How long a call may wait for its slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Not at all: a plain try.
    No,
    For(Duration),
    /// `'infinity'` (PostgreSQL 17+): until a slot frees or the statement is cancelled.
    Forever,
}

impl Wait {
    /// From an interval's months, days and microseconds: None when negative.
    pub fn from_interval(months: i32, days: i32, micros: i64) -> Option<Wait> {
        if months == i32::MAX && days == i32::MAX && micros == i64::MAX {
            return Some(Wait::Forever);
        }
        match interval_micros(months, days, micros) {
            ..0 => None,
            0 => Some(Wait::No),
            us => Some(Wait::For(Duration::from_micros(
                us.min(u64::MAX as i128) as u64
            ))),
        }
    }
}

/// An interval's months, days and microseconds as microseconds (a month as 30 days, as
/// PostgreSQL's interval arithmetic does), without overflow.
pub fn interval_micros(months: i32, days: i32, micros: i64) -> i128 {
    micros as i128 + days as i128 * 86_400_000_000 + months as i128 * 2_592_000_000_000
}

/// The same, saturated to an i64: `'infinity'` is a very long time.
pub fn interval_micros_saturating(months: i32, days: i32, micros: i64) -> i64 {
    interval_micros(months, days, micros).clamp(i64::MIN as i128, i64::MAX as i128) as i64
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn intervals_become_waits() {
        assert_eq!(Wait::from_interval(0, 0, 0), Some(Wait::No));
        assert_eq!(
            Wait::from_interval(0, 0, 1_500_000),
            Some(Wait::For(Duration::from_millis(1500)))
        );
        assert_eq!(
            Wait::from_interval(0, 1, -3_600_000_000),
            Some(Wait::For(Duration::from_secs(23 * 3600)))
        );
        assert_eq!(Wait::from_interval(0, 0, -1), None);
        assert_eq!(Wait::from_interval(-1, 0, 0), None);
        assert_eq!(
            Wait::from_interval(i32::MAX, i32::MAX, i64::MAX),
            Some(Wait::Forever)
        );
    }

    #[test]
    fn intervals_saturate_as_micros() {
        assert_eq!(interval_micros_saturating(0, 0, 5), 5);
        assert_eq!(interval_micros_saturating(1, 1, 0), 2_678_400_000_000);
        assert_eq!(
            interval_micros_saturating(i32::MAX, i32::MAX, i64::MAX),
            i64::MAX
        );
        assert_eq!(
            interval_micros_saturating(i32::MIN, i32::MIN, i64::MIN),
            i64::MIN
        );
    }
}
