//! Attacks through ingest: see tests/adversarial.rs. A worker, or whoever
//! holds a worker token, sends what no engine would: messages that cost far
//! more decoded than on the wire, floods of warnings, dumps that never end,
//! registrations of ids that are in use, and base URLs that point the router
//! elsewhere.

use kvroute_proto::{EventBatch, KvEvent, kv_event, worker_message};

use crate::common::*;

async fn connect_as(
    router: &RouterProcess,
    token: Option<&str>,
    id: u64,
    instance_id: u64,
    base_url: &str,
) -> Result<GrpcWorker, tonic::Status> {
    let mut register = register(id, base_url, &["m"], BLOCK_SIZE as u32);
    register.instance_id = instance_id;
    GrpcWorker::connect(&router.grpc, token, register).await
}

async fn connect(router: &RouterProcess, id: u64) -> Result<GrpcWorker, tonic::Status> {
    connect_as(
        router,
        None,
        id,
        1,
        &format!("http://127.0.0.1:{}", 9000 + id),
    )
    .await
}

fn assert_refused(status: &tonic::Status, code: tonic::Code, naming: &str) {
    assert_eq!(status.code(), code, "{status}");
    assert!(status.message().contains(naming), "{status}");
}

fn empty_events(n: usize) -> worker_message::Body {
    worker_message::Body::Events(EventBatch {
        dp_rank: 0,
        events: vec![KvEvent::default(); n],
    })
}

/// Attack 7: empty `KvEvent`s are 2 bytes on the wire and ~28 times that
/// decoded, so a queue capped in wire bytes held gigabytes. Now a batch is
/// queued at its decoded size: one that alone is over the whole queue (128 KiB
/// sent, several MiB decoded, against a 1 MiB queue) ends the stream, and what
/// the worker had indexed stays.
#[tokio::test]
async fn empty_events_are_counted_at_their_decoded_size() {
    let router = RouterProcess::start(
        "[ingest]\nevent_queue_bytes = 1048576\n[limits]\nmax_grpc_message_bytes = 1048576\n",
    );
    let mut worker = connect(&router, 1).await.unwrap();
    let kept = worker.store(&tokens(0, 64)).await;
    worker.send(empty_events(65_536)).await;
    let status = end_of(&mut worker).await;
    assert_refused(
        &status,
        tonic::Code::ResourceExhausted,
        "ingest.event_queue_bytes",
    );
    assert_eq!(refusals(&router, "event_queue_bytes").await, 1.0);
    assert_eq!(indexed(&router, 1).await.0, kept.len() as u64);
}

/// Attack 8: events without a kind, and batches for a rank the worker never
/// registered, each wrote a WARN line: 10 MiB in, millions of lines out. Now a
/// batch's kindless events make one warning, a stream logs at most 10 per
/// 10 s, and the rest are counted and summed up in one line.
#[tokio::test]
async fn a_flood_of_bad_events_writes_a_bounded_log_with_the_count_left_out() {
    let log = std::env::temp_dir().join(format!("kvroute-adv-ingest-{}.log", std::process::id()));
    let router = RouterProcess::start_logging("127.0.0.1:0", "", Some(&log));
    let mut worker = connect(&router, 1).await.unwrap();
    // 5,000 batches of 1,000 kindless events: 10 MB.
    let (kindless, unregistered) = (5_000, 1_000);
    for _ in 0..kindless {
        worker.send(empty_events(1_000)).await;
    }
    for id in 0..unregistered {
        worker
            .send(worker_message::Body::Events(EventBatch {
                dp_rank: 7,
                events: vec![KvEvent {
                    event_id: id,
                    kind: Some(kv_event::Kind::Cleared(kvroute_proto::Cleared {})),
                    ..KvEvent::default()
                }],
            }))
            .await;
    }
    // Applied in order: once this is acked, every warning above was raised.
    worker.store(&tokens(0, 64)).await;
    drop(worker);
    // A run slower than the warning interval sums up mid-stream as well: wait
    // for the summary of the stream's end, the one that brings the count whole.
    let read = || std::fs::read_to_string(&log).unwrap();
    let total = kindless + unregistered;
    eventually("the suppressed warnings to be summed up", || async {
        let (shown, suppressed) = warning_counts(&read());
        shown + suppressed >= total
    })
    .await;
    let text = read();
    let lines: Vec<&str> = text.lines().collect();
    let (shown, suppressed) = warning_counts(&text);
    assert!(lines.len() <= 40, "{} lines:\n{text}", lines.len());
    assert!(shown <= 20, "{shown} warnings shown");
    assert_eq!(shown + suppressed, total, "{text}");
    assert_eq!(
        refusals(&router, "stream_warnings").await,
        suppressed as f64
    );
    let _ = std::fs::remove_file(&log);
}

