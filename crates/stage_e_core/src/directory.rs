//! Caps by name: name rules, the deterministic lock key of a name, and the index that maps
//! `(database, name)` to a cap's entry in shared memory. Plain Rust, unit-tested.
//!
//! The index is open addressing with linear probing over a power-of-two table of entry numbers
//! (0 = empty), deleted by backward shift so no tombstones pile up under churn. It is read
//! under the directory LWLock in shared mode and changed under it in exclusive mode; backends
//! keep a local cache of it, so the lock is taken on a cache miss only.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

/// The cap of the one-argument functions; its slot `s` is the lock `(lock_key, s)`.
pub const DEFAULT_CAP: &str = "default";
/// Longest cap name in bytes (as NAMEDATALEN - 1).
pub const MAX_NAME: usize = 63;

/// Why a cap name is refused.
#[derive(Debug, PartialEq, Eq)]
pub enum NameError {
    Empty,
    TooLong { len: usize },
}

pub fn check_name(name: &str) -> Result<(), NameError> {
    match name.len() {
        0 => Err(NameError::Empty),
        len if len > MAX_NAME => Err(NameError::TooLong { len }),
        _ => Ok(()),
    }
}

/// 64-bit FNV-1a: small, fast for short names, and the same on every platform and release.
fn fnv1a(bytes: impl IntoIterator<Item = u8>, seed: u64) -> u64 {
    bytes.into_iter().fold(seed, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a as a `Hasher`, for a backend's own cache of cap names: a name is hashed on every call
/// that names a cap, and FNV-1a is several times cheaper than the default SipHash for short
/// keys. (Flooding that cache with colliding names would slow only the backend that chose them.)
#[derive(Clone, Copy)]
pub struct NameHasher(u64);

impl Default for NameHasher {
    fn default() -> Self {
        NameHasher(FNV_OFFSET)
    }
}

impl std::hash::Hasher for NameHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        self.0 = fnv1a(bytes.iter().copied(), self.0);
    }
}

/// The `BuildHasher` of [`NameHasher`].
pub type NameHash = std::hash::BuildHasherDefault<NameHasher>;

/// The first int4 of a named cap's advisory locks: the 32-bit FNV-1a of its name folded from
/// 64 bits, so it is the same on every server, after every restart and in every release.
/// (The `default` cap uses `stage_e_slots.lock_key` instead; see `shmem`.)
pub fn name_key(name: &str) -> i32 {
    let h = fnv1a(name.bytes(), FNV_OFFSET);
    ((h >> 32) ^ h) as u32 as i32
}

/// The `i`-th key of `name`'s probe sequence: [`name_key`] first, then the same hash seeded
/// with `i`, so each name has its own sequence (a name made to collide with another's first
/// key still has different later ones). Fixed like `name_key`: recorded keys refer to it.
pub fn probe_key(name: &str, i: u32) -> i32 {
    if i == 0 {
        return name_key(name);
    }
    let seed = FNV_OFFSET ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let h = fnv1a(name.bytes(), seed);
    ((h >> 32) ^ h) as u32 as i32
}

/// What a database knows of a name's key: the keys its counter rows record (see
/// `src/keys.rs`), read before a cap is made, for the first `covered` keys of the name's
/// probe sequence.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyBook {
    /// The key the name's own row records.
    pub recorded: Option<i32>,
    /// Keys other names' rows record, among the first `covered` probe keys.
    pub others: Vec<i32>,
    pub covered: u32,
}

/// The key a name gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// Its recorded key, or the first probe key that nothing holds.
    Key(i32),
    /// Every covered probe key is held: read the book again, covering more.
    Exhausted,
}

/// The key for a name whose book is `book`, where `taken(k)` says whether a live cap of the
/// same database (or the `default` cap) uses key `k`. A recorded key is kept unless a live cap
/// uses it (only a race with a flush can do that: the name then moves to a free key, which its
/// row records at the next flush). Otherwise the first probe key that neither a live cap nor
/// another name's row holds: a name colliding with another is resolved, never refused.
pub fn pick_key(name: &str, book: &KeyBook, taken: impl Fn(i32) -> bool) -> Pick {
    if let Some(k) = book.recorded.filter(|&k| !taken(k)) {
        return Pick::Key(k);
    }
    (0..book.covered)
        .map(|i| probe_key(name, i))
        .find(|&k| !taken(k) && !book.others.contains(&k))
        .map_or(Pick::Exhausted, Pick::Key)
}

