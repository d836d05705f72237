//! `discovery:` — where the worker list comes from besides `workers:` (see
//! `crate::discovery`).

use std::time::Duration;

use serde::Deserialize;
use serde_yaml_ng::Value;

use super::check::{Checker, ConfigError, Secs};
use super::difference::Section;

/// `discovery:` — `static` (default: only `workers:`), `dns: {…}` or `kubernetes: {…}`.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum DiscoveryConfig {
    #[default]
    Static,
    Dns(DnsDiscovery),
    Kubernetes(KubernetesDiscovery),
}

impl Section for DiscoveryConfig {
    const KEY: &'static str = "discovery";
}

/// `discovery.kubernetes:` — the ready endpoints of the EndpointSlices that match
/// `label_selector` in `namespace`, each `http://<address>:<port named port_name>`,
/// watched through the API server.
#[derive(Debug, Clone, PartialEq)]
pub struct KubernetesDiscovery {
    /// `None` = the client's default namespace (the pod's own, in-cluster).
    pub namespace: Option<String>,
    /// e.g. `kubernetes.io/service-name=vllm` or `app=vllm`.
    pub label_selector: String,
    /// The slice port to use; `None` = the slice's only (or first) port.
    pub port_name: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawKubernetes {
    namespace: Option<String>,
    label_selector: String,
    port_name: Option<String>,
}

/// `discovery.dns:` — the A/AAAA records of `name` (a headless Service), each
/// `http://<address>:<port>`, re-resolved every `interval`.
#[derive(Debug, Clone, PartialEq)]
pub struct DnsDiscovery {
    pub name: String,
    pub port: u16,
    /// Default 10 s.
    pub interval: Duration,
    /// A nameserver `ip:port` to ask; `None` = the system resolver (`/etc/resolv.conf`).
    pub resolver: Option<std::net::SocketAddr>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
struct RawDns {
    name: String,
    port: u16,
    interval_secs: Option<Secs>,
    resolver: Option<String>,
}

impl DiscoveryConfig {
    /// Reads `discovery:` (a YAML string or mapping; `None` when absent).
    pub(super) fn validate(raw: Option<Value>, ck: &Checker<'_>) -> Result<Self, ConfigError> {
        let Some(v) = raw else {
            return Ok(DiscoveryConfig::Static);
        };
        if v.as_str() == Some("static") {
            return Ok(DiscoveryConfig::Static);
        }
        let Value::Mapping(m) = &v else {
            return Err(ck.err(
                "discovery",
                "expected `static`, `dns: {name, port, interval_secs, resolver}` or `kubernetes: {namespace, label_selector, port_name}`",
            ));
        };
        if m.len() != 1 {
            return Err(ck.err(
                "discovery",
                "give exactly one source: `dns: {…}` or `kubernetes: {…}`",
            ));
        }
        let (k, body) = m.iter().next().expect("one entry");
        match k.as_str() {
            Some("dns") => {
                let d: RawDns = ck.typed("discovery.dns", body.clone())?;
                let name = d.name.trim().trim_end_matches('.').to_string();
                if name.is_empty()
                    || name.len() > 253
                    || !name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
                {
                    return Err(ck.bad(
                        "discovery.dns.name",
                        &d.name,
                        "is not a DNS name (e.g. engines.default.svc.cluster.local)",
                    ));
                }
                if d.port == 0 {
                    return Err(ck.bad("discovery.dns.port", 0, "is out of range (1 to 65535)"));
                }
                let resolver = d
                    .resolver
                    .map(|r| {
                        r.parse::<std::net::SocketAddr>().map_err(|_| {
                            ck.bad(
                                "discovery.dns.resolver",
                                &r,
                                "is not an ip:port (e.g. 10.96.0.10:53)",
                            )
                        })
                    })
                    .transpose()?;
                Ok(DiscoveryConfig::Dns(DnsDiscovery {
                    name,
                    port: d.port,
                    interval: ck.secs(
                        "discovery.dns.interval_secs",
                        d.interval_secs,
                        10.0,
                        None,
                    )?,
                    resolver,
                }))
            }
            Some("kubernetes") => {
                let k: RawKubernetes = ck.typed("discovery.kubernetes", body.clone())?;
                if k.label_selector.trim().is_empty() {
                    return Err(ck.err(
                        "discovery.kubernetes.label_selector",
                        "is empty: select the engines' EndpointSlices, e.g. kubernetes.io/service-name=vllm",
                    ));
                }
                if let Some(ns) = &k.namespace
                    && (ns.is_empty()
                        || ns.len() > 63
                        || !ns
                            .bytes()
                            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'))
                {
                    return Err(ck.bad(
                        "discovery.kubernetes.namespace",
                        ns,
                        "is not a namespace name (lowercase letters, digits, `-`)",
                    ));
                }
                Ok(DiscoveryConfig::Kubernetes(KubernetesDiscovery {
                    namespace: k.namespace,
                    label_selector: k.label_selector.trim().to_string(),
                    port_name: k.port_name.filter(|p| !p.is_empty()),
                }))
            }
            _ => Err(ck.err(
                "discovery",
                "unknown source: expected `static`, `dns: {…}` or `kubernetes: {…}`",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::config::load_text as load;

    #[test]
    fn dns_needs_no_static_workers_and_bad_values_name_their_key() {
        let c = load("discovery:\n  dns: {name: engines.default.svc.cluster.local., port: 8000}\n")
            .unwrap();
        let DiscoveryConfig::Dns(d) = c.discovery else {
            panic!("dns")
        };
        assert_eq!(d.name, "engines.default.svc.cluster.local");
        assert_eq!(
            (d.port, d.interval, d.resolver),
            (8000, Duration::from_secs(10), None)
        );
        assert!(c.workers.is_empty());
        let c = load("discovery:\n  kubernetes: {label_selector: app=vllm, port_name: http}\n")
            .unwrap();
        assert_eq!(
            c.discovery,
            DiscoveryConfig::Kubernetes(KubernetesDiscovery {
                namespace: None,
                label_selector: "app=vllm".into(),
                port_name: Some("http".into()),
            })
        );
        let c = load("discovery: static\nworkers:\n  - url: http://a:1\n").unwrap();
        assert_eq!(c.discovery, DiscoveryConfig::Static);
        assert!(load("discovery: static\n").unwrap_err().contains("workers"));
        for (section, key) in [
            ("dns: {name: \"bad name\", port: 1}", "discovery.dns.name"),
            ("dns: {name: e, port: 0}", "discovery.dns.port"),
            (
                "dns: {name: e, port: 1, resolver: dns.local}",
                "discovery.dns.resolver",
            ),
            (
                "dns: {name: e, port: 1, interval_secs: 0}",
                "discovery.dns.interval_secs",
            ),
            ("dns: {name: e}", "discovery.dns"),
            ("dns: {name: e, port: 1, every: 2}", "discovery.dns"),
            ("kubernetes: {namespace: x}", "discovery.kubernetes"),
            (
                "kubernetes: {label_selector: \" \"}",
                "discovery.kubernetes.label_selector",
            ),
            (
                "kubernetes: {label_selector: a=b, namespace: Prod}",
                "discovery.kubernetes.namespace",
            ),
            ("consul: {}", "discovery"),
            ("[1]", "discovery"),
        ] {
            let e = load(&format!("discovery:\n  {section}\n")).unwrap_err();
            assert!(e.contains(key), "{section}: {e}");
        }
    }
}
