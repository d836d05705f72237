//! `cost_aware`: the usable worker with the least expected time to first token.
//!
//! For each usable worker `w`, with its learned prefill speed (`pool::prefill`: a fixed
//! cost per request `base` and a cost per uncached token `per_token`, both seconds):
//!
//! ```text
//! own(w)   = prompt tokens − the prefix w holds, in whole engine blocks
//! queue(w) = κ(w) · max(router:  drain(w) − now,
//!                       engine:  waiting(w) · (base + mean_request_tokens(w) · per_token))
//! cost(w)  = queue(w) + base + own(w) · per_token
//!          + (own(w) − min own) · per_token · κ(w) · queued(w)   only when no worker is idle
//! ```
//!
//! and the pick is the least cost, in seconds (ties stable by the session or prompt
//! digest, as in [`least_loaded`](super::select::least_loaded)).
//!
//! - `drain` is when the prefill the router has sent to `w` and not yet seen a first
//!   byte of is predicted to end (`pool::prefill`, re-anchored on every answer);
//!   `waiting` is the engine's own queue from its last fresh scrape (`engine_metrics:`;
//!   missing or stale = 0, and the router's view stands). Both views count the same
//!   queue, so the larger is taken, never their sum.
//! - `κ(w)`, the queue factor, is learned from `w`'s answers that queued (`pool::prefill`):
//!   how much of that serial wait a request really waits on this engine — about 1 on
//!   one that prefills one request at a time, about 0 on one that runs several at full
//!   speed, in between on one that shares its speed among them. 1 until learned.
//! - The last term applies under saturation (every usable worker has requests queued):
//!   a recompute then delays the requests that queue behind it as much as this one, so
//!   the work `w` would add beyond the least any worker needs is charged once per
//!   request queued there (`queued(w)`, about as many as will arrive behind it by
//!   Little's law at a steady rate). With an idle worker nothing waits behind.
//! - A worker that has not answered [`MIN_SAMPLES`] unqueued streamed requests yet is
//!   costed at the mean rate of the usable workers that have (the priors only while none
//!   has): a fixed prior far from the fleet's real speed would make new workers look
//!   slower or faster than they are.
//!
//! Prompt tokens are estimated from the prompt's bytes with the worker's learned tokens
//! per byte; the prefix a worker holds is its longest match in the radix tree of what it
//! served (bytes → tokens the same way), rounded down to whole `cache.engine_block_tokens`
//! blocks (an engine reuses only whole blocks) and never the whole prompt (vLLM always
//! recomputes the last token). There is no threshold: a warm worker wins while its queue
//! costs less than the recompute it saves, and a cold one once it costs more. The prompt
//! is recorded for the worker that served it, so a hot prefix that spills to a second
//! worker lives on both from then on.
//!
//! The tree holds at most `cache.max_prompt_bytes` of each prompt. For a longer prompt
//! whose whole cut text a worker holds, the router cannot see how much of the rest that
//! worker has: it remembers, per cut text (`RouteContext::cut_digest`) and worker, the
//! longest prompt that worker served with it ([`BEYOND_CUT_ENTRIES`] texts, least
//! recently used first), and counts the match up to that length. A conversation's next
//! turn so counts the whole previous turn as cached, as the engine does.
//!
//! Reasons: [`Reason::CacheHit`] when the chosen worker holds the longest usable match
//! (at least one block), [`Reason::HitOverloaded`] when another usable worker held more
//! of the prompt (a diverted hit: its queue cost more than the recompute), otherwise
//! [`Reason::Miss`] / [`Reason::EmptyText`].

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::{Rng, RngCore};

use super::cache_aware::CacheAware;
use super::matches::Matches;
use super::select::{BlockScale, eviction_evidence, tie_rank, usable};
use super::{BoxFuture, Candidate, MatchUnit, Outcome, Pick, Policy, Reason, RouteRequest};
use crate::config::Config;
use crate::pools::pool::prefill::{MIN_SAMPLES, PrefillRate};
use crate::pools::pool::{Pool, PoolListener, Worker, WorkerId, WorkerSet};
use crate::shutdown::Shutdown;
use crate::tree::{SharedTree, WorkerMask};

