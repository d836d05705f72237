//! Header rules of the proxy path: request ids, the router's own response headers, and
//! the worker's own URLs in response headers made relative to the router. Hop-by-hop
//! stripping and the headers a worker is sent live with the client to workers
//! ([`crate::upstream::headers`]).

use std::borrow::Cow;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use crate::config::WorkerUrl;
pub use crate::upstream::headers::{DP_RANK, REQUEST_ID, strip_hop_by_hop};

/// Response header naming the worker that served the request
/// (`proxy.add_routed_peer_header`).
pub static ROUTED_PEER: HeaderName = HeaderName::from_static("x-routed-peer");
/// The prefill worker of a disaggregated request (with `add_routed_peer_header`).
pub static ROUTED_PREFILL: HeaderName = HeaderName::from_static("x-routed-prefill");
/// The response cache's verdict on a request: `hit`, `miss` or `bypass`.
pub static X_CACHE: HeaderName = HeaderName::from_static("x-cache");

/// Longest client-supplied request id forwarded as-is, in bytes.
pub const MAX_REQUEST_ID_LEN: usize = 128;

/// The client's request id when it is usable as-is (1–128 visible ASCII characters),
/// otherwise a fresh one: oversized or control-character ids are never forwarded or
/// logged.
pub fn request_id(headers: &HeaderMap) -> HeaderValue {
    if let Some(v) = headers.get(&REQUEST_ID) {
        let b = v.as_bytes();
        if !b.is_empty() && b.len() <= MAX_REQUEST_ID_LEN && b.iter().all(|c| c.is_ascii_graphic())
        {
            return v.clone();
        }
    }
    let mut hex = [0u8; 32];
    crate::trace::hex_into(&rand::random::<[u8; 16]>(), &mut hex);
    HeaderValue::from_bytes(&hex).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

/// Response headers that carry a URL a client may follow.
const URL_HEADERS: [HeaderName; 3] = [header::LOCATION, header::CONTENT_LOCATION, header::LINK];

/// Rewrites the URLs in `Location`, `Content-Location` and `Link` that point at
/// `worker` itself into paths relative to the router, with the worker's path prefix
/// removed, as nginx's `proxy_redirect default` does: an engine's trailing-slash
/// redirect (Starlette builds it from the `Host` it received, i.e. the worker's
/// address) must not send clients around the router, or to an address they cannot
/// reach. A URL on the worker's scheme-less or either-scheme origin counts; so does an
/// absolute path under the worker's prefix. Other URLs (another host, a path of the
/// router's own) pass unchanged. Nothing is allocated unless a header needs it.
pub fn rewrite_worker_urls(headers: &mut HeaderMap, worker: &WorkerUrl) {
    for name in &URL_HEADERS {
        let Some(first) = headers.get(name) else {
            continue;
        };
        // The common case: one value, nothing to change.
        let several = headers.get_all(name).iter().nth(1).is_some();
        if !several && rewrite_value(name, first, worker).is_none() {
            continue;
        }
        let rewritten: Vec<HeaderValue> = headers
            .get_all(name)
            .iter()
            .map(|v| rewrite_value(name, v, worker).unwrap_or_else(|| v.clone()))
            .collect();
        headers.remove(name);
        for v in rewritten {
            headers.append(name.clone(), v);
        }
    }
}

/// One header value rewritten, `None` when it is unchanged (or not text).
fn rewrite_value(name: &HeaderName, v: &HeaderValue, worker: &WorkerUrl) -> Option<HeaderValue> {
    let text = v.to_str().ok()?;
    let out = if name == header::LINK {
        rewrite_link(text, worker)?
    } else {
        relative_to_router(text.trim(), worker)?.into_owned()
    };
    HeaderValue::from_str(&out).ok()
}

/// A `Link` value with every `<URI-reference>` that points at the worker rewritten;
/// `None` when none does.
fn rewrite_link(text: &str, worker: &WorkerUrl) -> Option<String> {
    let mut out = String::new();
    let mut rest = text;
    let mut changed = false;
    while let Some(open) = rest.find('<') {
        let Some(len) = rest[open + 1..].find('>') else {
            break;
        };
        let target = &rest[open + 1..open + 1 + len];
        out.push_str(&rest[..=open]);
        match relative_to_router(target.trim(), worker) {
            Some(r) => {
                changed = true;
                out.push_str(&r);
            }
            None => out.push_str(target),
        }
        out.push('>');
        rest = &rest[open + len + 2..];
    }
    out.push_str(rest);
    changed.then_some(out)
}

/// `uri` (a URI reference) as the router's client should see it, when it points at
/// the worker: `scheme://<worker authority>[<prefix>]/p?q` (either scheme, or
/// scheme-relative `//authority`) and `<prefix>/p?q` become `/p?q`. `None` when it is
/// left as it is.
fn relative_to_router<'a>(uri: &'a str, worker: &WorkerUrl) -> Option<Cow<'a, str>> {
    let (path, on_origin) = match on_worker_origin(uri, worker.authority()) {
        Some(rest) => (rest, true),
        None if uri.starts_with('/') && !uri.starts_with("//") => (uri, false),
        None => return None,
    };
    let prefix = worker.path_prefix();
    let below = (!prefix.is_empty())
        .then(|| path.strip_prefix(prefix))
        .flatten()
        .filter(|r| r.is_empty() || r.starts_with(['/', '?', '#']));
    let path = match below {
        Some(r) => r,
        None if on_origin => path,
        None => return None,
    };
    Some(if path.starts_with('/') {
        Cow::Borrowed(path)
    } else {
        // "" or a bare query or fragment: the root.
        Cow::Owned(format!("/{path}"))
    })
}

