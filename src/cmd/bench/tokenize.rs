//! The tokenization parts of `kvroute bench router`:
//!
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

use super::router::{Lcg, Prose};

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
