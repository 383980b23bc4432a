//! One data-parallel rank's state: which engine sequence comes next, and a mirror
//! of the rank's cache as kvroute events.
//!
//! The engine numbers its *batches* (per publisher socket, from 0 at start); the
//! router wants consecutive *event* ids per (worker, rank). The bridge keeps the
//! two apart: [`SequenceTracker`] judges engine sequences (in order, a gap, or a
//! restart), and [`RankMirror`] gives every event it forwards the next id of its
//! own and applies it to a single-worker [`KvIndex`], so that a resync can be
//! answered with a full dump of exactly what the router should hold.
//!
//! Invariant: the mirror holds the result of applying, in id order, every event
//! this bridge has given an id; the router holds the same once it has applied
//! them all, which is what a dump restores after anything went missing.

use kvroute_index::{
    BlockHasher, EventKind, KvEvent, StoredBlock, Tier, TieredIndex, WorkerKey, salt_key,
};
use kvroute_proto as proto;

use crate::wire::{BlockKeys, EngineEvent, StoredEvent};

/// What the bridge forwards: the device medium, the offload media, the
/// configured block size.
#[derive(Clone, Debug)]
pub struct EventFilter {
    pub block_size: u32,
    /// Forwarded as the device tier (`--medium`).
    pub medium: String,
    /// Forwarded as the offload tier (`--offload-medium`, repeatable).
    pub offload_media: Vec<String>,
}

/// Why an engine event was not forwarded; labels the skipped-events metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkipReason {
    /// Blocks on a medium (CPU, disk, ...) neither `--medium` nor an `--offload-medium`.
    Medium,
    /// A KV-cache group other than the first (hybrid models report one per group).
    Group,
    /// Blocks of another size than `--block-size`: hashes would never match.
    BlockSize,
    /// A LoRA adapter given only by id: its hash seed needs the name.
    UnnamedLora,
    /// `token_ids` do not fill exactly one block per block hash.
    TokenCount,
    /// An event class the bridge does not know.
    UnknownType,
}

impl SkipReason {
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::Medium => "medium",
            SkipReason::Group => "group",
            SkipReason::BlockSize => "block_size",
            SkipReason::UnnamedLora => "unnamed_lora",
            SkipReason::TokenCount => "token_count",
            SkipReason::UnknownType => "unknown_type",
        }
    }
}

impl EventFilter {
    /// The kvroute event and its tier for an engine event, or why it is left
    /// out. Absent media are the GPU: engines only started to name the medium
    /// when they added others.
    pub fn translate(&self, event: &EngineEvent) -> Result<(Tier, EventKind), SkipReason> {
        match event {
            EngineEvent::Stored(stored) => {
                let tier = self.tier(stored.medium.as_deref())?;
                if stored.group_idx != 0 {
                    return Err(SkipReason::Group);
                }
                Ok((tier, self.stored(stored)?))
            }
            EngineEvent::Removed {
                block_hashes,
                medium,
                group_idx,
            } => {
                let tier = self.tier(medium.as_deref())?;
                if *group_idx != 0 {
                    return Err(SkipReason::Group);
                }
                let kind = EventKind::Removed {
                    block_hashes: block_hashes.clone(),
                };
                Ok((tier, kind))
            }
            // Clears every tier.
            EngineEvent::AllCleared => Ok((Tier::Device, EventKind::Cleared)),
            EngineEvent::Unknown(_) => Err(SkipReason::UnknownType),
        }
    }

    /// The tier a medium's blocks are forwarded as (names compared ignoring case).
    fn tier(&self, medium: Option<&str>) -> Result<Tier, SkipReason> {
        let medium = medium.unwrap_or("GPU");
        if medium.eq_ignore_ascii_case(&self.medium) {
            Ok(Tier::Device)
        } else if self
            .offload_media
            .iter()
            .any(|m| medium.eq_ignore_ascii_case(m))
        {
            Ok(Tier::Offload)
        } else {
            Err(SkipReason::Medium)
        }
    }