/// What follows `http(s)://<authority>` or `//<authority>` in `uri` when that is the
/// worker's authority (ASCII case ignored) and is followed by nothing, a path, a query
/// or a fragment.
fn on_worker_origin<'a>(uri: &'a str, authority: &str) -> Option<&'a str> {
    let after_scheme = ["http://", "https://", "//"].iter().find_map(|s| {
        uri.get(..s.len())
            .filter(|head| head.eq_ignore_ascii_case(s))
            .map(|_| &uri[s.len()..])
    })?;
    let host = after_scheme.get(..authority.len())?;
    let rest = &after_scheme[authority.len()..];
    (host.eq_ignore_ascii_case(authority) && (rest.is_empty() || rest.starts_with(['/', '?', '#'])))
        .then_some(rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(url: &str) -> WorkerUrl {
        WorkerUrl::parse(url).unwrap()
    }

    #[test]
    fn worker_urls_in_redirects_become_router_relative() {
        let plain = worker("http://127.0.0.1:8001");
        let prefixed = worker("http://127.0.0.1:8002/gpu5");
        let cases: [(&WorkerUrl, &str, Option<&str>); 14] = [
            (
                &plain,
                "http://127.0.0.1:8001/v1/chat/completions",
                Some("/v1/chat/completions"),
            ),
            (
                &plain,
                "HTTP://127.0.0.1:8001/v1/x?a=1#f",
                Some("/v1/x?a=1#f"),
            ),
            (&plain, "https://127.0.0.1:8001", Some("/")),
            (&plain, "//127.0.0.1:8001/v1/x", Some("/v1/x")),
            (&plain, "http://127.0.0.1:8001?q", Some("/?q")),
            // Another port, a longer authority, another host: not the worker.
            (&plain, "http://127.0.0.1:80011/v1/x", None),
            (&plain, "http://127.0.0.1:8002/v1/x", None),
            (&plain, "https://docs.example.org/help", None),
            // A path is the router's already when the worker has no prefix.
            (&plain, "/v1/chat/completions", None),
            (
                &prefixed,
                "http://127.0.0.1:8002/gpu5/v1/chat/completions",
                Some("/v1/chat/completions"),
            ),
            (&prefixed, "http://127.0.0.1:8002/gpu5", Some("/")),
            (&prefixed, "/gpu5/v1/models?x=1", Some("/v1/models?x=1")),
            // `/gpu50` is not below `/gpu5`; a relative path outside it is left alone.
            (&prefixed, "/gpu50/v1/models", None),
            (&prefixed, "http://127.0.0.1:8002/other", Some("/other")),
        ];
        for (w, from, to) in cases {
            assert_eq!(
                relative_to_router(from, w).as_deref(),
                to,
                "{from} via {}",
                w.as_str()
            );
        }
    }

    #[test]
    fn location_content_location_and_link_are_rewritten_others_kept() {
        let w = worker("http://127.0.0.1:8002/gpu5");
        let mut h = HeaderMap::new();
        h.insert(
            header::LOCATION,
            HeaderValue::from_static("http://127.0.0.1:8002/gpu5/v1/chat/completions"),
        );
        h.insert(
            header::CONTENT_LOCATION,
            HeaderValue::from_static("/gpu5/v1/responses/resp_1"),
        );
        h.append(
            header::LINK,
            HeaderValue::from_static(
                r#"<http://127.0.0.1:8002/gpu5/v1/models?page=2>; rel="next", <https://docs.example.org/a>; rel="help""#,
            ),
        );
        h.append(header::LINK, HeaderValue::from_static("</v1/x>; rel=self"));
        h.insert(
            "x-other",
            HeaderValue::from_static("http://127.0.0.1:8002/gpu5/"),
        );
        rewrite_worker_urls(&mut h, &w);
        assert_eq!(h[header::LOCATION], "/v1/chat/completions");
        assert_eq!(h[header::CONTENT_LOCATION], "/v1/responses/resp_1");
        let links: Vec<&str> = h
            .get_all(header::LINK)
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect();
        assert_eq!(
            links,
            [
                r#"</v1/models?page=2>; rel="next", <https://docs.example.org/a>; rel="help""#,
                "</v1/x>; rel=self",
            ]
        );
        assert_eq!(h["x-other"], "http://127.0.0.1:8002/gpu5/");

        // An external redirect, a bad Link: unchanged.
        let mut h = HeaderMap::new();
        h.insert(
            header::LOCATION,
            HeaderValue::from_static("https://docs.example.org/help"),
        );
        h.insert(
            header::LINK,
            HeaderValue::from_static("<http://127.0.0.1:8002/gpu5/x"),
        );
        let before = h.clone();
        rewrite_worker_urls(&mut h, &w);
        assert_eq!(h, before);
    }

    #[test]
    fn request_ids_are_kept_or_replaced() {
        let mut h = HeaderMap::new();
        h.insert(&REQUEST_ID, HeaderValue::from_static("qa-req-0001"));
        assert_eq!(request_id(&h), "qa-req-0001");
        h.insert(
            &REQUEST_ID,
            HeaderValue::from_str(&"a".repeat(10_000)).unwrap(),
        );
        let r = request_id(&h);
        assert_eq!(r.len(), 32);
        h.insert(&REQUEST_ID, HeaderValue::from_bytes(b"bad\tid").unwrap());
        assert_ne!(request_id(&h), "bad\tid");
        h.insert(&REQUEST_ID, HeaderValue::from_static("has space"));
        assert_eq!(request_id(&h).len(), 32);
        let a = request_id(&HeaderMap::new());
        let b = request_id(&HeaderMap::new());
        assert_ne!(a, b);
        assert!(
            a.to_str()
                .unwrap()
                .bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
        );
        assert_eq!(a.len(), 32);
    }
}
