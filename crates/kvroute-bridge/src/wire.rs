//! Decoding the engines' msgpack event batches, in every shape they have used.
//!
//! vLLM and SGLang serialise their batches with msgspec. Older releases encode
//! the batch as an array `[ts, events, data_parallel_rank]` and every event as an
//! array tagged by its class name first; newer ones use maps (`{"type":
//! "BlockStored", ...}` and `{"ts", "events", "data_parallel_rank"}`). Either way,
//! fields at their defaults may be left out. This module accepts every
//! combination, ignores fields and positions it does not know, and names what was
//! wrong with a payload it cannot read, so that the caller can count failures by
//! reason instead of silently dropping events (peers that missed the format
//! change reported 0% hits for weeks).

use kvroute_index::multimodal_identifier_hash;
use rmpv::Value;

/// One published batch, as the engine sent it.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineBatch {
    pub events: Vec<EngineEvent>,
    /// The data-parallel rank that published the batch, when stamped.
    pub dp_rank: Option<u32>,
}

/// One engine event. Hashes are the engine's own, reduced to 64 bits (see [`engine_hash`]).
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    Stored(StoredEvent),
    Removed {
        block_hashes: Vec<u64>,
        medium: Option<String>,
        group_idx: u32,
    },
    AllCleared,
    /// An event class this bridge does not know; skipped and counted by the caller.
    Unknown(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct StoredEvent {
    pub block_hashes: Vec<u64>,
    pub parent_block_hash: Option<u64>,
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<u64>,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// Per block: its extra keys, sorted out.
    pub extra_keys: Option<Vec<BlockKeys>>,
    pub group_idx: u32,
}

/// One block's extra keys as vLLM reports them (`extra_keys`, one entry per
/// block): the request's LoRA name on every block (already in the hash seed, so
/// left out here), the multimodal objects the block holds, the `cache_salt` on a
/// request's first block, and prompt-embedding digests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockKeys {
    /// Multimodal object keys ([`multimodal_identifier_hash`] of their
    /// identifiers), plus an opaque key for each key of no known kind, so that
    /// such a block never matches a request without it.
    pub multimodal: Vec<u64>,
    /// A `cache_salt`: keyed as the router keys a salted request's first block.
    pub cache_salt: Option<String>,
    /// Keys of no known kind (counted by the caller).
    pub undecoded: u32,
}

#[cfg(test)]
impl StoredEvent {
    /// Blocks of 4 tokens numbered from 0, on the default tier, base model.
    pub(crate) fn on_gpu(hashes: &[u64], parent: Option<u64>) -> Self {
        Self {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: (0..hashes.len() as u32 * 4).collect(),
            block_size: 4,
            lora_id: None,
            medium: None,
            lora_name: None,
            extra_keys: None,
            group_idx: 0,
        }
    }
}

/// Why a payload could not be decoded; [`DecodeError::reason`] labels the metric.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("payload is not msgpack: {0}")]
    NotMsgpack(String),
    #[error("{0} bytes after the msgpack value")]
    TrailingBytes(usize),
    #[error("batch is neither an array nor a map")]
    BatchShape,
    #[error("event is neither a tagged array nor a map with a \"type\"")]
    EventShape,
    #[error("field {field}: {problem}")]
    Field {
        field: &'static str,
        problem: &'static str,
    },
}

impl DecodeError {
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeError::NotMsgpack(_) => "not_msgpack",
            DecodeError::TrailingBytes(_) => "trailing_bytes",
            DecodeError::BatchShape => "batch_shape",
            DecodeError::EventShape => "event_shape",
            DecodeError::Field { .. } => "bad_field",
        }
    }
}

fn bad(field: &'static str, problem: &'static str) -> DecodeError {
    DecodeError::Field { field, problem }
}

/// Decodes one batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<EngineBatch, DecodeError> {
    let mut rest = payload;
    let value =
        rmpv::decode::read_value(&mut rest).map_err(|e| DecodeError::NotMsgpack(e.to_string()))?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes(rest.len()));
    }
    let (events, dp_rank) = match &value {
        Value::Array(items) => (items.get(1), items.get(2)),
        Value::Map(_) => (
            map_get(&value, "events"),
            map_get(&value, "data_parallel_rank").or_else(|| map_get(&value, "attn_dp_rank")),
        ),
        _ => return Err(DecodeError::BatchShape),
    };
    let events = match events {
        Some(Value::Array(events)) => events.iter().map(decode_event).collect::<Result<_, _>>()?,
        _ => return Err(bad("events", "missing or not an array")),
    };
    let dp_rank = optional(dp_rank)
        .map(|v| as_u32(v, "data_parallel_rank"))
        .transpose()?;
    Ok(EngineBatch { events, dp_rank })
}

