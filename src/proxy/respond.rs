//! Respond: a worker's answer made the client's response: its status and end-to-end
//! headers, its body streamed inside a [`GuardedBody`] that holds the in-flight slot and
//! writes the request's end when the body ends.

use std::sync::Arc;

use http::Response;
use http::header::{self, HeaderValue};
use http_body_util::BodyExt;

use super::access_log::AccessLog;
use super::body::{BodyTap, GuardedBody};
use super::forward::Route;
use super::{ProxyBody, Router, headers, migrate, usage};
use crate::cache;
use crate::pools::pool::{InFlightGuard, Worker};
use crate::prompt::Endpoint;
use crate::upstream::UpstreamBody;

impl Router {
    /// The client's response: upstream status and end-to-end headers, body streamed with
    /// the in-flight guard.
    pub(super) fn respond(
        &self,
        resp: Response<UpstreamBody>,
        guard: InFlightGuard,
        log: AccessLog,
        route: &Route<'_>,
    ) -> Response<ProxyBody> {
        let pending = route.cache.clone();
        // Handed back with the answer (precise mode's parity check); cloning shares it.
        let prepared = route.req.prepared.clone();
        self.metrics.request(log.endpoint, &log.worker, log.status);
        let record = pending.and_then(|p| cache::Recorder::start(p, resp.status(), resp.headers()));
        self.metrics.first_byte(&log.worker, log.arrived.elapsed());
        let status = resp.status();
        let (mut parts, incoming) = resp.into_parts();
        if headers::strip_hop_by_hop(&mut parts.headers) {
            // Framing is hyper's job now; a length beside chunked framing is stale.
            parts.headers.remove(header::CONTENT_LENGTH);
        }
        headers::rewrite_worker_urls(&mut parts.headers, guard.worker().url());
        if self.config.proxy.add_routed_peer_header
            && let Ok(v) = HeaderValue::from_str(&guard.worker().url().to_string())
        {
            parts.headers.insert(headers::ROUTED_PEER.clone(), v);
            if let Some(p) = route.pd.as_ref().and_then(|t| t.prefill.as_ref())
                && let Ok(v) = HeaderValue::from_str(&p.worker)
            {
                parts.headers.insert(headers::ROUTED_PREFILL.clone(), v);
            }
        }
        let mut log = log;
        log.pd = route.pd.clone();
        let reported = route.pd.as_ref().and_then(|t| t.reported_cached_tokens());
        if reported.is_some() {
            // The usage's count is rewritten as it passes: the length may change.
            parts.headers.remove(header::CONTENT_LENGTH);
        }
        // A compressed answer passes untouched: no event of it is read.
        let encoded = parts
            .headers
            .get(header::CONTENT_ENCODING)
            .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
        let is_sse = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if is_sse {
            // Keep any buffering proxy in front (nginx) from holding tokens back.
            parts
                .headers
                .entry(header::CACHE_CONTROL)
                .or_insert(HeaderValue::from_static("no-cache"));
            parts
                .headers
                .entry("x-accel-buffering")
                .or_insert(HeaderValue::from_static("no"));
        }
        let tap = BodyTap {
            metrics: Arc::clone(&self.metrics),
            policy: Arc::clone(route.policy),
            scanner: usage::UsageScanner::for_response(
                &parts.headers,
                may_answer_with_response_id(log.endpoint),
            ),
            streamed: is_sse,
            record,
            log,
            drift_floor: self.config.cache.drift_floor,
            drift_for: self.config.cache.drift_for,
            block_tokens: self.config.cache.engine_block_tokens as u64,
            prepared,
            export: self.export.clone(),
            charge: self
                .flow
                .charge(route.ticket, route.cost(), route.take_debit()),
        };
        let stream = route
            .resume
            .as_ref()
            .filter(|_| is_sse && status.is_success() && !encoded)
            .and_then(|r| self.stream_plan(r, guard.worker()));
        let mut body = GuardedBody::new(incoming, guard, self.config.proxy.request_timeout, tap);
        if let Some(stream) = stream {
            body = body.with_stream(stream);
        }
        let body = match reported {
            Some(cached) => super::pd::rewrite::CachedTokens::new(body, cached).boxed(),
            None => body.boxed(),
        };
        Response::from_parts(parts, body)
    }
}

impl Router {
    /// What the body of a streamed answer keeps of its continuation plan.
    fn stream_plan(&self, resume: &migrate::Resume, worker: &Worker) -> Option<migrate::Stream> {
        let metrics = Arc::clone(&self.metrics);
        Some(match (resume.plan.refused, &resume.continuer) {
            (Some(r), _) => {
                migrate::Stream::Watch(migrate::Watch::new(resume.plan.kind, r, metrics))
            }
            (None, Some(c)) => migrate::Stream::Migrate(Box::new(migrate::Migration::new(
                resume.plan.kind,
                c.clone(),
                &self.config.migration,
                metrics,
                worker,
            ))),
            (None, None) => return None,
        })
    }
}

/// Whether an answer to the endpoint labelled `label` ([`super::Call::label`]) may carry
/// a `/v1/responses` id: every label but those of the three endpoints that never answer
/// with one (a pass-through path may).
fn may_answer_with_response_id(label: &str) -> bool {
    ![
        Endpoint::ChatCompletions,
        Endpoint::Completions,
        Endpoint::Messages,
    ]
    .iter()
    .any(|e| e.as_str() == label)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::Call;

    #[test]
    fn only_responses_and_unknown_paths_are_searched_for_a_response_id() {
        let label = |c: Call| may_answer_with_response_id(c.label());
        assert!(label(Call::Forward(Some(Endpoint::Responses))));
        assert!(label(Call::Forward(None)));
        for e in [
            Endpoint::ChatCompletions,
            Endpoint::Completions,
            Endpoint::Messages,
        ] {
            assert!(!label(Call::Forward(Some(e))), "{e:?}");
        }
    }
}
