//! `kill-test`: streams survive workers that die or leave (issue 43's acceptance).
//!
//! Starts `--engines` sim-engines and the router in front of them (`proxy.drain_secs`
//! short), sends `--requests` streamed chat requests of `--tokens` tokens each at
//! `--concurrency`, SIGKILLs one engine once a quarter of them have completed and
//! drops another from the config by SIGHUP at half, then checks every answer the
//! client read: one `id`, one role chunk, exactly `--tokens` content chunks, one final
//! chunk, one `data: [DONE]`, no error event, usage saying `--tokens` completion
//! tokens. Prints the count of answers lost (not well-formed) and the router's
//! migrations by cause and outcome; exits 1 when any answer was lost.
//!
//! Build first: `cargo build -p bench --bin kill-test --bin sim-engine` and
//! `cargo build --bin cache-aware-router` (same profile; found beside this binary).

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bench::procs::{self, ChildProc, EngineParams, ScratchDir};
use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

/// Streams through a router while one engine is killed and another removed.
#[derive(Debug, Parser)]
#[command(name = "kill-test", version)]
struct Cli {
    /// Simulated engines behind the router (at least 3).
    #[arg(long, default_value_t = 4)]
    engines: usize,
    /// Streamed chat requests sent in all.
    #[arg(long, default_value_t = 500)]
    requests: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Tokens each answer must have (`max_tokens`).
    #[arg(long, default_value_t = 200)]
    tokens: u64,
    /// The engines' inter-token latency, in simulated ms.
    #[arg(long, default_value_t = 15.0)]
    itl_ms: f64,
    /// Multiplier on every simulated time (0.5 = twice as fast).
    #[arg(long, default_value_t = 0.5)]
    time_factor: f64,
    /// The router's `proxy.drain_secs`, in s.
    #[arg(long, default_value_t = 0.5)]
    drain_secs: f64,
    /// Runs the router with `migration: {enabled: false}` (what is lost without it).
    #[arg(long)]
    without_migration: bool,
}

/// What one answer looked like to its client.
#[derive(Debug, Default)]
struct Read {
    ids: usize,
    roles: usize,
    tokens: u64,
    finishes: usize,
    dones: usize,
    errors: usize,
    usage_tokens: Option<u64>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut children = Vec::new();
    let code = match run(&cli, &mut children).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("kill-test: {e}");
            ExitCode::from(2)
        }
    };
    procs::stop_all(children).await;
    code
}

async fn run(cli: &Cli, children: &mut Vec<ChildProc>) -> Result<bool, String> {
    if cli.engines < 3 {
        return Err("--engines must be at least 3 (one killed, one removed, one left)".into());
    }
    let (engine_bin, router_bin) =
        procs::engine_and_router_binaries().map_err(|e| e.to_string())?;
    let params = EngineParams {
        itl_ms: cli.itl_ms,
        time_factor: cli.time_factor,
        ..EngineParams::default()
    };
    let mut urls = Vec::new();
    for i in 0..cli.engines {
        let name = format!("e{i}");
        let wait = Duration::from_secs(10);
        let url = procs::start_engine(&engine_bin, &params, &name, 0, wait, children)
            .await
            .map_err(|e| e.to_string())?;
        urls.push(url);
    }
    let engines: Vec<usize> = (0..children.len()).collect();
    let dir = ScratchDir::new("kill-test", "router").map_err(|e| e.to_string())?;
    let port = procs::free_port().map_err(|e| e.to_string())?;
    let yaml = |urls: &[String]| {
        let mut y = format!(
            "server: {{host: 127.0.0.1, port: {port}}}\nlog: {{level: warn}}\nhealth: {{interval_secs: 0.5}}\nproxy: {{drain_secs: {}}}\nmigration: {{enabled: {}}}\nworkers:\n",
            cli.drain_secs, !cli.without_migration
        );
        for u in urls {
            y.push_str(&format!("  - url: {u}\n"));
        }
        y
    };
    let base = procs::start_router(
        &router_bin,
        &yaml(&urls),
        port,
        &dir,
        Duration::from_secs(20),
        children,
    )
    .await
    .map_err(|e| e.to_string())?;
    let router = children.len() - 1;
    let addr: std::net::SocketAddr = base
        .trim_start_matches("http://")
        .parse()
        .map_err(|e| format!("router address {base}: {e}"))?;

    let mut killed = false;
    let done = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(Semaphore::new(cli.concurrency));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..cli.requests {
        let permit = Arc::clone(&gate)
            .acquire_owned()
            .await
            .map_err(|e| e.to_string())?;
        let (counted, tokens) = (Arc::clone(&done), cli.tokens);
        tasks.spawn(async move {
            let r = stream_one(addr, i, tokens).await;
            counted.fetch_add(1, Ordering::SeqCst);
            drop(permit);
            r
        });
        // The faults, as the run passes a quarter and a half of its requests.
        let finished = done.load(Ordering::SeqCst);
        if !killed && finished >= cli.requests / 4 {
            killed = children[engines[0]].signal("KILL");
            eprintln!("kill-test: SIGKILL {} after {finished} answers", urls[0]);
        }
        if finished >= cli.requests / 2 && urls.len() == cli.engines {
            let removed = urls.remove(1);
            std::fs::write(dir.path().join("config.yaml"), yaml(&urls))
                .map_err(|e| format!("rewrite the config: {e}"))?;
            children[router].signal("HUP");
            eprintln!("kill-test: SIGHUP without {removed} after {finished} answers");
        }
    }
    let mut lost = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined.map_err(|e| e.to_string())? {
            Ok(r) if well_formed(&r, cli.tokens) => {}
            Ok(r) => lost.push(format!("{r:?}")),
            Err(e) => lost.push(e),
        }
    }
    let table = migrations(&base).await?;
    println!(
        "{} streamed answers of {} tokens at concurrency {}, {} engines (one SIGKILLed, one removed by SIGHUP, drain {} s), migration {}",
        cli.requests,
        cli.tokens,
        cli.concurrency,
        cli.engines,
        cli.drain_secs,
        if cli.without_migration { "off" } else { "on" }
    );
    println!(
        "well-formed: {} / {}; lost: {}",
        cli.requests - lost.len(),
        cli.requests,
        lost.len()
    );
    for l in lost.iter().take(5) {
        println!("  lost: {l}");
    }
    println!("\n| cause | continued | ended | refused | failed |\n|---|---|---|---|---|");
    for (cause, by) in &table {
        let n = |o: &str| by.get(o).copied().unwrap_or(0.0);
        println!(
            "| {cause} | {} | {} | {} | {} |",
            n("continued"),
            n("ended"),
            n("refused"),
            n("failed")
        );
    }
    Ok(lost.is_empty())
}

