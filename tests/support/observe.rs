//! The router as its operator reads it: `GET /workers` (worker list, in-flight counts)
//! and `GET /metrics` parsed into samples ([`Scrape`]).

use std::net::SocketAddr;
use std::time::Duration;

use crate::client::get;
use crate::wait::wait_until;

/// `GET /workers`, asserting 200 and JSON.
pub async fn get_workers(addr: SocketAddr) -> serde_json::Value {
    let r = get(addr, "/workers").await;
    assert_eq!(r.status, 200, "GET /workers: {}", r.text());
    r.json()
}

/// The workers' URLs, in `/workers` order.
pub async fn worker_urls(addr: SocketAddr) -> Vec<String> {
    get_workers(addr).await["workers"]
        .as_array()
        .expect("workers array")
        .iter()
        .map(|w| w["url"].as_str().expect("url").to_string())
        .collect()
}

/// In-flight count per worker, in `/workers` order.
pub async fn in_flight(addr: SocketAddr) -> Vec<u64> {
    get_workers(addr).await["workers"]
        .as_array()
        .expect("workers array")
        .iter()
        .map(|w| w["in_flight"].as_u64().expect("in_flight number"))
        .collect()
}

/// Waits until every worker's in-flight count is 0.
pub async fn wait_all_idle(addr: SocketAddr, limit: Duration) {
    wait_until("every in_flight back to 0", limit, || async {
        in_flight(addr).await.iter().all(|n| *n == 0)
    })
    .await
}

/// One sample of a `GET /metrics` scrape.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// A parsed `GET /metrics` answer (Prometheus text format).
#[derive(Debug, Clone)]
pub struct Scrape {
    pub samples: Vec<Sample>,
    pub text: String,
}

impl Scrape {
    /// Parses Prometheus text exposition; panics on a line it cannot read.
    pub fn parse(text: &str) -> Scrape {
        let samples = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(|l| parse_sample(l).unwrap_or_else(|| panic!("bad metrics line {l:?}")))
            .collect();
        Scrape {
            samples,
            text: text.to_string(),
        }
    }

    /// The sample `name` with exactly the labels `labels` (any order), if exposed.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples
            .iter()
            .find(|s| {
                s.name == name
                    && s.labels.len() == labels.len()
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.iter().any(|(k2, v2)| k2 == k && v2 == v))
            })
            .map(|s| s.value)
    }

    /// As [`Scrape::get`], reading an unexposed series as 0 (a labelled counter appears
    /// only once it was first incremented).
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels).unwrap_or(0.0)
    }

    /// Every sample named `name`.
    pub fn all(&self, name: &str) -> Vec<&Sample> {
        self.samples.iter().filter(|s| s.name == name).collect()
    }
}

/// `name{k="v",…} value [timestamp]` or `name value [timestamp]`.
fn parse_sample(line: &str) -> Option<Sample> {
    let name_end = line.find(['{', ' '])?;
    let name = line[..name_end].to_string();
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(mut inner) = rest.strip_prefix('{') {
        loop {
            inner = inner.trim_start_matches(',');
            if let Some(after) = inner.strip_prefix('}') {
                rest = after;
                break;
            }
            let (key, quoted) = inner.split_once("=\"")?;
            let mut value = String::new();
            let mut chars = quoted.char_indices();
            let end = loop {
                match chars.next()? {
                    (i, '"') => break i,
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        escaped => value.push(escaped),
                    },
                    (_, c) => value.push(c),
                }
            };
            labels.push((key.to_string(), value));
            inner = &quoted[end + 1..];
        }
    }
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// `GET /metrics`, asserting 200, parsed.
pub async fn scrape(addr: SocketAddr) -> Scrape {
    let r = get(addr, "/metrics").await;
    assert_eq!(r.status, 200, "GET /metrics: {}", r.text());
    Scrape::parse(&r.text())
}

/// The URL of worker `i` as `/workers` lists it (the `worker` label of metrics).
pub async fn worker_label(addr: SocketAddr, i: usize) -> String {
    get_workers(addr).await["workers"][i]["url"]
        .as_str()
        .expect("worker url")
        .to_string()
}
