//! The simulated engine's own hit accounting against the cache-policy lab:
//! fed one trace request at a time, an engine over N blocks finds exactly the
//! prefix hits `kvroute-lab replay --policy lru --capacity-blocks N --order E`
//! computes for the same block sequence, where E is the engine's kind.

use kvroute_cache::{Lru, PolicyKind, PreparedTrace, ReplayReport, replay_sglang, replay_vllm};
use kvroute_sim::trace::{TRACE_BLOCK_TOKENS, trace_tokens};
use kvroute_sim::{Engine, EngineConfig, EngineKind};
use kvroute_trace::{TraceRequest, read_trace};

const CAPACITY: usize = 96;

#[test]
fn vllm_engine_hits_match_the_vllm_order_replay_request_by_request() {
    let trace = trace();
    let lab = replay_vllm(
        &mut Lru::new(CAPACITY).unwrap(),
        &PreparedTrace::new(&trace),
        TRACE_BLOCK_TOKENS as u64,
        || {},
    );
    check_engine(EngineKind::Vllm, &trace, &lab);
}

#[test]
fn sglang_engine_hits_match_the_sglang_order_replay_request_by_request() {
    let trace = trace();
    let lab = replay_sglang(
        Some(CAPACITY),
        &PreparedTrace::new(&trace),
        TRACE_BLOCK_TOKENS as u64,
        || {},
    );
    check_engine(EngineKind::Sglang, &trace, &lab);
}

fn trace() -> Vec<TraceRequest> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/traces/conversation_trace.jsonl"
    );
    // Whole blocks only (the lab counts a resident partial last block as a
    // hit; an engine never caches a partial block), and requests that fit.
    read_trace(path.as_ref(), Some(1500))
        .unwrap()
        .into_iter()
        .filter(|r| r.hash_ids.len() <= 48)
        .map(|mut r| {
            r.input_length = (r.hash_ids.len() * TRACE_BLOCK_TOKENS) as u64;
            r
        })
        .collect()
}

fn check_engine(kind: EngineKind, trace: &[TraceRequest], lab: &ReplayReport) {
    assert!(
        lab.total_hit_tokens > 0 && lab.evictions > 0,
        "the test must exercise hits and evictions"
    );

    let mut engine = Engine::new(EngineConfig {
        kv_blocks: CAPACITY,
        block_size: TRACE_BLOCK_TOKENS,
        eviction: PolicyKind::Lru,
        kind,
        ..EngineConfig::default()
    })
    .unwrap();
    for (i, (request, expected)) in trace.iter().zip(&lab.per_request).enumerate() {
        engine
            .submit(
                &trace_tokens(&request.hash_ids, request.input_length as usize),
                1,
            )
            .unwrap();
        let mut cached = None;
        while let Some(step) = engine.step() {
            cached = cached.or(step.emitted.first().map(|e| e.cached_tokens as u64));
        }
        assert_eq!(cached, Some(expected.hit_tokens), "request {i}");
    }
    let stats = engine.stats();
    assert_eq!(stats.cached_tokens, lab.total_hit_tokens);
    assert_eq!(stats.prompt_tokens, lab.total_prompt_tokens);
    assert_eq!(engine.evictions(), lab.evictions);
}
