//! deploy/: the Kubernetes manifests start a router that gets ready, as the
//! kubelet would run it; they hold what operators rely on; the Dockerfile's
//! toolchain can build the workspace; and every Grafana query names series the
//! router really exports.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;

use common::{Http, Process, SimFleet, completion, eventually, free_ports, metric, tokens};
use serde_json::Value;

fn repo_file(path: &str) -> String {
    let full = format!("{}/{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
}

/// The documents of deploy/kubernetes/kvroute.yaml.
fn manifests() -> Vec<Value> {
    manifests_of("deploy/kubernetes/kvroute.yaml")
}

/// The documents of a YAML file of the repository.
fn manifests_of(path: &str) -> Vec<Value> {
    let text = repo_file(path);
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).expect("valid YAML"))
        .collect()
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn named<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    of_kind(docs, kind)
        .into_iter()
        .find(|d| d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} named {name}"))
}

/// The variables the kubelet injects into a pod for each Service (service links):
/// `{SVC}_SERVICE_HOST`, `{SVC}_SERVICE_PORT[_{NAME}]`, `{SVC}_PORT` and
/// `{SVC}_PORT_{port}_{PROTO}[_PROTO|_PORT|_ADDR]`, `SVC` the name upper-cased
/// with `-` as `_`.
fn service_links(docs: &[Value]) -> Vec<(String, String)> {
    let mut env = Vec::new();
    for (i, service) in of_kind(docs, "Service").into_iter().enumerate() {
        let svc = service["metadata"]["name"]
            .as_str()
            .unwrap()
            .to_uppercase()
            .replace('-', "_");
        let host = format!("10.96.0.{}", 10 + i);
        env.push((format!("{svc}_SERVICE_HOST"), host.clone()));
        let ports = service["spec"]["ports"].as_array().unwrap();
        for (j, port) in ports.iter().enumerate() {
            let number = port["port"].as_u64().unwrap();
            let proto = port["protocol"].as_str().unwrap_or("TCP");
            let url = format!("{}://{host}:{number}", proto.to_lowercase());
            if j == 0 {
                env.push((format!("{svc}_SERVICE_PORT"), number.to_string()));
                env.push((format!("{svc}_PORT"), url.clone()));
            }
            if let Some(name) = port["name"].as_str() {
                let name = name.to_uppercase().replace('-', "_");
                env.push((format!("{svc}_SERVICE_PORT_{name}"), number.to_string()));
            }
            let prefix = format!("{svc}_PORT_{number}_{proto}");
            env.push((format!("{prefix}_PROTO"), proto.to_lowercase()));
            env.push((format!("{prefix}_PORT"), number.to_string()));
            env.push((format!("{prefix}_ADDR"), host.clone()));
            env.push((prefix, url));
        }
    }
    env
}

/// The container's `env`, values from Secrets resolved.
fn container_env(docs: &[Value], container: &Value) -> Vec<(String, String)> {
    pod_env(docs, container, "")
}

/// The container's `env` in the pod named `pod_name`: values from Secrets and
/// from the downward API's `metadata.name` resolved.
fn pod_env(docs: &[Value], container: &Value, pod_name: &str) -> Vec<(String, String)> {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|var| {
            let name = var["name"].as_str().unwrap().to_string();
            let value = match var["value"].as_str() {
                Some(value) => value.to_string(),
                None if var["valueFrom"]["fieldRef"].is_object() => {
                    let field = &var["valueFrom"]["fieldRef"]["fieldPath"];
                    assert_eq!(
                        field, "metadata.name",
                        "{name}: only the pod's name is resolved"
                    );
                    pod_name.to_string()
                }
                None => {
                    let secret = &var["valueFrom"]["secretKeyRef"];
                    let secret_doc = named(docs, "Secret", secret["name"].as_str().unwrap());
                    secret_doc["stringData"][secret["key"].as_str().unwrap()]
                        .as_str()
                        .unwrap_or_else(|| panic!("{name}: no such key in the Secret"))
                        .to_string()
                }
            };
            (name, value)
        })
        .collect()
}

