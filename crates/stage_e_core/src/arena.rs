//! The slot arena's allocator: a binary buddy allocator over 256-byte pages, plain Rust.
//!
//! Each cap keeps its slots (holder records and occupancy bitmap) in one block of the arena,
//! sized for the largest `n` it has been used with: a cap of 8 slots takes one page, a cap of
//! 1,024 slots 128 pages. Blocks are powers of two pages ("orders"); freeing a block merges it
//! with its free buddy, so memory freed by reclaimed caps is reusable by caps of any size.
//!
//! The allocator's state lives in shared memory as plain words (`AtomicU32`, used with relaxed
//! ordering): every call is made under the directory's exclusive LWLock, which orders them.
//! In unit tests the same code runs on `Vec`s.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

/// Bytes per page, the smallest block.
pub const PAGE: usize = 256;
/// Bytes of one slot's holder record (`shmem::SlotRecord`).
pub const RECORD: usize = 16;
/// Largest order supported (a block of 2^MAX_ORDER pages).
pub const MAX_ORDER: u32 = 24;

const NONE: u32 = u32::MAX;
const FREE: u32 = 1 << 31;

/// Slots a block of `order` holds: `capacity` records of 16 bytes, then one bit per slot in
/// 64-bit words.
pub const fn capacity(order: u32) -> u32 {
    let bytes = PAGE << order;
    let mut c = bytes * 64 / (RECORD * 64 + 8);
    while c.div_ceil(64) * 8 + c * RECORD > bytes {
        c -= 1;
    }
    c as u32
}

/// The smallest order whose blocks hold `slots` slots.
pub fn order_for(slots: u32) -> u32 {
    (0..=MAX_ORDER)
        .find(|&o| capacity(o) >= slots)
        .expect("max_slots is bounded far below the largest order")
}

/// Pages the allocator needs at least for `bytes` of arena: a whole number of top blocks.
pub fn pages_for(bytes: usize, top_order: u32) -> u32 {
    let top = 1usize << top_order;
    bytes.div_ceil(PAGE).div_ceil(top).max(1) as u32 * top as u32
}

/// Words of metadata the allocator needs for `pages` pages (tags, links) and its heads.
pub fn meta_words(pages: u32) -> usize {
    3 * pages as usize + MAX_ORDER as usize + 1
}

/// A buddy allocator over `pages` pages whose largest block is of `top_order`.
pub struct Buddy<'a> {
    /// Per page: for a block's first page, its order, with `FREE` set while it is free.
    tags: &'a [AtomicU32],
    next: &'a [AtomicU32],
    prev: &'a [AtomicU32],
    /// Free-list head per order.
    heads: &'a [AtomicU32],
    top_order: u32,
}

impl<'a> Buddy<'a> {
    /// The allocator over `meta` (of [`meta_words`] words), for `pages` pages.
    pub fn over(meta: &'a [AtomicU32], pages: u32, top_order: u32) -> Self {
        let p = pages as usize;
        let (tags, rest) = meta.split_at(p);
        let (next, rest) = rest.split_at(p);
        let (prev, heads) = rest.split_at(p);
        Buddy {
            tags,
            next,
            prev,
            heads: &heads[..MAX_ORDER as usize + 1],
            top_order,
        }
    }

    /// Makes every page free, as top blocks.
    pub fn reset(&self) {
        for h in self.heads {
            h.store(NONE, Relaxed);
        }
        let top = 1u32 << self.top_order;
        for start in (0..self.tags.len() as u32).step_by(top as usize) {
            self.push(start, self.top_order);
        }
    }

    /// Allocates a block of `order`; its first page, or None when no block is that large.
    pub fn alloc(&self, order: u32) -> Option<u32> {
        if order > self.top_order {
            return None;
        }
        let mut k =
            (order..=self.top_order).find(|&k| self.heads[k as usize].load(Relaxed) != NONE)?;
        let block = self.heads[k as usize].load(Relaxed);
        self.unlink(block, k);
        while k > order {
            k -= 1;
            self.push(block + (1 << k), k);
        }
        self.tags[block as usize].store(order, Relaxed);
        Some(block)
    }

    /// Frees the block starting at `block`, merging it with free buddies.
    pub fn free(&self, block: u32) {
        let mut order = self.tags[block as usize].load(Relaxed);
        debug_assert!(order & FREE == 0, "double free of block {block}");
        let mut block = block;
        while order < self.top_order {
            let buddy = block ^ (1 << order);
            if self.tags[buddy as usize].load(Relaxed) != FREE | order {
                break;
            }
            self.unlink(buddy, order);
            block = block.min(buddy);
            order += 1;
        }
        self.push(block, order);
    }

