//! The routing table: the pools a request can route in, and which one it does.
//!
//! A **pool** ([`ModelPool`]) is what routes the requests for one model: its policy,
//! with its own routing memory. Every pool draws on one membership of workers, the
//! [`Pool`] in [`pool`] (health, breaker, in-flight load): a worker that serves two
//! models belongs to both pools, and its in-flight count, `max_load`, health and
//! breaker are one, because it is one engine.
//!
//! What each worker serves is its model list ([`pool::models`]: read from its
//! `GET /v1/models`, or pinned). A base model's served names that share a `root` on a
//! worker are one model (vLLM's `--served-model-name a b`), with one pool named by the
//! first; an adapter routes in its parent's pool, on the workers that list it. A worker
//! whose list is unknown serves any model: it is in every pool, and a model that no
//! list names goes to those workers, in the pool named [`DEFAULT_POOL`], which also
//! takes what names no model where no model can be chosen (other paths, WebSockets,
//! calls on a stored response) over every worker.
//!
//! The [`Table`] is one immutable version of all that (which workers each served name
//! routes to, each with its pool), swapped atomically when the membership or a worker's
//! list changes; a request loads it once ([`Pools::table`]). [`Table::route`] is the one
//! place a request's model chooses its pool and workers. Pools appear as models appear
//! in the lists (their policies made by the function `app` gives, so their upkeep and
//! metrics follow) and stay while the router runs: a model that comes back finds its
//! routing memory.
//!
//! A pool may be **disaggregated** ([`legs`]): when its workers include prefill and
//! decode ones, a request routes in two legs, each with a policy of its own, made by the
//! same function as the pool's (told which [`Leg`]).
//!
//! The table is generic over what routes in a pool (`P`, the proxy's policy) so that it
//! sits below `policy`: policies depend on the membership, never on the table.

pub mod legs;
pub mod metrics;
pub mod pool;
pub mod refresh;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::ArcSwap;

pub use self::legs::{Disaggregated, Leg, Legs, Phases};
use self::pool::{Pool, PoolListener, Worker, WorkerSet};
use crate::config::{AdaptersConfig, ModelsConfig};

/// Name of the pool of the workers that serve any model, and of requests that name no
/// model where none can be chosen (in logs and views).
pub const DEFAULT_POOL: &str = "default";

/// One pool: its name and what routes in it. See the module docs.
pub struct ModelPool<P> {
    name: Arc<str>,
    policy: P,
    /// Its legs' policies, once it has had prefill and decode workers ([`legs`]).
    legs: Option<Legs<P>>,
}

impl<P> ModelPool<P> {
    /// The pool's name: its model's (first served) name, or [`DEFAULT_POOL`].
    pub fn name(&self) -> &Arc<str> {
        &self.name
    }

    /// What chooses a worker in this pool.
    pub fn policy(&self) -> &P {
        &self.policy
    }

    /// What chooses each leg's worker, once the pool has had prefill and decode workers.
    pub fn legs(&self) -> Option<&Legs<P>> {
        self.legs.as_ref()
    }
}

/// Where the requests for one served name go.
struct Target {
    /// Index into [`Table::pools`].
    pool: usize,
    /// The workers that list it, and those that serve any model.
    set: Arc<WorkerSet>,
    /// The name as listed.
    name: Arc<str>,
    /// Requests routed as this name (`/metrics`).
    requests: Arc<AtomicU64>,
    /// Whether it is a LoRA adapter (listed with a parent).
    adapter: bool,
    /// `set` by side, when it disaggregates.
    phases: Option<Arc<Phases>>,
}

/// Public names (`models.aliases`), the default (`models.default`), and the adapters
/// the router loads on demand (`adapters.sources` with `load_on_demand`), each with the
/// base config names for it.
struct Names {
    default: Option<Arc<str>>,
    aliases: HashMap<Arc<str>, Alias>,
    loadable: Vec<(Arc<str>, Option<Arc<str>>)>,
}

/// One alias's targets and where its sequence of choices stands.
struct Alias {
    targets: Vec<(Arc<str>, f64)>,
    ticket: AtomicU64,
}

