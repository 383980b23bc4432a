//! kvroute-e2e: end-to-end runs of the router in front of a simulated fleet,
//! shared by `kvroute demo` and the lab's `kvroute-lab bench e2e`, `bench
//! soak` and `bench e2e --replicas`.
//!
//! [`Fleet`] starts a router and simulated engines in this process on
//! loopback; [`run`] replays a Mooncake trace through the router's HTTP API at
//! its timestamps ([`replay_through`], each request streamed by [`send`]) and
//! turns what the client and the workers measured into a [`PolicyReport`];
//! [`table`] sets reports side by side.
//!
//! Each policy gets a fresh router and fleet, so no policy inherits another's
//! warm caches. Requests stream (SSE) so the client sees the first token. The
//! prefix hit rate comes from the workers' own counters, the router's
//! prediction from its `kvroute_predicted_cached_tokens_total` counter, both as
//! cached over prompt tokens, so the two compare like for like.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_router::config::Policy;
use kvroute_router::server::{self, Running};
use kvroute_sim::eviction::PolicyFigures;
use kvroute_sim::trace::trace_tokens;
use kvroute_sim::{EngineConfig, Worker, WorkerConfig, start_fleet};
use kvroute_trace::TraceRequest;
use serde::Serialize;
use serde_json::Value;

pub const MODEL: &str = "sim-model";

/// A router and its simulated workers, all on loopback.
pub struct Fleet {
    pub router: Running,
    pub workers: Vec<Worker>,
}

impl Fleet {
    /// Starts a router from `router` (its addresses, block size and policy
    /// replaced) and `workers` engines registered with it.
    pub async fn start(
        workers: usize,
        engine: &EngineConfig,
        router: &kvroute_router::Config,
        policy: Policy,
    ) -> anyhow::Result<Fleet> {
        let mut config = kvroute_router::Config {
            http_addr: ([127, 0, 0, 1], 0).into(),
            grpc_addr: ([127, 0, 0, 1], 0).into(),
            block_size: engine.block_size as u32,
            ..router.clone()
        };
        config.scheduler.policy = policy;
        // Prediction windows stand for engine time (how long a prefix stays
        // cached, how long a prefill takes); the engines run `speedup` times
        // faster than real ones, so the windows shrink with them.
        let speedup = engine.cost.speedup;
        let scaled = |ms: u64| ((ms as f64 / speedup) as u64).max(1);
        config.scheduler.predicted_ttl_ms = scaled(config.scheduler.predicted_ttl_ms);
        config.scheduler.predicted_bridge_ms = scaled(config.scheduler.predicted_bridge_ms);
        scale_cost_seconds(&mut config.scheduler, speedup);
        config.upstream.shutdown_grace_ms = 1_000;
        let router = server::start(config)
            .await
            .context("cannot start the router")?;
        let mut template = WorkerConfig::new(0, engine.clone());
        template.model = MODEL.into();
        template.routers = vec![format!("http://{}", router.grpc_addr)];
        let workers = start_fleet(&template, workers, 0).await?;
        let fleet = Fleet { router, workers };
        fleet.wait_registered().await?;
        Ok(fleet)
    }

    pub fn http_url(&self) -> String {
        format!("http://{}", self.router.http_addr)
    }

