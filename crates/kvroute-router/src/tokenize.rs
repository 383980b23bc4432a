//! Turning a request's prompt into token ids, through `kvroute-tokenize`, and
//! making sure the router tokenizes as its workers do.
//!
//! Token-id prompts are used as they are. Text prompts and chat messages need
//! the workers' own tokenizer: a different one gives different tokens, so no
//! block hash would ever match, silently. The router uses only the tokenizers
//! its operator configured (`tokenizer`, one spec or a list), all loaded at
//! start; nothing a worker declares makes it load, read or wait on anything.
//! Workers declare their tokenizer's fingerprint when they register, and
//! [`RouterTokenizer::check_worker`] compares: a worker whose fingerprint none
//! of the configured tokenizers has is refused (unless
//! `allow_tokenizer_mismatch`), and is not told theirs. With `none`, there is
//! nothing to compare: text is routed on load alone, counted, and `/v1/route`
//! says so.
//!
//! Which tokenizer a request's text gets, when several are configured: the
//! one that the most registered workers serving its model declared
//! ([`crate::fleet::Registry::most_declared_tokenizer`]), the first
//! configured on a tie or when none declared. So workers of different
//! tokenizers coexist, each model routed with its workers' tokenizer, and one
//! worker declaring another configured tokenizer for a model does not decide
//! it for the workers already serving it.
//!
//! Tokenizing a long prompt takes milliseconds of CPU. Done on the async
//! runtime's threads it would hold up everything else they run (event ingest,
//! streamed responses, health checks), so [`RouterTokenizer::run`] tokenizes on
//! `tokenize_threads` threads of its own, below the runtime's priority
//! ([`crate::low_priority`]); requests beyond that wait in line without
//! holding a thread, and one whose client has gone by its turn is not
//! tokenized. The work a request can ask for is linear in its body (bounded by
//! `body_limit_bytes`), and a chat's parts and images are capped
//! ([`check_chat_size`]).

use std::sync::Arc;

use crate::config::LimitsConfig;
use crate::fleet::Registry;
use crate::limits;
use crate::low_priority::LowPriorityPool;
use crate::metrics;
use kvroute_index::MultimodalItem;
use kvroute_tokenize::{TokenizeError, TokenizerSpec};
use serde_json::Value;

pub use kvroute_tokenize::Prompt;

use crate::error::RouterError;

/// A loaded tokenizer; clones share it.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<kvroute_tokenize::Tokenizer>,
}

impl Tokenizer {
    /// `None` for the spec `none`; `cache_tokens` bounds its cache of recent
    /// results. Reads the spec's files: at start only.
    pub fn load(spec: &TokenizerSpec, cache_tokens: u64) -> Result<Option<Self>, RouterError> {
        if *spec == TokenizerSpec::None {
            return Ok(None);
        }
        let inner = kvroute_tokenize::Tokenizer::load_with_cache(spec, cache_tokens)
            .map_err(|e| RouterError::Config(format!("tokenizer {spec}: {e}")))?;
        Ok(Some(Self {
            inner: Arc::new(inner),
        }))
    }

    pub fn spec(&self) -> &TokenizerSpec {
        self.inner.spec()
    }

    pub fn fingerprint(&self) -> &str {
        self.inner.fingerprint()
    }

    /// What its cache of recent results holds and has saved.
    pub fn cache_stats(&self) -> kvroute_tokenize::CacheStats {
        self.inner.cache_stats()
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>, RouterError> {
        self.inner
            .encode(text)
            .map_err(|e| RouterError::Tokenize(e.to_string()))
    }

    /// Tokens of a chat request's `messages` through the model's chat
    /// template, and its images as the extra keys of the blocks they are in.
    pub fn encode_chat(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
    ) -> Result<(Vec<u32>, Vec<MultimodalItem>), RouterError> {
        self.inner
            .encode_chat_with_images(messages, add_generation_prompt)
            .map_err(|e| match e {
                TokenizeError::InvalidPrompt { message } => RouterError::BadRequest(message),
                e => RouterError::Tokenize(e.to_string()),
            })
    }
}

/// Refuses a chat with more content parts or images than `limits` allow,
/// before any of it is tokenized.
pub fn check_chat_size(messages: &[Value], limits: &LimitsConfig) -> Result<(), RouterError> {
    let parts = messages
        .iter()
        .filter_map(|m| m.get("content").and_then(Value::as_array))
        .flatten();
    let (mut count, mut images) = (0, 0);
    for part in parts {
        count += 1;
        images += usize::from(part.get("type").and_then(Value::as_str) == Some("image_url"));
    }
    let refuse = |limit: &'static str, what: &str, n: usize, max: usize| {
        limits::count(limit);
        Err(RouterError::BadRequest(format!(
            "the chat has {n} {what}; at most {max} are accepted (limits.max_{limit})"
        )))
    };
    if count > limits.max_chat_parts {
        return refuse(
            limits::CHAT_PARTS,
            "content parts",
            count,
            limits.max_chat_parts,
        );
    }
    if images > limits.max_chat_images {
        return refuse(
            limits::CHAT_IMAGES,
            "image parts",
            images,
            limits.max_chat_images,
        );
    }
    Ok(())
}

