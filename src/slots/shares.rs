//! Acquiring in a fair share (issue 38): a call that names a share, and every call on a cap
//! that has live shares (a call without a name is in the cap's unnamed share), takes its
//! slots through the cap's fair queue (`stage_e_core::fair`, placed by `shmem::shares`).
//! A cap that never had a share keeps the path of `super::acquire` (one load more).
//!
//! Protocol of a call that does not wait (`take_now`):
//! 1. under the waits lock: the fair queue says whether the call's share may take `k` of the
//!    free slots now (within its ceiling; while the cap has waiters in shares, only if its
//!    share would be served first), and if so reserves them in the share (charged, counted
//!    held): so two calls of one share at its ceiling cannot both pass;
//! 2. without the lock, as any call: the slots claimed and locked (`super::take`), the rate
//!    charged;
//! 3. taken: each slot's holder record names the share, so that whoever ends the slot (a
//!    release, the session's end, a lease's release or expiry) gives it back to the share
//!    (`held::drop_bookkeeping`, `shmem::leases`). Not taken (a raw lock, a waiter that
//!    claimed first, the rate): the reservation is given back under the lock.
//!
//! The share of a slot is written into its holder record before the holder is published (the
//! slot is then claimed by the taker alone) and read by its release before the record is
//! cleared; only the holder releases a session slot, and a lease's slot is ended under its
//! lease record's lock, so no release misses it.
//!
//! A call that waits (`waiting`) joins the cap's queue in its share (`Cap::enqueue_in_share`):
//! the front seats are in the fair queue's order of service. A seated waiter, woken, takes
//! session slots without the lock, in no share, and then under it its grant is counted in its
//! share and the slots' holder records name it (`Cap::granted_in_line`): only the waiter's own
//! session releases them, and it has not yet. Leases, which another session may release, are
//! taken under the lock and counted in the same round (`Cap::take_in_line`).

//! A share's policy (weight, ceiling) is the row of `stage_e_share_policy` for the cap and the
//! share, else the cap's `'*'` row, else weight 1 and no ceiling. `stage_e_share` writes it in
//! the caller's transaction; its commit moves the database's generation of share policies
//! (`shmem::share_policies_changed`), and each backend keeps the policies it read for a cap
//! while the generation stays ([`POLICIES`]). Read with the transaction's snapshot, a policy
//! is kept only if the transaction began after the generation last moved, so a snapshot older
//! than the commit is never kept under the new generation.

use super::{check_name, ready, Kind, SlotError, Taken};
use crate::backend::BackendLocal;
use crate::gucs;
use crate::names::{quoted, Text};
use crate::session;
use crate::shmem::{self, Cap};
use crate::sql;
use pgrx::datum::DatumWithOid;
use stage_e_core::directory;
pub use stage_e_core::fair::Share;
use stage_e_core::fair::{Refused, MAX_WEIGHT, NO_CEILING, UNNAMED};
use std::cell::RefCell;
use std::collections::HashMap;

/// The name of the share that applies to every share of a cap without a policy row of its own.
pub const DEFAULT_SHARE: &str = "*";

/// A call's share: its name (`""`: the cap's unnamed share) and its policy.
#[derive(Clone, Debug)]
pub struct CallShare {
    pub name: String,
    pub share: Share,
}

/// A cap's share policies as read: `(weight, ceiling)` by share name, `'*'` included.
type CapPolicies = HashMap<String, (u32, u32)>;

/// This backend's share policies, by cap, and the generation they were read at.
struct Policies {
    generation: u64,
    caps: HashMap<String, CapPolicies>,
}

static POLICIES: BackendLocal<RefCell<Option<Policies>>> = BackendLocal::new(RefCell::new(None));

/// A share name argument: class 22 unless it follows the cap-name rules (checked before the
/// call changes anything: before its cap is made).
#[inline]
pub(super) fn check_share_name(share: Option<&str>) -> Result<(), SlotError> {
    match share {
        Some(s) => directory::check_name(s).map_err(SlotError::BadShareName),
        None => Ok(()),
    }
}

