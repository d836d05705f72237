//! [`GuardedBody`]: the upstream response body, carrying the request's in-flight guard.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

use super::BoxError;
use super::access_log::AccessLog;
use super::metrics::RequestMetrics;
use super::usage::UsageScanner;
use crate::pools::pool::InFlightGuard;
use crate::pools::pool::breaker::Outcome;
use crate::upstream::UpstreamBody;

/// What is recorded when a response body finishes: duration, engine usage, access log.
#[derive(Debug)]
pub struct BodyTap {
    pub metrics: Arc<RequestMetrics>,
    /// Told what a complete answer carried (a `/v1/responses` id).
    pub policy: Arc<dyn crate::policy::Policy>,
    /// Reads usage from the bytes as they pass; `None` for bodies it cannot read.
    pub scanner: Option<UsageScanner>,
    /// An SSE answer: its first data frame is the first token (TTFT).
    pub streamed: bool,
    /// Copies the body for the response cache (a miss whose answer may be stored).
    pub record: Option<crate::cache::Recorder>,
    pub log: AccessLog,
    /// `cache.drift_floor` and `cache.drift_secs` (see `pool::hits`).
    pub drift_floor: f64,
    pub drift_for: Duration,
    /// `cache.engine_block_tokens`.
    pub block_tokens: u64,
    /// The policy's preparation of the request, handed back with the answer when it
    /// keyed the prompt's blocks (precise mode).
    pub prepared: crate::policy::Prepared,
    /// The span exporter (`tracing.otlp_endpoint`); `None` = no span.
    pub export: Option<Arc<crate::trace::export::Exporter>>,
}

/// Streams the upstream body to the client as it arrives (no buffering: frames already
/// read from the worker share one write, nothing waits for the worker) and holds the
/// [`InFlightGuard`] until the body ends, fails, or is dropped because the client left.
///
/// A gap of more than `idle_timeout` between two frames ends the body with an error (a
/// hung worker must not hold a client forever); a stream that keeps producing is never
/// cut, however long it runs. The timer is not moved per frame: a frame only notes its
/// time, and a timer that fires early is set again from the last frame's.
#[derive(Debug)]
pub struct GuardedBody {
    inner: UpstreamBody,
    guard: Option<InFlightGuard>,
    idle_timeout: Duration,
    idle: Pin<Box<Sleep>>,
    /// When the last frame arrived (the body's start before the first).
    last_frame: Instant,
    tap: Option<BodyTap>,
    /// Frames read from the worker and not yet handed on, with their data bytes.
    held: VecDeque<Frame<Bytes>>,
    held_bytes: usize,
    /// How the worker's body ended (an error, or `Ok` for its end), once `held` is out.
    end: Option<Result<(), BoxError>>,
    /// The worker's error was held back for one poll, so that hyper flushes the frames
    /// handed on before it (it drops unflushed output when a body fails).
    error_deferred: bool,
    /// Handing `held` on (then `end`) before reading the worker again.
    releasing: bool,
}

/// The worker went silent mid-body for longer than `proxy.request_timeout_secs`.
#[derive(Debug, thiserror::Error)]
#[error("upstream body idle for more than {0:?}")]
pub struct IdleTimeout(Duration);

impl GuardedBody {
    pub fn new(
        inner: UpstreamBody,
        guard: InFlightGuard,
        idle_timeout: Duration,
        tap: BodyTap,
    ) -> Self {
        GuardedBody {
            inner,
            guard: Some(guard),
            idle_timeout,
            idle: Box::pin(tokio::time::sleep(idle_timeout)),
            last_frame: Instant::now(),
            tap: Some(tap),
            held: VecDeque::new(),
            held_bytes: 0,
            end: None,
            error_deferred: false,
            releasing: false,
        }
    }

