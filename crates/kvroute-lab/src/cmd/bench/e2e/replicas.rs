//! `kvroute-lab bench e2e --replicas N`: the same replay through router replicas
//! that share one index over NATS JetStream (`[cluster]`).
//!
//! Each setup starts a fresh `nats-server` (tests/nats/install.sh installs it,
//! or `KVROUTE_NATS_SERVER` names one) and its routers as `kvroute serve`
//! child processes, so that each router's CPU time is its own
//! (`/proc/PID/stat`). The simulated workers run in this process and stream to
//! the replicas in turn (worker i to replica i mod N first); the client sends
//! request i to replica i mod N. Setups: one replica, N sharing load, N not
//! sharing it (`cluster.share_load = false`), so the drift shows side by side.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_router::config::Policy;
use kvroute_sim::{EngineConfig, Worker, WorkerConfig, start_fleet};
use kvroute_trace::TraceRequest;
use serde::Serialize;

use kvroute_e2e::{MODEL, PolicyReport, Replay, replay_through, report, token_sums};

use crate::cmd::bench::fixture::kvroute_binary;

/// How many replicas, and whether they share bookings and predictions.
#[derive(Clone, Copy, Debug)]
pub struct Setup {
    pub replicas: usize,
    pub share_load: bool,
}

impl Setup {
    pub fn label(&self) -> String {
        match (self.replicas, self.share_load) {
            (1, _) => "1 replica".into(),
            (n, true) => format!("{n} shared"),
            (n, false) => format!("{n} unshared"),
        }
    }
}

/// Milliseconds, from the replicas' apply-lag histograms.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Lag {
    /// Over every replica's applies together.
    pub p50: f64,
    pub p99: f64,
    /// The slowest replica's p99.
    pub worst_replica_p99: f64,
    pub samples: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ReplicaReport {
    pub setup: String,
    pub replicas: usize,
    pub share_load: bool,
    /// Worker send (the holder taking its batch) → each replica applied it.
    pub apply_lag_ms: Lag,
    /// The routers' user + system CPU over the replay, per request routed.
    pub router_cpu_ms_per_request: f64,
    pub run: PolicyReport,
}

/// What the routers are started with besides their addresses.
pub struct Routers<'a> {
    /// `bench e2e --config`, passed on.
    pub config: Option<&'a Path>,
    pub block_size: usize,
    /// The engines' speedup: prediction windows shrink with it (as in [`kvroute_e2e::Fleet`]).
    pub speedup: f64,
    pub router: &'a kvroute_router::Config,
}

/// Runs `trace` under `policy` through a fresh cluster set up as `setup`.
pub async fn run(
    setup: Setup,
    workers: usize,
    engine: &EngineConfig,
    routers: &Routers<'_>,
    policy: Policy,
    trace: &[TraceRequest],
    replay: Replay,
) -> anyhow::Result<ReplicaReport> {
    let nats = Nats::start()?;
    let mut children = Vec::with_capacity(setup.replicas);
    for i in 0..setup.replicas {
        children.push(RouterChild::start(routers, &nats.url, i, setup.share_load, policy).await?);
    }
    let http = Http::default();
    let grpc: Vec<String> = children.iter().map(|c| c.grpc.clone()).collect();
    let mut fleet: Vec<Worker> = Vec::with_capacity(workers);
    for i in 0..workers {
        let mut config = WorkerConfig::new(i as u64, engine.clone());
        config.model = MODEL.into();
        config.routers = grpc.clone();
        config.routers.rotate_left(i % grpc.len());
        fleet.extend(start_fleet(&config, 1, 0).await?);
    }
    for child in &children {
        wait_until(&format!("{workers} workers on {}", child.http), || async {
            let (_, body) = http.get(&format!("{}/workers", child.http)).await;
            let connected = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| {
                    v["workers"]
                        .as_array()
                        .map(|w| w.iter().filter(|w| w["state"] == "connected").count())
                })
                .unwrap_or(0);
            connected == workers
        })
        .await?;
        // Caught up with the event log (and with workers to route to).
        wait_until(&format!("{} to be ready", child.http), || async {
            http.get(&format!("{}/readyz", child.http)).await.0 == 200
        })
        .await?;
    }

    let urls = children
        .iter()
        .map(|c| format!("{}/v1/completions", c.http).parse())
        .collect::<Result<Vec<hyper::Uri>, _>>()?;
    let sums = |texts: &[String]| {
        texts
            .iter()
            .map(|t| token_sums(t))
            .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1))
    };
    let before = sums(&scrape(&http, &children).await);
    let cpu_before = cpu_seconds(&children);
    let (outcomes, duration_s) = replay_through(&urls, trace, replay).await;
    let cpu = cpu_seconds(&children) - cpu_before;
    let texts = scrape(&http, &children).await;
    let run = report(policy, &fleet, &outcomes, duration_s, before, sums(&texts));
    for worker in fleet {
        worker.shutdown().await;
    }
    drop(children);
    let routed = (run.requests - run.failed).max(1);
    Ok(ReplicaReport {
        setup: setup.label(),
        replicas: setup.replicas,
        share_load: setup.share_load,
        apply_lag_ms: apply_lag(&texts),
        router_cpu_ms_per_request: cpu * 1000.0 / routed as f64,
        run,
    })
}