/// The share a call on `cap` names (None: the cap's unnamed share), with its policy.
pub(super) fn resolve(cap: &str, share: Option<&str>) -> Result<CallShare, SlotError> {
    let name = share.unwrap_or("");
    let (weight, ceiling) = policy(cap, name)?;
    let digest = if name.is_empty() {
        UNNAMED
    } else {
        shmem::share_digest(session::database(), name)
    };
    Ok(CallShare {
        name: name.to_string(),
        share: Share {
            digest,
            weight,
            ceiling,
        },
    })
}

/// The policy of share `name` of `cap`: its row, else the cap's `'*'` row, else weight 1 and
/// no ceiling.
fn policy(cap: &str, name: &str) -> Result<(u32, u32), SlotError> {
    let (generation, moved_at) = shmem::share_policies_generation(session::database());
    let cached = POLICIES.with_borrow(|p| {
        p.as_ref()
            .filter(|p| p.generation == generation)
            .and_then(|p| p.caps.get(cap))
            .map(|c| pick(c, name))
    });
    if let Some(found) = cached {
        return Ok(found);
    }
    let read = read_policies(cap)?;
    let found = pick(&read, name);
    // Kept only if this transaction's snapshot is younger than the last commit of a policy.
    if moved_at < session::transaction_start() {
        POLICIES.with_borrow_mut(|p| {
            let p = p.get_or_insert_with(|| Policies {
                generation,
                caps: HashMap::new(),
            });
            if p.generation != generation {
                p.generation = generation;
                p.caps.clear();
            }
            p.caps.insert(cap.to_string(), read);
        });
    }
    Ok(found)
}

fn pick(c: &CapPolicies, name: &str) -> (u32, u32) {
    c.get(name)
        .or_else(|| c.get(DEFAULT_SHARE))
        .copied()
        .unwrap_or((1, NO_CEILING))
}

/// `cap`'s rows of `stage_e_share_policy` (none in a database whose extension is older than
/// 0.11.0, or where it is not installed).
fn read_policies(cap: &str) -> Result<CapPolicies, SlotError> {
    let Some(ext) = sql::extension().filter(|e| e.version.has_shares()) else {
        return Ok(CapPolicies::new());
    };
    let Some(table) = ext.table(c"stage_e_share_policy") else {
        crate::report::fail(format!(
            "reading the share policies of a cap: schema {} has no table stage_e_share_policy",
            ext.schema
        ))
    };
    // As the table's owner: a policy binds every role of the cap, whichever rows the calling
    // role may see.
    sql::as_owner(&table, || {
        sql::read(|c| {
            let mut out = CapPolicies::new();
            for r in c.select(
                &sql::share_policies_query(&ext),
                None,
                &[Text(cap.to_string()).into()],
            )? {
                let share = r.get::<Text>(1)?.unwrap_or_default().0;
                // Rows a superuser edited past the checks' bounds: the nearest valid ones.
                let weight = r.get::<i32>(2)?.unwrap_or(1).clamp(1, MAX_WEIGHT as i32) as u32;
                let ceiling = r.get::<i32>(3)?.map_or(NO_CEILING, |m| m.max(1) as u32);
                out.insert(share, (weight, ceiling));
            }
            Ok(out)
        })
    })
    .map_or_else(
        |e| crate::report::fail(format!("reading the share policies of a cap: {e}")),
        Ok,
    )
}

