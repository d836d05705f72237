//! `GET /metrics`: the engine's counters as Prometheus text, under vLLM's or SGLang's
//! metric names, plus the simulator's own `sim:` rows.

use super::{Engine, EngineStats};

/// Which serving engine's metric names `GET /metrics` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MetricsFlavor {
    /// vLLM: `vllm:num_requests_waiting`, `vllm:num_requests_running`,
    /// `vllm:kv_cache_usage_perc`, ... with labels `{engine="0",model_name="M"}`.
    #[default]
    Vllm,
    /// SGLang: `sglang:num_queue_reqs`, `sglang:num_running_reqs`,
    /// `sglang:token_usage`, ... with labels `{model_name="M"}`.
    Sglang,
}

impl MetricsFlavor {
    /// `vllm` or `sglang` (what [`std::str::FromStr`] reads).
    pub fn as_str(self) -> &'static str {
        match self {
            MetricsFlavor::Vllm => "vllm",
            MetricsFlavor::Sglang => "sglang",
        }
    }
}

impl std::fmt::Display for MetricsFlavor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for MetricsFlavor {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "vllm" => Ok(MetricsFlavor::Vllm),
            "sglang" => Ok(MetricsFlavor::Sglang),
            other => Err(format!(
                "unknown metrics flavor {other:?}: use vllm or sglang"
            )),
        }
    }
}

/// One exposed series: name, type, help text, value.
type Row = (&'static str, &'static str, &'static str, String);

fn gauge(name: &'static str, help: &'static str, value: impl ToString) -> Row {
    (name, "gauge", help, value.to_string())
}

fn counter(name: &'static str, help: &'static str, value: impl ToString) -> Row {
    (name, "counter", help, value.to_string())
}

impl Engine {
    /// Prometheus text exposition: vLLM's or SGLang's metric names (see
    /// [`MetricsFlavor`]), then the simulator's own rows, in both flavors:
    /// `sim:num_requests_waiting_peak` (gauge, requests), `sim:rejected_total`
    /// (counter, requests answered 429), `sim:embedding_requests_total`
    /// (counter, `/v1/embeddings` requests answered 200),
    /// `sim:prefill_tokens_computed_total` (counter, tokens) and the hand-off counters
    /// `sim:kv_handoffs_{sent,received,invalid}_total` (requests) and
    /// `sim:kv_transferred_tokens_total` (tokens), `sim:stalled_total` (counter,
    /// requests whose first token was held back), and the histogram
    /// `sim:inter_token_latency_seconds` (the engine's own clock, simulated seconds;
    /// see `itl`).
    pub fn metrics_text(&self) -> String {
        let s = self.stats();
        let model = escape_label(&self.inner.cfg.model);
        let usage = s.kv_blocks_used as f64 / self.lock_cache().capacity().max(1) as f64;
        let (labels, mut rows) = match self.inner.cfg.metrics_flavor {
            MetricsFlavor::Vllm => (
                format!("{{engine=\"0\",model_name=\"{model}\"}}"),
                vllm_rows(&s, usage),
            ),
            MetricsFlavor::Sglang => (
                format!("{{model_name=\"{model}\"}}"),
                sglang_rows(&s, usage, self.inner.cfg.block_size),
            ),
        };
        rows.extend(sim_rows(&s));
        let mut out = String::new();
        for (name, kind, help, value) in rows {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{labels} {value}\n"
            ));
        }
        let inner = labels.trim_start_matches('{').trim_end_matches('}');
        out.push_str(&self.inner.counters.itl.exposition(inner));
        out
    }
}

/// vLLM's series; `usage` is the fraction of cache blocks in use.
fn vllm_rows(s: &EngineStats, usage: f64) -> Vec<Row> {
    vec![
        gauge(
            "vllm:num_requests_running",
            "Requests in prefill or decode.",
            s.running,
        ),
        gauge(
            "vllm:num_requests_waiting",
            "Requests queued for prefill.",
            s.waiting,
        ),
        gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of prefix cache blocks in use (1 = 100 percent).",
            usage,
        ),
        counter(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in tokens.",
            s.cache_queries,
        ),
        counter(
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in tokens.",
            s.cache_hits,
        ),
        counter(
            "vllm:prompt_tokens_total",
            "Prompt tokens processed.",
            s.prompt_tokens,
        ),
        counter(
            "vllm:generation_tokens_total",
            "Generation tokens produced.",
            s.generation_tokens,
        ),
        counter(
            "vllm:request_success_total",
            "Requests that finished generating.",
            s.requests_finished,
        ),
    ]
}

