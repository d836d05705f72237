//! `flow-bench`: flow control's acceptance figures (issue 42) against sim-engines.
//!
//! - `priority`: a batch tenant sends long prompts at `--batch-load` times the pool's
//!   capacity while an interactive tenant replays conversation turns (`--sessions`
//!   conversations, one turn at a time each). Three runs on the same engines: the
//!   interactive turns alone (no batch load), with priority classes (`priority.reserve`
//!   holding the interactive conversations' slots), and with flow control off (one
//!   FIFO). Prints the interactive TTFT percentiles and what the batch tenant got.
//! - `fairness`: two tenants in one class, one sending ten times the other's token
//!   rate, together `--fair-load` times the capacity: the light tenant's admitted token
//!   rate as a share of its demand, with deficit round robin and with one FIFO.
//! - `budgets`: two router replicas on one Redis hold a tenant's
//!   `tokens_per_minute.input` (`--budget`) against `--budget-load` times that demand
//!   (and, for contrast, two replicas with budgets in process); then Redis is killed
//!   mid-run and started again: requests that failed, the fail-open counter, and when
//!   the limit came back.
//!
//! The pool's capacity is the routers' slots (`--engines` × `--max-load`) over a
//! request's simulated service time (prefill of its prompt plus its output tokens);
//! engines run up to `--max-load` prefills at once (`--prefill-physics`).
//!
//! Build first (same profile; found beside this binary):
//! `cargo build --release -p bench --bin flow-bench --bin sim-engine` and
//! `cargo build --release --bin cache-aware-router`; `budgets` needs `redis-server`
//! on the PATH.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use bench::prefill::Physics;
use bench::procs::{self, ChildProc, EngineParams, ScratchDir};
use bench::replay::SseParser;
use bench::stats::Percentiles;
use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::task::JoinSet;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Flow control's acceptance figures: priority under flood, fairness, token budgets.
#[derive(Debug, Parser)]
#[command(name = "flow-bench", version)]
struct Cli {
    /// Which figures: `priority`, `fairness`, `budgets` or `all`.
    #[arg(long, default_value = "all")]
    scenario: String,
    /// How long each run sends, in s (the Redis outage run: 1.5 times this).
    #[arg(long, default_value_t = 20.0)]
    secs: f64,
    /// Simulated engines behind the router.
    #[arg(long, default_value_t = 2)]
    engines: usize,
    /// Each worker's `max_load` (the router's slots per engine; also the engine's
    /// prefills at once).
    #[arg(long, default_value_t = 8)]
    max_load: usize,
    /// Multiplier on every simulated time (0.5 = twice as fast).
    #[arg(long, default_value_t = 0.5)]
    time_factor: f64,
    /// How prefills share an engine (sim-engine's `--prefill-physics`).
    #[arg(long, default_value = "parallel")]
    prefill_physics: Physics,
    /// priority: the batch tenant's request rate, as a multiple of the pool's capacity.
    #[arg(long, default_value_t = 3.0)]
    batch_load: f64,
    /// priority: interactive conversations at once.
    #[arg(long, default_value_t = 4)]
    sessions: usize,
    /// fairness: both tenants' demand together, as a multiple of the pool's capacity.
    #[arg(long, default_value_t = 1.5)]
    fair_load: f64,
    /// budgets: the tenant's `tokens_per_minute.input`.
    #[arg(long, default_value_t = 60_000)]
    budget: u64,
    /// budgets: the tenant's demand, as a multiple of its budget.
    #[arg(long, default_value_t = 10.0)]
    budget_load: f64,
}

type Http = Client<HttpConnector, Full<Bytes>>;

/// Engine defaults (sim-engine's): fixed prefill cost, per prompt token, per output
/// token, all in simulated ms.
const TTFT_BASE_MS: f64 = 20.0;
const PREFILL_MS_PER_TOKEN: f64 = 0.08;
const ITL_MS: f64 = 15.0;

