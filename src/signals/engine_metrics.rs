//! Engine load from each worker's Prometheus endpoint (`engine_metrics:`).
//!
//! Every `interval` one task scrapes `GET path` on every worker of the current set,
//! concurrently, each bounded by `interval` (so one worker's scrapes never overlap) and
//! by [`MAX_SCRAPE_BYTES`]. What is read (see [`EngineLoad`] for the metric names of
//! vLLM and SGLang) goes into the worker's signal slot; a failed scrape, a non-2xx
//! answer or a page without any known metric leaves the last good one in place, to go
//! stale after `stale_secs`, and is counted (`/workers`, `/metrics`).
//!
//! The text format is read by [`parse`], a small reader of sample lines (`name{labels}
//! value [timestamp]`) for the few names the router uses: the `prometheus-parse` crate
//! matches metric names with `\w+` and so silently drops every `vllm:` and `sglang:`
//! series (colons are legal in the format; both engines use them).

use std::collections::HashMap;
use std::sync::Arc;

use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;

use crate::config::EngineMetricsConfig;
use crate::pools::pool::signals::{EngineKind, EngineLoad};
use crate::pools::pool::{Fetch, Target};
use crate::pools::pool::{Pool, WorkerId};
use crate::shutdown::Shutdown;

/// Largest metrics page read, in bytes (vLLM's is ~100 KiB with its histograms).
pub const MAX_SCRAPE_BYTES: usize = 8 << 20;

/// Largest value read from a series (and of a sum of them): 1e9.
const MAX_VALUE: f64 = 1e9;

/// What one page said, before it is stamped with a time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Parsed {
    pub engine: EngineKind,
    pub waiting: f64,
    pub running: f64,
    pub kv_usage: Option<f64>,
    pub prefix_hit_rate: Option<f64>,
}

impl Parsed {
    pub fn at(self, at: std::time::Instant) -> EngineLoad {
        EngineLoad {
            engine: self.engine,
            waiting: self.waiting,
            running: self.running,
            kv_usage: self.kv_usage,
            prefix_hit_rate: self.prefix_hit_rate,
            at,
        }
    }
}

/// The series the router reads, and how each is folded over the page's samples (DP
/// ranks and models appear as separate label sets).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Series {
    Waiting,
    Running,
    KvUsage,
    PrefixQueries,
    PrefixHits,
    HitRate,
}

fn series(name: &str) -> Option<(EngineKind, Series)> {
    use EngineKind::{Sglang, Vllm};
    Some(match name {
        "vllm:num_requests_waiting" => (Vllm, Series::Waiting),
        "vllm:num_requests_running" => (Vllm, Series::Running),
        "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => (Vllm, Series::KvUsage),
        "vllm:prefix_cache_queries_total" | "vllm:prefix_cache_queries" => {
            (Vllm, Series::PrefixQueries)
        }
        "vllm:prefix_cache_hits_total" | "vllm:prefix_cache_hits" => (Vllm, Series::PrefixHits),
        "sglang:num_queue_reqs" => (Sglang, Series::Waiting),
        "sglang:num_running_reqs" => (Sglang, Series::Running),
        "sglang:token_usage" => (Sglang, Series::KvUsage),
        "sglang:cache_hit_rate" => (Sglang, Series::HitRate),
        _ => return None,
    })
}

