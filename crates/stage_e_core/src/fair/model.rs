//! The model test of `fair`: a plain reference of the rule (exact tags, heads and counts read
//! again from a list each time), the textbook SFQ with tags taken at arrival, and a simulator
//! that drives the implementation and both through thousands of random scenarios, checking
//! at every step that they agree and that SFQ's bound, the wait bound, work conservation and
//! no credit for idle shares hold.

use super::*;
use std::collections::BTreeMap;

/// SplitMix64: small, deterministic, no dependency.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub(super) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub(super) fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + self.below((hi - lo + 1) as usize) as u32
    }

    pub(super) fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

/// The reference's tag unit: another multiple of lcm(1..=16) than [`UNIT`], in u128, so
/// that the implementation's fixed point is checked too.
pub(super) const RU: u128 = 2 * 720_720;

pub(super) struct RefShare {
    weight: u32,
    ceiling: u32,
    held: u32,
    finish: u128,
}

/// The rule as the issue words it, the plain way: exact tags, a map of the shares that have
/// a state, and the queue as a list in arrival order, from which heads and counts are read
/// each time. A share is in the map while it holds, waits or owes (`F > V`).
#[derive(Default)]
pub(super) struct Reference {
    v: u128,
    shares: BTreeMap<u64, RefShare>,
    queue: Vec<Waiter>,
}

impl Reference {
    /// `S = max(V, F)`; `V` for a share with no state.
    pub(super) fn tag(&self, s: u64) -> u128 {
        self.shares.get(&s).map_or(self.v, |r| r.finish.max(self.v))
    }

    pub(super) fn head(&self, s: u64) -> Option<Waiter> {
        self.queue.iter().find(|w| w.share == s).copied()
    }