/// Where an event's fields are: by position after the tag, or by name.
enum Fields<'a> {
    Positional(&'a [Value]),
    Named(&'a Value),
}

impl<'a> Fields<'a> {
    /// The field at `position` (counting the tag as 0) or named `name`; null is absent.
    fn get(&self, position: usize, name: &str) -> Option<&'a Value> {
        let value = match self {
            Fields::Positional(items) => items.get(position),
            Fields::Named(map) => map_get(map, name),
        };
        optional(value)
    }
}

fn decode_event(value: &Value) -> Result<EngineEvent, DecodeError> {
    let (tag, fields) = match value {
        Value::Array(items) => (items.first(), Fields::Positional(items)),
        Value::Map(_) => (map_get(value, "type"), Fields::Named(value)),
        _ => return Err(DecodeError::EventShape),
    };
    let tag = tag.and_then(Value::as_str).ok_or(DecodeError::EventShape)?;
    match tag {
        "BlockStored" => decode_stored(&fields).map(EngineEvent::Stored),
        "BlockRemoved" => Ok(EngineEvent::Removed {
            block_hashes: hash_list(fields.get(1, "block_hashes"), "block_hashes")?,
            medium: string(fields.get(2, "medium"), "medium")?,
            group_idx: group(fields.get(3, "group_idx"))?,
        }),
        "AllBlocksCleared" => Ok(EngineEvent::AllCleared),
        other => Ok(EngineEvent::Unknown(other.to_owned())),
    }
}

fn decode_stored(fields: &Fields) -> Result<StoredEvent, DecodeError> {
    let block_hashes = hash_list(fields.get(1, "block_hashes"), "block_hashes")?;
    let parent_block_hash = fields
        .get(2, "parent_block_hash")
        .map(|v| engine_hash(v).ok_or(bad("parent_block_hash", "not an integer or bytes")))
        .transpose()?;
    let token_ids = match fields.get(3, "token_ids") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| as_u32(v, "token_ids"))
            .collect::<Result<_, _>>()?,
        _ => return Err(bad("token_ids", "missing or not an array")),
    };
    let block_size = fields
        .get(4, "block_size")
        .ok_or(bad("block_size", "missing"))
        .and_then(|v| as_u32(v, "block_size"))?;
    let lora_id = fields
        .get(5, "lora_id")
        .map(|v| v.as_u64().ok_or(bad("lora_id", "not an unsigned integer")))
        .transpose()?;
    let lora_name = string(fields.get(7, "lora_name"), "lora_name")?;
    let extra_keys = match fields.get(8, "extra_keys") {
        None => None,
        Some(Value::Array(blocks)) => Some(
            blocks
                .iter()
                .map(|keys| match keys {
                    Value::Nil => Ok(BlockKeys::default()),
                    Value::Array(keys) => Ok(block_keys(keys, lora_name.as_deref())),
                    _ => Err(bad("extra_keys", "an entry is not an array")),
                })
                .collect::<Result<_, _>>()?,
        ),
        Some(_) => return Err(bad("extra_keys", "not an array")),
    };
    Ok(StoredEvent {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        lora_id,
        medium: string(fields.get(6, "medium"), "medium")?,
        lora_name,
        extra_keys,
        group_idx: group(fields.get(9, "group_idx"))?,
    })
}

/// An engine block hash as a 64-bit id: unsigned integers as they are, signed
/// ones (SGLang) reinterpreted, raw bytes by their low 64 bits, big-endian.
pub fn engine_hash(value: &Value) -> Option<u64> {
    match value {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|s| s as u64)),
        Value::Binary(bytes) if !bytes.is_empty() => Some(low_64_big_endian(bytes)),
        _ => None,
    }
}

fn low_64_big_endian(bytes: &[u8]) -> u64 {
    let tail = &bytes[bytes.len().saturating_sub(8)..];
    tail.iter().fold(0, |acc, &b| (acc << 8) | u64::from(b))
}

