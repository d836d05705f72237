//! The HTTP side: the accept loop, the route table, request bodies, the JSON and
//! channel response bodies, and starting an engine on a socket.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderName, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};

use super::{ConfigError, ENGINE_HEADER, Endpoint, Engine, EngineConfig, MAX_MODEL_LEN, RespBody};
use crate::embeddings;

impl Engine {
    /// Serves HTTP/1 connections from `listener` until `shutdown` completes, then
    /// stops accepting and drops every open connection.
    pub async fn serve_with_shutdown(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) {
        let mut conns = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        let _ = stream.set_nodelay(true);
                        let engine = self.clone();
                        conns.spawn(async move {
                            let svc = service_fn(move |req| {
                                let engine = engine.clone();
                                async move { Ok::<_, Infallible>(engine.handle(req).await) }
                            });
                            // A connection error only ends that connection.
                            let _ = http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), svc)
                                .await;
                        });
                    }
                    Err(e) => {
                        // E.g. out of file descriptors: back off, keep serving.
                        eprintln!("sim-engine {}: accept failed: {e}", self.name());
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
            }
        }
    }

    /// Routes one request to its handler and stamps `x-sim-engine`.
    pub async fn handle(&self, req: Request<Incoming>) -> Response<RespBody> {
        let method = req.method().clone();
        let path = req.uri().path().to_owned();
        let mut resp = match (method, path.as_str()) {
            (Method::GET, "/health") => full(StatusCode::OK, None, Bytes::new()),
            (Method::GET, "/v1/models") => self.models_list(),
            (Method::GET, "/metrics") => full(
                StatusCode::OK,
                Some("text/plain; version=0.0.4; charset=utf-8"),
                Bytes::from(self.metrics_text()),
            ),
            (Method::POST, "/v1/chat/completions") => self.generate(Endpoint::Chat, req).await,
            (Method::POST, "/v1/completions") => self.generate(Endpoint::Completions, req).await,
            (Method::POST, "/v1/messages") => self.generate(Endpoint::Messages, req).await,
            (Method::POST, "/v1/messages/count_tokens") => self.count_tokens(req).await,
            (Method::POST, "/v1/embeddings") => self.embeddings(req).await,
            (Method::POST, "/tokenize") => self.tokenize(req).await,
            (Method::POST, "/detokenize") => self.detokenize(req).await,
            (Method::POST, "/v1/chat/completions/render") => self.render(Endpoint::Chat, req).await,
            (Method::POST, "/v1/completions/render") => {
                self.render(Endpoint::Completions, req).await
            }
            (_, "/health" | "/v1/models" | "/metrics")
            | (_, "/v1/chat/completions" | "/v1/completions" | "/v1/messages")
            | (_, "/v1/messages/count_tokens" | "/tokenize" | "/detokenize")
            | (_, "/v1/embeddings")
            | (_, "/v1/chat/completions/render" | "/v1/completions/render") => error_response(
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed",
                "invalid_request_error",
            ),
            _ => error_response(
                StatusCode::NOT_FOUND,
                &format!("no route for {path}"),
                "not_found_error",
            ),
        };
        resp.headers_mut().insert(
            HeaderName::from_static(ENGINE_HEADER),
            self.inner.name_header.clone(),
        );
        resp
    }

    /// `GET /v1/models`: one entry per served model, each its own `root` (distinct
    /// models, not aliases of one).
    fn models_list(&self) -> Response<RespBody> {
        let data: Vec<Value> = self
            .models()
            .map(|m| {
                json!({
                    "id": m,
                    "object": "model",
                    "created": self.inner.created,
                    "owned_by": "vllm",
                    "root": m,
                    "parent": null,
                    "max_model_len": MAX_MODEL_LEN,
                })
            })
            .collect();
        json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
    }

    /// `POST /v1/embeddings`: `{"input": "…" | ["…", …], "model"?, "encoding_format"?:
    /// "float"}` → the OpenAI list of [`crate::embeddings::embed`] vectors. Answered at
    /// once, outside the prefill queue, the prefix cache and the 429 admission; only
    /// `embedding_requests` counts it.
    async fn embeddings(&self, req: Request<Incoming>) -> Response<RespBody> {
        let body = match self.read_body(req).await {
            Ok(body) => body,
            Err((status, msg)) => return error_response(status, &msg, "invalid_request_error"),
        };
        let emb = match embeddings::parse_request(&body) {
            Ok(emb) => emb,
            Err(msg) => {
                return error_response(StatusCode::BAD_REQUEST, &msg, "invalid_request_error");
            }
        };
        let resp = embeddings::response_body(&emb, &self.inner.cfg.model);
        let c = &self.inner.counters;
        c.embedding_requests.fetch_add(1, Ordering::Relaxed);
        json_response(StatusCode::OK, &resp)
    }

    /// The whole request body, or the error answer (413 past `max_body_bytes`).
    pub(super) async fn read_body(
        &self,
        req: Request<Incoming>,
    ) -> Result<Bytes, (StatusCode, String)> {
        let limit = self.inner.cfg.max_body_bytes;
        match Limited::new(req.into_body(), limit).collect().await {
            Ok(collected) => Ok(collected.to_bytes()),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => Err((
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body exceeds {limit} bytes"),
            )),
            Err(e) => Err((
                StatusCode::BAD_REQUEST,
                format!("cannot read request body: {e}"),
            )),
        }
    }
}

