//! Serve: one request the route table (`crate::service`) sent to the proxy, from its
//! arrival to the response handed back. A routed or passed-through request is read
//! (bounded), checked, answered from the response cache when it can be, prepared for
//! the policy and forwarded ([`super::forward`]); `/v1/models`, calls on a stored
//! response and WebSocket handshakes take their own ways. Whatever happens, the
//! request's end is written once ([`super::access_log`]).

use std::sync::Arc;
use std::time::Instant;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;

use super::access_log::{Ident, RequestEnd};
use super::forward::Route;
use super::{ProxyBody, Router, headers, media, models, responses};
use crate::cache::{self, Lookup};
use crate::config::{PassthroughVerdict, RemoteMediaPolicy};
use crate::error::ProxyError;
use crate::policy::{self, Prepared, RequestParts, RouteRequest};
use crate::pools::RouteError;
use crate::prompt::{self, Endpoint};
use crate::trace::TraceContext;

/// What the proxy does with a request (the route table's choice).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// `GET /v1/models`: the per-set cache, or forwarded.
    Models,
    /// Read and forwarded: routed on its prompt when it is a routed endpoint's `POST`,
    /// else a path `proxy.passthrough` opens.
    Forward(Option<Endpoint>),
    /// A WebSocket handshake, tunnelled to one worker.
    Tunnel,
    /// A path `proxy.passthrough` closes (404 saying why).
    Closed(PassthroughVerdict),
}

impl Call {
    /// The endpoint label of logs and metrics.
    pub fn label(self) -> &'static str {
        match self {
            Call::Models => "models",
            Call::Forward(Some(e)) => e.as_str(),
            _ => "other",
        }
    }
}

impl Router {
    /// Answers a request for a worker as `call` says. Never fails: errors become JSON
    /// responses.
    pub async fn serve(&self, req: Request<Incoming>, call: Call) -> Response<ProxyBody> {
        let arrived = Instant::now();
        let request_id = headers::request_id(req.headers());
        let id = Ident {
            request_id: &request_id,
            trace: TraceContext::from_headers(req.headers()),
            endpoint: call.label(),
            arrived,
            who: None,
        };
        // `x-cache` on every answer while the cache is on: bypass unless the lookup
        // says otherwise.
        let mut x_cache = self.cache.as_ref().map(|_| cache::Status::Bypass);
        let mut end = RequestEnd::new(id, &self.metrics, self.export.as_deref(), &self.no_worker);
        let result = match call {
            Call::Models => models::get(self, req, &mut end).await,
            Call::Forward(endpoint) => {
                self.read_and_forward(req, endpoint, &mut x_cache, &mut end)
                    .await
            }
            Call::Tunnel => self.tunnel(req, &mut end).await,
            Call::Closed(verdict) => Err(self.closed(verdict, req.uri().path())),
        };
        let mut resp = match result {
            Ok(resp) => {
                end.answered();
                resp
            }
            Err(e) => {
                end.refused(&e);
                e.into_response()
            }
        };
        resp.headers_mut()
            .insert(headers::REQUEST_ID.clone(), request_id);
        if let Some(status) = x_cache {
            resp.headers_mut()
                .insert(headers::X_CACHE.clone(), status.header());
        }
        resp
    }

    /// Why `path` is not forwarded.
    fn closed(&self, verdict: PassthroughVerdict, path: &str) -> ProxyError {
        match verdict {
            PassthroughVerdict::Operator => ProxyError::OperatorEndpoint {
                path: shown_path(path),
            },
            _ => ProxyError::NotPassedThrough {
                path: shown_path(path),
                rule: self.config.proxy.passthrough.describe(),
            },
        }
    }

