//! What the sim-engine tests share: an HTTP client and one request helper.

// Each test binary uses a part of it.
#![allow(dead_code)]

use bench::engine::RunningEngine;
use bytes::Bytes;
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
    let req = Request::builder()
        .method(method)
        .uri(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default()
    };
    let (status, engine, content_type) = (
        resp.status(),
        header("x-sim-engine"),
        header("content-type"),
    );
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        engine,
        content_type,
        body,
    }
}