fn full(status: StatusCode, content_type: Option<&'static str>, body: Bytes) -> Response<RespBody> {
    let mut resp = Response::new(Full::new(body).map_err(|never| match never {}).boxed());
    *resp.status_mut() = status;
    if let Some(ct) = content_type {
        resp.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(ct));
    }
    resp
}

pub(super) fn json_response(status: StatusCode, value: &Value) -> Response<RespBody> {
    full(
        status,
        Some("application/json"),
        Bytes::from(value.to_string()),
    )
}

/// `{"error":{"message","type","param":null,"code"}}` with the given status.
pub(super) fn error_response(status: StatusCode, message: &str, kind: &str) -> Response<RespBody> {
    json_response(
        status,
        &json!({"error": {"message": message, "type": kind, "param": null, "code": status.as_u16()}}),
    )
}

/// A response body fed by a channel: one data frame per message, ends when the
/// sender is dropped. Dropping the body (client gone) makes the sender fail.
pub(super) struct ChannelBody {
    pub(super) rx: mpsc::Receiver<Bytes>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    /// An empty chunk is the stream's death (`die_after_tokens`): the body fails, and
    /// hyper closes the connection without the chunked body's end.
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.rx.poll_recv(cx).map(|m| {
            m.map(|b| match b.is_empty() {
                true => Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    "the simulated engine died mid-stream",
                )),
                false => Ok(Frame::data(b)),
            })
        })
    }
}

/// Serves `cfg` on `listener` forever (until the future is dropped).
pub async fn serve(listener: TcpListener, cfg: EngineConfig) -> Result<(), ConfigError> {
    let engine = Engine::new(cfg)?;
    engine
        .serve_with_shutdown(listener, std::future::pending())
        .await;
    Ok(())
}

/// An engine serving on a background task; dropping it stops the engine.
#[derive(Debug)]
pub struct RunningEngine {
    addr: SocketAddr,
    engine: Engine,
    task: JoinHandle<()>,
}

impl RunningEngine {
    /// The bound address (127.0.0.1 and an ephemeral port).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Base URL, e.g. `http://127.0.0.1:40123` (no trailing slash).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The engine, for [`Engine::stats`].
    pub fn engine(&self) -> &Engine {
        &self.engine
    }
}

impl Drop for RunningEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Why [`start`] failed.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Binding 127.0.0.1:0 failed.
    #[error("cannot bind 127.0.0.1:0: {0}")]
    Bind(#[from] std::io::Error),
}

/// Listen backlog of [`bind`]: uvicorn's default (vLLM's HTTP server). tokio's
/// `TcpListener::bind` uses 128, which a burst of a few hundred connects overflows:
/// the kernel then drops SYNs and the client retries after 1 s.
pub const LISTEN_BACKLOG: u32 = 2048;

/// Binds `addr` with SO_REUSEADDR and a [`LISTEN_BACKLOG`] backlog (the kernel caps
/// it at `net.core.somaxconn`); the first address that works wins.
pub async fn bind(addr: impl tokio::net::ToSocketAddrs) -> std::io::Result<TcpListener> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let socket = if a.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        match socket.bind(a).and_then(|()| socket.listen(LISTEN_BACKLOG)) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::AddrNotAvailable, "no address to bind")
    }))
}

/// Binds 127.0.0.1:0 and serves `cfg` on a spawned task (needs a tokio runtime).
pub async fn start(cfg: EngineConfig) -> Result<RunningEngine, StartError> {
    let engine = Engine::new(cfg)?;
    let listener = bind(("127.0.0.1", 0)).await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(
        engine
            .clone()
            .serve_with_shutdown(listener, std::future::pending()),
    );
    Ok(RunningEngine { addr, engine, task })
}
