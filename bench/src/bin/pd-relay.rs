//! `pd-relay`: how long a disaggregated request's decode stream waits in the router.
//!
//! A scripted vLLM prefill engine (NixlConnector's answer: `max_tokens: 1`, not
//! streamed, `kv_transfer_params` back) and a scripted decode engine run in this
//! process; the router (the release binary, `--router-bin`) runs in front of them with
//! `pd: {connector: nixl}`. Requests go one at a time, streamed. The decode engine
//! notes when it hands its first event to its socket (keyed by the request's
//! `x-request-id`, which the router passes on), then waits `--gap-ms` before the rest,
//! so that event reaches the client early only if nothing buffers it; the client notes
//! when the first body byte arrives. One process, one clock. The same requests sent
//! straight to the decode engine give the baseline (loopback and HTTP without a
//! router), alternated request by request with the routed ones.
//!
//! ```text
//! cargo build --release --workspace
//! target/release/pd-relay --requests 500
//! ```

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bench::engine::bind;
use bench::procs::{self, ChildProc, ScratchDir};
use bench::stats::Percentiles;
use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Measure the router's hold on a disaggregated stream's first decode byte.
#[derive(Debug, Parser)]
#[command(name = "pd-relay", version)]
struct Cli {
    /// Streamed chat requests through the router (and as many straight to the engine).
    #[arg(long, default_value_t = 500)]
    requests: usize,
    /// The decode engine's pause after its first event (ms).
    #[arg(long, default_value_t = 20)]
    gap_ms: u64,
    /// The router binary (default: `cache-aware-router` beside this one).
    #[arg(long)]
    router_bin: Option<PathBuf>,
}

/// When the decode engine wrote each request's first event, by `x-request-id`.
type Writes = Arc<Mutex<HashMap<String, Instant>>>;

/// One data frame per message; ends when the sender is dropped.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|m| m.map(|b| Ok(Frame::data(b))))
    }
}

type Answer = Response<http_body_util::Either<Full<Bytes>, ChannelBody>>;

fn json_answer(v: &Value) -> Answer {
    Response::builder()
        .header(CONTENT_TYPE, "application/json")
        .body(http_body_util::Either::Left(Full::new(Bytes::from(
            v.to_string(),
        ))))
        .expect("static response")
}

/// The prefill engine's answer to a hand-off request: one token, `finish_reason:
/// length`, NIXL's `kv_transfer_params`.
fn prefill_answer(n: u64) -> Value {
    json!({
        "id": format!("chatcmpl-p{n}"), "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"},
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": 64, "completion_tokens": 1, "total_tokens": 65,
                  "prompt_tokens_details": {"cached_tokens": 0}},
        "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [1, 2, 3, 4], "remote_engine_id": "prefill-0",
            "remote_request_id": format!("p{n}"), "remote_host": "127.0.0.1",
            "remote_port": 5600, "tp_size": 1}
    })
}

fn event(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// The decode engine's stream: the first token event at once (its time noted), the
/// rest after `gap`.
fn decode_answer(id: String, writes: &Writes, gap: Duration) -> Answer {
    let (tx, rx) = mpsc::channel(8);
    let chunk = |content: &str, finish: Value| {
        event(
            &json!({"id": "chatcmpl-d", "object": "chat.completion.chunk", "created": 0,
            "model": "m", "choices": [{"index": 0, "delta": {"content": content},
            "finish_reason": finish}]}),
        )
    };
    let first = chunk("x", Value::Null);
    let rest = [
        chunk("y", Value::Null),
        chunk("z", json!("length")),
        Bytes::from_static(b"data: [DONE]\n\n"),
    ];
    writes.lock().unwrap().insert(id, Instant::now());
    tx.try_send(first).expect("an empty channel");
    tokio::spawn(async move {
        tokio::time::sleep(gap).await;
        for b in rest {
            if tx.send(b).await.is_err() {
                return;
            }
        }
    });
    Response::builder()
        .header(CONTENT_TYPE, "text/event-stream")
        .body(http_body_util::Either::Right(ChannelBody(rx)))
        .expect("static response")
}

/// Serves one scripted engine on 127.0.0.1; returns its address.
async fn engine(prefill: bool, writes: Writes, gap: Duration) -> std::io::Result<SocketAddr> {
    let listener = bind(("127.0.0.1", 0)).await?;
    let addr = listener.local_addr()?;
    let served = Arc::new(std::sync::atomic::AtomicU64::new(0));
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let _ = sock.set_nodelay(true);
            let (writes, served) = (writes.clone(), served.clone());
            let svc = service_fn(move |req: Request<Incoming>| {
                let (writes, served) = (writes.clone(), served.clone());
                async move {
                    let id = req
                        .headers()
                        .get("x-request-id")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_string();
                    let get = req.method() == hyper::Method::GET;
                    let path = req.uri().path().to_string();
                    let _ = req.into_body().collect().await;
                    Ok::<_, Infallible>(match (get, path.as_str()) {
                        (true, "/v1/models") => json_answer(
                            &json!({"object": "list", "data": [{"id": "m", "object": "model"}]}),
                        ),
                        (true, _) => json_answer(&json!({})),
                        (false, _) if prefill => json_answer(&prefill_answer(
                            served.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                        )),
                        (false, _) => decode_answer(id, &writes, gap),
                    })
                }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(sock), svc)
                    .await;
            });
        }
    });
    Ok(addr)
}

