//! The proxy's side of flow control (`crate::flow`): the body members it reads
//! (`priority`, `cache_salt`), found in one pass over the body's top level
//! ([`super::json_members`]), and the forwarded body's rewrite, for the routed endpoints
//! only: with `priority.engine_priority` the request's class is written as vLLM's
//! `priority`; with `tenants.isolate_cache` its `cache_salt` becomes its tenant's
//! (replacing the client's). With flow control off nothing here runs.

use std::ops::Range;

use bytes::{Bytes, BytesMut};
use http::HeaderMap;

use super::Router;
use crate::error::ProxyError;
use crate::flow::{Over, Refusal, Ticket};

/// The top-level members of a request body that flow control reads.
#[derive(Debug, Default)]
struct Members {
    /// vLLM's `priority` (an integer), when it is one.
    priority: Option<i64>,
    /// Where the `priority` value is, to be replaced.
    priority_at: Option<Range<usize>>,
    /// Where the `cache_salt` value is, to be replaced.
    salt_at: Option<Range<usize>>,
}

impl Members {
    fn read(body: &[u8]) -> Self {
        let mut m = Members::default();
        let base = body.as_ptr() as usize;
        let _ = super::json_members::for_each(body, |key, value| {
            let start = value.as_ptr() as usize - base;
            let at = Some(start..start + value.len());
            match key {
                b"priority" => {
                    m.priority_at = at;
                    m.priority = serde_json::from_slice::<i64>(value).ok();
                }
                b"cache_salt" => m.salt_at = at,
                _ => {}
            }
        });
        m
    }
}

/// One member to set: `key` to the JSON text `value`, its old value at `at` (`None`:
/// the body has none).
struct Edit<'a> {
    key: &'a str,
    at: Option<Range<usize>>,
    value: &'a str,
}

impl Router {
    /// The request's ticket (its tenant and class) and the body to forward (rewritten
    /// as the module docs say, for a routed `endpoint`). Flow control off: the one
    /// ticket, the body as it came.
    pub(super) fn classify(
        &self,
        headers: &HeaderMap,
        body: Bytes,
        routed: bool,
    ) -> (Ticket, Bytes) {
        let Some(c) = self.flow.classifier() else {
            return (self.flow.default_ticket(), body);
        };
        let members = Members::read(&body);
        let ticket = c.ticket(headers, members.priority);
        if !routed {
            return (ticket, body);
        }
        let priority = self
            .flow
            .engine_priority()
            .then(|| c.engine_priority(ticket.class).to_string());
        let mut edits = Vec::new();
        if let Some(p) = &priority {
            edits.push(Edit {
                key: "priority",
                at: members.priority_at,
                value: p,
            });
        }
        if let Some(salt) = c.salt(ticket.tenant) {
            edits.push(Edit {
                key: "cache_salt",
                at: members.salt_at,
                value: salt,
            });
        }
        if edits.is_empty() {
            return (ticket, body);
        }
        (ticket, with_members(&body, &mut edits))
    }
}

impl Router {
    /// What the client is told when the queue refuses it: with flow control off, 503
    /// `queue_full` or `queue_timeout` (as before classes existed); on, 429 naming its
    /// class and the limit, never a 5xx.
    pub(super) fn refused(&self, ticket: Ticket, r: Refusal) -> ProxyError {
        let rule = self.flow.admission().rule(ticket.class);
        let Some(c) = self.flow.classifier() else {
            return match r {
                Refusal::Timeout { .. } => ProxyError::QueueTimeout {
                    ms: rule.timeout.as_millis() as u64,
                },
                Refusal::Full { max, .. } | Refusal::ClassFull { max } => {
                    ProxyError::QueueFull { max }
                }
            };
        };
        let class = std::sync::Arc::clone(c.class_name(ticket.class));
        let own = |key: &str| match rule.own {
            true => format!("proxy.queue.per_class.{class}.{key}"),
            false => format!("proxy.queue.{key}"),
        };
        let (why, limit, kind) = match r {
            Refusal::Full {
                max,
                evicted: false,
            } => (
                "the admission queue is full and no less urgent request, nor one of a tenant with more tokens waiting in its class, waits in it".to_string(),
                format!("proxy.queue.max_waiting: {max}"),
                "queue_full",
            ),
            Refusal::Full { max, evicted: true } => (
                "a more urgent request, or one of a tenant with fewer tokens waiting in its class, took this one's place in the full admission queue"
                    .to_string(),
                format!("proxy.queue.max_waiting: {max}"),
                "queue_full",
            ),
            Refusal::ClassFull { max } => (
                "its class's queue is full".to_string(),
                format!("{}: {max}", own("max_waiting")),
                "class_queue_full",
            ),
            Refusal::Timeout { waited } => (
                format!("no worker's slot freed for it in {} ms", waited.as_millis()),
                format!("{}: {}", own("timeout_ms"), rule.timeout.as_millis()),
                "queue_timeout",
            ),
        };
        ProxyError::Shed {
            class,
            why,
            limit,
            kind,
            retry_after: 1,
        }
    }
}

