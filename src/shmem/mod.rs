//! Shared memory: every database's caps, their slots and their counters, one file per concern.
//! Each file opens with the protocol it keeps (which lock or atomic guards what); the design as
//! a whole is in `docs/design.md`.
//!
//! - `segment`: the segment's layout, the request and startup hooks, attaching, the LWLocks;
//! - `entry`: a cap's entry (`#[repr(C)]`, its size asserted) and its slots' holder records;
//! - `pin`: pinning an entry (hazard slots, counted pins) and the pinned handle [`Cap`];
//! - `caps`: finding, creating, growing and reclaiming caps;
//! - `counters`: the hot counters and the flush seqlock over a cap's bookkeeping;
//! - `histograms`: a cap's hold and wait histograms, and their flush base;
//! - `waitq`: a cap's queue of waiters;
//! - `leases`: slots held by a token, and fencing tokens;
//! - `load`: load averages, sampled by the launcher;
//! - `adaptive`: adaptive caps' policies and what they learned, the enforced limit;
//! - `durable`: the committed lease horizon and token floor, holds, databases loaded;
//! - `persist`: pending counts and leases across a clean restart;
//! - `launcher`: waking the background launcher, flush ids.
//!
//! Outside this folder, shared memory is reached only through a pinned [`Cap`] and the
//! functions re-exported here.

mod caps;
mod committed;
mod counters;
mod entry;
mod histograms;
mod launcher;
mod leases;
mod load;
mod persist;
mod pin;
mod policies;
mod segment;
mod waitq;

pub use caps::{
    busy_caps, cap_refs, caps, create, databases, databases_with_pending, first_key, grow, key_now,
    lookup, reclaim_database, usage,
};
#[cfg(any(test, feature = "pg_test"))]
pub use caps::{pin_state, reclaim_now};
pub use committed::{
    advance_requested, databases_to_load, databases_to_recheck, databases_with_horizon_work,
    databases_with_waiting_calls, durable_watch, flusher_commits, loaded, mark_loaded,
    note_flusher_commit, note_recovered, recorded_databases, recovered_at, request_advance,
    request_load, start_kind, MAX_DATABASES,
};
pub use counters::Flushed;
pub use launcher::{launcher_wakeup, next_flush_id};
pub use leases::{caps_with_leases_due, LeaseCheck, LeaseInfo, LeaseRefused};
pub use load::{load_of, sample_load, Load};
pub use persist::init;
pub use pin::pin;
pub use policies::{
    adapt_tick, apply_policy, cap_limits, clear_policies, databases_with_limits_to_write,
    learned_limit, limits_to_write, limits_written, policy_count, policy_databases, policy_room,
    restore_policy, PolicyChange, PolicyView, ToWrite,
};
pub use segment::attached;
pub use stage_e_core::counters::Counter;
pub use stage_e_core::state::CapRef;
pub use waitq::{dequeue, waiters_of, Ticket, WaiterInfo};

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
