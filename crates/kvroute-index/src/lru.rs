//! Recency order of distinct blocks, for the optional `max_blocks` limit.
//!
//! An intrusive doubly linked list over a slab, newest at the head. Each node
//! counts its children present in the list (so only leaves are evicted, never an
//! ancestor before its descendants) and its pins (paths of requests being routed
//! right now, which are never evicted).
//!
//! Touching a path moves it to the head leaf first and root last, so that within
//! the chain the root-side ancestor is newest and the leaf oldest: a tail-to-head
//! scan meets a chain's leaf before its ancestors. The eviction scan resumes from a
//! cursor after each victim instead of restarting at the tail, so evicting M blocks
//! past K skipped ones (pinned or not leaves) visits M + K nodes.
//!
//! A lookup's touch is only written down (by the index, outside this order's
//! lock, then handed over with [`Lru::defer`]) and done before the order is
//! next read or changed (the next store, removal or eviction scan): moving a
//! routed prompt's few hundred blocks is a few cache misses each, which the
//! routing decision need not wait for. Done in arrival order before anything
//! else, the deferred touches leave the same order as touching at once. The
//! index's recency thread applies them in short slices ([`Lru::apply_some`])
//! when nothing else does, so a lookup rarely finds too many waiting and has
//! to apply them all itself (64 Ki moves, 3–12 ms).

use std::collections::VecDeque;

use crate::table::{NO_PARENT, SeqMap, map_bytes};

const NIL: u32 = u32::MAX;

/// Deferred touches kept at most, in blocks (512 KiB); past it a lookup
/// applies them itself.
pub(crate) const MAX_PENDING: usize = 1 << 16;

/// Deferred touches past which a lookup wakes the recency thread.
pub(crate) const DRAIN_AT: usize = 1 << 13;

struct Node {
    seq: u64,
    parent: u64,
    /// Toward the head (newer) and toward the tail (older).
    newer: u32,
    older: u32,
    children: u32,
    pins: u32,
}

#[derive(Default)]
pub(crate) struct Lru {
    nodes: Vec<Node>,
    free: Vec<u32>,
    index: SeqMap<u32>,
    head: Option<u32>,
    tail: Option<u32>,
    /// Blocks to move to the head, in order: the deferred touches' paths, each
    /// leaf first.
    pending: VecDeque<u64>,
    /// Nodes the eviction scan has visited, for the cost-bound test.
    pub visited: u64,
}

/// Where an eviction scan resumes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Cursor {
    #[default]
    Tail,
    /// At node `id`, which held block `seq` when the cursor was set: a scan
    /// resumed after the lock was let go (a dump's eviction in batches) starts
    /// at the tail again if that node went meanwhile.
    At { id: u32, seq: u64 },
    /// The scan reached the head.
    Done,
}

impl Lru {
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn heap_bytes(&self) -> u64 {
        (self.nodes.capacity() * size_of::<Node>()
            + self.free.capacity() * 4
            + self.pending.capacity() * 8) as u64
            + map_bytes(&self.index)
    }

