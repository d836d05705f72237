//! What one worker serves: its model list as last read from its `GET /v1/models` (or
//! pinned by `workers[].models`), held in a slot the request path reads without a lock
//! or an await ([`Worker::served`](super::Worker::served)).
//!
//! A list has the engines' shape, `{"object":"list","data":[{"id":…}, …]}`: vLLM lists
//! one base entry per served name (`--served-model-name a b` gives `a` and `b`, the
//! same `root`) and every registered LoRA adapter (`parent` = its base's name); SGLang
//! its one served name and, newer versions, its adapters likewise. A worker whose list
//! cannot be read (no `/v1/models`, an answer that is not a list) **serves any model**,
//! as a router without model lists treats every worker; one that cannot be reached
//! keeps what it listed last (it is down, and health checks say so).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{Fetch, Target, Worker};

/// Largest model list read, in bytes (vLLM lists every adapter ever registered).
pub const MAX_LIST_BYTES: usize = 4 << 20;

/// Path of the model list below a worker's URL.
pub const LIST_PATH: &str = "/v1/models";

/// Where a worker's list came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListSource {
    /// `workers[].models`: never read.
    Pinned,
    /// Its `GET /v1/models`, read at [`Served::read_at`].
    Listed,
    /// Not read yet (it just joined): serves any model until it is.
    Unread,
    /// Its answer was no model list (no `/v1/models`, an error status, another
    /// shape): serves any model.
    Unreadable,
}

impl ListSource {
    /// The word `/workers` shows.
    pub fn as_str(self) -> &'static str {
        match self {
            ListSource::Pinned => "pinned",
            ListSource::Listed => "listed",
            ListSource::Unread => "unread",
            ListSource::Unreadable => "unreadable",
        }
    }
}

/// One entry of a worker's list: a base model's served name, or an adapter.
#[derive(Debug, Clone)]
pub struct ServedModel {
    /// The name a request's `model` gives (`id`).
    pub id: Arc<str>,
    /// The base model's name, for an adapter (`parent`); `None` for a base model.
    pub parent: Option<Arc<str>>,
    /// What the engine loaded it from (`root`): a base's served names that share it
    /// are aliases of one model.
    pub root: Option<Box<str>>,
    /// The entry as the worker listed it (`GET /v1/models` passes it on); for a
    /// pinned name, a minimal card.
    pub card: Arc<RawValue>,
    /// Who serves it (`owned_by`: `vllm`, `sglang`, …), as listed.
    pub owned_by: Option<Box<str>>,
}

impl ServedModel {
    /// Whether it is a LoRA adapter (it names a parent).
    pub fn is_adapter(&self) -> bool {
        self.parent.is_some()
    }

    /// What identifies it across reads (the engines' `created` and permission ids
    /// change on every call).
    fn identity(&self) -> (&str, Option<&str>, Option<&str>) {
        (&self.id, self.parent.as_deref(), self.root.as_deref())
    }
}

/// What a worker serves, as last learned. See the module docs.
#[derive(Debug, Clone)]
pub struct Served {
    pub source: ListSource,
    /// In the worker's order; empty unless [`ListSource::Listed`] or
    /// [`ListSource::Pinned`] (or kept from before an unreachable read).
    pub models: Arc<[ServedModel]>,
    /// When the list was last read (an answer, of either kind); `None` before.
    pub read_at: Option<SystemTime>,
    /// Why the last read gave no list (a status, a connect error, the shape); `None`
    /// after a good one.
    pub error: Option<String>,
}

impl Served {
    /// The state of a worker that just joined: pinned (`names`), or not read yet.
    pub fn initial(pinned: Option<&[String]>) -> Served {
        match pinned {
            Some(names) => Served {
                source: ListSource::Pinned,
                models: names.iter().map(|n| pinned_card(n)).collect(),
                read_at: None,
                error: None,
            },
            None => Served {
                source: ListSource::Unread,
                models: Arc::from([]),
                read_at: None,
                error: None,
            },
        }
    }

    /// Whether it takes a request for any model (its list is unknown).
    pub fn serves_any(&self) -> bool {
        matches!(self.source, ListSource::Unread | ListSource::Unreadable)
    }