    async fn wait_registered(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let connected = self
                .router
                .state
                .registry
                .worker_info(None)
                .iter()
                .filter(|w| w.state == "connected")
                .count();
            if connected == self.workers.len() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "only {connected} of {} workers registered within 10 s",
                    self.workers.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn shutdown(self) {
        for worker in self.workers {
            worker.shutdown().await;
        }
        self.router.shutdown().await;
    }
}

/// The `seconds` cost's knobs are engine seconds too: they shrink with the
/// speedup like the prediction windows.
fn scale_cost_seconds(scheduler: &mut kvroute_router::config::SchedulerConfig, speedup: f64) {
    scheduler.prefill_seconds_per_token /= speedup;
    scheduler.decode_seconds_per_block /= speedup;
    if scheduler.cost == kvroute_router::config::Cost::Seconds {
        scheduler.overlap_slack /= speedup;
    }
}

/// How to replay a trace.
#[derive(Clone, Copy, Debug)]
pub struct Replay {
    /// Trace milliseconds per wall-clock millisecond.
    pub time_scale: f64,
    /// Caps each request's output tokens (the trace's `output_length`).
    pub max_output_tokens: Option<u32>,
    /// The API the requests use.
    pub api: Api,
}

/// The API a replay's requests use: completions with the trace's token ids,
/// or one of the chat-like APIs with a text of the same prefixes ([`trace_text`]),
/// which router and engines tokenize (both need a tokenizer).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    #[default]
    Completions,
    Chat,
    Responses,
    Messages,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
        }
    }

    /// The streaming request body for a trace request: its token ids for
    /// completions, else their [`trace_text`] as one user turn.
    pub fn body(self, tokens: &[u32], max_tokens: u64, class: u8) -> String {
        let text = || serde_json::Value::String(trace_text(tokens));
        let turn = || serde_json::json!([{"role": "user", "content": text()}]);
        let body = match self {
            Api::Completions => return completion_body(tokens, max_tokens, class),
            Api::Chat => serde_json::json!({
                "model": MODEL, "max_tokens": max_tokens, "priority_class": class,
                "stream": true, "stream_options": {"include_usage": true}, "messages": turn(),
            }),
            // Not stored: nothing continues these responses.
            Api::Responses => serde_json::json!({
                "model": MODEL, "max_output_tokens": max_tokens, "priority_class": class,
                "stream": true, "store": false, "input": text(),
            }),
            Api::Messages => serde_json::json!({
                "model": MODEL, "max_tokens": max_tokens, "priority_class": class,
                "stream": true, "messages": turn(),
            }),
        };
        body.to_string()
    }
}

impl std::str::FromStr for Api {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        match name {
            "completions" => Ok(Api::Completions),
            "chat" => Ok(Api::Chat),
            "responses" => Ok(Api::Responses),
            "messages" => Ok(Api::Messages),
            _ => Err(format!(
                "unknown API {name:?}: completions, chat, responses or messages"
            )),
        }
    }
}

/// Words that are one cl100k_base token each, with their leading space.
const WORDS: [&str; 64] = [
    " the", " of", " and", " to", " in", " is", " that", " for", " it", " with", " as", " was",
    " on", " be", " at", " by", " this", " had", " not", " are", " but", " from", " or", " have",
    " an", " they", " which", " one", " you", " were", " her", " all", " she", " there", " would",
    " their", " we", " him", " been", " has", " when", " who", " will", " more", " no", " if",
    " out", " so", " said", " what", " up", " its", " about", " into", " than", " them", " can",
    " only", " other", " new", " some", " could", " time", " these",
];

/// A text of one word per trace token: prompts that share a prefix of
/// token ids share the same prefix of text, so of tokens once tokenized.
pub fn trace_text(tokens: &[u32]) -> String {
    tokens
        .iter()
        .map(|&t| WORDS[t as usize % WORDS.len()])
        .collect()
}

