//! The predicted layer's per-generation table: pair key → expiry.
//!
//! An open-addressing table with linear probing, at most half full, that never
//! deletes (a generation is dropped whole). It replaces a `HashMap` so that a
//! record can prefetch the slots it is about to write: a 128k-token request
//! records 8 192 entries at random places in a table of megabytes, and waiting
//! for each cache miss in turn was most of a record's cost (244 µs p50, more
//! than the routing decision itself). With the slots of the next few keys
//! already on their way, the misses overlap.

/// Marks an empty slot. A pair key of 0 is stored as [`ZERO_KEY`] instead (the
/// odds that another key is that one are those of any two keys colliding).
const EMPTY: u64 = 0;
const ZERO_KEY: u64 = 0x5851_F42D_4C95_7F2D;
/// Keys whose slots are prefetched ahead of the one being written.
const AHEAD: usize = 8;

pub(crate) struct Slots {
    /// (key, expiry); a power of two long, at most half of it in use.
    slots: Vec<(u64, u64)>,
    len: usize,
}

impl Default for Slots {
    fn default() -> Self {
        Self::with_capacity(32)
    }
}

impl Slots {
    /// A table that takes `capacity` entries before it grows, every page of it
    /// written once (so that filling it faults nothing in).
    pub fn with_capacity(capacity: usize) -> Self {
        let buckets = (capacity * 2).next_power_of_two().max(64);
        let mut slots = Vec::with_capacity(buckets);
        slots.resize(buckets, (EMPTY, 0));
        Self { slots, len: 0 }
    }

    /// Entries it takes before it grows.
    pub fn capacity(&self) -> usize {
        self.slots.len() / 2
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Empties the table, keeping (and writing) its memory.
    pub fn clear(&mut self) {
        self.slots.fill((EMPTY, 0));
        self.len = 0;
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        // Keys are uniform (chain keys xored with a worker's constant).
        key as usize & (self.slots.len() - 1)
    }

    pub fn get(&self, key: u64) -> Option<u64> {
        let key = stored_key(key);
        let mask = self.slots.len() - 1;
        let mut at = self.home(key);
        loop {
            match self.slots[at] {
                (EMPTY, _) => return None,
                (k, expiry) if k == key => return Some(expiry),
                _ => at = (at + 1) & mask,
            }
        }
    }

    /// Sets every key of `keys` to `expiry`; calls `added(i)` for each
    /// `keys[i]` that was not in the table.
    pub fn set_all(&mut self, keys: &[u64], expiry: u64, mut added: impl FnMut(usize)) {
        if (self.len + keys.len()) * 2 > self.slots.len() {
            self.grow(self.len + keys.len());
        }
        for (i, &key) in keys.iter().enumerate() {
            if let Some(&ahead) = keys.get(i + AHEAD) {
                self.prefetch(self.home(stored_key(ahead)));
            }
            if self.set(key, expiry) {
                added(i);
            }
        }
    }

    /// Sets one key; returns whether it is new.
    fn set(&mut self, key: u64, expiry: u64) -> bool {
        let key = stored_key(key);
        let mask = self.slots.len() - 1;
        let mut at = self.home(key);
        loop {
            let slot = &mut self.slots[at];
            if slot.0 == key {
                slot.1 = expiry;
                return false;
            }
            if slot.0 == EMPTY {
                *slot = (key, expiry);
                self.len += 1;
                return true;
            }
            at = (at + 1) & mask;
        }
    }

    /// Rehashes into a table that takes `needed` entries (only a generation
    /// that opened without a prepared table, or one longer path, gets here).
    fn grow(&mut self, needed: usize) {
        let old = std::mem::replace(self, Self::with_capacity(needed.max(self.capacity() * 2)));
        for (key, expiry) in old.slots {
            if key != EMPTY {
                self.set(key, expiry);
            }
        }
    }

    #[inline]
    fn prefetch(&self, at: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            let slot = self.slots[at..].as_ptr().cast();
            // SAFETY: SSE is part of x86_64's baseline; a prefetch is a hint
            // that reads nothing architecturally and cannot fault, and the
            // address is in bounds anyway.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(slot) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = at;
    }
}

#[inline]
fn stored_key(key: u64) -> u64 {
    if key == EMPTY { ZERO_KEY } else { key }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Against a `HashMap`: the same answers through growth, clearing and key 0.
    #[test]
    fn behaves_as_a_map() {
        let mut slots = Slots::default();
        let mut model = HashMap::new();
        let mut rng = 1u64;
        for round in 0..3 {
            for step in 0..2_000u64 {
                rng = rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                // Few distinct keys, so that many are set again.
                let keys: Vec<u64> = (0..(rng >> 60))
                    .map(|k| (rng >> 40) % 3_000 * 7 + k)
                    .collect();
                let mut added = Vec::new();
                slots.set_all(&keys, step, |i| added.push(keys[i]));
                let mut expected = Vec::new();
                for &k in &keys {
                    if model.insert(k, step).is_none() {
                        expected.push(k);
                    }
                }
                assert_eq!(added, expected, "round {round}, step {step}");
                assert_eq!(slots.len(), model.len());
            }
            for k in 0..25_000 {
                assert_eq!(slots.get(k), model.get(&k).copied(), "key {k}");
            }
            slots.clear();
            model.clear();
            assert_eq!(slots.get(7), None);
        }
    }
}