    /// Releases the guard (recording `outcome` with the breaker, if any), settles what
    /// the answer's usage says, and ends the request ([`AccessLog::end`]), once.
    fn finish(&mut self, outcome: Option<Outcome>, how: &'static str) {
        let mut guard = self.guard.take();
        let served_by = guard.as_ref().map(|g| Arc::clone(g.worker()));
        if let Some(g) = &mut guard
            && let Some(o) = outcome
        {
            g.record(o);
        }
        if let Some(mut tap) = self.tap.take() {
            let worker = &tap.log.worker;
            tap.metrics.finished(worker, tap.log.arrived.elapsed());
            if how == "complete"
                && let Some(found) = tap.scanner.take().map(UsageScanner::found)
            {
                let mut delivery = None;
                let mut delivered_tokens = None;
                if let Some(u) = found.usage {
                    let cached = u.cached_tokens.unwrap_or(0);
                    tap.metrics.engine_usage(worker, u.prompt_tokens, cached);
                    if let Some(g) = &guard {
                        let d = &tap.log.decision;
                        let (delivered, marked) = crate::policy::decide::settle_usage(
                            g,
                            u.prompt_tokens,
                            u.cached_tokens,
                            tap.streamed,
                            (d.predicted_tokens, d.mark),
                            tap.block_tokens,
                        );
                        if let Some(delivered) = delivered {
                            tap.hit_numbers(g.worker(), delivered);
                        }
                        delivery = marked;
                        delivered_tokens = delivered;
                    }
                }
                let keyed = matches!(
                    tap.prepared,
                    crate::policy::Prepared::Blocks(crate::precise::Lookup::Blocks { .. })
                );
                let answer = crate::policy::Answer {
                    response_id: found.response_id.as_deref(),
                    delivery,
                    prepared: keyed.then_some(&tap.prepared),
                    delivered_tokens,
                };
                if let Some(w) = served_by.as_ref()
                    && (answer.response_id.is_some()
                        || answer.delivery.is_some()
                        || answer.prepared.is_some())
                {
                    tap.policy.answered(w, &answer);
                }
            }
            if let Some(r) = tap.record {
                r.finish(how == "complete");
            }
            tap.log.end(&tap.metrics, tap.export.as_deref(), how);
        }
    }
}

impl BodyTap {
    /// Counts the answer's available / predicted / `delivered` tokens for `w`, warns when
    /// its drift has stayed low, and logs `delivered`.
    fn hit_numbers(&mut self, w: &crate::pools::pool::Worker, delivered: u64) {
        let d = &self.log.decision;
        let numbers = [d.available_tokens, d.predicted_tokens, delivered];
        let drift = w.hits().record(numbers, self.drift_floor, self.drift_for);
        self.metrics
            .prefix_tokens(&self.log.worker, self.policy.name(), numbers, drift);
        if drift.warn {
            tracing::warn!(
                worker = &*self.log.worker,
                drift = format_args!("{:.2}", drift.ratio.unwrap_or(0.0)),
                floor = self.drift_floor,
                "worker delivers far fewer cached prefix tokens than the router predicts: \
                 its engine evicted what the router remembers (KV cache smaller than \
                 the load it gets), prefix caching off or another model behind its URL, \
                 a block-size mismatch (cache.engine_block_tokens), or in precise mode a \
                 tokenizer or chat-template drift"
            );
        }
        self.log.delivered_tokens = Some(delivered);
    }
}

impl Drop for GuardedBody {
    fn drop(&mut self) {
        // Dropped before the end: the client went away mid-body (an empty body is
        // complete without a single poll), unless the stream's last event had passed.
        let got_all = self
            .tap
            .as_ref()
            .and_then(|t| t.scanner.as_ref())
            .is_some_and(UsageScanner::saw_end);
        let how = if self.inner.is_end_stream() || got_all {
            "complete"
        } else {
            "client_gone"
        };
        self.finish(None, how);
    }
}

impl GuardedBody {
    /// What each frame read from the worker tells the in-flight guard, the usage scanner
    /// and the response-cache recorder; a sized body's last frame finishes the request.
    fn note(&mut self, frame: &Frame<Bytes>) {
        self.last_frame = Instant::now();
        if frame.is_data()
            && let Some(g) = &mut self.guard
        {
            // The first byte ends the prefill reservation (once; cheap after).
            g.first_byte();
        }
        if let (Some(data), Some(tap)) = (frame.data_ref(), self.tap.as_mut()) {
            if let Some(t) = tap.log.pd.as_mut()
                && t.first_token.is_none()
            {
                let at = tap.log.arrived.elapsed();
                t.first_token = Some(at);
                tap.metrics.pd().first_token(at.as_secs_f64());
            }
            if let Some(scanner) = tap.scanner.as_mut() {
                scanner.feed_bytes(data);
            }
            if let Some(r) = tap.record.as_mut() {
                r.feed(data);
            }
        }
        if self.inner.is_end_stream() {
            // A sized body's last frame: hyper will not poll for the end.
            self.finish(None, "complete");
        }
    }
}

