//! The SQL schema versions this library serves. A database keeps the objects of the version it
//! was created or last updated at until `ALTER EXTENSION stage_e_slots UPDATE`, and the library
//! answers each as that version did: what each version's objects have is decided here, once.

/// A version of the extension's SQL objects, oldest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SchemaVersion {
    /// One anonymous cap (`default`) and a one-row counter table.
    V0_1_0,
    /// Named caps: one counter row per cap, five counters.
    V0_2_0,
    /// Waiting: nine counters (waits, timeouts, wait and hold time).
    V0_3_0,
    /// Leases and fencing tokens: the `expired` counter, holders with token and expiry.
    V0_4_0,
    /// Every call resolves with untyped parameters: `stage_e_try_slot(n, wait)` retired.
    V0_5_0,
    /// Restarts, crashes and failovers: the `stage_e_lease_horizon` table, `stage_e_held_back`.
    V0_6_0,
    /// Cap names never refused for a colliding lock key: each counter row records its cap's key
    /// (`lock_key`), and `stage_e_cap_key` reads it.
    V0_7_0,
    /// Metrics: hold and wait histograms (`stage_e_histograms`, kept in the counter rows'
    /// `hold_buckets` and `wait_buckets`), the cap's current n in `stage_e_stats`.
    V0_8_0,
    /// Adaptive caps: `stage_e_adapt`, `stage_e_adapt_off`, `stage_e_cap_limits`; the policy and
    /// the learned limit in the counter rows (`adapt_*`).
    V0_9_0,
    /// Rate limits: `stage_e_try_rate`, `stage_e_rate_limit`, the `rate_limited` counter.
    V0_10_0,
    /// Fair shares: the `share` argument of the waiting acquisitions, `stage_e_share` and its
    /// table `stage_e_share_policy`, the view `stage_e_shares`, `share` in the holders' and
    /// waiters' views.
    V0_11_0,
}

impl SchemaVersion {
    /// The version of this library's own install script.
    pub const CURRENT: SchemaVersion = SchemaVersion::V0_11_0;

    pub const ALL: [SchemaVersion; 11] = [
        SchemaVersion::V0_1_0,
        SchemaVersion::V0_2_0,
        SchemaVersion::V0_3_0,
        SchemaVersion::V0_4_0,
        SchemaVersion::V0_5_0,
        SchemaVersion::V0_6_0,
        SchemaVersion::V0_7_0,
        SchemaVersion::V0_8_0,
        SchemaVersion::V0_9_0,
        SchemaVersion::V0_10_0,
        SchemaVersion::V0_11_0,
    ];

    /// `pg_extension.extversion` as a version; None for one this library does not know.
    pub fn parse(extversion: &str) -> Option<SchemaVersion> {
        Self::ALL.into_iter().find(|v| v.as_str() == extversion)
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            SchemaVersion::V0_1_0 => "0.1.0",
            SchemaVersion::V0_2_0 => "0.2.0",
            SchemaVersion::V0_3_0 => "0.3.0",
            SchemaVersion::V0_4_0 => "0.4.0",
            SchemaVersion::V0_5_0 => "0.5.0",
            SchemaVersion::V0_6_0 => "0.6.0",
            SchemaVersion::V0_7_0 => "0.7.0",
            SchemaVersion::V0_8_0 => "0.8.0",
            SchemaVersion::V0_9_0 => "0.9.0",
            SchemaVersion::V0_10_0 => "0.10.0",
            SchemaVersion::V0_11_0 => "0.11.0",
        }
    }

    /// Whether caps have names (one counter row each); 0.1.0 had the `default` cap only.
    pub fn has_named_caps(self) -> bool {
        self >= SchemaVersion::V0_2_0
    }

    /// Whether the holders view shows leases (`token`, `expires_at`).
    pub fn has_leases(self) -> bool {
        self >= SchemaVersion::V0_4_0
    }

    /// Whether the database keeps a durable lease horizon and token floor per cap
    /// (`stage_e_lease_horizon`): before 0.6.0 a crash or a failover frees its leases.
    pub fn has_lease_horizon(self) -> bool {
        self >= SchemaVersion::V0_6_0
    }

    /// Whether counter rows record their cap's lock key (`lock_key`), so that a name whose key
    /// collides with another's gets a key of its own, kept for the life of its row. Before
    /// 0.7.0 the name made second was refused (42710) while the other was in use.
    pub fn has_key_records(self) -> bool {
        self >= SchemaVersion::V0_7_0
    }

    /// Whether counter rows keep the hold and wait histograms (`hold_buckets`, `wait_buckets`).
    pub fn has_histograms(self) -> bool {
        self >= SchemaVersion::V0_8_0
    }

    /// Adaptive caps: `stage_e_adapt`, the policy and learned limit in the counter rows
    /// (`adapt_*`), `stage_e_cap_limits`.
    pub fn has_adaptive(self) -> bool {
        self >= SchemaVersion::V0_9_0
    }

    /// Rate limits: `stage_e_try_rate`.
    pub fn has_rates(self) -> bool {
        self >= SchemaVersion::V0_10_0
    }

    /// Fair shares: `stage_e_share`, its policies in `stage_e_share_policy`.
    pub fn has_shares(self) -> bool {
        self >= SchemaVersion::V0_11_0
    }

    /// How many counters (of `counters::CounterValues::NAMES`, in order) its table and
    /// functions have.
    pub fn counter_columns(self) -> usize {
        match self {
            SchemaVersion::V0_1_0 | SchemaVersion::V0_2_0 => crate::counters::COUNT_0_2_0,
            SchemaVersion::V0_3_0 => crate::counters::COUNT_0_3_0,
            SchemaVersion::V0_4_0
            | SchemaVersion::V0_5_0
            | SchemaVersion::V0_6_0
            | SchemaVersion::V0_7_0
            | SchemaVersion::V0_8_0
            | SchemaVersion::V0_9_0 => crate::counters::COUNT_0_9_0,
            SchemaVersion::V0_10_0 | SchemaVersion::V0_11_0 => crate::counters::COUNT,
        }
    }
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn versions_parse_and_order() {
        for v in SchemaVersion::ALL {
            assert_eq!(SchemaVersion::parse(v.as_str()), Some(v));
        }
        assert_eq!(SchemaVersion::parse("0.9.9"), None);
        assert!(SchemaVersion::ALL.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(SchemaVersion::CURRENT, *SchemaVersion::ALL.last().unwrap());
    }

    #[test]
    fn what_each_version_has() {
        use crate::counters::COUNT;
        use SchemaVersion::*;
        assert_eq!(
            SchemaVersion::ALL.map(|v| v.counter_columns()),
            [5, 5, 9, 10, 10, 10, 10, 10, 10, COUNT, COUNT]
        );
        assert_eq!(
            SchemaVersion::ALL.map(|v| v.has_named_caps()),
            [false, true, true, true, true, true, true, true, true, true, true]
        );
        assert!(!V0_3_0.has_leases() && V0_4_0.has_leases());
        assert!(!V0_5_0.has_lease_horizon() && V0_6_0.has_lease_horizon());
        assert!(!V0_6_0.has_key_records() && V0_7_0.has_key_records());
        assert!(!V0_7_0.has_histograms() && V0_8_0.has_histograms());
        assert!(!V0_8_0.has_adaptive() && V0_9_0.has_adaptive());
        assert!(!V0_9_0.has_rates() && V0_10_0.has_rates());
        assert!(!V0_10_0.has_shares() && V0_11_0.has_shares());
    }
}
