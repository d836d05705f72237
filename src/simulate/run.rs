//! One simulated replay: the log's requests, in arrival order, through a real policy
//! (`policy::build`) in front of N [`EngineModel`]s, on tokio's paused clock.
//!
//! Each request is routed as the proxy routes it: `prompt::extract` of its body, the
//! [`pick_slot`] the proxy uses (candidates, usability, the policy's `pick`, the
//! in-flight guard), the guard's prefill reservation, `Policy::observe(Served)` at once
//! (a streamed answer's headers come before its prefill, as sim-engine sends them), the
//! guard's `first_byte` at the end of prefill, and at the last byte the proxy's
//! [`settle_usage`] with the engine's `cached_tokens` and `Policy::answered` on a
//! shortfall; dropping the guard ends the request's in-flight count. Between events the
//! clock is advanced (`tokio::time::advance`) to the next one, so every state machine
//! the policies read (learned rates, drain estimates, staleness) sees simulated time.
//! Must run inside a current-thread runtime whose time is paused.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::StdRng;

use super::engine::{EngineModel, Served, Timing};
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

/// An event of a request in flight, in time order (ties: first byte before last, then
/// by request index, so runs are deterministic).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Event {
    at_ns: u64,
    kind: u8,
    index: usize,
}

const FIRST_BYTE: u8 = 0;
const LAST_BYTE: u8 = 1;

struct InFlight {
    guard: InFlightGuard,
    pick: Pick,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// Replays `requests` (sorted by arrival) through `config`'s policy over `model`;
/// `seed` seeds the policies' random choices; `progress` is told after each request.
/// `contexts` are the requests' routing contexts (`prompt::extract` at the config's
/// `max_prompt_bytes`, scoped by their adapters), worked out once for every run.
/// `residency`: adapter requests prefer the workers that hold their adapter, as the
/// router's decision does (off: the policy alone places them).
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
    let policy = policy::build(&config, &pool).policy;
    let set = pool.set();
    let mut engines = engines(model);
    let balance = policy::CacheParams::from(&config.cache);
    let mut rng = StdRng::seed_from_u64(seed);
    let start = tokio::time::Instant::now();
    let mut m = Measured {
        per_worker: vec![0; model.workers],
        ..Measured::default()
    };
    let mut events: BinaryHeap<Reverse<Event>> = BinaryHeap::new();
    let mut flying: Vec<Option<InFlight>> = (0..requests.len()).map(|_| None).collect();
    let block_tokens = model.block_tokens.get() as u64;
    let advance_to = |at_ns: u64| async move {
        let now = tokio::time::Instant::now().duration_since(start);
        let at = Duration::from_nanos(at_ns);
        if at > now {
            tokio::time::advance(at - now).await;
        }
    };
    let ms_to_ns = |ms: f64| (ms.max(0.0) * 1e6) as u64;
    for (index, r) in requests.iter().enumerate() {
        let arrival_ns = ms_to_ns(r.arrival_ms);
        while events
            .peek()
            .is_some_and(|Reverse(e)| e.at_ns <= arrival_ns)
        {
            let Some(Reverse(e)) = events.pop() else {
                break;
            };
            advance_to(e.at_ns).await;
            on_event(e, &mut flying, &*policy, block_tokens);
        }
        advance_to(arrival_ns).await;
        progress();
        m.requests += 1;
        m.prompt_tokens += r.prompt_tokens as u64;
        m.available_tokens += engines
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
            pick_slot(&*policy, &set, &req, &WorkerMask::default(), &mut rng)
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
            .unwrap_or(0);
        let engine = &mut engines[position.min(model.workers - 1)];
        let (served, last_ms) = serve_on(engine, r, model.adapter_load_ms);
        m.per_worker[position] += 1;
        m.peak_in_flight = m.peak_in_flight.max(worker.in_flight() as u64);
        m.predicted_tokens += pick.saved_tokens();
        m.delivered_tokens += served.cached_tokens;
        m.ttft_ms.push(served.first_token_ms - r.arrival_ms);
        events.push(Reverse(Event {
            at_ns: ms_to_ns(served.first_token_ms),
            kind: FIRST_BYTE,
            index,
        }));
        events.push(Reverse(Event {
            at_ns: ms_to_ns(last_ms),
            kind: LAST_BYTE,
            index,
        }));
        flying[index] = Some(InFlight {
            guard,
            pick,
            prompt_tokens: r.prompt_tokens as u64,
            cached_tokens: served.cached_tokens,
        });
    }
    while let Some(Reverse(e)) = events.pop() {
        advance_to(e.at_ns).await;
        on_event(e, &mut flying, &*policy, block_tokens);
    }
    finish(m, &engines, requests, model)
}

