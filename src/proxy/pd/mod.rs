//! Disaggregated requests: a routed request of a pool with prefill and decode workers
//! (`crate::pools::legs`) goes through a prefill worker and then a decode worker
//! (vLLM's NIXL hand-off, [`nixl`]), or straight to a decode worker when the prefill
//! leg would not pay; with `pd.connector: sglang`, to both at once ([`sglang`]).
//!
//! ```text
//! decode pick   the decode leg's policy over the decode side, slot taken (held through
//!               the prefill leg: the decode load counts from the start)
//! bypass?       n > 1, an endpoint or call the engines do not hand off, or the prompt's
//!               uncached part on that decode worker small (pd.bypass): decode alone
//! prefill leg   [`prefill`]: the prefill leg's policy over the prefill side, retried on
//!               another prefill worker on connection errors, time-outs and 5xx; its
//!               slot ends with its answer; a 4xx is the client's answer
//! decode leg    the client's body plus the hand-off, through the usual attempt loop
//!               (`super::forward`) on the decode side, its answer streamed as any
//! ```
//!
//! Routing memory: both legs' workers record the prompt (their policies' `observe`):
//! the prefill worker computed it, and the decode worker holds it after the hand-off as
//! after computing it itself. Breakers count each leg's failures on that leg's worker. What the client
//! sees is one request: the decode answer, `x-routed-prefill` beside `x-routed-peer`,
//! one access line carrying both legs ([`Trail`]), the prefill's `cached_tokens` in
//! the usage ([`rewrite`]).

mod nixl;
mod prefill;
pub mod rewrite;
mod sglang;
pub mod trail;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::Response;

use super::access_log::RequestEnd;
use super::forward::Route;
use super::{ProxyBody, Router};
use crate::config::{Connector, OnPrefillFailure};
use crate::error::ProxyError;
use crate::policy::{Pick, Policy};
use crate::pools::Disaggregated;
use crate::prompt::Endpoint;
use crate::tree::WorkerMask;
use crate::upstream::RequestTemplate;
use prefill::Prefilled;
use trail::{Path, Trail};

impl Router {
    /// Routes a request of a disaggregated pool (see the module docs). `route` comes
    /// with its pool's policy; its legs' policies and workers are `legs`.
    pub(super) async fn forward_pd(
        &self,
        legs: Disaggregated<'_, Arc<dyn Policy>>,
        endpoint: Endpoint,
        parts: http::request::Parts,
        body: Bytes,
        mut route: Route<'_>,
        end: &mut RequestEnd<'_>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let (policies, phases) = (legs.policies, legs.phases);
        let pd = self.metrics.pd();
        let base = RequestTemplate::new(parts, route.id.request_id, &route.id.trace);
        route.policy = &policies.decode;
        let started = route.started;
        let Some(decode) = self
            .pick_for(0, &phases.decode, &route, &WorkerMask::default(), started)
            .await?
        else {
            return Err(ProxyError::NoWorker(
                "no decode worker is usable: every one is unhealthy, at max_load, or down",
            ));
        };
        if self.config.pd.connector == Connector::Sglang {
            return self
                .forward_sglang(legs, base, body, route, decode, end)
                .await;
        }
        let mut trail = Trail {
            path: Path::Disaggregated,
            prefill: None,
            prefill_tried: false,
            first_token: None,
        };
        let prefill_body = match self.bypass(endpoint, &body, &decode.0) {
            Some(reason) => Err(Path::Bypass(reason)),
            None => nixl::prefill_body(endpoint, &body).ok_or(Path::Bypass("unreadable")),
        };
        let mut decode_body = body.clone();
        match prefill_body {
            Err(path) => trail.path = path,
            Ok(prefill_body) => {
                route.policy = &policies.prefill;
                let waiting_on = &mut end.waiting_on;
                let prefilled = self
                    .prefill_leg(&phases.prefill, &base, prefill_body, &route, waiting_on)
                    .await;
                trail.prefill_tried = !matches!(prefilled, Prefilled::NoWorker);
                match prefilled {
                    Prefilled::Handoff {
                        params,
                        done,
                        between,
                    } => {
                        decode_body = nixl::decode_body(&body, &params).unwrap_or(body);
                        // The decode worker reads the prompt's KV into its own prefix
                        // cache (vLLM keeps the blocks a NIXL read placed there): its
                        // policy records the prompt as for one it computed, so the next
                        // turn can find it there and skip the prefill leg.
                        trail.prefill = Some(done);
                        between.disarm();
                    }
                    Prefilled::Nothing { done } => {
                        pd.missing_handoff();
                        tracing::warn!(
                            request_id = ?route.id.request_id,
                            prefill = &*done.worker,
                            "the prefill worker answered without kv_transfer_params (an end of sequence on the first token?): the decode worker computes the prompt"
                        );
                        trail.path = Path::DecodeOnly("missing_handoff");
                        trail.prefill = Some(done);
                    }
                    Prefilled::Answer(resp) => return Ok(resp),
                    Prefilled::NoWorker => trail.path = Path::Bypass("no_prefill_worker"),
                    Prefilled::Failed(last) => {
                        if self.config.pd.on_prefill_failure == OnPrefillFailure::Error {
                            let last = format!(
                                "on every prefill worker tried: {last}; pd.on_prefill_failure: error"
                            );
                            return Err(ProxyError::PrefillFailed {
                                status: http::StatusCode::BAD_GATEWAY,
                                last,
                            });
                        }
                        pd.prefill_fallback();
                        tracing::warn!(
                            request_id = ?route.id.request_id,
                            last = %last,
                            "the prefill leg failed on every prefill worker tried: the decode worker computes the prompt (pd.on_prefill_failure: decode_only)"
                        );
                        trail.path = Path::DecodeOnly("prefill_failed");
                    }
                }
            }
        }
        pd.request(trail.path.labels().0);
        if let Path::Bypass(r) = trail.path {
            pd.bypass(r);
            tracing::debug!(request_id = ?route.id.request_id, reason = r, "no prefill leg");
        }
        route.policy = &policies.decode;
        route.pd = Some(trail);
        route.started = Instant::now();
        self.forward_with(
            &phases.decode,
            &base,
            decode_body,
            &route,
            Some(decode),
            &mut end.waiting_on,
        )
        .await
    }

