//! Adaptive caps: `stage_e_adapt` and `stage_e_adapt_off`, what `stage_e_cap_limits` reads,
//! and the launcher's tick. The controller is `stage_e_core::adapt`; the records and the
//! enforced limit are `shmem::policies`; the acquisition paths apply the limit (`acquire`,
//! `search`).
//!
//! A policy change is transactional: the function writes the cap's row in the caller's
//! transaction, and the change reaches shared memory when that transaction commits (`hooks`);
//! a rollback, or a rolled-back savepoint, drops both. The call checks there is a record for a
//! new policy, but another session may take the last one before this transaction commits: so
//! its pre-commit reserves one per cap it sets (`reserve_committing`), raising 53400 (and
//! rolling the rows back) when none is left, and the commit fills what it reserved. A row that
//! says adaptive so always has its record in memory. The learned limit is written back to the
//! row by the flusher, so that a restart resumes from it (`horizons::load` restores it).

use super::{check_name, ready, SlotError};
use crate::gucs;
use crate::names::{quoted, Text};
use crate::session;
use crate::shmem::{self, PolicyChange, PolicyView};
use crate::sql;
use pgrx::datum::DatumWithOid;
use stage_e_core::adapt::Bounds;

/// `stage_e_adapt(cap, min_slots, max_slots, enforce)`.
pub fn adapt(
    cap: Option<&str>,
    min: Option<i32>,
    max: Option<i32>,
    enforce: Option<bool>,
) -> Result<(), SlotError> {
    ready()?;
    super::admission::ensure_loaded()?;
    let name = check_name(cap)?;
    let min = min.ok_or(SlotError::NullArgument { name: "min_slots" })?;
    let max = max.ok_or(SlotError::NullArgument { name: "max_slots" })?;
    let enforce = enforce.ok_or(SlotError::NullArgument { name: "enforce" })?;
    let bounds = Bounds::new(min, max, gucs::max_slots()).map_err(SlotError::BadBounds)?;
    shmem::policy_room(session::database(), name)
        .map_err(|e| SlotError::NoPolicyRecord { max: e.max })?;
    let Some(ext) = sql::extension() else {
        return Err(SlotError::NotLoaded);
    };
    // The row keeps what the cap has learned (as the commit will clamp it), not a stale copy.
    let learned = shmem::learned_limit(session::database(), name, bounds).map(|l| l as i32);
    sql::write(
        &sql::adapt_write_query(&ext),
        &[
            Text(name.to_string()).into(),
            DatumWithOid::from(bounds.min as i32),
            DatumWithOid::from(bounds.max as i32),
            DatumWithOid::from(enforce),
            DatumWithOid::from(learned),
        ],
    )
    .unwrap_or_else(|e| crate::report::fail(format!("stage_e_adapt: {e}")));
    let log = format!(
        "stage_e_slots: role {} made cap {} of database {} adaptive between {} and {} slots \
         ({})",
        quoted(&sql::current_role()),
        quoted(name),
        quoted(&sql::current_database()),
        bounds.min,
        bounds.max,
        if enforce { "enforced" } else { "monitor mode" },
    );
    session::policy_changed(
        name,
        session::Change::Adapt(PolicyChange::Set { bounds, enforce }),
        log,
    );
    Ok(())
}

/// `stage_e_adapt_off(cap)`: the caller's n alone again, from the commit.
pub fn adapt_off(cap: Option<&str>) -> Result<(), SlotError> {
    ready()?;
    super::admission::ensure_loaded()?;
    let name = check_name(cap)?;
    let Some(ext) = sql::extension() else {
        return Err(SlotError::NotLoaded);
    };
    sql::write(
        &sql::adapt_off_query(&ext),
        &[Text(name.to_string()).into()],
    )
    .unwrap_or_else(|e| crate::report::fail(format!("stage_e_adapt_off: {e}")));
    let log = format!(
        "stage_e_slots: role {} returned cap {} of database {} to the callers' n alone \
         (stage_e_adapt_off)",
        quoted(&sql::current_role()),
        quoted(name),
        quoted(&sql::current_database()),
    );
    session::policy_changed(name, session::Change::Adapt(PolicyChange::Off), log);
    Ok(())
}

