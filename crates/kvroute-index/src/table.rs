//! The sharded table of distinct blocks: block key → which workers hold it.
//!
//! One flat hash map per shard, keyed by the block's chain key, holds each
//! distinct block once with the set of interned worker indices holding it in
//! one 32-bit word ([`Holders`]): a bitset in fleets of up to 31 ranks, else a
//! list of one or two indices, else (a block shared by many workers of a large fleet)
//! a sorted list in the shard's spill map. See DESIGN.md for why the layout and
//! the sharding rule were chosen.
//!
//! Sharding rule: a block at depth 0 or 1 lives in the shard picked by its own hash;
//! a deeper block lives in its parent's shard. Every block below one depth-1 block
//! (a conversation, typically) therefore shares a shard, so a lookup takes at most
//! two read locks and a writer's chain segment is applied under one write lock.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crossbeam_utils::CachePadded;

use crate::flat::{FlatMap, Zeroable};

/// Shards of the block table; a power of two.
pub(crate) const SHARDS: usize = 64;

/// Slots a shard's table keeps once it grew past them (8 KB): see [`FlatMap`].
/// At 16 workers a shard's share of the blocks swings between ~70 and ~300
/// entries: with a lower floor the shards grew and shrank round the same
/// lengths several times a replay. 400 keeps them at 400 for a few bytes more
/// heap a membership in the churned state, and nothing once a fleet fills the
/// shards past it (docs/measurements/index-vs-dynamo.md, "Layout choices").
const SHARD_FLOOR: usize = 400;

/// Marks "no parent" (a depth-0 block) in [`Entry::parent`].
pub(crate) const NO_PARENT: u64 = 0;

/// A chain key like Dynamo's sequence hash, so a key names a block with its
/// whole prefix, but a folded 64×64→128-bit multiply instead of an xxh3 call:
/// the predicted layer's keys ([`crate::predicted`]). The block table's keys
/// are [`BlockRef`]s, whose step can be undone.
pub(crate) fn chain_key(parent: Option<u64>, local: u64) -> u64 {
    let parent = parent.unwrap_or(0x243F_6A88_85A3_08D3);
    let product =
        u128::from(parent ^ 0x1319_8A2E_0370_7344) * u128::from(local ^ 0xA409_3822_299F_31D0);
    (product as u64) ^ ((product >> 64) as u64)
}

/// The keys of a path of local hashes, from block 0, into `keys` (emptied
/// first): callers keep the buffer.
pub(crate) fn chain_keys(local_hashes: &[u64], keys: &mut Vec<u64>) {
    let mut parent = None;
    keys.clear();
    keys.extend(local_hashes.iter().map(|&local| {
        let key = chain_key(parent, local);
        parent = Some(key);
        key
    }));
}

/// A block's key in the table, which also says where it lives: 57 bits of
/// chain hash above the block's shard and a depth-0 flag (the low seven bits),
/// so a worker's engine-hash map needs one word per block (57 bits of hash
/// are plenty to tell blocks apart).
///
/// The chain hash names a block with its whole prefix, like Dynamo's sequence
/// hash, but costs a multiply, not an xxh3 call: a lookup chains every block
/// it probes, and keys never leave the index. Its step is a bijection of the
/// parent's hash for each local hash, so a block's parent follows from its own
/// key and local hash ([`BlockRef::parent_candidates`]) and the table need not
/// store it: a 24-byte slot, not 32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct BlockRef(u64);

// SAFETY: a `u64`, valid for any bits.
unsafe impl Zeroable for BlockRef {}

/// Bits of chain hash in a key, above the flags.
const HASH_BITS: u32 = 57;
const HASH_MASK: u64 = (1 << HASH_BITS) - 1;
/// The parent hash of depth-0 blocks.
const ROOT_SEED: u64 = 0x243F_6A88_85A3_08D3 & HASH_MASK;
/// Odd, so that multiplying by it modulo 2^57 is a bijection.
const STEP_MUL: u64 = 0x9E37_79B9_7F4A_7C15 & HASH_MASK;
const STEP_MUL_INV: u64 = inverse_mod_2_64(STEP_MUL) & HASH_MASK;
const LOCAL_MUL: u64 = 0xD6E8_FEB8_6659_FD93;

