//! The order of service of a cap with shares, and its front: who the freed slots go to
//! ([`Fair::who_next`]), who would be served after them grant after grant ([`Fair::order`],
//! projected on an overlay of the records, nothing written), and the first
//! [`crate::front::FRONT`] of them as the front's seats ([`Fair::seats`]), which keeps the last
//! seat's start tag in the clock (the cutoff) for [`Fair::join`] to compare a newcomer's with.

use super::{cost, Fair, Waiter, CUTOFF_MAX, ORDER_MAX};
use crate::front::{Seated, Seats, FRONT};

impl Fair<'_> {
    /// The first eligible head: of the shares whose head fits under their ceiling, the smallest
    /// `max(V, F)`, the earlier ticket on a tie.
    pub(super) fn first(&self) -> Option<usize> {
        self.chain()
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

    /// The next waiters to be served, in order, into `out` (up to its length; returns how
    /// many): who [`Fair::who_next`] names with every slot free, then who it would name once
    /// that one was granted, and so on. `queue` is the waiters still queued, in any order
    /// (walked once per place, to find a served share's next head). This is the order of the
    /// front seats of a cap with shares (`front::Front::reseat_in`): the front's rules (a head
    /// asking for k slots is not overtaken, slots of different n) then apply to waiters in
    /// this order instead of arrival order. Nothing is written; the table is read through an
    /// overlay of the shares a projected grant touched.
    pub fn order<I>(&self, queue: I, out: &mut [Waiter]) -> usize
    where
        I: IntoIterator<Item = Waiter> + Clone,
    {
        self.project(queue, out).0
    }

    /// [`Fair::order`], and the start tag of the last place projected.
    fn project<I>(&self, queue: I, out: &mut [Waiter]) -> (usize, u64)
    where
        I: IntoIterator<Item = Waiter> + Clone,
    {
        // (record, finish, held, waiting, head, head_k) of each share a projected grant moved.
        let mut moved = [(usize::MAX, 0u64, 0u32, 0u32, 0u64, 0u32); ORDER_MAX];
        let mut touched = 0;
        let mut v = self.clock.v;
        let mut len = 0;
        let mut last = v;
        while len < out.len().min(ORDER_MAX) {
            let view = |i: usize| {
                let r = &self.shares[i];
                moved[..touched]
                    .iter()
                    .find(|m| m.0 == i)
                    .map_or((r.finish, r.held, r.waiting, r.head, r.head_k), |m| {
                        (m.1, m.2, m.3, m.4, m.5)
                    })
            };
            let first = self
                .chain()
                .filter(|&i| {
                    let (_, held, waiting, _, head_k) = view(i);
                    let r = &self.shares[i];
                    r.digest != 0 && waiting > 0 && held.saturating_add(head_k) <= r.ceiling
                })
                .min_by_key(|&i| {
                    let (finish, _, _, head, _) = view(i);
                    (v.max(finish), head)
                });
            let Some(i) = first else { break };
            let r = &self.shares[i];
            let (finish, held, waiting, head, head_k) = view(i);
            out[len] = Waiter {
                share: r.digest,
                ticket: head,
                k: head_k,
            };
            len += 1;
            // Granted: charged, holding, its next waiter by ticket is its head.
            let s = v.max(finish);
            v = s;
            last = s;
            let next = queue
                .clone()
                .into_iter()
                .filter(|w| w.share == r.digest && w.ticket > head)
                .min_by_key(|w| w.ticket);
            let m = (
                i,
                s + cost(head_k, r.weight),
                held.saturating_add(head_k),
                if next.is_some() { waiting - 1 } else { 0 },
                next.map_or(0, |n| n.ticket),
                next.map_or(0, |n| n.k),
            );
            match moved[..touched].iter_mut().find(|x| x.0 == i) {
                Some(x) => *x = m,
                None => {
                    moved[touched] = m;
                    touched += 1;
                }
            }
        }
        (len, last)
    }

    /// The front of a cap with shares: the first [`crate::front::FRONT`] waiters of `queue`
    /// (each with its share's digest, in any order) in the order of service ([`Fair::order`]),
    /// and the widest n of them all, for `queue::WaitLine::join_in_order` and its kin. A full
    /// front keeps its last seat's tag, for [`Fair::join`] to compare a newcomer's with.
    pub fn seats<I>(&mut self, queue: I) -> (Seats, u32)
    where
        I: IntoIterator<Item = (Seated, u64)> + Clone,
        I::IntoIter: Clone,
    {
        let as_waiter = |(s, share): (Seated, u64)| Waiter {
            share,
            ticket: s.ticket,
            k: s.k,
        };
        let mut order = [Waiter {
            share: 0,
            ticket: 0,
            k: 0,
        }; FRONT];
        let (len, last) = self.project(queue.clone().into_iter().map(as_waiter), &mut order);
        let widest = queue
            .clone()
            .into_iter()
            .map(|(s, _)| s.n)
            .max()
            .unwrap_or(0);
        let seats = order[..len]
            .iter()
            .filter_map(|w| {
                queue
                    .clone()
                    .into_iter()
                    .find(|(s, _)| s.ticket == w.ticket)
                    .map(|(s, _)| s)
            })
            .collect::<Seats>();
        let ahead = last - self.clock.v;
        self.clock.cutoff = if seats.len() == FRONT && ahead < CUTOFF_MAX {
            ahead as u32 + 1
        } else {
            0
        };
        (seats, widest)
    }
}
