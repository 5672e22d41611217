//! The SQL surface, one file per part of it: `slots` (session slots), `leases` (leases and tokens),
//! `adapt` (adaptive caps), `rates` (rate limits), `shares` (fair shares), `held_back` (caps held back after a crash), `stats` (counters, holders,
//! waiters, load, flush and reset), `snapshot` (the jsonb document). Each function translates
//! arguments, calls `slots` or `flush`, and maps errors (`errors`). Slot functions are VOLATILE and
//! PARALLEL UNSAFE (advisory locks are refused in parallel workers). Arguments are `Option` so a
//! NULL reaches us and becomes a class-22 ERROR rather than a silent NULL from a STRICT function.
//! The one-argument forms are the cap `default`. No two functions of one name take the same number
//! of arguments, so a call whose parameters are all untyped (as node-postgres and asyncpg send
//! them) resolves to exactly one (tests/test_overloads.py). Every other SQL object is in
//! `sql/schema/`; functions of earlier versions whose shape changed, or that were retired, keep
//! their C symbols in `compat`.

use crate::errors::raise;
use crate::failures::SlotError;
use crate::names;
use crate::sql;
use pgrx::callconv::{Arg, ArgAbi};
use pgrx::prelude::*;
use pgrx::varlena;
use stage_e_core::wait::{self, Wait};
use std::borrow::Cow;

/// A cap name argument: SQL `text`, as UTF-8 (converted from the server encoding when the
/// function is called, see `names`' doc). Dereferences to the name. A name that cannot be one
/// is kept as its bytes and refused where the function first reads it, in the function's body,
/// so that the ERROR names that function (`report::calling`: arguments are converted before the
/// body runs).
pub struct CapArg<'fcx>(Result<Cow<'fcx, str>, &'fcx [u8]>);

impl std::ops::Deref for CapArg<'_> {
    type Target = str;

    #[inline]
    fn deref(&self) -> &str {
        match &self.0 {
            Ok(name) => name,
            Err(bytes) => refuse_name(bytes),
        }
    }
}

impl CapArg<'_> {
    /// The argument as a share name: a name refused is said to be a share's (share names are
    /// read as cap names are).
    pub fn share_name(&self) -> &str {
        match &self.0 {
            Ok(name) => name,
            Err(bytes) => refuse_share_name(bytes),
        }
    }
}

#[cold]
#[inline(never)]
fn refuse_name(bytes: &[u8]) -> ! {
    match names::name_in(bytes) {
        Err(e) => raise(e),
        Ok(_) => crate::report::raise_internal("a cap name refused once was accepted".into()),
    }
}

#[cold]
#[inline(never)]
fn refuse_share_name(bytes: &[u8]) -> ! {
    match names::name_in(bytes) {
        Err(e) => raise(e.of_share()),
        Ok(_) => crate::report::raise_internal("a share name refused once was accepted".into()),
    }
}

// SAFETY: the SQL type is `text` (below), whose datum is a varlena, which is what `&[u8]`
// unboxes; a NULL argument never reaches `unbox_arg_unchecked` (`Option<CapArg>` checks it, and
// the default `unbox_nullable_arg` does).
unsafe impl<'fcx> ArgAbi<'fcx> for CapArg<'fcx> {
    /// The hot path (a name inline and uncompressed, a UTF8 database) is a few instructions
    /// with no stack frame to speak of; everything else is out of line, in [`cap_arg_slow`].
    #[inline]
    unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
        // SAFETY: per the trait's contract, a non-NULL `text` argument: its datum is a pointer
        // to a varlena that lives as long as the call (`'fcx`). Inline and uncompressed (a
        // name always is, unless it came from a toasted column), its bytes are all that
        // `pg_detoast_datum_packed` would return, without its guarded call (a setjmp).
        unsafe {
            let datum = arg.unbox_arg_using_from_datum::<pg_sys::Datum>();
            let datum = datum.unwrap_or_else(|| unreachable!("a NULL cap is not unboxed"));
            let p = datum.cast_mut_ptr::<pg_sys::varlena>();
            if varlena::varatt_is_4b_u(p)
                || (varlena::varatt_is_1b(p) && !varlena::varatt_is_1b_e(p))
            {
                let bytes = varlena::varlena_to_byte_slice(p);
                if let Some(name) = names::name_in_utf8(bytes) {
                    return CapArg(Ok(Cow::Borrowed(name)));
                }
            }
            cap_arg_slow(datum)
        }
    }
}

/// A cap argument that is compressed or out of line, or in a database that is not UTF8.
///
/// # Safety
/// `datum` is a non-NULL `text` argument of the call (`'fcx`).
#[cold]
#[inline(never)]
unsafe fn cap_arg_slow<'fcx>(datum: pg_sys::Datum) -> CapArg<'fcx> {
    // SAFETY: per this function's contract.
    let bytes: &'fcx [u8] = unsafe { <&[u8]>::from_datum(datum, false) }
        .unwrap_or_else(|| unreachable!("a NULL cap is not unboxed"));
    CapArg(names::name_in(bytes).map_err(|_| bytes))
}

