//! SGLang's disaggregation (`pd.connector: sglang`): the same body to a prefill and a
//! decode worker at once, with `bootstrap_host` (the prefill worker's host),
//! `bootstrap_port` (its `workers[].bootstrap_port`, else `null`) and a random
//! `bootstrap_room` where the two engines meet; the decode answer is the client's, the
//! prefill answer is drained. Either leg's failure ends the other at once: the engines
//! would otherwise wait out their 300 s rendezvous. No bypass: an SGLang decode worker
//! cannot compute a prompt alone.
//!
//! The prefill leg runs as a task of its own (it may outlive the decode answer's
//! headers), holding its in-flight slot until its answer has been read; it tells a
//! failure on a oneshot channel that the decode leg watches, before its headers and then
//! in its body ([`Watched`]). Dropping the decode leg (its failure, the client gone)
//! aborts the task, which closes the prefill connection.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use serde_json::{Map, Value};
use tokio::sync::oneshot;

use super::trail::{Path, Trail};
use crate::error::{BoxError, ProxyError};
use crate::policy::{Outcome, Pick, Policy};
use crate::pools::Disaggregated;
use crate::pools::pool::InFlightGuard;
use crate::pools::pool::breaker::Outcome as BreakerOutcome;
use crate::proxy::access_log::{AccessLog, RequestEnd};
use crate::proxy::forward::{Attempt, Route};
use crate::proxy::metrics::RequestMetrics;
use crate::proxy::metrics::pd::failure_cause;
use crate::proxy::retry::Retries;
use crate::proxy::{ProxyBody, Router};
use crate::tree::WorkerMask;
use crate::upstream::{RequestTemplate, Upstream};

/// How the prefill leg failed: the status the client gets (502, or the worker's 4xx)
/// and why.
#[derive(Debug)]
struct Failure {
    status: StatusCode,
    why: String,
}

/// `body` with the bootstrap fields; `None` when it is not a JSON object.
fn with_bootstrap(body: &[u8], host: &str, port: Option<u16>, room: u64) -> Option<Bytes> {
    let mut m: Map<String, Value> = serde_json::from_slice(body).ok()?;
    m.insert("bootstrap_host".into(), host.into());
    m.insert(
        "bootstrap_port".into(),
        port.map_or(Value::Null, Value::from),
    );
    m.insert("bootstrap_room".into(), room.into());
    serde_json::to_vec(&m).ok().map(Bytes::from)
}

/// The host of `authority` (`host[:port]`, IPv6 kept in brackets).
fn host_of(authority: &str) -> &str {
    match authority.rfind(':') {
        Some(i) if !authority[i..].contains(']') => &authority[..i],
        _ => authority,
    }
}

/// Aborts the prefill leg's task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What the prefill leg's task owns.
struct PrefillLeg {
    client: Upstream,
    guard: InFlightGuard,
    base: RequestTemplate,
    body: Bytes,
    wait: Duration,
    metrics: Arc<RequestMetrics>,
    fail: oneshot::Sender<Failure>,
}

impl PrefillLeg {
    /// Sends the prefill leg and reads its answer to the end; a failure goes on `fail`
    /// (its breaker hears it; a 2xx answer read whole drops `fail` unsent).
    async fn run(mut self) {
        let worker = Arc::clone(self.guard.worker());
        let sent = Instant::now();
        let result = (self.client)
            .send(&worker, &self.base, self.body, None, self.wait)
            .await;
        self.guard.record(match &result {
            Ok(r) if r.status().is_server_error() => BreakerOutcome::Failure,
            Ok(r) if r.status().is_client_error() => BreakerOutcome::Neutral,
            Ok(_) => BreakerOutcome::Success,
            Err(_) => BreakerOutcome::Failure,
        });
        let pd = self.metrics.pd();
        if let Some(cause) = failure_cause(&result) {
            pd.leg_failure("prefill", cause);
        }
        let failure = match result {
            Err(e) => Some(Failure {
                status: StatusCode::BAD_GATEWAY,
                why: format!("{}: {}", worker.url(), crate::error::Chain(&e)),
            }),
            Ok(resp) => {
                let status = resp.status();
                self.guard.first_byte();
                let read = tokio::time::timeout(self.wait, resp.into_body().collect()).await;
                match (status.is_success(), read) {
                    (true, Ok(Ok(_))) => {
                        pd.prefill_took(sent.elapsed().as_secs_f64());
                        None
                    }
                    (true, _) => {
                        pd.leg_failure("prefill", "upstream");
                        Some(Failure {
                            status: StatusCode::BAD_GATEWAY,
                            why: format!("{}: its answer broke off", worker.url()),
                        })
                    }
                    (false, read) => {
                        let text = read
                            .ok()
                            .and_then(Result::ok)
                            .map(|c| c.to_bytes())
                            .unwrap_or_default();
                        let text = String::from_utf8_lossy(&text[..text.len().min(300)]);
                        let status = match status.is_client_error() {
                            true => status,
                            false => StatusCode::BAD_GATEWAY,
                        };
                        Some(Failure {
                            status,
                            why: format!("{} answered {}: {text}", worker.url(), status.as_u16()),
                        })
                    }
                }
            }
        };
        if let Some(f) = failure {
            let _ = self.fail.send(f);
        }
    }
}

