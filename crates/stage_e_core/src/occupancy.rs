//! Occupancy bitmap: which slots of one cap are known to be held through the extension.
//!
//! Plain Rust over `AtomicU64` words, no Postgres: the same code runs on a shared-memory
//! bitmap in the server and on a `Vec` in unit tests. A set bit means "claimed": either a
//! backend holds the slot's advisory lock through the extension, or it is about to probe the
//! lock manager for it. Setting a bit is a compare-and-swap, so two backends never claim the
//! same slot at once, and a throttled search costs `n / 64` word loads and no lock-manager call.
//!
//! The bitmap is a cache: the lock manager decides. A clear bit may still be locked by a raw
//! `pg_try_advisory_lock` (the probe finds that out); a set bit is cleared by its owner only.

use crate::sync::{fence, AtomicU64, Ordering};

const WORD_BITS: u32 = 64;

/// Number of 64-bit words needed for `slots` bits.
pub const fn words_for(slots: u32) -> usize {
    slots.div_ceil(WORD_BITS) as usize
}

/// Mask of the bits of word `w` that fall below slot `n`.
fn mask_below(w: usize, n: u32) -> u64 {
    let first = w as u32 * WORD_BITS;
    match n.saturating_sub(first) {
        0 => 0,
        k if k >= WORD_BITS => u64::MAX,
        k => (1u64 << k) - 1,
    }
}

/// A claimed slot. Dropping it without [`Claim::keep`] clears the bit again, so an ERROR
/// raised while probing the lock manager (which unwinds through Rust) cannot leak a slot.
#[must_use]
pub struct Claim<'a> {
    words: &'a [AtomicU64],
    slot: u32,
    kept: bool,
}

impl<'a> Claim<'a> {
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The slot is now held: leave the bit set.
    pub fn keep(mut self) -> u32 {
        self.kept = true;
        self.slot
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.kept {
            clear(self.words, self.slot);
        }
    }
}

/// Claims the lowest clear slot in `[from, n)`, or returns `None` when every one is set.
#[inline]
pub fn claim_first_free(words: &[AtomicU64], from: u32, n: u32) -> Option<Claim<'_>> {
    if n <= WORD_BITS && !words.is_empty() {
        // One word (n <= 64, the common case), inline in the caller.
        if from >= n {
            return None;
        }
        let bit = claim_in(&words[0], mask_below(0, n) & (u64::MAX << from))?;
        return Some(Claim {
            words,
            slot: bit,
            kept: false,
        });
    }
    claim_in_words(words, from, n)
}

#[inline(never)]
fn claim_in_words(words: &[AtomicU64], from: u32, n: u32) -> Option<Claim<'_>> {
    let first = (from / WORD_BITS) as usize;
    for (w, word) in words
        .iter()
        .enumerate()
        .take(words_for(n).min(words.len()))
        .skip(first)
    {
        let mut allowed = mask_below(w, n);
        if w == first {
            allowed &= u64::MAX << (from % WORD_BITS);
        }
        if let Some(bit) = claim_in(word, allowed) {
            return Some(Claim {
                words,
                slot: w as u32 * WORD_BITS + bit,
                kept: false,
            });
        }
    }
    None
}

/// Sets the lowest bit of `word` that is clear and in `allowed`; which one, if any.
#[inline(always)]
fn claim_in(word: &AtomicU64, allowed: u64) -> Option<u32> {
    let mut current = word.load(Ordering::Acquire);
    loop {
        let free = !current & allowed;
        if free == 0 {
            return None;
        }
        let bit = free.trailing_zeros();
        match word.compare_exchange_weak(
            current,
            current | (1u64 << bit),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => return Some(bit),
            Err(now) => current = now,
        }
    }
}

/// Clears `slot`'s bit. Only the backend that claimed the slot calls this. SeqCst: a waiter
/// queue reads the bits after publishing its head, and the releaser reads the head after this.
pub fn clear(words: &[AtomicU64], slot: u32) {
    let (w, bit) = ((slot / WORD_BITS) as usize, slot % WORD_BITS);
    words[w].fetch_and(!(1u64 << bit), Ordering::SeqCst);
}

