//! What a running router or engine says over HTTP: our router's routing decisions
//! and fleet traffic, whether the fleet is connected, whether engines answer the
//! render endpoint.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;

use crate::procs::{ProcError, get_body};

/// Our router's `routing_decisions_total` by reason and the bytes its tree aged out,
/// from `GET /metrics` (`cache_hit 1200, hit_overloaded 40, miss 760, tree aged out
/// 0.0 MB`), then its `GET /workers` prefix
/// token summary when it has one (`available 9.1M, predicted 7.9M (0.87), delivered
/// 5.2M (0.66)`); `None` if unreadable.
pub async fn routing_decisions(router_url: &str) -> Option<String> {
    let decisions = decision_counts(router_url).await?;
    let Some(hits) = get_body(&format!("{router_url}/workers"))
        .await
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v.get("hits").cloned())
    else {
        return Some(decisions);
    };
    let n = |k: &str| hits[k].as_f64().unwrap_or(0.0);
    let m = |x: f64| format!("{:.2}M", x / 1e6);
    let share = |k: &str| hits[k].as_f64().map_or("-".into(), |x| format!("{x:.2}"));
    Some(format!(
        "{decisions}; prefix tokens available {}, predicted {} ({}), delivered {} ({})",
        m(n("available_tokens")),
        m(n("predicted_tokens")),
        share("routed_share"),
        m(n("delivered_tokens")),
        share("delivered_share"),
    ))
}

async fn decision_counts(router_url: &str) -> Option<String> {
    let body = get_body(&format!("{router_url}/metrics")).await?;
    let text = String::from_utf8_lossy(&body);
    // What the tree's learning removed (`cache.learn_evictions`), beside the decisions.
    let aged = text.lines().find_map(|l| {
        l.strip_prefix("cache_aware_router_tree_aged_out_bytes_total ")
            .and_then(|v| v.trim().parse::<f64>().ok())
    });
    let mut parts: Vec<String> = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("cache_aware_router_routing_decisions_total{")?;
            let (labels, value) = rest.split_once("} ")?;
            let reason = labels
                .split(',')
                .find_map(|kv| kv.strip_prefix("reason=\""))?
                .trim_end_matches('"');
            Some(format!("{reason} {}", value.trim()))
        })
        .collect();
    if let (false, Some(bytes)) = (parts.is_empty(), aged) {
        parts.push(format!("tree aged out {:.1} MB", bytes / 1e6));
    }
    (!parts.is_empty()).then(|| parts.join(", "))
}

/// Whether the engine at `engine_url` answers vLLM's render endpoint
/// (`POST /v1/chat/completions/render` with `token_ids`), which vllm-router's
/// `cache_aware` policy calls on every worker for every request to get the token
/// ids it matches on; without it vllm-router routes without a prefix match.
/// A short phrase for reports.
pub async fn render_status(engine_url: &str) -> String {
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;
    let Ok(uri) = format!("{engine_url}/v1/chat/completions/render").parse::<hyper::Uri>() else {
        return "render endpoint: bad engine URL".into();
    };
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let body =
        Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"a b c"}]}"#);
    let Ok(req) = hyper::Request::post(uri)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
    else {
        return "render endpoint: cannot build the request".into();
    };
    let call = async {
        let resp = client.request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok::<_, String>((status, bytes))
    };
    match tokio::time::timeout(Duration::from_secs(5), call).await {
        Ok(Ok((status, bytes))) if status.is_success() => {
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            if v["token_ids"].as_array().is_some_and(|a| !a.is_empty()) {
                "engines answer POST /v1/chat/completions/render with token_ids".into()
            } else {
                "engines answer POST /v1/chat/completions/render WITHOUT token_ids: \
                 vllm-router's cache_aware cannot match prefixes"
                    .into()
            }
        }
        Ok(Ok((status, _))) => format!(
            "engines answer POST /v1/chat/completions/render with {status}: \
             vllm-router's cache_aware cannot match prefixes"
        ),
        Ok(Err(e)) => format!("render probe failed: {e}"),
        Err(_) => "render probe took over 5 s".into(),
    }
}

