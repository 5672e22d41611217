//! Shared memory: every database's caps, their slots and their counters, one file per concern.
//! Each file opens with the protocol it keeps (which lock or atomic guards what); the design as
//! a whole is in `docs/design.md`.
//!
//! Interface (all that the rest of the crate uses; nothing else is exported):
//!
//! - a pinned cap: [`Cap`] (its methods: take and free slots, count, wait, lease, hold), [`pin`],
//!   [`CapRef`], [`Counter`], [`Flushed`] (the flush of one cap), [`Ticket`] (a place in line);
//! - finding and making caps: `lookup`, `create`, `grow`, `key_now`, `first_key`, `caps`,
//!   `cap_refs`, `busy_caps`, `databases`, `databases_with_pending`, `reclaim_database`, `usage`;
//! - waiting: `dequeue`, `waiters_of`, [`WaiterInfo`];
//! - fair shares: `Cap::has_shares`, `Cap::reserve_now`, `Cap::enqueue_in_share`,
//!   `Cap::granted_in_line`, `Cap::take_in_line`, `Cap::give_back_share`, `shares_of`;
//! - leases: `caps_with_leases_due`, [`LeaseCheck`], [`LeaseInfo`], [`LeaseRefused`];
//! - load averages: `sample_load`, `load_of`, [`Load`];
//! - rate keys: `try_rate`, `peek_rate`, `any_rate_policy`, `note_rates_recovered`, [`NoRoom`]; rate policies:
//!   `rate_policy`, `rate_policies`, `rate_policy_room`, `reserve_rate_policies`,
//!   `unreserve_rate_policies`, `set_rate_policy`, `clear_rate_policies`, [`RatePolicy`];
//! - adaptive policies: `apply_policy`, `restore_policy`, `clear_policies`, `policy_room`,
//!   `policy_count`, `policy_databases`, `learned_limit`, `cap_limits`, `adapt_tick`,
//!   `limits_to_write`, `limits_written`, `databases_with_limits_to_write`, [`PolicyChange`],
//!   [`PolicyView`], [`ToWrite`];
//! - the committed horizons: `databases_with_horizon_work`, `databases_to_recheck`,
//!   `databases_with_waiting_calls`, `durable_watch`;
//! - the databases' table: `loaded`, `request_load`, `mark_loaded`, `databases_to_load`,
//!   `recorded_databases`, `request_advance`, `advance_requested`, `flusher_commits`,
//!   `note_flusher_commit`, `start_kind`, `note_recovered`, `recovered_at`,
//!   `note_loads_requested`, `MAX_DATABASES`;
//! - the launcher: `launcher_wakeup`, `next_flush_id`;
//! - the segment: `init` (the hooks, from `_PG_init`), `attached`.
//!
//! Files, bottom to top: each uses only files above it in this list (`make layers` checks it).
//! [`Cap`] and `CapEntry` keep their impls in the file of each concern, on purpose:
//!
//! 1. `records`: the fields of every shared record (an entry's parts, the segment's tables)
//! 2. `entry`: a cap's entry (`#[repr(C)]`, its size asserted) and its slots' holder records
//! 3. `segment`: the layout, attaching, the LWLocks, the header's token counter
//! 4. `launcher`: waking the background launcher, flush ids
//! 5. `pin`: pinning an entry (hazard slots, counted pins) and the pinned handle [`Cap`]
//! 6. `counters`: the hot counters and the flush seqlock over a cap's bookkeeping
//!    (`stage_e_core::flush`'s, placed in the entry)
//! 7. `histograms`: a cap's hold and wait histograms, and their flush base
//! 8. `databases`: the table of databases: loaded, lease shares, flusher commits, start kind
//! 9. `caps`: finding, creating, growing and reclaiming caps
//! 10. `waitq`: a cap's queue of waiters (`stage_e_core::queue`'s line, placed in the entry)
//! 11. `shares`: fair shares of caps (`stage_e_core::fair`'s clock and pool, placed)
//! 12. `leases`: slots held by a token (`stage_e_core::lease`'s records), and fencing tokens
//! 13. `committed`: the committed lease horizon and token floor, holds, the journal
//! 14. `policies`: adaptive caps' policies and what they learned, the enforced limit
//! 15. `load`: load averages, sampled by the launcher
//! 16. `rates`: rate keys (`stage_e_core::rate`'s table, placed in the segment), their room
//! 17. `persist`: the startup hook; pending counts, leases and rate keys across a clean restart

mod caps;
mod committed;
mod counters;
mod databases;
mod entry;
mod histograms;
mod launcher;
mod leases;
mod load;
mod persist;
mod pin;
mod policies;
mod rates;
mod records;
mod segment;
mod shares;
mod waitq;

pub use caps::{
    busy_caps, cap_refs, caps, create, databases, databases_with_pending, first_key, grow, key_now,
    lookup, reclaim_database, usage,
};
#[cfg(any(test, feature = "pg_test"))]
pub use caps::{pin_state, reclaim_now};
pub use committed::{
    databases_to_recheck, databases_with_horizon_work, databases_with_waiting_calls, durable_watch,
};
pub use counters::Flushed;
pub use databases::{
    advance_requested, databases_to_load, flusher_commits, loaded, mark_loaded,
    note_flusher_commit, note_loads_requested, note_recovered, recorded_databases, recovered_at,
    request_advance, request_load, share_policies_changed, share_policies_generation, start_kind,
};
pub use launcher::{launcher_wakeup, next_flush_id};
pub use leases::{caps_with_leases_due, LeaseCheck, LeaseInfo, LeaseRefused};
pub use load::{load_of, sample_load, Load};
pub use persist::init;
pub use pin::pin;
pub use policies::{
    adapt_tick, apply_policy, cap_limits, clear_policies, databases_with_limits_to_write,
    learned_limit, limits_to_write, limits_written, note_expiry, policy_count, policy_databases,
    policy_room, reserve, restore_policy, unreserve, PolicyChange, PolicyView, ToWrite,
};
pub use rates::{
    any_rate_policy, clear_rate_policies, note_recovered as note_rates_recovered, peek_rate,
    rate_policies, rate_policy, rate_policy_room, reserve_rate_policies, set_rate_policy,
    share_digest, try_rate, unreserve_rate_policies, NoRoom, RatePolicy,
};
pub use records::MAX_DATABASES;
pub use segment::attached;
pub use shares::{dequeue, shares_of, ShareInfo};
pub use stage_e_core::counters::Counter;
pub use stage_e_core::state::CapRef;
pub use waitq::{waiters_of, Ticket, WaiterInfo};

use entry::CapEntry;
use stage_e_core::state::Pin;

/// A pinned cap: while it lives, its entry keeps its identity and its slot block (`pin`). Its
/// methods are in the file of their concern. (Defined here, so that its methods' names are
/// `stage_e_slots::shmem::Cap::…` wherever they are: a debugger breaks on them by that name.)
pub struct Cap {
    entry: &'static CapEntry,
    /// The cap this handle pins (entry and generation).
    pub at: CapRef,
    /// Unpins when the handle goes.
    _pin: Pin<'static>,
}