/// Fractional part of the golden ratio: the `n`-th choice of an alias sits at
/// `frac(n · φ⁻¹)` of the targets' weight, which spreads every run of requests over the
/// targets in their weights' proportion (off by a few requests, not by a random walk).
const GOLDEN: f64 = 0.618_033_988_749_894_9;

impl Alias {
    /// The next target among those `served` says are served; `None` when none is.
    fn choose(&self, served: impl Fn(&str) -> bool) -> Option<&Arc<str>> {
        let live: Vec<&(Arc<str>, f64)> = self.targets.iter().filter(|(t, _)| served(t)).collect();
        let total: f64 = live.iter().map(|(_, w)| w).sum();
        // Relaxed: a counter, nothing is published through it.
        let n = self.ticket.fetch_add(1, Ordering::Relaxed);
        let mut at = (n as f64 * GOLDEN).fract() * total;
        for (t, w) in &live {
            if at < *w {
                return Some(t);
            }
            at -= w;
        }
        live.last().map(|(t, _)| t)
    }
}

/// Why a request has no pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteError {
    /// No worker serves this model, and none serves any.
    UnknownModel(String),
    /// The request names no model, and the fleet serves several (its choices, the
    /// served models' and the aliases' names).
    NoModel { choices: Vec<Arc<str>> },
}

/// Where one request routes: a pool and its workers.
pub struct Routed<'t, P> {
    pub pool: &'t ModelPool<P>,
    /// The workers it may go to (a worker in several pools is the same `Worker`).
    pub set: &'t Arc<WorkerSet>,
    /// The served name the forwarded body must carry, when it is not what the request
    /// wrote: an alias's target, or the model chosen for a request that named none.
    pub rewrite: Option<&'t Arc<str>>,
    /// The served name it routes as, when a worker listed it or config names it (the
    /// only names that label metrics); `None` for workers that serve any model.
    pub model: Option<&'t Arc<str>>,
    /// The LoRA adapter it names, when the served name is one (it routes in its base
    /// model's pool): what an adapter-aware routing key adds (issue 40, item 4).
    pub adapter: Option<&'t Arc<str>>,
    /// Its legs, when its workers disaggregate and the pool's legs' policies are made.
    pub legs: Option<Disaggregated<'t, P>>,
}

/// One version of the routing table. See the module docs.
pub struct Table<P> {
    /// Every worker, as the membership had it when this table was built.
    set: Arc<WorkerSet>,
    /// Every pool made so far, [`DEFAULT_POOL`] first.
    pools: Vec<Arc<ModelPool<P>>>,
    /// Served name -> where it goes.
    routes: HashMap<Arc<str>, Target>,
    /// The workers that serve any model, when there are.
    any: Option<Arc<WorkerSet>>,
    /// The listed base models (their pools' names), in the workers' order.
    bases: Vec<Arc<str>>,
    names: Arc<Names>,
    /// `set` and `any` by side, when they disaggregate.
    set_phases: Option<Arc<Phases>>,
    any_phases: Option<Arc<Phases>>,
}

impl<P> Table<P> {
    /// Every worker once.
    pub fn set(&self) -> &Arc<WorkerSet> {
        &self.set
    }

    /// Every pool, [`DEFAULT_POOL`] first, then in the order their models appeared.
    pub fn pools(&self) -> impl Iterator<Item = &ModelPool<P>> {
        self.pools.iter().map(|p| &**p)
    }

    /// The workers that serve any model (their list is unknown), when there are.
    pub fn any(&self) -> Option<&Arc<WorkerSet>> {
        self.any.as_ref()
    }

    /// Every served name a worker lists now, with its pool and its workers (those that
    /// serve any model included), by name.
    pub fn models(&self) -> Vec<(&Arc<str>, &ModelPool<P>, &Arc<WorkerSet>)> {
        let mut out: Vec<_> = self
            .routes
            .values()
            .map(|t| (&t.name, &*self.pools[t.pool], &t.set))
            .collect();
        out.sort_by(|a, b| a.0.cmp(b.0));
        out
    }

