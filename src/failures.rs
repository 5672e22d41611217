//! What a call can fail with, as plain data: `SlotError` (a call on a cap), `NamedError` (about
//! one cap by name) and `CapError` (a cap that could not be made or grown). A leaf, so that every
//! floor can return them; `errors`, at the top, says each in words (SQLSTATE, message, detail,
//! hint).

use stage_e_core::directory::NameError;

/// Which name an argument is, for the words of an error about it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NameOf {
    Cap,
    Share,
}

impl NameOf {
    pub fn word(self) -> &'static str {
        match self {
            NameOf::Cap => "cap",
            NameOf::Share => "share",
        }
    }
}

#[derive(Debug, PartialEq)]
pub enum SlotError {
    NotPreloaded,
    Standby,
    ParallelMode,
    NullArgument {
        name: &'static str,
    },
    CapOutOfRange {
        n: i32,
        max_slots: u32,
    },
    CountOutOfRange {
        k: i32,
        n: u32,
    },
    NegativeWait,
    /// A lease's ttl must be positive.
    BadTtl,
    /// A rate or a call's cost refused (`stage_e_try_rate`); `value` is the argument's.
    BadRate {
        what: stage_e_core::rate::BadRate,
        value: i64,
        burst: i32,
    },
    /// A new rate key refused: `max` keys (`stage_e_slots.max_rate_keys`) are in use, or the
    /// database holds its share (`share` percent: `limit` keys).
    NoRateKey {
        max: u32,
        share: Option<(u32, u64)>,
    },
    /// A new share refused: the pool of `max` share records (`stage_e_slots.max_shares`) has
    /// none free, or the database holds its `share` percent of it, and the cap has no idle
    /// share to reuse.
    NoShareRecord {
        max: u32,
        share: u32,
    },
    /// An acquisition of more slots than its share's ceiling (`max_slots`): it could never be
    /// allowed.
    MoreThanCeiling {
        k: u32,
        ceiling: u32,
    },
    /// A row of `stage_e_throttle_counter` written by hand holds a rate policy that is not a
    /// valid rate (its CHECK dropped): on the cap or pattern `on`.
    BadRateRow {
        on: String,
    },
    /// One of the extension's trigger functions fired on a table other than the one it is for
    /// (a role attached it to a table of its own).
    NotOurTable {
        function: &'static str,
        table: &'static str,
    },
    /// Every rate policy record is in use (`stage_e_slots.max_rate_policies`).
    NoRatePolicyRecord {
        max: u32,
    },
    /// A waiting acquisition of more slots than the cap's rate burst: it could never be
    /// allowed.
    MoreThanBurst {
        k: u32,
        burst: u32,
    },
    /// An adaptive cap's bounds (`stage_e_adapt`).
    BadBounds(stage_e_core::adapt::BoundsError),
    /// Every adaptive policy record is in use (`stage_e_slots.max_adaptive_caps`).
    NoPolicyRecord {
        max: u32,
    },
    /// A lease's ttl must be at most `stage_e_slots.max_lease_ttl` (`max_us`).
    TtlTooLong {
        ttl_us: i64,
        max_us: i64,
    },
    /// This session holds `held` session slots, and `k` more would pass
    /// `stage_e_slots.max_session_slots` (`max`).
    TooManySessionSlots {
        held: u32,
        k: u32,
        max: u32,
    },
    /// Every lease record is in use.
    NoLeaseRecord {
        max_leases: u32,
    },
    /// The list of waiters had no record for this backend (a bug: it has one per backend).
    NoWaiterRecord,
    SlotOutOfRange {
        slot: i32,
        max_slots: u32,
    },
    BadCapName(NameError),
    /// A share name follows the cap-name rules (`directory::check_name`).
    BadShareName(NameError),
    /// A share's weight is 1 to `stage_e_core::fair::MAX_WEIGHT`.
    BadShareWeight {
        weight: i32,
    },
    /// A share's ceiling (`max_slots`) is at least 1, or NULL for none.
    BadShareCeiling {
        ceiling: i32,
    },
    /// A cap name (or a share name: `what`) of a SQL_ASCII database that is not UTF-8: the
    /// first bad `bytes`, `at` bytes into the name.
    CapNotUtf8 {
        at: usize,
        bytes: [u8; 4],
        len: u8,
        what: NameOf,
    },
    /// A cap name (or a share name: `what`) that fits in UTF-8 but takes more than `MAX_NAME`
    /// bytes (`len`) in the database's `encoding`, where the tables' name columns hold it.
    CapTooLongHere {
        len: usize,
        encoding: &'static str,
        what: NameOf,
    },
    /// The durable state of this database could not be loaded since the server started.
    NotLoaded,
    /// The database table of `stage_e_slots.max_databases`-like records is full.
    TooManyDatabases,
    /// A lease needs an advance of the horizon first (internal: `lease` waits for it and tries
    /// again).
    NeedsRoom {
        expires_at: i64,
        token: u64,
    },
    /// What went wrong with a cap by name. Boxed: the error path only, and the one variant that
    /// owns memory, so that every `Result` of the hot path is small and drops for free.
    Named(Box<Named>),
}

impl SlotError {
    /// The same refusal of a name argument, said of a share name (the share arguments are read
    /// as cap names are).
    pub fn of_share(self) -> SlotError {
        match self {
            SlotError::CapNotUtf8 { at, bytes, len, .. } => SlotError::CapNotUtf8 {
                at,
                bytes,
                len,
                what: NameOf::Share,
            },
            SlotError::CapTooLongHere { len, encoding, .. } => SlotError::CapTooLongHere {
                len,
                encoding,
                what: NameOf::Share,
            },
            other => other,
        }
    }
}

/// An error about one cap, by name.
#[derive(Debug, PartialEq)]
pub struct Named {
    pub cap: String,
    pub what: NamedError,
}

#[derive(Debug, PartialEq)]
pub enum NamedError {
    /// The cap could not be created or grown.
    Cap(CapError),
    /// The lease horizon (or token floor) of the cap was not made durable in time.
    NoDurableRoom,
    /// The current role may not renew or release the lease of `slot`, which role `owner`
    /// took.
    NotLeaseOwner { slot: u32, owner: u32 },
}

impl SlotError {
    pub fn named(cap: impl Into<String>, what: NamedError) -> SlotError {
        SlotError::Named(Box::new(Named {
            cap: cap.into(),
            what,
        }))
    }
}

/// Why a cap could not be created or grown.
#[derive(Debug, PartialEq)]
pub enum CapError {
    /// `max_caps` caps are in use (held slots, or counts not yet flushed).
    NoEntry { max_caps: u32, held: u32 },
    /// The arena has no block large enough.
    NoMemory { slots: u32 },
    /// Another cap of this database uses the same lock key (a key that cannot move: the
    /// `default` cap's, or any key in a database not yet updated to 0.7.0).
    KeyCollision { other: String, key: i32 },
    /// Every key the book covers is held (the create reads the book again, covering more).
    KeysExhausted { covered: u32 },
    /// The cap stayed pinned too long to be grown (a backend died mid-call).
    Busy,
    /// This database holds its share (`stage_e_slots.database_share`, `share` percent) of
    /// `pool`: `limit` caps or slot-memory pages.
    OverShare { pool: Pool, share: u32, limit: u64 },
}

/// A server-wide pool that databases share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pool {
    Caps,
    SlotMemory,
    Leases,
}
