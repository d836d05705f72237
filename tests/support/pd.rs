//! Scripted vLLM engines of a disaggregated fleet (NixlConnector), as
//! `shared/docs/pd-disaggregation.md` describes them: a prefill stand-in that, asked
//! for a hand-off (`kv_transfer_params.do_remote_decode` and a length cap of 1, not
//! streamed), answers `finish_reason: "length"` with `kv_transfer_params` of the NIXL
//! shape and registers the hand-off with a lease ([`Handoffs`]); and a decode stand-in
//! that checks the params it receives against that registry (unknown, expired or already
//! read: a 500, as with `kv_load_failure_policy: fail`), reports `cached_tokens` as a
//! real decode does, and streams its answer. Both keep a prefix cache: a prompt's longest
//! prefix shared with one computed (or, on a decode, received) before counts as cached.
//! Knobs per engine ([`PrefillScript`],
//! [`DecodeScript`]) and per request (headers the router forwards to both legs):
//! `x-prefill-cached: N` (the prefill's reported cached tokens), `x-decode-gap-ms: N`
//! (between streamed events), `x-decode-hold: 1` (the stream waits on the fleet's gate
//! before its usage chunk).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::worker::{FakeWorker, Gate, Recorded, Reply, Step};

/// One hand-off as the prefill engine issued it.
#[derive(Debug, Clone)]
pub struct Handoff {
    /// The prefill engine's name.
    pub prefill: String,
    /// The exact bytes of its `kv_transfer_params`.
    pub params: String,
    pub issued: Instant,
    /// Read by a decode engine (which one).
    pub read_by: Option<String>,
}

/// The hand-offs the prefill engines issued, by `remote_request_id`, each held for its
/// lease unless read: what a vLLM prefill instance holds for a remote decoder.
#[derive(Clone, Debug)]
pub struct Handoffs {
    lease: Duration,
    inner: Arc<Mutex<HashMap<String, Handoff>>>,
}

impl Handoffs {
    /// A registry whose hand-offs expire `lease` after they are issued.
    pub fn new(lease: Duration) -> Self {
        Handoffs {
            lease,
            inner: Arc::default(),
        }
    }

    fn issue(&self, prefill: &str, id: &str, params: &str) {
        self.inner.lock().unwrap().insert(
            id.to_string(),
            Handoff {
                prefill: prefill.to_string(),
                params: params.to_string(),
                issued: Instant::now(),
                read_by: None,
            },
        );
    }

    /// Reads hand-off `id` for `decode`: its prefill engine's name, or why not
    /// (`unknown`, `expired`, `already read`).
    fn read(&self, id: &str, decode: &str) -> Result<String, &'static str> {
        let mut all = self.inner.lock().unwrap();
        let h = all.get_mut(id).ok_or("unknown")?;
        if h.read_by.is_some() {
            return Err("already read");
        }
        if h.issued.elapsed() > self.lease {
            return Err("expired");
        }
        h.read_by = Some(decode.to_string());
        Ok(h.prefill.clone())
    }

    /// Every hand-off issued so far.
    pub fn all(&self) -> Vec<Handoff> {
        self.inner.lock().unwrap().values().cloned().collect()
    }

    /// Hand-offs issued and never read: KV a prefill engine holds for nobody until its
    /// lease expires (stranded).
    pub fn unread(&self) -> usize {
        self.all().iter().filter(|h| h.read_by.is_none()).count()
    }

    /// The hand-off whose params are exactly `params`, if one was issued.
    pub fn by_params(&self, params: &str) -> Option<Handoff> {
        self.all().into_iter().find(|h| h.params == params)
    }
}

/// How a prefill engine answers.
#[derive(Clone, Debug)]
pub enum PrefillScript {
    /// As vLLM does: the hand-off with `finish_reason: "length"`.
    Handoff,
    /// An end of sequence on the first token: `finish_reason: "stop"`,
    /// `kv_transfer_params: null`.
    Eos,
    /// This status with an error body.
    Status(u16),
    /// The connection closed without an answer (a crashed engine).
    Reset,
    /// The hand-off's head and the first part of its body, the rest once the gate
    /// opens (a slow answer to read).
    Trickle(Gate),
}

/// How a decode engine answers.
#[derive(Clone, Debug)]
pub enum DecodeScript {
    /// As vLLM with `kv_load_failure_policy: fail`.
    Serve,
    /// This status with an error body, whatever it is sent.
    Status(u16),
}

/// Prompt tokens an engine reports for a body: its bytes / 4.
fn prompt_tokens(body: &[u8]) -> u64 {
    body.len() as u64 / 4
}

/// A stand-in's prefix cache: the bodies it holds the KV of (the last 256).
#[derive(Default, Clone)]
struct PrefixCache(Arc<Mutex<Vec<Vec<u8>>>>);

