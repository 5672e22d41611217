//! Counter values as plain numbers: arithmetic for pending deltas, and the text format in which
//! pending counts survive a clean restart. Plain Rust, unit-tested without a server.

use crate::histogram::HistValues;
use serde::Serialize;

/// The counters, in the order of every table and function that shows them, with the SQL type
/// each is shown as: the one list in Rust. `for_each_counter!(m, rest…)` calls
/// `m!([name: type, …] rest…)`; [`CounterValues`] and the SQL functions' result columns (`api`)
/// are made from it. (SQL names them in `sql/`.) Times are counted in microseconds and shown
/// as `interval`. Versions before 0.3.0 had the first [`COUNT_0_2_0`] only, 0.3.0 the first
/// [`COUNT_0_3_0`], 0.4.0 to 0.9.0 the first [`COUNT_0_9_0`].
#[macro_export]
macro_rules! for_each_counter {
    ($m:ident $(, $($rest:tt)*)?) => {
        $m! {
            [
                acquired: i64,
                throttled: i64,
                released: i64,
                foreign_releases: i64,
                released_by_exit: i64,
                waits: i64,
                wait_timeouts: i64,
                wait_time: Interval,
                hold_time: Interval,
                expired: i64,
                rate_limited: i64
            ]
            $($($rest)*)?
        }
    };
}

/// The counters of 0.4.0's to 0.9.0's functions (all but `rate_limited`), which databases at
/// those versions call until they update (`compat`).
#[macro_export]
macro_rules! for_each_counter_0_9_0 {
    ($m:ident $(, $($rest:tt)*)?) => {
        $m! {
            [
                acquired: i64,
                throttled: i64,
                released: i64,
                foreign_releases: i64,
                released_by_exit: i64,
                waits: i64,
                wait_timeouts: i64,
                wait_time: Interval,
                hold_time: Interval,
                expired: i64
            ]
            $($($rest)*)?
        }
    };
}

/// The counters of 0.3.0's functions (all but `expired`), which databases at 0.3.0 call until
/// they update (`compat`).
#[macro_export]
macro_rules! for_each_counter_0_3_0 {
    ($m:ident $(, $($rest:tt)*)?) => {
        $m! {
            [
                acquired: i64,
                throttled: i64,
                released: i64,
                foreign_releases: i64,
                released_by_exit: i64,
                waits: i64,
                wait_timeouts: i64,
                wait_time: Interval,
                hold_time: Interval
            ]
            $($($rest)*)?
        }
    };
}

/// The counters of 0.1.0's and 0.2.0's functions (the first five), likewise.
#[macro_export]
macro_rules! for_each_counter_0_2_0 {
    ($m:ident $(, $($rest:tt)*)?) => {
        $m! {
            [
                acquired: i64,
                throttled: i64,
                released: i64,
                foreign_releases: i64,
                released_by_exit: i64
            ]
            $($($rest)*)?
        }
    };
}

/// Counters of the 0.1.0 and 0.2.0 tables and functions (the first ones of the list).
pub const COUNT_0_2_0: usize = 5;

/// Counters of the 0.3.0 table and functions (0.4.0 added `expired`).
pub const COUNT_0_3_0: usize = 9;

/// Counters of the 0.4.0 to 0.9.0 tables and functions (0.10.0 added `rate_limited`).
pub const COUNT_0_9_0: usize = 10;

