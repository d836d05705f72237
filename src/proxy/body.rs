//! [`GuardedBody`]: the upstream response body, carrying the request's in-flight guard.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

use super::BoxError;
use crate::breaker::Outcome;
use crate::workers::InFlightGuard;

/// Streams the upstream body to the client frame by frame (no buffering) and holds the
/// [`InFlightGuard`] until the body ends, fails, or is dropped because the client left.
///
/// A gap of more than `idle_timeout` between two frames ends the body with an error (a
/// hung worker must not hold a client forever); a stream that keeps producing is never
/// cut, however long it runs.
#[derive(Debug)]
pub struct GuardedBody {
    inner: Incoming,
    guard: Option<InFlightGuard>,
    idle_timeout: Duration,
    idle: Pin<Box<Sleep>>,
}

/// The worker went silent mid-body for longer than `proxy.request_timeout_secs`.
#[derive(Debug, thiserror::Error)]
#[error("upstream body idle for more than {0:?}")]
pub struct IdleTimeout(Duration);

impl GuardedBody {
    pub fn new(inner: Incoming, guard: InFlightGuard, idle_timeout: Duration) -> Self {
        GuardedBody {
            inner,
            guard: Some(guard),
            idle_timeout,
            idle: Box::pin(tokio::time::sleep(idle_timeout)),
        }
    }

    fn finish(&mut self, outcome: Option<Outcome>) {
        if let Some(mut g) = self.guard.take()
            && let Some(o) = outcome
        {
            g.record(o);
        }
    }
}

impl Body for GuardedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let deadline = Instant::now() + this.idle_timeout;
                this.idle.as_mut().reset(deadline);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                // The worker broke the stream: the client sees the error, the breaker too.
                this.finish(Some(Outcome::Failure));
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Ready(None) => {
                this.finish(None);
                Poll::Ready(None)
            }
            Poll::Pending => {
                if this.guard.is_some() && this.idle.as_mut().poll(cx).is_ready() {
                    this.finish(Some(Outcome::Failure));
                    return Poll::Ready(Some(Err(Box::new(IdleTimeout(this.idle_timeout)))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
