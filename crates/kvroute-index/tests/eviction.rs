//! The `max_blocks` limit: least-recently-used leaves go first, pinned paths stay.

mod model;

use kvroute_index::{ApplyOutcome, EventKind, IndexConfig, KvEvent, KvIndex, Matches, WorkerKey};
use model::stored;

fn depth(index: &KvIndex, path: &[u64]) -> u32 {
    index
        .find_matches(path)
        .iter()
        .map(|m| m.depth)
        .max()
        .unwrap_or(0)
}

/// Applies `kinds` as the worker's next events.
fn feed(index: &KvIndex, worker: WorkerKey, kinds: Vec<EventKind>) {
    for kind in kinds {
        let event_id = index.last_event_id(worker).map_or(1, |id| id + 1);
        index.apply(worker, &KvEvent { event_id, kind });
    }
}

fn limited(max_blocks: usize) -> KvIndex {
    KvIndex::new(IndexConfig {
        max_blocks: Some(max_blocks),
    })
}

const W: WorkerKey = WorkerKey {
    worker_id: 1,
    dp_rank: 0,
};

#[test]
fn over_the_limit_the_leaves_go_and_the_prefix_stays() {
    let index = limited(4);
    feed(
        &index,
        W,
        vec![stored(
            None,
            &[(1, 11), (2, 12), (3, 13), (4, 14), (5, 15), (6, 16)],
        )],
    );
    assert_eq!(index.stats().memberships, 4);
    assert_eq!(depth(&index, &[11, 12, 13, 14, 15, 16]), 4);
    assert_eq!(index.evicted_blocks(), 2);
}

#[test]
fn the_least_recently_used_chain_goes_first() {
    let index = limited(6);
    feed(&index, W, vec![stored(None, &[(1, 11), (2, 12), (3, 13)])]);
    feed(&index, W, vec![stored(None, &[(4, 21), (5, 22), (6, 23)])]);
    // Routing a request over the first chain makes it the most recent.
    assert_eq!(depth(&index, &[11, 12, 13]), 3);
    feed(&index, W, vec![stored(None, &[(7, 31), (8, 32), (9, 33)])]);
    assert_eq!(depth(&index, &[11, 12, 13]), 3);
    assert_eq!(depth(&index, &[21, 22, 23]), 0);
    assert_eq!(depth(&index, &[31, 32, 33]), 3);
}

/// A routing thread keeps one `Matches` (and the walked path in it) across
/// lookups: each lookup touches its own path, never what an earlier one left.
#[test]
fn a_kept_matches_buffer_touches_only_the_latest_lookups_path() {
    let index = limited(6);
    feed(&index, W, vec![stored(None, &[(1, 11), (2, 12), (3, 13)])]);
    feed(&index, W, vec![stored(None, &[(4, 21), (5, 22), (6, 23)])]);
    let mut matches = Matches::default();
    index.find_matches_into(&[11, 12, 13], &mut matches);
    index.find_matches_into(&[21, 22, 23], &mut matches);
    // The first chain is now the least recent: it goes for the third.
    feed(&index, W, vec![stored(None, &[(7, 31), (8, 32), (9, 33)])]);
    assert_eq!(depth(&index, &[11, 12, 13]), 0);
    assert_eq!(depth(&index, &[21, 22, 23]), 3);
    assert_eq!(depth(&index, &[31, 32, 33]), 3);
}

#[test]
fn a_path_being_routed_is_never_evicted() {
    let index = limited(3);
    feed(&index, W, vec![stored(None, &[(1, 11), (2, 12), (3, 13)])]);
    let pinned = index.pin_path(&[11, 12, 13]);
    feed(&index, W, vec![stored(None, &[(4, 21), (5, 22), (6, 23)])]);
    assert_eq!(depth(&index, &[11, 12, 13]), 3);
    // Only the new chain could go, so the index stays over its limit meanwhile.
    assert_eq!(depth(&index, &[21, 22, 23]), 0);
    drop(pinned);
    feed(&index, W, vec![stored(None, &[(7, 31)])]);
    assert!(index.stats().memberships <= 3);
}

/// A pin holds the blocks present when it was taken: dropping it releases
/// those only, never another request's pin on blocks stored since.
#[test]
fn a_pin_taken_before_its_blocks_came_never_releases_a_later_pin() {
    let index = limited(3);
    let early = index.pin_path(&[11, 12, 13]);
    feed(&index, W, vec![stored(None, &[(1, 11), (2, 12), (3, 13)])]);
    let routed = index.pin_path(&[11, 12, 13]);
    drop(early);
    feed(&index, W, vec![stored(None, &[(4, 21), (5, 22), (6, 23)])]);
    // `routed` still holds the first chain: only the new one could go.
    assert_eq!(depth(&index, &[11, 12, 13]), 3);
    assert_eq!(depth(&index, &[21, 22, 23]), 0);
    drop(routed);
}

