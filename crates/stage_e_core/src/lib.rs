//! stage_e_core: the parts of stage_e_slots that need no server.
//!
//! Everything here is plain Rust over atomics and slices, with no `unsafe` and no pgrx, so
//! `cargo test -p stage_e_core` runs on a machine without PostgreSQL and tests the lock-free
//! protocols with threads. The extension places these types in its shared memory and supplies
//! what only the server has (latches, sleeps, the clock); this crate decides what is safe.
//!
//! - `adapt`: adaptive caps' limit, learned from hold times;
//! - `occupancy`: the slot bitmap of one cap and the covered-front rule of its queue;
//! - `arena`: the buddy allocator of slot blocks;
//! - `directory`: cap names, lock keys and the (database, name) index;
//! - `counters`: the one list of counters, their values and the pending-counts file;
//! - `flush`: a cap's hot counters, and the flush seqlock and book that make them durable once;
//! - `holder`: the holder record of one slot (pid or lease marker, since when);
//! - `histogram`: the hold and wait histograms' buckets, and their quantiles;
//! - `layout`: where each part of the shared segment starts, from the settings;
//! - `state`: a cap entry's state word (generation, lock bit, counted pins) and hazard pins;
//! - `front`: the front seats of a cap's queue of waiters, and which slots a call may take while
//!   the cap has waiters;
//! - `lease`: a lease record's states and fencing-token arithmetic;
//! - `rate`: rate limits (GCRA) and the table of rate keys;
//! - `rate_file`: the rate file of a clean shutdown and how its arrival times carry over;
//! - `fair`: fair shares of one cap's slots (start-time fair queuing) and the order in which they
//!   seat the front of its queue (not yet used by the server);
//! - `queue`: a cap's queue of waiters: its count, tickets and seats, and who a release wakes;
//! - `lifecycle`: the durable horizon and token floor, start kinds, holds after a crash;
//! - `lease_file`: the lease journal, the lease file of a clean shutdown, the files' stamp;
//! - `load`: exponentially weighted load averages;
//! - `share`: how much of a server-wide pool one database may hold;
//! - `wait`: how long a call may wait, from an interval;
//! - `version`: the SQL schema versions the library serves;
//! - `sync`: std's atomics, or loom's in the model checks (`--cfg loom`).

#![forbid(unsafe_code)]

#[macro_use]
pub mod counters;
pub mod adapt;
pub mod arena;
pub mod directory;
pub mod fair;
pub mod flush;
pub mod front;
pub mod histogram;
pub mod holder;
pub mod layout;
pub mod lease;
pub mod lease_file;
pub mod lifecycle;
pub mod load;
pub mod occupancy;
pub mod queue;
pub mod rate;
pub mod rate_file;
pub mod share;
pub mod state;
mod sync;
pub mod version;
pub mod wait;
