//! Reading a client's request body: bounded in bytes, in memory and in time.
//!
//! hyper hands the body over in frames that are slices of its connection read buffer;
//! a client that sends one byte per packet gets one frame per byte, each keeping a whole
//! read buffer (~8 KiB) alive. Keeping the frames (as `collect()` does) makes a body
//! hold thousands of times its size: 300 connections trickling 117 kB took 493 MB.
//! Here every frame is copied into one buffer and dropped, so a body holds about its
//! own bytes; the one exception is a body that arrives whole in its first frame, kept
//! as it came (no copy).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;

use crate::error::ProxyError;

/// The request's declared `Content-Length`, when it has a valid one.
pub fn content_length(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// Most a body whose length is declared reserves before its bytes arrive; it grows
/// from there, so a client that declares 32 MiB and sends one byte holds 16 KiB.
const FIRST_RESERVE: usize = 16 * 1024;

/// Reads `body` whole. `declared` is the request's `Content-Length`, when given.
///
/// Errors: [`ProxyError::BodyTooLarge`] when `declared` or the bytes received pass
/// `limit` (bytes; checked before reading and as the body streams, so nothing past
/// the limit is buffered); [`ProxyError::BodyTimeout`] when the whole body has not
/// arrived within `timeout` of the call (idle gaps and slow trickles alike);
/// [`ProxyError::BadBody`] when the connection fails or the framing is broken.
pub async fn read<B>(
    body: B,
    declared: Option<u64>,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, ProxyError>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<crate::error::BoxError>,
{
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ProxyError::BodyTooLarge { limit });
    }
    tokio::time::timeout(timeout, collect(body, declared, limit))
        .await
        .unwrap_or(Err(ProxyError::BodyTimeout {
            secs: timeout.as_secs_f64(),
        }))
}

async fn collect<B>(mut body: B, declared: Option<u64>, limit: usize) -> Result<Bytes, ProxyError>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<crate::error::BoxError>,
{
    let declared = declared.and_then(|n| usize::try_from(n).ok());
    let mut buf: Vec<u8> = Vec::new();
    let mut first = true;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ProxyError::BadBody(e.into()))?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers: not forwarded
        };
        if buf.len() + data.len() > limit {
            return Err(ProxyError::BodyTooLarge { limit });
        }
        if std::mem::take(&mut first) && declared == Some(data.len()) {
            return Ok(data);
        }
        if buf.capacity() - buf.len() < data.len() {
            let want = capacity_for(buf.len() + data.len(), buf.capacity(), declared, limit);
            buf.reserve_exact(want - buf.len());
        }
        buf.extend_from_slice(&data);
    }
    Ok(Bytes::from(buf))
}

/// The capacity to grow to when `need` bytes no longer fit in `cap`: doubling from
/// [`FIRST_RESERVE`] (or the declared length, if smaller), never past the declared length
/// while the body is within it, never past `limit`, never below `need`. So a body holds
/// at most about twice what actually arrived, whatever it declared, and an honest one
/// ends in a buffer of exactly its length.
fn capacity_for(need: usize, cap: usize, declared: Option<usize>, limit: usize) -> usize {
    let start = FIRST_RESERVE.min(declared.unwrap_or(FIRST_RESERVE));
    let mut target = need.max(2 * cap).max(start);
    if let Some(d) = declared
        && d >= need
    {
        target = target.min(d);
    }
    target.min(limit).max(need)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::StreamBody;
    use hyper::body::Frame;

    type Chunks = StreamBody<
        futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, std::io::Error>>>,
    >;

    fn chunks(parts: &[&[u8]]) -> Chunks {
        let frames: Vec<Result<Frame<Bytes>, std::io::Error>> = parts
            .iter()
            .map(|p| Ok(Frame::data(Bytes::copy_from_slice(p))))
            .collect();
        StreamBody::new(futures_util::stream::iter(frames))
    }

    const T: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn frames_are_joined_into_one_buffer_of_about_the_body_size() {
        let one_byte_frames: Vec<&[u8]> = std::iter::repeat_n(&b"x"[..], 1000).collect();
        let b = read(chunks(&one_byte_frames), Some(1000), 1 << 20, T)
            .await
            .unwrap();
        assert_eq!(b.len(), 1000);
        let b = read(chunks(&one_byte_frames), None, 1 << 20, T)
            .await
            .unwrap();
        assert_eq!(b, vec![b'x'; 1000]);
    }

    #[test]
    fn capacity_stays_within_twice_what_arrived() {
        // Declares 32 MiB, sends 1 byte, then 1 more.
        assert_eq!(capacity_for(1, 0, Some(32 << 20), 64 << 20), FIRST_RESERVE);
        // An honest 390-byte body trickled a byte at a time: one allocation of 390.
        assert_eq!(capacity_for(1, 0, Some(390), 1 << 20), 390);
        // Chunked, no length: doubling from FIRST_RESERVE.
        assert_eq!(capacity_for(1, 0, None, 1 << 20), FIRST_RESERVE);
        assert_eq!(
            capacity_for(FIRST_RESERVE + 1, FIRST_RESERVE, None, 1 << 20),
            2 * FIRST_RESERVE
        );
        // Near the declared length: exactly it.
        assert_eq!(
            capacity_for(600_000, 524_288, Some(1_000_000), 1 << 30),
            1_000_000
        );
        // Never past the limit, never below what is needed.
        assert_eq!(capacity_for(10, 8, None, 12), 12);
        for need in [1, 7, 100, 70_000, 5_000_000] {
            for declared in [None, Some(need), Some(need * 3), Some(64 << 20)] {
                let c = capacity_for(need, need - 1, declared, 64 << 20);
                assert!(
                    c >= need && c <= (2 * need).max(FIRST_RESERVE),
                    "{need} {declared:?}: {c}"
                );
            }
        }
    }

    #[tokio::test]
    async fn limits_are_enforced_declared_and_streamed() {
        let e = read(chunks(&[b"abc"]), Some(10), 5, T).await.unwrap_err();
        assert!(matches!(e, ProxyError::BodyTooLarge { limit: 5 }));
        let e = read(chunks(&[b"abc", b"def"]), None, 5, T)
            .await
            .unwrap_err();
        assert!(matches!(e, ProxyError::BodyTooLarge { limit: 5 }));
        assert_eq!(
            &read(chunks(&[b"abcde"]), None, 5, T).await.unwrap()[..],
            b"abcde"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stops_arriving_times_out() {
        use futures_util::StreamExt;
        let first: Result<Frame<Bytes>, std::io::Error> =
            Ok(Frame::data(Bytes::from_static(b"{\"mo")));
        let body = StreamBody::new(
            futures_util::stream::iter([first]).chain(futures_util::stream::pending()),
        );
        let started = tokio::time::Instant::now();
        let e = read(body, Some(100), 1 << 20, Duration::from_secs(30))
            .await
            .unwrap_err();
        assert!(matches!(e, ProxyError::BodyTimeout { .. }), "{e}");
        assert_eq!(started.elapsed(), Duration::from_secs(30));
    }
}
