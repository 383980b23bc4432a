//! The engine's load and identity, from its own HTTP endpoints.
//!
//! Engines publish no load events, but both export Prometheus gauges: vLLM
//! `vllm:num_requests_running`, `vllm:num_requests_waiting` and
//! `vllm:gpu_cache_usage_perc` (renamed `vllm:kv_cache_usage_perc`), with its KV
//! pool size as the `num_gpu_blocks` label of `vllm:cache_config_info`; SGLang
//! `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage` and
//! `sglang:max_total_num_tokens`. Usage gauges are fractions (0..1) despite the
//! name. With data parallelism vLLM labels each rank's series `engine="N"`
//! (SGLang `dp_rank`); unlabelled series belong to rank 0.
//!
//! The text format is parsed here: the general-purpose parser crates reject
//! metric names with colons, which both engines use.

use std::collections::BTreeMap;

use kvroute_proto as proto;
use serde_json::Value;

/// One rank's load, as far as the engine reports it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankLoad {
    pub running: f64,
    pub waiting: f64,
    /// Fraction of the KV pool in use.
    pub usage: Option<f64>,
    /// Size of the KV pool in blocks.
    pub total_blocks: Option<u64>,
}

impl RankLoad {
    pub fn report(&self, dp_rank: u32) -> proto::LoadReport {
        let total = self.total_blocks.unwrap_or(0);
        let used = self
            .usage
            .map_or(0, |u| (u.clamp(0.0, 1.0) * total as f64).round() as u64);
        proto::LoadReport {
            dp_rank,
            running_requests: self.running as u32,
            queued_requests: self.waiting as u32,
            kv_blocks_used: used,
            kv_blocks_total: total,
            prefill_tokens_in_flight: 0,
        }
    }
}

/// Per-rank load from a Prometheus text exposition; `block_size` converts SGLang's token pool.
pub fn parse_load(text: &str, block_size: u32) -> BTreeMap<u32, RankLoad> {
    let mut ranks: BTreeMap<u32, RankLoad> = BTreeMap::new();
    for sample in text.lines().filter_map(parse_sample) {
        let rank = sample
            .label("engine")
            .or_else(|| sample.label("dp_rank"))
            .and_then(|r| r.parse().ok())
            .unwrap_or(0);
        let load = ranks.entry(rank).or_default();
        match sample.name {
            "vllm:num_requests_running" | "sglang:num_running_reqs" => load.running += sample.value,
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => load.waiting += sample.value,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                load.usage = Some(sample.value)
            }
            "vllm:cache_config_info" => {
                if let Some(blocks) = sample.label("num_gpu_blocks").and_then(|b| b.parse().ok()) {
                    load.total_blocks = Some(blocks);
                }
            }
            "sglang:max_total_num_tokens" => {
                load.total_blocks = Some(sample.value as u64 / u64::from(block_size))
            }
            _ => {}
        }
    }
    ranks
}

struct Sample<'a> {
    name: &'a str,
    labels: Vec<(&'a str, String)>,
    value: f64,
}

impl Sample<'_> {
    fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `name{label="value",...} value [timestamp]`; comments and broken lines are `None`.
fn parse_sample(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(body) = rest.strip_prefix('{') {
        rest = body;
        loop {
            rest = rest.trim_start_matches([',', ' ']);
            if let Some(after) = rest.strip_prefix('}') {
                rest = after;
                break;
            }
            let (key, after) = rest.split_once('=')?;
            let (value, after) = quoted(after.strip_prefix('"')?)?;
            labels.push((key.trim(), value));
            rest = after;
        }
    }
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// A label value up to its closing quote, unescaped, and what follows it.
fn quoted(s: &str) -> Option<(String, &str)> {
    let mut value = String::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((value, &s[i + 1..])),
            '\\' => match chars.next()?.1 {
                'n' => value.push('\n'),
                other => value.push(other),
            },
            c => value.push(c),
        }
    }
    None
}

/// What the engine serves, from its OpenAI-compatible `/v1/models`: base models,
/// and LoRA adapters (entries with a `parent`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ServedModels {
    pub models: Vec<String>,
    pub lora_names: Vec<String>,
}

pub fn parse_models(body: &Value) -> Option<ServedModels> {
    let mut served = ServedModels::default();
    for entry in body.get("data")?.as_array()? {
        let id = entry.get("id")?.as_str()?.to_owned();
        match entry.get("parent") {
            Some(Value::String(_)) => served.lora_names.push(id),
            _ => served.models.push(id),
        }
    }
    Some(served)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_gauges_per_engine_rank() {
        let text = r#"
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000",prefix="a\"b,c"} 1.0
"#;
        let load = parse_load(text, 16);
        assert_eq!(
            load[&0],
            RankLoad {
                running: 3.0,
                waiting: 2.0,
                usage: Some(0.25),
                total_blocks: Some(1000)
            }
        );
        assert_eq!(load[&1].running, 1.0);
        let report = load[&0].report(0);
        assert_eq!((report.kv_blocks_used, report.kv_blocks_total), (250, 1000));
        assert_eq!((report.running_requests, report.queued_requests), (3, 2));
    }

    #[test]
    fn older_vllm_and_sglang_names() {
        let vllm = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.5\n";
        assert_eq!(parse_load(vllm, 16)[&0].usage, Some(0.5));
        let sglang = "sglang:num_running_reqs{model_name=\"m\"} 4\n\
                      sglang:num_queue_reqs{model_name=\"m\"} 6\n\
                      sglang:token_usage{model_name=\"m\"} 0.75\n\
                      sglang:max_total_num_tokens{model_name=\"m\"} 1600\n";
        let report = parse_load(sglang, 16)[&0].report(0);
        assert_eq!(
            (
                report.running_requests,
                report.queued_requests,
                report.kv_blocks_used,
                report.kv_blocks_total
            ),
            (4, 6, 75, 100)
        );
    }

    #[test]
    fn models_and_lora_adapters() {
        let body = serde_json::json!({"object": "list", "data": [
            {"id": "llama", "object": "model", "parent": null},
            {"id": "sql-lora", "object": "model", "parent": "llama"},
        ]});
        assert_eq!(
            parse_models(&body),
            Some(ServedModels {
                models: vec!["llama".into()],
                lora_names: vec!["sql-lora".into()],
            })
        );
        assert_eq!(parse_models(&serde_json::json!({"data": 1})), None);
    }
}
