//! Prefill and decode engines handing KV over real HTTP, in vLLM's and
//! SGLang's conventions: what the decode counts as cached, what each engine
//! counts, and what happens when one leg never comes.

mod common;

use std::time::Duration;

use common::{eventually, post};
use kvroute_sim::{EngineConfig, PdConfig, PdConvention, Role, Worker, WorkerConfig};
use kvroute_tokenize::TokenizerSpec;
use serde_json::{Value, json};

const BLOCK: usize = 16;

async fn engine(id: u64, role: Role, convention: PdConvention, pd: &PdConfig) -> Worker {
    engine_at_speed(id, role, convention, pd, 100.0).await
}

async fn engine_at_speed(
    id: u64,
    role: Role,
    convention: PdConvention,
    pd: &PdConfig,
    speedup: f64,
) -> Worker {
    let mut config = WorkerConfig::new(
        id,
        EngineConfig {
            kv_blocks: 64,
            block_size: BLOCK,
            ..EngineConfig::default()
        },
    );
    config.engine.cost.speedup = speedup;
    config.tokenizer = TokenizerSpec::None;
    config.pd = PdConfig {
        role,
        convention,
        ..pd.clone()
    };
    Worker::start(config).await.unwrap()
}

/// A prompt of `len` token ids from `start`.
fn prompt(start: u32, len: u32) -> Value {
    json!((start..start + len).collect::<Vec<_>>())
}

