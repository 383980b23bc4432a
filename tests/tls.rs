//! TLS end to end, with certificates made at run time (never committed keys):
//! the router's HTTPS API, gRPC ingest over TLS with client certificates (mTLS),
//! the router calling simulated engines that serve HTTPS, plain clients against
//! TLS ports, and a bad certificate file at start.

mod common;

use std::path::PathBuf;

use common::{
    Certs, Http, HttpsClient, RouterProcess, SimFleet, completion, eventually, https, tokens,
    toml_path,
};
use kvroute_proto::kv_router_client::KvRouterClient;
use kvroute_proto::{WorkerMessage, worker_message};
use kvroute_tls::GrpcClientTls;

/// Opens an event stream and registers worker `id`; the error if either fails.
async fn register_over(url: &str, tls: &GrpcClientTls, id: u64) -> Result<(), String> {
    let channel = kvroute_tls::grpc_endpoint(url, tls)
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    let register = common::register(id, "http://127.0.0.1:9", &["m"], 16);
    let messages = tokio_stream::iter([WorkerMessage {
        body: Some(worker_message::Body::Register(register)),
    }]);
    let mut replies = KvRouterClient::new(channel)
        .stream(messages)
        .await
        .map_err(|status| format!("stream: {status:?}"))?
        .into_inner();
    replies
        .message()
        .await
        .map_err(|status| format!("first reply: {status:?}"))?;
    Ok(())
}

