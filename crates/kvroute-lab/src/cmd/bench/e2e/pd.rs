//! `kvroute-lab bench e2e --pd P:D[,P:D...]`: disaggregated fleets of P prefill
//! and D decode engines beside an aggregated fleet of P + D engines under
//! `kv`, on the same trace and rates, in one table per rate and one chart, and
//! issue 32's goals printed met or missed for each split:
//!
//! - inter-token latency p99 at most half the aggregated fleet's at the top rate;
//! - TTFT p50 at most 1.2× the aggregated fleet's at the lowest rate;
//! - the prefill pool's prefix hit rate at least 90% of the aggregated
//!   fleet's (at the top rate);
//! - output throughput not below the aggregated fleet's (at the top rate);
//! - no blocks freed by a prefill engine's lease timeout (every run).
//!
//! The disaggregated column's hit rate is the prefill engines' own: the decode
//! engines count a handed-over prompt as cached, which is a transfer, not a hit.

use std::str::FromStr;

use kvroute_e2e::{Fleet, PolicyReport, Replay};
use kvroute_router::config::Policy;
use kvroute_sim::{EngineConfig, PdConfig, PdConvention, Role};
use kvroute_trace::TraceRequest;
use serde_json::json;

use super::goals::{self, Goal};

/// A disaggregated fleet's shape, `P:D`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    pub prefill: usize,
    pub decode: usize,
}

impl FromStr for Split {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let parse = |n: &str| n.trim().parse::<usize>().ok().filter(|&n| n > 0);
        match s.split_once(':').map(|(p, d)| (parse(p), parse(d))) {
            Some((Some(prefill), Some(decode))) => Ok(Split { prefill, decode }),
            _ => Err(format!(
                "{s:?} is not P:D (prefill and decode engines, each at least 1)"
            )),
        }
    }
}

impl std::fmt::Display for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.prefill, self.decode)
    }
}

/// One run's report and the blocks its prefill engines freed by lease timeout.
struct Run {
    report: PolicyReport,
    lease_expired_blocks: u64,
}

