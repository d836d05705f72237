//! `random`: a uniformly random usable worker (a baseline).

use rand::{Rng, RngCore};

use super::{Candidate, Pick, Policy, RouteRequest};
use crate::pools::pool::{PoolListener, WorkerSet};

/// See the module docs.
pub struct Random;

/// A uniformly random usable worker.
pub fn pick_random(candidates: &[Candidate], text_len: usize, rng: &mut dyn RngCore) -> Pick {
    let usable = candidates.iter().filter(|c| c.usable).count();
    let w = (usable > 0)
        .then(|| {
            candidates
                .iter()
                .filter(|c| c.usable)
                .nth(rng.random_range(0..usable))
        })
        .flatten()
        .map(|c| c.id);
    Pick::load_only(w, text_len)
}

/// Keeps no per-worker state.
impl PoolListener for Random {}

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn pick(
        &self,
        req: &RouteRequest<'_>,
        _: &WorkerSet,
        candidates: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Pick {
        pick_random(candidates, req.text().len(), rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Reason;
    use crate::policy::fixtures::cands;
    use rand::SeedableRng;

    #[test]
    fn only_usable_workers_and_all_of_them() {
        let mut c = cands(&[5, 0, 3]);
        c[1].usable = false;
        let mut r = rand::rngs::StdRng::seed_from_u64(1);
        let mut seen = [0; 3];
        for _ in 0..300 {
            seen[pick_random(&c, 0, &mut r).worker.unwrap().0 as usize] += 1;
        }
        assert_eq!(seen[1], 0);
        assert!(seen[0] > 100 && seen[2] > 100, "{seen:?}");
        c[0].usable = false;
        c[2].usable = false;
        assert_eq!(pick_random(&c, 0, &mut r).reason, Reason::NoWorker);
    }
}
