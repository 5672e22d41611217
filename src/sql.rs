//! Every SQL statement the extension runs itself goes through this module (the background
//! flusher, `stage_e_flush`, `stage_e_reset_stats`, `stage_e_snapshot`, the schema lookup), and
//! keeps one rule: **no statement of ours may resolve to an object another role can create.**
//!
//! - Each runs with `search_path` pinned to `pg_catalog, pg_temp`, saved and restored around the
//!   statement as fmgr does for a function with `SET search_path`, so neither the database's,
//!   the role's nor the caller's setting applies.
//! - The extension's own objects are named with the extension's schema ([`extension`]),
//!   and every operator is written `OPERATOR(pg_catalog.x)`: a schema earlier in nobody's path
//!   can then supply a better-matching `+` or `=`.
//! - Reads go through read-only SPI ([`read`]), which assigns no transaction id: they work on a
//!   standby and in `BEGIN READ ONLY`. (pgrx's `Spi::get_one`/`Spi::run` take the read-write
//!   path and assign one.)
//!
//! The extension scripts (`extension_sql!` in `api`) follow the same rule for view bodies.
//! New SQL goes here, or follows this rule where it must live elsewhere.

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;
use pgrx::spi::{self, SpiClient};
use pgrx::Spi;
use std::ffi::CStr;

const PINNED_SEARCH_PATH: &CStr = c"pg_catalog, pg_temp";

/// Runs `f` with `search_path = pg_catalog, pg_temp`, restoring the caller's setting after.
pub fn pinned<R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: the fmgr_security_definer pattern. A new GUC nest level saves the setting; on the
    // success path AtEOXact_GUC(true, level) pops it. If `f` raises an ERROR, the (sub)transaction
    // abort pops every level above the surviving one, so the pinned value never leaks to the
    // caller. GUC_ACTION_SAVE is also the action allowed in parallel mode.
    unsafe {
        let level = pg_sys::NewGUCNestLevel();
        pg_sys::set_config_option(
            c"search_path".as_ptr(),
            PINNED_SEARCH_PATH.as_ptr(),
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

/// A read-only query session with the search path pinned; assigns no transaction id.
pub fn read<R>(f: impl FnOnce(&SpiClient<'_>) -> spi::Result<R>) -> spi::Result<R> {
    pinned(|| Spi::connect(f))
}

/// One writing statement with the search path pinned.
pub fn write(query: &str, args: &[DatumWithOid<'_>]) -> spi::Result<()> {
    pinned(|| Spi::connect_mut(|c| c.update(query, None, args).map(|_| ())))
}

/// `SET LOCAL name = value` for the rest of this transaction, without SQL.
pub fn set_local(name: &CStr, value: &CStr) {
    // SAFETY: as SET LOCAL does: the value is undone at transaction end.
    unsafe {
        pg_sys::set_config_option(
            name.as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_LOCAL,
            true,
            0,
            false,
        );
    }
}

/// The extension as installed in the current database.
pub struct Extension {
    /// Its schema, quoted for SQL.
    pub schema: String,
    pub version: String,
}

impl Extension {
    /// A database whose library was updated but whose `ALTER EXTENSION UPDATE` has not run:
    /// the 0.1.0 objects (one counter row, no caps) are still what its SQL sees.
    pub fn at_0_1_0(&self) -> bool {
        self.version == "0.1.0"
    }

    /// Whether its holders view shows leases (`token`, `expires_at`): 0.4.0 and later.
    pub fn has_leases(&self) -> bool {
        !matches!(self.version.as_str(), "0.1.0" | "0.2.0" | "0.3.0")
    }

    /// The counter columns its table has: the first five before 0.3.0 (the wait and hold
    /// counters came with 0.3.0, `expired` with 0.4.0), all of them since.
    pub fn counter_columns(&self) -> usize {
        match self.version.as_str() {
            "0.1.0" | "0.2.0" => crate::counters::COUNT_0_2_0,
            "0.3.0" => crate::counters::COUNT_0_3_0,
            _ => crate::counters::COUNT,
        }
    }
}

/// The extension in the current database, or None when it is not installed here.
pub fn extension() -> Option<Extension> {
    read(|c| {
        let row = c
            .select(
                "SELECT pg_catalog.quote_ident(n.nspname), e.extversion::pg_catalog.text \
                   FROM pg_catalog.pg_extension AS e \
                   JOIN pg_catalog.pg_namespace AS n \
                     ON n.oid OPERATOR(pg_catalog.=) e.extnamespace \
                  WHERE e.extname OPERATOR(pg_catalog.=) 'stage_e_slots'::pg_catalog.name",
                Some(1),
                &[],
            )?
            .first();
        Ok(match (row.get::<String>(1)?, row.get::<String>(2)?) {
            (Some(schema), Some(version)) => Some(Extension { schema, version }),
            _ => None,
        })
    })
    .ok()
    .flatten()
}

/// `current_database()`, without SQL.
pub fn current_database() -> String {
    // SAFETY: a syscache lookup of our own database inside a transaction; the palloc'd copy is
    // read at once.
    unsafe { owned(pg_sys::get_database_name(pg_sys::MyDatabaseId)) }
}

/// `current_user`, without SQL.
pub fn current_role() -> String {
    // SAFETY: as above; noerr = true returns NULL for a dropped role instead of an ERROR.
    unsafe { owned(pg_sys::GetUserNameFromId(pg_sys::GetUserId(), true)) }
}

/// # Safety
/// `p` is NULL or a valid C string.
unsafe fn owned(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: per the caller.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// A time counted in microseconds, as the `interval` SQL shows.
pub fn interval_us(us: u64) -> pgrx::prelude::Interval {
    let us = us.min(i64::MAX as u64) as i64;
    pgrx::prelude::Interval::new(0, 0, us)
        .unwrap_or_else(|_| pgrx::prelude::Interval::from_micros(0))
}
