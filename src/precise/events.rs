//! vLLM KV-cache events off the wire: ZeroMQ frames and msgpack payloads in, typed
//! [`Batch`]es out. Pure: no sockets, no clocks, no index.
//!
//! Implements `shared/docs/vllm-kv-events.md`:
//! - §3 live framing: `[topic, seq (8 bytes, big-endian), payload]` ([`live_frames`]);
//! - §7.2 replay replies, both layouts, and their terminator ([`replay_frames`]);
//! - §4.1 the batch: an array `[ts, events, dp_rank?, publisher_id?]` (2 to 4 elements,
//!   extras ignored), or a map with the same names;
//! - §4.2 events as tagged maps (current) or tagged arrays (legacy), decided per event;
//!   unknown fields ignored, missing trailing array fields read as nil;
//! - §4.3 the fields of `BlockStored`, `BlockRemoved` and `AllBlocksCleared`;
//! - §4.4 block hashes: an int of any width or sign, or bytes (last 8, big-endian).
//!
//! A payload that is not one msgpack value of the batch's shape is a [`DecodeError`]
//! (the caller counts and skips the message). Inside a good batch, an event with an
//! unknown tag or a bad field is skipped and counted in [`Batch::skipped`]; the rest of
//! the batch stands (§10).

use bytes::Bytes;
use rmpv::ValueRef;

/// One decoded `KVEventBatch` (§4.1).
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Publish time, seconds since the Unix epoch (0 when absent).
    pub ts: f64,
    /// The events that decoded, in order.
    pub events: Vec<Event>,
    /// `data_parallel_rank`; `None` when absent or nil (vLLM before mid-2025).
    pub dp_rank: Option<i64>,
    /// `publisher_id` (NEWEST, snapshot mode): changes when the publisher restarts.
    pub publisher_id: Option<Vec<u8>>,
    /// Events left out: unknown tag, or a field of the wrong type or length.
    pub skipped: u32,
}

/// One event of a batch (§4.3).
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Stored(BlockStored),
    Removed(BlockRemoved),
    /// `AllBlocksCleared`: the engine's prefix cache was reset (§5.5).
    AllCleared,
}

/// `BlockStored`: a contiguous run of newly cached full blocks of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    /// Engine hashes of the blocks, in sequence order (§4.4, normalised to u64).
    pub block_hashes: Vec<u64>,
    /// Engine hash of the block before the first one; `None` when the run starts at
    /// token 0.
    pub parent_block_hash: Option<u64>,
    /// Every token of those blocks: `block_hashes.len() * block_size` ids; empty for a
    /// host-tier copy announced by hash only (vLLM's CPU-offloading connector).
    pub token_ids: Vec<u32>,
    /// Tokens per block; 0 when the event does not say (the offloading connector).
    pub block_size: usize,
    /// The adapter: `lora_name`, else `lora_id` as text; `None` for the base model.
    pub lora: Option<String>,
    /// Storage tier (`"GPU"`, `"CPU"`, …); `None` when the engine sent nil.
    pub medium: Option<String>,
    /// Per block, a digest of its `extra_keys` entry (multimodal ids, cache salt…), or
    /// `None` for a block without one. Empty when the field is nil or absent.
    pub extra_keys: Vec<Option<u64>>,
    /// KV-cache group for hybrid models (`None` = absent: an ordinary model).
    pub group_idx: Option<i64>,
    /// `kv_cache_spec_kind`, e.g. `"full_attention"`.
    pub kind: Option<String>,
}

/// `BlockRemoved`: blocks evicted from the cache.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<u64>,
    pub medium: Option<String>,
    pub group_idx: Option<i64>,
}

