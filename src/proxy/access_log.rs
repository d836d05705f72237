//! The end of a request, written in one place: its outcome counted, its access line
//! written and its span exported by [`write`], whichever way it ended.
//!
//! A request ends in one of four ways, each of which builds a [`Line`] and hands it to
//! [`write`] exactly once:
//! - a worker's answer ends (its body read to the end, broken, or left by the client):
//!   [`AccessLog::end`], from `GuardedBody` (or a WebSocket tunnel when it closes);
//! - the router answers with its own error: [`RequestEnd::refused`];
//! - the response cache answers: [`RequestEnd::replayed`];
//! - the client leaves before any response headers: [`RequestEnd`] dropped unanswered.

use std::sync::Arc;
use std::time::Instant;

use http::HeaderValue;

use super::metrics::RequestMetrics;
use crate::error::{Chain, ProxyError};
use crate::log_format::Decimal;
use crate::policy::Reason;
use crate::pools::pool::Worker;
use crate::trace::TraceContext;
use crate::trace::export::{Exporter, Finished};

/// Status logged and counted for a request whose client left before its response
/// headers (nginx's "client closed request").
const CLIENT_CLOSED: u16 = 499;

/// Who a request is, for its logs, its span and what is sent upstream.
#[derive(Debug, Clone, Copy)]
pub struct Ident<'a> {
    pub request_id: &'a HeaderValue,
    /// The router's span (W3C Trace Context), sent upstream as `traceparent`.
    pub trace: TraceContext,
    /// Endpoint label for logs and metrics (`chat_completions`, `models`, `other`).
    pub endpoint: &'static str,
    /// When the request arrived (TTFB, duration, and the bound on its wait).
    pub arrived: Instant,
    /// Its tenant and class, once known (flow control on).
    pub who: Option<(&'a Arc<str>, &'a Arc<str>)>,
}

/// How a worker was chosen for one attempt.
#[derive(Debug, Clone, Copy)]
pub struct Decision {
    pub reason: Reason,
    pub matched_ratio: f64,
    /// The longest prefix any worker held, in tokens (estimated from bytes in
    /// approximate mode: whole engine blocks at the worker's learned tokens per byte;
    /// exact in precise mode).
    pub available_tokens: u64,
    /// The prefix the chosen worker was believed to hold, in the same tokens.
    pub predicted_tokens: u64,
    /// The pick's [`crate::policy::Pick::mark`].
    pub mark: crate::tree::Mark,
    /// Extract + match + insert, in µs.
    pub decision_us: u64,
    /// 0 for the first try.
    pub attempt: u32,
}

impl Decision {
    /// A worker chosen by `reason` alone, with no prefix to match (a tunnel, the holder
    /// of a stored response, a fan-out); the decision began at `started`.
    pub fn unmatched(reason: Reason, started: Instant, attempt: u32) -> Self {
        Decision {
            reason,
            matched_ratio: 0.0,
            available_tokens: 0,
            predicted_tokens: 0,
            mark: crate::tree::Mark::default(),
            decision_us: started.elapsed().as_micros() as u64,
            attempt,
        }
    }
}

/// A worker's answer to one request, from its headers to its end: what its access line
/// and span say. Owned, so that the answer's body carries it.
#[derive(Debug)]
pub struct AccessLog {
    pub request_id: HeaderValue,
    pub endpoint: &'static str,
    pub worker: Arc<str>,
    /// The worker's role (`primary`, `fallback`).
    pub role: &'static str,
    pub decision: Decision,
    pub status: u16,
    pub arrived: Instant,
    /// Cached prompt tokens the engine reported in the answer, once read.
    pub delivered_tokens: Option<u64>,
    /// The request's trace (its id is logged as `trace_id`).
    pub trace: TraceContext,
    /// A disaggregated pool's request: how its legs went.
    pub pd: Option<super::pd::trail::Trail>,
    /// The worker that finished the answer, when its stream continued elsewhere.
    pub continued_on: Option<Arc<str>>,
    /// How many times its stream continued elsewhere.
    pub migrations: u32,
    /// How its hedge went (`won`, `lost`, `failed`), when its first token was late and a
    /// second worker was asked too.
    pub hedge: Option<&'static str>,
    /// Its tenant and class (flow control on).
    pub who: Option<(Arc<str>, Arc<str>)>,
}

