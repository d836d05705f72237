//! The Responses API's calls on one stored response: `GET /v1/responses/{id}` (a poll,
//! or a stream resumed with `?stream=true&starting_after=N`), `POST …/{id}/cancel`,
//! `DELETE …/{id}`, `GET …/{id}/input_items`, and any other path below an id.
//!
//! An engine keeps each response in its own memory, so only the worker that created it
//! can answer these; any other says 404. They go to that worker, as the conversation
//! bindings know it (learned from the create answer's id, shared with the other router
//! replicas under `state:`; see `crate::policy::session`). When no binding names a
//! worker still in the pool (an id created before a restart, through a replica whose
//! binding has not arrived, or one that expired), the call is fanned out to every usable
//! worker at once and the client gets the first answer that is not a 404: a 2xx or any
//! other answer at once, a worker's 5xx only once no other answer is left; the engines'
//! 404 when every worker says so, never a router 5xx for an id no worker knows. The
//! worker that answered 2xx is bound to the id.
//!
//! No retry moves such a call to another worker: none but the holder could answer it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use bytes::Bytes;
use http::{Response, StatusCode};

use super::Router;
use super::access_log::{AccessLog, Decision};
use super::forward::Route;
use crate::error::{ProxyBody, ProxyError};
use crate::policy::{Answer, Reason};
use crate::pools::pool::InFlightGuard;
use crate::pools::pool::breaker::Outcome as BreakerOutcome;
use crate::upstream::{RequestTemplate, UpstreamBody};

/// The response id a call names when `path` is `/v1/responses/{id}` or a path below it
/// (`…/cancel`, `…/input_items`); `None` for `/v1/responses` itself and other paths.
pub fn response_id_in_path(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v1/responses/")?;
    let id = rest.split('/').next().unwrap_or(rest);
    (!id.is_empty()).then_some(id)
}

/// One worker's answer to a fanned-out call, with the slot it held there.
type Reply = (InFlightGuard, Result<Response<UpstreamBody>, ProxyError>);

/// Which of two answers a fanned-out call keeps while it waits for a better one: a
/// worker's 5xx (it may hold the response and be in trouble) over a 404 (it does not),
/// a 404 over a failure to get any answer.
fn rank(r: &Result<Response<UpstreamBody>, ProxyError>) -> u8 {
    match r {
        Ok(resp) if resp.status().is_server_error() => 2,
        Ok(_) => 1,
        Err(_) => 0,
    }
}

impl Router {
    /// Sends a call on a stored response (its id in the path) to the worker holding
    /// it, or fans it out (see the module docs). `body` has been read; nothing was
    /// routed yet.
    pub(super) async fn to_response_holder(
        &self,
        parts: http::request::Parts,
        body: Bytes,
        route: &Route<'_>,
        waiting_on: &mut Option<Arc<str>>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let id = response_id_in_path(parts.uri.path())
            .unwrap_or_default()
            .to_string();
        let key = xxhash_rust::xxh3::xxh3_64(id.as_bytes());
        let set = self.worker_set();
        let base = RequestTemplate::new(parts, route.id.request_id, &route.id.trace);
        let deadline = route.id.arrived + self.config.proxy.request_timeout;
        let wait = || {
            let left = deadline.saturating_duration_since(Instant::now());
            self.config
                .proxy
                .attempt_timeout
                .map_or(left, |a| a.min(left))
        };
        let holder = route
            .policy
            .response_holder(key, &set)
            .and_then(|w| set.get(w).cloned());
        if let Some(worker) = holder {
            // The only worker that can answer: at max_load or with its breaker open,
            // the client is told to come back, not sent to a worker that would say 404.
            let mut guard = InFlightGuard::try_acquire(&worker)
                .filter(|_| worker.is_healthy())
                .ok_or(ProxyError::NoWorker(
                    "the worker holding this response is unhealthy or at max_load",
                ))?;
            if !guard.admit() {
                return Err(ProxyError::NoWorker(
                    "the worker holding this response has its circuit breaker open",
                ));
            }
            *waiting_on = Some(Arc::clone(worker.label()));
            self.metrics
                .decision(Reason::Conversation, route.started.elapsed());
            let result = self.client.send(&worker, &base, body, None, wait()).await;
            record(&mut guard, &result);
            let resp = result?;
            return Ok(self.answer(resp, guard, Reason::Conversation, route));
        }
        self.fan_out(&set, &base, body, &id, route, wait()).await
    }

