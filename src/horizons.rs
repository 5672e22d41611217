//! The flusher's part of the lifecycle (`docs/lifecycle.md`): loading a database's durable
//! lease state into shared memory after a start or a promotion, and writing each cap's lease
//! horizon, token floor and journal ahead of need.
//!
//! Both run in the flusher's own transaction. A load changes shared memory before that
//! transaction commits, but only with what is already committed (rows it reads), so an abort
//! loses nothing. An advance is published ([`publish`]) only after its transaction committed:
//! a grant never relies on a horizon that is not on disk.

use crate::gucs;
use crate::names::Text;
use crate::session;
use crate::shmem::{self, Cap, CapRef};
use crate::sql::{self, Extension};
use pgrx::datetime::TimestampWithTimeZone;
use stage_e_core::lifecycle;

/// A journal is rewritten at most this often per cap (while its leases change).
pub const JOURNAL_EVERY_US: i64 = 1_000_000;

/// One row of `stage_e_lease_horizon`.
struct Row {
    cap: String,
    horizon: i64,
    floor: u64,
    n: u32,
    /// (slot, token, expires_at, owner) of each journaled lease.
    journal: Vec<(u32, u64, i64, u32)>,
}

fn ts(us: i64) -> String {
    TimestampWithTimeZone::try_from(us).map_or_else(|_| format!("{us} µs"), |t| t.to_string())
}

/// Loads database `db` (the flusher's, connected to it): token floors always; after a crash or
/// a promotion, holds and dormant leases too; then the adaptive policies, by `restore_policies`
/// (`slots::limits::restore`, passed in: the policies' rules live above this floor). Marks it
/// loaded.
pub fn load(
    db: u32,
    ext: Option<&Extension>,
    restore_policies: &dyn Fn(&Extension) -> Result<(), String>,
) -> Result<(), String> {
    let Some(ext) = ext.filter(|e| e.version.has_lease_horizon()) else {
        // No table (the extension is not here, or not yet updated): 0.5.0's behaviour.
        shmem::mark_loaded(db, false, 0);
        return Ok(());
    };
    let kind = shmem::start_kind();
    let rows = read_rows(ext).map_err(|e| format!("reading stage_e_lease_horizon: {e}"))?;
    let recovery_hold = gucs::recovery_hold_us();
    let holds = kind.holds();
    let held_caps: Vec<String> = if holds && recovery_hold > 0 {
        sql::read(|c| {
            c.select(&sql::counter_caps_query(ext), None, &[])?
                .map(|r| r.get::<Text>(1).map(|c| c.unwrap_or_default().0))
                .collect()
        })
        .map_err(|e| format!("reading stage_e_throttle_counter: {e}"))?
    } else {
        Vec::new()
    };
    let now = session::now();
    let since = match shmem::recovered_at() {
        0 => now,
        t => t,
    };
    let recovery_until = since.saturating_add(recovery_hold);
    let database = sql::current_database();
    let mut min_token = 0;
    for row in &rows {
        min_token = min_token.max(row.floor);
        // A cap already made (its counts restored at start) starts above its floor too.
        if let Some(cap) = shmem::lookup(db, &row.cap) {
            cap.load_row(row.floor, row.horizon);
        }
        let rh = held_caps.contains(&row.cap).then_some(recovery_until);
        let hold = lifecycle::hold_for(kind, now, Some(row.horizon), rh);
        // A cap only with a floor to restore, not held: made when it is next used (its tokens
        // then start above the database's highest floor).
        if hold.is_none() {
            continue;
        }
        let cap = make_cap(db, &row.cap, row.n)?;
        cap.load_row(row.floor, row.horizon);
        let mut reclaimable = 0;
        for &(slot, token, expires_at, owner) in &row.journal {
            if expires_at > now
                && slot < row.n
                && cap.restore_lease(slot, token, now, expires_at, owner)
            {
                reclaimable += 1;
            }
        }
        if let Some((until, reason)) = hold {
            cap.hold(until, reason);
            log_hold(&cap.name(), &database, until, reason.as_str(), reclaimable);
        }
    }
    for name in held_caps
        .iter()
        .filter(|c| !rows.iter().any(|r| &r.cap == *c))
    {
        if let Some((until, reason)) = lifecycle::hold_for(kind, now, None, Some(recovery_until)) {
            let cap = make_cap(db, name, 1)?;
            cap.hold(until, reason);
            log_hold(name, &database, until, reason.as_str(), 0);
        }
    }
    restore_policies(ext)?;
    shmem::mark_loaded(db, true, min_token);
    Ok(())
}