macro_rules! counters {
    ([$($name:ident: $ty:tt),*]) => {
        /// How many counters there are.
        pub const COUNT: usize = [$(stringify!($name)),*].len();

        /// One value per counter of `stage_e_stats()`, in that order.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
        pub struct CounterValues {
            $(pub $name: u64,)*
        }

        impl CounterValues {
            pub const NAMES: [&'static str; COUNT] = [$(stringify!($name)),*];

            pub fn to_array(self) -> [u64; COUNT] {
                [$(self.$name),*]
            }

            pub fn from_array(a: [u64; COUNT]) -> Self {
                let mut it = a.into_iter();
                CounterValues { $($name: it.next().unwrap_or_default(),)* }
            }

            /// Whether counter `i` is a time (microseconds here, `interval` in SQL).
            pub fn is_time(i: usize) -> bool {
                [$(stringify!($ty) == "Interval"),*][i]
            }
        }
    };
}

for_each_counter!(counters);

/// The names of a counter list, for the checks below.
macro_rules! names_of {
    ([$($name:ident: $ty:tt),*] $const_name:ident) => {
        const $const_name: &[&str] = &[$(stringify!($name)),*];
    };
}
for_each_counter_0_2_0!(names_of, NAMES_0_2_0);
for_each_counter_0_3_0!(names_of, NAMES_0_3_0);
for_each_counter_0_9_0!(names_of, NAMES_0_9_0);

const fn same_str(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Whether `old` is the first `len` counters of the list.
const fn is_prefix(old: &[&str], len: usize) -> bool {
    if old.len() != len {
        return false;
    }
    let mut i = 0;
    while i < len {
        if !same_str(old[i], CounterValues::NAMES[i]) {
            return false;
        }
        i += 1;
    }
    true
}

// Earlier versions' lists are the first counters of today's, in the same order.
const _: () = assert!(is_prefix(NAMES_0_2_0, COUNT_0_2_0));
const _: () = assert!(is_prefix(NAMES_0_3_0, COUNT_0_3_0));
const _: () = assert!(is_prefix(NAMES_0_9_0, COUNT_0_9_0));

/// Makes [`Counter`] from its variants, with their names as strings for the check below.
macro_rules! counter_enum {
    ($($(#[$doc:meta])* $v:ident),* $(,)?) => {
        /// Which counter to bump: one variant per entry of [`for_each_counter!`], in its order.
        /// The assertion below ties the two at compile time (same count, and each variant is
        /// its counter's name in CamelCase), so a counter added to the list and not here, or
        /// here in another place, does not build.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Counter {
            $($(#[$doc])* $v,)*
        }

        impl Counter {
            /// Every counter, in list order.
            pub const ALL: [Counter; COUNT] = [$(Counter::$v),*];
            const VARIANTS: [&'static str; COUNT] = [$(stringify!($v)),*];
        }
    };
}

counter_enum!(
    Acquired,
    Throttled,
    Released,
    ForeignReleases,
    ReleasedByExit,
    Waits,
    WaitTimeouts,
    /// Microseconds.
    WaitTime,
    /// Microseconds.
    HoldTime,
    Expired,
    /// Throttled by a cap's rate policy (counted in `Throttled` too).
    RateLimited,
);

impl Counter {
    /// The counter's column name.
    pub const fn name(self) -> &'static str {
        CounterValues::NAMES[self as usize]
    }
}

/// Whether `camel` is `snake` in CamelCase (`ForeignReleases` / `foreign_releases`).
const fn camel_is_snake(camel: &str, snake: &str) -> bool {
    let (c, s) = (camel.as_bytes(), snake.as_bytes());
    let (mut i, mut j, mut upper) = (0, 0, true);
    while i < c.len() && j < s.len() {
        if s[j] == b'_' {
            upper = true;
            j += 1;
            continue;
        }
        let want = if upper {
            s[j].to_ascii_uppercase()
        } else {
            s[j]
        };
        if c[i] != want {
            return false;
        }
        upper = false;
        i += 1;
        j += 1;
    }
    i == c.len() && j == s.len()
}

const _: () = {
    let mut i = 0;
    while i < COUNT {
        assert!(Counter::ALL[i] as usize == i);
        assert!(camel_is_snake(
            Counter::VARIANTS[i],
            CounterValues::NAMES[i]
        ));
        i += 1;
    }
};

impl CounterValues {
    fn zip(self, other: Self, f: impl Fn(u64, u64) -> u64) -> Self {
        let (a, b) = (self.to_array(), other.to_array());
        Self::from_array(std::array::from_fn(|i| f(a[i], b[i])))
    }

    pub fn plus(self, other: Self) -> Self {
        self.zip(other, u64::wrapping_add)
    }

    /// `self - other`, wrapping: the counters are monotonic, so a later snapshot minus an
    /// earlier one is the exact delta even across a (theoretical) u64 wrap.
    pub fn minus(self, other: Self) -> Self {
        self.zip(other, u64::wrapping_sub)
    }

    pub fn is_zero(self) -> bool {
        self == Self::default()
    }
}

/// The flush bookkeeping of one cap, read consistently (by the extension's flush seqlock).
///
/// A flush in progress has `inflight_id` (its id) and `inflight` (the delta it writes). Once
/// its transaction commits and the cap advances, `inflight_id` is 0 and `settled_id` is its id,
/// with `inflight` still its delta, until the next flush of the cap starts.
pub struct FlushState {
    pub counters: CounterValues,
    pub carried: CounterValues,
    pub flushed: CounterValues,
    pub inflight: CounterValues,
    pub inflight_id: u64,
    pub settled_id: u64,
    /// The histograms' counts, and their value at the last committed flush less what was
    /// carried (`hist_base`): what is pending of them is the difference. Only the flusher
    /// writes `hist_base`, and no reader adds them to rows, so they need no in-flight delta.
    pub hist: HistValues,
    pub hist_base: HistValues,
}

impl FlushState {
    /// Counts not yet in the table, for a reader whose snapshot's newest row has flush id
    /// `row_flush_id` (None: a reader of shared memory alone). A reader that already sees the
    /// in-flight flush's row (committed, the cap not yet advanced) must not count that delta
    /// twice; one whose snapshot was taken before the last settled flush committed does not
    /// see that flush's rows, so the delta the cap has since moved out of its pending counts is
    /// still pending for it. Either way a single statement that reads the rows and then the
    /// pending counts, while a flush commits, sees each count exactly once.
    pub fn pending(&self, row_flush_id: Option<u64>) -> CounterValues {
        let read = crate::flush::BookRead {
            counters: self.counters.to_array(),
            carried: self.carried.to_array(),
            flushed: self.flushed.to_array(),
            inflight: self.inflight.to_array(),
            inflight_id: self.inflight_id,
            settled_id: self.settled_id,
        };
        CounterValues::from_array(read.pending(row_flush_id))
    }

    /// The histogram counts not yet in the table.
    pub fn pending_hist(&self) -> HistValues {
        self.hist.minus(self.hist_base)
    }
}

/// Pending counts of one cap, as written at a clean shutdown and read at the next start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Carried {
    pub database: u32,
    pub cap: String,
    /// The cap's lock key (None in a file written before 0.7.0: the name's first key).
    pub key: Option<i32>,
    pub values: CounterValues,
    /// The histograms' pending counts (zeros in a file written before 0.8.0).
    pub hist: HistValues,
}

impl Carried {
    pub fn is_zero(&self) -> bool {
        self.values.is_zero() && self.hist.is_zero()
    }
}

/// `more` added into `into`: one entry per (database, cap), the counts of both summed, in the
/// order first seen. The pending file written at a shutdown is the live caps' counts merged with
/// those a smaller `max_caps` kept out of shared memory at the start before (still in the file).
pub fn merge(mut into: Vec<Carried>, more: Vec<Carried>) -> Vec<Carried> {
    let mut at: std::collections::HashMap<(u32, String), usize> = into
        .iter()
        .enumerate()
        .map(|(i, c)| ((c.database, c.cap.clone()), i))
        .collect();
    for c in more {
        match at.get(&(c.database, c.cap.clone())) {
            Some(&i) => {
                into[i].values = into[i].values.plus(c.values);
                into[i].hist = into[i].hist.plus(c.hist);
            }
            None => {
                at.insert((c.database, c.cap.clone()), into.len());
                into.push(c);
            }
        }
    }
    into
}

const FILE_HEADER_V1: &str = "stage_e_slots pending counters v1";
const FILE_HEADER_V2: &str = "stage_e_slots pending counters v2";
const FILE_HEADER_V3: &str = "stage_e_slots pending counters v3";
const FILE_HEADER: &str = "stage_e_slots pending counters v4";

/// One line per cap: database OID, the cap name in hex (names may hold any character), its
/// lock key (`-` if unknown), the counters in `NAMES` order, `|`, then the histograms' counts.
pub fn encode(pending: &[Carried]) -> String {
    let mut out = format!("{FILE_HEADER}\n");
    for c in pending {
        let hex: String = c.cap.bytes().map(|b| format!("{b:02x}")).collect();
        let key = c.key.map_or("-".to_string(), |k| k.to_string());
        let nums: Vec<String> = c.values.to_array().iter().map(u64::to_string).collect();
        let hist: Vec<String> = c.hist.0.iter().map(u64::to_string).collect();
        out.push_str(&format!(
            "{} {hex} {key} {} | {}\n",
            c.database,
            nums.join(" "),
            hist.join(" ")
        ));
    }
    out
}

/// Parses [`encode`]'s output, the v3 file of 0.7.0 (no histograms), the v2 file of 0.2.0 to
/// 0.6.0 (no key either), or the v1 file of
/// 0.1.0 (one line per database, which had the `default` cap only); None if the file is in
/// none of these formats (it is then ignored, as pg_stat_statements ignores a dump file of
/// another version).
pub fn decode(text: &str) -> Option<Vec<Carried>> {
    let mut lines = text.lines();
    let (v1, keyed, with_hist) = match lines.next()? {
        FILE_HEADER => (false, true, true),
        FILE_HEADER_V3 => (false, true, false),
        FILE_HEADER_V2 => (false, false, false),
        FILE_HEADER_V1 => (true, false, false),
        _ => return None,
    };
    lines
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (l, hist) = match (with_hist, l.split_once(" | ")) {
                (true, Some((counts, hist))) => (counts, Some(hist)),
                (true, None) => return None,
                (false, _) => (l, None),
            };
            let hist = match hist {
                None => HistValues::default(),
                Some(h) => {
                    let nums: Vec<u64> = h
                        .split_whitespace()
                        .map(|w| w.parse().ok())
                        .collect::<Option<_>>()?;
                    HistValues(nums.try_into().ok()?)
                }
            };
            let mut words = l.split_whitespace();
            let database = words.next()?.parse().ok()?;
            let cap = if v1 {
                crate::directory::DEFAULT_CAP.to_string()
            } else {
                let hex = words.next()?;
                let bytes: Option<Vec<u8>> = (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
                    .collect();
                String::from_utf8(bytes?).ok()?
            };
            let key = match keyed {
                false => None,
                true => match words.next()? {
                    "-" => None,
                    k => Some(k.parse().ok()?),
                },
            };
            // Files of earlier versions have fewer counters: the later ones start at zero.
            let nums: Vec<u64> = words.map(|w| w.parse().ok()).collect::<Option<_>>()?;
            if nums.len() < COUNT_0_2_0 || nums.len() > COUNT {
                return None;
            }
            let mut a = [0u64; COUNT];
            a[..nums.len()].copy_from_slice(&nums);
            let values = CounterValues::from_array(a);
            Some(Carried {
                database,
                cap,
                key,
                values,
                hist,
            })
        })
        .collect()
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn merging_pending_counts_sums_each_cap_once() {
        let c = |database, cap: &str, first| {
            let mut a = [0; COUNT];
            a[0] = first;
            Carried {
                database,
                cap: cap.into(),
                key: None,
                values: CounterValues::from_array(a),
                hist: HistValues([first; crate::histogram::VALUES]),
            }
        };
        let merged = merge(
            vec![c(1, "a", 2), c(1, "b", 3)],
            vec![c(1, "b", 4), c(2, "a", 5), c(1, "c", 6)],
        );
        assert_eq!(
            merged,
            vec![c(1, "a", 2), c(1, "b", 7), c(2, "a", 5), c(1, "c", 6)]
        );
        assert_eq!(merge(Vec::new(), vec![c(1, "a", 1)]), vec![c(1, "a", 1)]);
    }

    #[test]
    fn the_counter_enum_follows_the_list() {
        assert!(camel_is_snake("ForeignReleases", "foreign_releases"));
        assert!(camel_is_snake("Expired", "expired"));
        assert!(!camel_is_snake("WaitTime", "wait_timeouts"));
        assert!(!camel_is_snake("Waits", "wait"));
        for (i, c) in Counter::ALL.iter().enumerate() {
            assert_eq!(c.name(), CounterValues::NAMES[i]);
        }
        assert!(is_prefix(NAMES_0_2_0, COUNT_0_2_0) && !is_prefix(NAMES_0_2_0, COUNT_0_3_0));
        assert!(!is_prefix(&["acquired", "released"], 2), "order counts");
    }

    fn v(n: u64) -> CounterValues {
        CounterValues::from_array(std::array::from_fn(|i| n + i as u64))
    }

    #[test]
    fn plus_minus_round_trip() {
        assert_eq!(v(10).plus(v(5)).minus(v(5)), v(10));
        assert_eq!(v(7).minus(v(7)), CounterValues::default());
        assert!(v(7).minus(v(7)).is_zero());
        // Monotonic counters: a delta across a wrap is still exact.
        let before = CounterValues::from_array([u64::MAX; COUNT]);
        let after = before.plus(CounterValues::from_array([3; COUNT]));
        assert_eq!(after.minus(before), CounterValues::from_array([3; COUNT]));
    }

    #[test]
    fn file_round_trip() {
        let pending = vec![
            Carried {
                database: 16384,
                cap: "default".into(),
                key: Some(-7),
                values: v(1),
                hist: HistValues(std::array::from_fn(|i| i as u64 * 3)),
            },
            Carried {
                database: 4_000_000_000,
                cap: "tenant 7\nwith spaces, é".into(),
                key: None,
                values: v(u64::MAX - 10),
                hist: HistValues::default(),
            },
        ];
        assert_eq!(decode(&encode(&pending)), Some(pending));
        assert_eq!(decode(&encode(&[])), Some(vec![]));
    }

    #[test]
    fn reads_the_file_of_0_7_0_without_histograms() {
        let text = format!("{FILE_HEADER_V3}\n16384 6162 -5 1 2 3 4 5 6 7 8 9 10\n");
        let got = decode(&text).expect("a v3 file");
        assert_eq!((got[0].cap.as_str(), got[0].key), ("ab", Some(-5)));
        assert_eq!(got[0].values.expired, 10);
        assert!(got[0].hist.is_zero());
        // A v4 line without its histograms, or with too few of them, is damaged.
        assert_eq!(
            decode(&format!("{FILE_HEADER}\n16384 6162 -5 1 2 3\n")),
            None
        );
        assert_eq!(
            decode(&format!("{FILE_HEADER}\n16384 6162 -5 1 2 3 | 1 2\n")),
            None
        );
    }

    #[test]
    fn reads_the_keyless_file_of_0_6_0() {
        let text = format!("{FILE_HEADER_V2}\n16384 6162 1 2 3 4 5\n");
        let got = decode(&text).expect("a v2 file");
        assert_eq!((got[0].cap.as_str(), got[0].key), ("ab", None));
        assert_eq!(got[0].values.released_by_exit, 5);
        // A v3 line without its key is damaged, not a v2 line.
        assert_eq!(decode(&format!("{FILE_HEADER_V3}\n16384 6162\n")), None);
        assert_eq!(
            decode(&format!("{FILE_HEADER_V3}\n16384 6162 x 1 2 3 4 5\n")),
            None
        );
    }

    #[test]
    fn reads_the_file_of_0_1_0_as_the_default_cap() {
        let text = format!("{FILE_HEADER_V1}\n16384 1 2 3 4 5\n");
        assert_eq!(
            decode(&text),
            Some(vec![Carried {
                database: 16384,
                cap: "default".into(),
                key: None,
                values: CounterValues {
                    acquired: 1,
                    throttled: 2,
                    released: 3,
                    foreign_releases: 4,
                    released_by_exit: 5,
                    ..Default::default()
                },
                hist: HistValues::default(),
            }])
        );
    }

    #[test]
    fn foreign_or_damaged_files_are_rejected() {
        assert_eq!(decode(""), None);
        assert_eq!(decode("some other file\n1 2 3 4 5 6\n"), None);
        assert_eq!(decode(&format!("{FILE_HEADER}\n1 61 3\n")), None);
        assert_eq!(decode(&format!("{FILE_HEADER}\n1 61 2 3 4 5 x\n")), None);
        assert_eq!(decode(&format!("{FILE_HEADER}\n-1 61 2 3 4 5 6\n")), None);
        assert_eq!(decode(&format!("{FILE_HEADER}\n1 6 2 3 4 5 6\n")), None);
        assert_eq!(decode(&format!("{FILE_HEADER}\n1 ff 2 3 4 5 6\n")), None);
    }

    fn state(counters: u64, flushed: u64, inflight: u64, inflight_id: u64) -> FlushState {
        FlushState {
            counters: v(counters),
            carried: v(1000),
            flushed: v(flushed),
            inflight: if inflight_id == 0 {
                CounterValues::default()
            } else {
                v(inflight)
            },
            inflight_id,
            settled_id: 0,
            hist: HistValues([9; crate::histogram::VALUES]),
            hist_base: HistValues([4; crate::histogram::VALUES]),
        }
    }

    #[test]
    fn pending_histograms_are_the_counts_less_their_base() {
        let s = state(50, 20, 0, 0);
        assert_eq!(s.pending_hist(), HistValues([5; crate::histogram::VALUES]));
    }

    #[test]
    fn pending_is_carried_plus_counted_minus_flushed() {
        let s = state(50, 20, 0, 0);
        assert_eq!(s.pending(None), v(1000).plus(v(50)).minus(v(20)));
        assert_eq!(s.pending(Some(0)), s.pending(None));
    }

    #[test]
    fn a_reader_that_sees_the_inflight_flush_does_not_count_it_twice() {
        // A flush with id 7 wrote `inflight` into the row; the cap has not advanced yet.
        let s = state(50, 20, 30, 7);
        let all = v(1000).plus(v(50)).minus(v(20));
        // A reader whose row carries flush id 7 already has those 30 in the row.
        assert_eq!(s.pending(Some(7)), all.minus(v(30)));
        // A reader of the older row (or none) has not: they are still pending for it.
        assert_eq!(s.pending(Some(6)), all);
        assert_eq!(s.pending(None), all);
    }

    #[test]
    fn a_reader_whose_snapshot_predates_the_settled_flush_still_counts_its_delta() {
        // Flush 7 wrote 30 into the rows, committed, and the cap advanced: flushed is 20 + 30.
        let mut s = state(50, 0, 0, 0);
        s.flushed = v(20).plus(v(30));
        s.inflight = v(30);
        s.settled_id = 7;
        let after = v(1000).plus(v(50)).minus(s.flushed);
        // A reader that sees the rows of flush 7 (or of a later one): the 30 are in its rows.
        assert_eq!(s.pending(Some(7)), after);
        assert_eq!(s.pending(Some(9)), after);
        // A reader whose snapshot is older (newest visible row from flush 6): the 30 are in no
        // row it sees, so they are still pending for it, as before the flush.
        assert_eq!(s.pending(Some(6)), after.plus(v(30)));
        assert_eq!(s.pending(Some(6)), state(50, 20, 0, 0).pending(None));
        // Shared memory alone (stage_e_pending() with no row id): only what no row holds.
        assert_eq!(s.pending(None), after);
    }

    #[test]
    fn names_follow_array_order() {
        let v = CounterValues {
            throttled: 9,
            ..Default::default()
        };
        let i = CounterValues::NAMES
            .iter()
            .position(|n| *n == "throttled")
            .unwrap();
        assert_eq!(v.to_array()[i], 9);
    }
}
