//! Both engine modes against naive models of the engines they imitate, written
//! from the engines' documented rules, on random prompts drawn from a small
//! prefix tree and run one at a time: the prefix hits of every request and the
//! blocks evicted, in order, must be the model's.
//!
//! - vLLM: cached blocks wait in one free queue, oldest first; a request takes
//!   its cached blocks out, takes a slot per new block in prompt order (a full
//!   pool evicts the queue's front), and when it finishes gives all its blocks
//!   back in reverse order.
//! - SGLang: a list of blocks with their parent, last-use time and lock count;
//!   a request locks its cached blocks, evicts the least recently used
//!   unlocked leaf (found by a full scan) for each new block the pool has no
//!   room for, and on admission and on finishing uses its whole path, the root
//!   last; finishing unlocks it.

use kvroute_index::{BlockHasher, ExtraKeys, sequence_hashes};
use kvroute_sim::pool::PoolEvent;
use kvroute_sim::{Engine, EngineConfig, EngineKind};
use proptest::prelude::*;

const BLOCK: usize = 4;
const POOL: usize = 8;

/// A prompt of whole blocks; block `label` holds tokens `4·label ..`.
fn tokens(labels: &[u8]) -> Vec<u32> {
    labels
        .iter()
        .flat_map(|&l| (0..BLOCK as u32).map(move |i| u32::from(l) * BLOCK as u32 + i))
        .collect()
}

fn block_hashes(labels: &[u8]) -> Vec<u64> {
    sequence_hashes(
        &BlockHasher::new(BLOCK).local_hashes_with(&tokens(labels), &ExtraKeys::default()),
    )
}

/// What one request found cached and which blocks were evicted while it ran.
type Outcome = (usize, Vec<u64>);

fn run_engine(kind: EngineKind, prompts: &[Vec<u8>]) -> Vec<Outcome> {
    let mut engine = Engine::new(EngineConfig {
        kv_blocks: POOL,
        block_size: BLOCK,
        kind,
        ..EngineConfig::default()
    })
    .unwrap();
    engine.take_events();
    prompts
        .iter()
        .map(|labels| {
            engine.submit(&tokens(labels), 1).unwrap();
            let mut cached = 0;
            while let Some(step) = engine.step() {
                cached += step
                    .emitted
                    .iter()
                    .map(|e| e.cached_tokens as usize)
                    .sum::<usize>();
            }
            let removed = engine
                .take_events()
                .into_iter()
                .filter_map(|e| match e {
                    PoolEvent::Removed { hash } => Some(hash),
                    _ => None,
                })
                .collect();
            (cached / BLOCK, removed)
        })
        .collect()
}

fn vllm_model(prompts: &[Vec<u8>]) -> Vec<Outcome> {
    let mut queue: Vec<u64> = Vec::new();
    prompts
        .iter()
        .map(|labels| {
            let blocks = block_hashes(labels);
            let hit = blocks.iter().take_while(|b| queue.contains(b)).count();
            let mut evicted = Vec::new();
            for (in_use, block) in blocks.iter().enumerate() {
                if let Some(at) = queue.iter().position(|q| q == block) {
                    queue.remove(at);
                } else if queue.len() + in_use == POOL {
                    evicted.push(queue.remove(0));
                }
            }
            queue.extend(blocks.iter().rev());
            (hit, evicted)
        })
        .collect()
}

struct Node {
    block: u64,
    parent: Option<u64>,
    last_use: u64,
    locks: u32,
}

fn sglang_model(prompts: &[Vec<u8>]) -> Vec<Outcome> {
    let mut nodes: Vec<Node> = Vec::new();
    let mut clock = 0;
    // Uses the path ending at `blocks`' last block: the leaf first, the root last.
    let mut touch = |nodes: &mut Vec<Node>, blocks: &[u64]| {
        for block in blocks.iter().rev() {
            clock += 1;
            nodes
                .iter_mut()
                .find(|n| n.block == *block)
                .unwrap()
                .last_use = clock;
        }
    };
    prompts
        .iter()
        .map(|labels| {
            let blocks = block_hashes(labels);
            let hit = blocks
                .iter()
                .take_while(|b| nodes.iter().any(|n| n.block == **b))
                .count();
            for node in nodes.iter_mut().filter(|n| blocks.contains(&n.block)) {
                node.locks += 1;
            }
            let new = blocks.len() - hit;
            let mut evicted = Vec::new();
            while nodes.len() + new > POOL {
                let victim = (0..nodes.len())
                    .filter(|&i| nodes[i].locks == 0)
                    .filter(|&i| !nodes.iter().any(|c| c.parent == Some(nodes[i].block)))
                    .min_by_key(|&i| nodes[i].last_use)
                    .expect("the pool holds every prompt");
                evicted.push(nodes.remove(victim).block);
            }
            for (i, &block) in blocks.iter().enumerate().skip(hit) {
                let parent = i.checked_sub(1).map(|p| blocks[p]);
                nodes.push(Node {
                    block,
                    parent,
                    last_use: 0,
                    locks: 1,
                });
            }
            touch(&mut nodes, &blocks);
            for node in nodes.iter_mut().filter(|n| blocks.contains(&n.block)) {
                node.locks -= 1;
            }
            touch(&mut nodes, &blocks);
            (hit, evicted)
        })
        .collect()
}

fn prompts() -> impl Strategy<Value = Vec<Vec<u8>>> {
    prop::collection::vec(prop::collection::vec(0u8..3, 1..=6), 1..40)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn vllm_mode_matches_the_free_queue_model(prompts in prompts()) {
        prop_assert_eq!(run_engine(EngineKind::Vllm, &prompts), vllm_model(&prompts));
    }

    #[test]
    fn sglang_mode_matches_the_radix_model(prompts in prompts()) {
        prop_assert_eq!(run_engine(EngineKind::Sglang, &prompts), sglang_model(&prompts));
    }
}
