//! Attacks through tokenizer: see tests/adversarial.rs.
//!
//! A worker's tokenizer declaration must not make the router read, open or
//! wait on anything, tell anyone what the router's files are, or decide the
//! tokenizer for other workers; a client's chat must cost tokenizing work
//! linear in its size, within caps, and none once the client has gone.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use crate::common::*;
use kvroute_proto::TokenizerInfo;
use serde_json::{Value, json};

/// The tests' Hugging Face tokenizer: one token per byte of ASCII text.
const TEST_TOKENIZER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/tokenizer");

/// A directory of this test's own, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("kvroute-adversarial-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A copy of the test tokenizer whose chat template writes one line feed
/// fewer after each header: the same text tokens, other chat tokens, another
/// fingerprint.
fn other_tokenizer(dir: &Path) -> String {
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(Path::new(TEST_TOKENIZER).join(file), dir.join(file)).unwrap();
    }
    let config = dir.join("tokenizer_config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let changed = text.replacen(
        r"'<|end_header_id|>\\n\\n' + message",
        r"'<|end_header_id|>\\n' + message",
        1,
    );
    assert_ne!(changed, text, "the template changed");
    std::fs::write(&config, changed).unwrap();
    format!("hf:{}", dir.display())
}

async fn route(router: &RouterProcess, body: &Value) -> Reply {
    tokio::time::timeout(
        DEADLINE,
        Http::default().post(&format!("{}/v1/route", router.http), body),
    )
    .await
    .expect("/v1/route answers")
}

async fn metrics(router: &RouterProcess) -> String {
    Http::default()
        .get(&format!("{}/metrics", router.http))
        .await
        .text()
}

/// Prompt tokens the router has tokenized (its cache's misses).
async fn tokenized(router: &RouterProcess) -> f64 {
    metric(
        &metrics(router).await,
        "kvroute_tokenized_tokens_total",
        &[],
    )
}

/// Attack: with `tokenizer = "none"` (the default), a worker registered with
/// `hf:FIFO`; the router opened the FIFO to read it under a lock the HTTP
/// path takes, and every request, `/healthz` included, and every later
/// registration hung. Now the router loads nothing a worker names: the
/// registrations are answered, requests too, and the FIFO never has a reader
/// (a writer opening it without blocking finds none), nor does `/dev/zero`
/// get read.
#[tokio::test]
async fn a_workers_fifo_tokenizer_is_never_opened_and_nothing_waits() {
    let dir = TempDir::new("fifo");
    let fifo = dir.0.join("tokenizer.json");
    let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo only creates the node.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let router = RouterProcess::start("");
    let mut workers = Vec::new();
    for (id, spec) in [
        (1, format!("hf:{}", fifo.display())),
        (2, "hf:/dev/zero".into()),
    ] {
        let hostile = TokenizerInfo {
            spec,
            fingerprint: "0123456789abcdef".into(),
        };
        let worker = connect_declaring(&router, id, Some(hostile))
            .await
            .expect("a router without tokenizer has nothing to compare");
        workers.push(worker);
    }
    let http = Http::default();
    let health = tokio::time::timeout(DEADLINE, http.get(&format!("{}/healthz", router.http)))
        .await
        .expect("/healthz answers");
    assert_eq!(health.status, 200);
    workers.push(connect_declaring(&router, 3, None).await.unwrap());
    let text = route(
        &router,
        &json!({"model": "m", "prompt": "Route this text."}),
    )
    .await;
    assert_eq!(text.status, 200, "{}", text.text());
    assert!(text.json()["untokenized"].is_string(), "{}", text.text());
    wait_registered(&router, 3).await;
    // Had the router opened the FIFO for reading, it would be waiting there now.
    let opened = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&fifo);
    assert_eq!(
        opened.map(|_| ()).map_err(|e| e.raw_os_error()),
        Err(Some(libc::ENXIO)),
        "the FIFO has a reader: the router opened it"
    );
}

