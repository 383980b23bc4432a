//! Every API the engines serve, through a real `kvroute serve` to a real
//! `kvroute sim` fleet: OpenAI Responses (its conversations kept on the
//! worker that stores them), Anthropic Messages (errors in Anthropic's shape)
//! and the endpoints passed through on load.

mod common;

use common::{Http, Reply, RouterProcess, SimFleet, eventually, metric};
use serde_json::{Value, json};

const MODEL: &str = "sim-model";

/// A router with the sim's tokenizer and `n` sim workers registered with it.
async fn fleet(n: usize, config: &str) -> (RouterProcess, SimFleet) {
    let router = RouterProcess::start(&format!(
        "tokenizer = \"tiktoken:cl100k_base\"\n{config}\n[upstream]\nfirst_byte_timeout_ms = 5000\n"
    ));
    let sim = SimFleet::start(Some(&router.grpc), n);
    common::wait_registered(&router, n).await;
    (router, sim)
}

/// A prompt long enough to fill several blocks, distinct per `seed`.
fn long_text(seed: usize) -> String {
    (0..60)
        .map(|i| format!("conversation {seed} line {i}"))
        .collect::<Vec<_>>()
        .join(". ")
}

async fn post(http: &Http, router: &RouterProcess, path: &str, body: &Value) -> Reply {
    http.post(&format!("{}{path}", router.http), body).await
}

async fn post_pinned(
    http: &Http,
    router: &RouterProcess,
    path: &str,
    worker: u64,
    body: &Value,
) -> Reply {
    let worker = worker.to_string();
    http.call(
        "POST",
        &format!("{}{path}", router.http),
        &[("x-kvroute-worker", &worker)],
        body.to_string(),
    )
    .await
}

async fn metrics(http: &Http, router: &RouterProcess) -> String {
    http.get(&format!("{}/metrics", router.http)).await.text()
}

fn lookups(text: &str, outcome: &str) -> f64 {
    metric(
        text,
        "kvroute_response_owner_lookups_total",
        &[("outcome", outcome)],
    )
}

/// The `data:` payloads of an SSE body, as JSON.
fn events(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(str::trim)
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}")))
        .collect()
}

#[tokio::test]
async fn a_responses_follow_up_goes_to_the_worker_that_stores_the_response() {
    let (router, sim) = fleet(3, "").await;
    let http = Http::default();
    // One conversation started on each worker: no single tie-break could
    // send all three follow-ups home.
    for (seed, &(worker, _)) in sim.workers.iter().enumerate() {
        let first = json!({"model": MODEL, "input": long_text(seed), "max_output_tokens": 4});
        let first = post_pinned(&http, &router, "/v1/responses", worker, &first).await;
        assert_eq!(first.status, 200, "{}", first.text());
        assert_eq!(first.worker(), worker);
        let id = first.json()["id"].as_str().unwrap().to_string();
        let next = json!({"model": MODEL, "input": "And then?", "previous_response_id": id,
                          "max_output_tokens": 4});
        let next = post(&http, &router, "/v1/responses", &next).await;
        assert_eq!(next.status, 200, "{}", next.text());
        assert_eq!(next.worker(), worker, "the follow-up went elsewhere");
        let cached = next.json()["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(
            cached >= 16,
            "the second turn hit no cache: {}",
            next.text()
        );
    }
    assert_eq!(lookups(&metrics(&http, &router).await, "owner"), 3.0);
}

#[tokio::test]
async fn a_streamed_response_is_passed_through_and_its_id_recorded() {
    let (router, sim) = fleet(2, "").await;
    let http = Http::default();
    let (worker, _) = sim.workers[1];
    let body = json!({"model": MODEL, "input": long_text(7), "max_output_tokens": 3,
                      "stream": true});
    let streamed = post_pinned(&http, &router, "/v1/responses", worker, &body).await;
    assert_eq!(streamed.status, 200, "{}", streamed.text());
    assert!(
        streamed.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events = events(&streamed.text());
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds.first(), Some(&"response.created"));
    assert_eq!(kinds.last(), Some(&"response.completed"));
    assert!(kinds.contains(&"response.output_text.delta"));
    let id = events[0]["response"]["id"].as_str().unwrap();
    let next = json!({"model": MODEL, "input": "More.", "previous_response_id": id,
                      "max_output_tokens": 2, "stream": true});
    let next = post(&http, &router, "/v1/responses", &next).await;
    assert_eq!(next.status, 200, "{}", next.text());
    assert_eq!(next.worker(), worker);
    // Sent there for its id, not by a tie-break that happened to agree.
    assert_eq!(lookups(&metrics(&http, &router).await, "owner"), 1.0);
}

