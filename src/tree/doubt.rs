//! Records a worker's answers did not bear out. A prediction ends in a node the worker
//! holds ([`Mark`]); its answer names how many of the predicted tokens the engine served
//! from cache. An answer far short of the prediction says the engine did not hold the
//! first block after the delivered ones, a block whose cache key covers the prompt up
//! to its end: the node holding that block's last byte counts one *doubt* for that
//! worker (a head shared with other prompts that ends before it is not blamed), and [`DISBELIEVE_AFTER`] such answers in a row (no answer through
//! it delivering in between) make the worker *disbelieved* there — its match stops
//! before that node, for every prompt through it, and the pick prefers another worker of
//! equal load for such prompts, so a prefix the worker's engine never serves from cache
//! (prefix caching off, another model behind the URL, a chat template that differs) is
//! not pinned to it. An answer that delivers what was predicted clears the counts (not
//! a disbelief) on its path. Evidence about one record, whatever the worker's other
//! answers say; the shared head above the delivered point is never touched.
//!
//! A disbelief lasts while the node does (it is the worker's record of that prefix): the
//! worker leaving or going down, `POST /cache/clear`, or the node's eviction ends it.
//! Doubts live beside the arena in slots a node points to (`Node::doubt`, 0 for none):
//! nodes pay four bytes they had as padding, and a walk looks at a slot only while some
//! worker is disbelieved somewhere.

use super::{Mark, NodeIdx, ROOT, RadixTree, WorkerId, WorkerMask};

/// Short answers in a row on one record that make the router stop believing a worker
/// holds it: two, so that a worker whose engine never serves a prefix from cache gets
/// at most three requests of it in a row (the one that recorded it, then two short).
pub const DISBELIEVE_AFTER: u8 = 2;

/// The doubt slots of a tree's nodes.
#[derive(Debug, Clone, Default)]
pub(super) struct Doubts {
    /// Slot `i` is `Node::doubt == i + 1`: (worker, short answers in a row) pairs.
    slots: Vec<Vec<(WorkerId, u8)>>,
    /// Free slot indices.
    free: Vec<u32>,
    /// Pairs at [`DISBELIEVE_AFTER`] or more.
    disbelieved: usize,
    /// Pairs at all.
    pairs: usize,
}

impl Doubts {
    /// Whether any worker is disbelieved anywhere (walks look at slots only then).
    pub(super) fn any_disbelieved(&self) -> bool {
        self.disbelieved > 0
    }

    /// Whether no worker has a doubt anywhere.
    pub(super) fn is_empty(&self) -> bool {
        self.pairs == 0
    }

    /// The workers disbelieved at the node whose `doubt` is `slot`.
    pub(super) fn disbelieved_at(&self, slot: u32) -> impl Iterator<Item = WorkerId> + '_ {
        self.pairs_at(slot)
            .iter()
            .filter(|(_, n)| *n >= DISBELIEVE_AFTER)
            .map(|(w, _)| *w)
    }

    fn pairs_at(&self, slot: u32) -> &[(WorkerId, u8)] {
        slot.checked_sub(1)
            .and_then(|i| self.slots.get(i as usize))
            .map_or(&[], Vec::as_slice)
    }

    /// One more short answer of `w` at the node whose `doubt` is `*slot` (given a slot
    /// when it has none); returns whether `w`'s count there moved, and whether it
    /// reached [`DISBELIEVE_AFTER`] now.
    fn count(&mut self, slot: &mut u32, w: WorkerId) -> (bool, bool) {
        if *slot == 0 {
            let i = match self.free.pop() {
                Some(i) => i,
                None => {
                    self.slots.push(Vec::new());
                    (self.slots.len() - 1) as u32
                }
            };
            *slot = i + 1;
        }
        let pairs = &mut self.slots[(*slot - 1) as usize];
        let n = match pairs.iter_mut().find(|(x, _)| *x == w) {
            Some((_, n)) => n,
            None => {
                self.pairs += 1;
                pairs.push((w, 0));
                &mut pairs.last_mut().expect("just pushed").1
            }
        };
        if *n >= DISBELIEVE_AFTER {
            return (false, false);
        }
        *n += 1;
        let now = *n == DISBELIEVE_AFTER;
        if now {
            self.disbelieved += 1;
        }
        (true, now)
    }

    /// Forgets `w`'s count at `*slot` unless it is disbelieved there (`all`: even
    /// then); frees the slot when nothing is left in it. Returns whether it forgot one.
    fn forget(&mut self, slot: &mut u32, w: WorkerId, all: bool) -> bool {
        let Some(pairs) = slot
            .checked_sub(1)
            .and_then(|i| self.slots.get_mut(i as usize))
        else {
            return false;
        };
        let before = pairs.len();
        let mut gone_disbelieved = 0;
        pairs.retain(|&(x, n)| {
            let keep = x != w || (n >= DISBELIEVE_AFTER && !all);
            if !keep && n >= DISBELIEVE_AFTER {
                gone_disbelieved += 1;
            }
            keep
        });
        let gone = before - pairs.len();
        self.pairs -= gone;
        self.disbelieved -= gone_disbelieved;
        if pairs.is_empty() {
            self.release(slot);
        }
        gone > 0
    }

    /// Frees `*slot` and everything in it (its node goes).
    pub(super) fn release(&mut self, slot: &mut u32) {
        let Some(i) = slot.checked_sub(1) else {
            return;
        };
        if let Some(pairs) = self.slots.get_mut(i as usize) {
            self.pairs -= pairs.len();
            self.disbelieved -= pairs.iter().filter(|(_, n)| *n >= DISBELIEVE_AFTER).count();
            pairs.clear();
            self.free.push(i);
        }
        *slot = 0;
    }

    /// Forgets `w` at `*slot` (it no longer holds the node).
    pub(super) fn forget_worker(&mut self, slot: &mut u32, w: WorkerId) {
        if *slot != 0 {
            self.forget(slot, w, true);
        }
    }
}