/// Attack: the error of loading a worker's declared path was published in
/// `/v1/route`'s `untokenized`, so a worker could tell which paths exist on
/// the router's host (and what they hold). Now the router loads no declared
/// path, and `untokenized` is one generic reason, whichever path was named.
#[tokio::test]
async fn a_workers_path_shows_in_no_client_visible_answer() {
    let router = RouterProcess::start("");
    let http = Http::default();
    let mut answers = Vec::new();
    for (id, path) in [(1, TEST_TOKENIZER), (2, "/kvroute-no-such-dir/model")] {
        let probe = TokenizerInfo {
            spec: format!("hf:{path}"),
            fingerprint: "0123456789abcdef".into(),
        };
        let _worker = connect_declaring(&router, id, Some(probe)).await.unwrap();
        let routed = route(&router, &json!({"model": "m", "prompt": "Is it there?"})).await;
        let chat = route(
            &router,
            &json!({"model": "m", "messages": [{"role": "user", "content": "Is it there?"}]}),
        )
        .await;
        let listed = http.get(&format!("{}/workers", router.http)).await;
        for reply in [&routed, &chat, &listed] {
            let text = reply.text();
            for leak in [path, "No such file", "tokenizer.json", "0123456789abcdef"] {
                assert!(!text.contains(leak), "{leak:?} in {text}");
            }
        }
        answers.push(routed.json()["untokenized"].clone());
    }
    assert!(answers[0].is_string(), "{answers:?}");
    assert_eq!(answers[0], answers[1], "the answer depends on the path");
}

/// Attack: a chat of thousands of `image_url` parts was tokenized whole once
/// per image (3,200 images in 308 KiB: 4.3 s of CPU; 6.7 MiB: minutes). Now
/// the parts and images of a chat are capped (refused with a 400, counted),
/// and a chat at the caps is tokenized once: the tokens tokenized (no cache)
/// are those of the prompt, where the old code tokenized it 257 times.
#[tokio::test]
async fn a_chat_of_many_images_is_refused_over_the_caps_and_tokenized_once_under() {
    let router = RouterProcess::start(&format!(
        "tokenizer = \"hf:{TEST_TOKENIZER}\"\ntokenizer_cache_tokens = 0\n"
    ));
    let _worker = connect_declaring(&router, 1, None).await.unwrap();
    let image =
        |i: usize| json!({"type": "image_url", "image_url": {"url": format!("https://x/{i}.png")}});
    let text = |i: usize| json!({"type": "text", "text": format!("{i} ").repeat(300)});
    let chat =
        |parts: Vec<Value>| json!({"model": "m", "messages": [{"role": "user", "content": parts}]});

    let attack = chat((0..3_200).map(image).collect());
    let many_parts = chat(vec![json!({"type": "text", "text": "x"}); 5_000]);
    for (body, cap) in [(attack, "max_chat_images"), (many_parts, "max_chat_parts")] {
        let refused = route(&router, &body).await;
        refused.assert_error(400, "invalid_request");
        assert!(refused.text().contains(cap), "{}", refused.text());
    }
    let counted = metrics(&router).await;
    for limit in ["chat_images", "chat_parts"] {
        let refusals = metric(
            &counted,
            "kvroute_limit_refusals_total",
            &[("limit", limit)],
        );
        assert_eq!(refusals, 1.0, "{limit}");
    }

    let before = tokenized(&router).await;
    // 256 images (the default cap) between texts: about 300 KiB.
    let at_the_cap = chat((0..256).flat_map(|i| [text(i), image(i)]).collect());
    let routed = route(&router, &at_the_cap).await;
    assert_eq!(routed.status, 200, "{}", routed.text());
    let prompt_tokens = routed.json()["prompt_tokens"].as_f64().unwrap();
    assert!(prompt_tokens > 256.0 * 900.0, "{}", routed.text());
    let done = tokenized(&router).await - before;
    assert!(
        done <= 2.0 * prompt_tokens,
        "{done} tokens tokenized for a chat of {prompt_tokens}"
    );
}

