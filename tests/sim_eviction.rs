//! Eviction policies in a running simulated engine, as real processes on
//! loopback: the run-time switch (`POST /admin/eviction`) behind a real router,
//! priority classes passed through the router, `kvroute-lab sim stats`, and
//! `--log-evictions`.

mod common;

use std::process::Stdio;

use common::*;
use serde_json::json;

fn prompt(seed: u32) -> Vec<u32> {
    (seed * 1000..seed * 1000 + 64).collect()
}

async fn sim_last_event_id(url: &str) -> f64 {
    let text = Http::default().get(&format!("{url}/metrics")).await.text();
    metric(&text, "kvroute_sim_last_event_id", &[])
}

#[tokio::test]
async fn switching_policy_at_run_time_keeps_every_cached_block_and_the_routers_index() {
    let router = RouterProcess::start("");
    let sim = SimFleet::start(Some(&router.grpc), 1);
    wait_registered(&router, 1).await;
    let (id, url) = sim.workers[0].clone();
    let http = Http::default();
    // Four prompts of 4 blocks each, one per class and one without, through the router.
    for (seed, class) in [(1, Some(0)), (2, Some(1)), (3, Some(2)), (4, None)] {
        let mut body = json!({"model": "sim-model", "prompt": prompt(seed), "max_tokens": 2});
        if let Some(class) = class {
            body["priority_class"] = json!(class);
        }
        let reply = http
            .post(&format!("{}/v1/completions", router.http), &body)
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let events = sim_last_event_id(&url).await;
    eventually("the router indexed every block", || async {
        let (blocks, last) = indexed(&router, id).await;
        blocks == 16 && last as f64 == events
    })
    .await;
    let before = http.get(&format!("{url}/admin/eviction")).await.json();
    assert_eq!(before["policy"], "lru");
    assert_eq!(before["kv_blocks_cached"], 16);
    // The router passed each request's class through.
    let classes: Vec<u64> = (0..3)
        .map(|c| before["classes"][c]["requests"].as_u64().unwrap())
        .collect();
    assert_eq!(classes, [1, 2, 1]);

    let switched = http
        .post(&format!("{url}/admin/eviction"), &json!({"policy": "qos"}))
        .await;
    assert_eq!(switched.status, 200, "{}", switched.text());
    let switched = switched.json();
    assert_eq!(
        (&switched["from"], &switched["to"]),
        (&json!("lru"), &json!("qos"))
    );
    assert_eq!(switched["cached_blocks"], 16);
    // No block lost, no event sent, the router's view unchanged.
    assert_eq!(sim_last_event_id(&url).await, events);
    assert_eq!(indexed(&router, id).await, (16, events as u64));
    let after = http.get(&format!("{url}/admin/eviction")).await.json();
    assert_eq!(after["policy"], "qos");
    assert_eq!(after["kv_blocks_cached"], 16);
    let reply = http
        .post(
            &format!("{}/v1/completions", router.http),
            &json!({"model": "sim-model", "prompt": prompt(1), "max_tokens": 1}),
        )
        .await
        .json();
    assert_eq!(reply["usage"]["prompt_tokens_details"]["cached_tokens"], 64);

    // Bad switches are refused and change nothing.
    for (body, says) in [
        (json!({"policy": "belady"}), "reference bound"),
        (json!({"policy": "mru"}), "unknown policy"),
        (json!({}), "missing field `policy`"),
    ] {
        let reply = http.post(&format!("{url}/admin/eviction"), &body).await;
        assert_eq!(reply.status, 400, "{body}");
        let message = reply.json()["error"]["message"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(message.contains(says), "{message}");
    }
    let bad_class = http
        .post(
            &format!("{url}/v1/completions"),
            &json!({"model": "sim-model", "prompt": prompt(5), "priority_class": 3}),
        )
        .await;
    assert_eq!(bad_class.status, 400, "{}", bad_class.text());
    let figures = http.get(&format!("{url}/admin/eviction")).await.json();
    let policies: Vec<&str> = figures["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["policy"].as_str().unwrap())
        .collect();
    assert_eq!(policies, ["lru", "qos"]);
    assert_eq!(figures["policy"], "qos");

    // `kvroute-lab sim stats` prints both policies' figures and the goals.
    let output = kvroute_lab_output(&["sim", "stats", "--url", &url]);
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{text}");
    for needle in ["lru", "qos", "decision time p99", "re-prefill rate", "met"] {
        assert!(text.contains(needle), "{needle} missing from:\n{text}");
    }
    let unreachable = kvroute_lab_output(&["sim", "stats", "--url", "http://127.0.0.1:1"]);
    assert!(!unreachable.status.success());
}

#[tokio::test]
async fn log_evictions_writes_one_line_per_eviction() {
    let dir = std::env::temp_dir().join(format!("kvroute-evictlog-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("stderr.log");
    let mut command = kvroute();
    command
        .args([
            "sim",
            "--workers",
            "1",
            "--block-size",
            "16",
            "--kv-blocks",
            "8",
            "--speedup",
            "100",
            "--eviction",
            "s3fifo",
            "--log-evictions",
        ])
        .env("RUST_LOG", "info")
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()));
    let process = Process::start(command, |lines| {
        lines.iter().any(|l| l.starts_with("worker "))
    });
    let url = process.lines[0].split(' ').nth(2).unwrap().to_owned();
    let http = Http::default();
    // Three 4-block prompts through 8 blocks: the third needs evictions.
    for seed in 1..=3 {
        let reply = http
            .post(
                &format!("{url}/v1/completions"),
                &json!({"model": "sim-model", "prompt": prompt(seed), "max_tokens": 1}),
            )
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let evictions = metric(
        &http.get(&format!("{url}/metrics")).await.text(),
        "kvroute_sim_evictions_total",
        &[],
    );
    assert!(evictions >= 4.0, "{evictions}");
    let lines = || -> Vec<String> {
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .filter(|l| l.contains("kvroute_sim::eviction"))
            .map(str::to_owned)
            .collect()
    };
    eventually("every eviction is logged", || async {
        lines().len() as f64 == evictions
    })
    .await;
    for line in lines() {
        assert!(
            line.contains("policy=s3fifo")
                && line.contains("blocks_freed=1")
                && line.contains("why="),
            "{line}"
        );
        // tracing's timestamp opens the line.
        assert!(line.starts_with("20"), "{line}");
    }
    drop(process);
    let _ = std::fs::remove_dir_all(&dir);
}