/// The image's ENTRYPOINT arguments after the binary (`serve`).
fn entrypoint_args() -> Vec<String> {
    let dockerfile = repo_file("deploy/Dockerfile");
    let line = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("ENTRYPOINT "))
        .expect("the Dockerfile has an ENTRYPOINT");
    let entrypoint: Vec<String> = serde_json::from_str(line).expect("ENTRYPOINT in exec form");
    entrypoint[1..].to_vec()
}

/// A Deployment's router as the kubelet runs it: the image's entrypoint with
/// the container's args, the ConfigMap mounted where the manifest mounts it,
/// the container's env with its Secrets, and every service-link variable.
/// Only the container's ports are remapped to free ones (by name, with the
/// ConfigMap's addresses); the router still listens on 0.0.0.0, so it needs
/// the Secret's tokens. Returns the process, the ports by name and the env.
fn start_as_the_kubelet(
    docs: &[Value],
    deployment: &str,
) -> (Process, BTreeMap<String, u16>, Vec<(String, String)>) {
    let pod = &named(docs, "Deployment", deployment)["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let ports: BTreeMap<String, (u64, u16)> = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let name = p["name"].as_str().unwrap().to_string();
            (name, (p["containerPort"].as_u64().unwrap(), free_ports(1)))
        })
        .collect();

    // The ConfigMap, mounted into a directory of our own.
    let mount = &container["volumeMounts"][0];
    let mount_path = mount["mountPath"].as_str().unwrap();
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let config_map = named(
        docs,
        "ConfigMap",
        volume["configMap"]["name"].as_str().unwrap(),
    );
    let dir = std::env::temp_dir().join(format!(
        "kvroute-deploy-{deployment}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    for (file, text) in config_map["data"].as_object().unwrap() {
        let mut text = text.as_str().unwrap().to_string();
        for (container_port, port) in ports.values() {
            let written = format!(":{container_port}\"");
            assert!(text.contains(&written), "{file} listens on {written}");
            text = text.replace(&written, &format!(":{port}\""));
        }
        std::fs::write(dir.join(file), text).unwrap();
    }
    let args: Vec<String> = entrypoint_args()
        .into_iter()
        .chain(container["args"].as_array().unwrap().iter().map(|a| {
            a.as_str()
                .unwrap()
                .replace(mount_path, dir.to_str().unwrap())
        }))
        .collect();

    let env = container_env(docs, container);
    let links = service_links(docs);
    let mut command = common::kvroute();
    command
        .args(&args)
        .env_clear()
        .envs(env.iter().chain(&links).map(|(k, v)| (k, v)))
        .stderr(Stdio::inherit());
    let router = Process::start(command, |lines| {
        lines.iter().any(|l| l.starts_with("listening "))
    });
    std::fs::remove_dir_all(&dir).unwrap();
    let ports = ports
        .into_iter()
        .map(|(name, (_, port))| (name, port))
        .collect();
    (router, ports, env)
}

/// The value of `name` in `env`.
fn env_value<'a>(env: &'a [(String, String)], name: &str) -> &'a str {
    env.iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("the manifest gives the router {name}"))
}

/// deploy/kubernetes/kvroute.yaml's Deployment, as the kubelet runs it: a
/// simulated worker registers with the Secret's worker token, and the router
/// must turn ready.
#[tokio::test]
async fn the_deployment_starts_with_the_kubelets_environment_and_gets_ready() {
    let docs = manifests();
    assert!(
        service_links(&docs)
            .iter()
            .any(|(k, v)| k == "KVROUTE_PORT" && v.starts_with("tcp://"))
    );
    let (_router, ports, env) = start_as_the_kubelet(&docs, "kvroute");
    let _sim = SimFleet::start_with_env(
        Some(&format!("http://127.0.0.1:{}", ports["grpc"])),
        1,
        &[(
            "KVROUTE_ROUTER_TOKEN",
            env_value(&env, "KVROUTE_AUTH__WORKER_TOKEN"),
        )],
    );
    let http = Http::default();
    let readyz = format!("http://127.0.0.1:{}/readyz", ports["http"]);
    eventually("the router is ready", || async {
        http.get(&readyz).await.status == 200
    })
    .await;
}

