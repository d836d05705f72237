//! Benchmark kit for cache-aware-router: a simulated vLLM engine, a Mooncake
//! trace replayer and the policy comparison that drives both.
//!
//! ```text
//! prompts  trace line (hash_ids) -> deterministic prompt text (port of expand_prompts.py)
//! engine   simulated vLLM replica: OpenAI API, prefix cache of 16-token blocks, LRU,
//!          FIFO prefill + concurrent decode on tokio timers, vLLM metrics
//! prefill  how an engine's prefills share it: serial, parallel, shared (physics)
//! embeddings deterministic 256-d feature-hashing vectors of /v1/embeddings
//! replay   open-loop replay of a trace against one URL (or several, round robin)
//! stats    per-request results -> summary (hit rate, TTFT percentiles, throughput)
//! matrix   start engines + router per policy, replay, one markdown table
//! chart    the table's picture: TTFT CDF and hit rate per contender (SVG)
//! procs    child processes (engines, router): start, wait ready, stop; /proc usage
//! load     closed-loop HTTP load (one keep-alive connection per worker), bursts
//! workloads synthetic traces in the Mooncake format (the hot-prefix trace)
//! ```
//!
//! Binaries: `sim-engine`, `replay`, `trace-matrix` (the demo; also runs the peer
//! routers), `overhead` (what the router costs: added latency, saturation, 5,000
//! streams, tree memory, response cache), `hot-prefix-trace` (writes
//! `bench/data/hot_prefix.jsonl`), `peer-overhead` (the same against sglang-router and
//! vllm-router; `bench/peers/run.sh` installs them and runs both comparisons),
//! `kill-test` (streams through workers killed and drained) and `hedge-bench` (TTFT
//! with and without hedging a late first token).

#![forbid(unsafe_code)]

pub mod chart;
pub mod embeddings;
pub mod engine;
pub mod load;
pub mod matrix;
pub mod prefill;
pub mod procs;
pub mod prompts;
pub mod replay;
pub mod stats;
pub mod workloads;