/// Where `(db, name)` starts probing in the index.
pub fn index_hash(db: u32, name: &str) -> u64 {
    fnv1a(name.bytes(), fnv1a(db.to_le_bytes(), FNV_OFFSET))
}

/// Index table size for `entries` entries: a power of two, at most half full.
pub fn index_len(entries: u32) -> usize {
    (entries as usize * 2).next_power_of_two().max(16)
}

pub struct Index<'a> {
    table: &'a [AtomicU32],
}

impl<'a> Index<'a> {
    pub fn over(table: &'a [AtomicU32]) -> Self {
        debug_assert!(table.len().is_power_of_two());
        Index { table }
    }

    fn home(&self, hash: u64) -> usize {
        hash as usize & (self.table.len() - 1)
    }

    /// The entry for which `is(entry)` holds, probing from `hash`'s home.
    pub fn find(&self, hash: u64, is: impl Fn(u32) -> bool) -> Option<u32> {
        let mask = self.table.len() - 1;
        let mut i = self.home(hash);
        loop {
            match self.table[i].load(Relaxed) {
                0 => return None,
                e if is(e - 1) => return Some(e - 1),
                _ => i = (i + 1) & mask,
            }
        }
    }

    /// Adds `entry` (not present; the table is never more than half full).
    pub fn insert(&self, hash: u64, entry: u32) {
        let mask = self.table.len() - 1;
        let mut i = self.home(hash);
        while self.table[i].load(Relaxed) != 0 {
            i = (i + 1) & mask;
        }
        self.table[i].store(entry + 1, Relaxed);
    }

    /// Removes `entry`, found from `hash`; `hash_of` gives the hash of any other entry, to
    /// shift the entries after it back over the hole.
    pub fn remove(&self, hash: u64, entry: u32, hash_of: impl Fn(u32) -> u64) {
        let mask = self.table.len() - 1;
        let mut hole = self.home(hash);
        while self.table[hole].load(Relaxed) != entry + 1 {
            debug_assert!(
                self.table[hole].load(Relaxed) != 0,
                "entry {entry} not indexed"
            );
            hole = (hole + 1) & mask;
        }
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let e = self.table[j].load(Relaxed);
            if e == 0 {
                break;
            }
            let home = self.home(hash_of(e - 1));
            // Can e move back to the hole? Only if its home is not in (hole, j] cyclically.
            let between = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !between {
                self.table[hole].store(e, Relaxed);
                hole = j;
            }
        }
        self.table[hole].store(0, Relaxed);
    }
}

#[cfg(test)]
mod unit {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn the_name_hasher_is_fnv_1a_and_keys_a_map() {
        use std::hash::{BuildHasher, Hasher};
        let mut h = NameHasher::default();
        h.write(b"exports");
        assert_eq!(h.finish(), fnv1a(*b"exports", FNV_OFFSET));
        let b = NameHash::default();
        assert_eq!(b.hash_one("exports"), b.hash_one("exports"));
        assert_ne!(b.hash_one("exports"), b.hash_one("imports"));
        let mut m: HashMap<String, u32, NameHash> = HashMap::default();
        for i in 0..1_000 {
            m.insert(format!("c{i}"), i);
        }
        assert!((0..1_000).all(|i| m[&format!("c{i}")] == i));
    }

    #[test]
    fn names_are_1_to_63_bytes() {
        assert_eq!(check_name(""), Err(NameError::Empty));
        assert_eq!(check_name("x"), Ok(()));
        assert_eq!(check_name(&"é".repeat(31)), Ok(())); // 62 bytes
        assert_eq!(check_name(&"a".repeat(63)), Ok(()));
        assert_eq!(
            check_name(&"a".repeat(64)),
            Err(NameError::TooLong { len: 64 })
        );
        assert_eq!(
            check_name(&"é".repeat(32)),
            Err(NameError::TooLong { len: 64 })
        );
    }