#[tokio::test]
async fn a_stored_response_is_retrieved_cancelled_and_deleted_at_its_worker() {
    let (router, sim) = fleet(2, "").await;
    let http = Http::default();
    let (worker, _) = sim.workers[0];
    let body = json!({"model": MODEL, "input": "Hello there.", "max_output_tokens": 2});
    let created = post_pinned(&http, &router, "/v1/responses", worker, &body).await;
    assert_eq!(created.status, 200, "{}", created.text());
    let id = created.json()["id"].as_str().unwrap().to_string();
    let url = format!("{}/v1/responses/{id}", router.http);

    let got = http.get(&url).await;
    assert_eq!(got.status, 200, "{}", got.text());
    assert_eq!(got.worker(), worker);
    assert_eq!(got.json()["id"], id.as_str());
    // A finished response cannot be cancelled: the worker's answer, not the router's.
    let cancel = http.call("POST", &format!("{url}/cancel"), &[], "").await;
    assert_eq!(cancel.worker(), worker, "{}", cancel.text());
    let deleted = http.call("DELETE", &url, &[], "").await;
    assert_eq!(deleted.status, 200, "{}", deleted.text());
    assert_eq!(deleted.json()["deleted"], true);
    let gone = http.get(&url).await;
    assert_eq!(gone.status, 404, "{}", gone.text());
    assert_eq!(gone.worker(), worker, "the worker itself no longer has it");

    let unknown = http
        .get(&format!("{}/v1/responses/resp_unknown", router.http))
        .await;
    unknown.assert_error(404, "invalid_request");
    assert_eq!(lookups(&metrics(&http, &router).await, "unknown"), 1.0);
}

#[tokio::test]
async fn a_follow_up_whose_worker_left_is_routed_like_any_other_and_counted() {
    let (router, sim) = fleet(2, "").await;
    let http = Http::default();
    let (worker, _) = sim.workers[0];
    let body = json!({"model": MODEL, "input": long_text(3), "max_output_tokens": 2});
    let created = post_pinned(&http, &router, "/v1/responses", worker, &body).await;
    let id = created.json()["id"].as_str().unwrap().to_string();
    let drained = http
        .call(
            "POST",
            &format!("{}/workers/{worker}/drain", router.http),
            &[],
            "",
        )
        .await;
    assert_eq!(drained.status, 200, "{}", drained.text());
    let next = json!({"model": MODEL, "input": "Next.", "previous_response_id": id,
                      "max_output_tokens": 2});
    let next = post(&http, &router, "/v1/responses", &next).await;
    // The other worker does not store the response: the engine says so.
    assert_eq!(next.status, 404, "{}", next.text());
    assert_ne!(next.worker(), worker);
    assert_eq!(lookups(&metrics(&http, &router).await, "owner_gone"), 1.0);
}

