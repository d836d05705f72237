//! [`Matches`]: each worker's matched prefix for one request, on the stack for the usual
//! fleet size.

use crate::pools::pool::WorkerId;

/// Workers whose matches are kept on the stack; more spill to the heap.
const INLINE: usize = 64;

/// Matched bytes per worker id (0 for a worker never set), with the tree's last-use
/// stamp of each match (`tree::PrefixMatch::stamp`; 0 for another replica's record),
/// inline for the first [`INLINE`] ids.
pub struct Matches {
    inline: [(usize, u64); INLINE],
    spill: Vec<(WorkerId, usize, u64)>,
}

impl Matches {
    pub fn new() -> Self {
        Matches {
            inline: [(0, 0); INLINE],
            spill: Vec::new(),
        }
    }

    /// `w` matched `n` bytes, last used at tree stamp `stamp`.
    pub fn set(&mut self, w: WorkerId, n: usize, stamp: u64) {
        match self.inline.get_mut(w.0 as usize) {
            Some(slot) => *slot = (n, stamp),
            None => match self.spill.iter_mut().find(|(id, _, _)| *id == w) {
                Some((_, m, s)) => (*m, *s) = (n, stamp),
                None => self.spill.push((w, n, stamp)),
            },
        }
    }

    /// The longest match of any worker.
    pub fn longest(&self) -> usize {
        let spill = self.spill.iter().map(|(_, n, _)| *n);
        self.inline
            .iter()
            .map(|(n, _)| *n)
            .chain(spill)
            .max()
            .unwrap_or(0)
    }

    pub fn get(&self, w: WorkerId) -> usize {
        self.entry(w).0
    }

    /// The last-use stamp of `w`'s match (0 when none, or another replica's).
    pub fn stamp(&self, w: WorkerId) -> u64 {
        self.entry(w).1
    }

    fn entry(&self, w: WorkerId) -> (usize, u64) {
        match self.inline.get(w.0 as usize) {
            Some(e) => *e,
            None => self
                .spill
                .iter()
                .find(|(id, _, _)| *id == w)
                .map_or((0, 0), |(_, n, s)| (*n, *s)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_and_spilled_ids() {
        let mut m = Matches::new();
        assert_eq!((m.get(WorkerId(3)), m.longest()), (0, 0));
        m.set(WorkerId(3), 10, 7);
        m.set(WorkerId(300), 40, 1);
        m.set(WorkerId(300), 20, 2); // set again: replaced, not added
        assert_eq!((m.get(WorkerId(3)), m.get(WorkerId(300))), (10, 20));
        assert_eq!((m.stamp(WorkerId(3)), m.stamp(WorkerId(300))), (7, 2));
        assert_eq!((m.longest(), m.spill.len()), (20, 1));
    }
}