/// Why a message was not decoded. The consumer counts it and goes on.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("expected {expected} frames, got {got}")]
    Frames { expected: &'static str, got: usize },
    #[error("sequence frame is {0} bytes, not 8")]
    Sequence(usize),
    #[error("payload is not msgpack: {0}")]
    Msgpack(#[from] rmpv::decode::Error),
    #[error("{0} bytes left after the batch")]
    Trailing(usize),
    #[error("batch is not an array of at least 2 elements or a map")]
    BatchShape,
    #[error("batch has no events array")]
    Events,
}

/// A live message's sequence number and payload (§3): exactly three frames.
pub fn live_frames(frames: &[Bytes]) -> Result<(u64, &[u8]), DecodeError> {
    match frames {
        [_topic, seq, payload] => Ok((sequence(seq)?, payload)),
        _ => Err(DecodeError::Frames {
            expected: "3 (topic, sequence, payload)",
            got: frames.len(),
        }),
    }
}

/// One reply of the replay service as a DEALER receives it (§7.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayFrame<'a> {
    /// A buffered batch.
    Batch { seq: u64, payload: &'a [u8] },
    /// The terminator: every batch from the requested sequence on has been sent.
    End,
}

/// Parses a replay reply: an optional empty delimiter, then `[topic, seq, payload]`
/// (vLLM ≥ 0.26) or `[seq, payload]` (earlier). An all-`FF` sequence or an empty
/// payload is the terminator.
pub fn replay_frames(frames: &[Bytes]) -> Result<ReplayFrame<'_>, DecodeError> {
    let frames = match frames {
        [first, rest @ ..] if first.is_empty() && rest.len() >= 2 => rest,
        _ => frames,
    };
    let (seq, payload) = match frames {
        [_, seq, payload] | [seq, payload] => (seq, payload),
        _ => {
            return Err(DecodeError::Frames {
                expected: "2 or 3 after the delimiter",
                got: frames.len(),
            });
        }
    };
    let seq = sequence(seq)?;
    if seq == u64::MAX || payload.is_empty() {
        return Ok(ReplayFrame::End);
    }
    Ok(ReplayFrame::Batch { seq, payload })
}

