//! `RadixLru` against a naive model written from SGLang's rules (a list of
//! blocks in recency order with lock counts; the victim is the least recent
//! unlocked leaf, found by a full scan), and the cost of its eviction scan:
//! M victims past K skipped blocks visit exactly M + K blocks, including the
//! patterns that make a scan restarting from the oldest block quadratic.

use kvroute_cache::RadixLru;
use proptest::prelude::*;

#[derive(Clone, Copy, Debug)]
enum Op {
    Insert(u64, Option<u64>),
    Lock(u64),
    Unlock(u64),
    Touch(u64),
    Remove(u64),
    Evict(usize),
}

#[derive(Clone, Debug)]
struct Entry {
    block: u64,
    parent: Option<u64>,
    locks: u32,
}

/// Oldest first.
#[derive(Default)]
struct Naive {
    order: Vec<Entry>,
}

impl Naive {
    fn position(&self, block: u64) -> Option<usize> {
        self.order.iter().position(|e| e.block == block)
    }

    fn has_children(&self, block: u64) -> bool {
        self.order.iter().any(|e| e.parent == Some(block))
    }

    /// A new block takes its parent's recency, just below it; a root is newest.
    fn insert(&mut self, block: u64, parent: Option<u64>) -> bool {
        if self.position(block).is_some() {
            return false;
        }
        let parent = parent.filter(|&p| self.position(p).is_some());
        let entry = Entry {
            block,
            parent,
            locks: 0,
        };
        match parent.and_then(|p| self.position(p)) {
            Some(at) => self.order.insert(at, entry),
            None => self.order.push(entry),
        }
        true
    }

    fn lock(&mut self, block: u64, delta: i32) -> bool {
        match self.position(block) {
            Some(at) if delta > 0 || self.order[at].locks > 0 => {
                self.order[at].locks = self.order[at].locks.saturating_add_signed(delta);
                true
            }
            _ => false,
        }
    }

    /// The block, then each ancestor, becomes the newest: the root last.
    fn touch(&mut self, block: u64) {
        let mut next = Some(block);
        while let Some(at) = next.and_then(|b| self.position(b)) {
            let entry = self.order.remove(at);
            next = entry.parent;
            self.order.push(entry);
        }
    }

    fn remove(&mut self, block: u64) -> bool {
        match self.position(block) {
            Some(at) if !self.has_children(block) => {
                self.order.remove(at);
                true
            }
            _ => false,
        }
    }

    fn evict_one(&mut self) -> Option<u64> {
        let at = (0..self.order.len())
            .find(|&i| self.order[i].locks == 0 && !self.has_children(self.order[i].block))?;
        Some(self.order.remove(at).block)
    }
}

const BLOCKS: u64 = 10;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..BLOCKS, prop::option::weighted(0.8, 0..BLOCKS))
            .prop_map(|(b, p)| Op::Insert(b, p.filter(|&p| p != b))),
        2 => (0..BLOCKS).prop_map(Op::Lock),
        2 => (0..BLOCKS).prop_map(Op::Unlock),
        2 => (0..BLOCKS).prop_map(Op::Touch),
        1 => (0..BLOCKS).prop_map(Op::Remove),
        2 => (0..4usize).prop_map(Op::Evict),
    ]
}

