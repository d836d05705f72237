//! `proxy.passthrough`: which paths other than the routed endpoints may reach a worker.
//!
//! Every request the router forwards carries the backend `api_key`, so an unmatched
//! path passed on blindly lets any client use that key on the engine's operator
//! endpoints (vLLM's `/collective_rpc`, `/sleep`, `/v1/load_lora_adapter`,
//! `/v1/admin/…`; SGLang's `/flush_cache`, `/update_weights_from_disk`). The default
//! opens the OpenAI API (`/v1/…`) and vLLM's other client endpoints only, and an
//! operator endpoint stays closed under any prefix (vLLM serves some below `/v1/`)
//! until the list names it ([`OPERATOR_ENDPOINTS`]).

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

/// Engine operator endpoints (vLLM and SGLang): they load or drop adapters and
/// weights, pause, sleep, reset caches, profile or reconfigure the engine for every
/// client. Each is the first segment of a path, after an optional `/v1` (vLLM serves
/// `/v1/load_lora_adapter`, SGLang `/load_lora_adapter`), and covers the paths below
/// it (`/v1/admin/drain`); a trailing `*` matches names that start with it. Compared
/// after percent-decoding (the engine's server decodes `%5f` to `_` before routing),
/// ignoring empty segments and ASCII case.
pub const OPERATOR_ENDPOINTS: [&str; 47] = [
    // vLLM
    "load_lora_adapter",
    "unload_lora_adapter",
    "admin",
    "runtime_config",
    "collective_rpc",
    "sleep",
    "wake_up",
    "reset_prefix_cache",
    "reset_mm_cache",
    "reset_encoder_cache",
    "start_profile",
    "stop_profile",
    "scale_elastic_ep",
    "flash_epscale",
    "pause",
    "resume",
    "suspend",
    "abort_requests",
    "init_weight_transfer_engine",
    "start_weight_update",
    "start_draft_weight_update",
    "update_weights*",
    "finish_weight_update",
    "update_weight_version",
    "weight_checker",
    "drop_peer",
    "fault_tolerance",
    "trimtab",
    "server_info",
    // SGLang
    "flush_cache",
    "init_weights_update_group",
    "destroy_weights_update_group",
    "init_weights_send_group_for_remote_instance",
    "send_weights_to_remote_instance",
    "get_weights_by_name",
    "release_memory_occupation",
    "resume_memory_occupation",
    "start_expert_distribution_record",
    "stop_expert_distribution_record",
    "dump_expert_distribution_record",
    "abort_request",
    "pause_generation",
    "continue_generation",
    "set_internal_state",
    "configure_logging",
    "slow_down",
    "freeze_gc",
];

