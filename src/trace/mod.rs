//! Trace context of one request: W3C Trace Context (<https://www.w3.org/TR/trace-context/>)
//! read from the client, continued by the router's own span, and sent upstream.
//!
//! A `traceparent` header is `00-<trace-id>-<parent-id>-<flags>`: 32 and 16 lowercase hex
//! digits for the ids (never all zeros) and 2 for the flags (bit 0: sampled). A valid one
//! is continued: the router's span keeps the trace id, takes the client's span as its
//! parent and gets a fresh span id, which is what the request to the worker carries as
//! its parent-id (with the client's `tracestate` unchanged). A missing or invalid one
//! starts a new trace (random ids, sampled). This is always on and costs a parse and one
//! formatted header value per request.
//!
//! [`export`] sends one span per request to an OTLP collector when `tracing.otlp_endpoint`
//! is set. This module knows nothing of the proxy: the proxy hands it the facts.

pub mod export;

use std::fmt;

use http::header::{HeaderMap, HeaderName, HeaderValue};

/// `traceparent`: the caller's span (W3C Trace Context §3.2).
pub static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
/// `tracestate`: vendor entries that travel with `traceparent` (W3C Trace Context §3.3).
pub static TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// Length of a version-00 `traceparent`, in bytes.
const TRACEPARENT_LEN: usize = 55;
/// Flag bits the router forwards: sampled (0x01) and, from Trace Context Level 2,
/// random trace id (0x02). Others are cleared, as the spec asks of bits it does not know.
const KNOWN_FLAGS: u8 = 0x03;
/// The sampled flag.
const SAMPLED: u8 = 0x01;

/// A trace id: 16 bytes, never all zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceId([u8; 16]);

/// A span id: 8 bytes, never all zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpanId([u8; 8]);

impl TraceId {
    /// A random non-zero id.
    pub fn random() -> Self {
        loop {
            let id: u128 = rand::random();
            if id != 0 {
                return TraceId(id.to_be_bytes());
            }
        }
    }

    /// The id's bytes, most significant first (as written in hex).
    pub fn to_bytes(self) -> [u8; 16] {
        self.0
    }
}

impl SpanId {
    /// A random non-zero id.
    pub fn random() -> Self {
        loop {
            let id: u64 = rand::random();
            if id != 0 {
                return SpanId(id.to_be_bytes());
            }
        }
    }

    /// The id's bytes, most significant first (as written in hex).
    pub fn to_bytes(self) -> [u8; 8] {
        self.0
    }
}

/// Writes `bytes` as lowercase hex into `out` (twice as long).
pub(crate) fn hex_into(bytes: &[u8], out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (b, pair) in bytes.iter().zip(out.chunks_exact_mut(2)) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0x0f)];
    }
}

/// Reads lowercase hex (uppercase is invalid in `traceparent`) into `out` (half as long).
fn hex_from(text: &[u8], out: &mut [u8]) -> Option<()> {
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    if text.len() != out.len() * 2 {
        return None;
    }
    for (o, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *o = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Some(())
}

/// Formats without allocating (32 hex digits).
impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut buf = [0u8; 32];
        hex_into(&self.0, &mut buf);
        f.write_str(std::str::from_utf8(&buf).map_err(|_| fmt::Error)?)
    }
}

/// Formats without allocating (16 hex digits).
impl fmt::Display for SpanId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut buf = [0u8; 16];
        hex_into(&self.0, &mut buf);
        f.write_str(std::str::from_utf8(&buf).map_err(|_| fmt::Error)?)
    }
}

/// What a valid `traceparent` says: the caller's trace, span and flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parent {
    pub trace_id: TraceId,
    /// The caller's span: the parent of the router's.
    pub span_id: SpanId,
    /// The trace flags byte as sent (bit 0: sampled).
    pub flags: u8,
}

