//! Pending counts, leases and rate keys across a clean restart, and the startup hook that restores them:
//! written at postmaster shutdown, read back at start (the hook first attaches the segment,
//! `segment`), as pg_stat_statements keeps its dump in `pg_stat/`. The formats are
//! `stage_e_core::counters::{encode, decode}` and `stage_e_core::lease_file::LeaseFile`.
//!
//! Only the postmaster touches the files: at a clean shutdown (a control file that says "shut
//! down": an immediate shutdown exits like a clean one, but like a crash it kills the backends
//! mid-way and writes no shutdown checkpoint) every backend and worker is gone, so each cap's
//! pending counts, token counter and leases are final; at start (and after a crash reset) no
//! backend runs yet. A crash writes nothing: at most one flush interval of counts is lost, as
//! documented, and the leases are covered by the durable horizon instead (`committed`).
//!
//! **Nothing is lost to a start that fails.** The control file tells the postmaster's exit
//! whether its server ever came up: unchanged since the segment was made (state, checkpoint,
//! time), no startup process ran, so no process used what was restored and shared memory holds
//! exactly what the files said (a start that fails after shared memory is made: a bad
//! pg_hba.conf). Such an exit writes both files back, whatever its exit code.
//!
//! **Pending file**: removed once read, so it is never applied twice (its counts are in shared
//! memory, written back at a clean shutdown or a start that fails; a crash loses them).
//!
//! **Lease file**: stamped with the checkpoint of the clean shutdown that wrote it, and trusted
//! only by a start whose control file says "shut down" at that same checkpoint: so it is
//! kept where it is (a failed start leaves it for the next), a crash after the start that read
//! it finds the control file "in production" (the start is a crash), and an older copy put back
//! names an older checkpoint (ignored with a LOG line: a crash, held back). A file of 0.9.0 or
//! earlier has no stamp: removed once read, as those versions did, and trusted. The file also
//! carries the holds of a crash or a promotion not yet ended, so a clean restart keeps them;
//! a server that began so writes it only once every database is loaded (all its holds are
//! known), else its next start is a crash again.

use super::caps::{create_at_start, restore_at_start};
use super::databases;
use super::pin::pin;
use super::rates;
use super::segment::{self, segment, Segment};
use super::Cap;
use pgrx::pg_sys;
use stage_e_core::counters::{self, Carried};
use stage_e_core::lease_file::{self, Checkpoint, LeaseFile, LeaseShare, SavedHold, SavedLease};
use stage_e_core::lifecycle::StartKind;
use stage_e_core::rate_file::RateFile;
use stage_e_core::state::CapRef;
use std::sync::Mutex;

static mut PREV_SHMEM_STARTUP_HOOK: pg_sys::shmem_startup_hook_type = None;

/// The postmaster's: what the control file said when the segment was made (compared at exit).
static SEGMENT_MADE_AT: Mutex<Option<Control>> = Mutex::new(None);

/// Registers the hooks; called from `_PG_init` while preloading, after the GUCs are defined.
pub fn init() {
    segment::install_request_hook();
    // SAFETY: _PG_init runs single-threaded in the postmaster; chaining the previous hook keeps
    // other extensions' shared memory working.
    unsafe {
        PREV_SHMEM_STARTUP_HOOK = pg_sys::shmem_startup_hook;
        pg_sys::shmem_startup_hook = Some(shmem_startup);
    }
}

/// The startup hook: attaches the segment (`segment`), then, in the postmaster, takes back what
/// the last clean shutdown saved. Here rather than in `segment`, so that the layout does not
/// call up into the files that fill it.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn shmem_startup() {
    // SAFETY: a hook the postmaster calls at start and after a crash reset.
    unsafe {
        if let Some(prev) = PREV_SHMEM_STARTUP_HOOK {
            prev();
        }
    }
    let seg = segment::attach_at_startup();
    // SAFETY: a flag of this process, set at start.
    if unsafe { !pg_sys::IsUnderPostmaster } {
        // The postmaster (at start and after a crash reset): take back the counts and the
        // leases saved at the last clean shutdown, and save them again at the next one.
        // Leases first: they bind, so a pending file too large for a smaller max_caps must
        // not keep them out (what does not fit of the counts is kept for later instead).
        let control = control();
        *SEGMENT_MADE_AT.lock().unwrap_or_else(|e| e.into_inner()) = control;
        let (kind, in_shares) = restore_leases(seg, control);
        restore_rates(seg, control, kind);
        // After the rates: a share's digest is keyed with their secret.
        restore_lease_shares(&in_shares);
        restore_pending(seg);
        databases::set_start_kind(kind);
        save_at_shutdown();
    }
}

