//! TLS end to end, with certificates made at run time (never committed keys):
//! the router's HTTPS API, gRPC ingest over TLS with client certificates (mTLS),
//! the router calling simulated engines that serve HTTPS, plain clients against
//! TLS ports, and a bad certificate file at start.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use common::{Http, RouterProcess, SimFleet, completion, eventually, tokens};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_proto::kv_router_client::KvRouterClient;
use kvroute_proto::{WorkerMessage, worker_message};
use kvroute_tls::GrpcClientTls;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use serde_json::Value;

/// A test CA and the PEM files it signed, in a directory removed on drop.
struct Certs {
    dir: PathBuf,
    ca: PathBuf,
    /// For `localhost` and 127.0.0.1: the router's listeners and the engines' HTTPS.
    server_cert: PathBuf,
    server_key: PathBuf,
    /// A worker's client certificate.
    client_cert: PathBuf,
    client_key: PathBuf,
}

impl Certs {
    fn generate() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvroute-tls-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "kvroute test CA");
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let write = |name: &str, pem: String| {
            let path = dir.join(name);
            std::fs::write(&path, pem).unwrap();
            path
        };
        let leaf = |name: &str, sans: &[&str], usage: ExtendedKeyUsagePurpose| {
            let key = KeyPair::generate().unwrap();
            let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
            let mut params = CertificateParams::new(sans).unwrap();
            params.distinguished_name.push(DnType::CommonName, name);
            params.extended_key_usages = vec![usage];
            let cert = params.signed_by(&key, &ca).unwrap();
            (
                write(&format!("{name}.pem"), cert.pem()),
                write(&format!("{name}.key"), key.serialize_pem()),
            )
        };
        let (server_cert, server_key) = leaf(
            "server",
            &["localhost", "127.0.0.1"],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (client_cert, client_key) =
            leaf("worker", &["worker"], ExtendedKeyUsagePurpose::ClientAuth);
        let ca = write("ca.pem", ca.pem());
        Certs {
            dir,
            ca,
            server_cert,
            server_key,
            client_cert,
            client_key,
        }
    }

    /// The router's `[tls]` section; `mtls`: gRPC ingest requires client certificates.
    fn router_tls(&self, mtls: bool) -> String {
        let mut section = format!(
            "[tls]\ncert_file = {}\nkey_file = {}\n",
            toml_path(&self.server_cert),
            toml_path(&self.server_key)
        );
        if mtls {
            section += &format!("client_ca_file = {}\n", toml_path(&self.ca));
        }
        section
    }

    /// How a worker reaches the router: trusting the CA, with or without its certificate.
    fn worker_tls(&self, with_certificate: bool) -> GrpcClientTls {
        GrpcClientTls {
            ca_file: Some(self.ca.clone()),
            cert_file: with_certificate.then(|| self.client_cert.clone()),
            key_file: with_certificate.then(|| self.client_key.clone()),
        }
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn toml_path(path: &Path) -> String {
    Value::String(path.display().to_string()).to_string()
}

fn https(url: &str) -> String {
    url.replacen("http://", "https://", 1)
}

/// An HTTPS client trusting the test CA (and only the roots the router trusts).
struct HttpsClient(Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>);

impl HttpsClient {
    fn new(ca: &Path) -> Self {
        let tls = kvroute_tls::https_client_config(Some(ca)).unwrap();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_only()
            .enable_http1()
            .build();
        HttpsClient(Client::builder(TokioExecutor::new()).build(connector))
    }

    async fn call(&self, method: &str, url: &str, body: String) -> (u16, Value) {
        let request = http::Request::builder()
            .method(method)
            .uri(url)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let response = self.0.request(request).await.expect("an HTTPS response");
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }
}

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