    /// Where what names no model goes when none can be chosen (other paths, WebSockets,
    /// calls on a stored response): [`DEFAULT_POOL`], every worker.
    pub fn everyone(&self) -> Routed<'_, P> {
        Routed {
            pool: &self.pools[0],
            set: &self.set,
            rewrite: None,
            model: None,
            adapter: None,
            legs: legs_of(&self.pools[0], self.set_phases.as_ref()),
        }
    }

    /// Where a request for `model` (`None`: it names none) routes. See the module docs
    /// and `docs/src/concepts/models.md` for the rules.
    pub fn route(&self, model: Option<&str>) -> Result<Routed<'_, P>, RouteError> {
        if self.set.workers().is_empty() {
            // No worker at all: nothing is known of any model (503, not 404).
            return Ok(self.everyone());
        }
        let Some(model) = model else {
            if let Some(d) = &self.names.default {
                return self.named(d, Some(d));
            }
            return match self.bases.as_slice() {
                [] => Ok(self.everyone()),
                [only] => self.named(only, Some(only)),
                several => {
                    let mut choices = several.to_vec();
                    choices.extend(self.names.aliases.keys().cloned());
                    choices.sort();
                    Err(RouteError::NoModel { choices })
                }
            };
        };
        self.named(model, None)
    }

    /// A request for `model`; `written`: the request named none, and this is the name
    /// chosen for it (the served name is then always written into it).
    fn named<'t>(
        &'t self,
        model: &str,
        written: Option<&'t Arc<str>>,
    ) -> Result<Routed<'t, P>, RouteError> {
        let served = |name: &str| self.any.is_some() || self.routes.contains_key(name);
        let chosen = match self.names.aliases.get(model) {
            Some(alias) => Some(
                alias
                    .choose(served)
                    .ok_or_else(|| RouteError::UnknownModel(model.to_string()))?,
            ),
            None => None,
        };
        let name: &str = chosen.map_or(model, |c| c);
        // What the forwarded body must say: an alias's target (when it is another
        // name), or what was chosen for a request that named none.
        let carry = match chosen {
            Some(c) if written.is_some() || **c != *model => Some(c),
            Some(_) => None,
            None => written,
        };
        if let Some(t) = self.routes.get(name) {
            t.requests.fetch_add(1, Ordering::Relaxed);
            return Ok(Routed {
                pool: &self.pools[t.pool],
                set: &t.set,
                rewrite: carry.map(|_| &t.name),
                model: Some(&t.name),
                adapter: t.adapter.then_some(&t.name),
                legs: legs_of(&self.pools[t.pool], t.phases.as_ref()),
            });
        }
        match &self.any {
            Some(any) => Ok(Routed {
                pool: &self.pools[0],
                set: any,
                rewrite: carry,
                model: None,
                adapter: None,
                legs: legs_of(&self.pools[0], self.any_phases.as_ref()),
            }),
            None => Err(RouteError::UnknownModel(model.to_string())),
        }
    }
}

/// `pool`'s legs over `phases`, when the set disaggregates and the legs' policies are made.
fn legs_of<'t, P>(
    pool: &'t ModelPool<P>,
    phases: Option<&'t Arc<Phases>>,
) -> Option<Disaggregated<'t, P>> {
    Some(Disaggregated {
        policies: pool.legs.as_ref()?,
        phases: phases?,
    })
}

/// What makes a pool's policy: by the pool's name, for the whole request or one leg.
type Make<P> = dyn Fn(&str, Leg) -> P + Send + Sync;