/// What the client saw of one request.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub ok: bool,
    /// The request's priority class (0 low, 1 normal, 2 high).
    class: u8,
    /// From the final usage chunk.
    prompt_tokens: u64,
    cached_tokens: u64,
    ttft_s: f64,
    itl_s: Vec<f64>,
    e2e_s: f64,
    output_tokens: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct SimLag {
    pub mean: f64,
    pub max: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct WorkerLoad {
    pub worker_id: u64,
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Prompt tokens loaded from the engine's host tier instead of prefilled.
    pub offload_tokens: u64,
    /// Prompt tokens prefilled plus tokens generated: the work done.
    pub computed_tokens: u64,
    pub preemptions: u64,
}

/// One priority class's share of a run, as the client saw it.
#[derive(Clone, Debug, Serialize)]
pub struct ClassReport {
    pub class: u8,
    pub requests: usize,
    /// Cached over prompt tokens, from the responses' usage.
    pub hit_rate: f64,
    pub ttft_ms: Percentiles,
}

/// One policy's results.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyReport {
    pub policy: String,
    /// The engines' eviction policy.
    pub eviction: String,
    /// What the eviction policy cost, over the fleet.
    pub eviction_figures: Option<PolicyFigures>,
    /// Requests are given classes 0, 1, 2 in turn (`priority_class`).
    pub classes: Vec<ClassReport>,
    pub requests: usize,
    pub failed: usize,
    /// Requests that found every worker busy and waited in the router's queue.
    pub queued: u64,
    pub duration_s: f64,
    pub throughput_rps: f64,
    pub output_tokens_per_s: f64,
    pub ttft_ms: Percentiles,
    /// Every gap between two tokens of a stream. Engines sped up past the
    /// timer's millisecond deliver several steps at once, so these bunch up.
    pub itl_ms: Percentiles,
    /// Each request's mean gap between tokens (time per output token): robust
    /// to that bunching, and what users feel as generation speed.
    pub tpot_ms: Percentiles,
    pub e2e_ms: Percentiles,
    /// Cached over prompt tokens, summed over the workers' own counters.
    pub worker_hit_rate: f64,
    /// Prompt tokens loaded from the engines' host tiers (`--offload-blocks`)
    /// over prompt tokens: hits of the offload tier, beside the GPU's above.
    pub offload_hit_rate: f64,
    /// The same ratio as the router predicted it: prompt tokens the chosen
    /// worker was expected to hold over prompt tokens routed. `None` for
    /// policies that do not consult the index.
    pub predicted_hit_rate: Option<f64>,
    /// Mean and largest delay of the simulated engines behind their cost
    /// model's clock, in wall milliseconds: large values mean the machine could
    /// not keep up with `--speedup` and every latency above is inflated.
    pub sim_lag_ms: SimLag,
    /// Jain's index over the workers' computed tokens (1 = perfectly even).
    pub jain_fairness: f64,
    pub workers: Vec<WorkerLoad>,
    #[serde(skip)]
    pub ttft_samples_ms: Vec<f64>,
}

/// Replays `trace` through `fleet`'s router and collects the report.
pub async fn run(
    fleet: &Fleet,
    policy: Policy,
    trace: &[TraceRequest],
    replay: Replay,
) -> anyhow::Result<PolicyReport> {
    let url: hyper::Uri = format!("{}{}", fleet.http_url(), replay.api.path()).parse()?;
    let before = fleet.router.state.render_metrics();
    let (outcomes, duration_s) = replay_through(&[url], trace, replay).await;
    let after = fleet.router.state.render_metrics();
    let mut report = report(
        policy,
        &fleet.workers,
        &outcomes,
        duration_s,
        token_sums(&before),
        token_sums(&after),
    );
    report.queued = (counter(&after, "kvroute_queue_waits_total")
        - counter(&before, "kvroute_queue_waits_total")) as u64;
    Ok(report)
}