    /// Reads the body (bounded), answers from the response cache or routes and
    /// forwards.
    async fn read_and_forward<'a>(
        &'a self,
        req: Request<Incoming>,
        endpoint: Option<Endpoint>,
        x_cache: &mut Option<cache::Status>,
        end: &mut RequestEnd<'a>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let (parts, body) = req.into_parts();
        let body = self.read_body(&parts, body).await?;
        // Flow control's ticket (tenant, class), and the body as it is forwarded.
        let (ticket, body) = self.classify(&parts.headers, body, endpoint.is_some());
        end.id.who = self.flow.names(ticket);
        let id = end.id;
        // A call on a stored response goes where the response is.
        let table = self.table();
        if endpoint.is_none() && responses::response_id_in_path(parts.uri.path()).is_some() {
            let route = Route::without_prompt(id, table.everyone().pool, ticket);
            return self
                .to_response_holder(parts, body, &route, &mut end.waiting_on)
                .await;
        }
        // The response cache first: a hit skips extraction and the pick.
        let mut pending = None;
        if let (Some(c), Some(e)) = (&self.cache, endpoint) {
            match c.lookup(e, &parts.headers, &body).await {
                Lookup::Hit { entry, kind } => {
                    *x_cache = Some(cache::Status::Hit);
                    // Counted and logged like a routed answer (worker `cache`, reason
                    // `response_cache`).
                    end.replayed(&self.cache_worker, kind, entry.body.len());
                    return Ok(entry.replay());
                }
                Lookup::Route { status, pending: p } => {
                    *x_cache = Some(status);
                    pending = p;
                }
            }
        }
        let started = Instant::now();
        let mut ctx =
            endpoint.map(|e| prompt::extract(e, &body, self.config.cache.max_prompt_bytes));
        // The request's model chooses its pool and workers (other paths: any worker).
        let field = ctx.as_ref().and_then(|c| c.model.as_ref());
        let routed = match endpoint {
            Some(_) => {
                // An empty `model` names none (vLLM runs such a request on its base).
                let name = field.and_then(|f| f.name(&body)).filter(|n| !n.is_empty());
                table.route(name.as_deref()).map_err(|e| self.unrouted(e))?
            }
            None => table.everyone(),
        };
        // The served name the workers know, when it is not what the client wrote.
        let forwarded = match routed.rewrite {
            Some(served) => prompt::model::with_model(&body, field, served),
            None => body.clone(),
        };
        // The policy's own preparation (precise mode: token ids), once, before the
        // worker set is read: it may wait for the blocking pool.
        let pool = routed.pool;
        let prepared = match pool.policy().prepare(RequestParts {
            headers: &parts.headers,
            endpoint,
            body: &forwarded,
        }) {
            Some(work) => work.await,
            None => Prepared::Nothing,
        };
        // Read whether or not session affinity is on: `consistent_hash` hashes it too.
        let session = policy::session::session_key(&self.config.session, &parts.headers, &body);
        let set = routed.set;
        // Engines never share KV blocks across adapters or cache salts: neither does
        // the routing memory (the prompt is keyed by both), and an adapter request
        // prefers the workers that hold its adapter.
        if let Some(c) = ctx.as_mut() {
            c.scope(routed.adapter.map(|a| &**a));
        }
        let adapter = routed.adapter.map(|name| policy::AdapterAsk {
            name: Arc::clone(name),
            balance: policy::CacheParams::from(self.pool_cache(pool.name())),
        });
        // The chunk hashes extraction computed with the digest, moved to the request:
        // a shared-state pick matches by them and the publish of what was served
        // takes them.
        let chain = ctx
            .as_mut()
            .map(|c| std::mem::take(&mut c.chain))
            .unwrap_or_default();
        let route = Route {
            id,
            pool,
            policy: pool.policy(),
            req: RouteRequest {
                ctx: ctx.as_ref(),
                prepared,
                session,
                tie: session.or(ctx.as_ref().map(|c| c.digest)),
                chain: chain.into(),
                adapter,
            },
            started,
            cache: pending,
            pd: None,
            resume: None,
            ticket,
            preempted: Default::default(),
            debited: Default::default(),
        };
        if let (Some(legs), Some(endpoint)) = (routed.legs, endpoint) {
            return self
                .forward_pd(legs, endpoint, parts, forwarded, route, end)
                .await;
        }
        let mut route = route;
        route.resume = self.resume(endpoint, &parts, &forwarded, routed.model, id);
        self.forward(set, parts, forwarded, &route, &mut end.waiting_on)
            .await
    }

    /// How a streamed answer to this request continues elsewhere when its worker breaks
    /// (`migration:`); `None` for a request that streams nothing continuation knows.
    fn resume(
        &self,
        endpoint: Option<Endpoint>,
        parts: &http::request::Parts,
        body: &bytes::Bytes,
        model: Option<&Arc<str>>,
        id: super::access_log::Ident<'_>,
    ) -> Option<super::migrate::Resume> {
        let plan = super::migrate::plan(&self.config.migration, endpoint, body)?;
        let endpoint = endpoint?;
        let p = &self.config.proxy;
        let continuer = plan.refused.is_none().then(|| {
            let sending = super::migrate::Sending {
                client: self.client.clone(),
                pools: Arc::clone(&self.pools),
                max_prompt_bytes: self.config.cache.max_prompt_bytes,
                wait: p.attempt_timeout.unwrap_or(p.request_timeout),
                tries: p.max_retries + 1,
            };
            let head = (parts, id.request_id, &id.trace);
            super::migrate::Continuer::new(sending, model.cloned(), endpoint, head, body.clone())
        });
        Some(super::migrate::Resume { plan, continuer })
    }

    /// The request's body, read (bounded in size and time) and checked: before anything
    /// reads it for routing or the response cache, every body the router forwards,
    /// routed endpoint or pass-through, is checked the same.
    async fn read_body(
        &self,
        parts: &http::request::Parts,
        body: Incoming,
    ) -> Result<bytes::Bytes, ProxyError> {
        let body = crate::request::body::read(
            body,
            crate::request::body::content_length(&parts.headers),
            self.config.server.max_body_bytes,
            self.config.server.body_timeout,
        )
        .await?;
        if let RemoteMediaPolicy::Reject(status) = self.config.proxy.remote_media_url_policy
            && media::references_remote_media(&body)
        {
            return Err(ProxyError::RemoteMedia(
                StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
            ));
        }
        Ok(body)
    }

    /// The `cache:` settings of the pool `name` (`models.overrides.<name>.cache` over
    /// the top-level ones).
    fn pool_cache(&self, name: &str) -> &crate::config::CacheConfig {
        self.config
            .models
            .overrides
            .get(name)
            .and_then(|o| o.cache.as_ref())
            .unwrap_or(&self.config.cache)
    }

    /// Why a request has no pool, as the client is told: a model no worker serves is
    /// counted (without its name: a client's string never labels a metric).
    fn unrouted(&self, e: RouteError) -> ProxyError {
        match e {
            RouteError::UnknownModel(model) => {
                self.pools.not_found();
                ProxyError::ModelNotFound {
                    model: shown_path(&model),
                }
            }
            RouteError::NoModel { choices } => {
                let mut shown: Vec<String> =
                    choices.iter().take(20).map(|c| format!("`{c}`")).collect();
                if choices.len() > shown.len() {
                    shown.push(format!("and {} more", choices.len() - shown.len()));
                }
                ProxyError::ModelRequired {
                    choices: shown.join(", "),
                }
            }
        }
    }
}

/// A client's path (or model) as quoted back in an error: at most 100 characters.
fn shown_path(path: &str) -> String {
    match path.char_indices().nth(100) {
        Some((i, _)) => format!("{}…", &path[..i]),
        None => path.to_string(),
    }
}
