//! The tokenization parts of `kvroute-lab bench router`:
//!
//! - routing throughput per CPU-second for distinct 8.2k-token text prompts
//!   (tokenize, hash, match, schedule, book and release on one thread), in
//!   steady state: a router tokenizes for hours, so its per-thread piece cache
//!   is warm and its allocator's free lists are in use. The first prompts,
//!   which fill the piece cache from empty, are routed first and reported
//!   apart; the measured prompts then run in rounds alternating between the
//!   tokenizers, so that both see the same moments of a shared machine, and
//!   the spread of the rounds is printed with their median. CPU time is the
//!   thread's own clock (`CLOCK_THREAD_CPUTIME_ID`), exact to the nanosecond;
//!   the scheduler's statistics move in whole ticks (4 ms here), a few percent
//!   of a short run;
//! - a Hugging Face `tokenizer.json` of real size, built here from the bundled
//!   cl100k_base ranks (100k tokens, their merges, cl100k's split pattern as a
//!   byte-level `Split` pre-tokenizer, ChatML as its chat template), so that the
//!   `tokenizers` path is measured on a real vocabulary rather than the tests'
//!   20-token one;
//! - multi-turn conversations: what a follow-up turn of a 32k-token
//!   conversation costs against tokenizing the conversation whole, for tiktoken
//!   chat, Hugging Face chat and a growing completions prompt.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use hdrhistogram::Histogram;
use kvroute_tokenize::{ChatMessage, Tokenizer, TokenizerSpec};
use serde_json::{Value, json};

use kvroute_router::state::AppState;

use super::cpu_time::thread_cpu_time;
use super::fixture::{Lcg, Prose, quiet_config, register_workers, route_and_book, text_prompts};

/// cl100k_base's split pattern, as tiktoken and Llama 3's `tokenizer.json` write it.
const CL100K_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// ChatML, as the tiktoken backend writes it.
const CHATML_TEMPLATE: &str = "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Writes a model directory holding a `tokenizer.json` with cl100k_base's
/// 100,256 tokens and a `tokenizer_config.json` with ChatML; returns its path.
/// Merges are derived from the ranks as Hugging Face's tiktoken converter does:
/// every split of a token into two tokens, ordered by the merged token's rank.
pub(super) fn write_cl100k_tokenizer_json(dir: &Path) -> anyhow::Result<PathBuf> {
    let bpe = &bpe_openai::cl100k_base().bpe;
    let chars = kvroute_tokenize::byte_chars();
    let spell = |bytes: &[u8]| -> String { bytes.iter().map(|&b| chars[b as usize]).collect() };
    let tokens: Vec<&[u8]> = (0..bpe.num_tokens() as u32)
        .map(|id| bpe.token_bytes(id))
        .collect();
    let rank: HashMap<&[u8], usize> = tokens.iter().enumerate().map(|(i, &t)| (t, i)).collect();
    let mut merges = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        let mut splits: Vec<(usize, usize)> = (1..token.len())
            .filter_map(|i| Some((*rank.get(&token[..i])?, *rank.get(&token[i..])?)))
            .collect();
        splits.sort_unstable();
        merges.extend(splits.into_iter().map(|(left, right)| (id, left, right)));
    }
    merges.sort_by_key(|&(id, _, _)| id);
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(id, token)| (spell(token), json!(id)))
        .collect();
    let merges: Vec<Value> = merges
        .into_iter()
        .map(|(_, left, right)| json!([spell(tokens[left]), spell(tokens[right])]))
        .collect();
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            special(100257, "<|endoftext|>"),
            special(100264, "<|im_start|>"),
            special(100265, "<|im_end|>"),
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": CL100K_PATTERN}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": true,
                  "vocab": vocab, "merges": merges}
    });
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, serde_json::to_vec(&tokenizer)?)
        .with_context(|| format!("cannot write {}", path.display()))?;
    let config = json!({"eos_token": "<|im_end|>", "chat_template": CHATML_TEMPLATE});
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_vec(&config)?,
    )?;
    Ok(dir.to_path_buf())
}

/// One conversation: alternating user and assistant turns of about
/// `turn_words` words each, until the whole is about `total_tokens` tokens.
fn conversation(prose: &Prose, rng: &mut Lcg, turns: usize, turn_words: usize) -> Vec<ChatMessage> {
    (0..turns)
        .map(|turn| {
            let role = if turn % 2 == 0 { "user" } else { "assistant" };
            ChatMessage::new(role, prose.text(rng, turn_words))
        })
        .collect()
}

/// The same conversation as a completions prompt that grows each turn.
fn as_text(messages: &[ChatMessage]) -> String {
    messages
        .iter()
        .map(|m| format!("{}: {}\n\n", m.role, m.content))
        .collect()
}

/// Nanoseconds `work` took. Wall-clock time: the thread's CPU time (schedstat)
/// is only brought up to date at scheduling events, too coarse for a
/// follow-up turn.
fn timed<T>(work: impl FnOnce() -> T) -> anyhow::Result<(T, u64)> {
    let started = std::time::Instant::now();
    let result = work();
    Ok((result, started.elapsed().as_nanos() as u64))
}