/// The inverse of odd `k` modulo 2^64 (Newton's iteration: each step doubles
/// the correct low bits, from 3).
const fn inverse_mod_2_64(k: u64) -> u64 {
    let mut inv = k;
    let mut i = 0;
    while i < 5 {
        inv = inv.wrapping_mul(2u64.wrapping_sub(k.wrapping_mul(inv)));
        i += 1;
    }
    inv
}

/// A local hash folded to 57 bits, all of its bits mixed in.
#[inline]
fn local_mix(local: u64) -> u64 {
    local.wrapping_mul(LOCAL_MUL) >> (64 - HASH_BITS)
}

/// The chain hash of the block with local hash `local` under the block of
/// chain hash `parent`: for each `local`, a bijection of `parent` (xor, an odd
/// multiply and a xorshift, all modulo 2^57).
#[inline]
fn chain_step(parent: u64, local: u64) -> u64 {
    let x = ((parent ^ local_mix(local)).wrapping_mul(STEP_MUL)) & HASH_MASK;
    x ^ (x >> 29)
}

/// The `parent` of [`chain_step`] (`x >> 29` has no bits past 57 − 29, so one
/// xorshift undoes the other).
fn chain_unstep(hash: u64, local: u64) -> u64 {
    let x = hash ^ (hash >> 29);
    (x.wrapping_mul(STEP_MUL_INV) & HASH_MASK) ^ local_mix(local)
}

impl BlockRef {
    /// The block whose local hash is `local`, following `parent` (none: depth 0).
    #[inline]
    pub fn child_of(parent: Option<BlockRef>, local: u64) -> BlockRef {
        let raw = chain_step(parent.map_or(ROOT_SEED, |p| p.0 >> 7), local) << 7;
        let shard = match parent {
            Some(p) if !p.is_root() => p.shard(),
            _ => shard_of(raw),
        };
        BlockRef(raw | u64::from(shard) << 1 | u64::from(parent.is_none()))
    }

    /// The blocks that may be the parent of this one (not a depth-0 block),
    /// whose local hash is `local`: the chain step is undone to the parent's
    /// hash, but whether the parent is at depth 0, which sets its flags, is
    /// not in the key. The first candidate is the depth-0 one, if this block's
    /// shard allows it (a depth-1 block's shard is its own hash's, a deeper
    /// one's its parent's); of two, the one a worker holds is the parent
    /// (both held: odds of 2^-57).
    pub fn parent_candidates(self, local: u64) -> [Option<BlockRef>; 2] {
        let raw = chain_unstep(self.0 >> 7, local) << 7;
        let root = (self.shard() == shard_of(self.0))
            .then(|| BlockRef(raw | u64::from(shard_of(raw)) << 1 | 1));
        [root, Some(BlockRef(raw | u64::from(self.shard()) << 1))]
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
pub(crate) fn path_refs(local_hashes: &[u64]) -> impl Iterator<Item = BlockRef> + '_ {
    let mut parent = None;
    local_hashes.iter().map(move |&local| {
        let r = BlockRef::child_of(parent, local);
        parent = Some(r);
        r
    })
}

/// One distinct block: with its key, a 20-byte slot.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Entry {
    /// The workers holding the block, in one word (see [`Holders`]).
    pub workers: Holders,
    /// The block's local hash, for dumps (its parent follows from it and the
    /// key: [`BlockRef::parent_candidates`]); in halves, so that the entry is
    /// 4-byte aligned and packs beside its key.
    tokens_hash: [u32; 2],
}

// SAFETY: an entry is three `u32`s (the holders word and the hash's halves),
// valid for any bits.
unsafe impl Zeroable for Entry {}

impl Entry {
    fn new(tokens_hash: u64) -> Entry {
        Entry {
            workers: Holders::NONE,
            tokens_hash: [tokens_hash as u32, (tokens_hash >> 32) as u32],
        }
    }

