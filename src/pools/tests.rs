use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;

use super::pool::models::{Served, after_read};
use super::*;
use crate::config::{AliasTarget, WorkerConfig};

/// A worker's port (its identity in these tests).
fn port(w: &Worker) -> u16 {
    w.url()
        .authority()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0)
}

/// A worker entry on a closed port; `pinned` its `models`.
fn worker(port: u16, pinned: Option<&[&str]>) -> WorkerConfig {
    let models = pinned.map_or(String::new(), |m| format!(r#","models":{m:?}"#));
    let json = format!(r#"{{"url":"http://127.0.0.1:{port}"{models}}}"#);
    WorkerConfig::from_json(json.as_bytes()).unwrap()
}

/// A vLLM-shaped list: `(id, root, parent)`.
fn list(entries: &[(&str, &str, Option<&str>)]) -> Served {
    let data: Vec<serde_json::Value> = entries
        .iter()
        .map(|(id, root, parent)| serde_json::json!({"id": id, "object": "model", "root": root, "parent": parent}))
        .collect();
    let body = serde_json::json!({"object": "list", "data": data}).to_string();
    after_read(
        &Served::initial(None),
        Ok((http::StatusCode::OK, Bytes::from(body))),
    )
}

/// A table over `workers`, each pool's policy its name (and how many were made).
fn table(
    workers: &[WorkerConfig],
    models: &ModelsConfig,
) -> (Arc<Pools<Arc<str>>>, Arc<AtomicUsize>) {
    let pool = Arc::new(Pool::new(workers, &Default::default()));
    let made = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&made);
    let pools = Pools::new(pool, models, move |name: &str, _leg| {
        counted.fetch_add(1, Ordering::Relaxed);
        Arc::from(name)
    });
    (pools, made)
}

/// Keys of the workers `model` routes to, and its pool's name.
fn routes(pools: &Pools<Arc<str>>, model: Option<&str>) -> Result<(String, Vec<u16>), RouteError> {
    let t = pools.table();
    let r = t.route(model)?;
    let ports = r.set.workers().iter().map(|w| port(w)).collect();
    Ok((r.pool.name().to_string(), ports))
}

#[test]
fn without_lists_one_pool_serves_every_model_over_every_worker() {
    let (pools, made) = table(
        &[worker(1, None), worker(2, None)],
        &ModelsConfig::default(),
    );
    for model in [None, Some("llama"), Some("")] {
        assert_eq!(
            routes(&pools, model).unwrap(),
            (DEFAULT_POOL.to_string(), vec![1, 2])
        );
    }
    assert_eq!(made.load(Ordering::Relaxed), 1, "the default pool only");
    let t = pools.table();
    assert!(
        Arc::ptr_eq(t.route(Some("x")).unwrap().set, t.set()),
        "the one set, shared"
    );
}

#[test]
fn each_model_routes_in_its_own_pool_and_a_shared_worker_is_one_engine() {
    let (pools, made) = table(
        &[
            worker(1, Some(&["a"])),
            worker(2, Some(&["a", "b"])),
            worker(3, Some(&["b"])),
        ],
        &ModelsConfig::default(),
    );
    assert_eq!(routes(&pools, Some("a")).unwrap(), ("a".into(), vec![1, 2]));
    assert_eq!(routes(&pools, Some("b")).unwrap(), ("b".into(), vec![2, 3]));
    assert_eq!(made.load(Ordering::Relaxed), 2, "default (a shares it), b");
    let t = pools.table();
    let (a, b) = (t.route(Some("a")).unwrap(), t.route(Some("b")).unwrap());
    let shared = |s: &WorkerSet| Arc::clone(s.workers().iter().find(|w| port(w) == 2).unwrap());
    assert!(
        Arc::ptr_eq(&shared(a.set), &shared(b.set)),
        "one Worker: one in-flight count"
    );
    assert_eq!(
        routes(&pools, Some("c")).unwrap_err(),
        RouteError::UnknownModel("c".into()),
        "never another model's worker"
    );
    match routes(&pools, None).unwrap_err() {
        RouteError::NoModel { choices } => assert_eq!(choices, [Arc::from("a"), Arc::from("b")]),
        e => panic!("{e:?}"),
    }
}

#[test]
fn aliases_of_one_root_share_a_pool_and_adapters_route_in_their_parents_on_their_workers() {
    let (pools, _) = table(
        &[worker(1, None), worker(2, None)],
        &ModelsConfig::default(),
    );
    let set = pools.workers().set();
    set.workers()[0].set_served(list(&[
        ("llama", "/m", None),
        ("l3", "/m", None),
        ("sql", "/a/sql", Some("llama")),
    ]));
    set.workers()[1].set_served(list(&[("l3", "/m", None)]));
    pools.update();
    assert_eq!(
        routes(&pools, Some("llama")).unwrap(),
        ("llama".into(), vec![1])
    );
    assert_eq!(
        routes(&pools, Some("l3")).unwrap(),
        ("llama".into(), vec![1, 2])
    );
    assert_eq!(
        pools
            .table()
            .route(Some("sql"))
            .unwrap()
            .adapter
            .map(|a| &**a),
        Some("sql"),
        "an adapter, for the routing key"
    );
    assert!(pools.table().route(Some("l3")).unwrap().adapter.is_none());
    assert_eq!(
        routes(&pools, Some("sql")).unwrap(),
        ("llama".into(), vec![1])
    );
    assert_eq!(
        routes(&pools, None).unwrap(),
        ("llama".into(), vec![1]),
        "the fleet's only model"
    );
    assert_eq!(
        pools.table().route(None).unwrap().rewrite.map(|n| &**n),
        Some("llama")
    );
    assert_eq!(pools.table().pools().count(), 2, "default and llama");
}

#[test]
fn a_worker_whose_list_is_unknown_is_in_every_pool_and_takes_unlisted_models() {
    let (pools, _) = table(
        &[worker(1, Some(&["a"])), worker(2, None)],
        &ModelsConfig::default(),
    );
    assert_eq!(routes(&pools, Some("a")).unwrap(), ("a".into(), vec![1, 2]));
    assert_eq!(
        routes(&pools, Some("zzz")).unwrap(),
        (DEFAULT_POOL.into(), vec![2])
    );
    let set = pools.workers().set();
    set.workers()[1].set_served(list(&[("b", "/b", None)]));
    pools.update();
    assert_eq!(
        routes(&pools, Some("a")).unwrap(),
        ("a".into(), vec![1]),
        "it listed: now only its own"
    );
    assert!(routes(&pools, Some("zzz")).is_err());
}

#[test]
fn a_membership_change_rebuilds_the_table_at_once() {
    let (pools, _) = table(&[worker(1, Some(&["a"]))], &ModelsConfig::default());
    pools
        .workers()
        .replace(&[worker(1, Some(&["a"])), worker(2, Some(&["a"]))]);
    assert_eq!(
        routes(&pools, Some("a")).unwrap().1,
        vec![1, 2],
        "no list read needed"
    );
    pools.workers().replace(&[worker(2, Some(&["a"]))]);
    assert_eq!(
        routes(&pools, Some("a")).unwrap().1,
        vec![2],
        "a worker that left gets nothing"
    );
    // A model only the list reads make a pool for: until they run, it routes in the
    // default pool, on its own workers.
    pools
        .workers()
        .replace(&[worker(2, Some(&["a"])), worker(3, Some(&["new"]))]);
    assert_eq!(
        routes(&pools, Some("new")).unwrap(),
        (DEFAULT_POOL.into(), vec![3])
    );
    pools.update();
    assert_eq!(
        routes(&pools, Some("new")).unwrap(),
        ("new".into(), vec![3])
    );
}

#[test]
fn an_alias_splits_by_weight_and_the_body_carries_the_target() {
    let mut models = ModelsConfig::default();
    models.aliases.insert(
        "chat".into(),
        vec![
            AliasTarget {
                model: "a".into(),
                weight: 90.0,
            },
            AliasTarget {
                model: "b".into(),
                weight: 10.0,
            },
        ],
    );
    models.aliases.insert(
        "gone".into(),
        vec![AliasTarget {
            model: "c".into(),
            weight: 1.0,
        }],
    );
    let (pools, _) = table(&[worker(1, Some(&["a"])), worker(2, Some(&["b"]))], &models);
    let t = pools.table();
    let mut to_a = 0;
    for _ in 0..1000 {
        let r = t.route(Some("chat")).unwrap();
        let name = r.rewrite.expect("the served name is written").to_string();
        to_a += (name == "a") as usize;
        assert_eq!(&*name, &**r.pool.name());
    }
    assert!(
        (870..=930).contains(&to_a),
        "{to_a} of 1000 to the 90 % target"
    );
    assert!(
        t.route(Some("a")).unwrap().rewrite.is_none(),
        "a served name as written"
    );
    assert!(matches!(
        t.route(Some("gone")),
        Err(RouteError::UnknownModel(_))
    ));
    let (counts, _) = pools.request_counts();
    assert!(
        counts.iter().any(|(n, c)| &**n == "a" && *c > 800),
        "{counts:?}"
    );
}

#[test]
fn a_default_model_takes_requests_that_name_none() {
    let models = ModelsConfig {
        default: Some("b".into()),
        ..Default::default()
    };
    let (pools, _) = table(&[worker(1, Some(&["a"])), worker(2, Some(&["b"]))], &models);
    let t = pools.table();
    let r = t.route(None).unwrap();
    assert_eq!(&**r.pool.name(), "b");
    assert_eq!(r.rewrite.map(|n| &**n), Some("b"));
}

#[test]
fn the_first_model_shares_what_the_default_pool_learned_before_the_lists_were_read() {
    let mut models = ModelsConfig::default();
    models.overrides.insert(
        "a".into(),
        crate::config::ModelOverride {
            policy: None,
            cache: None,
        },
    );
    let (pools, made) = table(
        &[worker(1, None), worker(2, None), worker(3, None)],
        &models,
    );
    let before = Arc::clone(pools.table().everyone().pool.policy());
    let set = pools.workers().set();
    set.workers()[0].set_served(list(&[("a", "/a", None)]));
    set.workers()[1].set_served(list(&[("b", "/b", None)]));
    set.workers()[2].set_served(list(&[("c", "/c", None)]));
    pools.update();
    let t = pools.table();
    let policy = |m| Arc::clone(t.route(Some(m)).unwrap().pool.policy());
    assert_eq!(&*policy("a"), "a", "an override: made afresh");
    assert!(
        Arc::ptr_eq(&policy("b"), &before),
        "the first other model shares it"
    );
    assert!(Arc::ptr_eq(t.everyone().pool.policy(), &before));
    assert_eq!(&*policy("c"), "c");
    assert_eq!(made.load(Ordering::Relaxed), 3, "default, a, c");
}

/// A worker entry with `phase`, pinned to `models` when given.
fn phased(port: u16, phase: &str, pinned: Option<&[&str]>) -> WorkerConfig {
    let models = pinned.map_or(String::new(), |m| format!(r#","models":{m:?}"#));
    let json = format!(r#"{{"url":"http://127.0.0.1:{port}","phase":"{phase}"{models}}}"#);
    WorkerConfig::from_json(json.as_bytes()).unwrap()
}

/// Ports of a set's workers.
fn ports(set: &WorkerSet) -> Vec<u16> {
    set.workers().iter().map(|w| port(w)).collect()
}

#[test]
fn a_pool_with_prefill_and_decode_workers_disaggregates_and_one_without_does_not() {
    let (pools, made) = table(
        &[
            phased(1, "prefill", Some(&["pd"])),
            phased(2, "decode", Some(&["pd"])),
            phased(3, "both", Some(&["pd", "agg"])),
            phased(4, "prefill", Some(&["agg"])),
        ],
        &ModelsConfig::default(),
    );
    let t = pools.table();
    let r = t.route(Some("pd")).unwrap();
    let legs = r.legs.expect("prefill and decode workers: two legs");
    assert_eq!(ports(&legs.phases.prefill), [1]);
    assert_eq!(
        ports(&legs.phases.decode),
        [2, 3],
        "`both` is on the decode side"
    );
    assert_eq!(&*legs.policies.prefill, "pd");
    assert_eq!(ports(r.set), [1, 2, 3]);
    // A prefill worker without a decode worker: aggregated over all of them.
    let r = t.route(Some("agg")).unwrap();
    assert!(r.legs.is_none());
    assert_eq!(ports(r.set), [3, 4]);
    // Every worker: prefill and decode ones, so the default pool has legs too.
    assert!(t.everyone().legs.is_some());
    // default, pd; and two legs each.
    assert_eq!(made.load(Ordering::Relaxed), 2 + 2 * 2);
    // Made once: a rebuild makes nothing more.
    pools.update();
    assert_eq!(made.load(Ordering::Relaxed), 6);
}

#[test]
fn the_legs_appear_when_the_membership_first_has_both_phases() {
    let (pools, made) = table(
        &[phased(1, "prefill", None), phased(2, "both", None)],
        &ModelsConfig::default(),
    );
    assert!(pools.table().route(Some("m")).unwrap().legs.is_none());
    assert_eq!(made.load(Ordering::Relaxed), 1);
    pools.workers().add(phased(3, "decode", None)).unwrap();
    pools.update();
    let t = pools.table();
    let legs = t.route(Some("m")).unwrap().legs.expect("now disaggregated");
    assert_eq!(ports(&legs.phases.decode), [2, 3]);
    assert_eq!(made.load(Ordering::Relaxed), 3);
}