    /// Why a request for `endpoint` with `body`, whose decode worker was chosen by
    /// `pick`, skips the prefill leg; `None` when it takes it.
    fn bypass(&self, endpoint: Endpoint, body: &[u8], pick: &Pick) -> Option<&'static str> {
        let shape = nixl::Shape::of(body);
        if !shape.object {
            return Some("unreadable");
        }
        if shape.n > 1 {
            // The hand-off is single-consumer: n decodes cannot share it.
            return Some("n");
        }
        if endpoint == Endpoint::Messages {
            return Some("endpoint");
        }
        if shape.continues {
            // The stored response lives on a decode worker; the prefill worker has none.
            return Some("conversation");
        }
        uncached_is_small(pick, &self.config.pd.bypass).then_some("uncached")
    }
}

/// Whether the prompt's part the decode pick's worker does not hold (by its policy's
/// memory) is under both `pd.bypass` bounds. A load-only policy remembers nothing: the
/// whole prompt is uncached.
fn uncached_is_small(pick: &Pick, bypass: &crate::config::Bypass) -> bool {
    if pick.text_len == 0 {
        return false;
    }
    let uncached = pick.text_len - pick.matched.min(pick.text_len);
    let ratio = uncached as f64 / pick.text_len as f64;
    let tokens = pick.text_tokens().saturating_sub(pick.saved_tokens());
    tokens < bypass.uncached_tokens && ratio < bypass.uncached_ratio
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{MatchUnit, Reason};
    use crate::pools::pool::WorkerId;

    fn pick(matched: usize, text_len: usize, unit: MatchUnit) -> Pick {
        Pick {
            matched,
            text_len,
            unit,
            reason: Reason::CacheHit,
            ..Pick::load_only(Some(WorkerId(0)), text_len)
        }
    }

    #[test]
    fn a_small_uncached_part_in_both_measures_skips_the_prefill_leg() {
        let b = crate::config::PdConfig::default().bypass;
        // 1,000 tokens, 900 held: 100 uncached, 10 %.
        assert!(uncached_is_small(&pick(900, 1000, MatchUnit::Tokens), &b));
        // 40 % held: 60 % uncached is under 0.7, 600 tokens under 2048.
        assert!(uncached_is_small(&pick(400, 1000, MatchUnit::Tokens), &b));
        // Most of it uncached.
        assert!(!uncached_is_small(&pick(200, 1000, MatchUnit::Tokens), &b));
        // 10,000 held of 20,000: half, but 10,000 tokens to compute.
        assert!(!uncached_is_small(
            &pick(10_000, 20_000, MatchUnit::Tokens),
            &b
        ));
        // A load-only pick holds nothing, however short the prompt.
        assert!(!uncached_is_small(&pick(0, 40, MatchUnit::Bytes), &b));
        assert!(!uncached_is_small(&pick(0, 0, MatchUnit::Tokens), &b));
    }
}
