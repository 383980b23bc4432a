//! The shapes of OpenAI completions prompts and chat messages.

use kvroute_tokenize::{ChatMessage, Prompt, TokenizeError, parse_completion_prompt};
use serde_json::json;

#[test]
fn completion_prompts_of_every_accepted_shape() {
    let text = |s: &str| Prompt::Text(s.to_string());
    assert_eq!(parse_completion_prompt(&json!("hi")).unwrap(), text("hi"));
    assert_eq!(parse_completion_prompt(&json!("")).unwrap(), text(""));
    assert_eq!(parse_completion_prompt(&json!(["hi"])).unwrap(), text("hi"));
    assert_eq!(
        parse_completion_prompt(&json!([1, 2, 4294967295u64])).unwrap(),
        Prompt::Tokens(vec![1, 2, u32::MAX])
    );
    assert_eq!(
        parse_completion_prompt(&json!([[7, 8]])).unwrap(),
        Prompt::Tokens(vec![7, 8])
    );
}

#[test]
fn completion_prompts_of_other_shapes_are_client_errors() {
    let cases = [
        (json!(null), "not null"),
        (json!(12), "not a number"),
        (json!({"text": "hi"}), "not an object"),
        (json!([]), "must not be an empty array"),
        (json!([[]]), "must not be an empty array of token ids"),
        (json!(["a", "b"]), "batch of 2 prompts"),
        (json!([[1], [2]]), "batch of 2 prompts"),
        (json!([1, -2]), "element 1 is -2"),
        (json!([1, 4294967296u64]), "element 1 is 4294967296"),
        (json!([1, 2.5]), "element 1 is 2.5"),
        (json!([1, "a"]), "element 1 is a string"),
        (json!([true]), "not a boolean"),
    ];
    for (value, expected) in cases {
        let error = parse_completion_prompt(&value).unwrap_err();
        assert!(matches!(error, TokenizeError::InvalidPrompt { .. }));
        assert!(error.is_client_error());
        let message = error.to_string();
        assert!(message.contains(expected), "{value}: {message}");
    }
}

#[test]
fn chat_messages_accept_strings_parts_and_null() {
    let messages: Vec<ChatMessage> = serde_json::from_value(json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "first"},
            {"type": "image_url", "image_url": {"url": "data:..."}},
            {"type": "text", "text": "second"}
        ]},
        {"role": "assistant", "content": null, "tool_calls": []},
        {"role": "assistant"}
    ]))
    .unwrap();
    assert_eq!(
        messages,
        [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "first\n<image>\nsecond"),
            ChatMessage::new("assistant", ""),
            ChatMessage::new("assistant", ""),
        ]
    );
}

#[test]
fn chat_messages_of_other_shapes_are_refused_with_a_reason() {
    let cases = [
        (json!({"role": "user", "content": 5}), "not a number"),
        (
            json!({"role": "user", "content": [{"text": "x"}]}),
            "content part 0",
        ),
        (
            json!({"role": "user", "content": [{"type": "text"}]}),
            "no string \"text\"",
        ),
        (json!({"content": "x"}), "missing field `role`"),
    ];
    for (value, expected) in cases {
        let error = serde_json::from_value::<ChatMessage>(value.clone()).unwrap_err();
        assert!(error.to_string().contains(expected), "{value}: {error}");
    }
}
