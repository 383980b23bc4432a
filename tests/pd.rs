//! Prefill/decode disaggregation end to end: a real `kvroute serve` in front of
//! `kvroute sim` prefill and decode engines, in vLLM's and SGLang's
//! conventions. What each test checks of the KV: the prefill engine's leases
//! were all taken by a decode engine (none freed by its lease timeout, which
//! the tests set short so that a stranded lease would show), and the router's
//! bookings all returned.

mod common;

use common::{Http, Process, RouterProcess, eventually, kvroute, metric, wait_registered};
use serde_json::{Value, json};
use std::process::Stdio;

/// The tests' router settings: the engines' tokenizer (chat prompts are
/// text), prompts of 32 tokens and more disaggregate, and a decode engine
/// serves alone only a prompt it holds whole.
const ROUTER: &str = "tokenizer = \"tiktoken:cl100k_base\"\n\
    [disaggregation]\nmin_prompt_tokens = 32\nmax_local_prefill_tokens = 0\n";

/// A `kvroute sim` engine: its id, base URL and role.
struct Engine {
    id: u64,
    url: String,
    role: String,
}

/// `prefill` prefill engines and `decode` decode engines of `convention` in
/// one `kvroute sim`, streaming to `router`, with `extra` arguments.
fn pd_fleet(
    router: &RouterProcess,
    prefill: usize,
    decode: usize,
    convention: &str,
    extra: &[&str],
) -> (Process, Vec<Engine>) {
    let (p, d) = (prefill.to_string(), decode.to_string());
    let mut args = vec![
        "sim",
        "--prefill-workers",
        &p,
        "--decode-workers",
        &d,
        "--pd-convention",
        convention,
        "--block-size",
        "16",
        "--kv-blocks",
        "1024",
        "--load-report-ms",
        "50",
        "--kv-lease-timeout-secs",
        "2",
        "--bootstrap-timeout-secs",
        "2",
        "--router",
        &router.grpc,
    ];
    args.extend(extra);
    start_sim(&args, prefill + decode)
}

/// Starts `kvroute ARGS` and waits for its `n` engines' lines.
fn start_sim(args: &[&str], n: usize) -> (Process, Vec<Engine>) {
    let mut command = kvroute();
    command.args(args).stderr(Stdio::inherit());
    let process = Process::start(command, |lines| {
        lines.iter().filter(|l| l.starts_with("worker ")).count() == n
    });
    let engines = process
        .lines
        .iter()
        .filter_map(|line| {
            let mut parts = line.split(' ');
            parts.next()?;
            let id = parts.next()?.parse().ok()?;
            let url = parts.next()?.to_string();
            let role = parts
                .find_map(|p| p.strip_prefix("role="))
                .unwrap_or("aggregated")
                .to_string();
            Some(Engine { id, url, role })
        })
        .collect();
    (process, engines)
}

fn of_role<'a>(engines: &'a [Engine], role: &str) -> Vec<&'a Engine> {
    engines.iter().filter(|e| e.role == role).collect()
}

/// A prompt of `len` token ids from `start`.
fn prompt(start: u32, len: u32) -> Vec<u32> {
    (start..start + len).collect()
}

/// `name` summed over an engine's `/metrics`.
async fn engine_metric(engine: &Engine, name: &str) -> f64 {
    let text = Http::default()
        .get(&format!("{}/metrics", engine.url))
        .await
        .text();
    metric(&text, name, &[])
}

async fn router_metric(router: &RouterProcess, name: &str, labels: common::Labels<'_>) -> f64 {
    let text = Http::default()
        .get(&format!("{}/metrics", router.http))
        .await
        .text();
    metric(&text, name, labels)
}

/// Waits until no engine holds KV for a request (none running, no lease
/// held) and the router's bookings are all back to 0; then asserts that no
/// prefill engine freed a lease by its timeout and that every lease a
/// prefill engine made was taken by a decode engine.
async fn nothing_stranded(router: &RouterProcess, engines: &[Engine]) {
    let http = Http::default();
    eventually("the engines to hold no KV for a request", || async {
        for engine in engines {
            if engine_metric(engine, "kvroute_sim_kv_blocks_used").await != 0.0
                || engine_metric(engine, "kvroute_sim_running_requests").await != 0.0
            {
                return false;
            }
        }
        true
    })
    .await;
    eventually("the router's bookings to return to 0", || async {
        let workers = http.get(&format!("{}/workers", router.http)).await.json();
        workers["workers"].as_array().unwrap().iter().all(|w| {
            w["ranks"].as_array().unwrap().iter().all(|r| {
                r["inflight_requests"] == 0 && r["prefill_tokens"] == 0 && r["active_blocks"] == 0
            })
        })
    })
    .await;
    for engine in of_role(engines, "prefill") {
        assert_eq!(
            engine_metric(engine, "kvroute_sim_pd_lease_expired_blocks_total").await,
            0.0,
            "engine {} freed blocks by lease timeout",
            engine.id
        );
    }
}