/// The engines, the binaries and a client: what every run shares.
struct Env {
    cli: Cli,
    urls: Vec<String>,
    router_bin: PathBuf,
    http: Http,
}

/// A router process started for one run.
struct Router {
    proc: ChildProc,
    addr: SocketAddr,
    _dir: ScratchDir,
}

/// One streamed chat answer as its client saw it.
#[derive(Debug, Default, Clone)]
struct Answer {
    status: u16,
    /// Time to the first content token, in ms.
    ttft_ms: Option<f64>,
    /// The engine's `usage.prompt_tokens`.
    prompt_tokens: u64,
    text: String,
    retry_after: Option<u64>,
    /// A transport error or a broken stream.
    error: Option<String>,
}

impl Answer {
    fn is_ok(&self) -> bool {
        self.status == 200 && self.error.is_none()
    }

    /// Turned away by a limit (429, or the FIFO queue's 503): not a failure.
    fn is_refused(&self) -> bool {
        matches!(self.status, 429 | 503) && self.error.is_none()
    }
}

/// One request an open loop sends.
struct Ask {
    addr: SocketAddr,
    headers: Vec<(&'static str, String)>,
    messages: Value,
    max_tokens: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let mut engines = Vec::new();
    let code = match run(cli, &mut engines).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flow-bench: {e}");
            ExitCode::from(2)
        }
    };
    procs::stop_all(engines).await;
    code
}

async fn run(cli: Cli, engines: &mut Vec<ChildProc>) -> Result<(), String> {
    let which = cli.scenario.clone();
    if !["priority", "fairness", "budgets", "all"].contains(&which.as_str()) {
        return Err(format!(
            "--scenario {which}: one of priority, fairness, budgets, all"
        ));
    }
    let engine_bin = procs::sibling_binary("sim-engine");
    let router_bin = procs::sibling_binary("cache-aware-router");
    let hint = "cargo build --release -p bench --bin sim-engine; cargo build --release --bin cache-aware-router";
    procs::require_binary(&engine_bin, "sim-engine", hint).map_err(|e| e.to_string())?;
    procs::require_binary(&router_bin, "cache-aware-router", hint).map_err(|e| e.to_string())?;
    let params = EngineParams {
        time_factor: cli.time_factor,
        prefill_physics: cli.prefill_physics,
        prefill_slots: cli.max_load,
        ..EngineParams::default()
    };
    let mut urls = Vec::new();
    for i in 0..cli.engines {
        let wait = Duration::from_secs(10);
        let url = procs::start_engine(&engine_bin, &params, &format!("e{i}"), 0, wait, engines)
            .await
            .map_err(|e| e.to_string())?;
        urls.push(url);
    }
    let mut http = Client::builder(TokioExecutor::new());
    http.pool_max_idle_per_host(1024);
    let env = Env {
        cli,
        urls,
        router_bin,
        http: http.build_http(),
    };
    println!(
        "{} engines (sim-engine, prefill physics {}, time factor {}), max_load {} each: {} slots",
        env.cli.engines,
        env.cli.prefill_physics,
        env.cli.time_factor,
        env.cli.max_load,
        env.slots()
    );
    if matches!(which.as_str(), "priority" | "all") {
        priority(&env).await?;
    }
    if matches!(which.as_str(), "fairness" | "all") {
        fairness(&env).await?;
    }
    if matches!(which.as_str(), "budgets" | "all") {
        budgets(&env).await?;
    }
    Ok(())
}

impl Env {
    fn slots(&self) -> usize {
        self.cli.engines * self.cli.max_load
    }

    /// A request's service time on an engine, in s: its prefill and its output.
    fn service_secs(&self, prompt_tokens: usize, max_tokens: u64) -> f64 {
        let ms =
            TTFT_BASE_MS + prompt_tokens as f64 * PREFILL_MS_PER_TOKEN + max_tokens as f64 * ITL_MS;
        ms * self.cli.time_factor / 1e3
    }