    pub fn tokens_hash(&self) -> u64 {
        u64::from(self.tokens_hash[0]) | u64::from(self.tokens_hash[1]) << 32
    }

    /// In a bounded index (`max_blocks`) the low half of the local hash gives
    /// way to the block's node in the recency order ([`crate::lru`]), which
    /// keeps that half: the order needs no index of its own, and the slot
    /// stays 20 bytes in both kinds of index.
    pub fn lru_node(&self) -> u32 {
        self.tokens_hash[0]
    }

    /// Puts the block's recency node where the low half of its local hash
    /// was; returns that half.
    pub fn set_lru_node(&mut self, node: u32) -> u32 {
        std::mem::replace(&mut self.tokens_hash[0], node)
    }

    /// The local hash of a bounded index's block, whose low half its
    /// recency node keeps.
    pub fn tokens_hash_with_low(&self, low: u32) -> u64 {
        u64::from(low) | u64::from(self.tokens_hash[1]) << 32
    }
}

/// Worker indices below this are bits of the inline bitset.
const BITSET_IDS: u32 = 31;
/// Marks the list forms of [`Holders`].
const LIST_FLAG: u32 = 1 << 31;
/// Marks, in a list form, one wide index instead of two narrow ones.
const WIDE_FLAG: u32 = 1 << 30;
/// Bits of one narrow index, two of them to a word.
const SLOT_BITS: u32 = 15;
/// An empty narrow slot, and the first index too wide for one.
const NO_ID: u32 = (1 << SLOT_BITS) - 1;
/// The bits of the wide index.
const WIDE_MASK: u32 = WIDE_FLAG - 1;
/// Neither inline form fits: the holders are in the shard's spill map.
const SPILLED: u32 = u32::MAX;

/// The set of workers holding a block, in the 32-bit word the block's table
/// slot keeps, in the first of these forms that fits:
/// - a bitset of worker indices 0..31 (top bit clear; empty is 0), so a fleet
///   of up to 31 ranks never leaves it and a lookup intersects with an AND;
/// - a list of up to two indices below 32 767, of 15 bits each (top bit set),
///   or of one index below 2^30 − 1 (the next bit set too): in a large fleet
///   nearly every block has one or two holders (at 1,024 workers, 97 % one and
///   2.5 % two, on the conversation trace);
/// - spilled: the sorted indices live in the shard's spill map.
///
/// A 32-bit word, not 64 (which held a bitset of 63 and lists of three), takes
/// 4 bytes off every block's slot; the blocks it sends to the spill map
/// instead (three holders in a fleet past 31 ranks) are a fraction of a percent.
/// The form is a function of the set (each change re-encodes it), so equal
/// sets are equal words and an empty set is 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Holders(u32);

impl Holders {
    pub const NONE: Holders = Holders(0);

    /// The word for `ids` (sorted, distinct); [`Holders::is_spilled`] when
    /// neither inline form fits them.
    fn encode(ids: &[u32]) -> Holders {
        match ids {
            _ if ids.iter().all(|&i| i < BITSET_IDS) => {
                Holders(ids.iter().fold(0, |w, &i| w | 1 << i))
            }
            [a] if *a < NO_ID => Holders(LIST_FLAG | a | NO_ID << SLOT_BITS),
            [a, b] if *b < NO_ID => Holders(LIST_FLAG | a | b << SLOT_BITS),
            [a] if *a < WIDE_MASK => Holders(LIST_FLAG | WIDE_FLAG | a),
            _ => Holders(SPILLED),
        }
    }

    /// The bitset, in the bitset form.
    #[inline]
    pub fn bitset(self) -> Option<u64> {
        (self.0 & LIST_FLAG == 0).then_some(u64::from(self.0))
    }

    pub fn is_spilled(self) -> bool {
        self.0 == SPILLED
    }

