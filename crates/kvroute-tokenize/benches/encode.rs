//! Encoding an ~8k-token prompt with tiktoken cl100k_base, cold (no prompt
//! cache) and cached (the same prompt again), to judge the router's per-core
//! budget. The text's vocabulary is small, so after the first iteration "cold"
//! finds every piece in the per-thread piece cache: a best case; `kvroute-lab
//! bench router` measures Zipf-distributed text with a large vocabulary. The
//! budget:
//! ≥ ~1,500 routed 8k-token text requests/s leaves under ~650 µs per request.
//! `tiktoken_rs` encodes the same prompt with tiktoken-rs, the encoder this
//! crate's was chosen over, so the ratio comes from one run.
//!
//! Run: `cargo bench -p kvroute-tokenize --bench encode`

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_tokenize::{Tokenizer, TokenizerSpec};

/// A deterministic English-like text of about `tokens` cl100k tokens: common
/// words, numbers, punctuation and line breaks drawn by a fixed-seed generator,
/// so the BPE sees varied pieces rather than one repeated sentence.
fn prose(tokens: usize) -> String {
    const WORDS: &[&str] = &[
        "the",
        "router",
        "cache",
        "worker",
        "prefix",
        "block",
        "of",
        "and",
        "to",
        "a",
        "in",
        "request",
        "tokens",
        "model",
        "is",
        "that",
        "for",
        "with",
        "latency",
        "throughput",
        "scheduler",
        "GPU",
        "memory",
        "prompt",
        "attention",
        "KV",
        "hash",
        "index",
        "event",
        "load",
        "balance",
        "decode",
        "prefill",
        "batch",
        "stream",
        "response",
        "policy",
        "overlap",
        "fleet",
        "inference",
        "Kubernetes",
        "deployment",
        "metrics",
        "p99",
        "which",
        "because",
        "however",
        "therefore",
        "system",
        "user",
        "assistant",
        "function",
        "return",
    ];
    const PUNCTUATION: &[&str] = &[
        " ", " ", " ", " ", " ", ", ", ". ", "; ", ": ", ".\n", "\n\n",
    ];
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move |bound: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % bound as u64) as usize
    };
    let mut text = String::new();
    // About 1.75 tokens per word and separator pair in this mix.
    for _ in 0..tokens * 4 / 7 {
        if next(12) == 0 {
            text.push_str(&next(100_000).to_string());
        } else {
            text.push_str(WORDS[next(WORDS.len())]);
        }
        text.push_str(PUNCTUATION[next(PUNCTUATION.len())]);
    }
    text
}

fn encode(c: &mut Criterion) {
    let spec: TokenizerSpec = "tiktoken:cl100k_base".parse().unwrap();
    let cold = Tokenizer::load_with_cache(&spec, 0).unwrap();
    let cached = Tokenizer::load(&spec).unwrap();
    let text = prose(8192);
    let tokens = cold.encode(&text).unwrap().len();
    eprintln!("prompt: {} bytes, {tokens} cl100k_base tokens", text.len());

    let mut group = c.benchmark_group("encode_8k_cl100k");
    group.throughput(Throughput::Elements(tokens as u64));
    group.bench_function("cold", |b| {
        b.iter(|| cold.encode(black_box(&text)).unwrap())
    });
    let reference = tiktoken_rs::cl100k_base_singleton();
    assert_eq!(
        reference.encode_ordinary(&text),
        cold.encode(&text).unwrap()
    );
    group.bench_function("tiktoken_rs", |b| {
        b.iter(|| reference.encode_ordinary(black_box(&text)))
    });
    cached.encode(&text).unwrap();
    group.bench_function("cached", |b| {
        b.iter(|| cached.encode(black_box(&text)).unwrap())
    });
    group.finish();
}

criterion_group!(benches, encode);
criterion_main!(benches);
