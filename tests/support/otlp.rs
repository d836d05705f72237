//! A stub OpenTelemetry collector: accepts OTLP/HTTP protobuf `POST /v1/traces` on
//! `127.0.0.1:0`, answers 200, and keeps every span it received with its resource's
//! `service.name`.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::wait::within;

/// One exported span and the `service.name` of the resource it came under.
#[derive(Debug, Clone)]
pub struct Exported {
    pub service_name: String,
    pub span: Span,
}

impl Exported {
    pub fn trace_id(&self) -> String {
        hex(&self.span.trace_id)
    }

    pub fn span_id(&self) -> String {
        hex(&self.span.span_id)
    }

    /// Empty when the span has no parent.
    pub fn parent_span_id(&self) -> String {
        hex(&self.span.parent_span_id)
    }

    /// The attribute's value, when the span has it.
    pub fn attr(&self, key: &str) -> Option<&Value> {
        self.span
            .attributes
            .iter()
            .find(|kv| kv.key == key)
            .and_then(|kv| kv.value.as_ref()?.value.as_ref())
    }

    pub fn attr_str(&self, key: &str) -> Option<&str> {
        match self.attr(key)? {
            Value::StringValue(s) => Some(s),
            _ => None,
        }
    }

    pub fn attr_int(&self, key: &str) -> Option<i64> {
        match self.attr(key)? {
            Value::IntValue(i) => Some(*i),
            _ => None,
        }
    }

    pub fn attr_f64(&self, key: &str) -> Option<f64> {
        match self.attr(key)? {
            Value::DoubleValue(d) => Some(*d),
            _ => None,
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The running stub; stops when dropped.
pub struct Collector {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<Exported>>>,
    /// `(path, content-type)` of every POST.
    posts: Arc<Mutex<Vec<(String, String)>>>,
    arrived: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Collector {
    pub async fn start() -> Collector {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let spans: Arc<Mutex<Vec<Exported>>> = Arc::default();
        let posts: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
        let arrived = Arc::new(Notify::new());
        let (s, p, n) = (Arc::clone(&spans), Arc::clone(&posts), Arc::clone(&arrived));
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (s, p, n) = (Arc::clone(&s), Arc::clone(&p), Arc::clone(&n));
                let service = service_fn(move |req: hyper::Request<Incoming>| {
                    let (s, p, n) = (Arc::clone(&s), Arc::clone(&p), Arc::clone(&n));
                    async move {
                        let path = req.uri().path().to_string();
                        let ct = req
                            .headers()
                            .get("content-type")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("")
                            .to_string();
                        let body = req.into_body().collect().await?.to_bytes();
                        p.lock().unwrap().push((path, ct));
                        if let Ok(export) = ExportTraceServiceRequest::decode(body) {
                            let mut got = s.lock().unwrap();
                            for rs in export.resource_spans {
                                let service_name = rs
                                    .resource
                                    .iter()
                                    .flat_map(|r| &r.attributes)
                                    .find(|kv| kv.key == "service.name")
                                    .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                                        Value::StringValue(s) => Some(s.clone()),
                                        _ => None,
                                    })
                                    .unwrap_or_default();
                                for ss in rs.scope_spans {
                                    for span in ss.spans {
                                        got.push(Exported {
                                            service_name: service_name.clone(),
                                            span,
                                        });
                                    }
                                }
                            }
                        }
                        n.notify_waiters();
                        let mut resp = hyper::Response::new(Full::new(bytes::Bytes::new()));
                        resp.headers_mut().insert(
                            "content-type",
                            hyper::header::HeaderValue::from_static("application/x-protobuf"),
                        );
                        Ok::<_, hyper::Error>(resp)
                    }
                });
                tokio::spawn(async move {
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Collector {
            addr,
            spans,
            posts,
            arrived,
            task,
        }
    }

    /// The collector's base URL, as `tracing.otlp_endpoint` names it.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn spans(&self) -> Vec<Exported> {
        self.spans.lock().unwrap().clone()
    }

    /// `(path, content-type)` of every POST received.
    pub fn posts(&self) -> Vec<(String, String)> {
        self.posts.lock().unwrap().clone()
    }

    /// Waits (bounded) until at least `n` spans have arrived.
    pub async fn wait_for_spans(&self, n: usize) -> Vec<Exported> {
        within(&format!("{n} spans at the collector"), async {
            loop {
                let notified = self.arrived.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let spans = self.spans();
                if spans.len() >= n {
                    return spans;
                }
                notified.await;
            }
        })
        .await
    }
}
