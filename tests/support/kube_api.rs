//! A fake Kubernetes API server on a loopback port, serving one namespace's
//! EndpointSlices the way `kube`'s watcher reads them: a list (with a
//! `resourceVersion`), then a watch that streams `ADDED` / `MODIFIED` / `DELETED`
//! events from that version on, one JSON object per line, held open. The test changes
//! the slices; every change is one event. Plus a kubeconfig file pointing at it.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::TempFile;

struct State {
    version: u64,
    slices: BTreeMap<String, Value>,
    /// Every change so far: (version, event).
    log: Vec<(u64, Value)>,
    lists: usize,
    watches: usize,
    /// The version of the latest change: open watches wait on it.
    changed: watch::Sender<u64>,
}

pub struct FakeKubeApi {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeKubeApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An EndpointSlice of `name` with port `http` = `port` and these (address, ready)
/// endpoints.
pub fn slice(name: &str, port: u16, endpoints: &[(&str, bool)]) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "engines", "labels": {"app": "vllm"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints.iter().map(|(a, ready)| json!({
            "addresses": [a], "conditions": {"ready": ready}
        })).collect::<Vec<_>>(),
    })
}

impl FakeKubeApi {
    pub async fn start(slices: &[Value]) -> FakeKubeApi {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind fake API");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State {
            version: 1,
            slices: slices
                .iter()
                .map(|s| {
                    (
                        s["metadata"]["name"].as_str().unwrap().to_string(),
                        s.clone(),
                    )
                })
                .collect(),
            log: Vec::new(),
            lists: 0,
            watches: 0,
            changed: watch::Sender::new(1),
        }));
        let st = Arc::clone(&state);
        let task = tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    return;
                };
                let st = Arc::clone(&st);
                tokio::spawn(async move {
                    let svc = service_fn(move |req| serve(req, Arc::clone(&st)));
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(conn), svc)
                        .await;
                });
            }
        });
        FakeKubeApi { addr, state, task }
    }

    /// Adds or replaces a slice (one `ADDED` or `MODIFIED` event).
    pub fn apply(&self, slice: Value) {
        let name = slice["metadata"]["name"].as_str().unwrap().to_string();
        let mut s = self.state.lock().unwrap();
        s.version += 1;
        let kind = if s.slices.contains_key(&name) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let mut obj = slice;
        obj["metadata"]["resourceVersion"] = json!(s.version.to_string());
        s.slices.insert(name, obj.clone());
        let v = s.version;
        s.log.push((v, json!({"type": kind, "object": obj})));
        s.changed.send_replace(v);
    }

    /// Deletes a slice (one `DELETED` event).
    pub fn delete(&self, name: &str) {
        let mut s = self.state.lock().unwrap();
        let Some(mut obj) = s.slices.remove(name) else {
            return;
        };
        s.version += 1;
        obj["metadata"]["resourceVersion"] = json!(s.version.to_string());
        let v = s.version;
        s.log.push((v, json!({"type": "DELETED", "object": obj})));
        s.changed.send_replace(v);
    }

    /// (lists, watches) served so far.
    pub fn calls(&self) -> (usize, usize) {
        let s = self.state.lock().unwrap();
        (s.lists, s.watches)
    }

    /// A kubeconfig whose current context is this server, namespace `engines`.
    pub fn kubeconfig(&self) -> TempFile {
        TempFile::new(
            "kubeconfig",
            &format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\nusers:\n- name: u\n  user:\n    token: test-token\ncontexts:\n- name: c\n  context:\n    cluster: fake\n    user: u\n    namespace: engines\ncurrent-context: c\n",
                self.addr
            ),
        )
    }
}

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

async fn serve(
    req: Request<hyper::body::Incoming>,
    state: Arc<Mutex<State>>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    if path != "/apis/discovery.k8s.io/v1/namespaces/engines/endpointslices" {
        let mut r = Response::new(full(r#"{"kind":"Status","code":404}"#.into()));
        *r.status_mut() = hyper::StatusCode::NOT_FOUND;
        return Ok(r);
    }
    if !query.split('&').any(|kv| kv == "watch=true") {
        let mut s = state.lock().unwrap();
        s.lists += 1;
        let body = json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSliceList",
            "metadata": {"resourceVersion": s.version.to_string()},
            "items": s.slices.values().cloned().collect::<Vec<_>>(),
        });
        return Ok(json_response(body.to_string()));
    }
    let from: u64 = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("resourceVersion="))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    state.lock().unwrap().watches += 1;
    // Replay the log after `from`, then every new change, until the client leaves.
    let stream = watch_stream(state, from);
    let mut r = Response::new(StreamBody::new(stream).boxed());
    r.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    Ok(r)
}

/// The watch body: events after `from`, then each new one as it is logged.
fn watch_stream(
    state: Arc<Mutex<State>>,
    from: u64,
) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, Infallible>> {
    let changed = state.lock().unwrap().changed.subscribe();
    futures_util::stream::unfold((from, changed), move |(mut seen, mut changed)| {
        let state = Arc::clone(&state);
        async move {
            loop {
                let next = {
                    let s = state.lock().unwrap();
                    s.log.iter().find(|(v, _)| *v > seen).cloned()
                };
                if let Some((v, ev)) = next {
                    seen = v;
                    let frame = Frame::data(Bytes::from(format!("{ev}\n")));
                    return Some((Ok(frame), (seen, changed)));
                }
                // A change logged since the look above has marked `changed` already.
                changed.changed().await.ok()?;
            }
        }
    })
}

fn full(s: String) -> Body {
    http_body_util::Full::new(Bytes::from(s)).boxed()
}

fn json_response(s: String) -> Response<Body> {
    let mut r = Response::new(full(s));
    r.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    r
}
