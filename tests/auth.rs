//! Secure by default, end to end: the real `kvroute serve` with worker and admin
//! tokens, real gRPC streams and the real simulator, over loopback; and the
//! refusal to serve a public address without tokens.

mod common;

use std::process::Stdio;

use common::*;
use kvroute_proto::kv_router_client::KvRouterClient;
use kvroute_proto::{RouteRequest, TokenIds, route_request};

const WORKER: &str = "worker-token-1";
const ADMIN: &str = "admin-token-1";

fn tokens_config() -> String {
    format!("[auth]\nworker_token = \"{WORKER}\"\nadmin_token = \"{ADMIN}\"\n")
}

/// The `Route` RPC with `authorization` set to `bearer`, if any.
async fn route_rpc(router: &RouterProcess, bearer: Option<&str>) -> Result<u64, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(router.grpc.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut request = tonic::Request::new(RouteRequest {
        model: "m".into(),
        lora_name: String::new(),
        input: Some(route_request::Input::TokenIds(TokenIds {
            ids: tokens(1, 64),
        })),
    });
    if let Some(bearer) = bearer {
        request
            .metadata_mut()
            .insert("authorization", bearer.parse().unwrap());
    }
    let response = KvRouterClient::new(channel).route(request).await?;
    Ok(response.into_inner().worker_id)
}

#[tokio::test]
async fn worker_and_admin_tokens_are_separate_credentials() {
    let router = RouterProcess::start(&tokens_config());
    let worker = TestWorker::start(1).await;
    let reg = || register(1, &worker.url, &["m"], BLOCK_SIZE as u32);
    // Ingest takes the worker token only.
    for token in [None, Some("wrong"), Some(ADMIN)] {
        let err = GrpcWorker::connect(&router.grpc, token, reg())
            .await
            .err()
            .expect("refused");
        assert_eq!(err.code(), tonic::Code::Unauthenticated, "{token:?}");
    }
    let _stream = GrpcWorker::connect(&router.grpc, Some(WORKER), reg())
        .await
        .unwrap();

    // The Route RPC writes predictions: the admin token only; `bearer` in any case.
    for bearer in [None, Some(format!("Bearer {WORKER}"))] {
        let err = route_rpc(&router, bearer.as_deref()).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated, "{bearer:?}");
    }
    let lowercase = format!("bearer {ADMIN}");
    assert_eq!(route_rpc(&router, Some(&lowercase)).await.unwrap(), 1);

    // Admin endpoints: 401 with WWW-Authenticate, the admin token only.
    let http = Http::default();
    let workers = format!("{}/workers", router.http);
    let worker_bearer = format!("Bearer {WORKER}");
    for headers in [vec![], vec![("authorization", worker_bearer.as_str())]] {
        let reply = http.call("GET", &workers, &headers, "").await;
        reply.assert_error(401, "invalid_api_key");
        let challenge = reply.headers["www-authenticate"].to_str().unwrap();
        assert!(challenge.starts_with("Bearer"), "{challenge}");
    }
    let admin_bearer = format!("BEARER {ADMIN}");
    let admin = [("authorization", admin_bearer.as_str())];
    let ok = http.call("GET", &workers, &admin, "").await;
    assert_eq!(ok.status, 200);
    assert_eq!(ok.json()["workers"][0]["state"], "connected");

    // Clients route without a token, but may neither pin nor see worker URLs.
    let body = completion("m", &[1, 2, 3]).to_string();
    let completions = format!("{}/v1/completions", router.http);
    let reply = http.call("POST", &completions, &[], body.clone()).await;
    assert_eq!(reply.status, 200);
    let pin = ("x-kvroute-worker", "1");
    http.call("POST", &completions, &[pin], body.clone())
        .await
        .assert_error(403, "forbidden");
    let route = format!("{}/v1/route", router.http);
    let open = http.call("POST", &route, &[], body.clone()).await.json();
    assert_eq!(open["worker_id"], 1);
    assert!(open.get("base_url").is_none(), "{open}");
    let pinned = http
        .call("POST", &completions, &[pin, admin[0]], body.clone())
        .await;
    assert_eq!(pinned.worker(), 1);
    let detailed = http.call("POST", &route, &admin, body).await.json();
    assert_eq!(detailed["base_url"], worker.url.as_str());

    let drained = http
        .call("POST", &format!("{workers}/1/drain"), &admin, "")
        .await;
    assert_eq!(drained.status, 200);
    http.post(&completions, &completion("m", &[1, 2, 3]))
        .await
        .assert_error(503, "no_worker_available");
}

#[tokio::test]
async fn clients_may_pin_when_the_config_says_so() {
    let router = RouterProcess::start(&format!("{}clients_may_pin = true\n", tokens_config()));
    let worker = TestWorker::start(4).await;
    let _stream = GrpcWorker::connect(
        &router.grpc,
        Some(WORKER),
        register(4, &worker.url, &["m"], BLOCK_SIZE as u32),
    )
    .await
    .unwrap();
    let http = Http::default();
    let body = completion("m", &[1, 2, 3]).to_string();
    let pinned = http
        .call(
            "POST",
            &format!("{}/v1/completions", router.http),
            &[("x-kvroute-worker", "4")],
            body.clone(),
        )
        .await;
    assert_eq!(pinned.worker(), 4);
    let route = http
        .call("POST", &format!("{}/v1/route", router.http), &[], body)
        .await
        .json();
    assert_eq!(route["base_url"], worker.url.as_str());
    // Still no admin endpoints for clients.
    http.get(&format!("{}/workers", router.http))
        .await
        .assert_error(401, "invalid_api_key");
}

