//! The sharded table of distinct blocks: block key → which workers hold it.
//!
//! One flat hash map per shard, keyed by the block's chain key, holds each
//! distinct block once with the set of workers holding it as a bitset of interned
//! worker indices (the first 64 inline, the rest in a per-shard side map that stays
//! empty in fleets of up to 64 ranks). See DESIGN.md for why the layout and the
//! sharding rule were chosen.
//!
//! Sharding rule: a block at depth 0 or 1 lives in the shard picked by its own hash;
//! a deeper block lives in its parent's shard. Every block below one depth-1 block
//! (a conversation, typically) therefore shares a shard, so a lookup takes at most
//! two read locks and a writer's chain segment is applied under one write lock.

use std::collections::{HashMap, hash_map};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Shards of the block table; a power of two.
pub(crate) const SHARDS: usize = 64;

/// Marks "no parent" (a depth-0 block) in [`Entry::parent`].
pub(crate) const NO_PARENT: u64 = 0;

/// The index's key of a block whose local hash is `local`, following the block
/// keyed `parent` (none at depth 0): a chain like Dynamo's sequence hash, so a
/// key names a block with its whole prefix, but a folded 64×64→128-bit multiply
/// instead of an xxh3 call. It costs about a nanosecond, which matters because
/// a lookup must chain every block it probes. Dynamo's sequence hash is only
/// needed on the wire; keys never leave the index.
pub(crate) fn chain_key(parent: Option<u64>, local: u64) -> u64 {
    let parent = parent.unwrap_or(0x243F_6A88_85A3_08D3);
    let product =
        u128::from(parent ^ 0x1319_8A2E_0370_7344) * u128::from(local ^ 0xA409_3822_299F_31D0);
    (product as u64) ^ ((product >> 64) as u64)
}

/// The keys of a path of local hashes, from block 0.
pub(crate) fn chain_keys(local_hashes: &[u64]) -> Vec<u64> {
    let mut parent = None;
    local_hashes
        .iter()
        .map(|&local| {
            let key = chain_key(parent, local);
            parent = Some(key);
            key
        })
        .collect()
}

/// A block's key in the table, which also says where it lives: the chain key
/// with its low seven bits replaced by the block's shard and a depth-0 flag, so
/// a worker's engine-hash map needs one word per block (57 bits of hash are
/// plenty to tell blocks apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockRef(u64);

const FLAG_BITS: u64 = 0x7F;

impl BlockRef {
    /// The block whose local hash is `local`, following `parent` (none: depth 0).
    #[inline]
    pub fn child_of(parent: Option<BlockRef>, local: u64) -> BlockRef {
        let raw = chain_key(parent.map(|p| p.0), local);
        let shard = match parent {
            Some(p) if !p.is_root() => p.shard(),
            _ => shard_of(raw),
        };
        BlockRef((raw & !FLAG_BITS) | u64::from(shard) << 1 | u64::from(parent.is_none()))
    }

    pub fn from_key(key: u64) -> BlockRef {
        BlockRef(key)
    }

    /// The block's key in its shard's map.
    #[inline]
    pub fn key(self) -> u64 {
        self.0
    }

    #[inline]
    pub fn shard(self) -> u16 {
        (self.0 >> 1) as u16 & (SHARDS as u16 - 1)
    }

    /// Depth 0 (no parent): its children pick their own shard.
    pub fn is_root(self) -> bool {
        self.0 & 1 == 1
    }
}

fn shard_of(raw: u64) -> u16 {
    (raw >> 58) as u16 & (SHARDS as u16 - 1)
}

/// The blocks of a path of local hashes, from block 0.
pub(crate) fn path_refs(local_hashes: &[u64]) -> Vec<BlockRef> {
    let mut parent = None;
    local_hashes
        .iter()
        .map(|&local| {
            let r = BlockRef::child_of(parent, local);
            parent = Some(r);
            r
        })
        .collect()
}

