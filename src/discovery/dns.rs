//! `discovery.dns`: re-resolves a name's A and AAAA records with `hickory-resolver`
//! (the system's resolver configuration, or the nameserver `resolver` names) and turns
//! each address into a worker `http://<address>:<port>`.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use hickory_resolver::config::{LookupIpStrategy, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::{Resolver, TokioResolver};

use super::Found;
use crate::config::DnsDiscovery;
use crate::pools::pool::Pool;
use crate::shutdown::Shutdown;

/// The resolver `cfg` asks: its `resolver` nameserver (UDP, then TCP), else the system's.
/// No answer cache: every round asks again.
pub fn resolver(cfg: &DnsDiscovery) -> Result<TokioResolver, String> {
    let mut builder = match cfg.resolver {
        Some(addr) => {
            let mut ns = NameServerConfig::udp_and_tcp(addr.ip());
            for c in &mut ns.connections {
                c.port = addr.port();
            }
            Resolver::builder_with_config(
                ResolverConfig::from_name_servers(vec![ns]),
                TokioRuntimeProvider::default(),
            )
        }
        None => Resolver::builder_tokio().map_err(|e| format!("system resolver: {e}"))?,
    };
    let opts = builder.options_mut();
    opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    opts.cache_size = 0;
    opts.timeout = cfg.interval.min(std::time::Duration::from_secs(5));
    opts.attempts = 2;
    builder.build().map_err(|e| e.to_string())
}

/// The worker URL of one address.
pub fn url(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(a) => format!("http://{a}:{port}"),
        IpAddr::V6(a) => format!("http://[{a}]:{port}"),
    }
}

/// Resolves `cfg.name` every `cfg.interval` until shutdown and hands the pool each
/// change. The first lookup runs at once.
pub async fn run(pool: Arc<Pool>, cfg: DnsDiscovery, mut shutdown: Shutdown) {
    let resolver = match resolver(&cfg) {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, name = %cfg.name, "DNS discovery cannot start; only the configured workers serve");
            return;
        }
    };
    // A fully qualified name: no search domains appended.
    let fqdn = format!("{}.", cfg.name);
    let mut found = Found::default();
    let mut failing = false;
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.wait() => return,
            _ = tick.tick() => {}
        }
        let seen: BTreeSet<String> = match resolver.lookup_ip(fqdn.as_str()).await {
            Ok(l) => l.iter().map(|ip| url(ip, cfg.port)).collect(),
            Err(e) => {
                if !failing {
                    tracing::warn!(name = %cfg.name, error = %e, "DNS discovery lookup failed; keeping the workers found before");
                }
                failing = true;
                continue;
            }
        };
        if failing {
            tracing::info!(name = %cfg.name, "DNS discovery lookups answer again");
            failing = false;
        }
        let Some(urls) = found.update(&seen) else {
            continue;
        };
        super::publish(&pool, &urls, "dns");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_bracket_ipv6() {
        assert_eq!(
            url("10.1.2.3".parse().unwrap(), 8000),
            "http://10.1.2.3:8000"
        );
        assert_eq!(url("fd00::1".parse().unwrap(), 80), "http://[fd00::1]:80");
    }
}