/// In the data directory (the postmaster's working directory).
const PENDING_FILE: &str = "pg_stat/stage_e_slots.pending";
const LEASE_FILE: &str = "pg_stat/stage_e_slots.leases";
const RATE_FILE: &str = "pg_stat/stage_e_slots.rates";

/// The server's major version, stamped into the lease file.
fn major() -> u32 {
    pg_sys::PG_VERSION_NUM / 10_000
}

/// At start: the counts saved at the last clean shutdown become each cap's carried counts.
///
/// No count is lost when a setting shrank (a smaller `stage_e_slots.max_caps` or
/// `slot_memory` than the counts were saved under): what does not fit is written straight
/// back to the pending file, with a LOG line saying so, and stays there (the postmaster alone
/// touches the file, at start and at exit) until a start with room for it. The next clean
/// shutdown merges it with the live caps' counts ([`save_pending`]). Keeping it in the file,
/// rather than handing it to a flusher, keeps the one rule of the file: a count is either in
/// shared memory or in the file, never both, so a crash (which discards shared memory and
/// reads the file again) neither loses nor doubles what was kept.
pub(super) fn restore_pending(seg: &Segment) {
    let Some(entries) = read_pending(true) else {
        return;
    };
    let mut kept = Vec::new();
    let mut why = None;
    for c in entries {
        // A database dropped since is reclaimed by the launcher's first round.
        let key = c.key.unwrap_or_else(|| super::caps::first_key(&c.cap));
        match create_at_start(seg, c.database, &c.cap, key) {
            Ok(entry) => entry.carry(c.values, c.hist),
            Err(e) => {
                why.get_or_insert(e);
                kept.push(c);
            }
        }
    }
    let Some(why) = why else { return };
    let text = lease_file::stamp(major(), &counters::encode(&kept));
    if write_file(PENDING_FILE, &text) {
        pgrx::log!(
            "stage_e_slots: kept the saved counts of {} cap(s) in {PENDING_FILE} for a later \
             start, because they did not fit in shared memory: {why}; they are restored at a \
             start with room for them (raise stage_e_slots.max_caps or slot_memory back), and \
             until then each clean shutdown keeps them in the file",
            kept.len()
        );
    } else {
        pgrx::log!(
            "stage_e_slots: lost the saved counts of {} cap(s), because they did not fit in \
             shared memory ({why}) and {PENDING_FILE} could not be written back",
            kept.len()
        );
    }
}

/// The pending file's entries, or None without a usable file. At start it is removed once
/// read (`remove`: after a crash it must not be applied a second time; what is kept for later
/// is written back); at shutdown it is replaced whole by the merged file instead.
fn read_pending(remove: bool) -> Option<Vec<Carried>> {
    let text = std::fs::read_to_string(PENDING_FILE).ok()?;
    if remove {
        let _ = std::fs::remove_file(PENDING_FILE);
    }
    let body = match lease_file::unstamp(&text, major()) {
        Ok(body) => body,
        Err(e) => {
            pgrx::log!("stage_e_slots: ignoring {PENDING_FILE}: {e}; its counts are lost");
            return None;
        }
    };
    let entries = counters::decode(body);
    if entries.is_none() {
        pgrx::log!(
            "stage_e_slots: ignoring {PENDING_FILE}: it is not in the expected format; its \
             counts are lost"
        );
    }
    entries
}