/// One distinct block.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Entry {
    /// Workers 0..64 holding the block; higher indices are in [`Shard::wide`].
    pub workers: u64,
    /// The block's local hash and its parent's key, for dumps.
    pub tokens_hash: u64,
    pub parent: u64,
}

/// Sequence hashes are already uniform: use them as their own hash, rotated so
/// that the shard bits (the top six) pick neither hashbrown's bucket nor its tag.
#[derive(Default)]
pub(crate) struct SeqHasher(u64);

impl Hasher for SeqHasher {
    fn finish(&self) -> u64 {
        self.0.rotate_left(32)
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("SeqHasher only hashes u64 keys")
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

pub(crate) type SeqMap<V> = HashMap<u64, V, BuildHasherDefault<SeqHasher>>;

#[derive(Default)]
pub(crate) struct Shard {
    pub entries: SeqMap<Entry>,
    /// Bitset words for worker indices 64 and up (word 0 = indices 64..128).
    pub wide: SeqMap<Vec<u64>>,
}

impl Shard {
    /// Adds `worker` to the block, creating it. Returns (whether the worker is
    /// new to the block, whether the block is new).
    pub fn insert(&mut self, seq: u64, tokens_hash: u64, parent: u64, worker: u32) -> (bool, bool) {
        let (entry, created) = match self.entries.entry(seq) {
            hash_map::Entry::Occupied(o) => (o.into_mut(), false),
            hash_map::Entry::Vacant(v) => (
                v.insert(Entry {
                    workers: 0,
                    tokens_hash,
                    parent,
                }),
                true,
            ),
        };
        if worker < 64 {
            let bit = 1 << worker;
            let added = entry.workers & bit == 0;
            entry.workers |= bit;
            (added, created)
        } else {
            let (word, bit) = wide_bit(worker);
            let words = self.wide.entry(seq).or_default();
            if words.len() <= word {
                words.resize(word + 1, 0);
            }
            let added = words[word] & bit == 0;
            words[word] |= bit;
            (added, created)
        }
    }

    /// Removes `worker` from the block, dropping the block when nobody holds it.
    /// Returns (whether the worker held it, whether the block is gone).
    pub fn remove(&mut self, seq: u64, worker: u32) -> (bool, bool) {
        // One probe for the lookup and the removal.
        let hash_map::Entry::Occupied(mut occupied) = self.entries.entry(seq) else {
            return (false, false);
        };
        let entry = occupied.get_mut();
        let held = if worker < 64 {
            let bit = 1 << worker;
            let held = entry.workers & bit != 0;
            entry.workers &= !bit;
            held
        } else {
            let (word, bit) = wide_bit(worker);
            match self.wide.get_mut(&seq) {
                Some(words) if words.get(word).is_some_and(|w| w & bit != 0) => {
                    words[word] &= !bit;
                    if words.iter().all(|&w| w == 0) {
                        self.wide.remove(&seq);
                    }
                    true
                }
                _ => false,
            }
        };
        let empty = entry.workers == 0 && (self.wide.is_empty() || !self.wide.contains_key(&seq));
        if empty {
            occupied.remove();
            shrink_sparse(&mut self.entries);
        }
        (held, empty)
    }

    /// Drops the block for every worker; returns the worker indices that held it.
    pub fn evict(&mut self, seq: u64) -> Vec<u32> {
        let mut holders = Vec::new();
        if let Some(entry) = self.entries.remove(&seq) {
            holders.extend(bits(entry.workers, 0));
            shrink_sparse(&mut self.entries);
        }
        if let Some(words) = self.wide.remove(&seq) {
            for (i, &w) in words.iter().enumerate() {
                holders.extend(bits(w, 64 * (i as u32 + 1)));
            }
        }
        holders
    }

    /// Word `group` of the block's worker set (group 0: workers 0..64).
    #[inline]
    pub fn workers(&self, seq: u64, group: usize) -> u64 {
        if group == 0 {
            self.entries.get(&seq).map_or(0, |e| e.workers)
        } else {
            self.wide
                .get(&seq)
                .and_then(|w| w.get(group - 1).copied())
                .unwrap_or(0)
        }
    }
}

/// Gives memory back once a map is under a quarter full, keeping room to double:
/// hash maps never shrink by themselves, and under churn a shard's share of the
/// blocks moves around. Inlined: it runs after every removal, almost always
/// only to compare two numbers.
#[inline]
pub(crate) fn shrink_sparse<K: Eq + std::hash::Hash, V, S: std::hash::BuildHasher>(
    map: &mut HashMap<K, V, S>,
) {
    if map.capacity() > 64 && map.len() * 4 < map.capacity() {
        map.shrink_to(map.len() * 2);
    }
}

/// Heap bytes of a hashbrown-backed map: its buckets, one control byte each, and
/// one group of trailing control bytes.
pub(crate) fn map_bytes<K, V, S>(map: &HashMap<K, V, S>) -> u64 {
    let capacity = map.capacity();
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    (buckets * (size_of::<(K, V)>() + 1) + 16) as u64
}

fn wide_bit(worker: u32) -> (usize, u64) {
    let i = worker - 64;
    ((i / 64) as usize, 1 << (i % 64))
}

/// The worker indices whose bits are set in `word`, offset by `base`.
pub(crate) fn bits(mut word: u64, base: u32) -> impl Iterator<Item = u32> {
    std::iter::from_fn(move || {
        (word != 0).then(|| {
            let i = word.trailing_zeros();
            word &= word - 1;
            base + i
        })
    })
}

/// The shards, each behind its own lock.
pub(crate) struct Table {
    shards: Box<[RwLock<Shard>]>,
}

impl Table {
    pub fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
        }
    }