/// The pre-commit of a transaction that changed policies (`hooks`): a record for each cap it
/// leaves adaptive, reserved until the transaction ends; an ERROR 53400 here rolls back the
/// rows it wrote, when another session took the last record since the call.
pub fn reserve_committing(changes: &[session::PendingPolicy]) {
    let mut set: Vec<&str> = Vec::new();
    for c in changes {
        let session::Change::Adapt(change) = c.change else {
            continue;
        };
        set.retain(|&cap| cap != c.cap);
        if matches!(change, PolicyChange::Set { .. }) {
            set.push(&c.cap);
        }
    }
    super::rates::reserve_committing(changes);
    if set.is_empty() {
        return;
    }
    if let Err(e) = shmem::reserve(session::database(), &set) {
        crate::report::error(
            pgrx::PgSqlErrorCode::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            "stage_e_slots has no room for another adaptive cap".into(),
            format!(
                "All {} adaptive policy records (stage_e_slots.max_adaptive_caps) were taken \
                 by other sessions before this transaction committed; it is rolled back, and no \
                 policy changed.",
                e.max
            ),
            Some(
                "Turn adaptation off for caps that need it no longer (stage_e_adapt_off), or \
                 raise stage_e_slots.max_adaptive_caps in postgresql.conf and restart; then \
                 run the transaction again."
                    .into(),
            ),
        );
    }
}

/// The commit of a transaction that changed policies (`hooks`): each reaches shared memory, in
/// order, and is logged (the line was made at the call, where catalogs can be read). The
/// pre-commit reserved a record for each cap it sets, so none should fail; no ERROR may be
/// raised here, so one that did would be said in a WARNING (its cap keeping the caller's n
/// alone). The reservations end with the transaction (`hooks`).
pub fn apply_committed(changes: Vec<session::PendingPolicy>) {
    let db = session::database();
    let now = session::now();
    for c in changes {
        let change = match c.change {
            session::Change::Adapt(change) => change,
            session::Change::Rate(policy) => {
                super::rates::apply_committed(db, &c.cap, policy, c.log);
                continue;
            }
            session::Change::Share => {
                shmem::share_policies_changed(db, now);
                crate::report::log(c.log);
                continue;
            }
        };
        match shmem::apply_policy(db, &c.cap, change, now) {
            Ok(()) => crate::report::log(c.log),
            Err(e) => {
                pgrx::warning!(
                    "stage_e_slots: cap {} is not adaptive: all {} adaptive policy records \
                 (stage_e_slots.max_adaptive_caps) were taken before this transaction committed",
                    quoted(&c.cap),
                    e.max
                )
            }
        }
    }
}

/// The rows of `stage_e_cap_limits` for this database. Reading needs the shared state only (a
/// standby shows what its own server learned: nothing, since it hands out no slot).
pub fn cap_limits() -> Result<Vec<PolicyView>, SlotError> {
    super::attached()?;
    if !session::in_recovery() {
        super::admission::ensure_loaded()?;
    }
    Ok(shmem::cap_limits(session::database()))
}

/// The launcher, every window while any cap is adaptive: learn, and log the moves (at most
/// one line per cap every 10 s; the ones left out are counted in the next).
pub fn tick() {
    let moved = shmem::adapt_tick(session::now());
    if moved.is_empty() {
        return;
    }
    pgrx::bgworkers::BackgroundWorker::transaction(|| {
        for m in moved {
            let db = sql::database_name(m.db).unwrap_or_else(|| m.db.to_string());
            let also = match m.unlogged {
                0 => String::new(),
                1 => "; 1 change since the last line".into(),
                k => format!("; {k} changes since the last line"),
            };
            crate::report::log(format!(
                "stage_e_slots: limit of cap {} of database {}: {}{also}",
                quoted(&m.cap),
                quoted(&db),
                m.step.describe()
            ));
        }
    });
}

