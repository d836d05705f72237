//! `proxy.passthrough`: which paths other than the routed endpoints may reach a worker.
//!
//! Every request the router forwards carries the backend `api_key`, so an unmatched
//! path passed on blindly lets any client use that key on the engine's operator
//! endpoints (vLLM's `/collective_rpc`, `/sleep`, `/wake_up`, `/reset_prefix_cache`,
//! `/start_profile`; SGLang's `/flush_cache`, `/update_weights_from_disk`). The default
//! opens the OpenAI API (`/v1/…`) and vLLM's other client endpoints only.

/// The default prefixes: the OpenAI-style API and vLLM's client-facing extras.
pub const DEFAULT_PREFIXES: [&str; 7] = [
    "/v1/",
    "/tokenize",
    "/detokenize",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
];

/// The rule for paths that are not routed endpoints (`POST /v1/chat/completions`,
/// `/v1/completions`, `/v1/messages`, `/v1/responses`) or `GET /v1/models`, which
/// always reach a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Passthrough {
    /// Forward every path (`allow`).
    Allow,
    /// Forward none (`deny`).
    Deny,
    /// Forward paths under one of these prefixes (a list). A prefix that ends in `/`
    /// matches everything below it; one that does not matches that path and the paths
    /// below it (`/score` matches `/score` and `/score/x`, not `/scores`).
    Prefixes(Vec<String>),
}

impl Default for Passthrough {
    fn default() -> Self {
        Passthrough::Prefixes(DEFAULT_PREFIXES.iter().map(|p| p.to_string()).collect())
    }
}

impl Passthrough {
    /// Whether a request for `path` (without the query) may be forwarded. Under a list,
    /// a path with a dot segment (`/v1/../sleep`) or a percent-encoded `.` or `/`
    /// (`/v1/%2e%2e/sleep`) is never forwarded: an engine or a proxy beside it that
    /// normalises the path would otherwise reach what the list keeps closed.
    pub fn allows(&self, path: &str) -> bool {
        match self {
            Passthrough::Allow => true,
            Passthrough::Deny => false,
            Passthrough::Prefixes(list) => {
                !is_ambiguous(path)
                    && list.iter().any(|p| {
                        path.strip_prefix(p.as_str()).is_some_and(|rest| {
                            p.ends_with('/') || rest.is_empty() || rest.starts_with('/')
                        })
                    })
            }
        }
    }

    /// The rule as the config writes it, for messages.
    pub fn describe(&self) -> String {
        match self {
            Passthrough::Allow => "allow".into(),
            Passthrough::Deny => "deny".into(),
            Passthrough::Prefixes(list) => format!("[{}]", list.join(", ")),
        }
    }

    /// Reads the YAML value: `allow`, `deny` or a list of path prefixes, each starting
    /// with `/`, free of whitespace, dot segments and `%`. The error says what is wrong.
    pub fn from_yaml(v: &serde_yaml_ng::Value) -> Result<Passthrough, String> {
        use serde_yaml_ng::Value;
        match v {
            Value::String(s) if s == "allow" => Ok(Passthrough::Allow),
            Value::String(s) if s == "deny" => Ok(Passthrough::Deny),
            Value::Sequence(items) => items
                .iter()
                .map(|item| match item {
                    Value::String(p) if p.starts_with('/') && valid_prefix(p) => Ok(p.clone()),
                    Value::String(p) => Err(format!(
                        "`{p}` is not a path prefix (starts with `/`, no spaces, `%` or dot segments)"
                    )),
                    _ => Err("every entry of the list is a path prefix string such as /v1/".into()),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Passthrough::Prefixes),
            _ => Err("is not `allow`, `deny` or a list of path prefixes (e.g. [/v1/, /tokenize])".into()),
        }
    }
}

fn valid_prefix(p: &str) -> bool {
    !p.contains('%')
        && !p
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '?' || c == '#')
        && !is_ambiguous(p)
}

/// Whether a path could name something else once a server or a proxy in front of the
/// engine normalises it: a dot segment (also `..;x`, as Tomcat and Spring read it), a
/// backslash, or a percent-escape of anything but a plain visible character (`%2e`,
/// `%2f`, `%5c`, `%25` for double encoding, `%00` and other controls, `;`, and bytes
/// ≥ 0x80 such as the overlong `%c0%ae`), or a malformed escape.
fn is_ambiguous(path: &str) -> bool {
    if path.contains('\\') {
        return true;
    }
    let dot_segment = path.split('/').any(|seg| {
        let name = seg.split(';').next().unwrap_or(seg);
        name == "." || name == ".."
    });
    if dot_segment {
        return true;
    }
    let b = path.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = path
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            match hex {
                Some(c)
                    if (c == b' ' || c.is_ascii_graphic())
                        && !matches!(c, b'.' | b'/' | b'\\' | b'%' | b';') => {}
                _ => return true,
            }
            i += 3;
        } else {
            i += 1;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_opens_the_api_and_vllm_client_endpoints_only() {
        let p = Passthrough::default();
        for open in [
            "/v1/files/file-abc%20def",
            "/v1/embeddings",
            "/v1/audio/transcriptions",
            "/tokenize",
            "/detokenize",
            "/pooling",
            "/classify",
            "/score",
            "/rerank",
            "/rerank/x",
        ] {
            assert!(p.allows(open), "{open}");
        }
        for closed in [
            "/collective_rpc",
            "/sleep",
            "/wake_up",
            "/reset_prefix_cache",
            "/start_profile",
            "/flush_cache",
            "/update_weights_from_disk",
            "/scores",
            "/tokenizer_info",
            "/v1",
            "/",
            "/v1/../sleep",
            "/v1/%2e%2e/sleep",
            "/v1/%2E%2E/sleep",
            "/v1%2fsleep",
            "/v1/./x",
            "/v1/..",
            "/v1\\..\\sleep",
            "/v1/..;/collective_rpc",
            "/tokenize/..;/collective_rpc",
            "/v1/%252e%252e/collective_rpc",
            "/v1/%25%32%65%25%32%65/sleep",
            "/v1/x/..%00/sleep",
            "/v1/%c0%ae%c0%ae/sleep",
            "/v1/%zz",
            "/v1/%3b/x",
        ] {
            assert!(!p.allows(closed), "{closed}");
        }
    }

    #[test]
    fn allow_and_deny_are_absolute() {
        assert!(Passthrough::Allow.allows("/collective_rpc"));
        assert!(Passthrough::Allow.allows("/v1/../x"));
        assert!(!Passthrough::Deny.allows("/v1/embeddings"));
    }

    #[test]
    fn yaml_forms_are_read_and_bad_ones_refused() {
        let y = |s: &str| Passthrough::from_yaml(&serde_yaml_ng::from_str(s).unwrap());
        assert_eq!(y("allow"), Ok(Passthrough::Allow));
        assert_eq!(y("deny"), Ok(Passthrough::Deny));
        assert_eq!(
            y("[/v1/, /sleep]"),
            Ok(Passthrough::Prefixes(vec!["/v1/".into(), "/sleep".into()]))
        );
        assert!(y("[/sleep]").unwrap().allows("/sleep"));
        for bad in [
            "open",
            "[v1/]",
            "[\"/a b\"]",
            "[/v1/../x]",
            "[/a%2e]",
            "[1]",
            "3",
        ] {
            assert!(y(bad).is_err(), "{bad}");
        }
    }
}
