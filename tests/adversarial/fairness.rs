//! Attacks through fairness: see tests/adversarial.rs.

use crate::common::*;

/// Issue #36, attack 10: one worker storing 20,000 blocks took another's
/// 640-block prompt out of the bounded index (`index.max_blocks`, one LRU
/// for everyone): its overlap fell from 640 to 0, and the evictions marked
/// its digest trimmed, so it never healed. Each live worker now keeps its
/// share of the limit (the limit over the live workers) whoever stores:
/// the flood evicts the flooder's own oldest blocks.
#[tokio::test]
async fn a_flooding_worker_cannot_evict_another_workers_share_of_the_index() {
    const MAX_BLOCKS: u64 = 2048;
    const HONEST_BLOCKS: usize = 640;
    const CHAINS: u32 = 40;
    const CHAIN_BLOCKS: usize = 500;
    let router = RouterProcess::start(&format!("[index]\nmax_blocks = {MAX_BLOCKS}\n"));
    let mut honest = connect(&router, 1).await.unwrap();
    let mut hostile = connect(&router, 2).await.unwrap();
    let prompt = tokens(0, HONEST_BLOCKS * BLOCK_SIZE);
    honest.store(&prompt).await;
    assert_eq!(indexed(&router, 1).await.0, HONEST_BLOCKS as u64);

    // 20,000 blocks of its own, each chain acked once applied (and its
    // evictions done).
    for chain in 0..CHAINS {
        let start = 10_000_000 + chain * (CHAIN_BLOCKS * BLOCK_SIZE) as u32;
        hostile
            .store(&tokens(start, CHAIN_BLOCKS * BLOCK_SIZE))
            .await;
    }

    assert_eq!(indexed(&router, 1).await.0, HONEST_BLOCKS as u64);
    let flooded = indexed(&router, 2).await.0;
    assert_eq!(flooded, MAX_BLOCKS - HONEST_BLOCKS as u64);
    let text = Http::default()
        .get(&format!("{}/metrics", router.http))
        .await
        .text();
    let stored = u64::from(CHAINS) * CHAIN_BLOCKS as u64;
    assert_eq!(
        metric(&text, "kvroute_index_evicted_blocks_total", &[]) as u64,
        stored - flooded
    );
    // Looked up only now: a lookup touches the path, and between the
    // flood's events it would keep the honest blocks the most recent.
    assert_eq!(
        event_overlap(&router, &prompt, 1).await,
        HONEST_BLOCKS as u64
    );
}