/// Number of clear bits in `[0, n)` (free slots, as far as the bitmap knows).
pub fn free_below(words: &[AtomicU64], n: u32) -> u32 {
    (0..words_for(n).min(words.len()))
        .map(|w| (!words[w].load(Ordering::SeqCst) & mask_below(w, n)).count_ones())
        .sum()
}

/// Number of clear bits in `[lo, hi)`: the free slots a call may take from `lo` up.
pub fn free_between(words: &[AtomicU64], lo: u32, hi: u32) -> u32 {
    if lo >= hi {
        return 0;
    }
    let first = (lo / WORD_BITS) as usize;
    (first..words_for(hi).min(words.len()))
        .map(|w| {
            let mut allowed = mask_below(w, hi);
            if w == first {
                allowed &= u64::MAX << (lo % WORD_BITS);
            }
            (!words[w].load(Ordering::SeqCst) & allowed).count_ones()
        })
        .sum()
}

/// How many waiters at the front of a queue may take slots now, front to back: waiter `i` asks
/// for `k` of `[0, n)` as `front[i] = (n, k)`, and may take only while the slots free below the
/// smallest `n` up to it cover its own `k` and those of everyone ahead (who may be taking at the
/// same moment). So several waiters are served at once when several slots are free, and nobody
/// overtakes a waiter ahead: whatever those behind take, enough is left for it. `free_below`
/// counts free slots below an n; the prefix ends at the first waiter not covered.
pub fn covered_front(front: &[(u32, u32)], free_below: impl Fn(u32) -> u32) -> usize {
    let mut need = 0u32;
    let mut min_n = u32::MAX;
    for (i, &(n, k)) in front.iter().enumerate() {
        need = need.saturating_add(k);
        min_n = min_n.min(n);
        if free_below(min_n) < need {
            return i;
        }
    }
    front.len()
}

/// Whether more than `limit` bits of the whole bitmap are set (an adaptive cap's limit on
/// what it holds), read after a full fence. A claim is a read-modify-write of its word; a
/// caller that claims, then asks this, and gives its claim back when told yes, never keeps
/// more than `limit` between all such callers: of two claims made at once, the later one's
/// fence orders the earlier one's bit before its loads, so at least one of them counts both.
pub fn more_than(words: &[AtomicU64], limit: u32) -> bool {
    fence(Ordering::SeqCst);
    let mut set = 0u32;
    for w in words {
        set += w.load(Ordering::Relaxed).count_ones();
        if set > limit {
            return true;
        }
    }
    false
}

#[cfg(test)]
pub fn is_set(words: &[AtomicU64], slot: u32) -> bool {
    let (w, bit) = ((slot / WORD_BITS) as usize, slot % WORD_BITS);
    words[w].load(Ordering::Acquire) & (1u64 << bit) != 0
}

/// Number of set bits in `[0, n)`.
#[cfg(test)]
pub fn count(words: &[AtomicU64], n: u32) -> u32 {
    (0..words_for(n).min(words.len()))
        .map(|w| (words[w].load(Ordering::Acquire) & mask_below(w, n)).count_ones())
        .sum()
}

