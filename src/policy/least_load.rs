//! `least_load`: the usable worker with the fewest requests in flight (+ its
//! `load_penalty`), ties broken stably (a baseline).

use rand::RngCore;

use super::select::{least_loaded, usable};
use super::{Candidate, Pick, Policy, RouteRequest};
use crate::pools::pool::{PoolListener, WorkerSet};

/// See the module docs.
pub struct LeastLoad;

/// Keeps no per-worker state.
impl PoolListener for LeastLoad {}

impl Policy for LeastLoad {
    fn name(&self) -> &'static str {
        "least_load"
    }

    fn pick(
        &self,
        req: &RouteRequest<'_>,
        _: &WorkerSet,
        candidates: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Pick {
        let w = least_loaded(usable(candidates), req.tie, rng).map(|c| c.id);
        Pick::load_only(w, req.text().len())
    }
}