/// The gRPC health status of `service` at `addr`, or None while nothing answers.
async fn grpc_health(port: u16, service: &str) -> Option<i32> {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .ok()?;
    let reply = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.to_string(),
        })
        .await
        .ok()?;
    Some(reply.into_inner().status)
}

/// deploy/kubernetes/gateway/kvroute-epp.yaml's Deployment, as the kubelet
/// runs it: its probes are gRPC health checks on the picker's port, liveness
/// serving at once and readiness once a worker (the Secret's worker token, on
/// the port the ingest Service targets) has registered.
#[tokio::test]
async fn the_endpoint_picker_deployment_starts_and_its_grpc_probes_answer() {
    use tonic_health::ServingStatus;
    let docs = manifests_of("deploy/kubernetes/gateway/kvroute-epp.yaml");
    let (_router, ports, env) = start_as_the_kubelet(&docs, "kvroute-epp");
    let container =
        &named(&docs, "Deployment", "kvroute-epp")["spec"]["template"]["spec"]["containers"][0];
    let probe = |which: &str| {
        let grpc = &container[which]["grpc"];
        let port = grpc["port"].as_u64().unwrap();
        let name = container["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["containerPort"] == port)
            .unwrap_or_else(|| panic!("{which} probes a port the container names"))["name"]
            .as_str()
            .unwrap();
        (ports[name], grpc["service"].as_str().unwrap().to_string())
    };
    let (liveness_port, liveness) = probe("livenessProbe");
    let (readiness_port, readiness) = probe("readinessProbe");
    let serving = Some(ServingStatus::Serving as i32);
    eventually("the liveness probe passes", || async {
        grpc_health(liveness_port, &liveness).await == serving
    })
    .await;
    assert_eq!(
        grpc_health(readiness_port, &readiness).await,
        Some(ServingStatus::NotServing as i32),
        "no worker yet"
    );
    let ingest = named(&docs, "Service", "kvroute-epp-ingest")["spec"]["ports"][0]["targetPort"]
        .as_str()
        .unwrap()
        .to_string();
    let _sim = SimFleet::start_with_env(
        Some(&format!("http://127.0.0.1:{}", ports[&ingest])),
        1,
        &[(
            "KVROUTE_ROUTER_TOKEN",
            env_value(&env, "KVROUTE_AUTH__WORKER_TOKEN"),
        )],
    );
    eventually("the readiness probe passes", || async {
        grpc_health(readiness_port, &readiness).await == serving
    })
    .await;
    assert_eq!(
        grpc_health(
            readiness_port,
            "envoy.service.ext_proc.v3.ExternalProcessor"
        )
        .await,
        serving
    );
}

/// The value of `--flag=value` in `args`.
fn flag<'a>(args: &'a [Value], flag: &str) -> &'a str {
    args.iter()
        .find_map(|a| a.as_str()?.strip_prefix(&format!("{flag}=")))
        .unwrap_or_else(|| panic!("no {flag}= in {args:?}"))
}

/// The port of a `scheme://host:port[/...]` address.
fn port_of(address: &str) -> u64 {
    let rest = address.split("://").nth(1).unwrap_or(address);
    let authority = rest.split('/').next().unwrap();
    authority.rsplit_once(':').unwrap().1.parse().unwrap()
}