fn log_hold(cap: &str, database: &str, until: i64, reason: &str, reclaimable: usize) {
    let (cap, database) = (crate::names::quoted(cap), crate::names::quoted(database));
    crate::report::log(format!(
        "stage_e_slots: cap {cap} of database {database} is held back until {} ({reason}): {}",
        ts(until),
        if reason == "recovery_hold" {
            "stage_e_slots.recovery_hold keeps it for work that outlived its connection".into()
        } else {
            format!(
                "leases the previous server granted may be live until then; {reclaimable} can \
                 be reclaimed by renewing them"
            )
        }
    ));
}

/// The cap `name` of database `db`, made with room for `n` slots; fails closed (the load is
/// retried) when there is no room for it.
fn make_cap(db: u32, name: &str, n: u32) -> Result<Cap, String> {
    let n = n.clamp(1, gucs::max_slots());
    let fail = |e| format!("cap \"{name}\" could not be held back: {e}");
    loop {
        let cap = shmem::create(db, name, n, session::database_exists, &|covered| {
            crate::keys::book(name, covered)
        })
        .map_err(fail)?
        .ok_or("not preloaded")?;
        if cap.capacity() >= n {
            return Ok(cap);
        }
        let r = cap.at;
        drop(cap);
        shmem::grow(r, n).map_err(fail)?;
    }
}

fn read_rows(ext: &Extension) -> pgrx::spi::Result<Vec<Row>> {
    sql::read(|c| {
        let mut rows = Vec::new();
        for r in c.select(&sql::horizon_rows_query(ext), None, &[])? {
            let journal: Vec<(u32, u64, i64, u32)> = r
                .get::<String>(5)?
                .and_then(|j| serde_json::from_str(&j).ok())
                .unwrap_or_default();
            rows.push(Row {
                cap: r.get::<Text>(1)?.unwrap_or_default().0,
                horizon: r
                    .get::<TimestampWithTimeZone>(2)?
                    .map_or(0, TimestampWithTimeZone::into_inner),
                floor: r.get::<i64>(3)?.unwrap_or(0).max(0) as u64,
                n: r.get::<i32>(4)?.unwrap_or(1).max(1) as u32,
                journal,
            });
        }
        Ok(rows)
    })
}

/// An advance written in the flusher's transaction, to publish once it has committed.
pub struct Written {
    cap: CapRef,
    horizon: i64,
    floor: u64,
    journal: u64,
}

impl Written {
    /// The cap's name, if it is still in use.
    pub fn name(&self) -> Option<String> {
        shmem::pin(self.cap).map(|c| c.name())
    }
}

/// Writes the rows of the caps of this database that need an advance, a floor or a fresh
/// journal; one statement.
pub fn advance(ext: &Extension) -> Result<Vec<Written>, pgrx::spi::Error> {
    if !ext.version.has_lease_horizon() {
        return Ok(Vec::new());
    }
    let now = session::now();
    let mut refs = Vec::new();
    let (mut caps, mut horizons, mut floors, mut ns, mut journals) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in shmem::cap_refs(session::database()) {
        let Some(cap) = shmem::pin(r) else { continue };
        let Some(w) = cap.horizon_write(now, JOURNAL_EVERY_US, gucs::lease_horizon_margin_us())
        else {
            continue;
        };
        refs.push((r, cap.name(), w.journal.1));
        caps.push(Text(cap.name()));
        horizons.push(TimestampWithTimeZone::try_from(w.horizon).ok());
        floors.push(w.floor as i64);
        ns.push(w.n as i32);
        journals.push(stage_e_core::lease_file::encode_journal(&w.journal.0));
    }
    if caps.is_empty() {
        return Ok(Vec::new());
    }
    let returned: Vec<(String, i64, u64)> = sql::write_returning(
        &sql::horizon_write_query(ext),
        &[
            caps.into(),
            horizons.into(),
            floors.into(),
            ns.into(),
            journals.into(),
        ],
        |rows| {
            rows.map(|r| {
                Ok((
                    r.get::<Text>(1)?.unwrap_or_default().0,
                    r.get::<TimestampWithTimeZone>(2)?
                        .map_or(0, TimestampWithTimeZone::into_inner),
                    r.get::<i64>(3)?.unwrap_or(0).max(0) as u64,
                ))
            })
            .collect()
        },
    )?;
    Ok(refs
        .into_iter()
        .filter_map(|(cap, name, journal)| {
            let (_, horizon, floor) = returned.iter().find(|(c, _, _)| *c == name)?;
            Some(Written {
                cap,
                horizon: *horizon,
                floor: *floor,
                journal,
            })
        })
        .collect())
}

/// After the flusher's transaction committed: what it wrote is now what grants check against.
pub fn publish(written: Vec<Written>) {
    let now = session::now();
    for w in written {
        if let Some(cap) = shmem::pin(w.cap) {
            cap.publish(w.horizon, w.floor, w.journal, now);
        }
    }
}
