//! Hashing exactly what the engine hashes, with real processes on loopback:
//! router and workers agree on the tokenizer or the router says so loudly, and
//! vLLM's `cache_salt` keeps salted chains apart in the router and the engine.

mod common;

use common::*;
use serde_json::{Value, json};

/// What the sim reports as cached of a completion's prompt.
fn cached_tokens(reply: &Reply) -> u64 {
    let body = reply.json();
    body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {body}"))
}

#[tokio::test]
async fn a_router_with_the_sims_tokenizer_routes_text_prompts_by_prefix() {
    // The default sim's tokenizer.
    let router = RouterProcess::start("tokenizer = \"tiktoken:cl100k_base\"\n");
    let _sim = SimFleet::start(Some(&router.grpc), 2);
    wait_registered(&router, 2).await;
    let http = Http::default();
    let completions = format!("{}/v1/completions", router.http);
    let system = "You are a careful assistant who answers briefly and exactly. ".repeat(40);
    let request = |question: &str| json!({"model": "sim-model", "prompt": format!("{system}{question}"), "max_tokens": 2});
    let first = http
        .post(&completions, &request("What is a KV cache?"))
        .await;
    assert_eq!(first.status, 200, "{}", first.text());
    let worker = first.worker();

    // The router tokenizes the text (with the tokenizer the sims declared
    // too) and finds the shared prefix where the first request left it.
    let route = http
        .post(
            &format!("{}/v1/route", router.http),
            &request("Why route by prefix?"),
        )
        .await
        .json();
    assert!(route["untokenized"].is_null(), "{route}");
    assert_eq!(route["worker_id"], worker, "{route}");
    assert!(route["overlap_blocks"].as_u64().unwrap() >= 20, "{route}");
    // And the engine agrees: the second request hits its cache there.
    let second = http
        .post(&completions, &request("Why route by prefix?"))
        .await;
    assert_eq!(second.worker(), worker);
    assert!(
        cached_tokens(&second) >= 20 * BLOCK_SIZE as u64,
        "{}",
        second.text()
    );
}

#[tokio::test]
async fn text_that_cannot_be_tokenized_is_counted_and_explained() {
    let router = RouterProcess::start("");
    // A router without tokenizer: text has no tokens, whatever the workers declare.
    let _worker = GrpcWorker::connect(
        &router.grpc,
        None,
        register(1, "http://127.0.0.1:9", &["m"], BLOCK_SIZE as u32),
    )
    .await
    .unwrap();
    let http = Http::default();
    let route = http
        .post(
            &format!("{}/v1/route", router.http),
            &json!({"model": "m", "prompt": "Some text to route."}),
        )
        .await
        .json();
    assert_eq!(route["overlap_blocks"], 0, "{route}");
    let why = route["untokenized"].as_str().unwrap_or_default();
    assert!(why.contains("no tokenizer"), "{route}");
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}]});
    let route = http
        .post(&format!("{}/v1/route", router.http), &chat)
        .await
        .json();
    assert!(route["untokenized"].is_string(), "{route}");
    // Token ids need no tokenizer.
    let route = http
        .post(
            &format!("{}/v1/route", router.http),
            &completion("m", &tokens(0, 32)),
        )
        .await
        .json();
    assert!(route["untokenized"].is_null(), "{route}");
    let metrics = http.get(&format!("{}/metrics", router.http)).await.text();
    assert_eq!(
        metric(&metrics, "kvroute_untokenized_requests_total", &[]),
        2.0
    );
}

#[tokio::test]
async fn a_worker_with_another_tokenizer_is_refused_unless_allowed() {
    let router = RouterProcess::start("tokenizer = \"tiktoken:cl100k_base\"\n");
    let refused = connect_declaring(&router, 1, Some(declared("tiktoken:o200k_base")))
        .await
        .err()
        .expect("a worker with another tokenizer is refused");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    for needle in ["o200k_base", "allow_tokenizer_mismatch"] {
        assert!(refused.message().contains(needle), "{}", refused.message());
    }
    // The router's own tokenizer is not told: nothing to copy.
    let ours = declared("tiktoken:cl100k_base");
    for secret in ["cl100k_base", ours.fingerprint.as_str()] {
        assert!(!refused.message().contains(secret), "{}", refused.message());
    }
    connect_declaring(&router, 2, Some(declared("tiktoken:cl100k_base")))
        .await
        .expect("the same tokenizer is accepted");

    let lenient = RouterProcess::start(
        "tokenizer = \"tiktoken:cl100k_base\"\nallow_tokenizer_mismatch = true\n",
    );
    connect_declaring(&lenient, 1, Some(declared("tiktoken:o200k_base")))
        .await
        .expect("allowed by the configuration");
}

