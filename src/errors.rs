//! The refusals in words, at the top: each ERROR says what happened (message), what was expected
//! (detail) and how to fix it (hint), with a SQLSTATE a program can act on: class 22 for bad
//! input, 53 for a full configuration limit, 55 for a missing prerequisite. The errors are data
//! (`failures`), returned by every floor; the ereport plumbing is `report`, below.

use crate::failures::{CapError, NameOf, NamedError, Pool, SlotError};
use crate::flush::FlushError;
use crate::gucs;
use crate::names::quoted;
use crate::report;
use pgrx::{PgLogLevel, PgSqlErrorCode};
use stage_e_core::directory::{NameError, DEFAULT_CAP, MAX_NAME};

const HINT_PRELOAD: &str = "Add stage_e_slots to shared_preload_libraries in postgresql.conf \
     (shared_preload_libraries = 'stage_e_slots') and restart the server.";
pub const HINT_SAME_CONNECTION: &str = "A slot is a session-level lock: it belongs to the \
     connection that took it and is gone when that connection closes. Acquire and release on \
     one dedicated connection, and check stage_e_holding(slot) before committing work.";

/// Microseconds as seconds, for a message (`86400 s`, `0.25 s`).
fn seconds(us: i64) -> String {
    if us % 1_000_000 == 0 {
        format!("{} s", us / 1_000_000)
    } else {
        format!("{} s", us as f64 / 1e6)
    }
}

/// Raises `e` as an ERROR.
#[track_caller]
pub fn raise(e: SlotError) -> ! {
    let d = describe(&e);
    report::error(d.code, d.message, d.detail, d.hint)
}

/// An error in words: what an ERROR says, and what a LOG line quotes (its message) through
/// the errors' `Display`.
pub struct Described {
    pub code: PgSqlErrorCode,
    pub message: String,
    pub detail: String,
    pub hint: Option<String>,
}

fn said(code: PgSqlErrorCode, message: String, detail: String, hint: Option<String>) -> Described {
    Described {
        code,
        message,
        detail,
        hint,
    }
}

