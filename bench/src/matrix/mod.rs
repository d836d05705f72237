//! The policy comparison: for each contender start fresh engines (and a router),
//! replay the same trace slice through it, stop everything, and tabulate.
//!
//! A contender is a router policy of ours (`cache_aware`, `round_robin`,
//! `least_load`, ...), a peer router with one of its policies (`sglang:cache_aware`:
//! sglang-router; `vllm:cache_aware`: vllm-router; both run from their PyPI
//! packages, see [`Peer`]), `direct` (client-side round robin straight to the
//! engines, no router) or `ideal` (everything straight to ONE engine whose KV cache
//! holds the whole slice: the hit rate no routing over bounded caches can beat).
//! `POLICY/N[/shared][/kill]` ([`Replicas`]) runs N replicas of our router over the
//! same engines, requests alternating between them: independent, or sharing routing
//! state through a `redis-server` started for the run (`state.redis_url`), and with
//! `kill` the last replica killed when the middle request is due (the client sends
//! what finds it gone to the next replica).
//! Every contender starts from cold caches: new `sim-engine` processes, a new
//! router process (and Redis), free ports on 127.0.0.1.
//!
//! Child processes are started and owned through [`crate::procs`]: stopped
//! explicitly on the normal and error paths, and killed on drop if the future is
//! cancelled (Ctrl-C) or panics.

//!
//! Parts: `contender` (what a column is, parsed from the command line), `routers`
//! (starting ours, the peers or nginx, and their configs), `run` (one contender from
//! cold start to teardown), `sampler` (engine queues during a replay), `probes` (what a
//! running router or engine says: decisions, fleet traffic, render support), `report`
//! (the markdown tables and the target checks), `scenario` (fleets of several models,
//! and their table).

mod contender;
mod probes;
mod report;
mod routers;
mod run;
mod sampler;
mod scenario;

pub use crate::procs::{ChildProc, EngineParams, ProcError, sibling_binary};
pub use contender::{Contender, Replicas};
pub use probes::{FleetTraffic, PdCounts, engine_itl, render_status, routing_decisions};
pub use report::{check_fleet, check_targets, render_fleet_table, render_table};
pub use routers::{
    Peer, PeerSetup, RouterKind, StartedRouter, nginx_config, policy_variant, probe_body,
    router_config, router_config_phased, start_any_router,
};
pub use run::{
    ContenderRun, MatrixConfig, MatrixError, RouterUsage, engine_names, run_contender,
    run_contender_measured, write_results,
};
pub use sampler::{QUEUE_SAMPLE_EVERY, QueueSampler};
pub use scenario::{ModelLayout, ScenarioRow, render_models_table, render_pd_table};