/// What an answer did to a record ([`RadixTree::answered`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing changed (not evidence, the mark no longer names the record, or the
    /// worker is already disbelieved there).
    Nothing,
    /// A doubt was counted, or counts cleared.
    Counted,
    /// This answer made the worker disbelieved at a record.
    Disbelieved,
}

impl RadixTree {
    /// An answer from `worker` to a pick marked `mark` ([`Mark`], evidence only: see
    /// `policy::select::eviction_evidence`): `short` when it served far fewer tokens
    /// from cache than predicted, `missed` the byte of routing text that ends the first
    /// engine block it did not serve (delivered bytes + a block's bytes − 1, at the
    /// worker's tokens per byte; the match's last byte when past it). A short one counts
    /// a doubt at the node holding that byte; one that delivered clears the worker's
    /// counts on the path. See the module docs.
    pub fn answered(
        &mut self,
        worker: WorkerId,
        mark: &Mark,
        short: bool,
        missed: usize,
    ) -> Verdict {
        if mark.node == ROOT || (!short && self.doubts.is_empty()) {
            return Verdict::Nothing;
        }
        let Some(path) = self.path_of(mark) else {
            return Verdict::Nothing;
        };
        if !short {
            let mut any = false;
            for (n, _) in path {
                let mut slot = self.nodes[n as usize].doubt;
                if slot != 0 {
                    any |= self.doubts.forget(&mut slot, worker, false);
                    self.nodes[n as usize].doubt = slot;
                }
            }
            return if any {
                Verdict::Counted
            } else {
                Verdict::Nothing
            };
        }
        let at = missed.min((mark.bytes as usize).saturating_sub(1));
        // The node holding byte `at`: the path runs from the end up, with each node's
        // start.
        let Some(&(d, _)) = path.iter().find(|(_, start)| *start <= at) else {
            return Verdict::Nothing;
        };
        let node = &mut self.nodes[d as usize];
        if !node.workers.contains(worker) {
            return Verdict::Nothing;
        }
        let mut slot = node.doubt;
        let (moved, now) = self.doubts.count(&mut slot, worker);
        self.nodes[d as usize].doubt = slot;
        match (moved, now) {
            (_, true) => Verdict::Disbelieved,
            (true, false) => Verdict::Counted,
            (false, _) => Verdict::Nothing,
        }
    }

    /// The path from `mark`'s end node up to the root's child, each node with the
    /// byte offset where its edge starts; `None` when the node is no longer the one
    /// marked (freed, or a slot reused at another depth). The node may have been split
    /// since (by the request's own record): it keeps its end, so the path is still
    /// right, and the match's end lies in it or above.
    fn path_of(&self, mark: &Mark) -> Option<Vec<(NodeIdx, usize)>> {
        let mut ends = Vec::new();
        let mut n = mark.node;
        let mut depth = 0usize;
        while n != ROOT {
            let node = self.nodes.get(n as usize)?;
            if node.edge.is_empty() {
                return None;
            }
            ends.push((n, node.edge.len()));
            depth += node.edge.len();
            n = node.parent;
            if ends.len() > self.nodes.len() {
                return None;
            }
        }
        if depth != mark.end as usize || mark.bytes > mark.end {
            return None;
        }
        let mut end = depth;
        Some(
            ends.into_iter()
                .map(|(n, len)| {
                    end -= len;
                    (n, end)
                })
                .collect(),
        )
    }