#[tokio::test]
async fn https_api_mtls_ingest_and_https_workers_end_to_end() {
    let certs = Certs::generate();
    let router = RouterProcess::start(&format!(
        "[upstream]\nca_file = {}\n{}",
        toml_path(&certs.ca),
        certs.router_tls(true)
    ));
    let path = |p: &PathBuf| p.to_str().unwrap().to_string();
    let fleet = SimFleet::start_with(
        Some(&https(&router.grpc)),
        1,
        &[
            "--router-ca-file",
            &path(&certs.ca),
            "--router-cert-file",
            &path(&certs.client_cert),
            "--router-key-file",
            &path(&certs.client_key),
            "--tls-cert-file",
            &path(&certs.server_cert),
            "--tls-key-file",
            &path(&certs.server_key),
        ],
        &[],
    );
    let (worker, base_url) = fleet.workers[0].clone();
    assert!(base_url.starts_with("https://"), "{base_url}");

    // The worker's event stream came in over mTLS; the API answers over HTTPS.
    let client = HttpsClient::new(&certs.ca);
    let api = https(&router.http);
    eventually("the sim registered over gRPC TLS", || async {
        let (status, body) = client
            .call("GET", &format!("{api}/workers"), "".into())
            .await;
        status == 200
            && body["workers"]
                .as_array()
                .is_some_and(|w| w.iter().any(|w| w["state"] == "connected"))
    })
    .await;

    // The router proxies to the engine's https:// base URL.
    let (status, body) = client
        .call(
            "POST",
            &format!("{api}/v1/completions"),
            completion("sim-model", &tokens(0, 64)).to_string(),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(body["choices"][0]["text"].is_string(), "{body}");
    let (_, workers) = client
        .call("GET", &format!("{api}/workers"), "".into())
        .await;
    assert_eq!(workers["workers"][0]["id"], worker, "{workers}");
    assert_eq!(workers["workers"][0]["base_url"], base_url.as_str());
}

#[tokio::test]
async fn failed_handshakes_are_refused_counted_and_logged_once_per_interval() {
    let certs = Certs::generate();
    // Another CA: certificates the router does not trust, a client that does
    // not trust the router.
    let stranger = Certs::generate();
    let log = std::env::temp_dir().join(format!("kvroute-tls-log-{}.log", std::process::id()));
    let router = RouterProcess::start_logging("127.0.0.1:0", &certs.router_tls(true), Some(&log));
    let grpc = https(&router.grpc);
    let api = https(&router.http);

    // A TCP probe that closes without a byte is no failed handshake.
    drop(tokio::net::TcpStream::connect(router.http.trim_start_matches("http://")).await);

    // gRPC ingest: no client certificate, plain text, a certificate of another CA.
    let refused = register_over(&grpc, &certs.worker_tls(false), 1).await;
    assert!(
        refused.is_err(),
        "a worker without a client certificate registered"
    );
    register_over(&grpc, &certs.worker_tls(true), 2)
        .await
        .expect("a worker with a client certificate registers");
    let plain = register_over(&router.grpc, &GrpcClientTls::default(), 3).await;
    assert!(plain.is_err(), "plain gRPC reached the TLS ingest");
    let untrusted = GrpcClientTls {
        ca_file: Some(certs.ca.clone()),
        cert_file: Some(stranger.client_cert.clone()),
        key_file: Some(stranger.client_key.clone()),
    };
    let refused = register_over(&grpc, &untrusted, 4).await;
    assert!(refused.is_err(), "a certificate of another CA registered");

    // HTTPS API: plain HTTP gets a plain answer saying what to do; a client
    // that does not trust the router's CA gives up.
    let reply = Http::default()
        .get(&format!("{}/healthz", router.http))
        .await;
    reply.assert_error(400, "plain_http_on_https_port");
    assert!(reply.text().contains("https://"), "{}", reply.text());
    let distrustful = HttpsClient::new(&stranger.ca)
        .try_send("GET", &format!("{api}/healthz"), "".into())
        .await;
    assert!(distrustful.is_err(), "{distrustful:?}");
    let client = HttpsClient::new(&certs.ca);
    let (status, _) = client
        .call("GET", &format!("{api}/healthz"), "".into())
        .await;
    assert_eq!(status, 200);

    // Every failure counted (tonic's channel may try a refused handshake more
    // than once; the HTTPS client, and so the count, is exact), the probe not;
    // one log line per listener (the rest fall within
    // its interval), with the peer's address and rustls' reason.
    let failures = |text: &str, listener: &str| {
        common::metric(
            text,
            "kvroute_tls_handshake_failures_total",
            &[("listener", listener)],
        )
    };
    let metrics = || async {
        let (_, body) = client
            .try_send("GET", &format!("{api}/metrics"), "".into())
            .await
            .unwrap();
        String::from_utf8_lossy(&body).into_owned()
    };
    eventually("the failed handshakes counted and logged", || async {
        let text = metrics().await;
        let logged = std::fs::read_to_string(&log).unwrap_or_default();
        failures(&text, "grpc") >= 3.0
            && failures(&text, "http") >= 2.0
            && logged.matches("TLS handshake failed").count() >= 2
    })
    .await;
    let text = metrics().await;
    assert!(failures(&text, "grpc") >= 3.0, "{text}");
    assert_eq!(failures(&text, "http"), 2.0, "{text}");
    let text = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_file(&log);
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("TLS handshake failed"))
        .collect();
    assert_eq!(lines.len(), 2, "{text}");
    let grpc_line = lines
        .iter()
        .find(|l| l.contains("listener=\"grpc\""))
        .unwrap();
    assert!(
        grpc_line.contains("peer=127.0.0.1:") && grpc_line.contains("peer sent no certificates"),
        "{grpc_line}"
    );
    let http_line = lines
        .iter()
        .find(|l| l.contains("listener=\"http\""))
        .unwrap();
    assert!(
        http_line.contains("peer=127.0.0.1:") && http_line.contains("plain text, not TLS"),
        "{http_line}"
    );
}

#[test]
fn a_missing_certificate_file_stops_the_router_naming_it() {
    let dir = std::env::temp_dir().join(format!("kvroute-tls-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("router.toml");
    let missing = dir.join("missing-cert.pem");
    std::fs::write(
        &config,
        format!(
            "http_addr = \"127.0.0.1:0\"\ngrpc_addr = \"127.0.0.1:0\"\n[tls]\ncert_file = {}\nkey_file = {}\n",
            toml_path(&missing),
            toml_path(&dir.join("key.pem"))
        ),
    )
    .unwrap();
    let output = common::kvroute_output(&["serve", "--config", config.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("missing-cert.pem") && stderr.contains("tls"),
        "{stderr}"
    );
}
