//! The predicted layer's per-generation table: pair key → expiry.
//!
//! An open-addressing table with linear probing, at most half full, that never
//! deletes (a generation is dropped whole). It replaces a `HashMap` so that a
//! record can prefetch the slots it is about to write: a 128k-token request
//! records 8 192 entries at random places in a table of megabytes, and waiting
//! for each cache miss in turn was most of a record's cost (244 µs p50, more
//! than the routing decision itself). With the slots of the next few keys
//! already on their way, the misses overlap.
//!
//! More cuts to the misses: the entries of a path's consecutive blocks are
//! placed together ([`GROUP`] to a cache line, found from the home of their
//! group's first block, which a lookup knows as well as a record does); a slot
//! is 8 bytes (a 32-bit fingerprint of the key and a 32-bit expiry), so a line
//! takes eight of them and a fresh path misses once per eight blocks; and the
//! table lives in huge pages, so that a record's random lines do not each cost
//! a TLB miss as well.
//!
//! A fingerprint stands for its key: a lookup that meets another key's slot
//! with the same 32 bits before its own (or an empty slot) takes that entry's
//! expiry. The odds are 2^-32 per occupied slot compared, a few slots per
//! probe at most half full; what it costs is one worker credited with a block
//! it may not hold, for as long as the other entry lives: a routing choice made
//! on one block too many, never a wrong answer to anyone.

use crate::huge::{HUGE_PAGE, HugeSlice};

/// Marks an empty slot. A key whose fingerprint would be 0 gets [`ZERO_TAG`]
/// instead (one more key sharing that fingerprint).
const EMPTY: u32 = 0;
const ZERO_TAG: u32 = 0x4C95_7F2D;
/// Consecutive blocks of a path whose entries are placed together: block `p`'s
/// entry is sought from the home of the first block of its group (`p − p %
/// GROUP`), so a record of a fresh path fills one cache line (eight 8-byte
/// slots) per group instead of missing once per block.
pub(crate) const GROUP: usize = 8;
/// Groups whose lines are prefetched ahead of the one being written (4, 8, 16
/// and 32 measured with groups of four: 8 and 16 were best).
const AHEAD: usize = 8;

/// One entry: its key's fingerprint and its expiry, in ms after a base the
/// caller keeps (a generation's opening).
#[derive(Clone, Copy)]
#[repr(C)]
struct Slot {
    tag: u32,
    expiry: u32,
}

/// One cache line of slots.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([Slot; GROUP]);

const EMPTY_LINE: Line = Line(
    [Slot {
        tag: EMPTY,
        expiry: 0,
    }; GROUP],
);

pub(crate) struct Slots {
    /// A power of two long, at most half of their slots in use. In huge pages
    /// from 2 MiB on: a record writes thousands of lines at random in
    /// megabytes, and with 4 KiB pages nearly every group also missed the TLB.
    lines: HugeSlice<Line>,
    len: usize,
}

impl Slots {
    /// A table that takes `capacity` entries, every page of it written once (so
    /// that filling it faults nothing in). It never grows: a generation whose
    /// table cannot take a path gives way to a new one (see predicted.rs).
    /// From 1 MiB on it takes a whole huge page: a generation at the default cap
    /// (65 536 entries, 1 MiB of 8-byte slots) keeps the 2 MiB that 16-byte slots
    /// took, a quarter full, rather than lose the huge page.
    pub fn with_capacity(capacity: usize) -> Self {
        let lines = (capacity * 2).div_ceil(GROUP).next_power_of_two().max(16);
        let lines = if lines * size_of::<Line>() >= HUGE_PAGE / 2 {
            lines.max(HUGE_PAGE / size_of::<Line>())
        } else {
            lines
        };
        Self {
            lines: HugeSlice::filled(EMPTY_LINE, lines),
            len: 0,
        }
    }

