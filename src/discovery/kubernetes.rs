//! `discovery.kubernetes`: watches the EndpointSlices that match a label selector with
//! `kube`'s watcher (list, then watch; it resumes or relists on its own after a broken
//! watch) and turns each ready endpoint address into a worker
//! `http://<address>:<port>`. The client is configured the standard way: `KUBECONFIG` or
//! `~/.kube/config`, else the pod's service account. RBAC: `get`, `list` and `watch` on
//! `endpointslices` in `discovery.k8s.io` (deploy/kubernetes/discovery-rbac.yaml).
//!
//! Readiness follows the EndpointSlice API: an endpoint whose `conditions.ready` is
//! `false` is left out (`null` means ready, as its documentation says consumers should
//! read it); a terminating one is not ready.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};

use crate::config::KubernetesDiscovery;
use crate::pools::pool::Pool;
use crate::shutdown::Shutdown;

/// Least time between two log lines about watch failures.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// The worker URLs of one slice: its ready endpoints at the port named `port_name` (or
/// its only / first port); none when the slice has no such port.
pub fn slice_urls(slice: &EndpointSlice, port_name: Option<&str>) -> BTreeSet<String> {
    let ports = slice.ports.as_deref().unwrap_or_default();
    let port = match port_name {
        Some(name) => ports.iter().find(|p| p.name.as_deref() == Some(name)),
        None => ports.first(),
    }
    .and_then(|p| p.port)
    .and_then(|p| u16::try_from(p).ok())
    .filter(|p| *p > 0);
    let Some(port) = port else {
        return BTreeSet::new();
    };
    slice
        .endpoints
        .iter()
        .filter(|e| {
            let c = e.conditions.as_ref();
            c.and_then(|c| c.ready) != Some(false) && c.and_then(|c| c.terminating) != Some(true)
        })
        .flat_map(|e| e.addresses.iter())
        .map(|a| match a.parse::<std::net::IpAddr>() {
            Ok(ip) => super::dns::url(ip, port),
            // addressType FQDN.
            Err(_) => format!("http://{a}:{port}"),
        })
        .collect()
}

/// Watches until shutdown, handing the pool the union of every matching slice's ready
/// endpoints whenever it changes.
pub async fn run(pool: Arc<Pool>, cfg: KubernetesDiscovery, mut shutdown: Shutdown) {
    let client = match Client::try_default().await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "Kubernetes discovery cannot start (no kubeconfig or service account); only the configured workers serve");
            return;
        }
    };
    let namespace = cfg
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_string());
    let api: Api<EndpointSlice> = Api::namespaced(client, &namespace);
    let events = watcher::watcher(api, watcher::Config::default().labels(&cfg.label_selector))
        .default_backoff();
    let mut events = std::pin::pin!(events);
    let port = cfg.port_name.as_deref();
    let mut slices: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut listing: Option<BTreeMap<String, BTreeSet<String>>> = None;
    let mut published: Option<BTreeSet<String>> = None;
    let log = crate::clock::LogEvery::new(LOG_EVERY);
    tracing::info!(namespace = %namespace, selector = %cfg.label_selector, "Kubernetes discovery: watching EndpointSlices");
    loop {
        let event = tokio::select! {
            _ = shutdown.wait() => return,
            e = events.next() => match e {
                Some(e) => e,
                None => return,
            },
        };
        let name = |s: &EndpointSlice| s.metadata.name.clone().unwrap_or_default();
        match event {
            Ok(Event::Init) => listing = Some(BTreeMap::new()),
            Ok(Event::InitApply(s)) => {
                if let Some(l) = listing.as_mut() {
                    l.insert(name(&s), slice_urls(&s, port));
                }
            }
            Ok(Event::InitDone) => {
                if let Some(l) = listing.take() {
                    slices = l;
                }
            }
            Ok(Event::Apply(s)) => {
                slices.insert(name(&s), slice_urls(&s, port));
            }
            Ok(Event::Delete(s)) => {
                slices.remove(&name(&s));
            }
            Err(e) => {
                if let Some(failures) = log.due() {
                    tracing::warn!(error = %e, failures, "Kubernetes discovery: watch failed; keeping the workers found before, retrying");
                }
                continue;
            }
        }
        if listing.is_some() {
            continue;
        }
        let urls: BTreeSet<String> = slices.values().flatten().cloned().collect();
        if published.as_ref() == Some(&urls) {
            continue;
        }
        super::publish(&pool, &urls, "kubernetes");
        published = Some(urls);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(json: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn ready_endpoints_at_the_named_port() {
        let s = slice(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "vllm-abc"}, "addressType": "IPv4",
            "ports": [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}],
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": true}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": false}},
                {"addresses": ["10.0.0.3"]},
                {"addresses": ["10.0.0.4"], "conditions": {"ready": true, "terminating": true}},
            ]
        }));
        let urls: Vec<String> = slice_urls(&s, Some("http")).into_iter().collect();
        assert_eq!(urls, vec!["http://10.0.0.1:8000", "http://10.0.0.3:8000"]);
        let first: Vec<String> = slice_urls(&s, None).into_iter().collect();
        assert_eq!(first[0], "http://10.0.0.1:9090");
        assert!(slice_urls(&s, Some("grpc")).is_empty());
        let v6 = slice(serde_json::json!({
            "metadata": {"name": "v6"}, "addressType": "IPv6",
            "ports": [{"port": 8000}], "endpoints": [{"addresses": ["fd00::5"]}]
        }));
        assert_eq!(
            slice_urls(&v6, None).into_iter().collect::<Vec<_>>(),
            vec!["http://[fd00::5]:8000"]
        );
    }
}
