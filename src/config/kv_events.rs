//! `workers[i].kv_events:` — where a worker's engine publishes its KV-cache events
//! (precise mode), one publisher per data-parallel rank; and the checks across workers:
//! `precise_cache_aware` needs one, and no two workers dial one port.

use std::collections::HashMap;

use serde::Deserialize;

use super::check::{Checker, ConfigError};
use super::policy::PolicyKind;
use crate::redact;

/// `workers[i].kv_events:` — one vLLM KV-event publisher (spec
/// `shared/docs/vllm-kv-events.md`, sections 1–3 and 7).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvEventsConfig {
    /// The engine's PUB socket as the router dials it, `tcp://host:port` (the engine
    /// binds `tcp://*:5557`; give the address the router reaches it at).
    pub endpoint: String,
    /// Topic prefix subscribed to (the engine's `topic`; default `""` = every message).
    pub topic: String,
    /// The engine's replay ROUTER socket, `tcp://host:port`; `None` = no replay, so a
    /// sequence gap drops this worker's entries.
    pub replay_endpoint: Option<String>,
    /// Data-parallel ranks behind the worker's one HTTP endpoint (vLLM
    /// `--data-parallel-size` with its internal load balancing; default 1). Each rank
    /// publishes on its own port, `endpoint`'s plus the rank, and serves replay on
    /// `replay_endpoint`'s plus the rank (spec §1); the router follows each rank as a
    /// separate feed ([`KvEventsConfig::rank_endpoint`]).
    pub dp_size: u32,
}

/// Largest `kv_events.dp_size`.
pub const MAX_DP_SIZE: u32 = 64;

impl KvEventsConfig {
    /// Rank `rank`'s event endpoint: `endpoint` with its port plus `rank` (as vLLM
    /// offsets its per-rank publishers; rank 0 keeps the base).
    pub fn rank_endpoint(&self, rank: u32) -> String {
        offset_port(&self.endpoint, rank).unwrap_or_else(|| self.endpoint.clone())
    }

    /// Rank `rank`'s replay endpoint, offset like [`KvEventsConfig::rank_endpoint`].
    pub fn rank_replay_endpoint(&self, rank: u32) -> Option<String> {
        self.replay_endpoint
            .as_ref()
            .map(|r| offset_port(r, rank).unwrap_or_else(|| r.clone()))
    }
}

/// Host and port of a validated `tcp://host:port` endpoint.
fn host_port(endpoint: &str) -> Option<(&str, u16)> {
    let (host, port) = endpoint.strip_prefix("tcp://")?.rsplit_once(':')?;
    Some((host, port.parse().ok()?))
}

/// `endpoint` with its port plus `n`; `None` when it is not `tcp://host:port` or the
/// port would pass 65535 (validation rules both out).
fn offset_port(endpoint: &str, n: u32) -> Option<String> {
    if n == 0 {
        return Some(endpoint.to_string());
    }
    let (host, port) = host_port(endpoint)?;
    let port = u16::try_from(u32::from(port) + n).ok()?;
    Some(format!("tcp://{host}:{port}"))
}

/// Every (host, port) the router dials for `k`, all ranks: `(rank, is_replay, host, port)`.
fn kv_ports(k: &KvEventsConfig) -> Vec<(u32, bool, &str, u16)> {
    let mut out = Vec::new();
    for (replay, ep) in [
        (false, Some(&k.endpoint)),
        (true, k.replay_endpoint.as_ref()),
    ] {
        let Some((host, base)) = ep.and_then(|e| host_port(e)) else {
            continue;
        };
        for r in 0..k.dp_size {
            if let Ok(port) = u16::try_from(u32::from(base) + r) {
                out.push((r, replay, host, port));
            }
        }
    }
    out
}

