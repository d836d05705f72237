//! A worker's URL (`workers[].url`, the admin API's `url`), parsed and normalised once:
//! every request's URI and `Host` header are built from its parts.

/// A worker's base URL, normalised: `scheme://authority` plus a path prefix with no
/// trailing slash (`""` when none). IPv6 hosts keep their brackets.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WorkerUrl {
    scheme: String,
    authority: String,
    path_prefix: String,
    /// `scheme://authority/prefix`, as displayed.
    full: String,
    /// The scheme and authority parsed once, and the `Host` value: every request's URI
    /// and headers take shared copies instead of parsing them again.
    uri_scheme: http::uri::Scheme,
    uri_authority: http::uri::Authority,
    host: http::HeaderValue,
}

impl WorkerUrl {
    /// Parses and normalises a worker URL. Accepts `http://` or `https://` (verified as
    /// `proxy.tls` says) `host[:port][/prefix][/]`; refuses other schemes, a missing host, an unbracketed IPv6 literal, a bad port,
    /// a query or a fragment.
    pub fn parse(raw: &str) -> Result<Self, String> {
        let raw = raw.trim();
        let (scheme, rest) = raw
            .split_once("://")
            .ok_or_else(|| "expected http(s)://host[:port][/path]".to_string())?;
        let scheme = scheme.to_ascii_lowercase();
        if scheme != "http" && scheme != "https" {
            return Err(format!(
                "scheme `{scheme}` is not supported (http:// or https://)"
            ));
        }
        if rest.contains(['?', '#']) {
            return Err("a worker URL may not carry a query or fragment".into());
        }
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.is_empty() {
            return Err("missing host".into());
        }
        if raw.contains('@') {
            return Err(
                "user info (`user:password@`) in worker URLs is not supported; use api_key".into(),
            );
        }
        let (host, port) = if let Some(inner) = authority.strip_prefix('[') {
            let end = inner
                .find(']')
                .ok_or_else(|| "unclosed `[` in IPv6 host".to_string())?;
            let host = &inner[..end];
            if host.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(format!("`{host}` is not an IPv6 address"));
            }
            let after = &inner[end + 1..];
            let port = match after {
                "" => None,
                p => Some(
                    p.strip_prefix(':')
                        .ok_or_else(|| format!("unexpected `{p}` after IPv6 host"))?,
                ),
            };
            (&authority[..end + 2], port)
        } else {
            if authority.matches(':').count() > 1 {
                return Err(
                    "an IPv6 host must be written in brackets, e.g. http://[::1]:8000".into(),
                );
            }
            match authority.split_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err("missing host".into());
        }
        if !host.starts_with('[')
            && !host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
        {
            return Err(format!("invalid host `{host}`"));
        }
        let authority = match port {
            Some(p) => {
                let n: u16 = p
                    .parse()
                    .ok()
                    .filter(|n| *n != 0)
                    .ok_or_else(|| format!("invalid port `{p}`"))?;
                format!("{}:{n}", host.to_ascii_lowercase())
            }
            None => host.to_ascii_lowercase(),
        };
        let path_prefix = path.trim_end_matches('/');
        if path_prefix.contains("//") || path_prefix.chars().any(|c| c.is_whitespace()) {
            return Err(format!("invalid path `{path}`"));
        }
        let url = WorkerUrl {
            full: format!("{scheme}://{authority}{path_prefix}"),
            uri_scheme: scheme
                .parse()
                .map_err(|e| format!("not a valid URI scheme: {e}"))?,
            uri_authority: authority
                .parse()
                .map_err(|e| format!("not a valid URI authority: {e}"))?,
            host: http::HeaderValue::from_str(&authority)
                .map_err(|e| format!("not a valid Host header: {e}"))?,
            scheme,
            authority,
            path_prefix: path_prefix.to_string(),
        };
        // Final check with the same parser the proxy uses to build request URIs.
        url.uri_for("/")
            .map_err(|e| format!("not a valid URI: {e}"))?;
        Ok(url)
    }

    /// The normalised URL, `scheme://authority[/prefix]`.
    pub fn as_str(&self) -> &str {
        &self.full
    }

    /// `host[:port]`, as sent in the `Host` header (IPv6 in brackets).
    pub fn authority(&self) -> &str {
        &self.authority
    }

    /// [`WorkerUrl::authority`] as a `Host` header value (a shared copy).
    pub fn host_header(&self) -> http::HeaderValue {
        self.host.clone()
    }

    /// The path prefix, `""` or `/something` without a trailing slash.
    pub fn path_prefix(&self) -> &str {
        &self.path_prefix
    }

    /// The upstream URI for a client `path_and_query` (which starts with `/`): the
    /// worker's prefix is put in front, the query is kept, no `//` appears.
    pub fn uri_for(&self, path_and_query: &str) -> Result<http::Uri, http::Error> {
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(self.uri_scheme.clone());
        parts.authority = Some(self.uri_authority.clone());
        parts.path_and_query = Some(self.path_for(path_and_query)?);
        Ok(http::Uri::from_parts(parts)?)
    }

    /// [`WorkerUrl::uri_for`] in origin form (path and query only), as an HTTP/1.1
    /// request line to the worker itself carries it (RFC 9112 §3.2.1).
    pub fn origin_form(&self, path_and_query: &str) -> Result<http::Uri, http::Error> {
        Ok(http::Uri::from(self.path_for(path_and_query)?))
    }

    /// The worker's URI (its prefix as the path): a connection to it is opened to the
    /// scheme, host and port.
    pub fn origin(&self) -> Result<http::Uri, http::Error> {
        self.uri_for("/")
    }

    /// The worker's prefix in front of `path_and_query`.
    fn path_for(&self, path_and_query: &str) -> Result<http::uri::PathAndQuery, http::Error> {
        Ok(if self.path_prefix.is_empty() {
            path_and_query.parse()?
        } else {
            let mut pq = String::with_capacity(self.path_prefix.len() + path_and_query.len());
            pq.push_str(&self.path_prefix);
            pq.push_str(path_and_query);
            pq.parse()?
        })
    }
}

