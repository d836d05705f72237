//! LoRA adapters on the request path, once a worker is chosen for an adapter request:
//! the adapter loaded onto it first when it does not list it (`adapters.load_on_demand`,
//! from `adapters.sources`), and the body in the form an SGLang worker reads.
//!
//! A load goes through the engine's own endpoint (vLLM `POST /v1/load_lora_adapter`,
//! which needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING`; SGLang `POST /load_lora_adapter`),
//! once per (worker, adapter) at a time: requests that need the same load wait on the
//! one in progress and share its outcome. A worker counts as holding what it lists, or
//! what the router loaded there since its list was last read (a later list without it
//! means its engine restarted: it is loaded again). A worker whose list is unknown
//! (it serves any model) is never sent a load.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;

use crate::config::AdapterSource;
use crate::error::ProxyError;
use crate::pools::pool::Worker;
use crate::upstream::Upstream;

/// Largest load answer read, in bytes (a short message).
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// Longest part of an engine's refusal quoted back, in characters.
const MAX_QUOTED: usize = 300;

/// One (worker URL, adapter).
type Key = (Arc<str>, Arc<str>);

/// What the router did about one (worker, adapter), locked for a load's whole time.
type SharedCell = Arc<tokio::sync::Mutex<Cell>>;

/// The loads in progress and done, by (worker URL, adapter). See the module docs.
#[derive(Default)]
pub struct Loads {
    cells: Mutex<HashMap<Key, SharedCell>>,
}

/// Why a load failed: the message, and whether the worker did not answer at all.
#[derive(Debug, Clone)]
pub struct Failure {
    pub why: String,
    pub unreachable: bool,
}

/// What the router did about one (worker, adapter).
#[derive(Default)]
struct Cell {
    /// A load succeeded while the worker's list was the one read at this time.
    loaded_under: Option<Option<SystemTime>>,
    /// The last load failed: when it ended, and how.
    failed: Option<(Instant, Failure)>,
}

impl Cell {
    /// Whether `worker` holds `adapter` as far as the router knows.
    fn holds(&self, worker: &Worker, adapter: &str) -> bool {
        let served = worker.served();
        served.serves_any()
            || served.lists(adapter)
            || self.loaded_under.is_some_and(|at| at == served.read_at)
    }
}

impl Loads {
    /// Makes sure `worker` holds `adapter` (see the module docs), loading it from
    /// `source` within `wait` when it does not. `Err`: the client's answer when no
    /// other worker can take the request, and whether the worker did not answer.
    pub async fn ensure(
        &self,
        client: &Upstream,
        worker: &Arc<Worker>,
        adapter: &Arc<str>,
        source: &AdapterSource,
        wait: Duration,
    ) -> Result<(), (ProxyError, bool)> {
        {
            let served = worker.served();
            if served.serves_any() || served.lists(adapter) {
                return Ok(());
            }
        }
        let cell = {
            let mut cells = self.cells.lock().unwrap_or_else(|e| e.into_inner());
            Arc::clone(
                cells
                    .entry((Arc::clone(worker.label()), Arc::clone(adapter)))
                    .or_default(),
            )
        };
        let asked = Instant::now();
        let mut cell = cell.lock().await;
        if cell.holds(worker, adapter) {
            return Ok(());
        }
        let refused = |f: Failure| {
            let e = ProxyError::AdapterLoad {
                adapter: adapter.to_string(),
                worker: worker.url().to_string(),
                why: f.why,
            };
            (e, f.unreachable)
        };
        // A load that ended while this request waited for it: its outcome is this one's.
        if let Some((at, f)) = &cell.failed
            && *at >= asked
        {
            return Err(refused(f.clone()));
        }
        let read_at = worker.served().read_at;
        let counts = worker.adapters();
        match load(client, worker, adapter, source, wait).await {
            Ok(()) => {
                // Relaxed: counters.
                counts.loads_ok.fetch_add(1, Ordering::Relaxed);
                tracing::info!(worker = %worker.url(), adapter = %adapter, "LoRA adapter loaded");
                cell.loaded_under = Some(read_at);
                cell.failed = None;
                Ok(())
            }
            Err(f) => {
                counts.loads_failed.fetch_add(1, Ordering::Relaxed);
                // It does not hold it, and would fail again: the next requests for it
                // go to other workers while they can.
                counts.refused(adapter, crate::pools::pool::now());
                tracing::warn!(worker = %worker.url(), adapter = %adapter, error = %f.why, "LoRA adapter load failed");
                cell.failed = Some((Instant::now(), f.clone()));
                Err(refused(f))
            }
        }
    }
}

/// One load through the engine's endpoint; `Err` says why it failed.
async fn load(
    client: &Upstream,
    worker: &Arc<Worker>,
    adapter: &str,
    source: &AdapterSource,
    wait: Duration,
) -> Result<(), Failure> {
    let path = if worker.served().is_sglang() {
        "/load_lora_adapter"
    } else {
        "/v1/load_lora_adapter"
    };
    let body = serde_json::json!({"lora_name": adapter, "lora_path": source.path}).to_string();
    let (status, answer) = client
        .post_worker_json(worker, path, Bytes::from(body), wait, MAX_ANSWER_BYTES)
        .await
        .map_err(|e| Failure {
            why: crate::error::describe(&e),
            unreachable: true,
        })?;
    let text = String::from_utf8_lossy(&answer);
    if status.is_success() && !sglang_refused(&answer) {
        return Ok(());
    }
    // vLLM: the name is registered already (another router, or a load racing ours).
    if status == http::StatusCode::BAD_REQUEST && text.contains("already been loaded") {
        return Ok(());
    }
    let quoted: String = text.chars().take(MAX_QUOTED).collect();
    Err(Failure {
        why: format!("{path} answered {status}: {}", quoted.trim()),
        unreachable: false,
    })
}

/// Whether an SGLang answer with a 2xx status says the load failed (`success: false`).
fn sglang_refused(answer: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Answer {
        success: Option<bool>,
    }
    serde_json::from_slice::<Answer>(answer).is_ok_and(|a| a.success == Some(false))
}

/// The body an SGLang worker reads for a request for `adapter`: `model` set to
/// `base:adapter` (SGLang reads a plain adapter name as an unchecked base model name);
/// `None` for any other worker, or a body without a readable `model`.
pub fn sglang_form(worker: &Worker, body: &Bytes, adapter: &str, pool: &str) -> Option<Bytes> {
    let served = worker.served();
    if !served.is_sglang() {
        return None;
    }
    let base = served.base_for(adapter).map_or(pool, |b| &**b);
    let field = crate::prompt::model::of_any_object(body)?;
    Some(crate::prompt::model::with_model(
        body,
        Some(&field),
        &format!("{base}:{adapter}"),
    ))
}
