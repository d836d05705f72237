//! The proxy's side of flow control (`crate::flow`): the body members it reads
//! (`priority`), found in one pass over the body's top level ([`super::json_members`]),
//! and the forwarded body's rewrite: with `priority.engine_priority` the request's class
//! is written as vLLM's `priority`. With flow control off nothing here runs.

use std::ops::Range;

use bytes::{Bytes, BytesMut};
use http::HeaderMap;

use super::Router;
use crate::error::ProxyError;
use crate::flow::{Refusal, Ticket};

/// The top-level members of a request body that flow control reads.
#[derive(Debug, Default)]
struct Members {
    /// vLLM's `priority` (an integer), when it is one.
    priority: Option<i64>,
    /// Where the `priority` value is, to be replaced.
    priority_at: Option<Range<usize>>,
}

impl Members {
    fn read(body: &[u8]) -> Self {
        let mut m = Members::default();
        let base = body.as_ptr() as usize;
        let _ = super::json_members::for_each(body, |key, value| {
            if key == b"priority" {
                let start = value.as_ptr() as usize - base;
                m.priority_at = Some(start..start + value.len());
                m.priority = serde_json::from_slice::<i64>(value).ok();
            }
        });
        m
    }
}

impl Router {
    /// The request's ticket (its tenant and class) and the body to forward (rewritten
    /// as the module docs say). Flow control off: the one ticket, the body as it came.
    pub(super) fn classify(&self, headers: &HeaderMap, body: Bytes) -> (Ticket, Bytes) {
        let Some(c) = self.flow.classifier() else {
            return (Ticket::default(), body);
        };
        let members = Members::read(&body);
        let ticket = c.ticket(headers, members.priority);
        if !self.flow.engine_priority() {
            return (ticket, body);
        }
        let value = c.engine_priority(ticket.class).to_string();
        let body = with_member(&body, "priority", members.priority_at, &value);
        (ticket, body)
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
                "the admission queue is full and no less urgent request waits in it".to_string(),
                format!("proxy.queue.max_waiting: {max}"),
                "queue_full",
            ),
            Refusal::Full { max, evicted: true } => (
                "a more urgent request took this one's place in the full admission queue"
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

/// `body` with the member `key` set to the JSON text `value`: the value at `at`
/// replaced, or (`at` `None`) a member put first in the object. A body that is not an
/// object is returned as it is.
fn with_member(body: &Bytes, key: &str, at: Option<Range<usize>>, value: &str) -> Bytes {
    let (head, tail, member) = match at {
        Some(r) if r.end <= body.len() => (&body[..r.start], &body[r.end..], false),
        Some(_) => return body.clone(),
        None => match body.iter().position(|b| !b.is_ascii_whitespace()) {
            Some(i) if body[i] == b'{' => (&body[..=i], &body[i + 1..], true),
            _ => return body.clone(),
        },
    };
    let mut out = BytesMut::with_capacity(body.len() + key.len() + value.len() + 4);
    out.extend_from_slice(head);
    if member {
        out.extend_from_slice(b"\"");
        out.extend_from_slice(key.as_bytes());
        out.extend_from_slice(b"\":");
    }
    out.extend_from_slice(value.as_bytes());
    if member && tail.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'}') {
        out.extend_from_slice(b",");
    }
    out.extend_from_slice(tail);
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(body: &str, value: &str) -> String {
        let body = Bytes::from(body.to_string());
        let m = Members::read(&body);
        let out = with_member(&body, "priority", m.priority_at, value);
        String::from_utf8(out.to_vec()).unwrap()
    }

    #[test]
    fn the_priority_member_is_read_and_replaced_or_added() {
        let m = Members::read(br#"{"messages":[{"priority":9}],"priority": -3 }"#);
        assert_eq!(m.priority, Some(-3));
        assert_eq!(Members::read(br#"{"priority":"high"}"#).priority, None);
        assert_eq!(
            set(r#"{"model":"m","priority":5}"#, "-1"),
            r#"{"model":"m","priority":-1}"#
        );
        assert_eq!(
            set(r#" {"model":"m"}"#, "1"),
            r#" {"priority":1,"model":"m"}"#
        );
        assert_eq!(set("{ }", "0"), r#"{"priority":0 }"#);
        assert_eq!(set("[1]", "0"), "[1]");
    }
}