/// Attack: with `tokenizer = "none"`, the first worker to register chose the
/// router's tokenizer for the life of the process, and every honest worker
/// after it was refused (told the fingerprint to copy). Now a router without
/// tokenizer takes none from its workers; one configured with several
/// accepts workers of each, routes a model's text with the tokenizer most of
/// its workers declared, and refuses a tokenizer it does not have without
/// naming its own.
#[tokio::test]
async fn a_first_worker_with_another_tokenizer_does_not_lock_out_honest_workers() {
    let dir = TempDir::new("other-tokenizer");
    let other = other_tokenizer(&dir.0);
    let honest = format!("hf:{TEST_TOKENIZER}");

    let unconfigured = RouterProcess::start("");
    let _hostile = connect_declaring(&unconfigured, 1, Some(declared(&other)))
        .await
        .unwrap();
    connect_declaring(&unconfigured, 2, Some(declared(&honest)))
        .await
        .expect("an honest worker after it is accepted");
    let text = route(
        &unconfigured,
        &json!({"model": "m", "prompt": "Who picked?"}),
    )
    .await;
    assert!(text.json()["untokenized"].is_string(), "{}", text.text());

    let router = RouterProcess::start(&format!(
        "tokenizer = [{}, {}]\n",
        Value::from(other.as_str()),
        Value::from(honest.as_str())
    ));
    let _hostile = connect_declaring(&router, 1, Some(declared(&other)))
        .await
        .unwrap();
    for id in [2, 3] {
        connect_declaring(&router, id, Some(declared(&honest)))
            .await
            .expect("honest workers are accepted after it");
    }
    let unknown = TokenizerInfo {
        spec: "tiktoken:o200k_base".into(),
        fingerprint: "0123456789abcdef".into(),
    };
    let refused = connect_declaring(&router, 4, Some(unknown))
        .await
        .err()
        .expect("a tokenizer the router does not have is refused");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    for secret in [
        declared(&other).fingerprint,
        declared(&honest).fingerprint,
        TEST_TOKENIZER.to_string(),
        dir.0.display().to_string(),
    ] {
        assert!(
            !refused.message().contains(&secret),
            "{}",
            refused.message()
        );
    }
    // Two of the three workers of "m" declared the honest tokenizer: its
    // chat template, not the first worker's, makes the prompt.
    let messages = json!([{"role": "user", "content": "Which template?"}]);
    let chat = route(&router, &json!({"model": "m", "messages": messages})).await;
    let expected = |spec: &str| {
        let tokenizer = kvroute_tokenize::Tokenizer::load(&spec.parse().unwrap()).unwrap();
        let (tokens, _) = tokenizer
            .encode_chat_with_images(messages.as_array().unwrap(), true)
            .unwrap();
        tokens.len()
    };
    assert_ne!(expected(&honest), expected(&other));
    assert_eq!(
        chat.json()["prompt_tokens"],
        expected(&honest),
        "{}",
        chat.text()
    );
}

/// Attack: a client sent prompts that take long to tokenize and hung up; the
/// tokenizing threads went on with them, and every other client's text waited
/// behind. Now a request whose client has gone by its turn is not tokenized
/// (counted in `kvroute_tokenize_abandoned_total`): once a request sent after
/// them is answered by the one tokenizing thread, at most the two it may have
/// started on before their clients' hang-ups were seen are tokenized, where
/// the old code tokenized every one the router had taken in.
#[tokio::test]
async fn requests_whose_clients_hung_up_are_not_tokenized() {
    let router = RouterProcess::start(&format!(
        "tokenizer = \"hf:{TEST_TOKENIZER}\"\ntokenizer_cache_tokens = 0\ntokenize_threads = 1\n"
    ));
    let _worker = connect_declaring(&router, 1, None).await.unwrap();
    let before = tokenized(&router).await;
    const CLIENTS: usize = 8;
    // One token per byte: about 60k tokens each, a tenth of a second or more.
    let prompt = "Tokenize all of this, slowly. ".repeat(1 << 11);
    let body = json!({"model": "m", "prompt": prompt}).to_string();
    let addr = router.http.trim_start_matches("http://").to_string();
    for _ in 0..CLIENTS {
        let mut client = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            client,
            "POST /v1/route HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        // Hangs up without waiting for the answer.
        drop(client);
    }
    eventually("an abandoned request to be skipped", || async {
        metric(
            &metrics(&router).await,
            "kvroute_tokenize_abandoned_total",
            &[],
        ) >= 1.0
    })
    .await;
    // A request behind them all: once it is answered, every one before it has
    // been tokenized or skipped.
    let after = route(&router, &json!({"model": "m", "prompt": "After them."})).await;
    assert_eq!(after.status, 200, "{}", after.text());
    let done = tokenized(&router).await - before;
    assert!(
        done <= 2.0 * prompt.len() as f64 + 100.0,
        "{done} tokens tokenized for {CLIENTS} clients that hung up"
    );
}
