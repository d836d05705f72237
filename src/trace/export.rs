//! OTLP/HTTP export of one span per request (`tracing.otlp_endpoint`), through the
//! OpenTelemetry SDK's batch span processor and the `opentelemetry-otlp` exporter
//! (protobuf), sent with a hyper-util client over rustls.
//!
//! The request path only hands a finished span to the processor's bounded queue
//! ([`Exporter::record`]: no await, no I/O; a full queue drops the span). The processor's
//! own thread sends a batch every [`SCHEDULED_DELAY`] or every 512 spans; each POST runs
//! on the tokio runtime that built the exporter. A collector that cannot be reached, or
//! refuses a batch, is logged as a warning once (and its recovery once); requests never
//! notice. [`Exporter::shutdown`] sends what is queued.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry::trace::{SpanContext, SpanKind, Status, TraceFlags, TraceState};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_http::{HttpClient, HttpError};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SpanData, SpanEvents, SpanLinks, SpanProcessor,
};

use super::TraceContext;
use crate::config::{TlsSetting, TracingConfig};

/// How long a finished span waits in the queue at most before its batch is sent.
pub const SCHEDULED_DELAY: Duration = Duration::from_secs(1);
/// Bound of one POST to the collector (connect, send, answer).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// Spans held while the collector is slow; beyond that new spans are dropped.
const MAX_QUEUE: usize = 4096;
/// Longest collector answer read, in bytes.
const MAX_ANSWER_BYTES: usize = 1 << 20;
/// How long [`Exporter::shutdown`] waits for the last batch.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// What the proxy knows of a request when its answer ends: the span's name and
/// attributes. Borrowed; [`Exporter::record`] copies what it keeps.
#[derive(Debug)]
pub struct Finished<'a> {
    /// Span name, low-cardinality: `POST /v1/chat/completions`, `GET /v1/models`, `proxy`.
    pub name: &'static str,
    pub trace: TraceContext,
    /// When the request arrived: the span's start (its end is now).
    pub arrived: Instant,
    /// The endpoint label of logs and metrics (`chat_completions`, `models`, `other`).
    pub endpoint: &'static str,
    pub request_id: &'a str,
    /// The serving worker's label (its `name`, else its URL); `none` or `cache` for
    /// answers the router gave itself or replayed.
    pub worker: Arc<str>,
    /// Decision reason (`cache_hit`, `balance`, `no_worker`, `response_cache`, …).
    pub reason: &'static str,
    /// Matched prefix over prompt length, 0..=1, when a worker was picked.
    pub matched_ratio: Option<f64>,
    /// Attempt that answered, 0 for the first, when a worker was picked.
    pub attempt: Option<u32>,
    /// A disaggregated pool's request: its path (`disaggregated`, `bypass`,
    /// `decode_only`).
    pub pd: Option<&'static str>,
    /// …and the prefill worker whose answer was read, when one was.
    pub prefill_worker: Option<Arc<str>>,
    /// HTTP status sent to the client.
    pub status: u16,
    /// How the body ended (`complete`, `client_gone`, `upstream_error`, …).
    pub outcome: &'static str,
    /// The router's own error, when it answered one.
    pub error: Option<&'a str>,
}

/// The span exporter: one per router, shared by every request.
#[derive(Debug)]
pub struct Exporter {
    processor: BatchSpanProcessor,
    scope: InstrumentationScope,
}

