//! One simulated replay: the log's requests, in arrival order, through a real policy
//! (`policy::build`) in front of N [`EngineModel`]s, on tokio's paused clock.
//!
//! Each request is routed as the proxy routes it: `prompt::extract` of its body, the
//! [`pick_slot`] the proxy uses (candidates, usability, the policy's `pick`, the
//! in-flight guard), the guard's prefill reservation, `Policy::observe(Served)` at once
//! (a streamed answer's headers come before its prefill, as sim-engine sends them), the
//! guard's `first_byte` at the end of prefill (under the engines' [`Physics`]), and at
//! the last byte the proxy's [`settle_usage`] with the engine's `cached_tokens` and
//! `Policy::answered` with what it delivered of a marked prediction; dropping the guard ends the request's in-flight
//! count. The policy's upkeep task runs beside it. Between events the
//! clock is advanced (`tokio::time::advance`) to the next one, so every state machine
//! the policies read (learned rates, drain estimates, staleness) sees simulated time.
//! Must run inside a current-thread runtime whose time is paused.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::StdRng;

use super::engine::{EngineModel, Physics, Timing};
use crate::config::Config;
use crate::policy::decide::{pick_slot, settle_usage};
use crate::policy::{self, Answer, Outcome, Pick, Policy, RouteRequest};
use crate::pools::pool::{InFlightGuard, Pool};
use crate::prompt::{Endpoint, RouteContext};
use crate::tree::WorkerMask;

/// A request as the simulation replays it (worked out once, shared by every run).
#[derive(Debug, Clone)]
pub struct Prepared {
    pub endpoint: Endpoint,
    pub body: bytes::Bytes,
    /// Arrival, in ms from the start of the replay.
    pub arrival_ms: f64,
    /// The engine's prompt tokens (words of the whole prompt text).
    pub prompt_tokens: usize,
    /// Chained hashes of its full KV blocks.
    pub hashes: Vec<u64>,
    /// Tokens generated.
    pub output_tokens: u64,
    /// Logged time from arrival to last byte, in ms; `None` = from the engine model.
    pub duration_ms: Option<f64>,
    /// The LoRA adapter it runs under (its `model`, with `--max-lora`); `None`: the
    /// base model.
    pub adapter: Option<std::sync::Arc<str>>,
}

/// The engine pool's model.
#[derive(Debug, Clone, Copy)]
pub struct PoolModel {
    pub workers: usize,
    /// KV capacity per engine, in blocks.
    pub kv_blocks: std::num::NonZeroUsize,
    /// Tokens per KV block.
    pub block_tokens: std::num::NonZeroUsize,
    pub timing: Timing,
    /// How each engine's prefills share it, and how many run at once (parallel and
    /// shared physics).
    pub physics: Physics,
    pub prefill_slots: std::num::NonZeroUsize,
    /// Most requests in flight at once (the client's limit, as trace-matrix's replay
    /// has); a request due while that many run is sent when one ends. 0: no limit.
    pub concurrency: usize,
    /// LoRA adapters each engine holds at once; `None`: adapters are not modelled.
    pub adapter_slots: Option<std::num::NonZeroUsize>,
    /// What loading an adapter adds to the prefill of the request that needs it, ms.
    pub adapter_load_ms: f64,
}

