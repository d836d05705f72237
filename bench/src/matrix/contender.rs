//! A column of the comparison: one of our policies, a peer's, `direct`, `ideal`, or
//! replicas of our router.

use super::{Peer, RouterKind, policy_variant};

/// One column of the comparison.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Contender {
    /// Our router with this `policy:` value.
    Router(String),
    /// A peer router with this `--policy` value.
    Peer(Peer, String),
    /// No router: the replayer round-robins over the engines itself.
    Direct,
    /// No router, ONE engine whose cache holds the whole slice.
    Ideal,
    /// Several replicas of our router over the same engines.
    Replicas(Replicas),
    /// Our router with this `policy:` value (and variant keys) over a disaggregated
    /// fleet: the first half of the engines `phase: prefill`, the others `phase:
    /// decode`, every engine with vLLM's NixlConnector (`pd:POLICY`).
    Pd(String),
}

/// N replicas of our router in front of the same engines, request `i` sent to replica
/// `i mod N` (`POLICY/N`, `POLICY/N/shared`, `POLICY/N/shared/kill`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replicas {
    /// Our `policy:` value.
    pub policy: String,
    /// Router processes, at least 2.
    pub n: usize,
    /// Whether they share routing state through one Redis (`state.redis_url`).
    pub shared: bool,
    /// Whether the last replica is killed (SIGKILL) when the middle request of the
    /// replay is due; the client then sends a request that found it gone, or whose
    /// stream it cut, to the next replica ([`ReplayConfig::failover`]).
    ///
    /// [`ReplayConfig::failover`]: crate::replay::ReplayConfig::failover
    pub kill_one: bool,
}

impl Replicas {
    /// Parses `POLICY/N[/shared][/kill]`.
    pub fn parse(s: &str) -> Result<Replicas, String> {
        let mut parts = s.split('/').map(str::trim);
        let policy = parts.next().unwrap_or("");
        let n = parts.next().and_then(|n| n.parse::<usize>().ok());
        let (Some(n), false) = (n.filter(|&n| n >= 2), policy.is_empty()) else {
            return Err(format!(
                "bad replicas contender {s:?}: use POLICY/N[/shared][/kill], N >= 2"
            ));
        };
        let mut r = Replicas {
            policy: policy.into(),
            n,
            shared: false,
            kill_one: false,
        };
        for flag in parts {
            match flag {
                "shared" => r.shared = true,
                "kill" => r.kill_one = true,
                _ => {
                    return Err(format!(
                        "bad replicas contender {s:?}: {flag:?} is neither `shared` nor `kill`"
                    ));
                }
            }
        }
        Ok(r)
    }
}

impl Contender {
    /// Parses one entry of a contender list: `direct`, `ideal`, `sglang:POLICY`,
    /// `vllm:POLICY`, `pd:POLICY`, or one of our policies.
    pub fn parse(s: &str) -> Result<Contender, String> {
        let s = s.trim();
        match s {
            "" => Err("empty contender".into()),
            "direct" => Ok(Contender::Direct),
            "ideal" => Ok(Contender::Ideal),
            _ if s.starts_with("pd:") => {
                let policy = &s[3..];
                policy_variant(policy)?;
                if policy.is_empty() {
                    return Err(format!("empty policy in {s:?}: use pd:POLICY"));
                }
                Ok(Contender::Pd(policy.into()))
            }
            _ => match s.split_once(':') {
                Some((peer, policy)) => match Peer::from_key(peer) {
                    Some(p) if !policy.is_empty() => Ok(Contender::Peer(p, policy.into())),
                    _ => Err(format!(
                        "unknown contender {s:?}: use sglang:POLICY or vllm:POLICY"
                    )),
                },
                None if s.contains('/') => {
                    let r = Replicas::parse(s)?;
                    policy_variant(&r.policy)?;
                    Ok(Contender::Replicas(r))
                }
                None => policy_variant(s).map(|_| Contender::Router(s.into())),
            },
        }
    }

    /// Table label: the policy name, `sglang-router POLICY`, `direct (no router)`,
    /// `ideal (1 engine, unbounded KV)`, `cache_aware ×2 shared, 1 killed halfway`,
    /// `pd:cache_aware`.
    pub fn label(&self) -> String {
        match self {
            Contender::Router(p) => p.clone(),
            Contender::Pd(p) => format!("pd:{p}"),
            Contender::Peer(peer, p) => format!("{} {p}", peer.name()),
            Contender::Direct => "direct (no router)".into(),
            Contender::Ideal => "ideal (1 engine, unbounded KV)".into(),
            Contender::Replicas(r) => format!(
                "{} ×{} {}{}",
                r.policy,
                r.n,
                if r.shared { "shared" } else { "independent" },
                if r.kill_one { ", 1 killed halfway" } else { "" }
            ),
        }
    }

    /// The router serving it and its policy (`None`: no router).
    pub fn router(&self) -> Option<(RouterKind, &str)> {
        match self {
            Contender::Router(p) | Contender::Pd(p) => Some((RouterKind::Ours, p)),
            Contender::Replicas(r) => Some((RouterKind::Ours, &r.policy)),
            Contender::Peer(peer, p) => Some((RouterKind::Peer(*peer), p)),
            Contender::Direct | Contender::Ideal => None,
        }
    }

    /// The `workers[].phase` of each of `engines` engines: half `prefill`, half
    /// `decode` for [`Contender::Pd`] (the prefill half rounded down, at least one of
    /// each), none otherwise.
    pub fn phases(&self, engines: usize) -> Vec<&'static str> {
        match self {
            Contender::Pd(_) => {
                let prefill = (engines / 2).clamp(1, engines.saturating_sub(1).max(1));
                (0..engines)
                    .map(|i| if i < prefill { "prefill" } else { "decode" })
                    .collect()
            }
            _ => Vec::new(),
        }
    }

    /// Router processes it runs (0: none).
    pub fn routers(&self) -> usize {
        match self {
            Contender::Replicas(r) => r.n,
            Contender::Router(_) | Contender::Peer(..) | Contender::Pd(_) => 1,
            Contender::Direct | Contender::Ideal => 0,
        }
    }
}
