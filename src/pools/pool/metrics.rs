//! The pool's families in `/metrics`: each worker's in-flight count, health, breaker
//! state, engine and LMCache signals and prefill accounting, refilled from the current
//! worker set at each scrape (a worker that left has none).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Unit;

use super::{Pool, WorkerSet};
use crate::exposition::family;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabels {
    worker: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BreakerLabels {
    worker: Arc<str>,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerResultLabels {
    worker: Arc<str>,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PlacementLabels {
    worker: Arc<str>,
    placement: &'static str,
}

#[derive(Debug, Default)]
struct Families {
    lora_slots: Family<WorkerLabels, Gauge>,
    lora_resident: Family<WorkerLabels, Gauge>,
    lora_requests: Family<PlacementLabels, Counter>,
    lora_loads: Family<WorkerResultLabels, Counter>,
    in_flight: Family<WorkerLabels, Gauge>,
    healthy: Family<WorkerLabels, Gauge>,
    breaker: Family<BreakerLabels, Gauge>,
    waiting: Family<WorkerLabels, Gauge<f64, AtomicU64>>,
    running: Family<WorkerLabels, Gauge<f64, AtomicU64>>,
    kv_usage: Family<WorkerLabels, Gauge<f64, AtomicU64>>,
    signal_age: Family<WorkerLabels, Gauge<f64, AtomicU64>>,
    scrapes: Family<WorkerResultLabels, Counter>,
    lmcache_occupancy: Family<WorkerLabels, Gauge<f64, AtomicU64>>,
    lmcache_polls: Family<WorkerResultLabels, Counter>,
    neutral_reads: Family<WorkerLabels, Counter>,
    saturated: Family<WorkerLabels, Gauge>,
    pending_tokens: Family<WorkerLabels, Gauge>,
    prefill_rate: Family<WorkerLabels, Gauge<f64, AtomicU64>>,
    prefill_base: Family<WorkerLabels, Gauge<f64, AtomicU64>>,
}

/// See the module docs.
pub struct PoolMetrics {
    pool: Arc<Pool>,
    families: Families,
}

impl std::fmt::Debug for PoolMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolMetrics").finish_non_exhaustive()
    }
}

impl PoolMetrics {
    pub fn new(pool: Arc<Pool>) -> Self {
        PoolMetrics {
            pool,
            families: Families::default(),
        }
    }

    /// In-flight counts, health and breaker states of `set`'s workers now.
    fn state(&self, set: &WorkerSet, now: Instant) {
        let f = &self.families;
        f.in_flight.clear();
        f.healthy.clear();
        f.breaker.clear();
        for w in set.workers() {
            let labels = WorkerLabels {
                worker: Arc::clone(w.label()),
            };
            f.in_flight.get_or_create(&labels).set(w.in_flight() as i64);
            f.healthy
                .get_or_create(&labels)
                .set(i64::from(w.is_healthy()));
            let state = w.breaker_state(now);
            for s in [
                crate::pools::pool::breaker::State::Closed,
                crate::pools::pool::breaker::State::Open,
                crate::pools::pool::breaker::State::HalfOpen,
            ] {
                f.breaker
                    .get_or_create(&BreakerLabels {
                        worker: Arc::clone(w.label()),
                        state: s.as_str(),
                    })
                    .set(i64::from(s == state));
            }
        }
    }

    fn signals(&self, set: &WorkerSet, now: Instant) {
        let g = &self.families;
        for f in [
            &g.waiting,
            &g.running,
            &g.kv_usage,
            &g.signal_age,
            &g.lmcache_occupancy,
            &g.prefill_rate,
            &g.prefill_base,
        ] {
            f.clear();
        }
        g.scrapes.clear();
        g.lmcache_polls.clear();
        g.saturated.clear();
        g.pending_tokens.clear();
        g.neutral_reads.clear();
        for w in set.workers() {
            let labels = WorkerLabels {
                worker: Arc::clone(w.label()),
            };
            let sig = w.signals();
            if let Some(load) = sig.engine() {
                g.waiting.get_or_create(&labels).set(load.waiting);
                g.running.get_or_create(&labels).set(load.running);
                if let Some(kv) = load.kv_usage {
                    g.kv_usage.get_or_create(&labels).set(kv);
                }
                g.signal_age
                    .get_or_create(&labels)
                    .set(now.saturating_duration_since(load.at).as_secs_f64());
            }
            if let Some(l) = sig.lmcache() {
                g.lmcache_occupancy.get_or_create(&labels).set(l.occupancy);
            }
            for (family, counts) in [
                (&g.scrapes, &sig.scrapes),
                (&g.lmcache_polls, &sig.lmcache_polls),
            ] {
                let (ok, failed, unparsable) = counts.get();
                for (result, n) in [("ok", ok), ("failed", failed), ("unparsable", unparsable)] {
                    family
                        .get_or_create(&WorkerResultLabels {
                            worker: Arc::clone(w.label()),
                            result,
                        })
                        .inc_by(n);
                }
            }
            g.saturated
                .get_or_create(&labels)
                .set(i64::from(sig.is_saturated(now)));
            g.neutral_reads
                .get_or_create(&labels)
                .inc_by(sig.neutral_reads.load(std::sync::atomic::Ordering::Relaxed));
            let (_, tokens) = w.prefill().pending();
            g.pending_tokens.get_or_create(&labels).set(tokens as i64);
            let rate = w.prefill().rate();
            g.prefill_rate
                .get_or_create(&labels)
                .set(1.0 / rate.secs_per_token);
            g.prefill_base.get_or_create(&labels).set(rate.base_s);
        }
    }
}

impl PoolMetrics {
    /// Each worker's LoRA adapter estimate and counts (`super::adapters`).
    fn adapters(&self, set: &WorkerSet) {
        use std::sync::atomic::Ordering::Relaxed;
        let f = &self.families;
        f.lora_slots.clear();
        f.lora_resident.clear();
        f.lora_requests.clear();
        f.lora_loads.clear();
        for w in set.workers() {
            let worker = || Arc::clone(w.label());
            let r = w.adapters();
            let labels = WorkerLabels { worker: worker() };
            f.lora_slots.get_or_create(&labels).set(r.slots() as i64);
            f.lora_resident
                .get_or_create(&labels)
                .set(r.resident().len() as i64);
            for (p, n) in super::adapters::Placement::ALL.iter().zip(r.placed()) {
                f.lora_requests
                    .get_or_create(&PlacementLabels {
                        worker: worker(),
                        placement: p.as_str(),
                    })
                    .inc_by(n);
            }
            for (result, n) in [
                ("ok", r.loads_ok.load(Relaxed)),
                ("failed", r.loads_failed.load(Relaxed)),
            ] {
                f.lora_loads
                    .get_or_create(&WorkerResultLabels {
                        worker: worker(),
                        result,
                    })
                    .inc_by(n);
            }
        }
    }

    /// The adapter families (filled by [`PoolMetrics::adapters`]).
    fn encode_adapters(&self, enc: &mut DescriptorEncoder) -> std::fmt::Result {
        let f = &self.families;
        family(
            enc,
            "worker_lora_slots",
            "LoRA adapters the worker holds at once: workers[].max_lora, else its engine's report, else 1",
            None,
            &f.lora_slots,
        )?;
        family(
            enc,
            "worker_lora_resident",
            "LoRA adapters the router estimates the worker holds (those it sent there last, within its slots, and those its engine reports active)",
            None,
            &f.lora_resident,
        )?;
        family(
            enc,
            "worker_lora_requests",
            "LoRA adapter requests sent to the worker by placement: resident (it held the adapter), free_slot (a load that evicts nothing), evicting (a load that evicts another adapter)",
            None,
            &f.lora_requests,
        )?;
        family(
            enc,
            "lora_loads",
            "LoRA adapters loaded onto the worker on demand (adapters.load_on_demand) by result: ok, failed",
            None,
            &f.lora_loads,
        )?;
        Ok(())
    }
}

impl Collector for PoolMetrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let set = self.pool.set();
        let now = super::now();
        self.state(&set, now);
        self.signals(&set, now);
        self.adapters(&set);
        let f = &self.families;
        family(
            &mut enc,
            "worker_in_flight",
            "Requests in flight per worker",
            None,
            &f.in_flight,
        )?;
        family(
            &mut enc,
            "worker_healthy",
            "1 when the worker passes health checks",
            None,
            &f.healthy,
        )?;
        family(
            &mut enc,
            "worker_breaker_state",
            "1 for the worker's current circuit-breaker state",
            None,
            &f.breaker,
        )?;
        family(
            &mut enc,
            "worker_engine_waiting",
            "Requests queued inside the worker's engine at its last engine_metrics scrape (vllm:num_requests_waiting, sglang:num_queue_reqs)",
            None,
            &f.waiting,
        )?;
        family(
            &mut enc,
            "worker_engine_running",
            "Requests running in the worker's engine at its last scrape (vllm:num_requests_running, sglang:num_running_reqs)",
            None,
            &f.running,
        )?;
        family(
            &mut enc,
            "worker_engine_kv_cache_usage",
            "KV-cache usage 0-1 at the last scrape (vllm:kv_cache_usage_perc, sglang:token_usage)",
            None,
            &f.kv_usage,
        )?;
        family(
            &mut enc,
            "worker_engine_signal_age",
            "Seconds since the worker's last good engine_metrics scrape (older than stale_secs = neutral)",
            Some(&Unit::Seconds),
            &f.signal_age,
        )?;
        family(
            &mut enc,
            "engine_scrapes",
            "engine_metrics scrapes per worker by result: ok, failed (no answer or non-2xx), unparsable (no known metrics)",
            None,
            &f.scrapes,
        )?;
        family(
            &mut enc,
            "worker_lmcache_occupancy",
            "LMCache occupancy 0-1 from the worker's last good lmcache signal",
            None,
            &f.lmcache_occupancy,
        )?;
        family(
            &mut enc,
            "lmcache_polls",
            "LMCache signal polls per worker by result: ok, failed, unparsable",
            None,
            &f.lmcache_polls,
        )?;
        family(
            &mut enc,
            "signal_neutral_reads",
            "Routing decisions that found the worker's engine or LMCache signal missing or stale, so neutral",
            None,
            &f.neutral_reads,
        )?;
        family(
            &mut enc,
            "worker_saturated",
            "1 while the worker is avoided after a 429 or a 503 with Retry-After",
            None,
            &f.saturated,
        )?;
        family(
            &mut enc,
            "worker_pending_prefill_tokens",
            "Estimated uncached prompt tokens of requests sent to the worker and not yet answered with a first byte",
            None,
            &f.pending_tokens,
        )?;
        family(
            &mut enc,
            "worker_prefill_tokens_per_second",
            "The worker's prefill rate learned from its streamed answers (TTFT and cached tokens); the prior until it has answered enough",
            None,
            &f.prefill_rate,
        )?;
        family(
            &mut enc,
            "worker_prefill_base",
            "The worker's learned fixed cost per request, seconds",
            Some(&Unit::Seconds),
            &f.prefill_base,
        )?;
        self.encode_adapters(&mut enc)
    }
}
