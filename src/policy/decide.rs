//! The decision every routed request makes, shared by the proxy and `simulate` (one
//! code path, so a simulated run routes as the router does): [`pick_slot`] (the
//! candidates, the policy's pick, the in-flight slot on its worker) and
//! [`settle_usage`] (what a complete answer's engine usage teaches the router).

use std::sync::Arc;

use super::select::is_overloaded;
use super::{AdapterAsk, Candidate, Delivery, Pick, Policy, RouteRequest};
use crate::pools::pool::adapters::Placement;
use crate::pools::pool::{InFlightGuard, Worker, WorkerSet};
use crate::tree::{Mark, WorkerMask};

/// One decision plus the in-flight slot on the chosen worker, as every request makes
/// it (the proxy, and `simulate` with the same policy code): candidates are the set's
/// workers, usable when routable now and not in `tried`; fallback workers only while no
/// primary one is usable, and workers that pushed back only while no other is; for a
/// LoRA adapter request, the workers that hold its adapter first ([`prefer_placement`]).
/// A worker that filled up between the decision and the slot is skipped and the
/// decision re-run. `None` when no worker is usable.
pub fn pick_slot(
    policy: &dyn Policy,
    set: &WorkerSet,
    req: &RouteRequest<'_>,
    tried: &WorkerMask,
    rng: &mut dyn rand::RngCore,
) -> Option<(Pick, InFlightGuard)> {
    let mut excluded = tried.clone();
    loop {
        let now = crate::pools::pool::now();
        let now_ns = crate::clock::nanos(now);
        let is_fallback = |w: &Worker| w.is_fallback();
        let is_saturated = |w: &Worker| w.signals().is_saturated_at(now_ns);
        // Whether a usable worker is a fallback or saturated, noted while the list is
        // built: the passes that take them out run only then (one pass over the pool,
        // not three, in the common case).
        let mut avoided = false;
        let none_excluded = excluded.is_empty();
        let mut candidates: Vec<Candidate> = set
            .workers()
            .iter()
            .map(|w| {
                let (routable, load) = w.routing_state(now);
                let pending = w.prefill().pending_requests() as usize;
                let usable = routable && (none_excluded || !excluded.contains(w.id()));
                avoided |= usable && (is_fallback(w) || is_saturated(w));
                Candidate {
                    id: w.id(),
                    load,
                    usable,
                    cache_aware: w.is_cache_aware(),
                    pending,
                }
            })
            .collect();
        if avoided {
            let workers = set.workers();
            for avoid in [&is_fallback as &dyn Fn(&Worker) -> bool, &is_saturated] {
                if candidates
                    .iter()
                    .zip(workers)
                    .any(|(c, w)| c.usable && !avoid(w))
                {
                    for (c, w) in candidates.iter_mut().zip(workers) {
                        c.usable &= !avoid(w);
                    }
                }
            }
        }
        // A call continuing stored state goes where the state is, whatever it holds.
        if let Some(a) = &req.adapter
            && req.ctx.is_none_or(|c| c.continues.is_none())
        {
            prefer_placement(&mut candidates, set.workers(), a);
        }
        let pick = policy.pick(req, set, &candidates, rng);
        let id = pick.worker?;
        let worker = set.get(id)?;
        // Lost a race for the last slot, or the breaker's last probe slot: re-pick.
        if let Some(mut guard) = InFlightGuard::try_acquire(worker)
            && guard.admit()
        {
            if let Some(a) = &req.adapter {
                worker.adapters().sent(&a.name);
            }
            return Some((pick, guard));
        }
        excluded.insert(id);
    }
}

/// An adapter request's candidates narrowed by [`Placement`] (a worker whose load of
/// the adapter just failed only when no other is usable): the usable workers
/// estimated to hold the adapter; else (none usable, or the least loaded of them
/// overloaded against the least loaded usable worker, by `a.balance`'s margins) those
/// and the ones with a free adapter slot; else every usable worker. The policy then
/// picks among them as it would among any candidates (prefix affinity and its load
/// guard included), so an adapter stays on few workers while they keep up, and spreads
/// to more when they do not.
pub fn prefer_placement(candidates: &mut [Candidate], workers: &[Arc<Worker>], a: &AdapterAsk) {
    // A worker that just failed to load it: only when no other is usable.
    let now = crate::pools::pool::now();
    let refuses = |w: &Worker| w.adapters().refuses(&a.name, now);
    if candidates
        .iter()
        .zip(workers)
        .any(|(c, w)| c.usable && refuses(w))
        && candidates
            .iter()
            .zip(workers)
            .any(|(c, w)| c.usable && !refuses(w))
    {
        for (c, w) in candidates.iter_mut().zip(workers) {
            c.usable &= !refuses(w);
        }
    }
    let mut least = [usize::MAX; 3];
    let places: Vec<Placement> = candidates
        .iter()
        .zip(workers)
        .map(|(c, w)| {
            let p = w.adapters().placement(&a.name);
            if c.usable {
                least[p as usize] = least[p as usize].min(c.load);
            }
            p
        })
        .collect();
    let all = least.iter().copied().min().unwrap_or(usize::MAX);
    if all == usize::MAX {
        return;
    }
    let mut upto = usize::MAX;
    for tier in Placement::ALL {
        upto = upto.min(least[tier as usize]);
        if upto != usize::MAX && !is_overloaded(&a.balance, upto, all) {
            for (c, p) in candidates.iter_mut().zip(&places) {
                c.usable &= *p <= tier;
            }
            return;
        }
    }
}

/// What a complete answer's usage tells the router, applied as the proxy applies it
/// (and `simulate`, with the same code): the in-flight `guard` learns the worker's
/// tokens per byte (and its prefill speed when `streamed`); the worker's hit counters
/// hear the `cached_tokens` it reported, and count a delivery far short of the pick's
/// `predicted_tokens` ([`Delivery::is_short`], with `block_tokens` tokens per engine
/// block). Returns the delivered tokens (`None` while the worker has never reported
/// cached tokens) and, for a pick with a `mark`, the [`Delivery`] to give to
/// `Policy::answered`. Counts are prompt tokens.
pub fn settle_usage(
    guard: &InFlightGuard,
    prompt_tokens: u64,
    cached_tokens: Option<u64>,
    streamed: bool,
    (predicted_tokens, mark): (u64, Mark),
    block_tokens: u64,
) -> (Option<u64>, Option<Delivery>) {
    guard.learn(prompt_tokens, cached_tokens.unwrap_or(0), streamed);
    let Some(delivered) = guard.worker().hits().delivered(cached_tokens) else {
        return (None, None);
    };
    let short = Delivery::is_short(predicted_tokens, delivered, block_tokens);
    if short {
        guard.worker().hits().shortfall();
    }
    let delivery = (mark.is_some() && predicted_tokens > 0).then_some(Delivery {
        mark,
        predicted_tokens,
        delivered_tokens: delivered,
        short,
    });
    (Some(delivered), delivery)
}
