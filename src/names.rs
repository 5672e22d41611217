//! Text in the server encoding, and the one form names take inside: UTF-8.
//!
//! A cap's name is a key of things every database of the server shares (shared memory, the
//! lock key, which is a hash of the name's bytes, the pending-counts and lease files), and
//! databases of one server may have different encodings. So a name is UTF-8 everywhere inside,
//! and this module converts at the edge, both ways, and is the only one that does:
//!
//! - In: a cap argument is `api::CapArg` (SQL `text`): its bytes are converted from the server
//!   encoding to UTF-8 when the function is called. In a UTF8 database that is nothing; in a
//!   SQL_ASCII database (which stores whatever bytes it was sent) they must already be UTF-8,
//!   or the call is refused with SQLSTATE 22021. `'café'` is then the same cap, with the same
//!   lock key, in a UTF8, a LATIN1 and a SQL_ASCII database.
//! - Out: a name in a result, in a parameter of our own statements, or read back from our
//!   tables is [`Text`]; the snapshot document is [`Json`]; a message's text goes through
//!   [`message`] (PostgreSQL takes a message to be in the server encoding, and converts it to
//!   the client's).
//!
//! Conversions use the server's own functions. Text made only of ASCII characters is the same
//! in every server encoding, so it is never converted; neither is anything in a UTF8 database
//! (the encoding is read once per process): the cost there is one load and a compare.

use crate::failures::{NameOf, SlotError};
use pgrx::callconv::{BoxRet, FcInfo};
use pgrx::pg_sys;
use pgrx::{FromDatum, IntoDatum};
use stage_e_core::directory::MAX_NAME;
use std::borrow::Cow;
use std::ffi::CStr;
use std::sync::atomic::{AtomicI32, Ordering::Relaxed};

const UTF8: i32 = pg_sys::pg_enc::PG_UTF8 as i32;
const SQL_ASCII: i32 = pg_sys::pg_enc::PG_SQL_ASCII as i32;
/// Not read yet.
const UNKNOWN: i32 = -1;

/// The server encoding of this process, once it is connected to a database.
static ENCODING: AtomicI32 = AtomicI32::new(UNKNOWN);

/// The server encoding: UTF8 and SQL_ASCII need no conversion to or from UTF-8 (in SQL_ASCII
/// the bytes are taken as UTF-8); any other one does, for text that is not plain ASCII.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Server {
    Utf8,
    SqlAscii,
    Other(i32),
}

#[inline(always)]
fn server() -> Server {
    // UTF8 inline (a name's every call asks); the rest out of line.
    match ENCODING.load(Relaxed) {
        UTF8 => Server::Utf8,
        e => server_other(e),
    }
}

#[inline(never)]
fn server_other(mut e: i32) -> Server {
    if e == UNKNOWN {
        // SAFETY: reads the database encoding (a static) and MyDatabaseId.
        let (enc, connected) = unsafe {
            (
                pg_sys::GetDatabaseEncoding(),
                pg_sys::MyDatabaseId != pg_sys::InvalidOid,
            )
        };
        // Fixed once the process is connected to a database; before (the launcher, which
        // never is), it is SQL_ASCII, and read again next time.
        if connected {
            ENCODING.store(enc, Relaxed);
        }
        e = enc;
    }
    match e {
        UTF8 => Server::Utf8,
        SQL_ASCII => Server::SqlAscii,
        other => Server::Other(other),
    }
}

/// The server encoding's name (`LATIN1`), for messages.
fn server_encoding_name() -> &'static str {
    // SAFETY: a pointer to a static, NUL-terminated ASCII name in PostgreSQL's encoding table.
    unsafe { CStr::from_ptr(pg_sys::GetDatabaseEncodingName()) }
        .to_str()
        .unwrap_or("?")
}

// -- in ------------------------------------------------------------------------------------------

/// The bytes as they are, when the server encoding is UTF8 (they were checked on input): the
/// hot path of [`name_in`], for a caller that keeps every other case out of line.
#[inline(always)]
pub fn name_in_utf8(bytes: &[u8]) -> Option<&str> {
    (ENCODING.load(Relaxed) == UTF8).then(|| checked_on_input(bytes))
}

/// Text of a UTF8 database as `str`, unchecked.
#[inline(always)]
fn checked_on_input(bytes: &[u8]) -> &str {
    // SAFETY: only called in a UTF8 database, whose server checked the text on input (pgrx's
    // `&str` makes the same use of it).
    unsafe { std::str::from_utf8_unchecked(bytes) }
}

