//! Per-database shares of the server-wide pools (caps, lease records, slot memory), as
//! `stage_e_slots.database_share` sets them: PostgreSQL's per-database connection limit is the
//! model. A database at its share is refused more of that pool while the others keep theirs.

/// The most of a pool of `pool` units that one database may hold with a share of `percent`
/// (1 to 100): never below one unit, so a small pool still serves every database.
pub fn limit(pool: u64, percent: u32) -> u64 {
    (pool * percent.min(100) as u64 / 100).max(1)
}

/// Whether a database holding `used` units may take `want` more.
pub fn fits(used: u64, want: u64, pool: u64, percent: u32) -> bool {
    used.saturating_add(want) <= limit(pool, percent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_pool_at_100() {
        assert_eq!(limit(4096, 100), 4096);
        assert!(fits(4095, 1, 4096, 100));
        assert!(!fits(4096, 1, 4096, 100));
    }

    #[test]
    fn share_rounds_down_but_never_to_zero() {
        assert_eq!(limit(4096, 25), 1024);
        assert_eq!(limit(10, 15), 1);
        assert_eq!(limit(1, 1), 1);
        assert!(fits(0, 1, 1, 1));
        assert!(!fits(1, 1, 1, 1));
    }

    #[test]
    fn two_databases_at_half_each_fill_the_pool_exactly() {
        let pool = 4097;
        assert_eq!(limit(pool, 50) * 2, 4096);
        assert!(!fits(limit(pool, 50), 1, pool, 50));
    }

    #[test]
    fn no_overflow() {
        assert!(!fits(u64::MAX, 1, 100, 100));
        assert_eq!(limit(u64::MAX / 100, 100), u64::MAX / 100);
    }
}