/// The gateway manifests hang together as the gateway and kubelet read them:
/// the InferencePool (`inference.networking.k8s.io/v1`) selects the vLLM pods
/// on their port and names the picker's Service and port, which leads to the
/// router's `[epp] addr`; the HTTPRoute sends to the pool; each vLLM pod
/// publishes KV events where its `kvroute bridge` sidecar subscribes, with the
/// router's block size and tokenizer, registering the pod's IP at the
/// engine's port with the router's worker token, on the ingest Service.
#[test]
fn the_gateway_manifests_wire_the_pool_the_picker_and_the_bridges() {
    let epp = manifests_of("deploy/kubernetes/gateway/kvroute-epp.yaml");
    let pools = manifests_of("deploy/kubernetes/gateway/inferencepool.yaml");
    let vllm = manifests_of("deploy/kubernetes/gateway/vllm.yaml");
    let router: toml::Table = named(&epp, "ConfigMap", "kvroute-epp-config")["data"]["router.toml"]
        .as_str()
        .unwrap()
        .parse()
        .expect("router.toml is TOML");
    let epp_addr = router["epp"]["addr"].as_str().unwrap();
    let picker = named(&epp, "Deployment", "kvroute-epp")["spec"]["template"]["spec"]["containers"]
        [0]
    .clone();
    let container_port = |name: &str| {
        picker["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no container port {name}"))["containerPort"]
            .as_u64()
            .unwrap()
    };
    let service_port = |service: &str, port: u64| {
        named(&epp, "Service", service)["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["port"] == port)
            .unwrap_or_else(|| panic!("{service} has no port {port}"))["targetPort"]
            .as_str()
            .unwrap()
            .to_string()
    };

    // The pool and its picker.
    let pool = named(&pools, "InferencePool", "vllm-pool");
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
    let picker_ref = &pool["spec"]["endpointPickerRef"];
    let picker_port = picker_ref["port"]["number"].as_u64().unwrap();
    let target = service_port(picker_ref["name"].as_str().unwrap(), picker_port);
    assert_eq!(
        container_port(&target),
        port_of(epp_addr),
        "the endpointPickerRef leads to [epp] addr"
    );
    let engines = named(&vllm, "StatefulSet", "vllm");
    let engine_pod = &engines["spec"]["template"];
    assert_eq!(
        pool["spec"]["selector"]["matchLabels"],
        engine_pod["metadata"]["labels"]
    );
    let containers = engine_pod["spec"]["containers"].as_array().unwrap();
    let engine = containers.iter().find(|c| c["name"] == "vllm").unwrap();
    let engine_args = engine["args"].as_array().unwrap();
    let engine_port: u64 = flag(engine_args, "--port").parse().unwrap();
    assert_eq!(pool["spec"]["targetPorts"][0]["number"], engine_port);

    // The route.
    let route = named(&pools, "HTTPRoute", "vllm-route");
    let backend = &route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(
        (&backend["group"], &backend["kind"], &backend["name"]),
        (
            &Value::from("inference.networking.k8s.io"),
            &Value::from("InferencePool"),
            &pool["metadata"]["name"]
        )
    );

    // The engine and its bridge.
    assert!(engine_args.iter().any(|a| a == "--enable-prefix-caching"));
    let events: Value = serde_json::from_str(flag(engine_args, "--kv-events-config")).unwrap();
    assert_eq!(events["enable_kv_cache_events"], true);
    let bridge = containers
        .iter()
        .find(|c| c["name"] == "kvroute-bridge")
        .expect("a kvroute bridge sidecar");
    assert_eq!(bridge["command"][1], "bridge");
    let args = bridge["args"].as_array().unwrap();
    assert_eq!(
        port_of(flag(args, "--engine-events")),
        port_of(events["endpoint"].as_str().unwrap())
    );
    assert_eq!(
        port_of(flag(args, "--engine-replay")),
        port_of(events["replay_endpoint"].as_str().unwrap())
    );
    assert_eq!(flag(args, "--topic"), events["topic"]);
    let block_size = router["block_size"].as_integer().unwrap().to_string();
    assert_eq!(flag(args, "--block-size"), block_size);
    assert_eq!(flag(engine_args, "--block-size"), block_size);
    assert_eq!(
        flag(args, "--tokenizer"),
        router["tokenizer"].as_str().unwrap()
    );
    assert_eq!(
        flag(args, "--engine-url"),
        format!("http://$(POD_IP):{engine_port}")
    );
    let pod_ip = bridge["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "POD_IP")
        .unwrap();
    assert_eq!(pod_ip["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP");
    let ingest = flag(args, "--router");
    let host = ingest
        .split("://")
        .nth(1)
        .unwrap()
        .split(':')
        .next()
        .unwrap();
    let grpc = service_port(host, port_of(ingest));
    assert_eq!(
        container_port(&grpc),
        port_of(router["grpc_addr"].as_str().unwrap())
    );
    let secret_ref = |container: &Value, name: &str| {
        container["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no {name}"))["valueFrom"]["secretKeyRef"]
            .clone()
    };
    assert_eq!(
        secret_ref(bridge, "KVROUTE_ROUTER_TOKEN"),
        secret_ref(&picker, "KVROUTE_AUTH__WORKER_TOKEN")
    );
    // Every flag the bridge is given is one `kvroute bridge` takes.
    let help = common::kvroute()
        .args(["bridge", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    for arg in args {
        let name = arg.as_str().unwrap().split('=').next().unwrap();
        assert!(
            help.contains(&format!("{name} ")),
            "kvroute bridge takes no {name}"
        );
    }
}

/// The Envoy config tests/epp.rs runs is deploy/envoy/'s, placeholders
/// filled; the Kubernetes page points at each of its files and explains
/// each placeholder.
#[test]
fn the_kubernetes_page_shows_the_envoy_config_the_tests_run() {
    let page = repo_file("docs/operator/kubernetes.md");
    let tests = repo_file("tests/epp.rs");
    for file in ["envoy-epp.yaml", "pool-original-dst.yaml", "epp-tls.yaml"] {
        let path = format!("deploy/envoy/{file}");
        assert!(
            page.contains(&format!("../../{path}")),
            "kubernetes.md links {path}"
        );
        assert!(
            tests.contains(&format!("\"{path}\"")),
            "tests/epp.rs runs {path}"
        );
        let text = repo_file(&path);
        let mut rest = text.as_str();
        while let Some(at) = rest.find("${") {
            let end = rest[at..].find('}').unwrap() + at;
            let placeholder = &rest[at..=end];
            assert!(
                page.contains(&format!("`{placeholder}`")),
                "kubernetes.md explains {placeholder} of {path}"
            );
            assert!(
                tests.contains(&format!("(\"{}\",", &placeholder[2..placeholder.len() - 1])),
                "tests/epp.rs fills {placeholder}"
            );
            rest = &rest[end..];
        }
    }
}

#[test]
fn kubernetes_manifests_hold_probes_ports_tokens_and_no_service_links() {
    let docs = manifests();
    let deployment = named(&docs, "Deployment", "kvroute");
    let pod = &deployment["spec"]["template"];
    assert_eq!(
        pod["metadata"]["annotations"]["prometheus.io/scrape"],
        "true"
    );
    assert_eq!(
        pod["metadata"]["annotations"]["prometheus.io/path"],
        "/metrics"
    );
    assert_eq!(pod["spec"]["enableServiceLinks"], false);
    let container = &pod["spec"]["containers"][0];
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    let env: BTreeMap<String, String> = container_env(&docs, container).into_iter().collect();
    for token in ["KVROUTE_AUTH__WORKER_TOKEN", "KVROUTE_AUTH__ADMIN_TOKEN"] {
        assert!(env.get(token).is_some_and(|t| !t.is_empty()), "{token}");
    }
    assert_ne!(
        env["KVROUTE_AUTH__WORKER_TOKEN"], env["KVROUTE_AUTH__ADMIN_TOKEN"],
        "separate credentials"
    );
    let ports: BTreeSet<&str> = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(ports, BTreeSet::from(["grpc", "http"]));
    let service = named(&docs, "Service", "kvroute");
    let service_ports: BTreeSet<&str> = service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["targetPort"].as_str().unwrap())
        .collect();
    assert_eq!(service_ports, ports);
}

/// `1.89` or `1.89.0` as (major, minor).
fn major_minor(version: &str) -> (u32, u32) {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap());
    (parts.next().unwrap(), parts.next().unwrap())
}

#[test]
fn the_dockerfile_toolchain_meets_the_workspace_rust_version() {
    let manifest: toml::Table = repo_file("Cargo.toml").parse().unwrap();
    let required = manifest["workspace"]["package"]["rust-version"]
        .as_str()
        .unwrap();
    let dockerfile = repo_file("deploy/Dockerfile");
    let image = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("FROM rust:"))
        .expect("the build stage is FROM rust:<version>...");
    let version = image.split(['-', ' ']).next().unwrap();
    assert!(
        major_minor(version) >= major_minor(required),
        "deploy/Dockerfile builds with rust {version}, the workspace needs {required}"
    );
    let ignored = repo_file(".dockerignore");
    for entry in ["target/", ".git"] {
        assert!(
            ignored.lines().any(|l| l == entry),
            ".dockerignore: {entry}"
        );
    }
}

