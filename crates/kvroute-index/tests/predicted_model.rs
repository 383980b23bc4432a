//! The predicted layer against a reference model: every routed prefix of every
//! worker as its own map entry with an expiry, matched by walking the request.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvroute_index::{PredictedConfig, PredictedIndex, WorkerKey};
use proptest::prelude::*;

const TTL_MS: u64 = 1000;
/// Local hashes are 1..=TOKENS, so paths share prefixes and diverge often.
const TOKENS: u64 = 3;

#[derive(Clone, Debug)]
enum Op {
    Record {
        worker: u8,
        path: Vec<u64>,
    },
    RemoveWorker(u8),
    /// Time moves on by this many ms.
    Wait(u64),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        // Past one group of entries placed together (slots.rs, eight to a
        // group), up to three.
        6 => (0..4u8, prop::collection::vec(1..=TOKENS, 1..25))
            .prop_map(|(worker, path)| Op::Record { worker, path }),
        1 => (0..4u8).prop_map(Op::RemoveWorker),
        3 => prop_oneof![Just(0), Just(1), Just(TTL_MS / 3), Just(TTL_MS - 1), Just(TTL_MS)]
            .prop_map(Op::Wait),
    ]
}

fn worker(w: u8) -> WorkerKey {
    WorkerKey::new(u64::from(w % 2), u32::from(w / 2))
}

/// (worker, routed prefix) → expiry in ms.
#[derive(Default)]
struct Model {
    entries: HashMap<(WorkerKey, Vec<u64>), u64>,
}

impl Model {
    fn record(&mut self, worker: WorkerKey, path: &[u64], now: u64) {
        for end in 1..=path.len() {
            self.entries
                .insert((worker, path[..end].to_vec()), now + TTL_MS);
        }
    }

    fn remove_worker(&mut self, worker: WorkerKey) {
        self.entries.retain(|(w, _), _| *w != worker);
    }

    /// The longest prefix of `path` whose every prefix is live for `worker`.
    fn depth(&self, worker: WorkerKey, path: &[u64], now: u64) -> u32 {
        (1..=path.len())
            .take_while(|&end| {
                self.entries
                    .get(&(worker, path[..end].to_vec()))
                    .is_some_and(|&e| e > now)
            })
            .count() as u32
    }
}

/// Every path of up to four blocks over the token alphabet.
fn probe_paths() -> Vec<Vec<u64>> {
    let mut paths: Vec<Vec<u64>> = vec![Vec::new()];
    let mut all = Vec::new();
    for _ in 0..4 {
        paths = paths
            .iter()
            .flat_map(|p| {
                (1..=TOKENS).map(move |t| {
                    let mut q = p.clone();
                    q.push(t);
                    q
                })
            })
            .collect();
        all.extend(paths.iter().cloned());
    }
    all
}

/// Each worker's depth per the index (0 if not listed); fails on a duplicate.
fn depths(
    index: &PredictedIndex,
    path: &[u64],
    now: Instant,
) -> Result<HashMap<WorkerKey, u32>, TestCaseError> {
    let mut depths = HashMap::new();
    for m in index.find_matches(path, now) {
        prop_assert!(m.depth >= 1 && m.depth as usize <= path.len());
        prop_assert!(depths.insert(m.worker, m.depth).is_none(), "listed twice");
    }
    Ok(depths)
}

/// Runs `ops`; with a cap, the index may know less than the model (never more),
/// holds at most the cap, and always matches the path it recorded last.
fn run(ops: Vec<Op>, max_blocks: Option<usize>) -> Result<(), TestCaseError> {
    let index = PredictedIndex::new(PredictedConfig {
        ttl: Duration::from_millis(TTL_MS),
        max_blocks: max_blocks.unwrap_or(1 << 20),
    });
    let start = Instant::now();
    let mut now = 0;
    let mut model = Model::default();
    let mut paths = probe_paths();
    for op in ops {
        match op {
            Op::Record { worker: w, path } => {
                // Longer paths are probed too, with a changed last block.
                if path.len() > 4 {
                    let mut other = path.clone();
                    *other.last_mut().unwrap() = path[path.len() - 1] % TOKENS + 1;
                    paths.extend([path.clone(), other]);
                }
                index.record(worker(w), &path, start + Duration::from_millis(now));
                model.record(worker(w), &path, now);
                let recorded = path.len().min(max_blocks.unwrap_or(usize::MAX)) as u32;
                let found = depths(&index, &path, start + Duration::from_millis(now))?;
                prop_assert_eq!(found.get(&worker(w)).copied(), Some(recorded));
            }
            Op::RemoveWorker(w) => {
                index.remove_worker(worker(w));
                model.remove_worker(worker(w));
            }
            Op::Wait(ms) => now += ms,
        }
        if let Some(max) = max_blocks {
            prop_assert!(
                index.len() <= max,
                "{} entries over the cap {max}",
                index.len()
            );
        }
        for path in &paths {
            let found = depths(&index, path, start + Duration::from_millis(now))?;
            for w in 0..4 {
                let got = found.get(&worker(w)).copied().unwrap_or(0);
                let want = model.depth(worker(w), path, now);
                if max_blocks.is_some() {
                    prop_assert!(got <= want, "{path:?} {w}: {got} > model's {want}");
                } else {
                    prop_assert_eq!(got, want, "path {:?} worker {}", path, w);
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn matches_the_model(ops in prop::collection::vec(op_strategy(), 1..40)) {
        run(ops, None)?;
    }

    #[test]
    fn with_a_cap_knows_a_subset_of_the_model(
        ops in prop::collection::vec(op_strategy(), 1..40),
        max_blocks in 1..26usize,
    ) {
        run(ops, Some(max_blocks))?;
    }
}