/// Sorts one block's extra keys out. vLLM writes them in the order LoRA name,
/// multimodal keys, cache salt, prompt-embedding digests:
/// - a multimodal key is `[identifier, offset in the block]` (older releases:
///   the identifier alone, a hex digest);
/// - the salt is the one other string (only a request's first block has it);
/// - anything else (prompt-embedding digests, shapes of future releases) cannot
///   be reproduced from a request: it becomes an opaque key, and is counted.
fn block_keys(keys: &[Value], lora_name: Option<&str>) -> BlockKeys {
    let mut block = BlockKeys::default();
    for key in keys {
        match key {
            Value::String(s) if s.as_str().is_some() && s.as_str() == lora_name => {}
            Value::String(s) => match s.as_str() {
                Some(s) if is_hex_digest(s) => {
                    block.multimodal.push(multimodal_identifier_hash(s));
                }
                Some(s) if block.cache_salt.is_none() => block.cache_salt = Some(s.to_owned()),
                _ => block.opaque(key),
            },
            Value::Array(pair) => match pair.as_slice() {
                [Value::String(id), offset] if offset.is_i64() || offset.is_u64() => {
                    match id.as_str() {
                        Some(id) => block.multimodal.push(multimodal_identifier_hash(id)),
                        None => block.opaque(key),
                    }
                }
                _ => block.opaque(key),
            },
            other => block.opaque(other),
        }
    }
    block
}

impl BlockKeys {
    /// A key of no known kind: its msgpack bytes, hashed, key the block.
    fn opaque(&mut self, key: &Value) {
        let mut bytes = Vec::new();
        // Writing to a Vec cannot fail.
        let _ = rmpv::encode::write_value(&mut bytes, key);
        self.multimodal.push(xxhash_rust::xxh3::xxh3_64(&bytes));
        self.undecoded += 1;
    }
}

/// How engines write content hashes: at least 16 hex digits.
fn is_hex_digest(s: &str) -> bool {
    s.len() >= 16 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn hash_list(value: Option<&Value>, field: &'static str) -> Result<Vec<u64>, DecodeError> {
    match value {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| engine_hash(v).ok_or(bad(field, "an entry is not an integer or bytes")))
            .collect(),
        _ => Err(bad(field, "missing or not an array")),
    }
}

fn string(value: Option<&Value>, field: &'static str) -> Result<Option<String>, DecodeError> {
    value
        .map(|v| {
            v.as_str()
                .map(str::to_owned)
                .ok_or(bad(field, "not a string"))
        })
        .transpose()
}

/// The KV-cache group of an event; absent means the first (and usually only) group.
fn group(value: Option<&Value>) -> Result<u32, DecodeError> {
    value.map_or(Ok(0), |v| as_u32(v, "group_idx"))
}

fn as_u32(value: &Value, field: &'static str) -> Result<u32, DecodeError> {
    value
        .as_u64()
        .and_then(|v| u32::try_from(v).ok())
        .ok_or(bad(field, "not a 32-bit unsigned integer"))
}

fn map_get<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
    match map {
        Value::Map(entries) => entries
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v),
        _ => None,
    }
}

