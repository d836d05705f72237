//! `lmcache_aware`: prefer the worker whose LMCache has the most room.
//!
//! Each usable worker scores `1 − occupancy` when its last LMCache signal
//! (`workers[].lmcache`, polled by `signals::lmcache`) is fresh and says
//! `cache_available`, and 0 when it says the cache is unavailable. A worker without a
//! fresh signal (never polled, failed, malformed or stale) is neutral: it scores 0 too,
//! so when no worker has a usable signal every score ties and least-load decides. The
//! best-scoring worker is taken unless it is overloaded against the least-loaded one by
//! `cache.balance_*` (the guard of `cache_aware`, [`is_overloaded`]): a signal refreshed
//! every `refresh_secs` must not pull every request onto one worker in between.
//!
//! Reasons: [`Reason::CacheSignal`] when the signal chose, [`Reason::Miss`] when load did
//! (no fresh signal, or the best one overloaded).

use std::sync::atomic::Ordering;

use rand::RngCore;

use super::select::{CacheParams, is_overloaded, least_loaded, usable};
use super::{Candidate, Pick, Policy, Reason, RouteRequest};
use crate::config::CacheConfig;
use crate::pools::pool::{PoolListener, WorkerSet};

/// The `lmcache_aware` policy: stateless besides the guard's thresholds.
pub struct LmcacheAware {
    params: CacheParams,
}

impl LmcacheAware {
    pub fn new(cache: &CacheConfig) -> Self {
        LmcacheAware {
            params: CacheParams::from(cache),
        }
    }
}

impl PoolListener for LmcacheAware {}

/// A worker's score at `now` (see the module docs); `None` when neutral.
pub fn score(set: &WorkerSet, c: &Candidate, now: std::time::Instant) -> Option<f64> {
    let w = set.get(c.id)?;
    let stale = w.config().lmcache.as_ref()?.stale;
    let s = w.signals().lmcache_fresh(now, stale);
    if s.is_none() {
        w.signals().neutral_reads.fetch_add(1, Ordering::Relaxed);
    }
    let s = s?;
    Some(if s.cache_available {
        1.0 - s.occupancy
    } else {
        0.0
    })
}

impl Policy for LmcacheAware {
    fn name(&self) -> &'static str {
        "lmcache_aware"
    }

    fn pick(
        &self,
        req: &RouteRequest<'_>,
        set: &WorkerSet,
        candidates: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Pick {
        let text_len = req.text().len();
        let Some(least) = least_loaded(usable(candidates), req.tie, rng) else {
            return Pick::load_only(None, text_len);
        };
        let now = crate::clock::now();
        let scores: Vec<(Candidate, f64)> = usable(candidates)
            .map(|c| (*c, score(set, c, now).unwrap_or(0.0)))
            .collect();
        let top = scores.iter().map(|(_, s)| *s).fold(0.0, f64::max);
        if top <= 0.0 {
            return Pick::load_only(Some(least.id), text_len);
        }
        let best = least_loaded(
            scores
                .iter()
                .filter(|(_, s)| *s >= top - 1e-9)
                .map(|(c, _)| c),
            req.tie,
            rng,
        )
        .copied()
        .unwrap_or(*least);
        let (worker, reason) = if is_overloaded(&self.params, best.load, least.load) {
            (least.id, Reason::Miss)
        } else {
            (best.id, Reason::CacheSignal)
        };
        Pick {
            reason,
            ..Pick::load_only(Some(worker), text_len)
        }
    }
}
