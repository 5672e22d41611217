//! Rate limits on their own (`stage_e_try_rate`): checks the arguments (class 22, nothing
//! charged), then decides and charges in one step on the key's arrival time in shared memory
//! (`shmem::try_rate`). Refused where a slot is: on a standby (its shared memory is not the
//! primary's, so it would grant the whole rate a second time) and in parallel mode.
//!
//! Rate policies on caps (`stage_e_rate_limit`, `stage_e_rate_limit_off`): transactional and
//! restricted like adaptive caps' (`limits`), kept in the counter rows, restored at a load.
//! An acquisition of a rate-limited cap asks its [`Gate`]: at admission it peeks (a call the
//! rate refuses now is throttled without looking at a slot, unless it waits); with its slots
//! taken and not yet handed out it charges, and gives them back when the rate refused
//! meanwhile: both or neither. While the cap has waiters, a newcomer takes nothing (a waiter
//! the rate holds back keeps its turn at the rate too), and a waiter the rate refused sleeps
//! until the instant it would be allowed (or a release, or its deadline).

use super::{check_name, ready, SlotError};
use crate::gucs;
use crate::names::{quoted, Text};
use crate::session;
use crate::shmem::{self, Counter, NoRoom};
use crate::sql;
use pgrx::datum::DatumWithOid;
use stage_e_core::flush::Counters;
use stage_e_core::rate::{Decision, Rate, Space};

/// `stage_e_try_rate(key, count, per, burst, cost)`, `per` in ns (None: NULL, or not a fixed
/// length).
pub fn try_rate(
    key: Option<&str>,
    count: Option<i32>,
    per_ns: Option<Option<i64>>,
    burst: Option<i32>,
    cost: Option<i32>,
) -> Result<Decision, SlotError> {
    ready()?;
    let key = check_name(key).map_err(|e| match e {
        SlotError::NullArgument { .. } => SlotError::NullArgument { name: "key" },
        e => e,
    })?;
    let count = count.ok_or(SlotError::NullArgument { name: "count" })?;
    let per = per_ns.ok_or(SlotError::NullArgument { name: "per" })?;
    let burst = burst.ok_or(SlotError::NullArgument { name: "burst" })?;
    let cost = cost.ok_or(SlotError::NullArgument { name: "cost" })?;
    let bad = |what, value: i64| SlotError::BadRate { what, value, burst };
    let rate = Rate::new(count, per.unwrap_or(-1), burst).map_err(|what| {
        let value = match what {
            stage_e_core::rate::BadRate::Count => count as i64,
            _ => burst as i64,
        };
        bad(what, value)
    })?;
    let cost = rate.cost(cost).map_err(|what| bad(what, cost as i64))?;
    let db = session::database();
    let share = gucs::database_share();
    shmem::try_rate(db, Space::Key, key.as_bytes(), rate, cost, share).map_err(|room| match room {
        NoRoom::Pool { max } => SlotError::NoRateKey { max, share: None },
        NoRoom::Share { share, limit } => SlotError::NoRateKey {
            max: gucs::max_rate_keys(),
            share: Some((share, limit)),
        },
    })
}

// -- rate policies on caps ------------------------------------------------------------------------