/// At start: how this segment begins. After a clean shutdown of a primary, its leases and
/// token counters are put back exactly; a standby (or an archive recovery) takes none, since
/// its end is a promotion and the durable horizon covers that.
/// Returns the leases restored in a share, to be put back in it once the secret is known
/// ([`restore_lease_shares`]).
pub(super) fn restore_leases(
    seg: &Segment,
    control: Option<Control>,
) -> (StartKind, Vec<(CapRef, u32, LeaseShare)>) {
    // Bytes first: a file that is not even text is corrupt, not missing.
    let text = std::fs::read(LEASE_FILE).map(|b| String::from_utf8_lossy(&b).into_owned());
    let standby = ["standby.signal", "recovery.signal"]
        .iter()
        .any(|f| std::path::Path::new(f).exists());
    if standby {
        if text.is_ok() {
            let _ = std::fs::remove_file(LEASE_FILE);
            pgrx::log!(
                "stage_e_slots: not restoring the leases of {LEASE_FILE}: this server starts \
                 in recovery; they are held back from the durable lease horizon when it is \
                 promoted"
            );
        }
        return (StartKind::Standby, Vec::new());
    }
    let Ok(text) = text else {
        return (StartKind::Crash, Vec::new());
    };
    // Not shut down cleanly since the file was written: the start that read it came up, and
    // what it granted since is not in it. The usual crash, said by the held-back caps' lines.
    let Some(last) = control.filter(|c| c.shut_down()).map(|c| c.at) else {
        let _ = std::fs::remove_file(LEASE_FILE);
        return (StartKind::Crash, Vec::new());
    };
    let file = match LeaseFile::decode(&text, major()).and_then(|f| f.check(last).map(|()| f)) {
        Ok(file) => file,
        Err(e) => {
            let _ = std::fs::remove_file(LEASE_FILE);
            pgrx::log!(
                "stage_e_slots: ignoring {LEASE_FILE}: {e}; starting as after a crash (caps \
                 whose durable lease horizon is in the future are held back until it)"
            );
            return (StartKind::Crash, Vec::new());
        }
    };
    if file.checkpoint.is_none() {
        // 0.9.0's file cannot tell a later start from this one; the exit writes it back
        // (stamped) if this start fails.
        let _ = std::fs::remove_file(LEASE_FILE);
    }
    seg.header.tokens.raise(file.last_token);
    let mut lost = 0;
    let mut in_shares = Vec::new();
    for l in &file.leases {
        let key = l.key.unwrap_or_else(|| super::caps::first_key(&l.cap));
        match restore_at_start(seg, l.database, &l.cap, key, l.slot + 1) {
            Ok(cap) if cap.restore_lease(l.slot, l.token, l.acquired_at, l.expires_at, l.owner) => {
                // Its place, not the pin: a later lease of the cap may grow it, which waits
                // for no pin at start (it fails instead).
                if l.share != LeaseShare::None {
                    in_shares.push((cap.at, l.slot, l.share.clone()));
                }
            }
            _ => lost += 1,
        }
    }
    // The holds a crash or a promotion left that had not ended at the shutdown.
    for h in &file.holds {
        let key = h.key.unwrap_or_else(|| super::caps::first_key(&h.cap));
        match restore_at_start(seg, h.database, &h.cap, key, 1) {
            Ok(cap) => cap.hold(h.until, h.reason),
            Err(_) => lost += 1,
        }
    }
    if lost > 0 {
        // Fail closed: what could not be put back is covered by the durable horizon.
        pgrx::log!(
            "stage_e_slots: could not restore {lost} of the {} leases and holds of \
             {LEASE_FILE}; starting as after a crash",
            file.leases.len() + file.holds.len()
        );
        return (StartKind::Crash, in_shares);
    }
    if !(file.leases.is_empty() && file.holds.is_empty()) {
        pgrx::log!(
            "stage_e_slots: restored {} lease(s) and {} hold(s) from {LEASE_FILE}",
            file.leases.len(),
            file.holds.len()
        );
    }
    (StartKind::Clean, in_shares)
}

/// Restored leases count in their shares again, as before the shutdown. One that finds no room
/// (a smaller `stage_e_slots.max_shares`) counts in none: its slot still binds the cap, only
/// its share's ceiling does not see it, and a LOG line says so.
fn restore_lease_shares(leases: &[(CapRef, u32, LeaseShare)]) {
    let mut lost = 0;
    for (at, slot, share) in leases {
        let Some(cap): Option<Cap> = pin(*at) else {
            lost += 1;
            continue;
        };
        let (digest, name) = match share {
            LeaseShare::Named(name) => (rates::share_digest(cap.database(), name), name.as_str()),
            _ => (stage_e_core::fair::UNNAMED, ""),
        };
        if !cap.restore_in_share(*slot, digest, name) {
            lost += 1;
        }
    }
    if lost > 0 {
        pgrx::log!(
            "stage_e_slots: {lost} of the {} restored leases taken in a share could not be put \
             back in it (stage_e_slots.max_shares is smaller than when they were saved): they \
             count in no share until released",
            leases.len()
        );
    }
}

