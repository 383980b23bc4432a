//! The index against its reference model over random interleavings of events,
//! worker removals, resyncs and lookups.

mod model;

use std::collections::BTreeSet;

use kvroute_index::{
    EventKind, IndexConfig, KvEvent, KvIndex, Matches, StoredBlock, WorkerKey, WorkerMatch,
};
use model::Model;
use proptest::prelude::*;

/// Few engine hashes and token hashes, so that chains share prefixes, parents are
/// often unknown, removals hit middle blocks and duplicates occur.
const ENGINE_HASHES: u64 = 10;
/// Token hashes are 1..=TOKENS: small numbers, so chains collide on purpose.
const TOKENS: u64 = 3;

#[derive(Clone, Debug)]
enum Op {
    Event {
        worker: u8,
        /// 0: a duplicate of the last id, 1: the next id, 2: a gap.
        id_step: u8,
        kind: EventKind,
    },
    RemoveWorker(u8),
    /// Resync `to` from a dump of `from`.
    Resync {
        from: u8,
        to: u8,
    },
    Lookup(Vec<u64>),
}

fn worker(w: u8) -> WorkerKey {
    WorkerKey::new(u64::from(w % 2), u32::from(w / 2))
}

fn kind_strategy() -> impl Strategy<Value = EventKind> {
    prop_oneof![
        5 => (
            prop::option::weighted(0.6, 0..ENGINE_HASHES),
            prop::collection::vec((0..ENGINE_HASHES, 1..=TOKENS), 1..5),
        )
            .prop_map(|(parent_hash, blocks)| EventKind::Stored {
                parent_hash,
                blocks: blocks
                    .into_iter()
                    .map(|(block_hash, tokens_hash)| StoredBlock {
                        block_hash,
                        tokens_hash,
                    })
                    .collect(),
            }),
        3 => prop::collection::vec(0..ENGINE_HASHES + 2, 1..4)
            .prop_map(|block_hashes| EventKind::Removed { block_hashes }),
        1 => Just(EventKind::Cleared),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (0..4u8, prop_oneof![1 => Just(0u8), 8 => Just(1u8), 1 => Just(2u8)], kind_strategy())
            .prop_map(|(worker, id_step, kind)| Op::Event { worker, id_step, kind }),
        1 => (0..4u8).prop_map(Op::RemoveWorker),
        1 => (0..4u8, 0..4u8).prop_map(|(from, to)| Op::Resync { from, to }),
        4 => prop::collection::vec(1..=TOKENS, 1..6).prop_map(Op::Lookup),
    ]
}

fn sorted(mut matches: Vec<WorkerMatch>) -> Vec<WorkerMatch> {
    matches.sort_by_key(|m| m.worker);
    matches
}

/// Every lookup path of up to three blocks over the token alphabet.
fn probe_paths() -> Vec<Vec<u64>> {
    let mut paths: Vec<Vec<u64>> = (1..=TOKENS).map(|t| vec![t]).collect();
    for _ in 0..2 {
        let longer: Vec<Vec<u64>> = paths
            .iter()
            .filter(|p| p.len() == paths.last().unwrap().len())
            .flat_map(|p| {
                (1..=TOKENS).map(move |t| {
                    let mut q = p.clone();
                    q.push(t);
                    q
                })
            })
            .collect();
        paths.extend(longer);
    }
    paths
}

/// A lookup's pairs against the model's matches: one per matching worker,
/// shallowest first, so that the last is a deepest match.
fn check_pairs(index: &KvIndex, path: &[u64], expected: &[WorkerMatch]) {
    let mut matches = Matches::default();
    index.find_matches_into(path, &mut matches);
    let depths: Vec<u32> = matches.pairs().iter().map(|m| m.depth).collect();
    assert_eq!(depths.len(), expected.len(), "path {path:?}");
    assert!(depths.is_sorted(), "path {path:?}: depths {depths:?}");
    let deepest = matches
        .deepest()
        .map(|m| index.resolve(&matches, m).unwrap());
    let model_deepest = expected.iter().map(|m| m.depth).max();
    assert_eq!(deepest.map(|m| m.depth), model_deepest, "path {path:?}");
    if let Some(m) = deepest {
        assert!(
            expected.contains(&m),
            "path {path:?}: {m:?} not in {expected:?}"
        );
    }
}