/// What the last turn of `conversations` costs when every earlier turn was
/// tokenized before by the same tokenizer, against tokenizing the whole last
/// turn with no cache; prints both and their ratio.
pub(super) fn multi_turn(spec: &TokenizerSpec, label: &str, chat: bool) -> anyhow::Result<()> {
    let mut rng = Lcg(5);
    let prose = Prose::new(&mut rng, 50_000);
    // 32 turns of ~1k tokens: a 32k-token conversation.
    let conversations: Vec<Vec<ChatMessage>> = (0..8)
        .map(|_| conversation(&prose, &mut rng, 32, 760))
        .collect();
    let cached = Tokenizer::load(spec)?;
    let uncached = Tokenizer::load_with_cache(spec, 0)?;
    let encode = |tokenizer: &Tokenizer, messages: &[ChatMessage]| {
        if chat {
            tokenizer.encode_chat(messages, true)
        } else {
            tokenizer.encode(&as_text(messages))
        }
    };
    // Warm the per-thread piece caches of both on text like this.
    for messages in &conversations[..2] {
        encode(&uncached, messages)?;
    }
    let mut whole = Histogram::<u64>::new(3)?;
    let mut follow_up = Histogram::<u64>::new(3)?;
    let mut tokens = 0;
    for messages in &conversations[2..] {
        let (ids, ns) = timed(|| encode(&uncached, messages))?;
        let ids = ids?;
        whole.record(ns)?;
        tokens = ids.len();
        // The conversation as it happened: every turn resends the history.
        for turn in 1..messages.len() {
            encode(&cached, &messages[..turn])?;
        }
        let (again, ns) = timed(|| encode(&cached, messages))?;
        anyhow::ensure!(
            again? == ids,
            "{label}: the cached follow-up gave other ids"
        );
        follow_up.record(ns)?;
    }
    let ratio = follow_up.value_at_quantile(0.5) as f64 / whole.value_at_quantile(0.5) as f64;
    println!(
        "  {label}: {tokens}-token conversation, 32 turns: whole p50 {:.0} µs, follow-up turn p50 {:.0} µs: {:.1}% (target ≤ 10%: {})",
        whole.value_at_quantile(0.5) as f64 / 1000.0,
        follow_up.value_at_quantile(0.5) as f64 / 1000.0,
        100.0 * ratio,
        if ratio <= 0.10 { "met" } else { "MISSED" }
    );
    Ok(())
}

/// Prompts routed before the measured ones, not counted: the piece cache
/// fills from empty over the first of them (see the warm-up line printed).
const WARMUP_PROMPTS: usize = 200;

/// The warm-up is reported in slices of this many prompts.
const WARMUP_SLICE: usize = 50;

/// Measured rounds per tokenizer.
const ROUNDS: usize = 5;

/// One tokenizer's router and what its rounds measured.
struct ThroughputSide<'a> {
    label: &'a str,
    state: std::sync::Arc<AppState>,
    tokenize: Histogram<u64>,
    tokens: usize,
    prompts: usize,
    usage: ThreadUsage,
    /// Requests per CPU-second of each round, and the times it was preempted.
    rounds: Vec<(f64, u64)>,
}

/// What the calling thread has used so far.
#[derive(Clone, Copy, Default)]
struct ThreadUsage {
    cpu_ns: u64,
    minor_faults: u64,
    major_faults: u64,
    /// Times it was preempted.
    involuntary_switches: u64,
}

impl ThreadUsage {
    fn now() -> anyhow::Result<Self> {
        let cpu = thread_cpu_time().context("CLOCK_THREAD_CPUTIME_ID")?;
        // SAFETY: all-zero bytes are a valid `rusage` (integers only).
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `usage` is a valid, writable rusage for the call.
        let status = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
        anyhow::ensure!(
            status == 0,
            "getrusage: {}",
            std::io::Error::last_os_error()
        );
        Ok(ThreadUsage {
            cpu_ns: cpu.as_nanos() as u64,
            minor_faults: usage.ru_minflt as u64,
            major_faults: usage.ru_majflt as u64,
            involuntary_switches: usage.ru_nivcsw as u64,
        })
    }

    fn since(self, before: ThreadUsage) -> ThreadUsage {
        ThreadUsage {
            cpu_ns: self.cpu_ns - before.cpu_ns,
            minor_faults: self.minor_faults - before.minor_faults,
            major_faults: self.major_faults - before.major_faults,
            involuntary_switches: self.involuntary_switches - before.involuntary_switches,
        }
    }

    fn add(&mut self, other: ThreadUsage) {
        self.cpu_ns += other.cpu_ns;
        self.minor_faults += other.minor_faults;
        self.major_faults += other.major_faults;
        self.involuntary_switches += other.involuntary_switches;
    }
}