    /// Computes kvroute's own local hash of every block from its tokens, so the
    /// engine's hash algorithm and seed never matter.
    fn stored(&self, stored: &StoredEvent) -> Result<EventKind, SkipReason> {
        if stored.block_size != self.block_size {
            return Err(SkipReason::BlockSize);
        }
        let lora_name = match (&stored.lora_name, stored.lora_id) {
            (Some(name), _) => name.as_str(),
            (None, Some(_)) => return Err(SkipReason::UnnamedLora),
            (None, None) => "",
        };
        let block_size = self.block_size as usize;
        if stored.token_ids.len() != stored.block_hashes.len() * block_size {
            return Err(SkipReason::TokenCount);
        }
        let hasher = BlockHasher::with_lora(block_size, lora_name);
        let no_extra_keys = BlockKeys::default();
        let blocks = stored
            .block_hashes
            .iter()
            .zip(stored.token_ids.chunks_exact(block_size))
            .enumerate()
            .map(|(i, (&block_hash, tokens))| {
                let keys = stored
                    .extra_keys
                    .as_ref()
                    .and_then(|keys| keys.get(i))
                    .unwrap_or(&no_extra_keys);
                let salt = keys.cache_salt.as_deref().filter(|s| !s.is_empty());
                StoredBlock {
                    block_hash,
                    tokens_hash: hasher.local_hash_with_keys(
                        tokens,
                        &keys.multimodal,
                        salt.map(salt_key),
                    ),
                }
            })
            .collect();
        Ok(EventKind::Stored {
            parent_hash: stored.parent_block_hash,
            blocks,
        })
    }
}

/// What an engine sequence number means, given the ones seen before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sequence {
    /// The first batch since the bridge started: earlier ones may be in the replay buffer.
    First,
    /// The next one.
    InOrder,
    /// Batches `from..` this one are missing.
    Gap { from: u64 },
    /// The sequence went backwards: the engine restarted and dropped its cache.
    Restart,
}

/// The engine sequence a rank's publisher should send next.
#[derive(Clone, Debug, Default)]
pub struct SequenceTracker {
    next: Option<u64>,
}

impl SequenceTracker {
    pub fn check(&self, seq: u64) -> Sequence {
        match self.next {
            None => Sequence::First,
            Some(next) if seq == next => Sequence::InOrder,
            Some(next) if seq > next => Sequence::Gap { from: next },
            Some(_) => Sequence::Restart,
        }
    }

    /// Marks `seq` as handled.
    pub fn advance(&mut self, seq: u64) {
        self.next = Some(seq + 1);
    }
}

/// A rank's cache as the router should know it, both tiers, with the ids given so far.
pub struct RankMirror {
    key: WorkerKey,
    index: TieredIndex,
    /// The id of the last event given out; ids start at 1, so 0 means none yet.
    last_event_id: u64,
    /// Events given out since the last digest.
    since_digest: u64,
}

impl RankMirror {
    pub fn new(worker_id: u64, dp_rank: u32) -> Self {
        Self {
            key: WorkerKey::new(worker_id, dp_rank),
            index: TieredIndex::default(),
            last_event_id: 0,
            since_digest: 0,
        }
    }

    pub fn dp_rank(&self) -> u32 {
        self.key.dp_rank
    }

    /// Gives `kind` on `tier` the next id (one sequence for both tiers) and
    /// applies it to the mirror.
    pub fn record(&mut self, tier: Tier, kind: EventKind) -> KvEvent {
        self.last_event_id += 1;
        self.since_digest += 1;
        let event = KvEvent {
            event_id: self.last_event_id,
            kind,
        };
        self.index.apply(self.key, tier, &event);
        event
    }

    /// Events given out since the last [`Self::take_digest`].
    pub fn since_digest(&self) -> u64 {
        self.since_digest
    }

    /// The digest of what the rank holds in both tiers, as of the last event
    /// given out: the router checks its index against it. Kept by the mirror's
    /// index as events apply, so taking it costs nothing.
    pub fn take_digest(&mut self) -> proto::Digest {
        self.since_digest = 0;
        let digest = self
            .index
            .digest(self.key)
            .map(|d| d.digest)
            .unwrap_or_default();
        proto::Digest {
            dp_rank: self.key.dp_rank,
            last_event_id: self.last_event_id,
            block_count: digest.block_count,
            block_set_hash: digest.block_set_hash,
        }
    }

    /// Blocks the rank holds in both tiers, for the mirror-size gauge.
    pub fn blocks(&self) -> u64 {
        self.index.device.worker_blocks(self.key) + self.index.offload.worker_blocks(self.key)
    }

    /// The rank's whole cache, both tiers, to replace what the router holds.
    pub fn dump(&self) -> proto::Dump {
        let dump = self.index.dump(self.key);
        let chains = |events: Vec<EventKind>| -> Vec<proto::Stored> {
            events
                .into_iter()
                .filter_map(|kind| match kind {
                    EventKind::Stored {
                        parent_hash,
                        blocks,
                    } => Some(stored_to_proto(parent_hash, &blocks)),
                    _ => None,
                })
                .collect()
        };
        let (device, offload) = dump.map(|d| (d.device, d.offload)).unwrap_or_default();
        proto::Dump {
            dp_rank: self.key.dp_rank,
            last_event_id: self.last_event_id,
            chains: chains(device),
            more: false,
            offload_chains: chains(offload),
        }
    }
}