/// What one run measured. Token counts are engine prompt tokens.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measured {
    pub requests: u64,
    /// Requests no worker could take (every worker at `max_load`).
    pub rejected: u64,
    pub prompt_tokens: u64,
    /// Σ longest prefix any engine held at the request's arrival (the reuse perfect
    /// routing could have had).
    pub available_tokens: u64,
    /// Σ the pick's predicted prefix ([`Pick::saved_tokens`]; 0 for load-only policies).
    pub predicted_tokens: u64,
    /// Σ the chosen engine's `cached_tokens`.
    pub delivered_tokens: u64,
    /// Requests per worker, by worker position.
    pub per_worker: Vec<u64>,
    /// Most requests in flight on one worker at once.
    pub peak_in_flight: u64,
    /// Each request's estimated TTFT (queue wait + prefill), in ms, sorted.
    pub ttft_ms: Vec<f64>,
    /// Σ the chosen engine's `cached_tokens` over the requests whose pick predicted a
    /// hit (÷ `predicted_tokens`: the engines' delivered ÷ predicted).
    pub predicted_hit_delivered: u64,
    /// Answers that fell far short of their prediction (`pool::hits`).
    pub shortfalls: u64,
    /// Bytes of routing records the tree's learning aged out
    /// (`SharedTree::aged_out_bytes`).
    pub aged_out_bytes: u64,
    /// Adapters the engines loaded (a request for one its engine did not hold), when
    /// adapters are modelled.
    pub adapter_loads: Option<u64>,
    /// From the first arrival to the last, in ms.
    pub span_ms: f64,
}

impl Measured {
    /// `tokens` ÷ Σ prompt tokens (0 when there were none).
    pub fn ratio(&self, tokens: u64) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            tokens as f64 / self.prompt_tokens as f64
        }
    }

    /// Adapter loads per minute of the replay's span, when adapters are modelled.
    pub fn loads_per_minute(&self) -> Option<f64> {
        let minutes = (self.span_ms / 60_000.0).max(1.0 / 60.0);
        self.adapter_loads.map(|n| n as f64 / minutes)
    }

    /// Max ÷ mean requests per worker (1 = perfectly even; 0 with no requests).
    pub fn max_over_mean(&self) -> f64 {
        let n = self.per_worker.len().max(1) as f64;
        let total: u64 = self.per_worker.iter().sum();
        let max = self.per_worker.iter().copied().max().unwrap_or(0);
        if total == 0 {
            0.0
        } else {
            max as f64 / (total as f64 / n)
        }
    }

    /// The `q` quantile (0–1) of TTFT, in ms (nearest rank; 0 with no requests).
    pub fn ttft_quantile(&self, q: f64) -> f64 {
        if self.ttft_ms.is_empty() {
            return 0.0;
        }
        let rank = ((q * self.ttft_ms.len() as f64).ceil() as usize).clamp(1, self.ttft_ms.len());
        self.ttft_ms[rank - 1]
    }
}

/// An event, in time order (ties: an engine's prefill end before a last byte, then by
/// index, so runs are deterministic). `index` is the request's, or for [`PREFILL`] the
/// engine's, with the engine's [`EngineModel::version`] that scheduled it (a stale one,
/// whose end moved since, is dropped).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Event {
    at_ns: u64,
    kind: u8,
    index: usize,
    version: u64,
}

const PREFILL: u8 = 0;
const LAST_BYTE: u8 = 1;

struct InFlight {
    guard: InFlightGuard,
    pick: Pick,
    prompt_tokens: u64,
    cached_tokens: u64,
    arrival_ms: f64,
    /// The request's logged duration, or its output tokens' decode time after the first.
    duration_ms: Option<f64>,
    decode_ms: f64,
}

/// The replay's moving parts besides the policy: engines, requests in flight, events.
struct Sim {
    engines: Vec<EngineModel>,
    flying: Vec<Option<InFlight>>,
    events: BinaryHeap<Reverse<Event>>,
    block_tokens: u64,
    /// Requests sent and not yet ended.
    in_flight: usize,
    /// The replay's start on tokio's clock.
    start: tokio::time::Instant,
}

fn ms_to_ns(ms: f64) -> u64 {
    (ms.max(0.0) * 1e6) as u64
}

impl Sim {
    /// Schedules engine `e`'s next prefill end, if one runs.
    fn schedule(&mut self, e: usize) {
        let engine = &self.engines[e];
        if let Some(at) = engine.next_finish_ms() {
            self.events.push(Reverse(Event {
                at_ns: ms_to_ns(at),
                kind: PREFILL,
                index: e,
                version: engine.version(),
            }));
        }
    }