/// A name the server passed in, as UTF-8.
#[inline(always)]
pub fn name_in(bytes: &[u8]) -> Result<Cow<'_, str>, SlotError> {
    match server() {
        Server::Utf8 => Ok(Cow::Borrowed(checked_on_input(bytes))),
        other => name_in_other(other, bytes),
    }
}

/// [`name_in`] in a database whose encoding is not UTF8.
#[inline(never)]
fn name_in_other(server: Server, bytes: &[u8]) -> Result<Cow<'_, str>, SlotError> {
    match server {
        Server::Utf8 => Ok(Cow::Borrowed(checked_on_input(bytes))),
        Server::SqlAscii => std::str::from_utf8(bytes)
            .map(Cow::Borrowed)
            .map_err(|e| not_utf8(bytes, e)),
        // SAFETY: ASCII is valid UTF-8.
        Server::Other(_) if bytes.is_ascii() => Ok(Cow::Borrowed(unsafe {
            std::str::from_utf8_unchecked(bytes)
        })),
        Server::Other(_) => {
            let utf8 = server_to_utf8(bytes);
            // The tables' cap columns hold at most MAX_NAME bytes of the server encoding: a
            // name that takes more there than in UTF-8 must fit both.
            if bytes.len() > MAX_NAME && bytes.len() > utf8.len() {
                return Err(SlotError::CapTooLongHere {
                    len: bytes.len(),
                    encoding: server_encoding_name(),
                    what: NameOf::Cap,
                });
            }
            Ok(Cow::Owned(utf8))
        }
    }
}

pub(crate) fn not_utf8(bytes: &[u8], e: std::str::Utf8Error) -> SlotError {
    let at = e.valid_up_to();
    let bad = &bytes[at..at + e.error_len().unwrap_or(bytes.len() - at)];
    // An invalid sequence is at most 3 bytes: kept inline, so that SlotError owns no memory.
    let mut seq = [0u8; 4];
    let len = bad.len().min(seq.len());
    seq[..len].copy_from_slice(&bad[..len]);
    SlotError::CapNotUtf8 {
        at,
        bytes: seq,
        len: len as u8,
        what: NameOf::Cap,
    }
}

/// Text in the server encoding as UTF-8 (it is valid in the server encoding: it came from the
/// server, which checks what it stores, except in SQL_ASCII, where invalid UTF-8 is replaced).
fn server_to_utf8(bytes: &[u8]) -> String {
    match server() {
        Server::Utf8 | Server::SqlAscii => String::from_utf8_lossy(bytes).into_owned(),
        Server::Other(_) if bytes.is_ascii() => String::from_utf8_lossy(bytes).into_owned(),
        Server::Other(_) => crate::gucs::pinned(|| {
            // SAFETY: the bytes and their length; the result is either the same pointer (no
            // conversion needed) or a palloc'd, NUL-terminated copy, read here and freed. A
            // character without a Unicode equivalent raises PostgreSQL's ERROR (class 22).
            // The search path is pinned: the conversion is looked up in pg_catalog only.
            unsafe {
                let src = bytes.as_ptr().cast::<std::ffi::c_char>();
                let p = pg_sys::pg_server_to_any(src, bytes.len() as i32, UTF8);
                if std::ptr::eq(p, src) {
                    String::from_utf8_lossy(bytes).into_owned()
                } else {
                    let s = String::from_utf8_lossy(CStr::from_ptr(p).to_bytes()).into_owned();
                    pg_sys::pfree(p.cast());
                    s
                }
            }
        }),
    }
}

/// A C string of the server's (a database or role name) as UTF-8, for messages and the
/// snapshot: never fails (bytes that are not valid are replaced).
pub fn from_server_lossy(s: &CStr) -> String {
    let bytes = s.to_bytes();
    match server() {
        Server::Other(enc) if !bytes.is_ascii() && valid_in(enc, bytes) => server_to_utf8(bytes),
        _ => String::from_utf8_lossy(bytes).into_owned(),
    }
}

/// Whether `bytes` are valid text of encoding `enc`.
fn valid_in(enc: i32, bytes: &[u8]) -> bool {
    // SAFETY: reads `len` bytes; with noError, reports invalid text by its result.
    unsafe { pg_sys::pg_verify_mbstr(enc, bytes.as_ptr().cast(), bytes.len() as i32, true) }
}

// -- out -----------------------------------------------------------------------------------------

/// UTF-8 text that goes to the database in its encoding: a `text` result column, a parameter of
/// our own statements (`Vec<Text>` is a `text[]`), or a `text` column read back (`FromDatum`:
/// converted to UTF-8).
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Text(pub String);