#[tokio::test]
async fn chat_responses_and_messages_tokenize_one_conversation_alike() {
    let (router, _sim) = fleet(1, "").await;
    let http = Http::default();
    let text = long_text(11);
    let routed = |text: String| metric(&text, "kvroute_routed_prompt_tokens_total", &[]);
    let mut before = routed(metrics(&http, &router).await);
    let mut counted = Vec::new();
    let mut reported = Vec::new();
    for (path, body, usage) in [
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "max_tokens": 1, "messages": [
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]}),
            "/usage/prompt_tokens",
        ),
        (
            "/v1/responses",
            json!({"model": MODEL, "max_output_tokens": 1, "instructions": "Be brief.",
                   "input": text}),
            "/usage/input_tokens",
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 1, "system": "Be brief.",
                   "messages": [{"role": "user", "content": text}]}),
            "",
        ),
    ] {
        let reply = post(&http, &router, path, &body).await;
        assert_eq!(reply.status, 200, "{path}: {}", reply.text());
        let after = routed(metrics(&http, &router).await);
        counted.push(after - before);
        before = after;
        if !usage.is_empty() {
            reported.push(reply.json().pointer(usage).unwrap().as_f64().unwrap());
        }
    }
    assert!(counted[0] > 100.0, "{counted:?}");
    assert_eq!(
        counted, [counted[0]; 3],
        "the router's prompt tokens per API"
    );
    assert_eq!(reported, [counted[0]; 2], "the engine's prompt tokens");
}

/// Asserts an Anthropic error body with this status and `error.type`.
fn assert_anthropic_error(reply: &Reply, status: u16, kind: &str) {
    assert_eq!(reply.status.as_u16(), status, "{}", reply.text());
    let body = reply.json();
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], kind, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty())
    );
}

