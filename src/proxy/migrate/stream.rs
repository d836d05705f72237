//! What a `GuardedBody` keeps for a stream that has a [`super::Plan`]: for one that may
//! continue, a [`Migration`] (the relay, the continuation being placed, the drain it
//! waits on); for one refused up front, a [`Watch`] (which error event ends it when it
//! breaks). Both count what happened (`stream_migrations_total`).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;

use super::continuer::{Continuer, Resumed, Starting};
use super::relay::{self, Passed, Relay};
use super::resume::{self, Next};
use super::{Cause, Kind, Refusal};
use crate::config::MigrationConfig;
use crate::pools::pool::Worker;
use crate::proxy::metrics::RequestMetrics;
use crate::tree::WorkerMask;

/// A streamed answer's plan, kept by its body.
#[derive(Debug)]
pub enum Stream {
    /// Refused up front: see [`Watch`].
    Watch(Watch),
    /// May continue elsewhere: see [`Migration`].
    Migrate(Box<Migration>),
}

/// A stream refused up front ([`Refusal`]): its bytes pass untouched; when it breaks it
/// ends with an error event saying why it was not continued.
#[derive(Debug)]
pub struct Watch {
    kind: Kind,
    refused: Refusal,
    /// The bytes sent so far end at an event's end.
    clean: bool,
    metrics: Arc<RequestMetrics>,
}

impl Watch {
    pub fn new(kind: Kind, refused: Refusal, metrics: Arc<RequestMetrics>) -> Self {
        Watch {
            kind,
            refused,
            clean: true,
            metrics,
        }
    }

    /// Notes a read passed to the client.
    pub fn note(&mut self, data: &[u8]) {
        if !data.is_empty() {
            self.clean = data.ends_with(b"\n\n") || data.ends_with(b"\r\n\r\n");
        }
    }

    /// The stream broke (`cause`): counted, and the error event that ends it.
    pub fn refuse(&self, cause: Cause) -> Bytes {
        self.metrics
            .streams()
            .refused(cause.as_str(), self.refused.as_str());
        relay::error_event(self.kind, &refused_message(cause, self.refused), self.clean)
    }
}

/// What the body does after its stream broke.
#[derive(Debug)]
pub enum Step {
    /// A continuation is being placed: poll [`Migration::poll_resumed`].
    Continuing,
    /// The answer was whole: the router ends it with these bytes.
    End(Bytes),
    /// The stream ends with this error event.
    Refused(Bytes),
    /// Nothing changes (a drain ended under a stream that cannot continue: it goes on
    /// on its draining worker).
    Keep,
}

type Drained = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A stream that may continue on another worker (see the module docs).
pub struct Migration {
    kind: Kind,
    relay: Relay,
    continuer: Continuer,
    metrics: Arc<RequestMetrics>,
    max_attempts: u32,
    /// Why the continuation being placed is needed.
    cause: Cause,
    /// The continuation being placed. The lock is never taken: the body polls it
    /// through `&mut` (`get_mut`); it makes a `Send` future `Sync`, as a body must be.
    starting: Option<Mutex<Starting>>,
    /// Resolves when the serving worker's drain ends (same lock use).
    drained: Option<Mutex<Drained>>,
    /// The workers that broke this answer: not asked to continue it.
    failed: WorkerMask,
    /// The worker that serves it now, when it is not the first.
    pub continued_on: Option<Arc<str>>,
}

impl std::fmt::Debug for Migration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Migration")
            .field("kind", &self.kind)
            .field("part", &self.relay.part())
            .field("continued_on", &self.continued_on)
            .finish_non_exhaustive()
    }
}

impl Migration {
    /// A stream of `kind` served by `worker`, continued by `continuer`.
    pub fn new(
        kind: Kind,
        continuer: Continuer,
        cfg: &MigrationConfig,
        metrics: Arc<RequestMetrics>,
        worker: &Worker,
    ) -> Self {
        Migration {
            kind,
            relay: Relay::new(kind),
            continuer,
            metrics,
            max_attempts: cfg.max_attempts,
            cause: Cause::Reset,
            starting: None,
            drained: Some(Mutex::new(Box::pin(worker.drained()))),
            failed: WorkerMask::default(),
            continued_on: None,
        }
    }

    /// Passes one read of the worker's body (see [`Relay::pass`]).
    pub fn pass(&mut self, data: &Bytes) -> Passed {
        self.relay.pass(data)
    }

    /// Continuations so far.
    pub fn continuations(&self) -> u32 {
        self.relay.part()
    }

