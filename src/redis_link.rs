//! One Redis connection for bounded calls, replaced whenever a call on it timed out or
//! failed at the socket (the response cache's store, the fleet's publisher).
//!
//! A multiplexed connection matches replies to commands by order. A call that gave up
//! waiting leaves its command on the wire, and a server that was frozen (`SIGSTOP`,
//! `docker pause`, a network black hole: the TCP connection stays up, nothing answers)
//! answers all of them when it thaws. Rather than trust that every late reply still
//! lands on its own (dropped) waiter, a connection with a timed-out command is never
//! used again: the next call opens a fresh one, and the old one closes once the last
//! call holding it returns (its driver task is dropped with it). Connecting is shared:
//! calls that find no connection wait for one attempt, and every call, connecting
//! included, ends within the link's bound.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, FromRedisValue, RedisError};
use tokio::sync::OnceCell;

/// A command or a pipeline, as one call.
pub enum Query {
    Cmd(redis::Cmd),
    Pipe(redis::Pipeline),
}

/// Why a call failed.
#[derive(Debug)]
pub enum LinkError {
    /// No answer (connecting included) within the link's bound.
    Timeout(Duration),
    /// Redis or the socket said why.
    Redis(RedisError),
}

impl LinkError {
    /// Whether the server answered (an error reply, a value of another type, a reply
    /// that does not parse): it is up.
    pub fn answered(&self) -> bool {
        match self {
            LinkError::Timeout(_) => false,
            LinkError::Redis(e) => {
                !(e.is_io_error() || e.is_timeout() || e.is_connection_dropped())
            }
        }
    }

    /// Whether the connection is not used again: the socket failed or nothing came
    /// back in time, or the replies can no longer be trusted to be in step (a reply
    /// that does not parse: `is_unrecoverable_error`).
    fn spoils_connection(&self) -> bool {
        match self {
            LinkError::Timeout(_) => true,
            LinkError::Redis(e) => !self.answered() || e.is_unrecoverable_error(),
        }
    }

    /// The error Redis gave, if it gave one.
    pub fn redis(&self) -> Option<&RedisError> {
        match self {
            LinkError::Timeout(_) => None,
            LinkError::Redis(e) => Some(e),
        }
    }
}

impl std::fmt::Display for LinkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LinkError::Timeout(d) => write!(f, "redis: no answer within {d:?}"),
            LinkError::Redis(e) => write!(f, "redis: {e}"),
        }
    }
}

/// The connection slot: empty until the first call connects.
#[derive(Default)]
struct Slot(OnceCell<MultiplexedConnection>);

/// See the module docs.
pub struct RedisLink {
    client: redis::Client,
    config: AsyncConnectionConfig,
    slot: ArcSwap<Slot>,
    bound: Duration,
}

impl RedisLink {
    /// A link to `client`'s server whose calls each take at most `bound`; connects on
    /// first use.
    pub fn new(client: redis::Client, bound: Duration) -> Self {
        RedisLink {
            client,
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(bound))
                .set_response_timeout(Some(bound)),
            slot: ArcSwap::from_pointee(Slot::default()),
            bound,
        }
    }

    /// Runs `q` and reads its reply as `T`, within the bound. On a timeout or a
    /// connection error the connection is dropped (see the module docs).
    pub async fn query<T: FromRedisValue>(&self, q: &Query) -> Result<T, LinkError> {
        let slot = self.slot.load_full();
        let run = async {
            let conn = slot
                .0
                .get_or_try_init(|| {
                    self.client
                        .get_multiplexed_async_connection_with_config(&self.config)
                })
                .await?;
            let mut conn = conn.clone();
            match q {
                Query::Cmd(c) => c.query_async(&mut conn).await,
                Query::Pipe(p) => p.query_async(&mut conn).await,
            }
        };
        let result = match tokio::time::timeout(self.bound, run).await {
            Ok(Ok(v)) => return Ok(v),
            // The connection's own deadlines, equal to the bound, may fire first.
            Ok(Err(e)) if e.is_timeout() => LinkError::Timeout(self.bound),
            Ok(Err(e)) => LinkError::Redis(e),
            Err(_) => LinkError::Timeout(self.bound),
        };
        if result.spoils_connection() {
            // Only the slot this call used: a newer one (opened after another call's
            // failure) stays.
            self.slot.compare_and_swap(&slot, Arc::new(Slot::default()));
        }
        Err(result)
    }
}

impl std::fmt::Debug for RedisLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLink")
            .field("bound", &self.bound)
            .field("connected", &self.slot.load().0.initialized())
            .finish_non_exhaustive()
    }
}
