//! The Redis store: answers and semantic candidates shared by every router replica that
//! names the same `redis_url` and `namespace`.
//!
//! Keys: `<namespace>:rc:v1:e:<hex key>` holds an encoded [`Entry`] (`SET … PX ttl`);
//! `<namespace>:rc:v1:s:<hex partition>` is a list of candidates, newest first
//! (`LPUSH`, `LTRIM`, `PEXPIRE`), each the 32-byte key then the vector as little-endian
//! `f32`s. One multiplexed connection ([`crate::redis_link`]), opened on first use and
//! replaced after a call on it timed out; every call is bounded by [`OP_TIMEOUT`], so a
//! slow or dead Redis costs a request at most that long (and the cache's gate,
//! [`super::store::Gate`], keeps later ones from waiting at all).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::{BoxFuture, FutureExt};

use super::entry::Entry;
use super::key::{Key, LAYOUT};
use super::store::{Candidate, Store, StoreError, StoreStats};
use crate::redis_link::{Query, RedisLink};

/// Longest one Redis call may take, connecting included.
pub const OP_TIMEOUT: Duration = Duration::from_millis(250);

pub struct RedisStore {
    link: RedisLink,
    prefix: String,
    ttl_ms: u64,
}

impl RedisStore {
    /// A store on `url` (checked by config) under `namespace`; connects on first use.
    pub fn new(url: &str, namespace: &str, ttl: Duration) -> Result<Self, StoreError> {
        let client =
            redis::Client::open(url).map_err(|e| StoreError::Unavailable(e.to_string()))?;
        Ok(RedisStore {
            link: RedisLink::new(client, OP_TIMEOUT),
            prefix: format!("{namespace}:rc:{LAYOUT}"),
            ttl_ms: ttl.as_millis().max(1) as u64,
        })
    }

    fn entry_key(&self, key: &Key) -> String {
        format!("{}:e:{}", self.prefix, hex(key))
    }

    fn list_key(&self, partition: &Key) -> String {
        format!("{}:s:{}", self.prefix, hex(partition))
    }

    async fn call<T: redis::FromRedisValue>(&self, q: Query) -> Result<T, StoreError> {
        match self.link.query(&q).await {
            Ok(v) => Ok(v),
            // Redis answered, with an error or something not ours (WRONGTYPE, an odd
            // reply): the store is up and a SET heals the key. Only a connection that
            // failed or a call that timed out is an outage.
            Err(e)
                if e.answered()
                    && e.redis().is_some_and(|r| {
                        matches!(
                            r.kind(),
                            redis::ErrorKind::Parse
                                | redis::ErrorKind::UnexpectedReturnType
                                | redis::ErrorKind::Extension
                                | redis::ErrorKind::Server(_)
                        )
                    }) =>
            {
                Err(StoreError::Garbage(e.to_string()))
            }
            Err(e) => Err(StoreError::Unavailable(e.to_string())),
        }
    }
}

fn hex(k: &Key) -> String {
    use std::fmt::Write;
    k.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// A candidate as a list item: key, then the vector's `f32`s little-endian.
fn encode_candidate(c: &Candidate) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + 4 * c.vector.len());
    out.extend_from_slice(&c.key);
    for x in c.vector.iter() {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

fn decode_candidate(b: &[u8]) -> Result<Candidate, StoreError> {
    if b.len() < 36 || !(b.len() - 32).is_multiple_of(4) {
        return Err(StoreError::Garbage(format!(
            "redis: a semantic candidate of {} bytes is not a key and a vector",
            b.len()
        )));
    }
    let key: Key = b[..32].try_into().expect("32 bytes");
    let vector: Arc<[f32]> = b[32..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    Ok(Candidate { key, vector })
}

impl Store for RedisStore {
    fn get<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Entry>, StoreError>> {
        async move {
            let mut c = redis::cmd("GET");
            c.arg(self.entry_key(key));
            let raw: Option<Bytes> = self.call(Query::Cmd(c)).await?;
            raw.map(|b| Entry::decode(b).map_err(|e| StoreError::Garbage(format!("redis: {e}"))))
                .transpose()
        }
        .boxed()
    }

    fn put(&self, key: Key, entry: Entry) -> BoxFuture<'_, Result<(), StoreError>> {
        async move {
            let mut c = redis::cmd("SET");
            c.arg(self.entry_key(&key))
                .arg(entry.encode())
                .arg("PX")
                .arg(self.ttl_ms);
            self.call::<()>(Query::Cmd(c)).await
        }
        .boxed()
    }

    fn recent<'a>(
        &'a self,
        partition: &'a Key,
        n: usize,
    ) -> BoxFuture<'a, Result<Vec<Candidate>, StoreError>> {
        async move {
            let mut c = redis::cmd("LRANGE");
            c.arg(self.list_key(partition))
                .arg(0)
                .arg(n.max(1) as i64 - 1);
            let items: Vec<Bytes> = self.call(Query::Cmd(c)).await?;
            items.iter().map(|b| decode_candidate(b)).collect()
        }
        .boxed()
    }

    fn remember(
        &self,
        partition: Key,
        candidate: Candidate,
        keep: usize,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        async move {
            let list = self.list_key(&partition);
            let item = encode_candidate(&candidate);
            let mut p = redis::pipe();
            p.atomic()
                .cmd("LREM")
                .arg(&list)
                .arg(0)
                .arg(&item)
                .ignore()
                .cmd("LPUSH")
                .arg(&list)
                .arg(&item)
                .ignore()
                .cmd("LTRIM")
                .arg(&list)
                .arg(0)
                .arg(keep.max(1) as i64 - 1)
                .ignore()
                .cmd("PEXPIRE")
                .arg(&list)
                .arg(self.ttl_ms)
                .ignore();
            self.call::<()>(Query::Pipe(p)).await
        }
        .boxed()
    }

    fn stats(&self) -> Option<StoreStats> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_round_trip_and_refuse_garbage() {
        let c = Candidate {
            key: [3; 32],
            vector: Arc::from(vec![0.5f32, -1.25, 3.0]),
        };
        assert_eq!(decode_candidate(&encode_candidate(&c)).unwrap(), c);
        assert!(decode_candidate(&[0; 32]).is_err());
        assert!(decode_candidate(&[0; 37]).is_err());
        assert_eq!(hex(&[0xab; 32]).len(), 64);
    }
}