    /// Entries it takes.
    pub fn capacity(&self) -> usize {
        self.lines.len() * GROUP / 2
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether `n` more entries fit.
    pub fn has_room(&self, n: usize) -> bool {
        self.len + n <= self.capacity()
    }

    /// Empties the table, keeping (and writing) its memory.
    pub fn clear(&mut self) {
        self.lines.fill(EMPTY_LINE);
        self.len = 0;
    }

    /// The first slot of the line a group led by `group_key` starts from.
    #[inline]
    fn home(&self, group_key: u64) -> usize {
        // Keys are uniform (chain keys xored with a worker's constant); the
        // low bits place a group, the high ones are its keys' fingerprints.
        (group_key as usize & (self.lines.len() - 1)) * GROUP
    }

    #[inline]
    fn mask(&self) -> usize {
        self.lines.len() * GROUP - 1
    }

    #[inline]
    fn slot(&self, at: usize) -> Slot {
        self.lines[at / GROUP].0[at % GROUP]
    }

    #[inline]
    fn slot_mut(&mut self, at: usize) -> &mut Slot {
        &mut self.lines[at / GROUP].0[at % GROUP]
    }

    /// The expiry of `key`, whose group's first key is `group_key`.
    pub fn get(&self, group_key: u64, key: u64) -> Option<u32> {
        let tag = tag(key);
        let mask = self.mask();
        let mut at = self.home(group_key);
        loop {
            let slot = self.slot(at);
            if slot.tag == tag {
                return Some(slot.expiry);
            }
            if slot.tag == EMPTY {
                return None;
            }
            at = (at + 1) & mask;
        }
    }

    /// Sets the entries of a path to `expiry`: `keys[i]` is the key of its
    /// block `i`, from block 0, and a key fixes every key before it (chain
    /// keys do). Calls `added(i)` for each `keys[i]` that was not in the
    /// table. The table must have room for them all ([`Self::has_room`]).
    pub fn set_path(&mut self, keys: &[u64], expiry: u32, mut added: impl FnMut(usize)) {
        assert!(self.has_room(keys.len()), "a path past the table's room");
        let mask = self.mask();
        // Once a block is new here, so is every later one: a table holds a
        // block only if some record wrote its path, parent included. The rest
        // are then placed without comparing keys, each in the first empty
        // slot after the previous one, which is where a search from the
        // group's home would end (every slot from the home to the previous
        // one is taken).
        let mut fresh = false;
        for (g, group) in keys.chunks(GROUP).enumerate() {
            if let Some(&ahead) = keys.get((g + AHEAD) * GROUP) {
                self.prefetch(self.home(ahead));
            }
            let home = self.home(group[0]);
            let mut at = home;
            for (j, &key) in group.iter().enumerate() {
                let tag = tag(key);
                if !fresh {
                    at = home;
                    loop {
                        let slot = self.slot_mut(at);
                        if slot.tag == tag {
                            slot.expiry = expiry;
                            break;
                        }
                        if slot.tag == EMPTY {
                            fresh = true;
                            break;
                        }
                        at = (at + 1) & mask;
                    }
                    if !fresh {
                        continue;
                    }
                } else {
                    while self.slot(at).tag != EMPTY {
                        at = (at + 1) & mask;
                    }
                }
                *self.slot_mut(at) = Slot { tag, expiry };
                self.len += 1;
                added(g * GROUP + j);
                at = (at + 1) & mask;
            }
        }
    }

    #[inline]
    fn prefetch(&self, at: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            let line = std::ptr::from_ref(&self.lines[at / GROUP]).cast();
            // SAFETY: SSE is part of x86_64's baseline; a prefetch is a hint
            // that reads nothing architecturally and cannot fault, and the
            // address is in bounds anyway.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = at;
    }
}

/// A key's fingerprint: its high half, never [`EMPTY`].
#[inline]
fn tag(key: u64) -> u32 {
    match (key >> 32) as u32 {
        EMPTY => ZERO_TAG,
        tag => tag,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A path's keys from block 0, each one determined by its prefix (as chain
    /// keys are); block 0 of token 0 has key 0.
    fn path_keys(tokens: &[u64]) -> Vec<u64> {
        let mut parent: Option<u64> = None;
        tokens
            .iter()
            .map(|&t| {
                let key = match parent {
                    None => t.wrapping_mul(0xD6E8_FEB8_6659_FD93),
                    Some(p) => (p.rotate_left(23) ^ (t + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93))
                        .wrapping_mul(0x9E37_79B9_7F4A_7C15),
                };
                parent = Some(key);
                key
            })
            .collect()
    }

    /// Against a `HashMap` of key → (its group's first key, expiry): the same
    /// answers through shared prefixes, paths set again, full tables, clearing
    /// and key 0.
    #[test]
    fn behaves_as_a_map() {
        let mut slots = Slots::with_capacity(4_000);
        let mut model: HashMap<u64, (u64, u32)> = HashMap::new();
        let mut rng = 1u64;
        let mut next = || {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            rng >> 33
        };
        for round in 0..3 {
            let mut step = 0u32;
            loop {
                step += 1;
                // Few tokens, so that paths share prefixes and many keys are set again.
                let tokens: Vec<u64> = (0..1 + next() % 23).map(|_| next() % 3).collect();
                let keys = path_keys(&tokens);
                if !slots.has_room(keys.len()) {
                    break;
                }
                let mut added = Vec::new();
                slots.set_path(&keys, step, |i| added.push(keys[i]));
                let mut expected = Vec::new();
                for (i, &k) in keys.iter().enumerate() {
                    let group_key = keys[i - i % GROUP];
                    if model.insert(k, (group_key, step)).is_none() {
                        expected.push(k);
                    }
                }
                assert_eq!(added, expected, "round {round}, step {step}");
                assert_eq!(slots.len(), model.len());
            }
            assert!(slots.len() > slots.capacity() - 23, "filled to its room");
            for (&k, &(group_key, expiry)) in &model {
                assert_eq!(slots.get(group_key, k), Some(expiry), "key {k}");
            }
            for t in 0..2_000 {
                let keys = path_keys(&[3 + t, t % 3]);
                assert_eq!(slots.get(keys[0], keys[1]), None);
                assert_eq!(slots.get(keys[0], keys[0]), None);
            }
            slots.clear();
            model.clear();
            assert_eq!(slots.len(), 0);
            assert_eq!(slots.get(0, 0), None);
        }
    }
}
