//! Fair shares of one cap (issue 38): its slots shared among named shares (tenants), weighted,
//! each under its own ceiling, by start-time fair queuing (SFQ) over the cap's waiters.
//!
//! Interface (every call under the cap's queue lock, the extension's waits LWLock):
//!
//! - [`Fair::may_take_now`], then [`Fair::took_now`]: a call that does not wait;
//! - [`Fair::join`]: a call that waits, after its ticket is taken;
//! - [`Fair::who_next`], then [`Fair::granted`]: who freed slots go to, and that it took them;
//! - [`Fair::leave`]: a waiter that gives up (timed out, cancelled, terminated);
//! - [`Fair::released`]: a share gives slots back;
//! - [`Fair::order`], [`Fair::seats`]: who is served next, in order: the front seats of a cap
//!   with shares (`queue::WaitLine::join_in_order`, `leave_in_order`, `reorder`).
//!
//! The steps a server runs around these, with the wait line's lock-free protocol (a seated
//! waiter claims its slots without the lock, then records its grant), are `fair/line.rs`,
//! tested with threads and model-checked with loom.
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
//! **Layout.** A [`Clock`] (16 bytes in shared memory, [`Clock::pack`]) per cap, and a
//! [`ShareRecord`] (48 bytes) per live share in one [`Pool`] of fixed size that every cap
//! draws on: a cap's records are a chain from its clock, the records given back a free list
//! from the pool's [`PoolHead`] (8 bytes), and a database holds at most its limit of them (`database_share`); zeroed memory is empty. A
//! step walks the cap's chain only, so its cost is the cap's live shares, not the pool's
//! size. No allocation: the callers pass the waiters still queued as an iterator where a
//! share's next head must be found, as [`crate::front::Front::reseat`] takes them.
//!
//! **Slots of different n** are not this module's: `free` counts the slots the head could use,
//! and the front's rules (`front`) apply to waiters in this order instead of ticket order.
//!
//! `fair/order.rs` holds the order of service and the front's seats; this file the records,
//! the clock, and the steps that change them.

/// The largest weight; weights are 1 to 16.
pub const MAX_WEIGHT: u32 = 16;

/// Tag units per slot: lcm(1..=16), so that `UNIT / w` is whole for every weight.
pub const UNIT: u64 = 720_720;

/// A ceiling that never binds.
pub const NO_CEILING: u32 = u32::MAX;

/// The digest of a cap's unnamed share (the calls that name none, once the cap has shares):
/// named shares' digests are kept above it by their hash.
pub const UNNAMED: u64 = 1;

/// What a grant of `k` slots at weight `weight` adds to its share's finish tag: `k / w` slots,
/// exactly, in tag units (a grant and its projection in [`Fair::order`] charge the same).
fn cost(k: u32, weight: u32) -> u64 {
    k as u64 * (UNIT / weight.clamp(1, MAX_WEIGHT) as u64)
}

/// The most places [`Fair::order`] projects (the front has 4 seats).
pub const ORDER_MAX: usize = 8;

/// When `V` reaches this, the tags are rebased (subtracting `V`).
const REBASE_AT: u64 = 1 << 62;

/// A cap's virtual time, its count of waiters and its chain of share records (zeroed memory:
/// idle, no shares).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Clock {
    v: u64,
    waiting: u32,
    /// The cap's first share record in the pool, plus one (0: none).
    first: u32,
    /// While the front is full in the order of service: the last seat's start tag less `V`,
    /// plus one; 0 when it is not, or not known ([`Fair::join`]).
    cutoff: u32,
}

/// How [`Clock::pack`] shares its second word: the count of waiters (at most a backend each:
/// `MAX_BACKENDS` is 2^18 - 1), the cutoff, and the first record (the pool has at most 2^20
/// records, so an index plus one fits in 21 bits) in the top bits, so that a reader without
/// the lock sees from them alone whether the cap has shares.
const WAITING_BITS: u32 = 19;
const CUTOFF_BITS: u32 = 24;
const FIRST_SHIFT: u32 = WAITING_BITS + CUTOFF_BITS;
const _: () = assert!(64 - FIRST_SHIFT >= 21);

/// The largest cutoff kept (a front further ahead of `V` than 23 slots of weight 1 keeps none).
const CUTOFF_MAX: u64 = (1 << CUTOFF_BITS) - 1;

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
    /// The next record of the same cap's chain, or of the pool's free list, plus one (0: none).
    next: u32,
}

