//! Property tests: arbitrary input never panics, and the cache never changes a
//! result (the reference is the same tokenizer without a cache).

use std::sync::LazyLock;

use kvroute_tokenize::{ChatMessage, Tokenizer, TokenizerSpec, parse_completion_prompt};
use proptest::prelude::*;

static CACHED: LazyLock<Tokenizer> = LazyLock::new(|| {
    Tokenizer::load(&"tiktoken:cl100k_base".parse::<TokenizerSpec>().unwrap()).unwrap()
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
        ],
        0..40,
    )
    .prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn encode_never_panics_and_the_cache_agrees(text in text()) {
        let expected = UNCACHED.encode(&text);
        let cached = CACHED.encode(&text);
        prop_assert_eq!(cached.as_ref().ok(), expected.as_ref().ok());
        prop_assert_eq!(CACHED.encode(&text).ok(), expected.ok());
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