    /// Requests a second the pool serves, of `prompt_tokens` and `max_tokens` each.
    fn capacity(&self, prompt_tokens: usize, max_tokens: u64) -> f64 {
        self.slots() as f64 / self.service_secs(prompt_tokens, max_tokens)
    }

    /// Starts a router over the engines, `extra` YAML before its worker list.
    async fn router(&self, label: &str, extra: &str) -> Result<Router, String> {
        let dir = ScratchDir::new("flow-bench", label).map_err(|e| e.to_string())?;
        let port = procs::free_port().map_err(|e| e.to_string())?;
        let mut yaml = format!(
            "server: {{host: 127.0.0.1, port: {port}}}\nlog: {{level: warn}}\nhealth: {{interval_secs: 1}}\n{extra}workers:\n"
        );
        for u in &self.urls {
            yaml.push_str(&format!(
                "  - url: {u}\n    max_load: {}\n",
                self.cli.max_load
            ));
        }
        let mut started = Vec::new();
        let base = procs::start_router(
            &self.router_bin,
            &yaml,
            port,
            &dir,
            Duration::from_secs(20),
            &mut started,
        )
        .await
        .map_err(|e| e.to_string())?;
        let proc = started.pop().ok_or("the router was not started")?;
        Ok(Router {
            proc,
            addr: procs::addr_of(&base)?,
            _dir: dir,
        })
    }
}

/// `n` words of three letters, a function of `seed` (the engine counts a word a token;
/// the router estimates 4 bytes a token: the two agree).
fn words(seed: u64, n: usize) -> String {
    let mut s = String::with_capacity(n * 4);
    for j in 0..n as u64 {
        let b = xxh3_64_with_seed(&j.to_le_bytes(), seed).to_le_bytes();
        for k in &b[..3] {
            s.push(char::from(b'a' + k % 26));
        }
        s.push(' ');
    }
    s
}

fn user(text: String) -> Value {
    json!({"role": "user", "content": text})
}

/// Sends a streamed chat request and reads its answer.
async fn chat(http: &Http, ask: &Ask) -> Answer {
    let body = json!({
        "model": "m", "stream": true, "stream_options": {"include_usage": true},
        "max_tokens": ask.max_tokens, "messages": ask.messages,
    });
    let mut req = Request::post(format!("http://{}/v1/chat/completions", ask.addr))
        .header("content-type", "application/json");
    for (k, v) in &ask.headers {
        req = req.header(*k, v.as_str());
    }
    let mut a = Answer::default();
    let req = match req.body(Full::new(Bytes::from(body.to_string()))) {
        Ok(r) => r,
        Err(e) => {
            a.error = Some(e.to_string());
            return a;
        }
    };
    let t0 = Instant::now();
    let resp = match http.request(req).await {
        Ok(r) => r,
        Err(e) => {
            a.error = Some(format!("request failed: {e}"));
            return a;
        }
    };
    a.status = resp.status().as_u16();
    a.retry_after = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let mut body = resp.into_body();
    if a.status != 200 {
        let _ = body.collect().await;
        return a;
    }
    let mut sse = SseParser::default();
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(f) => f,
            Err(e) => {
                a.error = Some(format!("stream broke: {e}"));
                return a;
            }
        };
        let Some(data) = frame.data_ref() else {
            continue;
        };
        for payload in sse.push(data) {
            let Ok(v) = serde_json::from_str::<Value>(&payload) else {
                continue;
            };
            if v.get("error").is_some() {
                a.error = Some(payload);
                return a;
            }
            if let Some(t) = v["choices"][0]["delta"]["content"].as_str()
                && !t.is_empty()
            {
                a.ttft_ms
                    .get_or_insert_with(|| t0.elapsed().as_secs_f64() * 1e3);
                a.text.push_str(t);
            }
            if let Some(n) = v["usage"]["prompt_tokens"].as_u64() {
                a.prompt_tokens = n;
            }
        }
    }
    a
}

