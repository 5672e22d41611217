//! Adaptive and rate policies written into `stage_e_throttle_counter` by anything but the
//! extension's own statements: the table owner's UPDATE, INSERT or DELETE, a TRUNCATE, a COPY
//! into a database already in use. The rows are what a restart loads (`limits::restore`), so
//! what binds until then must be them too, or a cap would change its policy at the next restart
//! with nobody having asked (a row deleted, its cap unlimited after the restart).
//!
//! Interface: [`written`], from the table's statement trigger `stage_e_throttle_counter_written`.
//!
//! Protocol: after each such statement, this transaction's policy changes are what its rows
//! now say, and only its rows: the caps whose row it wrote (the row's `xmin` is its own), and
//! the caps whose row is gone. Only the rows that have a policy, or whose cap has one, are read
//! (through indexes, as the table's owner): a row written here with neither changes nothing.
//! Each is compared with what binds at this transaction's commit (shared memory's policies of
//! the database, then the changes the transaction queued before, in order), and each
//! difference is queued as `stage_e_adapt`, `stage_e_adapt_off`, `stage_e_rate_limit` or
//! `stage_e_rate_limit_off` would queue it (`session::policy_changed`): reserved at the
//! pre-commit (53400 when no record is left, rolling the statement back), applied and logged at
//! the commit, dropped by a rollback or a rolled-back savepoint.
//!
//! Other sessions may change other caps' policies meanwhile, so the rows are read after shared
//! memory and with the latest snapshot (`sql::read_latest`), not the statement's: a commit shared
//! memory shows is then in the rows too, and a row written by another session is left to that
//! session's commit (its row lock keeps a row written here from changing under this one). The
//! functions' own statements (`sql::writing_ours`) are left to them, as are the flusher's,
//! which write no policy.

use super::{limits, rates, SlotError};
use crate::gucs;
use crate::names::{quoted, Text};
use crate::session::{self, Change};
use crate::shmem::{self, PolicyChange};
use crate::sql;
use stage_e_core::adapt::Bounds;
use std::collections::{BTreeMap, BTreeSet};

/// A statement that wrote `stage_e_throttle_counter` (`op`: INSERT, UPDATE, DELETE or
/// TRUNCATE), from the table's trigger: the policies its rows now say bind from the commit.
/// `table` is the one the trigger fired on, which it checked is the extension's.
pub fn written(op: &str, table: &sql::Table) -> Result<(), SlotError> {
    if sql::writing_ours() || super::attached().is_err() {
        // Ours: the function that wrote queued its change. Not attached (the library is not
        // preloaded): no policy binds anywhere, and a restore must still fill the table.
        return Ok(());
    }
    // A database loads its policies from the committed rows: once it has, this commit's rows
    // are this transaction's to bring. One that cannot load now (no launcher yet, no room for
    // another database) reads them, committed, at its load.
    if super::admission::ensure_loaded().is_err() {
        return Ok(());
    }
    let (adaptive, rated) = binding_at_commit();
    let caps: BTreeSet<&String> = adaptive.keys().chain(rated.keys()).collect();
    let rows = rows_now(table, caps).unwrap_or_else(|e| crate::report::fail(e));
    // What this transaction changes: the policies of the rows it wrote, and of those gone.
    let present: BTreeSet<&str> = rows.iter().map(|r| r.cap.as_str()).collect();
    let gone = |cap: &String| !present.contains(cap.as_str());
    let mut adapt_off: Vec<String> = adaptive.keys().filter(|c| gone(c)).cloned().collect();
    let mut rate_off: Vec<String> = rated.keys().filter(|c| gone(c)).cloned().collect();
    // Formatted only for a change: most statements written by hand change no policy.
    let by = || {
        format!(
            "stage_e_slots: role {} wrote stage_e_throttle_counter of database {} ({op})",
            quoted(&sql::current_role()),
            quoted(&sql::current_database()),
        )
    };
    for r in rows.iter().filter(|r| r.here) {
        match r.adapt {
            Some(policy) if adaptive.get(&r.cap) != Some(&policy) => {
                let (bounds, enforce) = policy;
                let log = format!(
                    "{}, not through stage_e_adapt: cap {} is adaptive between {} and {} \
                     slots ({})",
                    by(),
                    quoted(&r.cap),
                    bounds.min,
                    bounds.max,
                    if enforce { "enforced" } else { "monitor mode" },
                );
                let set = PolicyChange::Set { bounds, enforce };
                session::policy_changed(&r.cap, Change::Adapt(set), log);
            }
            None if adaptive.contains_key(&r.cap) => adapt_off.push(r.cap.clone()),
            _ => {}
        }
        match r.rate {
            Some(None) => return Err(SlotError::BadRateRow { on: r.cap.clone() }),
            Some(Some(policy)) if rated.get(&r.cap) != Some(&policy) => {
                let log = format!(
                    "{}, not through stage_e_rate_limit: {} is limited to {}",
                    by(),
                    rates::describe(&r.cap),
                    rates::said(policy),
                );
                session::policy_changed(&r.cap, Change::Rate(Some(policy)), log);
            }
            None if rated.contains_key(&r.cap) => rate_off.push(r.cap.clone()),
            _ => {}
        }
    }
    for cap in adapt_off {
        let log = format!(
            "{}, not through stage_e_adapt_off: cap {} is adaptive no more",
            by(),
            quoted(&cap)
        );
        session::policy_changed(&cap, Change::Adapt(PolicyChange::Off), log);
    }
    for on in rate_off {
        let log = format!(
            "{}, not through stage_e_rate_limit_off: {} has no rate policy",
            by(),
            rates::describe(&on)
        );
        session::policy_changed(&on, Change::Rate(None), log);
    }
    Ok(())
}

