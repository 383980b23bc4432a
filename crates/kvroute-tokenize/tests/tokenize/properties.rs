//! Property tests: arbitrary input never panics, the tiktoken encodings give
//! the ids of tiktoken-rs (the port of OpenAI's own encoder), also for ASCII
//! text, which cl100k_base splits by hand, and when pieces come from the
//! per-thread piece cache; and the prompt cache never changes a result (the
//! reference is the same tokenizer without a prompt cache, or tokenizing the
//! whole text at once: a prompt or a conversation that grows is tokenized only
//! in its new part, and must give the ids of the whole). Hugging Face
//! tokenizers are checked against `tokenizers` encoding the whole text.

use std::collections::HashSet;
use std::sync::LazyLock;

use kvroute_tokenize::{ChatMessage, Tokenizer, TokenizerSpec, parse_completion_prompt};
use proptest::prelude::*;

static CACHED: LazyLock<Tokenizer> = LazyLock::new(|| {
    Tokenizer::load(&"tiktoken:cl100k_base".parse::<TokenizerSpec>().unwrap()).unwrap()
});
static O200K: LazyLock<Tokenizer> = LazyLock::new(|| {
    Tokenizer::load(&"tiktoken:o200k_base".parse::<TokenizerSpec>().unwrap()).unwrap()
});
/// The Llama-3-style Hugging Face tokenizer of the `huggingface` tests.
static HUGGING_FACE: LazyLock<Tokenizer> = LazyLock::new(|| {
    crate::huggingface::load(&crate::huggingface::llama3_dir("properties")).unwrap()
});
/// The same tokenizer with no prompt cache.
static HUGGING_FACE_UNCACHED: LazyLock<Tokenizer> = LazyLock::new(|| {
    let dir = crate::huggingface::llama3_dir("properties_uncached");
    Tokenizer::load_with_cache(&TokenizerSpec::HuggingFace { dir_or_file: dir }, 0).unwrap()
});
/// The same tokenizer, straight from `tokenizers`: whole texts, no cache.
static HUGGING_FACE_WHOLE: LazyLock<tokenizers::Tokenizer> = LazyLock::new(|| {
    let dir = crate::huggingface::llama3_dir("properties_whole");
    tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap()
});
static UNCACHED: LazyLock<Tokenizer> = LazyLock::new(|| {
    Tokenizer::load_with_cache(&"tiktoken:cl100k_base".parse::<TokenizerSpec>().unwrap(), 0)
        .unwrap()
});

/// Text mixing arbitrary characters with the whitespace runs and special-token
/// spellings that stress the split regex.
fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            any::<char>().prop_map(String::from),
            "[ \t\r\n]{1,40}",
            Just("<|endoftext|>".to_string()),
            Just("<|im_start|>".to_string()),
            "[a-z0-9']{1,12}",
            "[A-Za-z]{1,6}'(s|T|re|VE|m|ll|D)",
            "[0-9]{1,7}",
            "[ .,;:!?/()\\[\\]{}<>|\\-]{1,6}",
            "[éßñüçøæ中文字日本語한국어🙂🚀]{1,6}",
        ],
        0..40,
    )
    .prop_map(|parts| parts.concat())
}

/// ASCII text of the shapes the hand-written cl100k_base split must decide:
/// words with contractions and capitals, digit runs, symbol runs, every ASCII
/// whitespace character in runs, control characters.
fn ascii_text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            "[ -~]{1,8}",
            "[\t\n\x0B\x0C\r ]{1,6}",
            "[a-zA-Z]{1,10}",
            "'(s|t|re|ve|m|ll|d|S|T|RE|Ve|M|LL|D|x|)",
            "[0-9]{1,8}",
            "[!-/:-@\\[-`{-~]{1,5}",
            "[\x00-\x1f\x7f]",
        ],
        0..60,
    )
    .prop_map(|parts| parts.concat())
}

/// Multi-line text of a few kilobytes, so that it is cut into several chunks:
/// lines starting with letters, digits, spaces, symbols or other scripts, and
/// ending in the line feeds, spaces and symbols the split patterns treat apart.
fn long_text() -> impl Strategy<Value = String> {
    let line = (
        prop_oneof!["[a-zA-Z0-9]", "[ \t!/'.]", "[éß中🙂]"],
        "[ -~éß中🙂\t]{20,200}",
        prop_oneof![
            Just("\n"),
            Just("\r\n"),
            Just(" \n"),
            Just("!!\n"),
            Just("\n\n"),
            Just("/\n"),
            Just(""),
        ],
    )
        .prop_map(|(start, middle, end)| format!("{start}{middle}{end}"));
    prop::collection::vec(line, 8..30).prop_map(|lines| lines.concat())
}

