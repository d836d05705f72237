//! Summaries of replay results: hit rate, TTFT and latency percentiles,
//! throughput and how requests spread over replicas. Pure functions, no I/O.

use std::collections::BTreeMap;
use std::fmt;

use crate::replay::RequestResult;

/// Nearest-rank percentiles of a sample, in the sample's unit (ms here).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Arithmetic mean.
    pub mean: f64,
}

impl Percentiles {
    /// Percentiles of `values` (all zero when empty).
    pub fn of(values: &[f64]) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let rank = |p: f64| nearest_rank(&v, p);
        Self {
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            mean: v.iter().sum::<f64>() / v.len() as f64,
        }
    }
}

/// The value at quantile `p` (0 to 1) of `sorted` (ascending), by nearest rank; 0 when
/// empty.
pub fn nearest_rank(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// The samples of metric `name` in a Prometheus text exposition, summed by the values
/// of `labels` (in that order; "" where a series lacks one): e.g. a router's
/// `cache_aware_router_hedges_total` by `["outcome"]`, or a counter's total by `[]`.
pub fn series_by(text: &str, name: &str, labels: &[&str]) -> BTreeMap<Vec<String>, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (n, pairs) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.strip_suffix('}').unwrap_or(rest)),
            None => (series, ""),
        };
        let Ok(v) = value.parse::<f64>() else {
            continue;
        };
        if n != name {
            continue;
        }
        let found = label_pairs(pairs);
        let key = labels
            .iter()
            .map(|l| {
                found
                    .iter()
                    .find(|(k, _)| k == l)
                    .map(|(_, v)| v.clone())
                    .unwrap_or_default()
            })
            .collect();
        *out.entry(key).or_insert(0.0) += v;
    }
    out
}

/// `k="v",k2="v2"` (values with `\"` and `\\` escapes) as pairs.
fn label_pairs(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some((key, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, e)) = chars.next() {
                        value.push(if e == 'n' { '\n' } else { e });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.push((key.trim_start_matches(',').trim().to_string(), value));
        rest = &after[end..];
    }
    out
}

/// Aggregate of one replay.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Summary {
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed (status, broken stream, timeout, missing usage), after
    /// any retry.
    pub errors: usize,
    /// Requests sent a second time, to the next URL (see `ReplayConfig::failover`).
    pub retried: usize,
    /// Σ prompt tokens reported in usage (successful requests).
    pub prompt_tokens: u64,
    /// Σ cached tokens reported in usage.
    pub cached_tokens: u64,
    /// Σ completion tokens reported in usage.
    pub completion_tokens: u64,
    /// `cached_tokens / prompt_tokens` (0 when nothing was reported).
    pub hit_rate: f64,
    /// Time to first token of successful requests, in ms.
    pub ttft_ms: Percentiles,
    /// End-to-end latency of successful requests, in ms.
    pub latency_ms: Percentiles,
    /// Inter-token latency: every gap between two consecutive content chunks of a
    /// successful request, pooled over the requests, in ms.
    pub itl_ms: Percentiles,
    /// Requests an engine answered for another model than they named
    /// ([`RequestResult::wrong_model`]).
    pub wrong_model: usize,
    /// Requests per model named.
    pub per_model: BTreeMap<String, usize>,
    /// From the first send to the last completion, in s.
    pub duration_s: f64,
    /// Successful requests per second over `duration_s`.
    pub req_per_s: f64,
    /// Completion tokens per second over `duration_s`.
    pub out_tok_per_s: f64,
    /// Requests served per replica (`x-sim-engine`), including known idle ones.
    pub per_engine: BTreeMap<String, usize>,
    /// Most requests on one replica over the mean per replica (1.0 = even).
    pub max_over_mean: f64,
    /// Worst delay between a request's schedule and its send, in ms.
    pub max_lateness_ms: f64,
    /// The first error message, for the report.
    pub first_error: Option<String>,
    /// Engine queues sampled during the replay (`None`: not sampled; see
    /// [`QueueStats`]).
    pub queue: Option<QueueStats>,
}

/// What one engine's `GET /metrics` says about its queue, in requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineLoad {
    /// Waiting for prefill: `vllm:num_requests_waiting` or `sglang:num_queue_reqs`.
    pub waiting: u64,
    /// Running: `vllm:num_requests_running` or `sglang:num_running_reqs`.
    pub running: u64,
    /// The engine's own high-water mark of `waiting`
    /// (`sim:num_requests_waiting_peak`, sim-engine only).
    pub waiting_peak: Option<u64>,
}

