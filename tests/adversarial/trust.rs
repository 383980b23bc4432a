//! Attacks through trust: see tests/adversarial.rs.
//!
//! A worker's KV events are claims the router routes on; a client's dry run
//! (`/v1/route`) reads what the router believes the caches hold.

use crate::common::*;

/// Demotion after 3 failed claims of the last 4 judged, so that each attack
/// takes a few requests.
const TRUST: &str = "[trust]\nclaim_window = 4\nmax_failed_claims = 3\n";

/// A worker whose events claim `prompt` and whose HTTP side reports `cached`
/// cached tokens (`None`: no usage at all), registered as `id` for `model`.
async fn claimant(
    router: &RouterProcess,
    id: u64,
    model: &str,
    cached: Option<u64>,
    prompt: &[u32],
) -> (TestWorker, GrpcWorker) {
    let http = TestWorker::start(id).await;
    http.report_cached_tokens(cached);
    let mut grpc = GrpcWorker::connect(
        &router.grpc,
        None,
        register(id, &http.url, &[model], BLOCK_SIZE as u32),
    )
    .await
    .unwrap();
    grpc.store(prompt).await;
    (http, grpc)
}

/// The router's `/metrics` text.
async fn metrics(router: &RouterProcess) -> String {
    Http::default()
        .get(&format!("{}/metrics", router.http))
        .await
        .text()
}

/// `series{worker="id"}` in the router's metrics.
async fn worker_metric(router: &RouterProcess, series: &str, id: u64) -> f64 {
    let id = id.to_string();
    metric(&metrics(router).await, series, &[("worker", &id)])
}