/// Cut routing texts remembered with the longest prompt each worker served with them.
pub const BEYOND_CUT_ENTRIES: usize = 65_536;

/// Per cut text: (worker, longest prompt served with it, bytes).
type Beyond = lru::LruCache<u64, Vec<(WorkerId, usize)>>;

/// The `cost_aware` policy: the tree of `cache_aware` (recording, eviction) and the cost.
pub struct CostAware {
    tree: CacheAware,
    block_tokens: usize,
    /// Engine scrapes are read when on (`engine_metrics.enabled`).
    engine_metrics: bool,
    stale: Duration,
    beyond: Mutex<Beyond>,
}

impl CostAware {
    /// Each cache-aware worker's prefix match of the request's text (bytes, with the
    /// tree's last-use stamp; the other replicas' records when shared; a cut prompt
    /// as far as the worker served it), and the tree's clock when read.
    fn matches(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        prompt_bytes: usize,
    ) -> (Matches, u64) {
        let text = req.text();
        let mut matches = Matches::new();
        let mut clock = 0;
        if !text.is_empty() {
            // Every cache-aware worker, usable or not: the unusable ones' matches count
            // only in what was available (the costs are the usable ones').
            let eligible: WorkerMask = candidates
                .iter()
                .filter(|c| c.cache_aware)
                .map(|c| c.id)
                .collect();
            // Matches under one block cost as misses (`cost` counts whole blocks).
            let shared = self.tree.shared_tree();
            let tree = shared.lock();
            tree.prefix_per_worker(text, &eligible, |w, n, stamp| matches.set(w, n, stamp));
            clock = tree.clock();
            drop(tree);
            // Other replicas' records (no stamp of this tree's): whichever holds more.
            if let Some(r) = shared.remote() {
                r.prefix_per_worker(text, &eligible, &req.chain, &mut |w, n| {
                    if n > matches.get(w) {
                        matches.set(w, n, 0)
                    }
                });
            }
        }
        // A cut prompt whose whole cut text a worker holds: as far as it served before.
        if let Some(key) = req.ctx.and_then(|c| c.cut_digest)
            && let Some(served) = self.beyond().get(&key)
        {
            for &(w, len) in served {
                if matches.get(w) == text.len() {
                    matches.set(w, len.min(prompt_bytes), matches.stamp(w));
                }
            }
        }
        (matches, clock)
    }

    /// The tree it shares with `cache_aware`'s decision.
    pub fn shared_tree(&self) -> &Arc<SharedTree> {
        self.tree.shared_tree()
    }

    /// The policy for `config`, its tree shared through `fleet` when given.
    pub fn new(config: &Config, fleet: Option<&Arc<crate::fleet::Fleet>>) -> Self {
        CostAware {
            tree: CacheAware::new(&config.cache, fleet),
            block_tokens: config.cache.engine_block_tokens.max(1),
            engine_metrics: config.engine_metrics.enabled,
            stale: config.engine_metrics.stale,
            beyond: Mutex::new(lru::LruCache::new(
                std::num::NonZeroUsize::new(BEYOND_CUT_ENTRIES).expect("non-zero"),
            )),
        }
    }

    fn beyond(&self) -> std::sync::MutexGuard<'_, Beyond> {
        self.beyond.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn forget(&self, worker: WorkerId) {
        for (_, served) in self.beyond().iter_mut() {
            served.retain(|(w, _)| *w != worker);
        }
    }
}