/// Parses a `traceparent` value; `None` when it is invalid (W3C Trace Context §3.2 and
/// §4.3): a version other than two lowercase hex digits or `ff`; for version `00`,
/// anything but exactly 55 bytes; for a later version, fewer than 55 bytes or a 56th that
/// is not `-` (its first four fields are read as version 00's, the rest ignored); ids
/// or flags not lowercase hex of their length; an all-zero trace or parent id.
pub fn parse_traceparent(v: &[u8]) -> Option<Parent> {
    if v.len() < TRACEPARENT_LEN {
        return None;
    }
    let mut version = [0u8; 1];
    hex_from(&v[0..2], &mut version)?;
    match version[0] {
        0xff => return None,
        0x00 if v.len() != TRACEPARENT_LEN => return None,
        _ if v.len() > TRACEPARENT_LEN && v[TRACEPARENT_LEN] != b'-' => return None,
        _ => {}
    }
    if v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let mut trace_id = [0u8; 16];
    let mut span_id = [0u8; 8];
    let mut flags = [0u8; 1];
    hex_from(&v[3..35], &mut trace_id)?;
    hex_from(&v[36..52], &mut span_id)?;
    hex_from(&v[53..55], &mut flags)?;
    if trace_id == [0; 16] || span_id == [0; 8] {
        return None;
    }
    Some(Parent {
        trace_id: TraceId(trace_id),
        span_id: SpanId(span_id),
        flags: flags[0],
    })
}

/// The router's span for one request: its ids, its parent (the client's span, when the
/// request carried a valid `traceparent`), and the flags it propagates. `Copy`, 40 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: TraceId,
    /// The router's span; the parent-id of the `traceparent` sent upstream.
    pub span_id: SpanId,
    /// The client's span; `None` when the router started the trace.
    pub parent: Option<SpanId>,
    /// Trace flags sent upstream: the client's (known bits only), or sampled for a new
    /// trace.
    pub flags: u8,
}

impl TraceContext {
    /// Continues the request's `traceparent` when it has exactly one valid one, else
    /// starts a new trace.
    pub fn from_headers(headers: &HeaderMap) -> Self {
        let mut all = headers.get_all(&TRACEPARENT).iter();
        match (all.next(), all.next()) {
            (Some(v), None) => {
                parse_traceparent(v.as_bytes()).map_or_else(Self::start, Self::child_of)
            }
            // Several `traceparent` headers are as good as none (§3.2: "MUST" be one).
            _ => Self::start(),
        }
    }

    /// A new trace: random trace and span ids, no parent, sampled (so an engine that
    /// traces records it, as it would a request without any `traceparent`).
    pub fn start() -> Self {
        TraceContext {
            trace_id: TraceId::random(),
            span_id: SpanId::random(),
            parent: None,
            flags: SAMPLED,
        }
    }

    /// The router's span as a child of the client's: same trace, new span id.
    pub fn child_of(parent: Parent) -> Self {
        TraceContext {
            trace_id: parent.trace_id,
            span_id: SpanId::random(),
            parent: Some(parent.span_id),
            flags: parent.flags & KNOWN_FLAGS,
        }
    }

    /// Whether the trace continues the client's (and so its `tracestate` travels on).
    pub fn is_continued(&self) -> bool {
        self.parent.is_some()
    }

    /// Whether the trace is sampled: only then is its span exported.
    pub fn is_sampled(&self) -> bool {
        self.flags & SAMPLED != 0
    }

    /// The `traceparent` to send upstream: version 00, this trace, the router's span as
    /// parent-id, the flags. Formatted on the stack; the header value is the one
    /// allocation.
    pub fn traceparent(&self) -> HeaderValue {
        let mut buf = [0u8; TRACEPARENT_LEN];
        buf[..3].copy_from_slice(b"00-");
        hex_into(&self.trace_id.0, &mut buf[3..35]);
        buf[35] = b'-';
        hex_into(&self.span_id.0, &mut buf[36..52]);
        buf[52] = b'-';
        hex_into(&[self.flags], &mut buf[53..55]);
        HeaderValue::from_bytes(&buf).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
    }