    /// The indices of a list form, ascending.
    #[inline]
    fn listed(self) -> impl Iterator<Item = u32> {
        let w = self.0;
        let ids = if w & WIDE_FLAG != 0 {
            [Some(w & WIDE_MASK), None]
        } else {
            let narrow = |s: u32| Some((w >> (SLOT_BITS * s)) & NO_ID).filter(|&i| i != NO_ID);
            [narrow(0), narrow(1)]
        };
        ids.into_iter().flatten()
    }

    /// The indices of an inline form, ascending.
    fn inline_ids(self) -> InlineIds {
        let mut ids = InlineIds {
            ids: [0; BITSET_IDS as usize + 1],
            len: 0,
        };
        let listed: &mut dyn Iterator<Item = u32> = match self.bitset() {
            Some(b) => &mut bits(b, 0),
            None => &mut self.listed(),
        };
        for id in listed {
            ids.ids[ids.len] = id;
            ids.len += 1;
        }
        ids
    }
}

/// The indices of an inline [`Holders`] form and room for one more, on the
/// stack: a store or removal of a block in a fleet past 31 ranks re-encodes
/// the list form, and allocating a `Vec` for it was one allocation per block.
struct InlineIds {
    ids: [u32; BITSET_IDS as usize + 1],
    len: usize,
}

impl InlineIds {
    fn as_slice(&self) -> &[u32] {
        &self.ids[..self.len]
    }

    /// Adds `id`, keeping the order; false if present.
    fn insert(&mut self, id: u32) -> bool {
        let Err(at) = self.as_slice().binary_search(&id) else {
            return false;
        };
        self.ids.copy_within(at..self.len, at + 1);
        self.ids[at] = id;
        self.len += 1;
        true
    }

    /// Removes `id`; false if absent.
    fn remove(&mut self, id: u32) -> bool {
        let Ok(at) = self.as_slice().binary_search(&id) else {
            return false;
        };
        self.ids.copy_within(at + 1..self.len, at);
        self.len -= 1;
        true
    }
}

/// A block's holders as a lookup reads them.
pub(crate) enum HolderSet<'a> {
    Bits(u64),
    List(Holders),
    Spilled(&'a [u32]),
}

impl HolderSet<'_> {
    #[inline]
    pub fn contains(&self, idx: u32) -> bool {
        match self {
            HolderSet::Bits(b) => idx < BITSET_IDS && b & 1 << idx != 0,
            HolderSet::List(h) => h.listed().any(|i| i == idx),
            HolderSet::Spilled(ids) => ids.binary_search(&idx).is_ok(),
        }
    }

    /// The members of `set` (a bitset of indices 0..31) that hold the block.
    #[inline]
    pub fn mask(&self, set: u64) -> u64 {
        match self {
            HolderSet::Bits(b) => set & b,
            _ => bits(set, 0)
                .filter(|&i| self.contains(i))
                .fold(0, |w, i| w | 1 << i),
        }
    }

    /// All holders, ascending, appended to `out`.
    pub fn ids_into(&self, out: &mut Vec<u32>) {
        match self {
            HolderSet::Bits(b) => out.extend(bits(*b, 0)),
            HolderSet::List(h) => out.extend(h.listed()),
            HolderSet::Spilled(ids) => out.extend_from_slice(ids),
        }
    }

    /// Whether any holder passes `f`.
    #[inline]
    pub fn any(&self, mut f: impl FnMut(u32) -> bool) -> bool {
        match self {
            HolderSet::Bits(b) => bits(*b, 0).any(f),
            HolderSet::List(h) => h.listed().any(f),
            HolderSet::Spilled(ids) => ids.iter().any(|&id| f(id)),
        }
    }

    /// How many hold the block.
    pub fn len(&self) -> usize {
        match self {
            HolderSet::Bits(b) => b.count_ones() as usize,
            HolderSet::List(h) => h.listed().count(),
            HolderSet::Spilled(ids) => ids.len(),
        }
    }

    /// Keeps in `ids` (ascending) those that hold the block and passes the
    /// runs of the others, in order, to `dropped`, with one search of `ids` per
    /// holder: for when the holders are far fewer than `ids` (block 0 held by
    /// the whole fleet, block 1 by one to three workers), where testing every
    /// id against the holders cost a branchy probe per id.
    pub fn keep_held(&self, ids: &mut Vec<u32>, dropped: impl FnMut(&[u32])) {
        match self {
            HolderSet::Bits(b) => keep_listed(ids, bits(*b, 0), dropped),
            HolderSet::List(h) => keep_listed(ids, h.listed(), dropped),
            HolderSet::Spilled(held) => keep_listed(ids, held.iter().copied(), dropped),
        }
    }
}

