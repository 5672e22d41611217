//! The two files and the journal that carry leases over a restart (`docs/lifecycle.md`): the
//! journal of a cap's live leases as its horizon row stores it, the lease file a clean shutdown
//! writes, and the stamp every file of ours opens with. What the files may be trusted for is
//! `lifecycle`'s: the lease file is stamped with that shutdown's checkpoint ([`Checkpoint`]) and
//! is exact for the start right after it and for no other ([`LeaseFile::check`]), so a copy put
//! back later is known and the start is a crash.

use crate::lifecycle::HoldReason;
use std::fmt::{Display, Write as _};

/// One lease as the journal and the lease file record it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JournalLease {
    pub slot: u32,
    pub token: u64,
    pub expires_at: i64,
    /// The role that took it (the only one, with its members, that may renew or release it).
    pub owner: u32,
}

/// The journal of a cap's live leases, as the jsonb text its row stores:
/// `[[slot, token, expires_at_us, owner], …]`.
pub fn encode_journal(leases: &[JournalLease]) -> String {
    let mut out = String::from("[");
    for (i, l) in leases.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "[{},{},{},{}]", l.slot, l.token, l.expires_at, l.owner);
    }
    out.push(']');
    out
}

/// A saved lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedLease {
    pub database: u32,
    pub cap: String,
    pub slot: u32,
    pub token: u64,
    pub acquired_at: i64,
    pub expires_at: i64,
    pub owner: u32,
    /// The cap's lock key (None in a file written before 0.7.0: the name's first key).
    pub key: Option<i32>,
    /// The fair share it was taken in (None in a file written before 0.11.0).
    pub share: LeaseShare,
}

/// The fair share a saved lease counts in (issue 38).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum LeaseShare {
    /// None: its cap had no shares when it was taken.
    #[default]
    None,
    /// The cap's unnamed share (a call without `share` on a cap with shares).
    Unnamed,
    Named(String),
}

impl LeaseShare {
    /// As a lease line writes it: `-`, `unnamed` (not hex, so no name reads as it), or the
    /// name in hex.
    fn field(&self) -> String {
        match self {
            LeaseShare::None => "-".into(),
            LeaseShare::Unnamed => "unnamed".into(),
            LeaseShare::Named(name) => hex(name),
        }
    }

    fn parse(field: &str) -> Option<LeaseShare> {
        match field {
            "-" => Some(LeaseShare::None),
            "unnamed" => Some(LeaseShare::Unnamed),
            h => unhex(h).filter(|n| !n.is_empty()).map(LeaseShare::Named),
        }
    }
}

/// Which clean shutdown a lease file belongs to: the cluster's system identifier and the LSN of
/// the shutdown checkpoint in the control file when it was written. The file speaks for the
/// start right after that shutdown only: one whose control file says "shut down" at this same
/// checkpoint. Any other start (a crash since, or an older copy put back) cannot trust it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    pub system: u64,
    pub lsn: u64,
}

impl std::fmt::Display for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:X}/{:X}", self.lsn >> 32, self.lsn as u32)
    }
}

/// A cap held back at a clean shutdown (after a crash or a promotion, its hold had not ended):
/// the next start holds it back as long, since leases the crashed server granted but its
/// journal missed may still be live, and only the hold keeps their slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedHold {
    pub database: u32,
    pub cap: String,
    pub key: Option<i32>,
    pub until: i64,
    pub reason: HoldReason,
}

/// The lease file of a clean shutdown: the server's last token, every live lease and every
/// hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeaseFile {
    /// None in a file written before 0.9.1 (v1 and v2), which has no stamp.
    pub checkpoint: Option<Checkpoint>,
    pub last_token: u64,
    pub leases: Vec<SavedLease>,
    /// Since 0.9.1 (v3).
    pub holds: Vec<SavedHold>,
}

const LEASE_FILE_HEADER_V1: &str = "stage_e_slots leases v1";
/// Since 0.7.0 each lease line ends with its cap's lock key.
const LEASE_FILE_HEADER_V2: &str = "stage_e_slots leases v2";
/// Since 0.9.1 a `checkpoint` line says which clean shutdown wrote the file, and `hold` lines
/// carry the holds not yet ended.
const LEASE_FILE_HEADER_V3: &str = "stage_e_slots leases v3";
/// Since 0.11.0 each lease line ends with the share the lease counts in.
const LEASE_FILE_HEADER: &str = "stage_e_slots leases v4";

