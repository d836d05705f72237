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
//! With workers that have `kv_events` (precise mode's KV-event index, [`EventIndex`]),
//! a request whose token ids are known is priced on what each engine reports holding
//! instead, for every worker whose feed is live (the others on the tree): `own(w)` is
//! exact, and the blocks `w` holds only in a host tier (CPU, storage) are not free: they
//! add their transfer, `host(w) / precise.tier_load_tokens_per_sec` seconds, to
//! `cost(w)` (the load does not hold up the engine's other requests, so it adds to no
//! queue). The answer then splits its tokens by tier as in precise mode.
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
use super::precise::EventIndex;
use super::precise::event_index::{Best, Runs, rank_for};
use super::select::{BlockScale, eviction_evidence, tie_rank, usable};
use super::{BoxFuture, Candidate, MatchUnit, Outcome, Pick, Policy, Reason, RouteRequest};
use crate::config::Config;
use crate::pools::pool::prefill::{MIN_SAMPLES, PrefillRate};
use crate::pools::pool::{Pool, PoolListener, Worker, WorkerId, WorkerSet};
use crate::shutdown::Shutdown;
use crate::tree::{Mark, SharedTree, WorkerMask};

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
    /// Precise mode's KV-event index, when workers have `kv_events` (see the module
    /// docs).
    events: Option<EventIndex>,
    /// `precise.tier_load_tokens_per_sec`: tokens per second a host-tier hit loads at.
    load_rate: f64,
}

