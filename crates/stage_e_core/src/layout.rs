//! Where each part of the shared segment starts: one computation, used both to size the
//! segment (the request hook) and to find its parts (every attach). The server supplies the
//! sizes of its record types; the counts come from postmaster settings and are kept in the
//! segment's header, so every process computes the same layout.
//!
//! ```text
//! header                      settings, flush ids, the launcher
//! entry × caps                a cap's fixed part (`shmem::entry`)
//! waiter × waiters            who waits for which cap, one per backend (`shmem::waitq`)
//! lease × leases              slots held by a token (`shmem::leases`)
//! share × shares              the live shares of caps, one pool (`fair`, `shmem::shares`)
//! policy × policies           adaptive caps' bounds and what they learned (`shmem::adaptive`)
//! rate policy × rate_policies rate policies on caps and prefixes (`shmem::rates`)
//! rate × rate_records         rate keys' arrival times (`rate`, `shmem::rates`)
//! u32 × rate_records / BUCKET their buckets' claim locks
//! (to a cache line)
//! hazard × hazards            one pin slot per backend, each on its own cache line (`shmem::pin`)
//! u32 × index_len             the (database, name) → entry index (`directory`)
//! u32 × arena meta            the buddy allocator's state (`arena`), rounded to 8 bytes
//! page × pages                the slot blocks (`arena`)
//! ```
//!
//! Offsets are from the segment's start, which the server aligns to a cache line: [`Layout::size`]
//! includes the 64 bytes that alignment may take.

use crate::arena;

/// Bytes of a cache line, the alignment of the segment and of the hazard slots.
pub const CACHE_LINE: usize = 64;

/// How many of each record the segment holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counts {
    pub caps: u32,
    pub waiters: u32,
    pub leases: u32,
    /// Share records (`fair::ShareRecord`), one pool for every cap.
    pub shares: u32,
    pub policies: u32,
    pub rate_policies: u32,
    /// Records of the rate table (`rate::records_for`: a multiple of its bucket).
    pub rate_records: u32,
    pub hazards: u32,
    pub index_len: u32,
    pub pages: u32,
}

/// The size of each record type, in bytes.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub header: usize,
    pub entry: usize,
    pub waiter: usize,
    pub lease: usize,
    pub share: usize,
    pub policy: usize,
    pub rate_policy: usize,
    pub rate: usize,
    pub hazard: usize,
}

/// Offsets of the parts, from the (cache-line aligned) start of the segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub entries: usize,
    pub waiters: usize,
    pub leases: usize,
    pub shares: usize,
    pub policies: usize,
    pub rate_policies: usize,
    pub rates: usize,
    pub rate_locks: usize,
    pub hazards: usize,
    pub index: usize,
    pub meta: usize,
    pub meta_words: usize,
    pub arena: usize,
    /// End of the arena.
    pub end: usize,
}

impl Layout {
    pub fn new(c: Counts, s: Sizes) -> Layout {
        let entries = s.header;
        let waiters = entries + c.caps as usize * s.entry;
        let leases = waiters + c.waiters as usize * s.waiter;
        let shares = leases + c.leases as usize * s.lease;
        let policies = shares + c.shares as usize * s.share;
        let rate_policies = policies + c.policies as usize * s.policy;
        let rates = rate_policies + c.rate_policies as usize * s.rate_policy;
        let rate_locks = rates + c.rate_records as usize * s.rate;
        let rate_end = rate_locks + c.rate_records as usize / crate::rate::BUCKET * 4;
        let hazards = rate_end.next_multiple_of(CACHE_LINE);
        let index = hazards + c.hazards as usize * s.hazard;
        let meta = index + c.index_len as usize * 4;
        let meta_words = arena::meta_words(c.pages);
        let words = (c.index_len as usize + meta_words).next_multiple_of(2);
        let arena = index + words * 4;
        let end = arena + c.pages as usize * arena::PAGE;
        Layout {
            entries,
            waiters,
            leases,
            shares,
            policies,
            rate_policies,
            rates,
            rate_locks,
            hazards,
            index,
            meta,
            meta_words,
            arena,
            end,
        }
    }

    /// Bytes to request: the parts, and room to align the start to a cache line.
    pub fn size(&self) -> usize {
        CACHE_LINE + self.end
    }
}

/// Bytes from `addr` to the next cache-line boundary.
pub fn to_cache_line(addr: usize) -> usize {
    addr.next_multiple_of(CACHE_LINE) - addr
}

#[cfg(test)]
mod unit {
    use super::*;

    const SIZES: Sizes = Sizes {
        header: 64,
        entry: 704,
        waiter: 48,
        lease: 48,
        share: 48,
        policy: 256,
        rate_policy: 128,
        rate: 24,
        hazard: 64,
    };

    #[test]
    fn parts_follow_each_other_aligned_and_without_overlap() {
        for (caps, waiters, leases, policies, pages, rate_records) in [
            (4096, 100, 4096, 64, 8192, 32768),
            (1, 1, 0, 0, 128, 16),
            (7, 3, 5, 1, 1, 24),
        ] {
            let c = Counts {
                caps,
                waiters,
                leases,
                shares: leases / 2 + 1,
                policies,
                rate_policies: policies + 1,
                rate_records,
                hazards: waiters,
                index_len: 2 * caps.next_power_of_two(),
                pages,
            };
            let l = Layout::new(c, SIZES);
            assert_eq!(l.entries, SIZES.header);
            assert_eq!(l.waiters - l.entries, caps as usize * SIZES.entry);
            assert_eq!(l.leases - l.waiters, waiters as usize * SIZES.waiter);
            assert_eq!(l.shares, l.leases + leases as usize * SIZES.lease);
            assert!(l.shares.is_multiple_of(8), "share records are 8-aligned");
            assert_eq!(l.policies, l.shares + c.shares as usize * SIZES.share);
            assert_eq!(
                l.rate_policies,
                l.policies + policies as usize * SIZES.policy
            );
            assert_eq!(
                l.rates,
                l.rate_policies + (policies + 1) as usize * SIZES.rate_policy
            );
            assert!(l.rates.is_multiple_of(8), "rate records are 8-aligned");
            assert_eq!(l.rate_locks, l.rates + rate_records as usize * SIZES.rate);
            let rate_end = l.rate_locks + rate_records as usize / crate::rate::BUCKET * 4;
            assert!(l.hazards >= rate_end);
            assert!(
                l.hazards.is_multiple_of(CACHE_LINE),
                "hazard slots start on a line"
            );
            assert!(l.hazards - rate_end < CACHE_LINE);
            assert_eq!(l.index - l.hazards, c.hazards as usize * SIZES.hazard);
            assert_eq!(l.meta, l.index + c.index_len as usize * 4);
            assert!(l.arena >= l.meta + l.meta_words * 4 && l.arena.is_multiple_of(8));
            assert_eq!(l.end - l.arena, pages as usize * arena::PAGE);
            assert_eq!(l.size(), l.end + CACHE_LINE);
        }
    }

    #[test]
    fn alignment_slack() {
        assert_eq!(to_cache_line(0), 0);
        assert_eq!(to_cache_line(1), 63);
        assert_eq!(to_cache_line(64), 0);
        assert_eq!(to_cache_line(100), 28);
    }
}