/// One worker's expected TTFT and what it rests on.
#[derive(Debug, Clone, Copy)]
struct Cost {
    seconds: f64,
    /// The worker's tokens per byte of routing text, as used.
    tokens_per_byte: f64,
    /// Reused tokens (whole blocks).
    matched_tokens: u64,
    /// Tokens to prefill.
    own_tokens: u64,
    /// Whether requests are queued ahead of it there.
    queued: bool,
    /// Requests queued there now: about as many as will queue behind it (Little's law
    /// at a steady arrival rate).
    behind: f64,
    /// Its own prefill time, s.
    own_s: f64,
}

impl CostAware {
    fn cost(
        &self,
        w: &Worker,
        matched_bytes: usize,
        prompt_bytes: usize,
        now: std::time::Instant,
        fleet: Option<PrefillRate>,
    ) -> Cost {
        let prefill = w.prefill();
        let rate = match (prefill.rate(), fleet) {
            // Not learned yet: as fast as the pool's learned workers, not the prior.
            (r, Some(f)) if r.samples < MIN_SAMPLES => PrefillRate {
                tokens_per_byte: r.tokens_per_byte,
                ..f
            },
            (r, _) => r,
        };
        let prompt_tokens = (prompt_bytes as f64 * rate.tokens_per_byte).max(1.0);
        let block = self.block_tokens as f64;
        let matched_tokens = BlockScale {
            tokens_per_byte: rate.tokens_per_byte,
            block_tokens: self.block_tokens,
        }
        .tokens(matched_bytes) as f64;
        // The last prompt token is always recomputed.
        let matched_tokens = matched_tokens
            .min(((prompt_tokens - 1.0) / block).floor() * block)
            .max(0.0);
        let own = prompt_tokens - matched_tokens;
        let (pending_requests, _) = prefill.pending();
        let router_queue = prefill.queue_s(now, &rate);
        let engine_queue = if self.engine_metrics {
            match w.signals().engine_fresh(now, self.stale) {
                Some(load) => {
                    rate.cost_s(load.waiting, load.waiting * prefill.mean_request_tokens())
                }
                None => {
                    w.signals().neutral_reads.fetch_add(1, Ordering::Relaxed);
                    0.0
                }
            }
        } else {
            0.0
        };
        // Both views assume prefills one after another: what this engine really makes a
        // request wait behind them is learned (the queue factor, `pool::prefill`).
        let queue = router_queue.max(engine_queue) * rate.queue_factor;
        Cost {
            seconds: queue + rate.cost_s(1.0, own),
            queued: pending_requests > 0 || queue > 0.0,
            behind: pending_requests as f64 * rate.queue_factor,
            own_s: own * rate.secs_per_token,
            tokens_per_byte: rate.tokens_per_byte,
            matched_tokens: matched_tokens as u64,
            own_tokens: own.round() as u64,
        }
    }
}

/// The mean learned rate of the usable workers that have learned one (`None` when none
/// has): what a worker that has not answered enough yet is assumed to be.
fn fleet_rate(set: &WorkerSet, candidates: &[Candidate]) -> Option<PrefillRate> {
    let (mut n, mut base, mut per_token, mut queue_factor) = (0.0, 0.0, 0.0, 0.0);
    for c in usable(candidates) {
        let Some(w) = set.get(c.id) else { continue };
        let r = w.prefill().rate();
        if r.samples >= MIN_SAMPLES {
            n += 1.0;
            base += r.base_s;
            per_token += r.secs_per_token;
            queue_factor += r.queue_factor;
        }
    }
    (n > 0.0).then(|| PrefillRate {
        base_s: base / n,
        secs_per_token: per_token / n,
        tokens_per_byte: crate::pools::pool::prefill::PRIOR_TOKENS_PER_BYTE,
        samples: 0,
        queue_factor: queue_factor / n,
    })
}

impl PoolListener for CostAware {
    fn worker_left(&self, worker: &Worker) {
        self.tree.worker_left(worker);
        self.forget(worker.id());
    }

    fn worker_down(&self, worker: &Worker) {
        self.tree.worker_down(worker);
        self.forget(worker.id());
    }
}