/// What a worker's declared tokenizer means for its registration.
#[derive(Debug, PartialEq, Eq)]
pub enum Agreement {
    /// One of the router's tokenizers has the fingerprint the worker
    /// declared (kept in its registration).
    Agrees(String),
    /// The router has no tokenizer: nothing to compare.
    Unchecked,
    /// The worker declared none, or `none`: nothing to compare.
    Undeclared,
    /// None of the router's, accepted because the configuration allows it.
    AllowedMismatch(String),
}

/// Why text is routed untokenized, as `/v1/route` says it.
const NO_TOKENIZER: &str =
    "the router has no tokenizer (tokenizer = \"none\"): text is routed on load alone";

/// The tokenizers the operator configured, and the threads that use them.
pub struct RouterTokenizer {
    /// In the configured order; empty for `none`.
    configured: Vec<Tokenizer>,
    /// The threads that tokenize.
    pool: LowPriorityPool,
    allow_mismatch: bool,
}

impl RouterTokenizer {
    /// Loads every configured tokenizer, sharing `cache_tokens` out evenly
    /// between their caches. `threads`: how many requests tokenize at once
    /// (0: one per CPU).
    pub fn new(
        specs: &[TokenizerSpec],
        cache_tokens: u64,
        threads: usize,
        allow_mismatch: bool,
    ) -> Result<Self, RouterError> {
        let threads = match threads {
            0 => std::thread::available_parallelism().map_or(1, usize::from),
            n => n,
        };
        let each = cache_tokens / specs.len().max(1) as u64;
        let mut configured = Vec::with_capacity(specs.len());
        for spec in specs {
            if let Some(tokenizer) = Tokenizer::load(spec, each)? {
                tracing::info!(tokenizer = %spec, fingerprint = tokenizer.fingerprint(), "tokenizer loaded");
                configured.push(tokenizer);
            }
        }
        Ok(Self {
            configured,
            pool: LowPriorityPool::new("kvroute-tokenize", threads)?,
            allow_mismatch,
        })
    }

    /// The configured tokenizers, in order.
    pub fn configured(&self) -> &[Tokenizer] {
        &self.configured
    }

    /// The tokenizer for requests to `name` (a model or LoRA name); `None`
    /// without one (see the module's doc).
    pub fn for_name(&self, registry: &Registry, name: &str) -> Option<&Tokenizer> {
        match self.configured.as_slice() {
            [] => None,
            [one] => Some(one),
            several => {
                let fingerprints: Vec<&str> = several.iter().map(Tokenizer::fingerprint).collect();
                several.get(registry.most_declared_tokenizer(name, &fingerprints))
            }
        }
    }

    /// What the caches of all configured tokenizers hold and have saved.
    pub fn cache_stats(&self) -> kvroute_tokenize::CacheStats {
        let mut total = kvroute_tokenize::CacheStats::default();
        for stats in self.configured.iter().map(Tokenizer::cache_stats) {
            total.cached_tokens += stats.cached_tokens;
            total.capacity_tokens += stats.capacity_tokens;
            total.hit_tokens += stats.hit_tokens;
            total.tokenized_tokens += stats.tokenized_tokens;
        }
        total
    }

