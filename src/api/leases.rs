//! Leases and fencing tokens (`stage_e_lease`, `stage_e_renew`, `stage_e_release_lease`,
//! `stage_e_slot_token`, `stage_e_cap_key`). The result type `stage_e_lease_slot` is in
//! `sql/schema/lease_slot_type.sql`.

use super::CapArg;
use super::{to_micros, to_wait};
use crate::errors::{raise, warn_expired, warn_not_current};
use crate::hooks;
use crate::report::raise_internal;
use crate::slots::{self, LeaseAction};
use pgrx::prelude::*;

extension_sql_file!(
    "../../sql/schema/lease_slot_type.sql",
    name = "lease_slot_type",
    bootstrap
);

/// A slot of `[0, n)` of cap `cap` held by a token for `ttl` (not by this session, so it
/// survives transaction poolers): `(slot, token)`, or NULL when all n are taken after waiting
/// up to `wait`. Renew it with stage_e_renew, free it with stage_e_release_lease.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_lease(
    cap: Option<CapArg<'_>>,
    n: Option<i32>,
    ttl: Option<Interval>,
    wait: default!(Option<Interval>, "'0'"),
    fcinfo: pg_sys::FunctionCallInfo,
) -> Option<pgrx::composite_type!('static, "stage_e_lease_slot")> {
    let _call = crate::report::calling("stage_e_lease");
    lease_row(cap.as_deref(), n, ttl, wait, None, fcinfo)
}

/// A slot of `[0, n)` of cap `cap` held by a token for `ttl`, in fair share `share`, waiting
/// up to `wait` for one (in the order of the cap's fair queue): `(slot, token)`, or NULL.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_lease")]
fn stage_e_lease_share(
    cap: Option<CapArg<'_>>,
    n: Option<i32>,
    ttl: Option<Interval>,
    wait: Option<Interval>,
    share: Option<CapArg<'_>>,
    fcinfo: pg_sys::FunctionCallInfo,
) -> Option<pgrx::composite_type!('static, "stage_e_lease_slot")> {
    let _call = crate::report::calling("stage_e_lease");
    let share = super::slots::required_share(&share);
    lease_row(cap.as_deref(), n, ttl, wait, Some(share), fcinfo)
}

fn lease_row(
    cap: Option<&str>,
    n: Option<i32>,
    ttl: Option<Interval>,
    wait: Option<Interval>,
    share: Option<&str>,
    fcinfo: pg_sys::FunctionCallInfo,
) -> Option<pgrx::composite_type!('static, "stage_e_lease_slot")> {
    let wait = to_wait(wait);
    hooks::ensure();
    let got = slots::lease(cap, n, ttl.map(to_micros), wait, share).unwrap_or_else(|e| raise(e))?;
    // The result type is this function's own (in the extension's schema), found through the
    // call rather than by name, so search_path plays no part.
    // SAFETY: fcinfo and its flinfo are the live call's; get_func_rettype reads the syscache.
    let type_oid = unsafe { pg_sys::get_func_rettype((*(*fcinfo).flinfo).fn_oid) };
    let desc = pgrx::PgTupleDesc::for_composite_type_by_oid(type_oid)
        .unwrap_or_else(|| raise_internal("stage_e_lease's result type is not a row".into()));
    let values = [
        (got.slot as i32).into_datum(),
        (got.token as i64).into_datum(),
    ];
    // SAFETY: two datums for the type's two attributes (slot integer, token bigint), by value.
    let row = unsafe { PgHeapTuple::from_datums(desc, values) }
        .unwrap_or_else(|e| raise_internal(format!("stage_e_lease's result: {e}")));
    Some(row)
}

/// Extends the live lease of `slot` of `cap` to `ttl` from now, if `token` is its current
/// one; false with a WARNING when it expired or the token is not the slot's current one.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_renew(
    cap: Option<CapArg<'_>>,
    slot: Option<i32>,
    token: Option<i64>,
    ttl: Option<Interval>,
) -> bool {
    let _call = crate::report::calling("stage_e_renew");
    settle_lease(
        "stage_e_renew",
        cap.as_deref(),
        slot,
        token,
        LeaseAction::Renew {
            ttl_us: ttl.map(to_micros),
        },
    )
}

/// Frees the lease of `slot` of `cap` if `token` is its current one; false with a WARNING
/// (and a foreign release counted) otherwise, so a stale holder never frees a later one's slot.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_release_lease(cap: Option<CapArg<'_>>, slot: Option<i32>, token: Option<i64>) -> bool {
    let _call = crate::report::calling("stage_e_release_lease");
    settle_lease(
        "stage_e_release_lease",
        cap.as_deref(),
        slot,
        token,
        LeaseAction::Release,
    )
}

fn settle_lease(
    what: &str,
    cap: Option<&str>,
    slot: Option<i32>,
    token: Option<i64>,
    action: LeaseAction,
) -> bool {
    let name = cap.unwrap_or_default();
    let s = slot.unwrap_or_default();
    match slots::settle_lease(cap, slot, token, action).unwrap_or_else(|e| raise(e)) {
        slots::LeaseOutcome::Done => true,
        slots::LeaseOutcome::Expired { held_us } => {
            warn_expired(what, name, s, held_us);
            false
        }
        slots::LeaseOutcome::NotCurrent { current } => {
            warn_not_current(what, name, s, current);
            false
        }
    }
}

/// The fencing token of slot `slot` of `cap` if this session holds it (NULL otherwise): larger
/// than every earlier token of the cap, leases included, also across restarts.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_slot_token(cap: Option<CapArg<'_>>, slot: Option<i32>) -> Option<i64> {
    let _call = crate::report::calling("stage_e_slot_token");
    slots::slot_token(cap.as_deref(), slot)
        .unwrap_or_else(|e| raise(e))
        .map(|t| t as i64)
}

/// The first int4 of the advisory locks of `cap`: slot s of the cap is the lock
/// `(stage_e_cap_key(cap), s)`. The same on every server and after every restart for as long
/// as the cap's counter row lives (src/keys.rs).
#[pg_extern(stable, parallel_safe)]
fn stage_e_cap_key(cap: Option<CapArg<'_>>) -> i32 {
    let _call = crate::report::calling("stage_e_cap_key");
    slots::cap_key(cap.as_deref()).unwrap_or_else(|e| raise(e))
}
