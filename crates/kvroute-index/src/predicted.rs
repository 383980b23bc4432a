//! Predicted entries: the router's own routing decisions, remembered for a while.
//!
//! When the router sends a request to a worker, that worker will soon hold the
//! request's prefix. Recording it closes the race where sibling requests arrive
//! before the engine's first `Stored` event, and lets workers that publish no
//! events be routed by affinity at all. Entries expire after a TTL (refreshed
//! when the same path is routed again) and the layer is capped in size.
//!
//! Layout (see DESIGN.md, "Predicted layer"): one flat map per *generation*,
//! keyed by a block's chain key combined with the worker, holding the entry's
//! expiry; a small map of depth-0 blocks lists the workers with an entry there.
//! Recording writes into the newest generation only, so refreshing an entry
//! never touches an older one. The cap and the TTL are enforced by dropping the
//! oldest generation whole, which is one deallocation instead of a walk.
//!
//! A worker's live entries along one request always form a prefix of it (an
//! entry never outlives its parent; see the invariants), so a lookup finds a
//! worker's depth by bisection: about log2(blocks) probes per worker predicted
//! to hold block 0, instead of one probe per matched block.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::RwLock;
use std::time::{Duration, Instant};

use crate::event::WorkerKey;
use crate::index::{WorkerHashMap, WorkerMatch};
use crate::slots::{GROUP, Slots};
use crate::table::{SeqMap, chain_key, chain_keys};

/// Limits of the predicted layer.
#[derive(Clone, Debug)]
pub struct PredictedConfig {
    /// How long a routed path counts as cached (default 120 s).
    pub ttl: Duration,
    /// Most (worker, block) entries; over it, the least recently routed sixteenth goes.
    pub max_blocks: usize,
}

impl Default for PredictedConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(120),
            max_blocks: 1 << 20,
        }
    }
}

/// Generations the cap is split into: dropping one frees about a sixteenth of it.
/// Measured against 4 and 8: a smaller generation's map grows (rehashes) in
/// smaller steps, which took the 128k-token decision p99 from ≈ 5 ms to < 1 ms.
const GENERATIONS: usize = 16;

/// Entries recorded in one span of time. Within it, a worker's entry for a block
/// expires no later than its entry for the block's parent (both are written by
/// every record of a path through the block).
struct Generation {
    /// [`pair_key`] of (block chain key, worker serial) → expiry, ms after `opened`.
    entries: Slots,
    /// Chain key of a depth-0 block → serials of the workers with an entry for it here.
    roots: SeqMap<Vec<u64>>,
    /// Worker serial → its entries here.
    per_worker: WorkerHashMap<u64, u64>,
    /// When the generation took its first entry, ms since the epoch: its
    /// entries' expiries are kept as 32-bit offsets from it (49 days; a longer
    /// TTL counts as that).
    opened: u64,
    /// The latest expiry of its entries: after it, the whole generation is dead.
    newest_expiry: u64,
}

impl Generation {
    /// A generation over `entries`: a ready table from [`Spares`] when one is.
    fn new(opened: u64, entries: Slots) -> Self {
        Self {
            entries,
            roots: SeqMap::default(),
            per_worker: WorkerHashMap::default(),
            opened,
            newest_expiry: 0,
        }
    }

    /// The expiry of the worker's entry for block `p` of a path whose chain
    /// keys are `keys`.
    fn expiry(&self, keys: &[u64], p: usize, serial: u64) -> Option<u64> {
        let group_key = pair_key(keys[p - p % GROUP], serial);
        let offset = self.entries.get(group_key, pair_key(keys[p], serial))?;
        Some(self.opened + u64::from(offset))
    }

    /// `expires` (ms since the epoch) as kept in `entries`. Saturating keeps
    /// the order of expiries, so a block still expires no earlier than its parent.
    fn offset(&self, expires: u64) -> u32 {
        expires
            .saturating_sub(self.opened)
            .try_into()
            .unwrap_or(u32::MAX)
    }
}