/// The routing table over one membership of workers. See the module docs.
pub struct Pools<P> {
    workers: Arc<Pool>,
    table: ArcSwap<Table<P>>,
    /// Every pool made so far, [`DEFAULT_POOL`] first.
    made: Mutex<Vec<Arc<ModelPool<P>>>>,
    /// Makes the policy of a new pool, by the pool's name, for the whole request or one
    /// leg.
    make: Box<Make<P>>,
    names: Arc<Names>,
    /// Serialises table builds (membership changes, the list reads).
    building: Mutex<()>,
    /// Serialises the making of pools (one per name).
    making: Mutex<()>,
    /// The models `models.overrides` names (their pools are always made afresh).
    overridden: std::collections::HashSet<Arc<str>>,
    /// Told when the membership changed (a worker joined: its list is to be read).
    changed: tokio::sync::Notify,
    /// Requests per known model name (`/metrics`): the names workers listed and config
    /// writes, never a client's.
    requests: Mutex<HashMap<Arc<str>, Arc<AtomicU64>>>,
    /// Requests for a model no worker serves (404).
    not_found: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<P: Clone + Send + Sync + 'static> Pools<P> {
    /// The table over `workers`: [`DEFAULT_POOL`] and a pool for each model the workers
    /// are pinned to, each with the policy `make` makes for its name (and its legs'
    /// when its workers disaggregate). `make` is also called for each model that
    /// appears later, and for a pool's legs when it first disaggregates
    /// ([`Pools::update`]). The table hears the membership's changes.
    pub fn new(
        workers: Arc<Pool>,
        models: &ModelsConfig,
        make: impl Fn(&str, Leg) -> P + Send + Sync + 'static,
    ) -> Arc<Self> {
        Self::with_adapters(workers, models, &AdaptersConfig::default(), make)
    }

    /// As [`Pools::new`], with the adapters the router loads on demand (`adapters:`):
    /// such an adapter routes to every worker of its base model, not only to those
    /// that list it.
    pub fn with_adapters(
        workers: Arc<Pool>,
        models: &ModelsConfig,
        adapters: &AdaptersConfig,
        make: impl Fn(&str, Leg) -> P + Send + Sync + 'static,
    ) -> Arc<Self> {
        let default = Arc::new(ModelPool {
            name: Arc::from(DEFAULT_POOL),
            policy: make(DEFAULT_POOL, Leg::Whole),
            legs: None,
        });
        let names = Arc::new(Names {
            default: models.default.as_deref().map(Arc::from),
            aliases: models
                .aliases
                .iter()
                .map(|(public, targets)| {
                    let targets = targets
                        .iter()
                        .map(|t| (Arc::from(t.model.as_str()), t.weight))
                        .collect();
                    let alias = Alias {
                        targets,
                        ticket: AtomicU64::new(0),
                    };
                    (Arc::from(public.as_str()), alias)
                })
                .collect(),
            loadable: adapters
                .sources
                .iter()
                .filter(|_| adapters.load_on_demand)
                .map(|(name, s)| (Arc::from(name.as_str()), s.base.as_deref().map(Arc::from)))
                .collect(),
        });
        let requests = Mutex::new(
            models
                .names()
                .map(|n| (Arc::from(n), Arc::default()))
                .collect(),
        );
        let (first, _) = build(workers.set(), vec![Arc::clone(&default)], &names, &requests);
        let pools = Arc::new(Pools {
            table: ArcSwap::from_pointee(first),
            made: Mutex::new(vec![default]),
            workers: Arc::clone(&workers),
            make: Box::new(make),
            names,
            building: Mutex::new(()),
            making: Mutex::new(()),
            overridden: models
                .overrides
                .keys()
                .map(|k| Arc::from(k.as_str()))
                .collect(),
            changed: tokio::sync::Notify::new(),
            requests,
            not_found: AtomicU64::new(0),
        });
        workers.listen(Arc::new(Listener(Arc::downgrade(&pools))));
        pools.update();
        pools
    }

    /// Rebuilds the table from the membership and every worker's list, first making
    /// the pools of models seen for the first time (the list reads call it after a
    /// change).
    ///
    /// The first model's pool (unless `models.overrides` names it) shares the default
    /// pool's policy, memory and all: until the first lists are read every request
    /// routes in the default pool, and what it learned then is, in a fleet of one
    /// model, that model's (which so routes as it did without lists).
    pub fn update(&self) {
        let _one = lock(&self.making);
        let mut missing = self.rebuild(self.workers.set());
        if !missing.pools.is_empty() {
            self.make_pools(missing.pools);
            missing = self.rebuild(self.workers.set());
        }
        if !missing.legs.is_empty() {
            self.make_legs(&missing.legs);
            self.rebuild(self.workers.set());
        }
    }

