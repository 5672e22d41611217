//! Lock keys of cap names: which `(key, s)` advisory locks are a cap's slots.
//!
//! A named cap's slot `s` is the advisory lock `(key, s)` of its database, so that raw-lock
//! users can take it with `pg_try_advisory_lock(stage_e_cap_key(name), s)`. Keys are 32 bits,
//! and a name colliding with any other name's key is found by brute force in seconds: a key
//! cannot be a secret, so a collision is resolved instead of refused. The protocol:
//!
//! - **A name's key is recorded with its counter row** (`lock_key`, since 0.7.0), written by the
//!   flush that first counts the cap and kept for the life of the row (a dump keeps it too).
//! - **A name without a row** takes the first key of its probe sequence
//!   (`directory::probe_key`: its FNV key first, then the same hash seeded 1, 2, …) that no
//!   live cap of its database uses and no other name's row records. Almost every name gets its
//!   FNV key, as before 0.7.0; a squatter holding that key only moves the name to its next one.
//! - **The choice is made once per cap, under the directory lock** (`shmem::create`): live caps
//!   are checked under the lock, so two live caps of one database never share a key. The book
//!   (what the rows record) is read just before, outside the lock; a row committed in between
//!   can only name a cap that is not live, which then moves to a free key when it is next made
//!   (its row follows at the next flush).
//! - **The `default` cap** keeps `stage_e_slots.lock_key`, and a database not yet updated to
//!   0.7.0 keeps the old rule (the FNV key, the name made second refused with 42710): both read
//!   no book.
//! - A cap restored at start (pending counts, leases) keeps the key its file recorded.
//!
//! `stage_e_cap_key(name)` answers the live cap's key, else the key a create would pick now:
//! the truth for raw-lock users as long as the name's row lives (delete a row, or let
//! `stage_e_slots.counter_retention` delete it, and the name may get another key when next
//! used, if a name that collides with it is in use then).

use crate::sql;
use pgrx::spi;
use stage_e_core::directory::{self, KeyBook, DEFAULT_CAP};

/// What the current database's counter rows record of `name`'s first `covered` probe keys;
/// None when its key is fixed (the `default` cap, or a database before 0.7.0).
pub fn book(name: &str, covered: u32) -> Option<KeyBook> {
    if name == DEFAULT_CAP {
        return None;
    }
    let ext = sql::extension()?;
    if !ext.version.has_key_records() {
        return None;
    }
    let probes: Vec<i32> = (0..covered)
        .map(|i| directory::probe_key(name, i))
        .collect();
    let query = sql::key_book_query(&ext);
    let rows = sql::read(|c| {
        let table = c.select(
            &query,
            None,
            &[crate::names::Text(name.into()).into(), probes.into()],
        )?;
        table
            .map(|row| Ok((row.get::<crate::names::Text>(1)?, row.get::<i32>(2)?)))
            .collect::<spi::Result<Vec<_>>>()
    })
    .unwrap_or_else(|e| crate::report::raise_internal(format!("reading the cap keys: {e}")));
    let mut book = KeyBook {
        covered,
        ..KeyBook::default()
    };
    for (cap, key) in rows {
        match (cap, key) {
            (Some(cap), Some(key)) if cap.0 == name => book.recorded = Some(key),
            (_, Some(key)) => book.others.push(key),
            _ => {}
        }
    }
    Some(book)
}

/// The lock key of cap `name` in the current database: the live cap's, else the one a create
/// would pick now (`stage_e_cap_key`).
pub fn key_of(name: &str) -> i32 {
    crate::shmem::key_now(crate::session::database(), name, &|covered| {
        book(name, covered)
    })
}
