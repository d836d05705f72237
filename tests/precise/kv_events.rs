//! Precise mode end to end: fake vLLM engines publish real-format KV-event frames (both
//! payload encodings) on a ZeroMQ PUB socket, and serve replay on a ROUTER socket, in
//! the test process; the router consumes them and routes requests that carry
//! `x-token-ids` to the worker whose engine holds the prompt's blocks.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use cache_aware_router::app;
use rmpv::Value;
use support::{client::*, config::*, observe::*, wait::*, worker::*};

use crate::common::start_router;
use tokio::sync::watch;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// Tokens per block in these tests (the router's `precise.block_size`).
pub(crate) const BS: usize = 4;
pub(crate) const TOPIC: &str = "kv";

/// How an engine encodes its events (spec §4.2).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Form {
    /// Current vLLM: tagged maps.
    Map,
    /// Legacy vLLM: tagged arrays.
    Array,
}

pub(crate) fn s(x: &str) -> Value {
    Value::from(x)
}

pub(crate) fn ints(v: impl IntoIterator<Item = u64>) -> Value {
    Value::Array(v.into_iter().map(Value::from).collect())
}

/// `BlockStored` for whole blocks of `tokens`, engine hashes `hashes`.
pub(crate) fn stored(form: Form, hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Value {
    let parent = parent.map_or(Value::Nil, Value::from);
    let toks = ints(tokens.iter().map(|t| u64::from(*t)));
    match form {
        Form::Map => Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), ints(hashes.iter().copied())),
            (s("parent_block_hash"), parent),
            (s("token_ids"), toks),
            (s("block_size"), Value::from(BS as u64)),
            (s("lora_id"), Value::Nil),
            (s("medium"), s("GPU")),
            (s("lora_name"), Value::Nil),
            (s("group_idx"), Value::from(0)),
            (s("kv_cache_spec_kind"), s("full_attention")),
        ]),
        Form::Array => Value::Array(vec![
            s("BlockStored"),
            ints(hashes.iter().copied()),
            parent,
            toks,
            Value::from(BS as u64),
            Value::Nil,
            s("GPU"),
            Value::Nil,
        ]),
    }
}

pub(crate) fn removed(form: Form, hashes: &[u64]) -> Value {
    match form {
        Form::Map => Value::Map(vec![
            (s("type"), s("BlockRemoved")),
            (s("block_hashes"), ints(hashes.iter().copied())),
            (s("medium"), s("GPU")),
        ]),
        Form::Array => Value::Array(vec![
            s("BlockRemoved"),
            ints(hashes.iter().copied()),
            s("GPU"),
        ]),
    }
}

fn cleared(form: Form) -> Value {
    match form {
        Form::Map => Value::Map(vec![(s("type"), s("AllBlocksCleared"))]),
        Form::Array => Value::Array(vec![s("AllBlocksCleared")]),
    }
}

/// A msgpack `KVEventBatch`: `[ts, events, dp_rank]`.
pub(crate) fn batch(rank: u32, events: Vec<Value>) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(
        &mut out,
        &Value::Array(vec![
            Value::F64(1_767_225_600.25),
            Value::Array(events),
            Value::from(rank),
        ]),
    )
    .expect("encode");
    out
}

/// An engine's replay buffer: every batch by sequence number.
type Buffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// How the fake replay service answers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum ReplayMode {
    /// Every buffered batch from the requested sequence on, then the terminator.
    Serve,
    /// Only the terminator (the buffer no longer reaches back far enough).
    TerminatorOnly,
}

/// A fake vLLM engine's event side: a PUB socket (and optionally a ROUTER replay
/// service) on 127.0.0.1, with the engine's sequence numbering and replay buffer.
pub(crate) struct FakeEngine {
    /// The data-parallel rank its batches carry.
    pub(crate) rank: u32,
    pub(crate) endpoint: String,
    replay_endpoint: Option<String>,
    publisher: tokio::sync::Mutex<PubSocket>,
    next_seq: Mutex<u64>,
    /// Every batch published or lost, by sequence number (the replay buffer).
    buffer: Buffer,
    /// Start sequence of each replay request received.
    replay_requests: Arc<Mutex<Vec<u64>>>,
    /// While true, replay requests wait before being answered.
    hold: watch::Sender<bool>,
    mode: Arc<Mutex<ReplayMode>>,
}

impl FakeEngine {
    pub(crate) async fn start(with_replay: bool) -> FakeEngine {
        let replay = with_replay.then_some(0);
        FakeEngine::bind(0, 0, replay).await.expect("bind")
    }

    /// The publishers of one vLLM server with `n` data-parallel ranks: rank r on the
    /// PUB port of rank 0 plus r (spec §1), no replay. Ports come from the OS for rank 0;
    /// when one of the next is taken, all are dropped and it starts over.
    pub(crate) async fn ranks(n: u32) -> Vec<FakeEngine> {
        for _ in 0..50 {
            let first = FakeEngine::start(false).await;
            let base = first.port();
            let mut all = vec![first];
            for r in 1..n {
                match FakeEngine::bind(r, base + r as u16, None).await {
                    Ok(e) => all.push(e),
                    Err(_) => break,
                }
            }
            if all.len() == n as usize {
                return all;
            }
        }
        panic!("no {n} consecutive free ports");
    }

    /// An engine of DP rank `rank` with its PUB socket on `port` and, with `replay`,
    /// a replay ROUTER on that port (0 = any free port).
    async fn bind(rank: u32, port: u16, replay: Option<u16>) -> zeromq::ZmqResult<FakeEngine> {
        let mut publisher = PubSocket::new();
        let endpoint = publisher
            .bind(&format!("tcp://127.0.0.1:{port}"))
            .await?
            .to_string();
        let buffer: Buffer = Arc::default();
        let replay_requests: Arc<Mutex<Vec<u64>>> = Arc::default();
        let (hold, hold_rx) = watch::channel(false);
        let mode = Arc::new(Mutex::new(ReplayMode::Serve));
        let replay_endpoint = if let Some(port) = replay {
            let mut router = RouterSocket::new();
            let ep = router
                .bind(&format!("tcp://127.0.0.1:{port}"))
                .await?
                .to_string();
            tokio::spawn(serve_replay(
                router,
                Arc::clone(&buffer),
                Arc::clone(&replay_requests),
                hold_rx,
                Arc::clone(&mode),
            ));
            Some(ep)
        } else {
            None
        };
        Ok(FakeEngine {
            rank,
            endpoint,
            replay_endpoint,
            publisher: tokio::sync::Mutex::new(publisher),
            next_seq: Mutex::new(0),
            buffer,
            replay_requests,
            hold,
            mode,
        })
    }