/// `stage_e_share(cap, share, weight, max_slots)`: from the commit of the calling transaction,
/// share `share` of `cap` (or, for `'*'`, every share of it without a row of its own) has this
/// weight and ceiling. Bad input is class 22 and writes nothing.
pub fn set_policy(
    cap: Option<&str>,
    share: Option<&str>,
    weight: Option<i32>,
    max_slots: Option<i32>,
) -> Result<(), SlotError> {
    ready()?;
    super::admission::ensure_loaded()?;
    let cap = check_name(cap)?;
    let share = share.ok_or(SlotError::NullArgument { name: "share" })?;
    if share != DEFAULT_SHARE {
        check_share_name(Some(share))?;
    }
    let weight = weight.ok_or(SlotError::NullArgument { name: "weight" })?;
    if !(1..=MAX_WEIGHT as i32).contains(&weight) {
        return Err(SlotError::BadShareWeight { weight });
    }
    if let Some(m) = max_slots.filter(|m| *m < 1) {
        return Err(SlotError::BadShareCeiling { ceiling: m });
    }
    let Some(ext) = sql::extension() else {
        return Err(SlotError::NotLoaded);
    };
    // The table's trigger (`policy_written`) leaves this write, ours, to the change said below.
    sql::write(
        &sql::share_write_query(&ext),
        &[
            Text(cap.to_string()).into(),
            Text(share.to_string()).into(),
            DatumWithOid::from(weight),
            DatumWithOid::from(max_slots),
        ],
    )
    .unwrap_or_else(|e| crate::report::fail(format!("stage_e_share: {e}")));
    let which = if share == DEFAULT_SHARE {
        "every other share".to_string()
    } else {
        format!("share {}", quoted(share))
    };
    let log = format!(
        "stage_e_slots: role {} gave {which} of cap {} of database {} weight {weight} and {}",
        quoted(&sql::current_role()),
        quoted(cap),
        quoted(&sql::current_database()),
        max_slots.map_or("no ceiling".to_string(), |m| format!("at most {m} slots")),
    );
    session::policy_changed(cap, session::Change::Share, log);
    Ok(())
}

/// A statement that wrote `stage_e_share_policy` (`op`: INSERT, UPDATE, DELETE or TRUNCATE),
/// from the table's trigger. Unless it is `stage_e_share`'s own, its commit moves the
/// database's generation of share policies (so no session keeps the policies it read before)
/// and is logged: the table's owner may write it by hand, and a restore fills it with COPY.
pub fn policy_written(op: &str) {
    if sql::writing_ours() {
        return;
    }
    let log = format!(
        "stage_e_slots: role {} wrote stage_e_share_policy of database {} ({op}), not through \
         stage_e_share: every session reads the share policies again",
        quoted(&sql::current_role()),
        quoted(&sql::current_database()),
    );
    session::policy_changed("", session::Change::Share, log);
}

/// A live share of a cap, for `stage_e_shares`.
pub use shmem::ShareInfo;

/// The live shares of this database's caps (`stage_e_shares`); reading needs the shared state
/// only.
pub fn live() -> Result<Vec<ShareInfo>, SlotError> {
    super::attached()?;
    Ok(shmem::shares_of(session::database()))
}

/// What a refusal of the fair queue says to the caller, for a call of `k` slots in `share`.
pub(super) fn refused(r: Refused, share: Share, k: u32) -> SlotError {
    match r {
        Refused::Full => SlotError::NoShareRecord {
            max: gucs::max_shares(),
            share: gucs::database_share(),
        },
        Refused::Ceiling => SlotError::MoreThanCeiling {
            k,
            ceiling: share.ceiling,
        },
        Refused::Weight => SlotError::BadShareWeight {
            weight: share.weight as i32,
        },
    }
}

/// A call that does not wait takes `k` slots of `[0, n)` in `share` now, or None (throttled:
/// the slots are not free, the share is at its ceiling, or another share is to be served
/// first). `at` is the slots' acquisition time.
pub(super) fn take_now(
    cap: &Cap,
    n: u32,
    k: u32,
    at: i64,
    kind: Kind,
    gate: Option<&super::rates::Gate>,
    call: &CallShare,
) -> Result<Option<Taken>, SlotError> {
    let share = call.share;
    if k > share.ceiling {
        return Err(refused(Refused::Ceiling, share, k));
    }
    let Some(place) = cap
        .reserve_now(share, &call.name, n, k)
        .map_err(|r| refused(r, share, k))?
    else {
        return Ok(None);
    };
    // Served first: from the slots no waiter can use if there are such, else from slot 0
    // (seated waiters are served in the same order, so none of them is passed over).
    let from = if cap.waiters() == 0 {
        0
    } else {
        cap.newcomer(n, k).unwrap_or(0)
    };
    let taken = super::take(cap, n, k, from, at, kind, gate, place.0);
    if !matches!(taken, Ok(Some(_))) {
        cap.give_back_share(place.0, k); // reserved, not taken
    }
    taken
}