/// The key of one (block, worker) entry. Chain keys are uniform, so xoring in a
/// per-worker constant keeps them uniform and distinct (collisions: 2^-64 per pair).
fn pair_key(chain_key: u64, serial: u64) -> u64 {
    chain_key ^ serial.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

#[derive(Default)]
struct Inner {
    /// Oldest first; the last one takes new entries.
    generations: VecDeque<Generation>,
    /// Entries over all generations (a path routed again in a newer generation
    /// counts again), until their generation is dropped.
    len: usize,
    /// Workers by key → their serial. A worker removed and seen again gets a new
    /// serial, so entries left behind by the old one can never match.
    serials: WorkerHashMap<WorkerKey, u64>,
    /// Serial → (worker, its entries over all generations).
    workers: WorkerHashMap<u64, (WorkerKey, u64)>,
    next_serial: u64,
}

/// Entry maps sized for a whole generation with their pages already faulted
/// in, prepared by a background thread so that opening a generation costs the
/// request path nothing. A map allocated on the spot would either grow by
/// rehashing (hundreds of µs under the write lock for the request that lands on
/// it) or, allocated at full size, fault its pages in one by one during the
/// next few hundred records (8k tokens, 64 workers: 700 µs p99).
struct Spares {
    ready: std::sync::Arc<std::sync::Mutex<Vec<Slots>>>,
    /// Maps to clear and keep (dropped generations'), or `None` to make a new one.
    to_prepare: std::sync::mpsc::Sender<Option<Slots>>,
}

/// Spare maps kept ready; a dropped generation's map beyond them is freed.
const SPARES: usize = 2;

impl Spares {
    /// `None` if no thread can be started: generations' tables are then made
    /// on the request path.
    fn start(capacity: usize) -> Option<Self> {
        let ready = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (to_prepare, requests) = std::sync::mpsc::channel::<Option<Slots>>();
        let shelf = std::sync::Arc::clone(&ready);
        crate::background::spawn("kvroute-predicted-spares", move || {
            // Ends when the index (the sender) is dropped.
            for request in requests {
                let map = match request {
                    // A generation opened before a spare was ready may be smaller.
                    Some(mut map) if map.capacity() >= capacity => {
                        map.clear();
                        map
                    }
                    // Every page written now, none faulted in on the request path.
                    _ => Slots::with_capacity(capacity),
                };
                let mut shelf = shelf.lock().unwrap();
                if shelf.len() < SPARES {
                    shelf.push(map);
                }
            }
        })?;
        for _ in 0..SPARES {
            let _ = to_prepare.send(None);
        }
        Some(Self { ready, to_prepare })
    }

    /// A prepared map, and a request for the next one; `None` if none is ready.
    fn take(&self) -> Option<Slots> {
        let map = self.ready.lock().unwrap().pop()?;
        let _ = self.to_prepare.send(None);
        Some(map)
    }

    /// Hands a dropped generation's map back to be cleared off the request path.
    fn recycle(&self, map: Slots) {
        let _ = self.to_prepare.send(Some(map));
    }
}

/// A lookup's and a record's buffers, kept per thread: fresh ones were five
/// allocations per routed request (the lookup's listings, chain keys,
/// generations and matches, the record's chain keys).
#[derive(Default)]
struct Scratch {
    /// (worker serial, generation) for each generation listing the worker
    /// under the request's root.
    listed: Vec<(u64, usize)>,
    /// The request's chain keys (a record's, then its pair keys).
    keys: Vec<u64>,
    /// A lookup's matches, handed out once the layer's lock is let go.
    matches: Vec<WorkerMatch>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// Runs `f` with the thread's buffers (fresh ones if they are in use: a
/// lookup's caller may look up again from its callback).
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|kept| match kept.try_borrow_mut() {
        Ok(mut scratch) => f(&mut scratch),
        Err(_) => f(&mut Scratch::default()),
    })
}

/// Routing decisions as predicted cache contents, per worker.
pub struct PredictedIndex {
    ttl_ms: u64,
    max_blocks: usize,
    /// Entries of the newest generation before the next one opens.
    generation_capacity: usize,
    /// Times are kept as ms since this instant.
    epoch: Instant,
    inner: RwLock<Inner>,
    spares: Option<Spares>,
}

