//! Fair shares of one cap (issue 38): its slots shared among named shares (tenants), weighted,
//! each under its own ceiling, by start-time fair queuing (SFQ) over the cap's waiters.
//!
//! Interface (every call under the cap's queue lock, the extension's waits LWLock):
//!
//! - [`Fair::may_take_now`], then [`Fair::took_now`]: a call that does not wait;
//! - [`Fair::join`]: a call that waits, after its ticket is taken;
//! - [`Fair::who_next`], then [`Fair::granted`]: who freed slots go to, and that it took them;
//! - [`Fair::leave`]: a waiter that gives up (timed out, cancelled, terminated);
//! - [`Fair::released`]: a share gives slots back.
//!
//! **The rule.** While the cap has no waiters a call takes free slots within its share's
//! ceiling, and nothing is charged: there is nobody to be fair to. While it has waiters, a
//! share's next request starts at `S = max(V, F)` and finishes at `F = S + k / w` (k slots at
//! weight w), and `V`, the virtual time, becomes the `S` of each grant. Freed slots go to the
//! *first eligible head*: only a share's earliest waiter (its head) competes, a share whose
//! head would take it over its ceiling is passed over, and of the others the smallest `S` wins,
//! the earlier ticket on a tie. If that head's k slots are not all free, the free ones wait for
//! it: nobody behind it takes them (a head asking for k slots is not overtaken, as in
//! `front`). A call that does not wait takes while the cap has waiters only if its share has
//! none and its `S` is below the first eligible head's (a tie goes to the waiter, who came
//! first). When the last waiter leaves, the busy period is over: as SFQ then moves `V` to the
//! largest `F`, every share starts even (owing at most one request, it is forgiven), so `V`
//! and every `F` restart at 0.
//!
//! **Tags are computed when they are compared, not when a waiter joins.** A share keeps one
//! finish tag `F`, charged at a grant, and its head's tag is `max(V, F)` now. For a share served
//! in tag order this is SFQ's tag of the head at its arrival (`V` never passes an eligible
//! head's tag: every grant is at a tag no larger), and a share's queued waiters get successive
//! tags `F, F + k₁/w, ...` as each is served; the model test checks that such a cap serves
//! exactly as SFQ with tags taken at arrival. Two things follow that per-waiter tags taken at
//! arrival would get wrong:
//! - a waiter that leaves unserved was never charged, so the share banks neither credit nor
//!   debt, wherever it was in the share's queue (a tag taken at arrival would stay in the `F` of
//!   everyone behind it);
//! - a share passed over at its ceiling does not keep the old tags of its waiters: it comes back
//!   under its ceiling at `max(V, F)`, as an idle share comes back at `V`. Banked, those tags
//!   would let it take several grants in a row after its hold and break the fairness bound of
//!   the shares that were eligible all along.
//!
//! **Guarantee.** Over any stretch of grants during which two shares a and b both have an
//! eligible head, `|W_a/w_a - W_b/w_b| <= K_a/w_a + K_b/w_b` (W: slots granted in the stretch,
//! K: the largest k of the share's requests), SFQ's bound; the model test checks it exactly.
//! An eligible head waits for at most `(S - V)·w_t + 1` grants of each other share t (every
//! grant ahead of it is at a tag in `[V, S]`, and t's tags rise by at least `1/w_t`), so no
//! waiter starves while the shares that come fit the table. A stream of *new* shares is not
//! bounded: each comes in at `V`, ahead of every backlogged head, and a grant at `V` leaves `V`
//! where it is (SFQ's own behaviour: see the tests).
//!
//! **Idle shares.** A share that holds nothing and has no waiter is forgotten once `F <= V`
//! (then `max(V, F) = V`: its record says nothing a missing record does not). Until then it
//! owes at most its last request (`F - V <= k/w`), and forgetting that at once would let a
//! tenant of one session, leaving and coming back, skip its debt every time and take one grant
//! in two whatever the weights. Its record is reused first when the table is full (the debt
//! is forgiven then, the least first), and the end of the busy period forgets every idle share.
//!
//! **Fixed point.** Tags are u64 in units of 1/[`UNIT`] slot; `UNIT` = lcm(1..=16) = 720720,
//! so k slots at any weight of `1..=`[`MAX_WEIGHT`] cost `k·UNIT/w` exactly: no rounding, and
//! the bound holds exactly. One grant adds at most `k·UNIT < 2^52`; when `V` reaches `2^62`,
//! `V` is subtracted from every `F` (a finish below `V` becomes 0), which changes no `max(V, F)`
//! relative to `V` and so no decision: every value stays below `2^63`. (`V` reaches `2^62` only
//! after 6·10^12 slots granted at weight 1 in one busy period; the rebase is tested all the
//! same.)
//!
//! **Layout.** A [`Clock`] (16 bytes) per cap, and a [`ShareRecord`] (48 bytes) per live share
//! in a table of fixed size; zeroed memory is empty. No allocation: the callers pass the
//! waiters still queued as an iterator where a share's next head must be found, as
//! [`crate::front::Front::reseat`] takes them.
//!
//! **Slots of different n** are not this module's: `free` counts the slots the head could use,
//! and the front's rules (`front`) apply to waiters in this order instead of ticket order.

/// The largest weight; weights are 1 to 16.
pub const MAX_WEIGHT: u32 = 16;

/// Tag units per slot: lcm(1..=16), so that `UNIT / w` is whole for every weight.
pub const UNIT: u64 = 720_720;

/// A ceiling that never binds.
pub const NO_CEILING: u32 = u32::MAX;

/// When `V` reaches this, the tags are rebased (subtracting `V`).
const REBASE_AT: u64 = 1 << 62;

/// A cap's virtual time and its count of waiters (zeroed memory: idle).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Clock {
    v: u64,
    waiting: u32,
    _spare: u32,
}

/// One live share of a cap (zeroed memory: empty). 48 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShareRecord {
    /// The share's name digest; 0: empty.
    digest: u64,
    /// `F`: where the share's next request starts at the earliest.
    finish: u64,
    /// The ticket of its earliest waiter (while `waiting > 0`).
    head: u64,
    /// The slots its head asks for.
    head_k: u32,
    /// Its policy, as of its last call.
    weight: u32,
    ceiling: u32,
    held: u32,
    waiting: u32,
    _spare: u32,
}

impl ShareRecord {
    fn idle(&self) -> bool {
        self.held == 0 && self.waiting == 0
    }
}

/// A share as a call names it: the digest of its name (never 0; the caller's hash is kept off
/// 0 as [`crate::rate::digest`] is) and its policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    pub digest: u64,
    /// 1 to [`MAX_WEIGHT`].
    pub weight: u32,
    /// The most slots the share may hold at once ([`NO_CEILING`]: any).
    pub ceiling: u32,
}

/// A queued waiter as the fair queue knows it: its share's digest, its ticket (arrival order)
/// and the slots it asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waiter {
    pub share: u64,
    pub ticket: u64,
    pub k: u32,
}

/// Why a call is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// A weight outside `1..=MAX_WEIGHT`, or a digest of 0.
    Weight,
    /// k is 0 or above the share's ceiling: it could never be served.
    Ceiling,
    /// Every record holds a share that holds or waits.
    Full,
}

/// A cap's fair queue: its clock and its table of shares, borrowed for one step under the
/// queue lock.
pub struct Fair<'a> {
    clock: &'a mut Clock,
    shares: &'a mut [ShareRecord],
}

