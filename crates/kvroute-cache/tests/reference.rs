//! Each policy against a naive list-based implementation of the same rules, on
//! random mixes of accesses and worker-pool operations; and sanity properties
//! of the replay on random traces.

use std::collections::HashSet;

use kvroute_cache::{
    Access, AccessHint, ArcCache, Belady, BlockCache, Fifo, Infinite, Lfu, Lru, PolicyKind,
    Predictive, PreparedTrace, Priority, Qos, S3Fifo, S3FifoParams, replay,
};
use kvroute_trace::TraceRequest;
use proptest::prelude::*;

/// A step of a random workload.
#[derive(Clone, Copy, Debug)]
enum Op {
    Access(u64),
    Remove(u64),
    EvictOne,
    /// Describes the next access: depth and priority class.
    Hint(u32, u8),
}

/// The naive models implement the same trait, so the same driver checks them.
fn check_same(
    real: &mut dyn BlockCache,
    naive: &mut dyn BlockCache,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    for (i, &op) in ops.iter().enumerate() {
        match op {
            Op::Access(block) => {
                let (mut real_out, mut naive_out) = (Vec::new(), Vec::new());
                let got = real.access(block, &mut real_out);
                let want = naive.access(block, &mut naive_out);
                prop_assert_eq!(got, want, "op {} {:?}", i, op);
                prop_assert_eq!(real_out, naive_out, "op {} {:?}", i, op);
            }
            Op::Remove(block) => {
                prop_assert_eq!(real.remove(block), naive.remove(block), "op {} {:?}", i, op)
            }
            Op::EvictOne => prop_assert_eq!(real.evict_one(), naive.evict_one(), "op {}", i),
            Op::Hint(depth, class) => {
                let hint = AccessHint {
                    depth,
                    priority: Priority::from_class(class.into()).unwrap(),
                };
                real.hint(hint);
                naive.hint(hint);
            }
        }
        prop_assert_eq!(real.len(), naive.len(), "op {} {:?}", i, op);
        for block in 0..BLOCKS {
            prop_assert_eq!(
                real.contains(block),
                naive.contains(block),
                "op {} block {}",
                i,
                block
            );
        }
    }
    Ok(())
}

const BLOCKS: u64 = 12;

fn ops(pool_ops: bool) -> impl Strategy<Value = Vec<Op>> {
    let op = if pool_ops {
        prop_oneof![
            8 => (0..BLOCKS).prop_map(Op::Access),
            1 => (0..BLOCKS).prop_map(Op::Remove),
            1 => Just(Op::EvictOne),
            4 => (0u32..20, 0u8..3).prop_map(|(depth, class)| Op::Hint(depth, class)),
        ]
        .boxed()
    } else {
        (0..BLOCKS).prop_map(Op::Access).boxed()
    };
    prop::collection::vec(op, 0..200)
}

// ---------------------------------------------------------------- LRU, FIFO

/// A Vec in recency (LRU) or insertion (FIFO) order, oldest first.
struct NaiveQueue {
    capacity: usize,
    move_on_hit: bool,
    blocks: Vec<u64>,
}

impl BlockCache for NaiveQueue {
    fn access(&mut self, block: u64, evicted: &mut Vec<u64>) -> Access {
        if let Some(at) = self.blocks.iter().position(|&b| b == block) {
            if self.move_on_hit {
                self.blocks.remove(at);
                self.blocks.push(block);
            }
            return Access::Hit;
        }
        if self.blocks.len() >= self.capacity {
            evicted.push(self.blocks.remove(0));
        }
        self.blocks.push(block);
        Access::Miss
    }
    fn contains(&self, block: u64) -> bool {
        self.blocks.contains(&block)
    }
    fn remove(&mut self, block: u64) -> bool {
        let at = self.blocks.iter().position(|&b| b == block);
        at.map(|at| self.blocks.remove(at)).is_some()
    }
    fn evict_one(&mut self) -> Option<u64> {
        (!self.blocks.is_empty()).then(|| self.blocks.remove(0))
    }
    fn len(&self) -> usize {
        self.blocks.len()
    }
    fn capacity(&self) -> Option<usize> {
        Some(self.capacity)
    }
}