/// [`long_text`] with the test Hugging Face tokenizer's added tokens spelled
/// out here and there, at line starts too.
fn long_text_with_added_tokens() -> impl Strategy<Value = String> {
    let token = prop_oneof![
        Just("<|eot_id|>"),
        Just("<|start_header_id|>"),
        Just("<|begin_of_text|>"),
        Just("<|end_header_id|>\n"),
        Just("\n<|eot_id|>"),
    ];
    prop::collection::vec((long_text(), prop::option::of(token)), 1..4).prop_map(|parts| {
        parts
            .into_iter()
            .map(|(text, token)| format!("{text}{}", token.unwrap_or_default()))
            .collect()
    })
}

/// The positions just after a line feed followed by an ASCII letter or digit:
/// where the line-start rule says a text can be cut.
fn line_starts(text: &str) -> Vec<usize> {
    let bytes = text.as_bytes();
    (1..bytes.len())
        .filter(|&i| bytes[i - 1] == b'\n' && bytes[i].is_ascii_alphanumeric())
        .collect()
}

fn hugging_face_ids(text: &str, add_special_tokens: bool) -> Vec<u32> {
    HUGGING_FACE_WHOLE
        .encode_fast(text, add_special_tokens)
        .unwrap()
        .get_ids()
        .to_vec()
}

