//! The tree's recency list: every live node in one doubly linked list through the
//! arena (`Node::lru_newer` / `lru_older`), most recently used first, the root the
//! list's sentinel. An insert puts its path at the front in path order, so a node is
//! always nearer the front than each of its descendants; the last node is therefore
//! always a leaf, and the least recently used one (stamps never increase along the
//! list). Eviction takes leaves from the back one at a time: O(1) each, with no scan
//! of the arena and no sort ([`RadixTree::evict_oldest`]).

use super::{Freed, NodeIdx, ROOT, RadixTree};

/// Not in the list (a free or detached slot).
pub(super) const NONE: NodeIdx = NodeIdx::MAX;

/// The root: the list's sentinel, alone in an empty tree.
pub(super) fn root() -> super::Node {
    super::Node {
        lru_newer: ROOT,
        lru_older: ROOT,
        ..super::Node::empty()
    }
}

impl RadixTree {
    /// Takes `n` out of the list (nothing when it is not in it).
    pub(super) fn lru_remove(&mut self, n: NodeIdx) {
        let node = &mut self.nodes[n as usize];
        let (newer, older) = (node.lru_newer, node.lru_older);
        if newer == NONE || n == ROOT {
            return;
        }
        node.lru_newer = NONE;
        node.lru_older = NONE;
        self.nodes[newer as usize].lru_older = older;
        self.nodes[older as usize].lru_newer = newer;
    }

    /// Puts `n` right behind `at` (at the front when `at` is the root).
    pub(super) fn lru_after(&mut self, at: NodeIdx, n: NodeIdx) {
        if self.nodes[at as usize].lru_older == n {
            return;
        }
        self.lru_remove(n);
        let older = self.nodes[at as usize].lru_older;
        let node = &mut self.nodes[n as usize];
        node.lru_newer = at;
        node.lru_older = older;
        self.nodes[at as usize].lru_older = n;
        self.nodes[older as usize].lru_newer = n;
    }

    /// Evicts least recently used leaves, one at a time from the back of the list,
    /// while the tree holds more than `max_nodes` nodes or `max_bytes` bytes, at most
    /// `budget` of them; what they held goes to `freed` (to drop with the lock
    /// released). A parent left childless is a leaf from then on and goes when its
    /// turn comes. Returns the nodes removed: O(1) work each.
    pub fn evict_oldest(
        &mut self,
        max_nodes: usize,
        max_bytes: u64,
        budget: usize,
        freed: &mut Freed,
    ) -> usize {
        let mut removed = 0;
        while removed < budget && (self.node_count() > max_nodes || self.total_bytes > max_bytes) {
            // The list is a ring through the root: behind the last node comes the root.
            let last = self.nodes[ROOT as usize].lru_newer;
            if last == ROOT {
                break;
            }
            // Always a leaf (see the module docs); `release` takes a subtree anyway.
            self.unlink(last);
            self.release(last, freed);
            removed += 1;
        }
        removed
    }

    /// The list from the front, for tests: `(node, stamp, parent)`.
    #[cfg(test)]
    pub(super) fn lru_order(&self) -> Vec<(NodeIdx, u64, NodeIdx)> {
        let mut out = Vec::new();
        let mut n = self.nodes[ROOT as usize].lru_older;
        while n != ROOT && out.len() <= self.nodes.len() {
            let node = &self.nodes[n as usize];
            out.push((n, node.last_access, node.parent));
            n = node.lru_older;
        }
        out
    }
}
