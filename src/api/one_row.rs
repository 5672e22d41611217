//! One row of a `RETURNS TABLE` function, handed back in materialize mode: what a hot function
//! of ours with a one-row result (`stage_e_try_rate`) returns instead of pgrx's
//! `TableIterator`.
//!
//! Protocol (PostgreSQL's `SFRM_Materialize`, executor/execSRF.c): the function is called once,
//! puts its row into a tuplestore made in the query's memory, sets `returnMode`, `setResult` and
//! `setDesc` of the call's `ReturnSetInfo`, and returns a null datum. The row is formed with
//! the caller's `expectedDesc` (a FunctionScan's or a ProjectSet's, built from the function's
//! own OUT parameters), checked against the row's types; a caller without one, or with another
//! shape, gets a descriptor made from the row's types. `setDesc` is a copy, which the caller
//! frees.
//!
//! Why not pgrx's `TableIterator`: it returns value per call, so every call of the function
//! makes a multi-call memory context, asks `get_call_result_type` for the descriptor (which
//! rebuilds it from `pg_proc`'s argument arrays each time), blesses it, forms a composite datum
//! the caller takes apart again, and is called a second time to say it is done: some 11,000 of
//! the 13,000 instructions of a `stage_e_try_rate` call (callgrind, PostgreSQL 15).
//!
//! The type is named `TableIterator` because pgrx's `#[pg_extern]` reads the result type by its
//! last path segment: a `TableIterator<'a, (name!(col, T), ...)>` is written as
//! `RETURNS TABLE (col T, ...)`, so the SQL stays what it was while the call takes this path.

use crate::report::{error, raise_internal};
use pgrx::callconv::{BoxRet, RetAbi};
use pgrx::prelude::*;
use pgrx::{pg_sys, PgTupleDesc};
use std::marker::PhantomData;

/// One row `Row` (a tuple of four columns) of a set-returning function.
pub struct TableIterator<'a, Row>(Row, PhantomData<&'a ()>);

impl<Row> TableIterator<'_, Row> {
    pub fn once(row: Row) -> Self {
        TableIterator(row, PhantomData)
    }
}

type Datums4 = ([pg_sys::Datum; 4], [bool; 4], [pg_sys::Oid; 4]);

/// The row as datums, nulls and each column's type.
fn datums4<A: IntoDatum, B: IntoDatum, C: IntoDatum, D: IntoDatum>(
    (a, b, c, d): (A, B, C, D),
) -> Datums4 {
    let values = [
        a.into_datum(),
        b.into_datum(),
        c.into_datum(),
        d.into_datum(),
    ];
    let nulls = values.map(|v| v.is_none());
    let datums = values.map(|v| v.unwrap_or(pg_sys::Datum::from(0)));
    (
        datums,
        nulls,
        [A::type_oid(), B::type_oid(), C::type_oid(), D::type_oid()],
    )
}

// SAFETY: `check_fcinfo_and_prepare` keeps the default (the function's allocations in the
// current memory context, which outlives the call); `box_ret_in_fcinfo` follows the
// materialize protocol (module doc) on the live call's `fcinfo`.
unsafe impl<A, B, C, D> RetAbi for TableIterator<'_, (A, B, C, D)>
where
    A: IntoDatum + BoxRet,
    B: IntoDatum + BoxRet,
    C: IntoDatum + BoxRet,
    D: IntoDatum + BoxRet,
{
    type Item = (A, B, C, D);
    type Ret = Self;

    fn to_ret(self) -> Self::Ret {
        self
    }

    unsafe fn box_ret_in_fcinfo(fcinfo: pg_sys::FunctionCallInfo, ret: Self::Ret) -> pg_sys::Datum {
        let (mut datums, mut nulls, types) = datums4(ret.0);
        // SAFETY: `fcinfo` is the live call's (the trait's contract).
        unsafe { materialize(fcinfo, &mut datums, &mut nulls, &types) }
    }

    unsafe fn move_into_fcinfo_fcx(self, _fcinfo: pg_sys::FunctionCallInfo) {}

    unsafe fn fill_fcinfo_fcx(&self, _fcinfo: pg_sys::FunctionCallInfo) {}
}