    /// Sends the call to every usable worker at once; see the module docs for which
    /// answer the client gets.
    async fn fan_out(
        &self,
        set: &crate::pools::pool::WorkerSet,
        base: &RequestTemplate,
        body: Bytes,
        id: &str,
        route: &Route<'_>,
        wait: std::time::Duration,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let now = crate::pools::pool::now();
        let mut pending: Vec<Pin<Box<dyn Future<Output = Reply> + Send + '_>>> = set
            .workers()
            .iter()
            .filter(|w| w.is_routable(now))
            .filter_map(|w| {
                let mut guard = InFlightGuard::try_acquire(w)?;
                guard.admit().then_some(guard)
            })
            .map(|guard| {
                let body = body.clone();
                Box::pin(async move {
                    let worker = Arc::clone(guard.worker());
                    let result = self.client.send(&worker, base, body, None, wait).await;
                    (guard, result)
                }) as Pin<Box<dyn Future<Output = Reply> + Send + '_>>
            })
            .collect();
        if pending.is_empty() {
            self.metrics
                .decision(Reason::NoWorker, route.started.elapsed());
            return Err(ProxyError::NoWorker(
                "every worker is unhealthy, at max_load, or down",
            ));
        }
        self.metrics
            .decision(Reason::FanOut, route.started.elapsed());
        let mut kept: Option<Reply> = None;
        while !pending.is_empty() {
            let (i, (mut guard, result)) = std::future::poll_fn(|cx| {
                for (i, p) in pending.iter_mut().enumerate() {
                    if let Poll::Ready(out) = p.as_mut().poll(cx) {
                        return Poll::Ready((i, out));
                    }
                }
                Poll::Pending
            })
            .await;
            drop(pending.swap_remove(i));
            record(&mut guard, &result);
            match result {
                Ok(resp)
                    if resp.status() != StatusCode::NOT_FOUND
                        && !resp.status().is_server_error() =>
                {
                    if resp.status().is_success() {
                        let answer = Answer {
                            response_id: Some(id),
                            ..Answer::default()
                        };
                        route.policy.answered(guard.worker(), &answer);
                    }
                    // The others' calls are dropped: they could only say 404.
                    drop(pending);
                    return Ok(self.answer(resp, guard, Reason::FanOut, route));
                }
                result => {
                    if kept.as_ref().is_none_or(|k| rank(&result) > rank(&k.1)) {
                        kept = Some((guard, result));
                    }
                }
            }
        }
        match kept {
            Some((guard, Ok(resp))) => Ok(self.answer(resp, guard, Reason::FanOut, route)),
            Some((_, Err(e))) => Err(e),
            None => Err(ProxyError::NoWorker(
                "every worker is unhealthy, at max_load, or down",
            )),
        }
    }

    /// The client's response from `worker`'s answer, logged as `reason` decided it.
    fn answer(
        &self,
        resp: Response<UpstreamBody>,
        guard: InFlightGuard,
        reason: Reason,
        route: &Route<'_>,
    ) -> Response<ProxyBody> {
        let decision = Decision::unmatched(reason, route.started, 0);
        let log = AccessLog::new(&route.id, guard.worker(), decision, resp.status().as_u16());
        self.respond(resp, guard, log, route)
    }
}

/// Tells the worker's breaker how the call went: a 5xx or no answer is a failure, a 4xx
/// (a 404 for an id it does not hold) is not.
fn record(guard: &mut InFlightGuard, result: &Result<Response<UpstreamBody>, ProxyError>) {
    guard.record(match result {
        Ok(r) if r.status().is_server_error() => BreakerOutcome::Failure,
        Ok(r) if r.status().is_client_error() => BreakerOutcome::Neutral,
        Ok(_) => BreakerOutcome::Success,
        Err(_) => BreakerOutcome::Failure,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_on_a_stored_response_name_its_id() {
        for (path, id) in [
            ("/v1/responses/resp_1", Some("resp_1")),
            ("/v1/responses/resp_1/cancel", Some("resp_1")),
            ("/v1/responses/resp_1/input_items", Some("resp_1")),
            ("/v1/responses/resp_1/", Some("resp_1")),
            ("/v1/responses", None),
            ("/v1/responses/", None),
            ("/v1/responses//cancel", None),
            ("/v1/responsesx/resp_1", None),
            ("/v1/chat/completions", None),
        ] {
            assert_eq!(response_id_in_path(path), id, "{path}");
        }
    }
}