/// At start: the rate keys of the last clean shutdown, exactly (their arrival times, carried
/// onto this boot's clock: `RateFile::carried`), when the file was written at the shutdown
/// checkpoint the control file names (kept in place, as the lease file). After a crash, an immediate shutdown, on a standby, or with a file not to be trusted,
/// every key starts as if its whole burst had just been spent (`rates::start`): no full burst
/// for every key at once. A clean start with no file (a new cluster, the first start of a
/// library with rate limits) starts every key full: there was no rate to keep.
fn restore_rates(seg: &Segment, control: Option<Control>, kind: StartKind) {
    let now = rates::now();
    let text = std::fs::read(RATE_FILE)
        .ok()
        .map(|b| String::from_utf8_lossy(&b).into_owned());
    // Independent of the leases: the control file alone says whether this start follows the
    // clean shutdown that wrote the file.
    let shut_down_at = control
        .filter(|c| c.shut_down() && kind != StartKind::Standby)
        .map(|c| c.at);
    let file = text
        .as_deref()
        .and_then(|t| lease_file::unstamp(t, major()).ok())
        .and_then(RateFile::decode)
        .filter(|f| shut_down_at.is_some_and(|at| (at.system, at.lsn) == f.checkpoint));
    let Some(file) = file else {
        let spent = match (kind, shut_down_at, &text) {
            (StartKind::Standby, _, _) => rates::PROMOTION_PENDING,
            (_, Some(_), None) => 0, // a new cluster, or the first start of this library
            _ => now,
        };
        rates::start(seg, None, spent);
        if text.is_some() && shut_down_at.is_some() {
            pgrx::log!(
                "stage_e_slots: ignoring {RATE_FILE}: it was not written at the shutdown this \
                 server starts from; every rate key starts as if its burst had just been spent"
            );
        }
        return;
    };
    let boot = boot_id();
    let wall = pg_now();
    rates::start(seg, Some(file.secret), file.carried_spent(&boot, now));
    let keys = file.carried(&boot, now, wall);
    let lost = rates::restore(seg, &keys);
    if lost > 0 {
        // Fail closed: a key left out would otherwise come back with a full burst.
        rates::mark_spent(seg, now);
        pgrx::log!(
            "stage_e_slots: could not restore {lost} of the {} rate keys of {RATE_FILE}: \
             stage_e_slots.max_rate_keys is smaller than when they were saved; every key not \
             restored starts as if its burst had just been spent",
            keys.len()
        );
    }
}

/// This boot's id (empty when it cannot be read: then no file is of the same boot).
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

