//! Fair shares of a cap (`stage_e_share`, restricted: EXECUTE revoked from PUBLIC, as a share's
//! policy binds every role that uses the cap) and the live shares behind `stage_e_shares`. The
//! `share` argument of the waiting acquisitions is in `slots` and `leases`.

use super::CapArg;
use crate::errors::raise;
use crate::hooks;
use crate::names::Text;
use crate::slots;
use crate::sql;
use pgrx::prelude::*;

/// From the commit of the calling transaction, share `share` of cap `cap` (or, for `'*'`,
/// every share of the cap without a policy of its own, the unnamed share included) has weight
/// `weight` (1 to 16) and holds at most `max_slots` of the cap's slots at once (NULL: no
/// ceiling).
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_share(
    cap: Option<CapArg<'_>>,
    share: Option<CapArg<'_>>,
    weight: default!(Option<i32>, "1"),
    max_slots: default!(Option<i32>, "NULL"),
) {
    let _call = crate::report::calling("stage_e_share");
    hooks::ensure(); // moves the database's generation of share policies at the commit
    let share = share.as_ref().map(CapArg::share_name);
    slots::shares::set_policy(cap.as_deref(), share, weight, max_slots).unwrap_or_else(|e| raise(e))
}

/// After every statement that writes `stage_e_share_policy` (the trigger of the same name):
/// one not made by `stage_e_share` (an UPDATE or DELETE by the table's owner, a restore's
/// COPY, a TRUNCATE) binds from its commit too, as `stage_e_share`'s write does.
#[pg_trigger]
fn stage_e_share_policy_written<'a>(
    trigger: &'a PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, PgTriggerError> {
    let op = trigger.op()?;
    super::own_table(
        trigger,
        c"stage_e_share_policy",
        "stage_e_share_policy_written",
    );
    hooks::ensure(); // moves the database's generation of share policies at the commit
    slots::shares::policy_written(&op.to_string());
    Ok(None)
}

/// One row per live share of a cap of the current database. Behind the view `stage_e_shares`.
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::type_complexity)]
fn stage_e_shares_internal() -> TableIterator<
    'static,
    (
        name!(cap, Text),
        name!(share, Option<Text>),
        name!(weight, i32),
        name!(max_slots, Option<i32>),
        name!(held, i32),
        name!(waiting, i32),
        name!(granted, i64),
        name!(wait_time, Interval),
    ),
> {
    let _call = crate::report::calling("stage_e_shares_internal");
    let rows = slots::shares::live().unwrap_or_else(|e| raise(e));
    TableIterator::new(rows.into_iter().map(|s| {
        (
            Text(s.cap),
            s.name.map(Text),
            s.weight as i32,
            s.ceiling.map(|c| c as i32),
            s.held as i32,
            s.waiting as i32,
            s.granted as i64,
            sql::interval_us(s.wait_us),
        )
    }))
}