#[tokio::test]
async fn messages_stream_count_tokens_and_keep_a_conversation_on_its_cache() {
    let (router, _sim) = fleet(3, "").await;
    let http = Http::default();
    for seed in 0..3 {
        let first_turn = json!([{"role": "user", "content": long_text(20 + seed)}]);
        let first = json!({"model": MODEL, "max_tokens": 3, "messages": first_turn});
        let first = post(&http, &router, "/v1/messages", &first).await;
        assert_eq!(first.status, 200, "{}", first.text());
        let reply = first.json();
        assert_eq!(reply["type"], "message");
        let said = reply["content"][0]["text"].as_str().unwrap().to_string();
        let next = json!({"model": MODEL, "max_tokens": 2, "stream": true, "messages": [
            first_turn[0], {"role": "assistant", "content": said},
            {"role": "user", "content": "Go on."}]});
        let next = post(&http, &router, "/v1/messages", &next).await;
        assert_eq!(next.status, 200, "{}", next.text());
        assert_eq!(
            next.worker(),
            first.worker(),
            "the second turn left its cache"
        );
        let events = events(&next.text());
        assert_eq!(events.first().unwrap()["type"], "message_start");
        assert_eq!(events.last().unwrap()["type"], "message_stop");
        let cached = events[0]["message"]["usage"]["cache_read_input_tokens"]
            .as_u64()
            .unwrap();
        assert!(cached >= 16, "{}", next.text());
    }
    let count = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]});
    let count = post(&http, &router, "/v1/messages/count_tokens", &count).await;
    assert_eq!(count.status, 200, "{}", count.text());
    assert!(count.json()["input_tokens"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn messages_errors_are_in_anthropics_shape_the_routers_own_included() {
    let (router, _sim) = fleet(1, "body_limit_bytes = 4096\n").await;
    let http = Http::default();
    let url = format!("{}/v1/messages", router.http);
    let not_json = http.call("POST", &url, &[], "{nope").await;
    assert_anthropic_error(&not_json, 400, "invalid_request_error");
    let no_model = json!({"max_tokens": 1, "messages": []});
    assert_anthropic_error(
        &post(&http, &router, "/v1/messages", &no_model).await,
        400,
        "invalid_request_error",
    );
    let bad_block = json!({"model": MODEL, "max_tokens": 1,
                           "messages": [{"role": "user", "content": [{"type": "image"}]}]});
    assert_anthropic_error(
        &post(&http, &router, "/v1/messages", &bad_block).await,
        400,
        "invalid_request_error",
    );
    let unknown = json!({"model": "nope", "max_tokens": 1,
                         "messages": [{"role": "user", "content": "x"}]});
    assert_anthropic_error(
        &post(&http, &router, "/v1/messages", &unknown).await,
        404,
        "not_found_error",
    );
    let large = json!({"model": MODEL, "max_tokens": 1,
                       "messages": [{"role": "user", "content": "x".repeat(5000)}]});
    assert_anthropic_error(
        &post(&http, &router, "/v1/messages", &large).await,
        413,
        "request_too_large",
    );
    assert_anthropic_error(
        &post(&http, &router, "/v1/messages/count_tokens", &json!([])).await,
        400,
        "invalid_request_error",
    );
    // The same mistakes on the OpenAI endpoints answer in OpenAI's shape.
    let not_json = http
        .call(
            "POST",
            &format!("{}/v1/responses", router.http),
            &[],
            "{nope",
        )
        .await;
    not_json.assert_error(400, "invalid_request");
    let bad_input = json!({"model": MODEL, "input": 3});
    post(&http, &router, "/v1/responses", &bad_input)
        .await
        .assert_error(400, "invalid_request");
    assert!(common::refusals(&router, "response_owners").await == 0.0);
}

#[tokio::test]
async fn the_pass_through_endpoints_reach_a_worker_serving_the_model() {
    let (router, sim) = fleet(2, "").await;
    let http = Http::default();
    let workers: Vec<u64> = sim.workers.iter().map(|(id, _)| *id).collect();
    for (path, body) in [
        ("/v1/embeddings", json!({"model": MODEL, "input": "a cat"})),
        (
            "/v1/rerank",
            json!({"model": MODEL, "query": "cat", "documents": ["a cat", "a dog"]}),
        ),
        (
            "/v1/score",
            json!({"model": MODEL, "text_1": "cat", "text_2": "a cat"}),
        ),
        ("/tokenize", json!({"model": MODEL, "prompt": "a cat"})),
        ("/detokenize", json!({"model": MODEL, "tokens": [64, 8415]})),
    ] {
        let reply = post(&http, &router, path, &body).await;
        assert_eq!(reply.status, 200, "{path}: {}", reply.text());
        assert!(workers.contains(&reply.worker()), "{path}");
        let unknown = post(&http, &router, path, &json!({"model": "nope"})).await;
        unknown.assert_error(404, "model_not_found");
        let get = http.get(&format!("{}{path}", router.http)).await;
        assert_eq!(get.status, 405, "{path}");
    }
    eventually("every pass-through request to be counted", || async {
        metric(
            &metrics(&http, &router).await,
            "kvroute_routed_requests_total",
            &[],
        ) >= 5.0
    })
    .await;
}

/// The venv's python with the official clients, from `tests/python/install.sh`.
fn client_python() -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let output = std::process::Command::new("bash")
        .arg(format!("{root}/tests/python/install.sh"))
        .output()
        .expect("bash runs tests/python/install.sh");
    assert!(
        output.status.success(),
        "tests/python/install.sh failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap().trim().to_string()
}

/// Runs `tests/python/clients.py CLIENT` against `router`; its JSON summary.
async fn run_client(client: &str, router: &RouterProcess) -> Value {
    let python = client_python();
    let script = format!("{}/tests/python/clients.py", env!("CARGO_MANIFEST_DIR"));
    let (client, url) = (client.to_string(), router.http.clone());
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .args([&script, &client, &url])
            .output()
            .expect("the venv's python runs")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

#[tokio::test]
async fn the_official_openai_client_holds_a_responses_conversation() {
    let (router, _sim) = fleet(3, "").await;
    let summary = run_client("openai", &router).await;
    assert!(
        summary["second_turn_cached_tokens"].as_u64().unwrap() >= 16,
        "{summary}"
    );
    assert!(
        summary["after_stream_cached_tokens"].as_u64().unwrap() >= 16,
        "{summary}"
    );
    let text = metrics(&Http::default(), &router).await;
    assert_eq!(
        lookups(&text, "owner"),
        5.0,
        "two follow-ups, retrieve, delete, retrieve"
    );
}

#[tokio::test]
async fn the_official_anthropic_client_creates_streams_counts_and_gets_typed_errors() {
    let (router, _sim) = fleet(3, "").await;
    let summary = run_client("anthropic", &router).await;
    assert!(
        summary["second_turn_cached_tokens"].as_u64().unwrap() >= 16,
        "{summary}"
    );
}