    /// The heads that fit under their share's ceiling.
    pub(super) fn eligible(&self) -> BTreeMap<u64, Waiter> {
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
    pub(super) fn order(&self) -> Vec<(u128, Waiter)> {
        let mut o: Vec<(u128, Waiter)> = (self.eligible().into_iter())
            .map(|(s, h)| (self.tag(s), h))
            .collect();
        o.sort_by_key(|&(t, h)| (t, h.ticket));
        o
    }

    pub(super) fn who_next(&self, free: u32) -> Option<Waiter> {
        let &(_, h) = self.order().first()?;
        (h.k <= free).then_some(h)
    }

    /// The brief's literal reading: the first eligible head *whose k fits*.
    pub(super) fn who_next_literal(&self, free: u32) -> Option<Waiter> {
        self.order()
            .into_iter()
            .map(|(_, h)| h)
            .find(|h| h.k <= free)
    }

    pub(super) fn may_take_now(&self, sh: Share, k: u32, free: u32) -> bool {
        let held = self.shares.get(&sh.digest).map_or(0, |r| r.held);
        if k > free || held as u64 + k as u64 > sh.ceiling as u64 {
            return false;
        }
        self.queue.is_empty()
            || (self.head(sh.digest).is_none()
                && (self.order().first()).is_none_or(|&(t, _)| self.tag(sh.digest) < t))
    }

    pub(super) fn policy(&mut self, sh: Share) -> &mut RefShare {
        let r = self.shares.entry(sh.digest).or_insert(RefShare {
            weight: sh.weight,
            ceiling: sh.ceiling,
            held: 0,
            finish: 0,
        });
        (r.weight, r.ceiling) = (sh.weight, sh.ceiling);
        r
    }

    pub(super) fn charge(&mut self, s: u64, k: u32) {
        let t = self.tag(s);
        let r = self.shares.get_mut(&s).unwrap();
        r.finish = t + k as u128 * RU / r.weight as u128;
        self.v = t;
    }

    pub(super) fn took_now(&mut self, sh: Share, k: u32) {
        self.policy(sh);
        if !self.queue.is_empty() {
            self.charge(sh.digest, k);
        }
        self.shares.get_mut(&sh.digest).unwrap().held += k;
        self.tidy();
    }

    pub(super) fn join(&mut self, sh: Share, ticket: u64, k: u32) {
        self.policy(sh);
        self.queue.push(Waiter {
            share: sh.digest,
            ticket,
            k,
        });
    }

    pub(super) fn granted(&mut self, w: Waiter) {
        self.charge(w.share, w.k);
        self.shares.get_mut(&w.share).unwrap().held += w.k;
        self.queue.retain(|q| q.ticket != w.ticket);
        self.tidy();
    }

    pub(super) fn leave(&mut self, w: Waiter) {
        self.queue.retain(|q| q.ticket != w.ticket);
        self.tidy();
    }

    pub(super) fn released(&mut self, s: u64, k: u32) {
        self.shares.get_mut(&s).unwrap().held -= k;
        self.tidy();
    }

    /// No waiter: the busy period is over, the clock restarts. Then the shares with
    /// nothing held, waited for or owed are forgotten.
    pub(super) fn tidy(&mut self) {
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
pub(super) struct Textbook {
    v: u128,
    finish: BTreeMap<u64, u128>,
    queue: Vec<(u128, Waiter)>,
}

impl Textbook {
    pub(super) fn tag(&self, s: u64) -> u128 {
        self.finish.get(&s).copied().unwrap_or(0).max(self.v)
    }

    pub(super) fn charge(&mut self, sh: Share, k: u32) -> u128 {
        let t = self.tag(sh.digest);
        self.finish
            .insert(sh.digest, t + k as u128 * RU / sh.weight as u128);
        t
    }

    pub(super) fn first(&self) -> Option<(u128, Waiter)> {
        self.queue
            .iter()
            .copied()
            .min_by_key(|&(t, w)| (t, w.ticket))
    }

    pub(super) fn may_take_now(&self, sh: Share, k: u32, free: u32) -> bool {
        k <= free
            && (self.queue.is_empty()
                || (self.queue.iter().all(|(_, w)| w.share != sh.digest)
                    && self.first().is_none_or(|(t, _)| self.tag(sh.digest) < t)))
    }

    pub(super) fn took_now(&mut self, sh: Share, k: u32) {
        if !self.queue.is_empty() {
            self.v = self.charge(sh, k);
        }
    }

    pub(super) fn join(&mut self, sh: Share, ticket: u64, k: u32) {
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

    pub(super) fn who_next(&self, free: u32) -> Option<Waiter> {
        self.first().map(|(_, w)| w).filter(|w| w.k <= free)
    }

    pub(super) fn granted(&mut self, w: Waiter) {
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
pub(super) enum Got {
    Took,
    Queued(u64),
    Throttled,
}

/// A grant: to whom, how many slots.
#[derive(Clone, Copy, Debug)]
pub(super) struct Grant {
    pub(super) share: u64,
    pub(super) k: u32,
}

/// A share with an eligible head since some grant: the slots granted to each share when
/// it became so. A run of two such shares starts at the later of the two.
pub(super) struct Backlog {
    at: BTreeMap<u64, u128>,
}

/// An eligible head's wait: its tag, `V` when it began, the grants to each other share since.
pub(super) struct Stretch {
    head: u64,
    tag: u128,
    v0: u128,
    ahead: BTreeMap<u64, u128>,
}

/// A cap of `n` slots run through the implementation (a table of `capacity` records), the
/// reference (and the textbook, if set) side by side. Every decision must agree, and after
/// every step the properties are checked against the reference's exact tags.
pub(super) struct Sim {
    n: u32,
    pub(super) clock: Clock,
    pub(super) table: Shares,
    reference: Reference,
    textbook: Option<Textbook>,
    /// The waiters, in arrival order (the extension's list of waiter records).
    pub(super) queue: Vec<Waiter>,
    /// Slots held: (share, k, where its record is) per grant, oldest first.
    pub(super) holds: Vec<(u64, u32, ShareAt)>,
    tickets: u64,
    pub(super) log: Vec<Grant>,
    /// Per share seen: its weight and its largest k so far.
    seen: BTreeMap<u64, (u32, u32)>,
    /// Slots granted to each share so far.
    slots: BTreeMap<u64, u128>,
    /// The shares with an eligible head, since when.
    backlogs: BTreeMap<u64, Backlog>,
    stretches: BTreeMap<u64, Stretch>,
    /// The front as last seated (its tickets), as the server keeps it: seated again only after
    /// a step that forgot the cutoff ([`Sim::check_front`]).
    front: Vec<u64>,
    /// Joins that left the front as it stood, and all joins.
    pub(super) joins_behind: (u64, u64),
}

pub(super) fn share(digest: u64, weight: u32, ceiling: u32) -> Share {
    Share {
        digest,
        weight,
        ceiling,
    }
}

impl Sim {
    pub(super) fn new(n: u32, capacity: usize) -> Sim {
        Sim {
            n,
            clock: Clock::default(),
            table: Shares::new(capacity),
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
            front: Vec::new(),
            joins_behind: (0, 0),
        }
    }

    /// The front in the order of service, as the server seats it (one n: 0 stands for all).
    fn seats(clock: &mut Clock, table: &mut Shares, queue: &[Waiter]) -> Vec<u64> {
        let queue = queue.iter().map(|w| {
            let seat = crate::front::Seated {
                process: 0,
                ticket: w.ticket,
                n: 0,
                k: w.k,
            };
            (seat, w.share)
        });
        let (seats, _) = Fair::new(clock, table.pool()).seats(queue);
        seats.iter().map(|s| s.ticket).collect()
    }

    /// After every step: while the clock keeps a cutoff (no step since the front was seated
    /// forgot it: a join behind every seat, a release that cannot move the order), the front
    /// seated then is still the first of the order of service; else it is seated again, as the
    /// server does.
    fn check_front(&mut self) {
        if self.clock.cutoff != 0 {
            let (mut clock, mut table) = (self.clock, self.table.clone());
            let now = Self::seats(&mut clock, &mut table, &self.queue);
            assert_eq!(now, self.front, "a front kept by its cutoff");
        } else {
            self.front = Self::seats(&mut self.clock, &mut self.table, &self.queue);
        }
    }

    pub(super) fn fair(&mut self) -> Fair<'_> {
        Fair::new(&mut self.clock, self.table.pool())
    }

    pub(super) fn free(&self) -> u32 {
        self.n - self.holds.iter().map(|h| h.1).sum::<u32>()
    }

    pub(super) fn held(&self, s: u64) -> u32 {
        self.holds.iter().filter(|h| h.0 == s).map(|h| h.1).sum()
    }

    pub(super) fn queued(&self, s: u64) -> usize {
        self.queue.iter().filter(|w| w.share == s).count()
    }

    pub(super) fn grants_to(&self, s: u64, since: usize) -> usize {
        self.log[since..].iter().filter(|g| g.share == s).count()
    }

    /// A call of `sh` for `k` slots: takes if it may, else waits if `wait`.
    pub(super) fn call(&mut self, sh: Share, k: u32, wait: bool) -> Got {
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
            let f = Fair::new(&mut self.clock, self.table.pool());
            assert_eq!(f.start_of(sh.digest), f.virtual_time());
        }
        if may {
            self.observe();
            let charged = !self.queue.is_empty();
            let tag = self.reference.tag(sh.digest);
            let at = self.fair().took_now(sh, k).unwrap();
            self.reference.took_now(sh, k);
            if let Some(t) = &mut self.textbook {
                t.took_now(sh, k);
            }
            self.holds.push((sh.digest, k, at));
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
        let moved = self.fair().join(sh, ticket, k).unwrap();
        self.joins_behind.0 += !moved as u64;
        self.joins_behind.1 += 1;
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
    pub(super) fn release(&mut self, i: usize) {
        let (s, k, at) = self.holds.remove(i);
        self.fair().released_at(at, k);
        self.reference.released(s, k);
        self.settle();
    }

    /// Gives back share `s`'s oldest hold.
    pub(super) fn release_of(&mut self, s: u64) {
        let i = self.holds.iter().position(|h| h.0 == s).unwrap();
        self.release(i);
    }

    /// Waiter `ticket` gives up.
    pub(super) fn cancel(&mut self, ticket: u64) {
        assert!(
            self.textbook.is_none(),
            "the textbook keeps no cancellation"
        );
        let at = self.queue.iter().position(|w| w.ticket == ticket).unwrap();
        let w = self.queue.remove(at);
        Fair::new(&mut self.clock, self.table.pool()).leave(w, self.queue.iter().copied());
        self.reference.leave(w);
        self.settle();
    }

    /// [`Fair::order`] names, in order, who [`Fair::who_next`] would serve were every slot
    /// free and nothing released, one grant after another (done on a copy).
    pub(super) fn check_order(&self) {
        let mut out = [Waiter {
            share: 0,
            ticket: 0,
            k: 0,
        }; ORDER_MAX];
        let (mut clock, mut table) = (self.clock, self.table.clone());
        let len = Fair::new(&mut clock, table.pool()).order(self.queue.iter().copied(), &mut out);
        let mut queue = self.queue.clone();
        let mut served = Vec::new();
        while served.len() < ORDER_MAX {
            let mut f = Fair::new(&mut clock, table.pool());
            let Some(w) = f.who_next(u32::MAX) else { break };
            queue.retain(|q| q.ticket != w.ticket);
            f.granted(w, queue.iter().copied());
            served.push(w);
        }
        assert_eq!(&out[..len], &served[..], "projected order");
    }

    /// Serves who the free slots go to, one by one, as every release would.
    pub(super) fn settle(&mut self) {
        loop {
            self.observe();
            self.check_order();
            let free = self.free();
            let next = self.fair().who_next(free);
            assert_eq!(next, self.reference.who_next(free), "free {free}");
            if let Some(t) = &self.textbook {
                assert_eq!(next, t.who_next(free), "textbook, free {free}");
            }
            let Some(w) = next else { break };
            let tag = self.reference.tag(w.share);
            self.queue.retain(|q| q.ticket != w.ticket);
            let at = Fair::new(&mut self.clock, self.table.pool())
                .granted(w, self.queue.iter().copied())
                .expect("a waiter of a share");
            self.reference.granted(w);
            if let Some(t) = &mut self.textbook {
                t.granted(w);
            }
            self.holds.push((w.share, w.k, at));
            self.granted(w.share, w.k, Some(tag));
        }
        self.check();
    }

    pub(super) fn weight(&self, s: u64) -> u128 {
        self.seen[&s].0 as u128
    }

    pub(super) fn kmax(&self, s: u64) -> u128 {
        self.seen[&s].1 as u128
    }

    /// Before each grant and after each step: which shares have an eligible head now. A
    /// share that comes to have one starts its backlog (the slots granted so far) and its
    /// head's stretch; a share that has none ends both.
    pub(super) fn observe(&mut self) {
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
    pub(super) fn granted(&mut self, s: u64, k: u32, tag: Option<u128>) {
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
    pub(super) fn check(&mut self) {
        self.check_front();
        let free = self.free();
        let r = &self.reference;
        let f = Fair::new(&mut self.clock, self.table.pool());
        assert_eq!(f.waiting() as usize, self.queue.len());
        for (&s, _) in self.seen.iter() {
            let mine = (f.start_of(s) - f.virtual_time()) as u128 * RU;
            assert_eq!(mine, (r.tag(s) - r.v) * UNIT as u128, "share {s}'s start");
        }
        let live: Vec<u64> = (self.table.records.iter())
            .filter(|x| x.digest != 0 && !(x.idle() && x.finish <= self.clock.v))
            .map(|x| x.digest)
            .collect();
        let mut sorted = live.clone();
        sorted.sort();
        assert_eq!(sorted, r.shares.keys().copied().collect::<Vec<_>>());
        for x in self
            .table
            .records
            .iter()
            .filter(|x| live.contains(&x.digest))
        {
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
pub(super) fn scenario(seed: u64) -> (usize, (u64, u64)) {
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
    assert!(sim.table.records.iter().all(|r| r.digest == 0));
    assert_eq!(
        (sim.clock, sim.table.used),
        (Clock::default(), 0),
        "every record freed"
    );
    (grants, sim.joins_behind)
}

/// The model test: thousands of random scenarios, each decision the reference's (and the
/// textbook SFQ's where it applies), SFQ's bound, the wait bound, work conservation, no
/// credit for idle shares, everyone served in the end, and a front kept by its cutoff the one
/// seated again would be (many joins keep it).
#[test]
pub(super) fn random_scenarios_agree_with_the_reference_and_keep_the_bounds() {
    let (mut grants, mut behind, mut joins) = (0, 0, 0);
    for seed in 0..4000 {
        let (g, (b, j)) = scenario(seed);
        (grants, behind, joins) = (grants + g, behind + b, joins + j);
    }
    assert!(grants > 200_000, "{grants}");
    assert!(
        behind * 10 > joins,
        "{behind} of {joins} joins kept the front"
    );
}