    /// Handles one event: a prefill's end is the request's first byte (the guard's
    /// prefill ends, its TTFT is counted, its last byte scheduled); a last byte settles
    /// the engine's usage as the proxy does ([`settle_usage`], the drift, what the
    /// answer showed told to the policy) and ends its in-flight count.
    fn on_event(&mut self, e: Event, policy: &dyn Policy, m: &mut Measured) {
        if e.kind == PREFILL {
            if self.engines[e.index].version() != e.version {
                return;
            }
            // A chunked engine's step may end with no token to hand out: its next step
            // is scheduled all the same.
            let done = self.engines[e.index].finish_next();
            self.schedule(e.index);
            let Some(done) = done else {
                return;
            };
            if done.last {
                return self.end(done.index, policy);
            }
            let times_last = self.engines[e.index].times_last_tokens();
            let Some(f) = self.flying.get_mut(done.index).and_then(Option::as_mut) else {
                return;
            };
            f.guard.first_byte();
            m.ttft_ms.push(done.first_token_ms - f.arrival_ms);
            if times_last {
                return;
            }
            let last_ms = match f.duration_ms {
                Some(d) => (f.arrival_ms + d).max(done.first_token_ms),
                None => done.first_token_ms + f.decode_ms,
            };
            self.events.push(Reverse(Event {
                at_ns: ms_to_ns(last_ms),
                kind: LAST_BYTE,
                index: done.index,
                version: 0,
            }));
            return;
        }
        self.end(e.index, policy);
    }

    /// Request `index`'s last byte (see [`Sim::on_event`]).
    fn end(&mut self, index: usize, policy: &dyn Policy) {
        let Some(f) = self.flying.get_mut(index).and_then(Option::take) else {
            return;
        };
        self.in_flight -= 1;
        let (delivered, delivery) = settle_usage(
            &f.guard,
            f.prompt_tokens,
            Some(f.cached_tokens),
            true,
            (f.pick.saved_tokens(), f.pick.mark),
            self.block_tokens,
        );
        // The worker's drift, as the proxy counts it: the tree's learning weighs a
        // short answer against it.
        if let Some(d) = delivered {
            let numbers = [f.pick.available_tokens(), f.pick.saved_tokens(), d];
            f.guard.worker().hits().record(numbers, 0.0, Duration::MAX);
        }
        if delivery.is_some() {
            let answer = Answer {
                delivery,
                delivered_tokens: delivered,
                ..Answer::default()
            };
            policy.answered(f.guard.worker(), &answer);
        }
        drop(f.guard);
    }
}

impl Sim {
    fn new(model: &PoolModel, requests: usize) -> Sim {
        Sim {
            engines: (0..model.workers)
                .map(|_| {
                    let e = EngineModel::new(
                        model.kv_blocks,
                        model.block_tokens,
                        model.timing,
                        model.physics,
                        model.prefill_slots,
                    );
                    match model.adapter_slots {
                        Some(n) => e.with_adapter_slots(n),
                        None => e,
                    }
                })
                .collect(),
            flying: (0..requests).map(|_| None).collect(),
            events: BinaryHeap::new(),
            block_tokens: model.block_tokens.get() as u64,
            in_flight: 0,
            start: tokio::time::Instant::now(),
        }
    }

    /// Simulated ms since the replay's start.
    fn now_ms(&self) -> f64 {
        tokio::time::Instant::now()
            .duration_since(self.start)
            .as_secs_f64()
            * 1e3
    }

    /// Moves the clock to `at_ns` from the start (never back).
    async fn advance_to(&self, at_ns: u64) {
        let now = tokio::time::Instant::now().duration_since(self.start);
        let at = Duration::from_nanos(at_ns);
        if at > now {
            tokio::time::advance(at - now).await;
        }
    }

