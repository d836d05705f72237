//! `power_of_two`: two distinct usable workers drawn at random, the less loaded of the
//! two (Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing", 2001):
//! nearly the balance of least-load without every router herding onto the same
//! least-loaded worker.

use rand::{Rng, RngCore};

use super::{Candidate, Pick, Policy, RouteRequest};
use crate::pools::pool::{PoolListener, WorkerSet};

/// See the module docs.
pub struct PowerOfTwo;

/// The less loaded of two distinct random usable workers (the one usable worker when
/// there is one; ties go to the first drawn).
pub fn pick_power_of_two(candidates: &[Candidate], text_len: usize, rng: &mut dyn RngCore) -> Pick {
    let n = candidates.iter().filter(|c| c.usable).count();
    let nth = |i: usize| candidates.iter().filter(|c| c.usable).nth(i);
    let w = match n {
        0 => None,
        1 => nth(0),
        _ => {
            let a = rng.random_range(0..n);
            let b = (a + rng.random_range(1..n)) % n;
            match (nth(a), nth(b)) {
                (Some(x), Some(y)) if y.load < x.load => Some(y),
                (x, _) => x,
            }
        }
    };
    Pick::load_only(w.map(|c| c.id), text_len)
}

/// Keeps no per-worker state.
impl PoolListener for PowerOfTwo {}

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }

    fn pick(
        &self,
        req: &RouteRequest<'_>,
        _: &WorkerSet,
        candidates: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Pick {
        pick_power_of_two(candidates, req.text().len(), rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Reason;
    use crate::policy::fixtures::cands;
    use rand::SeedableRng;

    #[test]
    fn the_less_loaded_of_two_and_never_the_busiest() {
        let mut r = rand::rngs::StdRng::seed_from_u64(3);
        let c = cands(&[9, 1, 5, 3]);
        let mut seen = [0; 4];
        for _ in 0..2000 {
            seen[pick_power_of_two(&c, 0, &mut r).worker.unwrap().0 as usize] += 1;
        }
        assert_eq!(
            seen[0], 0,
            "the busiest of four never wins a pair: {seen:?}"
        );
        assert!(seen[1] > seen[3] && seen[3] > seen[2], "{seen:?}");
        // Worker 1 (least) wins every pair it is in: drawn in 1/2 of pairs.
        assert!((900..1100).contains(&seen[1]), "{seen:?}");
    }

    #[test]
    fn one_or_no_usable_worker() {
        let mut r = rand::rngs::StdRng::seed_from_u64(3);
        let mut c = cands(&[0, 0]);
        c[0].usable = false;
        assert_eq!(pick_power_of_two(&c, 0, &mut r).worker.unwrap().0, 1);
        c[1].usable = false;
        assert_eq!(pick_power_of_two(&c, 0, &mut r).reason, Reason::NoWorker);
    }
}