/// Reads [`EngineLoad`] from Prometheus text (vLLM or SGLang names; values of
/// several label sets of one name add up). `None` unless both a waiting and a
/// running gauge are present.
pub fn parse_engine_load(text: &str) -> Option<EngineLoad> {
    let (mut waiting, mut running, mut peak) = (None::<f64>, None::<f64>, None::<f64>);
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        let slot = match name {
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => &mut waiting,
            "vllm:num_requests_running" | "sglang:num_running_reqs" => &mut running,
            "sim:num_requests_waiting_peak" => &mut peak,
            _ => continue,
        };
        // The value follows the labels (which may hold spaces inside quotes).
        let rest = match line[name_end..].strip_prefix('{') {
            Some(labels) => labels.rsplit_once('}').map_or("", |(_, v)| v),
            None => &line[name_end..],
        };
        if let Some(v) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
        {
            *slot = Some(slot.unwrap_or(0.0) + v);
        }
    }
    Some(EngineLoad {
        waiting: waiting?.round() as u64,
        running: running?.round() as u64,
        waiting_peak: peak.map(|p| p.round() as u64),
    })
}

/// Engine queues over a replay, from polling every engine's `/metrics` at a fixed
/// interval (see `matrix::QueueSampler`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct QueueStats {
    /// Engine names, in the order of the samples.
    pub engines: Vec<String>,
    /// Longest queue seen per engine, in requests: the most `waiting` of any
    /// sample, or the engine's own high-water mark if it reports a higher one.
    pub peak_waiting: Vec<u64>,
    /// Samples in which every engine answered.
    pub samples: u64,
    /// Of those, samples in which some engine had ≥ 2 requests waiting while
    /// another had nothing waiting and nothing running.
    pub queued_while_idle: u64,
    /// Samples dropped because some engine did not answer.
    pub incomplete: u64,
}

impl QueueStats {
    /// No samples yet, for `engines`.
    pub fn new(engines: &[String]) -> Self {
        Self {
            engines: engines.to_vec(),
            peak_waiting: vec![0; engines.len()],
            ..Self::default()
        }
    }

    /// Peaks of one poll only (e.g. after the replay, for the engines' own
    /// high-water marks), not counted as a sample.
    pub fn record_peaks(&mut self, loads: &[Option<EngineLoad>]) {
        for (peak, load) in self.peak_waiting.iter_mut().zip(loads) {
            if let Some(l) = load {
                *peak = (*peak).max(l.waiting).max(l.waiting_peak.unwrap_or(0));
            }
        }
    }

    /// One poll of every engine (`None`: that engine did not answer).
    pub fn record(&mut self, loads: &[Option<EngineLoad>]) {
        self.record_peaks(loads);
        let all: Option<Vec<EngineLoad>> = loads.iter().copied().collect();
        let Some(all) = all.filter(|a| a.len() == self.engines.len()) else {
            self.incomplete += 1;
            return;
        };
        self.samples += 1;
        let queued_while_idle = all.iter().enumerate().any(|(i, q)| {
            q.waiting >= 2
                && all
                    .iter()
                    .enumerate()
                    .any(|(j, o)| j != i && o.waiting == 0 && o.running == 0)
        });
        self.queued_while_idle += u64::from(queued_while_idle);
    }

    /// Longest queue of any engine, in requests.
    pub fn longest_queue(&self) -> u64 {
        self.peak_waiting.iter().copied().max().unwrap_or(0)
    }

    /// Share of samples "queued while idle" (0–1; 0 without samples).
    pub fn queued_while_idle_share(&self) -> f64 {
        if self.samples == 0 {
            0.0
        } else {
            self.queued_while_idle as f64 / self.samples as f64
        }
    }
}

impl fmt::Display for QueueStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let peaks: Vec<String> = self
            .engines
            .iter()
            .zip(&self.peak_waiting)
            .map(|(e, p)| format!("{e}={p}"))
            .collect();
        write!(
            f,
            "longest queue {} (per engine {}); queued while idle in {:.1} % of {} samples",
            self.longest_queue(),
            peaks.join(" "),
            100.0 * self.queued_while_idle_share(),
            self.samples
        )?;
        if self.incomplete > 0 {
            write!(f, " ({} incomplete samples dropped)", self.incomplete)?;
        }
        Ok(())
    }
}

