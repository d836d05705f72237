//! A worker behind TLS on a loopback port: a certificate generated for the run
//! (`rcgen`, valid for `127.0.0.1` and `localhost`), served with rustls. It answers
//! `GET /health` and every other request with a small OpenAI-shaped JSON body, and
//! counts what it answered.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::config::TempFile;

pub struct TlsWorker {
    pub addr: SocketAddr,
    /// The worker's certificate, PEM (trust it as `proxy.tls.ca_file`).
    pub cert_pem: TempFile,
    /// Requests answered (health probes and others), and TLS handshakes that failed.
    pub requests: Arc<AtomicU64>,
    pub probes: Arc<AtomicU64>,
    /// The router's model-list reads (`GET /v1/models`), counted apart.
    pub model_reads: Arc<AtomicU64>,
    pub failed_handshakes: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TlsWorker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TlsWorker {
    pub async fn start() -> TlsWorker {
        let rcgen::CertifiedKey { cert, signing_key } =
            rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()])
                .expect("generate a certificate");
        let cert_pem = TempFile::new("worker.pem", &cert.pem());
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(signing_key.serialize_der()));
        let config = tokio_rustls::rustls::ServerConfig::builder_with_provider(Arc::new(
            tokio_rustls::rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(vec![CertificateDer::from(cert.der().to_vec())], key)
        .expect("server certificate");
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let requests = Arc::new(AtomicU64::new(0));
        let probes = Arc::new(AtomicU64::new(0));
        let model_reads = Arc::new(AtomicU64::new(0));
        let failed_handshakes = Arc::new(AtomicU64::new(0));
        let (r, p, m, f) = (
            Arc::clone(&requests),
            Arc::clone(&probes),
            Arc::clone(&model_reads),
            Arc::clone(&failed_handshakes),
        );
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, r, p, m, f) =
                    (acceptor.clone(), r.clone(), p.clone(), m.clone(), f.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        f.fetch_add(1, Ordering::SeqCst);
                        return;
                    };
                    let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                        let counter = match req.uri().path() {
                            "/health" => &p,
                            "/v1/models" => &m,
                            _ => &r,
                        };
                        counter.fetch_add(1, Ordering::SeqCst);
                        async {
                            Ok::<_, Infallible>(
                                Response::builder()
                                    .header("content-type", "application/json")
                                    .body(Full::new(Bytes::from_static(
                                        br#"{"id":"tls-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"over TLS"}}]}"#,
                                    )))
                                    .expect("response"),
                            )
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tls), svc)
                        .await;
                });
            }
        });
        TlsWorker {
            addr,
            cert_pem,
            requests,
            probes,
            model_reads,
            failed_handshakes,
            task,
        }
    }

    /// `https://127.0.0.1:P`.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }
}