/// Router policies the demo compares by default, in table order.
pub const DEFAULT_POLICIES: [&str; 3] = ["cache_aware", "round_robin", "least_load"];

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Duration;

    use bytes::Bytes;

    use super::*;
    use crate::stats::{EngineLoad, QueueStats, Summary};

    #[test]
    fn contenders_parse() {
        assert_eq!(Contender::parse("direct"), Ok(Contender::Direct));
        assert_eq!(Contender::parse(" ideal "), Ok(Contender::Ideal));
        assert_eq!(
            Contender::parse("sglang:cache_aware"),
            Ok(Contender::Peer(Peer::Sglang, "cache_aware".into()))
        );
        assert_eq!(
            Contender::parse("vllm-router:round_robin"),
            Ok(Contender::Peer(Peer::Vllm, "round_robin".into()))
        );
        assert_eq!(
            Contender::parse("least_load"),
            Ok(Contender::Router("least_load".into()))
        );
        assert!(Contender::parse("nginx:x").is_err());
        assert!(Contender::parse("vllm:").is_err());
        let r = |n, shared, kill_one| {
            Ok(Contender::Replicas(Replicas {
                policy: "cache_aware".into(),
                n,
                shared,
                kill_one,
            }))
        };
        assert_eq!(Contender::parse("cache_aware/2"), r(2, false, false));
        assert_eq!(Contender::parse("cache_aware/3/shared"), r(3, true, false));
        assert_eq!(
            Contender::parse("cache_aware/2/shared/kill"),
            r(2, true, true)
        );
        assert_eq!(
            Contender::parse("cache_aware/2/shared/kill")
                .unwrap()
                .label(),
            "cache_aware ×2 shared, 1 killed halfway"
        );
        for bad in [
            "cache_aware/1",
            "cache_aware/x",
            "/2",
            "cache_aware/2/sharde",
        ] {
            assert!(Contender::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn peer_commands_carry_only_what_they_need() {
        let w = [
            "http://127.0.0.1:1".to_string(),
            "http://127.0.0.1:2".into(),
        ];
        let s = Peer::Sglang.command(Path::new("/v/bin/smg"), "cache_aware", 7, &w, Some("warn"));
        assert_eq!(
            s.args.join(" "),
            "launch --host 127.0.0.1 --port 7 --policy cache_aware --log-level warn \
             --worker-urls http://127.0.0.1:1 http://127.0.0.1:2"
        );
        let v = Peer::Vllm.command(Path::new("/v/bin/vllm-router"), "cache_aware", 7, &w, None);
        assert_eq!(
            v.args.join(" "),
            "--host 127.0.0.1 --port 7 --policy cache_aware \
             --worker-urls http://127.0.0.1:1 http://127.0.0.1:2"
        );
        let v = Peer::Vllm.command(Path::new("/v/bin/vllm-router"), "x", 7, &w, Some("warn"));
        assert!(v.args.join(" ").contains("--log-level warning"));
        assert!(v.display_line().starts_with(
            "HF_ENDPOINT=http://127.0.0.1:9 HF_HUB_OFFLINE=1 /v/bin/vllm-router --host"
        ));
    }

    #[test]
    fn table_has_the_queue_columns() {
        let mut q = QueueStats::new(&engine_names(2));
        let l = |waiting, running| {
            Some(EngineLoad {
                waiting,
                running,
                waiting_peak: None,
            })
        };
        q.record(&[l(3, 1), l(0, 0)]);
        q.record(&[l(0, 1), l(0, 1)]);
        let run = ContenderRun {
            summary: Summary {
                requests: 10,
                queue: Some(q),
                ..Summary::default()
            },
            router: None,
            how: String::new(),
            other_cpu: None,
            routers: 1,
            fleet: None,
            ttft_ms: Vec::new(),
            pd: None,
            engine_itl_ms: None,
        };
        let t = render_table(&[
            ("least_load".into(), Ok(run)),
            ("cache_aware".into(), Err("boom".into())),
        ]);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].contains("| longest queue | queued while idle |"));
        let cells = |l: &str| l.split(" | ").count();
        assert!(lines.iter().all(|l| cells(l) == cells(lines[0])), "{t}");
        assert!(lines[2].contains("| 3 | 50.0 % |"), "{t}");
    }

    #[tokio::test]
    async fn sampler_sees_a_queue_next_to_an_idle_engine() {
        use crate::engine::{self, EngineConfig};
        let slow = engine::start(EngineConfig {
            ttft_base: Duration::from_millis(300),
            itl: Duration::ZERO,
            ..EngineConfig::default()
        })
        .await
        .unwrap();
        let idle = engine::start(EngineConfig::default()).await.unwrap();
        let names = engine_names(2);
        let sampler =
            QueueSampler::start(&names, &[slow.url(), idle.url()], Duration::from_millis(10));
        let client: hyper_util::client::legacy::Client<_, http_body_util::Full<Bytes>> =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(hyper_util::client::legacy::connect::HttpConnector::new());
        let mut sent = Vec::new();
        for i in 0..3 {
            let req = hyper::Request::post(format!("{}/v1/completions", slow.url()))
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(Bytes::from(format!(
                    r#"{{"prompt": "p{i}", "max_tokens": 1}}"#
                ))))
                .unwrap();
            sent.push(tokio::spawn(client.request(req)));
        }
        for _ in 0..2000 {
            if slow.engine().stats().waiting == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let q = sampler.finish().await;
        assert!(q.samples >= 3, "{q:?}");
        assert!(q.queued_while_idle >= 1, "{q:?}");
        assert_eq!(q.peak_waiting, [2, 0], "{q:?}");
        for t in sent {
            t.abort();
        }
    }

    #[test]
    fn a_policy_variant_becomes_a_layered_config() {
        assert_eq!(
            policy_variant("cache_aware").unwrap(),
            ("cache_aware", String::new())
        );
        assert_eq!(
            policy_variant(
                "cost_aware+cache.learn_evictions=true+cache.threshold=0.5+proxy.max_retries=0"
            )
            .unwrap(),
            (
                "cost_aware",
                "cache:\n  learn_evictions: true\n  threshold: 0.5\nproxy:\n  max_retries: 0\n"
                    .into()
            )
        );
        for bad in ["p+cache", "p+cache.x", "p+.x=1", "p+cache.=1", "p+a.b.c=1"] {
            assert!(policy_variant(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn router_config_lists_workers_in_order() {
        let y = router_config(
            "round_robin",
            6700,
            &["http://127.0.0.1:1".into(), "http://127.0.0.1:2".into()],
        );
        assert_eq!(
            y,
            "policy: round_robin\nserver: { host: 127.0.0.1, port: 6700 }\nworkers:\n  \
             - url: http://127.0.0.1:1\n  - url: http://127.0.0.1:2\nlog: { level: warn }\n"
        );
    }

    #[test]
    fn nginx_config_is_a_plain_round_robin_proxy_with_keepalive_and_no_buffering() {
        let workers = ["http://127.0.0.1:1".into(), "http://127.0.0.1:2/".into()];
        let c = nginx_config(6700, &workers, Path::new("/tmp/x"), false);
        for line in [
            "worker_processes auto;",
            "daemon off;",
            "master_process on;",
            "pid /tmp/x/nginx.pid;",
            "error_log stderr warn;",
            "    access_log off;",
            "    upstream engines {\n        server 127.0.0.1:1;\n        server 127.0.0.1:2;\n        keepalive 64;",
            "        listen 127.0.0.1:6700;",
            "            proxy_pass http://engines;",
            "            proxy_http_version 1.1;",
            "            proxy_set_header Connection \"\";",
            "            proxy_buffering off;",
            "            proxy_request_buffering off;",
        ] {
            assert!(c.contains(line), "{line:?} not in:\n{c}");
        }
        assert!(!c.contains("DIR") && !c.contains("PORT") && !c.contains("SERVERS"));
        let logged = nginx_config(6700, &workers, Path::new("/tmp/x"), true);
        assert!(
            logged.contains("    access_log /tmp/x/access.log;"),
            "{logged}"
        );
    }
}