/// Leases prefill engines made and decode engines took, over the fleet.
async fn handoffs(engines: &[Engine], role: &str) -> f64 {
    let mut sum = 0.0;
    for engine in of_role(engines, role) {
        sum += engine_metric(engine, "kvroute_sim_pd_handoffs_total").await;
    }
    sum
}

fn header(reply: &common::Reply, name: &str) -> Option<u64> {
    reply
        .headers
        .get(name)
        .map(|v| v.to_str().unwrap().parse().unwrap())
}

/// The body of a completions or chat request for `tokens` (chat: as text).
fn request(chat: bool, tokens: &[u32], stream: bool) -> (String, Value) {
    if chat {
        let words: Vec<String> = tokens.iter().map(|t| format!("word{t}")).collect();
        (
            "/v1/chat/completions".into(),
            json!({"model": "sim-model", "stream": stream, "max_tokens": 4,
                   "messages": [{"role": "user", "content": words.join(" ")}],
                   "an_unknown_field": {"passed": "through"}}),
        )
    } else {
        (
            "/v1/completions".into(),
            json!({"model": "sim-model", "stream": stream, "max_tokens": 4,
                   "prompt": tokens, "an_unknown_field": {"passed": "through"}}),
        )
    }
}

/// Completions and chat, streamed and not, through one prefill and one
/// decode engine of `convention`: each answered by the decode engine with
/// the prefill engine's KV.
async fn serves_every_kind(convention: &str) {
    let router = RouterProcess::start(ROUTER);
    let (_sim, engines) = pd_fleet(&router, 1, 1, convention, &["--speedup", "100"]);
    wait_registered(&router, 2).await;
    let (prefill, decode) = (
        of_role(&engines, "prefill")[0],
        of_role(&engines, "decode")[0],
    );
    let http = Http::default();
    let mut served = 0.0;
    for (i, (chat, stream)) in [(false, false), (false, true), (true, false), (true, true)]
        .into_iter()
        .enumerate()
    {
        let (path, body) = request(chat, &prompt(1000 * i as u32, 64), stream);
        let reply = http.post(&format!("{}{path}", router.http), &body).await;
        assert_eq!(
            reply.status,
            200,
            "{convention} {path} stream={stream}: {}",
            reply.text()
        );
        assert_eq!(header(&reply, "x-kvroute-worker"), Some(decode.id));
        assert_eq!(header(&reply, "x-kvroute-prefill-worker"), Some(prefill.id));
        let text = reply.text();
        if stream {
            assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        } else {
            let answer = reply.json();
            assert!(answer["choices"][0].is_object(), "{answer}");
            // The decode engine counts the handed-over prompt as cached.
            let cached = &answer["usage"]["prompt_tokens_details"]["cached_tokens"];
            assert!(cached.as_u64().is_some_and(|c| c > 0), "{answer}");
        }
        served += 1.0;
        assert_eq!(
            handoffs(&engines, "decode").await,
            served,
            "{path} stream={stream}"
        );
    }
    assert_eq!(
        router_metric(
            &router,
            "kvroute_pd_requests_total",
            &[("path", "disaggregated")]
        )
        .await,
        4.0
    );
    assert_eq!(
        router_metric(&router, "kvroute_pd_handoff_failures_total", &[]).await,
        0.0
    );
    nothing_stranded(&router, &engines).await;
}

#[tokio::test]
async fn the_vllm_convention_serves_completions_and_chat_streamed_and_not() {
    serves_every_kind("vllm").await;
}

#[tokio::test]
async fn the_sglang_convention_serves_completions_and_chat_streamed_and_not() {
    serves_every_kind("sglang").await;
}