impl<'a> Fair<'a> {
    pub fn new(clock: &'a mut Clock, shares: &'a mut [ShareRecord]) -> Self {
        Fair { clock, shares }
    }

    /// The virtual time, in units of 1/[`UNIT`] slot (relative: it restarts and is rebased).
    pub fn virtual_time(&self) -> u64 {
        self.clock.v
    }

    /// How many waiters the cap has.
    pub fn waiting(&self) -> u32 {
        self.clock.waiting
    }

    /// Where share `digest`'s next request starts: `max(V, F)`, `V` if it has no record.
    pub fn start_of(&self, digest: u64) -> u64 {
        self.find(digest)
            .map_or(self.clock.v, |i| self.start(&self.shares[i]))
    }

    /// The shares with a state: holding, waiting, or owing (`F > V`).
    pub fn live(&self) -> usize {
        self.shares.iter().filter(|r| !self.empty(r)).count()
    }

    fn start(&self, r: &ShareRecord) -> u64 {
        self.clock.v.max(r.finish)
    }

    /// A record that says nothing a missing one does not.
    fn empty(&self, r: &ShareRecord) -> bool {
        r.digest == 0 || (r.idle() && r.finish <= self.clock.v)
    }

    fn find(&self, digest: u64) -> Option<usize> {
        (digest != 0)
            .then(|| self.shares.iter().position(|r| r.digest == digest))
            .flatten()
    }

    fn check(share: Share, k: u32) -> Result<(), Refused> {
        if share.digest == 0 || !(1..=MAX_WEIGHT).contains(&share.weight) {
            return Err(Refused::Weight);
        }
        if k == 0 || k > share.ceiling {
            return Err(Refused::Ceiling);
        }
        Ok(())
    }

    /// The record of `share`, its policy updated (a weight applies from the next charge, a
    /// ceiling at once); a new one at `V` if it has none: an empty record, else the idle one
    /// that owes least (its debt, less than one request, is forgiven), else [`Refused::Full`].
    fn record(&mut self, share: Share) -> Result<usize, Refused> {
        let i = match self.find(share.digest) {
            Some(i) => i,
            None => {
                let i = (0..self.shares.len())
                    .find(|&i| self.empty(&self.shares[i]))
                    .or_else(|| {
                        (0..self.shares.len())
                            .filter(|&i| self.shares[i].idle())
                            .min_by_key(|&i| self.shares[i].finish)
                    })
                    .ok_or(Refused::Full)?;
                self.shares[i] = ShareRecord {
                    digest: share.digest,
                    ..ShareRecord::default()
                };
                i
            }
        };
        let r = &mut self.shares[i];
        r.weight = share.weight;
        r.ceiling = share.ceiling;
        Ok(i)
    }

    /// Whether a call of `share` that does not wait may take `k` of the `free` slots now: within
    /// its ceiling, and, while the cap has waiters, only if its share has none and it would be
    /// served before the first eligible head (or no head is eligible: the slots are nobody's).
    pub fn may_take_now(&self, share: Share, k: u32, free: u32) -> bool {
        if Self::check(share, k).is_err() || k > free {
            return false;
        }
        let r = self.find(share.digest).map(|i| &self.shares[i]);
        let held = r.map_or(0, |r| r.held);
        if held.saturating_add(k) > share.ceiling {
            return false;
        }
        if self.clock.waiting == 0 {
            return true;
        }
        if r.is_some_and(|r| r.waiting > 0) {
            return false; // behind its own waiters
        }
        let s = r.map_or(self.clock.v, |r| self.start(r));
        self.first().is_none_or(|h| s < self.start(&self.shares[h]))
    }

    /// A call that did not wait took `k` slots ([`Fair::may_take_now`] said it may). Charged
    /// only while the cap has waiters.
    pub fn took_now(&mut self, share: Share, k: u32) -> Result<(), Refused> {
        Self::check(share, k)?;
        let i = self.record(share)?;
        if self.shares[i].held.saturating_add(k) > share.ceiling {
            return Err(Refused::Ceiling);
        }
        if self.clock.waiting > 0 {
            self.charge(i, k);
        }
        self.shares[i].held += k;
        Ok(())
    }

    /// A call of `share` waits for `k` slots with `ticket` (tickets rise in arrival order). It
    /// is the share's head if the share had no waiter. Its tag is taken when it is compared.
    pub fn join(&mut self, share: Share, ticket: u64, k: u32) -> Result<(), Refused> {
        Self::check(share, k)?;
        let i = self.record(share)?;
        let r = &mut self.shares[i];
        if r.waiting == 0 {
            r.head = ticket;
            r.head_k = k;
        }
        r.waiting += 1;
        self.clock.waiting += 1;
        Ok(())
    }

    /// The first eligible head: of the shares whose head fits under their ceiling, the smallest
    /// `max(V, F)`, the earlier ticket on a tie.
    fn first(&self) -> Option<usize> {
        (0..self.shares.len())
            .filter(|&i| {
                let r = &self.shares[i];
                r.digest != 0 && r.waiting > 0 && r.held.saturating_add(r.head_k) <= r.ceiling
            })
            .min_by_key(|&i| (self.start(&self.shares[i]), self.shares[i].head))
    }

    /// Who `free` freed slots go to: the first eligible head, if its k slots are free. None
    /// if no head is eligible (every share with waiters is at its ceiling), or the first one's
    /// k are not all free: then they wait for it, and nobody else takes them.
    pub fn who_next(&self, free: u32) -> Option<Waiter> {
        let r = &self.shares[self.first()?];
        (r.head_k <= free).then_some(Waiter {
            share: r.digest,
            ticket: r.head,
            k: r.head_k,
        })
    }

    /// The waiter [`Fair::who_next`] named took its slots and left the queue; `queue` is the
    /// waiters still queued, in any order (read only to find its share's next head).
    pub fn granted(&mut self, w: Waiter, queue: impl IntoIterator<Item = Waiter>) {
        let Some(i) = self.find(w.share) else {
            debug_assert!(false, "granted a waiter of no share: {w:?}");
            return;
        };
        debug_assert!(self.shares[i].head == w.ticket && self.shares[i].head_k == w.k);
        self.charge(i, w.k);
        self.shares[i].held += w.k;
        self.dequeue(i, w.ticket, queue);
    }

    /// Waiter `w` left the queue unserved; `queue` as for [`Fair::granted`]. Nothing is given
    /// back because nothing was taken: its share is where it would be had it never come.
    pub fn leave(&mut self, w: Waiter, queue: impl IntoIterator<Item = Waiter>) {
        let Some(i) = self.find(w.share) else {
            debug_assert!(false, "a waiter of no share left: {w:?}");
            return;
        };
        self.dequeue(i, w.ticket, queue);
    }

    /// Share `digest` gave `k` slots back.
    pub fn released(&mut self, digest: u64, k: u32) {
        let Some(i) = self.find(digest) else {
            debug_assert!(false, "share {digest} released what it did not hold");
            return;
        };
        let r = &mut self.shares[i];
        debug_assert!(r.held >= k);
        r.held = r.held.saturating_sub(k);
        self.forget_if_empty(i);
    }