/// [`HolderSet::keep_held`] over the holders, ascending.
fn keep_listed(
    ids: &mut Vec<u32>,
    holders: impl Iterator<Item = u32>,
    mut dropped: impl FnMut(&[u32]),
) {
    let (mut kept, mut from) = (0, 0);
    for h in holders {
        if let Ok(at) = ids[from..].binary_search(&h) {
            let at = from + at;
            dropped(&ids[from..at]);
            // `kept` <= `at` < the new `from`: nothing still to be read.
            ids[kept] = h;
            kept += 1;
            from = at + 1;
        }
    }
    dropped(&ids[from..]);
    ids.truncate(kept);
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
    pub entries: FlatMap<Entry, SHARD_FLOOR>,
    /// Sorted holder indices of the blocks whose holders are spilled.
    pub spilled: SeqMap<Vec<u32>>,
}

impl Shard {
    /// Adds `worker` to the block, creating it. Returns whether the worker is
    /// new to the block, whether the block is new, and its entry.
    /// Always inlined: see [`FlatMap::get_or_insert`].
    #[inline(always)]
    pub fn insert(&mut self, seq: u64, tokens_hash: u64, worker: u32) -> (bool, bool, &mut Entry) {
        let Shard { entries, spilled } = self;
        let (entry, created) = entries.get_or_insert(seq, || Entry::new(tokens_hash));
        if let Some(b) = entry.workers.bitset()
            && worker < BITSET_IDS
        {
            let bit = 1 << worker;
            entry.workers = Holders((b | bit) as u32);
            return (b & bit == 0, created, entry);
        }
        if entry.workers == Holders::NONE {
            // A new block (most of a large fleet's): its first holder.
            entry.workers = Holders::encode(&[worker]);
            if entry.workers.is_spilled() {
                spilled.insert(seq, vec![worker]);
            }
            return (true, created, entry);
        }
        if entry.workers.is_spilled() {
            let ids = spilled.get_mut(&seq).expect("spilled holders are listed");
            let added = match ids.binary_search(&worker) {
                Ok(_) => false,
                Err(at) => {
                    ids.insert(at, worker);
                    true
                }
            };
            return (added, created, entry);
        }
        let mut ids = entry.workers.inline_ids();
        if !ids.insert(worker) {
            return (false, created, entry);
        }
        entry.workers = Holders::encode(ids.as_slice());
        if entry.workers.is_spilled() {
            spilled.insert(seq, ids.as_slice().to_vec());
        }
        (true, created, entry)
    }

    /// Removes `worker` from the block, dropping the block when nobody holds it.
    /// Returns whether the worker held it, and the entry of a block now gone.
    /// Always inlined: see [`FlatMap::get_or_insert`].
    #[inline(always)]
    pub fn remove(&mut self, seq: u64, worker: u32) -> (bool, Option<Entry>) {
        let Shard { entries, spilled } = self;
        let (mut held, mut empty) = (false, None);
        entries.change_or_remove(seq, |entry| {
            held = match entry.workers.bitset() {
                // A small fleet's every block, inline.
                Some(b) => {
                    let held = worker < BITSET_IDS && b & 1 << worker != 0;
                    if held {
                        entry.workers = Holders((b & !(1 << worker)) as u32);
                    }
                    held
                }
                None => Self::remove_listed(spilled, seq, &mut entry.workers, worker),
            };
            let gone = entry.workers == Holders::NONE;
            empty = gone.then_some(*entry);
            gone
        });
        (held, empty)
    }

