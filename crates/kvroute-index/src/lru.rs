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

use crate::table::{NO_PARENT, SeqMap, map_bytes};

const NIL: u32 = u32::MAX;

struct Node {
    seq: u64,
    parent: u64,
    shard: u16,
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
    /// Nodes the eviction scan has visited, for the cost-bound test.
    pub visited: u64,
}

/// Where an eviction scan resumes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Cursor {
    #[default]
    Tail,
    At(u32),
    /// The scan reached the head.
    Done,
}

impl Lru {
    pub fn heap_bytes(&self) -> u64 {
        (self.nodes.capacity() * size_of::<Node>() + self.free.capacity() * 4) as u64
            + map_bytes(&self.index)
    }

    /// Adds a block as the newest; no-op if present.
    pub fn insert(&mut self, seq: u64, parent: u64, shard: u16) {
        if self.index.contains_key(&seq) {
            return;
        }
        let node = Node {
            seq,
            parent,
            shard,
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
        if let Some(id) = self.index.remove(&seq) {
            self.unlink(id);
            let parent = self.nodes[id as usize].parent;
            if let Some(&p) = self.index.get(&parent).filter(|_| parent != NO_PARENT) {
                self.nodes[p as usize].children -= 1;
            }
            self.free.push(id);
        }
    }

    /// Marks a path (sequence hashes from the root) as just used: root newest.
    pub fn touch(&mut self, path: &[u64]) {
        for seq in path.iter().rev() {
            if let Some(&id) = self.index.get(seq) {
                self.unlink(id);
                self.push_head(id);
            }
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
    /// removed from the order, with its shard; none when the scan reached the head.
    pub fn next_victim(&mut self, cursor: &mut Cursor) -> Option<(u64, u16)> {
        let mut at = match *cursor {
            Cursor::Tail => self.tail,
            Cursor::At(id) => Some(id),
            Cursor::Done => None,
        };
        while let Some(id) = at {
            self.visited += 1;
            let node = &self.nodes[id as usize];
            let next = (node.newer != NIL).then_some(node.newer);
            if node.children == 0 && node.pins == 0 {
                let (seq, shard) = (node.seq, node.shard);
                self.remove(seq);
                *cursor = next.map_or(Cursor::Done, Cursor::At);
                return Some((seq, shard));
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