/// Replays `trace` at its timestamps, request `i` to `urls[i % urls.len()]`;
/// returns what the client saw of each request and how long it took.
pub async fn replay_through(
    urls: &[hyper::Uri],
    trace: &[TraceRequest],
    replay: Replay,
) -> (Vec<Outcome>, f64) {
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build({
            let mut connector = HttpConnector::new();
            connector.set_nodelay(true);
            connector
        });
    let first_ts = trace.first().map_or(0, |r| r.timestamp_ms);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(trace.len());
    for (index, request) in trace.iter().enumerate() {
        let class = (index % 3) as u8;
        let offset = (request.timestamp_ms - first_ts) as f64 / replay.time_scale;
        tokio::time::sleep_until((start + Duration::from_secs_f64(offset / 1000.0)).into()).await;
        let max_tokens = replay
            .max_output_tokens
            .map_or(request.output_length, |cap| {
                request.output_length.min(cap as u64)
            })
            .max(1);
        let hash_ids = request.hash_ids.clone();
        let input_length = request.input_length as usize;
        let client = client.clone();
        let url = urls[index % urls.len()].clone();
        tasks.push(tokio::spawn(async move {
            let tokens = trace_tokens(&hash_ids, input_length);
            let body = replay.api.body(&tokens, max_tokens, class);
            let mut outcome = send(&client, url, body).await.unwrap_or_default();
            outcome.class = class;
            outcome
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for task in tasks {
        outcomes.push(task.await.unwrap_or_default());
    }
    (outcomes, start.elapsed().as_secs_f64())
}

/// The streaming request body, written directly: a `serde_json::Value` of
/// tens of thousands of numbers would cost the client more than the router.
pub fn completion_body(tokens: &[u32], max_tokens: u64, class: u8) -> String {
    use std::fmt::Write as _;
    let mut body = String::with_capacity(tokens.len() * 6 + 180);
    let _ = write!(
        body,
        r#"{{"model":"{MODEL}","max_tokens":{max_tokens},"priority_class":{class},"stream":true,"#
    );
    body.push_str(r#""stream_options":{"include_usage":true},"prompt":["#);
    for (i, token) in tokens.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        let _ = write!(body, "{token}");
    }
    body.push_str("]}");
    body
}

pub async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    url: hyper::Uri,
    body: String,
) -> Option<Outcome> {
    let request = hyper::Request::post(url)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .ok()?;
    let sent = Instant::now();
    let response = client.request(request).await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    let mut body = response.into_body();
    let mut outcome = Outcome::default();
    let mut buffer = String::new();
    let mut last_token: Option<Instant> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.ok()?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        buffer.push_str(std::str::from_utf8(data).ok()?);
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            // Typed events (Responses, Messages) name their type on an
            // `event:` line first.
            let Some(data) = event.lines().find_map(|line| line.strip_prefix("data: ")) else {
                continue;
            };
            if data == "[DONE]" {
                outcome.ok = true;
                outcome.e2e_s = sent.elapsed().as_secs_f64();
                return Some(outcome);
            }
            let chunk: Value = serde_json::from_str(data).ok()?;
            // Completions and chat: chunks with `choices`, the usage last.
            // Responses and Messages: typed events.
            let kind = chunk["type"].as_str().unwrap_or_default();
            let usage = match kind {
                "response.completed" => chunk["response"].get("usage"),
                "message_start" => chunk["message"].get("usage"),
                _ => chunk.get("usage").filter(|_| kind.is_empty()),
            };
            if let Some(usage) = usage {
                (outcome.prompt_tokens, outcome.cached_tokens) = prompt_usage(usage);
            }
            if matches!(kind, "response.completed" | "message_stop") {
                outcome.ok = true;
                outcome.e2e_s = sent.elapsed().as_secs_f64();
                return Some(outcome);
            }
            let token = match kind {
                "" => chunk["choices"].as_array().is_some_and(|c| !c.is_empty()),
                kind => kind == "response.output_text.delta" || kind == "content_block_delta",
            };
            if token {
                let now = Instant::now();
                match last_token {
                    None => outcome.ttft_s = (now - sent).as_secs_f64(),
                    Some(previous) => outcome.itl_s.push((now - previous).as_secs_f64()),
                }
                last_token = Some(now);
                outcome.output_tokens += 1;
            }
        }
    }
    None
}

/// (prompt tokens, cached prompt tokens) of a usage object in any API's
/// shape. Anthropic's `input_tokens` leaves out the tokens read from cache.
fn prompt_usage(usage: &Value) -> (u64, u64) {
    let number = |pointer: &str| usage.pointer(pointer).and_then(Value::as_u64);
    if let Some(cached) = number("/cache_read_input_tokens") {
        let uncached = number("/input_tokens").unwrap_or(0)
            + number("/cache_creation_input_tokens").unwrap_or(0);
        return (uncached + cached, cached);
    }
    let prompt = number("/prompt_tokens").or_else(|| number("/input_tokens"));
    let cached = number("/prompt_tokens_details/cached_tokens")
        .or_else(|| number("/input_tokens_details/cached_tokens"));
    (prompt.unwrap_or(0), cached.unwrap_or(0))
}

/// (predicted cached tokens, routed prompt tokens) so far, from a router's
/// metrics text.
pub fn token_sums(text: &str) -> (f64, f64) {
    (
        counter(text, "kvroute_predicted_cached_tokens_total"),
        counter(text, "kvroute_routed_prompt_tokens_total"),
    )
}

/// An unlabelled counter's value in a router's metrics text (0 if absent).
fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.trim().parse::<f64>().ok())
        .unwrap_or(0.0)
}