/// Runs every split and its aggregated fleet at every rate of `rates`: the
/// JSON report and the top rate's reports, for the chart.
#[allow(clippy::too_many_arguments)]
pub fn run(
    splits: &[Split],
    convention: PdConvention,
    trace: &[TraceRequest],
    engine: &EngineConfig,
    router: &kvroute_router::Config,
    rates: &[f64],
    replay: impl Fn(f64) -> Replay,
    runtime: &tokio::runtime::Runtime,
) -> anyhow::Result<(serde_json::Value, Vec<PolicyReport>)> {
    let engines = splits[0].prefill + splits[0].decode;
    anyhow::ensure!(
        splits.iter().all(|s| s.prefill + s.decode == engines),
        "every --pd split must have as many engines as the first ({engines})"
    );
    let pd = PdConfig {
        convention,
        ..PdConfig::default()
    };
    let mut runs: Vec<(f64, Vec<Run>)> = Vec::new();
    for &rate in rates {
        let replay = replay(rate);
        let reports = runtime.block_on(async {
            let mut reports = Vec::new();
            eprintln!(
                "bench e2e --pd: {} requests at rate {rate} on {engines} aggregated engines ...",
                trace.len()
            );
            let fleet = Fleet::start(engines, engine, router, Policy::Kv).await?;
            let mut report = kvroute_e2e::run(&fleet, Policy::Kv, trace, replay).await?;
            report.policy = format!("aggregated {engines}");
            fleet.shutdown().await;
            reports.push(Run {
                report,
                lease_expired_blocks: 0,
            });
            for split in splits {
                eprintln!(
                    "bench e2e --pd: {} requests at rate {rate} on {split} ({}) ...",
                    trace.len(),
                    convention_name(convention)
                );
                let fleet =
                    Fleet::start_pd(split.prefill, split.decode, engine, router, &pd).await?;
                let mut report = kvroute_e2e::run(&fleet, Policy::Kv, trace, replay).await?;
                report.policy = format!("disaggregated {split}");
                let prefill: Vec<_> = fleet
                    .workers
                    .iter()
                    .filter(|w| w.role() == Role::Prefill)
                    .collect();
                let (prompt, cached) = prefill.iter().fold((0, 0), |(p, c), w| {
                    let (stats, _) = w.stats();
                    (p + stats.prompt_tokens, c + stats.cached_tokens)
                });
                report.worker_hit_rate = if prompt == 0 {
                    0.0
                } else {
                    cached as f64 / prompt as f64
                };
                let lease_expired_blocks = prefill
                    .iter()
                    .map(|w| w.pd_stats().lease_expired_blocks)
                    .sum();
                fleet.shutdown().await;
                reports.push(Run {
                    report,
                    lease_expired_blocks,
                });
            }
            anyhow::Ok(reports)
        })?;
        let table: Vec<PolicyReport> = reports.iter().map(|r| r.report.clone()).collect();
        eprintln!(
            "\nrate {rate} (disaggregated hit rate: the prefill engines')\n{}",
            kvroute_e2e::table(&table, false)
        );
        runs.push((rate, reports));
    }
    let goals = check(&runs);
    let top = runs
        .last()
        .map(|(_, reports)| reports.iter().map(|r| r.report.clone()).collect())
        .unwrap_or_default();
    let result = json!({
        "convention": convention_name(convention),
        "runs": runs.iter().map(|(rate, reports)| json!({
            "rate": rate,
            "fleets": reports.iter().map(|r| json!({
                "report": r.report,
                "lease_expired_blocks": r.lease_expired_blocks,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "goals": goals.iter().map(|(fleet, goals)| json!({"fleet": fleet, "goals": goals}))
            .collect::<Vec<_>>(),
    });
    Ok((result, top))
}

fn convention_name(convention: PdConvention) -> &'static str {
    match convention {
        PdConvention::Vllm => "vllm",
        PdConvention::Sglang => "sglang",
    }
}

/// Each split's goals against the aggregated fleet, printed.
fn check(runs: &[(f64, Vec<Run>)]) -> Vec<(String, Vec<Goal>)> {
    let (Some((light, light_runs)), Some((top, top_runs))) = (runs.first(), runs.last()) else {
        return Vec::new();
    };
    let columns: Vec<(String, Vec<Goal>)> = (1..top_runs.len())
        .map(|i| {
            let (aggregated, split) = (&top_runs[0].report, &top_runs[i].report);
            let (light_aggregated, light_split) = (&light_runs[0].report, &light_runs[i].report);
            let expired: u64 = runs.iter().map(|(_, r)| r[i].lease_expired_blocks).sum();
            let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::INFINITY };
            let itl = ratio(split.itl_ms.p99, aggregated.itl_ms.p99);
            let ttft = ratio(light_split.ttft_ms.p50, light_aggregated.ttft_ms.p50);
            let hit = ratio(split.worker_hit_rate, aggregated.worker_hit_rate);
            let throughput = ratio(split.output_tokens_per_s, aggregated.output_tokens_per_s);
            let goals = vec![
                Goal {
                    goal: "inter-token p99 ≤ 0.5× aggregated (top rate)",
                    value: format!("{itl:.2}×"),
                    met: itl <= 0.5,
                },
                Goal {
                    goal: "TTFT p50 ≤ 1.2× aggregated (lowest rate)",
                    value: format!("{ttft:.2}×"),
                    met: ttft <= 1.2,
                },
                Goal {
                    goal: "prefill pool hit rate ≥ 90% of aggregated's (top rate)",
                    value: format!("{:.0}%", hit * 100.0),
                    met: hit >= 0.9,
                },
                Goal {
                    goal: "output throughput ≥ aggregated's (top rate)",
                    value: format!("{throughput:.2}×"),
                    met: throughput >= 1.0,
                },
                Goal {
                    goal: "blocks freed by lease timeout = 0 (every rate)",
                    value: expired.to_string(),
                    met: expired == 0,
                },
            ];
            (split.policy.clone(), goals)
        })
        .collect();
    eprintln!(
        "\ngoals against aggregated, lowest rate {light}, top rate {top}\n{}",
        goals::table(&columns)
    );
    columns
}