impl PredictedIndex {
    pub fn new(config: PredictedConfig) -> Self {
        let generation_capacity = config.max_blocks.div_ceil(GENERATIONS).max(1);
        Self {
            ttl_ms: config.ttl.as_millis().try_into().unwrap_or(u64::MAX / 2),
            max_blocks: config.max_blocks,
            generation_capacity,
            epoch: Instant::now(),
            inner: RwLock::default(),
            spares: Spares::start(generation_capacity),
        }
    }

    fn millis(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_millis() as u64
    }

    /// Records that `worker` was chosen for a request with these local hashes;
    /// entries already there get a fresh TTL. A path longer than the cap keeps
    /// its first `max_blocks` blocks.
    pub fn record(&self, worker: WorkerKey, local_hashes: &[u64], now: Instant) {
        self.record_for(worker, local_hashes, now, Duration::MAX);
    }

    /// [`Self::record`] with a shorter TTL (the layer's is the most). Every
    /// record of one worker must use the same TTL, so that its entries along a
    /// path still expire no later than their parents.
    pub fn record_for(&self, worker: WorkerKey, local_hashes: &[u64], now: Instant, ttl: Duration) {
        with_scratch(|scratch| self.record_into(worker, local_hashes, now, ttl, &mut scratch.keys));
    }

    /// [`Self::record_for`] with a buffer for the path's keys.
    fn record_into(
        &self,
        worker: WorkerKey,
        local_hashes: &[u64],
        now: Instant,
        ttl: Duration,
        keys: &mut Vec<u64>,
    ) {
        let ttl_ms = (ttl.as_millis().min(self.ttl_ms as u128)) as u64;
        chain_keys(
            &local_hashes[..local_hashes.len().min(self.max_blocks)],
            keys,
        );
        let Some(&root) = keys.first() else {
            return;
        };
        let now = self.millis(now);
        let expires = now.saturating_add(ttl_ms);
        let mut dropped = Vec::new();
        let mut inner = self.inner.write().unwrap();
        // Whole generations past their newest expiry go first, so memory follows live entries.
        while inner
            .generations
            .front()
            .is_some_and(|g| g.newest_expiry <= now)
        {
            dropped.push(inner.pop_oldest());
        }
        // A generation is never empty, and its table takes the path that opened it.
        let rotate = inner.generations.back().is_none_or(|g| {
            g.entries.len() + keys.len() > self.generation_capacity
                || !g.entries.has_room(keys.len())
                || now >= g.opened + self.ttl_ms / GENERATIONS as u64
        });
        if rotate {
            let entries = self
                .spares
                .as_ref()
                .and_then(Spares::take)
                .filter(|t| t.has_room(keys.len()))
                .unwrap_or_else(|| Slots::with_capacity(self.generation_capacity.max(keys.len())));
            inner.generations.push_back(Generation::new(now, entries));
        }
        let serial = inner.serial(worker);
        let generation = inner.generations.back_mut().expect("opened above");
        for key in keys.iter_mut() {
            *key = pair_key(*key, serial);
        }
        let (mut added, mut new_root) = (0u64, false);
        let offset = generation.offset(expires);
        generation.entries.set_path(keys, offset, |depth| {
            added += 1;
            new_root |= depth == 0;
        });
        if new_root {
            generation.roots.entry(root).or_default().push(serial);
        }
        generation.newest_expiry = generation.newest_expiry.max(expires);
        *generation.per_worker.entry(serial).or_default() += added;
        inner.len += added as usize;
        inner.workers.get_mut(&serial).expect("interned").1 += added;
        // Over the cap, the least recently routed generation goes whole. The newest
        // one holds at most a sixteenth of the cap or one path, so the cap holds after.
        while inner.len > self.max_blocks && inner.generations.len() > 1 {
            dropped.push(inner.pop_oldest());
        }
        // Recycling or freeing dropped generations need not hold up other threads.
        drop(inner);
        if let Some(spares) = &self.spares {
            for generation in dropped {
                spares.recycle(generation.entries);
            }
        }
    }