/// What a disaggregated pool's requests did, from our router's `GET /metrics`:
/// `pd_requests_total` by path and `pd_bypasses_total` by reason (see the router's
/// docs, "Prefill and decode workers").
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PdCounts {
    /// Requests by path: `disaggregated`, `bypass`, `decode_only`.
    pub paths: BTreeMap<String, u64>,
    /// Bypasses by reason (`uncached`, `n`, `no_prefill_worker`, ...).
    pub bypasses: BTreeMap<String, u64>,
}

impl PdCounts {
    /// Reads them from our router at `router_url`; `None` if it does not answer.
    pub async fn read(router_url: &str) -> Option<PdCounts> {
        let body = get_body(&format!("{router_url}/metrics")).await?;
        Some(Self::parse(&String::from_utf8_lossy(&body)))
    }

    /// Reads them from Prometheus text (values of one label summed over the others).
    pub fn parse(text: &str) -> PdCounts {
        let mut out = PdCounts::default();
        for line in text.lines() {
            let (map, label, rest) =
                if let Some(r) = line.strip_prefix("cache_aware_router_pd_requests_total{") {
                    (&mut out.paths, "path=\"", r)
                } else if let Some(r) = line.strip_prefix("cache_aware_router_pd_bypasses_total{") {
                    (&mut out.bypasses, "reason=\"", r)
                } else {
                    continue;
                };
            let Some((labels, value)) = rest.split_once("} ") else {
                continue;
            };
            let key = labels.split(',').find_map(|kv| kv.strip_prefix(label));
            let value = value.trim().parse::<f64>().ok();
            if let (Some(key), Some(value)) = (key, value) {
                *map.entry(key.trim_end_matches('"').to_string())
                    .or_default() += value as u64;
            }
        }
        out
    }

    /// The counts' growth from `before` to `self`.
    pub fn since(&self, before: &PdCounts) -> PdCounts {
        let diff = |now: &BTreeMap<String, u64>, then: &BTreeMap<String, u64>| {
            now.iter()
                .map(|(k, v)| (k.clone(), v.saturating_sub(*then.get(k).unwrap_or(&0))))
                .collect()
        };
        PdCounts {
            paths: diff(&self.paths, &before.paths),
            bypasses: diff(&self.bypasses, &before.bypasses),
        }
    }

    /// Requests of every path.
    pub fn requests(&self) -> u64 {
        self.paths.values().sum()
    }

    /// Share of the requests that skipped the prefill leg (0 without requests).
    pub fn bypass_share(&self) -> f64 {
        let n = self.requests();
        if n == 0 {
            0.0
        } else {
            *self.paths.get("bypass").unwrap_or(&0) as f64 / n as f64
        }
    }
}

/// The engines' inter-token latency on their own clock (sim-engine's
/// `sim:inter_token_latency_seconds` histogram, summed over the engines at `urls`), as
/// percentiles in simulated ms (interpolated within a bucket); `None` when no engine
/// reports a gap.
pub async fn engine_itl(urls: &[String]) -> Option<crate::stats::Percentiles> {
    let mut merged: BTreeMap<u64, (f64, u64)> = BTreeMap::new();
    let (mut sum, mut count) = (0.0, 0u64);
    for url in urls {
        let Some(body) = get_body(&format!("{url}/metrics")).await else {
            continue;
        };
        let text = String::from_utf8_lossy(&body);
        let (buckets, s, n) = parse_itl(&text);
        for (le, c) in buckets {
            // Bounds are equal across engines; keyed by their bits.
            merged.entry(le.to_bits()).or_insert((le, 0)).1 += c;
        }
        sum += s;
        count += n;
    }
    itl_percentiles(merged.into_values().collect(), sum, count)
}