fn cached(response: &Value) -> u64 {
    response["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

fn url(worker: &Worker, path: &str) -> String {
    format!("{}{path}", worker.base_url())
}

#[tokio::test]
async fn a_vllm_decode_pulls_the_prefill_and_counts_it_cached_less_the_last_token() {
    let pd = PdConfig::default();
    let prefill = engine(1, Role::Prefill, PdConvention::Vllm, &pd).await;
    let decode = engine(2, Role::Decode, PdConvention::Vllm, &pd).await;
    // 2 full blocks and a partial one.
    let body = json!({"model": "sim-model", "prompt": prompt(0, 40)});
    let mut first = body.clone();
    first["max_tokens"] = json!(1);
    first["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    let (status, answer) = post(&url(&prefill, "/v1/completions"), &first).await;
    assert_eq!(status, 200, "{answer}");
    let params = answer["kv_transfer_params"].clone();
    for field in [
        "remote_engine_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
        "remote_request_id",
        "tp_size",
    ] {
        assert!(!params[field].is_null(), "no {field} in {params}");
    }
    assert_eq!(params["remote_port"], prefill.bootstrap_port());
    // Held under the lease: 2 full blocks and the partial one.
    assert_eq!(prefill.stats().1.kv_blocks_used, 3);

    let mut second = body.clone();
    second["max_tokens"] = json!(4);
    second["kv_transfer_params"] = params.clone();
    let (status, answer) = post(&url(&decode, "/v1/completions"), &second).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(cached(&answer), 39, "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 4);
    assert_eq!(decode.stats().0.transferred_tokens, 39);
    assert_eq!(decode.pd_stats().handoffs, 1);
    let served = prefill.pd_stats();
    assert_eq!((served.handoffs, served.lease_expired_blocks), (1, 0));
    assert_eq!(
        prefill.stats().1.kv_blocks_used,
        0,
        "the lease was released"
    );

    // The lease is gone: the same parameters again mean a full recompute.
    let (status, answer) = post(&url(&decode, "/v1/completions"), &second).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(decode.pd_stats().recomputes, 1);
    assert_eq!(decode.pd_stats().handoffs, 1);
}

#[tokio::test]
async fn a_vllm_decode_without_usable_parameters_recomputes() {
    let pd = PdConfig::default();
    let decode = engine(2, Role::Decode, PdConvention::Vllm, &pd).await;
    let body = json!({"model": "sim-model", "prompt": prompt(0, 40), "max_tokens": 2,
        "kv_transfer_params": {"do_remote_prefill": true, "remote_host": null}});
    let (status, answer) = post(&url(&decode, "/v1/completions"), &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(cached(&answer), 0);
    assert_eq!(decode.pd_stats().recomputes, 1);
    assert_eq!(decode.stats().0.computed_prompt_tokens, 40);
}

#[tokio::test]
async fn a_prefill_nobody_pulls_frees_its_blocks_when_the_lease_times_out() {
    let pd = PdConfig {
        lease_timeout: Duration::from_millis(200),
        ..PdConfig::default()
    };
    for convention in [PdConvention::Vllm, PdConvention::Sglang] {
        let prefill = engine(1, Role::Prefill, convention, &pd).await;
        let body = json!({"model": "sim-model", "prompt": prompt(0, 40), "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": true},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port(),
            "bootstrap_room": 7});
        let (status, answer) = post(&url(&prefill, "/v1/completions"), &body).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(prefill.stats().1.kv_blocks_used, 3, "{convention:?}");
        eventually(|| prefill.pd_stats().lease_expired_blocks == 3).await;
        assert_eq!(prefill.stats().1.kv_blocks_used, 0, "{convention:?}");
        assert_eq!(prefill.pd_stats().handoffs, 0);
    }
}

fn sglang_body(prefill: &Worker, room: u64, len: u32) -> Value {
    json!({"model": "sim-model", "prompt": prompt(100, len), "max_tokens": 3,
        "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port(),
        "bootstrap_room": room})
}

#[tokio::test]
async fn sglang_legs_sent_at_once_meet_at_the_rendezvous() {
    let pd = PdConfig::default();
    // At real speed the prefill takes 34 ms, so the decode waits at the rendezvous.
    let prefill = engine_at_speed(1, Role::Prefill, PdConvention::Sglang, &pd, 1.0).await;
    let decode = engine(2, Role::Decode, PdConvention::Sglang, &pd).await;
    let body = sglang_body(&prefill, (1 << 62) + 5, 600);
    let (decode_url, prefill_url) = (
        url(&decode, "/v1/completions"),
        url(&prefill, "/v1/completions"),
    );
    let (decoded, prefilled) = tokio::join!(post(&decode_url, &body), post(&prefill_url, &body));
    assert_eq!(prefilled.0, 200, "{}", prefilled.1);
    assert_eq!(decoded.0, 200, "{}", decoded.1);
    assert_eq!(cached(&decoded.1), 599, "{}", decoded.1);
    // The prefill stops at the first token; the decode generates what was asked.
    assert_eq!(prefilled.1["usage"]["completion_tokens"], 1);
    assert_eq!(decoded.1["usage"]["completion_tokens"], 3);
    assert_eq!(decode.pd_stats().handoffs, 1);
    assert_eq!(prefill.pd_stats().handoffs, 1);
    assert_eq!(prefill.pd_stats().lease_expired_blocks, 0);
    assert_eq!(prefill.stats().1.kv_blocks_used, 0);
}

#[tokio::test]
async fn an_sglang_decode_whose_prefill_never_comes_fails_after_the_timeout() {
    let pd = PdConfig {
        bootstrap_timeout: Duration::from_millis(300),
        ..PdConfig::default()
    };
    let prefill = engine(1, Role::Prefill, PdConvention::Sglang, &pd).await;
    let decode = engine(2, Role::Decode, PdConvention::Sglang, &pd).await;
    let started = std::time::Instant::now();
    let (status, answer) = post(
        &url(&decode, "/v1/completions"),
        &sglang_body(&prefill, 9, 40),
    )
    .await;
    assert_eq!(status, 500, "{answer}");
    assert!(started.elapsed() >= Duration::from_millis(300));
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains("bootstrap room 9"), "{answer}");
    assert_eq!(decode.stats().0.requests, 0, "nothing was queued");
    assert_eq!(decode.pd_stats().handoffs, 0);
}

#[tokio::test]
async fn an_aggregated_engine_ignores_handoff_fields() {
    let pd = PdConfig::default();
    let whole = engine(1, Role::Aggregated, PdConvention::Vllm, &pd).await;
    let body = json!({"model": "sim-model", "prompt": prompt(0, 40), "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": true}, "bootstrap_room": 3});
    let (status, answer) = post(&url(&whole, "/v1/completions"), &body).await;
    assert_eq!(status, 200, "{answer}");
    assert!(answer.get("kv_transfer_params").is_none(), "{answer}");
    assert_eq!(whole.stats().1.kv_blocks_used, 0);
    assert_eq!(whole.bootstrap_port(), 0);
}