/// Why a saved file is not used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileError {
    /// Written by a server of another major version.
    OtherMajor(u32),
    /// Not in the expected format (the line, counted from 1).
    Corrupt(usize),
    /// Written at another clean shutdown than the last one (an older copy put back), or by
    /// another cluster: what it says may no longer be all that is live.
    OtherShutdown {
        written: Checkpoint,
        last: Checkpoint,
    },
}

impl std::fmt::Display for FileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FileError::OtherMajor(m) => write!(f, "it was written by PostgreSQL {m}"),
            FileError::Corrupt(line) => write!(f, "line {line} is not in the expected format"),
            FileError::OtherShutdown { written, last } if written.system != last.system => write!(
                f,
                "it was written by another cluster (system identifier {}, this one is {})",
                written.system, last.system
            ),
            FileError::OtherShutdown { written, last } => write!(
                f,
                "it was written at the shutdown checkpoint {written}, not at the last clean \
                 shutdown's ({last}): it is an older copy, and leases granted since are not in it"
            ),
        }
    }
}

const STAMP: &str = "stage_e_slots major ";

/// A saved file's text with a first line naming the server's major version, so that a file
/// another major wrote is never read (the pending-counts file; the lease file has its own).
pub fn stamp(major: u32, body: &str) -> String {
    format!("{STAMP}{major}\n{body}")
}

/// The body of a text [`stamp`]ed by major `major`; a text without a stamp (written before
/// 0.6.0, which only this server's own shutdown could have done) as it is.
pub fn unstamp(text: &str, major: u32) -> Result<&str, FileError> {
    let Some(rest) = text.strip_prefix(STAMP) else {
        return Ok(text);
    };
    let (line, body) = rest.split_once('\n').ok_or(FileError::Corrupt(1))?;
    match line.parse::<u32>() {
        Ok(m) if m == major => Ok(body),
        Ok(m) => Err(FileError::OtherMajor(m)),
        Err(_) => Err(FileError::Corrupt(1)),
    }
}

/// One line of the file: its kind, then its fields, separated by spaces.
fn put_line(out: &mut String, kind: &str, fields: &[&dyn Display]) {
    out.push_str(kind);
    for f in fields {
        let _ = write!(out, " {f}");
    }
    out.push('\n');
}