    /// Adds a block as the newest; no-op if present.
    pub fn insert(&mut self, seq: u64, parent: u64) {
        self.apply_pending();
        if self.index.contains_key(&seq) {
            return;
        }
        let node = Node {
            seq,
            parent,
            newer: NIL,
            older: NIL,
            children: 0,
            pins: 0,
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() as u32 - 1
            }
        };
        self.index.insert(seq, id);
        self.push_head(id);
        if let Some(&p) = self.index.get(&parent).filter(|_| parent != NO_PARENT) {
            self.nodes[p as usize].children += 1;
        }
    }

    /// Forgets a block (nobody holds it any more).
    pub fn remove(&mut self, seq: u64) {
        self.apply_pending();
        if let Some(id) = self.index.remove(&seq) {
            self.unlink(id);
            let parent = self.nodes[id as usize].parent;
            if let Some(&p) = self.index.get(&parent).filter(|_| parent != NO_PARENT) {
                // A parent dropped and stored again while this child stayed (an
                // orphan) restarted its count without it.
                let children = &mut self.nodes[p as usize].children;
                *children = children.saturating_sub(1);
            }
            self.free.push(id);
        }
    }

    /// Marks a path (block keys from the root) as just used: root newest.
    pub fn touch(&mut self, path: &[u64]) {
        self.apply_pending();
        for &seq in path.iter().rev() {
            self.move_to_head(seq);
        }
    }

    /// Takes over touches written down elsewhere, in order (each path leaf
    /// first), leaving `touches` empty.
    pub fn defer(&mut self, touches: &mut Vec<u64>) {
        if self.pending.len() + touches.len() > MAX_PENDING {
            self.apply_pending();
        }
        if self.pending.capacity() == 0 && !touches.is_empty() {
            // At its full size at once: grown by doubling, the lookup that
            // crossed 32 Ki blocks copied 256 KiB into fresh pages (≈ 190 µs,
            // a routing decision's p99 at 8k tokens).
            self.pending.reserve_exact(MAX_PENDING);
        }
        self.pending.extend(touches.drain(..));
    }

    fn apply_pending(&mut self) {
        self.apply_some(usize::MAX);
    }

    /// Deferred touches waiting.
    #[cfg(test)]
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Applies the `n` oldest deferred touches; true when none are left.
    pub fn apply_some(&mut self, n: usize) -> bool {
        for _ in 0..n.min(self.pending.len()) {
            let Some(seq) = self.pending.pop_front() else {
                break;
            };
            self.move_to_head(seq);
        }
        self.pending.is_empty()
    }

    fn move_to_head(&mut self, seq: u64) {
        if let Some(&id) = self.index.get(&seq) {
            self.unlink(id);
            self.push_head(id);
        }
    }

    /// Protects (or, with `delta` -1, releases) the blocks of a path from eviction.
    pub fn pin(&mut self, path: &[u64], delta: i32) {
        for seq in path {
            if let Some(&id) = self.index.get(seq) {
                let pins = &mut self.nodes[id as usize].pins;
                *pins = pins.saturating_add_signed(delta);
            }
        }
    }

    /// The next evictable block (an unpinned leaf) from `cursor` toward the head,
    /// removed from the order; none when the scan reached the head.
    pub fn next_victim(&mut self, cursor: &mut Cursor) -> Option<u64> {
        self.apply_pending();
        let mut at = match *cursor {
            Cursor::Tail => self.tail,
            Cursor::At { id, seq } if self.index.get(&seq) == Some(&id) => Some(id),
            Cursor::At { .. } => self.tail,
            Cursor::Done => None,
        };
        while let Some(id) = at {
            self.visited += 1;
            let node = &self.nodes[id as usize];
            let next = (node.newer != NIL).then_some(node.newer);
            if node.children == 0 && node.pins == 0 {
                let seq = node.seq;
                self.remove(seq);
                *cursor = next.map_or(Cursor::Done, |id| Cursor::At {
                    id,
                    seq: self.nodes[id as usize].seq,
                });
                return Some(seq);
            }
            at = next;
        }
        *cursor = Cursor::Done;
        None
    }

    fn unlink(&mut self, id: u32) {
        let (newer, older) = {
            let n = &self.nodes[id as usize];
            (n.newer, n.older)
        };
        match newer {
            NIL => self.head = (older != NIL).then_some(older),
            n => self.nodes[n as usize].older = older,
        }
        match older {
            NIL => self.tail = (newer != NIL).then_some(newer),
            o => self.nodes[o as usize].newer = newer,
        }
    }

    fn push_head(&mut self, id: u32) {
        let old_head = self.head.unwrap_or(NIL);
        {
            let n = &mut self.nodes[id as usize];
            n.newer = NIL;
            n.older = old_head;
        }
        match self.head {
            Some(h) => self.nodes[h as usize].newer = id,
            None => self.tail = Some(id),
        }
        self.head = Some(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Evicts until `n` victims or the head, in one cursor-resumed scan.
    fn evict(lru: &mut Lru, n: usize) -> Vec<u64> {
        let mut cursor = Cursor::default();
        std::iter::from_fn(|| lru.next_victim(&mut cursor))
            .take(n)
            .collect()
    }

    #[test]
    fn interleaved_skips_cost_one_visit_each() {
        // Tail to head: pinned, leaf, pinned, leaf, ... A scan restarting at the
        // tail after each eviction would visit about M * K / 2 nodes.
        const M: u64 = 2000;
        let mut lru = Lru::default();
        for i in 1..=M {
            lru.insert(2 * i, NO_PARENT);
            lru.pin(&[2 * i], 1);
            lru.insert(2 * i + 1, NO_PARENT);
        }
        let victims = evict(&mut lru, M as usize);
        assert_eq!(victims, (1..=M).map(|i| 2 * i + 1).collect::<Vec<_>>());
        assert!(
            lru.visited <= 2 * M,
            "visited {} nodes for {M} evictions",
            lru.visited
        );
    }

    #[test]
    fn a_touched_chain_is_evicted_leaf_first_in_one_pass() {
        let mut lru = Lru::default();
        let chain = [10, 11, 12, 13];
        let mut parent = NO_PARENT;
        for seq in chain {
            lru.insert(seq, parent);
            parent = seq;
        }
        lru.insert(99, NO_PARENT);
        // Stored root first, the chain's leaf is newest; touching reorders it.
        lru.touch(&chain);
        assert_eq!(evict(&mut lru, 5), vec![99, 13, 12, 11, 10]);
        assert_eq!(lru.visited, 5);
    }

    #[test]
    fn ancestors_and_pinned_blocks_are_never_victims() {
        let mut lru = Lru::default();
        lru.insert(1, NO_PARENT);
        lru.insert(2, 1);
        lru.insert(3, 2);
        lru.insert(7, NO_PARENT);
        lru.pin(&[7], 1);
        // 1 and 2 are older than 3 but have children: skipped this pass.
        assert_eq!(evict(&mut lru, 10), vec![3]);
        assert_eq!(evict(&mut lru, 10), vec![2]);
        lru.pin(&[7], -1);
        assert_eq!(evict(&mut lru, 10), vec![1, 7]);
        assert_eq!(lru.len(), 0);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u64),
        Remove(u64),
        TouchLater(Vec<u64>),
        /// The recency thread's slice: changes nothing the order shows.
        ApplySome(usize),
        Evict,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            (0..12u64).prop_map(Op::Insert),
            (0..12u64).prop_map(Op::Remove),
            proptest::collection::vec(0..12u64, 0..5).prop_map(Op::TouchLater),
            (0..6usize).prop_map(Op::ApplySome),
            Just(Op::Evict),
        ]
    }

    proptest::proptest! {
        /// Deferred touches against a model that moves each touched block to
        /// the front of a list at once (root blocks only: the order alone).
        #[test]
        fn deferred_touches_evict_as_touches_done_at_once(
            ops in proptest::collection::vec(op(), 1..80)
        ) {
            let mut lru = Lru::default();
            // Newest first.
            let mut model: Vec<u64> = Vec::new();
            for op in ops {
                match op {
                    Op::Insert(seq) => {
                        lru.insert(seq, NO_PARENT);
                        if !model.contains(&seq) {
                            model.insert(0, seq);
                        }
                    }
                    Op::Remove(seq) => {
                        lru.remove(seq);
                        model.retain(|&s| s != seq);
                    }
                    Op::TouchLater(path) => {
                        lru.defer(&mut path.iter().rev().copied().collect());
                        for seq in path.iter().rev() {
                            if let Some(at) = model.iter().position(|s| s == seq) {
                                model.remove(at);
                                model.insert(0, *seq);
                            }
                        }
                    }
                    Op::ApplySome(n) => {
                        lru.apply_some(n);
                    }
                    Op::Evict => {
                        let victim = lru.next_victim(&mut Cursor::default());
                        proptest::prop_assert_eq!(victim, model.pop());
                    }
                }
            }
            proptest::prop_assert_eq!(evict(&mut lru, 100), model.into_iter().rev().collect::<Vec<_>>());
        }
    }
}