impl Clock {
    /// The clock as two words, for shared memory that keeps it in atomics (written only under
    /// the queue lock; [`Clock::unpack`] reads it back).
    pub fn pack(&self) -> [u64; 2] {
        debug_assert!(self.waiting < 1 << WAITING_BITS);
        [
            self.v,
            self.waiting as u64
                | (self.cutoff as u64) << WAITING_BITS
                | (self.first as u64) << FIRST_SHIFT,
        ]
    }

    pub fn unpack(words: [u64; 2]) -> Self {
        Clock {
            v: words[0],
            waiting: (words[1] & ((1 << WAITING_BITS) - 1)) as u32,
            cutoff: ((words[1] >> WAITING_BITS) & CUTOFF_MAX) as u32,
            first: (words[1] >> FIRST_SHIFT) as u32,
        }
    }

    /// Whether the cap has a chain of share records, from its second word alone: a reader
    /// without the queue lock may look (a cap without shares keeps its path unchanged).
    pub fn has_shares(second_word: u64) -> bool {
        second_word >> FIRST_SHIFT != 0
    }

    /// The front, if seated outside the fair queue's order (a waiter in no share left it by
    /// the front's own rules), keeps no cutoff.
    pub fn forget_cutoff(&mut self) {
        self.cutoff = 0;
    }
}

impl ShareRecord {
    fn idle(&self) -> bool {
        self.held == 0 && self.waiting == 0
    }
}

/// The head of a pool of share records that many caps share (zeroed memory: every record
/// free). A record is taken from the free list, else from the never-used ones above `high`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolHead {
    free: u32,
    high: u32,
}

impl PoolHead {
    /// The head as one word, as [`Clock::pack`] does.
    pub fn pack(&self) -> u64 {
        self.free as u64 | (self.high as u64) << 32
    }

    pub fn unpack(word: u64) -> Self {
        PoolHead {
            free: word as u32,
            high: (word >> 32) as u32,
        }
    }
}

/// The pool of share records as one step borrows it (under the queue lock): its records, its
/// head, and how many records the cap's database holds and may hold (its `database_share` of
/// the pool; `share::limit`).
pub struct Pool<'a> {
    pub records: &'a mut [ShareRecord],
    pub head: &'a mut PoolHead,
    pub used: &'a mut u32,
    pub limit: u32,
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

/// Where a share's record is in the pool, for whoever holds its slots to name it when they
/// are given back (the server keeps it in the slots' holder records): the index plus one, so
/// never 0. A record is kept while its share holds slots, so this stays valid until then.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShareAt(pub u32);

impl ShareAt {
    fn of(i: usize) -> Self {
        ShareAt(i as u32 + 1)
    }
}

/// Why a call is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// A weight outside `1..=MAX_WEIGHT`, or a digest of 0.
    Weight,
    /// k is 0 or above the share's ceiling: it could never be served.
    Ceiling,
    /// The pool (or the database's share of it) is taken, and the cap has no idle record to
    /// reuse.
    Full,
}

/// A live share as the views show it (its record, read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShareView {
    pub digest: u64,
    pub weight: u32,
    /// [`NO_CEILING`]: none.
    pub ceiling: u32,
    pub held: u32,
    pub waiting: u32,
}

/// The live shares of the cap whose clock is `clock`, with their index in the pool's
/// `records` (read under the queue lock, in either mode): those that hold or wait for slots
/// (a record that only owes its last request is not shown: it is forgotten as soon as that
/// is paid).
pub fn live_shares<'r>(
    clock: &Clock,
    records: &'r [ShareRecord],
) -> impl Iterator<Item = (usize, ShareView)> + 'r {
    Chain {
        shares: records,
        at: clock.first,
    }
    .filter(|&i| records[i].digest != 0 && !records[i].idle())
    .map(|i| {
        let r = &records[i];
        (
            i,
            ShareView {
                digest: r.digest,
                weight: r.weight,
                ceiling: r.ceiling,
                held: r.held,
                waiting: r.waiting,
            },
        )
    })
}

/// A cap's fair queue: its clock and the pool that holds its chain of shares, borrowed for one
/// step under the queue lock.
pub struct Fair<'a> {
    clock: &'a mut Clock,
    shares: &'a mut [ShareRecord],
    head: &'a mut PoolHead,
    used: &'a mut u32,
    limit: u32,
}

/// The records of a cap's chain, by index, from `first` (an index plus one).
struct Chain<'r> {
    shares: &'r [ShareRecord],
    at: u32,
}