    /// Handles the next event, at its time, if it is due by `until_ns` (any, for
    /// `None`); returns whether there was one.
    async fn step(&mut self, until_ns: Option<u64>, policy: &dyn Policy, m: &mut Measured) -> bool {
        if self
            .events
            .peek()
            .is_none_or(|Reverse(e)| until_ns.is_some_and(|t| e.at_ns > t))
        {
            return false;
        }
        let Some(Reverse(e)) = self.events.pop() else {
            return false;
        };
        self.advance_to(e.at_ns).await;
        self.on_event(e, policy, m);
        true
    }

    /// Sends request `index` (`r`, picked as `pick`, its slot `guard`) to engine
    /// `position` at `sent_ms`: its adapter loaded first when the engine does not hold
    /// it (at `sent.load_ms`), the engine's lookup and prefill, and the numbers.
    fn send(&mut self, index: usize, r: &Prepared, position: usize, sent_ms: f64, sent: Sent) {
        let Sent {
            pick,
            guard,
            decode_ms,
            load_ms,
        } = sent;
        let engine = &mut self.engines[position];
        let loaded = r.adapter.as_ref().is_some_and(|a| engine.use_adapter(a));
        let extra_ms = if loaded { load_ms } else { 0.0 };
        let cached = engine.arrive(
            sent_ms,
            index,
            (&r.hashes, r.prompt_tokens),
            extra_ms,
            r.output_tokens,
        );
        self.schedule(position);
        self.in_flight += 1;
        self.flying[index] = Some(InFlight {
            guard,
            pick,
            prompt_tokens: r.prompt_tokens as u64,
            cached_tokens: cached,
            arrival_ms: sent_ms,
            duration_ms: r.duration_ms,
            decode_ms,
        });
    }
}

/// A picked request on its way to its engine.
struct Sent {
    pick: Pick,
    guard: InFlightGuard,
    decode_ms: f64,
    /// What loading its adapter takes, when the engine does not hold it, in ms.
    load_ms: f64,
}

