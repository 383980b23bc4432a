//! Hugging Face tokenizers: a tiny byte-level BPE written here as
//! `tokenizer.json` (Llama 3's pre-tokenizer regex and post-processor, a
//! vocabulary of the 256 bytes plus a few merges, so every expected id can be
//! worked out by hand) and real-world chat templates.

use std::path::{Path, PathBuf};

use kvroute_tokenize::{ChatMessage, TokenizeError, Tokenizer, TokenizerSpec};
use serde_json::{Value, json};

const BEGIN_OF_TEXT: u32 = 265;
const START_HEADER: u32 = 266;
const END_HEADER: u32 = 267;
const EOT: u32 = 268;
const HELLO: u32 = 259;
const SPACE_WORLD: u32 = 264;

/// Llama 3's chat template, plus the role check that many templates carry.
const LLAMA3_TEMPLATE: &str = r#"{% set loop_messages = messages %}{% for message in loop_messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"#;

/// Zephyr's chat template: newlines between blocks, so it renders as
/// transformers does only with trim_blocks and lstrip_blocks.
const ZEPHYR_TEMPLATE: &str = "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}";

/// GPT-2's byte-to-character map, which byte-level BPE vocabularies are
/// written in: printable bytes stand for themselves, the others for 256 + n.
fn byte_char(byte: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(byte) {
        return char::from(byte);
    }
    let n = (0..byte).filter(|&b| !printable(b)).count() as u32;
    char::from_u32(256 + n).unwrap()
}

pub(crate) fn tokenizer_json() -> Value {
    // Byte b has id b; merges build "hello" (259) and " world" (264).
    let mut vocab: serde_json::Map<String, Value> = (0..=255u8)
        .map(|b| (byte_char(b).to_string(), json!(b)))
        .collect();
    let merges = [
        ("h", "e"),
        ("l", "l"),
        ("he", "ll"),
        ("hell", "o"),
        ("Ġ", "w"),
        ("o", "r"),
        ("Ġw", "or"),
        ("l", "d"),
        ("Ġwor", "ld"),
    ];
    for (id, (left, right)) in merges.iter().enumerate() {
        vocab.insert(format!("{left}{right}"), json!(256 + id));
    }
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            special(BEGIN_OF_TEXT, "<|begin_of_text|>"),
            special(START_HEADER, "<|start_header_id|>"),
            special(END_HEADER, "<|end_header_id|>"),
            special(EOT, "<|eot_id|>"),
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"},
             "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>",
                "ids": [BEGIN_OF_TEXT], "tokens": ["<|begin_of_text|>"]}}
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": true,
                  "vocab": vocab,
                  "merges": merges.iter().map(|(l, r)| format!("{l} {r}")).collect::<Vec<_>>()}
    })
}

/// A fresh model directory for one test, holding the given files.
fn model_dir(test: &str, files: &[(&str, String)]) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hf").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
    dir
}

/// A model directory with the test tokenizer and `config` as its
/// `tokenizer_config.json`.
fn configured_dir(test: &str, config: String) -> PathBuf {
    model_dir(
        test,
        &[
            ("tokenizer.json", tokenizer_json().to_string()),
            ("tokenizer_config.json", config),
        ],
    )
}

pub(crate) fn llama3_dir(test: &str) -> PathBuf {
    let config = json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                        "chat_template": LLAMA3_TEMPLATE});
    configured_dir(test, config.to_string())
}

pub(crate) fn load(path: &Path) -> Result<Tokenizer, TokenizeError> {
    Tokenizer::load(&TokenizerSpec::HuggingFace {
        dir_or_file: path.to_path_buf(),
    })
}