/// The image is the product alone: its build stage builds the `kvroute`
/// binary and no other (not the lab, `kvroute-lab`, whose dependencies would
/// lengthen the build), and its runtime stage takes only that binary.
#[test]
fn the_dockerfile_builds_and_ships_only_the_kvroute_binary() {
    let dockerfile = repo_file("deploy/Dockerfile");
    let builds: Vec<Vec<&str>> = dockerfile
        .lines()
        .filter(|l| l.contains("cargo "))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(builds.len(), 1, "one cargo command: {builds:?}");
    let build = &builds[0];
    let cargo = build.iter().position(|w| *w == "cargo").unwrap();
    assert_eq!(build[cargo + 1], "build", "{build:?}");
    // Each flag that selects what to build, with the word after it.
    let selecting = [
        "--bin",
        "--bins",
        "--package",
        "-p",
        "--workspace",
        "--all",
        "--all-targets",
    ];
    let targets: Vec<(&str, &str)> = build
        .iter()
        .enumerate()
        .filter(|(_, w)| {
            selecting
                .iter()
                .any(|f| **w == *f || w.starts_with(&format!("{f}=")))
        })
        .map(|(i, w)| (*w, build.get(i + 1).copied().unwrap_or("")))
        .collect();
    assert_eq!(targets, [("--bin", "kvroute")], "{build:?}");
    let shipped: Vec<&str> = dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("COPY --from=build "))
        .collect();
    assert_eq!(
        shipped,
        ["/src/target/release/kvroute /usr/local/bin/kvroute"],
        "the runtime stage copies only the kvroute binary"
    );
}

