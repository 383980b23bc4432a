//! `kvroute-lab bench index`: the global index under a production-shaped workload.
//!
//! A Mooncake trace is turned into a merged timeline of lookups and KV events by
//! simulating a fleet ([`kvroute_index::timeline`]); the timeline is replayed
//! against a fresh index several times with the workers' events split over the
//! ingest threads and the lookups spread over the same threads, so lookups run
//! while events are applied. Memory per membership is measured separately on the
//! same trace with unbounded pools (no eviction), and an optional churn run streams
//! millions of events over new content to show that memory stays flat.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use hdrhistogram::Histogram;
use kvroute_index::timeline::{FleetSimulator, TimelineOp, derive_timeline};
use kvroute_index::{
    EventKind, IndexConfig, KvEvent, KvIndex, Matches, StoredBlock, WorkerKey, WorkerMatch,
};
use serde_json::{Value, json};

use super::cpu_time::thread_cpu_time;

/// The conversation trace bundled with the sources.
const BUNDLED_TRACE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/data/traces/conversation_trace.jsonl"
);

#[derive(Args)]
pub struct IndexBenchArgs {
    /// Mooncake trace (JSON Lines) to derive the timeline from [default: the bundled conversation trace].
    #[arg(long, conflicts_with = "timeline")]
    trace: Option<PathBuf>,
    /// Replay this saved timeline (JSON Lines) instead of deriving one.
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// Write the merged timeline to this file (JSON Lines).
    #[arg(long)]
    save_timeline: Option<PathBuf>,
    /// Simulated workers.
    #[arg(long, default_value_t = 16)]
    workers: usize,
    /// Each simulated worker's LRU block pool.
    #[arg(long, default_value_t = 512)]
    blocks_per_worker: usize,
    /// Threads applying events (each owns a share of the workers) and running lookups.
    #[arg(long, default_value_t = 2)]
    ingest_threads: usize,
    /// Replays of the timeline, each on a fresh index.
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// Also stream this many events over ever-new content and report RSS flatness.
    #[arg(long)]
    churn_events: Option<u64>,
    /// The index's memory bound, as the router's `max_blocks` sets it [default: unbounded].
    #[arg(long)]
    max_blocks: Option<usize>,
}

pub fn run(args: IndexBenchArgs) -> anyhow::Result<()> {
    if args.workers == 0
        || args.blocks_per_worker == 0
        || args.ingest_threads == 0
        || args.rounds == 0
    {
        bail!("--workers, --blocks-per-worker, --ingest-threads and --rounds must be at least 1");
    }
    if args.max_blocks == Some(0) {
        bail!("--max-blocks must be at least 1");
    }
    let config = IndexConfig {
        max_blocks: args.max_blocks,
    };
    // The churn run goes first, so that the process's RSS is the index's and
    // not what the other measurements freed.
    let churned = match (args.churn_events, &args.timeline) {
        (Some(_), Some(_)) => bail!("--churn-events needs a trace, not a saved timeline"),
        (Some(events), None) => {
            let path = args
                .trace
                .clone()
                .unwrap_or_else(|| PathBuf::from(BUNDLED_TRACE));
            let requests: Vec<Vec<u64>> = kvroute_trace::read_trace(&path, None)?
                .into_iter()
                .map(|r| r.hash_ids)
                .collect();
            Some(churn(
                &config,
                &requests,
                args.workers,
                args.blocks_per_worker,
                events,
            ))
        }
        (None, _) => None,
    };
    let (source, ops, requests) = match &args.timeline {
        Some(path) => (path.display().to_string(), load_timeline(path)?, None),
        None => {
            let path = args
                .trace
                .clone()
                .unwrap_or_else(|| PathBuf::from(BUNDLED_TRACE));
            let trace = kvroute_trace::read_trace(&path, None)?;
            let requests: Vec<Vec<u64>> = trace.into_iter().map(|r| r.hash_ids).collect();
            let ops = derive_timeline(
                requests.iter().map(Vec::as_slice),
                args.workers,
                args.blocks_per_worker,
            );
            (path.display().to_string(), ops, Some(requests))
        }
    };
    if let Some(path) = &args.save_timeline {
        save_timeline(path, &ops)?;
    }
    let shape = Shape::of(&ops);
    let memory = match &requests {
        Some(requests) => measure_memory(
            &config,
            &derive_timeline(requests.iter().map(Vec::as_slice), args.workers, usize::MAX),
        ),
        None => measure_memory(&config, &ops),
    };
    let replay = replay(&config, &ops, args.ingest_threads, args.rounds);
    let secs = replay.wall.as_secs_f64();
    let rounds = args.rounds as f64;
    let us = |q: f64| replay.lookups.value_at_quantile(q) as f64 / 1000.0;
    let mut result = json!({
        "bench": "index",
        "source": source,
        "ingest_threads": args.ingest_threads,
        "max_blocks": args.max_blocks,
        "rounds": args.rounds,
        "requests": shape.lookups,
        "events": shape.events,
        "removes_share": shape.removes as f64 / shape.ops() as f64,
        "ops_per_s": shape.ops() as f64 * rounds / secs,
        "ops_per_cpu_s": shape.ops() as f64 * rounds / replay.cpu.as_secs_f64(),
        "cpu_share": replay.cpu.as_secs_f64() / (secs * args.ingest_threads as f64),
        "block_ops_per_s": (shape.event_blocks + shape.lookup_blocks) as f64 * rounds / secs,
        "ingest_blocks_per_s": shape.event_blocks as f64 * rounds / secs,
        "find_matches_us": {"p50": us(0.5), "p99": us(0.99), "p999": us(0.999), "max": us(1.0)},
        "memory": {
            "eviction": requests.is_none(),
            "memberships": memory.memberships,
            "distinct_blocks": memory.distinct_blocks,
            "heap_bytes_per_membership": memory.heap_bytes as f64 / memory.memberships.max(1) as f64,
            "rss_bytes_per_membership": memory.rss_delta as f64 / memory.memberships.max(1) as f64,
        },
    });
    if let Some(churned) = churned {
        result["churn"] = churned;
    }
    result["peak_rss_bytes"] = json!(rss_kib("VmHWM:") * 1024);
    println!("{result}");
    Ok(())
}

