//! cache-aware-router: a cache-aware load balancer for pools of vLLM / SGLang replicas.
//!
//! # Architecture
//!
//! ```text
//! main.rs      cli -> Config::load -> app::run (or a tool: simulate)
//! cli          the command line: serve, --config-check, simulate
//! app          parts: every running part built once from Config (the routing table of
//!              pools and policies, fleet, upstream client, metrics, response cache,
//!              exporter); hands each
//!              consumer the parts it uses, spawns every long-lived task, SIGHUP,
//!              SIGTERM drain
//! cores        thread per core: client connections on single-threaded runtimes
//! config       YAML layers -> validated Config: one file per section (its schema,
//!              defaults, checks, SIGHUP difference); check: positions and words;
//!              secret: credentials; passthrough: which other paths reach a worker
//! service      the hyper service: one route table (admin endpoints, listener rules,
//!              routed endpoints, passthrough verdicts, WebSockets) -> admin or proxy
//! proxy        serve -> forward -> respond, read in that direction
//!   serve      body (bounded) -> media check -> response cache -> prompt -> forward
//!   forward    the attempt loop: policy::decide::pick_slot -> upstream -> observe
//!   retry      which answer or failure another worker takes; backoff; push-back
//!   respond    the answer's headers, its body in a GuardedBody
//!   body       GuardedBody: streams the answer, owns the in-flight guard
//!   access_log the end of a request in one place: outcome, access line, span
//!   media      proxy.remote_media_url_policy: media members of any JSON body
//!   headers    request ids, the router's response headers, worker URLs made relative
//!   usage      engine token usage (and /v1/responses ids) read as bytes pass
//!   pd         disaggregated pools: the decode pick, the bypass, the prefill leg,
//!              vLLM's NIXL hand-off relayed to the decode leg; what the client sees
//!   metrics    the request path's families (requests, decisions, latencies, engine
//!              usage, prefix numbers, admission queue), per-worker handles to them
//!   adapters   a LoRA adapter request on its worker: loaded on demand, SGLang's form
//!   models, responses, tunnel   GET /v1/models; calls on a stored response; WebSockets
//! request      a client's request body, bounded in bytes, memory and time (proxy, admin)
//! upstream     the client to workers: hyper HTTP/1.1 connections kept per worker, one
//!              attempt; health probes and scrapes on the same connections; headers
//!              (hop-by-hop stripping); below both proxy and cache
//! policy       trait Policy (pick pure, observe = the only writer of routing memory),
//!              build(); decide (the pick with its slot, an adapter's placement, the
//!              usage settlement: shared with simulate); select; one module per
//!              policy; session (conversation state and sessions around any policy);
//!              precise (KV-event policy);
//!              view: what a policy's memory shows (/workers fields, its metric
//!              families, POST /cache/clear), one interface for every policy
//! pools        the routing table: one pool per model (and `default`: models no list
//!              names, requests that name none), each with its policy, over one
//!              membership of workers (a worker in two pools is one engine); which
//!              workers a request's model goes to; refresh: each worker's GET
//!              /v1/models read on join and every models.refresh_secs; legs: a pool
//!              with prefill and decode workers disaggregates; metrics
//!   pool       workers, stable ids, membership, health, breaker, in-flight guards,
//!              models (what each worker serves, read lock-free), adapters (which
//!              LoRA adapters each worker holds, as the router estimates it),
//!              fetch (how tasks reach a worker), pending prefill and the learned
//!              prefill rate, each worker's signal slots and idle connections;
//!              metrics: the pool's scrape-time families
//! signals      background sources for those slots: engine /metrics scrapes, LMCache
//! cache        the response cache: exact and semantic keys, stored answers, in-process
//!              (moka) or Redis store, embeddings
//! fleet        routing state shared by router replicas over Redis (prefix records,
//!              in-flight shares, bindings, snapshot)
//! flow         flow control: tenants and priority classes (classify), the admission
//!              queue (one queue per class and tenant: strict order, deficit round
//!              robin in tokens), priority.reserve, pre-emption
//! redis_link   one bounded Redis connection, replaced after a call on it timed out
//!              (the cache's store, the fleet's publisher)
//! discovery    workers found at run time (DNS, Kubernetes EndpointSlices)
//! tree         RadixTree (owned by cache_aware) + eviction task
//! precise      KV-event state: events, sequence, index, feed, consumer
//! tokenize     request token ids as vLLM computes them (chat_template)
//! prompt       request body -> RouteContext (routing text, length, digest, where
//!              its `model` is, its cache_salt; the text scoped by adapter and salt;
//!              model: that string replaced in place)
//! metrics      the registry (prometheus-client) and its naming rules, imports no part:
//!              each part registers its own families and scrape-time collectors
//!              (exposition: how), may ask to run before each scrape (BeforeScrape)
//!              or write text families after the registry's (ScrapeText)
//! admin        GET /health, /workers, /metrics; the admin API (its own parts: Admin)
//! exposition   how a part writes its scrape-time families (imports no part)
//! reload       SIGHUP: re-read files, replace the pool's workers; reloads_total
//! simulate     `simulate`: a request log through the same policy code over modelled
//!              engines (the engine model sim-engine uses), a grid of settings
//! error        ProxyError (causes kept as #[source]) -> the one JSON error response
//! log_format   the text log line's fields and timestamp, written for less (one access
//!              line per request)
//! log_sink     where log lines go: stderr, gathered per connection thread and written
//!              out when it goes idle (one write for many lines)
//! redact       credentials out of every message, log line and answer
//! trace        W3C traceparent: continued or started, sent upstream; export: one
//!              span per request to an OTLP collector (batch, off the request path)
//! clock, shutdown  tokio's clock for state machines; one shutdown signal
//! allocator    freed memory back to the system after a burst (glibc's malloc_trim
//!              when the router is quiet again)
//! ```
//!
//! Dependencies point one way: app -> service -> admin | proxy; proxy -> cache ->
//! upstream, proxy -> upstream -> pools, proxy -> trace, proxy -> flow -> pools,
//! proxy -> policy -> fleet ->
//! pools/tree (the table of pools is generic over the policy, so it sits below it);
//! simulate -> policy, never the proxy; admin reads the pools' policies' views and the
//! workers, never the proxy; health, reload, discovery and the KV-event supervisor use
//! the workers' pool. Each part registers its own metric families in the registry
//! `app` builds (the proxy the request path's, reload its reloads, the others
//! scrape-time collectors written with exposition); metrics and exposition import no
//! part, and admin encodes the registry without knowing whose families it holds.
//!
//! # A request
//!
//! 1. Read the body up to `server.max_body_bytes` (413) within `server.body_timeout_secs`
//!    (408).
//! 2. The response cache, when on: a hit is answered here (no pick). Else
//!    `prompt::extract` the routing text for the endpoint (and where its `model` is).
//! 3. Load the routing table once: the request's `model` (read in step 2's parse) chooses
//!    its pool and workers (`Table::route`: 404 for a model no worker serves); the
//!    pool's policy's `prepare` (precise mode: token ids); mark the usable candidates;
//!    `Policy::pick`.
//! 4. Take an `InFlightGuard`, forward, return the upstream body in a `GuardedBody` so
//!    the guard lives exactly as long as the stream; `Policy::observe` the outcome.
//! 5. Retry on another worker on connection errors, timeouts before headers and
//!    retryable statuses, only while nothing has reached the client.