impl Router {
    /// A request over its tenant's token budget: 429 naming the limit, `Retry-After`
    /// the refill's time.
    pub(super) fn over_budget(&self, ticket: Ticket, over: Over) -> ProxyError {
        let class = self.flow.names(ticket).map_or_else(
            || std::sync::Arc::from("-"),
            |(_, c)| std::sync::Arc::clone(c),
        );
        ProxyError::Shed {
            class,
            why: "its tenant's token budget is spent".to_string(),
            limit: over.limit,
            kind: "budget_exceeded",
            retry_after: over.retry_after,
        }
    }
}

/// `body` with each edit's member set: a value at its `at` replaced, a member the body
/// lacks put first in its object. A body that is not an object, or edits out of its
/// bounds, leave it as it is.
fn with_members(body: &Bytes, edits: &mut [Edit<'_>]) -> Bytes {
    edits.sort_by_key(|e| e.at.as_ref().map(|r| r.start));
    let inserts = edits.iter().filter(|e| e.at.is_none()).count();
    let mut cursor = 0;
    let mut out = BytesMut::with_capacity(body.len() + 64);
    if inserts > 0 {
        let Some(open) = body.iter().position(|b| !b.is_ascii_whitespace()) else {
            return body.clone();
        };
        if body[open] != b'{' {
            return body.clone();
        }
        out.extend_from_slice(&body[..=open]);
        cursor = open + 1;
        for (i, e) in edits.iter().filter(|e| e.at.is_none()).enumerate() {
            if i > 0 {
                out.extend_from_slice(b",");
            }
            out.extend_from_slice(b"\"");
            out.extend_from_slice(e.key.as_bytes());
            out.extend_from_slice(b"\":");
            out.extend_from_slice(e.value.as_bytes());
        }
        if body[cursor..].iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'}') {
            out.extend_from_slice(b",");
        }
    }
    for e in edits.iter() {
        let Some(r) = &e.at else { continue };
        if r.start < cursor || r.end > body.len() {
            return body.clone();
        }
        out.extend_from_slice(&body[cursor..r.start]);
        out.extend_from_slice(e.value.as_bytes());
        cursor = r.end;
    }
    out.extend_from_slice(&body[cursor..]);
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(body: &str, priority: Option<&str>, salt: Option<&str>) -> String {
        let body = Bytes::from(body.to_string());
        let m = Members::read(&body);
        let mut edits = Vec::new();
        if let Some(value) = priority {
            edits.push(Edit {
                key: "priority",
                at: m.priority_at,
                value,
            });
        }
        if let Some(value) = salt {
            edits.push(Edit {
                key: "cache_salt",
                at: m.salt_at,
                value,
            });
        }
        let out = with_members(&body, &mut edits);
        String::from_utf8(out.to_vec()).unwrap()
    }

    #[test]
    fn the_members_are_read_and_replaced_or_added() {
        let m = Members::read(br#"{"messages":[{"priority":9}],"priority": -3 }"#);
        assert_eq!(m.priority, Some(-3));
        assert_eq!(Members::read(br#"{"priority":"high"}"#).priority, None);
        let p = Some("-1");
        assert_eq!(
            set(r#"{"model":"m","priority":5}"#, p, None),
            r#"{"model":"m","priority":-1}"#
        );
        assert_eq!(
            set(r#" {"model":"m"}"#, Some("1"), None),
            r#" {"priority":1,"model":"m"}"#
        );
        assert_eq!(set("{ }", Some("0"), None), r#"{"priority":0 }"#);
        assert_eq!(set("[1]", Some("0"), None), "[1]");
        let salt = Some(r#""t1""#);
        // The client's salt is replaced; the two members in either order.
        assert_eq!(
            set(r#"{"cache_salt":"mine","priority":2,"x":1}"#, p, salt),
            r#"{"cache_salt":"t1","priority":-1,"x":1}"#
        );
        assert_eq!(
            set(r#"{"priority":2,"cache_salt":"mine"}"#, p, salt),
            r#"{"priority":-1,"cache_salt":"t1"}"#
        );
        assert_eq!(
            set(r#"{"x":1}"#, p, salt),
            r#"{"priority":-1,"cache_salt":"t1","x":1}"#
        );
        assert_eq!(
            set(r#"{"priority":3}"#, p, salt),
            r#"{"cache_salt":"t1","priority":-1}"#
        );
    }
}