/// Counts of a timeline's operations.
struct Shape {
    lookups: u64,
    events: u64,
    removes: u64,
    event_blocks: u64,
    lookup_blocks: u64,
}

impl Shape {
    fn of(ops: &[TimelineOp]) -> Shape {
        let mut shape = Shape {
            lookups: 0,
            events: 0,
            removes: 0,
            event_blocks: 0,
            lookup_blocks: 0,
        };
        for op in ops {
            match op {
                TimelineOp::Match { tokens_hashes } => {
                    shape.lookups += 1;
                    shape.lookup_blocks += tokens_hashes.len() as u64;
                }
                TimelineOp::Event { event, .. } => {
                    shape.events += 1;
                    shape.event_blocks += match &event.kind {
                        EventKind::Stored { blocks, .. } => blocks.len() as u64,
                        EventKind::Removed { block_hashes } => {
                            shape.removes += 1;
                            block_hashes.len() as u64
                        }
                        EventKind::Cleared => 0,
                    };
                }
            }
        }
        shape
    }

    fn ops(&self) -> u64 {
        self.lookups + self.events
    }
}

struct Replay {
    wall: Duration,
    /// CPU time the replay threads got: the machine may be shared.
    cpu: Duration,
    /// find_matches latencies in nanoseconds.
    lookups: Histogram<u64>,
}

/// Replays `ops` `rounds` times on fresh indexes: each thread applies the events
/// of its share of the workers and every `threads`-th lookup, in timeline order.
fn replay(config: &IndexConfig, ops: &[TimelineOp], threads: usize, rounds: usize) -> Replay {
    let mut shares: Vec<Vec<&TimelineOp>> = vec![Vec::new(); threads];
    let mut lookups = 0;
    for op in ops {
        let thread = match op {
            TimelineOp::Event { worker, .. } => worker.worker_id as usize % threads,
            TimelineOp::Match { .. } => {
                lookups += 1;
                lookups % threads
            }
        };
        shares[thread].push(op);
    }
    let mut total = Replay {
        wall: Duration::ZERO,
        cpu: Duration::ZERO,
        lookups: latency_histogram(),
    };
    for _ in 0..rounds {
        let index = KvIndex::new(config.clone());
        let start = Barrier::new(threads + 1);
        std::thread::scope(|scope| {
            let handles: Vec<_> = shares
                .iter()
                .map(|share| {
                    let (index, start) = (&index, &start);
                    scope.spawn(move || {
                        let mut hist = latency_histogram();
                        let mut matches = Matches::default();
                        start.wait();
                        let cpu_start = thread_cpu_time().unwrap_or_default();
                        for op in share {
                            match op {
                                TimelineOp::Event { worker, event } => {
                                    std::hint::black_box(index.apply(*worker, event));
                                }
                                TimelineOp::Match { tokens_hashes } => {
                                    let t = Instant::now();
                                    std::hint::black_box(best_match(
                                        index,
                                        tokens_hashes,
                                        &mut matches,
                                    ));
                                    hist.saturating_record(t.elapsed().as_nanos() as u64);
                                }
                            }
                        }
                        (
                            hist,
                            thread_cpu_time()
                                .unwrap_or_default()
                                .saturating_sub(cpu_start),
                        )
                    })
                })
                .collect();
            start.wait();
            let t = Instant::now();
            let hists: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            total.wall += t.elapsed();
            for (hist, cpu) in hists {
                total.lookups.add(hist).expect("histograms share bounds");
                total.cpu += cpu;
            }
        });
    }
    total
}

