//! Turning a request's prompt into token ids, through `kvroute-tokenize`, and
//! making sure the router tokenizes as its workers do.
//!
//! Token-id prompts are used as they are. Text prompts and chat messages need
//! the workers' own tokenizer: a different one gives different tokens, so no
//! block hash would ever match, silently. So workers declare their tokenizer
//! (spec and fingerprint) when they register, and [`RouterTokenizer`] compares:
//! a worker whose fingerprint differs from the router's is refused, and a router
//! configured with `none` adopts the tokenizer its workers declare, once it
//! loads here with the same fingerprint. Text that still cannot be tokenized is
//! routed on load alone, counted, and `/v1/route` says why.
//!
//! Tokenizing a long prompt takes milliseconds of CPU. Done on the async
//! runtime's threads it would hold up everything else they run (event ingest,
//! streamed responses, health checks), so [`RouterTokenizer::run`] tokenizes on
//! `tokenize_threads` threads of its own, below the runtime's priority
//! ([`crate::low_priority`]); requests beyond that wait in line without
//! holding a thread.

use std::sync::{Arc, Mutex, OnceLock};

use crate::low_priority::LowPriorityPool;
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
    /// results.
    pub fn load(spec: &TokenizerSpec, cache_tokens: u64) -> Result<Option<Self>, RouterError> {
        if *spec == TokenizerSpec::None {
            return Ok(None);
        }
        let inner = kvroute_tokenize::Tokenizer::load_with_cache(spec, cache_tokens)
            .map_err(|e| RouterError::Config(format!("tokenizer: {e}")))?;
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

/// What a worker's declared tokenizer means for its registration.
#[derive(Debug, PartialEq, Eq)]
pub enum Agreement {
    /// Same fingerprint as the router's tokenizer.
    Agrees,
    /// The router had none and now uses the worker's.
    Adopted,
    /// The router has none and could not take the worker's (the reason is kept
    /// for `/v1/route`); the worker is accepted, text is routed on load.
    NotAdopted,
    /// The worker declared none, or `none`: nothing to compare.
    Undeclared,
    /// Another fingerprint, accepted because the configuration allows it.
    AllowedMismatch(String),
}

/// The router's tokenizer: configured, or adopted from the workers.
pub struct RouterTokenizer {
    loaded: OnceLock<Tokenizer>,
    /// The cache size of a tokenizer loaded here, configured or adopted.
    cache_tokens: u64,
    /// The threads that tokenize.
    pool: LowPriorityPool,
    allow_mismatch: bool,
    /// Why there is no tokenizer, while there is none.
    missing: Mutex<String>,
}

impl RouterTokenizer {
    /// `threads`: how many requests tokenize at once (0: one per CPU).
    pub fn new(
        spec: &TokenizerSpec,
        cache_tokens: u64,
        threads: usize,
        allow_mismatch: bool,
    ) -> Result<Self, RouterError> {
        let threads = match threads {
            0 => std::thread::available_parallelism().map_or(1, usize::from),
            n => n,
        };
        let loaded = OnceLock::new();
        if let Some(tokenizer) = Tokenizer::load(spec, cache_tokens)? {
            let _ = loaded.set(tokenizer);
        }
        Ok(Self {
            loaded,
            cache_tokens,
            pool: LowPriorityPool::new("kvroute-tokenize", threads)?,
            allow_mismatch,
            missing: Mutex::new(
                "the router has no tokenizer (tokenizer = \"none\") and no worker has declared one"
                    .into(),
            ),
        })
    }

    /// The tokenizer in use, if any.
    pub fn get(&self) -> Option<&Tokenizer> {
        self.loaded.get()
    }

    /// Runs `work` with the tokenizer in use on a tokenizing thread, once one
    /// is free; `None` if there is no tokenizer.
    pub async fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Tokenizer) -> Result<T, RouterError> + Send + 'static,
    ) -> Result<Option<T>, RouterError> {
        let Some(tokenizer) = self.get().cloned() else {
            return Ok(None);
        };
        self.pool
            .run(move || work(&tokenizer))
            .await
            .map_err(|e| RouterError::Io(std::io::Error::other(format!("tokenizing failed: {e}"))))?
            .map(Some)
    }

    /// Why text cannot be tokenized now (meaningful while [`Self::get`] is `None`).
    pub fn missing_reason(&self) -> String {
        self.missing.lock().unwrap().clone()
    }

    /// Checks a registering worker's declared tokenizer (`spec`, `fingerprint`)
    /// against the router's, adopting it when the router has none. `Err` is the
    /// refusal's message. May load a tokenizer: call off the async threads.
    pub fn check_worker(
        &self,
        worker_id: u64,
        spec: &str,
        fingerprint: &str,
    ) -> Result<Agreement, String> {
        if spec.is_empty() || spec == "none" || fingerprint.is_empty() {
            return Ok(Agreement::Undeclared);
        }
        if self.loaded.get().is_none() {
            self.try_adopt(spec, fingerprint);
            if self.loaded.get().is_none() {
                return Ok(Agreement::NotAdopted);
            }
            if self
                .loaded
                .get()
                .is_some_and(|t| t.fingerprint() == fingerprint)
            {
                return Ok(Agreement::Adopted);
            }
        }
        let ours = self.loaded.get().expect("set above or before");
        if ours.fingerprint() == fingerprint {
            return Ok(Agreement::Agrees);
        }
        let message = format!(
            "worker {worker_id} tokenizes with {spec} (fingerprint {fingerprint}), the router with {} \
             (fingerprint {}): text prompts would never match its cache. Give both the same \
             tokenizer, or set allow_tokenizer_mismatch = true in the router's config",
            ours.spec(),
            ours.fingerprint()
        );
        if self.allow_mismatch {
            Ok(Agreement::AllowedMismatch(message))
        } else {
            Err(message)
        }
    }

    /// Loads `spec` and keeps it if it has the worker's fingerprint here too.
    fn try_adopt(&self, spec: &str, fingerprint: &str) {
        // One registration at a time tries, so a tokenizer is loaded once.
        let mut missing = self.missing.lock().unwrap();
        if self.loaded.get().is_some() {
            return;
        }
        let loaded = spec
            .parse::<TokenizerSpec>()
            .map_err(|e| e.to_string())
            .and_then(|spec| {
                kvroute_tokenize::Tokenizer::load_with_cache(&spec, self.cache_tokens)
                    .map_err(|e| e.to_string())
            });
        match loaded {
            Ok(inner) if inner.fingerprint() == fingerprint => {
                tracing::info!(tokenizer = %spec, fingerprint, "adopted the tokenizer the workers declare");
                let _ = self.loaded.set(Tokenizer {
                    inner: Arc::new(inner),
                });
            }
            Ok(inner) => {
                *missing = format!(
                    "the workers' tokenizer {spec} has fingerprint {fingerprint} there but {} on the \
                     router's host; configure the router's tokenizer",
                    inner.fingerprint()
                );
                tracing::warn!("{}", *missing);
            }
            Err(e) => {
                *missing = format!(
                    "the workers' tokenizer {spec} cannot be loaded by the router: {e}; configure \
                     the router's tokenizer"
                );
                tracing::warn!("{}", *missing);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cl100k() -> (String, String) {
        let t = Tokenizer::load(&"tiktoken:cl100k_base".parse().unwrap(), 0)
            .unwrap()
            .unwrap();
        (t.spec().to_string(), t.fingerprint().to_string())
    }

    #[test]
    fn a_router_without_tokenizer_adopts_the_workers_then_refuses_others() {
        let router = RouterTokenizer::new(&TokenizerSpec::None, 0, 1, false).unwrap();
        assert!(router.get().is_none());
        assert_eq!(router.check_worker(1, "", ""), Ok(Agreement::Undeclared));
        let (spec, fingerprint) = cl100k();
        assert_eq!(
            router.check_worker(1, &spec, &fingerprint),
            Ok(Agreement::Adopted)
        );
        assert_eq!(router.get().unwrap().fingerprint(), fingerprint);
        assert_eq!(
            router.check_worker(2, &spec, &fingerprint),
            Ok(Agreement::Agrees)
        );
        let refused = router
            .check_worker(3, "tiktoken:o200k_base", "0123456789abcdef")
            .unwrap_err();
        assert!(refused.contains("worker 3"), "{refused}");
        assert!(refused.contains("allow_tokenizer_mismatch"), "{refused}");
    }

    #[test]
    fn an_unloadable_or_different_tokenizer_is_not_adopted_and_says_why() {
        let router = RouterTokenizer::new(&TokenizerSpec::None, 0, 1, false).unwrap();
        assert_eq!(
            router.check_worker(1, "hf:/nowhere/model", "00"),
            Ok(Agreement::NotAdopted)
        );
        assert!(router.missing_reason().contains("/nowhere/model"));
        assert_eq!(
            router.check_worker(1, "tiktoken:cl100k_base", "not-its-fingerprint"),
            Ok(Agreement::NotAdopted)
        );
        assert!(router.get().is_none());
        assert!(router.missing_reason().contains("fingerprint"));
    }

    /// The runtime has one thread; a tokenization that blocks it would stop
    /// the other task from answering. The pool has one thread, so a second
    /// tokenization waits for the first to end.
    #[tokio::test(flavor = "current_thread")]
    async fn tokenizing_runs_off_the_runtime_one_per_thread() {
        let router = Arc::new(
            RouterTokenizer::new(&"tiktoken:cl100k_base".parse().unwrap(), 0, 1, false).unwrap(),
        );
        let (release, released) = std::sync::mpsc::channel::<()>();
        let (started, mut first_started) = tokio::sync::mpsc::unbounded_channel();
        let first = tokio::spawn({
            let router = Arc::clone(&router);
            async move {
                router
                    .run(move |t| {
                        started.send(()).unwrap();
                        // Blocks its thread until the test lets it go.
                        released.recv().unwrap();
                        t.encode("first")
                    })
                    .await
            }
        });
        first_started.recv().await.unwrap();
        // The runtime's one thread is free while the first one tokenizes.
        let (ping, pong) = tokio::sync::oneshot::channel();
        tokio::spawn(async move { ping.send(()).unwrap() });
        pong.await.unwrap();
        let second = tokio::spawn({
            let router = Arc::clone(&router);
            async move { router.run(|t| t.encode("second")).await }
        });
        tokio::task::yield_now().await;
        assert!(!second.is_finished(), "the first holds the one thread");
        release.send(()).unwrap();
        assert!(first.await.unwrap().unwrap().is_some());
        assert!(second.await.unwrap().unwrap().is_some());
        let none = RouterTokenizer::new(&TokenizerSpec::None, 0, 1, false).unwrap();
        assert!(none.run(|t| t.encode("x")).await.unwrap().is_none());
    }

    #[test]
    fn a_configured_mismatch_can_be_allowed() {
        let spec = "tiktoken:o200k_base".parse().unwrap();
        let (cl_spec, cl_fingerprint) = cl100k();
        let strict = RouterTokenizer::new(&spec, 0, 1, false).unwrap();
        assert!(strict.check_worker(1, &cl_spec, &cl_fingerprint).is_err());
        let lenient = RouterTokenizer::new(&spec, 0, 1, true).unwrap();
        assert!(matches!(
            lenient.check_worker(1, &cl_spec, &cl_fingerprint),
            Ok(Agreement::AllowedMismatch(_))
        ));
    }
}