fn stored_to_proto(parent_hash: Option<u64>, blocks: &[StoredBlock]) -> proto::Stored {
    proto::Stored {
        parent_hash,
        blocks: blocks
            .iter()
            .map(|b| proto::StoredBlock {
                block_hash: b.block_hash,
                tokens_hash: b.tokens_hash,
            })
            .collect(),
    }
}

/// A kvroute event on `tier` in its wire form.
pub fn event_to_proto(event: &KvEvent, tier: Tier) -> proto::KvEvent {
    use proto::kv_event::Kind;
    let kind = match &event.kind {
        EventKind::Stored {
            parent_hash,
            blocks,
        } => Kind::Stored(stored_to_proto(*parent_hash, blocks)),
        EventKind::Removed { block_hashes } => Kind::Removed(proto::Removed {
            block_hashes: block_hashes.clone(),
        }),
        EventKind::Cleared => Kind::Cleared(proto::Cleared {}),
    };
    let tier = match tier {
        Tier::Device => proto::Tier::Device,
        Tier::Offload => proto::Tier::Offload,
    };
    proto::KvEvent {
        event_id: event.event_id,
        kind: Some(kind),
        tier: tier.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter() -> EventFilter {
        EventFilter {
            block_size: 4,
            medium: "GPU".into(),
            offload_media: Vec::new(),
        }
    }

    fn stored(hashes: &[u64], parent: Option<u64>) -> StoredEvent {
        StoredEvent::on_gpu(hashes, parent)
    }

    #[test]
    fn stored_blocks_get_kvroute_local_hashes_from_their_tokens() {
        let event = EngineEvent::Stored(stored(&[10, 11], None));
        let local = BlockHasher::new(4).local_hashes(&(0..8).collect::<Vec<_>>());
        let (_, EventKind::Stored { blocks, .. }) = filter().translate(&event).unwrap() else {
            panic!("not a stored event");
        };
        let hashes: Vec<_> = blocks
            .iter()
            .map(|b| (b.block_hash, b.tokens_hash))
            .collect();
        assert_eq!(hashes, [(10, local[0]), (11, local[1])]);
    }

    /// Local hashes of a vLLM `BlockStored` of tokens 0..8 whose first block's
    /// extra keys are `first_keys`, through the bridge's decoder.
    fn decoded_local_hashes(first_keys: rmpv::Value) -> Vec<u64> {
        use rmpv::Value;
        let event = Value::Map(
            [
                ("type", Value::from("BlockStored")),
                (
                    "block_hashes",
                    Value::Array(vec![Value::from(1), Value::from(2)]),
                ),
                ("parent_block_hash", Value::Nil),
                ("token_ids", Value::Array((0..8).map(Value::from).collect())),
                ("block_size", Value::from(4)),
                ("extra_keys", Value::Array(vec![first_keys, Value::Nil])),
            ]
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect(),
        );
        let batch = Value::Array(vec![Value::F64(0.0), Value::Array(vec![event])]);
        let mut payload = Vec::new();
        rmpv::encode::write_value(&mut payload, &batch).unwrap();
        let decoded = crate::wire::decode_batch(&payload).unwrap();
        let (_, EventKind::Stored { blocks, .. }) = filter().translate(&decoded.events[0]).unwrap()
        else {
            panic!("not a stored event");
        };
        blocks.iter().map(|b| b.tokens_hash).collect()
    }

    #[test]
    fn a_cache_salt_in_vllm_extra_keys_hashes_like_the_routers_salted_request() {
        use kvroute_index::{ExtraKeys, MultimodalItem, multimodal_identifier_hash};
        use rmpv::Value;
        let tokens: Vec<u32> = (0..8).collect();
        let hasher = BlockHasher::new(4);
        let request = |salt: Option<&str>| {
            let extra = ExtraKeys {
                cache_salt: salt.map(str::to_owned),
                ..ExtraKeys::default()
            };
            hasher.local_hashes_with(&tokens, &extra)
        };
        let salted_a = decoded_local_hashes(Value::Array(vec![Value::from("tenant-a")]));
        assert_eq!(salted_a, request(Some("tenant-a")));
        assert_ne!(salted_a, request(Some("tenant-b")));
        assert_ne!(salted_a, request(None));
        assert_eq!(decoded_local_hashes(Value::Nil), request(None));
        // An image key ([identifier, offset]) before the salt, as vLLM orders them.
        let image = Value::Array(vec![Value::from("img-1"), Value::from(1)]);
        let both = decoded_local_hashes(Value::Array(vec![image, Value::from("tenant-a")]));
        let extra = ExtraKeys {
            cache_salt: Some("tenant-a".into()),
            multimodal: vec![MultimodalItem {
                offset: 1,
                length: 2,
                hash: multimodal_identifier_hash("img-1"),
            }],
        };
        assert_eq!(both, hasher.local_hashes_with(&tokens, &extra));
        // A key of no known kind still keys the block: it never matches a plain request.
        let unknown = decoded_local_hashes(Value::Array(vec![Value::Binary(vec![7; 32])]));
        assert_ne!(unknown[0], request(None)[0]);
    }

    #[test]
    fn lora_name_selects_the_adapter_seed_and_an_unnamed_lora_is_refused() {
        let mut event = stored(&[1], None);
        event.lora_name = Some("my-adapter".into());
        event.lora_id = Some(3);
        let (_, EventKind::Stored { blocks, .. }) = filter()
            .translate(&EngineEvent::Stored(event.clone()))
            .unwrap()
        else {
            panic!("not a stored event");
        };
        let adapter = BlockHasher::with_lora(4, "my-adapter").local_hashes(&[0, 1, 2, 3]);
        assert_eq!(blocks[0].tokens_hash, adapter[0]);
        event.lora_name = None;
        assert_eq!(
            filter().translate(&EngineEvent::Stored(event)),
            Err(SkipReason::UnnamedLora)
        );
    }

    #[test]
    fn multimodal_keys_change_the_block_hash() {
        let mut event = stored(&[1, 2], None);
        event.extra_keys = Some(vec![
            BlockKeys::default(),
            BlockKeys {
                multimodal: vec![99],
                ..BlockKeys::default()
            },
        ]);
        let (_, EventKind::Stored { blocks, .. }) =
            filter().translate(&EngineEvent::Stored(event)).unwrap()
        else {
            panic!("not a stored event");
        };
        let hasher = BlockHasher::new(4);
        assert_eq!(blocks[0].tokens_hash, hasher.local_hashes(&[0, 1, 2, 3])[0]);
        assert_eq!(
            blocks[1].tokens_hash,
            hasher.local_hash_multimodal(&[4, 5, 6, 7], &[99])
        );
    }

    #[test]
    fn other_media_groups_and_block_sizes_are_skipped() {
        let mut cpu = stored(&[1], None);
        cpu.medium = Some("CPU".into());
        let mut gpu = stored(&[1], None);
        gpu.medium = Some("gpu".into());
        let mut second_group = stored(&[1], None);
        second_group.group_idx = 1;
        let mut big = stored(&[1], None);
        big.block_size = 8;
        big.token_ids = (0..8).collect();
        let mut short = stored(&[1, 2], None);
        short.token_ids.pop();
        let f = filter();
        assert_eq!(
            f.translate(&EngineEvent::Stored(cpu)),
            Err(SkipReason::Medium)
        );
        assert!(f.translate(&EngineEvent::Stored(gpu)).is_ok());
        assert_eq!(
            f.translate(&EngineEvent::Stored(second_group)),
            Err(SkipReason::Group)
        );
        assert_eq!(
            f.translate(&EngineEvent::Stored(big)),
            Err(SkipReason::BlockSize)
        );
        assert_eq!(
            f.translate(&EngineEvent::Stored(short)),
            Err(SkipReason::TokenCount)
        );
        let cpu_removal = EngineEvent::Removed {
            block_hashes: vec![1],
            medium: Some("CPU_PINNED".into()),
            group_idx: 0,
        };
        assert_eq!(f.translate(&cpu_removal), Err(SkipReason::Medium));
        assert_eq!(
            f.translate(&EngineEvent::Unknown("BlockMoved".into())),
            Err(SkipReason::UnknownType)
        );
    }

    #[test]
    fn sequences_in_order_gaps_and_restarts() {
        let mut tracker = SequenceTracker::default();
        assert_eq!(tracker.check(5), Sequence::First);
        tracker.advance(5);
        assert_eq!(tracker.check(6), Sequence::InOrder);
        assert_eq!(tracker.check(9), Sequence::Gap { from: 6 });
        assert_eq!(tracker.check(5), Sequence::Restart);
        assert_eq!(tracker.check(0), Sequence::Restart);
    }

    #[test]
    fn mirror_gives_consecutive_ids_and_dumps_what_it_holds() {
        let f = filter();
        let mut mirror = RankMirror::new(7, 1);
        let (tier, kind) = f
            .translate(&EngineEvent::Stored(stored(&[1, 2], None)))
            .unwrap();
        let first = mirror.record(tier, kind);
        let (tier, kind) = f
            .translate(&EngineEvent::Stored(stored(&[3], Some(2))))
            .unwrap();
        let second = mirror.record(tier, kind);
        let third = mirror.record(
            Tier::Device,
            EventKind::Removed {
                block_hashes: vec![3],
            },
        );
        assert_eq!([first.event_id, second.event_id, third.event_id], [1, 2, 3]);
        let dump = mirror.dump();
        assert_eq!((dump.dp_rank, dump.last_event_id), (1, 3));
        let mut held: Vec<_> = dump
            .chains
            .iter()
            .flat_map(|c| c.blocks.iter().map(|b| b.block_hash))
            .collect();
        held.sort();
        assert_eq!(held, [1, 2]);
        assert_eq!(mirror.blocks(), 2);
        let digest = mirror.take_digest();
        assert_eq!((digest.dp_rank, digest.last_event_id), (1, 3));
        let expected = kvroute_index::BlockSetDigest::of([1, 2]);
        assert_eq!(
            (digest.block_count, digest.block_set_hash),
            (expected.block_count, expected.block_set_hash)
        );
        assert_eq!(mirror.since_digest(), 0);
        mirror.record(Tier::Device, EventKind::Cleared);
        assert!(mirror.dump().chains.is_empty());
        assert_eq!(mirror.since_digest(), 1);
        assert_eq!(mirror.take_digest().block_count, 0);
    }

    #[test]
    fn offload_media_go_as_the_offload_tier_on_the_ranks_one_sequence() {
        let f = EventFilter {
            offload_media: vec!["cpu".into(), "DISK".into()],
            ..filter()
        };
        let on = |medium: &str, parent, hashes: &[u64]| {
            let mut event = stored(hashes, parent);
            event.medium = Some(medium.into());
            f.translate(&EngineEvent::Stored(event))
        };
        // Case-insensitive; media neither device nor offload are still skipped.
        let (tier, cpu) = on("CPU", None, &[1, 2]).unwrap();
        assert_eq!(tier, Tier::Offload);
        assert_eq!(on("Disk", None, &[1]).unwrap().0, Tier::Offload);
        assert_eq!(on("GPU", None, &[1]).unwrap().0, Tier::Device);
        assert_eq!(on("CPU_PINNED", None, &[1]), Err(SkipReason::Medium));
        let cpu_removal = EngineEvent::Removed {
            block_hashes: vec![2],
            medium: Some("CPU".into()),
            group_idx: 0,
        };
        assert_eq!(f.translate(&cpu_removal).unwrap().0, Tier::Offload);

        let mut mirror = RankMirror::new(7, 0);
        let (tier, gpu) = on("GPU", None, &[1]).unwrap();
        let events = [
            event_to_proto(&mirror.record(tier, gpu), tier),
            event_to_proto(&mirror.record(Tier::Offload, cpu), Tier::Offload),
        ];
        assert_eq!(
            events.map(|e| (e.event_id, e.tier())),
            [(1, proto::Tier::Device), (2, proto::Tier::Offload)]
        );
        let dump = mirror.dump();
        let hashes = |chains: &[proto::Stored]| -> Vec<u64> {
            let mut held: Vec<u64> = chains
                .iter()
                .flat_map(|c| c.blocks.iter().map(|b| b.block_hash))
                .collect();
            held.sort();
            held
        };
        assert_eq!(hashes(&dump.chains), [1]);
        assert_eq!(hashes(&dump.offload_chains), [1, 2]);
        // The digest covers both tiers: hash 1 once per tier.
        let digest = mirror.take_digest();
        let expected =
            kvroute_index::BlockSetDigest::of([1]).plus(kvroute_index::BlockSetDigest::of([1, 2]));
        assert_eq!(
            (digest.block_count, digest.block_set_hash),
            (expected.block_count, expected.block_set_hash)
        );
        let (tier, removal) = f.translate(&cpu_removal).unwrap();
        mirror.record(tier, removal);
        assert_eq!(hashes(&mirror.dump().offload_chains), [1]);
        assert_eq!(mirror.blocks(), 2);
    }
}