    /// A grant of `k` slots to share `i`: `S = max(V, F)`, `F = S + k/w`, `V = S`.
    fn charge(&mut self, i: usize, k: u32) {
        if self.clock.v >= REBASE_AT {
            self.rebase();
        }
        let r = &mut self.shares[i];
        let s = self.clock.v.max(r.finish);
        // V < 2^62 here, F <= V + 2^52 (a charge leaves F - V at k·UNIT/w < 2^52: k < 2^32,
        // UNIT < 2^20), so the new F < 2^63.
        r.finish = s + k as u64 * (UNIT / r.weight.clamp(1, MAX_WEIGHT) as u64);
        self.clock.v = s;
    }

    /// Subtracts `V` from every tag: every `max(V, F) - V` is kept, so no decision changes.
    fn rebase(&mut self) {
        let v = self.clock.v;
        for r in self.shares.iter_mut() {
            r.finish = r.finish.saturating_sub(v);
        }
        self.clock.v = 0;
    }

    /// A waiter of share `i` with `ticket` left the queue (served or not).
    fn dequeue(&mut self, i: usize, ticket: u64, queue: impl IntoIterator<Item = Waiter>) {
        let r = &mut self.shares[i];
        debug_assert!(r.waiting > 0 && self.clock.waiting > 0);
        r.waiting = r.waiting.saturating_sub(1);
        self.clock.waiting = self.clock.waiting.saturating_sub(1);
        if r.waiting > 0 && r.head == ticket {
            let digest = r.digest;
            let next = queue
                .into_iter()
                .filter(|w| w.share == digest && w.ticket != ticket)
                .min_by_key(|w| w.ticket);
            let r = &mut self.shares[i];
            match next {
                Some(n) => (r.head, r.head_k) = (n.ticket, n.k),
                None => {
                    // Counted waiters the queue does not have (a caller's bug): drop them
                    // rather than keep a head nobody can be.
                    debug_assert!(false, "share {digest}: {} waiters not queued", r.waiting);
                    self.clock.waiting = self.clock.waiting.saturating_sub(r.waiting);
                    r.waiting = 0;
                }
            }
        }
        if self.clock.waiting == 0 {
            self.restart();
        } else {
            self.forget_if_empty(i);
        }
    }

    /// The busy period is over: SFQ moves `V` to the largest `F`, so every share's next
    /// request starts at the same `V` (a share owes at most one request, forgiven here): the
    /// clock and every tag restart at 0, and the idle shares are forgotten.
    fn restart(&mut self) {
        self.clock.v = 0;
        for r in self.shares.iter_mut() {
            r.finish = 0;
            if r.idle() {
                *r = ShareRecord::default();
            }
        }
    }

    fn forget_if_empty(&mut self, i: usize) {
        if self.empty(&self.shares[i]) {
            self.shares[i] = ShareRecord::default();
        }
    }
}