/// A lookup as a router makes it: every matching worker as an (index, depth)
/// pair, and the key of the deepest one resolved.
fn best_match(
    index: &KvIndex,
    tokens_hashes: &[u64],
    matches: &mut Matches,
) -> Option<WorkerMatch> {
    index.find_matches_into(tokens_hashes, matches);
    index.resolve(matches, matches.deepest()?)
}

/// Nanoseconds from 1 ns to 10 s at 3 significant figures.
fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 10_000_000_000, 3).expect("valid bounds")
}

struct Memory {
    memberships: u64,
    distinct_blocks: u64,
    heap_bytes: u64,
    rss_delta: u64,
}

/// Applies every event of `ops` to a fresh index and measures what it holds.
fn measure_memory(config: &IndexConfig, ops: &[TimelineOp]) -> Memory {
    let before = rss_kib("VmRSS:");
    let index = KvIndex::new(config.clone());
    for op in ops {
        if let TimelineOp::Event { worker, event } = op {
            index.apply(*worker, event);
        }
    }
    let rss_delta = rss_kib("VmRSS:").saturating_sub(before) * 1024;
    let stats = index.stats();
    Memory {
        memberships: stats.memberships,
        distinct_blocks: stats.blocks,
        heap_bytes: index.heap_bytes(),
        rss_delta,
    }
}

/// Streams `events` events over laps of the trace, each lap with new block ids so
/// that every block is eventually evicted, and samples the process RSS.
fn churn(
    config: &IndexConfig,
    requests: &[Vec<u64>],
    workers: usize,
    blocks_per_worker: usize,
    events: u64,
) -> Value {
    const SAMPLES: u64 = 20;
    let index = KvIndex::new(config.clone());
    let mut fleet = FleetSimulator::new(workers, blocks_per_worker);
    let mut ops = Vec::new();
    let (mut applied, mut next_sample) = (0u64, events / SAMPLES);
    let mut samples = Vec::new();
    let start = Instant::now();
    'laps: for lap in 0u64.. {
        for ids in requests {
            let ids: Vec<u64> = ids.iter().map(|id| id + (lap << 40)).collect();
            ops.clear();
            fleet.request(&ids, &mut ops);
            for op in &ops {
                match op {
                    TimelineOp::Event { worker, event } => {
                        index.apply(*worker, event);
                        applied += 1;
                    }
                    TimelineOp::Match { tokens_hashes } => {
                        std::hint::black_box(index.find_matches(tokens_hashes));
                    }
                }
            }
            if applied >= next_sample {
                samples.push((rss_kib("VmRSS:") * 1024, index.heap_bytes()));
                next_sample += events / SAMPLES;
            }
            if applied >= events {
                break 'laps;
            }
        }
    }
    // The first tenth warms up the allocator and the tables.
    let steady = &samples[samples.len() / 10..];
    let min = steady.iter().map(|s| s.0).min().unwrap_or(0);
    let max = steady.iter().map(|s| s.0).max().unwrap_or(0);
    let heap_min = steady.iter().map(|s| s.1).min().unwrap_or(0);
    let heap_max = steady.iter().map(|s| s.1).max().unwrap_or(0);
    json!({
        "events": applied,
        "seconds": start.elapsed().as_secs_f64(),
        "rss_bytes_min": min,
        "rss_bytes_max": max,
        "rss_spread": (max - min) as f64 / min.max(1) as f64,
        "index_heap_bytes_min": heap_min,
        "index_heap_bytes_max": heap_max,
        "index_heap_spread": (heap_max - heap_min) as f64 / heap_min.max(1) as f64,
        "memberships_last": index.stats().memberships,
    })
}

/// A field of /proc/self/status in KiB (0 where unavailable).
fn rss_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn save_timeline(path: &Path, ops: &[TimelineOp]) -> anyhow::Result<()> {
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut out = BufWriter::new(file);
    for op in ops {
        let line = match op {
            TimelineOp::Match { tokens_hashes } => {
                json!({"op": "match", "tokens_hashes": tokens_hashes})
            }
            TimelineOp::Event { worker, event } => {
                let mut line = match &event.kind {
                    EventKind::Stored {
                        parent_hash,
                        blocks,
                    } => json!({
                        "op": "stored",
                        "parent": parent_hash,
                        "blocks": blocks.iter().map(|b| [b.block_hash, b.tokens_hash]).collect::<Vec<_>>(),
                    }),
                    EventKind::Removed { block_hashes } => {
                        json!({"op": "removed", "block_hashes": block_hashes})
                    }
                    EventKind::Cleared => json!({"op": "cleared"}),
                };
                line["worker"] = json!(worker.worker_id);
                line["dp_rank"] = json!(worker.dp_rank);
                line["event_id"] = json!(event.event_id);
                line
            }
        };
        writeln!(out, "{line}").with_context(|| format!("cannot write {}", path.display()))?;
    }
    out.flush()
        .with_context(|| format!("cannot write {}", path.display()))
}