fn pg_now() -> i64 {
    // SAFETY: reads the clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// At a clean shutdown: every rate key not idle, with the clocks and the checkpoint.
fn save_rates(seg: &Segment, at: Checkpoint) {
    let (secret, spent, keys) = rates::saved(seg);
    let file = RateFile {
        checkpoint: (at.system, at.lsn),
        boot: boot_id(),
        clock: rates::now(),
        wall_us: pg_now(),
        secret,
        spent,
        keys,
    };
    if write_file(RATE_FILE, &lease_file::stamp(major(), &file.encode())) && !file.keys.is_empty() {
        pgrx::log!(
            "stage_e_slots: saved {} rate key(s) to {RATE_FILE}",
            file.keys.len()
        );
    }
}

/// Registers [`save_at_exit`] to run at postmaster exit.
pub(super) fn save_at_shutdown() {
    // SAFETY: called by the postmaster from the startup hook; the callback runs at its exit.
    unsafe { pg_sys::on_shmem_exit(Some(save_at_exit), pg_sys::Datum::from(0)) };
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn save_at_exit(_code: i32, _arg: pg_sys::Datum) {
    let Some(seg) = segment() else { return };
    let made_at = *SEGMENT_MADE_AT.lock().unwrap_or_else(|e| e.into_inner());
    let Some(now) = control() else { return };
    // Whatever the exit code (a start that fails exits with 1): see "Nothing is lost".
    let never_up = made_at == Some(now);
    if now.shut_down_in_any_way() || never_up {
        save_pending(seg);
    }
    // Only the leases of a clean shutdown, or those restored exactly by a start that then
    // failed: a crash start that failed has no hold loaded, and its next start is a crash too.
    // After a crash or a promotion, the holds go into the file too, so only once every
    // database is loaded (every hold there is to be is known); before that the next start is
    // a crash again, and holds back from the durable horizons.
    let kind = databases::start_kind();
    let restored = never_up && kind == StartKind::Clean;
    let holds_known = !kind.holds() || databases::all_loaded();
    if now.shut_down() && (!never_up || restored) && holds_known {
        save_leases(seg, now.at);
    }
    // Rate keys need no hold to be known: what shared memory has is what a start restored,
    // or what calls charged since.
    if now.shut_down() {
        save_rates(seg, now.at);
    }
}

/// What the control file says: where the last checkpoint is (and of which cluster), its state
/// and when it was last updated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Control {
    at: Checkpoint,
    state: pg_sys::DBState::Type,
    time: i64,
}

impl Control {
    /// A clean shutdown of a primary (its checkpoint is the shutdown checkpoint).
    fn shut_down(&self) -> bool {
        self.state == pg_sys::DBState::DB_SHUTDOWNED
    }

    /// A clean shutdown of a primary or of a standby.
    fn shut_down_in_any_way(&self) -> bool {
        self.shut_down() || self.state == pg_sys::DBState::DB_SHUTDOWNED_IN_RECOVERY
    }
}

/// The control file now, or None if it cannot be read or its checksum is wrong.
fn control() -> Option<Control> {
    let mut crc_ok = false;
    // SAFETY: as pg_control_system() does: DataDir is the postmaster's data directory, and
    // get_controlfile reads pg_control into palloc'd memory, read at once.
    unsafe {
        let cf = pg_sys::get_controlfile(pg_sys::DataDir, &mut crc_ok);
        (crc_ok && !cf.is_null()).then(|| Control {
            at: Checkpoint {
                system: (*cf).system_identifier,
                lsn: (*cf).checkPoint,
            },
            state: (*cf).state,
            time: (*cf).time,
        })
    }
}

fn save_pending(seg: &Segment) {
    // What a start kept for later (not in shared memory, so not counted twice).
    let kept = read_pending(false).unwrap_or_default();
    let live: Vec<Carried> = seg
        .live()
        .map(|e| Carried {
            database: e.database(),
            cap: e.name(),
            key: Some(e.key()),
            values: e.pending(),
            hist: e.pending_hist(),
        })
        .filter(|c| !c.is_zero())
        .collect();
    let pending = counters::merge(live, kept);
    if pending.is_empty() {
        return;
    }
    if write_file(
        PENDING_FILE,
        &lease_file::stamp(major(), &counters::encode(&pending)),
    ) {
        pgrx::log!(
            "stage_e_slots: saved pending counters of {} cap(s) to {PENDING_FILE}",
            pending.len()
        );
    }
}

/// Always written at a clean shutdown, also with no lease: its presence marks the start as
/// clean.
fn save_leases(seg: &Segment, at: Checkpoint) {
    let mut file = LeaseFile {
        checkpoint: Some(at),
        last_token: seg.header.tokens.last(),
        leases: Vec::new(),
        holds: Vec::new(),
    };
    // SAFETY: reads the clock.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    for (i, e) in seg.entries.iter().enumerate() {
        if !e.in_use() {
            continue;
        }
        let Some(cap): Option<Cap> = pin(e.state.cap_ref(i as u32)) else {
            continue;
        };
        file.leases
            .extend(cap.leases().into_iter().map(|l| SavedLease {
                database: cap.database(),
                cap: cap.name(),
                slot: l.slot,
                token: l.token,
                acquired_at: l.acquired_at,
                expires_at: l.expires_at,
                owner: l.owner,
                key: Some(cap.key()),
                share: cap.lease_share(l.slot),
            }));
        if let Some((until, reason)) = cap.held_until(now) {
            file.holds.push(SavedHold {
                database: cap.database(),
                cap: cap.name(),
                key: Some(cap.key()),
                until,
                reason,
            });
        }
    }
    if write_file(LEASE_FILE, &file.encode(major()))
        && !(file.leases.is_empty() && file.holds.is_empty())
    {
        pgrx::log!(
            "stage_e_slots: saved {} lease(s) and {} hold(s) to {LEASE_FILE}",
            file.leases.len(),
            file.holds.len()
        );
    }
}

/// Writes `path` whole or not at all (a temporary file renamed over it, synced first).
fn write_file(path: &str, text: &str) -> bool {
    use std::io::Write;
    let tmp = format!("{path}.tmp");
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| {
            f.write_all(text.as_bytes())?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    match written {
        Ok(()) => true,
        Err(e) => {
            pgrx::warning!("stage_e_slots: could not write {path}: {e}");
            false
        }
    }
}