// Layout, for shared memory: a share costs 48 bytes (issue 38: at most 64), a cap's clock 16.
const _: () = assert!(size_of::<ShareRecord>() == 48 && size_of::<ShareRecord>() <= 64);
const _: () = assert!(size_of::<Clock>() == 16);

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// SplitMix64: small, deterministic, no dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        /// Uniform in `lo..=hi`.
        fn range(&mut self, lo: u32, hi: u32) -> u32 {
            lo + self.below((hi - lo + 1) as usize) as u32
        }

        fn chance(&mut self, percent: usize) -> bool {
            self.below(100) < percent
        }
    }

    /// The reference's tag unit: another multiple of lcm(1..=16) than [`UNIT`], in u128, so
    /// that the implementation's fixed point is checked too.
    const RU: u128 = 2 * 720_720;

    struct RefShare {
        weight: u32,
        ceiling: u32,
        held: u32,
        finish: u128,
    }

    /// The rule as the issue words it, the plain way: exact tags, a map of the shares that have
    /// a state, and the queue as a list in arrival order, from which heads and counts are read
    /// each time. A share is in the map while it holds, waits or owes (`F > V`).
    #[derive(Default)]
    struct Reference {
        v: u128,
        shares: BTreeMap<u64, RefShare>,
        queue: Vec<Waiter>,
    }

    impl Reference {
        /// `S = max(V, F)`; `V` for a share with no state.
        fn tag(&self, s: u64) -> u128 {
            self.shares.get(&s).map_or(self.v, |r| r.finish.max(self.v))
        }

        fn head(&self, s: u64) -> Option<Waiter> {
            self.queue.iter().find(|w| w.share == s).copied()
        }

        /// The heads that fit under their share's ceiling.
        fn eligible(&self) -> BTreeMap<u64, Waiter> {
            let mut heads = BTreeMap::new();
            for w in &self.queue {
                heads.entry(w.share).or_insert(*w);
            }
            heads.retain(|s, h| {
                let r = &self.shares[s];
                r.held as u64 + h.k as u64 <= r.ceiling as u64
            });
            heads
        }

        /// The eligible heads, by tag and then ticket.
        fn order(&self) -> Vec<(u128, Waiter)> {
            let mut o: Vec<(u128, Waiter)> = (self.eligible().into_iter())
                .map(|(s, h)| (self.tag(s), h))
                .collect();
            o.sort_by_key(|&(t, h)| (t, h.ticket));
            o
        }

        fn who_next(&self, free: u32) -> Option<Waiter> {
            let &(_, h) = self.order().first()?;
            (h.k <= free).then_some(h)
        }

        /// The brief's literal reading: the first eligible head *whose k fits*.
        fn who_next_literal(&self, free: u32) -> Option<Waiter> {
            self.order()
                .into_iter()
                .map(|(_, h)| h)
                .find(|h| h.k <= free)
        }

        fn may_take_now(&self, sh: Share, k: u32, free: u32) -> bool {
            let held = self.shares.get(&sh.digest).map_or(0, |r| r.held);
            if k > free || held as u64 + k as u64 > sh.ceiling as u64 {
                return false;
            }
            self.queue.is_empty()
                || (self.head(sh.digest).is_none()
                    && (self.order().first()).is_none_or(|&(t, _)| self.tag(sh.digest) < t))
        }

        fn policy(&mut self, sh: Share) -> &mut RefShare {
            let r = self.shares.entry(sh.digest).or_insert(RefShare {
                weight: sh.weight,
                ceiling: sh.ceiling,
                held: 0,
                finish: 0,
            });
            (r.weight, r.ceiling) = (sh.weight, sh.ceiling);
            r
        }

        fn charge(&mut self, s: u64, k: u32) {
            let t = self.tag(s);
            let r = self.shares.get_mut(&s).unwrap();
            r.finish = t + k as u128 * RU / r.weight as u128;
            self.v = t;
        }

        fn took_now(&mut self, sh: Share, k: u32) {
            self.policy(sh);
            if !self.queue.is_empty() {
                self.charge(sh.digest, k);
            }
            self.shares.get_mut(&sh.digest).unwrap().held += k;
            self.tidy();
        }

        fn join(&mut self, sh: Share, ticket: u64, k: u32) {
            self.policy(sh);
            self.queue.push(Waiter {
                share: sh.digest,
                ticket,
                k,
            });
        }

        fn granted(&mut self, w: Waiter) {
            self.charge(w.share, w.k);
            self.shares.get_mut(&w.share).unwrap().held += w.k;
            self.queue.retain(|q| q.ticket != w.ticket);
            self.tidy();
        }

        fn leave(&mut self, w: Waiter) {
            self.queue.retain(|q| q.ticket != w.ticket);
            self.tidy();
        }

        fn released(&mut self, s: u64, k: u32) {
            self.shares.get_mut(&s).unwrap().held -= k;
            self.tidy();
        }

        /// No waiter: the busy period is over, the clock restarts. Then the shares with
        /// nothing held, waited for or owed are forgotten.
        fn tidy(&mut self) {
            if self.queue.is_empty() {
                self.v = 0;
                self.shares.values_mut().for_each(|r| r.finish = 0);
            }
            let (v, queue) = (self.v, &self.queue);
            self.shares
                .retain(|s, r| r.held > 0 || r.finish > v || queue.iter().any(|w| w.share == *s));
        }
    }

    /// SFQ as published: every waiter's tag taken at its arrival and kept. Without ceilings
    /// and cancellations it must serve exactly as the implementation does.
    #[derive(Default)]
    struct Textbook {
        v: u128,
        finish: BTreeMap<u64, u128>,
        queue: Vec<(u128, Waiter)>,
    }

    impl Textbook {
        fn tag(&self, s: u64) -> u128 {
            self.finish.get(&s).copied().unwrap_or(0).max(self.v)
        }

        fn charge(&mut self, sh: Share, k: u32) -> u128 {
            let t = self.tag(sh.digest);
            self.finish
                .insert(sh.digest, t + k as u128 * RU / sh.weight as u128);
            t
        }

        fn first(&self) -> Option<(u128, Waiter)> {
            self.queue
                .iter()
                .copied()
                .min_by_key(|&(t, w)| (t, w.ticket))
        }

        fn may_take_now(&self, sh: Share, k: u32, free: u32) -> bool {
            k <= free
                && (self.queue.is_empty()
                    || (self.queue.iter().all(|(_, w)| w.share != sh.digest)
                        && self.first().is_none_or(|(t, _)| self.tag(sh.digest) < t)))
        }

        fn took_now(&mut self, sh: Share, k: u32) {
            if !self.queue.is_empty() {
                self.v = self.charge(sh, k);
            }
        }

        fn join(&mut self, sh: Share, ticket: u64, k: u32) {
            let t = self.charge(sh, k);
            self.queue.push((
                t,
                Waiter {
                    share: sh.digest,
                    ticket,
                    k,
                },
            ));
        }

        fn who_next(&self, free: u32) -> Option<Waiter> {
            self.first().map(|(_, w)| w).filter(|w| w.k <= free)
        }

        fn granted(&mut self, w: Waiter) {
            let at = self.queue.iter().position(|(_, q)| *q == w).unwrap();
            let (t, _) = self.queue.remove(at);
            assert!(t >= self.v, "SFQ's tags are served in order");
            self.v = t;
            if self.queue.is_empty() {
                self.v = 0;
                self.finish.clear();
            }
        }
    }

    /// What a call got.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Got {
        Took,
        Queued(u64),
        Throttled,
    }

    /// A grant: to whom, how many slots.
    #[derive(Clone, Copy, Debug)]
    struct Grant {
        share: u64,
        k: u32,
    }

    /// A share with an eligible head since some grant: the slots granted to each share when
    /// it became so. A run of two such shares starts at the later of the two.
    struct Backlog {
        at: BTreeMap<u64, u128>,
    }

    /// An eligible head's wait: its tag, `V` when it began, the grants to each other share since.
    struct Stretch {
        head: u64,
        tag: u128,
        v0: u128,
        ahead: BTreeMap<u64, u128>,
    }

    /// A cap of `n` slots run through the implementation (a table of `capacity` records), the
    /// reference (and the textbook, if set) side by side. Every decision must agree, and after
    /// every step the properties are checked against the reference's exact tags.
    struct Sim {
        n: u32,
        clock: Clock,
        table: Vec<ShareRecord>,
        reference: Reference,
        textbook: Option<Textbook>,
        /// The waiters, in arrival order (the extension's list of waiter records).
        queue: Vec<Waiter>,
        /// Slots held: (share, k) per grant, oldest first.
        holds: Vec<(u64, u32)>,
        tickets: u64,
        log: Vec<Grant>,
        /// Per share seen: its weight and its largest k so far.
        seen: BTreeMap<u64, (u32, u32)>,
        /// Slots granted to each share so far.
        slots: BTreeMap<u64, u128>,
        /// The shares with an eligible head, since when.
        backlogs: BTreeMap<u64, Backlog>,
        stretches: BTreeMap<u64, Stretch>,
    }

    fn share(digest: u64, weight: u32, ceiling: u32) -> Share {
        Share {
            digest,
            weight,
            ceiling,
        }
    }

    impl Sim {
        fn new(n: u32, capacity: usize) -> Sim {
            Sim {
                n,
                clock: Clock::default(),
                table: vec![ShareRecord::default(); capacity],
                reference: Reference::default(),
                textbook: None,
                queue: Vec::new(),
                holds: Vec::new(),
                tickets: 0,
                log: Vec::new(),
                seen: BTreeMap::new(),
                slots: BTreeMap::new(),
                backlogs: BTreeMap::new(),
                stretches: BTreeMap::new(),
            }
        }

        fn fair(&mut self) -> Fair<'_> {
            Fair::new(&mut self.clock, &mut self.table)
        }

        fn free(&self) -> u32 {
            self.n - self.holds.iter().map(|h| h.1).sum::<u32>()
        }

        fn held(&self, s: u64) -> u32 {
            self.holds.iter().filter(|h| h.0 == s).map(|h| h.1).sum()
        }

        fn queued(&self, s: u64) -> usize {
            self.queue.iter().filter(|w| w.share == s).count()
        }

        fn grants_to(&self, s: u64, since: usize) -> usize {
            self.log[since..].iter().filter(|g| g.share == s).count()
        }

        /// A call of `sh` for `k` slots: takes if it may, else waits if `wait`.
        fn call(&mut self, sh: Share, k: u32, wait: bool) -> Got {
            let seen = self.seen.entry(sh.digest).or_insert((sh.weight, k));
            seen.1 = seen.1.max(k);
            let free = self.free();
            let may = self.fair().may_take_now(sh, k, free);
            assert_eq!(may, self.reference.may_take_now(sh, k, free), "{sh:?} {k}");
            if let Some(t) = &self.textbook {
                assert_eq!(may, t.may_take_now(sh, k, free), "textbook: {sh:?} {k}");
            }
            if !self.reference.shares.contains_key(&sh.digest) {
                // A share with no state (new, or idle and forgotten) starts at V: no credit.
                let f = Fair::new(&mut self.clock, &mut self.table);
                assert_eq!(f.start_of(sh.digest), f.virtual_time());
            }
            if may {
                self.observe();
                let charged = !self.queue.is_empty();
                let tag = self.reference.tag(sh.digest);
                self.fair().took_now(sh, k).unwrap();
                self.reference.took_now(sh, k);
                if let Some(t) = &mut self.textbook {
                    t.took_now(sh, k);
                }
                self.holds.push((sh.digest, k));
                self.granted(sh.digest, k, charged.then_some(tag));
                self.check();
                return Got::Took;
            }
            if !wait {
                return Got::Throttled;
            }
            let ticket = self.tickets;
            self.tickets += 1;
            // The tables here hold every share: a table that fills up forgives debts, which the
            // reference (no bound) does not (`a_full_table_forgives_the_least_debt_then_refuses`).
            self.fair().join(sh, ticket, k).unwrap();
            self.reference.join(sh, ticket, k);
            if let Some(t) = &mut self.textbook {
                t.join(sh, ticket, k);
            }
            self.queue.push(Waiter {
                share: sh.digest,
                ticket,
                k,
            });
            self.settle();
            Got::Queued(ticket)
        }

        /// Gives back hold `i` (oldest first), then serves whom the freed slots go to.
        fn release(&mut self, i: usize) {
            let (s, k) = self.holds.remove(i);
            self.fair().released(s, k);
            self.reference.released(s, k);
            self.settle();
        }

        /// Gives back share `s`'s oldest hold.
        fn release_of(&mut self, s: u64) {
            let i = self.holds.iter().position(|h| h.0 == s).unwrap();
            self.release(i);
        }

        /// Waiter `ticket` gives up.
        fn cancel(&mut self, ticket: u64) {
            assert!(
                self.textbook.is_none(),
                "the textbook keeps no cancellation"
            );
            let at = self.queue.iter().position(|w| w.ticket == ticket).unwrap();
            let w = self.queue.remove(at);
            Fair::new(&mut self.clock, &mut self.table).leave(w, self.queue.iter().copied());
            self.reference.leave(w);
            self.settle();
        }

        /// Serves who the free slots go to, one by one, as every release would.
        fn settle(&mut self) {
            loop {
                self.observe();
                let free = self.free();
                let next = self.fair().who_next(free);
                assert_eq!(next, self.reference.who_next(free), "free {free}");
                if let Some(t) = &self.textbook {
                    assert_eq!(next, t.who_next(free), "textbook, free {free}");
                }
                let Some(w) = next else { break };
                let tag = self.reference.tag(w.share);
                self.queue.retain(|q| q.ticket != w.ticket);
                Fair::new(&mut self.clock, &mut self.table).granted(w, self.queue.iter().copied());
                self.reference.granted(w);
                if let Some(t) = &mut self.textbook {
                    t.granted(w);
                }
                self.holds.push((w.share, w.k));
                self.granted(w.share, w.k, Some(tag));
            }
            self.check();
        }

        fn weight(&self, s: u64) -> u128 {
            self.seen[&s].0 as u128
        }

        fn kmax(&self, s: u64) -> u128 {
            self.seen[&s].1 as u128
        }

        /// Before each grant and after each step: which shares have an eligible head now. A
        /// share that comes to have one starts its backlog (the slots granted so far) and its
        /// head's stretch; a share that has none ends both.
        fn observe(&mut self) {
            let r = &self.reference;
            let eligible = r.eligible();
            self.backlogs.retain(|s, _| eligible.contains_key(s));
            for &s in eligible.keys() {
                let slots = &self.slots;
                self.backlogs
                    .entry(s)
                    .or_insert_with(|| Backlog { at: slots.clone() });
            }
            self.stretches
                .retain(|s, st| eligible.get(s).is_some_and(|h| h.ticket == st.head));
            for (&s, &h) in &eligible {
                let tag = r.tag(s);
                let st = self.stretches.entry(s).or_insert(Stretch {
                    head: h.ticket,
                    tag,
                    v0: r.v,
                    ahead: BTreeMap::new(),
                });
                // While it is eligible, a head's tag stays what it was: V never passes it.
                assert_eq!(st.tag, tag, "share {s}'s eligible head moved");
            }
        }

        /// `k` slots went to share `s` (charged at `tag`, or uncharged: the cap had no
        /// waiters). Checks SFQ's fairness bound for every run and the wait bound of every
        /// other eligible head.
        fn granted(&mut self, s: u64, k: u32, tag: Option<u128>) {
            self.log.push(Grant { share: s, k });
            let before = self.slots.get(&s).copied().unwrap_or(0);
            self.slots.insert(s, before + k as u128);
            let Some(tag) = tag else {
                assert!(self.backlogs.is_empty() && self.stretches.is_empty());
                return;
            };
            // The runs this grant counts in: s and each other share, both backlogged (before
            // the grant) since the later of the two became so. Only their gap changed.
            let Some(bs) = self.backlogs.get(&s) else {
                return;
            };
            for (&b, bb) in self.backlogs.iter().filter(|(&b, _)| b != s) {
                // The later backlog began after more slots were granted (or as many: the same).
                let since = if bs.at.values().sum::<u128>() >= bb.at.values().sum::<u128>() {
                    &bs.at
                } else {
                    &bb.at
                };
                let got = |x: u64| self.slots.get(&x).copied().unwrap_or(0);
                let was = |x: u64| since.get(&x).copied().unwrap_or(0);
                let (a, wa, wb) = (s, got(s) - was(s), got(b) - was(b));
                // |W_a/w_a - W_b/w_b| <= K_a/w_a + K_b/w_b, times w_a·w_b.
                let (ua, ub) = (self.weight(a), self.weight(b));
                let gap = (wa * ub).abs_diff(wb * ua);
                assert!(
                    gap <= self.kmax(a) * ub + self.kmax(b) * ua,
                    "shares {a} (w {ua}) and {b} (w {ub}) both backlogged: {wa} and {wb} slots"
                );
            }
            let wt = self.weight(s);
            for (&h, st) in self.stretches.iter_mut().filter(|(&h, _)| h != s) {
                assert!(
                    st.v0 <= tag && tag <= st.tag,
                    "share {s} served at {tag} past share {h}'s eligible head at {}",
                    st.tag
                );
                let n = st.ahead.entry(s).or_insert(0);
                *n += 1;
                // Share s's tags in [v0, tag of h] rise by at least 1/w_s a grant.
                assert!(
                    *n <= (st.tag - st.v0) * wt / RU + 1,
                    "share {h}'s head waited {n} grants of share {s}"
                );
            }
        }

        /// After each step: the implementation's state is the reference's, and no slot is
        /// idle while a waiter that may use it waits.
        fn check(&mut self) {
            let free = self.free();
            let r = &self.reference;
            let f = Fair::new(&mut self.clock, &mut self.table);
            assert_eq!(f.waiting() as usize, self.queue.len());
            for (&s, _) in self.seen.iter() {
                let mine = (f.start_of(s) - f.virtual_time()) as u128 * RU;
                assert_eq!(mine, (r.tag(s) - r.v) * UNIT as u128, "share {s}'s start");
            }
            let live: Vec<u64> = (self.table.iter())
                .filter(|x| x.digest != 0 && !(x.idle() && x.finish <= self.clock.v))
                .map(|x| x.digest)
                .collect();
            let mut sorted = live.clone();
            sorted.sort();
            assert_eq!(sorted, r.shares.keys().copied().collect::<Vec<_>>());
            for x in self.table.iter().filter(|x| live.contains(&x.digest)) {
                let rs = &r.shares[&x.digest];
                let queued = self.queue.iter().filter(|w| w.share == x.digest).count();
                assert_eq!((x.held, x.waiting as usize), (rs.held, queued));
                assert!(rs.held as u64 <= rs.ceiling as u64, "over the ceiling");
                assert_eq!(
                    rs.held,
                    self.holds
                        .iter()
                        .filter(|h| h.0 == x.digest)
                        .map(|h| h.1)
                        .sum()
                );
            }
            // Work conservation: free slots stay free only if no head may use them, or the
            // first eligible head (by tag, then ticket) needs more than are free.
            let mut first: Option<(u128, Waiter)> = None;
            let mut heads = std::collections::BTreeSet::new();
            for w in &self.queue {
                let rs = &r.shares[&w.share];
                if heads.insert(w.share) && rs.held as u64 + w.k as u64 <= rs.ceiling as u64 {
                    let key = (r.tag(w.share), *w);
                    if first.is_none_or(|f| (key.0, key.1.ticket) < (f.0, f.1.ticket)) {
                        first = Some(key);
                    }
                }
            }
            if let Some((_, h)) = first {
                assert!(h.k > free, "{free} slots idle while {h:?} may take them");
            }
        }
    }

    /// One random scenario: arrivals of random shares (weights, ceilings, k), tries, releases
    /// and cancellations, then a drain in which everyone still queued must be served.
    fn scenario(seed: u64) -> usize {
        let mut rng = Rng(seed);
        let n = rng.range(1, 6);
        let ceilings = rng.chance(60);
        let cancels = rng.chance(70);
        let shares: Vec<(Share, u32)> = (0..rng.range(2, 5) as u64)
            .map(|i| {
                let ceiling = if ceilings && rng.chance(60) {
                    rng.range(1, n)
                } else {
                    NO_CEILING
                };
                let kmax = rng.range(1, 3.min(n).min(ceiling));
                (share(101 + i, rng.range(1, MAX_WEIGHT), ceiling), kmax)
            })
            .collect();
        let mut sim = Sim::new(n, shares.len() + rng.below(3));
        if !ceilings && !cancels {
            sim.textbook = Some(Textbook::default());
        }
        // Bursts: a scenario leans to arrivals or to releases for a while.
        let mut lean = 0;
        for step in 0..rng.range(50, 300) {
            if step % 25 == 0 {
                lean = rng.below(20) as i64 - 10;
            }
            let (sh, kmax) = shares[rng.below(shares.len())];
            let k = rng.range(1, kmax);
            match rng.below(100) as i64 + lean {
                ..40 => {
                    sim.call(sh, k, true);
                }
                40..55 => {
                    sim.call(sh, k, false);
                }
                55..85 if !sim.holds.is_empty() => {
                    let i = rng.below(sim.holds.len());
                    sim.release(i);
                }
                85.. if cancels && !sim.queue.is_empty() => {
                    let i = rng.below(sim.queue.len());
                    sim.cancel(sim.queue[i].ticket);
                }
                _ => {}
            }
        }
        let grants = sim.log.len();
        while !sim.holds.is_empty() {
            let i = rng.below(sim.holds.len());
            sim.release(i);
        }
        assert!(sim.queue.is_empty(), "left waiting: {:?}", sim.queue);
        let f = sim.fair();
        assert_eq!((f.live(), f.waiting(), f.virtual_time()), (0, 0, 0));
        assert!(sim.table.iter().all(|r| *r == ShareRecord::default()));
        grants
    }

    /// The model test: thousands of random scenarios, each decision the reference's (and the
    /// textbook SFQ's where it applies), SFQ's bound, the wait bound, work conservation, no
    /// credit for idle shares, and everyone served in the end.
    #[test]
    fn random_scenarios_agree_with_the_reference_and_keep_the_bounds() {
        let mut grants = 0;
        for seed in 0..4000 {
            grants += scenario(seed);
        }
        assert!(grants > 200_000, "{grants}");
    }

    const A: u64 = 1;
    const B: u64 = 2;
    const C: u64 = 3;
    const D: u64 = 4;

    /// Releases the oldest hold until `done`, at most `limit` times.
    fn turn_over(sim: &mut Sim, limit: usize, mut done: impl FnMut(&Sim) -> bool) {
        for _ in 0..limit {
            if done(sim) {
                return;
            }
            sim.release(0);
        }
        assert!(done(sim), "not done after {limit} releases");
    }

    /// Keeps `count` waiters of `sh` queued.
    fn backlog(sim: &mut Sim, sh: Share, count: usize) {
        while sim.queued(sh.digest) < count {
            sim.call(sh, 1, true);
        }
    }

    /// The flood: share A has 64 waiters behind its 4 slots; B's one waiter, come
    /// later, gets one of the next 2 grants.
    #[test]
    fn a_late_share_behind_a_flood_is_served_within_two_grants() {
        let mut sim = Sim::new(4, 8);
        let (a, b) = (share(A, 1, NO_CEILING), share(B, 1, NO_CEILING));
        for _ in 0..4 {
            assert_eq!(sim.call(a, 1, true), Got::Took);
        }
        for _ in 0..64 {
            assert!(matches!(sim.call(a, 1, true), Got::Queued(_)));
        }
        assert!(matches!(sim.call(b, 1, true), Got::Queued(_)));
        let mark = sim.log.len();
        sim.release(0);
        sim.release(0);
        assert_eq!(sim.log.len(), mark + 2);
        // A's head came first and ties at V: it goes first; then B, at V, before A's next.
        assert_eq!(sim.grants_to(B, mark), 1);
        assert_eq!(sim.log[mark + 1].share, B);
    }

    /// Weights 1:3, both backlogged: the grants split 25/75 within 3 points (SFQ keeps them
    /// within K_a/w_a + K_b/w_b = 1 + 1/3 slot of normalized service; the model checks it).
    #[test]
    fn weights_one_to_three_split_the_grants_a_quarter_and_three_quarters() {
        let mut sim = Sim::new(4, 8);
        let (a, b) = (share(A, 1, NO_CEILING), share(B, 3, NO_CEILING));
        backlog(&mut sim, a, 10);
        backlog(&mut sim, b, 10);
        let mark = sim.log.len();
        for _ in 0..2000 {
            sim.release(0);
            backlog(&mut sim, a, 10);
            backlog(&mut sim, b, 10);
        }
        let (ga, gb) = (sim.grants_to(A, mark), sim.grants_to(B, mark));
        let percent = 100.0 * ga as f64 / (ga + gb) as f64;
        assert!((22.0..=28.0).contains(&percent), "A got {percent:.1}%");
        assert!(
            (ga as i64 - (ga + gb) as i64 / 4).abs() <= 2,
            "{ga} of {}",
            ga + gb
        );
    }

    /// The heavy share (weight 3) has a ceiling of 1: the light one gets the other 3 slots,
    /// and no slot is ever idle while it waits.
    #[test]
    fn a_ceiling_on_the_heavy_share_leaves_the_other_slots_to_the_light_one() {
        let mut sim = Sim::new(4, 8);
        let (heavy, light) = (share(A, 3, 1), share(B, 1, NO_CEILING));
        backlog(&mut sim, heavy, 10);
        backlog(&mut sim, light, 10);
        let mark = sim.log.len();
        for _ in 0..1000 {
            sim.release(0);
            backlog(&mut sim, heavy, 10);
            backlog(&mut sim, light, 10);
            assert_eq!(sim.free(), 0);
            assert!(sim.held(A) <= 1 && sim.held(B) >= 3);
        }
        assert!(
            sim.grants_to(A, mark) > 100,
            "the heavy share is served at its ceiling"
        );
    }

    /// 200 shares of one waiter each queue behind a share of 1,000: every small share is
    /// served before the big share's 10th grant, as issue 38 says, and in fact before its
    /// 2nd: each comes in at V, and the big share's head is at V only until its next grant.
    /// The same with the big share at weight 16, and with the small shares coming one per
    /// release. (It needs 201 records: a table smaller than the live shares refuses some.)
    #[test]
    fn two_hundred_small_shares_are_served_before_the_big_ones_tenth_grant() {
        for big_weight in [1, 16] {
            let mut sim = Sim::new(4, 256);
            let big = share(A, big_weight, NO_CEILING);
            for _ in 0..1000 {
                sim.call(big, 1, true);
            }
            assert_eq!(sim.held(A), 4);
            let mark = sim.log.len();
            for i in 0..200 {
                assert!(matches!(
                    sim.call(share(1000 + i, 1, NO_CEILING), 1, true),
                    Got::Queued(_)
                ));
            }
            let small = |sim: &Sim| sim.log.iter().filter(|g| g.share >= 1000).count();
            turn_over(&mut sim, 1000, |sim| small(sim) == 200);
            let big_grants = sim.grants_to(A, mark);
            assert!(big_grants < 10, "issue 38's claim");
            assert!(big_grants <= 1, "w {big_weight}: {big_grants}");
        }
        let mut sim = Sim::new(4, 256);
        for _ in 0..1000 {
            sim.call(share(A, 1, NO_CEILING), 1, true);
        }
        let mark = sim.log.len();
        for i in 0..200 {
            sim.call(share(1000 + i, 1, NO_CEILING), 1, true);
            sim.release(0);
        }
        turn_over(&mut sim, 10, |sim| sim.queue.iter().all(|w| w.share == A));
        assert!(sim.grants_to(A, mark) <= 1);
    }

    /// Waiters that give up (the share's head, one in the middle, the share's last) leave
    /// the others served exactly as if they had never come: nothing was charged for them.
    #[test]
    fn a_waiter_that_leaves_gives_its_share_neither_credit_nor_debt() {
        let (a, b, c) = (
            share(A, 1, NO_CEILING),
            share(B, 2, NO_CEILING),
            share(C, 1, NO_CEILING),
        );
        // (share, cancelled) in arrival order.
        let arrivals = [
            (a, true),
            (b, false),
            (a, false),
            (a, true),
            (b, false),
            (a, false),
            (b, true),
            (a, false),
        ];
        let run = |with_cancelled: bool| {
            let mut sim = Sim::new(1, 8);
            sim.call(b, 1, true);
            let mut cancel = Vec::new();
            for &(sh, cancelled) in &arrivals {
                if with_cancelled || !cancelled {
                    let Got::Queued(t) = sim.call(sh, 1, true) else {
                        panic!()
                    };
                    if cancelled {
                        cancel.push(t);
                    }
                }
            }
            let start = sim.fair().start_of(A);
            for t in cancel {
                sim.cancel(t);
            }
            assert_eq!(sim.fair().start_of(A), start, "A's start moved");
            // A share whose only waiter leaves, holding nothing, is forgotten.
            let (live, v) = (sim.fair().live(), sim.fair().virtual_time());
            let Got::Queued(t) = sim.call(c, 1, true) else {
                panic!()
            };
            sim.cancel(t);
            assert_eq!((sim.fair().live(), sim.fair().start_of(C)), (live, v));
            turn_over(&mut sim, 20, |sim| sim.queue.is_empty());
            sim.log.iter().map(|g| g.share).collect::<Vec<_>>()
        };
        assert_eq!(run(true), run(false));
    }

    /// A share idle while another was served 50 times comes back at V: not behind by the 50
    /// grants it did not ask for (credit), nor ahead.
    #[test]
    fn an_idle_share_comes_back_at_the_virtual_time() {
        let mut sim = Sim::new(2, 8);
        let (a, b) = (share(A, 1, NO_CEILING), share(B, 1, NO_CEILING));
        backlog(&mut sim, a, 3);
        backlog(&mut sim, b, 3);
        turn_over(&mut sim, 100, |sim| sim.queued(A) == 0 && sim.held(A) == 0);
        for _ in 0..50 {
            sim.release(0);
            backlog(&mut sim, b, 3);
        }
        let f = sim.fair();
        assert_eq!(f.start_of(A), f.virtual_time());
        assert!(f.start_of(B) > f.virtual_time());
        let mark = sim.log.len();
        backlog(&mut sim, a, 3);
        for _ in 0..20 {
            sim.release(0);
            backlog(&mut sim, a, 3);
            backlog(&mut sim, b, 3);
        }
        // Both at weight 1: within one grant of each other (the model checks every step).
        assert!(sim.grants_to(A, mark).abs_diff(sim.grants_to(B, mark)) <= 2);
    }

    /// A tenant of one session (weight 1) that gives its slot back and asks again at once is
    /// idle in between: it keeps what it owes while the cap is busy, so a backlogged share of
    /// weight 3 still gets three grants in four. (Forgotten at once, it would come back at V
    /// each time, ahead of the other's head, and take one grant in two.)
    #[test]
    fn a_tenant_of_one_session_keeps_its_debt_while_the_cap_is_busy() {
        let mut sim = Sim::new(1, 8);
        let (a, b) = (share(A, 1, NO_CEILING), share(B, 3, NO_CEILING));
        backlog(&mut sim, b, 10);
        sim.call(a, 1, true);
        let mark = sim.log.len();
        for _ in 0..400 {
            let was_a = sim.holds[0].0 == A;
            sim.release(0);
            if was_a {
                sim.call(a, 1, true);
            }
            backlog(&mut sim, b, 10);
        }
        let (ga, gb) = (sim.grants_to(A, mark), sim.grants_to(B, mark));
        assert!(
            (ga as i64 - (ga + gb) as i64 / 4).abs() <= 2,
            "{ga} of {}",
            ga + gb
        );
    }

    /// Share B (ceiling 3) holds its ceiling while A's one slot turns over four times; then B
    /// gives back its three. B comes back at max(V, F): B, B (a tie at V, its ticket first),
    /// then A. Its waiters' tags taken at their arrival (0, 1, 2, banked during the hold) would
    /// give B all three while A waited, 3 slots against SFQ's bound of 2.
    #[test]
    fn a_share_held_at_its_ceiling_banks_no_tags() {
        let mut sim = Sim::new(4, 8);
        let (a, b) = (share(A, 1, NO_CEILING), share(B, 1, 3));
        for _ in 0..3 {
            assert_eq!(sim.call(b, 1, true), Got::Took);
        }
        assert_eq!(sim.call(a, 1, true), Got::Took);
        backlog(&mut sim, b, 6);
        backlog(&mut sim, a, 6);
        for _ in 0..4 {
            sim.release_of(A);
        }
        assert_eq!(sim.grants_to(A, 4), 4);
        let mark = sim.log.len();
        for _ in 0..3 {
            sim.release_of(B);
        }
        let order: Vec<u64> = sim.log[mark..].iter().map(|g| g.share).collect();
        assert_eq!(order, [B, B, A]);
    }

    /// A head asking for 2 slots while another share's waiters ask for 1: the brief's literal
    /// rule (the smallest tag among heads *whose k fits*) gives every freed slot to the other
    /// share, forever; here the free slot waits for the head, which gets the next two.
    #[test]
    fn a_head_asking_for_two_slots_is_not_overtaken_as_the_literal_rule_would() {
        let (a, b) = (share(A, 1, NO_CEILING), share(B, 1, NO_CEILING));
        let mut r = Reference::default();
        r.took_now(b, 1);
        r.took_now(b, 1);
        r.join(a, 0, 2);
        for t in 1..6 {
            r.join(b, t, 1);
        }
        for t in 6..106 {
            r.released(B, 1);
            let w = r.who_next_literal(1).unwrap();
            assert_eq!(w.share, B, "the literal rule serves A");
            r.granted(w);
            r.join(b, t, 1);
        }
        let mut sim = Sim::new(2, 8);
        sim.call(b, 1, true);
        sim.call(b, 1, true);
        sim.call(a, 2, true);
        backlog(&mut sim, b, 5);
        sim.release(0);
        assert!(
            sim.log.len() == 2 && sim.free() == 1,
            "the free slot waits for A"
        );
        sim.release(0);
        assert_eq!((sim.log[2].share, sim.log[2].k), (A, 2));
    }

    /// SFQ's V is the tag of the last grant, and a share new to the cap starts at V: a stream
    /// of new shares, one waiter each, goes ahead of a backlogged share's head every time (a
    /// grant at V leaves V where it is). Each waiter's wait is bounded by the shares that come
    /// while it waits, not by a constant. Records of the new shares, owing their one grant,
    /// are reused when the table is full.
    #[test]
    fn new_shares_keep_coming_in_ahead_of_a_backlogged_one() {
        let mut clock = Clock::default();
        let mut table = [ShareRecord::default(); 8];
        let mut fair = Fair::new(&mut clock, &mut table);
        let big = share(A, 1, NO_CEILING);
        fair.took_now(big, 1).unwrap();
        let mut queue: Vec<Waiter> = (0..5)
            .map(|t| {
                fair.join(big, t, 1).unwrap();
                Waiter {
                    share: A,
                    ticket: t,
                    k: 1,
                }
            })
            .collect();
        let mut holder = A;
        let mut big_grants = 0;
        for i in 0..100 {
            let fresh = share(1000 + i, 1, NO_CEILING);
            fair.join(fresh, 5 + i, 1).unwrap();
            queue.push(Waiter {
                share: fresh.digest,
                ticket: 5 + i,
                k: 1,
            });
            fair.released(holder, 1);
            let w = fair.who_next(1).unwrap();
            queue.retain(|q| q.ticket != w.ticket);
            fair.granted(w, queue.iter().copied());
            holder = w.share;
            big_grants += (w.share == A) as u32;
            assert!(fair.live() <= 8);
        }
        assert_eq!(
            big_grants, 1,
            "the big share's head waited for every new share"
        );
    }

    /// The clock moved up next to the rebase point runs on as it did, checked against the
    /// reference at every step, and is rebased while the cap is busy.
    #[test]
    fn a_rebase_changes_no_decision() {
        let mut sim = Sim::new(4, 8);
        let (a, b, c) = (
            share(A, 1, NO_CEILING),
            share(B, 3, 2),
            share(C, 16, NO_CEILING),
        );
        backlog(&mut sim, a, 5);
        backlog(&mut sim, b, 5);
        let offset = REBASE_AT - 50 * UNIT - sim.clock.v;
        sim.clock.v += offset;
        for r in sim.table.iter_mut().filter(|r| r.digest != 0) {
            r.finish += offset;
        }
        let mut rebased = false;
        for i in 0..200 {
            let before = sim.clock.v;
            sim.release(0);
            backlog(&mut sim, a, 5);
            backlog(&mut sim, b, 5);
            if i % 3 == 0 {
                sim.call(c, 1, i % 2 == 0);
            }
            rebased |= sim.clock.v < before;
        }
        assert!(rebased && sim.clock.v < offset);
    }

    /// A full table: a new share takes an empty record, else the idle share that owes least
    /// (forgiven), else it is refused.
    #[test]
    fn a_full_table_forgives_the_least_debt_then_refuses() {
        let mut clock = Clock::default();
        let mut table = [ShareRecord::default(); 3];
        let mut fair = Fair::new(&mut clock, &mut table);
        let s = |d| share(d, 1, NO_CEILING);
        let w = |d, t| Waiter {
            share: d,
            ticket: t,
            k: 1,
        };
        fair.took_now(s(A), 1).unwrap();
        fair.join(s(B), 0, 1).unwrap();
        fair.join(s(C), 1, 1).unwrap();
        fair.released(A, 1);
        assert_eq!(fair.who_next(1), Some(w(B, 0)));
        fair.granted(w(B, 0), [w(C, 1)]);
        fair.released(B, 1);
        // B holds nothing and waits for nothing, but owes its grant while C waits.
        assert_eq!((fair.live(), fair.start_of(B)), (2, UNIT));
        fair.join(s(D), 2, 1).unwrap();
        fair.join(s(5), 3, 1).unwrap();
        assert_eq!(
            fair.start_of(B),
            fair.virtual_time(),
            "B's debt was forgiven"
        );
        assert_eq!(fair.join(s(6), 4, 1), Err(Refused::Full));
        assert_eq!(fair.took_now(s(6), 1), Err(Refused::Full));
        assert_eq!(fair.live(), 3);
    }

    /// Calls that do not wait: with no waiters any call takes within its ceiling; with
    /// waiters a share's call waits behind its own waiters, loses a tie to a waiter, and
    /// takes a slot the first head cannot use yet only if its start is below that head's.
    #[test]
    fn calls_that_do_not_wait() {
        let mut sim = Sim::new(3, 8);
        let (a, b, c) = (share(A, 1, 2), share(B, 1, NO_CEILING), share(C, 1, 1));
        assert_eq!(sim.call(a, 1, false), Got::Took);
        assert_eq!(sim.call(a, 1, false), Got::Took);
        assert_eq!(sim.call(a, 1, false), Got::Throttled, "A's ceiling");
        assert_eq!(sim.call(c, 1, false), Got::Took);
        assert!(matches!(sim.call(b, 2, true), Got::Queued(_)));
        assert!(matches!(sim.call(b, 2, true), Got::Queued(_)));
        sim.release_of(A); // one free: B's head asks for 2
        assert_eq!(sim.free(), 1);
        assert_eq!(
            sim.call(b, 1, false),
            Got::Throttled,
            "behind its own waiter"
        );
        assert_eq!(
            sim.call(share(D, 1, 1), 1, false),
            Got::Throttled,
            "a tie at V"
        );
        sim.release_of(A);
        // B's head served at V; its next starts at V + 2 (the cap is still busy: had the
        // queue emptied, the clock would have restarted and B would be at V again).
        assert_eq!(sim.held(B), 2);
        sim.release_of(C);
        assert_eq!(
            sim.call(share(D, 1, 1), 1, false),
            Got::Took,
            "D starts below B"
        );
        assert_eq!(sim.call(c, 1, false), Got::Throttled, "no slot free");
    }

    #[test]
    fn weights_ks_and_digests_out_of_range_are_refused() {
        let mut clock = Clock::default();
        let mut table = [ShareRecord::default(); 2];
        let mut fair = Fair::new(&mut clock, &mut table);
        for (sh, k, why) in [
            (share(A, 0, 4), 1, Refused::Weight),
            (share(A, MAX_WEIGHT + 1, 4), 1, Refused::Weight),
            (share(0, 1, 4), 1, Refused::Weight),
            (share(A, 1, 4), 0, Refused::Ceiling),
            (share(A, 1, 2), 3, Refused::Ceiling),
        ] {
            assert!(!fair.may_take_now(sh, k, 8));
            assert_eq!(fair.took_now(sh, k), Err(why));
            assert_eq!(fair.join(sh, 0, k), Err(why));
        }
        assert_eq!(fair.live(), 0);
    }
}