    /// Makes the pools named `missing` (see [`Pools::update`]).
    fn make_pools(&self, missing: Vec<Arc<str>>) {
        let adopter = missing
            .iter()
            .find(|n| !self.overridden.contains(*n))
            .filter(|_| lock(&self.made).len() == 1)
            .cloned();
        // Made outside the build lock: a policy registers with the membership, whose
        // change handlers wait on that lock.
        let made: Vec<Arc<ModelPool<P>>> = missing
            .into_iter()
            .map(|name| {
                tracing::info!(model = %name, "a pool for a new model");
                let (policy, legs) = if adopter.as_ref() == Some(&name) {
                    let default = Arc::clone(&lock(&self.made)[0]);
                    (default.policy.clone(), default.legs.clone())
                } else {
                    ((self.make)(&name, Leg::Whole), None)
                };
                Arc::new(ModelPool { policy, name, legs })
            })
            .collect();
        lock(&self.made).extend(made);
    }

    /// Gives the pools named `names` their legs' policies (they now have prefill and
    /// decode workers): each is replaced by the same pool with its legs.
    fn make_legs(&self, names: &[Arc<str>]) {
        for name in names {
            let Some(old) = lock(&self.made)
                .iter()
                .find(|p| p.name == *name && p.legs.is_none())
                .cloned()
            else {
                continue;
            };
            tracing::info!(pool = %name, "prefill and decode workers: the pool disaggregates");
            let legs = Legs {
                prefill: (self.make)(name, Leg::Prefill),
                decode: (self.make)(name, Leg::Decode),
            };
            let new = Arc::new(ModelPool {
                name: Arc::clone(&old.name),
                policy: old.policy.clone(),
                legs: Some(legs),
            });
            for p in lock(&self.made).iter_mut() {
                if Arc::ptr_eq(p, &old) {
                    *p = Arc::clone(&new);
                }
            }
        }
    }

    /// Builds and stores the table for `set` with the pools made so far; returns what
    /// it lacks.
    fn rebuild(&self, set: Arc<WorkerSet>) -> Missing {
        let _one = lock(&self.building);
        let made = lock(&self.made).clone();
        let (table, missing) = build(set, made, &self.names, &self.requests);
        self.table.store(Arc::new(table));
        missing
    }
}

impl<P> Pools<P> {
    /// The current table (one atomic load): a request keeps it for all its attempts.
    pub fn table(&self) -> Arc<Table<P>> {
        self.table.load_full()
    }

    /// Every worker, once (what health checks, discovery and reloads change).
    pub fn workers(&self) -> &Arc<Pool> {
        &self.workers
    }

    /// Notified when the membership changed: the list reads look at the new workers.
    pub fn membership_changed(&self) -> &tokio::sync::Notify {
        &self.changed
    }

    /// Counts a request for a model no worker serves.
    pub fn not_found(&self) {
        self.not_found.fetch_add(1, Ordering::Relaxed);
    }

    /// Requests per known model name, by name, and those for unknown models.
    pub fn request_counts(&self) -> (Vec<(Arc<str>, u64)>, u64) {
        let mut per: Vec<(Arc<str>, u64)> = lock(&self.requests)
            .iter()
            .map(|(n, c)| (Arc::clone(n), c.load(Ordering::Relaxed)))
            .collect();
        per.sort();
        (per, self.not_found.load(Ordering::Relaxed))
    }
}

/// The table's ear on the membership; weak, so that the membership (which the table
/// holds) does not keep the table alive.
struct Listener<P>(std::sync::Weak<Pools<P>>);

impl<P: Clone + Send + Sync + 'static> PoolListener for Listener<P> {
    fn set_changed(&self, set: &Arc<WorkerSet>) {
        let Some(pools) = self.0.upgrade() else {
            return;
        };
        // Under the membership's lock: no pool is made here (the list reads make the
        // new ones when they wake).
        pools.rebuild(Arc::clone(set));
        pools.changed.notify_one();
    }
}