/// What `e` says.
pub fn describe(e: &SlotError) -> Described {
    use PgSqlErrorCode::*;
    let max_slots = gucs::max_slots();
    match e {
        SlotError::NotPreloaded => said(
            ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            "stage_e_slots must be loaded via shared_preload_libraries".into(),
            "Without its shared memory the cap cannot be enforced, so no slot is handed out."
                .into(),
            Some(HINT_PRELOAD.into()),
        ),
        SlotError::Standby => said(
            ERRCODE_READ_ONLY_SQL_TRANSACTION,
            "stage_e_slots cannot be used on a standby".into(),
            "Advisory locks on a standby do not coordinate with the primary, so a cap here would \
             not bind."
                .into(),
            Some("Take and release slots on the primary.".into()),
        ),
        SlotError::ParallelMode => said(
            ERRCODE_INVALID_TRANSACTION_STATE,
            "stage_e_slots cannot be used during a parallel operation".into(),
            "A slot is a session lock: one taken in a parallel worker would end with the worker, \
             and the leader would not hold it."
                .into(),
            Some(
                "Call the stage_e_slots functions outside parallel queries: do not wrap them in \
                 functions marked PARALLEL SAFE or RESTRICTED."
                    .into(),
            ),
        ),
        SlotError::NullArgument { name } => said(
            ERRCODE_NULL_VALUE_NOT_ALLOWED,
            format!("{name} must not be NULL"),
            match *name {
                "n" => format!("n must be between 1 and stage_e_slots.max_slots ({max_slots})."),
                "cap" => format!("A cap name is 1 to {MAX_NAME} bytes, counted in UTF-8."),
                "k" => "k is how many slots to take at once, between 1 and n.".into(),
                "wait" => "wait is how long to wait for a slot: '0' does not wait.".into(),
                "ttl" => "ttl is how long a lease lasts unless renewed.".into(),
                "token" => "token is the one stage_e_lease returned with the slot.".into(),
                "key" => "key names the rate limit: calls with one key share one rate.".into(),
                "count" | "per" => "A rate is count calls per interval per.".into(),
                "burst" => "burst is how many calls may come at once (1: none).".into(),
                "cost" => "cost is how many calls of the rate this call counts for.".into(),
                _ => format!("Slots are numbered 0 to {}.", max_slots - 1),
            },
            Some(match *name {
                "cap" => "Pass a cap name, such as 'exports' or 'tenant:42'.".into(),
                "wait" => "Pass an interval such as '0', '500 ms' or '30 s'.".into(),
                "ttl" | "per" => "Pass an interval such as '30 s' or '5 min'.".into(),
                "key" => "Pass a key, such as 'api.example.com' or 'tenant:42'.".into(),
                _ => "Pass an integer.".into(),
            }),
        ),
        SlotError::CapOutOfRange { n, max_slots } => said(
            ERRCODE_INVALID_PARAMETER_VALUE,
            format!("cap n = {n} is out of range"),
            format!("n must be between 1 and stage_e_slots.max_slots ({max_slots})."),
            Some(
                "For a larger cap, raise stage_e_slots.max_slots in postgresql.conf and restart."
                    .into(),
            ),
        ),
        SlotError::CountOutOfRange { k, n } => said(
            ERRCODE_INVALID_PARAMETER_VALUE,
            format!("k = {k} slots is out of range"),
            format!("k must be between 1 and n ({n})."),
            Some("Ask for at most n slots of a cap of n.".into()),
        ),
        SlotError::BadRate { what, value, burst } => {
            use stage_e_core::rate::BadRate::*;
            let (message, detail, hint) = match what {
                Count => (
                    format!("count = {value} is out of range"),
                    "count is how many calls the rate allows per interval: at least 1.".into(),
                    "Pass a positive integer, such as 10 for 10 calls per '1 s'.",
                ),
                Per => (
                    "per must be positive and at most 1 day".to_string(),
                    "per is the interval the rate's count is over; months are not a fixed \
                     length."
                        .into(),
                    "Pass an interval such as '1 s', '1 min' or '1 day'.",
                ),
                Burst => (
                    format!("burst = {value} is out of range"),
                    "burst is how many calls may come at once: at least 1.".into(),
                    "Pass 1 for no burst, or more to allow calls to bunch up.",
                ),
                Cost => (
                    format!("cost = {value} is out of range"),
                    "cost is how many calls of the rate this call counts for: at least 1.".into(),
                    "Pass 1, or the weight of this call.",
                ),
                CostAboveBurst => (
                    format!("cost = {value} is larger than burst = {burst}"),
                    format!(
                        "A call can never be allowed with a cost above the burst: at most \
                         {burst} calls' worth may come at once, however long it waits."
                    ),
                    "Raise burst to at least the largest cost, or split the call.",
                ),
            };
            said(
                ERRCODE_INVALID_PARAMETER_VALUE,
                message,
                detail,
                Some(hint.into()),
            )
        }
        SlotError::NoRateKey { max, share } => match share {
            Some((share, limit)) => said(
                ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
                "this database has no room for another rate key".into(),
                format!(
                    "It holds its share of rate keys: {share}% (stage_e_slots.database_share) \
                     of stage_e_slots.max_rate_keys ({max}), {limit} keys not idle; the call \
                     was not counted."
                ),
                Some(
                    "Use fewer distinct keys, or raise stage_e_slots.database_share for this \
                     database."
                        .into(),
                ),
            ),
            None => said(
                ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
                "stage_e_slots has no room for another rate key".into(),
                format!(
                    "All {max} rate keys (stage_e_slots.max_rate_keys) are in use and none is \
                     idle; the call was not counted."
                ),
                Some(
                    "Use fewer distinct keys, or raise stage_e_slots.max_rate_keys in \
                     postgresql.conf and restart."
                        .into(),
                ),
            ),
        },
        SlotError::NegativeWait => said(
            ERRCODE_INVALID_PARAMETER_VALUE,
            "wait must not be negative".into(),
            "wait is how long to wait for a slot: '0' does not wait.".into(),
            Some("Pass an interval such as '0', '500 ms' or '30 s'.".into()),
        ),
        SlotError::BadTtl => said(
            ERRCODE_INVALID_PARAMETER_VALUE,
            "ttl must be positive".into(),
            "ttl is how long a lease lasts unless renewed; its slot comes back when it passes."
                .into(),
            Some(
                "Pass an interval longer than the work it guards, such as '30 s', and renew \
                 before it passes."
                    .into(),
            ),
        ),
        SlotError::BadBounds(e) => {
            use stage_e_core::adapt::BoundsError::*;
            let (message, hint) = match e {
                MinBelowOne { min } => (
                    format!("min_slots must be at least 1, not {min}"),
                    "Pass the fewest slots the cap may shrink to, such as 1.".to_string(),
                ),
                MaxBelowMin { min, max } => (
                    format!("max_slots ({max}) must be at least min_slots ({min})"),
                    "Pass bounds with min_slots <= max_slots.".to_string(),
                ),
                MaxAboveMaxSlots { max, max_slots } => (
                    format!("max_slots ({max}) is above stage_e_slots.max_slots ({max_slots})"),
                    format!(
                        "Pass a max_slots of at most {max_slots}, or raise \
                         stage_e_slots.max_slots in postgresql.conf and restart."
                    ),
                ),
            };
            said(
                ERRCODE_INVALID_PARAMETER_VALUE,
                message,
                "stage_e_adapt keeps a cap's learned limit within [min_slots, max_slots]; \
                 nothing was changed."
                    .into(),
                Some(hint),
            )
        }
        SlotError::NoPolicyRecord { max } => said(
            ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            "stage_e_slots has no room for another adaptive cap".into(),
            format!(
                "All {max} adaptive policy records (stage_e_slots.max_adaptive_caps) are in use; \
                 nothing was changed."
            ),
            Some(
                "Turn adaptation off for caps that need it no longer (stage_e_adapt_off), or \
                 raise stage_e_slots.max_adaptive_caps in postgresql.conf and restart."
                    .into(),
            ),
        ),
        SlotError::BadRateRow { on } => said(
            ERRCODE_INVALID_PARAMETER_VALUE,
            format!(
                "the rate policy in row {} of stage_e_throttle_counter is not a valid rate",
                quoted(on)
            ),
            "rate_count and rate_burst must be at least 1 and rate_per between 1 microsecond \
             and 1 day; the statement that wrote the row was rolled back, and no policy changed."
                .into(),
            Some(
                "Set rate policies with stage_e_rate_limit(cap, count, per, burst), which checks \
                 them, and keep the table's CHECK constraint."
                    .into(),
            ),
        ),
        SlotError::NotOurTable { function, table } => said(
            ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED,
            format!("{function}() fires only on the extension's table {table}"),
            format!(
                "A trigger runs {function}() on another table; the statement was rolled back, \
                 and no policy changed."
            ),
            Some(format!(
                "Drop that trigger: policies are changed through the extension's functions, or \
                 by writing {table} itself."
            )),
        ),
        SlotError::NoRatePolicyRecord { max } => said(
            ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            "stage_e_slots has no room for another rate policy".into(),
            format!(
                "All {max} rate policy records (stage_e_slots.max_rate_policies) are in use; \
                 nothing was changed."
            ),
            Some(
                "Take off the rate policies no longer needed (stage_e_rate_limit_off), use a \
                 prefix policy ('tenant:*') for many caps, or raise \
                 stage_e_slots.max_rate_policies in postgresql.conf and restart."
                    .into(),
            ),
        ),
        SlotError::NoShareRecord { max, share } => said(
            ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            "no room for another live share of this cap".into(),
            format!(
                "All share records this database may hold are live: {share}% \
                 (stage_e_slots.database_share) of stage_e_slots.max_shares ({max}), and the \
                 cap has no idle share to reuse; nothing was taken."
            ),
            Some(
                "Use fewer distinct shares at once, or raise stage_e_slots.max_shares in \
                 postgresql.conf and restart (or stage_e_slots.database_share for this \
                 database)."
                    .into(),
            ),
        ),
        SlotError::MoreThanCeiling { k, ceiling } => said(
            ERRCODE_INVALID_PARAMETER_VALUE,
            format!("k = {k} slots is more than the share may hold at once"),
            format!(
                "The share's max_slots (stage_e_share) is {ceiling}: an acquisition of {k} \
                 slots could never be allowed."
            ),
            Some("Take at most max_slots at once, or raise the share's max_slots.".into()),
        ),
        SlotError::MoreThanBurst { k, burst } => said(
            ERRCODE_INVALID_PARAMETER_VALUE,
            format!("k = {k} slots is more than the cap's rate allows at once"),
            format!(
                "The cap's rate policy (stage_e_rate_limit) has a burst of {burst}: an \
                 acquisition of {k} slots charges {k} and could never be allowed."
            ),
            Some("Take at most the burst at once, or raise the policy's burst.".into()),
        ),
        SlotError::TtlTooLong { ttl_us, max_us } => said(
            ERRCODE_INVALID_PARAMETER_VALUE,
            format!(
                "ttl {} is longer than stage_e_slots.max_lease_ttl ({})",
                seconds(*ttl_us),
                seconds(*max_us)
            ),
            "A lease must be renewed at least once per stage_e_slots.max_lease_ttl, so that no \
             holder keeps a slot unseen for longer; nothing was taken or changed."
                .into(),
            Some(
                "Pass a shorter ttl and renew before it passes, or ask a superuser to raise \
                 stage_e_slots.max_lease_ttl."
                    .into(),
            ),
        ),
        SlotError::TooManySessionSlots { held, k, max } => said(
            ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            format!("this session holds {held} session slots and may hold at most {max}"),
            format!(
                "Taking {k} more would pass stage_e_slots.max_session_slots; each session slot \
                 is an advisory lock in the lock table every database shares. Nothing was taken."
            ),
            Some(
                "Release slots this session no longer needs, spread the work over sessions, or \
                 ask a superuser to raise stage_e_slots.max_session_slots."
                    .into(),
            ),
        ),
        SlotError::NoLeaseRecord { max_leases } => said(
            ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            "stage_e_slots has no room for another lease".into(),
            format!(
                "All {max_leases} lease records (stage_e_slots.max_leases) are live; no slot was \
                 taken."
            ),
            Some(
                "Release leases when done, or raise stage_e_slots.max_leases in \
                 postgresql.conf and restart."
                    .into(),
            ),
        ),
        SlotError::NotLoaded => said(
            ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            "stage_e_slots could not load this database's lease horizons".into(),
            "After a start or a promotion, the background launcher reads each database's \
             stage_e_lease_horizon table before its caps hand out slots; it did not within \
             10 s, so no slot was taken."
                .into(),
            Some(
                "Check that the stage_e_slots launcher runs (pg_stat_activity) and that \
                 max_worker_processes leaves room for its flusher; see the server log."
                    .into(),
            ),
        ),
        SlotError::TooManyDatabases => said(
            ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            "stage_e_slots has no room for another database".into(),
            format!(
                "At most {} databases of one server can use stage_e_slots at once.",
                crate::shmem::MAX_DATABASES
            ),
            Some("Use the extension from fewer databases of this server.".into()),
        ),
        SlotError::NeedsRoom { .. } => said(
            ERRCODE_INTERNAL_ERROR,
            "stage_e_slots: a lease waited for its horizon outside its retry".into(),
            "This is a bug in stage_e_slots; no lease was granted.".into(),
            None,
        ),
        SlotError::NoWaiterRecord => said(
            ERRCODE_INTERNAL_ERROR,
            "stage_e_slots has no room to record this waiter".into(),
            "There is a record for every backend; this is a bug in stage_e_slots.".into(),
            None,
        ),
        SlotError::SlotOutOfRange { slot, max_slots } => said(
            ERRCODE_INVALID_PARAMETER_VALUE,
            format!("slot {slot} is out of range"),
            format!(
                "Slots are numbered 0 to {} (stage_e_slots.max_slots - 1).",
                max_slots - 1
            ),
            Some("Pass a slot number returned by stage_e_try_slot.".into()),
        ),
        SlotError::BadCapName(e) => said(
            ERRCODE_INVALID_PARAMETER_VALUE,
            match e {
                NameError::Empty => "cap name must not be empty".into(),
                NameError::TooLong { len } => format!("cap name is too long ({len} bytes)"),
            },
            format!("A cap name is 1 to {MAX_NAME} bytes, counted in UTF-8."),
            Some("Use a shorter name; a hash of a long key works (md5(key) is 32 bytes).".into()),
        ),
        SlotError::BadShareName(e) => said(
            ERRCODE_INVALID_PARAMETER_VALUE,
            match e {
                NameError::Empty => "share name must not be empty".into(),
                NameError::TooLong { len } => format!("share name is too long ({len} bytes)"),
            },
            format!("A share name is 1 to {MAX_NAME} bytes, counted in UTF-8, as a cap name."),
            Some(
                "Use a shorter name; a hash of a long tenant id works (md5(id) is 32 bytes)."
                    .into(),
            ),
        ),
        SlotError::BadShareWeight { weight } => said(
            ERRCODE_INVALID_PARAMETER_VALUE,
            format!("share weight {weight} is out of range"),
            format!(
                "A share's weight is 1 to {}: its slots, when shares compete, in proportion \
                 to the others' weights.",
                stage_e_core::fair::MAX_WEIGHT
            ),
            Some("Use a weight from 1 to 16.".into()),
        ),
        SlotError::BadShareCeiling { ceiling } => said(
            ERRCODE_INVALID_PARAMETER_VALUE,
            format!("share max_slots {ceiling} is out of range"),
            "A share's max_slots is at least 1 (the most slots it holds at once), or NULL for \
             no ceiling."
                .into(),
            Some("Use NULL for no ceiling.".into()),
        ),
        SlotError::CapTooLongHere {
            len,
            encoding,
            what,
        } => said(
            ERRCODE_INVALID_PARAMETER_VALUE,
            format!(
                "{} name is too long in encoding {encoding} ({len} bytes)",
                what.word()
            ),
            format!(
                "A {} name is 1 to {MAX_NAME} bytes, counted in UTF-8 and in the database's \
                 encoding ({encoding}), in which {} keeps it.",
                what.word(),
                match what {
                    NameOf::Cap => "its counter row",
                    NameOf::Share => "stage_e_share_policy",
                }
            ),
            Some("Use a shorter name; a hash of a long key works (md5(key) is 32 bytes).".into()),
        ),
        SlotError::CapNotUtf8 {
            at,
            bytes,
            len,
            what,
        } => said(
            ERRCODE_CHARACTER_NOT_IN_REPERTOIRE,
            format!(
                "{} name is not valid UTF-8: invalid byte sequence {} at byte {}",
                what.word(),
                bytes[..*len as usize]
                    .iter()
                    .map(|b| format!("0x{b:02x}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                at + 1
            ),
            match what {
                NameOf::Cap => {
                    "In a SQL_ASCII database, which keeps whatever bytes it is sent, a cap name \
                     is read as UTF-8, so that one name is one cap in every database of the \
                     server; nothing was taken or changed."
                }
                NameOf::Share => {
                    "In a SQL_ASCII database, which keeps whatever bytes it is sent, a share \
                     name is read as UTF-8, as a cap name is; nothing was taken or changed."
                }
            }
            .into(),
            Some(format!(
                "Send {} names in UTF-8 (client_encoding has no effect in a SQL_ASCII \
                 database), or use names of ASCII characters only.",
                what.word()
            )),
        ),
        SlotError::Named(e) => describe_named(&e.cap, &e.what),
    }
}

/// An error about cap `cap`.
fn describe_named(cap: &str, e: &NamedError) -> Described {
    use PgSqlErrorCode::*;
    match *e {
        NamedError::Cap(ref e) => describe_cap(cap, e),
        NamedError::NoDurableRoom => said(
            ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!("the lease horizon of cap \"{cap}\" could not be made durable"),
            "A lease is granted only once a committed row covers its expiry, so that a crash or \
             a failover cannot free it early; no row was committed within 10 s, so no lease was \
             granted or renewed."
                .into(),
            Some(
                "Check that the stage_e_slots launcher runs and that its flusher can write \
                 stage_e_lease_horizon (the server log says why not)."
                    .into(),
            ),
        ),
        NamedError::NotLeaseOwner { slot, owner } => said(
            ERRCODE_INSUFFICIENT_PRIVILEGE,
            format!(
                "permission denied to renew or release the lease of slot {slot} of cap \"{cap}\""
            ),
            format!(
                "The lease belongs to role {}, which took it; nothing was changed.",
                crate::session::role_name(owner)
            ),
            Some(
                "Renew or release a lease as the role that took it, a member of that role, or \
                 a member of pg_signal_backend (for a lease not taken by a superuser)."
                    .into(),
            ),
        ),
    }
}

/// What a cap that could not be made or grown says.
pub fn describe_cap(cap: &str, e: &CapError) -> Described {
    use PgSqlErrorCode::*;
    match e {
        CapError::NoEntry { max_caps, held } => said(
            ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            format!("stage_e_slots has no room for cap \"{cap}\""),
            format!(
                "All {max_caps} caps (stage_e_slots.max_caps) are in use: {held} hold slots or \
                 have counts not yet flushed, the others are being reclaimed."
            ),
            Some(
                "Raise stage_e_slots.max_caps in postgresql.conf and restart, or lower \
                 stage_e_slots.flush_interval so idle caps are reclaimed sooner."
                    .into(),
            ),
        ),
        CapError::NoMemory { slots } => said(
            ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            format!("stage_e_slots has no room for {slots} slots of cap \"{cap}\""),
            "The slot memory (stage_e_slots.slot_memory) is taken by caps in use.".into(),
            Some("Raise stage_e_slots.slot_memory in postgresql.conf and restart.".into()),
        ),
        CapError::KeyCollision { other, key } => said(
            ERRCODE_DUPLICATE_OBJECT,
            format!("cap \"{cap}\" has the same lock key ({key}) as cap \"{other}\""),
            format!(
                "Both caps' slots would be the advisory locks ({key}, s) of this database, so \
                 they would share slots. Cap \"{other}\" is in use."
            ),
            Some(format!(
                "Update the extension (ALTER EXTENSION stage_e_slots UPDATE): since 0.7.0 a \
                 name whose key collides gets a key of its own. Until then rename one of the \
                 caps (stage_e_cap_key(name) shows a name's key), or, if \"{other}\" is \
                 default, change stage_e_slots.lock_key."
            )),
        ),
        CapError::KeysExhausted { covered } => said(
            ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            format!("cap \"{cap}\" found no free lock key"),
            format!(
                "All {covered} keys of its probe sequence are used by other caps of this \
                 database or recorded by their counter rows."
            ),
            Some(
                "Delete the counter rows of caps no longer used (or set \
                 stage_e_slots.counter_retention), or use another name."
                    .into(),
            ),
        ),
        CapError::OverShare { pool, share, limit } => said(
            ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            format!(
                "database \"{}\" holds its share of {}: no room for cap \"{cap}\"",
                crate::session::database_name(),
                pool_words(*pool)
            ),
            format!(
                "stage_e_slots.database_share is {share}% here, so one database may hold {limit} \
                 {}; nothing was taken.",
                pool_unit(*pool)
            ),
            Some(
                "Release slots and leases this database no longer needs (idle caps go by \
                 themselves), or ask a superuser to raise stage_e_slots.database_share for \
                 this database (ALTER DATABASE ... SET)."
                    .into(),
            ),
        ),
        CapError::Busy => said(
            ERRCODE_OBJECT_IN_USE,
            format!("cap \"{cap}\" could not be resized: it stayed in use"),
            "Using a cap with a larger n than before moves its slots to a larger block, which \
             waits for the calls in progress on that cap."
                .into(),
            Some("Try again.".into()),
        ),
    }
}

/// A pool, in words.
fn pool_words(pool: Pool) -> &'static str {
    match pool {
        Pool::Caps => "the caps (stage_e_slots.max_caps)",
        Pool::SlotMemory => "the slot memory (stage_e_slots.slot_memory)",
        Pool::Leases => "the lease records (stage_e_slots.max_leases)",
    }
}

fn pool_unit(pool: Pool) -> &'static str {
    match pool {
        Pool::Caps => "caps",
        Pool::SlotMemory => "pages of slot memory",
        Pool::Leases => "live leases",
    }
}

