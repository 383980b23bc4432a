//! One table shard's blocks: chain key → entry, in a table of our own.
//!
//! Open addressing with linear probing and backward-shift deletion (no
//! tombstones), one 32-byte slot per block (its key and entry), at most three
//! quarters full. It replaces a `HashMap` so that a walk can prefetch the slots
//! of the blocks ahead of the one it probes: a path's chain keys are computed
//! without the table, so the walk knows them in advance, and a routing decision
//! over 256 matched blocks of a million otherwise waited for one cache miss
//! after another (DESIGN.md, "The routing decision, before and after").

use crate::table::{Entry, Holders};

/// Marks an empty slot. A block keyed 0 is stored under [`ZERO_KEY`] instead
/// (the odds that another block keys to that one are those of any collision).
const EMPTY: u64 = 0;
const ZERO_KEY: u64 = 0x5851_F42D_4C95_7F2D;
/// Slots of the smallest table.
const MIN_SLOTS: usize = 16;
/// Most slots in use, in eighths of the table.
const MAX_EIGHTHS: usize = 7;

#[derive(Clone, Copy)]
struct Slot {
    key: u64,
    entry: Entry,
}

#[derive(Default)]
pub(crate) struct BlockMap {
    /// Empty, or a power of two long.
    slots: Vec<Slot>,
    len: usize,
}

impl BlockMap {
    pub fn len(&self) -> usize {
        self.len
    }

    /// Heap bytes of the slots.
    pub fn heap_bytes(&self) -> u64 {
        (self.slots.capacity() * size_of::<Slot>()) as u64
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        // The slots' count is a power of two; the product's top bits mix all of
        // the key's (its low bits are the shard's, the same for every block).
        let bits = self.slots.len().trailing_zeros();
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - bits)) as usize
    }

    /// Where `key` is, if present.
    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let key = stored_key(key);
        let mask = self.slots.len() - 1;
        let mut at = self.home(key);
        loop {
            match self.slots[at].key {
                k if k == key => return Some(at),
                EMPTY => return None,
                _ => at = (at + 1) & mask,
            }
        }
    }

    #[inline]
    pub fn get(&self, key: u64) -> Option<&Entry> {
        self.find(key).map(|at| &self.slots[at].entry)
    }

    /// Starts bringing `key`'s first slot into the cache.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        if self.slots.is_empty() {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            let slot = self.slots[self.home(stored_key(key))..].as_ptr().cast();
            // SAFETY: SSE is part of x86_64's baseline; a prefetch is a hint
            // that reads nothing architecturally and cannot fault, and the
            // address is in bounds anyway.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(slot) };
        }
    }

    /// The entry of `key`, made by `make` if absent; and whether it was made.
    pub fn get_or_insert(&mut self, key: u64, make: impl FnOnce() -> Entry) -> (&mut Entry, bool) {
        if (self.len + 1) * 8 > self.slots.len() * MAX_EIGHTHS {
            self.resize((self.slots.len() * 2).max(MIN_SLOTS));
        }
        let key = stored_key(key);
        let mask = self.slots.len() - 1;
        let mut at = self.home(key);
        loop {
            match self.slots[at].key {
                k if k == key => return (&mut self.slots[at].entry, false),
                EMPTY => break,
                _ => at = (at + 1) & mask,
            }
        }
        self.slots[at] = Slot { key, entry: make() };
        self.len += 1;
        (&mut self.slots[at].entry, true)
    }

    /// The entry of `key` and its place, for [`Self::remove_at`].
    #[inline]
    pub fn find_mut(&mut self, key: u64) -> Option<(usize, &mut Entry)> {
        let at = self.find(key)?;
        Some((at, &mut self.slots[at].entry))
    }

    pub fn remove(&mut self, key: u64) -> Option<Entry> {
        let at = self.find(key)?;
        Some(self.remove_at(at))
    }

    /// Empties slot `at`, moving back the slots after it that probed past it,
    /// and gives memory back once the table is under a quarter of what it may
    /// hold (under churn a shard's share of the blocks moves around).
    pub fn remove_at(&mut self, at: usize) -> Entry {
        let removed = self.slots[at].entry;
        let mask = self.slots.len() - 1;
        let (mut hole, mut next) = (at, (at + 1) & mask);
        while self.slots[next].key != EMPTY {
            let home = self.home(self.slots[next].key);
            // The slot may fill the hole iff its home is not cyclically in
            // (hole, next]: otherwise moving it would put it before its home.
            if (next.wrapping_sub(home) & mask) >= (next.wrapping_sub(hole) & mask) {
                self.slots[hole] = self.slots[next];
                hole = next;
            }
            next = (next + 1) & mask;
        }
        self.slots[hole].key = EMPTY;
        self.len -= 1;
        let usable = self.slots.len() * MAX_EIGHTHS / 8;
        if usable > 64 && self.len * 4 < usable {
            let slots = (self.len * 2 * 8).div_ceil(MAX_EIGHTHS);
            self.resize(slots.next_power_of_two().max(MIN_SLOTS));
        }
        removed
    }

    fn resize(&mut self, slots: usize) {
        let empty = Slot {
            key: EMPTY,
            entry: Entry {
                workers: Holders::NONE,
                tokens_hash: 0,
                parent: 0,
            },
        };
        let old = std::mem::replace(&mut self.slots, vec![empty; slots]);
        let mask = slots - 1;
        for slot in old.into_iter().filter(|s| s.key != EMPTY) {
            let mut at = self.home(slot.key);
            while self.slots[at].key != EMPTY {
                at = (at + 1) & mask;
            }
            self.slots[at] = slot;
        }
    }
}