/// A counter row as the latest snapshot shows it.
struct Row {
    cap: String,
    /// Written by this transaction.
    here: bool,
    /// Its adaptive policy (bounds as `limits::row_bounds` reads them).
    adapt: Option<(Bounds, bool)>,
    /// Its rate policy; `Some(None)`: one that is not a valid rate.
    rate: Option<Option<rates::RatePolicy>>,
}

/// The counter rows of this database that have a policy, or whose cap has one that binds at
/// the commit (`caps`), with the latest snapshot (`sql::read_latest`), read as the table's
/// owner (`sql::as_owner`: every row, whatever the writing role may see). A cap of `caps`
/// without a row has none.
fn rows_now(table: &sql::Table, caps: BTreeSet<&String>) -> Result<Vec<Row>, String> {
    let caps: Vec<Text> = caps.into_iter().map(|c| Text(c.clone())).collect();
    let mut rows = Vec::new();
    let query = sql::policy_rows_query(&table.schema);
    gucs::index_scans(|| {
        sql::as_owner(table, || {
            sql::read_latest(&query, &[caps.into()], |r| {
                let cap = r.get::<Text>(1)?.unwrap_or_default().0;
                let here = r
                    .get::<i64>(2)?
                    .is_some_and(|x| sql::written_here(x as u32));
                let adapt = match (r.get::<i32>(3)?, r.get::<i32>(4)?) {
                    (Some(min), Some(max)) => Some((min, max, r.get::<bool>(5)?.unwrap_or(true))),
                    _ => None,
                };
                let rate = match (r.get::<i32>(6)?, r.get::<i64>(7)?, r.get::<i32>(8)?) {
                    (Some(count), per_us, burst) => Some(rates::row_rate(
                        count,
                        per_us.unwrap_or(1_000_000),
                        burst.unwrap_or(1),
                    )),
                    _ => None,
                };
                rows.push((cap, here, adapt, rate));
                Ok(())
            })
        })
    })?;
    rows.into_iter()
        .map(|(cap, here, adapt, rate)| {
            let adapt = match adapt {
                Some((min, max, enforce)) => Some((limits::row_bounds(min, max)?, enforce)),
                None => None,
            };
            Ok(Row {
                cap,
                here,
                adapt,
                rate,
            })
        })
        .collect()
}

/// The adaptive and rate policies of this database that bind once this transaction commits:
/// shared memory's, with the changes the transaction queued so far applied in order.
#[allow(clippy::type_complexity)]
fn binding_at_commit() -> (
    BTreeMap<String, (Bounds, bool)>,
    BTreeMap<String, rates::RatePolicy>,
) {
    let db = session::database();
    let mut adaptive: BTreeMap<_, _> = shmem::cap_limits(db)
        .into_iter()
        .map(|p| (p.cap, (p.bounds, p.enforce)))
        .collect();
    let mut rated: BTreeMap<_, _> = shmem::rate_policies(db)
        .into_iter()
        .map(|p| (p.on, (p.count, p.per_ns, p.burst)))
        .collect();
    for p in session::pending_policies() {
        match p.change {
            Change::Adapt(PolicyChange::Set { bounds, enforce }) => {
                adaptive.insert(p.cap, (bounds, enforce));
            }
            Change::Adapt(PolicyChange::Off) => {
                adaptive.remove(&p.cap);
            }
            Change::Rate(Some(policy)) => {
                rated.insert(p.cap, policy);
            }
            Change::Rate(None) => {
                rated.remove(&p.cap);
            }
            Change::Share => {}
        }
    }
    (adaptive, rated)
}