async fn scrape(http: &Http, children: &[RouterChild]) -> Vec<String> {
    let mut texts = Vec::with_capacity(children.len());
    for child in children {
        let (_, body) = http.get(&format!("{}/metrics", child.http)).await;
        texts.push(String::from_utf8_lossy(&body).into_owned());
    }
    texts
}

/// p50 and p99 of `kvroute_cluster_apply_lag_seconds`, over all the
/// replicas' histograms and for the slowest one, interpolated within buckets.
fn apply_lag(texts: &[String]) -> Lag {
    let buckets: Vec<Vec<(f64, f64)>> = texts.iter().map(|t| lag_buckets(t)).collect();
    let mut merged: Vec<(f64, f64)> = Vec::new();
    for replica in &buckets {
        for &(le, count) in replica {
            match merged.iter_mut().find(|(l, _)| *l == le) {
                Some(entry) => entry.1 += count,
                None => merged.push((le, count)),
            }
        }
    }
    merged.sort_by(|a, b| a.0.total_cmp(&b.0));
    let ms = |q: f64, b: &[(f64, f64)]| quantile(b, q) * 1000.0;
    Lag {
        p50: ms(0.5, &merged),
        p99: ms(0.99, &merged),
        worst_replica_p99: buckets.iter().map(|b| ms(0.99, b)).fold(0.0, f64::max),
        samples: merged.last().map_or(0, |&(_, count)| count as u64),
    }
}

/// (upper bound, cumulative count) of the apply-lag histogram, `+Inf` last.
fn lag_buckets(text: &str) -> Vec<(f64, f64)> {
    let prefix = "kvroute_cluster_apply_lag_seconds_bucket{";
    let mut buckets: Vec<(f64, f64)> = text
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(prefix)?;
            let le = rest.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            let count = line.rsplit(' ').next()?.parse().ok()?;
            Some((le, count))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    buckets
}

/// The `q` quantile of cumulative buckets, linear within its bucket (the last
/// finite bound when it falls in `+Inf`); 0 without samples.
fn quantile(buckets: &[(f64, f64)], q: f64) -> f64 {
    let total = buckets.last().map_or(0.0, |b| b.1);
    if total == 0.0 {
        return 0.0;
    }
    let rank = q * total;
    let mut previous = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return previous.0;
            }
            let within = count - previous.1;
            let share = if within > 0.0 {
                (rank - previous.1) / within
            } else {
                1.0
            };
            return previous.0 + share * (le - previous.0);
        }
        previous = (le, count);
    }
    previous.0
}

/// User plus system CPU seconds of the routers so far.
fn cpu_seconds(children: &[RouterChild]) -> f64 {
    let ticks: u64 = children.iter().map(|c| cpu_ticks(c.child.id())).sum();
    ticks as f64 / clock_ticks_per_second()
}