/// Null and absent mean the same: the field holds its default.
fn optional(value: Option<&Value>) -> Option<&Value> {
    value.filter(|v| !v.is_nil())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rmpv::Value;

    use super::*;

    fn encode(value: &Value) -> Vec<u8> {
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, value).unwrap();
        bytes
    }

    fn s(text: &str) -> Value {
        Value::from(text)
    }

    fn map(entries: Vec<(&str, Value)>) -> Value {
        Value::Map(entries.into_iter().map(|(k, v)| (s(k), v)).collect())
    }

    fn ints(values: &[u64]) -> Value {
        Value::Array(values.iter().map(|&v| Value::from(v)).collect())
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: u32) -> StoredEvent {
        let event = StoredEvent::on_gpu(hashes, parent);
        assert_eq!(event.token_ids.len(), tokens as usize);
        event
    }

    #[test]
    fn array_batch_with_tagged_array_events_and_trailing_defaults_left_out() {
        let batch = Value::Array(vec![
            Value::F64(1.5),
            Value::Array(vec![
                Value::Array(vec![
                    s("BlockStored"),
                    ints(&[1, 2]),
                    Value::Nil,
                    ints(&(0..8).collect::<Vec<_>>()),
                    Value::from(4),
                    Value::Nil,
                    s("GPU"),
                ]),
                Value::Array(vec![s("BlockRemoved"), ints(&[2])]),
                Value::Array(vec![s("AllBlocksCleared")]),
            ]),
            Value::from(3),
        ]);
        let decoded = decode_batch(&encode(&batch)).unwrap();
        let mut expected = stored(&[1, 2], None, 8);
        expected.medium = Some("GPU".into());
        assert_eq!(decoded.dp_rank, Some(3));
        assert_eq!(
            decoded.events,
            [
                EngineEvent::Stored(expected),
                EngineEvent::Removed {
                    block_hashes: vec![2],
                    medium: None,
                    group_idx: 0
                },
                EngineEvent::AllCleared,
            ]
        );
    }

    #[test]
    fn newest_array_positions_and_extra_positions_are_read_or_ignored() {
        let event = Value::Array(vec![
            s("BlockStored"),
            ints(&[7]),
            Value::from(6),
            ints(&[0, 1, 2, 3]),
            Value::from(4),
            Value::from(2),
            s("GPU"),
            s("adapter"),
            Value::Array(vec![
                Value::Array(vec![
                    s("adapter"),
                    Value::Array(vec![s("img-1"), Value::from(3)]),
                    s("00112233445566778899aabbccddeeff"),
                    s("salt"),
                    Value::from(5),
                ]),
                Value::Nil,
            ]),
            Value::from(1),
            s("full_attention"),
            Value::from(0),
            s("a position from the future"),
        ]);
        let batch = Value::Array(vec![Value::F64(0.0), Value::Array(vec![event])]);
        let EngineEvent::Stored(got) = &decode_batch(&encode(&batch)).unwrap().events[0] else {
            panic!("not a stored event");
        };
        assert_eq!(got.parent_block_hash, Some(6));
        assert_eq!(got.lora_id, Some(2));
        assert_eq!(got.lora_name.as_deref(), Some("adapter"));
        let keys = got.extra_keys.as_ref().unwrap();
        assert_eq!(keys.len(), 2);
        // The LoRA name is left out; the image by its uuid, the legacy hex
        // digest by its tail; the integer is of no known kind.
        assert_eq!(
            keys[0].multimodal[..2],
            [multimodal_identifier_hash("img-1"), 0x8899aabbccddeeff]
        );
        assert_eq!(keys[0].multimodal.len(), 3);
        assert_eq!(keys[0].cache_salt.as_deref(), Some("salt"));
        assert_eq!(keys[0].undecoded, 1);
        assert_eq!(keys[1], BlockKeys::default());
        assert_eq!(got.group_idx, 1);
    }

    #[test]
    fn map_batch_with_map_events_and_unknown_fields() {
        let batch = map(vec![
            ("ts", Value::F64(2.0)),
            (
                "events",
                Value::Array(vec![
                    map(vec![
                        ("type", s("BlockStored")),
                        ("block_hashes", ints(&[1])),
                        ("token_ids", ints(&[0, 1, 2, 3])),
                        ("block_size", Value::from(4)),
                        ("kv_cache_spec_kind", s("full_attention")),
                        ("brand_new_field", Value::Boolean(true)),
                    ]),
                    map(vec![
                        ("type", s("BlockRemoved")),
                        ("block_hashes", ints(&[1])),
                        ("medium", s("CPU")),
                        ("remaining_copy_counts", ints(&[0])),
                    ]),
                    map(vec![("type", s("BlockMoved"))]),
                ]),
            ),
            ("attn_dp_rank", Value::from(1)),
        ]);
        let decoded = decode_batch(&encode(&batch)).unwrap();
        assert_eq!(decoded.dp_rank, Some(1));
        assert_eq!(
            decoded.events,
            [
                EngineEvent::Stored(stored(&[1], None, 4)),
                EngineEvent::Removed {
                    block_hashes: vec![1],
                    medium: Some("CPU".into()),
                    group_idx: 0
                },
                EngineEvent::Unknown("BlockMoved".into()),
            ]
        );
    }

    #[test]
    fn hashes_unsigned_signed_and_bytes() {
        assert_eq!(engine_hash(&Value::from(u64::MAX)), Some(u64::MAX));
        assert_eq!(engine_hash(&Value::from(-2i64)), Some(u64::MAX - 1));
        let digest: Vec<u8> = (1..=32).collect();
        assert_eq!(
            engine_hash(&Value::Binary(digest)),
            Some(u64::from_be_bytes([25, 26, 27, 28, 29, 30, 31, 32]))
        );
        assert_eq!(engine_hash(&Value::Binary(vec![1, 2])), Some(0x0102));
        assert_eq!(engine_hash(&Value::Binary(vec![])), None);
        assert_eq!(engine_hash(&s("12")), None);
    }

    #[test]
    fn malformed_payloads_name_their_reason() {
        let reason = |bytes: &[u8]| decode_batch(bytes).unwrap_err().reason();
        assert_eq!(reason(&[0x92, 0x01]), "not_msgpack");
        assert_eq!(reason(&[]), "not_msgpack");
        let mut trailing = encode(&Value::Array(vec![Value::F64(0.0), Value::Array(vec![])]));
        trailing.push(0);
        assert_eq!(reason(&trailing), "trailing_bytes");
        assert_eq!(reason(&encode(&Value::from(3))), "batch_shape");
        assert_eq!(
            reason(&encode(&Value::Array(vec![Value::F64(0.0)]))),
            "bad_field"
        );
        let batch = |event: Value| {
            encode(&Value::Array(vec![
                Value::F64(0.0),
                Value::Array(vec![event]),
            ]))
        };
        assert_eq!(reason(&batch(Value::from(1))), "event_shape");
        assert_eq!(
            reason(&batch(Value::Array(vec![Value::from(1)]))),
            "event_shape"
        );
        let no_tokens = Value::Array(vec![s("BlockStored"), ints(&[1]), Value::Nil]);
        assert_eq!(reason(&batch(no_tokens)), "bad_field");
        let bad_hash = Value::Array(vec![s("BlockRemoved"), Value::Array(vec![s("x")])]);
        assert_eq!(reason(&batch(bad_hash)), "bad_field");
    }

    fn encode_stored(event: &StoredEvent, hashes_as: u8, as_map: bool) -> Value {
        let hash = |h: u64| match hashes_as {
            0 => Value::from(h),
            1 => Value::from(h as i64),
            _ => Value::Binary([[0xab; 24].as_slice(), &h.to_be_bytes()].concat()),
        };
        let fields = vec![
            (
                "block_hashes",
                Value::Array(event.block_hashes.iter().map(|&h| hash(h)).collect()),
            ),
            (
                "parent_block_hash",
                event.parent_block_hash.map_or(Value::Nil, hash),
            ),
            (
                "token_ids",
                Value::Array(event.token_ids.iter().map(|&t| Value::from(t)).collect()),
            ),
            ("block_size", Value::from(event.block_size)),
            ("lora_id", event.lora_id.map_or(Value::Nil, Value::from)),
            ("medium", event.medium.as_deref().map_or(Value::Nil, s)),
            (
                "lora_name",
                event.lora_name.as_deref().map_or(Value::Nil, s),
            ),
        ];
        if as_map {
            let mut entries = vec![("type", s("BlockStored"))];
            entries.extend(fields.into_iter().filter(|(_, v)| !v.is_nil()));
            map(entries)
        } else {
            let mut items = vec![s("BlockStored")];
            items.extend(fields.into_iter().map(|(_, v)| v));
            while items.last().is_some_and(Value::is_nil) {
                items.pop();
            }
            Value::Array(items)
        }
    }

    fn arb_stored() -> impl Strategy<Value = StoredEvent> {
        (
            prop::collection::vec(any::<u64>(), 1..4),
            prop::option::of(any::<u64>()),
            prop::option::of(prop::sample::select(vec!["GPU", "CPU"])),
            prop::option::of("[a-z]{1,8}"),
        )
            .prop_map(|(hashes, parent, medium, lora)| StoredEvent {
                token_ids: (0..hashes.len() as u32 * 4).collect(),
                block_hashes: hashes,
                parent_block_hash: parent,
                block_size: 4,
                lora_id: lora.as_ref().map(|_| 1),
                medium: medium.map(str::to_owned),
                lora_name: lora,
                extra_keys: None,
                group_idx: 0,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Whatever shape the batch and each event take, and whatever form the
        /// hashes take, the decoded batch is the same.
        #[test]
        fn every_encoding_decodes_to_the_same_batch(
            events in prop::collection::vec((arb_stored(), 0u8..3, any::<bool>()), 0..5),
            batch_as_map in any::<bool>(),
            dp_rank in prop::option::of(0u32..8),
        ) {
            let encoded: Vec<Value> = events.iter().map(|(e, h, m)| encode_stored(e, *h, *m)).collect();
            let rank = dp_rank.map_or(Value::Nil, Value::from);
            let batch = if batch_as_map {
                map(vec![("ts", Value::F64(0.5)), ("events", Value::Array(encoded)), ("data_parallel_rank", rank)])
            } else {
                Value::Array(vec![Value::F64(0.5), Value::Array(encoded), rank])
            };
            let decoded = decode_batch(&encode(&batch)).unwrap();
            prop_assert_eq!(decoded.dp_rank, dp_rank);
            let expected: Vec<_> = events.into_iter().map(|(e, _, _)| EngineEvent::Stored(e)).collect();
            prop_assert_eq!(decoded.events, expected);
        }
    }
}