/// Names one dialled port of [`kv_ports`] in an error message.
fn kv_port_name(dp_size: u32, rank: u32, replay: bool) -> String {
    let what = if replay { "replay" } else { "event" };
    if dp_size > 1 {
        format!("rank {rank} {what} endpoint")
    } else {
        format!("{what} endpoint")
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawKvEvents {
    endpoint: String,
    topic: Option<String>,
    replay_endpoint: Option<String>,
    dp_size: Option<i64>,
}

impl RawKvEvents {
    /// Checks one worker's `kv_events`; an error names the key below the worker entry.
    pub(super) fn validate(self) -> Result<KvEventsConfig, (&'static str, String)> {
        let endpoint = zmq_endpoint(&self.endpoint).map_err(|m| {
            (
                "kv_events.endpoint",
                format!("`{}`: {m}", redact::url(&self.endpoint)),
            )
        })?;
        let replay_endpoint = match self.replay_endpoint {
            None => None,
            Some(r) => Some(zmq_endpoint(&r).map_err(|m| {
                (
                    "kv_events.replay_endpoint",
                    format!("`{}`: {m}", redact::url(&r)),
                )
            })?),
        };
        if replay_endpoint.as_ref() == Some(&endpoint) {
            return Err((
                "kv_events.replay_endpoint",
                format!(
                    "`{endpoint}` is also the event endpoint; the replay socket has its own port"
                ),
            ));
        }
        let dp_size = match self.dp_size {
            None => 1,
            Some(n) if (1..=i64::from(MAX_DP_SIZE)).contains(&n) => n as u32,
            Some(n) => {
                return Err((
                    "kv_events.dp_size",
                    format!(
                        "{n} is out of range (1 to {MAX_DP_SIZE}: the engine's --data-parallel-size behind this one URL; the router opens a SUB socket, a replay socket and a task per rank, so a larger value is taken for a mistake)"
                    ),
                ));
            }
        };
        let k = KvEventsConfig {
            endpoint,
            topic: self.topic.unwrap_or_default(),
            replay_endpoint,
            dp_size,
        };
        check_rank_ports(&k)?;
        Ok(k)
    }
}

/// Checks the ports of a worker's ranks (spec §1: rank r publishes on the event port
/// plus r, replays on the replay port plus r): none past 65535, and the event range
/// apart from the replay range when both are on one host.
fn check_rank_ports(k: &KvEventsConfig) -> Result<(), (&'static str, String)> {
    let n = k.dp_size;
    for (key, ep) in [
        ("kv_events.endpoint", Some(&k.endpoint)),
        ("kv_events.replay_endpoint", k.replay_endpoint.as_ref()),
    ] {
        let Some((_, port)) = ep.and_then(|e| host_port(e)) else {
            continue;
        };
        if u32::from(port) + n - 1 > 65535 {
            return Err((
                key,
                format!(
                    "`{}`: with dp_size {n} rank {} would use port {}, past 65535",
                    ep.map_or("", |e| e.as_str()),
                    n - 1,
                    u32::from(port) + n - 1
                ),
            ));
        }
    }
    let (Some((eh, ep)), Some((rh, rp))) = (
        host_port(&k.endpoint),
        k.replay_endpoint.as_deref().and_then(host_port),
    ) else {
        return Ok(());
    };
    let (e_end, r_end) = (u32::from(ep) + n - 1, u32::from(rp) + n - 1);
    if eh == rh && u32::from(ep) <= r_end && u32::from(rp) <= e_end {
        return Err((
            "kv_events.replay_endpoint",
            format!(
                "with dp_size {n} the event ports {ep}..={e_end} and the replay ports {rp}..={r_end} of {eh} overlap (each rank offsets both by its rank); pick bases at least {n} apart, e.g. event 5557 and replay 6557"
            ),
        ));
    }
    Ok(())
}

/// Checks a ZeroMQ endpoint the router dials: `tcp://host:port` with a concrete host
/// (an IP, a bracketed IPv6 address or a DNS name) and a port from 1 to 65535. Returns
/// it trimmed. vLLM's bind forms (`tcp://*:5557`, `tcp://0.0.0.0:5557`) are refused
/// with a hint: they name the engine's side, not an address to reach it at.
fn zmq_endpoint(raw: &str) -> Result<String, String> {
    let raw = raw.trim();
    let Some(rest) = raw.strip_prefix("tcp://") else {
        return Err("expected tcp://host:port (other ZeroMQ transports are not supported)".into());
    };
    if rest.contains('@') {
        return Err("a ZeroMQ tcp endpoint has no user info (`user:password@`)".into());
    }
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| "missing `:port`".to_string())?;
    let unspecified = host
        .trim_matches(['[', ']'])
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified());
    if host == "*" || unspecified {
        return Err("that is the engine's bind address; give the address the router dials, e.g. tcp://10.0.0.7:5557".into());
    }
    if host.is_empty() {
        return Err("missing host".into());
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => return Err(format!("invalid port `{port}`")),
    }
    // Final check with the parser the event consumer connects with.
    match raw.parse::<zeromq::Endpoint>() {
        Ok(zeromq::Endpoint::Tcp(..)) => Ok(raw.to_string()),
        Ok(_) => Err("not a tcp:// endpoint".into()),
        Err(e) => Err(format!("not a ZeroMQ endpoint: {e}")),
    }
}