    /// Whether it lists `name` (a base model's served name or an adapter).
    pub fn lists(&self, name: &str) -> bool {
        self.models.iter().any(|m| *m.id == *name)
    }

    /// Whether its list says it is SGLang (`owned_by: sglang`): it takes an adapter as
    /// `model: "base:adapter"`, and loads one at `/load_lora_adapter`.
    pub fn is_sglang(&self) -> bool {
        self.models
            .iter()
            .any(|m| m.owned_by.as_deref() == Some("sglang"))
    }

    /// The base model's served name an adapter request for `adapter` names here: its
    /// listed parent, else the first base model it lists.
    pub fn base_for(&self, adapter: &str) -> Option<&Arc<str>> {
        self.models
            .iter()
            .find(|m| *m.id == *adapter)
            .and_then(|m| m.parent.as_ref())
            .or_else(|| self.models.iter().find(|m| !m.is_adapter()).map(|m| &m.id))
    }

    /// Whether it routes as `other` does: same source kind as far as routing goes and
    /// the same entries (ids, parents, roots) in the same order.
    pub fn routes_as(&self, other: &Served) -> bool {
        self.serves_any() == other.serves_any()
            && self.models.len() == other.models.len()
            && self
                .models
                .iter()
                .zip(other.models.iter())
                .all(|(a, b)| a.identity() == b.identity())
    }
}

fn pinned_card(name: &str) -> ServedModel {
    let card = serde_json::json!({"id": name, "object": "model", "owned_by": "cache-aware-router"});
    ServedModel {
        id: Arc::from(name),
        parent: None,
        root: None,
        card: Arc::from(serde_json::value::to_raw_value(&card).unwrap_or_else(|_| empty_card())),
        owned_by: None,
    }
}

fn empty_card() -> Box<RawValue> {
    RawValue::from_string("{}".to_string()).expect("`{}` is JSON")
}

#[derive(Deserialize)]
struct List<'a> {
    #[serde(borrow)]
    data: Vec<&'a RawValue>,
}

#[derive(Deserialize)]
struct Entry {
    id: Option<String>,
    parent: Option<String>,
    root: Option<String>,
    owned_by: Option<String>,
}

/// The entries of a `GET /v1/models` answer; `Err` says why it is no model list.
/// Entries without a string `id` are left out.
pub fn parse_list(body: &[u8]) -> Result<Vec<ServedModel>, String> {
    let list: List<'_> = serde_json::from_slice(body)
        .map_err(|e| format!("not a model list ({{\"data\": [...]}}): {e}"))?;
    let mut out: Vec<ServedModel> = Vec::with_capacity(list.data.len());
    for raw in list.data {
        let Ok(Entry {
            id: Some(id),
            parent,
            root,
            owned_by,
        }) = serde_json::from_str::<Entry>(raw.get())
        else {
            continue;
        };
        if id.is_empty() || out.iter().any(|m| *m.id == *id) {
            continue;
        }
        out.push(ServedModel {
            id: Arc::from(id),
            parent: parent.filter(|p| !p.is_empty()).map(Arc::from),
            root: root.map(String::into_boxed_str),
            card: Arc::from(raw.to_owned()),
            owned_by: owned_by.map(String::into_boxed_str),
        });
    }
    Ok(out)
}

/// What a read of the list (an answer, or why there was none) makes of `before`.
pub fn after_read(before: &Served, answer: Result<(http::StatusCode, Bytes), String>) -> Served {
    let now = Some(SystemTime::now());
    match answer {
        Ok((status, body)) if status.is_success() => match parse_list(&body) {
            Ok(models) => Served {
                source: ListSource::Listed,
                models: models.into(),
                read_at: now,
                error: None,
            },
            Err(why) => unreadable(why, now),
        },
        Ok((status, _)) => unreadable(format!("status {status}"), now),
        // Unreachable: it keeps what it listed (health checks take it out meanwhile).
        Err(why) => Served {
            error: Some(why),
            ..before.clone()
        },
    }
}

fn unreadable(why: String, read_at: Option<SystemTime>) -> Served {
    Served {
        source: ListSource::Unreadable,
        models: Arc::from([]),
        read_at,
        error: Some(why),
    }
}