#[track_caller]
pub fn raise_flush(e: FlushError) -> ! {
    match e {
        FlushError::Slots(e) => raise(e),
        FlushError::Spi(e) => report::error(
            PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
            format!("stage_e_slots could not write the counter rows: {e}"),
            "The counts stay pending and are written by the next flush.".into(),
            None,
        ),
        FlushError::AgainInThisTransaction => report::error(
            PgSqlErrorCode::ERRCODE_OBJECT_IN_USE,
            "stage_e_slots counters were already flushed in this transaction".into(),
            "The rows are settled when this transaction commits or aborts.".into(),
            Some("Call stage_e_flush() or stage_e_reset_stats() once per transaction.".into()),
        ),
    }
}

#[track_caller]
pub fn raise_not_installed() -> ! {
    report::error(
        PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT,
        "extension \"stage_e_slots\" is not installed in this database".into(),
        "The counters are kept in the extension's table.".into(),
        Some("CREATE EXTENSION stage_e_slots;".into()),
    )
}

/// The WARNING of a release by a session that does not hold the slot.
#[track_caller]
pub fn warn_not_held(cap: &str, slot: i32, holder: Option<i32>, leased: bool) {
    let detail = match (holder, leased) {
        (Some(pid), _) => {
            format!("Slot {slot} of cap \"{cap}\" is held by pid {pid}; it keeps the slot.")
        }
        (None, true) => format!(
            "Slot {slot} of cap \"{cap}\" is leased; its holder keeps it (a lease is released \
             with stage_e_release_lease and its token)."
        ),
        (None, false) => format!("No session holds slot {slot} of cap \"{cap}\"."),
    };
    let message = if cap == DEFAULT_CAP {
        format!("slot {slot} was not held by this connection")
    } else {
        format!("slot {slot} of cap \"{cap}\" was not held by this connection")
    };
    report::ereport(
        PgLogLevel::WARNING,
        PgSqlErrorCode::ERRCODE_WARNING,
        message,
        Some(detail),
        Some(HINT_SAME_CONNECTION.into()),
    );
}