/// Percentiles in ms of a histogram's cumulative `buckets` (upper bound in s, count;
/// interpolated within a bucket), `sum` (s) and `count`; `None` when empty.
fn itl_percentiles(
    mut buckets: Vec<(f64, u64)>,
    sum: f64,
    count: u64,
) -> Option<crate::stats::Percentiles> {
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last().map_or(0, |b| b.1);
    if total == 0 {
        return None;
    }
    let at = |p: f64| {
        let target = p * total as f64;
        let (mut lower, mut below) = (0.0, 0u64);
        for &(le, cum) in &buckets {
            if cum as f64 >= target && cum > below {
                let upper = if le.is_finite() { le } else { lower };
                let within = (target - below as f64) / (cum - below) as f64;
                return 1e3 * (lower + (upper - lower) * within.clamp(0.0, 1.0));
            }
            (lower, below) = (le, cum);
        }
        1e3 * lower
    };
    Some(crate::stats::Percentiles {
        p50: at(0.50),
        p90: at(0.90),
        p99: at(0.99),
        mean: if count > 0 {
            1e3 * sum / count as f64
        } else {
            0.0
        },
    })
}

/// `sim:inter_token_latency_seconds` of one engine's Prometheus text: its cumulative
/// buckets (upper bound in s, count), sum (s) and count.
fn parse_itl(text: &str) -> (Vec<(f64, u64)>, f64, u64) {
    let name = "sim:inter_token_latency_seconds";
    let (mut buckets, mut sum, mut count) = (Vec::new(), 0.0, 0);
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let Some((series, value)) = rest.rsplit_once(' ') else {
            continue;
        };
        if let Some(labels) = series.strip_prefix("_bucket{") {
            let le = labels
                .split(',')
                .find_map(|kv| kv.strip_prefix("le=\""))
                .map(|v| v.trim_end_matches('}').trim_end_matches('"'));
            let le = match le {
                Some("+Inf") => Some(f64::INFINITY),
                Some(v) => v.parse().ok(),
                None => None,
            };
            if let (Some(le), Ok(c)) = (le, value.parse::<u64>()) {
                buckets.push((le, c));
            }
        } else if series.starts_with("_sum") {
            sum = value.parse().unwrap_or(0.0);
        } else if series.starts_with("_count") {
            count = value.parse().unwrap_or(0);
        }
    }
    (buckets, sum, count)
}

/// The fleet counters of one replica (`GET /workers` → `fleet`), or their sum over
/// replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FleetTraffic {
    /// Redis `PUBLISH`es made.
    pub messages_out: u64,
    /// Bytes in them.
    pub bytes_out: u64,
    /// Messages received from the other replicas.
    pub messages_in: u64,
    /// Bytes in them.
    pub bytes_in: u64,
    /// Prefix records dropped because the publisher fell behind.
    pub dropped: u64,
    /// Chunk hashes held from the other replicas (at the end; summed over replicas).
    pub remote_records: u64,
}

impl FleetTraffic {
    /// Reads `GET /workers` of our router at `router_url`; `None` if it has no fleet
    /// or does not answer.
    pub async fn read(router_url: &str) -> Option<FleetTraffic> {
        let body = get_body(&format!("{router_url}/workers")).await?;
        let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
        let f = v.get("fleet")?;
        let n = |k: &str| f[k].as_u64().unwrap_or(0);
        Some(FleetTraffic {
            messages_out: n("messages_out"),
            bytes_out: n("bytes_out"),
            messages_in: n("messages_in"),
            bytes_in: n("bytes_in"),
            dropped: n("dropped"),
            remote_records: n("remote_records"),
        })
    }

    /// The counters' growth from `before` to `self` (`remote_records` is `self`'s).
    pub fn since(self, before: FleetTraffic) -> FleetTraffic {
        FleetTraffic {
            messages_out: self.messages_out.saturating_sub(before.messages_out),
            bytes_out: self.bytes_out.saturating_sub(before.bytes_out),
            messages_in: self.messages_in.saturating_sub(before.messages_in),
            bytes_in: self.bytes_in.saturating_sub(before.bytes_in),
            dropped: self.dropped.saturating_sub(before.dropped),
            remote_records: self.remote_records,
        }
    }

