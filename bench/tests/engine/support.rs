//! What the sim-engine tests share: an HTTP client, one request helper, and a router
//! started in-process in front of engines.

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use bench::engine::RunningEngine;
use bytes::Bytes;
use cache_aware_router::app::{self, RunningRouter};
use cache_aware_router::config::Config;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// One answer of the engine.
pub struct Reply {
    pub status: StatusCode,
    /// Its `x-sim-engine` header (the engine's name).
    pub engine: String,
    /// Its `content-type`, empty when none.
    pub content_type: String,
    /// Its `x-cache` (the router's response cache said hit, miss or bypass), empty
    /// when none.
    pub cache: String,
    pub body: Bytes,
}

impl Reply {
    pub fn text(&self) -> String {
        String::from_utf8(self.body.to_vec()).expect("UTF-8 body")
    }

    /// The body as JSON, `Null` when it is not.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

/// Sends `body` (JSON) to `path` of `e` and reads the whole answer.
pub async fn send(
    c: &HttpClient,
    e: &RunningEngine,
    method: Method,
    path: &str,
    body: &str,
) -> Reply {
    send_to(c, &e.url(), method, path, body).await
}

/// As [`send`], to any HTTP server at `base` (`http://host:port`): a router in front of
/// engines, say.
pub async fn send_to(c: &HttpClient, base: &str, method: Method, path: &str, body: &str) -> Reply {
    send_with(c, base, method, path, body, &[]).await
}

/// As [`send_to`], with request `headers` of its own.
pub async fn send_with(
    c: &HttpClient,
    base: &str,
    method: Method,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> Reply {
    let mut req = Request::builder()
        .method(method)
        .uri(format!("{base}{path}"))
        .header("content-type", "application/json");
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req.body(Full::new(Bytes::from(body.to_owned()))).unwrap();
    let resp = c.request(req).await.unwrap();
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default()
    };
    let (status, engine, content_type, cache) = (
        resp.status(),
        header("x-sim-engine"),
        header("content-type"),
        header("x-cache"),
    );
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        engine,
        content_type,
        cache,
        body,
    }
}

/// Starts the router in-process on 127.0.0.1:0 from YAML text; its base URL.
pub async fn start_router(yaml: &str) -> (RunningRouter, String) {
    let config = Config::from_sources([(Path::new("test.yaml"), yaml)])
        .unwrap_or_else(|e| panic!("test config refused: {e}\n{yaml}"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let router = app::spawn(config, listener).expect("router");
    let base = format!("http://{}", router.addr);
    (router, base)
}

/// Polls `cond` every 10 ms until it holds; panics with `what` after 5 s.
pub async fn wait_until<F: Future<Output = bool>>(what: &str, mut cond: impl FnMut() -> F) {
    let start = Instant::now();
    while !cond().await {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "not within 5 s: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