    /// Why the last continuation was needed.
    pub fn cause(&self) -> Cause {
        self.cause
    }

    /// Whether a continuation is being placed.
    pub fn is_starting(&self) -> bool {
        self.starting.is_some()
    }

    /// The stream served by `worker` broke (`cause`): continue it elsewhere, end it, or
    /// refuse (see [`Step`]).
    pub fn broke(&mut self, cause: Cause, worker: &Worker) -> Step {
        let (tokens, part) = (self.relay.tokens(), self.relay.part());
        let said = self.relay.said();
        let refused = if said.tool_call {
            Some(Refusal::ToolCall)
        } else if said.reasoning {
            Some(Refusal::Reasoning)
        } else if part >= self.max_attempts {
            Some(Refusal::Attempts)
        } else {
            None
        };
        // A drain never cuts what cannot go on elsewhere, nor an answer about to end.
        if cause == Cause::Drained && (refused.is_some() || said.finished) {
            self.drained = None;
            return Step::Keep;
        }
        let next = match refused {
            Some(r) => Err(r),
            None => resume::next(self.kind, self.continuer.original(), said, tokens)
                .ok_or(Refusal::Unsupported),
        };
        let streams = self.metrics.streams();
        match next {
            Err(r) => {
                streams.refused(cause.as_str(), r.as_str());
                tracing::warn!(request_id = ?self.continuer.request_id(), worker = %worker.url(), cause = cause.as_str(), refused = r.as_str(), "a stream broke and cannot continue elsewhere");
                Step::Refused(relay::error_event(
                    self.kind,
                    &refused_message(cause, r),
                    true,
                ))
            }
            Ok(Next::End) => {
                streams.migrated(cause.as_str(), "ended");
                Step::End(self.relay.ending())
            }
            Ok(Next::Send(body)) => {
                self.failed.insert(worker.id());
                self.cause = cause;
                self.drained = None;
                let start = self.continuer.start(body, self.failed.clone());
                self.starting = Some(Mutex::new(start));
                Step::Continuing
            }
        }
    }

    /// The continuation being placed: its answer, once a worker took it (its events
    /// then follow as the first part's sequel), or the error event that ends the
    /// stream.
    pub fn poll_resumed(&mut self, cx: &mut Context<'_>) -> Poll<Result<Resumed, Bytes>> {
        let Some(starting) = self.starting.as_mut() else {
            return Poll::Pending;
        };
        let placed = match starting.get_mut() {
            Ok(f) => std::task::ready!(f.as_mut().poll(cx)),
            Err(_) => Err(crate::error::ProxyError::NoWorker("continuation lost")),
        };
        self.starting = None;
        let cause = self.cause.as_str();
        let streams = self.metrics.streams();
        Poll::Ready(match placed {
            Ok(resumed) => {
                let to = resumed.guard.worker();
                streams.migrated(cause, "continued");
                tracing::info!(request_id = ?self.continuer.request_id(), to = %to.url(), cause, tokens_sent = self.relay.tokens(), "stream continued on another worker");
                self.relay.begin_part();
                self.continued_on = Some(Arc::clone(to.label()));
                self.drained = Some(Mutex::new(Box::pin(to.drained())));
                Ok(resumed)
            }
            Err(e) => {
                streams.migrated(cause, "failed");
                tracing::warn!(request_id = ?self.continuer.request_id(), cause, error = %crate::error::Chain(&e), "no worker could continue a broken stream");
                let message = format!(
                    "the worker serving this stream failed ({cause}) and no other worker could continue it: {e}"
                );
                Err(relay::error_event(self.kind, &message, true))
            }
        })
    }

    /// Ready when the serving worker's drain has ended (once).
    pub fn poll_drained(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(Ok(drained)) = self.drained.as_mut().map(Mutex::get_mut) else {
            return Poll::Pending;
        };
        std::task::ready!(drained.as_mut().poll(cx));
        self.drained = None;
        Poll::Ready(())
    }
}

fn refused_message(cause: Cause, why: Refusal) -> String {
    let why = match why {
        Refusal::N => "it asked for several choices (n > 1)",
        Refusal::Guided => "it asked for guided or structured output",
        Refusal::Logprobs => "it asked for log probabilities",
        Refusal::ToolCall => "a tool call was being streamed",
        Refusal::Reasoning => "reasoning was being streamed",
        Refusal::Unsupported => "its request shape cannot be continued",
        Refusal::Attempts => "it was already continued migration.max_attempts times",
    };
    format!(
        "the worker serving this stream failed ({}) and the answer cannot be continued on another worker: {why}",
        cause.as_str()
    )
}