    /// Per worker with an unexpired predicted prefix of `local_hashes`: its depth.
    /// `total_blocks` is the worker's count of predicted entries.
    pub fn find_matches(&self, local_hashes: &[u64], now: Instant) -> Vec<WorkerMatch> {
        let mut matches = Vec::new();
        self.for_each_match(local_hashes, now, |m| matches.push(m));
        matches
    }

    /// [`Self::find_matches`] handed to `found` one by one, with no allocation
    /// once the thread's buffers have grown: the router's lookup per request.
    pub fn for_each_match(
        &self,
        local_hashes: &[u64],
        now: Instant,
        found: impl FnMut(WorkerMatch),
    ) {
        with_scratch(|scratch| {
            self.matches_into(local_hashes, now, scratch);
            scratch.matches.drain(..).for_each(found);
        });
    }

    /// Fills `scratch.matches` (empty) for `local_hashes`.
    fn matches_into(&self, local_hashes: &[u64], now: Instant, scratch: &mut Scratch) {
        let Some(&first) = local_hashes.first() else {
            return;
        };
        let now = self.millis(now);
        let inner = self.inner.read().unwrap();
        let root = chain_key(None, first);
        // (serial, generation) for each generation that lists the worker under
        // this root: the only generations that can hold its entries along the
        // request, since a record writes its path from block 0 and lists the
        // worker when it writes block 0 (invariant 1). A probe then looks in one
        // or two tables, not in every generation's.
        let listed = &mut scratch.listed;
        listed.clear();
        listed.extend(
            inner
                .generations
                .iter()
                .enumerate()
                .filter_map(|(i, g)| Some((i, g.roots.get(&root)?)))
                .flat_map(|(i, serials)| serials.iter().map(move |&serial| (serial, i))),
        );
        if listed.is_empty() {
            return;
        }
        // By worker, then newest generation first.
        listed.sort_unstable_by_key(|&(serial, i)| (serial, std::cmp::Reverse(i)));
        let keys = &mut scratch.keys;
        keys.clear();
        for listings in listed.chunk_by(|a, b| a.0 == b.0) {
            let serial = listings[0].0;
            let live = |keys: &[u64], p: usize| live(&inner.generations, listings, keys, p, now);
            if !live(&[root], 0) {
                continue;
            }
            let Some(&(worker, total_blocks)) = inner.workers.get(&serial) else {
                continue;
            };
            if keys.is_empty() {
                chain_keys(local_hashes, keys);
            }
            // The worker's live entries along the request form a prefix, so
            // "holds block p" is true up to its depth and false after.
            let (mut held, mut limit) = (1, keys.len());
            while held < limit {
                let probe = held + (limit - held) / 2;
                if live(keys, probe) {
                    held = probe + 1;
                } else {
                    limit = probe;
                }
            }
            scratch.matches.push(WorkerMatch {
                worker,
                depth: held as u32,
                total_blocks,
            });
        }
    }

    /// Forgets every prediction for `worker`. Its entries stop matching at once
    /// and their memory goes with their generation.
    pub fn remove_worker(&self, worker: WorkerKey) {
        let mut inner = self.inner.write().unwrap();
        let Some(serial) = inner.serials.remove(&worker) else {
            return;
        };
        inner.workers.remove(&serial);
        for generation in &mut inner.generations {
            generation.roots.retain(|_, serials| {
                serials.retain(|&s| s != serial);
                !serials.is_empty()
            });
        }
    }

