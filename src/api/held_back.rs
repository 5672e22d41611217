//! Restarts, crashes and failovers (`stage_e_held_back`); the table and the view are in
//! `sql/schema/lifecycle.sql`.

use crate::errors::raise;
use crate::names::Text;
use crate::slots;
use pgrx::datetime::TimestampWithTimeZone;
use pgrx::prelude::*;

/// The caps of this database held back now, and why; the view `stage_e_held_back` reads it.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_held_back_internal() -> TableIterator<
    'static,
    (
        name!(cap, Text),
        name!(held_until, Option<TimestampWithTimeZone>),
        name!(reason, String),
    ),
> {
    let _call = crate::report::calling("stage_e_held_back_internal");
    let rows = slots::held_back().unwrap_or_else(|e| raise(e));
    TableIterator::new(rows.into_iter().map(|h| {
        (
            Text(h.cap),
            TimestampWithTimeZone::try_from(h.until).ok(),
            h.reason.to_string(),
        )
    }))
}

extension_sql_file!(
    "../../sql/schema/lifecycle.sql",
    name = "lifecycle",
    requires = [stage_e_held_back_internal],
);
