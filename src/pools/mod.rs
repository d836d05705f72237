//! The routing table: the pools a request can route in, and which one it does.
//!
//! A **pool** ([`ModelPool`]) is the workers that serve one model and what chooses among
//! them: its policy, with its own routing memory. Every pool draws on one membership of
//! workers, the [`Pool`] in [`pool`] (health, breaker, in-flight load): a worker that
//! serves two models belongs to both pools, and its in-flight count, `max_load`, health
//! and breaker are one, because it is one engine.
//!
//! Today one pool, `default`, serves every model; [`Pools::route`] is the one place a
//! request's model chooses its pool, so routing by model adds entries to this table
//! (and prefill/decode pools a kind of entry) without changing its callers.
//!
//! The table is generic over what routes in a pool (`P`, the proxy's policy) so that it
//! sits below `policy`: policies depend on the membership, never on the table.

pub mod pool;

use std::sync::Arc;

use self::pool::Pool;

/// Name of the pool that serves any model (in logs and views).
pub const DEFAULT_POOL: &str = "default";

/// One pool: its name and what routes in it. See the module docs.
pub struct ModelPool<P> {
    name: Arc<str>,
    policy: P,
}

impl<P> ModelPool<P> {
    /// The pool's name ([`DEFAULT_POOL`] for the pool that serves any model).
    pub fn name(&self) -> &Arc<str> {
        &self.name
    }

    /// What chooses a worker in this pool.
    pub fn policy(&self) -> &P {
        &self.policy
    }
}

/// The routing table over one membership of workers. See the module docs.
pub struct Pools<P> {
    workers: Arc<Pool>,
    /// Never empty: the first entry serves any model.
    pools: Box<[ModelPool<P>]>,
}

impl<P> Pools<P> {
    /// A table with one pool, [`DEFAULT_POOL`], that serves every model over `workers`.
    pub fn single(workers: Arc<Pool>, policy: P) -> Self {
        Pools {
            workers,
            pools: Box::new([ModelPool {
                name: Arc::from(DEFAULT_POOL),
                policy,
            }]),
        }
    }

    /// Every worker, once (what health checks, discovery and reloads change).
    pub fn workers(&self) -> &Arc<Pool> {
        &self.workers
    }

    /// The pool a request for `model` (`None`: the request names none) routes in.
    pub fn route(&self, _model: Option<&str>) -> &ModelPool<P> {
        &self.pools[0]
    }

    /// Every pool, the default first.
    pub fn iter(&self) -> impl Iterator<Item = &ModelPool<P>> {
        self.pools.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_pool_serves_every_model_and_shares_the_workers() {
        let workers = Arc::new(Pool::new(&[], &Default::default()));
        let pools = Pools::single(Arc::clone(&workers), 7u8);
        for model in [None, Some("llama"), Some("")] {
            let p = pools.route(model);
            assert_eq!(&**p.name(), DEFAULT_POOL);
            assert_eq!(*p.policy(), 7);
        }
        assert_eq!(pools.iter().count(), 1);
        assert!(Arc::ptr_eq(pools.workers(), &workers));
    }
}