fn load_timeline(path: &Path) -> anyhow::Result<Vec<TimelineOp>> {
    let file =
        File::open(path).with_context(|| format!("cannot read timeline {}", path.display()))?;
    let mut ops = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("cannot read timeline {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let op =
            parse_op(&line).map_err(|e| anyhow::anyhow!("{}:{}: {e}", path.display(), i + 1))?;
        ops.push(op);
    }
    Ok(ops)
}

fn parse_op(line: &str) -> Result<TimelineOp, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let u64_field = |name: &str| {
        v.get(name)
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("missing or non-integer \"{name}\""))
    };
    let u64_list = |value: Option<&Value>, name: &str| -> Result<Vec<u64>, String> {
        value
            .and_then(Value::as_array)
            .ok_or_else(|| format!("missing array \"{name}\""))?
            .iter()
            .map(|x| {
                x.as_u64()
                    .ok_or_else(|| format!("non-integer in \"{name}\""))
            })
            .collect()
    };
    let op = v
        .get("op")
        .and_then(Value::as_str)
        .ok_or("missing \"op\"")?;
    if op == "match" {
        return Ok(TimelineOp::Match {
            tokens_hashes: u64_list(v.get("tokens_hashes"), "tokens_hashes")?,
        });
    }
    let kind = match op {
        "stored" => {
            let parent_hash = match v.get("parent") {
                None | Some(Value::Null) => None,
                Some(p) => Some(p.as_u64().ok_or("non-integer \"parent\"")?),
            };
            let blocks = v
                .get("blocks")
                .and_then(Value::as_array)
                .ok_or("missing array \"blocks\"")?
                .iter()
                .map(|pair| match u64_list(Some(pair), "blocks")?.as_slice() {
                    &[block_hash, tokens_hash] => Ok(StoredBlock {
                        block_hash,
                        tokens_hash,
                    }),
                    _ => Err("each block must be [block_hash, tokens_hash]".to_string()),
                })
                .collect::<Result<_, _>>()?;
            EventKind::Stored {
                parent_hash,
                blocks,
            }
        }
        "removed" => EventKind::Removed {
            block_hashes: u64_list(v.get("block_hashes"), "block_hashes")?,
        },
        "cleared" => EventKind::Cleared,
        other => return Err(format!("unknown op \"{other}\"")),
    };
    let dp_rank = u32::try_from(u64_field("dp_rank")?).map_err(|_| "\"dp_rank\" exceeds u32")?;
    Ok(TimelineOp::Event {
        worker: WorkerKey::new(u64_field("worker")?, dp_rank),
        event: KvEvent {
            event_id: u64_field("event_id")?,
            kind,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_timelines_load_back_equal() {
        let requests = [vec![0u64, 1, 2], vec![0, 3], vec![0, 1, 2, 4]];
        let ops = derive_timeline(requests.iter().map(Vec::as_slice), 2, 3);
        let path =
            std::env::temp_dir().join(format!("kvroute-timeline-{}.jsonl", std::process::id()));
        save_timeline(&path, &ops).unwrap();
        let loaded = load_timeline(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(loaded, ops);
    }

    #[test]
    fn a_bad_timeline_line_names_its_problem() {
        assert!(
            parse_op(r#"{"op":"stored","worker":1,"dp_rank":0,"event_id":1,"blocks":[[1]]}"#)
                .unwrap_err()
                .contains("[block_hash, tokens_hash]")
        );
        assert!(
            parse_op(r#"{"op":"fly"}"#)
                .unwrap_err()
                .contains("unknown op")
        );
        assert!(parse_op("nope").unwrap_err().contains("not JSON"));
    }

    #[test]
    fn a_churn_under_max_blocks_ends_within_it() {
        // 4 workers of 64 blocks, each request a new 32-block chain: the pools
        // hold up to 256 memberships, the limit half of that.
        let requests: Vec<Vec<u64>> = (0..64u64)
            .map(|r| (0..32).map(|b| r * 1_000 + b).collect())
            .collect();
        let bounded = IndexConfig {
            max_blocks: Some(128),
        };
        let churned = churn(&bounded, &requests, 4, 64, 5_000);
        assert_eq!(churned["memberships_last"], 128, "{churned}");
        let unbounded = churn(&IndexConfig::default(), &requests, 4, 64, 5_000);
        assert!(
            unbounded["memberships_last"].as_u64() > Some(128),
            "{unbounded}"
        );
    }
}