impl std::fmt::Display for WorkerUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.full)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::testing::load;

    #[test]
    fn worker_urls_are_normalised_and_duplicates_merged() {
        let doc = "workers:\n  - url: http://127.0.0.1:18001/\n  - url: http://127.0.0.1:18001\n  - url: http://[::1]:18003\n  - url: http://[::1]:18004/\n  - url: http://127.0.0.1:18005/gpu5/\n  - url: HTTP://Example.com\n";
        let c = load(&[("w.yaml", doc)]).unwrap();
        let urls: Vec<String> = c.workers.iter().map(|w| w.url.to_string()).collect();
        assert_eq!(
            urls,
            [
                "http://127.0.0.1:18001",
                "http://[::1]:18003",
                "http://[::1]:18004",
                "http://127.0.0.1:18005/gpu5",
                "http://example.com"
            ]
        );
        assert_eq!(c.workers[1].url.authority(), "[::1]:18003");
        assert_eq!(c.workers[1].url.host_header(), "[::1]:18003");
        assert_eq!(
            c.workers[1]
                .url
                .uri_for("/v1/models?x=1")
                .unwrap()
                .to_string(),
            "http://[::1]:18003/v1/models?x=1"
        );
        assert!(
            c.workers[1].url.uri_for("/bad path").is_err(),
            "a path the URI parser refuses is an error, not a panic"
        );
        let u = &c.workers[3].url;
        assert_eq!(
            u.uri_for("/v1/chat/completions?trace=1")
                .unwrap()
                .to_string(),
            "http://127.0.0.1:18005/gpu5/v1/chat/completions?trace=1"
        );
        assert_eq!(
            c.workers[0].url.uri_for("/v1/models").unwrap().to_string(),
            "http://127.0.0.1:18001/v1/models"
        );
    }
}
