//! Configuration. The settings that size or identify shared state are read once at server start
//! (postmaster context); the flush interval follows reloads. The prefix is reserved so a typo is
//! an error, not a silently ignored placeholder. Also the search path our own statements and
//! conversions run under (`pinned`).

use pgrx::pg_sys;
use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};
use std::ffi::CStr;

/// Default advisory-lock key: the date of the incident this extension answers (2026-07-25).
pub const DEFAULT_LOCK_KEY: i32 = 20_260_725;
pub const DEFAULT_MAX_SLOTS: i32 = 1024;
pub const MAX_MAX_SLOTS: i32 = 65_536;
pub const DEFAULT_MAX_CAPS: i32 = 4096;
pub const MAX_MAX_CAPS: i32 = 1 << 20;
pub const DEFAULT_SLOT_MEMORY_KB: i32 = 2048;
pub const MAX_SLOT_MEMORY_KB: i32 = 1 << 20;
pub const DEFAULT_MAX_LEASES: i32 = 4096;
pub const MAX_MAX_LEASES: i32 = 1 << 20;
pub const DEFAULT_MAX_ADAPTIVE_CAPS: i32 = 64;
pub const DEFAULT_MAX_SHARES: i32 = 4096;
pub const MAX_MAX_SHARES: i32 = 1 << 20;
pub const DEFAULT_MAX_RATE_KEYS: i32 = 16_384;
pub const MAX_MAX_RATE_KEYS: i32 = 1 << 24;
pub const DEFAULT_MAX_RATE_POLICIES: i32 = 64;
pub const MAX_MAX_RATE_POLICIES: i32 = 1 << 16;
pub const MAX_MAX_ADAPTIVE_CAPS: i32 = 1 << 16;
pub const DEFAULT_FLUSH_INTERVAL_MS: i32 = 10_000;
pub const MIN_FLUSH_INTERVAL_MS: i32 = 100;
pub const MAX_FLUSH_INTERVAL_MS: i32 = 3_600_000;
pub const DEFAULT_LEASE_HORIZON_MARGIN_MS: i32 = 2_000;
pub const MAX_LEASE_HORIZON_MARGIN_MS: i32 = 3_600_000;
pub const MAX_RECOVERY_HOLD_MS: i32 = 86_400_000;
pub const DEFAULT_MAX_LEASE_TTL_S: i32 = 86_400;
/// One session may hold as many slots as one full cap of the default `max_slots`.
pub const DEFAULT_MAX_SESSION_SLOTS: i32 = 1024;
pub const DEFAULT_FLUSH_GIVE_UP_MS: i32 = 300_000;
pub const MAX_FLUSH_GIVE_UP_MS: i32 = 86_400_000;

static MAX_SLOTS: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_MAX_SLOTS);
static MAX_ADAPTIVE_CAPS: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_MAX_ADAPTIVE_CAPS);
static MAX_RATE_KEYS: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_MAX_RATE_KEYS);
static MAX_SHARES: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_MAX_SHARES);
static MAX_RATE_POLICIES: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_MAX_RATE_POLICIES);
static LOCK_KEY: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_LOCK_KEY);
static MAX_CAPS: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_MAX_CAPS);
static SLOT_MEMORY_KB: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_SLOT_MEMORY_KB);
static MAX_LEASES: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_MAX_LEASES);
static FLUSH_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_FLUSH_INTERVAL_MS);
static LEASE_HORIZON_MARGIN_MS: GucSetting<i32> =
    GucSetting::<i32>::new(DEFAULT_LEASE_HORIZON_MARGIN_MS);
static RECOVERY_HOLD_MS: GucSetting<i32> = GucSetting::<i32>::new(0);
static MAX_LEASE_TTL_S: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_MAX_LEASE_TTL_S);
static COUNTER_RETENTION_S: GucSetting<i32> = GucSetting::<i32>::new(0);
static DATABASE_SHARE: GucSetting<i32> = GucSetting::<i32>::new(100);
static MAX_SESSION_SLOTS: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_MAX_SESSION_SLOTS);
static FLUSH_GIVE_UP_MS: GucSetting<i32> = GucSetting::<i32>::new(DEFAULT_FLUSH_GIVE_UP_MS);
static EXPORT_SHARES: GucSetting<bool> = GucSetting::<bool>::new(true);