/// tiktoken-rs's ids for `text` as ordinary text, or `None` where its
/// backtracking regex gives up.
fn reference(bpe: &tiktoken_rs::CoreBPE, text: &str) -> Option<Vec<u32>> {
    bpe.encode(text, &HashSet::new()).ok().map(|(ids, _)| ids)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn tiktoken_encodings_match_tiktoken_rs(text in text()) {
        let cl100k = reference(tiktoken_rs::cl100k_base_singleton(), &text);
        if let Some(expected) = cl100k {
            prop_assert_eq!(UNCACHED.encode(&text).unwrap(), expected);
        }
        let o200k = reference(tiktoken_rs::o200k_base_singleton(), &text);
        if let Some(expected) = o200k {
            prop_assert_eq!(O200K.encode(&text).unwrap(), expected);
        }
    }

    #[test]
    fn ascii_text_matches_tiktoken_rs_also_from_the_piece_cache(text in ascii_text()) {
        if let Some(expected) = reference(tiktoken_rs::cl100k_base_singleton(), &text) {
            // The second time every piece is in this thread's piece cache.
            prop_assert_eq!(UNCACHED.encode(&text).unwrap(), expected.clone());
            prop_assert_eq!(UNCACHED.encode(&text).unwrap(), expected);
        }
    }

    #[test]
    fn encode_never_panics_and_the_cache_agrees(text in text()) {
        let expected = UNCACHED.encode(&text);
        let cached = CACHED.encode(&text);
        prop_assert_eq!(cached.as_ref().ok(), expected.as_ref().ok());
        prop_assert_eq!(CACHED.encode(&text).ok(), expected.ok());
    }

    /// Prompts are split by this crate and encoded piece by piece (the
    /// second time from the piece cache), and must give `tokenizers`' ids.
    #[test]
    fn hugging_face_prompts_give_the_ids_of_tokenizers(
        parts in prop::collection::vec(
            prop_oneof![4 => text(), 1 => Just("<|eot_id|>".to_string())],
            0..4,
        ),
    ) {
        let text = parts.concat();
        let expected = hugging_face_ids(&text, true);
        prop_assert_eq!(expected.first(), Some(&265));
        prop_assert_eq!(HUGGING_FACE_UNCACHED.encode(&text).unwrap(), expected.clone());
        prop_assert_eq!(HUGGING_FACE_UNCACHED.encode(&text).unwrap(), expected);
    }

    #[test]
    fn hugging_face_chat_renders_or_refuses_and_never_panics(
        turns in prop::collection::vec((prop_oneof!["user", "assistant", "[a-z]{1,5}"], text()), 0..4),
    ) {
        let messages: Vec<ChatMessage> =
            turns.into_iter().map(|(role, content)| ChatMessage::new(role, content)).collect();
        let known_roles = messages.iter().all(|m| ["system", "user", "assistant"].contains(&m.role.as_str()));
        match HUGGING_FACE.encode_chat(&messages, true) {
            Ok(ids) => prop_assert!(known_roles && !ids.is_empty()),
            Err(error) => prop_assert!(!known_roles && error.is_client_error(), "{}", error),
        }
    }

    #[test]
    fn encode_chat_never_panics_and_the_cache_agrees(
        turns in prop::collection::vec(("[a-z]{1,9}", text()), 0..6),
        add_generation_prompt in any::<bool>(),
    ) {
        let messages: Vec<ChatMessage> =
            turns.into_iter().map(|(role, content)| ChatMessage::new(role, content)).collect();
        let expected = UNCACHED.encode_chat(&messages, add_generation_prompt);
        prop_assert_eq!(CACHED.encode_chat(&messages, add_generation_prompt).ok(), expected.ok());
    }

    #[test]
    fn a_grown_prompt_gives_the_ids_of_the_whole(
        text in long_text(),
        head in 0.0..1.0f64,
    ) {
        let mut split = (text.len() as f64 * head) as usize;
        while !text.is_char_boundary(split) {
            split -= 1;
        }
        for (tokenizer, bpe) in [
            (&*CACHED, tiktoken_rs::cl100k_base_singleton()),
            (&*O200K, tiktoken_rs::o200k_base_singleton()),
        ] {
            let Some(expected) = reference(bpe, &text) else { continue };
            // The head first, as an earlier turn; then the whole, twice.
            tokenizer.encode(&text[..split]).unwrap();
            prop_assert_eq!(tokenizer.encode(&text).unwrap(), expected.clone());
            prop_assert_eq!(tokenizer.encode(&text).unwrap(), expected);
        }
    }

    #[test]
    fn a_grown_conversation_gives_the_ids_of_the_whole(
        contents in prop::collection::vec(long_text(), 1..4),
        earlier in 0..4usize,
    ) {
        let messages: Vec<ChatMessage> = contents
            .into_iter()
            .enumerate()
            .map(|(i, content)| ChatMessage::new(["user", "assistant"][i % 2], content))
            .collect();
        // The conversation's earlier turn first, then the whole.
        HUGGING_FACE.encode_chat(&messages[..earlier.min(messages.len())], true).unwrap();
        let text = HUGGING_FACE.apply_chat_template(&messages, true).unwrap();
        let expected = HUGGING_FACE_WHOLE.encode_fast(text, false).unwrap().get_ids().to_vec();
        prop_assert_eq!(HUGGING_FACE.encode_chat(&messages, true).unwrap(), expected);
        // tiktoken's chat against its own uncached encoding of each message.
        CACHED.encode_chat(&messages[..earlier.min(messages.len())], true).unwrap();
        prop_assert_eq!(
            CACHED.encode_chat(&messages, true).unwrap(),
            UNCACHED.encode_chat(&messages, true).unwrap()
        );
    }

    /// The claim Hugging Face prompts are cut on, checked against
    /// `tokenizers` for every line start of the text.
    #[test]
    fn every_line_start_is_an_exact_cut_for_a_cl100k_style_hugging_face_tokenizer(
        text in long_text_with_added_tokens(),
    ) {
        let whole = hugging_face_ids(&text, false);
        for cut in line_starts(&text) {
            let mut joined = hugging_face_ids(&text[..cut], false);
            joined.extend(hugging_face_ids(&text[cut..], false));
            prop_assert_eq!(&joined, &whole, "cut at {}", cut);
        }
    }

    #[test]
    fn a_grown_hugging_face_prompt_gives_the_ids_of_the_whole(
        text in long_text_with_added_tokens(),
        head in 0.0..1.0f64,
    ) {
        let mut split = (text.len() as f64 * head) as usize;
        while !text.is_char_boundary(split) {
            split -= 1;
        }
        // The head first, as an earlier turn; then the whole, twice.
        prop_assert_eq!(HUGGING_FACE.encode(&text[..split]).unwrap(), hugging_face_ids(&text[..split], true));
        let expected = hugging_face_ids(&text, true);
        prop_assert_eq!(HUGGING_FACE.encode(&text).unwrap(), expected.clone());
        prop_assert_eq!(HUGGING_FACE.encode(&text).unwrap(), expected);
    }

    #[test]
    fn parse_completion_prompt_never_panics(json in json_value()) {
        let _ = parse_completion_prompt(&json);
    }
}

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(serde_json::Value::from),
        ".{0,8}".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            prop::collection::btree_map(".{0,4}", inner, 0..3)
                .prop_map(|map| serde_json::Value::Object(map.into_iter().collect())),
        ]
    })
}