// ---------------------------------------------------------------------- LFU

/// (block, count, insertion number); the victim is the minimum (count, insertion).
struct NaiveLfu {
    capacity: usize,
    next: u64,
    blocks: Vec<(u64, u64, u64)>,
}

impl BlockCache for NaiveLfu {
    fn access(&mut self, block: u64, evicted: &mut Vec<u64>) -> Access {
        if let Some(entry) = self.blocks.iter_mut().find(|e| e.0 == block) {
            entry.1 += 1;
            return Access::Hit;
        }
        if self.blocks.len() >= self.capacity {
            evicted.extend(self.evict_one());
        }
        self.blocks.push((block, 1, self.next));
        self.next += 1;
        Access::Miss
    }
    fn contains(&self, block: u64) -> bool {
        self.blocks.iter().any(|e| e.0 == block)
    }
    fn remove(&mut self, block: u64) -> bool {
        let before = self.blocks.len();
        self.blocks.retain(|e| e.0 != block);
        self.blocks.len() != before
    }
    fn evict_one(&mut self) -> Option<u64> {
        let at = (0..self.blocks.len()).min_by_key(|&i| (self.blocks[i].1, self.blocks[i].2))?;
        Some(self.blocks.remove(at).0)
    }
    fn len(&self) -> usize {
        self.blocks.len()
    }
    fn capacity(&self) -> Option<usize> {
        Some(self.capacity)
    }
}

// ------------------------------------------------------------------- S3FIFO

/// S3-FIFO as the paper (Yang et al., SOSP'23) describes it, with the
/// project's documented choices (s3fifo.rs): a small FIFO S of
/// `round_half_even(capacity × small_ratio)` (at least 1) slots, a main FIFO M
/// of the rest, a ghost FIFO G of as many ids as M; access counts capped at
/// `max_freq`.
/// - A hit in S or M counts the access.
/// - A miss whose id is in G leaves G and joins M's tail with count 0.
/// - Any other miss joins S's tail with count 0, after S's head moves on while
///   S is full: to M's tail with its count if it was accessed in S, else out
///   (evicted) to G.
/// - Joining a full M first evicts from M: its head goes round to the tail
///   with its count lowered while it has one; the first head with none leaves
///   to G. An M eviction caused by an S promotion is reported as well.
/// - G forgets its oldest id when full.
/// - A pool's `evict_one` takes from S while S is at its size (or M is empty),
///   otherwise from M.
///
/// Written independently of the real one: all blocks in one list, every queue
/// position a global arrival stamp, a queue's head the lowest stamp in it.
struct NaiveS3Fifo {
    small_cap: usize,
    main_cap: usize,
    ghost_cap: usize,
    max_freq: u8,
    clock: u64,
    /// (block, where, count, stamp).
    entries: Vec<(u64, Where, u8, u64)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Where {
    Small,
    Main,
    Ghost,
}

impl NaiveS3Fifo {
    fn new(capacity: usize, small_ratio: f64, max_freq: u8) -> Self {
        let small_cap = ((capacity as f64 * small_ratio).round_ties_even() as usize).max(1);
        NaiveS3Fifo {
            small_cap,
            main_cap: capacity - small_cap,
            ghost_cap: capacity - small_cap,
            max_freq,
            clock: 0,
            entries: Vec::new(),
        }
    }

    fn size(&self, queue: Where) -> usize {
        self.entries.iter().filter(|e| e.1 == queue).count()
    }

    /// Takes the head (lowest stamp) of `queue` out of the list.
    fn pop_head(&mut self, queue: Where) -> Option<(u64, u8)> {
        let at = (0..self.entries.len())
            .filter(|&i| self.entries[i].1 == queue)
            .min_by_key(|&i| self.entries[i].3)?;
        let (block, _, count, _) = self.entries.remove(at);
        Some((block, count))
    }