/// Summarises `results`; `engines` names replicas that should appear in the
/// spread even if they served nothing (may be empty).
pub fn summarize(results: &[RequestResult], engines: &[String]) -> Summary {
    let ok: Vec<&RequestResult> = results.iter().filter(|r| r.is_ok()).collect();
    let prompt_tokens: u64 = ok.iter().filter_map(|r| r.prompt_tokens).sum();
    let cached_tokens: u64 = ok.iter().filter_map(|r| r.cached_tokens).sum();
    let completion_tokens: u64 = ok.iter().filter_map(|r| r.completion_tokens).sum();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
    let latency: Vec<f64> = ok.iter().map(|r| r.latency_ms).collect();
    let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl_ms.iter().copied()).collect();
    let mut per_model: BTreeMap<String, usize> = BTreeMap::new();
    for r in results {
        *per_model.entry(r.model.clone()).or_default() += 1;
    }
    let first = results
        .iter()
        .map(|r| r.sent_ms)
        .fold(f64::INFINITY, f64::min);
    let last = results
        .iter()
        .map(|r| r.sent_ms + r.latency_ms)
        .fold(0.0, f64::max);
    let duration_s = if results.is_empty() {
        0.0
    } else {
        ((last - first) / 1000.0).max(1e-9)
    };
    let mut per_engine: BTreeMap<String, usize> = engines.iter().map(|e| (e.clone(), 0)).collect();
    for r in &ok {
        let name = r.engine.clone().unwrap_or_else(|| "(no header)".into());
        *per_engine.entry(name).or_default() += 1;
    }
    let max = per_engine.values().copied().max().unwrap_or(0) as f64;
    let mean = if per_engine.is_empty() {
        0.0
    } else {
        per_engine.values().sum::<usize>() as f64 / per_engine.len() as f64
    };
    let rate = |x: f64| {
        if duration_s > 0.0 {
            x / duration_s
        } else {
            0.0
        }
    };
    Summary {
        requests: results.len(),
        errors: results.len() - ok.len(),
        retried: results.iter().filter(|r| r.retried).count(),
        prompt_tokens,
        cached_tokens,
        completion_tokens,
        hit_rate: if prompt_tokens > 0 {
            cached_tokens as f64 / prompt_tokens as f64
        } else {
            0.0
        },
        ttft_ms: Percentiles::of(&ttft),
        latency_ms: Percentiles::of(&latency),
        itl_ms: Percentiles::of(&itl),
        wrong_model: results.iter().filter(|r| r.wrong_model()).count(),
        per_model,
        duration_s,
        req_per_s: rate(ok.len() as f64),
        out_tok_per_s: rate(completion_tokens as f64),
        per_engine,
        max_over_mean: if mean > 0.0 { max / mean } else { 0.0 },
        max_lateness_ms: results
            .iter()
            .map(|r| r.sent_ms - r.scheduled_ms)
            .fold(0.0, f64::max),
        first_error: results.iter().find_map(|r| r.error.clone()),
        queue: None,
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "requests         {} ({} errors{})",
            self.requests,
            self.errors,
            if self.retried > 0 {
                format!(", {} retried on the next URL", self.retried)
            } else {
                String::new()
            }
        )?;
        writeln!(
            f,
            "prefix hit rate  {:.3} ({} cached of {} prompt tokens)",
            self.hit_rate, self.cached_tokens, self.prompt_tokens
        )?;
        let p = |x: &Percentiles| {
            format!(
                "p50 {:.0} / p90 {:.0} / p99 {:.0} / mean {:.0} ms",
                x.p50, x.p90, x.p99, x.mean
            )
        };
        writeln!(f, "TTFT             {}", p(&self.ttft_ms))?;
        writeln!(f, "latency          {}", p(&self.latency_ms))?;
        if self.itl_ms != Percentiles::default() {
            writeln!(f, "ITL              {}", p(&self.itl_ms))?;
        }
        writeln!(
            f,
            "throughput       {:.1} req/s, {:.0} output tok/s over {:.1} s",
            self.req_per_s, self.out_tok_per_s, self.duration_s
        )?;
        let spread: Vec<String> = self
            .per_engine
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        writeln!(
            f,
            "per replica      {} (max/mean {:.2})",
            spread.join(" "),
            self.max_over_mean
        )?;
        write!(f, "max send lateness {:.0} ms", self.max_lateness_ms)?;
        if let Some(q) = &self.queue {
            write!(f, "\nqueues           {q}")?;
        }
        if let Some(e) = &self.first_error {
            write!(f, "\nfirst error      {e}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = Percentiles::of(&v);
        assert_eq!((p.p50, p.p90, p.p99), (50.0, 90.0, 99.0));
        assert_eq!(Percentiles::of(&[7.0]).p99, 7.0);
        assert_eq!(nearest_rank(&v, 1.0), 100.0);
        assert_eq!(nearest_rank(&[], 0.5), 0.0);
    }

    #[test]
    fn series_are_summed_by_the_labels_asked_for() {
        let text = "# TYPE cache_aware_router_hedges_total counter\n\
                    cache_aware_router_hedges_total{outcome=\"won\"} 3\n\
                    cache_aware_router_hedges_total{outcome=\"lost\"} 1\n\
                    cache_aware_router_hedges_total_other{outcome=\"won\"} 50\n\
                    m{cause=\"a,\\\"b\",outcome=\"won\"} 2\n\
                    m{outcome=\"won\"} 1.5\n\
                    m 4\n";
        let key = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let hedges = series_by(text, "cache_aware_router_hedges_total", &["outcome"]);
        assert_eq!(hedges.get(&key(&["won"])), Some(&3.0));
        assert_eq!(hedges.get(&key(&["lost"])), Some(&1.0));
        assert_eq!(hedges.len(), 2);
        let m = series_by(text, "m", &["cause", "outcome"]);
        assert_eq!(m.get(&key(&["a,\"b", "won"])), Some(&2.0));
        assert_eq!(m.get(&key(&["", "won"])), Some(&1.5));
        assert_eq!(m.get(&key(&["", ""])), Some(&4.0));
        assert_eq!(series_by(text, "m", &[]).get(&key(&[])), Some(&7.5));
    }

    #[test]
    fn engine_load_reads_vllm_and_sglang_names() {
        let vllm = "# HELP vllm:num_requests_waiting x\n# TYPE vllm:num_requests_waiting gauge\n\
                    vllm:num_requests_waiting{engine=\"0\",model_name=\"a b\"} 3\n\
                    vllm:num_requests_waiting{engine=\"1\",model_name=\"a b\"} 2.0\n\
                    vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 1\n\
                    vllm:num_requests_waiting_total 99\n\
                    sim:num_requests_waiting_peak{engine=\"0\"} 7\n";
        assert_eq!(
            parse_engine_load(vllm),
            Some(EngineLoad {
                waiting: 5,
                running: 1,
                waiting_peak: Some(7)
            })
        );
        let sglang = "sglang:num_queue_reqs{model_name=\"m\"} 4.0\nsglang:num_running_reqs 0\n";
        assert_eq!(
            parse_engine_load(sglang),
            Some(EngineLoad {
                waiting: 4,
                running: 0,
                waiting_peak: None
            })
        );
        assert_eq!(parse_engine_load("vllm:num_requests_waiting 1\n"), None);
    }

    #[test]
    fn queue_stats_count_queued_while_idle() {
        let names: Vec<String> = ["e0", "e1", "e2"].map(String::from).to_vec();
        let mut q = QueueStats::new(&names);
        let l = |waiting, running| {
            Some(EngineLoad {
                waiting,
                running,
                waiting_peak: None,
            })
        };
        // e0 queues 2 while e2 is idle: counted.
        q.record(&[l(2, 1), l(0, 1), l(0, 0)]);
        // A queue of 1 does not count; neither does a busy but unqueued engine.
        q.record(&[l(1, 1), l(0, 0), l(0, 0)]);
        q.record(&[l(3, 1), l(0, 1), l(0, 1)]);
        // An engine that did not answer: dropped, but its peers' peaks count.
        q.record(&[l(9, 1), None, l(0, 0)]);
        assert_eq!((q.samples, q.queued_while_idle, q.incomplete), (3, 1, 1));
        assert!((q.queued_while_idle_share() - 1.0 / 3.0).abs() < 1e-9);
        q.record_peaks(&[
            None,
            Some(EngineLoad {
                waiting: 0,
                running: 0,
                waiting_peak: Some(4),
            }),
            l(0, 0),
        ]);
        assert_eq!(q.peak_waiting, [9, 4, 0]);
        assert_eq!(q.longest_queue(), 9);
        assert_eq!(q.samples, 3);
        assert!(
            q.to_string()
                .starts_with("longest queue 9 (per engine e0=9 e1=4 e2=0)")
        );
    }
}