fn well_formed(r: &Read, tokens: u64) -> bool {
    r.ids == 1
        && r.roles == 1
        && r.tokens == tokens
        && r.finishes == 1
        && r.dones == 1
        && r.errors == 0
        && r.usage_tokens == Some(tokens)
}

/// Sends streamed chat request `i` and reads its answer as a client does.
async fn stream_one(addr: std::net::SocketAddr, i: usize, tokens: u64) -> Result<Read, String> {
    let body = serde_json::json!({
        "model": "m",
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": format!("kill test, request {i}: tell me a long story")}],
    });
    let io = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(conn);
    let req = Request::post("/v1/chat/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let resp = send
        .send_request(req)
        .await
        .map_err(|e| format!("request {i}: {e}"))?;
    if !resp.status().is_success() {
        return Err(format!("request {i}: status {}", resp.status()));
    }
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("request {i}: the stream broke: {e}"))?
        .to_bytes();
    Ok(read(&bytes))
}

/// Reads an answer's events (see [`Read`]).
fn read(body: &[u8]) -> Read {
    let mut r = Read::default();
    let mut ids = std::collections::HashSet::new();
    for event in String::from_utf8_lossy(body).split("\n\n") {
        let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else {
            continue;
        };
        if data == "[DONE]" {
            r.dones += 1;
            continue;
        }
        let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
            r.errors += 1;
            continue;
        };
        if v.get("error").is_some() {
            r.errors += 1;
            continue;
        }
        if let Some(id) = v["id"].as_str() {
            ids.insert(id.to_string());
        }
        let c = &v["choices"][0];
        r.roles += usize::from(c["delta"].get("role").is_some());
        r.tokens += u64::from(
            c["delta"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty()),
        );
        r.finishes += usize::from(c["finish_reason"].is_string());
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            r.usage_tokens = Some(n);
        }
    }
    r.ids = ids.len();
    r
}

/// The router's `stream_migrations_total`, by cause then outcome.
async fn migrations(base: &str) -> Result<BTreeMap<String, BTreeMap<String, f64>>, String> {
    let text = procs::get_body(&format!("{base}/metrics"))
        .await
        .ok_or_else(|| format!("GET {base}/metrics failed"))?;
    let series = bench::stats::series_by(
        &String::from_utf8_lossy(&text),
        "cache_aware_router_stream_migrations_total",
        &["cause", "outcome"],
    );
    let mut table: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    for (labels, v) in series {
        if let [cause, outcome] = labels.as_slice() {
            table
                .entry(cause.clone())
                .or_default()
                .insert(outcome.clone(), v);
        }
    }
    Ok(table)
}