    fn push_tail(&mut self, block: u64, queue: Where, count: u8) {
        if queue == Where::Ghost && self.size(Where::Ghost) >= self.ghost_cap {
            self.pop_head(Where::Ghost);
        }
        self.clock += 1;
        self.entries.push((block, queue, count, self.clock));
    }

    fn evict_from_main(&mut self) -> Option<u64> {
        loop {
            let (block, count) = self.pop_head(Where::Main)?;
            if count == 0 {
                self.push_tail(block, Where::Ghost, 0);
                return Some(block);
            }
            self.push_tail(block, Where::Main, count - 1);
        }
    }

    /// Puts a block at M's tail, evicting from M first if M is full.
    fn join_main(&mut self, block: u64, count: u8) -> Option<u64> {
        let victim = if self.size(Where::Main) >= self.main_cap {
            self.evict_from_main()
        } else {
            None
        };
        self.push_tail(block, Where::Main, count);
        victim
    }

    /// S's head moves on: to M if accessed in S (returning whatever M lost),
    /// else out to G (returning it).
    fn move_small_head(&mut self) -> Option<u64> {
        let (block, count) = self.pop_head(Where::Small)?;
        if count > 0 {
            self.join_main(block, count)
        } else {
            self.push_tail(block, Where::Ghost, 0);
            Some(block)
        }
    }
}

impl BlockCache for NaiveS3Fifo {
    fn access(&mut self, block: u64, evicted: &mut Vec<u64>) -> Access {
        let max = self.max_freq;
        let found = self.entries.iter().position(|e| e.0 == block);
        match found.map(|at| (at, self.entries[at].1)) {
            Some((at, Where::Small | Where::Main)) => {
                let count = &mut self.entries[at].2;
                *count = (*count + 1).min(max);
                Access::Hit
            }
            Some((at, Where::Ghost)) => {
                self.entries.remove(at);
                evicted.extend(self.join_main(block, 0));
                Access::Miss
            }
            None => {
                while self.size(Where::Small) >= self.small_cap {
                    evicted.extend(self.move_small_head());
                }
                self.push_tail(block, Where::Small, 0);
                Access::Miss
            }
        }
    }
    fn contains(&self, block: u64) -> bool {
        self.entries
            .iter()
            .any(|e| e.0 == block && e.1 != Where::Ghost)
    }
    fn remove(&mut self, block: u64) -> bool {
        let at = self
            .entries
            .iter()
            .position(|e| e.0 == block && e.1 != Where::Ghost);
        at.map(|at| self.entries.remove(at)).is_some()
    }
    fn evict_one(&mut self) -> Option<u64> {
        loop {
            let small = self.size(Where::Small);
            if small == 0 || (small < self.small_cap && self.size(Where::Main) > 0) {
                return self.evict_from_main();
            }
            if let Some(victim) = self.move_small_head() {
                return Some(victim);
            }
        }
    }
    fn len(&self) -> usize {
        self.entries.iter().filter(|e| e.1 != Where::Ghost).count()
    }
    fn capacity(&self) -> Option<usize> {
        Some(self.small_cap + self.main_cap)
    }
}

// ---------------------------------------------------------------------- ARC

/// The paper's ARC with Vecs (LRU first), with the same two pool-use guards as
/// the real one: REPLACE only on a full cache, and from the other list when
/// the chosen one is empty.
struct NaiveArc {
    c: usize,
    p: f64,
    t1: Vec<u64>,
    t2: Vec<u64>,
    b1: Vec<u64>,
    b2: Vec<u64>,
}

fn take(list: &mut Vec<u64>, block: u64) -> bool {
    let at = list.iter().position(|&b| b == block);
    at.map(|at| list.remove(at)).is_some()
}

impl NaiveArc {
    fn replace(&mut self, x_in_b2: bool) -> Option<u64> {
        let t1 = self.t1.len() as f64;
        let prefer_t1 = t1 >= 1.0 && ((x_in_b2 && t1 == self.p) || t1 > self.p);
        if (prefer_t1 || self.t2.is_empty()) && !self.t1.is_empty() {
            let victim = self.t1.remove(0);
            self.b1.push(victim);
            Some(victim)
        } else if !self.t2.is_empty() {
            let victim = self.t2.remove(0);
            self.b2.push(victim);
            Some(victim)
        } else {
            None
        }
    }