    /// The PUB socket's port.
    pub(crate) fn port(&self) -> u16 {
        let (_, port) = self.endpoint.rsplit_once(':').expect("tcp endpoint");
        port.parse().expect("port")
    }

    fn take_seq(&self, payload: &[u8]) -> u64 {
        let mut next = self.next_seq.lock().unwrap();
        let seq = *next;
        *next += 1;
        self.buffer.lock().unwrap().push((seq, payload.to_vec()));
        seq
    }

    /// Publishes one batch with the next sequence number.
    pub(crate) async fn publish(&self, events: Vec<Value>) {
        self.publish_as(self.rank, events).await;
    }

    /// Publishes one batch that says it comes from DP rank `rank`.
    pub(crate) async fn publish_as(&self, rank: u32, events: Vec<Value>) {
        let payload = batch(rank, events);
        let seq = self.take_seq(&payload);
        self.send(vec![
            Bytes::from_static(TOPIC.as_bytes()),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(payload),
        ])
        .await;
    }

    /// Takes the next sequence number for a batch that never reaches the subscriber
    /// (as when ZeroMQ drops at the high-water mark); the replay buffer keeps it.
    fn lose(&self, events: Vec<Value>) {
        self.take_seq(&batch(self.rank, events));
    }

    /// Restarts the engine's publisher on the same port: a new process, whose sequence
    /// numbers start again at 0.
    async fn restart(&self) {
        let mut publisher = self.publisher.lock().await;
        let old = std::mem::replace(&mut *publisher, PubSocket::new());
        old.close().await;
        let start = std::time::Instant::now();
        // The old listener's port is released asynchronously.
        while let Err(e) = publisher.bind(&self.endpoint).await {
            assert!(start.elapsed() < STEP_TIMEOUT, "rebind PUB: {e}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        *self.next_seq.lock().unwrap() = 0;
        self.buffer.lock().unwrap().clear();
    }

    /// Sends raw frames (well-formed or not).
    async fn send(&self, frames: Vec<Bytes>) {
        let msg = ZmqMessage::try_from(frames).expect("frames");
        self.publisher
            .lock()
            .await
            .send(msg)
            .await
            .expect("publish");
    }

    /// Publishes empty batches until the router has received one (the ZeroMQ slow
    /// joiner loses what is sent before the subscription arrives), then waits until the
    /// feed is live (a first-contact replay, if any, done).
    pub(crate) async fn sync(&self, router: &app::RunningRouter, worker: usize) {
        self.sync_rank(router, worker, None).await;
    }

    /// [`FakeEngine::sync`] for rank `rank` of a worker with several DP ranks (its
    /// entry in `kv_events.ranks`), or of a one-rank worker (`None`).
    pub(crate) async fn sync_rank(
        &self,
        router: &app::RunningRouter,
        worker: usize,
        rank: Option<usize>,
    ) {
        let addr = router.addr;
        let start = std::time::Instant::now();
        loop {
            self.publish(Vec::new()).await;
            let w = get_workers(addr).await;
            let mut feed = &w["workers"][worker]["kv_events"];
            if let Some(r) = rank {
                feed = &feed["ranks"][r];
            }
            if feed["messages"].as_u64().unwrap_or(0) > 0 && feed["state"] == "live" {
                return;
            }
            assert!(
                start.elapsed() < STEP_TIMEOUT,
                "the router never received worker {worker}'s events: {w}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The fake engine's replay service (spec §7): `[identity, empty, start_seq]` in; per
/// buffered batch `[identity, empty, topic, seq, payload]`, then the terminator
/// `[identity, empty, empty, FF×8, empty]` out.
async fn serve_replay(
    mut router: RouterSocket,
    buffer: Buffer,
    requests: Arc<Mutex<Vec<u64>>>,
    mut hold: watch::Receiver<bool>,
    mode: Arc<Mutex<ReplayMode>>,
) {
    while let Ok(msg) = router.recv().await {
        let frames = msg.into_vec();
        let [identity, delimiter, start] = &frames[..] else {
            continue;
        };
        let (true, Ok(start)) = (delimiter.is_empty(), <[u8; 8]>::try_from(&start[..])) else {
            continue;
        };
        let start = u64::from_be_bytes(start);
        requests.lock().unwrap().push(start);
        let _ = hold.wait_for(|held| !*held).await;
        let mode = *mode.lock().unwrap();
        let batches: Vec<(u64, Vec<u8>)> = if mode == ReplayMode::Serve {
            buffer
                .lock()
                .unwrap()
                .iter()
                .filter(|(seq, _)| *seq >= start)
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        for (seq, payload) in batches {
            let reply = vec![
                identity.clone(),
                Bytes::new(),
                Bytes::from_static(TOPIC.as_bytes()),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::from(payload),
            ];
            let _ = router
                .send(ZmqMessage::try_from(reply).expect("reply"))
                .await;
        }
        let end = vec![
            identity.clone(),
            Bytes::new(),
            Bytes::new(),
            Bytes::from_static(&[0xff; 8]),
            Bytes::new(),
        ];
        let _ = router.send(ZmqMessage::try_from(end).expect("end")).await;
    }
}

/// Health checks too rare to matter in a test.
pub(crate) const NO_HEALTH: &str = "  interval_secs: 60\n";

/// The router's YAML: precise mode, block size [`BS`] plus the `precise:` lines in
/// `extra` and the `health:` lines in `health` (both indented), and one worker per
/// HTTP fake with its engine's endpoints.
fn precise_yaml(workers: &[(&FakeWorker, &FakeEngine)], extra: &str, health: &str) -> String {
    let mut y = format!(
        "policy: precise_cache_aware\nprecise:\n  block_size: {BS}\n{extra}health:\n{health}workers:\n"
    );
    for (w, e) in workers {
        y.push_str(&format!(
            "  - url: \"{}\"\n    kv_events:\n      endpoint: \"{}\"\n      topic: {TOPIC}\n",
            w.url(),
            e.endpoint
        ));
        if let Some(r) = &e.replay_endpoint {
            y.push_str(&format!("      replay_endpoint: \"{r}\"\n"));
        }
    }
    y
}

/// A prompt of `blocks` full blocks plus two tokens, distinct per `salt`.
pub(crate) fn prompt(blocks: usize, salt: u32) -> Vec<u32> {
    (0..(blocks * BS + 2) as u32)
        .map(|i| salt * 1000 + i)
        .collect()
}

/// Sends a chat request whose token ids are `tokens` (the text is the same for every
/// request, so the approximate tree cannot tell them apart); returns the worker index.
pub(crate) async fn route(
    router: &app::RunningRouter,
    ws: &[&FakeWorker],
    tokens: &[u32],
) -> usize {
    let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
    let req = Req::post("/v1/chat/completions", chat_body("the same text", false))
        .header("x-token-ids", &ids.join(","));
    let (resp, w) = send_tagged(router.addr, ws, req).await;
    assert_eq!(resp.status, 200);
    w
}

pub(crate) async fn feed(router: &app::RunningRouter, worker: usize) -> serde_json::Value {
    get_workers(router.addr).await["workers"][worker]["kv_events"].clone()
}

/// Waits until worker `worker`'s feed satisfies `cond`.
pub(crate) async fn wait_feed(
    router: &app::RunningRouter,
    worker: usize,
    what: &str,
    cond: impl Fn(&serde_json::Value) -> bool,
) {
    wait_until(what, STEP_TIMEOUT, || async {
        cond(&feed(router, worker).await)
    })
    .await;
}

/// Two HTTP workers with fake engines, the router started and both feeds live.
async fn setup(
    replay: bool,
    extra: &str,
) -> (Vec<FakeWorker>, Vec<FakeEngine>, app::RunningRouter) {
    let ws = vec![FakeWorker::start().await, FakeWorker::start().await];
    setup_with(ws, replay, extra, NO_HEALTH).await
}

/// [`setup`] with these HTTP workers and `health:` lines.
pub(crate) async fn setup_with(
    ws: Vec<FakeWorker>,
    replay: bool,
    extra: &str,
    health: &str,
) -> (Vec<FakeWorker>, Vec<FakeEngine>, app::RunningRouter) {
    let es = vec![
        FakeEngine::start(replay).await,
        FakeEngine::start(replay).await,
    ];
    let pairs: Vec<(&FakeWorker, &FakeEngine)> = ws.iter().zip(&es).collect();
    let router = start_router(&precise_yaml(&pairs, extra, health)).await;
    for (i, e) in es.iter().enumerate() {
        e.sync(&router, i).await;
    }
    (ws, es, router)
}

/// Engine A reports `p`'s first three blocks, engine B its first one (the layout most
/// tests start from); returns once both are indexed.
async fn a_holds_three_b_one(es: &[FakeEngine], router: &app::RunningRouter, p: &[u32]) {
    es[0]
        .publish(vec![stored(Form::Map, &hashes(1, 3), None, &p[..3 * BS])])
        .await;
    es[1]
        .publish(vec![stored(Form::Map, &hashes(2, 1), None, &p[..BS])])
        .await;
    wait_feed(router, 0, "A indexed", |f| f["blocks"] == 3).await;
    wait_feed(router, 1, "B indexed", |f| f["blocks"] == 1).await;
}

/// Hashes of blocks `0..n` as engine `e` numbers them (any per-engine values do).
pub(crate) fn hashes(e: u64, n: usize) -> Vec<u64> {
    (0..n as u64).map(|i| e * 1_000_000 + i).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_prefix_routes_to_its_worker_with_the_tree_empty() {
    let (ws, es, router) = setup(false, "").await;
    let w: Vec<&FakeWorker> = ws.iter().collect();
    assert_eq!(get_workers(router.addr).await["tree_nodes"], 0);
    // Engine A reports prompt P in the current (map) encoding, in two runs chained by
    // the parent hash; engine B reports Q in the legacy (array) encoding.
    let p = prompt(4, 1);
    let q = prompt(3, 2);
    let hp = hashes(1, 4);
    es[0]
        .publish(vec![stored(Form::Map, &hp[..2], None, &p[..2 * BS])])
        .await;
    es[0]
        .publish(vec![stored(
            Form::Map,
            &hp[2..],
            Some(hp[1]),
            &p[2 * BS..4 * BS],
        )])
        .await;
    es[1]
        .publish(vec![stored(Form::Array, &hashes(2, 3), None, &q[..3 * BS])])
        .await;
    wait_feed(&router, 0, "A's blocks indexed", |f| f["blocks"] == 4).await;
    wait_feed(&router, 1, "B's blocks indexed", |f| f["blocks"] == 3).await;
    for _ in 0..3 {
        assert_eq!(route(&router, &w, &p).await, 0, "P is on A");
        assert_eq!(route(&router, &w, &q).await, 1, "Q is on B");
    }
    // A prompt that shares P's first two blocks only still prefers A.
    let mut p2 = p.clone();
    p2[2 * BS] = 99_999;
    assert_eq!(route(&router, &w, &p2).await, 0);
    let view = get_workers(router.addr).await;
    assert_eq!(
        view["precise"]["decisions"]["precise"]["x_token_ids"], 7,
        "{view}"
    );
    assert_eq!(view["precise"]["block_size"], BS);
    // Without token ids the approximate tree decides.
    let (resp, _) = send_tagged(
        router.addr,
        &w,
        Req::post("/v1/chat/completions", chat_body("the same text", false)),
    )
    .await;
    assert_eq!(resp.status, 200);
    let view = get_workers(router.addr).await;
    assert_eq!(
        view["precise"]["decisions"]["fallback"]["no_tokens"], 1,
        "{view}"
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_blocks_no_longer_attract() {
    for form in [Form::Map, Form::Array] {
        let (ws, es, router) = setup(false, "").await;
        let w: Vec<&FakeWorker> = ws.iter().collect();
        let p = prompt(3, 3);
        let ha = hashes(1, 3);
        es[0]
            .publish(vec![stored(form, &ha, None, &p[..3 * BS])])
            .await;
        // B holds only the first block.
        es[1]
            .publish(vec![stored(form, &hashes(2, 1), None, &p[..BS])])
            .await;
        wait_feed(&router, 0, "A indexed", |f| f["blocks"] == 3).await;
        wait_feed(&router, 1, "B indexed", |f| f["blocks"] == 1).await;
        assert_eq!(
            route(&router, &w, &p).await,
            0,
            "{form:?}: 3 blocks on A beat 1 on B"
        );
        es[0].publish(vec![removed(form, &ha)]).await;
        wait_feed(&router, 0, "A's removal applied", |f| f["blocks"] == 0).await;
        // The removal also cancels the speculative entry the last request left on A.
        assert_eq!(
            route(&router, &w, &p).await,
            1,
            "{form:?}: A no longer holds P"
        );
        router.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_blocks_cleared_forgets_the_worker() {
    let (ws, es, router) = setup(false, "").await;
    let w: Vec<&FakeWorker> = ws.iter().collect();
    let p = prompt(3, 4);
    es[0]
        .publish(vec![stored(Form::Map, &hashes(1, 3), None, &p[..3 * BS])])
        .await;
    es[1]
        .publish(vec![stored(Form::Array, &hashes(2, 1), None, &p[..BS])])
        .await;
    wait_feed(&router, 0, "A indexed", |f| f["blocks"] == 3).await;
    wait_feed(&router, 1, "B indexed", |f| f["blocks"] == 1).await;
    assert_eq!(route(&router, &w, &p).await, 0);
    es[0].publish(vec![cleared(Form::Array)]).await;
    wait_feed(&router, 0, "A cleared", |f| {
        f["cleared"] == 1 && f["blocks"] == 0
    })
    .await;
    assert_eq!(route(&router, &w, &p).await, 1);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequence_gap_withdraws_a_and_replay_fills_it() {
    let (ws, es, router) = setup(true, "").await;
    let w: Vec<&FakeWorker> = ws.iter().collect();
    let p = prompt(3, 5);
    let ha = hashes(1, 3);
    es[0]
        .publish(vec![stored(Form::Map, &ha, None, &p[..3 * BS])])
        .await;
    es[1]
        .publish(vec![stored(Form::Map, &hashes(2, 1), None, &p[..BS])])
        .await;
    wait_feed(&router, 0, "A indexed", |f| f["blocks"] == 3).await;
    wait_feed(&router, 1, "B indexed", |f| f["blocks"] == 1).await;
    assert_eq!(route(&router, &w, &p).await, 0);

    // A's removal of P is lost on the way; the next batch reveals the gap. The replay
    // service holds its answer for now.
    let before = es[0].replay_requests.lock().unwrap().len();
    es[0].hold.send_replace(true);
    let lost_seq = *es[0].next_seq.lock().unwrap();
    es[0].lose(vec![removed(Form::Map, &ha)]);
    es[0].publish(Vec::new()).await;
    // (The feed turns `replaying` just before the request is sent: wait for both.)
    wait_feed(&router, 0, "A replaying", |f| {
        f["state"] == "replaying"
            && f["gaps"] == 1
            && es[0].replay_requests.lock().unwrap().len() > before
    })
    .await;
    assert_eq!(
        es[0].replay_requests.lock().unwrap()[before..],
        [lost_seq],
        "replay asked from the first missing sequence number"
    );
    // While replaying, A scores neutral: B's one block wins.
    assert_eq!(route(&router, &w, &p).await, 1);

    // The replay delivers the lost removal: A is whole again and no longer holds P.
    es[0].hold.send_replace(false);
    wait_feed(&router, 0, "replay complete", |f| {
        f["state"] == "live" && f["replays_complete"].as_u64() >= Some(1)
    })
    .await;
    let a = feed(&router, 0).await;
    assert_eq!(
        (a["blocks"].as_u64(), a["replays_failed"].as_u64()),
        (Some(0), Some(0)),
        "{a}"
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequence_gap_clears_a_when_it_cannot_be_replayed() {
    // Without a replay endpoint.
    let (ws, es, router) = setup(false, "  speculative_ttl_secs: 0\n").await;
    let w: Vec<&FakeWorker> = ws.iter().collect();
    let p = prompt(3, 6);
    a_holds_three_b_one(&es, &router, &p).await;
    es[0].lose(Vec::new());
    es[0].publish(Vec::new()).await;
    wait_feed(&router, 0, "A cleared after the gap", |f| {
        f["gaps"] == 1 && f["blocks"] == 0
    })
    .await;
    assert_eq!(route(&router, &w, &p).await, 1);
    router.shutdown().await;

    // With a replay service whose buffer no longer reaches the gap.
    let (ws, es, router) = setup(true, "  speculative_ttl_secs: 0\n").await;
    let w: Vec<&FakeWorker> = ws.iter().collect();
    es[0]
        .publish(vec![stored(Form::Array, &hashes(1, 3), None, &p[..3 * BS])])
        .await;
    es[1]
        .publish(vec![stored(Form::Array, &hashes(2, 1), None, &p[..BS])])
        .await;
    wait_feed(&router, 0, "A indexed", |f| f["blocks"] == 3).await;
    wait_feed(&router, 1, "B indexed", |f| f["blocks"] == 1).await;
    *es[0].mode.lock().unwrap() = ReplayMode::TerminatorOnly;
    es[0].lose(Vec::new());
    es[0].publish(Vec::new()).await;
    wait_feed(&router, 0, "replay failed, A cleared", |f| {
        f["replays_failed"] == 1 && f["blocks"] == 0 && f["state"] == "live"
    })
    .await;
    assert_eq!(route(&router, &w, &p).await, 1);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_feed_scores_neutral_until_events_resume() {
    let (ws, es, router) = setup(false, "  stale_secs: 0.3\n  speculative_ttl_secs: 0\n").await;
    let w: Vec<&FakeWorker> = ws.iter().collect();
    let p = prompt(3, 7);
    a_holds_three_b_one(&es, &router, &p).await;
    assert_eq!(route(&router, &w, &p).await, 0);
    // Requests flowed to A, and A's engine says nothing for longer than stale_secs.
    wait_feed(&router, 0, "A stale", |f| f["state"] == "stale").await;
    assert_eq!(route(&router, &w, &p).await, 1, "stale A is neutral");
    // A message from A makes it live again.
    es[0].publish(Vec::new()).await;
    wait_feed(&router, 0, "A live again", |f| f["state"] == "live").await;
    assert_eq!(route(&router, &w, &p).await, 0);
    // Every worker stale: the approximate tree decides.
    for (i, what) in [(0, "A stale again"), (1, "B stale")] {
        wait_feed(&router, i, what, |f| f["state"] == "stale").await;
    }
    route(&router, &w, &p).await;
    let view = get_workers(router.addr).await;
    assert!(
        view["precise"]["decisions"]["fallback"]["no_fresh_worker"].as_u64() >= Some(1),
        "{view}"
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_frames_are_counted_and_skipped() {
    let (ws, es, router) = setup(false, "").await;
    let w: Vec<&FakeWorker> = ws.iter().collect();
    let e = &es[0];
    let seq = |n: u64| Bytes::copy_from_slice(&n.to_be_bytes());
    let topic = || Bytes::from_static(TOPIC.as_bytes());
    // Two frames; a 5-byte sequence number.
    e.send(vec![topic(), seq(999)]).await;
    e.send(vec![
        topic(),
        Bytes::from_static(&[0, 0, 0, 0, 1]),
        Bytes::from_static(b"x"),
    ])
    .await;
    // Well-framed, with the next sequence numbers, but payloads that are not batches.
    for payload in [&b"not msgpack \xc1"[..], &[0x93, 0x01][..], &[0x05][..]] {
        let n = e.take_seq(payload);
        e.send(vec![topic(), seq(n), Bytes::copy_from_slice(payload)])
            .await;
    }
    // A good batch with an unknown event kind beside a real one.
    let p = prompt(2, 8);
    e.publish(vec![
        Value::Map(vec![(s("type"), s("BlockSnapshotted"))]),
        stored(Form::Map, &hashes(1, 2), None, &p[..2 * BS]),
    ])
    .await;
    wait_feed(&router, 0, "garbage counted, good batch applied", |f| {
        f["malformed"] == 5 && f["skipped_events"] == 1 && f["blocks"] == 2
    })
    .await;
    let a = feed(&router, 0).await;
    assert_eq!(
        (a["gaps"].as_u64(), a["restarts"].as_u64()),
        (Some(0), Some(0)),
        "{a}"
    );
    assert_eq!(route(&router, &w, &p).await, 0);
    let label = worker_label(router.addr, 0).await;
    let m = scrape(router.addr).await;
    assert_eq!(
        m.value(
            "cache_aware_router_kv_event_malformed_total",
            &[("worker", &label)]
        ),
        5.0
    );
    assert_eq!(
        m.value(
            "cache_aware_router_kv_events_total",
            &[("worker", &label), ("kind", "block_stored")]
        ),
        1.0
    );
    assert_eq!(
        m.value(
            "cache_aware_router_precise_index_worker_blocks",
            &[("worker", &label)]
        ),
        2.0
    );
    assert!(
        m.get(
            "cache_aware_router_kv_event_since_last_seconds",
            &[("worker", &label)]
        )
        .is_some()
    );
    assert_eq!(
        m.value(
            "cache_aware_router_precise_decisions_total",
            &[("path", "precise"), ("cause", "x_token_ids")]
        ),
        1.0
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_restart_clears_its_blocks_after_a_reconnect() {
    let (ws, es, router) = setup(false, "  speculative_ttl_secs: 0\n").await;
    let w: Vec<&FakeWorker> = ws.iter().collect();
    let p = prompt(3, 9);
    // Far along in its sequence, A's engine holds P.
    *es[0].next_seq.lock().unwrap() = 1000;
    a_holds_three_b_one(&es, &router, &p).await;
    assert_eq!(route(&router, &w, &p).await, 0);
    // The engine restarts; its new publisher counts from 0 again.
    es[0].restart().await;
    wait_until("the restart seen", STEP_TIMEOUT, || async {
        es[0].publish(Vec::new()).await;
        feed(&router, 0).await["restarts"] == 1
    })
    .await;
    let a = feed(&router, 0).await;
    assert!(a["reconnects"].as_u64() >= Some(1), "{a}");
    // The consumer counts the restart, then clears: a read between the two sees the
    // count and the old blocks, so wait for the clear itself.
    wait_feed(&router, 0, "A's blocks cleared by the restart", |f| {
        f["blocks"] == 0
            && f["clears_restart"].as_u64().unwrap_or(0)
                + f["clears_reconnect"].as_u64().unwrap_or(0)
                >= 1
    })
    .await;
    assert_eq!(route(&router, &w, &p).await, 1);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_tokenizes_requests_without_token_ids() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
    let extra = format!("  tokenizer: \"{}\"\n", dir.display());
    let (ws, es, router) = setup(false, &extra).await;
    let w: Vec<&FakeWorker> = ws.iter().collect();
    // What vLLM would prefill for two chats (the parity test pins these to vLLM's own).
    let tokenizer = cache_aware_router::tokenize::PromptTokenizer::load(
        &dir,
        None,
        cache_aware_router::tokenize::chat_template::ContentFormat::Auto,
    )
    .unwrap();
    let chat_p = chat_body(
        "a long shared system prompt about routing, KV caches and blocks",
        false,
    );
    let chat_q = chat_body(
        "a different conversation, about something else entirely",
        false,
    );
    let p = tokenizer.chat(chat_p.as_bytes()).unwrap();
    let q = tokenizer.chat(chat_q.as_bytes()).unwrap();
    let (np, nq) = (p.len() / BS, q.len() / BS);
    es[0]
        .publish(vec![stored(Form::Map, &hashes(1, np), None, &p[..np * BS])])
        .await;
    es[1]
        .publish(vec![stored(Form::Map, &hashes(2, nq), None, &q[..nq * BS])])
        .await;
    wait_feed(&router, 0, "A indexed", |f| f["blocks"] == np).await;
    wait_feed(&router, 1, "B indexed", |f| f["blocks"] == nq).await;
    for _ in 0..3 {
        let (resp, to) = send_tagged(
            router.addr,
            &w,
            Req::post("/v1/chat/completions", chat_p.clone()),
        )
        .await;
        assert_eq!((resp.status, to), (200, 0), "P's blocks are on A");
        let (resp, to) = send_tagged(
            router.addr,
            &w,
            Req::post("/v1/chat/completions", chat_q.clone()),
        )
        .await;
        assert_eq!((resp.status, to), (200, 1), "Q's blocks are on B");
    }
    // A completions prompt of token ids needs no tokenizing.
    let ids: Vec<String> = q.iter().map(u32::to_string).collect();
    let body = format!("{{\"model\": \"m\", \"prompt\": [{}]}}", ids.join(","));
    let (resp, to) = send_tagged(router.addr, &w, Req::post("/v1/completions", body)).await;
    assert_eq!((resp.status, to), (200, 1));
    // An image cannot be mirrored: the approximate tree decides, and says why.
    let image = r#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}"#;
    let (resp, _) = send_tagged(router.addr, &w, Req::post("/v1/chat/completions", image)).await;
    assert_eq!(resp.status, 200);
    let d = &get_workers(router.addr).await["precise"]["decisions"];
    assert_eq!(d["precise"]["tokenizer"], 6, "{d}");
    assert_eq!(d["precise"]["prompt_token_ids"], 1, "{d}");
    assert_eq!(d["fallback"]["untokenizable"], 1, "{d}");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_restart_unseen_while_disconnected_is_rebuilt_from_its_replay() {
    let (ws, es, router) = setup(true, "  speculative_ttl_secs: 0\n").await;
    let w: Vec<&FakeWorker> = ws.iter().collect();
    let p = prompt(3, 10);
    let q = prompt(2, 11);
    a_holds_three_b_one(&es, &router, &p).await;
    assert_eq!(route(&router, &w, &p).await, 0);
    let old_next = *es[0].next_seq.lock().unwrap();
    let a = feed(&router, 0).await;
    let replays_before = a["replays_complete"].as_u64().unwrap();

    // A's engine restarts. While the router is disconnected, the new engine stores Q
    // and publishes more batches than the old one had: its first batch the router sees
    // is further on than the old stream's next one. Asked to replay "from old_next",
    // its buffer would answer seamlessly and P would stay on A.
    es[0].restart().await;
    es[0].lose(vec![stored(Form::Map, &hashes(3, 2), None, &q[..2 * BS])]);
    for _ in 0..old_next + 3 {
        es[0].lose(Vec::new());
    }
    wait_until(
        "the restart after the reconnect handled",
        STEP_TIMEOUT,
        || async {
            es[0].publish(Vec::new()).await;
            let a = feed(&router, 0).await;
            a["clears_reconnect"] == 1
                && a["state"] == "live"
                && a["replays_complete"].as_u64() > Some(replays_before)
        },
    )
    .await;
    let a = feed(&router, 0).await;
    assert_eq!(
        (a["restarts"].as_u64(), a["gaps"].as_u64()),
        (Some(1), Some(0)),
        "taken as a restart, not a gap: {a}"
    );
    assert!(a["reconnects"].as_u64() >= Some(1), "{a}");
    // `/workers` reads a rank's block count and its feed's counters one after the
    // other, not at one instant: the count can lag the counters that ended the loop.
    wait_feed(&router, 0, "only the new engine's Q", |a| a["blocks"] == 2).await;
    assert_eq!(
        es[0].replay_requests.lock().unwrap().last(),
        Some(&0),
        "rebuilt from the start of the new engine's buffer"
    );
    assert_eq!(route(&router, &w, &p).await, 1, "P is no longer on A");
    assert_eq!(route(&router, &w, &q).await, 0, "Q is on A");
    let label = worker_label(router.addr, 0).await;
    let m = scrape(router.addr).await;
    for (cause, n) in [("reconnect", 1.0), ("restart", 0.0), ("gap", 0.0)] {
        assert_eq!(
            m.value(
                "cache_aware_router_kv_event_clears_total",
                &[("worker", &label), ("cause", cause)]
            ),
            n,
            "{cause}"
        );
    }
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unhealthy_worker_loses_its_blocks_and_its_feed_starts_over() {
    let up = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let probe = Arc::clone(&up);
    let a = FakeWorker::builder()
        .health(
            move |_| match probe.load(std::sync::atomic::Ordering::SeqCst) {
                true => Reply::json(200, r#"{"status":"ok"}"#),
                false => Reply::json(503, r#"{"status":"down"}"#),
            },
        )
        .start()
        .await;
    let ws = vec![a, FakeWorker::start().await];
    let health = "  interval_secs: 0.05\n  failure_threshold: 1\n  success_threshold: 1\n";
    let (ws, es, router) = setup_with(ws, true, "  speculative_ttl_secs: 0\n", health).await;
    let w: Vec<&FakeWorker> = ws.iter().collect();
    let p = prompt(3, 12);
    a_holds_three_b_one(&es, &router, &p).await;
    assert_eq!(route(&router, &w, &p).await, 0);
    let requests_before = es[0].replay_requests.lock().unwrap().len();

    // A fails its probe: its blocks go with its tree entries.
    up.store(false, std::sync::atomic::Ordering::SeqCst);
    wait_feed(&router, 0, "A's blocks dropped when unhealthy", |f| {
        f["clears_unhealthy"] == 1 && f["blocks"] == 0
    })
    .await;
    assert_eq!(
        get_workers(router.addr).await["workers"][0]["healthy"],
        false
    );
    up.store(true, std::sync::atomic::Ordering::SeqCst);
    wait_until("A healthy again", STEP_TIMEOUT, || async {
        get_workers(router.addr).await["workers"][0]["healthy"] == true
    })
    .await;
    let a = feed(&router, 0).await;
    assert_eq!(
        (a["blocks"].as_u64(), a["gaps"].as_u64()),
        (Some(0), Some(0)),
        "{a}"
    );
    assert_eq!(
        route(&router, &w, &p).await,
        1,
        "A's old blocks do not count"
    );

    // The feed forgot its sequence: A's next batch, though in order, is a first contact,
    // answered by a replay from 0 that rebuilds what the engine still reports.
    es[0].publish(Vec::new()).await;
    wait_feed(&router, 0, "A rebuilt by a replay from 0", |f| {
        f["blocks"] == 3 && f["state"] == "live"
    })
    .await;
    assert_eq!(
        es[0].replay_requests.lock().unwrap()[requests_before..],
        [0]
    );
    assert_eq!(route(&router, &w, &p).await, 0);
    let label = worker_label(router.addr, 0).await;
    let m = scrape(router.addr).await;
    assert_eq!(
        m.value(
            "cache_aware_router_kv_event_clears_total",
            &[("worker", &label), ("cause", "unhealthy")]
        ),
        1.0
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_two_dp_ranks_is_followed_rank_by_rank() {
    let ws = [FakeWorker::start().await, FakeWorker::start().await];
    let w: Vec<&FakeWorker> = ws.iter().collect();
    // A: one HTTP endpoint, two engine ranks publishing on consecutive ports. B: one.
    let a = FakeEngine::ranks(2).await;
    let b = FakeEngine::start(false).await;
    assert_eq!(a[1].port(), a[0].port() + 1);
    let mut yaml = format!(
        "policy: precise_cache_aware\nprecise:\n  block_size: {BS}\n  speculative_ttl_secs: 0\nhealth:\n{NO_HEALTH}workers:\n"
    );
    for (url, engine, ranks) in [
        (ws[0].url(), &a[0], "      dp_size: 2\n"),
        (ws[1].url(), &b, ""),
    ] {
        yaml.push_str(&format!(
            "  - url: \"{url}\"\n    kv_events:\n      endpoint: \"{}\"\n      topic: {TOPIC}\n{ranks}",
            engine.endpoint
        ));
    }
    let router = start_router(&yaml).await;
    a[0].sync_rank(&router, 0, Some(0)).await;
    a[1].sync_rank(&router, 0, Some(1)).await;
    b.sync(&router, 1).await;
    assert_eq!(get_workers(router.addr).await["tree_nodes"], 0);

    // A's rank 1 holds P's 3 blocks, its rank 0 a block of Q; B holds P's first block.
    let p = prompt(3, 21);
    let q = prompt(1, 22);
    a[1].publish(vec![stored(Form::Map, &hashes(1, 3), None, &p[..3 * BS])])
        .await;
    a[0].publish(vec![stored(Form::Array, &hashes(1, 1), None, &q[..BS])])
        .await;
    b.publish(vec![stored(Form::Map, &hashes(2, 1), None, &p[..BS])])
        .await;
    wait_feed(&router, 0, "A's ranks indexed", |f| {
        f["ranks"][0]["blocks"] == 1 && f["ranks"][1]["blocks"] == 3
    })
    .await;
    wait_feed(&router, 1, "B indexed", |f| f["blocks"] == 1).await;
    for _ in 0..2 {
        assert_eq!(route(&router, &w, &p).await, 0, "P is on A's rank 1");
    }
    // The engine is told which rank (vLLM's X-data-parallel-rank), not left to guess.
    let sent = ws[0].requests();
    assert!(
        sent.iter()
            .all(|r| r.header("x-data-parallel-rank") == Some("1")),
        "{:?}",
        sent.iter().map(|r| &r.headers).collect::<Vec<_>>()
    );
    let f = feed(&router, 0).await;
    assert_eq!(
        (f["dp_size"].as_u64(), f["live_ranks"].as_u64()),
        (Some(2), Some(2)),
        "{f}"
    );
    assert_eq!(
        (f["blocks"].as_u64(), f["state"].as_str()),
        (Some(4), Some("live")),
        "{f}"
    );
    assert_eq!(f["endpoint"], a[0].endpoint.as_str());
    assert_eq!(f["ranks"][1]["endpoint"], a[1].endpoint.as_str());
    assert_eq!(f["ranks"][1]["rank"], 1);
    assert!(f["last_seq"].is_null(), "each rank numbers its own: {f}");
    let per_rank: u64 = (0..2)
        .map(|r| f["ranks"][r]["messages"].as_u64().unwrap())
        .sum();
    assert_eq!(f["messages"].as_u64(), Some(per_rank), "{f}");
    let one_rank = feed(&router, 1).await;
    assert!(
        one_rank.get("ranks").is_none() && one_rank.get("dp_size").is_none(),
        "a one-rank worker keeps its shape: {one_rank}"
    );

    // A gap on rank 0 (no replay) clears rank 0's blocks only.
    a[0].lose(Vec::new());
    a[0].publish(Vec::new()).await;
    wait_feed(&router, 0, "rank 0 cleared after its gap", |f| {
        f["ranks"][0]["clears_gap"] == 1 && f["ranks"][0]["blocks"] == 0
    })
    .await;
    let f = feed(&router, 0).await;
    assert_eq!(
        (
            f["ranks"][1]["blocks"].as_u64(),
            f["ranks"][1]["gaps"].as_u64()
        ),
        (Some(3), Some(0)),
        "{f}"
    );
    assert_eq!(
        (f["gaps"].as_u64(), f["blocks"].as_u64()),
        (Some(1), Some(3)),
        "{f}"
    );
    assert_eq!(route(&router, &w, &p).await, 0, "P is still on A's rank 1");

    // A batch on rank 1's port that says rank 0: counted, applied to rank 1.
    let r = prompt(1, 23);
    a[1].publish_as(0, vec![stored(Form::Map, &hashes(3, 1), None, &r[..BS])])
        .await;
    wait_feed(&router, 0, "mismatch counted", |f| {
        f["ranks"][1]["rank_mismatch"] == 1 && f["ranks"][1]["blocks"] == 4
    })
    .await;
    assert_eq!(feed(&router, 0).await["rank_mismatch"], 1);
    assert_eq!(route(&router, &w, &r).await, 0);

    // /metrics: one series per worker, the ranks summed.
    let label = worker_label(router.addr, 0).await;
    let m = scrape(router.addr).await;
    for (name, v) in [
        ("cache_aware_router_precise_index_worker_blocks", 4.0),
        ("cache_aware_router_kv_event_live_ranks", 2.0),
        ("cache_aware_router_kv_event_gaps_total", 1.0),
        ("cache_aware_router_kv_event_rank_mismatch_total", 1.0),
    ] {
        assert_eq!(m.value(name, &[("worker", &label)]), v, "{name}");
    }
    router.shutdown().await;
}

/// One worker whose engine keys its blocks from the fixture tokenizer's own chat
/// template (as vLLM would), behind a router tokenizing with `template` instead when
/// given: after each answer the engine reports the blocks it prefilled. Returns the
/// worker's `kv_events` view once its parity checks are in.
async fn parity_run(template: Option<&std::path::Path>, requests: usize) -> serde_json::Value {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
    let mut extra = format!("  tokenizer: \"{}\"\n", dir.display());
    if let Some(t) = template {
        extra.push_str(&format!("  chat_template: \"{}\"\n", t.display()));
    }
    let w = FakeWorker::start().await;
    let e = FakeEngine::start(false).await;
    let router = start_router(&precise_yaml(&[(&w, &e)], &extra, NO_HEALTH)).await;
    e.sync(&router, 0).await;
    let engine = cache_aware_router::tokenize::PromptTokenizer::load(
        &dir,
        None,
        cache_aware_router::tokenize::chat_template::ContentFormat::Auto,
    )
    .unwrap();
    for i in 0..requests {
        let body = chat_body(
            &format!("conversation {i} about routing and KV caches"),
            false,
        );
        let resp = send(
            router.addr,
            &Req::post("/v1/chat/completions", body.clone()),
        )
        .await;
        assert_eq!(resp.status, 200);
        let t = engine.chat(body.as_bytes()).unwrap();
        let n = t.len() / BS;
        e.publish(vec![stored(
            Form::Map,
            &hashes(i as u64 + 1, n),
            None,
            &t[..n * BS],
        )])
        .await;
    }
    wait_feed(&router, 0, "every answer checked", |f| {
        let p = &f["parity"];
        p["matches"].as_u64().unwrap_or(0) + p["mismatches"].as_u64().unwrap_or(0)
            >= requests as u64
    })
    .await;
    let view = feed(&router, 0).await;
    if template.is_some() {
        // The tree routes for the worker now, and says why.
        let resp = send(
            router.addr,
            &Req::post("/v1/chat/completions", chat_body("one more", false)),
        )
        .await;
        assert_eq!(resp.status, 200);
        let d = &get_workers(router.addr).await["precise"]["decisions"];
        assert_eq!(d["fallback"]["parity_lost"], 1, "{d}");
        assert_eq!(d["precise"]["tokenizer"], requests as u64, "{d}");
        let label = worker_label(router.addr, 0).await;
        let checked =
            get_workers(router.addr).await["workers"][0]["kv_events"]["parity"]["mismatches"]
                .as_u64()
                .unwrap();
        // Scraped twice: the counter shows the total, not the total once per scrape.
        for _ in 0..2 {
            let m = scrape(router.addr).await;
            assert_eq!(
                m.value(
                    "cache_aware_router_precise_parity_lost",
                    &[("worker", &label)]
                ),
                1.0
            );
            assert_eq!(
                m.value(
                    "cache_aware_router_precise_parity_checks_total",
                    &[("worker", &label), ("result", "mismatch")]
                ),
                checked as f64
            );
        }
    }
    router.shutdown().await;
    view
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_template_unlike_the_engines_loses_parity_and_falls_back() {
    // Same template as the engine: every answer's blocks are confirmed.
    let same = parity_run(None, 10).await;
    let p = &same["parity"];
    assert_eq!(
        (p["matches"].as_u64(), p["mismatches"].as_u64()),
        (Some(10), Some(0)),
        "{same}"
    );
    assert_eq!(
        (p["lost"].as_bool(), same["state"].as_str()),
        (Some(false), Some("live"))
    );
    // The router's template leaves out the engine's BOS token: no block ever matches.
    let template = TempFile::new(
        "no-bos.jinja",
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    );
    let other = parity_run(Some(&template.path), 10).await;
    let p = &other["parity"];
    assert_eq!(
        (p["matches"].as_u64(), p["mismatches"].as_u64()),
        (Some(0), Some(10)),
        "{other}"
    );
    assert_eq!(p["lost"], true, "{other}");
    assert_eq!(other["state"], "parity_lost", "{other}");
    assert_eq!(p["last_cause"], "tokens", "{other}");
    let detail = p["last_cause_detail"].as_str().unwrap();
    assert!(detail.contains("from token 0 on"), "{detail}");
}