/// Reads `worker`'s list (unless pinned) within `timeout` and stores what it says.
/// Returns whether what the worker routes changed.
pub async fn refresh<F: Fetch>(fetch: &F, worker: &Arc<Worker>, timeout: Duration) -> bool {
    let before = worker.served();
    if before.source == ListSource::Pinned {
        return false;
    }
    let answer = fetch
        .get(worker, Target::Path(LIST_PATH), timeout, MAX_LIST_BYTES)
        .await;
    let after = after_read(&before, answer);
    let changed = !after.routes_as(&before);
    if changed {
        match after.source {
            ListSource::Listed => {
                let ids: Vec<&str> = after.models.iter().map(|m| &*m.id).collect();
                tracing::info!(worker = %worker.url(), models = ?ids, "worker's model list");
            }
            _ => tracing::info!(
                worker = %worker.url(),
                reason = after.error.as_deref().unwrap_or(""),
                "worker's model list cannot be read: it serves any model"
            ),
        }
    }
    worker.set_served(after);
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"{"object":"list","data":[
        {"id":"llama","object":"model","created":1,"owned_by":"vllm","root":"/m/llama","parent":null,"max_model_len":4096},
        {"id":"l3","object":"model","created":1,"owned_by":"vllm","root":"/m/llama","parent":null},
        {"id":"sql","object":"model","created":1,"owned_by":"vllm","root":"/a/sql","parent":"llama"},
        {"object":"model"}
    ]}"#;

    #[test]
    fn a_vllm_list_gives_bases_aliases_and_adapters_with_their_cards() {
        let m = parse_list(VLLM.as_bytes()).unwrap();
        let ids: Vec<&str> = m.iter().map(|m| &*m.id).collect();
        assert_eq!(
            ids,
            ["llama", "l3", "sql"],
            "an entry without id is left out"
        );
        assert_eq!(m[1].root.as_deref(), Some("/m/llama"));
        assert_eq!(m[2].parent.as_deref(), Some("llama"));
        assert!(m[2].is_adapter() && !m[0].is_adapter());
        assert!(
            m[0].card.get().contains("max_model_len"),
            "passed on as listed"
        );
    }

    #[test]
    fn an_answer_that_is_no_list_serves_any_model_and_an_unreachable_one_keeps_its_list() {
        let ok = |b: &str| Ok((http::StatusCode::OK, Bytes::from(b.to_string())));
        let listed = after_read(&Served::initial(None), ok(VLLM));
        assert_eq!(listed.source, ListSource::Listed);
        assert!(!listed.serves_any());
        for answer in [
            ok(r#"{"choices":[]}"#),
            ok("not json"),
            Ok((http::StatusCode::NOT_FOUND, Bytes::new())),
        ] {
            let s = after_read(&listed, answer);
            assert!(s.serves_any() && s.error.is_some(), "{s:?}");
        }
        let kept = after_read(&listed, Err("connect refused".into()));
        assert!(kept.routes_as(&listed) && kept.error.is_some());
        assert!(
            after_read(&Served::initial(None), Err("refused".into())).serves_any(),
            "never read: still any"
        );
    }

    #[test]
    fn only_ids_parents_and_roots_count_as_a_change() {
        let a = after_read(
            &Served::initial(None),
            Ok((http::StatusCode::OK, Bytes::from(VLLM))),
        );
        let later = VLLM.replace("\"created\":1", "\"created\":2");
        let b = after_read(&a, Ok((http::StatusCode::OK, Bytes::from(later))));
        assert!(a.routes_as(&b));
        let gone = VLLM.replace("\"id\":\"sql\"", "\"id\":\"sql2\"");
        let c = after_read(&a, Ok((http::StatusCode::OK, Bytes::from(gone))));
        assert!(!a.routes_as(&c));
    }

    #[test]
    fn pinned_names_are_cards_of_their_own() {
        let s = Served::initial(Some(&["a".into(), "b".into()]));
        assert_eq!(s.source, ListSource::Pinned);
        assert_eq!(s.models.len(), 2);
        assert!(s.models[1].card.get().contains(r#""id":"b""#));
    }
}