    /// Runs `work` with `tokenizer` on a tokenizing thread, once one is free,
    /// unless the caller went away before then (its future dropped: the
    /// client hung up), counted in `kvroute_tokenize_abandoned_total`.
    pub async fn run<T: Send + 'static>(
        &self,
        tokenizer: &Tokenizer,
        work: impl FnOnce(&Tokenizer) -> Result<T, RouterError> + Send + 'static,
    ) -> Result<T, RouterError> {
        let tokenizer = tokenizer.clone();
        self.pool
            .run(move |caller| {
                if caller.gone() {
                    ::metrics::counter!(metrics::TOKENIZE_ABANDONED).increment(1);
                    return None;
                }
                Some(work(&tokenizer))
            })
            .await
            .map_err(|e| RouterError::Io(std::io::Error::other(format!("tokenizing failed: {e}"))))?
            .ok_or_else(|| RouterError::Io(std::io::Error::other("the request went away")))?
    }

    /// Why text has no tokens: there is no tokenizer (meaningful while
    /// [`Self::for_name`] is `None`). The same for every request: no load
    /// error, path or fingerprint reaches a client.
    pub fn missing_reason(&self) -> &'static str {
        NO_TOKENIZER
    }

    /// Checks a registering worker's declared tokenizer (`spec`, `fingerprint`)
    /// against the router's. `Err` is the refusal's message, which names no
    /// tokenizer of the router's. Loads and reads nothing.
    pub fn check_worker(
        &self,
        worker_id: u64,
        spec: &str,
        fingerprint: &str,
    ) -> Result<Agreement, String> {
        if spec.is_empty() || spec == "none" || fingerprint.is_empty() {
            return Ok(Agreement::Undeclared);
        }
        if self.configured.is_empty() {
            return Ok(Agreement::Unchecked);
        }
        if self
            .configured
            .iter()
            .any(|t| t.fingerprint() == fingerprint)
        {
            return Ok(Agreement::Agrees(fingerprint.to_string()));
        }
        let message = format!(
            "worker {worker_id} tokenizes with {spec:?} (fingerprint {fingerprint:?}), which is not \
             one of the router's tokenizers: text prompts would never match its cache. Give the \
             router the worker's tokenizer, or set allow_tokenizer_mismatch = true in the \
             router's config"
        );
        if self.allow_mismatch {
            Ok(Agreement::AllowedMismatch(message))
        } else {
            Err(message)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(text: &str) -> TokenizerSpec {
        text.parse().unwrap()
    }

    fn fingerprint(text: &str) -> String {
        let t = Tokenizer::load(&spec(text), 0).unwrap().unwrap();
        t.fingerprint().to_string()
    }

    #[test]
    fn a_router_without_tokenizer_loads_nothing_a_worker_declares() {
        let router = RouterTokenizer::new(&[], 0, 1, false).unwrap();
        assert_eq!(router.check_worker(1, "", ""), Ok(Agreement::Undeclared));
        assert_eq!(
            router.check_worker(1, "hf:/nowhere/model", "00"),
            Ok(Agreement::Unchecked)
        );
        let cl100k = fingerprint("tiktoken:cl100k_base");
        assert_eq!(
            router.check_worker(2, "tiktoken:cl100k_base", &cl100k),
            Ok(Agreement::Unchecked)
        );
        assert!(router.configured().is_empty());
        assert!(!router.missing_reason().contains("nowhere"));
    }

    #[test]
    fn workers_of_any_configured_tokenizer_are_accepted_and_others_not_told_them() {
        let specs = [spec("tiktoken:cl100k_base"), spec("tiktoken:o200k_base")];
        let router = RouterTokenizer::new(&specs, 0, 1, false).unwrap();
        for text in ["tiktoken:cl100k_base", "tiktoken:o200k_base"] {
            let ours = fingerprint(text);
            assert_eq!(
                router.check_worker(1, text, &ours),
                Ok(Agreement::Agrees(ours.clone()))
            );
        }
        let refused = router
            .check_worker(3, "hf:/models/other", "0123456789abcdef")
            .unwrap_err();
        assert!(refused.contains("worker 3"), "{refused}");
        assert!(refused.contains("allow_tokenizer_mismatch"), "{refused}");
        for configured in router.configured() {
            assert!(!refused.contains(configured.fingerprint()), "{refused}");
            assert!(
                !refused.contains(&configured.spec().to_string()),
                "{refused}"
            );
        }
    }

    /// A router with one tokenizing thread, and that thread held by a job
    /// until the sender returned is used (or dropped).
    async fn one_thread_held() -> (
        Arc<RouterTokenizer>,
        Tokenizer,
        tokio::task::JoinHandle<Result<(), RouterError>>,
        std::sync::mpsc::Sender<()>,
    ) {
        let router =
            Arc::new(RouterTokenizer::new(&[spec("tiktoken:cl100k_base")], 0, 1, false).unwrap());
        let tokenizer = router.configured()[0].clone();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let (started, mut first_started) = tokio::sync::mpsc::unbounded_channel();
        let first = tokio::spawn({
            let (router, tokenizer) = (Arc::clone(&router), tokenizer.clone());
            async move {
                router
                    .run(&tokenizer, move |t| {
                        started.send(()).unwrap();
                        // Blocks its thread until the test lets it go.
                        let _ = released.recv();
                        t.encode("first").map(drop)
                    })
                    .await
            }
        });
        first_started.recv().await.unwrap();
        (router, tokenizer, first, release)
    }

    /// The runtime has one thread; a tokenization that blocks it would stop
    /// the other task from answering. The pool has one thread, so a second
    /// tokenization waits for the first to end.
    #[tokio::test(flavor = "current_thread")]
    async fn tokenizing_runs_off_the_runtime_one_per_thread() {
        let (router, tokenizer, first, release) = one_thread_held().await;
        // The runtime's one thread is free while the first one tokenizes.
        let (ping, pong) = tokio::sync::oneshot::channel();
        tokio::spawn(async move { ping.send(()).unwrap() });
        pong.await.unwrap();
        let second =
            tokio::spawn(async move { router.run(&tokenizer, |t| t.encode("second")).await });
        tokio::task::yield_now().await;
        assert!(!second.is_finished(), "the first holds the one thread");
        release.send(()).unwrap();
        assert!(first.await.unwrap().is_ok());
        assert!(second.await.unwrap().is_ok());
    }

    /// A request whose caller went away while it waited for the one thread
    /// is not tokenized when its turn comes.
    #[tokio::test(flavor = "current_thread")]
    async fn a_request_whose_caller_left_is_not_tokenized() {
        let (router, tokenizer, first, release) = one_thread_held().await;
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let abandoned = tokio::spawn({
            let (router, tokenizer, ran) =
                (Arc::clone(&router), tokenizer.clone(), Arc::clone(&ran));
            async move {
                router
                    .run(&tokenizer, move |t| {
                        ran.store(true, std::sync::atomic::Ordering::SeqCst);
                        t.encode("abandoned")
                    })
                    .await
            }
        });
        tokio::task::yield_now().await;
        abandoned.abort();
        assert!(abandoned.await.unwrap_err().is_cancelled());
        release.send(()).unwrap();
        first.await.unwrap().unwrap();
        // The pool takes jobs in order: this one ran after the abandoned one's turn.
        router.run(&tokenizer, |t| t.encode("after")).await.unwrap();
        assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[test]
    fn a_configured_mismatch_can_be_allowed() {
        let (cl_spec, cl_fingerprint) =
            ("tiktoken:cl100k_base", fingerprint("tiktoken:cl100k_base"));
        let o200k = [spec("tiktoken:o200k_base")];
        let strict = RouterTokenizer::new(&o200k, 0, 1, false).unwrap();
        assert!(strict.check_worker(1, cl_spec, &cl_fingerprint).is_err());
        let lenient = RouterTokenizer::new(&o200k, 0, 1, true).unwrap();
        assert!(matches!(
            lenient.check_worker(1, cl_spec, &cl_fingerprint),
            Ok(Agreement::AllowedMismatch(_))
        ));
    }

    #[test]
    fn chats_over_the_part_or_image_caps_are_refused_naming_the_cap() {
        let limits = LimitsConfig {
            max_chat_parts: 4,
            max_chat_images: 2,
            ..LimitsConfig::default()
        };
        let image =
            serde_json::json!({"type": "image_url", "image_url": {"url": "https://x/a.png"}});
        let text = serde_json::json!({"type": "text", "text": "hi"});
        let chat = |parts: Vec<Value>| vec![serde_json::json!({"role": "user", "content": parts})];
        assert!(
            check_chat_size(
                &chat(vec![image.clone(), image.clone(), text.clone()]),
                &limits
            )
            .is_ok()
        );
        let err = check_chat_size(&chat(vec![image.clone(); 3]), &limits).unwrap_err();
        assert!(err.to_string().contains("limits.max_chat_images"), "{err}");
        let err = check_chat_size(&chat(vec![text; 5]), &limits).unwrap_err();
        assert!(err.to_string().contains("limits.max_chat_parts"), "{err}");
        assert_eq!(err.status(), axum::http::StatusCode::BAD_REQUEST);
    }
}
