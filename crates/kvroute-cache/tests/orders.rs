//! The lab's replay in the engines' orders, on traces worked out by hand.

use kvroute_cache::{
    Infinite, Lru, PreparedTrace, ReplayReport, replay, replay_sglang, replay_vllm,
};
use kvroute_trace::TraceRequest;

fn request(hash_ids: &[u64]) -> TraceRequest {
    TraceRequest {
        timestamp_ms: 0,
        input_length: 4 * hash_ids.len() as u64,
        output_length: 1,
        hash_ids: hash_ids.to_vec(),
    }
}

fn hits(report: &ReplayReport) -> Vec<u64> {
    report.per_request.iter().map(|r| r.hit_tokens).collect()
}

/// Capacity 4, block size 4: a chain of three, an unrelated pair that needs
/// one slot more than is free, then the chain again.
fn chain_then_pressure() -> PreparedTrace {
    PreparedTrace::new(&[request(&[0, 1, 2]), request(&[3, 4]), request(&[0, 1, 2])])
}

#[test]
fn seed_order_evicts_the_root_and_loses_the_whole_chain() {
    // Root first, LRU oldest first: [0,1,2]; [3,4] evicts 0 -> nothing of the
    // chain can be hit; 0 comes back evicting 1, and so on.
    let report = replay(&mut Lru::new(4).unwrap(), &chain_then_pressure(), 4, || {});
    assert_eq!(hits(&report), [0, 0, 0]);
}

#[test]
fn engine_orders_evict_the_tail_and_keep_the_prefix() {
    // Tail first: [2,1,0]; [3,4] needs one slot: 2 goes -> [1,0,4,3]; the
    // chain hits 0 and 1 (8 tokens) and recomputes 2, evicting the pair's
    // least recent block.
    let lru = replay_vllm(&mut Lru::new(4).unwrap(), &chain_then_pressure(), 4, || {});
    let radix = replay_sglang(Some(4), &chain_then_pressure(), 4, || {});
    for report in [&lru, &radix] {
        assert_eq!(hits(report), [0, 0, 8]);
        assert_eq!(report.evictions, 2);
        assert_eq!(report.final_cache_blocks, 4);
        assert_eq!(report.block_hits, 2);
    }
}

#[test]
fn a_running_request_never_evicts_its_own_prefix() {
    // Capacity 4: [1,0] (tail first) and [7] are cached; [0,1,5,6] needs all
    // four slots: only 7 may go, never 0 or 1, which the request is using
    // (giving blocks back tail first without taking them out first would
    // evict 1 and 0 to make room for 5 and 6: three evictions).
    let trace = PreparedTrace::new(&[request(&[0, 1]), request(&[7]), request(&[0, 1, 5, 6])]);
    let lru = replay_vllm(&mut Lru::new(4).unwrap(), &trace, 4, || {});
    let radix = replay_sglang(Some(4), &trace, 4, || {});
    for report in [&lru, &radix] {
        assert_eq!(hits(report), [0, 0, 8]);
        assert_eq!(report.evictions, 1);
    }
}

#[test]
fn without_a_limit_every_order_hits_the_same() {
    let trace = chain_then_pressure();
    let seed = replay(&mut Infinite::default(), &trace, 4, || {});
    let vllm = replay_vllm(&mut Infinite::default(), &trace, 4, || {});
    let sglang = replay_sglang(None, &trace, 4, || {});
    assert_eq!(hits(&seed), [0, 0, 12]);
    assert_eq!(hits(&vllm), hits(&seed));
    assert_eq!(hits(&sglang), hits(&seed));
    assert_eq!(sglang.evictions + vllm.evictions, 0);
}
