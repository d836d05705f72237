//! [`Matches`]: each worker's matched prefix for one request, on the stack for the usual
//! fleet size.

use crate::pools::pool::WorkerId;
use crate::tree::Mark;

/// Workers whose matches are kept on the stack; more spill to the heap.
const INLINE: usize = 64;

/// Matched bytes per worker id (0 for a worker never set), with where each match ended
/// in the tree (`tree::Mark`; none for another replica's record), inline for the first
/// [`INLINE`] ids.
pub struct Matches {
    inline: [(usize, Mark); INLINE],
    spill: Vec<(WorkerId, usize, Mark)>,
}

impl Matches {
    pub fn new() -> Self {
        Matches {
            inline: [(0, Mark::default()); INLINE],
            spill: Vec::new(),
        }
    }

    /// `w` matched `n` bytes, ending at `mark`.
    pub fn set(&mut self, w: WorkerId, n: usize, mark: Mark) {
        match self.inline.get_mut(w.0 as usize) {
            Some(slot) => *slot = (n, mark),
            None => match self.spill.iter_mut().find(|(id, _, _)| *id == w) {
                Some((_, m, s)) => (*m, *s) = (n, mark),
                None => self.spill.push((w, n, mark)),
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

    /// Where `w`'s match ended in the tree (none when it has none, or another
    /// replica's).
    pub fn mark(&self, w: WorkerId) -> Mark {
        self.entry(w).1
    }

    fn entry(&self, w: WorkerId) -> (usize, Mark) {
        match self.inline.get(w.0 as usize) {
            Some(e) => *e,
            None => self
                .spill
                .iter()
                .find(|(id, _, _)| *id == w)
                .map_or((0, Mark::default()), |(_, n, s)| (*n, *s)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_and_spilled_ids() {
        let mark = |stamp| Mark {
            stamp,
            ..Mark::default()
        };
        let mut m = Matches::new();
        assert_eq!((m.get(WorkerId(3)), m.longest()), (0, 0));
        m.set(WorkerId(3), 10, mark(7));
        m.set(WorkerId(300), 40, mark(1));
        m.set(WorkerId(300), 20, mark(2)); // set again: replaced, not added
        assert_eq!((m.get(WorkerId(3)), m.get(WorkerId(300))), (10, 20));
        assert_eq!(
            (m.mark(WorkerId(3)).stamp, m.mark(WorkerId(300)).stamp),
            (7, 2)
        );
        assert_eq!((m.longest(), m.spill.len()), (20, 1));
    }
}