    fn replace_if_full(&mut self, x_in_b2: bool, evicted: &mut Vec<u64>) {
        if self.t1.len() + self.t2.len() >= self.c {
            evicted.extend(self.replace(x_in_b2));
        }
    }
}

impl BlockCache for NaiveArc {
    fn access(&mut self, x: u64, evicted: &mut Vec<u64>) -> Access {
        let c = self.c as f64;
        if take(&mut self.t1, x) || take(&mut self.t2, x) {
            self.t2.push(x);
            return Access::Hit;
        }
        if self.b1.contains(&x) {
            let (b1, b2) = (self.b1.len() as f64, self.b2.len() as f64);
            self.p = (self.p + if b1 >= b2 { 1.0 } else { b2 / b1 }).min(c);
            self.replace_if_full(false, evicted);
            take(&mut self.b1, x);
            self.t2.push(x);
        } else if self.b2.contains(&x) {
            let (b1, b2) = (self.b1.len() as f64, self.b2.len() as f64);
            self.p = (self.p - if b2 >= b1 { 1.0 } else { b1 / b2 }).max(0.0);
            self.replace_if_full(true, evicted);
            take(&mut self.b2, x);
            self.t2.push(x);
        } else {
            let l1 = self.t1.len() + self.b1.len();
            let total = l1 + self.t2.len() + self.b2.len();
            if l1 == self.c {
                if self.t1.len() < self.c {
                    self.b1.remove(0);
                    self.replace_if_full(false, evicted);
                } else {
                    evicted.push(self.t1.remove(0));
                }
            } else if total >= self.c {
                if total == 2 * self.c {
                    self.b2.remove(0);
                }
                self.replace_if_full(false, evicted);
            }
            self.t1.push(x);
        }
        Access::Miss
    }
    fn contains(&self, block: u64) -> bool {
        self.t1.contains(&block) || self.t2.contains(&block)
    }
    fn remove(&mut self, block: u64) -> bool {
        take(&mut self.t1, block) || take(&mut self.t2, block)
    }
    fn evict_one(&mut self) -> Option<u64> {
        self.replace(false)
    }
    fn len(&self) -> usize {
        self.t1.len() + self.t2.len()
    }
    fn capacity(&self) -> Option<usize> {
        Some(self.c)
    }
}

// ---------------------------------------------------------------------- QoS

/// Blocks in recency order (oldest first) with their class; the victim is the
/// oldest block of the lowest class present.
struct NaiveQos {
    capacity: usize,
    next_class: u8,
    blocks: Vec<(u64, u8)>,
}

impl BlockCache for NaiveQos {
    fn access(&mut self, block: u64, evicted: &mut Vec<u64>) -> Access {
        let class = std::mem::take(&mut self.next_class);
        self.next_class = 1;
        if let Some(at) = self.blocks.iter().position(|e| e.0 == block) {
            let (_, old) = self.blocks.remove(at);
            self.blocks.push((block, old.max(class)));
            return Access::Hit;
        }
        if self.blocks.len() >= self.capacity {
            evicted.extend(self.evict_one());
        }
        self.blocks.push((block, class));
        Access::Miss
    }
    fn hint(&mut self, hint: AccessHint) {
        self.next_class = hint.priority.class();
    }
    fn contains(&self, block: u64) -> bool {
        self.blocks.iter().any(|e| e.0 == block)
    }
    fn remove(&mut self, block: u64) -> bool {
        take_entry(&mut self.blocks, |e| e.0 == block)
    }
    fn evict_one(&mut self) -> Option<u64> {
        let lowest = self.blocks.iter().map(|e| e.1).min()?;
        let at = self.blocks.iter().position(|e| e.1 == lowest)?;
        Some(self.blocks.remove(at).0)
    }
    fn len(&self) -> usize {
        self.blocks.len()
    }
    fn capacity(&self) -> Option<usize> {
        Some(self.capacity)
    }
}

fn take_entry<T>(list: &mut Vec<T>, found: impl Fn(&T) -> bool) -> bool {
    let at = list.iter().position(found);
    at.map(|at| list.remove(at)).is_some()
}

// --------------------------------------------------------------- Predictive

/// The predictive policy's rule by full scan (exact below 64 residents):
/// score = (age + 1) for a block reused while resident or admitted while among
/// the last `capacity` victims, else (age + 1) / √((reused + 1) / (admitted + 2))
/// of its depth bucket (0, 1, 2–3, 4–7, ...), where such returns count as
/// reused; the victim has the largest score, ties to the older use, then the
/// smaller id.
struct NaivePredictive {
    capacity: usize,
    now: u64,
    next_depth: u32,
    /// (block, last use, reused, depth bucket)
    blocks: Vec<(u64, u64, bool, usize)>,
    admitted: [f64; 16],
    reused: [f64; 16],
    /// Every victim, oldest first (only the last `capacity` matter).
    victims: Vec<u64>,
}

impl NaivePredictive {
    fn new(capacity: usize) -> Self {
        NaivePredictive {
            capacity,
            now: 0,
            next_depth: 0,
            blocks: vec![],
            admitted: [0.0; 16],
            reused: [0.0; 16],
            victims: vec![],
        }
    }
    fn score(&self, e: &(u64, u64, bool, usize)) -> f64 {
        let age = (self.now - e.1) as f64 + 1.0;
        if e.2 {
            age
        } else {
            age / ((self.reused[e.3] + 1.0) / (self.admitted[e.3] + 2.0)).sqrt()
        }
    }
}

impl BlockCache for NaivePredictive {
    fn access(&mut self, block: u64, evicted: &mut Vec<u64>) -> Access {
        let depth = std::mem::take(&mut self.next_depth);
        let now = self.now;
        self.now += 1;
        if let Some(e) = self.blocks.iter_mut().find(|e| e.0 == block) {
            if !e.2 {
                e.2 = true;
                self.reused[e.3] += 1.0;
            }
            e.1 = now;
            return Access::Hit;
        }
        if self.blocks.len() >= self.capacity {
            evicted.extend(self.evict_one());
        }
        let bucket = if depth == 0 {
            0
        } else {
            (depth.ilog2() as usize + 1).min(15)
        };
        let window = &self.victims[self.victims.len().saturating_sub(self.capacity)..];
        let returning = window.contains(&block);
        self.admitted[bucket] += 1.0;
        if returning {
            self.reused[bucket] += 1.0;
        }
        self.blocks.push((block, now, returning, bucket));
        Access::Miss
    }
    fn hint(&mut self, hint: AccessHint) {
        self.next_depth = hint.depth;
    }
    fn contains(&self, block: u64) -> bool {
        self.blocks.iter().any(|e| e.0 == block)
    }
    fn remove(&mut self, block: u64) -> bool {
        take_entry(&mut self.blocks, |e| e.0 == block)
    }
    fn evict_one(&mut self) -> Option<u64> {
        let at = (0..self.blocks.len()).max_by(|&a, &b| {
            let (ea, eb) = (&self.blocks[a], &self.blocks[b]);
            self.score(ea)
                .total_cmp(&self.score(eb))
                .then((eb.1, eb.0).cmp(&(ea.1, ea.0)))
        })?;
        let victim = self.blocks.remove(at).0;
        self.victims.push(victim);
        Some(victim)
    }
    fn len(&self) -> usize {
        self.blocks.len()
    }
    fn capacity(&self) -> Option<usize> {
        Some(self.capacity)
    }
}

// ------------------------------------------------------------------- Belady

/// MIN by scanning the rest of the sequence for every resident block.
fn naive_belady(capacity: usize, sequence: &[u64]) -> Vec<(Access, Vec<u64>)> {
    let mut resident: Vec<u64> = Vec::new();
    let mut out = Vec::new();
    for (i, &block) in sequence.iter().enumerate() {
        if resident.contains(&block) {
            out.push((Access::Hit, vec![]));
            continue;
        }
        let mut evicted = vec![];
        if resident.len() >= capacity {
            let next_use = |b: u64| {
                let later = sequence[i..].iter().position(|&s| s == b);
                later.map_or(u64::MAX, |d| (i + d) as u64)
            };
            let at = (0..resident.len())
                .max_by_key(|&j| (next_use(resident[j]), resident[j]))
                .unwrap();
            evicted.push(resident.remove(at));
        }
        resident.push(block);
        out.push((Access::Miss, evicted));
    }
    out
}

fn config() -> ProptestConfig {
    ProptestConfig::with_cases(128)
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn lru_matches_naive(capacity in 1usize..6, ops in ops(true)) {
        let mut naive = NaiveQueue { capacity, move_on_hit: true, blocks: vec![] };
        check_same(&mut Lru::new(capacity).unwrap(), &mut naive, &ops)?;
    }

    #[test]
    fn fifo_matches_naive(capacity in 1usize..6, ops in ops(true)) {
        let mut naive = NaiveQueue { capacity, move_on_hit: false, blocks: vec![] };
        check_same(&mut Fifo::new(capacity).unwrap(), &mut naive, &ops)?;
    }

    #[test]
    fn lfu_matches_naive(capacity in 1usize..6, ops in ops(true)) {
        let mut naive = NaiveLfu { capacity, next: 0, blocks: vec![] };
        check_same(&mut Lfu::new(capacity).unwrap(), &mut naive, &ops)?;
    }

    #[test]
    fn s3fifo_matches_naive(
        capacity in 2usize..9,
        small_ratio in prop::sample::select(vec![0.1, 0.25, 0.4]),
        max_freq in 0u8..4,
        ops in ops(true),
    ) {
        let params = S3FifoParams { small_ratio, max_freq };
        let mut naive = NaiveS3Fifo::new(capacity, small_ratio, max_freq);
        check_same(&mut S3Fifo::new(capacity, params).unwrap(), &mut naive, &ops)?;
    }

    #[test]
    fn arc_matches_naive(capacity in 1usize..6, pool_ops in any::<bool>(), seed_ops in ops(true)) {
        // Pure access streams keep the paper's invariants; mixed ones test the guards.
        let ops: Vec<Op> = if pool_ops {
            seed_ops
        } else {
            seed_ops.into_iter().filter(|op| matches!(op, Op::Access(_))).collect()
        };
        let mut naive = NaiveArc { c: capacity, p: 0.0, t1: vec![], t2: vec![], b1: vec![], b2: vec![] };
        check_same(&mut ArcCache::new(capacity).unwrap(), &mut naive, &ops)?;
    }

    #[test]
    fn qos_matches_naive(capacity in 1usize..6, ops in ops(true)) {
        let mut naive = NaiveQos { capacity, next_class: 1, blocks: vec![] };
        check_same(&mut Qos::new(capacity).unwrap(), &mut naive, &ops)?;
    }

    #[test]
    fn predictive_matches_naive(capacity in 1usize..9, ops in ops(true)) {
        check_same(&mut Predictive::new(capacity).unwrap(), &mut NaivePredictive::new(capacity), &ops)?;
    }

    #[test]
    fn adopting_another_policys_blocks_loses_none(
        from in prop::sample::select(vec![PolicyKind::Lru, PolicyKind::S3Fifo, PolicyKind::Arc, PolicyKind::Predictive, PolicyKind::Qos]),
        to in prop::sample::select(vec![PolicyKind::Lru, PolicyKind::Lfu, PolicyKind::Fifo, PolicyKind::S3Fifo, PolicyKind::Arc, PolicyKind::Predictive, PolicyKind::Qos]),
        capacity in 2usize..12,
        ops in ops(true),
    ) {
        let mut old = from.build(capacity, S3FifoParams::default(), &[]).unwrap();
        let mut evicted = vec![];
        for op in ops {
            match op {
                Op::Access(block) => { old.access(block, &mut evicted); }
                Op::Remove(block) => { old.remove(block); }
                Op::EvictOne => { old.evict_one(); }
                Op::Hint(..) => {}
            }
        }
        let before: HashSet<u64> = (0..BLOCKS).filter(|&b| old.contains(b)).collect();
        let mut new = to.build(capacity, S3FifoParams::default(), &[]).unwrap();
        let mut order = vec![];
        while let Some(victim) = old.evict_one() {
            order.push(victim);
            new.adopt(victim);
        }
        let after: HashSet<u64> = (0..BLOCKS).filter(|&b| new.contains(b)).collect();
        prop_assert_eq!(order.len(), before.len());
        prop_assert_eq!(&after, &before);
        prop_assert_eq!(new.len(), before.len());
    }

    #[test]
    fn belady_matches_naive(capacity in 1usize..6, sequence in prop::collection::vec(0..BLOCKS, 0..150)) {
        let mut cache = Belady::new(capacity, &sequence).unwrap();
        let got: Vec<(Access, Vec<u64>)> = sequence
            .iter()
            .map(|&block| {
                let mut evicted = vec![];
                (cache.access(block, &mut evicted), evicted)
            })
            .collect();
        prop_assert_eq!(got, naive_belady(capacity, &sequence));
    }
}

// ------------------------------------------------------ replay sanity checks

const BLOCK_SIZE: u64 = 4;

/// Requests whose blocks come from a small id space, so prefixes repeat; the
/// input length may end inside the last block, or be shorter than the blocks.
fn trace() -> impl Strategy<Value = Vec<TraceRequest>> {
    let request = (prop::collection::vec(0u64..24, 0..8), 0u64..4).prop_map(|(ids, short)| {
        let input_length = (ids.len() as u64 * BLOCK_SIZE).saturating_sub(short);
        TraceRequest {
            timestamp_ms: 0,
            input_length,
            output_length: 1,
            hash_ids: ids,
        }
    });
    prop::collection::vec(request, 0..40)
}

fn hit_tokens(kind: PolicyKind, capacity: usize, trace: &PreparedTrace) -> u64 {
    let mut cache = kind
        .build(capacity, S3FifoParams::default(), trace.accesses())
        .unwrap();
    replay(cache.as_mut(), trace, BLOCK_SIZE, || {}).total_hit_tokens
}

/// The replay rules applied straight to the trace's own ids (each access hinted
/// with its depth): per request the
/// hit tokens, then the evictions and the final size.
fn naive_replay(cache: &mut dyn BlockCache, trace: &[TraceRequest]) -> (Vec<u64>, u64, usize) {
    let mut hits = Vec::new();
    let mut evicted = Vec::new();
    for request in trace {
        let mut k = 0;
        while k < request.hash_ids.len() && cache.contains(request.hash_ids[k]) {
            k += 1;
        }
        hits.push((k as u64 * BLOCK_SIZE).min(request.input_length));
        for (depth, &block) in request.hash_ids.iter().enumerate() {
            cache.hint(AccessHint {
                depth: depth as u32,
                priority: Priority::Normal,
            });
            cache.access(block, &mut evicted);
        }
    }
    (hits, evicted.len() as u64, cache.len())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn replay_totals_bounds_and_capacity(raw in trace(), capacity in 2usize..12) {
        let trace = PreparedTrace::new(&raw);
        let infinite = hit_tokens(PolicyKind::Infinite, capacity, &trace);
        let distinct: HashSet<u64> = raw.iter().flat_map(|r| r.hash_ids.iter().copied()).collect();
        for kind in PolicyKind::ALL {
            let mut cache = kind.build(capacity, S3FifoParams::default(), trace.accesses()).unwrap();
            let mut calls = 0;
            let report = replay(cache.as_mut(), &trace, BLOCK_SIZE, || calls += 1);
            prop_assert_eq!(calls, raw.len());
            prop_assert_eq!(report.total_requests, raw.len());
            let prompt_in_trace: u64 = raw.iter().map(|r| r.input_length).sum();
            prop_assert_eq!(report.total_prompt_tokens, prompt_in_trace);
            let prompt: u64 = report.per_request.iter().map(|r| r.prompt_tokens).sum();
            let hits: u64 = report.per_request.iter().map(|r| r.hit_tokens).sum();
            prop_assert_eq!(prompt, report.total_prompt_tokens);
            prop_assert_eq!(hits, report.total_hit_tokens);
            prop_assert!(report.per_request.iter().all(|r| r.hit_tokens <= r.prompt_tokens));
            prop_assert!(report.total_hit_tokens <= infinite, "{} beats the infinite bound", kind);
            prop_assert_eq!(report.final_cache_blocks, cache.len());
            if kind == PolicyKind::Infinite {
                prop_assert_eq!(report.final_cache_blocks, distinct.len());
            } else {
                prop_assert!(report.final_cache_blocks <= capacity, "{}", kind);
                prop_assert!(report.re_prefilled_evictions <= report.evictions);
                let mean = report.mean_utilisation.unwrap_or(0.0);
                prop_assert!((0.0..=1.0).contains(&mean), "{}: {}", kind, mean);
            }
        }
    }

    #[test]
    fn replay_of_relabelled_ids_matches_a_direct_replay(raw in trace(), capacity in 2usize..12) {
        // Scatter the ids so that dense relabelling really changes them.
        let scattered: Vec<TraceRequest> = raw
            .iter()
            .map(|r| TraceRequest {
                hash_ids: r.hash_ids.iter().map(|id| id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xabcd).collect(),
                ..r.clone()
            })
            .collect();
        let trace = PreparedTrace::new(&scattered);
        // Belady's future is given in each replay's own ids.
        let direct_future: Vec<u64> = scattered.iter().flat_map(|r| r.hash_ids.clone()).collect();
        for kind in PolicyKind::ALL {
            let params = S3FifoParams::default();
            let mut cache = kind.build(capacity, params, trace.accesses()).unwrap();
            let report = replay(cache.as_mut(), &trace, BLOCK_SIZE, || {});
            let mut direct = kind.build(capacity, params, &direct_future).unwrap();
            let (hits, evictions, final_blocks) = naive_replay(direct.as_mut(), &scattered);
            let got: Vec<u64> = report.per_request.iter().map(|r| r.hit_tokens).collect();
            prop_assert_eq!(got, hits, "{}", kind);
            prop_assert_eq!(report.evictions, evictions, "{}", kind);
            prop_assert_eq!(report.final_cache_blocks, final_blocks, "{}", kind);
        }
    }

    #[test]
    fn lru_hits_never_fall_as_capacity_grows(raw in trace(), capacity in 1usize..12) {
        let trace = PreparedTrace::new(&raw);
        prop_assert!(
            hit_tokens(PolicyKind::Lru, capacity, &trace)
                <= hit_tokens(PolicyKind::Lru, capacity + 1, &trace)
        );
    }
}

#[test]
fn infinite_reports_every_block_once_seen() {
    let mut cache = Infinite::default();
    let mut evicted = vec![];
    assert_eq!(cache.access(7, &mut evicted), Access::Miss);
    assert_eq!(cache.access(7, &mut evicted), Access::Hit);
    assert!(cache.remove(7) && !cache.contains(7) && evicted.is_empty());
}