impl PrefixCache {
    /// Tokens of `body` held: its longest prefix shared with a body held before, in
    /// whole 16-token blocks (4 bytes a token); `body` is held from now on.
    fn look_up_and_keep(&self, body: &[u8]) -> u64 {
        let mut seen = self.0.lock().unwrap();
        let lcp = |b: &Vec<u8>| b.iter().zip(body).take_while(|(x, y)| x == y).count();
        let longest = seen.iter().map(lcp).max().unwrap_or(0);
        if seen.len() >= 256 {
            seen.remove(0);
        }
        seen.push(body.to_vec());
        (longest as u64 / 4) / 16 * 16
    }
}

/// The prefill engine `name` (issuing hand-offs into `handoffs`).
pub fn prefill_engine(
    name: &str,
    script: PrefillScript,
    handoffs: Handoffs,
) -> impl Fn(&Recorded) -> Reply + Send + Sync + 'static {
    let name = name.to_string();
    let n = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let cache = PrefixCache::default();
    move |req| {
        match script {
            PrefillScript::Status(s) => {
                return Reply::json(
                    s,
                    &format!(r#"{{"error":{{"message":"prefill says {s}","code":{s}}}}}"#),
                );
            }
            PrefillScript::Reset => return Reply::raw(Vec::new()),
            _ => {}
        }
        let v: Value = match serde_json::from_slice(&req.body) {
            Ok(v) => v,
            Err(_) => return Reply::json(400, r#"{"error":{"message":"not JSON"}}"#),
        };
        let capped = ["max_tokens", "max_completion_tokens", "max_output_tokens"]
            .iter()
            .any(|k| v[k] == 1);
        if v["kv_transfer_params"]["do_remote_decode"] != true || !capped || v["stream"] != false {
            return Reply::json(400, r#"{"error":{"message":"not a prefill request"}}"#);
        }
        let held = cache.look_up_and_keep(&req.body);
        let cached: u64 = req
            .header("x-prefill-cached")
            .and_then(|c| c.parse().ok())
            .unwrap_or(held);
        let usage = crate::engine::usage_json(prompt_tokens(&req.body), cached);
        if let PrefillScript::Eos = script {
            return Reply::json(
                200,
                &format!(
                    r#"{{"id":"cmpl-p","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":""}},"finish_reason":"stop"}}],"usage":{usage},"kv_transfer_params":null}}"#
                ),
            );
        }
        let id = format!(
            "{}-{}-{}",
            req.header("x-request-id").unwrap_or("none"),
            name,
            n.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        // Python's json.dumps spacing, as vLLM writes it: relayed byte for byte.
        let params = format!(
            r#"{{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "{name}", "remote_request_id": "{id}", "remote_block_ids": [[1, 2, 3]], "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}}"#
        );
        handoffs.issue(&name, &id, &params);
        let body = format!(
            r#"{{"id":"cmpl-p","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"x"}},"finish_reason":"length"}}],"usage":{usage},"kv_transfer_params": {params}}}"#
        );
        match &script {
            PrefillScript::Trickle(gate) => {
                let (a, b) = body.split_at(body.len() / 2);
                Reply::status(200)
                    .header("Content-Type", "application/json")
                    .trickle(vec![
                        Step::Write(a.as_bytes().to_vec()),
                        Step::Wait(gate.clone()),
                        Step::Write(b.as_bytes().to_vec()),
                    ])
            }
            _ => Reply::json(200, &body),
        }
    }
}

/// The decode engine `name` (reading hand-offs from `handoffs`); `hold` is what
/// `x-decode-hold` streams wait on.
pub fn decode_engine(
    name: &str,
    script: DecodeScript,
    handoffs: Handoffs,
    hold: Gate,
) -> impl Fn(&Recorded) -> Reply + Send + Sync + 'static {
    let name = name.to_string();
    let cache = PrefixCache::default();
    move |req| {
        if let DecodeScript::Status(s) = script {
            return Reply::json(
                s,
                &format!(r#"{{"error":{{"message":"decode says {s}","code":{s}}}}}"#),
            );
        }
        let v: Value = match serde_json::from_slice(&req.body) {
            Ok(v) => v,
            Err(_) => return Reply::json(400, r#"{"error":{"message":"not JSON"}}"#),
        };
        let prompt = prompt_tokens(&req.body);
        // Transferred KV counts as cached, as vLLM's decode reports it; a prompt it
        // computes, as much as its prefix cache holds (which keeps either).
        let held = cache.look_up_and_keep(&req.body);
        let cached = match v["kv_transfer_params"]["remote_request_id"].as_str() {
            None => held,
            Some(id) => match handoffs.read(id, &name) {
                Ok(_) => prompt,
                Err(why) => {
                    return Reply::json(
                        500,
                        &format!(r#"{{"error":{{"message":"invalid KVTransferParams: {why}"}}}}"#),
                    );
                }
            },
        };
        let usage = crate::engine::usage_json(prompt, cached);
        if v["stream"] == true {
            let gap = req
                .header("x-decode-gap-ms")
                .and_then(|g| g.parse().ok())
                .map_or(Duration::ZERO, Duration::from_millis);
            let mut steps = Vec::new();
            for i in 0..3 {
                if i > 0 && !gap.is_zero() {
                    steps.push(Step::Sleep(gap));
                }
                let e = crate::engine::sse_event(i);
                steps.push(Step::Write(format!("data: {e}\n\n").into_bytes()));
            }
            if req.has_header("x-decode-hold") {
                steps.push(Step::Wait(hold.clone()));
            }
            let u = crate::engine::sse_usage_chunk(&usage);
            steps.push(Step::Write(format!("data: {u}\n\n").into_bytes()));
            steps.push(Step::Write(b"data: [DONE]\n\n".to_vec()));
            Reply::status(200)
                .header("Content-Type", "text/event-stream")
                .chunked(steps)
        } else {
            Reply::json(
                200,
                &format!(
                    r#"{{"id":"cmpl-d","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"decoded"}},"finish_reason":"stop"}}],"usage":{usage}}}"#
                ),
            )
        }
    }
}

/// Two prefill and two decode engines and what they share, with the YAML of a router
/// in front of them (`extra`: more top-level keys).
pub struct PdFleet {
    pub prefill: [FakeWorker; 2],
    pub decode: [FakeWorker; 2],
    pub handoffs: Handoffs,
    /// What `x-decode-hold` streams wait on.
    pub hold: Gate,
    pub yaml: String,
}

impl PdFleet {
    /// Engines scripted as given (hand-offs leased for a minute).
    pub async fn start(
        prefill: [PrefillScript; 2],
        decode: [DecodeScript; 2],
        extra: &str,
    ) -> Self {
        let handoffs = Handoffs::new(Duration::from_secs(60));
        let hold = Gate::new();
        let [p0, p1] = prefill;
        let [d0, d1] = decode;
        let prefill = [
            FakeWorker::start_with(prefill_engine("p0", p0, handoffs.clone())).await,
            FakeWorker::start_with(prefill_engine("p1", p1, handoffs.clone())).await,
        ];
        let decode = [
            FakeWorker::start_with(decode_engine("d0", d0, handoffs.clone(), hold.clone())).await,
            FakeWorker::start_with(decode_engine("d1", d1, handoffs.clone(), hold.clone())).await,
        ];
        let mut yaml = String::from(extra);
        if !yaml.is_empty() && !yaml.ends_with('\n') {
            yaml.push('\n');
        }
        yaml.push_str("workers:\n");
        for (w, phase) in prefill
            .iter()
            .map(|w| (w, "prefill"))
            .chain(decode.iter().map(|w| (w, "decode")))
        {
            yaml.push_str(&format!("  - {{url: \"{}\", phase: {phase}}}\n", w.url()));
        }
        PdFleet {
            prefill,
            decode,
            handoffs,
            hold,
            yaml,
        }
    }

    /// Every engine scripted to serve.
    pub async fn serving(extra: &str) -> Self {
        Self::start(
            [PrefillScript::Handoff, PrefillScript::Handoff],
            [DecodeScript::Serve, DecodeScript::Serve],
            extra,
        )
        .await
    }

    /// Requests each prefill engine received.
    pub fn prefill_calls(&self) -> Vec<Recorded> {
        self.prefill.iter().flat_map(|w| w.requests()).collect()
    }

    /// Requests each decode engine received.
    pub fn decode_calls(&self) -> Vec<Recorded> {
        self.decode.iter().flat_map(|w| w.requests()).collect()
    }
}

/// SGLang stand-ins' meeting places: a prefill and a decode request with the same
/// `bootstrap_room` meet there (the decode answer waits for its prefill).
#[derive(Clone, Debug, Default)]
pub struct Rooms(Arc<Mutex<HashMap<u64, Gate>>>);

impl Rooms {
    fn gate(&self, room: u64) -> Gate {
        self.0.lock().unwrap().entry(room).or_default().clone()
    }
}

/// The room a request names, and its body as JSON; `None` without one.
fn room_of(req: &Recorded) -> Option<(u64, Value)> {
    let v: Value = serde_json::from_slice(&req.body).ok()?;
    Some((v["bootstrap_room"].as_u64()?, v))
}

/// An SGLang prefill engine (`--disaggregation-mode prefill`): opens its request's room
/// and answers a one-token generation.
pub fn sglang_prefill(rooms: Rooms) -> impl Fn(&Recorded) -> Reply + Send + Sync + 'static {
    move |req| {
        let Some((room, _)) = room_of(req) else {
            return Reply::json(400, r#"{"error":{"message":"no bootstrap_room"}}"#);
        };
        rooms.gate(room).open();
        Reply::json(200, r#"{"text":"x","meta_info":{"prompt_tokens":3}}"#)
    }
}

/// An SGLang decode engine (`--disaggregation-mode decode`): answers once its
/// request's room has its prefill, streamed when asked.
pub fn sglang_decode(rooms: Rooms) -> impl Fn(&Recorded) -> Reply + Send + Sync + 'static {
    move |req| {
        let Some((room, v)) = room_of(req) else {
            return Reply::json(400, r#"{"error":{"message":"no bootstrap_room"}}"#);
        };
        let met = rooms.gate(room);
        let reply = if v["stream"] == true {
            let events: Vec<String> = (0..3).map(crate::engine::sse_event).collect();
            Reply::sse(&events, Duration::ZERO)
        } else {
            Reply::ok()
        };
        reply.after_gate(&met)
    }
}
