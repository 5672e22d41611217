//! Tests of the pool that many caps' share records live in: chains that never cross, records
//! given back, a database's limit of them.

use super::model::{share, Rng};
use super::*;

/// Every record is in exactly one cap's chain, on the free list, or never used (at or above
/// `high`); the count of used records is the chains' length; no chain names a share twice.
fn check_pool(clocks: &[Clock], t: &Shares) {
    let mut seen = vec![0u8; t.records.len()];
    let mut chained = 0;
    for c in clocks {
        let mut digests = Vec::new();
        let mut at = c.first;
        while at != 0 {
            let i = at as usize - 1;
            seen[i] += 1;
            chained += 1;
            assert_ne!(t.records[i].digest, 0, "a chain holds a free record");
            digests.push(t.records[i].digest);
            at = t.records[i].next;
        }
        let n = digests.len();
        digests.sort();
        digests.dedup();
        assert_eq!(digests.len(), n, "a share twice in one chain");
    }
    let mut at = t.head.free;
    while at != 0 {
        let i = at as usize - 1;
        seen[i] += 1;
        assert_eq!(t.records[i].digest, 0, "a free record names a share");
        at = t.records[i].next;
    }
    for (i, &n) in seen.iter().enumerate() {
        let expect = u8::from(i < t.head.high as usize);
        assert_eq!(n, expect, "record {i} is in {n} lists");
    }
    assert_eq!(t.used as usize, chained);
}

/// Three caps share one pool of 6 records; the database may hold 5. A cap whose shares fill
/// the limit refuses a new one until another cap's idle share is forgotten.
#[test]
fn caps_share_one_pool_within_the_databases_limit() {
    let mut t = Shares::new(6);
    let mut clocks = [Clock::default(); 3];
    fn pool(t: &mut Shares) -> Pool<'_> {
        Pool {
            limit: 5,
            ..t.pool()
        }
    }
    let s = |d| share(d, 1, NO_CEILING);
    for (cap, d) in [(0, 1), (0, 2), (1, 3), (1, 4), (2, 5)] {
        Fair::new(&mut clocks[cap], pool(&mut t))
            .took_now(s(d), 1)
            .unwrap();
    }
    assert_eq!(t.used, 5);
    check_pool(&clocks, &t);
    assert_eq!(
        Fair::new(&mut clocks[2], pool(&mut t)).took_now(s(6), 1),
        Err(Refused::Full),
        "at the database's limit, with no idle record of its own"
    );
    Fair::new(&mut clocks[0], pool(&mut t)).released(1, 1);
    assert_eq!(t.used, 4, "an idle share is forgotten");
    Fair::new(&mut clocks[2], pool(&mut t))
        .took_now(s(6), 1)
        .unwrap();
    check_pool(&clocks, &t);
    let f = Fair::new(&mut clocks[0], pool(&mut t));
    assert_eq!((f.live(), f.start_of(2)), (1, 0), "cap 0 keeps share 2");
}

/// Random calls, waits, grants, cancellations and releases on four caps that share one pool
/// keep the pool's lists whole after every step, and give every record back at the end.
#[test]
fn random_steps_on_caps_sharing_a_pool_keep_its_lists_whole() {
    for seed in 0..300 {
        let mut rng = Rng(seed);
        let mut t = Shares::new(rng.range(2, 12) as usize);
        let mut clocks = [Clock::default(); 4];
        // Per cap: its waiters (share, ticket) and its holds (where their share's record is).
        let mut queues: [Vec<Waiter>; 4] = Default::default();
        let mut holds: [Vec<ShareAt>; 4] = Default::default();
        let mut ticket = 0;
        for _ in 0..400 {
            let cap = rng.below(4);
            let sh = share(1 + rng.below(6) as u64, rng.range(1, 4), NO_CEILING);
            let mut f = Fair::new(&mut clocks[cap], t.pool());
            match rng.below(4) {
                0 if f.may_take_now(sh, 1, 8) => {
                    if let Ok(at) = f.took_now(sh, 1) {
                        holds[cap].push(at);
                    }
                }
                1 => {
                    if f.join(sh, ticket, 1).is_ok() {
                        queues[cap].push(Waiter {
                            share: sh.digest,
                            ticket,
                            k: 1,
                        });
                        ticket += 1;
                    }
                }
                2 if !queues[cap].is_empty() => {
                    let i = rng.below(queues[cap].len());
                    let w = queues[cap].remove(i);
                    f.leave(w, queues[cap].iter().copied());
                }
                _ => {
                    if let Some(w) = f.who_next(1) {
                        queues[cap].retain(|q| q.ticket != w.ticket);
                        let at = f.granted(w, queues[cap].iter().copied());
                        holds[cap].push(at.expect("a waiter of a share"));
                    } else if !holds[cap].is_empty() {
                        let at = holds[cap].remove(rng.below(holds[cap].len()));
                        f.released_at(at, 1);
                    }
                }
            }
            check_pool(&clocks, &t);
        }
        for cap in 0..4 {
            let mut f = Fair::new(&mut clocks[cap], t.pool());
            while let Some(w) = queues[cap].pop() {
                f.leave(w, queues[cap].iter().copied());
            }
            for at in std::mem::take(&mut holds[cap]) {
                f.released_at(at, 1);
            }
        }
        check_pool(&clocks, &t);
        assert_eq!(t.used, 0, "seed {seed}: every record back in the pool");
    }
}

/// What shared memory keeps in atomics comes back as it was: the clock's two words (its chain
/// link readable from the second alone, without the lock) and the pool's head word.
#[test]
fn clock_and_pool_head_pack_into_words_and_back() {
    let mut t = Shares::new(4);
    let mut clock = Clock::default();
    assert!(!Clock::has_shares(clock.pack()[1]));
    let a = share(7, 2, 3);
    {
        let mut f = Fair::new(&mut clock, t.pool());
        f.join(a, 1, 1).unwrap();
        f.took_now(share(9, 1, NO_CEILING), 1).unwrap();
    }
    let words = clock.pack();
    assert_eq!(Clock::unpack(words), clock);
    assert!(Clock::has_shares(words[1]));
    assert_eq!(PoolHead::unpack(t.head.pack()), t.head);
    let edge = PoolHead {
        free: u32::MAX,
        high: 1,
    };
    assert_eq!(PoolHead::unpack(edge.pack()), edge);
    let edge = Clock {
        v: u64::MAX,
        waiting: (1 << WAITING_BITS) - 1,
        cutoff: CUTOFF_MAX as u32,
        first: (1 << 21) - 1,
    };
    assert_eq!(Clock::unpack(edge.pack()), edge);
    // The views' reading of the chain: both shares, their policy and counts.
    let mut live: Vec<ShareView> = live_shares(&clock, &t.records).map(|(_, s)| s).collect();
    live.sort_by_key(|s| s.digest);
    assert_eq!(
        live,
        vec![
            ShareView {
                digest: 7,
                weight: 2,
                ceiling: 3,
                held: 0,
                waiting: 1
            },
            ShareView {
                digest: 9,
                weight: 1,
                ceiling: NO_CEILING,
                held: 1,
                waiting: 0
            },
        ]
    );
}