    /// [`Self::remove`] from holders in a list form or spilled; whether the
    /// worker held the block.
    fn remove_listed(
        spilled: &mut SeqMap<Vec<u32>>,
        seq: u64,
        workers: &mut Holders,
        worker: u32,
    ) -> bool {
        if workers.is_spilled() {
            let ids = spilled.get_mut(&seq).expect("spilled holders are listed");
            let Ok(at) = ids.binary_search(&worker) else {
                return false;
            };
            ids.remove(at);
            let encoded = Holders::encode(ids);
            if !encoded.is_spilled() {
                *workers = encoded;
                spilled.remove(&seq);
                shrink_sparse(spilled);
            }
            return true;
        }
        let mut ids = workers.inline_ids();
        let held = ids.remove(worker);
        if held {
            *workers = Holders::encode(ids.as_slice());
        }
        held
    }

    /// Drops the block for every worker; returns the worker indices that held it.
    pub fn evict(&mut self, seq: u64) -> Vec<u32> {
        let Some(entry) = self.entries.remove(seq) else {
            return Vec::new();
        };
        if entry.workers.is_spilled() {
            let ids = self.spilled.remove(&seq).unwrap_or_default();
            shrink_sparse(&mut self.spilled);
            ids
        } else {
            entry.workers.inline_ids().as_slice().to_vec()
        }
    }

    /// The block's holders (none if the block is absent).
    #[inline]
    pub fn holders(&self, seq: u64) -> HolderSet<'_> {
        let workers = self.entries.get(seq).map_or(Holders::NONE, |e| e.workers);
        self.holder_set(seq, workers)
    }

    /// The holders of block `seq`, whose word is `workers`.
    #[inline]
    fn holder_set(&self, seq: u64, workers: Holders) -> HolderSet<'_> {
        match workers.bitset() {
            Some(b) => HolderSet::Bits(b),
            None if workers.is_spilled() => {
                HolderSet::Spilled(self.spilled.get(&seq).map_or(&[], Vec::as_slice))
            }
            None => HolderSet::List(workers),
        }
    }

    /// [`Self::holders`], with a copy of the block's entry (zeroed if the
    /// block is absent).
    #[inline]
    pub fn holders_and_entry(&self, seq: u64) -> (HolderSet<'_>, Entry) {
        let entry = self.entries.get(seq).copied().unwrap_or_default();
        (self.holder_set(seq, entry.workers), entry)
    }

    pub fn holds(&self, seq: u64, worker: u32) -> bool {
        self.holders(seq).contains(worker)
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
    /// Each on cache lines of its own: two ingest threads writing neighbouring
    /// shards otherwise bounced one line between their cores.
    shards: Box<[CachePadded<RwLock<Shard>>]>,
}