/// One keep-alive HTTP/1.1 connection to `addr`.
async fn connect(
    addr: SocketAddr,
) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>, String> {
    let sock = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    sock.set_nodelay(true).map_err(|e| e.to_string())?;
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(sock))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    Ok(send)
}

/// Sends one streamed chat with `id`; returns when its first body byte arrived (and
/// reads the rest).
async fn first_byte(
    send: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    id: &str,
) -> Result<Instant, String> {
    let body = json!({"model": "m", "stream": true, "max_tokens": 3,
        "messages": [{"role": "user", "content": format!("request {id}: a prompt long enough to be worth a prefill")}]});
    let req = Request::post("/v1/chat/completions")
        .header(HOST, "127.0.0.1")
        .header(CONTENT_TYPE, "application/json")
        .header("x-request-id", id)
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    send.ready().await.map_err(|e| e.to_string())?;
    let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("status {}", resp.status()));
    }
    let mut body = resp.into_body();
    let mut first = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| e.to_string())?;
        if first.is_none() && frame.data_ref().is_some_and(|d| !d.is_empty()) {
            first = Some(Instant::now());
        }
    }
    first.ok_or_else(|| "an empty body".to_string())
}

fn router_yaml(port: u16, prefill: SocketAddr, decode: SocketAddr) -> String {
    format!(
        "server: {{host: 127.0.0.1, port: {port}}}\n\
         log: {{level: warn}}\n\
         workers:\n  - {{url: \"http://{prefill}\", phase: prefill}}\n  - {{url: \"http://{decode}\", phase: decode}}\n\
         pd: {{connector: nixl}}\n"
    )
}

async fn run(cli: Cli) -> Result<(), String> {
    let gap = Duration::from_millis(cli.gap_ms);
    let writes: Writes = Arc::default();
    let prefill = engine(true, writes.clone(), gap)
        .await
        .map_err(|e| e.to_string())?;
    let decode = engine(false, writes.clone(), gap)
        .await
        .map_err(|e| e.to_string())?;
    let bin = cli
        .router_bin
        .unwrap_or_else(|| procs::sibling_binary("cache-aware-router"));
    procs::require_binary(&bin, "the router", "cargo build --release")
        .map_err(|e| e.to_string())?;
    let port = procs::free_port().map_err(|e| e.to_string())?;
    let dir = ScratchDir::new("pd-relay", "router").map_err(|e| e.to_string())?;
    let mut children: Vec<ChildProc> = Vec::new();
    let yaml = router_yaml(port, prefill, decode);
    let url = procs::start_router(
        &bin,
        &yaml,
        port,
        &dir,
        Duration::from_secs(20),
        &mut children,
    )
    .await
    .map_err(|e| e.to_string())?;
    let router: SocketAddr = url
        .trim_start_matches("http://")
        .parse()
        .map_err(|e| format!("{url}: {e}"))?;
    let (mut via_router, mut direct) = (connect(router).await?, connect(decode).await?);
    let (mut routed_us, mut direct_us) = (Vec::new(), Vec::new());
    for i in 0..cli.requests {
        for (send, out, tag) in [
            (&mut via_router, &mut routed_us, "r"),
            (&mut direct, &mut direct_us, "d"),
        ] {
            let id = format!("{tag}{i}");
            let arrived = first_byte(send, &id).await?;
            let written = writes
                .lock()
                .unwrap()
                .remove(&id)
                .ok_or_else(|| format!("the decode engine never saw {id}"))?;
            out.push(arrived.saturating_duration_since(written).as_secs_f64() * 1e6);
        }
    }
    procs::stop_all(children).await;
    let row = |name: &str, v: &[f64]| {
        let p = Percentiles::of(v);
        let max = v.iter().copied().fold(0.0, f64::max);
        println!(
            "| {name} | {} | {:.0} | {:.0} | {:.0} | {:.0} |",
            v.len(),
            p.p50,
            p.p90,
            p.p99,
            max
        );
    };
    println!(
        "first decode event: engine write -> client's first body byte (µs), gap {} ms\n",
        cli.gap_ms
    );
    println!("| path | requests | p50 | p90 | p99 | max |\n|---|---|---|---|---|---|");
    row("through the router (pd: nixl)", &routed_us);
    row("straight to the decode engine", &direct_us);
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    match run(Cli::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pd-relay: {e}");
            ExitCode::FAILURE
        }
    }
}
