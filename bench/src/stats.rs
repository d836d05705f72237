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
        let rank = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Self {
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            mean: v.iter().sum::<f64>() / v.len() as f64,
        }
    }
}

/// Aggregate of one replay.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Summary {
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed (status, broken stream, timeout, missing usage).
    pub errors: usize,
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
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "requests         {} ({} errors)",
            self.requests, self.errors
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
    }
}