pgrx::impl_sql_translatable!(CapArg<'_>, arg_only = "TEXT");

/// Defines a `#[pg_extern]` returning rows of some leading columns followed by the counters,
/// so the counter columns are listed in one place (`stage_e_core::counters`' list, passed in by
/// `for_each_counter!`). The body yields `(leading columns, CounterValues)` pairs.
macro_rules! counter_table_fn {
    ([$($c:ident: $cty:tt),*]
     $(#[$attr:meta])*
     fn $name:ident($($args:tt)*) -> ($($lead:ident: $lty:tt),*) $body:block) => {
        $(#[$attr])*
        #[allow(clippy::type_complexity)]
        fn $name($($args)*) -> TableIterator<'static, ($(name!($lead, $lty),)* $(name!($c, $cty),)*)> {
            let rows: Vec<(($($lty,)*), CounterValues)> = $body;
            TableIterator::new(rows.into_iter().map(|(($($lead,)*), v)| {
                ($($lead,)* $(<$cty as $crate::api::FromCounter>::from_counter(v.$c),)*)
            }))
        }
    };
}

mod adapt;
mod held_back;
mod leases;
mod one_row;
mod rates;
mod shares;
pub(crate) mod slots;
mod snapshot;
mod stats;

pub use snapshot::snapshot_document;
pub use stats::{flush_rows, pending_rows, stats_rows, stats_rows_with_n, CurrentN};

/// A counter as SQL shows it: a count as bigint, a time (microseconds) as interval.
pub trait FromCounter {
    fn from_counter(v: u64) -> Self;
}

impl FromCounter for i64 {
    fn from_counter(v: u64) -> Self {
        v as i64
    }
}

impl FromCounter for Interval {
    fn from_counter(us: u64) -> Self {
        sql::interval_us(us)
    }
}

/// `table`, the one table the extension's trigger function `function` is for; an ERROR if it
/// fired on any other (a role attached it to a table of its own, where its writes would be
/// taken for policy changes and logged as such).
fn own_table(
    trigger: &PgTrigger<'_>,
    table: &'static std::ffi::CStr,
    function: &'static str,
) -> sql::Table {
    let fired_on = trigger.relid().unwrap_or(pg_sys::InvalidOid);
    sql::own_table(trigger.trigger().tgfoid, fired_on, table).unwrap_or_else(|| {
        raise(SlotError::NotOurTable {
            function,
            table: table.to_str().unwrap_or_default(),
        })
    })
}

/// A `wait` argument: NULL or negative is class 22.
fn to_wait(wait: Option<Interval>) -> Wait {
    wait.ok_or(SlotError::NullArgument { name: "wait" })
        .and_then(|w| {
            Wait::from_interval(w.months(), w.days(), w.micros()).ok_or(SlotError::NegativeWait)
        })
        .unwrap_or_else(|e| raise(e))
}

/// An interval as microseconds, saturating, so 'infinity' is a very long time.
fn to_micros(i: Interval) -> i64 {
    wait::interval_micros_saturating(i.months(), i.days(), i.micros())
}

// -- tables and views (sql/schema/) --------------------------------------------------------------

extension_sql_file!(
    "../../sql/schema/counter_table.sql",
    name = "counter_table",
    requires = [adapt::stage_e_throttle_counter_written],
);

extension_sql_file!(
    "../../sql/schema/shares.sql",
    name = "share_policy_table",
    requires = [shares::stage_e_share_policy_written],
);

extension_sql_file!(
    "../../sql/schema/views.sql",
    name = "views",
    requires = [
        "counter_table",
        stats::stage_e_pending_v5,
        stats::stage_e_slot_holders_internal_v4,
        stats::stage_e_slot_waiters_internal_v2,
        shares::stage_e_shares_internal,
        stats::stage_e_cap_load_internal,
        stats::stage_e_histogram_quantiles_internal,
        adapt::stage_e_cap_limits_internal,
        rates::stage_e_rate_limits_internal
    ],
);

extension_sql_file!(
    "../../sql/schema/privileges.sql",
    name = "privileges",
    requires = [
        stats::stage_e_flush_v5,
        stats::stage_e_reset_stats,
        stats::stage_e_reset_stats_cap,
        adapt::stage_e_adapt,
        adapt::stage_e_adapt_off,
        rates::stage_e_rate_limit,
        rates::stage_e_rate_limit_off,
        shares::stage_e_share,
        adapt::stage_e_throttle_counter_written,
        shares::stage_e_share_policy_written
    ],
);
