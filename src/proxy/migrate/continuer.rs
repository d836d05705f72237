//! The continuation's pick and send: on the current workers of the pool the request
//! routed in (a worker removed since is gone from it; a draining one is not usable),
//! the workers that broke this answer excluded, like a retry: another worker when one
//! fails before its headers, at most `proxy.max_retries` more.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderValue;
use http::header;

use crate::error::ProxyError;
use crate::policy::{self, Outcome, Pick, Policy, RouteRequest, Routes};
use crate::pools::pool::breaker::Outcome as BreakerOutcome;
use crate::pools::pool::{InFlightGuard, Worker, WorkerSet};
use crate::prompt::{self, Endpoint};
use crate::tree::WorkerMask;
use crate::upstream::{RequestTemplate, Upstream, UpstreamBody};

/// A continuation that answered: its body and its slot.
#[derive(Debug)]
pub struct Resumed {
    pub body: UpstreamBody,
    pub guard: InFlightGuard,
}

/// A continuation being placed (Send, not Sync: its owner wraps it).
pub type Starting = Pin<Box<dyn Future<Output = Result<Resumed, ProxyError>> + Send>>;

/// What a request's continuations are sent with. Cheap to clone.
#[derive(Clone)]
pub struct Continuer(Arc<Inner>);

struct Inner {
    client: Upstream,
    pools: Arc<Routes>,
    /// The served name it routes as (`None`: workers that serve any model).
    model: Option<Arc<str>>,
    endpoint: Endpoint,
    template: RequestTemplate,
    /// The body the first worker got.
    body: Bytes,
    max_prompt_bytes: usize,
    /// What one attempt waits for headers.
    wait: Duration,
    /// Workers tried per continuation, at most.
    tries: u32,
    request_id: HeaderValue,
}

impl std::fmt::Debug for Continuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Continuer")
            .field("endpoint", &self.0.endpoint)
            .field("model", &self.0.model)
            .finish_non_exhaustive()
    }
}

/// How a [`Continuer`] sends (parts of `proxy:` and the request's own).
pub struct Sending {
    pub client: Upstream,
    pub pools: Arc<Routes>,
    pub max_prompt_bytes: usize,
    /// `proxy.attempt_timeout_secs`, else `proxy.request_timeout_secs`.
    pub wait: Duration,
    /// `proxy.max_retries` + 1.
    pub tries: u32,
}

impl Continuer {
    /// The continuations of the request `head` + `body` to `endpoint`, routed as
    /// `model`.
    pub fn new(
        sending: Sending,
        model: Option<Arc<str>>,
        endpoint: Endpoint,
        head: (
            &http::request::Parts,
            &HeaderValue,
            &crate::trace::TraceContext,
        ),
        body: Bytes,
    ) -> Self {
        let (parts, request_id, trace) = head;
        let (mut copy, ()) = http::Request::new(()).into_parts();
        copy.method = parts.method.clone();
        copy.uri = parts.uri.clone();
        // A Responses or Messages answer continues as chat (see `responses`).
        let endpoint = match endpoint {
            Endpoint::Responses | Endpoint::Messages => {
                copy.uri = http::Uri::from_static("/v1/chat/completions");
                Endpoint::ChatCompletions
            }
            other => other,
        };
        copy.headers = parts.headers.clone();
        Continuer(Arc::new(Inner {
            client: sending.client,
            pools: sending.pools,
            model,
            endpoint,
            template: RequestTemplate::new(copy, request_id, trace),
            body,
            max_prompt_bytes: sending.max_prompt_bytes,
            wait: sending.wait,
            tries: sending.tries.max(1),
            request_id: request_id.clone(),
        }))
    }

    /// The body the first worker got.
    pub fn original(&self) -> &Bytes {
        &self.0.body
    }

    pub fn request_id(&self) -> &HeaderValue {
        &self.0.request_id
    }

    /// Sends `body` to a worker not in `avoid`, trying another while one fails before
    /// its headers; resolves with the first that answers a 2xx event stream.
    pub fn start(&self, body: Bytes, avoid: WorkerMask) -> Starting {
        let inner = Arc::clone(&self.0);
        Box::pin(async move { inner.place(body, avoid).await })
    }
}

impl Inner {
    /// The pool's workers and policy now.
    fn pool(&self) -> (Arc<WorkerSet>, Arc<dyn Policy>) {
        let table = self.pools.table();
        if let Some(name) = &self.model
            && let Some((_, pool, set)) = table.models().into_iter().find(|(n, ..)| *n == name)
        {
            return (Arc::clone(set), Arc::clone(pool.policy()));
        }
        let everyone = table.everyone();
        let set = table.any().unwrap_or(everyone.set);
        (Arc::clone(set), Arc::clone(everyone.pool.policy()))
    }

    async fn place(&self, body: Bytes, mut tried: WorkerMask) -> Result<Resumed, ProxyError> {
        let (set, policy) = self.pool();
        let ctx = prompt::extract(self.endpoint, &body, self.max_prompt_bytes);
        let req = RouteRequest {
            ctx: Some(&ctx),
            tie: Some(ctx.digest),
            ..RouteRequest::default()
        };
        let mut last = ProxyError::NoWorker("no other worker can continue the stream");
        for _ in 0..self.tries {
            let picked = policy::decide::pick_slot(&*policy, &set, &req, &tried, &mut rand::rng());
            let Some((pick, mut guard)) = picked else {
                break;
            };
            let worker = Arc::clone(guard.worker());
            tried.insert(worker.id());
            let mut told = Told {
                policy: &*policy,
                req: &req,
                pick: &pick,
                worker: &worker,
                done: false,
            };
            let sent = self
                .client
                .send(
                    &worker,
                    &self.template,
                    body.clone(),
                    pick.dp_rank,
                    self.wait,
                )
                .await;
            match sent {
                Ok(resp) if resp.status().is_success() && is_event_stream(&resp) => {
                    guard.record(BreakerOutcome::Success);
                    told.tell(Outcome::Served);
                    return Ok(Resumed {
                        body: resp.into_body(),
                        guard,
                    });
                }
                Ok(resp) => {
                    let status = resp.status();
                    guard.record(if status.is_server_error() {
                        BreakerOutcome::Failure
                    } else {
                        BreakerOutcome::Neutral
                    });
                    told.tell(Outcome::Failed);
                    tracing::warn!(request_id = ?self.request_id, worker = %worker.url(), status = status.as_u16(), "a worker refused a stream's continuation");
                    last = ProxyError::Upstream(format!("the worker answered {status}").into());
                }
                Err(e) => {
                    guard.record(BreakerOutcome::Failure);
                    told.tell(Outcome::Failed);
                    tracing::warn!(request_id = ?self.request_id, worker = %worker.url(), error = %crate::error::Chain(&e), "a stream's continuation failed");
                    last = e;
                }
            }
        }
        Err(last)
    }
}

fn is_event_stream<B>(resp: &http::Response<B>) -> bool {
    resp.headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// The continuation's pick, told to the policy exactly once ([`Outcome::Cancelled`]
/// when the client leaves first), as `forward::Attempt` tells a request's.
struct Told<'a> {
    policy: &'a dyn Policy,
    req: &'a RouteRequest<'a>,
    pick: &'a Pick,
    worker: &'a Arc<Worker>,
    done: bool,
}

impl Told<'_> {
    fn tell(&mut self, outcome: Outcome) {
        self.done = true;
        self.policy
            .observe(self.req, self.pick, self.worker, outcome);
    }
}

impl Drop for Told<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.policy
                .observe(self.req, self.pick, self.worker, Outcome::Cancelled);
        }
    }
}