/// `stage_e_rate_limit(cap, count, per, burst)`: from the commit, every acquisition of `cap` (or,
/// for `prefix*`, of every cap whose name starts with `prefix` and has no policy of its own,
/// each at its own rate) is granted only when a slot is free and the rate allows, and charges
/// both or neither. Written in the caller's transaction, applied at its commit (`hooks`), as
/// `stage_e_adapt` is (`limits`).
pub fn rate_limit(
    cap: Option<&str>,
    count: Option<i32>,
    per_ns: Option<Option<i64>>,
    burst: Option<i32>,
) -> Result<(), SlotError> {
    ready()?;
    super::admission::ensure_loaded()?;
    let name = check_name(cap)?;
    let count = count.ok_or(SlotError::NullArgument { name: "count" })?;
    let per = per_ns.ok_or(SlotError::NullArgument { name: "per" })?;
    let burst = burst.ok_or(SlotError::NullArgument { name: "burst" })?;
    Rate::new(count, per.unwrap_or(-1), burst).map_err(|what| SlotError::BadRate {
        what,
        value: match what {
            stage_e_core::rate::BadRate::Count => count as i64,
            _ => burst as i64,
        },
        burst,
    })?;
    let per = per.unwrap_or_default();
    let db = session::database();
    shmem::rate_policy_room(db, name).map_err(|e| SlotError::NoRatePolicyRecord { max: e.max })?;
    let Some(ext) = sql::extension() else {
        return Err(SlotError::NotLoaded);
    };
    sql::write(
        &sql::rate_write_query(&ext),
        &[
            Text(name.to_string()).into(),
            DatumWithOid::from(count),
            DatumWithOid::from(sql::interval_us((per / 1_000) as u64)),
            DatumWithOid::from(burst),
        ],
    )
    .unwrap_or_else(|e| crate::report::fail(format!("stage_e_rate_limit: {e}")));
    let log = format!(
        "stage_e_slots: role {} limited {} of database {} to {}",
        quoted(&sql::current_role()),
        describe(name),
        quoted(&sql::current_database()),
        said((count as u32, per as u64, burst as u32)),
    );
    session::policy_changed(
        name,
        session::Change::Rate(Some((count as u32, per as u64, burst as u32))),
        log,
    );
    Ok(())
}

/// `stage_e_rate_limit_off(cap)`: from the commit, `cap` (or the pattern) has no rate policy
/// (a cap under a prefix falls back to the prefix's).
pub fn rate_limit_off(cap: Option<&str>) -> Result<(), SlotError> {
    ready()?;
    super::admission::ensure_loaded()?;
    let name = check_name(cap)?;
    let Some(ext) = sql::extension() else {
        return Err(SlotError::NotLoaded);
    };
    sql::write(&sql::rate_off_query(&ext), &[Text(name.to_string()).into()])
        .unwrap_or_else(|e| crate::report::fail(format!("stage_e_rate_limit_off: {e}")));
    let log = format!(
        "stage_e_slots: role {} took the rate policy off {} of database {}",
        quoted(&sql::current_role()),
        describe(name),
        quoted(&sql::current_database()),
    );
    session::policy_changed(name, session::Change::Rate(None), log);
    Ok(())
}

/// What a policy is on, as log lines say it: a cap, or every cap under a prefix.
pub(super) fn describe(on: &str) -> String {
    match on.strip_suffix('*') {
        Some(prefix) => format!("every cap starting with {}", quoted(prefix)),
        None => format!("cap {}", quoted(on)),
    }
}

fn human(ns: u64) -> String {
    let us = ns / 1_000;
    if us.is_multiple_of(1_000_000) {
        format!("{} s", us / 1_000_000)
    } else {
        format!("{} ms", us as f64 / 1_000.0)
    }
}

/// The pre-commit (`limits::reserve_committing`): a record for each rate policy the
/// transaction leaves set; 53400 (rolling its rows back) when another session took the last.
pub fn reserve_committing(changes: &[session::PendingPolicy]) {
    let mut set: Vec<&str> = Vec::new();
    for c in changes {
        let session::Change::Rate(policy) = c.change else {
            continue;
        };
        set.retain(|&cap| cap != c.cap);
        if policy.is_some() {
            set.push(&c.cap);
        }
    }
    if set.is_empty() {
        return;
    }
    if let Err(e) = shmem::reserve_rate_policies(session::database(), &set) {
        crate::report::error(
            pgrx::PgSqlErrorCode::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            "stage_e_slots has no room for another rate policy".into(),
            format!(
                "All {} rate policy records (stage_e_slots.max_rate_policies) were taken by \
                 other sessions before this transaction committed; it is rolled back, and no \
                 policy changed.",
                e.max
            ),
            Some(
                "Take off the rate policies no longer needed (stage_e_rate_limit_off), use a \
                 prefix policy ('tenant:*') for many caps, or raise \
                 stage_e_slots.max_rate_policies in postgresql.conf and restart; then run the \
                 transaction again."
                    .into(),
            ),
        );
    }
}