    pub fn read(&self, shard: u16) -> RwLockReadGuard<'_, Shard> {
        self.shards[shard as usize].read().unwrap()
    }

    pub fn write(&self, shard: u16) -> RwLockWriteGuard<'_, Shard> {
        self.shards[shard as usize].write().unwrap()
    }

    /// Heap bytes of every shard's tables.
    pub fn heap_bytes(&self) -> u64 {
        (0..SHARDS as u16)
            .map(|s| {
                let shard = self.read(s);
                map_bytes(&shard.entries)
                    + map_bytes(&shard.wide)
                    + shard
                        .wide
                        .values()
                        .map(|w| 8 * w.capacity() as u64)
                        .sum::<u64>()
            })
            .sum()
    }

    pub fn distinct_blocks(&self) -> u64 {
        (0..SHARDS as u16)
            .map(|s| self.read(s).entries.len() as u64)
            .sum()
    }
}

/// Write access to one shard at a time, re-locking only when the shard changes,
/// so a run of blocks in the same shard costs one lock.
pub(crate) struct ShardWriter<'a> {
    table: &'a Table,
    current: Option<(u16, RwLockWriteGuard<'a, Shard>)>,
}

impl<'a> ShardWriter<'a> {
    pub fn new(table: &'a Table) -> Self {
        Self {
            table,
            current: None,
        }
    }

    #[inline]
    pub fn shard(&mut self, shard: u16) -> &mut Shard {
        if self.current.as_ref().is_none_or(|(s, _)| *s != shard) {
            self.current = None;
            self.current = Some((shard, self.table.write(shard)));
        }
        &mut self.current.as_mut().unwrap().1
    }
}

/// Read access to one shard at a time, like [`ShardWriter`].
pub(crate) struct ShardReader<'a> {
    table: &'a Table,
    current: Option<(u16, RwLockReadGuard<'a, Shard>)>,
}

impl<'a> ShardReader<'a> {
    pub fn new(table: &'a Table) -> Self {
        Self {
            table,
            current: None,
        }
    }

    pub fn shard(&mut self, shard: u16) -> &Shard {
        if self.current.as_ref().is_none_or(|(s, _)| *s != shard) {
            self.current = None;
            self.current = Some((shard, self.table.read(shard)));
        }
        &self.current.as_ref().unwrap().1
    }
}