/// Routes `prompts` through `state`'s tokenizer and index; what it used.
fn route_prompts(
    state: &AppState,
    prompts: &[String],
    tokenize: &mut Histogram<u64>,
    tokens: &mut usize,
) -> anyhow::Result<ThreadUsage> {
    let tokenizer = state
        .tokenizer
        .configured()
        .first()
        .context("no tokenizer configured")?;
    let before = ThreadUsage::now()?;
    for prompt in prompts {
        let started = std::time::Instant::now();
        let ids = tokenizer.encode(prompt)?;
        tokenize.record(started.elapsed().as_nanos() as u64)?;
        *tokens += ids.len();
        route_and_book(state, &ids)?;
    }
    Ok(ThreadUsage::now()?.since(before))
}

/// Routing throughput for `requests` distinct text prompts per tokenizer, in
/// steady state (see the module's doc).
pub(super) fn throughput(
    requests: usize,
    tokenizers: &[(&TokenizerSpec, &str)],
) -> anyhow::Result<()> {
    let prompts = text_prompts(WARMUP_PROMPTS + requests);
    let (warmup, measured) = prompts.split_at(WARMUP_PROMPTS);
    let mut sides = Vec::new();
    for &(spec, label) in tokenizers {
        let mut config = quiet_config();
        config.tokenizer = kvroute_router::config::TokenizerSpecs(vec![spec.clone()]);
        let state = AppState::new(config, None)?;
        register_workers(&state, 64)?;
        let mut ignored = Histogram::<u64>::new(3)?;
        let mut tokens = 0;
        let slices: Vec<String> = warmup
            .chunks(WARMUP_SLICE)
            .map(|slice| {
                let used = route_prompts(&state, slice, &mut ignored, &mut tokens)?;
                Ok(format!(
                    "{:.0}",
                    slice.len() as f64 * 1e9 / used.cpu_ns as f64
                ))
            })
            .collect::<anyhow::Result<_>>()?;
        println!(
            "\n== throughput, {label}: warm-up, not counted (the piece cache fills from empty): {} prompts, routed per CPU-second in slices of {WARMUP_SLICE}: {}",
            warmup.len(),
            slices.join(", ")
        );
        sides.push(ThroughputSide {
            label,
            state,
            tokenize: Histogram::new(3)?,
            tokens: 0,
            prompts: 0,
            usage: ThreadUsage::default(),
            rounds: Vec::new(),
        });
    }
    let per_round = measured.len().div_ceil(ROUNDS).max(1);
    for round in measured.chunks(per_round) {
        for side in &mut sides {
            let used = route_prompts(&side.state, round, &mut side.tokenize, &mut side.tokens)?;
            side.prompts += round.len();
            side.usage.add(used);
            side.rounds.push((
                round.len() as f64 * 1e9 / used.cpu_ns as f64,
                used.involuntary_switches,
            ));
        }
    }
    for side in &sides {
        let prompts = side.prompts.max(1) as f64;
        let mut rounds: Vec<f64> = side.rounds.iter().map(|&(rate, _)| rate).collect();
        rounds.sort_by(f64::total_cmp);
        let in_order: Vec<String> = side
            .rounds
            .iter()
            .map(|(rate, preempted)| format!("{rate:.0} ({preempted})"))
            .collect();
        let overall = prompts * 1e9 / side.usage.cpu_ns.max(1) as f64;
        println!(
            "\n== throughput, {}: {} distinct text prompts of {} tokens on average (a shared head, then Zipf-distributed words from a 50,000-word vocabulary), one thread doing tokenize + hash + match + schedule + book + release, 64 workers, {} rounds alternating with the other tokenizer",
            side.label,
            side.prompts,
            side.tokens / side.prompts.max(1),
            rounds.len()
        );
        println!(
            "  tokenize: p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs",
            side.tokenize.value_at_quantile(0.5) as f64 / 1000.0,
            side.tokenize.value_at_quantile(0.99) as f64 / 1000.0,
            side.tokenize.max() as f64 / 1000.0,
        );
        println!(
            "  per prompt: {:.1} minor and {:.2} major page faults, preempted {:.2} times",
            side.usage.minor_faults as f64 / prompts,
            side.usage.major_faults as f64 / prompts,
            side.usage.involuntary_switches as f64 / prompts,
        );
        println!(
            "  rounds in order, routed per CPU-second (times preempted): {}",
            in_order.join(", ")
        );
        println!(
            "  routed {overall:.0} requests per CPU-second of the routing thread; rounds: median {:.0}, {:.0}–{:.0} (target ≥ 2,000 per core: {})",
            rounds.get(rounds.len() / 2).copied().unwrap_or_default(),
            rounds.first().copied().unwrap_or_default(),
            rounds.last().copied().unwrap_or_default(),
            if overall >= 2000.0 { "met" } else { "MISSED" }
        );
    }
    // The tokenizers' tables ask for 2 MiB pages (kvroute-tokenize's `huge`
    // module); whether the kernel gave them shows here.
    if let Some(huge) = std::fs::read_to_string("/proc/self/smaps_rollup")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("AnonHugePages:"))
                .map(str::to_owned)
        })
    {
        println!(
            "\n  the process's memory in transparent huge pages: {}",
            huge.trim_start_matches("AnonHugePages:").trim()
        );
    }
    Ok(())
}
