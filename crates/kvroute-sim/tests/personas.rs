//! The engines' personas: what a tool built for vLLM or SGLang reads from a
//! simulated engine, and the requests both refuse, in their own error shapes.

mod common;

use common::{get, post};
use kvroute_sim::{EngineConfig, PdConfig, Persona, Role, Worker, WorkerConfig};
use kvroute_tokenize::TokenizerSpec;
use serde_json::{Value, json};

async fn engine(persona: Persona, role: Role) -> Worker {
    let mut config = WorkerConfig::new(
        3,
        EngineConfig {
            kv_blocks: 64,
            block_size: 16,
            ..EngineConfig::default()
        },
    );
    config.engine.cost.speedup = 100.0;
    config.tokenizer = TokenizerSpec::None;
    config.persona = persona;
    config.pd = PdConfig {
        role,
        ..PdConfig::default()
    };
    Worker::start(config).await.unwrap()
}

async fn json_at(worker: &Worker, path: &str) -> Value {
    let (status, body) = get(&format!("{}{path}", worker.base_url())).await;
    assert_eq!(status, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap()
}

/// A Prometheus sample's value, by its name and a label it carries.
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

#[tokio::test]
async fn the_vllm_persona_answers_as_vllm_does() {
    let worker = engine(Persona::Vllm, Role::Aggregated).await;
    let base = worker.base_url().to_string();
    let (status, body) = get(&format!("{base}/health")).await;
    assert_eq!((status.as_u16(), body.as_str()), (200, ""));
    assert!(json_at(&worker, "/version").await["version"].is_string());
    let models = json_at(&worker, "/v1/models").await;
    assert_eq!(models["data"][0]["id"], "sim-model");
    assert_eq!(models["data"][0]["owned_by"], "vllm");
    // The sglang persona's endpoints are not here.
    let (status, _) = get(&format!("{base}/server_info")).await;
    assert_eq!(status, 404);

    let prompt: Vec<u32> = (0..40).collect();
    for _ in 0..2 {
        let (status, answer) = post(
            &format!("{base}/v1/completions"),
            &json!({"model": "sim-model", "prompt": prompt, "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, 200, "{answer}");
    }
    let (_, metrics) = get(&format!("{base}/metrics")).await;
    assert_eq!(sample(&metrics, "vllm:num_requests_running"), 0.0);
    assert_eq!(sample(&metrics, "vllm:num_requests_waiting"), 0.0);
    assert_eq!(sample(&metrics, "vllm:kv_cache_usage_perc"), 0.0);
    assert_eq!(sample(&metrics, "vllm:prefix_cache_queries_total"), 80.0);
    assert_eq!(sample(&metrics, "vllm:prefix_cache_hits_total"), 32.0);
    assert!(
        metrics.contains("num_gpu_blocks=\"64\""),
        "vllm:cache_config_info gives the pool size:\n{metrics}"
    );
    assert_eq!(sample(&metrics, "kvroute_sim_requests_total"), 2.0);
}

#[tokio::test]
async fn the_sglang_persona_answers_as_sglang_does() {
    for (role, mode) in [
        (Role::Aggregated, "null"),
        (Role::Prefill, "prefill"),
        (Role::Decode, "decode"),
    ] {
        let worker = engine(Persona::Sglang, role).await;
        let info = json_at(&worker, "/server_info").await;
        assert_eq!(info["disaggregation_mode"], mode);
        assert_eq!(info["page_size"], 16);
        assert_eq!(
            info["disaggregation_bootstrap_port"],
            worker.bootstrap_port()
        );
    }
    let worker = engine(Persona::Sglang, Role::Aggregated).await;
    let base = worker.base_url().to_string();
    let (status, body) = get(&format!("{base}/health")).await;
    assert_eq!((status.as_u16(), body.as_str()), (200, ""));
    let info = json_at(&worker, "/get_model_info").await;
    assert_eq!(info["model_path"], "sim-model");
    assert_eq!(info["is_generation"], true);
    let models = json_at(&worker, "/v1/models").await;
    assert_eq!(models["data"][0]["owned_by"], "sglang");
    let (status, _) = get(&format!("{base}/version")).await;
    assert_eq!(status, 404);

    let (status, answer) = post(
        &format!("{base}/v1/completions"),
        &json!({"model": "sim-model", "prompt": (0..40).collect::<Vec<u32>>(), "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let load = json_at(&worker, "/get_load").await;
    assert_eq!(load[0]["dp_rank"], 0);
    assert_eq!(load[0]["num_reqs"], 0);
    assert_eq!(load[0]["num_waiting_reqs"], 0);
    let (_, metrics) = get(&format!("{base}/metrics")).await;
    assert_eq!(sample(&metrics, "sglang:num_running_reqs"), 0.0);
    assert_eq!(sample(&metrics, "sglang:num_queue_reqs"), 0.0);
    assert_eq!(sample(&metrics, "sglang:token_usage"), 0.0);
    assert_eq!(sample(&metrics, "sglang:max_total_num_tokens"), 1024.0);
}

#[tokio::test]
async fn both_personas_refuse_what_the_engines_refuse_in_their_own_shape() {
    let refused = [
        (
            json!({"model": "sim-model", "prompt": [1, 2, 3], "stream_options": {"include_usage": true}}),
            "stream_options",
        ),
        (
            json!({"model": "sim-model", "prompt": [1, 2, 3], "stream": false,
                   "stream_options": {"include_usage": true}}),
            "stream_options",
        ),
        (
            json!({"model": "sim-model", "prompt": [1, 2, 3], "max_tokens": 4,
                   "max_completion_tokens": 4}),
            "max_completion_tokens",
        ),
    ];
    for persona in [Persona::Vllm, Persona::Sglang] {
        let worker = engine(persona, Role::Aggregated).await;
        for (body, named) in &refused {
            for path in ["/v1/completions", "/v1/chat/completions"] {
                let mut body = body.clone();
                if path.contains("chat") {
                    let prompt = body.as_object_mut().unwrap().remove("prompt");
                    assert!(prompt.is_some());
                    body["messages"] = json!([{"role": "user", "content": "hi"}]);
                }
                let (status, answer) = post(&format!("{}{path}", worker.base_url()), &body).await;
                assert_eq!(status, 400, "{persona:?} {path} {body}: {answer}");
                let error = match persona {
                    Persona::Vllm => &answer["error"],
                    Persona::Sglang => {
                        assert_eq!(answer["object"], "error", "{answer}");
                        &answer
                    }
                };
                assert_eq!(error["type"], "BadRequestError", "{answer}");
                assert_eq!(error["code"], 400, "{answer}");
                let message = error["message"].as_str().unwrap();
                assert!(message.contains(named), "{answer}");
            }
        }
        assert_eq!(worker.stats().0.requests, 0, "nothing refused was queued");
        // A streamed request may carry stream_options.
        let (status, _) = post(
            &format!("{}/v1/completions", worker.base_url()),
            &json!({"model": "sim-model", "prompt": [1, 2, 3], "max_tokens": 1,
                    "stream": true, "stream_options": {"include_usage": true}}),
        )
        .await;
        assert_eq!(status, 200);
    }
}