/// The WARNING of a renewal or a release by token that found no live lease with that token.
#[track_caller]
pub fn warn_not_current(
    what: &str,
    cap: &str,
    slot: i32,
    current: Option<crate::shmem::LeaseInfo>,
) {
    // Never the current token: it is the current holder's key to its slot.
    let detail = match current {
        Some(_) => format!(
            "Slot {slot} of cap \"{cap}\" is leased under another token; its holder keeps it."
        ),
        None => format!("Slot {slot} of cap \"{cap}\" has no live lease."),
    };
    report::ereport(
        PgLogLevel::WARNING,
        PgSqlErrorCode::ERRCODE_WARNING,
        format!("{what}: the token is not the current lease of slot {slot} of cap \"{cap}\""),
        Some(detail),
        Some(
            "The lease expired and was freed (the slot may since be someone else's), or it was \
             released already. Stop the guarded work: its fencing token is stale."
                .into(),
        ),
    );
}

/// The WARNING of a renewal or a release by token of a lease that had expired.
#[track_caller]
pub fn warn_expired(what: &str, cap: &str, slot: i32, held_us: i64) {
    report::ereport(
        PgLogLevel::WARNING,
        PgSqlErrorCode::ERRCODE_WARNING,
        format!("{what}: the lease of slot {slot} of cap \"{cap}\" had expired"),
        Some(format!(
            "It was held for {:.3} s, past its ttl; it is now freed and counted as expired.",
            held_us as f64 / 1e6
        )),
        Some(
            "Renew before the ttl passes, or take the lease with a longer ttl. Work done after \
             the expiry was not guarded."
                .into(),
        ),
    );
}