/// In a router's log: the warnings about bad events shown, and the count of
/// those suppressed that the summary lines give.
fn warning_counts(text: &str) -> (u64, u64) {
    let lines = text.lines();
    let shown = lines
        .clone()
        .filter(|l| l.contains("without a kind") || l.contains("was not registered"))
        .count();
    let suppressed = lines
        .filter_map(|l| {
            let words = l
                .split(" more warnings of this stream were suppressed")
                .next()?;
            l.contains("were suppressed")
                .then(|| words.rsplit(' ').next()?.parse::<u64>().ok())?
        })
        .sum();
    (shown as u64, suppressed)
}

/// Sends `n` parts of 100 blocks each of a dump of rank 0 that never finishes
/// (`more` set), until the router closes the stream.
async fn send_endless_parts(worker: &mut GrpcWorker, n: u32) {
    for i in 0..n {
        let (chain, _) = worker.chain(&tokens(10_000 * (i + 1), BLOCK_SIZE * 100));
        let part = dump(1, vec![chain], true);
        if !worker.try_send(part).await {
            return;
        }
    }
}

/// Attack 9: dump parts with `more` set for ever were held per rank up to
/// `index.max_blocks`. Now unfinished parts are capped per worker and over all
/// workers: past either the stream ends with RESOURCE_EXHAUSTED, the parts are
/// dropped, and a dump that does finish is applied as before.
#[tokio::test]
async fn dump_parts_that_never_finish_are_refused_past_the_budgets() {
    // A 100-block part holds about 2 KiB: 32 of them fill a worker's budget.
    let router = RouterProcess::start(
        "[ingest]\ndump_parts_bytes_per_worker = 65536\ndump_parts_bytes = 98304\n",
    );
    let mut one = connect(&router, 1).await.unwrap();
    let kept = one.store(&tokens(0, 64)).await;
    send_endless_parts(&mut one, 200).await;
    let status = end_of(&mut one).await;
    assert_refused(
        &status,
        tonic::Code::ResourceExhausted,
        "ingest.dump_parts_bytes_per_worker",
    );
    assert_eq!(refusals(&router, "dump_parts_bytes_per_worker").await, 1.0);
    assert_eq!(indexed(&router, 1).await.0, kept.len() as u64);

    // Worker 2 holds 20 parts (under its own budget), acked through its rank 1.
    let mut two_ranks = register(2, "http://127.0.0.1:9002", &["m"], BLOCK_SIZE as u32);
    two_ranks.dp_ranks = vec![0, 1];
    let mut two = GrpcWorker::connect(&router.grpc, None, two_ranks)
        .await
        .unwrap();
    send_endless_parts(&mut two, 20).await;
    let (chain, _) = two.chain(&tokens(5, 64));
    let id = two
        .event_on(1, None, kv_event::Kind::Stored(chain), false)
        .await;
    two.wait_ack(id).await;
    // Worker 3, under its own budget too, runs into everyone's.
    let mut three = connect(&router, 3).await.unwrap();
    send_endless_parts(&mut three, 30).await;
    let status = end_of(&mut three).await;
    assert_refused(
        &status,
        tonic::Code::ResourceExhausted,
        "(ingest.dump_parts_bytes)",
    );
    assert_eq!(refusals(&router, "dump_parts_bytes").await, 1.0);
    // Worker 2's dump finishes and applies: its parts and the last one.
    let (chain, _) = two.chain(&tokens(900_000, BLOCK_SIZE * 4));
    send_dump(&two, 1, vec![chain], false).await;
    two.wait_ack(1).await;
    assert_eq!(indexed(&router, 2).await.0, 20 * 100 + 4);
}

