//! Pending counts across a clean restart: written at postmaster shutdown, read back at start,
//! as pg_stat_statements keeps its dump in `pg_stat/`. The file format is
//! `stage_e_core::counters::{encode, decode}`.
//!
//! Only the postmaster touches the file: at a clean shutdown (exit code 0) every backend and
//! worker is gone, so each cap's pending counts are final; at start (and after a crash reset)
//! no backend runs yet. A crash writes nothing: at most one flush interval of counts is lost,
//! as documented. The file is removed once read, so it is never applied twice.

use super::caps::create_at_start;
use super::segment::{segment, Segment};
use pgrx::pg_sys;
use stage_e_core::counters::{self, Carried};

/// In the data directory (the postmaster's working directory).
const PENDING_FILE: &str = "pg_stat/stage_e_slots.pending";

/// At start: the counts saved at the last clean shutdown become each cap's carried counts.
pub(super) fn restore_pending(seg: &Segment) {
    let Ok(text) = std::fs::read_to_string(PENDING_FILE) else {
        return;
    };
    // Read once: after a crash the file must not be applied a second time.
    let _ = std::fs::remove_file(PENDING_FILE);
    let Some(entries) = counters::decode(&text) else {
        pgrx::log!("stage_e_slots: ignoring {PENDING_FILE}: not in the expected format");
        return;
    };
    for c in entries {
        // A database dropped since is reclaimed by the launcher's first round.
        match create_at_start(seg, c.database, &c.cap) {
            Ok(entry) => entry.carry(c.values),
            Err(e) => pgrx::log!(
                "stage_e_slots: dropped the saved counts of cap \"{}\" of database {}: {e:?}",
                c.cap,
                c.database
            ),
        }
    }
}

/// Registers [`save_pending`] to run at postmaster exit.
pub(super) fn save_at_shutdown() {
    // SAFETY: called by the postmaster from the startup hook; the callback runs at its exit.
    unsafe { pg_sys::on_shmem_exit(Some(save_pending), pg_sys::Datum::from(0)) };
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn save_pending(code: i32, _arg: pg_sys::Datum) {
    if code != 0 {
        return;
    }
    let Some(seg) = segment() else { return };
    let pending: Vec<Carried> = seg
        .live()
        .map(|e| Carried {
            database: e.database(),
            cap: e.name(),
            values: e.pending(),
        })
        .filter(|c| !c.values.is_zero())
        .collect();
    if pending.is_empty() {
        return;
    }
    let tmp = format!("{PENDING_FILE}.tmp");
    let written = std::fs::write(&tmp, counters::encode(&pending))
        .and_then(|()| std::fs::rename(&tmp, PENDING_FILE));
    match written {
        Ok(()) => pgrx::log!(
            "stage_e_slots: saved pending counters of {} cap(s) to {PENDING_FILE}",
            pending.len()
        ),
        Err(e) => pgrx::warning!("stage_e_slots: could not write {PENDING_FILE}: {e}"),
    }
}