fn check_all(index: &KvIndex, model: &Model, paths: &[Vec<u64>]) -> Result<(), TestCaseError> {
    for path in paths {
        let expected = model.find_matches(path);
        prop_assert_eq!(
            sorted(index.find_matches(path)),
            expected.clone(),
            "path {:?}",
            path
        );
        check_pairs(index, path, &expected);
    }
    let stats = index.stats();
    prop_assert_eq!(stats.memberships, model.memberships());
    prop_assert_eq!(stats.blocks, model.distinct_blocks());
    for w in 0..4 {
        let key = worker(w);
        prop_assert_eq!(index.worker_blocks(key), model.held(key));
        prop_assert_eq!(index.last_event_id(key), model.last_event_id(key));
        let dumped: BTreeSet<u64> = index
            .dump(key)
            .map(|d| {
                d.events
                    .iter()
                    .flat_map(|e| match e {
                        EventKind::Stored { blocks, .. } => {
                            blocks.iter().map(|b| b.block_hash).collect()
                        }
                        _ => Vec::new(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        prop_assert_eq!(dumped, model.dumped_engine_hashes(key));
    }
    Ok(())
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    run_after_fillers(ops, 0, false)
}

/// [`run`] with each run of one worker's consecutive events applied in one
/// [`KvIndex::with_worker`], as its stream's message would bring them: every
/// outcome and the state after the run are the model's, event by event.
fn run_batched(ops: Vec<Op>) -> Result<(), TestCaseError> {
    run_after_fillers(ops, 0, true)
}

/// [`run`] after `fillers` workers that hold nothing took the first interned
/// indices, so the four workers under test get the indices after them;
/// `batched` as in [`run_batched`].
fn run_after_fillers(ops: Vec<Op>, fillers: u64, batched: bool) -> Result<(), TestCaseError> {
    let index = KvIndex::new(IndexConfig::default());
    let mut model = Model::default();
    for f in 0..fillers {
        let key = WorkerKey::new(1_000 + f, 0);
        let event = KvEvent {
            event_id: 1,
            kind: EventKind::Removed {
                block_hashes: vec![0],
            },
        };
        prop_assert_eq!(index.apply(key, &event), model.apply(key, &event));
    }
    let paths = probe_paths();
    let mut ops = ops.into_iter().peekable();
    while let Some(op) = ops.next() {
        match op {
            Op::Event {
                worker: w,
                id_step,
                kind,
            } => {
                let key = worker(w);
                let (mut events, mut expected) = (Vec::new(), Vec::new());
                let mut next = Some((id_step, kind));
                while let Some((id_step, kind)) = next.take() {
                    let event_id = match (model.last_event_id(key), id_step) {
                        (None, _) => 5,
                        (Some(l), 0) => l,
                        (Some(l), step) => l + u64::from(step),
                    };
                    let event = KvEvent { event_id, kind };
                    expected.push(model.apply(key, &event));
                    events.push(event);
                    if batched
                        && let Some(Op::Event { worker: n, .. }) = ops.peek()
                        && *n == w
                        && let Some(Op::Event { id_step, kind, .. }) = ops.next()
                    {
                        next = Some((id_step, kind));
                    }
                }
                let outcomes: Vec<_> = if batched {
                    index.with_worker(key, |w| events.iter().map(|e| w.apply(e)).collect())
                } else {
                    events.iter().map(|e| index.apply(key, e)).collect()
                };
                prop_assert_eq!(outcomes, expected);
            }
            Op::RemoveWorker(w) => {
                index.remove_worker(worker(w));
                model.remove_worker(worker(w));
            }
            Op::Resync { from, to } => {
                if let Some(dump) = index.dump(worker(from)) {
                    let last = dump.last_event_id.unwrap_or(0);
                    index.replace_worker(worker(to), last, &dump.events);
                    model.replace_worker(worker(to), last, &dump.events);
                }
            }
            Op::Lookup(path) => {
                prop_assert_eq!(sorted(index.find_matches(&path)), model.find_matches(&path));
            }
        }
        check_all(&index, &model, &paths)?;
    }
    Ok(())
}

/// Rewrites an event so that engine hashes name content, as real engines' do:
/// a stored block's hash is derived from its parent's and its tokens, and the
/// small numbers picked for parents and removals select among `known` hashes.
/// One worker then never has two names for one block.
fn content_named(kind: EventKind, known: &[u64]) -> EventKind {
    let pick = |h: u64| known.get(h as usize).copied().unwrap_or(u64::MAX - h);
    match kind {
        EventKind::Stored {
            parent_hash,
            blocks,
        } => {
            let parent_hash = parent_hash.map(pick);
            let mut parent = parent_hash.unwrap_or(0);
            let blocks = blocks
                .into_iter()
                .map(|b| {
                    parent = xxhash_rust::xxh3::xxh3_64_with_seed(
                        &[parent.to_le_bytes(), b.tokens_hash.to_le_bytes()].concat(),
                        7,
                    );
                    StoredBlock {
                        block_hash: parent,
                        tokens_hash: b.tokens_hash,
                    }
                })
                .collect();
            EventKind::Stored {
                parent_hash,
                blocks,
            }
        }
        EventKind::Removed { block_hashes } => EventKind::Removed {
            block_hashes: block_hashes.into_iter().map(pick).collect(),
        },
        EventKind::Cleared => EventKind::Cleared,
    }
}

/// With `max_blocks`, the index holds a subset of the model: never more than the
/// limit, never a deeper match than the model's, and no panic on any interleaving.
fn run_limited(ops: Vec<Op>, max_blocks: usize) -> Result<(), TestCaseError> {
    let index = KvIndex::new(IndexConfig {
        max_blocks: Some(max_blocks),
    });
    let mut model = Model::default();
    let paths = probe_paths();
    for op in ops {
        match op {
            Op::Event {
                worker: w,
                id_step,
                kind,
            } => {
                let key = worker(w);
                let event_id = match (model.last_event_id(key), id_step) {
                    (None, _) => 5,
                    (Some(l), 0) => l,
                    (Some(l), step) => l + u64::from(step),
                };
                let known = model.engine_hashes(key);
                let event = KvEvent {
                    event_id,
                    kind: content_named(kind, &known),
                };
                index.apply(key, &event);
                model.apply(key, &event);
            }
            Op::RemoveWorker(w) => {
                index.remove_worker(worker(w));
                model.remove_worker(worker(w));
            }
            Op::Resync { from, to } => {
                if let Some(dump) = index.dump(worker(from)) {
                    let last = dump.last_event_id.unwrap_or(0);
                    index.replace_worker(worker(to), last, &dump.events);
                    // The dump may lack evicted blocks: resync the model from it too.
                    model.replace_worker(worker(to), last, &dump.events);
                }
            }
            Op::Lookup(path) => {
                let _pinned = index.pin_path(&path);
                index.find_matches(&path);
            }
        }
        prop_assert!(index.stats().memberships <= max_blocks as u64);
        for path in &paths {
            let expected = model.find_matches(path);
            for m in index.find_matches(path) {
                let bound = expected
                    .iter()
                    .find(|e| e.worker == m.worker)
                    .map_or(0, |e| e.depth);
                prop_assert!(
                    m.depth <= bound,
                    "{:?} deeper than the model's {}",
                    m,
                    bound
                );
            }
        }
    }
    Ok(())
}

/// An op of [`run_fair`]: an event of the honest worker or of the flooding
/// one, or a lookup (which touches its path).
#[derive(Clone, Debug)]
enum FairOp {
    Honest(EventKind),
    Flood(EventKind),
    Lookup(Vec<u64>),
}

/// The honest worker stores chains of one or two blocks from the root over
/// two of the tokens, content-named, and never removes: it holds at most six
/// blocks, with every prefix of each, so it is within its share of any limit
/// of twelve or more between two workers.
fn fair_op() -> impl Strategy<Value = FairOp> {
    let honest = prop::collection::vec(1..=2u64, 1..=2).prop_map(|tokens| {
        let blocks = tokens
            .into_iter()
            .map(|tokens_hash| StoredBlock {
                block_hash: 0,
                tokens_hash,
            })
            .collect();
        let kind = EventKind::Stored {
            parent_hash: None,
            blocks,
        };
        FairOp::Honest(content_named(kind, &[]))
    });
    prop_oneof![
        1 => honest,
        6 => kind_strategy().prop_map(FairOp::Flood),
        2 => prop::collection::vec(1..=TOKENS, 1..4).prop_map(FairOp::Lookup),
    ]
}

/// A bounded index shared by a worker within its share and one storing,
/// removing and clearing at will over the same tokens: the honest worker
/// matches exactly as in the model (nothing of it is ever evicted), its
/// count and digest are exact (the digest as an unbounded index's, not
/// trimmed), the flooder never matches deeper than in the model, and the
/// index holds the limit.
fn run_fair(ops: Vec<FairOp>, max_blocks: usize) -> Result<(), TestCaseError> {
    let index = KvIndex::new(IndexConfig {
        max_blocks: Some(max_blocks),
    });
    let unbounded = KvIndex::new(IndexConfig::default());
    let mut model = Model::default();
    let (honest, flooder) = (worker(0), worker(1));
    let paths = probe_paths();
    let next_id = |model: &Model, key| model.last_event_id(key).map_or(1, |l| l + 1);
    for op in ops {
        match op {
            FairOp::Honest(kind) => {
                let event = KvEvent {
                    event_id: next_id(&model, honest),
                    kind,
                };
                index.apply(honest, &event);
                unbounded.apply(honest, &event);
                model.apply(honest, &event);
            }
            FairOp::Flood(kind) => {
                let known = model.engine_hashes(flooder);
                let event = KvEvent {
                    event_id: next_id(&model, flooder),
                    kind: content_named(kind, &known),
                };
                index.apply(flooder, &event);
                model.apply(flooder, &event);
            }
            FairOp::Lookup(path) => {
                let _pinned = index.pin_path(&path);
                index.find_matches(&path);
            }
        }
        let stats = index.stats();
        prop_assert!(stats.memberships <= max_blocks as u64);
        prop_assert_eq!(
            stats.memberships,
            index.worker_blocks(honest) + index.worker_blocks(flooder)
        );
        prop_assert_eq!(index.worker_blocks(honest), model.held(honest));
        prop_assert_eq!(index.digest(honest), unbounded.digest(honest));
        for path in &paths {
            let expected = model.find_matches(path);
            let depth = |matches: &[WorkerMatch], key| {
                matches
                    .iter()
                    .find(|m| m.worker == key)
                    .map_or(0, |m| m.depth)
            };
            let found = index.find_matches(path);
            prop_assert_eq!(
                depth(&found, honest),
                depth(&expected, honest),
                "path {:?}",
                path
            );
            prop_assert!(depth(&found, flooder) <= depth(&expected, flooder));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn a_flood_never_evicts_a_worker_within_its_share(
        ops in prop::collection::vec(fair_op(), 1..60),
        max_blocks in 12..24usize,
    ) {
        run_fair(ops, max_blocks)?;
    }

    #[test]
    fn index_matches_model(ops in prop::collection::vec(op_strategy(), 1..40)) {
        run(ops)?;
    }

    /// The workers under test get indices 61..=64, so blocks' holder sets take
    /// every form: the inline bitset (all below 63), the inline list (up to
    /// three, one at 63 or above) and the spilled list (all four), and move
    /// between them as workers come and go.
    #[test]
    fn index_matches_model_across_holder_forms(ops in prop::collection::vec(op_strategy(), 1..40)) {
        run_after_fillers(ops, 61, false)?;
    }

    #[test]
    fn batches_match_the_model(ops in prop::collection::vec(op_strategy(), 1..40)) {
        run_batched(ops)?;
    }

    #[test]
    fn a_limited_index_holds_a_subset_of_the_model(
        ops in prop::collection::vec(op_strategy(), 1..40),
        max_blocks in 1..8usize,
    ) {
        run_limited(ops, max_blocks)?;
    }
}

/// More than 64 workers: indices past the blocks' inline bitset, and reuse of the
/// indices of removed workers.
#[test]
fn wide_fleets_match_the_model() {
    let index = KvIndex::new(IndexConfig::default());
    let mut model = Model::default();
    let apply = |index: &KvIndex, model: &mut Model, w: u64, event_id: u64, kind: EventKind| {
        let key = WorkerKey::new(w, 0);
        let event = KvEvent { event_id, kind };
        assert_eq!(index.apply(key, &event), model.apply(key, &event));
    };
    for w in 0..150u64 {
        let blocks: Vec<StoredBlock> = (0..1 + w % 6)
            .map(|d| StoredBlock {
                block_hash: 100 + d,
                tokens_hash: 1 + d,
            })
            .collect();
        let kind = EventKind::Stored {
            parent_hash: None,
            blocks,
        };
        apply(&index, &mut model, w, 1, kind);
    }
    for w in (0..150u64).step_by(7) {
        let kind = EventKind::Removed {
            block_hashes: vec![101],
        };
        apply(&index, &mut model, w, 2, kind);
    }
    for w in (3..150u64).step_by(11) {
        index.remove_worker(WorkerKey::new(w, 0));
        model.remove_worker(WorkerKey::new(w, 0));
    }
    for w in 1000..1010u64 {
        let kind = EventKind::Stored {
            parent_hash: None,
            blocks: vec![StoredBlock {
                block_hash: 7,
                tokens_hash: 1,
            }],
        };
        apply(&index, &mut model, w, 1, kind);
    }
    for len in 1..=7 {
        let path: Vec<u64> = (1..=len).collect();
        let expected = model.find_matches(&path);
        assert_eq!(sorted(index.find_matches(&path)), expected);
        check_pairs(&index, &path, &expected);
    }
    assert_eq!(index.stats().memberships, model.memberships());
    let workers = (0..1010).filter(|&w| model.last_event_id(WorkerKey::new(w, 0)).is_some());
    assert_eq!(index.stats().workers, workers.count() as u64);
}

/// A chain of `len` blocks of `chain`, engine hashes 100, 101, ... in order.
fn chain_prefix(chain: &[u64], len: usize) -> EventKind {
    let blocks: Vec<(u64, u64)> = (0..len).map(|d| (100 + d as u64, chain[d])).collect();
    model::stored(None, &blocks)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Paths longer than the blocks a walk chains and prefetches ahead of
    /// the one it probes (16), in the bitset and in the lists of holders
    /// (after 40 fillers): each worker holds a prefix of one long chain, less
    /// a block removed now and then, and every cut of the chain, and the
    /// chain with one block changed, match as the model says.
    #[test]
    fn long_paths_match_the_model(
        chain in prop::collection::vec(1..=TOKENS, 1..70),
        held in prop::collection::vec((0..70usize, prop::option::of(0..70u64)), 1..5),
        changed in 0..70usize,
        fillers in prop_oneof![Just(0u64), Just(40)],
    ) {
        let index = KvIndex::new(IndexConfig::default());
        let mut model = Model::default();
        let mut apply = |key: WorkerKey, event: KvEvent| {
            prop_assert_eq!(index.apply(key, &event), model.apply(key, &event));
            Ok(())
        };
        for f in 0..fillers {
            let kind = EventKind::Removed { block_hashes: vec![0] };
            apply(WorkerKey::new(1_000 + f, 0), KvEvent { event_id: 1, kind })?;
        }
        for (w, &(len, removed)) in held.iter().enumerate() {
            let key = WorkerKey::new(w as u64, 0);
            let kind = chain_prefix(&chain, len.min(chain.len()));
            apply(key, KvEvent { event_id: 1, kind })?;
            if let Some(r) = removed {
                let kind = EventKind::Removed { block_hashes: vec![100 + r] };
                apply(key, KvEvent { event_id: 2, kind })?;
            }
        }
        let mut other = chain.clone();
        if let Some(t) = other.get_mut(changed) {
            *t = *t % TOKENS + 1;
        }
        for path in (1..=chain.len()).map(|cut| &chain[..cut]).chain([&other[..]]) {
            let expected = model.find_matches(path);
            prop_assert_eq!(sorted(index.find_matches(path)), expected.clone(), "path {:?}", path);
            check_pairs(&index, path, &expected);
        }
    }
}