    /// Field by field sum.
    pub fn plus(self, o: FleetTraffic) -> FleetTraffic {
        FleetTraffic {
            messages_out: self.messages_out + o.messages_out,
            bytes_out: self.bytes_out + o.bytes_out,
            messages_in: self.messages_in + o.messages_in,
            bytes_in: self.bytes_in + o.bytes_in,
            dropped: self.dropped + o.dropped,
            remote_records: self.remote_records + o.remote_records,
        }
    }
}

/// Waits until every router in `urls` says in `GET /workers` that it is subscribed to
/// the fleet channel (a message published before a replica subscribes never reaches it).
pub(super) async fn wait_fleet_connected(
    urls: &[String],
    timeout: Duration,
) -> Result<(), ProcError> {
    let deadline = tokio::time::Instant::now() + timeout;
    for url in urls {
        loop {
            let body = get_body(&format!("{url}/workers")).await;
            let connected = body
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                .and_then(|v| v["fleet"]["connected"].as_bool())
                .unwrap_or(false);
            if connected {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(ProcError::NotReady(format!(
                    "{url} not subscribed to the fleet channel within {timeout:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// Waits until our router at `url` has read every worker's model list (`GET /workers`:
/// each worker's `models.source` is `listed`): until then it routes every request in its
/// default pool, whatever model it names.
pub(super) async fn wait_models_listed(url: &str, timeout: Duration) -> Result<(), ProcError> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let listed = get_body(&format!("{url}/workers"))
            .await
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|v| {
                let ws = v["workers"].as_array()?.clone();
                Some(
                    !ws.is_empty()
                        && ws
                            .iter()
                            .all(|w| w["models"]["source"].as_str() == Some("listed")),
                )
            })
            .unwrap_or(false);
        if listed {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(ProcError::NotReady(format!(
                "{url} did not read every worker's GET /v1/models within {timeout:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pd_counts_read_paths_and_reasons_and_their_growth() {
        let text = "# TYPE x counter\n\
            cache_aware_router_pd_requests_total{path=\"disaggregated\"} 30\n\
            cache_aware_router_pd_requests_total{path=\"bypass\"} 10\n\
            cache_aware_router_pd_bypasses_total{reason=\"uncached\"} 9\n\
            cache_aware_router_pd_bypasses_total{reason=\"n\"} 1\n";
        let now = PdCounts::parse(text);
        assert_eq!(now.requests(), 40);
        assert_eq!(now.bypass_share(), 0.25);
        let before =
            PdCounts::parse("cache_aware_router_pd_requests_total{path=\"disaggregated\"} 2\n");
        let d = now.since(&before);
        assert_eq!((d.requests(), d.bypasses["uncached"]), (38, 9));
    }

    #[test]
    fn itl_percentiles_come_from_the_merged_buckets() {
        let h = "sim:inter_token_latency_seconds_bucket{engine=\"0\",le=\"0.010000\"} 0\n\
            sim:inter_token_latency_seconds_bucket{engine=\"0\",le=\"0.020000\"} 98\n\
            sim:inter_token_latency_seconds_bucket{engine=\"0\",le=\"0.200000\"} 100\n\
            sim:inter_token_latency_seconds_bucket{engine=\"0\",le=\"+Inf\"} 100\n\
            sim:inter_token_latency_seconds_sum{engine=\"0\"} 1.8\n\
            sim:inter_token_latency_seconds_count{engine=\"0\"} 100\n";
        let (buckets, sum, count) = parse_itl(h);
        assert_eq!((buckets.len(), sum, count), (4, 1.8, 100));
        let p = itl_percentiles(buckets, sum, count).unwrap();
        // The median in the 10–20 ms bucket, the 99th in the 20–200 ms one.
        assert!((p.p50 - 15.1).abs() < 0.1, "{p:?}");
        assert!((p.p99 - 110.0).abs() < 0.1, "{p:?}");
        assert!((p.mean - 18.0).abs() < 1e-9);
        assert!(itl_percentiles(Vec::new(), 0.0, 0).is_none());
    }
}
