//! S3FIFO (Yang et al., SOSP'23): a small probationary FIFO in front of a main
//! FIFO with second chance, and a ghost FIFO remembering recent evictees.
//!
//! Most blocks are used once; S3FIFO lets them leave quickly through the small
//! queue S, promotes blocks used again while in S to the main queue M, and
//! readmits straight into M a block whose id is still in the ghost queue G.
//!
//! Layout and invariants: S, M and G are [`List`]s over one slab, and one map
//! entry per block points at its slot, whose `queue` says which list holds it,
//! so a block is in at most one of S, M, G. Resident blocks are S ∪ M, with
//! |S| ≤ small_cap and |M| ≤ main_cap at rest; G holds ids only (not resident)
//! and |G| ≤ ghost_cap. `count` ∈ [0, max_freq] is meaningful for S and M.

use crate::list::{List, Slab, SlotMap};
use crate::{Access, BlockCache, BlockId, CacheError, check_capacity};

const SMALL: u8 = 0;
const MAIN: u8 = 1;
const GHOST: u8 = 2;

/// S3FIFO's two knobs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct S3FifoParams {
    /// Share of the capacity given to the small queue.
    pub small_ratio: f64,
    /// Saturation of a block's access count.
    pub max_freq: u8,
}

impl Default for S3FifoParams {
    fn default() -> Self {
        S3FifoParams {
            small_ratio: 0.1,
            max_freq: 3,
        }
    }
}

/// S3FIFO with `small_cap = round_half_even(capacity × small_ratio)` (at least
/// 1), `main_cap = capacity − small_cap` and `ghost_cap = main_cap`.
#[derive(Debug)]
pub struct S3Fifo {
    small_cap: usize,
    main_cap: usize,
    ghost_cap: usize,
    max_freq: u8,
    map: SlotMap,
    slab: Slab,
    small: List,
    main: List,
    ghost: List,
}

impl S3Fifo {
    pub fn new(capacity: usize, params: S3FifoParams) -> Result<Self, CacheError> {
        check_capacity(capacity)?;
        let ratio = params.small_ratio;
        if !(ratio > 0.0 && ratio < 1.0) {
            return Err(CacheError::SmallRatio(ratio));
        }
        let small_cap = ((capacity as f64 * ratio).round_ties_even() as usize).max(1);
        if small_cap >= capacity {
            return Err(CacheError::NoMainQueue {
                capacity,
                small_ratio: ratio,
                small_cap,
            });
        }
        let main_cap = capacity - small_cap;
        let reserve = capacity.saturating_add(main_cap).min(1 << 21) + 1;
        Ok(S3Fifo {
            small_cap,
            main_cap,
            ghost_cap: main_cap,
            max_freq: params.max_freq,
            map: SlotMap::with_capacity_and_hasher(reserve, Default::default()),
            slab: Slab::with_capacity(reserve),
            small: List::default(),
            main: List::default(),
            ghost: List::default(),
        })
    }

    /// Capacities of the small, main and ghost queues.
    pub fn queue_capacities(&self) -> (usize, usize, usize) {
        (self.small_cap, self.main_cap, self.ghost_cap)
    }

    /// Admits a new block to S, first making room by moving S's head on (to M
    /// if it was used while in S, else out to G).
    fn admit_small(&mut self, block: BlockId, evicted: &mut Vec<BlockId>) {
        while self.small.len() >= self.small_cap {
            let Some(head) = self.slab.pop_front(&mut self.small) else {
                break;
            };
            if self.slab.get(head).count >= 1 {
                if let Some(victim) = self.admit_main(head) {
                    evicted.push(victim);
                }
            } else {
                evicted.push(self.slab.get(head).block);
                self.insert_ghost(head);
            }
        }
        let slot = self.slab.insert(block, SMALL, 0);
        self.slab.push_back(&mut self.small, slot);
        self.map.insert(block, slot);
    }

    /// Appends an unlinked slot to M, evicting one block from M first if M is
    /// full; returns that block.
    fn admit_main(&mut self, slot: u32) -> Option<BlockId> {
        let victim = if self.main.len() >= self.main_cap {
            self.evict_main()
        } else {
            None
        };
        self.slab.get_mut(slot).queue = MAIN;
        self.slab.push_back(&mut self.main, slot);
        victim
    }