#[test]
fn evicted_blocks_drop_for_every_worker_and_later_events_still_apply() {
    let index = limited(3);
    let other = WorkerKey::new(2, 0);
    feed(&index, W, vec![stored(None, &[(1, 11), (2, 12)])]);
    feed(&index, other, vec![stored(None, &[(101, 11), (102, 12)])]);
    // Block 12 is held by both workers, each over its share of 1: evicting
    // it frees two memberships.
    assert_eq!(index.stats().memberships, 2);
    assert_eq!(index.worker_blocks(other), 1);
    assert_eq!(depth(&index, &[11, 12]), 1);
    // The engine still reports removing what the index evicted: applied, and
    // counted as unknown once the worker's engine-hash map has been swept.
    let outcome = index.apply(
        other,
        &KvEvent {
            event_id: 2,
            kind: EventKind::Removed {
                block_hashes: vec![102, 101],
            },
        },
    );
    assert!(matches!(
        outcome,
        ApplyOutcome::Applied {
            unknown_removals: 0..=1,
            ..
        }
    ));
    assert_eq!(index.worker_blocks(other), 0);
    assert_eq!(index.stats().memberships, 1);
}

#[test]
fn memberships_stay_under_the_limit_through_churn_and_memory_is_reclaimed() {
    let index = limited(64);
    for round in 0..1000u64 {
        let base = round * 10;
        let blocks: Vec<(u64, u64)> = (0..8).map(|i| (base + i + 1, base + i + 1)).collect();
        feed(&index, W, vec![stored(None, &blocks)]);
        assert!(index.stats().memberships <= 64);
    }
    let full = index.heap_bytes();
    let unbounded = KvIndex::new(IndexConfig::default());
    for round in 0..1000u64 {
        let base = round * 10;
        let blocks: Vec<(u64, u64)> = (0..8).map(|i| (base + i + 1, base + i + 1)).collect();
        feed(&unbounded, W, vec![stored(None, &blocks)]);
    }
    assert!(
        full * 4 < unbounded.heap_bytes(),
        "{full} vs {}",
        unbounded.heap_bytes()
    );
}

/// How deep `worker` matches `path` in `index`.
fn depth_of(index: &KvIndex, path: &[u64], worker: WorkerKey) -> u32 {
    index
        .find_matches(path)
        .iter()
        .find(|m| m.worker == worker)
        .map_or(0, |m| m.depth)
}

/// A chain of `len` blocks whose engine and token hashes start at `first`.
fn chain(first: u64, len: u64) -> EventKind {
    let blocks: Vec<(u64, u64)> = (first..first + len).map(|h| (h, h)).collect();
    stored(None, &blocks)
}

/// One worker flooding a bounded index (issue #36, attack 10): its stores
/// evict its own oldest blocks, never those of a worker within its share
/// (the limit over the live workers), and every count and digest stays
/// exact. On the old, global order the flood took the honest worker's
/// chain down to nothing and marked its digest trimmed.
#[test]
fn a_flooding_worker_never_evicts_a_worker_within_its_share() {
    let index = limited(256);
    let honest = WorkerKey::new(7, 0);
    let flooder = WorkerKey::new(8, 0);
    // The same events in an unbounded index: the honest worker's digest
    // there is what it must stay.
    let reference = KvIndex::new(IndexConfig::default());
    let honest_path: Vec<u64> = (1..=64).collect();
    feed(&index, honest, vec![chain(1, 64)]);
    feed(&reference, honest, vec![chain(1, 64)]);
    for round in 0..125u64 {
        let first = 1_000_000 + round * 16;
        feed(&index, flooder, vec![chain(first, 16)]);
        // Counted, not looked up: a lookup would touch the honest chain
        // and keep it recent.
        assert_eq!(index.worker_blocks(honest), 64, "round {round}");
        let stats = index.stats();
        assert!(stats.memberships <= 256, "{}", stats.memberships);
        assert_eq!(
            stats.memberships,
            index.worker_blocks(honest) + index.worker_blocks(flooder)
        );
    }
    assert_eq!(depth_of(&index, &honest_path, honest), 64);
    // The flood's newest chain is whole: its oldest went first.
    let newest: Vec<u64> = (1_000_000 + 124 * 16..1_000_000 + 125 * 16).collect();
    assert_eq!(depth_of(&index, &newest, flooder), 16);
    assert_eq!(index.worker_blocks(flooder), 256 - 64);
    assert_eq!(index.evicted_blocks(), 2000 - (256 - 64));
    let oldest: Vec<u64> = (1_000_000..1_000_016).collect();
    assert_eq!(depth_of(&index, &oldest, flooder), 0);
    assert_eq!(index.digest(honest), reference.digest(honest));
}

/// A worker over its share loses its own least recently used blocks first,
/// even when another worker's blocks are older; once within its share it
/// keeps them, and the index evicts from whoever is over.
#[test]
fn eviction_takes_the_least_recently_used_of_the_workers_over_their_share() {
    let index = limited(8);
    let a = WorkerKey::new(1, 0);
    let b = WorkerKey::new(2, 0);
    // a: 3 blocks, the oldest in the index, within its share of 4.
    feed(&index, a, vec![chain(1, 3)]);
    feed(&index, b, vec![chain(100, 2)]);
    feed(&index, b, vec![chain(200, 2)]);
    // b holds 6 of the 9: its oldest leaf goes, not a's older one.
    feed(&index, b, vec![chain(300, 2)]);
    assert_eq!(index.stats().memberships, 8);
    assert_eq!(index.worker_blocks(a), 3);
    // (No lookup until the end: a lookup touches its path.)
    feed(&index, b, vec![chain(400, 1)]);
    assert_eq!(depth_of(&index, &[1, 2, 3], a), 3);
    assert_eq!(depth_of(&index, &[100, 101], b), 0);
    assert_eq!(depth_of(&index, &[200, 201], b), 2);
    assert_eq!(index.worker_blocks(b), 5);
}