impl AccessLog {
    /// The answer of `worker` with `status` to the request `id`, chosen by `decision`.
    pub fn new(id: &Ident<'_>, worker: &Worker, decision: Decision, status: u16) -> Self {
        AccessLog {
            request_id: id.request_id.clone(),
            endpoint: id.endpoint,
            worker: Arc::clone(worker.label()),
            role: worker.config().role.as_str(),
            decision,
            status,
            arrived: id.arrived,
            delivered_tokens: None,
            trace: id.trace,
            pd: None,
            continued_on: None,
            migrations: 0,
            hedge: None,
            who: id.who.map(|(t, c)| (Arc::clone(t), Arc::clone(c))),
        }
    }

    /// Ends the request ([`write`]); `outcome` says how the answer ended (`complete`,
    /// `client_gone`, `upstream_error`, …). Its status was counted when its headers came.
    pub fn end(&self, metrics: &RequestMetrics, export: Option<&Exporter>, outcome: &'static str) {
        let line = Line {
            request_id: &self.request_id,
            trace: self.trace,
            endpoint: self.endpoint,
            who: self.who.as_ref().map(|(t, c)| (&**t, &**c)),
            arrived: self.arrived,
            worker: &self.worker,
            status: self.status,
            outcome,
            kind: Kind::Routed {
                role: self.role,
                decision: &self.decision,
                delivered_tokens: self.delivered_tokens,
                pd: self.pd.as_ref(),
                continued: self.continued_on.as_ref().map(|w| (w, self.migrations)),
                hedge: self.hedge,
            },
        };
        write(metrics, export, &line);
    }
}

/// The end of a request that no worker's body answers yet: written by the router when
/// it answers itself ([`RequestEnd::refused`], [`RequestEnd::replayed`]), or on drop
/// when the client left before any response (hyper drops the request's future): status
/// 499, outcome `client_gone`, with the worker it was waiting on, if any. A request
/// handed a worker's answer ([`RequestEnd::answered`]) ends with that answer instead
/// ([`AccessLog::end`]), so each request has exactly one line and one span.
pub struct RequestEnd<'a> {
    pub id: Ident<'a>,
    /// The worker of the attempt in progress.
    pub waiting_on: Option<Arc<str>>,
    metrics: &'a RequestMetrics,
    export: Option<&'a Exporter>,
    /// Worker label of answers the router gave itself (`none`).
    no_worker: &'a Arc<str>,
    done: bool,
}

impl<'a> RequestEnd<'a> {
    pub fn new(
        id: Ident<'a>,
        metrics: &'a RequestMetrics,
        export: Option<&'a Exporter>,
        no_worker: &'a Arc<str>,
    ) -> Self {
        RequestEnd {
            id,
            waiting_on: None,
            metrics,
            export,
            no_worker,
            done: false,
        }
    }

    /// A response was returned whose own end is written elsewhere (a worker's answer,
    /// a replay already written, a cached `/v1/models` list).
    pub fn answered(mut self) {
        self.done = true;
    }

    /// The router answers `error` itself.
    pub fn refused(mut self, error: &ProxyError) {
        self.done = true;
        let reason = match error {
            ProxyError::NoWorker(_) => "no_worker",
            _ => "-",
        };
        self.write(
            self.no_worker,
            error.status().as_u16(),
            "complete",
            Kind::Refused { reason, error },
        );
    }

    /// The response cache answers (`cache`: the kind of hit) with a stored body of
    /// `bytes`, as worker `worker` (`cache`).
    pub fn replayed(&mut self, worker: &Arc<str>, cache: &'static str, bytes: usize) {
        self.done = true;
        self.write(worker, 200, "complete", Kind::Replayed { cache, bytes });
    }

    fn write(&self, worker: &Arc<str>, status: u16, outcome: &'static str, kind: Kind<'_>) {
        let line = Line {
            request_id: self.id.request_id,
            trace: self.id.trace,
            endpoint: self.id.endpoint,
            who: self.id.who.map(|(t, c)| (&**t, &**c)),
            arrived: self.id.arrived,
            worker,
            status,
            outcome,
            kind,
        };
        write(self.metrics, self.export, &line);
    }
}

impl Drop for RequestEnd<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let worker = self.waiting_on.take();
        let worker = worker.as_ref().unwrap_or(self.no_worker);
        self.write(worker, CLIENT_CLOSED, "client_gone", Kind::ClientGone);
    }
}

