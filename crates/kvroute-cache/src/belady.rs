//! Belady's MIN at block level: the offline bound for block hits.
//!
//! It knows the whole future sequence of block accesses (the trace flattened in
//! request order) and, when full, evicts the resident block whose next use is
//! farthest away, or that is never used again. Every missed block is admitted
//! (no bypass), as in the other policies. It is optimal for block hits, not
//! exactly for prefix hits, which also depend on which blocks sit together.
//!
//! Layout: `next_use[i]` is the position of the next access to the block at
//! position `i` (or [`NEVER`]). Resident blocks map to their current next use;
//! a max-heap of `(next use, block)` finds the victim, with entries that no
//! longer match the map skipped when popped (lazy deletion) and the heap
//! rebuilt from the map when stale entries pile up.

use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;

use crate::{Access, BlockCache, BlockId, CacheError, check_capacity};

const NEVER: u64 = u64::MAX;

/// Block-level MIN over a known access sequence. Accesses must follow that
/// sequence; an access that does not match it is treated as a block never used
/// again.
#[derive(Debug)]
pub struct Belady {
    capacity: usize,
    sequence: Vec<BlockId>,
    next_use: Vec<u64>,
    position: usize,
    resident: FxHashMap<BlockId, u64>,
    farthest: BinaryHeap<(u64, BlockId)>,
}

impl Belady {
    /// A cache that will see exactly `sequence`, in order.
    pub fn new(capacity: usize, sequence: &[BlockId]) -> Result<Self, CacheError> {
        check_capacity(capacity)?;
        let mut next_use = vec![NEVER; sequence.len()];
        let mut seen_at: FxHashMap<BlockId, u64> = FxHashMap::default();
        for (i, &block) in sequence.iter().enumerate().rev() {
            if let Some(later) = seen_at.insert(block, i as u64) {
                next_use[i] = later;
            }
        }
        Ok(Belady {
            capacity,
            sequence: sequence.to_vec(),
            next_use,
            position: 0,
            resident: FxHashMap::default(),
            farthest: BinaryHeap::new(),
        })
    }

    fn compact_if_stale(&mut self) {
        if self.farthest.len() > 4 * self.resident.len() + 1024 {
            self.farthest = self.resident.iter().map(|(&b, &n)| (n, b)).collect();
        }
    }
}

impl BlockCache for Belady {
    fn access(&mut self, block: BlockId, evicted: &mut Vec<BlockId>) -> Access {
        let at = self.position;
        self.position += 1;
        let next = match self.sequence.get(at) {
            Some(&expected) if expected == block => self.next_use[at],
            _ => NEVER,
        };
        let outcome = if let Some(slot) = self.resident.get_mut(&block) {
            *slot = next;
            Access::Hit
        } else {
            if self.resident.len() >= self.capacity
                && let Some(victim) = self.evict_one()
            {
                evicted.push(victim);
            }
            self.resident.insert(block, next);
            Access::Miss
        };
        self.farthest.push((next, block));
        self.compact_if_stale();
        outcome
    }

    fn contains(&self, block: BlockId) -> bool {
        self.resident.contains_key(&block)
    }

    fn remove(&mut self, block: BlockId) -> bool {
        self.resident.remove(&block).is_some()
    }

    fn evict_one(&mut self) -> Option<BlockId> {
        while let Some((next, block)) = self.farthest.pop() {
            if self.resident.get(&block) == Some(&next) {
                self.resident.remove(&block);
                return Some(block);
            }
        }
        None
    }

    fn len(&self) -> usize {
        self.resident.len()
    }

    fn capacity(&self) -> Option<usize> {
        Some(self.capacity)
    }
}
