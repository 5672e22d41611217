//! The rate file a clean shutdown writes (`pg_stat/stage_e_slots.rates`): the secret of the
//! keys' digests, every key not idle with its arrival time, the spent mark, and the clocks and
//! checkpoint it was written at; and how the arrival times carry over onto the clock of the
//! next start, of this boot or another (`rate` is the table they go back into).

use crate::rate::BUSY;

/// The rate file of a clean shutdown: the secret and every key not idle, with the clocks and
/// the checkpoint it was written at. A start trusts it only right after that shutdown (the
/// server's control file at the same checkpoint), as the lease file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RateFile {
    /// `(system identifier, checkpoint LSN)` of the shutdown.
    pub checkpoint: (u64, u64),
    /// `/proc/sys/kernel/random/boot_id`: the same boot keeps the clock running.
    pub boot: String,
    /// The rate clock (boot time, ns) and the wall clock (µs since 2000) at the shutdown.
    pub clock: u64,
    pub wall_us: i64,
    pub secret: [u64; 2],
    /// Since when every key's burst counted as spent (a crash or a promotion before the
    /// shutdown; 0: none).
    pub spent: u64,
    /// `(digest, db, tat)`.
    pub keys: Vec<(u64, u32, u64)>,
}

const FILE_HEAD: &str = "stage_e_slots rates 1";

impl RateFile {
    pub fn encode(&self) -> String {
        let mut out = format!(
            "{FILE_HEAD}\ncheckpoint {} {}\nboot {}\nclock {} {} {}\nsecret {} {}\n",
            self.checkpoint.0,
            self.checkpoint.1,
            self.boot,
            self.clock,
            self.wall_us,
            self.spent,
            self.secret[0],
            self.secret[1]
        );
        for (d, db, tat) in &self.keys {
            out.push_str(&format!("key {d} {db} {tat}\n"));
        }
        out.push_str(&format!("end {}\n", self.keys.len()));
        out
    }

    /// None for a file that is not one whole (a torn or foreign file is not trusted).
    pub fn decode(text: &str) -> Option<RateFile> {
        let mut lines = text.lines();
        if lines.next()? != FILE_HEAD {
            return None;
        }
        let mut field = |name: &str| -> Option<Vec<String>> {
            let line = lines.next()?;
            let mut words = line.split(' ');
            (words.next()? == name).then(|| words.map(str::to_owned).collect())
        };
        let num = |w: &[String], i: usize| w.get(i)?.parse::<u64>().ok();
        let cp = field("checkpoint")?;
        let boot = field("boot")?;
        let clock = field("clock")?;
        let secret = field("secret")?;
        let mut file = RateFile {
            checkpoint: (num(&cp, 0)?, num(&cp, 1)?),
            boot: boot.first()?.clone(),
            clock: num(&clock, 0)?,
            wall_us: clock.get(1)?.parse().ok()?,
            spent: num(&clock, 2)?,
            secret: [num(&secret, 0)?, num(&secret, 1)?],
            keys: Vec::new(),
        };
        for line in lines {
            let w: Vec<&str> = line.split(' ').collect();
            if w.len() == 2 && w[0] == "end" {
                // The last line: a torn file has none, or not this count.
                return (w[1].parse::<usize>().ok()? == file.keys.len()).then_some(file);
            }
            if w.len() != 4 || w[0] != "key" {
                return None;
            }
            file.keys
                .push((w[1].parse().ok()?, w[2].parse().ok()?, w[3].parse().ok()?));
        }
        None
    }

    /// The keys' arrival times on the clock of a start at `clock` (`boot`, `wall_us`). The
    /// same boot: exactly as saved (the clock ran on). Another boot: each key keeps what was
    /// left of its wait at the shutdown, less the time since, counted no longer than the new
    /// boot has run and than the wall clock moved, whichever is less (a wall clock stepped
    /// forward grants nothing). Keys idle by then are left out.
    pub fn carried(&self, boot: &str, clock: u64, wall_us: i64) -> Vec<(u64, u32, u64)> {
        if self.same_boot(boot, clock) {
            return self.keys.iter().copied().filter(|k| k.2 > clock).collect();
        }
        let wall_ns = (wall_us.saturating_sub(self.wall_us).max(0) as u64).saturating_mul(1_000);
        let elapsed = wall_ns.min(clock);
        self.keys
            .iter()
            .filter_map(|&(d, db, tat)| {
                let left = tat.saturating_sub(self.clock).checked_sub(elapsed)?;
                (left > 0).then(|| (d, db, clock.saturating_add(left).min(BUSY - 1)))
            })
            .collect()
    }

    /// The spent mark on the clock of a start at `clock` of `boot`: kept in the same boot
    /// (another's clock has no common origin; a boot takes longer than any burst it keeps).
    pub fn carried_spent(&self, boot: &str, clock: u64) -> u64 {
        if self.same_boot(boot, clock) {
            self.spent
        } else {
            0
        }
    }

    fn same_boot(&self, boot: &str, clock: u64) -> bool {
        boot == self.boot && clock >= self.clock
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn the_rate_file_round_trips_and_refuses_torn_files() {
        let f = RateFile {
            checkpoint: (7, 0x1_0000_0028),
            boot: "b1".into(),
            clock: 100 * SEC,
            wall_us: 5_000_000,
            secret: [1, u64::MAX],
            spent: 99 * SEC,
            keys: vec![(9, 1, 101 * SEC), (10, 2, 130 * SEC)],
        };
        let text = f.encode();
        assert_eq!(RateFile::decode(&text), Some(f.clone()));
        assert_eq!(RateFile::decode(&text[..text.len() - 3]), None, "torn");
        let cut = text.find("key 10").unwrap();
        assert_eq!(RateFile::decode(&text[..cut]), None, "torn at a line");
        assert_eq!(RateFile::decode("stage_e_slots rates 2\n"), None);
        // The same boot: exactly.
        assert_eq!(f.carried("b1", 100 * SEC + 5, 6_000_000), f.keys);
        assert_eq!(f.carried("b1", 120 * SEC, 0), vec![(10, 2, 130 * SEC)]);
        assert_eq!(f.carried_spent("b1", 120 * SEC), 99 * SEC);
        assert_eq!(f.carried_spent("b2", 120 * SEC), 0);
        // Another boot, 10 s of wall clock later, up 20 s: 10 s counted.
        assert_eq!(
            f.carried("b2", 20 * SEC, 15_000_000),
            vec![(10, 2, 40 * SEC)]
        );
        // The wall clock stepped 1 h forward, but the machine is up 3 s: 3 s counted.
        assert_eq!(
            f.carried("b2", 3 * SEC, 3_605_000_000),
            vec![(10, 2, 30 * SEC)]
        );
        // The wall clock stepped back: nothing counted.
        assert_eq!(
            f.carried("b2", 50 * SEC, 0),
            vec![(9, 1, 51 * SEC), (10, 2, 80 * SEC)]
        );
    }
}