#[cfg(all(test, not(loom)))]
mod unit {
    #[test]
    fn the_one_word_path_claims_what_the_general_one_does() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let bits = x & x.rotate_left(11); // about a quarter clear
            let n = (x >> 58) as u32 + 1; // 1..=64
            let from = ((x >> 40) as u32) % (n + 1);
            let one = [AtomicU64::new(bits)];
            let general = [AtomicU64::new(bits)];
            let a = claim_first_free(&one, from, n).map(|c| c.keep());
            let b = claim_in_words(&general, from, n).map(|c| c.keep());
            assert_eq!(a, b, "bits {bits:#x} n {n} from {from}");
            assert_eq!(
                one[0].load(Ordering::Relaxed),
                general[0].load(Ordering::Relaxed)
            );
        }
    }

    use super::*;
    use std::collections::HashSet;
    use std::sync::Arc;

    fn bitmap(slots: u32) -> Vec<AtomicU64> {
        (0..words_for(slots)).map(|_| AtomicU64::new(0)).collect()
    }

    #[test]
    fn claims_lowest_free_slot_in_order() {
        let b = bitmap(130);
        let got: Vec<u32> = (0..5)
            .map(|_| claim_first_free(&b, 0, 130).unwrap().keep())
            .collect();
        assert_eq!(got, vec![0, 1, 2, 3, 4]);
        clear(&b, 2);
        assert_eq!(claim_first_free(&b, 0, 130).unwrap().keep(), 2);
    }

    #[test]
    fn never_claims_at_or_above_n() {
        let b = bitmap(128);
        for expected in 0..8 {
            assert_eq!(claim_first_free(&b, 0, 8).unwrap().keep(), expected);
        }
        assert!(claim_first_free(&b, 0, 8).is_none());
        assert_eq!(count(&b, 8), 8);
        assert_eq!(count(&b, 128), 8);
        // A larger n on the same cap sees the remaining slots.
        assert_eq!(claim_first_free(&b, 0, 9).unwrap().keep(), 8);
    }

    #[test]
    fn crosses_word_boundaries_and_fills_exactly_n() {
        for n in [1u32, 63, 64, 65, 127, 128, 129, 1024, 16384] {
            let b = bitmap(n);
            let mut seen = HashSet::new();
            while let Some(c) = claim_first_free(&b, 0, n) {
                assert!(c.slot() < n);
                assert!(seen.insert(c.keep()));
            }
            assert_eq!(seen.len() as u32, n, "n = {n}");
            assert_eq!(count(&b, n), n);
        }
    }

    #[test]
    fn from_skips_lower_slots() {
        let b = bitmap(200);
        assert_eq!(claim_first_free(&b, 70, 200).unwrap().keep(), 70);
        assert_eq!(claim_first_free(&b, 70, 200).unwrap().keep(), 71);
        assert_eq!(claim_first_free(&b, 199, 200).unwrap().keep(), 199);
        assert!(claim_first_free(&b, 199, 200).is_none());
        assert!(claim_first_free(&b, 200, 200).is_none());
        assert_eq!(claim_first_free(&b, 0, 200).unwrap().keep(), 0);
    }

    #[test]
    fn covered_front_serves_in_order_and_never_past_a_waiter_ahead() {
        let b = bitmap(8);
        for _ in 0..5 {
            claim_first_free(&b, 0, 8).unwrap().keep(); // slots 0..4 held, 5..7 free
        }
        let free = |n| free_below(&b, n);
        // Three free: three waiters of one slot each are served at once, not a fourth.
        assert_eq!(covered_front(&[(8, 1), (8, 1), (8, 1), (8, 1)], free), 3);
        // A head asking for 3 takes them all; nobody behind it is served.
        assert_eq!(covered_front(&[(8, 3), (8, 1)], free), 1);
        // A head asking for 4 is not covered, and nobody behind it may take (no overtaking).
        assert_eq!(covered_front(&[(8, 4), (8, 1)], free), 0);
        // A head whose n reaches no free slot holds back those behind it with larger n.
        assert_eq!(covered_front(&[(4, 1), (8, 1)], free), 0);
        assert_eq!(covered_front(&[(8, 1), (6, 1), (8, 1)], free), 1);
        assert_eq!(covered_front(&[], free), 0);
    }

    #[test]
    fn free_below_counts_clear_bits_under_n() {
        let b = bitmap(130);
        assert_eq!(free_below(&b, 130), 130);
        for _ in 0..70 {
            claim_first_free(&b, 0, 130).unwrap().keep();
        }
        assert_eq!(free_below(&b, 130), 60);
        assert_eq!(free_below(&b, 64), 0);
        assert_eq!(free_below(&b, 71), 1);
        clear(&b, 3);
        assert_eq!(free_below(&b, 64), 1);
    }

    #[test]
    fn free_between_counts_clear_bits_in_a_range() {
        let b = bitmap(200);
        for s in [0u32, 5, 63, 64, 130] {
            claim_first_free(&b, s, s + 1).unwrap().keep();
        }
        for (lo, hi) in [
            (0, 200),
            (0, 1),
            (1, 5),
            (5, 6),
            (6, 64),
            (60, 70),
            (64, 65),
            (65, 131),
            (131, 200),
            (7, 7),
            (9, 3),
        ] {
            let want = (lo..hi).filter(|&s| !is_set(&b, s)).count() as u32;
            assert_eq!(free_between(&b, lo, hi), want, "[{lo}, {hi})");
        }
        assert_eq!(free_between(&b, 0, 70), free_below(&b, 70));
    }

    #[test]
    fn dropped_claim_releases_its_bit() {
        let b = bitmap(8);
        {
            let c = claim_first_free(&b, 0, 8).unwrap();
            assert!(is_set(&b, c.slot()));
        }
        assert!(!is_set(&b, 0));
        assert_eq!(count(&b, 8), 0);
    }

    #[test]
    fn dropped_claim_releases_on_unwind() {
        let b = bitmap(8);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _c = claim_first_free(&b, 0, 8).unwrap();
            panic!("lock manager raised an ERROR");
        }));
        assert!(r.is_err());
        assert_eq!(count(&b, 8), 0);
    }

    #[test]
    fn concurrent_claims_never_exceed_n_or_duplicate() {
        let n = 100u32;
        let b: Arc<Vec<AtomicU64>> = Arc::new(bitmap(n));
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let b = Arc::clone(&b);
                std::thread::spawn(move || {
                    let mut mine = Vec::new();
                    while let Some(c) = claim_first_free(&b, 0, n) {
                        mine.push(c.keep());
                    }
                    mine
                })
            })
            .collect();
        let mut all: Vec<u32> = handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..n).collect::<Vec<_>>());
    }

    #[test]
    fn concurrent_claim_and_release_never_hands_one_slot_to_two_threads() {
        // Each thread marks the slot it claimed in an ownership table (0 = nobody) and unmarks
        // it before clearing the bit: a claim of a slot another thread still owns would find
        // its mark there.
        let n = 4u32;
        let b: Arc<Vec<AtomicU64>> = Arc::new(bitmap(64));
        let owner: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());
        let handles: Vec<_> = (1..=8u64)
            .map(|me| {
                let (b, owner) = (Arc::clone(&b), Arc::clone(&owner));
                std::thread::spawn(move || {
                    let mut got = 0u32;
                    for _ in 0..20_000 {
                        if let Some(c) = claim_first_free(&b, 0, n) {
                            let s = c.keep();
                            assert!(s < n, "claimed {s} outside [0, {n})");
                            let prev = owner[s as usize].swap(me, Ordering::AcqRel);
                            assert_eq!(prev, 0, "slot {s} claimed by {me} while {prev} held it");
                            std::hint::spin_loop();
                            owner[s as usize].store(0, Ordering::Release);
                            clear(&b, s);
                            got += 1;
                        }
                    }
                    got
                })
            })
            .collect();
        let total: u32 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert!(total > 0);
        assert_eq!(count(&b, 64), 0);
    }

    #[test]
    fn claims_checked_against_a_limit_never_keep_more_than_it() {
        use std::sync::atomic::AtomicU32;
        use std::sync::Arc;
        const LIMIT: u32 = 3;
        let words: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        let inside = Arc::new(AtomicU32::new(0));
        let worst = Arc::new(AtomicU32::new(0));
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let (words, inside, worst) = (words.clone(), inside.clone(), worst.clone());
                std::thread::spawn(move || {
                    let mut kept = 0u32;
                    for i in 0..20_000u32 {
                        // Claims spread over both words, so the fence (not one word's order)
                        // is what is tested.
                        let from = if (i + t) % 2 == 0 { 0 } else { 64 };
                        let Some(claim) = super::claim_first_free(&words[..], from, 128) else {
                            continue;
                        };
                        if super::more_than(&words[..], LIMIT) {
                            continue; // dropping the claim clears its bit
                        }
                        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        worst.fetch_max(now, Ordering::SeqCst);
                        kept += 1;
                        std::hint::spin_loop();
                        inside.fetch_sub(1, Ordering::SeqCst);
                        drop(claim);
                    }
                    kept
                })
            })
            .collect();
        let kept: u32 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert!(kept > 0, "some claims were kept");
        assert!(
            worst.load(Ordering::SeqCst) <= LIMIT,
            "{}",
            worst.load(Ordering::SeqCst)
        );
    }
}