impl Exporter {
    /// Starts the batch processor for `cfg.otlp_endpoint` (the full `/v1/traces` URL).
    /// Needs a tokio runtime (each POST runs on it). `Err` says why it cannot start.
    pub fn new(cfg: &TracingConfig) -> Result<Exporter, String> {
        let endpoint = cfg
            .otlp_endpoint
            .as_ref()
            .ok_or("tracing.otlp_endpoint is not set")?;
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| format!("no tokio runtime to send spans on: {e}"))?;
        let client = Collector::new(runtime, endpoint.to_string())?;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(endpoint.to_string())
            .with_timeout(EXPORT_TIMEOUT)
            .with_http_client(client)
            .build()
            .map_err(|e| e.to_string())?;
        let batch = BatchConfigBuilder::default()
            .with_scheduled_delay(SCHEDULED_DELAY)
            .with_max_queue_size(MAX_QUEUE)
            .build();
        let mut processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(batch)
            .build();
        processor.set_resource(
            &Resource::builder()
                .with_service_name(cfg.service_name.clone())
                .build(),
        );
        let scope = InstrumentationScope::builder(env!("CARGO_PKG_NAME"))
            .with_version(env!("CARGO_PKG_VERSION"))
            .build();
        Ok(Exporter { processor, scope })
    }

    /// Queues the request's span (a server span: the router's span id, the client's as
    /// parent when it sent one; status error for a 5xx or a broken answer). Never waits;
    /// a trace the client marked not sampled is not exported.
    pub fn record(&self, f: &Finished<'_>) {
        if !f.trace.is_sampled() {
            return;
        }
        let end = SystemTime::now();
        let start = end.checked_sub(f.arrived.elapsed()).unwrap_or(end);
        let t = &f.trace;
        let mut attributes = vec![
            KeyValue::new("router.endpoint", f.endpoint),
            KeyValue::new("router.request_id", f.request_id.to_string()),
            KeyValue::new("router.worker", Arc::clone(&f.worker)),
            KeyValue::new("router.reason", f.reason),
            KeyValue::new("router.outcome", f.outcome),
            KeyValue::new("http.response.status_code", i64::from(f.status)),
        ];
        if let Some(r) = f.matched_ratio {
            attributes.push(KeyValue::new("router.matched_ratio", r));
        }
        if let Some(a) = f.attempt {
            attributes.push(KeyValue::new("router.attempt", i64::from(a)));
        }
        if let Some(p) = f.pd {
            attributes.push(KeyValue::new("router.pd", p));
        }
        if let Some(w) = &f.prefill_worker {
            attributes.push(KeyValue::new("router.prefill_worker", Arc::clone(w)));
        }
        if let Some(e) = f.error {
            attributes.push(KeyValue::new("error.message", e.to_string()));
        }
        let failed = f.status >= 500 || f.outcome.starts_with("upstream_");
        let status = if failed {
            Status::error(f.error.unwrap_or(f.outcome).to_string())
        } else {
            Status::Unset
        };
        self.processor.on_end(SpanData {
            span_context: SpanContext::new(
                opentelemetry::trace::TraceId::from_bytes(t.trace_id.to_bytes()),
                opentelemetry::trace::SpanId::from_bytes(t.span_id.to_bytes()),
                TraceFlags::new(t.flags),
                false,
                TraceState::NONE,
            ),
            parent_span_id: t.parent.map_or(opentelemetry::trace::SpanId::INVALID, |p| {
                opentelemetry::trace::SpanId::from_bytes(p.to_bytes())
            }),
            parent_span_is_remote: t.parent.is_some(),
            span_kind: SpanKind::Server,
            name: f.name.into(),
            start_time: start,
            end_time: end,
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status,
            instrumentation_scope: self.scope.clone(),
        });
    }

    /// Sends what is queued and stops the processor (blocks up to a few seconds: call
    /// it off the runtime's worker threads, e.g. in `spawn_blocking`).
    pub fn shutdown(&self) {
        if let Err(e) = self.processor.shutdown_with_timeout(SHUTDOWN_TIMEOUT) {
            tracing::warn!(error = %e, "tracing: the last spans may not have reached the collector");
        }
    }
}

/// The HTTP client the OTLP exporter sends with: hyper-util over rustls (platform
/// roots), each request spawned on the router's runtime (the batch processor's thread
/// has none). Logs a failing collector once, and its recovery once.
#[derive(Debug)]
struct Collector {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    runtime: tokio::runtime::Handle,
    /// The URL, for the warning.
    url: String,
    /// Whether the last POST failed; Relaxed: a log-once flag, ordering nothing else.
    failing: AtomicBool,
}

impl Collector {
    fn new(runtime: tokio::runtime::Handle, url: String) -> Result<Self, String> {
        let connector = TlsSetting::load(None, false)?.https_connector(EXPORT_TIMEOUT);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Ok(Collector {
            client,
            runtime,
            url: crate::redact::url(&url).into_owned(),
            failing: AtomicBool::new(false),
        })
    }

    /// Records one POST's fate for the log-once warning.
    fn observe(&self, problem: Option<String>) {
        match problem {
            Some(why) if !self.failing.swap(true, Ordering::Relaxed) => tracing::warn!(
                collector = %self.url,
                error = %why,
                "tracing: spans cannot be exported (requests are not affected); warning once until it recovers"
            ),
            None if self.failing.swap(false, Ordering::Relaxed) => {
                tracing::info!(collector = %self.url, "tracing: the collector takes spans again");
            }
            _ => {}
        }
    }
}

#[async_trait::async_trait]
impl HttpClient for Collector {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> Result<http::Response<Bytes>, HttpError> {
        let client = self.client.clone();
        let call = async move {
            let (parts, body) = request.into_parts();
            let resp = client
                .request(http::Request::from_parts(parts, Full::new(body)))
                .await?;
            let (parts, body) = resp.into_parts();
            let body = http_body_util::Limited::new(body, MAX_ANSWER_BYTES)
                .collect()
                .await?
                .to_bytes();
            Ok::<_, HttpError>(http::Response::from_parts(parts, body))
        };
        let result = match self
            .runtime
            // The timer is made inside the task: this thread has no runtime.
            .spawn(async move { tokio::time::timeout(EXPORT_TIMEOUT, call).await })
            .await
        {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(format!("no answer within {EXPORT_TIMEOUT:?}").into()),
            Err(e) => Err(format!("the export task ended: {e}").into()),
        };
        self.observe(match &result {
            Ok(r) if r.status().is_success() => None,
            Ok(r) => Some(format!("the collector answered {}", r.status())),
            Err(e) => Some(crate::error::describe(&**e)),
        });
        result
    }
}
