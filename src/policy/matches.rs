//! [`Matches`]: each worker's matched prefix for one request, on the stack for the usual
//! fleet size.

use crate::pool::WorkerId;

/// Workers whose matches are kept on the stack; more spill to the heap.
const INLINE: usize = 64;

/// Matched bytes per worker id (0 for a worker never set), inline for the first
/// [`INLINE`] ids.
pub struct Matches {
    inline: [usize; INLINE],
    spill: Vec<(WorkerId, usize)>,
}

impl Matches {
    pub fn new() -> Self {
        Matches {
            inline: [0; INLINE],
            spill: Vec::new(),
        }
    }

    pub fn set(&mut self, w: WorkerId, n: usize) {
        match self.inline.get_mut(w.0 as usize) {
            Some(slot) => *slot = n,
            None => match self.spill.iter_mut().find(|(id, _)| *id == w) {
                Some((_, m)) => *m = n,
                None => self.spill.push((w, n)),
            },
        }
    }

    /// The longest match of any worker.
    pub fn longest(&self) -> usize {
        let spill = self.spill.iter().map(|(_, n)| *n);
        self.inline.iter().copied().chain(spill).max().unwrap_or(0)
    }

    pub fn get(&self, w: WorkerId) -> usize {
        match self.inline.get(w.0 as usize) {
            Some(n) => *n,
            None => self
                .spill
                .iter()
                .find(|(id, _)| *id == w)
                .map_or(0, |(_, n)| *n),
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
        m.set(WorkerId(3), 10);
        m.set(WorkerId(300), 40);
        m.set(WorkerId(300), 20); // set again: replaced, not added
        assert_eq!((m.get(WorkerId(3)), m.get(WorkerId(300))), (10, 20));
        assert_eq!((m.longest(), m.spill.len()), (20, 1));
    }
}