/// A lock key as the file writes it: `-` for none (a file of 0.6.0).
fn key_field(key: Option<i32>) -> String {
    key.map_or("-".to_string(), |k| k.to_string())
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

fn unhex(h: &str) -> Option<String> {
    if !h.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..h.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(h.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

impl LeaseFile {
    /// The file's text, stamped with the server's major version (and its checkpoint, if any:
    /// a file without one is written in the v2 format).
    pub fn encode(&self, major: u32) -> String {
        let mut out = match self.checkpoint {
            Some(c) => format!(
                "{LEASE_FILE_HEADER}\nmajor {major}\ncheckpoint {} {}\n",
                c.system, c.lsn
            ),
            None => format!("{LEASE_FILE_HEADER_V2}\nmajor {major}\n"),
        };
        let _ = writeln!(out, "tokens {}", self.last_token);
        for l in &self.leases {
            let cap = hex(&l.cap);
            let key = key_field(l.key);
            let share = l.share.field();
            let mut fields: Vec<&dyn Display> = vec![
                &l.database,
                &cap,
                &l.slot,
                &l.token,
                &l.acquired_at,
                &l.expires_at,
                &l.owner,
                &key,
            ];
            if self.checkpoint.is_some() {
                fields.push(&share); // (a v2 file has no share)
            }
            put_line(&mut out, "lease", &fields);
        }
        // (A v2 file has no hold lines.)
        for h in self.holds.iter().filter(|_| self.checkpoint.is_some()) {
            let (cap, reason, key) = (hex(&h.cap), h.reason as u32, key_field(h.key));
            let fields: [&dyn Display; 5] = [&h.database, &cap, &h.until, &reason, &key];
            put_line(&mut out, "hold", &fields);
        }
        out.push_str("end\n");
        out
    }

    /// Parses [`encode`](Self::encode)'s text written by a server of major `major`; a file cut
    /// short (no `end` line), of another major or with any bad line is refused whole.
    pub fn decode(text: &str, major: u32) -> Result<LeaseFile, FileError> {
        let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l));
        let corrupt = |i: usize| FileError::Corrupt(i);
        // Fields after the owner: the key (v2 on), the share (v4).
        let (extra, stamped) = match lines.next() {
            Some((_, LEASE_FILE_HEADER)) => (2, true),
            Some((_, LEASE_FILE_HEADER_V3)) => (1, true),
            Some((_, LEASE_FILE_HEADER_V2)) => (1, false),
            Some((_, LEASE_FILE_HEADER_V1)) => (0, false),
            other => return Err(corrupt(other.map_or(1, |(i, _)| i))),
        };
        let (i, stamp) = lines.next().ok_or(corrupt(2))?;
        let written_by: u32 = stamp
            .strip_prefix("major ")
            .and_then(|m| m.parse().ok())
            .ok_or(corrupt(i))?;
        if written_by != major {
            return Err(FileError::OtherMajor(written_by));
        }
        let checkpoint = if stamped {
            let (i, line) = lines.next().ok_or(corrupt(3))?;
            let parsed = match line.split(' ').collect::<Vec<_>>().as_slice() {
                ["checkpoint", system, lsn] => system
                    .parse()
                    .ok()
                    .zip(lsn.parse().ok())
                    .map(|(system, lsn)| Checkpoint { system, lsn }),
                _ => None,
            };
            Some(parsed.ok_or(corrupt(i))?)
        } else {
            None
        };
        let (i, tokens) = lines.next().ok_or(corrupt(3 + stamped as usize))?;
        let mut file = LeaseFile {
            checkpoint,
            last_token: tokens
                .strip_prefix("tokens ")
                .and_then(|t| t.parse().ok())
                .ok_or(corrupt(i))?,
            leases: Vec::new(),
            holds: Vec::new(),
        };
        for (i, line) in lines {
            let w: Vec<&str> = line.split(' ').collect();
            let parsed = match w.as_slice() {
                ["end"] => return Ok(file),
                ["lease", db, name, slot, token, acquired, expires, owner, rest @ ..]
                    if rest.len() == extra =>
                {
                    (|| {
                        let key = match rest.first() {
                            None | Some(&"-") => None,
                            Some(k) => Some(k.parse().ok()?),
                        };
                        let share = match rest.get(1) {
                            None => LeaseShare::None,
                            Some(s) => LeaseShare::parse(s)?,
                        };
                        file.leases.push(SavedLease {
                            database: db.parse().ok()?,
                            cap: unhex(name)?,
                            slot: slot.parse().ok()?,
                            token: token.parse().ok()?,
                            acquired_at: acquired.parse().ok()?,
                            expires_at: expires.parse().ok()?,
                            owner: owner.parse().ok()?,
                            key,
                            share,
                        });
                        Some(())
                    })()
                }
                ["hold", db, name, until, reason, key] if stamped => (|| {
                    file.holds.push(SavedHold {
                        database: db.parse().ok()?,
                        cap: unhex(name)?,
                        key: match *key {
                            "-" => None,
                            k => Some(k.parse().ok()?),
                        },
                        until: until.parse().ok()?,
                        reason: HoldReason::from_u32(reason.parse().ok()?)?,
                    });
                    Some(())
                })(),
                _ => None,
            };
            parsed.ok_or(corrupt(i))?;
        }
        Err(corrupt(text.lines().count() + 1))
    }

    /// Whether the file speaks for a start whose control file says the server shut down
    /// cleanly at `last`: a stamped file only if it was written at that very shutdown; a file
    /// of 0.9.0 or earlier (no stamp) is taken on trust, as those versions did, since only its
    /// own shutdown could have written it unless a copy was put back.
    pub fn check(&self, last: Checkpoint) -> Result<(), FileError> {
        match self.checkpoint {
            Some(written) if written != last => Err(FileError::OtherShutdown { written, last }),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn the_journal_is_json_arrays_of_integers() {
        let j = encode_journal(&[
            JournalLease {
                slot: 0,
                token: 1 << 62,
                expires_at: 851_000_000_000_000,
                owner: 10,
            },
            JournalLease {
                slot: 7,
                token: 3,
                expires_at: -1,
                owner: 16_384,
            },
        ]);
        assert_eq!(
            j,
            "[[0,4611686018427387904,851000000000000,10],[7,3,-1,16384]]".to_string()
        );
        assert_eq!(encode_journal(&[]), "[]");
    }

    const AT: Checkpoint = Checkpoint {
        system: 7_448_066_310_915_473_127,
        lsn: 0x1_0400_0028,
    };

    fn sample() -> LeaseFile {
        LeaseFile {
            checkpoint: Some(AT),
            last_token: 1 << 61,
            leases: vec![SavedLease {
                database: 5,
                cap: "with space é".into(),
                slot: 3,
                token: 9,
                acquired_at: -5,
                expires_at: 851_000_000_000_000,
                owner: 10,
                key: Some(-1_155_795_468),
                share: LeaseShare::Named("tenant é".into()),
            }],
            holds: vec![SavedHold {
                database: 5,
                cap: "held é".into(),
                key: Some(-7),
                until: 851_000_000_000_000,
                reason: HoldReason::Crash,
            }],
        }
    }

    /// Issue 35: an older copy of the file put back (a restore of pg_stat/) is refused, since
    /// leases granted after it was written are not in it; so is another cluster's.
    #[test]
    fn the_lease_file_speaks_only_for_the_shutdown_that_wrote_it() {
        let f = sample();
        let text = f.encode(18);
        assert!(
            text.contains("\ncheckpoint 7448066310915473127 4362076200\n"),
            "{text}"
        );
        let read = LeaseFile::decode(&text, 18).expect("a v4 file");
        assert_eq!(read.check(AT), Ok(()));
        let later = Checkpoint {
            lsn: AT.lsn + 0x98,
            ..AT
        };
        let err = read.check(later).unwrap_err();
        assert_eq!(
            err,
            FileError::OtherShutdown {
                written: AT,
                last: later
            }
        );
        assert_eq!(
            err.to_string(),
            "it was written at the shutdown checkpoint 1/4000028, not at the last clean \
             shutdown's (1/40000C0): it is an older copy, and leases granted since are not in it"
        );
        let other = Checkpoint { system: 1, ..AT };
        assert!(read
            .check(other)
            .unwrap_err()
            .to_string()
            .contains("another cluster"));
        // A damaged stamp line is corrupt, like any other line.
        let bad = text.replace("checkpoint 7448066310915473127", "checkpoint x");
        assert_eq!(LeaseFile::decode(&bad, 18), Err(FileError::Corrupt(3)));
        // A file of 0.7.0 to 0.9.0 (v2, no stamp, no holds) is still read, and taken on trust.
        let v2 = LeaseFile {
            checkpoint: None,
            holds: Vec::new(),
            ..sample()
        };
        let old = v2.encode(18);
        assert!(
            old.starts_with("stage_e_slots leases v2\nmajor 18\ntokens "),
            "{old}"
        );
        let read = LeaseFile::decode(&old, 18).expect("a v2 file");
        assert_eq!((read.checkpoint, read.check(later)), (None, Ok(())));
    }

    /// Issue 38: a lease keeps its share over a clean restart; a file of 0.9.1 to 0.10.0 (v3)
    /// is still read, its leases in no share.
    #[test]
    fn a_lease_line_ends_with_its_share() {
        let mut f = sample();
        let named = f.leases[0].clone();
        f.leases.push(SavedLease {
            slot: 4,
            share: LeaseShare::Unnamed,
            ..named.clone()
        });
        f.leases.push(SavedLease {
            slot: 5,
            share: LeaseShare::None,
            ..named
        });
        let text = f.encode(18);
        assert!(text.starts_with("stage_e_slots leases v4\n"), "{text}");
        assert!(text.contains(" -1155795468 74656e616e7420c3a9\n"), "{text}");
        assert!(text.contains(" -1155795468 unnamed\n"), "{text}");
        assert!(text.contains(" -1155795468 -\n"), "{text}");
        assert_eq!(LeaseFile::decode(&text, 18), Ok(f.clone()));
        let v3 = text
            .replace("leases v4", "leases v3")
            .replace(" 74656e616e7420c3a9\n", "\n")
            .replace(" unnamed\n", "\n")
            .replace(" -1155795468 -\n", " -1155795468\n");
        let read = LeaseFile::decode(&v3, 18).expect("a v3 file");
        assert!(read.leases.iter().all(|l| l.share == LeaseShare::None));
        // A share that is not hex (nor `-`, nor `unnamed`), or an empty name, is damage.
        for bad in [" zz\n", " \n", " 746\n"] {
            let damaged = text.replace(" 74656e616e7420c3a9\n", bad);
            assert!(matches!(
                LeaseFile::decode(&damaged, 18),
                Err(FileError::Corrupt(_))
            ));
        }
        // A v3 line with a share is damaged too.
        assert!(matches!(
            LeaseFile::decode(&text.replace("leases v4", "leases v3"), 18),
            Err(FileError::Corrupt(_))
        ));
    }

    #[test]
    fn the_lease_file_of_0_6_0_has_no_keys() {
        let text = "stage_e_slots leases v1\nmajor 18\ntokens 7\n\
                    lease 5 6162 3 9 -5 851000000000000 10\nend\n";
        let f = LeaseFile::decode(text, 18).expect("a v1 file");
        assert_eq!((f.leases[0].cap.as_str(), f.leases[0].key), ("ab", None));
        // A v1 line with a key, or a v2 line without one, is damaged.
        let keyed = text.replace(" 10\n", " 10 5\n");
        assert_eq!(LeaseFile::decode(&keyed, 18), Err(FileError::Corrupt(4)));
        let keyless = text.replace("leases v1", "leases v2");
        assert_eq!(LeaseFile::decode(&keyless, 18), Err(FileError::Corrupt(4)));
    }

    #[test]
    fn the_lease_file_round_trips_and_refuses_anything_else() {
        let f = sample();
        let text = f.encode(18);
        assert_eq!(LeaseFile::decode(&text, 18), Ok(f));
        assert_eq!(LeaseFile::decode(&text, 15), Err(FileError::OtherMajor(18)));
        // Cut short, garbled, or empty: refused whole.
        let cut = &text[..text.len() - 4];
        assert!(matches!(
            LeaseFile::decode(cut, 18),
            Err(FileError::Corrupt(_))
        ));
        // A hold line with a reason that is none.
        let unknown = text.replace(" 851000000000000 1 -7\n", " 851000000000000 9 -7\n");
        assert_ne!(unknown, text);
        assert!(matches!(
            LeaseFile::decode(&unknown, 18),
            Err(FileError::Corrupt(_))
        ));
        let garbled = text.replace("lease 5", "lease x");
        assert_eq!(LeaseFile::decode(&garbled, 18), Err(FileError::Corrupt(5)));
        assert_eq!(LeaseFile::decode("", 18), Err(FileError::Corrupt(1)));
        assert_eq!(
            LeaseFile::decode("\u{0}\u{1}garbage", 18),
            Err(FileError::Corrupt(1))
        );
        // The pending-counts file's stamp.
        let body = "stage_e_slots pending counters v2\n1 61 2 3 4 5 6\n";
        assert_eq!(unstamp(&stamp(15, body), 15), Ok(body));
        assert_eq!(
            unstamp(&stamp(15, body), 18),
            Err(FileError::OtherMajor(15))
        );
        assert_eq!(unstamp(body, 18), Ok(body), "a file of 0.5.0, unstamped");
        assert_eq!(
            unstamp("stage_e_slots major x\n", 18),
            Err(FileError::Corrupt(1))
        );
        let empty = LeaseFile::default();
        assert_eq!(LeaseFile::decode(&empty.encode(15), 15), Ok(empty));
    }
}
