//! [`WorkerMask`]: a set of [`WorkerId`]s, one bit each.

use super::WorkerId;

/// A set of workers. Ids below 64 live inline (no allocation: the common fleet size);
/// larger ids spill into a boxed bit vector.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerMask {
    low: u64,
    high: Option<Box<[u64]>>,
}

impl WorkerMask {
    /// Adds `w`; returns whether it was absent.
    pub fn insert(&mut self, w: WorkerId) -> bool {
        let (word, bit) = split(w);
        let slot = if word == 0 {
            &mut self.low
        } else {
            let high = self.high.get_or_insert_with(|| vec![0; word].into());
            if high.len() < word {
                let mut grown = vec![0; word];
                grown[..high.len()].copy_from_slice(high);
                *high = grown.into();
            }
            &mut high[word - 1]
        };
        let absent = *slot & bit == 0;
        *slot |= bit;
        absent
    }

    /// Removes `w`; returns whether it was present.
    pub fn remove(&mut self, w: WorkerId) -> bool {
        let (word, bit) = split(w);
        let slot = if word == 0 {
            &mut self.low
        } else {
            match self.high.as_mut().and_then(|h| h.get_mut(word - 1)) {
                Some(s) => s,
                None => return false,
            }
        };
        let present = *slot & bit != 0;
        *slot &= !bit;
        if present
            && word > 0
            && self
                .high
                .as_ref()
                .is_some_and(|h| h.iter().all(|x| *x == 0))
        {
            self.high = None;
        }
        present
    }

    /// Whether `w` is in the set.
    pub fn contains(&self, w: WorkerId) -> bool {
        let (word, bit) = split(w);
        let v = if word == 0 {
            self.low
        } else {
            self.high
                .as_ref()
                .and_then(|h| h.get(word - 1))
                .copied()
                .unwrap_or(0)
        };
        v & bit != 0
    }

    pub fn is_empty(&self) -> bool {
        self.low == 0 && self.high.is_none()
    }

    /// Whether the set holds exactly one worker (no allocation).
    pub fn is_single(&self) -> bool {
        let high = self.high.iter().flat_map(|h| h.iter());
        std::iter::once(&self.low)
            .chain(high)
            .map(|w| w.count_ones())
            .sum::<u32>()
            == 1
    }

    /// Whether the two sets share a worker (no allocation).
    pub fn intersects(&self, other: &WorkerMask) -> bool {
        if self.low & other.low != 0 {
            return true;
        }
        match (&self.high, &other.high) {
            (Some(a), Some(b)) => a.iter().zip(b.iter()).any(|(x, y)| x & y != 0),
            _ => false,
        }
    }

    /// The workers in both sets.
    pub fn intersection(&self, other: &WorkerMask) -> WorkerMask {
        let high = match (&self.high, &other.high) {
            (Some(a), Some(b)) => {
                let v: Box<[u64]> = a.iter().zip(b.iter()).map(|(x, y)| x & y).collect();
                v.iter().any(|x| *x != 0).then_some(v)
            }
            _ => None,
        };
        WorkerMask {
            low: self.low & other.low,
            high,
        }
    }

    /// The workers in this set and not in `other`.
    pub fn difference(&self, other: &WorkerMask) -> WorkerMask {
        let mut out = self.clone();
        out.low &= !other.low;
        if other.high.is_some() {
            for w in other.iter().filter(|w| w.0 >= 64) {
                out.remove(w);
            }
        }
        out
    }

    /// The workers in either set.
    pub fn union(&self, other: &WorkerMask) -> WorkerMask {
        let mut out = self.clone();
        for w in other.iter() {
            out.insert(w);
        }
        out
    }

    /// The members in increasing id order.
    pub fn iter(&self) -> impl Iterator<Item = WorkerId> + '_ {
        std::iter::once(self.low)
            .chain(self.high.iter().flat_map(|h| h.iter().copied()))
            .enumerate()
            .flat_map(|(word, mut bits)| {
                std::iter::from_fn(move || {
                    if bits == 0 {
                        return None;
                    }
                    let b = bits.trailing_zeros();
                    bits &= bits - 1;
                    Some(WorkerId(word as u32 * 64 + b))
                })
            })
    }
}

impl FromIterator<WorkerId> for WorkerMask {
    /// The same set as inserting each id, built with one growing buffer ([`MaskBuilder`]).
    fn from_iter<I: IntoIterator<Item = WorkerId>>(iter: I) -> Self {
        let mut b = MaskBuilder::default();
        for w in iter {
            b.insert(w);
        }
        b.build()
    }
}

/// Builds a [`WorkerMask`] an id at a time in one growing buffer: inserting a pool's ids
/// in order into a mask reallocated its boxed words once per 64 workers (15 times a
/// mask at 1,000 workers, the top cost of a decision there).
#[derive(Debug, Default)]
pub struct MaskBuilder {
    low: u64,
    high: Vec<u64>,
}

impl MaskBuilder {
    /// A builder with room for ids below `n` without growing (larger ids still fit).
    pub fn for_ids(n: usize) -> Self {
        MaskBuilder {
            low: 0,
            high: vec![0; n.saturating_sub(1) / 64],
        }
    }

    /// Adds `w`.
    #[inline]
    pub fn insert(&mut self, w: WorkerId) {
        self.insert_if(w, true);
    }