/// Reads the engine's load from a Prometheus text page. Sums `waiting` and `running`
/// over label sets (DP ranks; a series repeated with the same labels is summed too),
/// takes the largest KV usage (the rank closest to preempting), and `None` when the page
/// holds neither engine's queue gauges (a different server, an HTML error page,
/// garbage). Values that are not finite, negative or above 1e9 are skipped, as are lines
/// it cannot read. Never panics. (The scraper refuses a page that is not UTF-8 whole.)
pub fn parse(text: &str) -> Option<Parsed> {
    let mut engine = None;
    let (mut waiting, mut running) = (None::<f64>, None::<f64>);
    let (mut kv, mut queries, mut hits, mut rate) = (None::<f64>, None, None, None::<f64>);
    for line in text.lines() {
        let Some((name, value)) = sample(line) else {
            continue;
        };
        let Some((kind, s)) = series(name) else {
            continue;
        };
        // A gauge past a billion is no engine's queue: skip it rather than let a sum
        // overflow to infinity.
        if !value.is_finite() || !(0.0..=MAX_VALUE).contains(&value) {
            continue;
        }
        // One engine per page: the first one seen.
        if *engine.get_or_insert(kind) != kind {
            continue;
        }
        let add = |slot: &mut Option<f64>| *slot = Some(slot.unwrap_or(0.0) + value);
        match s {
            Series::Waiting => add(&mut waiting),
            Series::Running => add(&mut running),
            Series::PrefixQueries => add(&mut queries),
            Series::PrefixHits => add(&mut hits),
            Series::KvUsage => kv = Some(kv.map_or(value, |k: f64| k.max(value))),
            Series::HitRate => rate = Some(rate.map_or(value, |r: f64| r.max(value))),
        }
    }
    let engine = engine?;
    if waiting.is_none() && running.is_none() {
        return None;
    }
    // Sums of at most a few thousand bounded series stay finite; clamp all the same.
    let (waiting, running) = (
        waiting.map(|w| w.min(MAX_VALUE)),
        running.map(|r| r.min(MAX_VALUE)),
    );
    let prefix_hit_rate = match (rate, queries, hits) {
        (Some(r), _, _) => Some(r.min(1.0)),
        (None, Some(q), Some(h)) if q > 0.0 => Some((h / q).min(1.0)),
        _ => None,
    };
    Some(Parsed {
        engine,
        waiting: waiting.unwrap_or(0.0),
        running: running.unwrap_or(0.0),
        kv_usage: kv.map(|k| k.min(1.0)),
        prefix_hit_rate,
    })
}

/// What a page says of the engine's LoRA adapters.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LoraReport {
    /// Adapters with requests queued or running (vLLM's `vllm:lora_requests_info`,
    /// the series with the latest stamp: its `running_lora_adapters` and
    /// `waiting_lora_adapters`, comma-joined names). Activity, not residency: an idle
    /// adapter still in memory is absent.
    pub active: Vec<String>,
    /// Adapters it holds at once: that series' `max_lora` (vLLM `--max-loras`), or
    /// `sglang:lora_pool_slots_total`.
    pub slots: Option<usize>,
}

/// Reads the engine's LoRA report from a Prometheus text page; `None` when it has none
/// (LoRA off, or an engine that does not say). Never panics.
pub fn lora(text: &str) -> Option<LoraReport> {
    if !text.contains(":lora_") {
        return None;
    }
    let mut latest: Option<(f64, &str)> = None;
    let mut slots = None;
    for line in text.lines() {
        let line = line.trim_start();
        if let Some(rest) = line.strip_prefix("vllm:lora_requests_info{") {
            let Some((_, value)) = sample(line) else {
                continue;
            };
            if value.is_finite() && latest.is_none_or(|(v, _)| value > v) {
                latest = Some((value, rest));
            }
        } else if line.starts_with("sglang:lora_pool_slots_total")
            && let Some((_, v)) = sample(line)
            && v.is_finite()
            && (1.0..=MAX_VALUE).contains(&v)
        {
            slots = Some(v as usize);
        }
    }
    let mut report = LoraReport {
        active: Vec::new(),
        slots,
    };
    if let Some((_, labels)) = latest {
        for (key, value) in label_pairs(labels) {
            match key {
                "running_lora_adapters" | "waiting_lora_adapters" => {
                    for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                        if !report.active.iter().any(|a| a == name) {
                            report.active.push(name.to_string());
                        }
                    }
                }
                "max_lora" => report.slots = value.parse().ok().filter(|n| *n > 0),
                _ => {}
            }
        }
    }
    (latest.is_some() || report.slots.is_some()).then_some(report)
}

