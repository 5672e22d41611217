//! Adaptive and rate policies written into `stage_e_throttle_counter` by anything but the
//! extension's own statements: the table owner's UPDATE, INSERT or DELETE, a TRUNCATE, a COPY
//! into a database already in use. The rows are what a restart loads (`limits::restore`), so
//! what binds until then must be them too, or a cap would change its policy at the next restart
//! with nobody having asked (a row deleted, its cap unlimited after the restart).
//!
//! Interface: [`written`], from the table's statement trigger `stage_e_throttle_counter_written`.
//!
//! Protocol: after each such statement the policy rows are read (they include the statement's
//! changes) and compared with what binds at this transaction's commit: shared memory's policies
//! of the database, then the changes this transaction queued before, in order. Each difference
//! is queued as `stage_e_adapt`, `stage_e_adapt_off`, `stage_e_rate_limit` or
//! `stage_e_rate_limit_off` would queue it (`session::policy_changed`): reserved at the
//! pre-commit (53400 when no record is left, rolling the statement back), applied and logged at
//! the commit, dropped by a rollback or a rolled-back savepoint. The functions' own statements
//! (`sql::writing_ours`) are left to them, as are the flusher's, which write no policy.

use super::{limits, rates, SlotError};
use crate::names::quoted;
use crate::session::{self, Change};
use crate::shmem::{self, PolicyChange};
use crate::sql;
use stage_e_core::adapt::Bounds;
use std::collections::BTreeMap;

/// A statement that wrote `stage_e_throttle_counter` (`op`: INSERT, UPDATE, DELETE or
/// TRUNCATE), from the table's trigger: the policies its rows now say bind from the commit.
pub fn written(op: &str) -> Result<(), SlotError> {
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
    let Some(ext) = sql::extension() else {
        return Err(SlotError::NotLoaded);
    };
    let (adapt_rows, rate_rows) = match (limits::adapt_rows(&ext), rates::rate_rows(&ext)) {
        (Ok(a), Ok(r)) => (a, r),
        (Err(e), _) | (_, Err(e)) => crate::report::fail(e),
    };
    let by = format!(
        "stage_e_slots: role {} wrote stage_e_throttle_counter of database {} ({op})",
        quoted(&sql::current_role()),
        quoted(&sql::current_database()),
    );
    let (mut adaptive, mut rated) = binding_at_commit();
    for r in adapt_rows {
        let policy = (r.bounds, r.enforce);
        if adaptive.remove(&r.cap) != Some(policy) {
            let log = format!(
                "{by}, not through stage_e_adapt: cap {} is adaptive between {} and {} slots \
                 ({})",
                quoted(&r.cap),
                r.bounds.min,
                r.bounds.max,
                if r.enforce {
                    "enforced"
                } else {
                    "monitor mode"
                },
            );
            let set = PolicyChange::Set {
                bounds: r.bounds,
                enforce: r.enforce,
            };
            session::policy_changed(&r.cap, Change::Adapt(set), log);
        }
    }
    for cap in adaptive.into_keys() {
        let log = format!(
            "{by}, not through stage_e_adapt_off: cap {} is adaptive no more",
            quoted(&cap)
        );
        session::policy_changed(&cap, Change::Adapt(PolicyChange::Off), log);
    }
    for (on, policy) in rate_rows {
        let Some(policy) = policy else {
            return Err(SlotError::BadRateRow { on });
        };
        if rated.remove(&on) != Some(policy) {
            let log = format!(
                "{by}, not through stage_e_rate_limit: {} is limited to {}",
                rates::describe(&on),
                rates::said(policy),
            );
            session::policy_changed(&on, Change::Rate(Some(policy)), log);
        }
    }
    for on in rated.into_keys() {
        let log = format!(
            "{by}, not through stage_e_rate_limit_off: {} has no rate policy",
            rates::describe(&on)
        );
        session::policy_changed(&on, Change::Rate(None), log);
    }
    Ok(())
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