/// Every `kvroute_...` name in `expr`.
fn series_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find("kvroute_") {
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

#[test]
fn dashboard_queries_name_exported_series() {
    let dashboard: Value =
        serde_json::from_str(&repo_file("deploy/grafana/kvroute-dashboard.json")).unwrap();
    let families: BTreeSet<&str> = kvroute_router::metrics::FAMILIES
        .iter()
        .map(|(n, _)| *n)
        .collect();
    let mut used = BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let names = series_names(expr);
            assert!(!names.is_empty(), "{expr} names no kvroute series");
            for name in names {
                let histogram = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s))
                    .filter(|base| kvroute_router::metrics::is_histogram(base));
                let family = histogram.unwrap_or(&name).to_string();
                assert!(
                    families.contains(family.as_str()),
                    "{name} in {expr:?} is not exported"
                );
                used.insert(family);
            }
        }
    }
    // And the dashboard shows every family.
    let unused: Vec<_> = families.iter().filter(|f| !used.contains(**f)).collect();
    assert!(unused.is_empty(), "families without a panel: {unused:?}");
}

/// The status of `GET url` (plain HTTP/1.0), or None while nothing answers.
async fn probe_status(url: &str) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://")?;
    let (addr, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.ok()?;
    String::from_utf8_lossy(&answer)
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// deploy/kubernetes/kvroute-replicas.yaml as the kubelet runs it: the NATS
/// StatefulSet's nats-server with its ConfigMap (store on a directory of our
/// own, as the PVC; ready by its own readiness probe), then the Deployment's 3
/// pods, each with the image's entrypoint and the container's args, the router
/// ConfigMap mounted, the container's env with its Secrets and its pod name
/// (downward API), and every service-link variable. Only ports are remapped,
/// and `kvroute-nats` resolves to loopback. Simulated workers stream to one
/// replica with the Secret's worker token; every replica gets ready and
/// indexes the workers' caches alike.
#[tokio::test]
async fn three_replicas_and_jetstream_nats_start_from_the_manifests_converge_and_get_ready() {
    let docs = manifests_of("deploy/kubernetes/kvroute-replicas.yaml");
    let dir = std::env::temp_dir().join(format!("kvroute-deploy-replicas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    // NATS, as its StatefulSet runs it.
    let nats_set = named(&docs, "StatefulSet", "kvroute-nats");
    assert_eq!(
        nats_set["spec"]["volumeClaimTemplates"][0]["metadata"]["name"], "data",
        "JetStream's store is on a PVC"
    );
    let nats_pod = &nats_set["spec"]["template"]["spec"];
    let nats = &nats_pod["containers"][0];
    let mount = |container: &Value, volume: &str| {
        container["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == volume)
            .unwrap_or_else(|| panic!("no mount of {volume}"))["mountPath"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (client_port, monitor_port) = (free_ports(1), free_ports(1));
    let nats_dir = dir.join("nats");
    let data_dir = dir.join("nats-data");
    std::fs::create_dir_all(&nats_dir).unwrap();
    let nats_conf = named(&docs, "ConfigMap", "kvroute-nats-config")["data"]["nats.conf"]
        .as_str()
        .unwrap()
        .replace("0.0.0.0:4222", &format!("127.0.0.1:{client_port}"))
        .replace("0.0.0.0:8222", &format!("127.0.0.1:{monitor_port}"))
        .replace(&mount(nats, "data"), data_dir.to_str().unwrap());
    assert!(nats_conf.contains("jetstream"), "{nats_conf}");
    std::fs::write(nats_dir.join("nats.conf"), nats_conf).unwrap();
    let nats_args: Vec<String> = nats["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            a.as_str()
                .unwrap()
                .replace(&mount(nats, "config"), nats_dir.to_str().unwrap())
        })
        .collect();
    let mut nats_child = std::process::Command::new(common::nats_server_binary())
        .args(&nats_args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nats-server starts");
    let http = Http::default();
    let probe = &nats["readinessProbe"]["httpGet"];
    assert_eq!(probe["port"], "monitor");
    let nats_ready = format!(
        "http://127.0.0.1:{monitor_port}{}",
        probe["path"].as_str().unwrap()
    );
    eventually("NATS with JetStream to be ready", || async {
        probe_status(&nats_ready).await == Some(200)
    })
    .await;

    // Three router pods.
    let pod = &named(&docs, "Deployment", "kvroute")["spec"]["template"]["spec"];
    assert_eq!(named(&docs, "Deployment", "kvroute")["spec"]["replicas"], 3);
    let container = &pod["containers"][0];
    let config_mount = mount(container, "config");
    let router_toml = named(&docs, "ConfigMap", "kvroute-config")["data"]["router.toml"]
        .as_str()
        .unwrap()
        .to_string();
    let links = service_links(&docs);
    let nats_service = named(&docs, "Service", "kvroute-nats");
    let nats_port = nats_service["spec"]["ports"][0]["port"].as_u64().unwrap();
    let mut routers = Vec::new();
    for i in 0..3 {
        let (http_port, grpc_port) = (free_ports(1), free_ports(1));
        let pod_dir = dir.join(format!("pod-{i}"));
        std::fs::create_dir_all(&pod_dir).unwrap();
        let text = router_toml
            .replace(":8000\"", &format!(":{http_port}\""))
            .replace(":50051\"", &format!(":{grpc_port}\""));
        std::fs::write(pod_dir.join("router.toml"), text).unwrap();
        let args: Vec<String> = entrypoint_args()
            .into_iter()
            .chain(container["args"].as_array().unwrap().iter().map(|a| {
                a.as_str()
                    .unwrap()
                    .replace(&config_mount, pod_dir.to_str().unwrap())
            }))
            .collect();
        let pod_name = format!("kvroute-5d8f9c7b6-x{i}");
        let env: Vec<(String, String)> = pod_env(&docs, container, &pod_name)
            .into_iter()
            .map(|(k, v)| {
                // The Service's DNS name, as cluster DNS would resolve it.
                let v = v.replace(
                    &format!("kvroute-nats:{nats_port}"),
                    &format!("127.0.0.1:{client_port}"),
                );
                (k, v)
            })
            .collect();
        assert!(
            env.iter()
                .any(|(k, v)| k == "KVROUTE_CLUSTER__NATS_URL" && v.starts_with("nats://")),
            "{env:?}"
        );
        let mut command = common::kvroute();
        command
            .args(&args)
            .env_clear()
            .envs(env.iter().chain(&links).map(|(k, v)| (k, v)))
            .stderr(Stdio::inherit());
        let process = Process::start(command, |lines| {
            lines.iter().any(|l| l.starts_with("listening "))
        });
        routers.push((process, http_port, grpc_port, env));
    }

    let secret = |key: &str| {
        routers[0]
            .3
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("the manifest gives the router {key}"))
    };
    let worker_token = secret("KVROUTE_AUTH__WORKER_TOKEN");
    let admin = format!("Bearer {}", secret("KVROUTE_AUTH__ADMIN_TOKEN"));
    let sim = SimFleet::start_with_env(
        Some(&format!("http://127.0.0.1:{}", routers[0].2)),
        2,
        &[("KVROUTE_ROUTER_TOKEN", worker_token.as_str())],
    );
    for (_, http_port, ..) in &routers {
        let readyz = format!("http://127.0.0.1:{http_port}/readyz");
        eventually("every replica to be ready", || async {
            http.get(&readyz).await.status == 200
        })
        .await;
    }
    // Requests through every replica; each indexes every worker's cache.
    for i in 0..6u32 {
        let url = format!(
            "http://127.0.0.1:{}/v1/completions",
            routers[i as usize % 3].1
        );
        let reply = http
            .post(&url, &completion("sim-model", &tokens(i * 10_000, 64)))
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    for (id, url) in &sim.workers {
        let text = http.get(&format!("{url}/metrics")).await.text();
        let cache = (
            metric(&text, "kvroute_sim_kv_blocks_cached", &[]) as u64,
            metric(&text, "kvroute_sim_last_event_id", &[]) as u64,
        );
        for (_, http_port, ..) in &routers {
            let worker = format!("http://127.0.0.1:{http_port}/workers/{id}");
            eventually("every replica to index the worker's cache", || async {
                let info = http
                    .call("GET", &worker, &[("authorization", &admin)], "")
                    .await
                    .json();
                let rank = &info["index"][0];
                (
                    rank["indexed_blocks"].as_u64(),
                    rank["last_event_id"].as_u64(),
                ) == (Some(cache.0), Some(cache.1))
            })
            .await;
        }
    }
    drop(sim);
    drop(routers);
    let _ = nats_child.kill();
    let _ = nats_child.wait();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_replicas_manifests_hold_budgets_a_jetstream_store_and_the_pod_name_as_replica_id() {
    let docs = manifests_of("deploy/kubernetes/kvroute-replicas.yaml");
    let deployment = named(&docs, "Deployment", "kvroute");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let replica_id = container["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "KVROUTE_CLUSTER__REPLICA_ID")
        .expect("replica_id from the environment");
    assert_eq!(
        replica_id["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    // Each budget selects the pods it protects.
    for (budget, set) in [
        ("kvroute", named(&docs, "Deployment", "kvroute")),
        ("kvroute-nats", named(&docs, "StatefulSet", "kvroute-nats")),
    ] {
        let pdb = named(&docs, "PodDisruptionBudget", budget);
        assert_eq!(
            pdb["spec"]["selector"]["matchLabels"], set["spec"]["template"]["metadata"]["labels"],
            "{budget}"
        );
    }
    let routers = &named(&docs, "PodDisruptionBudget", "kvroute")["spec"];
    assert_eq!(routers["minAvailable"], 2, "two of three replicas route");
    let nats = named(&docs, "StatefulSet", "kvroute-nats");
    let claim = &nats["spec"]["volumeClaimTemplates"][0];
    let mounted = nats["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == claim["metadata"]["name"])
        .expect("the PVC is mounted")["mountPath"]
        .as_str()
        .unwrap()
        .to_string();
    let conf = named(&docs, "ConfigMap", "kvroute-nats-config")["data"]["nats.conf"]
        .as_str()
        .unwrap();
    let store = conf
        .lines()
        .find_map(|l| l.trim().strip_prefix("store_dir:"))
        .expect("JetStream has a store_dir");
    assert!(
        store.trim().trim_matches('"').starts_with(&mounted),
        "JetStream stores on the PVC: {store} under {mounted}"
    );
}
