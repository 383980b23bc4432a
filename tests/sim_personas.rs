//! The bridge reads a simulated engine of either persona as it reads the real
//! engine: its load and KV pool from `/metrics`, its models from `/v1/models`.

mod common;

use common::*;
use kvroute_bridge::load::{RankLoad, parse_load, parse_models};

#[tokio::test]
async fn the_bridge_reads_both_personas_load_and_models() {
    for persona in ["vllm", "sglang"] {
        let sim = Process::spawn(
            &["sim", "--persona", persona, "--kv-blocks", "256"],
            |lines| lines.iter().any(|l| l.starts_with("worker ")),
        );
        let url = sim.lines[0].split(' ').nth(2).unwrap().to_string();
        let http = Http::default();
        let metrics = http.get(&format!("{url}/metrics")).await.text();
        let load = parse_load(&metrics, 16);
        let expected = RankLoad {
            running: 0.0,
            waiting: 0.0,
            usage: Some(0.0),
            total_blocks: Some(256),
        };
        assert_eq!(load.get(&0), Some(&expected), "{persona}:\n{metrics}");
        assert_eq!(load.len(), 1, "{persona}: one rank");
        let models = http.get(&format!("{url}/v1/models")).await.json();
        assert_eq!(models["data"][0]["owned_by"], persona);
        let served = parse_models(&models).unwrap();
        assert_eq!(served.models, ["sim-model"], "{persona}");
        assert!(served.lora_names.is_empty());
    }
}