    /// Second chance over M: heads with a count are decremented and go round
    /// again; the first head with count 0 leaves for G.
    fn evict_main(&mut self) -> Option<BlockId> {
        loop {
            let head = self.slab.pop_front(&mut self.main)?;
            let node = self.slab.get_mut(head);
            if node.count >= 1 {
                node.count -= 1;
                self.slab.push_back(&mut self.main, head);
            } else {
                let victim = node.block;
                self.insert_ghost(head);
                return Some(victim);
            }
        }
    }

    /// Puts an unlinked, no longer resident slot at G's back, dropping G's
    /// oldest id when G is full.
    fn insert_ghost(&mut self, slot: u32) {
        if self.ghost.len() >= self.ghost_cap
            && let Some(oldest) = self.slab.pop_front(&mut self.ghost)
        {
            self.map.remove(&self.slab.get(oldest).block);
            self.slab.release(oldest);
        }
        self.slab.get_mut(slot).queue = GHOST;
        self.slab.push_back(&mut self.ghost, slot);
    }
}

impl BlockCache for S3Fifo {
    fn access(&mut self, block: BlockId, evicted: &mut Vec<BlockId>) -> Access {
        match self.map.get(&block) {
            Some(&slot) if self.slab.get(slot).queue != GHOST => {
                let node = self.slab.get_mut(slot);
                node.count = node.count.saturating_add(1).min(self.max_freq);
                Access::Hit
            }
            Some(&slot) => {
                self.slab.unlink(&mut self.ghost, slot);
                self.slab.get_mut(slot).count = 0;
                if let Some(victim) = self.admit_main(slot) {
                    evicted.push(victim);
                }
                Access::Miss
            }
            None => {
                self.admit_small(block, evicted);
                Access::Miss
            }
        }
    }

    fn contains(&self, block: BlockId) -> bool {
        self.map
            .get(&block)
            .is_some_and(|&slot| self.slab.get(slot).queue != GHOST)
    }

    fn remove(&mut self, block: BlockId) -> bool {
        let Some(&slot) = self.map.get(&block) else {
            return false;
        };
        match self.slab.get(slot).queue {
            SMALL => self.slab.unlink(&mut self.small, slot),
            MAIN => self.slab.unlink(&mut self.main, slot),
            _ => return false,
        }
        self.map.remove(&block);
        self.slab.release(slot);
        true
    }

    /// The paper's eviction: from S while S is at its share (or M is empty),
    /// moving used S blocks on to M, else from M with second chance.
    fn evict_one(&mut self) -> Option<BlockId> {
        loop {
            if !self.small.is_empty()
                && (self.small.len() >= self.small_cap || self.main.is_empty())
            {
                let head = self.slab.pop_front(&mut self.small)?;
                if self.slab.get(head).count >= 1 {
                    if let Some(victim) = self.admit_main(head) {
                        return Some(victim);
                    }
                } else {
                    let victim = self.slab.get(head).block;
                    self.insert_ghost(head);
                    return Some(victim);
                }
            } else {
                return self.evict_main();
            }
        }
    }

    /// Fills M first, then S, all with count 0: admitting to S would push
    /// S's overflow out to G, losing blocks that the caller is carrying over.
    fn adopt(&mut self, block: BlockId) {
        match self.map.get(&block) {
            Some(&slot) if self.slab.get(slot).queue == GHOST => {
                self.slab.unlink(&mut self.ghost, slot);
                self.map.remove(&block);
                self.slab.release(slot);
            }
            Some(_) => return,
            None => {}
        }
        let (queue, list) = if self.main.len() < self.main_cap {
            (MAIN, &mut self.main)
        } else {
            (SMALL, &mut self.small)
        };
        let slot = self.slab.insert(block, queue, 0);
        self.slab.push_back(list, slot);
        self.map.insert(block, slot);
    }

    fn len(&self) -> usize {
        self.small.len() + self.main.len()
    }

    fn capacity(&self) -> Option<usize> {
        Some(self.small_cap + self.main_cap)
    }
}