fn percentiles(mut values: Vec<f64>) -> Percentiles {
    values.sort_by(f64::total_cmp);
    let at = |q: f64| {
        if values.is_empty() {
            0.0
        } else {
            values[((values.len() - 1) as f64 * q).round() as usize]
        }
    };
    Percentiles {
        p50: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
    }
}

/// Jain's fairness index: (Σx)² / (n·Σx²); 1 when every x is equal.
pub fn jain(values: &[f64]) -> f64 {
    let sum: f64 = values.iter().sum();
    let squares: f64 = values.iter().map(|x| x * x).sum();
    if squares == 0.0 {
        1.0
    } else {
        sum * sum / (values.len() as f64 * squares)
    }
}

pub fn report(
    policy: Policy,
    fleet: &[Worker],
    outcomes: &[Outcome],
    duration_s: f64,
    predicted_before: (f64, f64),
    predicted_after: (f64, f64),
) -> PolicyReport {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok).collect();
    let ms = |f: &dyn Fn(&Outcome) -> f64| percentiles(ok.iter().map(|o| f(o) * 1000.0).collect());
    let itl = percentiles(
        ok.iter()
            .flat_map(|o| o.itl_s.iter().map(|s| s * 1000.0))
            .collect(),
    );
    let workers: Vec<WorkerLoad> = fleet
        .iter()
        .map(|w| {
            let (stats, _) = w.stats();
            WorkerLoad {
                worker_id: w.id(),
                requests: stats.requests,
                prompt_tokens: stats.prompt_tokens,
                cached_tokens: stats.cached_tokens,
                offload_tokens: stats.offload_tokens,
                computed_tokens: stats.computed_prompt_tokens + stats.generated_tokens,
                preemptions: stats.preemptions,
            }
        })
        .collect();
    let prompt: u64 = workers.iter().map(|w| w.prompt_tokens).sum();
    let cached: u64 = workers.iter().map(|w| w.cached_tokens).sum();
    let offload: u64 = workers.iter().map(|w| w.offload_tokens).sum();
    let routed_tokens = predicted_after.1 - predicted_before.1;
    let pacing: Vec<_> = fleet.iter().map(|w| w.pacing()).collect();
    let steps: u64 = pacing.iter().map(|p| p.steps).sum();
    let total_lag: f64 = pacing.iter().map(|p| p.total_lag.as_secs_f64()).sum();
    let output: u64 = ok.iter().map(|o| o.output_tokens).sum();
    let classes = (0..3u8)
        .map(|class| {
            let of_class: Vec<&&Outcome> = ok.iter().filter(|o| o.class == class).collect();
            let prompt: u64 = of_class.iter().map(|o| o.prompt_tokens).sum();
            let cached: u64 = of_class.iter().map(|o| o.cached_tokens).sum();
            ClassReport {
                class,
                requests: of_class.len(),
                hit_rate: if prompt == 0 {
                    0.0
                } else {
                    cached as f64 / prompt as f64
                },
                ttft_ms: percentiles(of_class.iter().map(|o| o.ttft_s * 1000.0).collect()),
            }
        })
        .collect();
    let eviction = fleet
        .first()
        .map_or_else(String::new, |w| w.eviction_policy().to_string());
    let figures: Vec<PolicyFigures> = fleet
        .iter()
        .flat_map(|w| w.eviction_figures())
        .filter(|f| f.policy == eviction)
        .collect();
    PolicyReport {
        policy: policy.as_str().to_string(),
        eviction_figures: PolicyFigures::combine(&figures),
        eviction,
        classes,
        requests: outcomes.len(),
        failed: outcomes.len() - ok.len(),
        queued: 0,
        duration_s,
        throughput_rps: ok.len() as f64 / duration_s,
        output_tokens_per_s: output as f64 / duration_s,
        ttft_ms: ms(&|o| o.ttft_s),
        itl_ms: itl,
        tpot_ms: percentiles(
            ok.iter()
                .filter(|o| !o.itl_s.is_empty())
                .map(|o| o.itl_s.iter().sum::<f64>() * 1000.0 / o.itl_s.len() as f64)
                .collect(),
        ),
        e2e_ms: ms(&|o| o.e2e_s),
        worker_hit_rate: if prompt == 0 {
            0.0
        } else {
            cached as f64 / prompt as f64
        },
        offload_hit_rate: if prompt == 0 {
            0.0
        } else {
            offload as f64 / prompt as f64
        },
        predicted_hit_rate: (matches!(policy, Policy::Kv | Policy::Approx) && routed_tokens > 0.0)
            .then(|| (predicted_after.0 - predicted_before.0) / routed_tokens),
        sim_lag_ms: SimLag {
            mean: total_lag * 1000.0 / steps.max(1) as f64,
            max: pacing
                .iter()
                .map(|p| p.max_lag.as_secs_f64() * 1000.0)
                .fold(0.0, f64::max),
        },
        jain_fairness: jain(
            &workers
                .iter()
                .map(|w| w.computed_tokens as f64)
                .collect::<Vec<_>>(),
        ),
        ttft_samples_ms: ok.iter().map(|o| o.ttft_s * 1000.0).collect(),
        workers,
    }
}