/// utime + stime of `pid`, in clock ticks; 0 once it is gone.
fn cpu_ticks(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat_ticks(&stat))
        .unwrap_or(0)
}

/// Fields 14 (utime) and 15 (stime) of a /proc/PID/stat line, counted after
/// the command name, which is in parentheses and may hold spaces and `)`.
fn stat_ticks(stat: &str) -> Option<u64> {
    let (_, after_name) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // fields[0] is field 3 (the state).
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(field(14)? + field(15)?)
}

fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// Polls `check` every 20 ms for up to 30 s.
async fn wait_until<F, Fut>(what: &str, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        if start.elapsed() > Duration::from_secs(30) {
            bail!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

#[derive(Clone)]
struct Http(Client<HttpConnector, Empty<Bytes>>);

impl Default for Http {
    fn default() -> Self {
        Self(Client::builder(TokioExecutor::new()).build(HttpConnector::new()))
    }
}

impl Http {
    /// (status, body); (0, empty) when the request failed.
    async fn get(&self, url: &str) -> (u16, Bytes) {
        let Ok(uri) = url.parse::<hyper::Uri>() else {
            return (0, Bytes::new());
        };
        let Ok(response) = self.0.get(uri).await else {
            return (0, Bytes::new());
        };
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        (status, body)
    }
}

/// A `nats-server` with JetStream on a free loopback port and a temporary
/// store; killed and removed on drop.
struct Nats {
    child: Child,
    dir: PathBuf,
    url: String,
}

impl Nats {
    fn start() -> anyhow::Result<Self> {
        let binary = nats_server_binary()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let dir =
            std::env::temp_dir().join(format!("kvroute-bench-nats-{}-{port}", std::process::id()));
        std::fs::create_dir_all(dir.join("store"))?;
        let config = dir.join("nats.conf");
        std::fs::write(
            &config,
            format!(
                "listen: \"127.0.0.1:{port}\"\njetstream {{\n  store_dir: {:?}\n}}\n",
                dir.join("store").display().to_string()
            ),
        )?;
        let child = Command::new(&binary)
            .arg("-c")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("cannot start {}", binary.display()))?;
        let nats = Nats {
            child,
            dir,
            url: format!("nats://127.0.0.1:{port}"),
        };
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if start.elapsed() > Duration::from_secs(10) {
                bail!("nats-server did not listen on port {port} within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(nats)
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `KVROUTE_NATS_SERVER`, or the one tests/nats/install.sh installs (and prints).
fn nats_server_binary() -> anyhow::Result<PathBuf> {
    if let Some(binary) = std::env::var_os("KVROUTE_NATS_SERVER") {
        return Ok(PathBuf::from(binary));
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/nats/install.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    if !out.status.success() {
        bail!(
            "{} failed: nats-server could not be installed (or set KVROUTE_NATS_SERVER)",
            script.display()
        );
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// A `kvroute serve` replica; killed on drop.
struct RouterChild {
    child: Child,
    http: String,
    grpc: String,
}

impl RouterChild {
    async fn start(
        routers: &Routers<'_>,
        nats_url: &str,
        index: usize,
        share_load: bool,
        policy: Policy,
    ) -> anyhow::Result<Self> {
        let scheduler = &routers.router.scheduler;
        let scaled = |ms: u64| ((ms as f64 / routers.speedup) as u64).max(1).to_string();
        let mut command = Command::new(kvroute_binary()?);
        command.arg("serve");
        if let Some(config) = routers.config {
            command.arg("--config").arg(config);
        }
        command
            .envs([
                ("KVROUTE_HTTP_ADDR", "127.0.0.1:0".to_string()),
                ("KVROUTE_GRPC_ADDR", "127.0.0.1:0".to_string()),
                ("KVROUTE_BLOCK_SIZE", routers.block_size.to_string()),
                ("KVROUTE_SCHEDULER__POLICY", policy.as_str().to_string()),
                (
                    "KVROUTE_SCHEDULER__PREDICTED_TTL_MS",
                    scaled(scheduler.predicted_ttl_ms),
                ),
                (
                    "KVROUTE_SCHEDULER__PREDICTED_BRIDGE_MS",
                    scaled(scheduler.predicted_bridge_ms),
                ),
                ("KVROUTE_UPSTREAM__SHUTDOWN_GRACE_MS", "1000".into()),
                ("KVROUTE_CLUSTER__NATS_URL", nats_url.to_string()),
                ("KVROUTE_CLUSTER__REPLICA_ID", format!("bench-{index}")),
                ("KVROUTE_CLUSTER__SHARE_LOAD", share_load.to_string()),
                ("KVROUTE_LOG__LEVEL", "warn".into()),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = command.spawn().context("cannot start `kvroute serve`")?;
        let stdout = child.stdout.take().expect("stdout is piped");
        // `kvroute serve` prints `listening http=ADDR grpc=ADDR` once it listens.
        let ready = tokio::task::spawn_blocking(move || {
            let mut reader = BufReader::new(stdout);
            let mut line = String::new();
            loop {
                line.clear();
                if reader.read_line(&mut line).ok()? == 0 {
                    return None;
                }
                if line.starts_with("listening ") {
                    let line = line.trim().to_string();
                    // Drained from now on, so the child never blocks on a full pipe.
                    std::thread::spawn(move || {
                        let _ = reader.read_to_end(&mut Vec::new());
                    });
                    return Some(line);
                }
            }
        })
        .await?;
        let mut started = RouterChild {
            child,
            http: String::new(),
            grpc: String::new(),
        };
        let Some(line) = ready else {
            bail!("`kvroute serve` (replica {index}) exited before listening");
        };
        let addr = |key: &str| {
            line.split_whitespace()
                .find_map(|part| part.strip_prefix(key))
                .map(|a| format!("http://{a}"))
        };
        match (addr("http="), addr("grpc=")) {
            (Some(http), Some(grpc)) => {
                started.http = http;
                started.grpc = grpc;
                Ok(started)
            }
            _ => bail!("unexpected ready line from `kvroute serve`: {line}"),
        }
    }
}

impl Drop for RouterChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The side-by-side table, with each goal met or missed against the one-replica run.
pub fn table(reports: &[ReplicaReport]) -> String {
    use std::fmt::Write as _;
    type Cell<'a> = &'a dyn Fn(&ReplicaReport) -> String;
    let gap = |r: &ReplicaReport| {
        r.run
            .predicted_hit_rate
            .map(|p| (p - r.run.worker_hit_rate).abs() * 100.0)
    };
    let rows: [(&str, Cell); 10] = [
        ("prefix hit rate (workers)", &|r| {
            format!("{:.1}%", r.run.worker_hit_rate * 100.0)
        }),
        ("hit rate predicted by routers", &|r| {
            r.run
                .predicted_hit_rate
                .map_or("-".into(), |p| format!("{:.1}%", p * 100.0))
        }),
        ("predicted - actual (points)", &|r| {
            gap(r).map_or("-".into(), |g| format!("{g:.1}"))
        }),
        ("Jain fairness (work)", &|r| {
            format!("{:.3}", r.run.jain_fairness)
        }),
        ("TTFT p50 / p99", &|r| {
            format!("{:.0} / {:.0} ms", r.run.ttft_ms.p50, r.run.ttft_ms.p99)
        }),
        ("failed requests", &|r| r.run.failed.to_string()),
        ("apply lag p50 / p99", &|r| {
            format!("{:.2} / {:.2} ms", r.apply_lag_ms.p50, r.apply_lag_ms.p99)
        }),
        ("apply lag p99, slowest replica", &|r| {
            format!("{:.2} ms", r.apply_lag_ms.worst_replica_p99)
        }),
        ("router CPU per request", &|r| {
            format!("{:.3} ms", r.router_cpu_ms_per_request)
        }),
        ("requests per worker", &|r| {
            r.run
                .workers
                .iter()
                .map(|w| w.requests.to_string())
                .collect::<Vec<_>>()
                .join("/")
        }),
    ];
    let cells: Vec<(&str, Vec<String>)> = rows
        .iter()
        .map(|(name, cell)| (*name, reports.iter().map(cell).collect()))
        .collect();
    let widths: Vec<usize> = (0..reports.len())
        .map(|i| {
            cells
                .iter()
                .map(|(_, row)| row[i].len())
                .chain([reports[i].setup.len()])
                .max()
                .unwrap_or(0)
                + 3
        })
        .collect();
    let name_width = cells.iter().map(|(name, _)| name.len()).max().unwrap_or(0) + 2;
    let mut out = String::new();
    let _ = write!(out, "{:<name_width$}", "");
    for (r, width) in reports.iter().zip(&widths) {
        let _ = write!(out, "{:>width$}", r.setup);
    }
    out.push('\n');
    for (name, row) in &cells {
        let _ = write!(out, "{name:<name_width$}");
        for (cell, width) in row.iter().zip(&widths) {
            let _ = write!(out, "{cell:>width$}");
        }
        out.push('\n');
    }
    let verdict = |met: bool| if met { "met" } else { "missed" };
    let one = reports.iter().find(|r| r.replicas == 1);
    for r in reports.iter().filter(|r| r.replicas > 1) {
        let _ = writeln!(out, "{}:", r.setup);
        if let Some(one) = one {
            let points = (r.run.worker_hit_rate - one.run.worker_hit_rate) * 100.0;
            let _ = writeln!(
                out,
                "  hit rate vs 1 replica: {points:+.1} points (goal within 1): {}",
                verdict(points.abs() <= 1.0)
            );
            let _ = writeln!(
                out,
                "  router CPU per request vs 1 replica: {:.2}x (goal: flat)",
                r.router_cpu_ms_per_request / one.router_cpu_ms_per_request.max(1e-9)
            );
        }
        let _ = writeln!(
            out,
            "  Jain {:.3} (goal >= 0.9): {}",
            r.run.jain_fairness,
            verdict(r.run.jain_fairness >= 0.9)
        );
        if let Some(g) = gap(r) {
            let _ = writeln!(
                out,
                "  predicted vs actual {g:.1} points (goal within 2): {}",
                verdict(g <= 2.0)
            );
        }
        let _ = writeln!(
            out,
            "  apply lag p99 {:.2} ms (goal <= 5 ms): {}",
            r.apply_lag_ms.p99,
            verdict(r.apply_lag_ms.p99 <= 5.0)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_within_buckets_and_ignore_infinity() {
        let text = "\
kvroute_cluster_apply_lag_seconds_bucket{le=\"0.001\"} 50
kvroute_cluster_apply_lag_seconds_bucket{le=\"0.002\"} 90
kvroute_cluster_apply_lag_seconds_bucket{le=\"0.005\"} 100
kvroute_cluster_apply_lag_seconds_bucket{le=\"+Inf\"} 100
kvroute_cluster_apply_lag_seconds_sum 0.1
";
        let buckets = lag_buckets(text);
        assert_eq!(buckets.len(), 4);
        assert!((quantile(&buckets, 0.5) - 0.001).abs() < 1e-12);
        // The 99th of 100 is 9/10 into (0.002, 0.005].
        assert!((quantile(&buckets, 0.99) - 0.0047).abs() < 1e-12);
        let lag = apply_lag(&[text.to_string(), text.to_string()]);
        assert_eq!(lag.samples, 200);
        assert!((lag.p99 - 4.7).abs() < 1e-9);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }

    #[test]
    fn cpu_ticks_are_read_past_a_command_name_with_spaces() {
        let stat = "4242 (kv route) x) S 1 4242 4242 0 -1 4194560 900 0 0 0 117 23 0 0 20 0 9 0";
        assert_eq!(stat_ticks(stat), Some(140));
        assert_eq!(stat_ticks("4242 (kvroute) S 1"), None);
        assert_eq!(cpu_ticks(u32::MAX), 0);
    }
}