/// The commit (`limits::apply_committed`): the policy reaches shared memory and is logged. Its
/// record was reserved at the pre-commit; no ERROR may be raised here, so a failure is a
/// WARNING.
pub fn apply_committed(db: u32, on: &str, policy: Option<(u32, u64, u32)>, log: String) {
    if shmem::set_rate_policy(db, on, policy) {
        crate::report::log(log);
    } else {
        pgrx::warning!(
            "stage_e_slots: {} has no rate policy: all rate policy records \
             (stage_e_slots.max_rate_policies) were taken before this transaction committed",
            describe(on)
        );
    }
}

/// A load of this database (`limits::restore`): the rate policies its rows keep.
pub fn restore(ext: &sql::Extension) -> Result<(), String> {
    let db = session::database();
    for (on, policy) in rate_rows(ext)? {
        // The row's CHECK keeps it valid; a row edited past it anyway is left out, said.
        if !policy.is_some_and(|p| shmem::set_rate_policy(db, &on, Some(p))) {
            crate::report::log(format!(
                "stage_e_slots: {} has no rate policy after the restart: its row is not a \
                 valid rate, or all rate policy records (stage_e_slots.max_rate_policies) are \
                 in use",
                describe(&on)
            ));
        }
    }
    Ok(())
}

/// A rate policy as a row keeps it: (count, per in ns, burst).
pub(super) type RatePolicy = (u32, u64, u32);

/// The rate policies of this database's rows (none before 0.10.0), by the name or pattern they
/// are on; None for a row that is not a valid rate.
fn rate_rows(ext: &sql::Extension) -> Result<Vec<(String, Option<RatePolicy>)>, String> {
    if !ext.version.has_rates() {
        return Ok(Vec::new());
    }
    let rows = sql::read(|c| {
        let mut rows = Vec::new();
        for r in c.select(&sql::rate_rows_query(ext), None, &[])? {
            rows.push((
                r.get::<crate::names::Text>(1)?.unwrap_or_default().0,
                r.get::<i32>(2)?.unwrap_or(1),
                r.get::<i64>(3)?.unwrap_or(1_000_000),
                r.get::<i32>(4)?.unwrap_or(1),
            ));
        }
        Ok(rows)
    })
    .map_err(|e| format!("reading the rate policies: {e}"))?;
    Ok(rows
        .into_iter()
        .map(|(on, count, per_us, burst)| (on, row_rate(count, per_us, burst)))
        .collect())
}

/// A row's `rate_count`, `rate_per` (µs) and `rate_burst` as a policy; None if not a valid rate.
pub(super) fn row_rate(count: i32, per_us: i64, burst: i32) -> Option<RatePolicy> {
    let per_ns = per_us.saturating_mul(1_000);
    let valid = Rate::new(count, per_ns, burst).is_ok();
    valid.then_some((count as u32, per_ns as u64, burst as u32))
}

/// "`count` per `per` in bursts of `burst`", as the log lines say a rate.
pub(super) fn said((count, per_ns, burst): RatePolicy) -> String {
    format!("{count} per {} in bursts of {burst}", human(per_ns))
}

/// The rate of a rate-limited cap, for one acquisition: what the acquisition pipeline asks
/// (`admit`, `search`, `take_many`, `waiting`). The last answer is kept, for a waiter's timer.
pub struct Gate {
    db: u32,
    cap: String,
    rate: Rate,
    last: std::cell::Cell<Option<Decision>>,
    /// Whether the rate said no to this acquisition at least once: a call that ends throttled
    /// then counts as `rate_limited` too.
    refused: std::cell::Cell<bool>,
}

impl Gate {
    /// The gate of cap `cap` of this database, if it has a rate policy: two loads and no call
    /// when no database has any (the hot path of every cap then), and a pointer to carry.
    #[inline(always)]
    pub fn of(cap: &str) -> Option<Box<Gate>> {
        if !shmem::any_rate_policy() {
            return None;
        }
        Self::of_policy(cap)
    }

    #[cold]
    #[inline(never)]
    fn of_policy(cap: &str) -> Option<Box<Gate>> {
        let db = session::database();
        let policy = shmem::rate_policy(db, cap)?;
        Some(Box::new(Gate {
            db,
            cap: cap.to_string(),
            rate: policy.rate(),
            last: std::cell::Cell::new(None),
            refused: std::cell::Cell::new(false),
        }))
    }