/// What the rule says of one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Forwarded.
    Open,
    /// Closed: no entry of the rule opens it (or the rule is `deny`, or the path is
    /// ambiguous).
    NotListed,
    /// Closed: an engine operator endpoint (`config::passthrough::OPERATOR_ENDPOINTS`)
    /// that no entry names.
    Operator,
}

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
    /// Whether a request for `path` (without the query) may be forwarded: see
    /// [`Passthrough::verdict`].
    pub fn allows(&self, path: &str) -> bool {
        self.verdict(path) == Verdict::Open
    }

    /// What the rule says of a request for `path` (without the query). `allow` and
    /// `deny` are absolute. Under a list, a path with a dot segment (`/v1/../sleep`) or
    /// a percent-encoded `.` or `/` (`/v1/%2e%2e/sleep`) is never forwarded: an engine
    /// or a proxy beside it that normalises the path would otherwise reach what the
    /// list keeps closed. An operator endpoint is forwarded only when an entry that is
    /// itself an operator path opens it (`/v1/load_lora_adapter`, `/v1/admin/`), never
    /// by a broader prefix such as `/v1/`.
    pub fn verdict(&self, path: &str) -> Verdict {
        match self {
            Passthrough::Allow => Verdict::Open,
            Passthrough::Deny => Verdict::NotListed,
            Passthrough::Prefixes(_) if is_ambiguous(path) => Verdict::NotListed,
            Passthrough::Prefixes(list) => {
                let opens = |p: &&String| {
                    path.strip_prefix(p.as_str()).is_some_and(|rest| {
                        p.ends_with('/') || rest.is_empty() || rest.starts_with('/')
                    })
                };
                if is_operator(path) {
                    if list.iter().filter(opens).any(|p| is_operator(p)) {
                        Verdict::Open
                    } else {
                        Verdict::Operator
                    }
                } else if list.iter().any(|p| opens(&p)) {
                    Verdict::Open
                } else {
                    Verdict::NotListed
                }
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

/// Whether `path` (not ambiguous, see [`is_ambiguous`]) names an engine operator
/// endpoint: its first non-empty segment, after an optional `v1`, percent-decoded and
/// without `;` parameters, is one of [`OPERATOR_ENDPOINTS`] (ASCII case ignored).
fn is_operator(path: &str) -> bool {
    let decoded = percent_decoded(path);
    let mut segments = decoded
        .split(|&b| b == b'/')
        .map(|seg| seg.split(|&b| b == b';').next().unwrap_or(seg))
        .filter(|seg| !seg.is_empty());
    let mut first = segments.next();
    if first.is_some_and(|s| s.eq_ignore_ascii_case(b"v1")) {
        first = segments.next();
    }
    let Some(name) = first else {
        return false;
    };
    OPERATOR_ENDPOINTS
        .iter()
        .any(|op| match op.strip_suffix('*') {
            Some(stem) => name
                .get(..stem.len())
                .is_some_and(|head| head.eq_ignore_ascii_case(stem.as_bytes())),
            None => name.eq_ignore_ascii_case(op.as_bytes()),
        })
}

/// `path` with its `%XX` escapes decoded (a malformed one is kept as written).
fn percent_decoded(path: &str) -> std::borrow::Cow<'_, [u8]> {
    if !path.contains('%') {
        return std::borrow::Cow::Borrowed(path.as_bytes());
    }
    let b = path.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = (b[i] == b'%')
            .then(|| path.get(i + 1..i + 3))
            .flatten()
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex {
            Some(c) => {
                out.push(c);
                i += 3;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    std::borrow::Cow::Owned(out)
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

    // Issue 38: operator endpoints under an open prefix.
    #[test]
    fn operator_endpoints_stay_closed_under_any_prefix_until_listed() {
        let p = Passthrough::default();
        for closed in [
            "/v1/load_lora_adapter",
            "/v1/unload_lora_adapter",
            "/v1/admin/drain",
            "/v1/admin/resume",
            "/v1/runtime_config",
            "/v1//load_lora_adapter/",
            "/v1/load%5flora_adapter",
            "/v1/Load_LoRA_Adapter",
            "/v1/load_lora_adapter;x",
            "/v1/sleep",
            "/v1/update_weights_from_disk",
        ] {
            assert_eq!(p.verdict(closed), Verdict::Operator, "{closed}");
        }
        // Operator endpoints outside every prefix say why too.
        assert_eq!(p.verdict("/sleep"), Verdict::Operator);
        assert_eq!(p.verdict("/scores"), Verdict::NotListed);
        // Client endpoints that merely end in an operator word stay open.
        for open in [
            "/v1/fine_tuning/jobs/ft-1/pause",
            "/v1/models/sleep",
            "/v1/files/resume",
        ] {
            assert_eq!(p.verdict(open), Verdict::Open, "{open}");
        }
        // A root prefix opens everything but operator endpoints.
        let root = Passthrough::Prefixes(vec!["/".into()]);
        assert!(root.allows("/health_generate"));
        for closed in [
            "/load_lora_adapter",
            "/flush_cache",
            "/update_weights_from_tensor",
        ] {
            assert_eq!(root.verdict(closed), Verdict::Operator, "{closed}");
        }
        // Listing the path (or an operator subtree) opens it, and only it.
        let listed = Passthrough::Prefixes(vec![
            "/v1/".into(),
            "/v1/load_lora_adapter".into(),
            "/v1/admin/".into(),
        ]);
        assert!(listed.allows("/v1/load_lora_adapter"));
        assert!(listed.allows("/v1/admin/drain"));
        assert_eq!(listed.verdict("/v1/unload_lora_adapter"), Verdict::Operator);
        assert_eq!(listed.verdict("/v1/load%5flora_adapter"), Verdict::Operator);
        assert!(Passthrough::Allow.allows("/v1/load_lora_adapter"));
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
