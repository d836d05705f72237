//! Headers on the way to a worker: hop-by-hop stripping (RFC 9110 §7.6.1) and the
//! headers the router adds to what it forwards.

use http::header::{self, HeaderMap, HeaderName};

/// `x-request-id`, the id shared by the router's log, the worker and the client.
pub static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// Sent to a vLLM server with several data-parallel ranks to pick the rank that holds
/// the prompt's prefix (vLLM `_get_data_parallel_rank`: "router can inject it").
pub static DP_RANK: HeaderName = HeaderName::from_static("x-data-parallel-rank");

/// Hop-by-hop headers (RFC 9110 §7.6.1, plus the de-facto `Keep-Alive`,
/// `Proxy-Connection` and the proxy auth pair): they describe one connection and are
/// never forwarded.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Removes hop-by-hop headers and every header named in `Connection`. Returns whether
/// the message had `Transfer-Encoding` (so a stale `Content-Length` can be dropped).
pub fn strip_hop_by_hop(headers: &mut HeaderMap) -> bool {
    // Which of them are present, from one pass over the names (a message has a handful):
    // a `remove` hashes its name, and most messages carry none or one of the nine.
    let mut present = 0u16;
    for name in headers.keys() {
        if let Some(i) = HOP_BY_HOP.iter().position(|h| h == name) {
            present |= 1 << i;
        }
    }
    if present == 0 {
        return false;
    }
    let chunked = headers.contains_key(header::TRANSFER_ENCODING);
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.iter() {
        headers.remove(name);
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << i) != 0 {
            headers.remove(name);
        }
    }
    chunked
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn strips_hop_by_hop_and_connection_named_headers() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("connection", "keep-alive, X-Trace-Hop"),
            ("x-trace-hop", "1"),
            ("keep-alive", "timeout=2"),
            ("te", "trailers"),
            ("upgrade", "websocket"),
            ("proxy-authorization", "Basic dGVzdDp0ZXN0"),
            ("transfer-encoding", "chunked"),
            ("x-request-id", "qa-hop-1"),
            ("authorization", "Bearer k"),
        ] {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_static(v),
            );
        }
        assert!(strip_hop_by_hop(&mut h));
        let mut left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        left.sort();
        assert_eq!(left, ["authorization", "x-request-id"]);
        // None of them: nothing removed, not chunked.
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("2"));
        let before = h.clone();
        assert!(!strip_hop_by_hop(&mut h));
        assert_eq!(h, before);
        // One of them, naming another: both go, nothing else does.
        h.insert(header::CONNECTION, HeaderValue::from_static("x-hop"));
        h.insert("x-hop", HeaderValue::from_static("1"));
        assert!(!strip_hop_by_hop(&mut h));
        assert_eq!(h, before);
    }
}
