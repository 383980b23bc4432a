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
async fn ingest_refuses_workers_without_a_client_certificate_and_plain_clients_fail_clearly() {
    let certs = Certs::generate();
    let router = RouterProcess::start(&certs.router_tls(true));
    let grpc = https(&router.grpc);

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

    // Plain HTTP to the HTTPS port gets a plain answer saying what to do.
    let reply = Http::default()
        .get(&format!("{}/healthz", router.http))
        .await;
    reply.assert_error(400, "plain_http_on_https_port");
    assert!(reply.text().contains("https://"), "{}", reply.text());
    let (status, _) = HttpsClient::new(&certs.ca)
        .call(
            "GET",
            &format!("{}/healthz", https(&router.http)),
            "".into(),
        )
        .await;
    assert_eq!(status, 200);
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