/// The `key="value"` pairs of a label set, from just after its `{` up to its `}`
/// (escapes `\\`, `\"` and `\n` decoded); stops at anything it cannot read.
fn label_pairs(mut rest: &str) -> Vec<(&str, String)> {
    let mut out = Vec::new();
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        let Some((key, after)) = rest.split_once("=\"") else {
            return out;
        };
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, e)) => value.push(e),
                    None => return out,
                },
                '"' => {
                    end = Some(i + 1);
                    break;
                }
                c => value.push(c),
            }
        }
        let Some(end) = end else { return out };
        out.push((key.trim(), value));
        rest = &after[end..];
        if rest.starts_with('}') {
            return out;
        }
    }
}

/// One sample line's metric name and value; `None` for comments, blank and unreadable
/// lines. Label values may hold any character, `}` and escaped quotes included.
fn sample(line: &str) -> Option<(&str, f64)> {
    let line = line.trim_start();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let end = line
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(line.len());
    let (name, mut rest) = line.split_at(end);
    if name.is_empty() {
        return None;
    }
    if let Some(labels) = rest.strip_prefix('{') {
        let mut quoted = false;
        let mut escaped = false;
        let mut close = None;
        for (i, c) in labels.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' if quoted => escaped = true,
                '"' => quoted = !quoted,
                '}' if !quoted => {
                    close = Some(i);
                    break;
                }
                _ => {}
            }
        }
        rest = &labels[close? + 1..];
    }
    let value = rest.split_whitespace().next()?;
    Some((name, value.parse().ok()?))
}

