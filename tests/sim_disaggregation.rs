//! `kvroute sim --prefill-workers P --decode-workers D` as a real process: both
//! pools start in one process, say their roles, and hand KV over as SGLang's
//! engines do.

mod common;

use common::*;
use serde_json::json;

#[tokio::test]
async fn one_process_runs_both_pools_and_they_hand_kv_over() {
    let sim = Process::spawn(
        &[
            "sim",
            "--prefill-workers",
            "1",
            "--decode-workers",
            "2",
            "--persona",
            "sglang",
            "--speedup",
            "100",
            "--kv-lease-timeout-secs",
            "5",
        ],
        |lines| lines.iter().filter(|l| l.starts_with("worker ")).count() == 3,
    );
    let engines: Vec<Vec<&str>> = sim
        .lines
        .iter()
        .filter(|l| l.starts_with("worker "))
        .map(|l| l.split(' ').collect())
        .collect();
    let roles: Vec<(&str, &str)> = engines.iter().map(|e| (e[1], e[3])).collect();
    assert_eq!(
        roles,
        [
            ("0", "role=prefill"),
            ("1", "role=decode"),
            ("2", "role=decode")
        ],
        "{:?}",
        sim.lines
    );
    let (prefill, decode) = (engines[0][2], engines[1][2]);
    let bootstrap: u16 = engines[0][4]
        .strip_prefix("bootstrap=")
        .and_then(|p| p.parse().ok())
        .filter(|&p| p != 0)
        .unwrap_or_else(|| panic!("no bootstrap port in {:?}", engines[0]));

    let http = Http::default();
    for (url, mode) in [(prefill, "prefill"), (decode, "decode")] {
        let info = http.get(&format!("{url}/server_info")).await.json();
        assert_eq!(info["disaggregation_mode"], mode);
    }
    let body = json!({"model": "sim-model", "prompt": tokens(0, 40), "max_tokens": 2,
        "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": 42});
    let (prefill_url, decode_url) = (
        format!("{prefill}/v1/completions"),
        format!("{decode}/v1/completions"),
    );
    let (decoded, prefilled) = tokio::join!(
        http.post(&decode_url, &body),
        http.post(&prefill_url, &body)
    );
    assert_eq!(prefilled.status, 200, "{}", prefilled.text());
    assert_eq!(decoded.status, 200, "{}", decoded.text());
    assert_eq!(
        decoded.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        39
    );
    let served = http.get(&format!("{prefill}/metrics")).await.text();
    assert_eq!(metric(&served, "kvroute_sim_pd_handoffs_total", &[]), 1.0);
    assert_eq!(
        metric(&served, "kvroute_sim_pd_lease_expired_blocks_total", &[]),
        0.0
    );
}

#[test]
fn the_pools_replace_workers_and_role() {
    for (args, named) in [
        (
            &[
                "sim",
                "--prefill-workers",
                "1",
                "--decode-workers",
                "1",
                "--workers",
                "2",
            ][..],
            "--workers",
        ),
        (
            &[
                "sim",
                "--prefill-workers",
                "1",
                "--decode-workers",
                "1",
                "--role",
                "decode",
            ],
            "--role",
        ),
        (&["sim", "--prefill-workers", "1"], "--decode-workers"),
    ] {
        let output = kvroute_output(args);
        assert!(!output.status.success(), "{args:?} was accepted");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(named), "{args:?}: {stderr}");
    }
}