impl Table {
    pub fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| CachePadded::default()).collect(),
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
                shard.entries.heap_bytes()
                    + map_bytes(&shard.spilled)
                    + shard
                        .spilled
                        .values()
                        .map(|ids| 4 * ids.capacity() as u64)
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

    /// Lets the shard held go, if any.
    #[inline]
    pub fn release(&mut self) {
        self.current = None;
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Keeping the holders by searching for each one leaves what testing
        /// every id leaves, and drops the others in order.
        #[test]
        fn keep_held_keeps_the_holders_and_drops_the_rest_in_order(
            ids in prop::collection::btree_set(0..300u32, 0..120),
            held in prop::collection::btree_set(0..300u32, 0..12),
        ) {
            let held: Vec<u32> = held.into_iter().collect();
            let holders = HolderSet::Spilled(&held);
            let mut kept: Vec<u32> = ids.iter().copied().collect();
            let mut dropped = Vec::new();
            holders.keep_held(&mut kept, |run| dropped.extend_from_slice(run));
            let (expect_kept, expect_dropped): (Vec<u32>, Vec<u32>) =
                ids.iter().partition(|i| held.contains(i));
            prop_assert_eq!(kept, expect_kept);
            prop_assert_eq!(dropped, expect_dropped);
            let bits: u64 = held.iter().filter(|&&i| i < 31).fold(0, |w, &i| w | 1 << i);
            let mut kept: Vec<u32> = ids.iter().copied().collect();
            HolderSet::Bits(bits).keep_held(&mut kept, |_| ());
            let in_bits: BTreeSet<u32> = bits_of(bits);
            prop_assert!(kept.iter().all(|i| in_bits.contains(i) && ids.contains(i)));
            prop_assert_eq!(kept.len(), ids.intersection(&in_bits).count());
        }
    }

    proptest! {
        /// A block's parent is among the candidates its key and local hash
        /// give, at every depth, and a depth-0 candidate is offered only where
        /// the block's shard allows one.
        #[test]
        fn the_chain_step_is_undone_to_the_parent(locals in prop::collection::vec(any::<u64>(), 2..40)) {
            let path: Vec<BlockRef> = path_refs(&locals).collect();
            prop_assert!(path[0].is_root());
            for (depth, pair) in path.windows(2).enumerate() {
                let (parent, child) = (pair[0], pair[1]);
                prop_assert!(!child.is_root());
                let [root, inner] = child.parent_candidates(locals[depth + 1]);
                if depth == 0 {
                    prop_assert_eq!(root, Some(parent));
                } else {
                    prop_assert_eq!(inner, Some(parent));
                    prop_assert_ne!(root, Some(parent));
                }
            }
        }

        /// A block's holders follow adds and removals, against a set, through
        /// every form (bitset, one or two narrow, one wide, spilled) and back.
        #[test]
        fn holders_follow_adds_and_removals(
            ops in prop::collection::vec(
                (any::<bool>(), prop_oneof![0..40u32, 32_760..32_775u32, (1u32 << 30) - 2..(1 << 30) + 2]),
                1..200,
            ),
        ) {
            let mut shard = Shard::default();
            let mut model = BTreeSet::new();
            const SEQ: u64 = 0x1234_5678_9ABC_DEF0;
            for (add, worker) in ops {
                if add {
                    let (added, created, _) = shard.insert(SEQ, 7, worker);
                    prop_assert_eq!(created, model.is_empty());
                    prop_assert_eq!(added, model.insert(worker));
                } else {
                    let (held, gone) = shard.remove(SEQ, worker);
                    prop_assert_eq!(held, model.remove(&worker));
                    prop_assert_eq!(gone.is_some(), held && model.is_empty());
                }
                let mut ids = Vec::new();
                shard.holders(SEQ).ids_into(&mut ids);
                prop_assert_eq!(ids, model.iter().copied().collect::<Vec<u32>>());
                prop_assert_eq!(shard.spilled.len(), usize::from(
                    shard.entries.get(SEQ).is_some_and(|e| e.workers.is_spilled())));
            }
        }

        /// Every set of holders reads back as itself, in the first form that
        /// fits, and equal sets are equal words.
        #[test]
        fn holders_read_back_as_encoded(
            ids in prop::collection::btree_set(
                prop_oneof![0..40u32, 32_700..32_800u32, (1u32 << 30) - 3..(1 << 30) + 3],
                0..5,
            ),
        ) {
            let ids: Vec<u32> = ids.into_iter().collect();
            let word = Holders::encode(&ids);
            let fits_bits = ids.iter().all(|&i| i < 31);
            let fits_list = match ids.as_slice() {
                [a] => *a < (1 << 30) - 1,
                [_, b] => *b < NO_ID,
                _ => false,
            };
            prop_assert_eq!(word.is_spilled(), !fits_bits && !fits_list);
            prop_assert_eq!(word.bitset().is_some(), fits_bits);
            if !word.is_spilled() {
                let read = word.inline_ids();
                prop_assert_eq!(read.as_slice(), ids.as_slice());
            }
            prop_assert_eq!(word == Holders::NONE, ids.is_empty());
        }
    }

    fn bits_of(b: u64) -> BTreeSet<u32> {
        bits(b, 0).collect()
    }
}