/// What a table lacks: pools not made yet (by name, in the workers' order), and pools
/// whose workers disaggregate without their legs' policies made.
#[derive(Default)]
struct Missing {
    pools: Vec<Arc<str>>,
    legs: Vec<Arc<str>>,
}

/// The members of one served name: workers by their index in the set.
#[derive(Default)]
struct Members {
    pool: Option<Arc<str>>,
    workers: Vec<usize>,
    /// Listed as an adapter (with a parent).
    adapter: bool,
}

/// What the workers' lists say, before pools are matched to it.
struct Survey {
    /// Each served name's pool and the workers that list it.
    names: HashMap<Arc<str>, Members>,
    /// The workers that serve any model (their index in the set).
    any: Vec<usize>,
    /// The base models' pools, in the workers' order.
    bases: Vec<Arc<str>>,
}

/// Which pool each served name of `set`'s lists belongs to, and who lists it; the
/// workers that serve any model; the base models' pools in order. See the module docs.
fn survey(set: &WorkerSet) -> Survey {
    let mut names: HashMap<Arc<str>, Members> = HashMap::new();
    let mut any = Vec::new();
    let mut bases: Vec<Arc<str>> = Vec::new();
    for (i, w) in set.workers().iter().enumerate() {
        let served = w.served();
        if served.serves_any() {
            any.push(i);
            continue;
        }
        let pinned = served.source == pool::models::ListSource::Pinned;
        // root -> pool, on this worker: its served names of one model share a root.
        let mut by_root: HashMap<&str, Arc<str>> = HashMap::new();
        for m in served.models.iter().filter(|m| !m.is_adapter()) {
            let root = m.root.as_deref().filter(|_| !pinned);
            let pool = root
                .and_then(|r| by_root.get(r).cloned())
                .or_else(|| names.get(&m.id).and_then(|n| n.pool.clone()))
                .unwrap_or_else(|| Arc::clone(&m.id));
            if let Some(r) = root {
                by_root.entry(r).or_insert_with(|| Arc::clone(&pool));
            }
            if !bases.contains(&pool) {
                bases.push(Arc::clone(&pool));
            }
            let n = names.entry(Arc::clone(&m.id)).or_default();
            n.pool.get_or_insert(pool);
            n.workers.push(i);
        }
        for m in served.models.iter() {
            let Some(parent) = &m.parent else { continue };
            let pool = names
                .get(parent)
                .and_then(|n| n.pool.clone())
                .unwrap_or_else(|| Arc::clone(parent));
            let n = names.entry(Arc::clone(&m.id)).or_default();
            n.pool.get_or_insert(pool);
            n.workers.push(i);
            n.adapter = true;
        }
    }
    Survey { names, any, bases }
}

/// Adds to `served` the adapters loaded on demand (`names.loadable`): each routes in
/// its base model's pool, on the workers that list it and every worker of that base
/// (which can load it). Its base is the one a worker lists it under, else the one its
/// source names, else `models.default`, else the fleet's only base model; an adapter
/// whose base is none of these routes only where it is listed.
fn loadable_anywhere(served: &mut HashMap<Arc<str>, Members>, bases: &[Arc<str>], names: &Names) {
    for (adapter, base) in &names.loadable {
        let listed_pool = served
            .get(adapter)
            .filter(|m| m.adapter)
            .and_then(|m| m.pool.clone());
        let base_pool = listed_pool.or_else(|| {
            let base = base.as_ref().or(names.default.as_ref()).or(match bases {
                [only] => Some(only),
                _ => None,
            })?;
            served
                .get(base)
                .filter(|m| !m.adapter)
                .and_then(|m| m.pool.clone())
        });
        let Some(pool) = base_pool else { continue };
        let base_workers: Vec<usize> = served
            .values()
            .filter(|m| !m.adapter && m.pool.as_ref() == Some(&pool))
            .flat_map(|m| m.workers.iter().copied())
            .collect();
        let m = served.entry(Arc::clone(adapter)).or_default();
        if m.workers.is_empty() || m.adapter {
            m.pool.get_or_insert(pool);
            m.workers.extend(base_workers);
            m.adapter = true;
        }
    }
}