    /// The workers disbelieved at node `n`, added to `into`.
    pub(super) fn add_disbelieved(&self, n: &super::Node, into: &mut WorkerMask) {
        if n.doubt != 0 {
            for w in self.doubts.disbelieved_at(n.doubt) {
                into.insert(w);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: WorkerId = WorkerId(0);
    const B: WorkerId = WorkerId(1);

    fn all() -> WorkerMask {
        [A, B].into_iter().collect()
    }

    /// Worker `w`'s match of `text`, alone.
    fn own(t: &RadixTree, text: &[u8], w: WorkerId) -> usize {
        t.longest_prefix(text, &[w].into_iter().collect()).matched
    }

    const HEAD: &[u8] = b"system: you are a careful assistant who cites the manual.\n";

    fn prompt(tag: &str) -> Vec<u8> {
        [HEAD, format!("user: {tag} ").repeat(20).as_bytes()].concat()
    }

    #[test]
    fn two_short_answers_in_a_row_on_a_record_disbelieve_that_worker_there() {
        let mut t = RadixTree::new();
        let p = prompt("summarise chapter one");
        t.insert(&p, A);
        let mark = t.lookup(&p, &all()).mark;
        assert!(mark.is_some());
        // Nothing served from cache: the first block's last byte (63) is in the head.
        assert_eq!(t.answered(A, &mark, true, 63), Verdict::Counted);
        assert_eq!(own(&t, &p, A), p.len(), "one short answer: still believed");
        assert_eq!(t.answered(A, &mark, true, 63), Verdict::Disbelieved);
        let l = t.lookup(&p, &all());
        assert_eq!(l.found.matched, 0);
        assert!(l.disbelieved.contains(A));
        // Another worker's record of the same prompt is believed, the first's not.
        t.insert(&p, B);
        let l = t.lookup(&p, &all());
        assert_eq!(
            (l.found.matched, l.found.workers),
            (p.len(), [B].into_iter().collect())
        );
        assert_eq!(own(&t, &p, A), 0);
        let mut per = Vec::new();
        let out = t.prefix_per_worker(&p, &all(), |w, n, _| per.push((w, n)));
        assert_eq!((per, out.contains(A)), (vec![(B, p.len())], true));
        // Further answers change nothing; a delivering one does not lift a disbelief.
        assert_eq!(t.answered(A, &mark, true, 63), Verdict::Nothing);
        t.answered(A, &mark, false, 0);
        assert_eq!(own(&t, &p, A), 0);
    }

    #[test]
    fn a_delivering_answer_clears_the_count_and_the_shared_head_is_not_blamed() {
        let mut t = RadixTree::new();
        let (p, q) = (prompt("chapter one"), prompt("chapter two"));
        t.insert(&p, A);
        t.insert(&q, A);
        t.insert(&q, B);
        let mark = t.lookup(&p, &[A].into_iter().collect()).mark;
        // The head was served, the block after it was not: that block ends in p's own
        // node, below what both prompts share (the head and `user: chapter `).
        let missed = HEAD.len() + 20;
        assert_eq!(t.answered(A, &mark, true, missed), Verdict::Counted);
        assert_eq!(t.answered(A, &mark, false, 0), Verdict::Counted, "cleared");
        assert_eq!(t.answered(A, &mark, true, missed), Verdict::Counted);
        assert_eq!(t.answered(A, &mark, true, missed), Verdict::Disbelieved);
        assert_eq!(own(&t, &p, A), HEAD.len() + 14, "the shared head stays");
        assert_eq!(
            own(&t, &q, A),
            q.len(),
            "the other prompt under the head stays"
        );
        // Nothing left to clear: a delivering answer takes no lock's worth of work.
        assert_eq!(t.answered(B, &mark, false, 0), Verdict::Nothing);
    }

    #[test]
    fn a_split_record_is_still_found_and_a_gone_one_says_nothing() {
        let mut t = RadixTree::new();
        let p = prompt("chapter one");
        t.insert(&p, A);
        let mark = t.lookup(&p, &all()).mark;
        // Another prompt splits the record's node: the mark's node keeps its end.
        t.insert(&p[..p.len() - 40], B);
        assert_eq!(t.answered(A, &mark, true, p.len() - 1), Verdict::Counted);
        assert_eq!(
            t.answered(A, &mark, true, p.len() - 1),
            Verdict::Disbelieved
        );
        assert_eq!(own(&t, &p, A), p.len() - 40, "disbelieved in the tail only");
        // The worker goes: its doubts with it, and the node's slot is free.
        t.remove_worker(A);
        assert!(t.doubts.is_empty() && !t.doubts.any_disbelieved());
        t.insert(&p, A);
        assert_eq!(own(&t, &p, A), p.len(), "back, believed");
        // A mark of no node, or of a slot now at another depth, is no evidence.
        assert_eq!(t.answered(A, &Mark::default(), true, 0), Verdict::Nothing);
        let other = Mark {
            end: mark.end + 1,
            ..mark
        };
        assert_eq!(t.answered(A, &other, true, 0), Verdict::Nothing);
    }
}