#[tokio::test]
async fn n_above_1_short_prompts_and_prompts_the_decode_engine_holds_go_decode_only() {
    let router = RouterProcess::start(ROUTER);
    let (_sim, engines) = pd_fleet(&router, 1, 1, "vllm", &["--speedup", "100"]);
    wait_registered(&router, 2).await;
    let decode = of_role(&engines, "decode")[0];
    let http = Http::default();
    let url = format!("{}/v1/completions", router.http);
    let decode_only = |reply: &common::Reply| {
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(header(reply, "x-kvroute-worker"), Some(decode.id));
        assert_eq!(header(reply, "x-kvroute-prefill-worker"), None);
    };
    let short = json!({"model": "sim-model", "prompt": prompt(0, 20), "max_tokens": 2});
    decode_only(&http.post(&url, &short).await);
    let several = json!({"model": "sim-model", "prompt": prompt(100, 64), "max_tokens": 2, "n": 2});
    decode_only(&http.post(&url, &several).await);
    assert_eq!(handoffs(&engines, "decode").await, 0.0);

    // 4 whole blocks: handed over once, then held by the decode engine, whose
    // events tell the router so; the same prompt again is its alone.
    let whole = json!({"model": "sim-model", "prompt": prompt(200, 64), "max_tokens": 2});
    let first = http.post(&url, &whole).await;
    assert!(header(&first, "x-kvroute-prefill-worker").is_some());
    let route = format!("{}/v1/route", router.http);
    eventually("the decode engine's events to reach the router", || async {
        http.post(&route, &whole).await.json()["overlap_blocks"] == 4
    })
    .await;
    decode_only(&http.post(&url, &whole).await);
    assert_eq!(
        router_metric(
            &router,
            "kvroute_pd_requests_total",
            &[("path", "decode_only")]
        )
        .await,
        3.0
    );
    nothing_stranded(&router, &engines).await;
}

/// Where a client leaves a disaggregated request.
#[derive(Clone, Copy, Debug)]
enum Leaves {
    /// While the prefill engine computes its prompt. In the vLLM convention
    /// the router finds the client gone once the prefill answer is in, with
    /// `kv_transfer_params` in hand: between the legs.
    BeforeThePrefillAnswer,
    /// After the first streamed chunk of the decode engine's answer.
    DuringDecode,
}

/// A client leaves a request at `when`: the engines end up holding nothing
/// for it, no lease expires, and the router's bookings return to 0.
async fn a_client_leaving(convention: &str, when: Leaves) {
    let router = RouterProcess::start(ROUTER);
    let (_sim, engines) = pd_fleet(&router, 1, 1, convention, &["--speedup", "1"]);
    wait_registered(&router, 2).await;
    let prefill = of_role(&engines, "prefill")[0];
    let url = format!("{}/v1/completions", router.http);
    let http = Http::default();
    match when {
        Leaves::BeforeThePrefillAnswer => {
            let body = json!({"model": "sim-model", "prompt": prompt(0, 8000), "max_tokens": 2000});
            let client = tokio::spawn({
                let http = http.clone();
                async move { http.post(&url, &body).await }
            });
            eventually("the prefill engine to take the prompt", || async {
                engine_metric(prefill, "kvroute_sim_requests_total").await >= 1.0
            })
            .await;
            client.abort();
            let _ = client.await;
        }
        Leaves::DuringDecode => {
            let body = json!({"model": "sim-model", "prompt": prompt(0, 64), "max_tokens": 2000,
                              "stream": true});
            let response = http.send("POST", &url, &[], body.to_string()).await;
            assert_eq!(response.status(), 200);
            let mut incoming = response.into_body();
            let first = http_body_util::BodyExt::frame(&mut incoming)
                .await
                .unwrap()
                .unwrap();
            assert!(first.into_data().unwrap().starts_with(b"data: "));
            drop(incoming);
        }
    }
    nothing_stranded(&router, &engines).await;
    assert_eq!(
        handoffs(&engines, "prefill").await,
        handoffs(&engines, "decode").await,
        "{when:?}: every lease made was taken"
    );
}

#[tokio::test]
async fn a_vllm_client_leaving_before_the_prefill_answer_strands_no_kv() {
    a_client_leaving("vllm", Leaves::BeforeThePrefillAnswer).await;
}

#[tokio::test]
async fn a_vllm_client_leaving_during_decode_strands_no_kv() {
    a_client_leaving("vllm", Leaves::DuringDecode).await;
}

#[tokio::test]
async fn an_sglang_client_leaving_before_the_prefill_answer_strands_no_kv() {
    a_client_leaving("sglang", Leaves::BeforeThePrefillAnswer).await;
}

#[tokio::test]
async fn an_sglang_client_leaving_during_decode_strands_no_kv() {
    a_client_leaving("sglang", Leaves::DuringDecode).await;
}

/// A static prefill worker at `base_url`, of the vLLM convention.
fn static_prefill(id: u64, base_url: &str) -> String {
    format!(
        "[[workers]]\nid = {id}\nbase_url = \"{base_url}\"\nmodels = [\"sim-model\"]\n\
         role = \"prefill\"\npd_convention = \"vllm\"\n"
    )
}