/// The table for `set` with the pools `made`; and the pools' names it lacks (models
/// whose requests meanwhile route in the default pool, on their own workers), in the
/// workers' order.
fn build<P>(
    set: Arc<WorkerSet>,
    made: Vec<Arc<ModelPool<P>>>,
    names: &Arc<Names>,
    requests: &Mutex<HashMap<Arc<str>, Arc<AtomicU64>>>,
) -> (Table<P>, Missing) {
    let Survey {
        names: mut served,
        any,
        bases,
    } = survey(&set);
    loadable_anywhere(&mut served, &bases, names);
    let index: HashMap<&str, usize> = made
        .iter()
        .enumerate()
        .map(|(i, p)| (&*p.name, i))
        .collect();
    // One set per distinct membership: names with the same workers share it (and so
    // whatever a policy derives from a set), and its split by side.
    type Split = (Arc<WorkerSet>, Option<Arc<Phases>>);
    let set_phases = Phases::of(&set);
    let mut sets: HashMap<Vec<usize>, Split> = HashMap::new();
    sets.insert(
        (0..set.workers().len()).collect(),
        (Arc::clone(&set), set_phases.clone()),
    );
    let mut set_of = |mut members: Vec<usize>| -> Split {
        members.sort_unstable();
        members.dedup();
        let (s, p) = sets.entry(members).or_insert_with_key(|m| {
            let s = WorkerSet::new(
                m.iter()
                    .map(|&i| Arc::clone(&set.workers()[i]))
                    .collect::<Vec<Arc<Worker>>>(),
            );
            let p = Phases::of(&s);
            (Arc::new(s), p)
        });
        (Arc::clone(s), p.clone())
    };
    let mut legs: Vec<Arc<str>> = Vec::new();
    let mut want_legs = |pool: usize, phases: &Option<Arc<Phases>>| {
        let p = &made[pool];
        if phases.is_some() && p.legs.is_none() && !legs.contains(&p.name) {
            legs.push(Arc::clone(&p.name));
        }
    };
    let mut missing: Vec<Arc<str>> = Vec::new();
    let mut routes = HashMap::with_capacity(served.len());
    let mut counters = lock(requests);
    for (name, m) in served {
        let pool = m.pool.unwrap_or_else(|| Arc::clone(&name));
        // A model whose pool is not made yet routes in the default pool meanwhile (on
        // its own workers): a listed model is never unknown.
        let i = index.get(&*pool).copied().unwrap_or_else(|| {
            if !missing.contains(&pool) {
                missing.push(Arc::clone(&pool));
            }
            0
        });
        let mut members = m.workers;
        members.extend_from_slice(&any);
        let (members, phases) = set_of(members);
        want_legs(i, &phases);
        let target = Target {
            pool: i,
            set: members,
            requests: Arc::clone(counters.entry(Arc::clone(&name)).or_default()),
            name: Arc::clone(&name),
            adapter: m.adapter,
            phases,
        };
        routes.insert(name, target);
    }
    drop(counters);
    // In the workers' order (the first model is the first listed).
    missing.sort_by_key(|m| bases.iter().position(|b| b == m).unwrap_or(usize::MAX));
    let (any, any_phases) = match any.is_empty() {
        true => (None, None),
        false => {
            let (s, p) = set_of(any);
            (Some(s), p)
        }
    };
    want_legs(0, &set_phases);
    want_legs(0, &any_phases);
    let bases = bases
        .into_iter()
        .filter(|b| index.contains_key(&**b))
        .collect();
    let table = Table {
        set,
        pools: made,
        routes,
        any,
        bases,
        names: Arc::clone(names),
        set_phases,
        any_phases,
    };
    (
        table,
        Missing {
            pools: missing,
            legs,
        },
    )
}

#[cfg(test)]
mod tests;
