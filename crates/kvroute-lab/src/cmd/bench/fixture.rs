//! What the router benches (`router`, `tokenize`, `saturation`, `proxy`,
//! `service`) drive the router with: deterministic token and text prompts, a
//! router configured for measuring with workers registered, a stub worker, and
//! a pooled HTTP client to call either; and the `kvroute` binary that `soak`,
//! `service` and `e2e --replicas` run as router processes.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_index::WorkerKey;
use kvroute_router::Config;
use kvroute_router::config::StaticWorker;
use kvroute_router::fleet::{Registration, Source};
use kvroute_router::state::{AppState, RouteInput};

/// The model every registered and stub worker serves.
pub(super) const MODEL: &str = "bench";

/// A small deterministic generator (no seeding from the OS: runs are repeatable).
pub(super) struct Lcg(pub(super) u64);

impl Lcg {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    pub(super) fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.next() % 100_000) as u32).collect()
    }
}

pub(super) fn quiet_config() -> Config {
    let mut config = Config {
        http_addr: ([127, 0, 0, 1], 0).into(),
        grpc_addr: ([127, 0, 0, 1], 0).into(),
        ..Config::default()
    };
    config.upstream.health_interval_ms = 0;
    config
}

/// Registers `n` streamed workers serving [`MODEL`].
pub(super) fn register_workers(state: &AppState, n: u64) -> anyhow::Result<()> {
    for id in 0..n {
        state
            .registry
            .register(
                Registration {
                    worker_id: id,
                    dp_ranks: vec![0],
                    models: vec![MODEL.into()],
                    lora_names: Vec::new(),
                    base_url: format!("http://127.0.0.1:{}", 10_000 + id),
                    total_kv_blocks: 1 << 20,
                    tokenizer: String::new(),
                    pd: Default::default(),
                },
                Source::Stream,
            )
            .map_err(anyhow::Error::msg)?;
    }
    Ok(())
}

/// Routes `tokens` as the proxy does: decide, record the prediction, book the
/// load (released at once, as if the response were instant).
pub(super) fn route_and_book(state: &AppState, tokens: &[u32]) -> anyhow::Result<WorkerKey> {
    let routed = state
        .route_now(MODEL, RouteInput::Tokens(tokens), None, None, &[])?
        .map_err(|e| anyhow::anyhow!("no worker: {e:?}"))?;
    state.record_prediction(&routed);
    let decision = routed.decision;
    drop(state.registry.book(
        decision.worker,
        decision.new_prefill_tokens,
        decision.request_blocks,
    ));
    Ok(decision.worker)
}

/// English-like prose with a realistic vocabulary, so that caching the BPE of
/// repeated words (the tokenizer's piece cache) is not flattered. The
/// vocabulary has 50,000 words ranked by frequency: first the whole words of
/// cl100k_base (a space and 3 or more lowercase letters, about 25,000), in
/// merge order, which follows their frequency in OpenAI's training text; then
/// made-up words of 2 to 4 syllables, which BPE splits into several tokens as
/// it splits rare words and names. Words are drawn with Zipf's law (frequency
/// ∝ 1/rank); sentences start with a capital, some words are numbers, and
/// there are commas, full stops and paragraphs.
pub(super) struct Prose {
    words: Vec<String>,
    /// Cumulative Zipf weights of `words`, for drawing by binary search.
    cumulative: Vec<f64>,
}