    /// Adds `w` when `yes`, without a branch on `yes`: a pass that sorts a whole pool's
    /// ids into masks costs a few instructions per id.
    #[inline]
    pub fn insert_if(&mut self, w: WorkerId, yes: bool) {
        let (word, bit) = split(w);
        let bit = bit * u64::from(yes);
        if word == 0 {
            self.low |= bit;
        } else if let Some(slot) = self.high.get_mut(word - 1) {
            *slot |= bit;
        } else if yes {
            self.high.resize(word, 0);
            self.high[word - 1] = bit;
        }
    }

    /// Adds the ids of mask word `word` (ids `64 * word ..`) whose bits are set in
    /// `bits`: a pass that gathers a word's bits in a register stores each word once,
    /// where [`MaskBuilder::insert_if`] reads and writes it in memory for every id.
    #[inline]
    pub fn or_word(&mut self, word: usize, bits: u64) {
        if word == 0 {
            self.low |= bits;
        } else if let Some(slot) = self.high.get_mut(word - 1) {
            *slot |= bits;
        } else if bits != 0 {
            self.high.resize(word, 0);
            self.high[word - 1] = bits;
        }
    }

    /// The mask (trailing zero words dropped, as [`WorkerMask::insert`] leaves none).
    pub fn build(mut self) -> WorkerMask {
        while self.high.last() == Some(&0) {
            self.high.pop();
        }
        WorkerMask {
            low: self.low,
            high: (!self.high.is_empty()).then(|| self.high.into_boxed_slice()),
        }
    }
}

fn split(w: WorkerId) -> (usize, u64) {
    ((w.0 / 64) as usize, 1u64 << (w.0 % 64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_single_member_is_told_on_either_side_of_the_inline_boundary() {
        let one = |ids: &[u32]| ids.iter().map(|&i| WorkerId(i)).collect::<WorkerMask>();
        assert!(!one(&[]).is_single());
        assert!(one(&[5]).is_single());
        assert!(one(&[130]).is_single());
        assert!(!one(&[5, 130]).is_single());
        assert!(!one(&[5, 6]).is_single());
        let mut m = one(&[5, 130]);
        m.remove(WorkerId(5));
        assert!(m.is_single());
    }

    #[test]
    fn set_operations_across_the_inline_boundary() {
        let mut a: WorkerMask = [WorkerId(1), WorkerId(63), WorkerId(64), WorkerId(200)]
            .into_iter()
            .collect();
        assert!(a.contains(WorkerId(200)) && !a.contains(WorkerId(199)));
        assert!(!a.insert(WorkerId(64)));
        let b: WorkerMask = [WorkerId(200), WorkerId(5)].into_iter().collect();
        assert!(a.intersects(&b));
        assert_eq!(
            a.intersection(&b).iter().collect::<Vec<_>>(),
            vec![WorkerId(200)]
        );
        assert_eq!(
            a.iter().collect::<Vec<_>>(),
            vec![WorkerId(1), WorkerId(63), WorkerId(64), WorkerId(200)]
        );
        for w in [1, 63, 64, 200] {
            assert!(a.remove(WorkerId(w)));
        }
        assert!(a.is_empty(), "{a:?}");
        assert!(!a.remove(WorkerId(500)));
        let only_low: WorkerMask = [WorkerId(3)].into_iter().collect();
        assert!(!only_low.intersects(&b));
        assert!(only_low.intersection(&b).is_empty());
    }

    #[test]
    fn collecting_equals_inserting_one_by_one() {
        for ids in [
            vec![],
            vec![3],
            vec![999, 0, 64, 63, 500],
            (0..1000).collect(),
        ] {
            let collected: WorkerMask = ids.iter().map(|&i| WorkerId(i)).collect();
            let mut inserted = WorkerMask::default();
            for &i in &ids {
                inserted.insert(WorkerId(i));
            }
            assert_eq!(collected, inserted, "{ids:?}");
        }
    }

    #[test]
    fn words_or_ids_build_the_same_masks() {
        for (room, ids) in [
            (0, vec![]),
            (1000, vec![3, 64, 999]),
            (10, (0..300).step_by(7).collect::<Vec<u32>>()),
            (64, vec![640, 5, 63]),
        ] {
            let expected: WorkerMask = ids.iter().map(|&i| WorkerId(i)).collect();
            let mut b = MaskBuilder::for_ids(room);
            for &i in &ids {
                b.or_word(i as usize / 64, 1 << (i % 64));
            }
            b.or_word(20, 0);
            assert_eq!(b.build(), expected, "room {room}, {ids:?}");
        }
    }

    #[test]
    fn a_presized_builder_builds_the_same_masks() {
        for (room, ids) in [
            (0, vec![]),
            (1000, vec![]),
            (1000, vec![3]),
            (64, vec![999, 0, 64, 63, 500]),
            (1000, (0..1000).collect()),
            (10, (0..300).step_by(7).collect()),
        ] {
            let expected: WorkerMask = ids.iter().map(|&i| WorkerId(i)).collect();
            let mut b = MaskBuilder::for_ids(room);
            for i in 0..1100 {
                b.insert_if(WorkerId(i), ids.contains(&i));
            }
            assert_eq!(b.build(), expected, "room {room}, {ids:?}");
        }
    }
}