/// The 8-byte big-endian sequence frame.
fn sequence(frame: &[u8]) -> Result<u64, DecodeError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError::Sequence(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// The 8-byte big-endian frame that asks the replay service for every batch from
/// `start` on (§7.1; a DEALER sends it after an empty delimiter frame).
pub fn replay_request(start: u64) -> [u8; 8] {
    start.to_be_bytes()
}

/// Nesting limit handed to rmpv (it counts about two per level): a batch needs five
/// levels down to an `extra_keys` entry, so 32 leaves room for the entry's own nesting
/// while a hostile payload cannot recurse deep.
const MAX_DEPTH: usize = 32;

/// Decodes one payload: a msgpack `KVEventBatch` (§4).
pub fn decode_batch(payload: &[u8]) -> Result<Batch, DecodeError> {
    let mut rest = payload;
    let value = rmpv::decode::read_value_ref_with_max_depth(&mut rest, MAX_DEPTH)?;
    if !rest.is_empty() {
        return Err(DecodeError::Trailing(rest.len()));
    }
    let (ts, events, rank, publisher) = match &value {
        ValueRef::Array(a) if a.len() >= 2 => (Some(&a[0]), &a[1], a.get(2), a.get(3)),
        ValueRef::Map(m) => {
            let field = |name| map_get(m, name);
            let events = field("events").ok_or(DecodeError::Events)?;
            (
                field("ts"),
                events,
                field("data_parallel_rank"),
                field("publisher_id"),
            )
        }
        _ => return Err(DecodeError::BatchShape),
    };
    let ValueRef::Array(raw_events) = events else {
        return Err(DecodeError::Events);
    };
    let mut batch = Batch {
        ts: ts.and_then(as_f64).unwrap_or(0.0),
        events: Vec::with_capacity(raw_events.len()),
        dp_rank: rank.and_then(|r| as_int(r)),
        publisher_id: match publisher {
            Some(ValueRef::Binary(b)) => Some(b.to_vec()),
            _ => None,
        },
        skipped: 0,
    };
    for raw in raw_events {
        match decode_event(raw) {
            Some(e) => batch.events.push(e),
            None => batch.skipped += 1,
        }
    }
    Ok(batch)
}

/// An event's fields by name (map form) or position (legacy array form, §4.2).
enum Fields<'v, 'a> {
    Map(&'v [(ValueRef<'a>, ValueRef<'a>)]),
    Array(&'v [ValueRef<'a>]),
}

impl<'v, 'a> Fields<'v, 'a> {
    /// The field `name` (map) or at `pos` (array, the tag at 0); `None` when absent or
    /// nil.
    fn get(&self, name: &str, pos: usize) -> Option<&'v ValueRef<'a>> {
        let v = match self {
            Fields::Map(m) => map_get(m, name),
            Fields::Array(a) => a.get(pos),
        };
        v.filter(|v| !matches!(v, ValueRef::Nil))
    }
}

/// `None` for an unknown tag or a malformed field (the event is skipped).
fn decode_event(raw: &ValueRef<'_>) -> Option<Event> {
    let (tag, fields) = match raw {
        ValueRef::Map(m) => (map_get(m, "type")?, Fields::Map(m)),
        ValueRef::Array(a) => (a.first()?, Fields::Array(a)),
        _ => return None,
    };
    match as_str(tag)? {
        "BlockStored" => decode_stored(&fields).map(Event::Stored),
        "BlockRemoved" => Some(Event::Removed(BlockRemoved {
            block_hashes: hashes(fields.get("block_hashes", 1)?)?,
            medium: opt_string(fields.get("medium", 2))?,
            group_idx: opt_int(fields.get("group_idx", 3))?,
        })),
        "AllBlocksCleared" => Some(Event::AllCleared),
        _ => None,
    }
}

fn decode_stored(f: &Fields<'_, '_>) -> Option<BlockStored> {
    let block_hashes = hashes(f.get("block_hashes", 1)?)?;
    let parent_block_hash = match f.get("parent_block_hash", 2) {
        None => None,
        Some(v) => Some(hash(v)?),
    };
    let ValueRef::Array(tokens) = f.get("token_ids", 3)? else {
        return None;
    };
    let token_ids = tokens
        .iter()
        .map(|t| as_int(t).and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<Vec<u32>>>()?;
    // A host-tier copy from vLLM's offloading connector has no tokens and a block size
    // of 0 (or its own, larger one): it is placed by hash, so only a run with tokens
    // must add up.
    let block_size = match f.get("block_size", 4) {
        Some(v) => usize::try_from(as_int(v)?).ok()?,
        None => 0,
    };
    if !token_ids.is_empty()
        && (block_size == 0 || Some(token_ids.len()) != block_hashes.len().checked_mul(block_size))
    {
        return None;
    }
    let lora = match opt_string(f.get("lora_name", 7))? {
        Some(name) => Some(name),
        None => opt_int(f.get("lora_id", 5))?.map(|id| format!("id:{id}")),
    };
    let extra_keys = match f.get("extra_keys", 8) {
        None => Vec::new(),
        Some(ValueRef::Array(per_block)) if per_block.len() == block_hashes.len() => {
            per_block.iter().map(extra_digest).collect()
        }
        Some(_) => return None,
    };
    Some(BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        lora,
        medium: opt_string(f.get("medium", 6))?,
        extra_keys,
        group_idx: opt_int(f.get("group_idx", 9))?,
        kind: opt_string(f.get("kv_cache_spec_kind", 10))?,
    })
}

/// The digest [`extra_digest`] gives an `extra_keys` entry that is an array of strings,
/// as vLLM writes LoRA names and cache salts (`to_event_extra_keys` in vLLM 0.32
/// `v1/core/kv_cache_utils.py`: `[lora_name]` on every block of an adapter's request,
/// `[cache_salt]` or `[lora_name, cache_salt]` on its first block). Lets a request's
/// keys be chained the way its engine blocks are.
pub fn strings_digest(items: &[&str]) -> u64 {
    let items: Vec<ValueRef<'_>> = items.iter().map(|s| ValueRef::from(*s)).collect();
    extra_digest(&ValueRef::Array(items)).unwrap_or_default()
}

/// A digest of one block's `extra_keys` entry: opaque (§4.3), so its msgpack bytes are
/// hashed. `None` for nil.
fn extra_digest(v: &ValueRef<'_>) -> Option<u64> {
    if matches!(v, ValueRef::Nil) {
        return None;
    }
    let mut buf = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value_ref(&mut buf, v);
    Some(xxhash_rust::xxh3::xxh3_64(&buf))
}

fn map_get<'v, 'a>(m: &'v [(ValueRef<'a>, ValueRef<'a>)], name: &str) -> Option<&'v ValueRef<'a>> {
    m.iter()
        .find(|(k, _)| as_str(k) == Some(name))
        .map(|(_, v)| v)
}

fn as_str<'v>(v: &'v ValueRef<'_>) -> Option<&'v str> {
    match v {
        ValueRef::String(s) => s.as_str(),
        _ => None,
    }
}

fn as_int(v: &ValueRef<'_>) -> Option<i64> {
    match v {
        ValueRef::Integer(i) => i.as_i64(),
        _ => None,
    }
}

fn as_f64(v: &ValueRef<'_>) -> Option<f64> {
    match v {
        ValueRef::F64(x) => Some(*x),
        ValueRef::F32(x) => Some(f64::from(*x)),
        ValueRef::Integer(i) => i.as_f64(),
        _ => None,
    }
}

/// A present field that must be a string or nil: `Some(None)` for absent, `None` (skip
/// the event) for another type.
fn opt_string(v: Option<&ValueRef<'_>>) -> Option<Option<String>> {
    match v {
        None => Some(None),
        Some(v) => as_str(v).map(|s| Some(s.to_string())),
    }
}

fn opt_int(v: Option<&ValueRef<'_>>) -> Option<Option<i64>> {
    match v {
        None => Some(None),
        Some(v) => as_int(v).map(Some),
    }
}

fn hashes(v: &ValueRef<'_>) -> Option<Vec<u64>> {
    match v {
        ValueRef::Array(a) => a.iter().map(hash).collect(),
        _ => None,
    }
}

/// §4.4: an int of any width or sign is reinterpreted as u64; bytes give their last 8
/// bytes read big-endian, left-padded with zeros when shorter.
fn hash(v: &ValueRef<'_>) -> Option<u64> {
    match v {
        ValueRef::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|x| x as u64)),
        ValueRef::Binary(b) => {
            let tail = &b[b.len().saturating_sub(8)..];
            Some(
                tail.iter()
                    .fold(0u64, |acc, byte| acc << 8 | u64::from(*byte)),
            )
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unhex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// §6: the current-format test vector (289 bytes, msgspec 0.23).
    const CURRENT: &str = "
    93cb41da556e40100000938ba474797065ab426c6f636b53746f726564ac626c6f636b5f6861
    7368657392cfa1b2c3d4e5f607182ab1706172656e745f626c6f636b5f68617368c0a9746f6b
    656e5f69647398cd03e8cd03e9cd03eacd03ebcd03eccd03edcd03eecd03efaa626c6f636b5f
    73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65
    787472615f6b65797392c0c0a967726f75705f69647800b26b765f63616368655f737065635f
    6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564
    ac626c6f636b5f6861736865739107a66d656469756da3475055a967726f75705f6964780081
    a474797065b0416c6c426c6f636b73436c656172656400";

    /// §6: the same batch in the legacy (tagged-array) format, 112 bytes.
    const LEGACY: &str = "
    93cb41da556e40100000939cab426c6f636b53746f72656492cfa1b2c3d4e5f607182ac098cd
    03e8cd03e9cd03eacd03ebcd03eccd03edcd03eecd03ef04c0a3475055c0c0c0c0c094ac426c
    6f636b52656d6f7665649107a3475055c091b0416c6c426c6f636b73436c656172656400";

    fn expected_events() -> Vec<Event> {
        vec![
            Event::Stored(BlockStored {
                block_hashes: vec![11651590505119483672, 42],
                parent_block_hash: None,
                token_ids: (1000..1008).collect(),
                block_size: 4,
                lora: None,
                medium: Some("GPU".into()),
                extra_keys: vec![None, None],
                group_idx: Some(0),
                kind: Some("full_attention".into()),
            }),
            Event::Removed(BlockRemoved {
                block_hashes: vec![7],
                medium: Some("GPU".into()),
                group_idx: Some(0),
            }),
            Event::AllCleared,
        ]
    }

    #[test]
    fn spec_vectors_decode_the_same_in_both_encodings() {
        let current = unhex(CURRENT);
        assert_eq!(current.len(), 289);
        let legacy = unhex(LEGACY);
        assert_eq!(legacy.len(), 112);
        let a = decode_batch(&current).unwrap();
        let b = decode_batch(&legacy).unwrap();
        assert_eq!(a.events, expected_events());
        assert_eq!(a.dp_rank, Some(0));
        assert_eq!(a.skipped, 0);
        assert!((a.ts - 1_767_225_600.25).abs() < 1e-6);
        let mut b_fixed = b.clone();
        // The legacy vector carries no extra_keys / group / kind (all nil).
        if let Event::Stored(s) = &mut b_fixed.events[0] {
            assert_eq!(s.extra_keys, Vec::<Option<u64>>::new());
            assert_eq!(s.group_idx, None);
            assert_eq!(s.kind, None);
            s.extra_keys = vec![None, None];
            s.group_idx = Some(0);
            s.kind = Some("full_attention".into());
        }
        if let Event::Removed(r) = &mut b_fixed.events[1] {
            assert_eq!(r.group_idx, None);
            r.group_idx = Some(0);
        }
        assert_eq!(b_fixed.events, expected_events());
        assert_eq!(b.dp_rank, Some(0));
    }

    /// Builds msgpack bytes from an rmpv value (hand-built test input).
    fn encode(v: &rmpv::Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn s(x: &str) -> rmpv::Value {
        rmpv::Value::from(x)
    }

    fn map(pairs: Vec<(&str, rmpv::Value)>) -> rmpv::Value {
        rmpv::Value::Map(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
    }

    fn arr(v: Vec<rmpv::Value>) -> rmpv::Value {
        rmpv::Value::Array(v)
    }

    fn ints(v: impl IntoIterator<Item = u64>) -> rmpv::Value {
        arr(v.into_iter().map(rmpv::Value::from).collect())
    }

    #[test]
    fn two_element_batch_without_rank_and_unknown_fields_are_accepted() {
        let stored = map(vec![
            ("block_size", 2.into()),
            ("type", s("BlockStored")),
            ("token_ids", ints([5, 6])),
            ("block_hashes", ints([9])),
            ("parent_block_hash", 3.into()),
            ("locality", s("LOCAL")),
            ("something_new", map(vec![("x", 1.into())])),
        ]);
        let bytes = encode(&arr(vec![1.5.into(), arr(vec![stored])]));
        let b = decode_batch(&bytes).unwrap();
        assert_eq!(b.dp_rank, None);
        assert_eq!(b.skipped, 0);
        let Event::Stored(e) = &b.events[0] else {
            panic!("{b:?}")
        };
        assert_eq!(
            (e.parent_block_hash, &e.token_ids[..], e.medium.as_deref()),
            (Some(3), &[5, 6][..], None)
        );
    }

    #[test]
    fn hashes_normalise_from_every_width_sign_and_bytes() {
        let mut digest = vec![0u8; 24];
        digest.extend_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        let removed = arr(vec![
            s("BlockRemoved"),
            arr(vec![
                rmpv::Value::from(7u8),
                rmpv::Value::from(u64::MAX),
                rmpv::Value::from(-1i64),
                rmpv::Value::Binary(digest),
                rmpv::Value::Binary(vec![0xab, 0xcd]),
            ]),
            s("GPU"),
        ]);
        let b = decode_batch(&encode(&arr(vec![0.into(), arr(vec![removed]), 3.into()]))).unwrap();
        let Event::Removed(r) = &b.events[0] else {
            panic!("{b:?}")
        };
        assert_eq!(
            r.block_hashes,
            [7, u64::MAX, u64::MAX, 0x0102_0304_0506_0708, 0xabcd]
        );
        assert_eq!(b.dp_rank, Some(3));
    }

    #[test]
    fn map_batch_and_mixed_event_forms_are_accepted() {
        let batch = map(vec![
            ("ts", 2.0.into()),
            (
                "events",
                arr(vec![
                    arr(vec![s("AllBlocksCleared")]),
                    map(vec![("type", s("AllBlocksCleared"))]),
                ]),
            ),
            ("data_parallel_rank", rmpv::Value::Nil),
        ]);
        let b = decode_batch(&encode(&batch)).unwrap();
        assert_eq!(b.events, [Event::AllCleared, Event::AllCleared]);
        assert_eq!(b.dp_rank, None);
    }

    #[test]
    fn bad_events_are_skipped_and_the_rest_kept() {
        let good = arr(vec![s("AllBlocksCleared")]);
        let events = arr(vec![
            arr(vec![s("BlockSnapshotted"), 1.into()]),
            // token count does not match hashes × block size
            arr(vec![
                s("BlockStored"),
                ints([1, 2]),
                rmpv::Value::Nil,
                ints([1, 2, 3]),
                2.into(),
            ]),
            // a token id above u32
            arr(vec![
                s("BlockStored"),
                ints([1]),
                rmpv::Value::Nil,
                ints([1 << 40]),
                1.into(),
            ]),
            // block_hashes missing
            map(vec![("type", s("BlockRemoved"))]),
            // medium of the wrong type
            arr(vec![s("BlockRemoved"), ints([1]), 5.into()]),
            3.into(),
            good.clone(),
        ]);
        let b = decode_batch(&encode(&arr(vec![0.into(), events, 0.into()]))).unwrap();
        assert_eq!(b.events, [Event::AllCleared]);
        assert_eq!(b.skipped, 6);
    }

    #[test]
    fn extra_keys_give_per_block_digests_and_lora_is_kept() {
        let stored = map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", ints([1, 2])),
            ("parent_block_hash", rmpv::Value::Nil),
            ("token_ids", ints([1, 2])),
            ("block_size", 1.into()),
            ("lora_name", s("adapter-a")),
            (
                "extra_keys",
                arr(vec![arr(vec![s("salt")]), rmpv::Value::Nil]),
            ),
        ]);
        let b = decode_batch(&encode(&arr(vec![0.into(), arr(vec![stored])]))).unwrap();
        let Event::Stored(e) = &b.events[0] else {
            panic!()
        };
        assert!(e.extra_keys[0].is_some());
        assert_eq!(e.extra_keys[1], None);
        assert_eq!(e.lora.as_deref(), Some("adapter-a"));
    }

    #[test]
    fn request_extra_keys_equal_what_the_engine_reports() {
        // vLLM's extra_keys for a request to adapter-a with cache_salt "s1", 3 blocks.
        let stored = map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", ints([1, 2, 3])),
            ("parent_block_hash", rmpv::Value::Nil),
            ("token_ids", ints([1, 2, 3])),
            ("block_size", 1.into()),
            ("lora_name", s("adapter-a")),
            (
                "extra_keys",
                arr(vec![
                    arr(vec![s("adapter-a"), s("s1")]),
                    arr(vec![s("adapter-a")]),
                    arr(vec![s("adapter-a")]),
                ]),
            ),
        ]);
        let b = decode_batch(&encode(&arr(vec![0.into(), arr(vec![stored])]))).unwrap();
        let Event::Stored(e) = &b.events[0] else {
            panic!()
        };
        let ours = super::super::index::request_extra_keys(Some("adapter-a"), Some("s1"), 3);
        assert_eq!(e.extra_keys, ours);
        // Salt only: the first block carries it, the rest nothing.
        let salted = super::super::index::request_extra_keys(None, Some("s1"), 2);
        assert_eq!(salted, [Some(strings_digest(&["s1"])), None]);
        assert!(super::super::index::request_extra_keys(None, None, 2).is_empty());
    }

    /// vLLM's CPU-offloading connector announces its copies with the GPU blocks'
    /// hashes (raw 32-byte digests in some versions), no tokens, no parent, and a block
    /// size of 0 (or its own block size, in the first versions).
    #[test]
    fn offloading_connector_events_decode_without_tokens() {
        let digest = |tail: u64| {
            let mut d = vec![0xee; 24];
            d.extend_from_slice(&tail.to_be_bytes());
            rmpv::Value::Binary(d)
        };
        let current = map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", arr(vec![digest(42), digest(43)])),
            ("parent_block_hash", rmpv::Value::Nil),
            ("token_ids", arr(vec![])),
            ("block_size", 0.into()),
            ("lora_id", rmpv::Value::Nil),
            ("medium", s("CPU")),
            ("lora_name", rmpv::Value::Nil),
        ]);
        let legacy = arr(vec![
            s("BlockStored"),
            arr(vec![digest(44)]),
            rmpv::Value::Nil,
            arr(vec![]),
            64.into(),
            rmpv::Value::Nil,
            s("CPU"),
        ]);
        let gone = map(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", arr(vec![digest(42)])),
            ("medium", s("CPU")),
        ]);
        let b = decode_batch(&encode(&arr(vec![
            0.into(),
            arr(vec![current, legacy, gone]),
            0.into(),
        ])))
        .unwrap();
        assert_eq!(b.skipped, 0);
        let Event::Stored(e) = &b.events[0] else {
            panic!("{b:?}")
        };
        assert_eq!(
            (&e.block_hashes[..], e.token_ids.len(), e.block_size),
            (&[42, 43][..], 0, 0)
        );
        assert_eq!(
            (e.parent_block_hash, e.medium.as_deref()),
            (None, Some("CPU"))
        );
        let Event::Stored(e) = &b.events[1] else {
            panic!("{b:?}")
        };
        assert_eq!((&e.block_hashes[..], e.block_size), (&[44][..], 64));
        let Event::Removed(r) = &b.events[2] else {
            panic!("{b:?}")
        };
        assert_eq!(
            (&r.block_hashes[..], r.medium.as_deref()),
            (&[42][..], Some("CPU"))
        );
        // Tokens that do not fill the blocks are still refused.
        let bad = arr(vec![
            s("BlockStored"),
            ints([1]),
            rmpv::Value::Nil,
            ints([1, 2, 3]),
            0.into(),
        ]);
        let b = decode_batch(&encode(&arr(vec![0.into(), arr(vec![bad])]))).unwrap();
        assert_eq!(b.skipped, 1);
    }

    #[test]
    fn garbage_payloads_are_errors_not_panics() {
        let cases: Vec<Vec<u8>> = vec![
            vec![],
            vec![0xc1],
            b"hello".to_vec(),
            encode(&1.into()),
            encode(&arr(vec![1.into()])),
            encode(&arr(vec![1.into(), 2.into()])),
            encode(&map(vec![("ts", 1.into())])),
            [unhex(LEGACY), vec![0]].concat(),
            unhex(LEGACY)[..50].to_vec(),
            // a huge array length with no elements behind it
            vec![0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff],
        ];
        for c in cases {
            assert!(decode_batch(&c).is_err(), "{c:?}");
        }
        // A nesting bomb stops at rmpv's depth limit.
        let bomb = vec![0x91u8; 100_000];
        assert!(decode_batch(&bomb).is_err());
    }

    #[test]
    fn frames_and_replay_replies() {
        let b = |x: &[u8]| Bytes::copy_from_slice(x);
        let seq5 = 5u64.to_be_bytes();
        let live = [b(b"kv"), b(&seq5), b(b"p")];
        let (seq, payload) = live_frames(&live).unwrap();
        assert_eq!((seq, payload), (5, &b"p"[..]));
        assert!(live_frames(&[b(b"kv"), b(&seq5)]).is_err());
        assert!(live_frames(&[b(b"kv"), b(&[1, 2]), b(b"p")]).is_err());

        let new = [b(b""), b(b"kv"), b(&seq5), b(b"p")];
        let old = [b(b""), b(&seq5), b(b"p")];
        let bare = [b(&seq5), b(b"p")];
        for f in [&new[..], &old[..], &bare[..]] {
            assert_eq!(
                replay_frames(f).unwrap(),
                ReplayFrame::Batch {
                    seq: 5,
                    payload: b"p"
                }
            );
        }
        let ff = [0xffu8; 8];
        assert_eq!(
            replay_frames(&[b(b""), b(b""), b(&ff), b(b"")]).unwrap(),
            ReplayFrame::End
        );
        assert_eq!(
            replay_frames(&[b(b""), b(&ff), b(b"")]).unwrap(),
            ReplayFrame::End
        );
        assert!(replay_frames(&[b(b"")]).is_err());
        assert_eq!(replay_request(258), [0, 0, 0, 0, 0, 0, 1, 2]);
    }
}