impl CostAware {
    /// Each cache-aware worker's prefix match of the request's text (bytes, with where
    /// it ended in the tree; the other replicas' records when shared; a cut prompt as
    /// far as the worker served it), the tree's clock when read, and the workers
    /// disbelieved on the text's path (`tree::doubt`).
    fn matches(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        prompt_bytes: usize,
    ) -> (Matches, u64, WorkerMask) {
        let text = req.text();
        let mut matches = Matches::new();
        let mut clock = 0;
        let mut disbelieved = WorkerMask::default();
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
            disbelieved =
                tree.prefix_per_worker(text, &eligible, |w, n, mark| matches.set(w, n, mark));
            clock = tree.clock();
            drop(tree);
            // Other replicas' records (no stamp of this tree's): whichever holds more.
            if let Some(r) = shared.remote() {
                r.prefix_per_worker(text, &eligible, &req.chain, &mut |w, n| {
                    if n > matches.get(w) {
                        matches.set(w, n, Mark::default())
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
                    matches.set(w, len.min(prompt_bytes), matches.mark(w));
                }
            }
        }
        (matches, clock, disbelieved)
    }

    /// The tree it shares with `cache_aware`'s decision.
    pub fn shared_tree(&self) -> &Arc<SharedTree> {
        self.tree.shared_tree()
    }

    /// The policy for `config` (tests), with a KV-event index of its own when workers
    /// have `kv_events`.
    #[cfg(test)]
    fn new(config: &Config, fleet: Option<&Arc<crate::fleet::Fleet>>) -> Self {
        let events = config
            .workers
            .iter()
            .any(|w| w.kv_events.is_some())
            .then(|| EventIndex::new(&config.precise));
        Self::with_events(config, fleet, events)
    }

    /// The policy for `config`, its tree shared through `fleet` when given, priced on
    /// `events`, a KV-event index (one state serves every model's pool, see
    /// [`EventIndex::sharing`]), when there is one.
    pub fn with_events(
        config: &Config,
        fleet: Option<&Arc<crate::fleet::Fleet>>,
        events: Option<EventIndex>,
    ) -> Self {
        CostAware {
            tree: CacheAware::new(&config.cache, fleet),
            block_tokens: config.cache.engine_block_tokens.max(1),
            engine_metrics: config.engine_metrics.enabled,
            stale: config.engine_metrics.stale,
            beyond: Mutex::new(lru::LruCache::new(
                std::num::NonZeroUsize::new(BEYOND_CUT_ENTRIES).expect("non-zero"),
            )),
            events,
            load_rate: config.precise.tier_load_tokens_per_sec,
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
    /// Priced on the KV-event index (exact tokens), not on the tree.
    exact: bool,
}

/// A worker's prompt as priced: its tokens, the prefix it holds (whole blocks, never
/// the last token) and of that the part held only in a host tier, loaded at a cost.
#[derive(Debug, Clone, Copy)]
struct Held {
    prompt_tokens: f64,
    matched_tokens: f64,
    host_tokens: f64,
    exact: bool,
}

impl Held {
    /// From the tree: the worker's match and the prompt in bytes of routing text,
    /// at its learned tokens per byte, in whole `block`-token blocks.
    fn estimated(
        rate: &PrefillRate,
        matched_bytes: usize,
        prompt_bytes: usize,
        block: usize,
    ) -> Held {
        let prompt_tokens = (prompt_bytes as f64 * rate.tokens_per_byte).max(1.0);
        let matched = BlockScale {
            tokens_per_byte: rate.tokens_per_byte,
            block_tokens: block,
        }
        .tokens(matched_bytes) as f64;
        Held::capped(prompt_tokens, matched, 0.0, block, false)
    }

    /// From the KV-event index: the worker's best rank's run of `block`-token blocks.
    fn reported(best: &Best, prompt_tokens: usize, block: usize, gpu_tier: usize) -> Held {
        let matched = (best.run.blocks * block) as f64;
        let host = (best.run.host_blocks(gpu_tier) * block) as f64;
        Held::capped((prompt_tokens as f64).max(1.0), matched, host, block, true)
    }

    /// The last prompt token is always recomputed: the match stops a block short of it.
    fn capped(prompt_tokens: f64, matched: f64, host: f64, block: usize, exact: bool) -> Held {
        let block = block as f64;
        let matched_tokens = matched
            .min(((prompt_tokens - 1.0) / block).floor() * block)
            .max(0.0);
        Held {
            prompt_tokens,
            matched_tokens,
            host_tokens: host.min(matched_tokens),
            exact,
        }
    }
}

impl CostAware {
    /// `w`'s learned prefill rate, or the pool's (`fleet`) while it has not learned one.
    fn rate(w: &Worker, fleet: Option<PrefillRate>) -> PrefillRate {
        match (w.prefill().rate(), fleet) {
            // Not learned yet: as fast as the pool's learned workers, not the prior.
            (r, Some(f)) if r.samples < MIN_SAMPLES => PrefillRate {
                tokens_per_byte: r.tokens_per_byte,
                ..f
            },
            (r, _) => r,
        }
    }

    fn cost(&self, w: &Worker, rate: PrefillRate, held: Held, now: std::time::Instant) -> Cost {
        let prefill = w.prefill();
        let own = held.prompt_tokens - held.matched_tokens;
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
        // A host-tier hit is read into GPU memory first: this request waits for it.
        let load = held.host_tokens / self.load_rate;
        Cost {
            seconds: queue + rate.cost_s(1.0, own) + load,
            queued: pending_requests > 0 || queue > 0.0,
            behind: pending_requests as f64 * rate.queue_factor,
            own_s: own * rate.secs_per_token,
            tokens_per_byte: rate.tokens_per_byte,
            matched_tokens: held.matched_tokens as u64,
            own_tokens: own.round() as u64,
            exact: held.exact,
        }
    }

    /// Each usable candidate's cost: on the KV-event index where `runs` scored it, else
    /// on the tree's `matches`.
    fn costs<'c>(
        &self,
        set: &WorkerSet,
        candidates: &'c [Candidate],
        (matches, prompt_bytes): (&Matches, usize),
        runs: Option<&Runs<'_>>,
        now: std::time::Instant,
    ) -> Vec<(usize, &'c Candidate, Cost)> {
        let fleet = fleet_rate(set, candidates);
        let index_block = self
            .events
            .as_ref()
            .map_or(1, |e| e.precise().config().block_size);
        candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| c.usable)
            .filter_map(|(i, c)| {
                let w = set.get(c.id)?;
                let rate = Self::rate(w, fleet);
                let reported = runs.and_then(|r| Some((r.best.get(i)?.as_ref()?, r)));
                let held = match reported {
                    Some((best, r)) => Held::reported(best, r.tokens, index_block, r.gpu_tier),
                    None => {
                        let matched = if c.cache_aware { matches.get(c.id) } else { 0 };
                        Held::estimated(&rate, matched, prompt_bytes, self.block_tokens)
                    }
                };
                Some((i, c, self.cost(w, rate, held, now)))
            })
            .collect()
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

/// The least cost of `costs` (candidate index, candidate, cost). When no worker is
/// idle, recompute on one worker delays the requests that queue behind it there as
/// much as it delays this one, so the work a worker would add beyond the least any
/// worker needs is charged once per request queued there (see the module docs). Ties
/// are stable by the request's key `tie` (`disbelieved` workers losing them), else
/// uniformly at random.
fn choose<'c>(
    costs: Vec<(usize, &'c Candidate, Cost)>,
    tie: Option<u64>,
    disbelieved: &WorkerMask,
    rng: &mut dyn RngCore,
) -> Option<(usize, &'c Candidate, Cost)> {
    let everywhere_queued = costs.iter().all(|(_, _, c)| c.queued);
    let least_own_s = costs
        .iter()
        .map(|(_, _, c)| c.own_s)
        .fold(f64::MAX, f64::min);
    let mut best: Option<(usize, &Candidate, Cost, u64)> = None;
    let mut ties = 0u32;
    for (i, c, mut cost) in costs {
        if everywhere_queued {
            cost.seconds += (cost.own_s - least_own_s) * cost.behind.max(1.0);
        }
        // A worker disbelieved on this text's path (`tree::doubt`) loses ties: a prefix
        // its engine does not serve from cache goes where it will be.
        let rank = match tie {
            Some(_) if disbelieved.contains(c.id) => 0,
            Some(k) => tie_rank(k, c).max(1),
            None => 0,
        };
        match &best {
            Some((_, _, b, _)) if cost.seconds > b.seconds + 1e-9 => {}
            Some((_, _, b, held)) if cost.seconds >= b.seconds - 1e-9 => {
                let take = match tie {
                    Some(_) => rank > *held,
                    None => {
                        ties += 1;
                        rng.random_range(0..ties) == 0
                    }
                };
                if take {
                    best = Some((i, c, cost, rank));
                }
            }
            _ => {
                best = Some((i, c, cost, rank));
                ties = 1;
            }
        }
    }
    best.map(|(i, c, cost, _)| (i, c, cost))
}

impl PoolListener for CostAware {
    fn worker_left(&self, worker: &Worker) {
        self.tree.worker_left(worker);
        self.forget(worker.id());
    }

    fn worker_down(&self, worker: &Worker) {
        self.tree.worker_down(worker);
        self.forget(worker.id());
        if let Some(e) = &self.events {
            e.worker_down(worker);
        }
    }
}

impl Policy for CostAware {
    fn name(&self) -> &'static str {
        "cost_aware"
    }

    /// Keys the prompt for the KV-event index, when workers have `kv_events`.
    fn prepare<'a>(
        &'a self,
        req: super::RequestParts<'a>,
    ) -> Option<BoxFuture<'a, super::Prepared>> {
        self.events.as_ref().map(|e| e.prepare(req))
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
        let (matches, clock, disbelieved) = self.matches(req, candidates, prompt_bytes);
        let now = crate::clock::now();
        let feeds = self
            .events
            .as_ref()
            .map(|_| EventIndex::feeds(set, candidates));
        let runs = match (&self.events, &feeds) {
            (Some(e), Some(feeds)) => {
                let runs = e.runs(req, candidates, feeds, now);
                match &runs {
                    Ok(r) => e.precise().count_precise(r.source),
                    Err(why) => e.precise().count_fallback(*why),
                }
                runs.ok()
            }
            _ => None,
        };
        let costs = self.costs(
            set,
            candidates,
            (&matches, prompt_bytes),
            runs.as_ref(),
            now,
        );
        let most_tokens = costs
            .iter()
            .map(|(_, _, c)| c.matched_tokens)
            .max()
            .unwrap_or(0);
        let longest_reported = runs.as_ref().map_or(0, |r| {
            let block = self
                .events
                .as_ref()
                .map_or(0, |e| e.precise().config().block_size);
            r.best
                .iter()
                .flatten()
                .map(|b| b.run.blocks * block)
                .max()
                .unwrap_or(0)
        });
        let Some((i, c, cost)) = choose(costs, req.tie, &disbelieved, rng) else {
            return Pick::load_only(None, text.len());
        };
        let reason = if text.is_empty() && !cost.exact {
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
        let text_len = match &runs {
            Some(r) if cost.exact => r.tokens,
            _ => scale.text_tokens(text.len()),
        };
        let mut pick = Pick {
            worker: Some(c.id),
            reason,
            matched,
            available: scale
                .tokens(matches.longest())
                .max(longest_reported.min(text_len))
                .max(matched),
            text_len,
            unit: MatchUnit::Tokens,
            dp_rank: None,
            cache_aware: c.cache_aware,
            prefill_tokens: cost.own_tokens,
            mark: if reason == Reason::CacheHit && !cost.exact {
                let in_flight = candidates.iter().map(|c| c.load).sum();
                eviction_evidence(matches.mark(c.id), clock, in_flight)
            } else {
                Mark::default()
            },
        };
        if let (Some(r), Some(feeds), Some(e)) = (&runs, &feeds, &self.events) {
            if cost.exact {
                let stale = e.precise().config().stale;
                pick.dp_rank = rank_for(feeds[i], r.best[i].as_ref(), now, stale, rng);
            }
            r.note(cost.exact.then_some(i), &pick);
        }
        if let Some(feeds) = &feeds {
            EventIndex::routed(&pick, candidates, feeds, now);
        }
        pick
    }

    fn observe(&self, req: &RouteRequest<'_>, pick: &Pick, worker: &Worker, outcome: Outcome) {
        if outcome != Outcome::Served {
            return;
        }
        self.tree.record_served(req, pick);
        if let Some(e) = &self.events {
            e.speculate(req, pick, worker);
        }
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

    /// Learns from the engines as `cache_aware` does (the same tree), and as precise
    /// mode does with the KV-event index (token parity, tokens by tier).
    fn answered(&self, worker: &Worker, answer: &super::Answer<'_>) {
        self.tree.learn(worker, answer);
        if let Some(e) = &self.events {
            e.answered(worker, answer);
        }
    }

    fn views(&self) -> Vec<Arc<dyn super::View>> {
        let mut views = self.tree.views();
        if let Some(v) = self.events.as_ref().and_then(EventIndex::view) {
            views.insert(0, v);
        }
        views
    }

    fn background(&self, pool: Arc<Pool>, shutdown: Shutdown) -> Option<BoxFuture<'static, ()>> {
        let tree = self.tree.background(Arc::clone(&pool), shutdown.clone());
        let events = self
            .events
            .as_ref()
            .and_then(|e| e.background(pool, shutdown));
        super::precise::both(tree, events)
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
                pending: 0,
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
    fn a_hit_carries_its_mark_and_a_short_delivery_sets_the_horizon_on_evidence_only() {
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
        assert!(again.mark.evidence && again.mark.stamp > 0);
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
            (p.worker, p.reason, p.mark.evidence),
            (first.worker, Reason::CacheHit, false)
        );
        let answer = super::super::Answer {
            response_id: None,
            delivery: Some(super::super::Delivery {
                mark: again.mark,
                predicted_tokens: again.matched as u64,
                delivered_tokens: 0,
                short: true,
            }),
            ..Default::default()
        };
        // A worker whose answers have borne its records out: a short answer is one
        // record, not an engine that evicts.
        let predicted = again.matched as u64;
        for _ in 0..40 {
            w.hits().borne(predicted, predicted);
        }
        policy.answered(w, &answer);
        assert!(policy.tree.shared_tree().take_horizons().is_empty());
        // One whose records deliver measurably less (under 0.95, recent and long): a
        // short answer waits for a second to confirm it, and the two bound the records.
        for _ in 0..40 {
            w.hits().borne(predicted, 0);
        }
        policy.answered(w, &answer);
        assert!(policy.tree.shared_tree().take_horizons().is_empty());
        policy.answered(w, &answer);
        assert_eq!(
            policy.tree.shared_tree().take_horizons(),
            vec![(w.id(), again.mark.stamp)]
        );
    }

    /// With workers that have `kv_events`, a prompt whose tokens are known is priced on
    /// the blocks the engines report: on the GPU they are free, in a host tier they
    /// cost their transfer at `precise.tier_load_tokens_per_sec`.
    #[test]
    fn a_host_tier_hit_costs_its_transfer() {
        use crate::precise::TokenSource;
        use crate::precise::events::{BlockRemoved, BlockStored, Event};
        let tokens: Vec<u32> = (1..=66).collect();
        let gpu_store = Event::Stored(BlockStored {
            block_hashes: (0..16).collect(),
            parent_block_hash: None,
            token_ids: tokens[..64].to_vec(),
            block_size: 4,
            lora: None,
            medium: Some("GPU".into()),
            extra_keys: Vec::new(),
            group_idx: None,
            kind: None,
        });
        let cpu_copy = Event::Stored(BlockStored {
            token_ids: Vec::new(),
            block_size: 0,
            medium: Some("CPU".into()),
            ..match &gpu_store {
                Event::Stored(e) => e.clone(),
                _ => unreachable!(),
            }
        });
        let gpu_evicts = Event::Removed(BlockRemoved {
            block_hashes: (0..16).collect(),
            medium: Some("GPU".into()),
            group_idx: None,
        });
        // 64 tokens on worker 0; recomputing them takes 6.4 ms at the prior rate.
        for (rate, on_cpu, want) in [(1_000, true, 1), (1_000_000, true, 0), (1_000, false, 0)] {
            let yaml = format!(
                "policy: cost_aware\nengine_metrics: {{enabled: false}}\nprecise:\n  block_size: 4\n  tier_load_tokens_per_sec: {rate}\nworkers:\n  - url: http://a:1\n    kv_events: {{endpoint: \"tcp://127.0.0.1:5557\"}}\n  - url: http://b:1\n    kv_events: {{endpoint: \"tcp://127.0.0.1:5558\"}}\n"
            );
            let config = Config::from_sources([(std::path::Path::new("t.yaml"), yaml.as_str())])
                .expect("config");
            let pool = Pool::new(&config.workers, &config.circuit_breaker);
            let policy = CostAware::new(&config, None);
            let set = pool.set();
            set.workers()
                .iter()
                .flat_map(|w| w.feeds())
                .for_each(|f| f.set_connected(true));
            let precise = policy
                .events
                .as_ref()
                .expect("kv_events: the index")
                .precise();
            let source = set.workers()[0].feeds()[0].source();
            precise.index().apply(source, &gpu_store);
            if on_cpu {
                precise.index().apply(source, &cpu_copy);
                precise.index().apply(source, &gpu_evicts);
            }
            let req = RouteRequest {
                prepared: crate::policy::Prepared::Blocks(precise.keyed(
                    &tokens,
                    TokenSource::Header,
                    None,
                    None,
                )),
                ..Default::default()
            };
            let pick = policy.pick(&req, &set, &cands(&set), &mut StdRng::seed_from_u64(1));
            let case = format!("{rate} tokens/s, on the CPU: {on_cpu}");
            assert_eq!(pick.worker.map(|w| w.0), Some(want), "{case}");
            assert_eq!((pick.available, pick.text_len), (64, 66), "{case}");
            if want == 0 {
                assert_eq!(
                    (pick.matched, pick.reason),
                    (64, Reason::CacheHit),
                    "{case}"
                );
            } else {
                assert_eq!(pick.reason, Reason::HitOverloaded, "{case}");
            }
            assert!(
                precise.decisions().contains(&("precise", "x_token_ids", 1)),
                "{case}"
            );
        }
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