/// `r` served by `engine` (its adapter loaded first when it does not hold it, at
/// `load_ms`): what the engine served, and when its last byte goes out (ms).
fn serve_on(engine: &mut EngineModel, r: &Prepared, load_ms: f64) -> (Served, f64) {
    let loaded = r.adapter.as_ref().is_some_and(|a| engine.use_adapter(a));
    let load_ms = if loaded { load_ms } else { 0.0 };
    let served = engine.serve_after(r.arrival_ms, &r.hashes, r.prompt_tokens, load_ms);
    let last_ms = match r.duration_ms {
        Some(d) => (r.arrival_ms + d).max(served.first_token_ms),
        None => {
            served.first_token_ms
                + engine.timing().decode_ms_per_token * r.output_tokens.saturating_sub(1) as f64
        }
    };
    (served, last_ms)
}

/// The model's engines, empty, each with its adapter slots when adapters are modelled.
fn engines(model: &PoolModel) -> Vec<EngineModel> {
    (0..model.workers)
        .map(|_| {
            let e = EngineModel::new(model.kv_blocks, model.block_tokens, model.timing);
            match model.adapter_slots {
                Some(n) => e.with_adapter_slots(n),
                None => e,
            }
        })
        .collect()
}

/// `m` completed at the end of a replay: TTFTs sorted, the engines' adapter loads, the
/// arrivals' span.
fn finish(
    mut m: Measured,
    engines: &[EngineModel],
    requests: &[Prepared],
    model: &PoolModel,
) -> Measured {
    m.ttft_ms.sort_by(f64::total_cmp);
    if model.adapter_slots.is_some() {
        m.adapter_loads = Some(engines.iter().map(EngineModel::adapter_loads).sum());
    }
    m.span_ms = match (requests.first(), requests.last()) {
        (Some(a), Some(b)) => b.arrival_ms - a.arrival_ms,
        _ => 0.0,
    };
    m
}

/// A request's event: its first byte ends the guard's prefill; its last byte settles
/// the engine's usage as the proxy does ([`settle_usage`], the drift, a shortfall told to
/// the policy) and ends its in-flight count.
fn on_event(e: Event, flying: &mut [Option<InFlight>], policy: &dyn Policy, block_tokens: u64) {
    let Some(f) = flying[e.index].as_mut() else {
        return;
    };
    if e.kind == FIRST_BYTE {
        f.guard.first_byte();
        return;
    }
    let Some(f) = flying[e.index].take() else {
        return;
    };
    let (delivered, shortfall) = settle_usage(
        &f.guard,
        f.prompt_tokens,
        Some(f.cached_tokens),
        true,
        (f.pick.saved_tokens(), f.pick.stamp),
        block_tokens,
    );
    // The worker's drift, as the proxy counts it: the tree's learning weighs a
    // short answer against it.
    if let Some(d) = delivered {
        let numbers = [f.pick.available_tokens(), f.pick.saved_tokens(), d];
        f.guard.worker().hits().record(numbers, 0.0, Duration::MAX);
    }
    if shortfall.is_some() {
        let answer = Answer {
            shortfall,
            delivered_tokens: delivered,
            ..Answer::default()
        };
        policy.answered(f.guard.worker(), &answer);
    }
    drop(f.guard);
}
