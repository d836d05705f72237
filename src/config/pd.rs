//! `pd:` — prefill/decode disaggregation (see `crate::proxy::pd`): how a pool that has
//! `workers[].phase: prefill` and `phase: decode` workers routes a request through a
//! prefill worker and then a decode worker, and when it sends one straight to a decode
//! worker instead. A pool without both kinds of worker stays aggregated whatever this
//! section says.

use serde::Deserialize;

use super::PolicyKind;
use super::check::{Checker, ConfigError, named};
use super::difference::Section;

/// `workers[].phase`: which part of a request the worker takes in a disaggregated pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Phase {
    /// Computes prompts and hands their KV cache on (vLLM's prefill instance, SGLang's
    /// `--disaggregation-mode prefill`).
    Prefill,
    /// Generates from a handed-on KV cache, or computes the prompt itself when a request
    /// skips the prefill leg.
    Decode,
    /// A whole-request worker (the default): aggregated, and on the decode side of a
    /// disaggregated pool.
    #[default]
    Both,
}

impl Phase {
    /// The name used in config and `/workers`.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
            Phase::Both => "both",
        }
    }
}

named!(Phase { "prefill" => Phase::Prefill, "decode" => Phase::Decode, "both" => Phase::Both });

/// `pd.connector`: the engines' hand-off protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Connector {
    /// vLLM (NixlConnector): the prefill leg first, its `kv_transfer_params` relayed
    /// to the decode leg.
    #[default]
    Nixl,
    /// SGLang: both legs at once, meeting on a bootstrap room.
    Sglang,
}

named!(Connector { "nixl" => Connector::Nixl, "sglang" => Connector::Sglang });

/// `pd.on_prefill_failure`: what a request whose prefill leg failed on every worker tried
/// gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnPrefillFailure {
    /// Sent to its decode worker without a hand-off: the decode worker computes the
    /// prompt itself.
    #[default]
    DecodeOnly,
    /// A 502 naming the prefill failure.
    Error,
}

named!(OnPrefillFailure { "decode_only" => OnPrefillFailure::DecodeOnly, "error" => OnPrefillFailure::Error });

/// `pd.bypass`: a request skips the prefill leg when the part of its prompt its decode
/// worker does not hold is small in both measures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bypass {
    /// Uncached prompt tokens on the chosen decode worker under which the decode worker
    /// computes the prompt itself (default 2048).
    pub uncached_tokens: u64,
    /// …and under this share of the prompt (0–1, default 0.7).
    pub uncached_ratio: f64,
}

/// `pd:` — see the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct PdConfig {
    pub connector: Connector,
    /// The prefill leg's policy (default `cache_aware`: the prefix cache lives there).
    pub prefill_policy: PolicyKind,
    /// The decode leg's policy (default `least_load`).
    pub decode_policy: PolicyKind,
    pub bypass: Bypass,
    pub on_prefill_failure: OnPrefillFailure,
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig {
            connector: Connector::Nixl,
            prefill_policy: PolicyKind::CacheAware,
            decode_policy: PolicyKind::LeastLoad,
            bypass: Bypass {
                uncached_tokens: 2048,
                uncached_ratio: 0.7,
            },
            on_prefill_failure: OnPrefillFailure::DecodeOnly,
        }
    }
}

