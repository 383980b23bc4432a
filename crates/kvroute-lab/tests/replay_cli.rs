//! `kvroute-lab replay` as a user runs it: JSON output, per-request lines, the
//! comparison's table, CSV and charts, and exit status 2 on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// Runs `kvroute-lab ARGS` to the end, logging warnings only.
fn kvroute(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute-lab"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("kvroute-lab runs")
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("replay_cli");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "kvroute failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout.clone()).unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The LRU/FIFO hand trace of the cache crate's tests (block size 4,
/// capacity 3), with ids shifted and one skipped to show that the values of
/// ids do not matter: LRU hits 0, 0, 7, 0, 8, 0 tokens of 10, 4, 7, 8, 12, 8.
const GAP_TRACE: &str = r#"{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3]}
{"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [4]}
{"timestamp": 2, "input_length": 7, "output_length": 1, "hash_ids": [2, 3]}
{"timestamp": 3, "input_length": 8, "output_length": 1, "hash_ids": [5, 6]}
{"timestamp": 4, "input_length": 12, "output_length": 1, "hash_ids": [3, 5, 7]}
{"timestamp": 5, "input_length": 8, "output_length": 1, "hash_ids": [9, 3]}
"#;

fn gap_trace() -> PathBuf {
    let path = scratch("gap_trace.jsonl");
    std::fs::write(&path, GAP_TRACE).unwrap();
    path
}

fn conversation() -> String {
    format!(
        "{}/../../tests/data/traces/conversation_trace.jsonl",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn json_output_and_per_request_lines() {
    let trace = gap_trace();
    let per_request = scratch("gap_per_request.jsonl");
    let output = kvroute(&[
        "replay",
        trace.to_str().unwrap(),
        "--policy",
        "lru",
        "--capacity-blocks",
        "3",
        "--block-size",
        "4",
        "--json",
        "--per-request",
        per_request.to_str().unwrap(),
    ]);
    let text = stdout(&output);
    assert_eq!(text.lines().count(), 1, "exactly one JSON object: {text}");
    let report: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(report["total_requests"], 6);
    assert_eq!(report["total_prompt_tokens"], 49);
    assert_eq!(report["total_hit_tokens"], 15);
    assert_eq!(report["final_cache_blocks"], 3);
    assert_eq!(report["evictions"], 6);
    assert!((report["overall_hit_rate"].as_f64().unwrap() - 15.0 / 49.0).abs() < 1e-12);
    assert!((report["re_prefill_rate"].as_f64().unwrap() - 1.0 / 6.0).abs() < 1e-12);
    assert!(report["eviction_latency_p50_ns"].as_u64().is_some());
    assert!(
        report["eviction_latency_p99_ns"].as_u64() >= report["eviction_latency_p50_ns"].as_u64()
    );
    let utilisation = report["mean_utilisation"].as_f64().unwrap();
    // After each request: 3, 3, 3, 3, 3, 3 blocks of 3.
    assert_eq!(utilisation, 1.0);

    let lines: Vec<Value> = std::fs::read_to_string(&per_request)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let hits: Vec<u64> = lines
        .iter()
        .map(|l| l["hit_tokens"].as_u64().unwrap())
        .collect();
    let prompts: Vec<u64> = lines
        .iter()
        .map(|l| l["prompt_tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(hits, [0, 0, 7, 0, 8, 0]);
    assert_eq!(prompts, [10, 4, 7, 8, 12, 8]);
}

#[test]
fn max_requests_replays_a_prefix_of_the_trace() {
    let trace = gap_trace();
    let output = kvroute(&[
        "replay",
        trace.to_str().unwrap(),
        "--policy",
        "fifo",
        "--capacity-blocks",
        "3",
        "--block-size",
        "4",
        "--max-requests",
        "3",
        "--json",
    ]);
    let report: Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(report["total_requests"], 3);
    assert_eq!(report["total_prompt_tokens"], 21);
    assert_eq!(report["total_hit_tokens"], 7);
}

#[test]
fn infinite_needs_no_capacity_and_bundled_trace_replays() {
    let output = kvroute(&[
        "replay",
        &conversation(),
        "--policy",
        "infinite",
        "--max-requests",
        "500",
        "--json",
    ]);
    let report: Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(report["total_requests"], 500);
    assert_eq!(report["capacity_blocks"], Value::Null);
    assert_eq!(report["evictions"], 0);
    assert_eq!(report["mean_utilisation"], Value::Null);
    let hit = report["total_hit_tokens"].as_u64().unwrap();
    let prompt = report["total_prompt_tokens"].as_u64().unwrap();
    assert!(hit > 0 && hit < prompt);
}

#[test]
fn compare_prints_a_table_and_writes_csv_and_charts() {
    let csv = scratch("compare.csv");
    let svg = scratch("compare.svg");
    let png = scratch("compare.png");
    let trace = conversation();
    let base = [
        "replay",
        trace.as_str(),
        "--max-requests",
        "300",
        "--compare",
        "lru,s3fifo,belady",
        "--capacities",
        "64,256",
    ];
    let mut args = base.to_vec();
    args.extend([
        "--csv",
        csv.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let table = stdout(&kvroute(&args));
    assert!(table.contains("belady (bound)"), "{table}");
    assert!(table.contains("best policy"), "{table}");
    assert!(table.lines().any(|l| l.starts_with("lru")), "{table}");
    let details = table.lines().filter(|l| l.ends_with('%')).count();
    assert_eq!(details, 3 * 2, "a details line per run: {table}");

    let csv = std::fs::read_to_string(&csv).unwrap();
    let rows: Vec<&str> = csv.lines().collect();
    assert_eq!(rows.len(), 1 + 3 * 2, "{csv}");
    assert!(rows[0].starts_with("policy,capacity_blocks,"));
    assert!(rows[1].starts_with("lru,64,300,"), "{csv}");
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(
        svg.contains("<svg") && svg.contains("s3fifo"),
        "chart names its lines"
    );

    let mut args = base.to_vec();
    args.extend(["--plot", png.to_str().unwrap()]);
    stdout(&kvroute(&args));
    let png = std::fs::read(&png).unwrap();
    assert!(png.starts_with(b"\x89PNG"), "a PNG file");
}

/// Runs kvroute expecting exit status 2 and returns its stderr.
fn fails(args: &[&str]) -> String {
    let output = kvroute(args);
    assert_eq!(
        output.status.code(),
        Some(2),
        "{args:?}: stdout {}",
        String::from_utf8_lossy(&output.stdout)
    );
    assert!(!stderr(&output).contains("panicked"), "{}", stderr(&output));
    stderr(&output)
}

#[test]
fn bad_input_exits_2_with_a_clear_error() {
    let trace = gap_trace();
    let trace = trace.to_str().unwrap();
    let err = fails(&["replay", trace, "--policy", "lru", "--capacity-blocks", "0"]);
    assert!(err.contains("--capacity-blocks"), "{err}");
    let err = fails(&[
        "replay",
        trace,
        "--policy",
        "lru",
        "--capacity-blocks",
        "4",
        "--block-size",
        "0",
    ]);
    assert!(err.contains("--block-size"), "{err}");
    let err = fails(&["replay", trace, "--policy", "mru", "--capacity-blocks", "4"]);
    assert!(err.contains("unknown policy `mru`"), "{err}");
    let err = fails(&["replay", trace, "--compare", "lru,mru", "--capacities", "4"]);
    assert!(err.contains("unknown policy `mru`"), "{err}");
    let err = fails(&["replay", trace, "--compare", "lru", "--capacities", "4,0"]);
    assert!(err.contains("--capacities"), "{err}");
    let err = fails(&["replay", trace, "--policy", "lru"]);
    assert!(err.contains("--capacity-blocks is required"), "{err}");
    let err = fails(&[
        "replay",
        "/nonexistent/trace.jsonl",
        "--policy",
        "lru",
        "--capacity-blocks",
        "4",
    ]);
    assert!(err.contains("/nonexistent/trace.jsonl"), "{err}");
    assert_eq!(
        err.matches("No such file").count(),
        1,
        "the reason once: {err}"
    );
    let err = fails(&[
        "replay",
        trace,
        "--policy",
        "s3fifo",
        "--capacity-blocks",
        "1",
    ]);
    assert!(err.contains("main queue"), "{err}");
    let err = fails(&[
        "replay",
        trace,
        "--compare",
        "lru",
        "--capacities",
        "4",
        "--plot",
        "chart.pdf",
    ]);
    assert!(err.contains(".svg or .png"), "{err}");

    let malformed = scratch("malformed.jsonl");
    let mut text = GAP_TRACE.to_owned();
    text.push_str(
        r#"{"timestamp": 6, "input_length": 8, "output_length": 1, "hash_ids": [1, "x"]}"#,
    );
    std::fs::write(&malformed, text).unwrap();
    let err = fails(&[
        "replay",
        malformed.to_str().unwrap(),
        "--policy",
        "lru",
        "--capacity-blocks",
        "4",
    ]);
    assert!(
        err.contains("malformed.jsonl:7"),
        "names file and line: {err}"
    );
    assert!(err.contains("hash_ids`[1]"), "names the field: {err}");
}

/// A 3-block chain, an unrelated pair that needs one slot more than is free
/// (capacity 4), then the chain again: given back root first, the chain loses
/// its root and hits nothing; given back tail first or leaf first, it keeps
/// its first two blocks (8 tokens).
const CHAIN_TRACE: &str = r#"{"timestamp": 0, "input_length": 12, "output_length": 1, "hash_ids": [1, 2, 3]}
{"timestamp": 1, "input_length": 8, "output_length": 1, "hash_ids": [4, 5]}
{"timestamp": 2, "input_length": 12, "output_length": 1, "hash_ids": [1, 2, 3]}
"#;

#[test]
fn orders_give_blocks_back_like_the_engines() {
    let path = scratch("chain_trace.jsonl");
    std::fs::write(&path, CHAIN_TRACE).unwrap();
    let trace = path.to_str().unwrap();
    for (order, hit) in [
        (None, 0),
        (Some("seed"), 0),
        (Some("vllm"), 8),
        (Some("sglang"), 8),
    ] {
        let mut args = vec![
            "replay",
            trace,
            "--policy",
            "lru",
            "--capacity-blocks",
            "4",
            "--block-size",
            "4",
            "--json",
        ];
        args.extend(order.iter().flat_map(|o| ["--order", o]));
        let report: Value = serde_json::from_str(&stdout(&kvroute(&args))).unwrap();
        assert_eq!(report["total_hit_tokens"], hit, "{order:?}");
        assert_eq!(report["order"], order.unwrap_or("seed"));
    }
    let err = fails(&[
        "replay",
        trace,
        "--policy",
        "s3fifo",
        "--capacity-blocks",
        "4",
        "--order",
        "sglang",
    ]);
    assert!(
        err.contains("--order sglang") && err.contains("s3fifo"),
        "{err}"
    );
    let err = fails(&[
        "replay",
        trace,
        "--compare",
        "lru,belady",
        "--capacities",
        "4",
        "--order",
        "vllm",
    ]);
    assert!(err.contains("belady"), "{err}");
    let err = fails(&[
        "replay",
        trace,
        "--policy",
        "lru",
        "--capacity-blocks",
        "4",
        "--order",
        "lifo",
    ]);
    assert!(err.contains("unknown order `lifo`"), "{err}");
}
