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
use super::migrate::{Cause, Step, Stream};
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
    /// Flow control's count of the request's tokens (flow control on).
    pub charge: Option<crate::flow::Charge>,
}

/// Streams the upstream body to the client as it arrives (no buffering: frames already
/// read from the worker share one write, nothing waits for the worker) and holds the
/// [`InFlightGuard`] until the body ends, fails, or is dropped because the client left.
///
/// A gap of more than `idle_timeout` between two frames ends the body with an error (a
/// hung worker must not hold a client forever); a stream that keeps producing is never
/// cut, however long it runs. The timer is not moved per frame: a frame only notes its
/// time, and a timer that fires early is set again from the last frame's.
///
/// A streamed answer with a continuation plan ([`super::migrate`]) goes through its
/// relay, and when its worker breaks it (or the gap, or the worker's drain ending) the
/// body continues it on another worker: the guard then holds that worker's slot. One
/// that cannot continue ends with an error event, then the error.
#[derive(Debug)]
pub struct GuardedBody {
    /// The worker's body; `None` once a broken stream dropped it (its continuation's
    /// body takes its place when a worker takes it).
    inner: Option<UpstreamBody>,
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
    /// A streamed answer with a continuation plan (see [`super::migrate`]).
    stream: Option<Stream>,
}

/// The worker went silent mid-body for longer than `proxy.request_timeout_secs`.
#[derive(Debug, thiserror::Error)]
#[error("upstream body idle for more than {0:?}")]
pub struct IdleTimeout(Duration);