impl Policy for CostAware {
    fn name(&self) -> &'static str {
        "cost_aware"
    }

    fn pick(
        &self,
        req: &RouteRequest<'_>,
        set: &WorkerSet,
        candidates: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Pick {
        let text = req.text();
        let prompt_bytes = req
            .ctx
            .map_or(text.len(), |c| c.total_len.max(c.text.len()));
        let (matches, clock) = self.matches(req, candidates, prompt_bytes);
        let now = crate::clock::now();
        let fleet = fleet_rate(set, candidates);
        let costs: Vec<(&Candidate, Cost)> = usable(candidates)
            .filter_map(|c| {
                let w = set.get(c.id)?;
                let matched = if c.cache_aware { matches.get(c.id) } else { 0 };
                Some((c, self.cost(w, matched, prompt_bytes, now, fleet)))
            })
            .collect();
        // No worker idle: recompute on one worker delays the requests that queue behind
        // it there as much as it delays this one, so the work a worker would add beyond
        // the least any worker needs is charged once per request queued there (see the
        // module docs).
        let everywhere_queued = costs.iter().all(|(_, c)| c.queued);
        let least_own_s = costs.iter().map(|(_, c)| c.own_s).fold(f64::MAX, f64::min);
        let most_tokens = costs
            .iter()
            .map(|(_, c)| c.matched_tokens)
            .max()
            .unwrap_or(0);
        let mut best: Option<(&Candidate, Cost, u64)> = None;
        let mut ties = 0u32;
        for (c, mut cost) in costs {
            if everywhere_queued {
                cost.seconds += (cost.own_s - least_own_s) * cost.behind.max(1.0);
            }
            let rank = req.tie.map_or(0, |k| tie_rank(k, c));
            match &best {
                Some((_, b, _)) if cost.seconds > b.seconds + 1e-9 => {}
                Some((_, b, held)) if cost.seconds >= b.seconds - 1e-9 => {
                    // A tie: stable by the request's key, else uniformly at random.
                    let take = match req.tie {
                        Some(_) => rank > *held,
                        None => {
                            ties += 1;
                            rng.random_range(0..ties) == 0
                        }
                    };
                    if take {
                        best = Some((c, cost, rank));
                    }
                }
                _ => {
                    best = Some((c, cost, rank));
                    ties = 1;
                }
            }
        }
        let Some((c, cost, _)) = best else {
            return Pick::load_only(None, text.len());
        };
        let reason = if text.is_empty() {
            Reason::EmptyText
        } else if cost.matched_tokens > 0 && cost.matched_tokens == most_tokens {
            Reason::CacheHit
        } else if most_tokens > 0 {
            Reason::HitOverloaded
        } else {
            Reason::Miss
        };
        // In tokens at the chosen worker's rate, whole blocks (as its cost counted them).
        let scale = BlockScale {
            tokens_per_byte: cost.tokens_per_byte,
            block_tokens: self.block_tokens,
        };
        let matched = cost.matched_tokens as usize;
        Pick {
            worker: Some(c.id),
            reason,
            matched,
            available: scale.tokens(matches.longest()).max(matched),
            text_len: scale.text_tokens(text.len()),
            unit: MatchUnit::Tokens,
            dp_rank: None,
            cache_aware: c.cache_aware,
            prefill_tokens: cost.own_tokens,
            stamp: if reason == Reason::CacheHit {
                let in_flight = candidates.iter().map(|c| c.load).sum();
                eviction_evidence(matches.stamp(c.id), clock, in_flight)
            } else {
                0
            },
        }
    }

    fn observe(&self, req: &RouteRequest<'_>, pick: &Pick, _: &Worker, outcome: Outcome) {
        if outcome != Outcome::Served {
            return;
        }
        self.tree.record_served(req, pick);
        let Some(ctx) = req.ctx else { return };
        if let (Some(w), true, Some(key)) = (pick.worker, pick.cache_aware, ctx.cut_digest) {
            let mut beyond = self.beyond();
            let served = beyond.get_or_insert_mut(key, Vec::new);
            match served.iter_mut().find(|(id, _)| *id == w) {
                Some((_, len)) => *len = (*len).max(ctx.total_len),
                None => served.push((w, ctx.total_len)),
            }
        }
    }

    /// Learns from the engines as `cache_aware` does (the same tree).
    fn answered(&self, worker: &Worker, answer: &super::Answer<'_>) {
        self.tree.learn(worker, answer);
    }

    fn views(&self) -> Vec<Arc<dyn super::View>> {
        self.tree.views()
    }

    fn background(&self, pool: Arc<Pool>, shutdown: Shutdown) -> Option<BoxFuture<'static, ()>> {
        self.tree.background(pool, shutdown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::{Endpoint, extract};
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn setup(extra: &str) -> (Config, Pool, CostAware) {
        let yaml = format!(
            "policy: cost_aware\nengine_metrics: {{enabled: false}}\n{extra}workers:\n  - url: http://a:1\n  - url: http://b:1\n"
        );
        let config = Config::from_sources([(std::path::Path::new("t.yaml"), yaml.as_str())])
            .expect("config");
        let pool = Pool::new(&config.workers, &config.circuit_breaker);
        let policy = CostAware::new(&config, None);
        (config, pool, policy)
    }

    fn body(words: usize, tail: &str) -> Vec<u8> {
        let text: String = (0..words).map(|i| format!("word{i} ")).collect();
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": format!("{text}{tail}")}]})
            .to_string()
            .into_bytes()
    }

    fn cands(set: &WorkerSet) -> Vec<Candidate> {
        set.workers()
            .iter()
            .map(|w| Candidate {
                id: w.id(),
                load: 0,
                usable: true,
                cache_aware: true,
            })
            .collect()
    }

    #[test]
    fn a_cut_prompt_counts_as_far_as_its_worker_served_it() {
        // The tree keeps 1 KiB of each prompt; the conversation is ~8 KiB.
        let (config, pool, policy) = setup("cache:\n  max_prompt_bytes: 1024\n");
        let set = pool.set();
        let c = cands(&set);
        let mut rng = StdRng::seed_from_u64(1);
        let first = body(800, "first question");
        let ctx = extract(
            Endpoint::ChatCompletions,
            &first,
            config.cache.max_prompt_bytes,
        );
        assert!(ctx.text.len() < ctx.total_len);
        let req = RouteRequest {
            ctx: Some(&ctx),
            ..Default::default()
        };
        let pick = policy.pick(&req, &set, &c, &mut rng);
        let served = set.get(pick.worker.unwrap()).unwrap();
        policy.observe(&req, &pick, served, Outcome::Served);
        // The next turn: same first 1 KiB, longer. The worker that served the first
        // turn is expected to reuse all of it, not just the 1 KiB the tree holds.
        let next = body(800, "first question answer and a second question");
        let ctx2 = extract(
            Endpoint::ChatCompletions,
            &next,
            config.cache.max_prompt_bytes,
        );
        let req2 = RouteRequest {
            ctx: Some(&ctx2),
            ..Default::default()
        };
        let pick2 = policy.pick(&req2, &set, &c, &mut rng);
        assert_eq!(pick2.worker, pick.worker);
        assert_eq!(pick2.reason, Reason::CacheHit);
        // In tokens, whole blocks (0.25 tokens per byte before any answer).
        assert_eq!(
            pick2.matched,
            (ctx.total_len as f64 * 0.25) as usize / 16 * 16
        );
        // The prefill it reserves is the new part only (at 0.25 tokens per byte).
        let new_tokens = ((ctx2.total_len - ctx.total_len) as f64 * 0.25) as u64;
        assert!(
            pick2.prefill_tokens <= new_tokens + 16,
            "{} vs {new_tokens}",
            pick2.prefill_tokens
        );
        // A worker that leaves forgets it.
        policy.worker_left(served);
        let pick3 = policy.pick(&req2, &set, &c, &mut rng);
        assert_eq!(pick3.reason, Reason::Miss);
    }

    #[test]
    fn a_hit_carries_its_stamp_and_a_short_delivery_sets_the_horizon_on_evidence_only() {
        let (config, pool, policy) = setup("cache: {learn_evictions: true}\n");
        let set = pool.set();
        let c = cands(&set);
        let mut rng = StdRng::seed_from_u64(1);
        let body = body(800, "a question");
        let ctx = extract(
            Endpoint::ChatCompletions,
            &body,
            config.cache.max_prompt_bytes,
        );
        let req = RouteRequest {
            ctx: Some(&ctx),
            ..Default::default()
        };
        let first = policy.pick(&req, &set, &c, &mut rng);
        let w = set.get(first.worker.unwrap()).unwrap();
        policy.observe(&req, &first, w, Outcome::Served);
        let again = policy.pick(&req, &set, &c, &mut rng);
        assert_eq!(
            (again.worker, again.reason),
            (first.worker, Reason::CacheHit)
        );
        assert!(again.stamp > 0);
        let answer = super::super::Answer {
            response_id: None,
            shortfall: Some(super::super::Shortfall {
                stamp: again.stamp,
                predicted_tokens: again.matched as u64,
                delivered_tokens: 0,
            }),
            prepared: None,
        };
        // A worker that has delivered what was predicted: one short answer is noise.
        let (predicted, floor, never) = (again.matched as u64, 0.5, std::time::Duration::MAX);
        for _ in 0..40 {
            w.hits()
                .record([predicted, predicted, predicted], floor, never);
        }
        w.hits().record([predicted, predicted, 0], floor, never);
        policy.answered(w, &answer);
        assert!(policy.tree.shared_tree().take_horizons().is_empty());
        // One that delivers measurably less (drift under 0.95): evidence.
        for _ in 0..3 {
            w.hits().record([predicted, predicted, 0], floor, never);
        }
        policy.answered(w, &answer);
        assert_eq!(
            policy.tree.shared_tree().take_horizons(),
            vec![(w.id(), again.stamp)]
        );
        // Three requests running (on the other worker: the same pick): the record, made
        // 0 inserts ago, may be one of theirs, and a hit on it is no evidence.
        let busy: Vec<Candidate> = c
            .iter()
            .map(|x| Candidate {
                load: if x.id == w.id() { 0 } else { 3 },
                ..*x
            })
            .collect();
        let p = policy.pick(&req, &set, &busy, &mut rng);
        assert_eq!(
            (p.worker, p.reason, p.stamp),
            (first.worker, Reason::CacheHit, 0)
        );
    }

    #[test]
    fn equal_workers_split_a_cold_prompt_and_empty_text_is_reported() {
        let (_, pool, policy) = setup("");
        let set = pool.set();
        let c = cands(&set);
        let mut rng = StdRng::seed_from_u64(3);
        let mut seen = [0; 2];
        for i in 0..200 {
            let b = body(50, &format!("q{i}"));
            let ctx = extract(Endpoint::ChatCompletions, &b, 32 * 1024);
            let req = RouteRequest {
                ctx: Some(&ctx),
                ..Default::default()
            };
            let p = policy.pick(&req, &set, &c, &mut rng);
            assert_eq!(p.reason, Reason::Miss);
            seen[p.worker.unwrap().0 as usize] += 1;
        }
        assert!(seen.iter().all(|n| *n > 60), "{seen:?}");
        let p = policy.pick(&RouteRequest::default(), &set, &c, &mut rng);
        assert_eq!(p.reason, Reason::EmptyText);
        let none: Vec<Candidate> = c
            .iter()
            .map(|x| Candidate {
                usable: false,
                ..*x
            })
            .collect();
        assert_eq!(
            policy
                .pick(&RouteRequest::default(), &set, &none, &mut rng)
                .reason,
            Reason::NoWorker
        );
    }
}