#[inline]
fn stored_key(key: u64) -> u64 {
    if key == EMPTY { ZERO_KEY } else { key }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    fn entry(n: u64) -> Entry {
        Entry {
            workers: Holders::NONE,
            tokens_hash: n,
            parent: 0,
        }
    }

    proptest! {
        /// Against a `HashMap`, through growth, removals that shift clusters
        /// back, shrinking, and key 0. Keys from a small range collide often.
        #[test]
        fn behaves_as_a_map(ops in prop::collection::vec((any::<bool>(), 0..400u64), 1..3_000)) {
            let mut map = BlockMap::default();
            let mut model = HashMap::new();
            for (i, &(insert, k)) in ops.iter().enumerate() {
                // Spread some keys so that homes differ, keep others close.
                let key = if k % 2 == 0 { k } else { k.wrapping_mul(0x2545_F491_4F6C_DD1D) };
                if insert {
                    let (e, made) = map.get_or_insert(key, || entry(i as u64));
                    let was = model.get(&key).copied();
                    prop_assert_eq!(made, was.is_none());
                    prop_assert_eq!(e.tokens_hash, was.unwrap_or(i as u64));
                    model.entry(key).or_insert(i as u64);
                } else {
                    prop_assert_eq!(map.remove(key).map(|e| e.tokens_hash), model.remove(&key));
                }
                prop_assert_eq!(map.len(), model.len());
            }
            for k in 0..400u64 {
                for key in [k, k.wrapping_mul(0x2545_F491_4F6C_DD1D)] {
                    prop_assert_eq!(map.get(key).map(|e| e.tokens_hash), model.get(&key).copied());
                }
            }
            // Drained, through the shrinking.
            let keys: Vec<u64> = model.keys().copied().collect();
            for (n, key) in keys.iter().enumerate() {
                prop_assert_eq!(map.remove(*key).map(|e| e.tokens_hash), model.remove(key));
                if n % 16 == 0 {
                    for other in &keys[n + 1..] {
                        prop_assert!(map.get(*other).is_some());
                    }
                }
            }
            prop_assert_eq!(map.len(), 0);
        }
    }
}