impl Router {
    /// A request of a disaggregated SGLang pool (see the module docs), its decode
    /// worker already chosen (`decode`, with its slot); `route` comes with the decode
    /// leg's policy.
    pub(super) async fn forward_sglang(
        &self,
        legs: Disaggregated<'_, Arc<dyn Policy>>,
        base: RequestTemplate,
        body: Bytes,
        mut route: Route<'_>,
        (dpick, mut dguard): (Pick, InFlightGuard),
        end: &mut RequestEnd<'_>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let pd = self.metrics.pd();
        let (phases, prefill_policy) = (legs.phases, &legs.policies.prefill);
        let decode_policy = route.policy;
        route.policy = prefill_policy;
        let started = Instant::now();
        let Some((ppick, pguard)) = self.pick(&phases.prefill, &route, &WorkerMask::default())
        else {
            return Err(ProxyError::NoWorker(
                "no prefill worker is usable (an SGLang decode worker cannot compute a prompt alone)",
            ));
        };
        let pworker = Arc::clone(pguard.worker());
        // A request counts one decision: its prefill leg's.
        self.decided(&ppick, &pworker, started, 0, true);
        let room = rand::random::<u64>() >> 1;
        let host = host_of(pworker.url().authority()).to_string();
        let body = with_bootstrap(&body, &host, pworker.config().bootstrap_port, room).ok_or(
            ProxyError::BadRequest("a disaggregated request's body must be a JSON object".into()),
        )?;
        let wait = Retries::new(&self.config.proxy, route.id.arrived).attempt_wait();
        let (fail_tx, mut fail_rx) = oneshot::channel();
        let prefill = AbortOnDrop(tokio::spawn(
            PrefillLeg {
                client: self.client.clone(),
                guard: pguard,
                base: base.clone(),
                body: body.clone(),
                wait,
                metrics: Arc::clone(&self.metrics),
                fail: fail_tx,
            }
            .run(),
        ));
        route.policy = decode_policy;
        route.pd = Some(Trail {
            path: Path::Disaggregated,
            prefill: None,
            prefill_tried: true,
            first_token: None,
        });
        let route = route;
        let prefill_watch = Attempt {
            policy: &**prefill_policy,
            req: &route.req,
            pick: &ppick,
            worker: &pworker,
            done: false,
        };
        let dworker = Arc::clone(dguard.worker());
        end.waiting_on = Some(Arc::clone(dworker.label()));
        let ddecision = self.decided(&dpick, &dworker, route.started, 0, false);
        let watch = Attempt {
            policy: &**route.policy,
            req: &route.req,
            pick: &dpick,
            worker: &dworker,
            done: false,
        };
        let mut prefill_live = true;
        let result = {
            let decode = self.send(watch, &base, &body, &route.id, &mut dguard, wait);
            tokio::pin!(decode);
            loop {
                tokio::select! {
                    (r, _) = &mut decode => break r,
                    f = &mut fail_rx, if prefill_live => match f {
                        Ok(f) => {
                            // The decode leg waits on a rendezvous that will not come.
                            prefill_watch.finish(Outcome::Failed);
                            tracing::warn!(request_id = ?route.id.request_id, prefill = %pworker.url(), why = %f.why, "SGLang prefill leg failed: its decode leg is cancelled");
                            return Err(ProxyError::PrefillFailed { status: f.status, last: f.why });
                        }
                        // Answered and read whole.
                        Err(_) => prefill_live = false,
                    },
                }
            }
        };
        pd.decode_attempt(&result);
        let resp = result?;
        let status = resp.status();
        if !status.is_success() {
            // The room is spent: no other decode worker, and the prefill leg ends now.
            drop(prefill);
            let log = AccessLog::new(&route.id, &dworker, ddecision, status.as_u16());
            return Ok(self.respond(resp, dguard, log, &route));
        }
        prefill_watch.finish(Outcome::Served);
        pd.request("disaggregated");
        let log = AccessLog::new(&route.id, &dworker, ddecision, status.as_u16());
        let resp = self.respond(resp, dguard, log, &route);
        let fail = prefill_live.then_some(fail_rx);
        Ok(resp.map(|inner| {
            Watched {
                inner,
                fail,
                _prefill: prefill,
            }
            .boxed()
        }))
    }
}

/// The decode answer's body while the prefill leg may still fail: its failure ends
/// the body with an error (the decode engine would wait out its rendezvous).
struct Watched {
    inner: ProxyBody,
    fail: Option<oneshot::Receiver<Failure>>,
    _prefill: AbortOnDrop,
}

/// The prefill leg failed after the decode answer began.
#[derive(Debug, thiserror::Error)]
#[error("the prefill leg failed after the decode answer began: {0}")]
struct PrefillBroke(String);

impl Body for Watched {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(rx) = this.fail.as_mut()
            && let Poll::Ready(r) = Pin::new(rx).poll(cx)
        {
            this.fail = None;
            if let Ok(f) = r {
                tracing::warn!(why = %f.why, "SGLang prefill leg failed: the decode stream is cut");
                return Poll::Ready(Some(Err(Box::new(PrefillBroke(f.why)))));
            }
        }
        Pin::new(&mut this.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bootstrap_fields_join_the_body_and_hosts_keep_their_brackets() {
        let b =
            with_bootstrap(br#"{"text":"hi","stream":true}"#, "10.0.0.1", Some(8998), 7).unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["bootstrap_host"], "10.0.0.1");
        assert_eq!(v["bootstrap_port"], 8998);
        assert_eq!(v["bootstrap_room"], 7);
        assert_eq!(v["text"], "hi");
        let b = with_bootstrap(b"{}", "h", None, 1).unwrap();
        assert_eq!(
            serde_json::from_slice::<Value>(&b).unwrap()["bootstrap_port"],
            Value::Null
        );
        assert!(with_bootstrap(b"[]", "h", None, 1).is_none());
        assert_eq!(host_of("10.0.0.1:8000"), "10.0.0.1");
        assert_eq!(host_of("[::1]:8000"), "[::1]");
        assert_eq!(host_of("[::1]"), "[::1]");
        assert_eq!(host_of("pods.local"), "pods.local");
    }
}