impl From<String> for Text {
    fn from(s: String) -> Self {
        Text(s)
    }
}

impl From<Text> for String {
    fn from(t: Text) -> Self {
        t.0
    }
}

pgrx::impl_sql_translatable!(Text, "TEXT");

impl IntoDatum for Text {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        match utf8_to_server(&self.0) {
            Cow::Borrowed(_) => self.0.into_datum(),
            Cow::Owned(bytes) => {
                // SAFETY: bytes of the server encoding, copied into a new text datum.
                let t = unsafe {
                    pg_sys::cstring_to_text_with_len(bytes.as_ptr().cast(), bytes.len() as i32)
                };
                Some(pg_sys::Datum::from(t))
            }
        }
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::TEXTOID
    }
}

impl FromDatum for Text {
    unsafe fn from_polymorphic_datum(
        datum: pg_sys::Datum,
        is_null: bool,
        typoid: pg_sys::Oid,
    ) -> Option<Self> {
        // SAFETY: per the caller, a text datum (or NULL).
        let bytes = unsafe { <&[u8]>::from_polymorphic_datum(datum, is_null, typoid) }?;
        Some(Text(match server() {
            Server::Utf8 => String::from_utf8_lossy(bytes).into_owned(),
            _ => server_to_utf8(bytes),
        }))
    }
}

// SAFETY: returns the datum `into_datum` made (a text), or NULL.
unsafe impl BoxRet for Text {
    unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> pgrx::datum::Datum<'fcx> {
        match self.into_datum() {
            // SAFETY: a text datum, the function's result type.
            Some(datum) => unsafe { fcinfo.return_raw_datum(datum) },
            None => fcinfo.return_null(),
        }
    }
}

/// UTF-8 text in the server encoding: borrowed when it is the same bytes (a UTF8 or SQL_ASCII
/// database, plain ASCII), otherwise converted by the server; a character the server encoding
/// has no equivalent for raises PostgreSQL's ERROR (SQLSTATE 22P05). It cannot come from this
/// database's own callers, whose names were in its encoding to begin with.
fn utf8_to_server(s: &str) -> Cow<'_, [u8]> {
    match server() {
        Server::Utf8 | Server::SqlAscii => Cow::Borrowed(s.as_bytes()),
        Server::Other(_) if s.is_ascii() => Cow::Borrowed(s.as_bytes()),
        Server::Other(_) => crate::gucs::pinned(|| {
            // SAFETY: as in `server_to_utf8`, the other way.
            unsafe {
                let src = s.as_ptr().cast::<std::ffi::c_char>();
                let p = pg_sys::pg_any_to_server(src, s.len() as i32, UTF8);
                if std::ptr::eq(p, src) {
                    Cow::Borrowed(s.as_bytes())
                } else {
                    let out = CStr::from_ptr(p).to_bytes().to_vec();
                    pg_sys::pfree(p.cast());
                    Cow::Owned(out)
                }
            }
        }),
    }
}

/// A jsonb result built from a document whose strings are UTF-8 (`jsonb_in` reads its input in
/// the server encoding, as `pgrx::JsonB` does not take into account).
pub struct Json(pub serde_json::Value);

pgrx::impl_sql_translatable!(Json, "jsonb");

impl IntoDatum for Json {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        let text = serde_json::to_string(&self.0).ok()?;
        // JSON text has no NUL byte (a NUL in a string is written \u0000); nor has the text
        // converted from it.
        let input = std::ffi::CString::new(utf8_to_server(&text).into_owned()).ok()?;
        // SAFETY: jsonb_in of a C string, as pgrx's JsonB does.
        unsafe {
            pgrx::direct_function_call_as_datum(pg_sys::jsonb_in, &[Some(input.as_ptr().into())])
        }
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::JSONBOID
    }
}

// SAFETY: returns the datum `into_datum` made (a jsonb), or NULL.
unsafe impl BoxRet for Json {
    unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> pgrx::datum::Datum<'fcx> {
        match self.into_datum() {
            // SAFETY: a jsonb datum, the function's result type.
            Some(datum) => unsafe { fcinfo.return_raw_datum(datum) },
            None => fcinfo.return_null(),
        }
    }
}

/// An identifier as `quote_ident` quoted it (read as UTF-8), for the text of our own
/// statements, which are UTF-8 and which the server reads in its encoding: unchanged where that
/// is the same (a UTF8 or SQL_ASCII database, an ASCII name); otherwise as a Unicode-escaped
/// identifier (`U&"sch\00E9ma"`), which the server turns into its own encoding. `quote_ident`
/// quotes every name with a character that is not ASCII.
pub fn sql_identifier(quoted: String) -> String {
    let Server::Other(_) = server() else {
        return quoted;
    };
    let Some(inner) = quoted
        .strip_prefix('"')
        .and_then(|q| q.strip_suffix('"'))
        .filter(|_| !quoted.is_ascii())
    else {
        return quoted;
    };
    unicode_escaped_identifier(inner)
}