// -- in words, for LOG lines: never Rust's Debug text ------------------------------------------

impl std::fmt::Display for SlotError {
    /// The ERROR's message: `stage_e_slots has no room for cap "x"`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&describe(self).message)
    }
}

impl std::fmt::Display for CapError {
    /// Why, without the cap's name (the caller names it).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CapError::NoEntry { max_caps, held } => write!(
                f,
                "all {max_caps} caps (stage_e_slots.max_caps) are in use ({held} hold slots or \
                 have counts not yet flushed)"
            ),
            CapError::NoMemory { slots } => write!(
                f,
                "the slot memory (stage_e_slots.slot_memory) has no room for {slots} more slots"
            ),
            CapError::KeyCollision { other, key } => write!(
                f,
                "it has the same lock key ({key}) as cap \"{other}\", which is in use"
            ),
            CapError::KeysExhausted { covered } => write!(
                f,
                "all {covered} keys of its probe sequence are taken by other caps"
            ),
            CapError::Busy => f.write_str("it stayed in use while it was being resized"),
            CapError::OverShare { pool, share, limit } => write!(
                f,
                "its database holds its share ({share}%: {limit} {}) of {}",
                pool_unit(*pool),
                pool_words(*pool)
            ),
        }
    }
}

impl std::fmt::Display for FlushError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FlushError::Slots(e) => write!(f, "{e}"),
            FlushError::Spi(e) => write!(f, "the counter rows could not be written ({e})"),
            FlushError::AgainInThisTransaction => {
                f.write_str("the counters were already flushed in this transaction")
            }
        }
    }
}