/// The side-by-side table of `demo` and `bench e2e`; `with_eviction` adds
/// the eviction policy's goals and the per-class figures. When the runs used
/// different eviction policies, columns are named `routing/eviction`.
pub fn table(reports: &[PolicyReport], with_eviction: bool) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    type Cell<'a> = &'a dyn Fn(&PolicyReport) -> String;
    let base: [(&str, Cell); 13] = [
        ("prefix hit rate (workers)", &|r| {
            format!("{:.1}%", r.worker_hit_rate * 100.0)
        }),
        ("hit rate predicted by router", &|r| {
            r.predicted_hit_rate
                .map_or("-".into(), |p| format!("{:.1}%", p * 100.0))
        }),
        ("TTFT p50", &|r| format!("{:.0} ms", r.ttft_ms.p50)),
        ("TTFT p99", &|r| format!("{:.0} ms", r.ttft_ms.p99)),
        ("time per output token p50", &|r| {
            format!("{:.2} ms", r.tpot_ms.p50)
        }),
        ("e2e p50", &|r| format!("{:.0} ms", r.e2e_ms.p50)),
        ("throughput", &|r| format!("{:.1} req/s", r.throughput_rps)),
        ("output tokens/s", &|r| {
            format!("{:.0}", r.output_tokens_per_s)
        }),
        ("failed requests", &|r| r.failed.to_string()),
        ("queued in the router", &|r| r.queued.to_string()),
        ("Jain fairness (work)", &|r| {
            format!("{:.3}", r.jain_fairness)
        }),
        ("sim lag mean / max", &|r| {
            format!("{:.1} / {:.0} ms", r.sim_lag_ms.mean, r.sim_lag_ms.max)
        }),
        ("requests per worker", &|r| {
            r.workers
                .iter()
                .map(|w| w.requests.to_string())
                .collect::<Vec<_>>()
                .join("/")
        }),
    ];
    let mut rows: Vec<(String, Cell)> = base
        .into_iter()
        .map(|(name, cell)| (name.to_string(), cell))
        .collect();
    if reports.iter().any(|r| r.offload_hit_rate > 0.0) {
        rows.insert(
            1,
            ("loaded from host tier (workers)".into(), &|r| {
                format!("{:.1}%", r.offload_hit_rate * 100.0)
            }),
        );
    }
    let goal_cells: Vec<Vec<String>>;
    let class_cells: Vec<Vec<String>>;
    if with_eviction {
        rows.push(("evictions".into(), &|r| {
            r.eviction_figures
                .as_ref()
                .map_or("-".into(), |f| f.evictions.to_string())
        }));
        // One row per goal; the goal list is the same for every policy.
        goal_cells = reports
            .iter()
            .map(|r| {
                r.eviction_figures.as_ref().map_or(Vec::new(), |f| {
                    f.goals()
                        .iter()
                        .map(|g| format!("{} {}", g.value, if g.met { "met" } else { "missed" }))
                        .collect()
                })
            })
            .collect();
        class_cells = reports
            .iter()
            .map(|r| {
                r.classes
                    .iter()
                    .flat_map(|c| {
                        [
                            format!("{:.1}%", c.hit_rate * 100.0),
                            format!("{:.0} / {:.0} ms", c.ttft_ms.p50, c.ttft_ms.p99),
                        ]
                    })
                    .collect()
            })
            .collect();
    } else {
        goal_cells = Vec::new();
        class_cells = Vec::new();
    }
    let mut cells: Vec<(String, Vec<String>)> = rows
        .iter()
        .map(|(name, cell)| (name.clone(), reports.iter().map(cell).collect()))
        .collect();
    if with_eviction {
        let goals = reports
            .iter()
            .find_map(|r| r.eviction_figures.as_ref())
            .map(PolicyFigures::goals)
            .unwrap_or_default();
        for (i, goal) in goals.iter().enumerate() {
            cells.push((
                format!("{} ({})", goal.figure, goal.goal),
                goal_cells
                    .iter()
                    .map(|c| c.get(i).cloned().unwrap_or_else(|| "-".into()))
                    .collect(),
            ));
        }
        for class in 0..3 {
            for (j, what) in ["hit rate", "TTFT p50 / p99"].iter().enumerate() {
                cells.push((
                    format!("class {class} {what}"),
                    class_cells
                        .iter()
                        .map(|c| c.get(class * 2 + j).cloned().unwrap_or_else(|| "-".into()))
                        .collect(),
                ));
            }
        }
    }
    let mixed = reports.iter().any(|r| r.eviction != reports[0].eviction);
    let label = |r: &PolicyReport| {
        if mixed {
            format!("{}/{}", r.policy, r.eviction)
        } else {
            r.policy.clone()
        }
    };
    // Each policy's column is as wide as its widest cell, so long cells (eight
    // workers' request counts) never run into the next column.
    let widths: Vec<usize> = (0..reports.len())
        .map(|i| {
            cells
                .iter()
                .map(|(_, row)| row[i].len())
                .chain([label(&reports[i]).len()])
                .max()
                .unwrap_or(0)
                + 3
        })
        .collect();
    let name_width = cells.iter().map(|(name, _)| name.len()).max().unwrap_or(0) + 2;
    let _ = write!(out, "{:<name_width$}", "");
    for (r, width) in reports.iter().zip(&widths) {
        let _ = write!(out, "{:>width$}", label(r));
    }
    out.push('\n');
    for (name, row) in cells {
        let _ = write!(out, "{name:<name_width$}");
        for (cell, width) in row.iter().zip(&widths) {
            let _ = write!(out, "{cell:>width$}");
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hand_written_body_is_the_json_it_means() {
        let body: Value = serde_json::from_str(&completion_body(&[7, 0, 42], 5, 2)).unwrap();
        assert_eq!(body["priority_class"], 2);
        assert_eq!(body["prompt"], serde_json::json!([7, 0, 42]));
        assert_eq!(body["max_tokens"], 5);
        assert_eq!(body["model"], MODEL);
        assert_eq!(body["stream_options"]["include_usage"], true);
    }

    #[test]
    fn jain_is_one_when_even_and_one_over_n_when_one_takes_all() {
        assert_eq!(jain(&[3.0, 3.0, 3.0]), 1.0);
        assert!((jain(&[8.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
    }
}