#[tokio::test]
async fn a_failed_prefill_is_retried_on_another_prefill_worker() {
    let dead = format!("http://127.0.0.1:{}", common::free_ports(1));
    let router = RouterProcess::start(&format!("{ROUTER}{}", static_prefill(99, &dead)));
    let (_sim, engines) = pd_fleet(&router, 1, 1, "vllm", &["--speedup", "100"]);
    wait_registered(&router, 2).await;
    let prefill = of_role(&engines, "prefill")[0];
    let http = Http::default();
    let url = format!("{}/v1/completions", router.http);
    // Ties on load go to the worker with the fewest blocks: the dead one,
    // until its breaker opens.
    for i in 0..8 {
        let body = json!({"model": "sim-model", "prompt": prompt(1000 * i, 64), "max_tokens": 2});
        let reply = http.post(&url, &body).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(header(&reply, "x-kvroute-prefill-worker"), Some(prefill.id));
        let tried_dead = router_metric(
            &router,
            "kvroute_routed_requests_total",
            &[("worker", "99")],
        )
        .await;
        if tried_dead > 0.0 {
            assert_eq!(
                router_metric(&router, "kvroute_pd_handoff_failures_total", &[]).await,
                0.0
            );
            nothing_stranded(&router, &engines).await;
            return;
        }
    }
    panic!("the dead prefill worker was never tried");
}

#[tokio::test]
async fn with_every_prefill_worker_failing_the_decode_worker_serves_alone() {
    let dead = format!("http://127.0.0.1:{}", common::free_ports(1));
    let router = RouterProcess::start(&format!("{ROUTER}{}", static_prefill(99, &dead)));
    let (_sim, engines) = start_sim(
        &[
            "sim",
            "--role",
            "decode",
            "--workers",
            "1",
            "--block-size",
            "16",
            "--speedup",
            "100",
            "--router",
            &router.grpc,
        ],
        1,
    );
    wait_registered(&router, 1).await;
    let http = Http::default();
    let body = json!({"model": "sim-model", "prompt": prompt(0, 64), "max_tokens": 2});
    let reply = http
        .post(&format!("{}/v1/completions", router.http), &body)
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(header(&reply, "x-kvroute-worker"), Some(engines[0].id));
    assert_eq!(header(&reply, "x-kvroute-prefill-worker"), None);
    assert_eq!(
        router_metric(
            &router,
            "kvroute_pd_handoff_failures_total",
            &[("reason", "prefill_failed")]
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn a_prefill_answer_without_kv_transfer_params_is_computed_by_the_decode_worker() {
    // An aggregated engine answers a prefill leg without kv_transfer_params.
    let (_aggregated, plain) = start_sim(&["sim", "--workers", "1", "--block-size", "16"], 1);
    let router = RouterProcess::start(&format!("{ROUTER}{}", static_prefill(99, &plain[0].url)));
    let (_sim, engines) = start_sim(
        &[
            "sim",
            "--role",
            "decode",
            "--workers",
            "1",
            "--block-size",
            "16",
            "--speedup",
            "100",
            "--router",
            &router.grpc,
        ],
        1,
    );
    wait_registered(&router, 1).await;
    let http = Http::default();
    let body = json!({"model": "sim-model", "prompt": prompt(0, 64), "max_tokens": 3});
    let reply = http
        .post(&format!("{}/v1/completions", router.http), &body)
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(header(&reply, "x-kvroute-worker"), Some(engines[0].id));
    assert_eq!(
        reply.json()["usage"]["completion_tokens"],
        3,
        "the client's own body"
    );
    assert_eq!(
        router_metric(
            &router,
            "kvroute_pd_handoff_failures_total",
            &[("reason", "no_kv_transfer_params")]
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn replicas_serve_a_disaggregated_fleet_from_the_shared_registrations() {
    let nats = common::NatsServer::start();
    let routers: Vec<RouterProcess> = (0..2)
        .map(|i| {
            RouterProcess::start(&format!(
                "{ROUTER}{}",
                nats.cluster_config(&format!("r{i}"))
            ))
        })
        .collect();
    // The engines stream to the first replica; the second knows their roles
    // from the registrations the replicas share.
    let (_sim, engines) = pd_fleet(&routers[0], 1, 1, "vllm", &["--speedup", "100"]);
    for router in &routers {
        wait_registered(router, 2).await;
    }
    let (prefill, decode) = (
        of_role(&engines, "prefill")[0],
        of_role(&engines, "decode")[0],
    );
    let http = Http::default();
    for (i, router) in routers.iter().enumerate() {
        for (j, stream) in [false, true].into_iter().enumerate() {
            let (path, body) = request(
                false,
                &prompt(10_000 * i as u32 + 1000 * j as u32, 64),
                stream,
            );
            let reply = http.post(&format!("{}{path}", router.http), &body).await;
            assert_eq!(reply.status, 200, "replica {i}: {}", reply.text());
            assert_eq!(header(&reply, "x-kvroute-worker"), Some(decode.id));
            assert_eq!(header(&reply, "x-kvroute-prefill-worker"), Some(prefill.id));
        }
    }
    assert_eq!(handoffs(&engines, "decode").await, 4.0);
    for router in &routers {
        nothing_stranded(router, &engines).await;
    }
}