/// Sends `rate` requests a second for `secs` (open loop: each on its own task), the
/// `i`-th as `ask(i)` says; returns each answer with when it was sent (s from the
/// start), once all have ended.
async fn open_loop(
    http: &Http,
    rate: f64,
    secs: f64,
    ask: impl Fn(usize) -> Ask,
) -> Vec<(f64, Answer)> {
    let start = tokio::time::Instant::now();
    let mut tasks = JoinSet::new();
    let mut i = 0usize;
    loop {
        let due = start + Duration::from_secs_f64(i as f64 / rate);
        if due.duration_since(start).as_secs_f64() >= secs {
            break;
        }
        tokio::time::sleep_until(due).await;
        let (http, a) = (http.clone(), ask(i));
        let at = start.elapsed().as_secs_f64();
        tasks.spawn(async move { (at, chat(&http, &a).await) });
        i += 1;
    }
    let mut out = Vec::with_capacity(i);
    while let Some(joined) = tasks.join_next().await {
        if let Ok(r) = joined {
            out.push(r);
        }
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

fn headers(tenant: &str, class: Option<&str>) -> Vec<(&'static str, String)> {
    let mut h = vec![("x-tenant-id", tenant.to_string())];
    if let Some(c) = class {
        h.push(("x-priority", c.to_string()));
    }
    h
}

/// Interactive conversation turns for one run.
#[derive(Debug, Default)]
struct Turns {
    ttft_ms: Vec<f64>,
    refused: usize,
    failed: usize,
}

/// `sessions` conversations replayed one turn at a time for `secs`: six turns each
/// (a system prompt, then 150 new words a turn, the answers kept in the history),
/// 100 ms between turns; a refused turn ends its conversation (the next one starts
/// after the same pause).
async fn conversations(
    http: &Http,
    addr: SocketAddr,
    run: u64,
    sessions: usize,
    secs: f64,
) -> Turns {
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = JoinSet::new();
    for s in 0..sessions as u64 {
        let http = http.clone();
        tasks.spawn(async move {
            let mut t = Turns::default();
            let mut conv = 0u64;
            while Instant::now() < deadline {
                let seed = (run << 40) | (s << 20) | conv;
                conv += 1;
                let mut messages = vec![json!({"role": "system", "content": words(seed, 50)})];
                for turn in 0..6u64 {
                    messages.push(user(words(seed ^ (turn << 56) ^ 1, 150)));
                    let ask = Ask {
                        addr,
                        headers: headers("chat", Some("interactive")),
                        messages: Value::Array(messages.clone()),
                        max_tokens: 16,
                    };
                    let a = chat(&http, &ask).await;
                    match (a.is_ok(), a.ttft_ms) {
                        (true, Some(ms)) => t.ttft_ms.push(ms),
                        _ if a.is_refused() => t.refused += 1,
                        _ => t.failed += 1,
                    }
                    // The user's pause, after an answer or a refusal alike.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    if !a.is_ok() || Instant::now() >= deadline {
                        break;
                    }
                    messages.push(json!({"role": "assistant", "content": a.text}));
                }
            }
            t
        });
    }
    let mut all = Turns::default();
    while let Some(Ok(t)) = tasks.join_next().await {
        all.ttft_ms.extend(t.ttft_ms);
        all.refused += t.refused;
        all.failed += t.failed;
    }
    all
}

/// Counts of an open loop's answers: answered, refused (429/503), failed.
fn counts(answers: &[(f64, Answer)]) -> (usize, usize, usize) {
    let ok = answers.iter().filter(|(_, a)| a.is_ok()).count();
    let refused = answers.iter().filter(|(_, a)| a.is_refused()).count();
    (ok, refused, answers.len() - ok - refused)
}

const BATCH_WORDS: usize = 3000;
const BATCH_TOKENS: u64 = 32;

async fn priority(env: &Env) -> Result<(), String> {
    let cli = &env.cli;
    let slots = env.slots();
    let rate = cli.batch_load * env.capacity(BATCH_WORDS, BATCH_TOKENS);
    let reserve = (cli.sessions as f64 / slots as f64).min(1.0);
    let queue = "proxy: {queue: {max_waiting: 64, timeout_ms: 10000}}\n";
    let classes = format!("{queue}priority: {{reserve: {{interactive: {reserve:.4}}}}}\n");
    println!(
        "\n## Priority under flood\n\n{} interactive conversations (6 turns of 150 new words, 16 tokens out, 100 ms apart) against a batch tenant sending {BATCH_WORDS}-word prompts (32 tokens out) at {rate:.1}/s, {} × the pool's capacity; {} s a run. Classes: `priority.reserve: {{interactive: {reserve:.3}}}`; both: `{}`\n",
        cli.sessions,
        cli.batch_load,
        cli.secs,
        queue.trim()
    );
    println!(
        "| run | turns answered | refused | failed | TTFT p50 ms | p90 ms | p99 ms | batch sent | batch answered | batch refused | batch failed |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let mut p99 = Vec::new();
    let runs = [
        ("no batch load", classes.as_str(), false),
        ("batch flood, priority classes", classes.as_str(), true),
        ("batch flood, one FIFO (flow control off)", queue, true),
    ];
    for (run, (name, extra, flood)) in runs.into_iter().enumerate() {
        let router = env.router(&format!("priority{run}"), extra).await?;
        let addr = router.addr;
        let batch = async {
            if !flood {
                return Vec::new();
            }
            open_loop(&env.http, rate, cli.secs, |i| Ask {
                addr,
                headers: headers("jobs", Some("batch")),
                messages: json!([user(words(
                    ((run as u64) << 40) | (1 << 39) | i as u64,
                    BATCH_WORDS
                ))]),
                max_tokens: BATCH_TOKENS,
            })
            .await
        };
        let turns = conversations(&env.http, addr, run as u64, cli.sessions, cli.secs);
        let (batch, turns) = tokio::join!(batch, turns);
        router.proc.stop().await;
        let p = Percentiles::of(&turns.ttft_ms);
        let (ok, refused, failed) = counts(&batch);
        println!(
            "| {name} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {} | {ok} | {refused} | {failed} |",
            turns.ttft_ms.len(),
            turns.refused,
            turns.failed,
            p.p50,
            p.p90,
            p.p99,
            batch.len()
        );
        p99.push(p.p99);
    }
    if let [alone, classes, fifo] = p99[..] {
        println!(
            "\nInteractive TTFT p99 against no batch load: {:.2}× with classes, {:.2}× with one FIFO.",
            classes / alone,
            fifo / alone
        );
    }
    Ok(())
}

const FAIR_WORDS: usize = 500;
const FAIR_TOKENS: u64 = 16;

async fn fairness(env: &Env) -> Result<(), String> {
    let cli = &env.cli;
    let light_rate = cli.fair_load * env.capacity(FAIR_WORDS, FAIR_TOKENS) / 11.0;
    let queue = "proxy: {queue: {max_waiting: 2048, timeout_ms: 2000}}\n";
    let drr = format!("{queue}priority: {{}}\ntenants: {{list: {{light: {{}}, heavy: {{}}}}}}\n");
    println!(
        "\n## Fairness within a class\n\nTwo tenants in one class sending {FAIR_WORDS}-word prompts (16 tokens out): `light` at {light_rate:.1}/s, `heavy` at {:.1}/s, together {} × the pool's capacity; {} s a run; `{}`\n",
        light_rate * 10.0,
        cli.fair_load,
        cli.secs,
        queue.trim()
    );
    println!(
        "| run | tenant | sent | answered | refused | failed | admitted prompt tokens/s | share of its demand |\n|---|---|---|---|---|---|---|---|"
    );
    let runs = [
        ("deficit round robin", drr.as_str()),
        ("one FIFO (flow control off)", queue),
    ];
    for (run, (name, extra)) in runs.into_iter().enumerate() {
        let router = env.router(&format!("fair{run}"), extra).await?;
        let addr = router.addr;
        let tenant = |name: &'static str, rate: f64, tag: u64| {
            open_loop(&env.http, rate, cli.secs, move |i| Ask {
                addr,
                headers: headers(name, Some("standard")),
                messages: json!([user(words(
                    (tag << 40) | ((run as u64) << 32) | i as u64,
                    FAIR_WORDS
                ))]),
                max_tokens: FAIR_TOKENS,
            })
        };
        let (light, heavy) = tokio::join!(
            tenant("light", light_rate, 1),
            tenant("heavy", light_rate * 10.0, 2)
        );
        router.proc.stop().await;
        for (who, answers) in [("light", &light), ("heavy", &heavy)] {
            let (ok, refused, failed) = counts(answers);
            let tokens: u64 = answers.iter().map(|(_, a)| a.prompt_tokens).sum();
            let share = ok as f64 / answers.len().max(1) as f64;
            println!(
                "| {name} | {who} | {} | {ok} | {refused} | {failed} | {:.0} | {:.1} % |",
                answers.len(),
                tokens as f64 / cli.secs,
                share * 100.0
            );
        }
    }
    Ok(())
}

const BUDGET_WORDS: usize = 500;

/// Redis for the budget runs, started again on its port after a kill.
struct Redis {
    bin: PathBuf,
    dir: ScratchDir,
    port: u16,
    proc: Vec<ChildProc>,
}

impl Redis {
    async fn start(&mut self) -> Result<(), String> {
        procs::start_redis_on(
            &self.bin,
            &self.dir,
            self.port,
            Duration::from_secs(10),
            &mut self.proc,
        )
        .await
        .map(drop)
        .map_err(|e| e.to_string())
    }

    async fn kill(&mut self) {
        if let Some(mut p) = self.proc.pop() {
            p.signal("KILL");
            p.stop().await;
        }
    }
}

async fn budgets(env: &Env) -> Result<(), String> {
    let cli = &env.cli;
    let budget = cli.budget;
    let mut redis = Redis {
        bin: PathBuf::from("redis-server"),
        dir: ScratchDir::new("flow-bench", "redis").map_err(|e| e.to_string())?,
        port: procs::free_port().map_err(|e| e.to_string())?,
        proc: Vec::new(),
    };
    redis.start().await?;
    let rate = cli.budget_load * budget as f64 / 60.0 / BUDGET_WORDS as f64;
    println!(
        "\n## Token budgets\n\nA tenant with `tokens_per_minute: {{input: {budget}}}` sends {BUDGET_WORDS}-word prompts at {rate:.1}/s ({} × its budget), alternately through two router replicas; {} s a run.\n",
        cli.budget_load, cli.secs
    );
    println!(
        "| replicas | sent | answered | 429 | failed | Retry-After s (min–max) | admitted prompt tokens | the budget allows | deviation |\n|---|---|---|---|---|---|---|---|---|"
    );
    let tenants = format!(
        "tenants: {{list: {{acme: {{tokens_per_minute: {{input: {budget}}}}}, fresh: {{tokens_per_minute: {{input: {budget}}}}}}}}}\n"
    );
    let shared = format!(
        "state: {{redis_url: \"redis://127.0.0.1:{}\"}}\n{tenants}",
        redis.port
    );
    for (name, extra) in [
        ("two on one Redis", shared.as_str()),
        ("two, budgets in process", tenants.as_str()),
    ] {
        let one = env.router("budget1", extra).await?;
        let two = env.router("budget2", extra).await?;
        let addrs = [one.addr, two.addr];
        let answers = open_loop(&env.http, rate, cli.secs, |i| Ask {
            addr: addrs[i % 2],
            headers: headers("acme", None),
            messages: json!([user(words((3 << 40) | i as u64, BUDGET_WORDS))]),
            max_tokens: 1,
        })
        .await;
        one.proc.stop().await;
        two.proc.stop().await;
        let (ok, refused, failed) = counts(&answers);
        let admitted: u64 = answers.iter().map(|(_, a)| a.prompt_tokens).sum();
        // A full bucket at the start, then its refill over the time requests were sent.
        let span = answers.last().map_or(0.0, |(at, _)| *at);
        let allowed = budget as f64 * (1.0 + span / 60.0);
        let retry: Vec<u64> = answers.iter().filter_map(|(_, a)| a.retry_after).collect();
        println!(
            "| {name} | {} | {ok} | {refused} | {failed} | {}–{} | {admitted} | {allowed:.0} | {:+.1} % |",
            answers.len(),
            retry.iter().min().unwrap_or(&0),
            retry.iter().max().unwrap_or(&0),
            (admitted as f64 / allowed - 1.0) * 100.0
        );
    }
    outage(env, &mut redis, rate, &shared).await
}

/// Redis killed and started again while the two replicas send: what each window saw.
async fn outage(env: &Env, redis: &mut Redis, rate: f64, shared: &str) -> Result<(), String> {
    let secs = env.cli.secs * 1.5;
    let (down, up) = (secs * 0.35, secs * 0.55);
    let one = env.router("outage1", shared).await?;
    let two = env.router("outage2", shared).await?;
    let addrs = [one.addr, two.addr];
    let send = open_loop(&env.http, rate, secs, |i| Ask {
        addr: addrs[i % 2],
        headers: headers("fresh", None),
        messages: json!([user(words((4 << 40) | i as u64, BUDGET_WORDS))]),
        max_tokens: 1,
    });
    let faults = async {
        tokio::time::sleep(Duration::from_secs_f64(down)).await;
        redis.kill().await;
        tokio::time::sleep(Duration::from_secs_f64(up - down)).await;
        redis.start().await
    };
    let (answers, restarted) = tokio::join!(send, faults);
    restarted?;
    let mut errors = Vec::new();
    for a in addrs {
        errors.push(metric(&env.http, a, "cache_aware_router_flow_budget_errors_total").await);
    }
    one.proc.stop().await;
    two.proc.stop().await;
    println!(
        "\nRedis killed at {down:.1} s and started again (empty) at {up:.1} s of a {secs:.0} s run at the same demand, by a tenant with the same budget not used before:\n\n| window | sent | answered | 429 | failed |\n|---|---|---|---|---|"
    );
    for (name, from, to) in [
        ("Redis up", 0.0, down),
        ("Redis down", down, up),
        ("Redis back", up, f64::MAX),
    ] {
        let w: Vec<(f64, Answer)> = answers
            .iter()
            .filter(|(at, _)| (from..to).contains(at))
            .cloned()
            .collect();
        let (ok, refused, failed) = counts(&w);
        println!("| {name} | {} | {ok} | {refused} | {failed} |", w.len());
    }
    let back = answers
        .iter()
        .find(|(at, a)| *at >= up && a.status == 429)
        .map(|(at, _)| at - up);
    println!(
        "\n`flow_budget_errors_total` (limits failed open): {:?} on the two replicas; first 429 after Redis came back: {}.",
        errors,
        back.map_or("none".to_string(), |s| format!("{s:.1} s later"))
    );
    Ok(())
}

/// The sum of a family's samples on the router at `addr`.
async fn metric(http: &Http, addr: SocketAddr, family: &str) -> f64 {
    let Ok(req) = Request::get(format!("http://{addr}/metrics")).body(Full::new(Bytes::new()))
    else {
        return f64::NAN;
    };
    let Ok(resp) = http.request(req).await else {
        return f64::NAN;
    };
    let Ok(body) = resp.into_body().collect().await else {
        return f64::NAN;
    };
    String::from_utf8_lossy(&body.to_bytes())
        .lines()
        .filter(|l| l.starts_with(family))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