/// The ids of ASCII text that no merge applies to: one id per byte.
fn bytes(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

#[test]
fn tokenizers_can_be_shared_across_threads() {
    fn shared<T: Send + Sync>() {}
    shared::<Tokenizer>();
}

#[test]
fn completions_prompts_get_the_bos_of_the_post_processor() {
    let tokenizer = load(&llama3_dir("bos")).unwrap();
    assert_eq!(
        tokenizer.encode("hello world").unwrap(),
        [BEGIN_OF_TEXT, HELLO, SPACE_WORLD]
    );
    // "\n\n" is one split of Llama 3's regex; Ċ is byte 10.
    assert_eq!(
        tokenizer.encode("hello\n\nhi").unwrap(),
        [BEGIN_OF_TEXT, HELLO, 10, 10, 104, 105]
    );
    assert_eq!(tokenizer.encode("").unwrap(), [BEGIN_OF_TEXT]);
}

#[test]
fn llama3_chat_renders_and_encodes_exactly() {
    let tokenizer = load(&llama3_dir("llama3_chat")).unwrap();
    let messages = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "  hello world\n"),
    ];
    assert_eq!(
        tokenizer.apply_chat_template(&messages, true).unwrap(),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nhello world<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    let mut expected = vec![BEGIN_OF_TEXT, START_HEADER];
    expected.extend(bytes("system"));
    expected.extend([END_HEADER, 10, 10]);
    expected.extend(bytes("Be brief."));
    expected.extend([EOT, START_HEADER]);
    expected.extend(bytes("user"));
    expected.extend([END_HEADER, 10, 10, HELLO, SPACE_WORLD, EOT, START_HEADER]);
    expected.extend(bytes("assistant"));
    expected.extend([END_HEADER, 10, 10]);
    // No second BOS: the template wrote it, and chat adds no special tokens.
    assert_eq!(tokenizer.encode_chat(&messages, true).unwrap(), expected);
    // Cached the second time, and the same.
    assert_eq!(tokenizer.encode_chat(&messages, true).unwrap(), expected);
}

/// Each image's span starts at its placeholder, tokenized apart from the
/// text around it, in one pass over the rendered chat; a chat that already
/// holds the mark images are rendered as keys every block by its images.
#[test]
fn images_start_at_their_placeholder_in_the_rendered_chat() {
    let tokenizer = load(&llama3_dir("images")).unwrap();
    let image = |name: &str| json!({"type": "image_url", "image_url": {"url": name}});
    let messages = [json!({"role": "user", "content": [
        {"type": "text", "text": "hi"}, image("a"), {"type": "text", "text": "and"}, image("b")
    ]})];
    let (tokens, images) = tokenizer.encode_chat_with_images(&messages, false).unwrap();
    let mut expected = vec![BEGIN_OF_TEXT, START_HEADER];
    expected.extend(bytes("user"));
    expected.extend([END_HEADER, 10, 10]);
    expected.extend(bytes("hi\n"));
    let first = expected.len();
    expected.extend(bytes("<image>\nand\n"));
    let second = expected.len();
    expected.extend(bytes("<image>"));
    expected.push(EOT);
    assert_eq!(tokens, expected);
    let offsets: Vec<usize> = images.iter().map(|i| i.offset).collect();
    assert_eq!(offsets, [first, second]);
    assert_eq!(
        images[0].hash,
        kvroute_index::multimodal_identifier_hash("a")
    );

    let marked = [json!({"role": "user", "content": [
        {"type": "text", "text": "hi \u{FDD0}"}, image("a")
    ]})];
    let (_, images) = tokenizer.encode_chat_with_images(&marked, false).unwrap();
    assert_eq!(images.iter().map(|i| i.offset).collect::<Vec<_>>(), [0]);
}

#[test]
fn a_tokenizer_json_path_finds_its_config_beside_it() {
    let dir = llama3_dir("file_spec");
    let tokenizer = load(&dir.join("tokenizer.json")).unwrap();
    let messages = [ChatMessage::new("user", "hello world")];
    assert!(
        tokenizer
            .apply_chat_template(&messages, false)
            .unwrap()
            .starts_with("<|begin_of_text|><|start_header_id|>user")
    );
}

#[test]
fn a_template_exception_is_a_client_error_with_its_message() {
    let tokenizer = load(&llama3_dir("raise")).unwrap();
    let messages = [ChatMessage::new("tool", "42")];
    let error = tokenizer.encode_chat(&messages, true).unwrap_err();
    assert!(
        matches!(error, TokenizeError::ChatTemplate { .. }),
        "{error}"
    );
    assert!(error.is_client_error());
    assert_eq!(error.to_string(), "chat template error: Unknown role: tool");
}

