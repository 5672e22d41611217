//! How anything of ours reaches the server log or the client: `ereport` and the plain reports
//! every floor makes (`log`, `fail`, `raise_internal`). The words of each refusal (`describe`,
//! the SQLSTATEs, details and hints) are `errors`', at the top; this is the plumbing below.
//!
//! Location: a report names the SQL function being called (`calling`, set by each function of
//! `api` on entry) and the line of ours that made it (`#[track_caller]` down to pgrx's
//! `ErrorReport`, so the line is where a refusal was decided, not this file); a report made
//! outside any SQL function (a commit callback, the background workers) names the library.

use crate::backend::BackendLocal;
use crate::names;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};
use std::cell::Cell;

/// The SQL function this backend is running, if any (a process static, not `thread_local!`,
/// which costs a call per access in a loaded library: `backend`).
static CALLING: BackendLocal<Cell<Option<&'static str>>> = BackendLocal::new(Cell::new(None));

/// Names `function` as the SQL function being called until the guard is dropped (at the
/// function's return, or as an ERROR unwinds out of it); a nested call (through SPI) restores
/// the outer one.
#[must_use]
pub struct Calling(Option<&'static str>);

/// Marks the start of SQL function `function` (its SQL name), for the reports it makes.
#[inline]
pub fn calling(function: &'static str) -> Calling {
    let outer = CALLING.get();
    CALLING.set(Some(function));
    Calling(outer)
}

impl Drop for Calling {
    #[inline]
    fn drop(&mut self) {
        CALLING.set(self.0);
    }
}

/// Every report of ours is made here: the text, made in UTF-8, is handed over in the server
/// encoding (`names::message`; pgrx's ErrorReport only copies it into the report).
#[track_caller]
pub fn ereport(
    level: PgLogLevel,
    code: PgSqlErrorCode,
    message: String,
    detail: Option<String>,
    hint: Option<String>,
) {
    let function = CALLING.get().unwrap_or("stage_e_slots");
    let mut e = ErrorReport::new(code, names::message(one_line(message)), function);
    if let Some(detail) = detail {
        e = e.set_detail(names::message(one_line(detail)));
    }
    if let Some(hint) = hint {
        e = e.set_hint(names::message(one_line(hint)));
    }
    e.report(level);
}

/// `s` with its control characters written out (`\n`, `\r`, `\t`, `\xNN`): every report of
/// ours is one line of the server log, whatever a cap, role or database name holds, so a name
/// with a newline cannot forge a line of its own. None of our texts has one on purpose.
pub fn one_line(s: String) -> String {
    if !s.chars().any(char::is_control) {
        return s;
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\x{:02X}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// An ERROR with its detail and hint.
#[track_caller]
pub fn error(code: PgSqlErrorCode, message: String, detail: String, hint: Option<String>) -> ! {
    ereport(PgLogLevel::ERROR, code, message, Some(detail), hint);
    unreachable!("ereport(ERROR) does not return")
}

/// An ERROR without a detail (what pgrx's `error!` raises), for the background workers.
#[track_caller]
pub fn fail(message: String) -> ! {
    ereport(
        PgLogLevel::ERROR,
        PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
        message,
        None,
        None,
    );
    unreachable!("ereport(ERROR) does not return")
}

/// A LOG line (the server log, and a client with client_min_messages = log).
#[track_caller]
pub fn log(message: String) {
    ereport(
        PgLogLevel::LOG,
        PgSqlErrorCode::ERRCODE_SUCCESSFUL_COMPLETION,
        message,
        None,
        None,
    );
}

/// A LOG line for the server log only (errhidefromclient), for what the client of this
/// backend must not see.
#[track_caller]
pub fn log_server_only(message: String) {
    ereport(
        PgLogLevel::LOG_SERVER_ONLY,
        PgSqlErrorCode::ERRCODE_SUCCESSFUL_COMPLETION,
        message,
        None,
        None,
    );
}

/// An ERROR that is a bug of ours.
#[track_caller]
pub fn raise_internal(message: String) -> ! {
    error(
        PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
        message,
        "This is a bug in stage_e_slots; nothing was changed.".into(),
        None,
    )
}
