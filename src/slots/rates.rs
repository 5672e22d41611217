//! Rate limits on their own (`stage_e_try_rate`): checks the arguments (class 22, nothing
//! charged), then decides and charges in one step on the key's arrival time in shared memory
//! (`shmem::try_rate`). Refused where a slot is: on a standby (its shared memory is not the
//! primary's, so it would grant the whole rate a second time) and in parallel mode.

use super::{check_name, ready, SlotError};
use crate::gucs;
use crate::session;
use crate::shmem::{self, NoRoom};
use stage_e_core::rate::{Decision, Rate};

/// `stage_e_try_rate(key, count, per, burst, cost)`, `per` in ns (None: NULL, or not a fixed
/// length).
pub fn try_rate(
    key: Option<&str>,
    count: Option<i32>,
    per_ns: Option<Option<i64>>,
    burst: Option<i32>,
    cost: Option<i32>,
) -> Result<Decision, SlotError> {
    ready()?;
    let key = check_name(key).map_err(|e| match e {
        SlotError::NullArgument { .. } => SlotError::NullArgument { name: "key" },
        e => e,
    })?;
    let count = count.ok_or(SlotError::NullArgument { name: "count" })?;
    let per = per_ns.ok_or(SlotError::NullArgument { name: "per" })?;
    let burst = burst.ok_or(SlotError::NullArgument { name: "burst" })?;
    let cost = cost.ok_or(SlotError::NullArgument { name: "cost" })?;
    let bad = |what, value: i64| SlotError::BadRate { what, value, burst };
    let rate = Rate::new(count, per.unwrap_or(-1), burst).map_err(|what| {
        let value = match what {
            stage_e_core::rate::BadRate::Count => count as i64,
            _ => burst as i64,
        };
        bad(what, value)
    })?;
    let cost = rate.cost(cost).map_err(|what| bad(what, cost as i64))?;
    let db = session::database();
    let share = gucs::database_share();
    shmem::try_rate(db, key.as_bytes(), rate, cost, share).map_err(|room| match room {
        NoRoom::Pool { max } => SlotError::NoRateKey { max, share: None },
        NoRoom::Share { share, limit } => SlotError::NoRateKey {
            max: gucs::max_rate_keys(),
            share: Some((share, limit)),
        },
    })
}