#[test]
fn chat_template_jinja_wins_and_blocks_are_trimmed_as_in_transformers() {
    let config = json!({"bos_token": {"content": "<s>", "special": true},
                        "eos_token": {"__type": "AddedToken", "content": "</s>"},
                        "chat_template": LLAMA3_TEMPLATE});
    let dir = model_dir(
        "zephyr",
        &[
            ("tokenizer.json", tokenizer_json().to_string()),
            ("tokenizer_config.json", config.to_string()),
            ("chat_template.jinja", ZEPHYR_TEMPLATE.to_string()),
        ],
    );
    let tokenizer = load(&dir).unwrap();
    let messages = [
        ChatMessage::new("system", "Be a pirate."),
        ChatMessage::new("user", "How many helicopters?"),
    ];
    assert_eq!(
        tokenizer.apply_chat_template(&messages, true).unwrap(),
        "<|system|>\nBe a pirate.</s>\n<|user|>\nHow many helicopters?</s>\n<|assistant|>\n"
    );
}

#[test]
fn templates_get_python_methods_loop_controls_and_helpers() {
    let template = "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}\
                    {{ m.content.strip().upper() }}|{{ m.get('role') }}|{% endfor %}\
                    {% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}\
                    {{ ns.n }}|{{ messages | tojson }}|{{ strftime_now('%Y') | length }}";
    let config = json!({"chat_template": template});
    let dir = configured_dir("helpers", config.to_string());
    let tokenizer = load(&dir).unwrap();
    let messages = [
        ChatMessage::new("user", " hi "),
        ChatMessage::new("skip", "x"),
    ];
    assert_eq!(
        tokenizer.apply_chat_template(&messages, false).unwrap(),
        r#"HI|user|2|[{"role": "user", "content": " hi "}, {"role": "skip", "content": "x"}]|4"#
    );
}

#[test]
fn the_default_of_a_list_of_named_templates_is_used() {
    let config = json!({"chat_template": [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ messages[0]['content'] }}!"}
    ]});
    let dir = configured_dir("named", config.to_string());
    let tokenizer = load(&dir).unwrap();
    let messages = [ChatMessage::new("user", "hi")];
    assert_eq!(
        tokenizer.apply_chat_template(&messages, false).unwrap(),
        "hi!"
    );
}

#[test]
fn without_a_chat_template_prompts_work_and_chats_are_refused() {
    let dir = model_dir(
        "no_template",
        &[("tokenizer.json", tokenizer_json().to_string())],
    );
    let tokenizer = load(&dir).unwrap();
    assert_eq!(tokenizer.encode("hello").unwrap(), [BEGIN_OF_TEXT, HELLO]);
    let error = tokenizer
        .encode_chat(&[ChatMessage::new("user", "hi")], true)
        .unwrap_err();
    assert!(
        matches!(error, TokenizeError::NoChatTemplate { .. }),
        "{error}"
    );
    assert!(
        error.to_string().contains("tokenizer_config.json"),
        "{error}"
    );
}

#[test]
fn missing_and_broken_files_are_errors_naming_the_file() {
    fn message(error: TokenizeError) -> String {
        assert!(!error.is_client_error(), "{error}");
        error.to_string()
    }
    let empty = model_dir("empty", &[]);
    let error = message(load(&empty).err().unwrap());
    assert!(
        error.starts_with("cannot read ") && error.contains("tokenizer.json"),
        "{error}"
    );

    let missing = empty.join("nowhere").join("tokenizer.json");
    let error = message(load(&missing).err().unwrap());
    assert!(error.contains("nowhere"), "{error}");

    for (case, text) in [
        ("not_json", "{".to_string()),
        ("not_tokenizer", "{\"a\": 1}".to_string()),
    ] {
        let dir = model_dir(case, &[("tokenizer.json", text)]);
        let error = message(load(&dir).err().unwrap());
        assert!(
            error.starts_with("invalid ") && error.contains("tokenizer.json"),
            "{error}"
        );
    }

    let cases = [
        (
            "bad_config",
            "{\"chat_template\": ".to_string(),
            "tokenizer_config.json",
        ),
        (
            "bad_template",
            json!({"chat_template": "{% for %}"}).to_string(),
            "does not compile",
        ),
        (
            "bad_bos",
            json!({"bos_token": 1, "chat_template": "x"}).to_string(),
            "bos_token",
        ),
        (
            "bad_list",
            json!({"chat_template": [{"name": "x", "template": "y"}]}).to_string(),
            "'default'",
        ),
    ];
    for (case, config, expected) in cases {
        let dir = configured_dir(case, config);
        let error = message(load(&dir).err().unwrap());
        assert!(
            error.contains("tokenizer_config.json") && error.contains(expected),
            "{error}"
        );
    }
}