/// `U&"…"` of the inside of a quoted identifier (its `""` kept as they are).
pub(crate) fn unicode_escaped_identifier(inner: &str) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(inner.len() * 2 + 4);
    out.push_str("U&\"");
    for c in inner.chars() {
        match c as u32 {
            0x5c => out.push_str("\\\\"),
            0..=0x7f => out.push(c),
            u @ 0x80..=0xffff => {
                let _ = write!(out, "\\{u:04X}");
            }
            u => {
                let _ = write!(out, "\\+{u:06X}");
            }
        }
    }
    out.push('"');
    out
}

// -- messages ------------------------------------------------------------------------------------

/// A message (ERROR, WARNING or LOG text) made in UTF-8, in the server encoding, which is what
/// PostgreSQL takes a message to be in. Never fails: where the text cannot be converted (a
/// character the encoding lacks, such as a cap of another database's named in the log, or no
/// transaction to look the conversion up in), its non-ASCII characters are written as `\uXXXX`.
///
/// The result is a `String` only because pgrx's `ErrorReport` takes one: in a database whose
/// encoding is neither UTF8 nor SQL_ASCII it may hold bytes that are not UTF-8, so it must only
/// be handed to `ErrorReport` (which copies its bytes into the report) and never read.
pub fn message(s: String) -> String {
    let Server::Other(enc) = server() else {
        return s;
    };
    if s.is_ascii() {
        return s;
    }
    match convert_for_message(&s, enc) {
        // SAFETY: a `str` that is not UTF-8 is allowed to exist (UTF-8 is a safety invariant of
        // `str`, not a validity one); what is not allowed is a function that relies on it
        // reading it. This one goes only to pgrx's ErrorReport, whose report copies the bytes
        // (`AsPgCStr`) into the palloc'd strings errmsg/errdetail/errhint receive, and which
        // looks at them nowhere else (pgrx =0.18.1: ErrorReport, ErrorReportWithLevel,
        // do_ereport); see the callers in `errors`.
        Some(bytes) => unsafe { String::from_utf8_unchecked(bytes) },
        None => escape_non_ascii(&s),
    }
}

/// `s` converted to encoding `enc`, if every character has an equivalent there and there is a
/// transaction to look the conversion up in.
fn convert_for_message(s: &str, enc: i32) -> Option<Vec<u8>> {
    // SAFETY: a field of the transaction state.
    if !unsafe { pg_sys::IsTransactionState() } {
        return None;
    }
    crate::gucs::pinned(|| {
        // SAFETY: a catalog lookup inside a transaction (search path pinned); then the
        // conversion with noError into a buffer of the worst-case size plus the NUL, which
        // returns how many input bytes it converted (all of them, or it stopped short).
        unsafe {
            let proc_ = pg_sys::FindDefaultConversionProc(UTF8, enc);
            if proc_ == pg_sys::InvalidOid {
                return None;
            }
            let mut src = s.as_bytes().to_vec();
            let mut dest = vec![0u8; src.len() * pg_sys::MAX_CONVERSION_GROWTH as usize + 1];
            let done = pg_sys::pg_do_encoding_conversion_buf(
                proc_,
                UTF8,
                enc,
                src.as_mut_ptr(),
                src.len() as i32,
                dest.as_mut_ptr(),
                dest.len() as i32,
                true,
            );
            if done as usize != src.len() {
                return None;
            }
            let len = dest.iter().position(|&b| b == 0).unwrap_or(dest.len());
            dest.truncate(len);
            Some(dest)
        }
    })
}

/// `s` in double quotes for a report, a quote or backslash in it escaped with a backslash: a
/// name cannot close its quotes early and pass the rest of itself off as the report's words
/// (control characters are `report::one_line`'s).
pub fn quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// `s` with every non-ASCII character as `\uXXXX` (`\UXXXXXXXX` above U+FFFF): the same in
/// every server encoding.
pub(crate) fn escape_non_ascii(s: &str) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        match c as u32 {
            0..=0x7f => out.push(c),
            u @ 0x80..=0xffff => {
                let _ = write!(out, "\\u{u:04X}");
            }
            u => {
                let _ = write!(out, "\\U{u:08X}");
            }
        }
    }
    out
}