/// Attack 11a: with one shared worker token, re-registering a live worker's id
/// as another instance took over its traffic. Now the live stream keeps the id:
/// the newcomer is refused (ALREADY_EXISTS, counted) and clients' requests
/// keep going to the first worker, until an operator removes it.
#[tokio::test]
async fn a_live_worker_id_is_not_taken_over_by_another_instance() {
    let router =
        RouterProcess::start("[auth]\nworker_token = \"fleet\"\nadmin_token = \"admin\"\n");
    let real = TestWorker::start(1).await;
    let thief = TestWorker::start(1).await;
    let _first = connect_as(&router, Some("fleet"), 1, 7, &real.url)
        .await
        .unwrap();
    let status = connect_as(&router, Some("fleet"), 1, 666, &thief.url)
        .await
        .err()
        .expect("the takeover is refused");
    assert_refused(&status, tonic::Code::AlreadyExists, "DELETE /workers/1");
    assert_eq!(refusals(&router, "live_worker_id").await, 1.0);
    let http = Http::default();
    for i in 0..20 {
        let reply = http
            .post(
                &format!("{}/v1/completions", router.http),
                &completion("m", &tokens(i * 100, 32)),
            )
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    assert_eq!((real.received(), thief.received()), (20, 0));

    // An operator's removal frees the id for another instance.
    let removed = http
        .call(
            "DELETE",
            &format!("{}/workers/1", router.http),
            &[("authorization", "Bearer admin")],
            "",
        )
        .await;
    assert!(removed.status.is_success(), "{}", removed.text());
    connect_as(&router, Some("fleet"), 1, 666, &thief.url)
        .await
        .expect("registered after the removal");
}

/// Attack 13: one token could open every `max_streams` slot and register every
/// `max_workers` one, and its closed registrations held theirs for the grace
/// period. Now each token has its share, and a closed registration gives its
/// slot to the token's next worker.
#[tokio::test]
async fn one_token_cannot_take_every_stream_or_worker_slot() {
    let router = RouterProcess::start(
        "[ingest]\ngrace_period_ms = 600000\n\
         [limits]\nmax_streams = 3\nmax_streams_per_token = 2\nmax_workers_per_token = 2\n\
         [[auth.bound_worker_tokens]]\ntoken = \"a\"\nworker_ids = [1, 2, 3, 4]\n\
         [[auth.bound_worker_tokens]]\ntoken = \"b\"\nworker_ids = [11, 12]\n",
    );
    let url = |id: u64| format!("http://127.0.0.1:{}", 9000 + id);
    let _one = connect_as(&router, Some("a"), 1, 1, &url(1)).await.unwrap();
    let two = connect_as(&router, Some("a"), 2, 1, &url(2)).await.unwrap();
    let status = connect_as(&router, Some("a"), 3, 1, &url(3))
        .await
        .err()
        .expect("token a has its share of streams");
    assert_refused(
        &status,
        tonic::Code::ResourceExhausted,
        "limits.max_streams_per_token",
    );
    assert_eq!(refusals(&router, "streams_per_token").await, 1.0);
    // Token b still gets in; the global limit still holds.
    let _eleven = connect_as(&router, Some("b"), 11, 1, &url(11))
        .await
        .unwrap();
    let status = connect_as(&router, Some("b"), 12, 1, &url(12))
        .await
        .err()
        .expect("max_streams is reached");
    assert_refused(
        &status,
        tonic::Code::ResourceExhausted,
        "(limits.max_streams)",
    );

    // Worker 2 closes: in its grace period it holds no slot token a needs.
    drop(two);
    let http = Http::default();
    eventually("worker 2 to be disconnected", || async {
        let info = http.get(&format!("{}/workers/2", router.http)).await.json();
        info["worker"]["state"] == "disconnected"
    })
    .await;
    connect_as(&router, Some("a"), 3, 1, &url(3))
        .await
        .expect("worker 3 takes the closed registration's slot");
    let gone = http.get(&format!("{}/workers/2", router.http)).await;
    assert_eq!(gone.status, 404, "{}", gone.text());
}

/// Attack 14: `base_url` took link-local and metadata addresses, user:pw@,
/// queries and 0.0.0.0, and health checks and prompts went there. Each form is
/// now refused, naming the rule without echoing the secret.
#[tokio::test]
async fn base_urls_aimed_elsewhere_are_refused_naming_the_rule() {
    let router = RouterProcess::start("[limits]\nallowed_base_url_addresses = [\"169.254.7.7\"]\n");
    let refused = [
        ("http://169.254.169.254/latest/meta-data", "metadata"),
        ("http://[fd00:ec2::254]:80", "metadata"),
        ("http://100.100.100.200", "metadata"),
        ("http://169.254.1.1:8000", "link-local"),
        ("http://[fe80::1]:8000", "link-local"),
        ("http://0.0.0.0:8000", "unspecified"),
        ("http://[::]:8000", "unspecified"),
        ("http://2852039166:80", "a number"),
        ("http://admin:s3cret@10.0.0.5:8000", "user or password"),
        ("http://10.0.0.5:8000/v1?token=s3cret", "?query"),
        ("http://10.0.0.5:8000/#s3cret", "#fragment"),
        ("gopher://10.0.0.5:70", "http:// or https://"),
    ];
    for (i, (url, rule)) in refused.iter().enumerate() {
        let status = connect_as(&router, None, i as u64 + 1, 1, url)
            .await
            .err()
            .unwrap_or_else(|| panic!("{url} was accepted"));
        assert_refused(&status, tonic::Code::InvalidArgument, rule);
        assert!(!status.message().contains("s3cret"), "{url}: {status}");
    }
    assert_eq!(refusals(&router, "base_url").await, refused.len() as f64);
    // An address the operator allowed is accepted.
    connect_as(&router, None, 100, 1, "http://169.254.7.7:8000")
        .await
        .expect("an allowed link-local address");
}
