//! deploy/: the Kubernetes manifests parse and hold what operators rely on, and
//! every Grafana query names series the router really exports.

use std::collections::BTreeSet;

use serde_json::Value;

fn repo_file(path: &str) -> String {
    let full = format!("{}/{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
}

#[test]
fn kubernetes_manifests_parse_with_probes_ports_config_and_token() {
    let text = repo_file("deploy/kubernetes/kvroute.yaml");
    let docs: Vec<Value> = serde_norway::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).expect("valid YAML"))
        .collect();
    let of_kind =
        |kind: &str| -> Vec<&Value> { docs.iter().filter(|d| d["kind"] == kind).collect() };

    let config = of_kind("ConfigMap")[0]["data"]["router.toml"]
        .as_str()
        .unwrap();
    let path = std::env::temp_dir().join(format!("kvroute-deploy-{}.toml", std::process::id()));
    std::fs::write(&path, config).unwrap();
    let loaded = kvroute_router::Config::load(Some(&path), Vec::new());
    std::fs::remove_file(&path).unwrap();
    loaded.expect("the ConfigMap's router.toml is a valid router config");

    let deployment = of_kind("Deployment")[0];
    let pod = &deployment["spec"]["template"];
    assert_eq!(
        pod["metadata"]["annotations"]["prometheus.io/scrape"],
        "true"
    );
    assert_eq!(
        pod["metadata"]["annotations"]["prometheus.io/path"],
        "/metrics"
    );
    let container = &pod["spec"]["containers"][0];
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    let env = &container["env"][0];
    assert_eq!(env["name"], "KVROUTE_AUTH_TOKEN");
    assert_eq!(env["valueFrom"]["secretKeyRef"]["name"], "kvroute-token");
    assert!(
        of_kind("Secret")
            .iter()
            .any(|s| s["metadata"]["name"] == "kvroute-token")
    );
    let ports: BTreeSet<&str> = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(ports, BTreeSet::from(["grpc", "http"]));
    let service = of_kind("Service")
        .into_iter()
        .find(|s| s["metadata"]["name"] == "kvroute")
        .unwrap();
    let service_ports: BTreeSet<&str> = service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["targetPort"].as_str().unwrap())
        .collect();
    assert_eq!(service_ports, ports);
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