impl Section for PdConfig {
    const KEY: &'static str = "pd";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawPd {
    connector: Option<Connector>,
    prefill_policy: Option<PolicyKind>,
    decode_policy: Option<PolicyKind>,
    bypass: Option<RawBypass>,
    on_prefill_failure: Option<OnPrefillFailure>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawBypass {
    uncached_tokens: Option<u64>,
    uncached_ratio: Option<f64>,
}

impl RawPd {
    /// Checks the section; `policy` is the top-level policy (precise mode is the whole
    /// router's, as for `models.overrides`).
    pub(super) fn validate(
        self,
        ck: &Checker<'_>,
        policy: PolicyKind,
    ) -> Result<PdConfig, ConfigError> {
        let d = PdConfig::default();
        for (key, kind) in [
            ("pd.prefill_policy", self.prefill_policy),
            ("pd.decode_policy", self.decode_policy),
        ] {
            if kind == Some(PolicyKind::PreciseCacheAware)
                && policy != PolicyKind::PreciseCacheAware
            {
                return Err(ck.bad(
                    key,
                    "precise_cache_aware",
                    "needs `policy: precise_cache_aware` (precise mode is the whole router's: the workers' KV-event feeds)",
                ));
            }
        }
        let raw = self.bypass.unwrap_or_default();
        let ratio = raw.uncached_ratio.unwrap_or(d.bypass.uncached_ratio);
        if !(0.0..=1.0).contains(&ratio) {
            return Err(ck.bad(
                "pd.bypass.uncached_ratio",
                ratio,
                "is out of range (a share of the prompt, 0 to 1; 0 never bypasses)",
            ));
        }
        Ok(PdConfig {
            connector: self.connector.unwrap_or(d.connector),
            prefill_policy: self.prefill_policy.unwrap_or(d.prefill_policy),
            decode_policy: self.decode_policy.unwrap_or(d.decode_policy),
            bypass: Bypass {
                uncached_tokens: raw.uncached_tokens.unwrap_or(d.bypass.uncached_tokens),
                uncached_ratio: ratio,
            },
            on_prefill_failure: self.on_prefill_failure.unwrap_or(d.on_prefill_failure),
        })
    }
}

/// `workers[i].bootstrap_port` only on a prefill worker (it is where SGLang's decode
/// worker meets the prefill worker's KV); the first worker that breaks this is refused.
pub(super) fn check_workers<'a>(
    workers: impl Iterator<Item = &'a super::WorkerConfig>,
    ck: &Checker<'_>,
) -> Result<(), ConfigError> {
    for (i, w) in workers.enumerate() {
        if let Some(port) = w.bootstrap_port
            && w.phase != Phase::Prefill
        {
            return Err(ck.bad(
                &format!("workers[{i}].bootstrap_port"),
                port,
                format!(
                    "is set on a `{}` worker: only a `phase: prefill` worker has a bootstrap port (SGLang's --disaggregation-bootstrap-port)",
                    w.phase.as_str()
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{ONE, err, load};

    #[test]
    fn unset_means_the_documented_defaults() {
        let c = load(&[("a.yaml", ONE)]).unwrap();
        assert_eq!(c.pd, PdConfig::default());
        assert_eq!(c.pd.prefill_policy, PolicyKind::CacheAware);
        assert_eq!(c.pd.decode_policy, PolicyKind::LeastLoad);
        assert_eq!(c.pd.bypass.uncached_tokens, 2048);
        assert_eq!(c.pd.bypass.uncached_ratio, 0.7);
        assert_eq!(c.pd.on_prefill_failure, OnPrefillFailure::DecodeOnly);
        assert_eq!(c.workers[0].phase, Phase::Both);
        assert_eq!(c.workers[0].bootstrap_port, None);
    }

    #[test]
    fn the_section_and_the_worker_keys_are_read() {
        let doc = "pd:
  connector: sglang
  prefill_policy: prefix_hash
  decode_policy: power_of_two
  bypass: {uncached_tokens: 100, uncached_ratio: 0.5}
  on_prefill_failure: error
workers:
  - {url: http://p:1, phase: prefill, bootstrap_port: 8998}
  - {url: http://d:1, phase: decode}
";
        let c = load(&[("a.yaml", doc)]).unwrap();
        assert_eq!(c.pd.connector, Connector::Sglang);
        assert_eq!(c.pd.prefill_policy, PolicyKind::PrefixHash);
        assert_eq!(c.pd.decode_policy, PolicyKind::PowerOfTwo);
        assert_eq!(c.pd.bypass.uncached_tokens, 100);
        assert_eq!(c.pd.bypass.uncached_ratio, 0.5);
        assert_eq!(c.pd.on_prefill_failure, OnPrefillFailure::Error);
        assert_eq!(c.workers[0].phase, Phase::Prefill);
        assert_eq!(c.workers[0].bootstrap_port, Some(8998));
        assert_eq!(c.workers[1].phase, Phase::Decode);
    }

    #[test]
    fn refusals_name_the_file_line_and_key() {
        for (doc, key) in [
            (
                "pd: {bypass: {uncached_ratio: 1.5}}",
                "pd.bypass.uncached_ratio",
            ),
            (
                "pd: {decode_policy: precise_cache_aware}",
                "pd.decode_policy",
            ),
            ("pd: {connector: mooncake}", "mooncake"),
            ("pd: {on_prefill_failure: retry}", "retry"),
            ("pd: {bypass: {uncached: 3}}", "uncached"),
        ] {
            let e = err(&[("a.yaml", ONE), ("b.yaml", doc)]);
            assert!(e.contains("b.yaml") && e.contains(key), "{doc}: {e}");
        }
        let e = err(&[(
            "w.yaml",
            "workers:\n  - url: http://a:1\n  - {url: http://b:1, phase: decode, bootstrap_port: 8998}\n",
        )]);
        assert!(
            e.contains("w.yaml:3") && e.contains("workers[1].bootstrap_port"),
            "{e}"
        );
        let e = err(&[("w.yaml", "workers:\n  - {url: http://a:1, phase: middle}\n")]);
        assert!(
            e.contains("workers[0].phase") && e.contains("middle"),
            "{e}"
        );
    }

    #[test]
    fn a_reload_may_change_the_phases_but_not_the_section() {
        let a = load(&[("a.yaml", ONE)]).unwrap();
        let b = load(&[
            ("a.yaml", ONE),
            ("b.yaml", "pd: {on_prefill_failure: error}"),
        ])
        .unwrap();
        assert_eq!(a.non_worker_difference(&b), Some("pd"));
        let c = load(&[(
            "a.yaml",
            "workers:\n  - {url: http://127.0.0.1:8001, phase: decode}\n",
        )])
        .unwrap();
        assert_eq!(a.non_worker_difference(&c), None);
    }
}