/// The checks of `kv_events` across workers: `precise_cache_aware` needs at least one
/// worker that publishes, and no port any rank of a worker dials (event or replay) may
/// be one another worker's rank dials (one publisher per worker and rank).
/// `kv` holds each worker's `kv_events`, in list order.
pub(super) fn check_workers<'a>(
    policy: PolicyKind,
    kv: impl Iterator<Item = Option<&'a KvEventsConfig>> + Clone,
    ck: &Checker<'_>,
) -> Result<(), ConfigError> {
    if policy == PolicyKind::PreciseCacheAware
        && kv.clone().next().is_some()
        && kv.clone().all(|k| k.is_none())
    {
        return Err(ck.err(
            "workers",
            "policy precise_cache_aware needs `kv_events: {endpoint: tcp://host:port}` on at least one worker",
        ));
    }
    let mut dialled: HashMap<(&str, u16), (usize, u32, u32, bool)> = HashMap::new();
    for (i, k) in kv.enumerate() {
        let Some(k) = k else { continue };
        for (rank, replay, host, port) in kv_ports(k) {
            if let Some(&(j, dp, r, rep)) = dialled.get(&(host, port))
                && j != i
            {
                return Err(ck.err(
                    &format!("workers[{i}].kv_events"),
                    format!(
                        "`{}`: another worker already dials tcp://{host}:{port}, this worker's {}, as workers[{j}]'s {} (one publisher per worker and rank; with dp_size n a worker dials its event and replay ports plus 0 to n-1)",
                        k.endpoint,
                        kv_port_name(k.dp_size, rank, replay),
                        kv_port_name(dp, r, rep),
                    ),
                ));
            }
            dialled.insert((host, port), (i, k.dp_size, rank, replay));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{err, load};
    use crate::config::{PolicyKind, WorkerConfig};

    #[test]
    fn kv_events_keys_are_read_with_defaults() {
        let doc = "policy: precise_cache_aware\nworkers:\n  - url: http://a:1\n    kv_events:\n      endpoint: tcp://10.0.0.7:5557\n      topic: kv-events\n      replay_endpoint: tcp://10.0.0.7:5558\n  - url: http://b:1\n";
        let c = load(&[("p.yaml", doc)]).unwrap();
        assert_eq!(c.policy, PolicyKind::PreciseCacheAware);
        let k = c.workers[0].kv_events.as_ref().unwrap();
        assert_eq!(
            (
                k.endpoint.as_str(),
                k.topic.as_str(),
                k.replay_endpoint.as_deref()
            ),
            (
                "tcp://10.0.0.7:5557",
                "kv-events",
                Some("tcp://10.0.0.7:5558")
            )
        );
        assert_eq!(c.workers[1].kv_events, None);
        // kv_events through the admin API's JSON form too.
        let w = WorkerConfig::from_json(
            br#"{"url":"http://c:1","kv_events":{"endpoint":"tcp://c:5557"}}"#,
        )
        .unwrap();
        assert_eq!(w.kv_events.unwrap().topic, "");
    }

    #[test]
    fn kv_events_errors_name_the_key() {
        let base = "workers:\n  - url: http://a:1\n";
        let e = err(&[
            ("p.yaml", "policy: precise_cache_aware\n"),
            ("w.yaml", base),
        ]);
        assert!(
            e.contains("kv_events") && e.contains("precise_cache_aware"),
            "{e}"
        );
        for (endpoint, why) in [
            ("tcp://*:5557", "bind address"),
            ("tcp://0.0.0.0:5557", "bind address"),
            ("ipc:///tmp/kv", "tcp://host:port"),
            ("tcp://h:0", "invalid port"),
            ("tcp://h", "missing `:port`"),
            ("tcp://:5557", "missing host"),
        ] {
            let doc = format!(
                "workers:\n  - url: http://a:1\n    kv_events:\n      endpoint: \"{endpoint}\"\n"
            );
            let e = err(&[("k.yaml", &doc)]);
            assert!(
                e.contains("k.yaml")
                    && e.contains("workers[0].kv_events.endpoint")
                    && e.contains(endpoint)
                    && e.contains(why),
                "{endpoint}: {e}"
            );
        }
        let dup = "workers:\n  - url: http://a:1\n    kv_events: {endpoint: \"tcp://h:1\"}\n  - url: http://b:1\n    kv_events: {endpoint: \"tcp://h:1\"}\n";
        let e = err(&[("d.yaml", dup)]);
        assert!(
            e.contains("workers[1].kv_events") && e.contains("another worker"),
            "{e}"
        );
        let same = "workers:\n  - url: http://a:1\n    kv_events: {endpoint: \"tcp://h:1\", replay_endpoint: \"tcp://h:1\"}\n";
        assert!(err(&[("s.yaml", same)]).contains("replay_endpoint"));
        let unknown =
            "workers:\n  - url: http://a:1\n    kv_events: {endpoint: \"tcp://h:1\", topik: x}\n";
        assert!(err(&[("u.yaml", unknown)]).contains("topik"));
    }

    #[test]
    fn dp_size_offsets_every_rank_and_is_checked() {
        let kv = |w: &str, fields: &str| {
            format!(
                "  - url: http://{w}:1\n    kv_events: {{endpoint: \"tcp://h:5557\", {fields}}}\n"
            )
        };
        // Default 1; a rank's ports are the bases plus the rank.
        let c = load(&[(
            "a.yaml",
            &format!(
                "workers:\n{}",
                kv("a", "replay_endpoint: \"tcp://h:6557\", dp_size: 4")
            ),
        )])
        .unwrap();
        let k = c.workers[0].kv_events.as_ref().unwrap();
        assert_eq!(k.dp_size, 4);
        assert_eq!(
            (
                k.rank_endpoint(0),
                k.rank_endpoint(3),
                k.rank_replay_endpoint(3)
            ),
            (
                "tcp://h:5557".to_string(),
                "tcp://h:5560".to_string(),
                Some("tcp://h:6560".to_string())
            )
        );
        let c = load(&[("b.yaml", &format!("workers:\n{}", kv("a", "topic: t")))]).unwrap();
        assert_eq!(c.workers[0].kv_events.as_ref().unwrap().dp_size, 1);
        let w = WorkerConfig::from_json(
            br#"{"url":"http://c:1","kv_events":{"endpoint":"tcp://c:5557","dp_size":2}}"#,
        )
        .unwrap();
        assert_eq!(w.kv_events.unwrap().rank_endpoint(1), "tcp://c:5558");

        let refused = |workers: &[String], key: &str, why: &[&str]| {
            let e = err(&[("d.yaml", &format!("workers:\n{}", workers.concat()))]);
            assert!(
                e.contains("d.yaml") && e.contains(key) && why.iter().all(|w| e.contains(w)),
                "{workers:?} gave {e}"
            );
        };
        // Range, with the reason.
        for n in ["0", "-1", "65"] {
            refused(
                &[kv("a", &format!("dp_size: {n}"))],
                "workers[0].kv_events.dp_size",
                &[n, "1 to 64", "--data-parallel-size"],
            );
        }
        // The last rank's port must exist.
        refused(
            &[
                "  - url: http://a:1\n    kv_events: {endpoint: \"tcp://h:65534\", dp_size: 3}\n"
                    .into(),
            ],
            "workers[0].kv_events.endpoint",
            &["rank 2", "65536", "65535"],
        );
        refused(
            &[kv("a", "replay_endpoint: \"tcp://h:65535\", dp_size: 2")],
            "workers[0].kv_events.replay_endpoint",
            &["65536"],
        );
        // A worker's event and replay ranges apart: vLLM's defaults 5557/5558 collide
        // from dp_size 2 on.
        refused(
            &[kv("a", "replay_endpoint: \"tcp://h:5558\", dp_size: 2")],
            "workers[0].kv_events.replay_endpoint",
            &["5557..=5558", "5558..=5559", "overlap"],
        );
        assert!(
            load(&[(
                "ok.yaml",
                &format!(
                    "workers:\n{}",
                    kv("a", "replay_endpoint: \"tcp://h:5559\", dp_size: 2")
                )
            )])
            .is_ok()
        );
        // Another worker on any rank's port: event on event, event on replay.
        let two_ranks = kv("a", "dp_size: 2");
        let on_rank_1 = "  - url: http://b:1\n    kv_events: {endpoint: \"tcp://h:5558\"}\n";
        refused(
            &[two_ranks.clone(), on_rank_1.into()],
            "workers[1].kv_events",
            &[
                "another worker",
                "tcp://h:5558",
                "workers[0]'s rank 1 event endpoint",
            ],
        );
        let replay_on_rank_1 = "  - url: http://b:1\n    kv_events: {endpoint: \"tcp://h:7000\", replay_endpoint: \"tcp://h:5558\"}\n";
        refused(
            &[two_ranks.clone(), replay_on_rank_1.into()],
            "workers[1].kv_events",
            &[
                "this worker's replay endpoint",
                "workers[0]'s rank 1 event endpoint",
            ],
        );
        let below =
            "  - url: http://b:1\n    kv_events: {endpoint: \"tcp://h:5556\", dp_size: 2}\n";
        refused(
            &[two_ranks.clone(), below.into()],
            "workers[1].kv_events",
            &[
                "this worker's rank 1 event endpoint",
                "workers[0]'s rank 0 event endpoint",
            ],
        );
        // Next to each other, or the same ports on another host, is fine.
        let after =
            "  - url: http://b:1\n    kv_events: {endpoint: \"tcp://h:5559\", dp_size: 2}\n";
        let elsewhere =
            "  - url: http://c:1\n    kv_events: {endpoint: \"tcp://g:5557\", dp_size: 2}\n";
        let c = load(&[(
            "ok.yaml",
            &format!("workers:\n{two_ranks}{after}{elsewhere}"),
        )])
        .unwrap();
        assert_eq!(c.workers.len(), 3);
    }
}