/// Hands back the row `datums`/`nulls` of column types `types` as the call's materialized set.
///
/// # Safety
/// `fcinfo` is the live call's; `datums` hold values of `types` where `nulls` is false.
unsafe fn materialize(
    fcinfo: pg_sys::FunctionCallInfo,
    datums: &mut [pg_sys::Datum],
    nulls: &mut [bool],
    types: &[pg_sys::Oid],
) -> pg_sys::Datum {
    // SAFETY: per the contract, `fcinfo` is live; `resultinfo` is checked to be a
    // ReturnSetInfo before it is read as one, and its econtext and expectedDesc are the
    // caller's, live for the call.
    unsafe {
        let rsinfo = (*fcinfo).resultinfo.cast::<pg_sys::ReturnSetInfo>();
        let materialize = pg_sys::SetFunctionReturnMode::SFRM_Materialize as i32;
        if rsinfo.is_null()
            || (*rsinfo).type_ != pg_sys::NodeTag::T_ReturnSetInfo
            || (*rsinfo).allowedModes & materialize == 0
        {
            error(
                PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
                "set-valued function called in context that cannot accept a set".into(),
                "The caller gave no ReturnSetInfo that allows a materialized set.".into(),
                Some("Call it in FROM: SELECT * FROM the_function(...).".into()),
            );
        }
        let expected = (*rsinfo).expectedDesc;
        let desc = if fits(expected, types) {
            expected
        } else {
            describe(types)
        };
        let random = (*rsinfo).allowedModes
            & pg_sys::SetFunctionReturnMode::SFRM_Materialize_Random as i32
            != 0;
        let query_memory = (*(*rsinfo).econtext).ecxt_per_query_memory;
        let old = pg_sys::MemoryContextSwitchTo(query_memory);
        let store = pg_sys::tuplestore_begin_heap(random, false, pg_sys::work_mem);
        pg_sys::tuplestore_putvalues(store, desc, datums.as_mut_ptr(), nulls.as_mut_ptr());
        (*rsinfo).returnMode = pg_sys::SetFunctionReturnMode::SFRM_Materialize;
        (*rsinfo).setResult = store;
        // The caller frees a descriptor that is not reference-counted: a copy, never its own.
        (*rsinfo).setDesc = pg_sys::CreateTupleDescCopy(desc);
        pg_sys::MemoryContextSwitchTo(old);
        (*fcinfo).isnull = true;
        pg_sys::Datum::from(0)
    }
}

/// Whether `desc` has exactly the columns `types`, none dropped.
///
/// # Safety
/// `desc` is NULL or a live descriptor.
unsafe fn fits(desc: pg_sys::TupleDesc, types: &[pg_sys::Oid]) -> bool {
    if desc.is_null() {
        return false;
    }
    // SAFETY: per the contract, a live descriptor; borrowed, never freed by the wrapper
    // (which reads its attributes the way the major lays them out: 18 puts them after its
    // compact ones).
    let desc = unsafe { PgTupleDesc::from_pg_unchecked(desc) };
    desc.len() == types.len()
        && types.iter().enumerate().all(|(i, &ty)| {
            desc.get(i)
                .is_some_and(|attr| attr.atttypid == ty && !attr.attisdropped)
        })
}

/// A descriptor of columns `types`, in the current memory context (a caller that gave none).
#[cold]
fn describe(types: &[pg_sys::Oid]) -> pg_sys::TupleDesc {
    // SAFETY: a template of `types.len()` attributes, each initialized once below, by number
    // from 1; TupleDescInitEntry looks each type up in the syscache (an ERROR if unknown).
    unsafe {
        let desc = pg_sys::CreateTemplateTupleDesc(types.len() as i32);
        for (i, &ty) in types.iter().enumerate() {
            pg_sys::TupleDescInitEntry(desc, (i + 1) as i16, std::ptr::null(), ty, -1, 0);
        }
        if (*desc).natts as usize != types.len() {
            raise_internal("a one-row result's descriptor was not made".into());
        }
        desc
    }
}
