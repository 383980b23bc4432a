//! Issue 13's routing goals, checked on a `bench e2e` run: each `kv` cost
//! against round robin at the same rate, and against one shared cache of the
//! fleet's size that evicts in the engines' order.
//!
//! The bound replays the same requests through a single cache of
//! `workers × kv_blocks` blocks in the engine mode's order (`replay --order
//! vllm|sglang`): a router can at best make eight caches behave as one.

use kvroute_cache::{PreparedTrace, S3FifoParams, replay_sglang, replay_vllm};
use kvroute_sim::{EngineConfig, EngineKind};
use kvroute_trace::TraceRequest;
use serde::Serialize;

use kvroute_e2e::PolicyReport;

/// One goal for one `kv` cost at one rate.
#[derive(Clone, Debug, Serialize)]
pub struct Goal {
    pub goal: &'static str,
    /// The measured figure, formatted.
    pub value: String,
    pub met: bool,
}

/// Hit rate of one shared cache of `workers × engine.kv_blocks` blocks over
/// `trace`, evicting as `engine`'s mode does (cached over prompt tokens).
pub fn shared_cache_bound(
    trace: &[TraceRequest],
    workers: usize,
    engine: &EngineConfig,
) -> anyhow::Result<f64> {
    let prepared = PreparedTrace::new(trace);
    let capacity = workers * engine.kv_blocks;
    let block_size = engine.block_size as u64;
    let report = match engine.kind {
        EngineKind::Sglang => replay_sglang(Some(capacity), &prepared, block_size, || {}),
        EngineKind::Vllm => {
            let mut cache =
                engine
                    .eviction
                    .build(capacity, S3FifoParams::default(), prepared.accesses())?;
            replay_vllm(cache.as_mut(), &prepared, block_size, || {})
        }
    };
    Ok(report.overall_hit_rate())
}

/// The goals of `kv` (one cost's run) against `round_robin`'s run at the same
/// rate; `top_rate`: the run past round robin's saturation, where TTFT p50
/// must halve.
pub fn goals(
    kv: &PolicyReport,
    round_robin: &PolicyReport,
    bound: f64,
    top_rate: bool,
) -> Vec<Goal> {
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::INFINITY };
    let hit_ratio = ratio(kv.worker_hit_rate, round_robin.worker_hit_rate);
    let of_bound = ratio(kv.worker_hit_rate, bound);
    let p50 = ratio(kv.ttft_ms.p50, round_robin.ttft_ms.p50);
    let p50_goal = if top_rate { 0.5 } else { 0.7 };
    let p99 = ratio(kv.ttft_ms.p99, round_robin.ttft_ms.p99);
    let gap = kv
        .predicted_hit_rate
        .map(|p| (p - kv.worker_hit_rate).abs() * 100.0);
    vec![
        Goal {
            goal: "hit rate ≥ 3× round robin's",
            value: format!("{hit_ratio:.2}×"),
            met: hit_ratio >= 3.0,
        },
        Goal {
            goal: "hit rate ≥ 95% of one shared cache",
            value: format!("{:.0}% of {:.1}%", of_bound * 100.0, bound * 100.0),
            met: of_bound >= 0.95,
        },
        Goal {
            goal: if top_rate {
                "TTFT p50 ≤ 0.5× round robin's"
            } else {
                "TTFT p50 ≤ 0.7× round robin's"
            },
            value: format!("{p50:.2}×"),
            met: p50 <= p50_goal,
        },
        Goal {
            goal: "TTFT p99 ≤ round robin's",
            value: format!("{p99:.2}×"),
            met: p99 <= 1.0,
        },
        Goal {
            goal: "Jain ≥ 0.9",
            value: format!("{:.3}", kv.jain_fairness),
            met: kv.jain_fairness >= 0.9,
        },
        Goal {
            goal: "predicted hit within 2 points",
            value: gap.map_or("-".into(), |g| format!("{g:.1} points")),
            met: gap.is_some_and(|g| g <= 2.0),
        },
    ]
}

/// The goals table: one row per goal, one column per `kv` cost.
pub fn table(columns: &[(String, Vec<Goal>)]) -> String {
    use std::fmt::Write as _;
    let Some((_, first)) = columns.first() else {
        return String::new();
    };
    let cell = |g: &Goal| format!("{} {}", g.value, if g.met { "met" } else { "missed" });
    let name_width = first
        .iter()
        .map(|g| g.goal.chars().count())
        .max()
        .unwrap_or(0)
        + 2;
    let widths: Vec<usize> = columns
        .iter()
        .map(|(name, goals)| {
            goals
                .iter()
                .map(|g| cell(g).chars().count())
                .chain([name.len()])
                .max()
                .unwrap_or(0)
                + 3
        })
        .collect();
    let mut out = String::new();
    let _ = write!(out, "{:<name_width$}", "");
    for ((name, _), width) in columns.iter().zip(&widths) {
        let _ = write!(out, "{name:>width$}");
    }
    out.push('\n');
    for (row, goal) in first.iter().enumerate() {
        let pad = name_width - goal.goal.chars().count();
        let _ = write!(out, "{}{:pad$}", goal.goal, "");
        for ((_, goals), width) in columns.iter().zip(&widths) {
            let text = goals.get(row).map_or("-".into(), cell);
            let pad = width.saturating_sub(text.chars().count());
            let _ = write!(out, "{:pad$}{text}", "");
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_cache::PolicyKind;

    #[test]
    fn the_bound_is_the_labs_replay_in_the_engines_order() {
        // Two requests sharing a first block; a cache big enough for all.
        let trace = vec![
            TraceRequest {
                timestamp_ms: 0,
                input_length: 1024,
                output_length: 1,
                hash_ids: vec![1, 2],
            },
            TraceRequest {
                timestamp_ms: 1,
                input_length: 1024,
                output_length: 1,
                hash_ids: vec![1, 3],
            },
        ];
        for kind in [EngineKind::Vllm, EngineKind::Sglang] {
            let engine = EngineConfig {
                kv_blocks: 2,
                block_size: 512,
                kind,
                eviction: PolicyKind::Lru,
                ..EngineConfig::default()
            };
            // 512 of 2,048 prompt tokens hit.
            assert_eq!(
                shared_cache_bound(&trace, 2, &engine).unwrap(),
                0.25,
                "{kind:?}"
            );
        }
    }
}