/// Scrapes every worker each `interval` until shutdown (see the module docs).
pub async fn run<F: Fetch>(
    pool: Arc<Pool>,
    cfg: EngineMetricsConfig,
    fetch: F,
    mut shutdown: Shutdown,
) {
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    // Whether each worker's last scrape worked: a change is logged, not every failure.
    let mut ok: HashMap<WorkerId, bool> = HashMap::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.wait() => return,
        }
        let set = pool.set();
        let mut scrapes = JoinSet::new();
        for worker in set.workers() {
            let worker = Arc::clone(worker);
            let fetch = fetch.clone();
            let (path, timeout) = (cfg.path.clone(), cfg.interval);
            scrapes.spawn(async move {
                let got = fetch
                    .get(&worker, Target::Path(&path), timeout, MAX_SCRAPE_BYTES)
                    .await;
                (worker, got)
            });
        }
        let wait = async {
            while let Some(joined) = scrapes.join_next().await {
                let Ok((worker, got)) = joined else { continue };
                let counts = &worker.signals().scrapes;
                let outcome = match got {
                    Ok((status, body)) if status.is_success() => {
                        let text = std::str::from_utf8(&body).ok();
                        if let Some(l) = text.and_then(lora) {
                            let active: Vec<&str> = l.active.iter().map(String::as_str).collect();
                            worker.adapters().engine_reported(&active, l.slots);
                        }
                        match text.and_then(parse) {
                            Some(p) => {
                                worker.signals().set_engine(p.at(crate::clock::now()));
                                counts.ok.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                Ok(())
                            }
                            None => {
                                counts
                                    .unparsable
                                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                Err("no vllm: or sglang: queue metrics in the page".to_string())
                            }
                        }
                    }
                    Ok((status, _)) => {
                        counts
                            .failed
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        Err(format!("status {status}"))
                    }
                    Err(e) => {
                        counts
                            .failed
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        Err(e)
                    }
                };
                let was = ok.insert(worker.id(), outcome.is_ok());
                match (was, outcome) {
                    (Some(false), Ok(())) => {
                        tracing::info!(worker = %worker.url(), "engine metrics readable again")
                    }
                    (None | Some(true), Err(why)) => tracing::warn!(
                        worker = %worker.url(),
                        path = %cfg.path,
                        error = %crate::redact::text(&why),
                        "engine metrics unreadable; its load signals are neutral until they return"
                    ),
                    _ => {}
                }
            }
        };
        tokio::select! {
            _ = wait => {}
            _ = shutdown.wait() => return,
        }
        ok.retain(|id, _| set.get(*id).is_some());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-7B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen2.5-7B"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen2.5-7B"} 4.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen2.5-7B"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen2.5-7B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen2.5-7B"} 0.75
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 12
"#;

    #[test]
    fn vllm_names_summed_over_ranks() {
        let p = parse(VLLM).unwrap();
        assert_eq!(p.engine, EngineKind::Vllm);
        assert_eq!((p.waiting, p.running), (5.0, 5.0));
        assert_eq!(p.kv_usage, Some(0.75));
        assert_eq!(p.prefix_hit_rate, Some(0.25));
    }

    #[test]
    fn the_lora_report_is_the_latest_series_and_the_slots() {
        // A vLLM 0.32 CPU scrape: one series per label set ever seen, the latest
        // (largest stamp) current.
        let page = r#"# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql-lora",waiting_lora_adapters="sql-lora"} 1.7966253612834687e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="chat-lora,sql-lora",waiting_lora_adapters="chat-lora"} 1.7966253625529401e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7966253625467913e+09
vllm:num_requests_running{model_name="m"} 1
"#;
        let r = lora(page).unwrap();
        assert_eq!(r.active, ["chat-lora", "sql-lora"]);
        assert_eq!(r.slots, Some(2));
        let idle = page.replace("1.7966253625467913e+09", "1.8e+09");
        assert_eq!(lora(&idle).unwrap().active, Vec::<String>::new());
        assert_eq!(lora(VLLM), None, "no LoRA on the page");
        let sg = "sglang:lora_pool_slots_total{model_name=\"m\"} 8\n";
        assert_eq!(lora(sg).unwrap().slots, Some(8));
        for garbage in [
            "vllm:lora_requests_info{max_lora=\"x\"} 1\n",
            "vllm:lora_requests_info{running_lora_adapters=\"a\\\"b\"} 1\n",
            "vllm:lora_requests_info{running_lora_adapters=\"unterminated} 1\n",
            "vllm:lora_requests_info{ 1\n",
        ] {
            let _ = lora(garbage);
        }
    }

    #[test]
    fn older_vllm_and_sglang_names() {
        let old = "vllm:num_requests_waiting 2\nvllm:gpu_cache_usage_perc{model_name=\"m\"} 0.5\n";
        let p = parse(old).unwrap();
        assert_eq!((p.waiting, p.running, p.kv_usage), (2.0, 0.0, Some(0.5)));
        let sg = "# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name=\"m\"} 7\nsglang:num_running_reqs{model_name=\"m\"} 12\nsglang:token_usage{model_name=\"m\"} 0.9\nsglang:cache_hit_rate{model_name=\"m\"} 0.4\n";
        let p = parse(sg).unwrap();
        assert_eq!(p.engine, EngineKind::Sglang);
        assert_eq!((p.waiting, p.running), (7.0, 12.0));
        assert_eq!((p.kv_usage, p.prefix_hit_rate), (Some(0.9), Some(0.4)));
    }

    #[test]
    fn garbage_and_foreign_pages_are_unparsable() {
        for page in [
            "",
            "<html><body>502 Bad Gateway</body></html>",
            "process_cpu_seconds_total 12.5\nhttp_requests_total{code=\"200\"} 3\n",
            "vllm:num_requests_waiting{engine=\"0\" 3\n",
            "vllm:num_requests_waiting NaN\nvllm:num_requests_running -1\n",
            "vllm:num_requests_waiting 1e308\nvllm:num_requests_running +Inf\n",
            "\u{0}\u{1}vllm:num_requests_waiting",
        ] {
            assert_eq!(parse(page), None, "{page:?}");
        }
    }

    #[test]
    fn sums_stay_finite() {
        let page = "vllm:num_requests_waiting{engine=\"0\"} 9e8\nvllm:num_requests_waiting{engine=\"1\"} 9e8\nvllm:num_requests_running 1\n";
        let p = parse(page).unwrap();
        assert_eq!(p.waiting, 1e9);
        assert!(p.waiting.is_finite());
    }

    #[test]
    fn label_values_may_hold_braces_and_quotes() {
        let page = "vllm:num_requests_waiting{model_name=\"a}b\\\"c\"} 9 1700000000000\n";
        assert_eq!(parse(page).unwrap().waiting, 9.0);
    }
}