/// Replays `requests` (sorted by arrival) through `config`'s policy over `model`;
/// `seed` seeds the policies' random choices; `progress` is told after each request.
/// `contexts` are the requests' routing contexts (`prompt::extract` at the config's
/// `max_prompt_bytes`, scoped by their adapters), worked out once for every run.
/// `residency`: adapter requests prefer the workers that hold their adapter, as the
/// router's decision does (off: the policy alone places them). The policy's own upkeep
/// (the tree's eviction and age-out sweeps) runs beside the replay on the same clock.
pub async fn replay(
    config: &Config,
    model: &PoolModel,
    requests: &[Prepared],
    contexts: &[RouteContext<'_>],
    (seed, residency): (u64, bool),
    mut progress: impl FnMut(),
) -> Measured {
    let pool = std::sync::Arc::new(Pool::new(&config.workers, &config.circuit_breaker));
    // The run is this process's alone: nothing shared with other router replicas.
    let mut config = config.clone();
    config.state.redis_url = None;
    let routing = policy::build(&config, &pool);
    let policy = &*routing.policy;
    let (stop, shutdown) = crate::shutdown::channel();
    let upkeep = policy
        .background(std::sync::Arc::clone(&pool), shutdown)
        .map(tokio::spawn);
    let set = pool.set();
    let balance = policy::CacheParams::from(&config.cache);
    let mut sim = Sim::new(model, requests.len());
    let mut rng = StdRng::seed_from_u64(seed);
    let mut m = Measured {
        per_worker: vec![0; model.workers],
        ..Measured::default()
    };
    for (index, r) in requests.iter().enumerate() {
        let arrival_ns = ms_to_ns(r.arrival_ms);
        while sim.step(Some(arrival_ns), policy, &mut m).await {}
        sim.advance_to(arrival_ns).await;
        // At the client's limit: sent when a request ends (its TTFT counts from then).
        while model.concurrency > 0
            && sim.in_flight >= model.concurrency
            && sim.step(None, policy, &mut m).await
        {}
        let sent_ms = r.arrival_ms.max(sim.now_ms());
        progress();
        m.requests += 1;
        m.prompt_tokens += r.prompt_tokens as u64;
        m.available_tokens += sim
            .engines
            .iter()
            .map(|e| e.cached_tokens(&r.hashes, r.prompt_tokens))
            .max()
            .unwrap_or(0);
        let Some(ctx) = contexts.get(index) else {
            break;
        };
        let req = RouteRequest {
            ctx: Some(ctx),
            prepared: policy::Prepared::Nothing,
            session: None,
            tie: Some(ctx.digest),
            // As the proxy does (it moves them; the replay keeps its contexts).
            chain: ctx.chain.clone().into(),
            adapter: r
                .adapter
                .as_ref()
                .filter(|_| residency)
                .map(|name| policy::AdapterAsk {
                    name: std::sync::Arc::clone(name),
                    balance,
                }),
        };
        let Some((pick, mut guard)) =
            pick_slot(policy, &set, &req, &WorkerMask::default(), &mut rng)
        else {
            m.rejected += 1;
            continue;
        };
        guard.reserve_prefill(pick.prefill_tokens, ctx.total_len as u64);
        let worker = std::sync::Arc::clone(guard.worker());
        policy.observe(&req, &pick, &worker, Outcome::Served);
        let position = set
            .workers()
            .iter()
            .position(|w| w.id() == worker.id())
            .unwrap_or(0)
            .min(model.workers - 1);
        m.per_worker[position] += 1;
        m.peak_in_flight = m.peak_in_flight.max(worker.in_flight() as u64);
        m.predicted_tokens += pick.saved_tokens();
        let decode_ms = model.timing.decode_ms_per_token * r.output_tokens.saturating_sub(1) as f64;
        let load_ms = model.adapter_load_ms;
        let sent = Sent {
            pick,
            guard,
            decode_ms,
            load_ms,
        };
        sim.send(index, r, position, sent_ms, sent);
        let cached = sim.flying[index].as_ref().map_or(0, |f| f.cached_tokens);
        m.delivered_tokens += cached;
        if pick.saved_tokens() > 0 {
            m.predicted_hit_delivered += cached;
        }
    }
    while sim.step(None, policy, &mut m).await {}
    let upkeep = (stop, upkeep);
    finish(
        m,
        sim,
        requests,
        model,
        (routing.tree.as_deref(), &set),
        upkeep,
    )
    .await
}

/// `m` completed at the end of a replay: the policy's upkeep stopped after its last
/// sweep, what the tree's learning did, the answers that fell short, TTFTs sorted,
/// the engines' adapter loads, the arrivals' span.
async fn finish(
    mut m: Measured,
    sim: Sim,
    requests: &[Prepared],
    model: &PoolModel,
    (tree, set): (
        Option<&crate::tree::SharedTree>,
        &crate::pools::pool::WorkerSet,
    ),
    (stop, upkeep): (
        crate::shutdown::Trigger,
        Option<tokio::task::JoinHandle<()>>,
    ),
) -> Measured {
    // What the tree's learning did, once its last sweep ran.
    tokio::time::advance(crate::tree::evict::AGE_OUT_EVERY).await;
    stop.shutdown();
    if let Some(task) = upkeep {
        let _ = task.await;
    }
    use std::sync::atomic::Ordering::Relaxed;
    if let Some(tree) = tree {
        m.aged_out_bytes = tree.aged_out_bytes.load(Relaxed);
    }
    m.shortfalls = set
        .workers()
        .iter()
        .map(|w| w.hits().shortfalls.load(Relaxed))
        .sum();
    m.ttft_ms.sort_by(f64::total_cmp);
    if model.adapter_slots.is_some() {
        m.adapter_loads = Some(sim.engines.iter().map(EngineModel::adapter_loads).sum());
    }
    m.span_ms = match (requests.first(), requests.last()) {
        (Some(a), Some(b)) => b.arrival_ms - a.arrival_ms,
        _ => 0.0,
    };
    m
}