/// A stream the router ended because its worker's answer broke (`Cause`) and it could
/// not continue elsewhere.
#[derive(Debug, thiserror::Error)]
#[error("the stream broke ({0}) and was not continued")]
pub struct StreamCut(&'static str);

impl GuardedBody {
    pub fn new(
        inner: UpstreamBody,
        guard: InFlightGuard,
        idle_timeout: Duration,
        tap: BodyTap,
    ) -> Self {
        GuardedBody {
            inner: Some(inner),
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
            stream: None,
        }
    }

    /// The same body, its stream continued elsewhere or ended with an error event when
    /// it breaks, as `stream` says.
    pub fn with_stream(mut self, stream: Stream) -> Self {
        self.stream = Some(stream);
        self
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
            let mut reported = None;
            if let Some(Stream::Migrate(m)) = &self.stream {
                tap.log.continued_on = m.continued_on.clone();
                tap.log.migrations = m.continuations();
            }
            if tap.log.migrations > 0 {
                // Its usage is the last worker's: the decision's prediction was for
                // the first, so nothing is settled.
                let found = tap.scanner.take().map(UsageScanner::found);
                if let (Some(u), Some(w)) = (found.and_then(|f| f.usage), &served_by) {
                    let cached = u.cached_tokens.unwrap_or(0);
                    tap.metrics.engine_usage(w.label(), u.prompt_tokens, cached);
                }
            }
            if how == "complete"
                && let Some(found) = tap.scanner.take().map(UsageScanner::found)
            {
                let mut delivery = None;
                let mut delivered_tokens = None;
                if let Some(u) = found.usage {
                    reported = Some((u.prompt_tokens, u.completion_tokens));
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
            if let Some(c) = tap.charge.take() {
                c.settle(reported);
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
        let ended = self.inner.as_ref().is_some_and(UpstreamBody::is_end_stream);
        let how = if ended || got_all {
            "complete"
        } else {
            "client_gone"
        };
        self.finish(None, how);
    }
}

impl GuardedBody {
    /// What each frame read from the worker tells the in-flight guard (its first byte)
    /// and a disaggregated request's trail (its first token).
    fn note(&mut self, frame: &Frame<Bytes>) {
        self.last_frame = Instant::now();
        if frame.is_data()
            && let Some(g) = &mut self.guard
        {
            // The first byte ends the prefill reservation (once; cheap after).
            g.first_byte();
        }
        if frame.is_data()
            && let Some(tap) = self.tap.as_mut()
            && let Some(t) = tap.log.pd.as_mut()
            && t.first_token.is_none()
        {
            let at = tap.log.arrived.elapsed();
            t.first_token = Some(at);
            tap.metrics.pd().first_token(at.as_secs_f64());
        }
    }

    /// Bytes on their way to the client, shown to the usage scanner and the
    /// response-cache recorder.
    fn feed(&mut self, data: &Bytes) {
        if let Some(tap) = self.tap.as_mut() {
            if let Some(scanner) = tap.scanner.as_mut() {
                scanner.feed_bytes(data);
            }
            if let Some(r) = tap.record.as_mut() {
                r.feed(data);
            }
        }
    }

    /// Whether the worker's body has ended.
    fn inner_ended(&self) -> bool {
        self.inner.as_ref().is_some_and(UpstreamBody::is_end_stream)
    }

    /// One frame read from the worker: handed on now (returned), or held to go out with
    /// the next ones (see [`GuardedBody::poll_frame`]). A stream that may continue
    /// elsewhere passes it through its relay, which may hold part of it back or find
    /// that the engine broke the stream.
    fn take(&mut self, frame: Frame<Bytes>) -> Option<Frame<Bytes>> {
        self.note(&frame);
        let frame = match frame.into_data() {
            Ok(data) => match self.stream.as_mut() {
                Some(Stream::Migrate(m)) => {
                    let passed = m.pass(&data);
                    if let Some(out) = passed.out {
                        self.feed(&out);
                        self.hold(Frame::data(out));
                    }
                    if passed.broke {
                        self.broke(Cause::EngineError, Box::new(StreamCut("engine_error")));
                    }
                    return None;
                }
                watched => {
                    if let Some(Stream::Watch(w)) = watched {
                        w.note(&data);
                    }
                    self.feed(&data);
                    Frame::data(data)
                }
            },
            Err(other) => other,
        };
        if self.inner_ended() {
            // A sized body's last frame: hyper will not poll for the end.
            self.finish(None, "complete");
        }
        let more = frame.is_data() && !self.inner_ended();
        if !more && self.held.is_empty() {
            // A sized body's only frame, or trailers: nothing to gather (and no queue
            // to allocate for a non-streamed answer).
            return Some(frame);
        }
        self.hold(frame);
        if !more {
            self.releasing = true;
        }
        None
    }

    /// Holds `frame` to go out with the others read so far; past the bounds of one
    /// write they go out now.
    fn hold(&mut self, frame: Frame<Bytes>) {
        self.held_bytes += frame.data_ref().map_or(0, Bytes::len);
        self.held.push_back(frame);
        if self.held.len() >= HOLD_MAX_FRAMES || self.held_bytes >= HOLD_MAX_BYTES {
            self.releasing = true;
        }
    }

    /// The worker's answer broke (`cause`, `error`): continued elsewhere, ended by the
    /// router, or cut after the error event that says why, as the stream's plan allows.
    fn broke(&mut self, cause: Cause, error: BoxError) {
        let step = match (self.stream.as_mut(), self.guard.as_ref()) {
            (Some(Stream::Migrate(m)), Some(g)) => m.broke(cause, g.worker()),
            (Some(Stream::Watch(_)), _) if cause == Cause::Drained => Step::Keep,
            (Some(Stream::Watch(w)), _) => Step::Refused(w.refuse(cause)),
            _ => Step::Refused(Bytes::new()),
        };
        match step {
            Step::Keep => {}
            Step::Continuing => {
                // Its connection closes (the engine stops generating) and its slot frees.
                self.inner = None;
                if let Some(mut g) = self.guard.take()
                    && cause != Cause::Drained
                {
                    g.record(Outcome::Failure);
                }
            }
            Step::End(bytes) => {
                self.inner = None;
                self.feed(&bytes);
                self.hold(Frame::data(bytes));
                // The answer is whole for its client; its worker still broke.
                self.finish(Some(Outcome::Failure), "complete");
                self.end = Some(Ok(()));
                self.releasing = true;
            }
            Step::Refused(event) => {
                self.inner = None;
                if !event.is_empty() {
                    self.feed(&event);
                    self.hold(Frame::data(event));
                }
                let how = match cause {
                    Cause::IdleTimeout => "upstream_idle_timeout",
                    _ => "upstream_error",
                };
                self.finish(Some(Outcome::Failure), how);
                self.end = Some(Err(error));
                self.releasing = true;
            }
        }
    }

    /// Its worker's body ended: the answer is complete (a cut connection is an error,
    /// not an end).
    fn ended(&mut self) {
        self.finish(None, "complete");
        self.end = Some(Ok(()));
        self.releasing = true;
    }

    /// The continuation being placed, if any: `Pending` while it is; once a worker took
    /// it its body is read from then on; when none could, the stream ends with the
    /// error event.
    fn poll_continuation(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(Stream::Migrate(m)) = self.stream.as_mut() else {
            return Poll::Ready(());
        };
        if !m.is_starting() {
            return Poll::Ready(());
        }
        let cause = m.cause();
        match std::task::ready!(m.poll_resumed(cx)) {
            Ok(resumed) => {
                self.inner = Some(resumed.body);
                self.guard = Some(resumed.guard);
                self.last_frame = Instant::now();
            }
            Err(event) => {
                self.feed(&event);
                self.hold(Frame::data(event));
                let how = match cause {
                    Cause::IdleTimeout => "upstream_idle_timeout",
                    _ => "upstream_error",
                };
                self.finish(Some(Outcome::Failure), how);
                self.end = Some(Err(Box::new(StreamCut("no_worker"))));
                self.releasing = true;
            }
        }
        Poll::Ready(())
    }

    /// Nothing to read from the worker now: `Pending` until it sends, unless its drain
    /// ends (the stream continues elsewhere) or it stays silent past the idle timeout
    /// (continued elsewhere, or cut); `None` when either happened.
    fn wait(&mut self, cx: &mut Context<'_>) -> Option<Polled> {
        if self.guard.is_none() {
            return Some(Poll::Pending);
        }
        if let Some(Stream::Migrate(m)) = self.stream.as_mut()
            && m.poll_drained(cx).is_ready()
        {
            self.broke(Cause::Drained, Box::new(StreamCut("drained")));
            return None;
        }
        while self.idle.as_mut().poll(cx).is_ready() {
            let deadline = self.last_frame + self.idle_timeout;
            if Instant::now() >= deadline {
                let e = IdleTimeout(self.idle_timeout);
                self.broke(Cause::IdleTimeout, Box::new(e));
                return None;
            }
            // Frames came since it was set: wait out the rest of the gap.
            self.idle.as_mut().reset(deadline);
        }
        Some(Poll::Pending)
    }

    /// Hands on what is held, then how the body ended (`None`: nothing more to hand
    /// on; read the worker again).
    fn release(&mut self, cx: &mut Context<'_>) -> Option<Polled> {
        if let Some(frame) = self.held.pop_front() {
            self.held_bytes -= frame.data_ref().map_or(0, Bytes::len);
            return Some(Poll::Ready(Some(Ok(self.joined(frame)))));
        }
        self.releasing = false;
        match self.end.take() {
            Some(Err(e)) if !self.error_deferred => {
                // Let hyper flush what came before: the client sees it, then the cut.
                self.error_deferred = true;
                self.end = Some(Err(e));
                self.releasing = true;
                cx.waker().wake_by_ref();
                Some(Poll::Pending)
            }
            Some(Err(e)) => Some(Poll::Ready(Some(Err(e)))),
            Some(Ok(())) => Some(Poll::Ready(None)),
            None => None,
        }
    }
}

impl GuardedBody {
    /// `first` with the data frames held after it joined to it: one HTTP chunk for the
    /// client to parse, not one per SSE event (peer-overhead, 23-event streams at 64
    /// connections: +6 % streams a second, the router's CPU unchanged).
    fn joined(&mut self, first: Frame<Bytes>) -> Frame<Bytes> {
        let more = self.held.iter().take_while(|f| f.is_data()).count();
        if more == 0 {
            return first;
        }
        let first = match first.into_data() {
            Ok(data) => data,
            // Trailers go out on their own.
            Err(other) => return other,
        };
        let mut all = bytes::BytesMut::with_capacity(first.len() + self.held_bytes);
        all.extend_from_slice(&first);
        for frame in self.held.drain(..more) {
            if let Ok(data) = frame.into_data() {
                self.held_bytes -= data.len();
                all.extend_from_slice(&data);
            }
        }
        Frame::data(all.freeze())
    }
}

/// Whether the worker's connection closed before its body's end (an end of file where
/// more was due: a process killed), rather than failing otherwise.
fn closed_early(e: &hyper::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::UnexpectedEof)
        {
            return true;
        }
        source = s.source();
    }
    e.is_incomplete_message()
}

/// What one poll of the body gives hyper.
type Polled = Poll<Option<Result<Frame<Bytes>, BoxError>>>;

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
                match this.release(cx) {
                    Some(out) => return out,
                    None => continue,
                }
            }
            if this.poll_continuation(cx).is_pending() {
                return Poll::Pending;
            }
            if this.releasing {
                continue;
            }
            let Some(inner) = this.inner.as_mut() else {
                return Poll::Ready(None);
            };
            match Pin::new(inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(now) = this.take(frame) {
                        return Poll::Ready(Some(Ok(now)));
                    }
                }
                // The worker broke the stream: continued elsewhere, or the client sees
                // what came before, then the error; the breaker sees the failure.
                Poll::Ready(Some(Err(e))) => {
                    let cause = if closed_early(&e) {
                        Cause::Closed
                    } else {
                        Cause::Reset
                    };
                    this.broke(cause, Box::new(e));
                }
                Poll::Ready(None) => this.ended(),
                Poll::Pending if !this.held.is_empty() => {
                    // Nothing more read yet: what is held goes out now.
                    this.releasing = true;
                }
                Poll::Pending => {
                    if let Some(out) = this.wait(cx) {
                        return out;
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_empty() && self.end.is_none() && self.inner_ended()
    }

    /// The worker's remaining body plus the bytes held back.
    fn size_hint(&self) -> SizeHint {
        let Some(inner) = &self.inner else {
            return SizeHint::default();
        };
        let mut hint = inner.size_hint();
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