/// SGLang's series; `usage` is the fraction of cache blocks in use.
fn sglang_rows(s: &EngineStats, usage: f64, block_size: usize) -> Vec<Row> {
    let hit_rate = if s.cache_queries > 0 {
        s.cache_hits as f64 / s.cache_queries as f64
    } else {
        0.0
    };
    let used_tokens = s.kv_blocks_used * block_size as u64;
    vec![
        gauge(
            "sglang:num_running_reqs",
            "The number of running requests",
            s.running,
        ),
        gauge(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue",
            s.waiting,
        ),
        gauge(
            "sglang:token_usage",
            "The token usage (fraction of KV cache in use, 0-1)",
            usage,
        ),
        gauge(
            "sglang:num_used_tokens",
            "The number of used tokens",
            used_tokens,
        ),
        gauge(
            "sglang:cache_hit_rate",
            "The cache hit rate (cached over prompt tokens since start)",
            hit_rate,
        ),
        counter(
            "sglang:prompt_tokens_total",
            "Number of prefill tokens processed.",
            s.prompt_tokens,
        ),
        counter(
            "sglang:generation_tokens_total",
            "Number of generation tokens processed.",
            s.generation_tokens,
        ),
    ]
}

/// The simulator's own series, the same in both flavors.
fn sim_rows(s: &EngineStats) -> Vec<Row> {
    vec![
        gauge(
            "sim:num_requests_waiting_peak",
            "Most requests queued for prefill at once since start.",
            s.waiting_peak,
        ),
        counter(
            "sim:rejected_total",
            "Generation requests answered 429 because max_waiting requests were queued.",
            s.rejected,
        ),
        counter(
            "sim:embedding_requests_total",
            "Embedding requests answered (outside the prefill queue and the prefix cache).",
            s.embedding_requests,
        ),
        counter(
            "sim:prefill_tokens_computed_total",
            "Prompt tokens computed (neither cached nor handed over by a prefill engine).",
            s.prefill_tokens_computed,
        ),
        counter(
            "sim:kv_handoffs_sent_total",
            "Prefill answers carrying kv_transfer_params for a remote decoder.",
            s.kv_handoffs_sent,
        ),
        counter(
            "sim:kv_handoffs_received_total",
            "Requests that read their prompt's KV from a prefill engine.",
            s.kv_handoffs_received,
        ),
        counter(
            "sim:kv_handoffs_invalid_total",
            "Requests whose kv_transfer_params a decode cannot act on (prompt computed here).",
            s.kv_handoffs_invalid,
        ),
        counter(
            "sim:kv_transferred_tokens_total",
            "Tokens of KV read from prefill engines.",
            s.kv_transferred_tokens,
        ),
        counter(
            "sim:stalled_total",
            "Generation requests whose first token was held back (--stall-share).",
            s.stalled,
        ),
    ]
}

fn escape_label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineConfig;

    #[test]
    fn metrics_flavor_parses_and_prints() {
        assert_eq!("vllm".parse(), Ok(MetricsFlavor::Vllm));
        assert_eq!(" SGLang ".parse(), Ok(MetricsFlavor::Sglang));
        assert!("tgi".parse::<MetricsFlavor>().is_err());
        assert_eq!(MetricsFlavor::Sglang.to_string(), "sglang");
        assert_eq!(MetricsFlavor::default(), MetricsFlavor::Vllm);
    }

    #[test]
    fn sglang_flavor_uses_sglang_names_only() {
        let e = Engine::new(EngineConfig {
            metrics_flavor: MetricsFlavor::Sglang,
            ..EngineConfig::default()
        })
        .unwrap();
        let text = e.metrics_text();
        for name in [
            "sglang:num_queue_reqs",
            "sglang:num_running_reqs",
            "sglang:token_usage",
            "sglang:cache_hit_rate",
            "sglang:prompt_tokens_total",
            "sglang:generation_tokens_total",
            "sim:num_requests_waiting_peak",
            "sim:rejected_total",
        ] {
            assert!(
                text.contains(&format!("\n{name}{{model_name=\"m\"}} ")),
                "{name} missing from\n{text}"
            );
        }
        assert!(!text.contains("vllm:"));
    }
}
