//! Configuration. The settings that size or identify shared state are read once at server start
//! (postmaster context); the flush interval follows reloads. The prefix is reserved so a typo is
//! an error, not a silently ignored placeholder.

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};

/// Default advisory-lock key: the date of the incident this extension answers (2026-07-25).
pub const DEFAULT_LOCK_KEY: i32 = 20_260_725;
pub const DEFAULT_MAX_SLOTS: i32 = 1024;
pub const MAX_MAX_SLOTS: i32 = 65_536;
pub const DEFAULT_MAX_DATABASES: i32 = 16;
pub const MAX_MAX_DATABASES: i32 = 1024;
pub const DEFAULT_FLUSH_INTERVAL_MS: i32 = 10_000;
pub const MIN_FLUSH_INTERVAL_MS: i32 = 100;
pub const MAX_FLUSH_INTERVAL_MS: i32 = 3_600_000;

static MAX_SLOTS: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_MAX_SLOTS);
static LOCK_KEY: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_LOCK_KEY);
static MAX_DATABASES: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_MAX_DATABASES);
static FLUSH_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_FLUSH_INTERVAL_MS);

pub fn init() {
    GucRegistry::define_int_guc(
        c"stage_e_slots.max_slots",
        c"Largest cap (n) stage_e_try_slot accepts; slots are numbered 0 .. max_slots-1.",
        c"Shared memory holds a bitmap bit and a 16-byte holder record per slot per database.",
        &MAX_SLOTS,
        1,
        MAX_MAX_SLOTS,
        GucContext::Postmaster,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"stage_e_slots.lock_key",
        c"First int4 of every slot's advisory lock: slot s is the lock (lock_key, s).",
        c"pg_locks shows a held slot as classid = lock_key, objid = slot, objsubid = 2.",
        &LOCK_KEY,
        0,
        i32::MAX,
        GucContext::Postmaster,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"stage_e_slots.max_databases",
        c"How many databases can use stage_e_slots at once (each gets its own slots and counters).",
        c"A database takes its entry on first use and keeps it until server restart.",
        &MAX_DATABASES,
        1,
        MAX_MAX_DATABASES,
        GucContext::Postmaster,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"stage_e_slots.flush_interval",
        c"How often counters are added to each database's stage_e_throttle_counter row.",
        c"One row update per database per interval, whatever the throttle rate. A crash loses \
          at most the counts of one interval; a clean shutdown loses none.",
        &FLUSH_INTERVAL_MS,
        MIN_FLUSH_INTERVAL_MS,
        MAX_FLUSH_INTERVAL_MS,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
}

pub fn max_slots() -> u32 {
    MAX_SLOTS.get() as u32
}

pub fn lock_key() -> i32 {
    LOCK_KEY.get()
}

pub fn max_databases() -> u32 {
    MAX_DATABASES.get() as u32
}

pub fn flush_interval() -> std::time::Duration {
    std::time::Duration::from_millis(FLUSH_INTERVAL_MS.get() as u64)
}

/// Makes `SET stage_e_slots.typo = …` an error instead of a silently ignored placeholder.
pub fn reserve_prefix() {
    // SAFETY: called from _PG_init after our GUCs are defined (PG 15+ API).
    unsafe { pgrx::pg_sys::MarkGUCPrefixReserved(c"stage_e_slots".as_ptr()) };
}