    /// Entries held, expired ones and removed workers' included until their
    /// generation is dropped.
    pub fn len(&self) -> usize {
        self.inner.read().unwrap().len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Inner {
    fn serial(&mut self, worker: WorkerKey) -> u64 {
        if let Some(&serial) = self.serials.get(&worker) {
            return serial;
        }
        self.next_serial += 1;
        let serial = self.next_serial;
        self.serials.insert(worker, serial);
        self.workers.insert(serial, (worker, 0));
        serial
    }

    fn pop_oldest(&mut self) -> Generation {
        let generation = self.generations.pop_front().expect("a generation to drop");
        self.len -= generation.entries.len();
        for (serial, n) in &generation.per_worker {
            if let Some((_, total)) = self.workers.get_mut(serial) {
                *total -= n;
            }
        }
        generation
    }
}

/// Whether any of the generations in `listings` ((worker serial, generation),
/// one worker's) has an unexpired entry of the worker for block `p` of the path
/// whose chain keys are `keys`.
fn live(
    generations: &VecDeque<Generation>,
    listings: &[(u64, usize)],
    keys: &[u64],
    p: usize,
    now: u64,
) -> bool {
    listings.iter().any(|&(serial, i)| {
        generations[i]
            .expiry(keys, p, serial)
            .is_some_and(|e| e > now)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: WorkerKey = WorkerKey {
        worker_id: 1,
        dp_rank: 0,
    };
    const B: WorkerKey = WorkerKey {
        worker_id: 2,
        dp_rank: 0,
    };

    fn depth_of(matches: &[WorkerMatch], worker: WorkerKey) -> u32 {
        matches
            .iter()
            .find(|m| m.worker == worker)
            .map_or(0, |m| m.depth)
    }

    #[test]
    fn routed_prefixes_match_per_worker() {
        let p = PredictedIndex::new(PredictedConfig::default());
        let now = Instant::now();
        p.record(A, &[1, 2, 3], now);
        p.record(B, &[1, 2, 9, 9], now);
        let m = p.find_matches(&[1, 2, 3, 4], now);
        assert_eq!(depth_of(&m, A), 3);
        assert_eq!(depth_of(&m, B), 2);
        assert_eq!(m.iter().find(|m| m.worker == B).unwrap().total_blocks, 4);
        assert!(p.find_matches(&[7], now).is_empty());
        p.remove_worker(A);
        assert_eq!(depth_of(&p.find_matches(&[1, 2, 3], now), A), 0);
        // Seen again after removal, A starts from nothing.
        p.record(A, &[5], now);
        let m = p.find_matches(&[1, 2, 3], now);
        assert_eq!((depth_of(&m, A), depth_of(&m, B)), (0, 2));
    }

    #[test]
    fn entries_expire_unless_routed_again() {
        let ttl = Duration::from_secs(120);
        let p = PredictedIndex::new(PredictedConfig {
            ttl,
            ..PredictedConfig::default()
        });
        let t0 = Instant::now();
        p.record(A, &[1, 2], t0);
        p.record(B, &[1, 2], t0);
        // A's path is routed again halfway: its TTL restarts.
        p.record(A, &[1, 2], t0 + ttl / 2);
        let later = t0 + ttl + Duration::from_secs(1);
        let m = p.find_matches(&[1, 2], later);
        assert_eq!(depth_of(&m, A), 2);
        assert_eq!(depth_of(&m, B), 0);
        // Recording after every entry of a generation expired drops it: only the
        // refreshed generation (A's two entries) and the new entry remain.
        p.record(A, &[5], later);
        assert_eq!(p.len(), 3);
    }

    #[test]
    fn over_the_cap_the_least_recently_routed_generation_goes() {
        let p = PredictedIndex::new(PredictedConfig {
            max_blocks: 10,
            ..PredictedConfig::default()
        });
        let now = Instant::now();
        p.record(A, &[1, 2, 3, 4, 5, 6], now);
        p.record(B, &[1, 2, 3, 4, 5], now);
        // 11 entries > 10: A's generation (6) goes whole, B's path stays whole.
        assert_eq!(p.len(), 5);
        let m = p.find_matches(&[1, 2, 3, 4, 5, 6], now);
        assert_eq!((depth_of(&m, A), depth_of(&m, B)), (0, 5));
        // A path longer than the cap keeps its first `max_blocks` blocks.
        let long: Vec<u64> = (1..=30).collect();
        p.record(A, &long, now);
        assert_eq!(p.len(), 10);
        assert_eq!(depth_of(&p.find_matches(&long, now), A), 10);
    }
}