// `deny`, not `forbid`: `allocator::trim` is the one `unsafe` call (glibc's malloc_trim).
#![deny(unsafe_code)]

pub mod admin;
pub mod allocator;
pub mod app;
pub mod cache;
pub mod cli;
pub mod clock;
pub mod config;
pub mod cores;
pub mod discovery;
pub mod error;
pub mod exposition;
pub mod fleet;
pub mod flow;
pub mod log_format;
pub mod log_sink;
pub mod metrics;
pub mod policy;
pub mod pools;
pub mod precise;
pub mod prompt;
pub mod proxy;
pub mod redact;
pub mod redis_link;
pub mod reload;
pub mod request;
pub mod service;
pub mod shutdown;
pub mod signals;
pub mod simulate;
pub mod tokenize;
pub mod trace;
pub mod tree;
pub mod upstream;

#[cfg(test)]
mod tests {
    /// The text block of `//!` docs that starts with ```` ```text ````, and the paragraph
    /// after it, as plain text.
    fn module_map(text: &str) -> (String, String) {
        let (_, rest) = text.split_once("```text\n").expect("a module map");
        let (map, rest) = rest.split_once("```").expect("its end");
        let deps = rest.trim_start().split("\n\n").next().unwrap_or_default();
        (map.to_string(), deps.to_string())
    }

    #[test]
    fn the_books_architecture_page_copies_this_module_map() {
        let docs: String = include_str!("lib.rs")
            .lines()
            .filter_map(|l| l.strip_prefix("//!"))
            .map(|l| format!("{}\n", l.strip_prefix(' ').unwrap_or(l)))
            .collect();
        let page = include_str!("../docs/src/architecture.md");
        assert_eq!(
            module_map(&docs),
            module_map(page),
            "docs/src/architecture.md's module map and dependency paragraph must copy src/lib.rs's"
        );
    }
}