/// Frames gathered at most into one write to the client (the worker's connection holds
/// more already read): a bound on the write, never a wait for the worker.
const HOLD_MAX_FRAMES: usize = 64;
const HOLD_MAX_BYTES: usize = 64 * 1024;

impl Body for GuardedBody {
    type Data = Bytes;
    type Error = BoxError;

    /// Hands on every frame as soon as the worker's connection has decoded it, and gathers
    /// the frames it has already read into one write to the client: the worker's body
    /// reads its connection in this task ([`UpstreamBody`]), so it answers `Pending` only
    /// when the socket has nothing more; until then every frame decoded from bytes
    /// already read is held, then they go out together and hyper flushes once. An
    /// engine's burst of SSE events thus costs one write, not one per event (as nginx
    /// sends what one read returned), and no event ever waits for one not yet received.
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if this.releasing {
                if let Some(frame) = this.held.pop_front() {
                    this.held_bytes -= frame.data_ref().map_or(0, Bytes::len);
                    return Poll::Ready(Some(Ok(frame)));
                }
                this.releasing = false;
                match this.end.take() {
                    Some(Err(e)) if !this.error_deferred => {
                        // Let hyper flush what came before: the client sees it, then the
                        // cut.
                        this.error_deferred = true;
                        this.end = Some(Err(e));
                        this.releasing = true;
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                    Some(Ok(())) => return Poll::Ready(None),
                    None => {}
                }
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    this.note(&frame);
                    let more = frame.is_data() && !this.inner.is_end_stream();
                    if !more && this.held.is_empty() {
                        // A sized body's only frame, or trailers: nothing to gather (and
                        // no queue to allocate for a non-streamed answer).
                        return Poll::Ready(Some(Ok(frame)));
                    }
                    this.held_bytes += frame.data_ref().map_or(0, Bytes::len);
                    this.held.push_back(frame);
                    if !more
                        || this.held.len() >= HOLD_MAX_FRAMES
                        || this.held_bytes >= HOLD_MAX_BYTES
                    {
                        this.releasing = true;
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    // The worker broke the stream: the client sees what came before, then
                    // the error; the breaker sees the failure.
                    this.finish(Some(Outcome::Failure), "upstream_error");
                    this.end = Some(Err(Box::new(e)));
                    this.releasing = true;
                }
                Poll::Ready(None) => {
                    this.finish(None, "complete");
                    this.end = Some(Ok(()));
                    this.releasing = true;
                }
                Poll::Pending if !this.held.is_empty() => {
                    // Nothing more read yet: what is held goes out now.
                    this.releasing = true;
                }
                Poll::Pending => {
                    if this.guard.is_none() {
                        return Poll::Pending;
                    }
                    while this.idle.as_mut().poll(cx).is_ready() {
                        let deadline = this.last_frame + this.idle_timeout;
                        if Instant::now() >= deadline {
                            this.finish(Some(Outcome::Failure), "upstream_idle_timeout");
                            let e = IdleTimeout(this.idle_timeout);
                            return Poll::Ready(Some(Err(Box::new(e))));
                        }
                        // Frames came since it was set: wait out the rest of the gap.
                        this.idle.as_mut().reset(deadline);
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_empty() && self.end.is_none() && self.inner.is_end_stream()
    }

    /// The worker's remaining body plus the bytes held back.
    fn size_hint(&self) -> SizeHint {
        let mut hint = self.inner.size_hint();
        let held = self.held_bytes as u64;
        if held > 0 {
            match hint.exact() {
                Some(n) => hint.set_exact(n + held),
                None => {
                    let upper = hint.upper();
                    hint.set_lower(hint.lower() + held);
                    if let Some(u) = upper {
                        hint.set_upper(u + held);
                    }
                }
            }
        }
        hint
    }
}