impl Iterator for Chain<'_> {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        let i = self.at.checked_sub(1)? as usize;
        // A link out of the pool (a bug) ends the chain rather than the process.
        let r = self.shares.get(i)?;
        self.at = r.next;
        Some(i)
    }
}

impl<'a> Fair<'a> {
    pub fn new(clock: &'a mut Clock, pool: Pool<'a>) -> Self {
        Fair {
            clock,
            shares: pool.records,
            head: pool.head,
            used: pool.used,
            limit: pool.limit,
        }
    }

    /// The cap's records, by index.
    fn chain(&self) -> Chain<'_> {
        Chain {
            shares: self.shares,
            at: self.clock.first,
        }
    }

    /// The virtual time, in units of 1/[`UNIT`] slot (relative: it restarts and is rebased).
    pub fn virtual_time(&self) -> u64 {
        self.clock.v
    }

    /// How many waiters the cap has.
    pub fn waiting(&self) -> u32 {
        self.clock.waiting
    }

    /// The front was seated outside the order of service ([`Clock::forget_cutoff`]).
    pub fn forget_cutoff(&mut self) {
        self.clock.forget_cutoff();
    }

    /// Where share `digest`'s next request starts: `max(V, F)`, `V` if it has no record.
    pub fn start_of(&self, digest: u64) -> u64 {
        self.find(digest)
            .map_or(self.clock.v, |i| self.start(&self.shares[i]))
    }

    /// The shares with a state: holding, waiting, or owing (`F > V`).
    pub fn live(&self) -> usize {
        self.chain()
            .filter(|&i| !self.empty(&self.shares[i]))
            .count()
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
            .then(|| self.chain().find(|&i| self.shares[i].digest == digest))
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
    /// ceiling at once); a new one at `V` if it has none: an empty record of the cap's, else
    /// one from the pool while the database is under its limit, else the cap's idle record
    /// that owes least (its debt, less than one request, is forgiven), else [`Refused::Full`].
    fn record(&mut self, share: Share) -> Result<usize, Refused> {
        let i = match self.find(share.digest) {
            Some(i) => i,
            None => {
                let reused = self.chain().find(|&i| self.empty(&self.shares[i]));
                let i = match reused.or_else(|| self.take()) {
                    Some(i) => i,
                    None => self
                        .chain()
                        .filter(|&i| self.shares[i].idle())
                        .min_by_key(|&i| self.shares[i].finish)
                        .ok_or(Refused::Full)?,
                };
                self.shares[i] = ShareRecord {
                    digest: share.digest,
                    next: self.shares[i].next,
                    ..ShareRecord::default()
                };
                i
            }
        };
        self.set_policy(i, share);
        Ok(i)
    }

    /// A call of `share` came: a record the share has takes its policy (a weight applies from
    /// the next charge, a ceiling at once), as an admitted call's does, so that a share whose
    /// record a restart restored without its policy shows it after any call, taken or not.
    pub fn refresh(&mut self, share: Share) {
        if Self::check(share, 1).is_ok() {
            if let Some(i) = self.find(share.digest) {
                self.set_policy(i, share);
            }
        }
    }

    /// Record `i` takes `share`'s policy; a change to a share with waiters may reorder them.
    fn set_policy(&mut self, i: usize, share: Share) {
        let r = &mut self.shares[i];
        if (r.weight, r.ceiling) != (share.weight, share.ceiling) {
            (r.weight, r.ceiling) = (share.weight, share.ceiling);
            if r.waiting > 0 {
                self.clock.cutoff = 0;
            }
        }
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
    pub fn took_now(&mut self, share: Share, k: u32) -> Result<ShareAt, Refused> {
        Self::check(share, k)?;
        let i = self.record(share)?;
        if self.shares[i].held.saturating_add(k) > share.ceiling {
            return Err(Refused::Ceiling);
        }
        if self.clock.waiting > 0 {
            self.charge(i, k);
        }
        self.shares[i].held += k;
        Ok(ShareAt::of(i))
    }

    /// Where share `digest`'s record is, if it has one: for a waiter to name it in its slots'
    /// holder records as it takes them (the record stays while the share has a waiter).
    pub fn at_of(&self, digest: u64) -> Option<ShareAt> {
        self.find(digest).map(ShareAt::of)
    }

    /// Share `digest` with the policy its record has (as of its last call), if it has one.
    pub fn share_of(&self, digest: u64) -> Option<Share> {
        self.find(digest).map(|i| {
            let r = &self.shares[i];
            Share {
                digest,
                weight: r.weight,
                ceiling: r.ceiling,
            }
        })
    }

    /// A call of `share` is to wait for `k` slots: its record is made (or its policy updated)
    /// now, so that [`Fair::join`], once the call has its ticket, cannot be refused. Err as
    /// `join` would be.
    pub fn admit(&mut self, share: Share, k: u32) -> Result<(), Refused> {
        Self::check(share, k)?;
        self.record(share).map(|_| ())
    }

    /// A call of `share` waits for `k` slots with `ticket` (tickets rise in arrival order). It
    /// is the share's head if the share had no waiter. Its tag is taken when it is compared.
    ///
    /// Returns whether the front may have changed: false when the front is full in the order
    /// of service (its cutoff known, [`Fair::seats`]) and the joiner can start no earlier than
    /// the last seat. It starts at `max(V, F)` at the earliest, plus at least one slot's cost
    /// for each waiter of its share ahead of it; tags only grow along the order, and on a tie
    /// the joiner, whose ticket is the newest, comes last. Then the seats stand, and the
    /// caller need not walk the queue to seat them again.
    pub fn join(&mut self, share: Share, ticket: u64, k: u32) -> Result<bool, Refused> {
        Self::check(share, k)?;
        let i = self.record(share)?;
        let v = self.clock.v;
        let r = &mut self.shares[i];
        let earliest = r.finish.saturating_sub(v) + r.waiting as u64 * cost(1, r.weight);
        let behind = self.clock.cutoff != 0 && earliest >= self.clock.cutoff as u64 - 1;
        if r.waiting == 0 {
            r.head = ticket;
            r.head_k = k;
        }
        r.waiting += 1;
        self.clock.waiting += 1;
        if !behind {
            self.clock.cutoff = 0;
        }
        Ok(!behind)
    }

    /// Waiter `w` took its slots and left the queue; `queue` is the waiters still queued, in
    /// any order (read only to find its share's next head). It is the one [`Fair::who_next`]
    /// named, or one the front seated behind it ([`Fair::order`]) that took first because the
    /// free slots covered both: a share is charged per grant, so the order in which seated
    /// waiters record their grants changes no tag but their own share's.
    pub fn granted(
        &mut self,
        w: Waiter,
        queue: impl IntoIterator<Item = Waiter>,
    ) -> Option<ShareAt> {
        let Some(i) = self.find(w.share) else {
            debug_assert!(false, "granted a waiter of no share: {w:?}");
            return None;
        };
        self.charge(i, w.k);
        self.shares[i].held += w.k;
        self.dequeue(i, w.ticket, queue);
        Some(ShareAt::of(i))
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

    /// Share `digest` gave `k` slots back ([`Fair::released_at`], found by its digest).
    pub fn released(&mut self, digest: u64, k: u32) -> bool {
        match self.find(digest) {
            Some(i) => self.released_at(ShareAt::of(i), k),
            None => {
                debug_assert!(false, "share {digest} released what it did not hold");
                false
            }
        }
    }

    /// The share whose record is `at` ([`Fair::took_now`], [`Fair::granted`]) gave `k` slots
    /// back. A record that is not the cap's (a caller's bug) changes nothing: another cap's
    /// share is never given slots it did not hold. Returns whether the order of service may
    /// have changed: only if the share has waiters and a ceiling (a share's held slots weigh
    /// in the order only against its ceiling), so a release that cannot move the order need
    /// not seat the front again.
    pub fn released_at(&mut self, at: ShareAt, k: u32) -> bool {
        let Some(i) = at.0.checked_sub(1).map(|i| i as usize) else {
            return false;
        };
        if !self.chain().any(|c| c == i) {
            debug_assert!(false, "record {i} is not the cap's");
            return false;
        }
        let r = &mut self.shares[i];
        debug_assert!(r.held >= k);
        r.held = r.held.saturating_sub(k);
        let moved = r.waiting > 0 && r.ceiling != NO_CEILING;
        if moved {
            self.clock.cutoff = 0;
        }
        self.forget_if_empty(i);
        moved
    }

    /// A grant of `k` slots to share `i`: `S = max(V, F)`, `F = S + k/w`, `V = S`.
    fn charge(&mut self, i: usize, k: u32) {
        self.clock.cutoff = 0; // the front is seated again after a grant
        if self.clock.v >= REBASE_AT {
            self.rebase();
        }
        let r = &mut self.shares[i];
        let s = self.clock.v.max(r.finish);
        // V < 2^62 here, F <= V + 2^52 (a charge leaves F - V at k·UNIT/w < 2^52: k < 2^32,
        // UNIT < 2^20), so the new F < 2^63.
        r.finish = s + cost(k, r.weight);
        self.clock.v = s;
    }

    /// Subtracts `V` from every tag: every `max(V, F) - V` is kept, so no decision changes.
    fn rebase(&mut self) {
        let v = self.clock.v;
        let mut at = self.clock.first;
        while let Some(r) = at
            .checked_sub(1)
            .and_then(|i| self.shares.get_mut(i as usize))
        {
            r.finish = r.finish.saturating_sub(v);
            at = r.next;
        }
        self.clock.v = 0;
    }

    /// A waiter of share `i` with `ticket` left the queue (served or not).
    fn dequeue(&mut self, i: usize, ticket: u64, queue: impl IntoIterator<Item = Waiter>) {
        self.clock.cutoff = 0; // the front is seated again after a waiter leaves
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
        let (mut prev, mut at): (Option<usize>, u32) = (None, self.clock.first);
        while let Some(i) = at.checked_sub(1).map(|i| i as usize) {
            let Some(r) = self.shares.get_mut(i) else {
                break;
            };
            at = r.next;
            r.finish = 0;
            if r.idle() {
                match prev {
                    None => self.clock.first = at,
                    Some(p) => self.shares[p].next = at,
                }
                self.free(i);
            } else {
                prev = Some(i);
            }
        }
    }

    fn forget_if_empty(&mut self, i: usize) {
        if self.empty(&self.shares[i]) {
            self.forget(i);
        }
    }

    /// A record from the pool, first in the cap's chain; None if the database holds its limit
    /// or the pool has none free.
    fn take(&mut self) -> Option<usize> {
        if *self.used >= self.limit {
            return None;
        }
        let i = match self.head.free.checked_sub(1) {
            Some(i) => {
                self.head.free = self.shares[i as usize].next;
                i as usize
            }
            None if (self.head.high as usize) < self.shares.len() => {
                self.head.high += 1;
                self.head.high as usize - 1
            }
            None => return None,
        };
        self.shares[i] = ShareRecord {
            next: self.clock.first,
            ..ShareRecord::default()
        };
        self.clock.first = i as u32 + 1;
        *self.used += 1;
        Some(i)
    }

    /// Unlinks record `i` from the cap's chain and gives it back to the pool.
    fn forget(&mut self, i: usize) {
        let link = i as u32 + 1;
        let next = self.shares[i].next;
        if self.clock.first == link {
            self.clock.first = next;
        } else if let Some(prev) = self.chain().find(|&p| self.shares[p].next == link) {
            self.shares[prev].next = next;
        } else {
            debug_assert!(false, "record {i} is not in the cap's chain");
            return;
        }
        self.free(i);
    }

    /// Puts record `i`, out of every chain, on the pool's free list.
    fn free(&mut self, i: usize) {
        self.shares[i] = ShareRecord {
            next: self.head.free,
            ..ShareRecord::default()
        };
        self.head.free = i as u32 + 1;
        *self.used = self.used.saturating_sub(1);
    }
}

/// A pool of its own, for the tests.
#[cfg(test)]
#[derive(Clone, Debug)]
pub(crate) struct Shares {
    pub(crate) records: Vec<ShareRecord>,
    pub(crate) head: PoolHead,
    pub(crate) used: u32,
}

#[cfg(test)]
impl Shares {
    pub(crate) fn new(records: usize) -> Self {
        Shares {
            records: vec![ShareRecord::default(); records],
            head: PoolHead::default(),
            used: 0,
        }
    }

    pub(crate) fn pool(&mut self) -> Pool<'_> {
        Pool {
            limit: self.records.len() as u32,
            records: &mut self.records,
            head: &mut self.head,
            used: &mut self.used,
        }
    }
}

// Layout, for shared memory: a share's state costs 48 bytes (the server keeps an 80-byte note of
// its name and counts beside it, for the views: 128 in all), a cap's clock 16 (`Clock::pack`).
const _: () = assert!(size_of::<ShareRecord>() == 48 && size_of::<ShareRecord>() <= 64);
const _: () = assert!(size_of::<PoolHead>() == 8);

mod order;

#[cfg(test)]
mod line;
#[cfg(all(test, loom))]
mod line_model;
#[cfg(all(test, not(loom)))]
mod line_threads;
#[cfg(all(test, not(loom)))]
mod model;
#[cfg(all(test, not(loom)))]
mod pool;
#[cfg(all(test, not(loom)))]
mod scenarios;
