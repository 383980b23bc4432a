//! `kvroute demo`: the router and a 4-worker simulated fleet replay the start of
//! the bundled trace under `kv` and `round_robin`, print the table, then keep
//! serving. This checks behaviour only (both policies ran, every request
//! succeeded, the fleet serves afterwards); hit rates are compared by
//! `kvroute-lab bench e2e`, not here.

mod common;

use serde_json::json;

const REQUESTS: usize = 60;

/// The cells of the table row starting with `row`.
fn cells<'a>(lines: &'a [String], row: &str) -> Vec<&'a str> {
    let line = lines
        .iter()
        .find(|l| l.starts_with(row))
        .unwrap_or_else(|| panic!("no row `{row}` in {lines:#?}"));
    line[row.len()..].split_whitespace().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_runs_both_policies_then_serves() {
    let requests = REQUESTS.to_string();
    let demo = common::Process::spawn(&["demo", "--requests", &requests], |lines| {
        lines
            .iter()
            .any(|l| l.ends_with("# the fleet as the router sees it"))
    });
    let lines = &demo.lines;
    let header: Vec<&str> = lines
        .iter()
        .find(|l| l.contains("round_robin"))
        .unwrap_or_else(|| panic!("no table in {lines:#?}"))
        .split_whitespace()
        .collect();
    assert_eq!(header, ["kv", "round_robin"]);
    assert_eq!(cells(lines, "failed requests"), ["0", "0"], "{lines:#?}");
    for (policy, per_worker) in header.iter().zip(cells(lines, "requests per worker")) {
        let counts: Vec<usize> = per_worker.split('/').map(|n| n.parse().unwrap()).collect();
        assert_eq!(counts.len(), 4, "{policy}: {per_worker}");
        assert_eq!(
            counts.iter().sum::<usize>(),
            REQUESTS,
            "{policy}: {per_worker}"
        );
    }
    for rate in cells(lines, "prefix hit rate (workers)") {
        let rate: f64 = rate.trim_end_matches('%').parse().unwrap();
        assert!((0.0..=100.0).contains(&rate), "{lines:#?}");
    }

    // The fleet it leaves running serves requests.
    let serving = lines
        .iter()
        .find(|l| l.starts_with("Serving under `kv` at "))
        .unwrap();
    let url = serving["Serving under `kv` at ".len()..]
        .split_whitespace()
        .next()
        .unwrap();
    let model = lines
        .iter()
        .find_map(|l| l.split("\"model\": \"").nth(1))
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("no example request in {lines:#?}"));
    let http = common::Http::default();
    let workers = http.get(&format!("{url}/workers")).await;
    assert_eq!(workers.status, 200);
    assert_eq!(workers.json()["workers"].as_array().unwrap().len(), 4);
    let body = json!({"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 8});
    let reply = http.post(&format!("{url}/v1/completions"), &body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert!(
        reply.json()["choices"][0]["text"].is_string(),
        "{}",
        reply.text()
    );
}