/// One request's end, as [`write`] takes it.
struct Line<'a> {
    request_id: &'a HeaderValue,
    trace: TraceContext,
    endpoint: &'static str,
    /// Tenant and class (flow control on).
    who: Option<(&'a str, &'a str)>,
    arrived: Instant,
    /// The worker label counted and exported (`none`, `cache` for the router's own).
    worker: &'a Arc<str>,
    status: u16,
    outcome: &'static str,
    kind: Kind<'a>,
}

/// What answered the request.
enum Kind<'a> {
    /// A worker, chosen by `decision`.
    Routed {
        role: &'static str,
        decision: &'a Decision,
        delivered_tokens: Option<u64>,
        pd: Option<&'a super::pd::trail::Trail>,
        /// The worker that finished the answer and how many times it moved, when its
        /// stream continued elsewhere.
        continued: Option<(&'a Arc<str>, u32)>,
        /// How its hedge went, when it had one.
        hedge: Option<&'static str>,
    },
    /// The router, with its own error.
    Refused {
        reason: &'static str,
        error: &'a ProxyError,
    },
    /// The response cache.
    Replayed { cache: &'static str, bytes: usize },
    /// Nobody: the client left first.
    ClientGone,
}

/// The one writer of a request's end: counts its status (unless a worker's headers
/// did) and its outcome, writes its access line (target `cache_aware_router::access`;
/// each kind's fields, in one order), and hands its span to the exporter when on.
fn write(metrics: &RequestMetrics, export: Option<&Exporter>, line: &Line<'_>) {
    let (routed, reason) = match &line.kind {
        Kind::Routed {
            role,
            decision,
            delivered_tokens,
            ..
        } => (
            Some((*role, *decision, *delivered_tokens)),
            decision.reason.as_str(),
        ),
        Kind::Refused { reason, .. } => (None, *reason),
        Kind::Replayed { .. } => (None, "response_cache"),
        Kind::ClientGone => (None, "-"),
    };
    if routed.is_none() {
        metrics.request(line.endpoint, line.worker, line.status);
    }
    metrics.outcome(line.outcome);
    let (cache, bytes) = match line.kind {
        Kind::Replayed { cache, bytes } => (Some(cache), Some(bytes)),
        _ => (None, None),
    };
    let error = match line.kind {
        Kind::Refused { error, .. } => Some(error),
        _ => None,
    };
    let decision = routed.map(|r| r.1);
    let pd = match line.kind {
        Kind::Routed { pd, .. } => pd,
        _ => None,
    };
    let (continued, hedge) = match line.kind {
        Kind::Routed {
            continued, hedge, ..
        } => (continued, hedge),
        _ => (None, None),
    };
    let (pd_path, pd_reason) = pd.map(|t| t.path.labels()).unzip();
    let prefill = pd.and_then(|t| t.prefill.as_ref());
    let request_id = line.request_id.to_str().unwrap_or("-");
    tracing::info!(
        target: "cache_aware_router::access",
        request_id,
        trace_id = %line.trace.trace_id,
        endpoint = line.endpoint,
        tenant = line.who.map(|w| w.0),
        class = line.who.map(|w| w.1),
        worker = if error.is_some() { "-" } else { &**line.worker },
        role = routed.map(|r| r.0),
        reason = (!matches!(line.kind, Kind::ClientGone)).then_some(reason),
        cache,
        matched_ratio = decision.map(|d| tracing::field::display(Decimal::new(d.matched_ratio, 3))),
        available_tokens = decision.map(|d| d.available_tokens),
        predicted_tokens = decision.map(|d| d.predicted_tokens),
        delivered_tokens = routed.map(|r| r.2.map_or(-1, |t| t as i64)),
        decision_us = decision.map(|d| d.decision_us),
        attempt = decision.map(|d| d.attempt),
        hedge,
        continued_on = continued.map(|c| &**c.0),
        migrations = continued.map(|c| c.1),
        pd = pd_path,
        pd_reason = pd_reason.flatten(),
        prefill_worker = prefill.map(|p| &*p.worker),
        prefill_ms = prefill.map(|p| tracing::field::display(Decimal::millis(p.took, 1))),
        status = line.status,
        bytes,
        error = error.map(|e| tracing::field::display(Chain(e))),
        duration_ms = error
            .is_none()
            .then(|| tracing::field::display(Decimal::millis(line.arrived.elapsed(), 1))),
        outcome = line.outcome,
        "request"
    );
    if let Some(x) = export {
        let error = error.map(|e| Chain(e).to_string());
        x.record(&Finished {
            name: span_name(line.endpoint),
            trace: line.trace,
            arrived: line.arrived,
            endpoint: line.endpoint,
            request_id,
            worker: Arc::clone(line.worker),
            reason,
            matched_ratio: decision.map(|d| d.matched_ratio),
            attempt: decision.map(|d| d.attempt),
            pd: pd_path,
            prefill_worker: prefill.map(|p| Arc::clone(&p.worker)),
            status: line.status,
            outcome: line.outcome,
            error: error.as_deref(),
        });
    }
}

/// The span name of an endpoint label: method and route, or `proxy` for a path
/// `proxy.passthrough` let through (low cardinality: never the raw path).
fn span_name(label: &'static str) -> &'static str {
    match label {
        "chat_completions" => "POST /v1/chat/completions",
        "completions" => "POST /v1/completions",
        "messages" => "POST /v1/messages",
        "responses" => "POST /v1/responses",
        "models" => "GET /v1/models",
        _ => "proxy",
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use tracing::field::{Field, Visit};
    use tracing_subscriber::layer::{Context, SubscriberExt};

    use super::*;

    /// Records the field names of every event, in order (the message left out).
    #[derive(Clone, Default)]
    struct Names(Arc<Mutex<Vec<Vec<&'static str>>>>);

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Names {
        fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
            struct V(Vec<&'static str>);
            impl Visit for V {
                fn record_debug(&mut self, f: &Field, _: &dyn std::fmt::Debug) {
                    if f.name() != "message" {
                        self.0.push(f.name());
                    }
                }
            }
            let mut v = V(Vec::new());
            event.record(&mut v);
            self.0.lock().unwrap().push(v.0);
        }
    }

    #[test]
    fn each_way_a_request_ends_keeps_its_access_line_fields_in_order() {
        let names = Names::default();
        let subscriber = tracing_subscriber::registry().with(names.clone());
        let metrics = RequestMetrics::new();
        let request_id = HeaderValue::from_static("r1");
        let id = Ident {
            request_id: &request_id,
            trace: TraceContext::from_headers(&http::HeaderMap::new()),
            endpoint: "chat_completions",
            arrived: Instant::now(),
            who: None,
        };
        let none: Arc<str> = Arc::from("none");
        tracing::subscriber::with_default(subscriber, || {
            let log = AccessLog {
                request_id: request_id.clone(),
                endpoint: id.endpoint,
                worker: Arc::from("w0"),
                role: "primary",
                decision: Decision::unmatched(Reason::Miss, Instant::now(), 0),
                status: 200,
                arrived: id.arrived,
                delivered_tokens: None,
                trace: id.trace,
                pd: None,
                continued_on: None,
                migrations: 0,
                hedge: None,
                who: None,
            };
            log.end(&metrics, None, "complete");
            let continued = AccessLog {
                continued_on: Some(Arc::from("w1")),
                migrations: 1,
                hedge: Some("won"),
                ..log
            };
            continued.end(&metrics, None, "complete");
            RequestEnd::new(id, &metrics, None, &none).refused(&ProxyError::NoWorker("x"));
            RequestEnd::new(id, &metrics, None, &none).replayed(&Arc::from("cache"), "exact", 5);
            drop(RequestEnd::new(id, &metrics, None, &none));
            RequestEnd::new(id, &metrics, None, &none).answered();
        });
        let lines = names.0.lock().unwrap().clone();
        let head = ["request_id", "trace_id", "endpoint", "worker"];
        let tails: [&[&str]; 5] = [
            &[
                "role",
                "reason",
                "matched_ratio",
                "available_tokens",
                "predicted_tokens",
                "delivered_tokens",
                "decision_us",
                "attempt",
                "status",
                "duration_ms",
                "outcome",
            ],
            &[
                "role",
                "reason",
                "matched_ratio",
                "available_tokens",
                "predicted_tokens",
                "delivered_tokens",
                "decision_us",
                "attempt",
                "hedge",
                "continued_on",
                "migrations",
                "status",
                "duration_ms",
                "outcome",
            ],
            &["reason", "status", "error", "outcome"],
            &[
                "reason",
                "cache",
                "status",
                "bytes",
                "duration_ms",
                "outcome",
            ],
            &["status", "duration_ms", "outcome"],
        ];
        // One line per end; an answered request's line is its answer's.
        assert_eq!(lines.len(), tails.len());
        for (line, tail) in lines.iter().zip(tails) {
            let want: Vec<&str> = head.iter().chain(tail).copied().collect();
            assert_eq!(line, &want);
        }
    }
}