    /// The order of the allocated block starting at `block`.
    pub fn order_of(&self, block: u32) -> u32 {
        self.tags[block as usize].load(Relaxed) & !FREE
    }

    /// Pages in free blocks (for reporting and tests).
    pub fn free_pages(&self) -> u64 {
        (0..=self.top_order)
            .map(|k| {
                let mut n = 0u64;
                let mut b = self.heads[k as usize].load(Relaxed);
                while b != NONE {
                    n += 1 << k;
                    b = self.next[b as usize].load(Relaxed);
                }
                n
            })
            .sum()
    }

    fn push(&self, block: u32, order: u32) {
        let head = &self.heads[order as usize];
        let old = head.load(Relaxed);
        self.next[block as usize].store(old, Relaxed);
        self.prev[block as usize].store(NONE, Relaxed);
        if old != NONE {
            self.prev[old as usize].store(block, Relaxed);
        }
        head.store(block, Relaxed);
        self.tags[block as usize].store(FREE | order, Relaxed);
    }

    fn unlink(&self, block: u32, order: u32) {
        let (n, p) = (
            self.next[block as usize].load(Relaxed),
            self.prev[block as usize].load(Relaxed),
        );
        if p == NONE {
            self.heads[order as usize].store(n, Relaxed);
        } else {
            self.next[p as usize].store(n, Relaxed);
        }
        if n != NONE {
            self.prev[n as usize].store(p, Relaxed);
        }
        self.tags[block as usize].store(order, Relaxed);
    }
}

#[cfg(test)]
mod unit {
    use super::*;

    fn meta(pages: u32) -> Vec<AtomicU32> {
        (0..meta_words(pages)).map(|_| AtomicU32::new(0)).collect()
    }

    #[test]
    fn capacities_fill_their_blocks() {
        assert_eq!(capacity(0), 15);
        assert_eq!(capacity(1), 31);
        assert_eq!(capacity(3), 127);
        for o in 0..=16 {
            let c = capacity(o) as usize;
            assert!(c.div_ceil(64) * 8 + c * RECORD <= PAGE << o);
            assert!((c + 1).div_ceil(64) * 8 + (c + 1) * RECORD > PAGE << o);
        }
        assert_eq!(order_for(1), 0);
        assert_eq!(order_for(8), 0);
        assert_eq!(order_for(15), 0);
        assert_eq!(order_for(16), 1);
        assert_eq!(order_for(1024), 7);
        assert_eq!(order_for(65536), 13);
    }

    #[test]
    fn splits_and_merges_back_to_the_top_blocks() {
        let pages = 64;
        let m = meta(pages);
        let b = Buddy::over(&m, pages, 4);
        b.reset();
        assert_eq!(b.free_pages(), 64);
        let small: Vec<u32> = (0..20).map(|_| b.alloc(0).unwrap()).collect();
        let big = b.alloc(3).unwrap();
        assert_eq!(b.free_pages(), 64 - 20 - 8);
        let mut all = small.clone();
        all.push(big);
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 21, "no block handed out twice");
        for p in small {
            b.free(p);
        }
        b.free(big);
        assert_eq!(b.free_pages(), 64);
        // Fully merged: four top blocks can be allocated again.
        let tops: Vec<u32> = (0..4).map(|_| b.alloc(4).unwrap()).collect();
        assert!(b.alloc(0).is_none());
        for t in tops {
            b.free(t);
        }
    }

    #[test]
    fn random_churn_never_overlaps_and_leaks_nothing() {
        let pages = 256;
        let m = meta(pages);
        let b = Buddy::over(&m, pages, 6);
        b.reset();
        let mut owner = vec![0u32; pages as usize];
        let mut live: Vec<(u32, u32, u32)> = Vec::new();
        let mut x = 12345u64;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 1..20_000u32 {
            if rnd() % 3 != 0 || live.is_empty() {
                let order = (rnd() % 5) as u32;
                if let Some(p) = b.alloc(order) {
                    for q in p..p + (1 << order) {
                        assert_eq!(owner[q as usize], 0, "page {q} handed out twice");
                        owner[q as usize] = step;
                    }
                    assert_eq!(b.order_of(p), order);
                    live.push((p, order, step));
                }
            } else {
                let (p, order, _) = live.swap_remove((rnd() % live.len() as u64) as usize);
                for q in p..p + (1 << order) {
                    owner[q as usize] = 0;
                }
                b.free(p);
            }
        }
        for (p, _, _) in live.drain(..) {
            b.free(p);
        }
        assert_eq!(b.free_pages(), pages as u64);
        assert!((0..4).all(|_| b.alloc(6).is_some()));
    }
}