/// The flusher of this database: writes the learned limits that changed into their rows (in
/// its transaction); what it wrote, to mark once that commits.
pub fn write_limits(ext: &sql::Extension) -> Result<Vec<shmem::ToWrite>, pgrx::spi::Error> {
    if !ext.version.has_adaptive() {
        return Ok(Vec::new());
    }
    let limits = shmem::limits_to_write(session::database());
    if limits.is_empty() {
        return Ok(limits);
    }
    let caps: Vec<Text> = limits.iter().map(|l| Text(l.cap.clone())).collect();
    let values: Vec<i32> = limits.iter().map(|l| l.limit as i32).collect();
    let baselines: Vec<Option<f64>> = limits.iter().map(|l| l.baseline_us).collect();
    sql::write(
        &sql::adapt_limits_query(ext),
        &[
            DatumWithOid::from(caps),
            DatumWithOid::from(values),
            DatumWithOid::from(baselines),
        ],
    )?;
    Ok(limits)
}

/// A load of this database (`horizons::load`): the policies its rows keep, with their learned
/// limits, and its rate policies.
pub fn restore(ext: &sql::Extension) -> Result<(), String> {
    super::rates::restore(ext)?;
    let (db, now) = (session::database(), session::now());
    for r in adapt_rows(ext)? {
        if let Err(e) =
            shmem::restore_policy(db, &r.cap, r.bounds, r.enforce, r.limit, r.baseline_us, now)
        {
            crate::report::log(format!(
                "stage_e_slots: cap {} is not adaptive after the restart: all {} adaptive \
                 policy records (stage_e_slots.max_adaptive_caps) are in use",
                quoted(&r.cap),
                e.max
            ));
        }
    }
    Ok(())
}

/// An adaptive policy as this database's row keeps it.
struct AdaptRow {
    cap: String,
    bounds: Bounds,
    enforce: bool,
    /// The learned limit and baseline the flusher last wrote.
    limit: Option<u32>,
    baseline_us: Option<f64>,
}

/// The adaptive policies of this database's rows (none before 0.9.0), their bounds as
/// [`row_bounds`] reads them.
fn adapt_rows(ext: &sql::Extension) -> Result<Vec<AdaptRow>, String> {
    if !ext.version.has_adaptive() {
        return Ok(Vec::new());
    }
    let rows = sql::read(|c| {
        let mut rows = Vec::new();
        for r in c.select(&sql::adapt_rows_query(ext), None, &[])? {
            rows.push((
                r.get::<crate::names::Text>(1)?.unwrap_or_default().0,
                r.get::<i32>(2)?.unwrap_or(1),
                r.get::<i32>(3)?.unwrap_or(1),
                r.get::<bool>(4)?.unwrap_or(true),
                r.get::<i32>(5)?,
                r.get::<f64>(6)?,
            ));
        }
        Ok(rows)
    })
    .map_err(|e| format!("reading the adaptive policies: {e}"))?;
    rows.into_iter()
        .map(|(cap, min, max, enforce, limit, baseline_us)| {
            Ok(AdaptRow {
                cap,
                bounds: row_bounds(min, max)?,
                enforce,
                limit: limit.map(|l| l.max(0) as u32),
                baseline_us,
            })
        })
        .collect()
}

/// A row's `adapt_min` and `adapt_max` as bounds: for a row a superuser edited past the bounds
/// of this server, the nearest valid ones.
pub(super) fn row_bounds(min: i32, max: i32) -> Result<Bounds, String> {
    let max_slots = gucs::max_slots();
    let max = max.clamp(1, max_slots as i32);
    Bounds::new(min.clamp(1, max), max, max_slots).map_err(|e| format!("{e:?}"))
}

/// The extension was dropped from this database, or the database itself: its policies end.
pub fn end_database(db: u32) {
    shmem::clear_policies(db);
    shmem::clear_rate_policies(db);
}

/// Whether the launcher has adaptive caps to tick.
pub fn any() -> bool {
    shmem::policy_count() > 0
}