#[test]
fn fingerprint_follows_the_files_not_their_path() {
    let a = load(&llama3_dir("fingerprint_a")).unwrap();
    let b = load(&llama3_dir("fingerprint_b")).unwrap();
    assert_eq!(a.fingerprint(), b.fingerprint());
    // Another chat template tokenizes chats differently: another fingerprint.
    let zephyr = configured_dir(
        "fingerprint_zephyr",
        json!({"eos_token": "</s>", "chat_template": ZEPHYR_TEMPLATE}).to_string(),
    );
    assert_ne!(load(&zephyr).unwrap().fingerprint(), a.fingerprint());
    let tiktoken = Tokenizer::load(&"tiktoken:cl100k_base".parse().unwrap()).unwrap();
    assert_ne!(tiktoken.fingerprint(), a.fingerprint());
}

/// A prompt of `lines` lines of prose, each starting with a letter.
fn prose_lines(lines: usize) -> String {
    (0..lines)
        .map(|i| {
            format!(
                "Line {i} says hello world to the router, {} times.\n",
                i * 7
            )
        })
        .collect()
}

/// The ids of `prompt` after `head` was encoded, and how many tokens that
/// tokenized (the cache's misses).
fn follow_up(tokenizer: &Tokenizer, head: &str, prompt: &str) -> (Vec<u32>, u64) {
    tokenizer.encode(head).unwrap();
    let before = tokenizer.cache_stats().tokenized_tokens;
    let ids = tokenizer.encode(prompt).unwrap();
    (ids, tokenizer.cache_stats().tokenized_tokens - before)
}

fn reference_ids(dir: &Path, prompt: &str) -> Vec<u32> {
    tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
        .unwrap()
        .encode_fast(prompt, true)
        .unwrap()
        .get_ids()
        .to_vec()
}

#[test]
fn a_grown_prompt_is_tokenized_only_in_its_new_part() {
    let dir = llama3_dir("grown_prompt");
    let tokenizer = load(&dir).unwrap();
    let head = prose_lines(300);
    let prompt = format!("{head}And one more line.\n");
    let (ids, tokenized) = follow_up(&tokenizer, &head, &prompt);
    assert_eq!(ids, reference_ids(&dir, &prompt));
    assert_eq!(ids[0], BEGIN_OF_TEXT);
    assert!(
        tokenized * 10 < ids.len() as u64,
        "{tokenized} of {} tokens tokenized again",
        ids.len()
    );
}

#[test]
fn prompts_stay_whole_where_a_cut_could_change_the_ids() {
    // Stripping the spaces after it too, so that it is no cut itself.
    fn special(id: u32, content: &str, lstrip: bool) -> Value {
        json!({"id": id, "content": content, "single_word": false, "lstrip": lstrip,
               "rstrip": true, "normalized": false, "special": true})
    }
    /// A name, and how that variant changes the test tokenizer.
    type Variant = (&'static str, fn(&mut Value));
    let variants: [Variant; 5] = [
        ("normalizer", |json| {
            json["normalizer"] = json!({"type": "Lowercase"})
        }),
        ("prefix_space", |json| {
            json["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = json!(true)
        }),
        ("gpt2_split", |json| {
            json["pre_tokenizer"] = json!({"type": "ByteLevel", "add_prefix_space": false,
                                           "trim_offsets": true, "use_regex": true})
        }),
        ("line_feed_token", |json| {
            json["added_tokens"]
                .as_array_mut()
                .unwrap()
                .push(special(300, ".\nL", false))
        }),
        ("lstrip_token", |json| {
            json["added_tokens"]
                .as_array_mut()
                .unwrap()
                .push(special(300, "Line", true))
        }),
    ];
    let head = prose_lines(300);
    let prompt = format!("{head}And one more line.\n");
    for (name, change) in variants {
        let mut tokenizer_json = tokenizer_json();
        change(&mut tokenizer_json);
        let dir = model_dir(
            &format!("whole_{name}"),
            &[("tokenizer.json", tokenizer_json.to_string())],
        );
        let tokenizer = load(&dir).unwrap();
        let (ids, tokenized) = follow_up(&tokenizer, &head, &prompt);
        assert_eq!(ids, reference_ids(&dir, &prompt), "{name}");
        assert!(tokenized + 1 >= ids.len() as u64, "{name}: {tokenized}");
    }
}