impl Prose {
    pub(super) fn new(rng: &mut Lcg, vocabulary: usize) -> Self {
        const ONSETS: [&str; 20] = [
            "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st",
            "tr", "pl", "ch",
        ];
        const VOWELS: [&str; 8] = ["a", "e", "i", "o", "u", "ea", "io", "ou"];
        const CODAS: [&str; 10] = ["", "", "n", "r", "s", "t", "l", "nd", "st", "ng"];
        let pick = |rng: &mut Lcg, options: &[&'static str]| -> &'static str {
            options[(rng.next() % options.len() as u64) as usize]
        };
        let bpe = &bpe_openai::cl100k_base().bpe;
        let mut words: Vec<String> = (0..bpe.num_tokens() as u32)
            .filter_map(|id| {
                let word = bpe.token_bytes(id).strip_prefix(b" ")?;
                (word.len() >= 3 && word.iter().all(u8::is_ascii_lowercase))
                    .then(|| String::from_utf8_lossy(word).into_owned())
            })
            .take(vocabulary)
            .collect();
        let mut seen: std::collections::HashSet<String> = words.iter().cloned().collect();
        while words.len() < vocabulary {
            let syllables = 2 + (rng.next() % 3) as usize;
            let word: String = (0..syllables)
                .flat_map(|_| [pick(rng, &ONSETS), pick(rng, &VOWELS), pick(rng, &CODAS)])
                .collect();
            if seen.insert(word.clone()) {
                words.push(word);
            }
        }
        let mut total = 0.0;
        let cumulative = (1..=words.len())
            .map(|rank| {
                total += 1.0 / rank as f64;
                total
            })
            .collect();
        Prose { words, cumulative }
    }

    fn word(&self, rng: &mut Lcg) -> &str {
        let x =
            rng.next() as f64 / (1u64 << 31) as f64 * self.cumulative[self.cumulative.len() - 1];
        let rank = self.cumulative.partition_point(|&c| c < x);
        &self.words[rank.min(self.words.len() - 1)]
    }

    /// About `words` words of text.
    pub(super) fn text(&self, rng: &mut Lcg, words: usize) -> String {
        let mut text = String::with_capacity(words * 8);
        let mut sentence_words = 0;
        for _ in 0..words {
            let word = self.word(rng);
            if sentence_words == 0 {
                let mut chars = word.chars();
                text.extend(chars.next().map(|c| c.to_ascii_uppercase()));
                text.push_str(chars.as_str());
            } else if rng.next().is_multiple_of(40) {
                text.push_str(&(rng.next() % 2000).to_string());
            } else {
                text.push_str(word);
            }
            sentence_words += 1;
            if sentence_words > 6 && rng.next().is_multiple_of(12) {
                sentence_words = 0;
                text.push_str(if rng.next().is_multiple_of(6) {
                    ".\n\n"
                } else {
                    ". "
                });
            } else if rng.next().is_multiple_of(10) {
                text.push_str(", ");
            } else {
                text.push(' ');
            }
        }
        text
    }
}

/// `n` distinct ~8.2k-token prompts: a shared "system prompt" of about 1,000
/// tokens, then unique text, so only the head's chunks are in the tokenizer's
/// cache (and, with tiktoken, frequent pieces in its piece cache).
pub(super) fn text_prompts(n: usize) -> Vec<String> {
    let mut rng = Lcg(3);
    let prose = Prose::new(&mut rng, 50_000);
    let system = prose.text(&mut rng, 700);
    (0..n)
        .map(|_| format!("{system}{}", prose.text(&mut rng, 5100)))
        .collect()
}

/// A stub worker answering every POST with a small completion.
pub(super) async fn stub_worker() -> anyhow::Result<std::net::SocketAddr> {
    let body: &'static str = r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}"#;
    let app = axum::Router::new()
        .route(
            "/v1/completions",
            axum::routing::post(move || async move {
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    body,
                )
            }),
        )
        .route("/health", axum::routing::get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

pub(super) type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub(super) async fn post(client: &HttpClient, url: &str, body: &Bytes) -> anyhow::Result<()> {
    let request = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))?;
    let response = client.request(request).await?;
    anyhow::ensure!(
        response.status().is_success(),
        "status {}",
        response.status()
    );
    response.into_body().collect().await?;
    Ok(())
}

/// A router configuration with the stub worker at `worker_url` as its one static worker.
pub(super) fn proxy_config(worker_url: &str) -> Config {
    let mut config = quiet_config();
    config.log.level = "error".into();
    config.upstream.shutdown_grace_ms = 1000;
    config.workers = vec![StaticWorker {
        id: 1,
        base_url: worker_url.to_string(),
        models: vec![MODEL.into()],
        lora_names: Vec::new(),
        dp_ranks: vec![0],
        role: Default::default(),
        pd_convention: None,
        bootstrap_port: None,
    }];
    config
}

pub(super) fn pooled_client() -> HttpClient {
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(HttpConnector::new())
}

/// The `kvroute` binary beside this `kvroute-lab`: the benches measure the
/// router as operators run it (`kvroute serve`), and the lab does not ship it.
pub(super) fn kvroute_binary() -> anyhow::Result<PathBuf> {
    let lab = std::env::current_exe().context("cannot find the kvroute-lab binary")?;
    let kvroute = lab.with_file_name("kvroute");
    anyhow::ensure!(
        kvroute.is_file(),
        "{} is missing: the router runs as `kvroute serve` from beside kvroute-lab; \
         build both (cargo build --release -p kvroute -p kvroute-lab)",
        kvroute.display()
    );
    Ok(kvroute)
}