    /// What a charge of `cost` would be told now, charging nothing.
    pub fn peek(&self, cost: u32) -> Decision {
        let d = shmem::peek_rate(self.db, Space::Cap, self.cap.as_bytes(), self.rate, cost);
        self.note(d);
        d
    }

    /// Charges `cost` if the rate allows it now; whether it did. Called with the slots taken
    /// and not yet handed out, which are given back when it did not (both or neither).
    pub fn charge(&self, cost: u32) -> Result<bool, SlotError> {
        let cost = cost.min(self.rate.burst); // k above the burst is refused at admission
        let share = gucs::database_share();
        let d = shmem::try_rate(
            self.db,
            Space::Cap,
            self.cap.as_bytes(),
            self.rate,
            cost,
            share,
        )
        .map_err(|room| match room {
            NoRoom::Pool { max } => SlotError::NoRateKey { max, share: None },
            NoRoom::Share { share, limit } => SlotError::NoRateKey {
                max: gucs::max_rate_keys(),
                share: Some((share, limit)),
            },
        })?;
        self.note(d);
        Ok(d.allowed)
    }

    fn note(&self, d: Decision) {
        self.last.set(Some(d));
        if !d.allowed {
            self.refused.set(true);
        }
    }

    /// Whether the rate refused this acquisition at least once.
    pub fn refused(&self) -> bool {
        self.refused.get()
    }

    /// How long until the last call told no would be allowed (None: it was allowed, or none
    /// was told since the last time this was asked).
    pub fn take_retry_after(&self) -> Option<std::time::Duration> {
        self.last
            .take()
            .and_then(|d| d.retry_after)
            .map(std::time::Duration::from_nanos)
    }

    /// The burst: a call of more slots than this can never be allowed.
    pub fn burst(&self) -> u32 {
        self.rate.burst
    }
}

/// A call ends throttled: counted as throttled, and as rate-limited too when its cap's rate
/// refused it at least once on the way (`gate`).
#[inline]
pub fn count_throttled(counters: &Counters, gate: Option<&Gate>) {
    counters.bump(Counter::Throttled, 1);
    if gate.is_some_and(|g| g.refused()) {
        counters.bump(Counter::RateLimited, 1);
    }
}

/// One row of `stage_e_rate_limits`: a rate-limited cap (or a prefix policy's pattern), its
/// policy, and for a cap how many calls of one slot its rate allows now and when the next is
/// allowed (µs of the wall clock; now when one is).
pub struct RateLimitRow {
    pub cap: String,
    pub count: u32,
    pub per_us: u64,
    pub burst: u32,
    pub remaining: Option<u32>,
    pub next_at: Option<i64>,
}

/// The rows of `stage_e_rate_limits` for this database: each policy, and under a prefix
/// policy each live cap it limits. Reading needs the shared state only, once the database's
/// rows are loaded into it (after a restart or a restore, before any acquisition, the view
/// would otherwise show none of the policies its rows keep); a standby shows none.
pub fn rate_limits() -> Result<Vec<RateLimitRow>, SlotError> {
    super::attached()?;
    if !session::in_recovery() {
        super::admission::ensure_loaded()?;
    }
    let db = session::database();
    let now = session::now();
    let policies = shmem::rate_policies(db);
    let mut rows = Vec::new();
    let row = |cap: String, p: &shmem::RatePolicy, live: bool| {
        let (remaining, next_at) = if live {
            let d = shmem::peek_rate(db, Space::Cap, cap.as_bytes(), p.rate(), 1);
            let wait_us = d.retry_after.map_or(0, |ns| ns.div_ceil(1_000) as i64);
            (Some(d.remaining), Some(now.saturating_add(wait_us)))
        } else {
            (None, None)
        };
        RateLimitRow {
            cap,
            count: p.count,
            per_us: p.per_ns / 1_000,
            burst: p.burst,
            remaining,
            next_at,
        }
    };
    for p in &policies {
        let pattern = p.on.ends_with('*');
        rows.push(row(p.on.clone(), p, !pattern));
        if pattern {
            for cap in shmem::caps(Some(db)) {
                let name = cap.name();
                if shmem::rate_policy(db, &name).is_some_and(|q| q.on == p.on) {
                    rows.push(row(name, p, true));
                }
            }
        }
    }
    Ok(rows)
}