    #[test]
    fn keys_are_deterministic_and_spread() {
        // Fixed values: a change here changes every cap's locks on upgrade.
        assert_eq!(name_key("exports"), name_key("exports"));
        assert_eq!(name_key("exports"), 1_751_787_301);
        assert_eq!(name_key("tenant:1"), 655_409_628);
        // A known collision (the tests use it to check that two such caps are refused).
        assert_eq!(name_key("c128898"), name_key("c153422"));
        let keys: std::collections::HashSet<i32> = (0..100_000)
            .map(|i| name_key(&format!("tenant:{i}")))
            .collect();
        assert!(keys.len() > 99_990, "{} distinct of 100000", keys.len());
    }

    #[test]
    fn probe_keys_start_at_the_name_key_and_differ_between_colliding_names() {
        let (a, b) = ("c128898", "c153422");
        assert_eq!(probe_key(a, 0), name_key(a));
        assert_eq!(probe_key(a, 0), probe_key(b, 0));
        assert_ne!(probe_key(a, 1), probe_key(b, 1));
        let seq: std::collections::HashSet<i32> = (0..1_000).map(|i| probe_key(a, i)).collect();
        assert_eq!(seq.len(), 1_000);
        // Fixed values: recorded keys refer to this sequence.
        assert_eq!(probe_key("exports", 1), probe_key("exports", 1));
        assert_eq!(probe_key("exports", 1), -1_155_795_468);
    }

    #[test]
    fn a_colliding_name_gets_the_next_free_key_and_a_recorded_key_is_kept() {
        let name = "exports";
        let k = |i| probe_key(name, i);
        let book = |recorded, others: Vec<i32>| KeyBook {
            recorded,
            others,
            covered: 4,
        };
        assert_eq!(
            pick_key(name, &book(None, vec![]), |_| false),
            Pick::Key(k(0))
        );
        // Its first key held by a live cap, its second by another name's row.
        let taken = |key| key == k(0);
        assert_eq!(
            pick_key(name, &book(None, vec![k(1)]), taken),
            Pick::Key(k(2))
        );
        // A recorded key wins over the sequence, even the name's first key being free...
        assert_eq!(
            pick_key(name, &book(Some(77), vec![]), |_| false),
            Pick::Key(77)
        );
        // ...unless a live cap uses it.
        assert_eq!(
            pick_key(name, &book(Some(77), vec![]), |key| key == 77),
            Pick::Key(k(0))
        );
        // Every covered key held: read further.
        let all = vec![k(1), k(2), k(3)];
        assert_eq!(pick_key(name, &book(None, all), taken), Pick::Exhausted);
    }

    #[test]
    fn index_finds_inserts_and_removes_under_churn() {
        let table: Vec<AtomicU32> = (0..index_len(64)).map(|_| AtomicU32::new(0)).collect();
        let idx = Index::over(&table);
        // entry -> (db, name); a deliberately weak hash makes long probe chains.
        let mut names: HashMap<u32, (u32, String)> = HashMap::new();
        let weak = |db: u32, name: &str| index_hash(db, name) % 7;
        let mut x = 7u64;
        for step in 0..20_000u32 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let e = ((x >> 33) % 64) as u32;
            if let Some((db, name)) = names.remove(&e) {
                let h = weak(db, &name);
                let snapshot = names.clone();
                idx.remove(h, e, |o| {
                    let (d, n) = &snapshot[&o];
                    weak(*d, n)
                });
                assert_eq!(idx.find(h, |o| o == e), None);
            } else {
                let (db, name) = (step % 3, format!("cap-{step}"));
                idx.insert(weak(db, &name), e);
                names.insert(e, (db, name));
            }
            for (&e, (db, name)) in &names {
                let found = idx.find(weak(*db, name), |o| {
                    names.get(&o).is_some_and(|(d, n)| d == db && n == name)
                });
                assert_eq!(found, Some(e), "step {step}");
            }
        }
    }
}
