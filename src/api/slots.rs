//! Session slots: take, release, hold, check (`stage_e_try_slot`, `stage_e_try_slots`,
//! `stage_e_release`, `stage_e_release_all`, `stage_e_holding`).

use super::to_wait;
use super::CapArg;
use crate::errors::{raise, warn_not_held};
use crate::hooks;
use crate::slots::{self, Caps, Release};
use pgrx::prelude::*;
use stage_e_core::directory::DEFAULT_CAP;

/// A slot in `[0, n)` of the cap `default` that this session now holds, or NULL when all n are
/// taken.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_try_slot(n: Option<i32>) -> Option<i32> {
    let _call = crate::report::calling("stage_e_try_slot");
    try_slot(Some(DEFAULT_CAP), n)
}

/// A slot in `[0, n)` of cap `cap` that this session now holds, or NULL when all n are taken.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_try_slot")]
fn stage_e_try_slot_cap(cap: Option<CapArg<'_>>, n: Option<i32>) -> Option<i32> {
    let _call = crate::report::calling("stage_e_try_slot");
    try_slot(cap.as_deref(), n)
}

/// A slot in `[0, n)` of cap `cap`, waiting up to `wait` for one (in arrival order); NULL
/// once `wait` has passed.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_try_slot")]
fn stage_e_try_slot_wait_cap(
    cap: Option<CapArg<'_>>,
    n: Option<i32>,
    wait: Option<Interval>,
) -> Option<i32> {
    let _call = crate::report::calling("stage_e_try_slot");
    try_slots(cap.as_deref(), n, Some(1), wait, None).map(|s| s[0])
}

/// A slot in `[0, n)` of cap `cap` in fair share `share`, waiting up to `wait` for one (in
/// the order of the cap's fair queue); NULL once `wait` has passed.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_try_slot")]
fn stage_e_try_slot_share(
    cap: Option<CapArg<'_>>,
    n: Option<i32>,
    wait: Option<Interval>,
    share: Option<CapArg<'_>>,
) -> Option<i32> {
    let _call = crate::report::calling("stage_e_try_slot");
    let share = required_share(&share);
    try_slots(cap.as_deref(), n, Some(1), wait, Some(share)).map(|s| s[0])
}

/// k distinct slots of `[0, n)` of cap `cap`, all or none, waiting up to `wait` for them;
/// NULL when they could not all be had in time.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_try_slots(
    cap: Option<CapArg<'_>>,
    n: Option<i32>,
    k: Option<i32>,
    wait: default!(Option<Interval>, "'0'"),
) -> Option<Vec<i32>> {
    let _call = crate::report::calling("stage_e_try_slots");
    try_slots(cap.as_deref(), n, k, wait, None)
}

/// k distinct slots of `[0, n)` of cap `cap` in fair share `share`, all or none, waiting up to
/// `wait` for them; NULL when they could not all be had in time.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_try_slots")]
fn stage_e_try_slots_share(
    cap: Option<CapArg<'_>>,
    n: Option<i32>,
    k: Option<i32>,
    wait: Option<Interval>,
    share: Option<CapArg<'_>>,
) -> Option<Vec<i32>> {
    let _call = crate::report::calling("stage_e_try_slots");
    let share = required_share(&share);
    try_slots(cap.as_deref(), n, k, wait, Some(share))
}

/// A `share` argument: NULL is class 22 (a call in no share omits the argument).
pub(super) fn required_share<'a>(share: &'a Option<CapArg<'_>>) -> &'a str {
    share
        .as_ref()
        .map(CapArg::share_name)
        .unwrap_or_else(|| raise(slots::SlotError::NullArgument { name: "share" }))
}

pub(crate) fn try_slots(
    cap: Option<&str>,
    n: Option<i32>,
    k: Option<i32>,
    wait: Option<Interval>,
    share: Option<&str>,
) -> Option<Vec<i32>> {
    let wait = to_wait(wait);
    hooks::ensure();
    slots::try_slots(cap, n, k, wait, share)
        .unwrap_or_else(|e| raise(e))
        .map(|t| t.into_vec().into_iter().map(|s| s as i32).collect())
}

fn try_slot(cap: Option<&str>, n: Option<i32>) -> Option<i32> {
    hooks::ensure();
    slots::try_slot(cap, n)
        .unwrap_or_else(|e| raise(e))
        .map(|s| s as i32)
}

/// True when this session held the slot of `default` and no longer does; false with a WARNING
/// otherwise.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_release(slot: Option<i32>) -> bool {
    let _call = crate::report::calling("stage_e_release");
    release(Some(DEFAULT_CAP), slot)
}

/// True when this session held the slot of `cap` and no longer does; false with a WARNING
/// otherwise.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_release")]
fn stage_e_release_cap(cap: Option<CapArg<'_>>, slot: Option<i32>) -> bool {
    let _call = crate::report::calling("stage_e_release");
    release(cap.as_deref(), slot)
}

fn release(cap: Option<&str>, slot: Option<i32>) -> bool {
    match slots::release(cap, slot).unwrap_or_else(|e| raise(e)) {
        Release::Released => true,
        Release::NotHeld { holder, leased } => {
            let (cap, slot) = (cap.unwrap_or_default(), slot.unwrap_or_default());
            warn_not_held(cap, slot, holder, leased);
            false
        }
    }
}

/// Releases every slot this session took with stage_e_try_slot, of every cap; returns how many.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_release_all() -> i32 {
    let _call = crate::report::calling("stage_e_release_all");
    slots::release_all(Caps::Every).unwrap_or_else(|e| raise(e)) as i32
}

/// Releases every slot of `cap` this session took; returns how many.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_release_all")]
fn stage_e_release_all_cap(cap: Option<CapArg<'_>>) -> i32 {
    let _call = crate::report::calling("stage_e_release_all");
    slots::release_all(Caps::One(cap.as_deref())).unwrap_or_else(|e| raise(e)) as i32
}

/// Whether this session holds the slot of `default` right now.
#[pg_extern(volatile, parallel_unsafe)]
fn stage_e_holding(slot: Option<i32>) -> bool {
    let _call = crate::report::calling("stage_e_holding");
    slots::holding(Some(DEFAULT_CAP), slot).unwrap_or_else(|e| raise(e))
}

/// Whether this session holds the slot of `cap` right now.
#[pg_extern(volatile, parallel_unsafe, name = "stage_e_holding")]
fn stage_e_holding_cap(cap: Option<CapArg<'_>>, slot: Option<i32>) -> bool {
    let _call = crate::report::calling("stage_e_holding");
    slots::holding(cap.as_deref(), slot).unwrap_or_else(|e| raise(e))
}
