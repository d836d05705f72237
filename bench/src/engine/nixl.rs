//! vLLM's NixlConnector wire contract as the engine sees it (`kv_connector: nixl`; see
//! `shared/docs/pd-disaggregation.md`): `kv_transfer_params` in a request body makes the
//! engine a prefill for a remote decoder or a decoder of a remote prefill.
//!
//! - **Prefill** (`do_remote_decode: true`): computed as any request; a non-streamed
//!   answer (it finishes on its length cap, as every simulated request does) carries a
//!   top-level `kv_transfer_params` of the NIXL shape: `do_remote_prefill: true`,
//!   `do_remote_decode: false`, `remote_engine_id` (the engine's name),
//!   `remote_request_id`, `remote_block_ids` (one id per block of the prompt, the last
//!   partial one included), `remote_host`, `remote_port` (vLLM's side-channel defaults)
//!   and `tp_size`.
//! - **Decode** (`do_remote_prefill: true` with `remote_block_ids`, `remote_engine_id`,
//!   `remote_request_id`, `remote_host` and `remote_port`): the prompt's KV is read from
//!   the prefill engine instead of computed. The engine pulls only the blocks it does not
//!   hold itself (as vLLM's decode does), which costs `kv_transfer_base +
//!   kv_transfer_per_token × tokens pulled` while the request waits (off the
//!   accelerator: the other requests keep decoding), then computes the prompt's last
//!   token and decodes. The pulled blocks join its prefix cache; the usage reports the
//!   prompt as cached, all but its last token (vLLM counts transferred KV as cached).
//!   Params without every field vLLM needs are ignored with the prompt computed locally,
//!   as vLLM does ("invalid KVTransferParams"), and counted.
//!
//! The prefill engine does not hold the blocks for a lease here (its cache is the usual
//! LRU): a decode always finds them.

use serde_json::{Value, json};

/// The KV connector of an engine (vLLM's `--kv-transfer-config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvConnector {
    /// None: `kv_transfer_params` are ignored.
    #[default]
    None,
    /// NixlConnector with `kv_role: kv_both`: each request's params say its role.
    Nixl,
}

impl KvConnector {
    /// `none` or `nixl` (what [`std::str::FromStr`] reads).
    pub fn as_str(self) -> &'static str {
        match self {
            KvConnector::None => "none",
            KvConnector::Nixl => "nixl",
        }
    }
}

impl std::fmt::Display for KvConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for KvConnector {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "none" => Ok(KvConnector::None),
            "nixl" => Ok(KvConnector::Nixl),
            other => Err(format!("unknown KV connector {other:?}: use none or nixl")),
        }
    }
}

/// What a request's `kv_transfer_params` ask of the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KvRole {
    /// Compute the prompt for a remote decoder and hand it off.
    Prefill,
    /// Read the prompt's KV (this many blocks) from a remote prefill.
    Decode { blocks: u64 },
    /// Params a decode cannot act on: the prompt is computed here.
    Invalid,
}

/// The role `params` (a request's `kv_transfer_params`) give; `None` for none (absent,
/// null, or neither side remote).
pub(super) fn role(params: &Value) -> Option<KvRole> {
    let p = params.as_object()?;
    let yes = |k: &str| p.get(k).and_then(Value::as_bool) == Some(true);
    if yes("do_remote_decode") {
        return Some(KvRole::Prefill);
    }
    if !yes("do_remote_prefill") {
        return None;
    }
    let present = |k: &str| p.get(k).is_some_and(|v| !v.is_null());
    let complete = [
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
    ]
    .iter()
    .all(|k| present(k));
    // One list of block ids, or one per KV-cache group (the first counts).
    let ids = p.get("remote_block_ids").and_then(Value::as_array);
    let blocks = ids.map(|ids| match ids.first() {
        Some(Value::Array(group)) => group.len() as u64,
        _ => ids.len() as u64,
    });
    match blocks {
        Some(blocks) if complete && blocks > 0 => Some(KvRole::Decode { blocks }),
        _ => Some(KvRole::Invalid),
    }
}

/// The `kv_transfer_params` a prefill engine named `engine` answers request `id` with,
/// for a prompt of `blocks` blocks.
pub(super) fn handoff(engine: &str, id: &str, blocks: u64) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": engine,
        "remote_request_id": id,
        "remote_block_ids": (0..blocks).collect::<Vec<u64>>(),
        "remote_host": "localhost",
        "remote_port": 5600,
        "tp_size": 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_give_the_role_vllm_reads_in_them() {
        assert_eq!(
            role(&json!({"do_remote_decode": true, "do_remote_prefill": false})),
            Some(KvRole::Prefill)
        );
        let handed = handoff("p0", "r1", 3);
        assert_eq!(role(&handed), Some(KvRole::Decode { blocks: 3 }));
        let mut grouped = handed.clone();
        grouped["remote_block_ids"] = json!([[1, 2], [3, 4]]);
        assert_eq!(role(&grouped), Some(KvRole::Decode { blocks: 2 }));
        let mut partial = handed;
        partial["remote_host"] = Value::Null;
        assert_eq!(role(&partial), Some(KvRole::Invalid));
        assert_eq!(
            role(&json!({"do_remote_prefill": true})),
            Some(KvRole::Invalid)
        );
        assert_eq!(role(&Value::Null), None);
        assert_eq!(role(&json!({"do_remote_decode": false})), None);
    }
}