    /// Sets the request's trace headers for a worker: `traceparent` replaced by the
    /// router's; `tracestate` kept when the trace continues the client's, removed when
    /// the router started a new one (it described a trace that is not this one).
    pub fn propagate(&self, headers: &mut HeaderMap) {
        headers.insert(TRACEPARENT.clone(), self.traceparent());
        if !self.is_continued() {
            headers.remove(&TRACESTATE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn parse(s: &str) -> Option<Parent> {
        parse_traceparent(s.as_bytes())
    }

    #[test]
    fn a_valid_traceparent_is_read() {
        let p = parse(VALID).unwrap();
        assert_eq!(p.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(p.span_id.to_string(), "00f067aa0ba902b7");
        assert_eq!(p.flags, 0x01);
        let p = parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap();
        assert_eq!(p.flags, 0);
    }

    #[test]
    fn uppercase_hex_is_invalid() {
        for bad in [
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0A",
            "0A-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn all_zero_ids_are_invalid() {
        assert_eq!(
            parse("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
            None
        );
        assert_eq!(
            parse("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"),
            None
        );
    }

    #[test]
    fn wrong_lengths_and_separators_are_invalid() {
        for bad in [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7_01",
            "00-4bf92f3577b34da6a3ce929d0e0e47360-0f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902g7-01",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_future_version_is_read_leniently() {
        let p = parse("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(p.span_id.to_string(), "00f067aa0ba902b7");
        let p = parse("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09-what-comes-next")
            .unwrap();
        assert_eq!(p.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(p.flags, 0x09);
        // Still: what follows must be a new field, and `ff` is never a version.
        assert_eq!(
            parse("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x"),
            None
        );
        assert_eq!(
            parse("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            None
        );
    }

    #[test]
    fn a_continued_trace_keeps_the_trace_and_takes_a_new_span() {
        let mut h = HeaderMap::new();
        h.insert(&TRACEPARENT, HeaderValue::from_static(VALID));
        let t = TraceContext::from_headers(&h);
        assert_eq!(t.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.parent.unwrap().to_string(), "00f067aa0ba902b7");
        assert_ne!(t.span_id, t.parent.unwrap());
        assert!(t.is_sampled());
        let sent = t.traceparent();
        let back = parse_traceparent(sent.as_bytes()).unwrap();
        assert_eq!(back.trace_id, t.trace_id);
        assert_eq!(back.span_id, t.span_id);
        assert_eq!(back.flags, 0x01);
        // Unknown flag bits are not forwarded.
        let p = parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-ff").unwrap();
        assert_eq!(TraceContext::child_of(p).flags, 0x03);
    }

    #[test]
    fn none_invalid_or_several_start_a_new_sampled_trace() {
        let mut h = HeaderMap::new();
        let a = TraceContext::from_headers(&h);
        assert!(a.parent.is_none() && a.is_sampled());
        assert_ne!(a.trace_id, TraceContext::from_headers(&h).trace_id);
        h.insert(&TRACEPARENT, HeaderValue::from_static("garbage"));
        h.insert(&TRACESTATE, HeaderValue::from_static("k=v"));
        let b = TraceContext::from_headers(&h);
        assert!(b.parent.is_none());
        b.propagate(&mut h);
        assert!(
            !h.contains_key(&TRACESTATE),
            "a new trace drops the old state"
        );
        assert_eq!(
            parse_traceparent(h[&TRACEPARENT].as_bytes())
                .unwrap()
                .trace_id,
            b.trace_id
        );
        let mut two = HeaderMap::new();
        two.append(&TRACEPARENT, HeaderValue::from_static(VALID));
        two.append(&TRACEPARENT, HeaderValue::from_static(VALID));
        assert!(TraceContext::from_headers(&two).parent.is_none());
    }
}
