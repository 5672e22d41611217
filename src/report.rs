//! How anything of ours reaches the server log or the client: `ereport` and the plain reports
//! every floor makes (`log`, `fail`, `raise_internal`). The words of each refusal (`describe`,
//! the SQLSTATEs, details and hints) are `errors`', at the top; this is the plumbing below.

use crate::names;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};

/// Every report of ours is made here: the text, made in UTF-8, is handed over in the server
/// encoding (`names::message`; pgrx's ErrorReport only copies it into the report).
pub fn ereport(
    level: PgLogLevel,
    code: PgSqlErrorCode,
    message: String,
    detail: Option<String>,
    hint: Option<String>,
) {
    let mut e = ErrorReport::new(code, names::message(message), "stage_e_slots");
    if let Some(detail) = detail {
        e = e.set_detail(names::message(detail));
    }
    if let Some(hint) = hint {
        e = e.set_hint(names::message(hint));
    }
    e.report(level);
}

/// An ERROR with its detail and hint.
pub fn error(code: PgSqlErrorCode, message: String, detail: String, hint: Option<String>) -> ! {
    ereport(PgLogLevel::ERROR, code, message, Some(detail), hint);
    unreachable!("ereport(ERROR) does not return")
}

/// An ERROR without a detail (what pgrx's `error!` raises), for the background workers.
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
pub fn raise_internal(message: String) -> ! {
    error(
        PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
        message,
        "This is a bug in stage_e_slots; nothing was changed.".into(),
        None,
    )
}