proptest! {
    #[test]
    fn radix_lru_matches_the_naive_model(ops in prop::collection::vec(op(), 0..250)) {
        let mut real = RadixLru::new();
        let mut naive = Naive::default();
        for (i, &op) in ops.iter().enumerate() {
            match op {
                Op::Insert(block, parent) => {
                    prop_assert_eq!(real.insert(block, parent), naive.insert(block, parent), "op {} {:?}", i, op);
                }
                Op::Lock(block) => prop_assert_eq!(real.lock(block), naive.lock(block, 1), "op {}", i),
                Op::Unlock(block) => prop_assert_eq!(real.unlock(block), naive.lock(block, -1), "op {}", i),
                Op::Touch(block) => {
                    real.touch(block);
                    naive.touch(block);
                }
                Op::Remove(block) => prop_assert_eq!(real.remove(block), naive.remove(block), "op {}", i),
                Op::Evict(count) => {
                    let before: Vec<u64> = naive.order.iter().map(|e| e.block).collect();
                    let want: Vec<u64> = std::iter::from_fn(|| naive.evict_one()).take(count).collect();
                    let visited = real.visited();
                    let mut got = Vec::new();
                    prop_assert_eq!(real.evict(count, &mut got), want.len(), "op {}", i);
                    prop_assert_eq!(&got, &want, "op {} {:?}", i, op);
                    // One pass: the victims, plus every survivor older than the
                    // last victim (all of them when the scan ran out).
                    let scanned = if want.len() == count {
                        want.last().map_or(0, |last| before.iter().position(|b| b == last).unwrap() + 1)
                    } else {
                        before.len()
                    };
                    prop_assert_eq!(real.visited() - visited, scanned as u64, "op {} visits", i);
                }
            }
            prop_assert_eq!(real.len(), naive.order.len(), "op {} {:?}", i, op);
            for block in 0..BLOCKS {
                let want = naive.position(block).map(|at| naive.order[at].locks);
                prop_assert_eq!(real.locks(block), want, "op {} block {}", i, block);
            }
        }
    }
}

/// Builds `chains` chains of `depth` blocks, ids from `first`, each locked at
/// its tail (so every block of it is skipped: the tail locked, the rest
/// parents of a locked block), oldest first; returns the next free id.
fn locked_chains(lru: &mut RadixLru, first: u64, chains: u64, depth: u64) -> u64 {
    let mut id = first;
    for _ in 0..chains {
        let mut parent = None;
        for _ in 0..depth {
            lru.insert(id, parent);
            parent = Some(id);
            id += 1;
        }
        lru.lock(id - 1);
        lru.touch(id - 1);
    }
    id
}

#[test]
fn evicting_past_a_cold_end_of_locked_and_non_leaf_blocks_visits_each_once() {
    // K = 20,000 skipped blocks at the cold end: 1,000 locked chains of 20
    // (1,000 locked leaves, 19,000 unlocked non-leaves), then M = 5,000
    // unlocked single blocks. A scan restarting at the oldest block after each
    // victim would visit about M × K = 10^8 blocks.
    const K_CHAINS: u64 = 1_000;
    const DEPTH: u64 = 20;
    const M: u64 = 5_000;
    let mut lru = RadixLru::new();
    let first_free = locked_chains(&mut lru, 0, K_CHAINS, DEPTH);
    for id in first_free..first_free + M {
        lru.insert(id, None);
    }
    let mut victims = Vec::new();
    assert_eq!(lru.evict(M as usize, &mut victims), M as usize);
    assert_eq!(victims, (first_free..first_free + M).collect::<Vec<_>>());
    assert_eq!(lru.visited(), K_CHAINS * DEPTH + M);
    // Nothing else is evictable: one more pass visits the K blocks once.
    assert_eq!(lru.evict(1, &mut victims), 0);
    assert_eq!(lru.visited(), 2 * K_CHAINS * DEPTH + M);
}

#[test]
fn interleaved_locked_blocks_and_cascading_chains_cost_one_visit_each() {
    // Oldest to newest: a locked block, then an unlocked chain of 3 touched
    // (leaf oldest), repeated. Each victim's parent becomes a leaf just ahead
    // of the scan, so the chains go tail first without going back.
    const ROUNDS: u64 = 2_000;
    let mut lru = RadixLru::new();
    let mut expected = Vec::new();
    for round in 0..ROUNDS {
        let base = round * 10;
        lru.insert(base, None);
        lru.lock(base);
        lru.touch(base);
        for (parent, block) in [
            (None, base + 1),
            (Some(base + 1), base + 2),
            (Some(base + 2), base + 3),
        ] {
            lru.insert(block, parent);
        }
        lru.touch(base + 3);
        expected.extend([base + 3, base + 2, base + 1]);
    }
    let mut victims = Vec::new();
    let m = expected.len();
    assert_eq!(lru.evict(m, &mut victims), m);
    assert_eq!(victims, expected);
    // Each locked block is skipped once.
    assert_eq!(lru.visited(), m as u64 + ROUNDS);
}