/// Sends a completion of `prompt` and returns the worker that served it.
async fn served_by(router: &RouterProcess, model: &str, prompt: &[u32]) -> u64 {
    let reply = Http::default()
        .post(
            &format!("{}/v1/completions", router.http),
            &completion(model, prompt),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.worker()
}

/// Attack 11b, prefix capture: a worker announces a prompt's blocks without
/// holding them, beside an honest engine, and answers with
/// `cached_tokens: 0`. It takes the prompt's first requests, is then demoted
/// (metric), and the prompt goes to the honest engine, which keeps it; a full
/// dump restores the claimant's credit.
#[tokio::test]
async fn a_worker_claiming_blocks_it_does_not_hold_is_demoted_until_a_dump() {
    let router = RouterProcess::start(TRUST);
    let sim = SimFleet::start(Some(&router.grpc), 1);
    let honest = sim.workers[0].0;
    let model = "sim-model";
    let prompt = tokens(1000, 8 * BLOCK_SIZE);
    let (liar, mut liar_grpc) = claimant(&router, 7, model, Some(0), &prompt).await;
    wait_registered(&router, 2).await;

    // The claim captures the prompt while its judged failures stay under 3 of 4.
    for _ in 0..3 {
        assert_eq!(served_by(&router, model, &prompt).await, 7);
    }
    eventually("the claimant to be demoted", || async {
        worker_metric(&router, "kvroute_worker_demoted", 7).await == 1.0
    })
    .await;
    assert_eq!(
        worker_metric(&router, "kvroute_worker_claims_failed_total", 7).await,
        3.0
    );

    // Its claim no longer counts: the honest engine takes the prompt, and its
    // own events (and truthful reports) keep it there.
    let captured = liar.received();
    for _ in 0..6 {
        assert_eq!(served_by(&router, model, &prompt).await, honest);
    }
    assert_eq!(liar.received(), captured);
    let text = metrics(&router).await;
    let honest_label = honest.to_string();
    let honest_labels = [("worker", honest_label.as_str())];
    assert_eq!(metric(&text, "kvroute_worker_demoted", &honest_labels), 0.0);
    assert_eq!(
        metric(&text, "kvroute_worker_claims_failed_total", &honest_labels),
        0.0
    );

    // A full dump replaces what the claimant is indexed with and restores its
    // credit: a prompt only it claims goes to it again.
    let other = tokens(50_000, 8 * BLOCK_SIZE);
    let (chain, _) = liar_grpc.chain(&other);
    send_dump(&liar_grpc, 1, vec![chain], false).await;
    liar_grpc.wait_ack(1).await;
    eventually("the dump to restore the claimant", || async {
        worker_metric(&router, "kvroute_worker_demoted", 7).await == 0.0
    })
    .await;
    assert_eq!(served_by(&router, model, &other).await, 7);
}

/// The same claim from a worker whose responses carry no `cached_tokens`
/// (vLLM without `--enable-prompt-tokens-details`): absence is not evidence,
/// so it keeps its prompt however many requests it serves; beside it a worker
/// reporting 0 for its own prompt is demoted within the same few requests.
#[tokio::test]
async fn a_worker_that_never_reports_cached_tokens_is_not_demoted() {
    let router = RouterProcess::start(TRUST);
    let silent_prompt = tokens(1000, 8 * BLOCK_SIZE);
    let lying_prompt = tokens(9000, 8 * BLOCK_SIZE);
    let (_silent, _silent_grpc) = claimant(&router, 1, "m", None, &silent_prompt).await;
    let (_liar, _liar_grpc) = claimant(&router, 2, "m", Some(0), &lying_prompt).await;
    wait_registered(&router, 2).await;

    for _ in 0..3 {
        assert_eq!(served_by(&router, "m", &lying_prompt).await, 2);
    }
    eventually("the reporting claimant to be demoted", || async {
        worker_metric(&router, "kvroute_worker_demoted", 2).await == 1.0
    })
    .await;
    // Twice the window of requests, every one on the silent worker's claim.
    for _ in 0..8 {
        assert_eq!(served_by(&router, "m", &silent_prompt).await, 1);
    }
    let text = metrics(&router).await;
    assert_eq!(
        metric(&text, "kvroute_worker_demoted", &[("worker", "1")]),
        0.0
    );
    assert_eq!(
        metric(
            &text,
            "kvroute_worker_claims_failed_total",
            &[("worker", "1")]
        ),
        0.0
    );
}

/// The `/v1/route` answer for `prompt` with `headers`.
async fn dry_run(
    router: &RouterProcess,
    headers: &[(&str, &str)],
    prompt: &[u32],
) -> serde_json::Value {
    let reply = Http::default()
        .call(
            "POST",
            &format!("{}/v1/route", router.http),
            headers,
            completion("m", prompt).to_string(),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()
}

/// Attack 12, the prefix-cache oracle: a client without the admin token asks
/// `/v1/route` about another tenant's prompt. It gets the decision, without
/// the overlaps that would confirm the prompt block by block; the admin, or
/// every client where `auth.clients_see_overlaps` allows it, gets them.
#[tokio::test]
async fn route_dry_runs_show_overlaps_only_to_admins_or_where_allowed() {
    const OVERLAPS: [&str; 4] = [
        "overlap_blocks",
        "offload_overlap_blocks",
        "predicted_hit_ratio",
        "scores",
    ];
    let prompt = tokens(1000, 8 * BLOCK_SIZE);
    for clients_see_overlaps in [false, true] {
        let router = RouterProcess::start(&format!(
            "[auth]\nadmin_token = \"admin\"\nclients_see_overlaps = {clients_see_overlaps}\n"
        ));
        let (_worker, _grpc) = claimant(&router, 3, "m", None, &prompt).await;

        let plain = dry_run(&router, &[], &prompt).await;
        assert_eq!(plain["worker_id"], 3, "{plain}");
        assert_eq!(plain["request_blocks"], 8, "{plain}");
        for field in OVERLAPS {
            assert_eq!(
                plain.get(field).is_some(),
                clients_see_overlaps,
                "{field} with clients_see_overlaps = {clients_see_overlaps}: {plain}"
            );
        }
        let wrong = dry_run(&router, &[("authorization", "Bearer nope")], &prompt).await;
        assert_eq!(
            wrong.get("scores").is_some(),
            clients_see_overlaps,
            "{wrong}"
        );

        let admin = dry_run(&router, &[("authorization", "Bearer admin")], &prompt).await;
        assert_eq!(admin["overlap_blocks"], 8, "{admin}");
        assert_eq!(admin["scores"][0]["overlap_blocks"], 8, "{admin}");
        assert!(admin["base_url"].is_string(), "{admin}");
    }
}
