//! [`GuardedBody`]: the upstream response body, carrying the request's in-flight guard.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

use crate::workers::InFlightGuard;

/// Streams the upstream body to the client frame by frame (no buffering) and holds the
/// [`InFlightGuard`] until the body ends, fails, or is dropped because the client left.
#[derive(Debug)]
pub struct GuardedBody {
    inner: Incoming,
    guard: Option<InFlightGuard>,
}

impl GuardedBody {
    pub fn new(inner: Incoming, guard: InFlightGuard) -> Self {
        GuardedBody {
            inner,
            guard: Some(guard),
        }
    }
}

impl Body for GuardedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => {
                // Finished or failed: the worker is no longer busy with this request.
                self.guard = None;
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
