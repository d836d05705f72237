//! What the integration tests in `tests/` run against, split by role. It does not
//! depend on the router (the tests start it themselves, see `tests/common`), so the
//! router's dev-dependency on it points one way.
//!
//! - [`worker`]: [`worker::FakeWorker`], a scripted mock replica on a raw TCP listener;
//!   [`engine`]: the OpenAI-shaped bodies and a mock engine reporting prefix usage.
//! - [`client`]: a raw HTTP/1.1 client ([`client::Conn`]) that keeps what it received
//!   exactly, and one-shot helpers.
//! - [`observe`]: the router as its operator reads it (`/workers`, `/metrics`).
//! - [`config`]: YAML for a router in front of mock workers, temporary files.
//! - [`binary`]: the built router in its own process (output, signals, memory).
//! - Stand-ins for what the router talks to: [`redis`] (a real `redis-server`),
//!   [`dns`], [`kube_api`], [`otlp`], [`tls`] (an `https://` worker), [`ws`].
//! - [`pd`]: scripted vLLM prefill and decode engines sharing a hand-off registry.
//! - [`story`]: an engine whose answers are checked token by token, continues a
//!   partial answer as vLLM does, and dies mid-stream on request.
//! - [`wait`]: bounded waits, so that a bug shows as a failure, not a hang.

pub mod binary;
pub mod client;
pub mod config;
pub mod dns;
pub mod engine;
pub mod kube_api;
pub mod observe;
pub mod otlp;
pub mod pd;
pub mod redis;
pub mod story;
pub mod tls;
pub mod wait;
mod wire;
pub mod worker;
pub mod ws;
