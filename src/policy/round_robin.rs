//! `round_robin`: the usable workers in turn (a baseline).

use rand::RngCore;

use super::{Candidate, Pick, Policy, RouteRequest};
use crate::pools::pool::{PoolListener, WorkerSet};

/// See the module docs. The turn is the worker set's ticket counter.
pub struct RoundRobin;

/// The `ticket`-th usable worker, cycling.
pub fn pick_round_robin(candidates: &[Candidate], text_len: usize, ticket: usize) -> Pick {
    let usable = candidates.iter().filter(|c| c.usable).count();
    let w = (usable > 0)
        .then(|| candidates.iter().filter(|c| c.usable).nth(ticket % usable))
        .flatten()
        .map(|c| c.id);
    Pick::load_only(w, text_len)
}

/// Keeps no per-worker state.
impl PoolListener for RoundRobin {}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn pick(
        &self,
        req: &RouteRequest<'_>,
        set: &WorkerSet,
        candidates: &[Candidate],
        _: &mut dyn RngCore,
    ) -> Pick {
        pick_round_robin(candidates, req.text().len(), set.next_ticket())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Reason;
    use crate::policy::fixtures::cands;

    #[test]
    fn usable_workers_in_turn() {
        let mut c = cands(&[5, 0, 3]);
        let order: Vec<_> = (0..6)
            .map(|t| pick_round_robin(&c, 0, t).worker.unwrap().0)
            .collect();
        assert_eq!(order, [0, 1, 2, 0, 1, 2]);
        c[1].usable = false;
        let order: Vec<_> = (0..4)
            .map(|t| pick_round_robin(&c, 0, t).worker.unwrap().0)
            .collect();
        assert_eq!(order, [0, 2, 0, 2]);
        for x in &mut c {
            x.usable = false;
        }
        assert_eq!(pick_round_robin(&c, 0, 3).reason, Reason::NoWorker);
    }
}