pub fn init() {
    GucRegistry::define_int_guc(
        c"stage_e_slots.max_slots",
        c"Largest cap (n) stage_e_try_slot accepts; slots are numbered 0 .. max_slots-1.",
        c"A cap's slots take 16 bytes each in stage_e_slots.slot_memory.",
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
        c"stage_e_slots.max_caps",
        c"How many caps (named or default, of all databases) can be in use at once.",
        c"A cap with held slots or counts not yet flushed is in use; an idle one is reclaimed \
          when room is needed. Each takes a 1,216-byte entry and a slot block of shared memory.",
        &MAX_CAPS,
        16,
        MAX_MAX_CAPS,
        GucContext::Postmaster,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"stage_e_slots.slot_memory",
        c"Shared memory for the slots of all caps (16 bytes per slot, in blocks of 256 bytes).",
        c"A cap's block holds the largest n it was used with: 256 bytes up to n = 15, \
          32 kB for n = 1024. At least one block of max_slots slots is always reserved.",
        &SLOT_MEMORY_KB,
        64,
        MAX_SLOT_MEMORY_KB,
        GucContext::Postmaster,
        GucFlags::UNIT_KB,
    );
    GucRegistry::define_int_guc(
        c"stage_e_slots.max_leases",
        c"How many leases (slots held by a token, of all caps and databases) can be live at once.",
        c"Each takes 48 bytes of shared memory. A lease past its TTL is freed by the next \
          search that meets it, or by the background worker within a few seconds.",
        &MAX_LEASES,
        16,
        MAX_MAX_LEASES,
        GucContext::Postmaster,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"stage_e_slots.max_adaptive_caps",
        c"How many caps (of all databases) can be adaptive at once (stage_e_adapt).",
        c"Each takes 256 bytes of shared memory. An adaptive cap's policy is kept apart from \
          its entry, so that it outlives the entry's reclaim.",
        &MAX_ADAPTIVE_CAPS,
        0,
        MAX_MAX_ADAPTIVE_CAPS,
        GucContext::Postmaster,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"stage_e_slots.max_rate_keys",
        c"How many rate keys (stage_e_try_rate, of all databases) can be limited at once.",
        c"Each takes 49 bytes of shared memory (two 24-byte records and a lock word per 8). \
          A key whose arrival time has passed is idle and is reclaimed when room is needed; \
          full, a new key is refused (SQLSTATE 53400).",
        &MAX_RATE_KEYS,
        16,
        MAX_MAX_RATE_KEYS,
        GucContext::Postmaster,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"stage_e_slots.max_shares",
        c"How many live shares (fair shares of caps, of all databases) can be kept at once.",
        c"Each takes 128 bytes of shared memory. A share is live while it holds or waits for \
          slots, or owes its last request; an idle one is forgotten. Full, a call in a new \
          share is refused (SQLSTATE 53400).",
        &MAX_SHARES,
        16,
        MAX_MAX_SHARES,
        GucContext::Postmaster,
        GucFlags::empty(),
    );
    GucRegistry::define_bool_guc(
        c"stage_e_slots.export_shares",
        c"Whether the exporter's query of fair shares (monitoring/postgres_exporter.yaml) returns rows.",
        c"One series per live share of each cap: with many tenants, set it off for the \
          exporter's role (ALTER ROLE monitor SET stage_e_slots.export_shares = off). It \
          changes nothing else; the view stage_e_shares shows the shares either way.",
        &EXPORT_SHARES,
        GucContext::Userset,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"stage_e_slots.max_rate_policies",
        c"How many rate policies (stage_e_rate_limit, on caps or prefixes, of all databases) \
          can be set at once.",
        c"Each takes 128 bytes of shared memory. A prefix policy ('tenant:*') is one, however \
          many caps it limits.",
        &MAX_RATE_POLICIES,
        0,
        MAX_MAX_RATE_POLICIES,
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
    GucRegistry::define_int_guc(
        c"stage_e_slots.lease_horizon_margin",
        c"How far past every lease's expiry the durable lease horizon is kept.",
        c"A standby promoted with a replay lag shorter than this still holds back every cap \
          until the old primary's leases have expired (see the README's Lifecycle section).",
        &LEASE_HORIZON_MARGIN_MS,
        0,
        MAX_LEASE_HORIZON_MARGIN_MS,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"stage_e_slots.max_lease_ttl",
        c"Longest ttl stage_e_lease and stage_e_renew accept.",
        c"A longer ttl is refused (SQLSTATE 22023), so no role can hold a slot for longer \
          without renewing, and no expiry can overflow. Only superusers may change it.",
        &MAX_LEASE_TTL_S,
        1,
        i32::MAX,
        GucContext::Suset,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"stage_e_slots.recovery_hold",
        c"After a crash or a promotion, hold back every cap with a counter row this long.",
        c"For work that outlives its connection: a crash ends every session slot's connection, \
          not its work. Set it to the p99 hold time; 0 (the default) holds back only caps with \
          leases that may still be live.",
        &RECOVERY_HOLD_MS,
        0,
        MAX_RECOVERY_HOLD_MS,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"stage_e_slots.counter_retention",
        c"Delete the counter rows of caps unused for this long; 0 (the default) keeps them.",
        c"The background flusher deletes, in each database, the rows of stage_e_throttle_counter \
          flushed longer ago than this whose cap has no held slot, lease, waiter or pending \
          count now (and their quiet lease horizon rows), at most 10000 per database and round.",
        &COUNTER_RETENTION_S,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"stage_e_slots.database_share",
        c"Percent of max_caps, max_leases, max_rate_keys, max_shares and slot_memory that one database may hold.",
        c"Like a database's connection limit: a database at its share is refused new caps, \
          leases, rate keys, shares or slot memory (SQLSTATE 53400) while others keep theirs. 100 (the default) \
          lets one database use it all. Only superusers may change it, also per database with \
          ALTER DATABASE ... SET.",
        &DATABASE_SHARE,
        1,
        100,
        GucContext::Suset,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"stage_e_slots.max_session_slots",
        c"Most session slots one session may hold at once, over all caps.",
        c"Each session slot is an advisory lock in PostgreSQL's shared lock table, which every \
          database shares: this keeps one call such as stage_e_try_slot over a large query \
          from filling it. Only superusers may change it.",
        &MAX_SESSION_SLOTS,
        1,
        i32::MAX,
        GucContext::Suset,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"stage_e_slots.flush_give_up",
        c"Drop the pending counts of a database whose flush has failed for this long.",
        c"After this time and at least 3 rounds in a row in which the background flusher could \
          not write a database's counts (a table renamed, a trigger that raises, anything), \
          they are dropped, with a LOG line saying how many: until then its caps cannot be \
          reclaimed, and would keep stage_e_slots.max_caps full for every database.",
        &FLUSH_GIVE_UP_MS,
        0,
        MAX_FLUSH_GIVE_UP_MS,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
}

/// A postmaster-context setting, read without `GucSetting::get`'s thread check (a thread-local
/// lookup, twice per acquire+release pair): the value is fixed before any backend starts, and
/// only this process's one thread reads it.
fn fixed(setting: &'static GucSetting<i32>) -> i32 {
    // SAFETY: `as_ptr` is the variable the GUC machinery assigned in the postmaster at start;
    // nothing writes it afterwards (GucContext::Postmaster), so a plain read is a read of a
    // constant.
    unsafe { *setting.as_ptr() }
}

pub fn max_slots() -> u32 {
    fixed(&MAX_SLOTS) as u32
}

pub fn lock_key() -> i32 {
    fixed(&LOCK_KEY)
}

pub fn max_caps() -> u32 {
    MAX_CAPS.get() as u32
}

pub fn max_leases() -> u32 {
    MAX_LEASES.get() as u32
}

pub fn max_rate_keys() -> u32 {
    MAX_RATE_KEYS.get() as u32
}

pub fn max_shares() -> u32 {
    MAX_SHARES.get() as u32
}

pub fn max_rate_policies() -> u32 {
    MAX_RATE_POLICIES.get() as u32
}

pub fn max_adaptive_caps() -> u32 {
    MAX_ADAPTIVE_CAPS.get() as u32
}

pub fn slot_memory_bytes() -> usize {
    SLOT_MEMORY_KB.get() as usize * 1024
}

/// `stage_e_slots.counter_retention`, or None when it is off (0).
pub fn counter_retention() -> Option<std::time::Duration> {
    match COUNTER_RETENTION_S.get() {
        s if s > 0 => Some(std::time::Duration::from_secs(s as u64)),
        _ => None,
    }
}

/// `stage_e_slots.flush_give_up`.
pub fn flush_give_up() -> std::time::Duration {
    std::time::Duration::from_millis(FLUSH_GIVE_UP_MS.get().max(0) as u64)
}

pub fn flush_interval() -> std::time::Duration {
    std::time::Duration::from_millis(FLUSH_INTERVAL_MS.get() as u64)
}

/// A setting this session may change (SET, ALTER DATABASE/ROLE ... SET), read without
/// `GucSetting::get`'s thread check: it is on the acquire path.
fn current(setting: &'static GucSetting<i32>) -> i32 {
    // SAFETY: `as_ptr` is the variable the GUC machinery assigns, only ever from this
    // backend's one thread, which is the thread reading it here.
    unsafe { *setting.as_ptr() }
}

/// `stage_e_slots.database_share`: the percent of each server-wide pool one database may hold.
pub fn database_share() -> u32 {
    current(&DATABASE_SHARE) as u32
}

/// `stage_e_slots.max_session_slots`.
pub fn max_session_slots() -> u32 {
    current(&MAX_SESSION_SLOTS) as u32
}

/// `stage_e_slots.lease_horizon_margin`, in microseconds.
pub fn lease_horizon_margin_us() -> i64 {
    LEASE_HORIZON_MARGIN_MS.get() as i64 * 1_000
}

/// `stage_e_slots.max_lease_ttl`, in microseconds.
pub fn max_lease_ttl_us() -> i64 {
    MAX_LEASE_TTL_S.get() as i64 * 1_000_000
}

/// `stage_e_slots.recovery_hold`, in microseconds.
pub fn recovery_hold_us() -> i64 {
    RECOVERY_HOLD_MS.get() as i64 * 1_000
}

/// Makes `SET stage_e_slots.typo = …` an error instead of a silently ignored placeholder.
pub fn reserve_prefix() {
    // SAFETY: called from _PG_init after our GUCs are defined (PG 15+ API).
    unsafe { pgrx::pg_sys::MarkGUCPrefixReserved(c"stage_e_slots".as_ptr()) };
}

/// The search path our own statements and conversions run under (`pinned`).
const PINNED_SEARCH_PATH: &CStr = c"pg_catalog, pg_temp";

/// Runs `f` with `search_path = pg_catalog, pg_temp`, restoring the caller's setting after.
pub fn pinned<R>(f: impl FnOnce() -> R) -> R {
    with_setting(c"search_path", PINNED_SEARCH_PATH, f)
}

/// Runs `f` with `enable_seqscan = off`: for a read of few rows that an index finds, which the
/// planner would read with a sequential scan of the whole table while its statistics are stale
/// (a table no ANALYZE has seen since it grew: every row then looks like a match of
/// `IS NOT NULL`).
pub fn index_scans<R>(f: impl FnOnce() -> R) -> R {
    with_setting(c"enable_seqscan", c"off", f)
}

/// Runs `f` with setting `name` at `value`, restoring the caller's setting after.
fn with_setting<R>(name: &CStr, value: &CStr, f: impl FnOnce() -> R) -> R {
    // SAFETY: the fmgr_security_definer pattern. A new GUC nest level saves the setting; on the
    // success path AtEOXact_GUC(true, level) pops it. If `f` raises an ERROR, the (sub)transaction
    // abort pops every level above the surviving one, so the value never leaks to the caller.
    // GUC_ACTION_SAVE is also the action allowed in parallel mode.
    unsafe {
        let level = pg_sys::NewGUCNestLevel();
        pg_sys::set_config_option(
            name.as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_SAVE,
            true,
            0,
            false,
        );
        let r = f();
        pg_sys::AtEOXact_GUC(true, level);
        r
    }
}