#[tokio::test]
async fn a_bound_token_registers_only_its_ids_and_no_stream_takes_a_static_id() {
    let router = RouterProcess::start(&format!(
        "[auth]\nworker_token = \"{WORKER}\"\n\
         [[auth.bound_worker_tokens]]\ntoken = \"only-7\"\nworker_ids = [7]\n\
         [[workers]]\nid = 1\nbase_url = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n"
    ));
    let worker = TestWorker::start(7).await;
    let reg = |id| register(id, &worker.url, &["m"], BLOCK_SIZE as u32);
    let err = GrpcWorker::connect(&router.grpc, Some("only-7"), reg(8))
        .await
        .err()
        .expect("id 8 is not this token's");
    assert_eq!(err.code(), tonic::Code::PermissionDenied);
    assert!(err.message().contains("not 8"), "{}", err.message());
    let _seven = GrpcWorker::connect(&router.grpc, Some("only-7"), reg(7))
        .await
        .unwrap();
    let err = GrpcWorker::connect(&router.grpc, Some(WORKER), reg(1))
        .await
        .err()
        .expect("a static worker's id is never taken over");
    assert_eq!(err.code(), tonic::Code::PermissionDenied);
    assert!(err.message().contains("static"), "{}", err.message());
    // The static worker kept its URL.
    let http = Http::default();
    let info = http.get(&format!("{}/workers/1", router.http)).await.json();
    assert_eq!(info["worker"]["base_url"], "http://127.0.0.1:9");
    assert_eq!(info["worker"]["source"], "static");
}

#[tokio::test]
async fn the_simulator_registers_with_a_protected_router_using_its_worker_token() {
    let router = RouterProcess::start(&tokens_config());
    let _sims =
        SimFleet::start_with_env(Some(&router.grpc), 2, &[("KVROUTE_ROUTER_TOKEN", WORKER)]);
    let http = Http::default();
    let workers = format!("{}/workers", router.http);
    let bearer = format!("Bearer {ADMIN}");
    eventually("both simulated workers registered", || async {
        let reply = http
            .call("GET", &workers, &[("authorization", &bearer)], "")
            .await;
        reply.json()["workers"].as_array().map(Vec::len) == Some(2)
    })
    .await;
    let ready = http.get(&format!("{}/readyz", router.http)).await;
    assert_eq!(ready.status, 200);
}

/// `kvroute serve ARGS` with a clean environment plus `env`, its stderr in a file.
fn serve(args: &[&str], env: &[(&str, &str)]) -> (std::process::Command, std::path::PathBuf) {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let log = std::env::temp_dir().join(format!(
        "kvroute-auth-{}-{}.log",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"));
    command
        .arg("serve")
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .stderr(std::fs::File::create(&log).unwrap());
    (command, log)
}

fn read_log(path: &std::path::Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    std::fs::remove_file(path).unwrap();
    text
}

#[test]
fn serve_refuses_a_public_address_without_tokens_unless_insecure() {
    let public = ["--http-addr", "0.0.0.0:0", "--grpc-addr", "0.0.0.0:0"];
    let (mut command, log) = serve(&public, &[]);
    let mut child = command.stdout(Stdio::null()).spawn().unwrap();
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("served without tokens: {}", read_log(&log));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let text = read_log(&log);
    assert!(!status.success(), "{text}");
    for expected in ["auth.worker_token", "auth.admin_token", "--insecure"] {
        assert!(text.contains(expected), "{text}");
    }

    // The same from the config key, and a warning at start.
    let (command, log) = serve(&public, &[("KVROUTE_AUTH__INSECURE", "true")]);
    let router = Process::start(command, |lines| {
        lines.iter().any(|l| l.starts_with("listening "))
    });
    drop(router);
    assert!(read_log(&log).contains("insecure mode"));
    let mut insecure = public.to_vec();
    insecure.push("--insecure");
    let (command, log) = serve(&insecure, &[]);
    let router = Process::start(command, |lines| {
        lines.iter().any(|l| l.starts_with("listening "))
    });
    drop(router);
    let text = read_log(&log);
    assert!(
        text.contains("WARN") && text.contains("insecure mode"),
        "{text}"
    );
}

#[test]
fn foreign_variables_are_skipped_and_secrets_stay_out_of_the_log() {
    let (command, log) = serve(
        &["--http-addr", "0.0.0.0:0", "--grpc-addr", "0.0.0.0:0"],
        &[
            ("KVROUTE_LOG__LEVEL", "debug"),
            // The deprecated key still sets both tokens (so a public address is fine).
            ("KVROUTE_AUTH_TOKEN", "legacy-secret-value"),
            ("KVROUTE_ROUTER_TOKEN", "bridge-secret-value"),
            ("KVROUTE_PORT", "tcp://10.96.0.10:8000"),
        ],
    );
    let router = Process::start(command, |lines| {
        lines.iter().any(|l| l.starts_with("listening "))
    });
    drop(router);
    let text = read_log(&log);
    assert!(text.contains("auth_token is deprecated"), "{text}");
    for name in ["KVROUTE_ROUTER_TOKEN", "KVROUTE_PORT"] {
        assert!(
            text.contains(&format!("{name} names no configuration key")),
            "{text}"
        );
    }
    assert!(!text.contains("secret-value"), "{text}");
}