#[tokio::test]
async fn a_cache_salt_matches_only_its_own_salt_in_router_and_engine() {
    // Predictions end at once: the router matches on the sim's events alone.
    let router = RouterProcess::start("[scheduler]\npredicted_bridge_ms = 0\n");
    let _sim = SimFleet::start(Some(&router.grpc), 2);
    wait_registered(&router, 2).await;
    let http = Http::default();
    let prompt = tokens(5000, 6 * BLOCK_SIZE + 3);
    let request = |salt: Option<&str>| {
        let mut body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2});
        if let Some(salt) = salt {
            body["cache_salt"] = Value::from(salt);
        }
        body
    };
    let completions = format!("{}/v1/completions", router.http);
    let first = http.post(&completions, &request(Some("tenant-a"))).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let worker = first.worker();

    let route_url = format!("{}/v1/route", router.http);
    eventually("the salted chain to be indexed", || async {
        let route = http
            .post(&route_url, &request(Some("tenant-a")))
            .await
            .json();
        route["worker_id"] == worker && route["overlap_blocks"] == 6
    })
    .await;
    for other in [Some("tenant-b"), None] {
        let route = http.post(&route_url, &request(other)).await.json();
        assert_eq!(route["overlap_blocks"], 0, "salt {other:?}: {route}");
    }

    // The engine keys its own cache the same way.
    let pin = worker.to_string();
    let pinned = |salt| {
        let body = request(salt).to_string();
        let (http, url, pin) = (http.clone(), completions.clone(), pin.clone());
        async move {
            http.call("POST", &url, &[("x-kvroute-worker", &pin)], body)
                .await
        }
    };
    assert_eq!(cached_tokens(&pinned(Some("tenant-b")).await), 0);
    assert_eq!(cached_tokens(&pinned(None).await), 0);
    assert_eq!(
        cached_tokens(&pinned(Some("tenant-a")).await),
        6 * BLOCK_SIZE as u64
    );
    let bad = http
        .post(
            &completions,
            &json!({"model": "sim-model", "prompt": prompt, "cache_salt": 7}),
        )
        .await;
    bad.assert_error(400, "invalid_request");
}

/// Each worker's overlap in a dry run's scores.
fn overlaps(route: &Value) -> std::collections::HashMap<u64, u64> {
    route["scores"]
        .as_array()
        .unwrap_or_else(|| panic!("no scores in {route}"))
        .iter()
        .map(|s| {
            (
                s["worker_id"].as_u64().unwrap(),
                s["overlap_blocks"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test]
async fn an_image_matches_only_the_worker_that_cached_it() {
    let router = RouterProcess::start(
        "tokenizer = \"tiktoken:cl100k_base\"\n[scheduler]\npredicted_bridge_ms = 0\n",
    );
    let sim = SimFleet::start(Some(&router.grpc), 2);
    wait_registered(&router, 2).await;
    let system = "You describe pictures carefully and briefly. ".repeat(20);
    let after = "Answer in one long sentence with plenty of words. ".repeat(6);
    let chat = |image: &str| {
        json!({"model": "sim-model", "max_tokens": 2, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": format!("https://example.com/{image}.png")}},
                {"type": "text", "text": after}
            ]}
        ]})
    };
    let http = Http::default();
    let completions = format!("{}/v1/chat/completions", router.http);
    let (cat_worker, dog_worker) = (sim.workers[0].0, sim.workers[1].0);
    for (image, worker) in [("cat", cat_worker), ("dog", dog_worker)] {
        let pin = worker.to_string();
        let reply = http
            .call(
                "POST",
                &completions,
                &[("x-kvroute-worker", &pin)],
                chat(image).to_string(),
            )
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let route_url = format!("{}/v1/route", router.http);
    let route = |image: &'static str| {
        let (http, url, body) = (http.clone(), route_url.clone(), chat(image));
        async move { http.post(&url, &body).await.json() }
    };
    // Both chains are indexed once each worker holds its image's whole prompt,
    // and each image then goes to its worker once the pinned requests' load
    // has left the load picture (a worker's report of them can come late).
    eventually("each image to go to the worker that cached it", || async {
        let (cat, dog) = (route("cat").await, route("dog").await);
        let (cat_overlaps, dog_overlaps) = (overlaps(&cat), overlaps(&dog));
        cat_overlaps[&cat_worker] > cat_overlaps[&dog_worker]
            && dog_overlaps[&dog_worker] > dog_overlaps[&cat_worker]
            && cat["worker_id"] == cat_worker
            && dog["worker_id"] == dog_worker
    })
    .await;
    let cat = route("cat").await;
    assert_eq!(cat["worker_id"], cat_worker, "{cat}");
    let full = cat["overlap_blocks"].as_u64().unwrap();
    // Another image shares only the blocks before the image, on both workers.
    let bird = overlaps(&route("bird").await);
    let before_image = bird[&cat_worker];
    assert_eq!(bird[&dog_worker], before_image);
    assert!(
        before_image > 0 && before_image + 3 < full,
        "{bird:?} vs {full}"
    );
    assert_eq!(overlaps(&cat)[&dog_worker], before_image);
}
