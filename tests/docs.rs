//! The operator docs stay current: every key of `config/router.toml` has a row
//! in `docs/operator/configuration.md`, and every series named in the router's
//! `metrics.rs` has a row in `docs/operator/metrics.md`. A row is a table line
//! that starts with the name in backticks, so a name only mentioned in passing
//! does not count as documented.

use std::path::Path;

fn read(relative: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Whether `doc` has a table row for `name`.
fn has_row(doc: &str, name: &str) -> bool {
    let row = format!("| `{name}` |");
    doc.lines().any(|line| line.trim_start().starts_with(&row))
}

/// `text` with its commented-out examples (`# [[workers]]`, `# id = 1`)
/// uncommented, so that optional keys shown only as examples count too.
fn with_examples(text: &str) -> String {
    let example = |line: &str| {
        let Some(rest) = line.strip_prefix("# ") else {
            return false;
        };
        let table = rest.starts_with('[') && rest.ends_with(']');
        let key = rest.split_once(" = ").is_some_and(|(key, _)| {
            !key.is_empty() && key.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
        });
        table || key
    };
    text.lines()
        .map(|line| if example(line) { &line[2..] } else { line })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every key of `table` as its dotted path (`ingest.grace_period_ms`), keys of
/// sub-tables and of arrays of tables included.
fn key_paths(table: &toml::Table, prefix: &str, paths: &mut Vec<String>) {
    for (key, value) in table {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        match value {
            toml::Value::Table(sub) => key_paths(sub, &path, paths),
            toml::Value::Array(items)
                if items.iter().all(toml::Value::is_table) && !items.is_empty() =>
            {
                for item in items {
                    if let toml::Value::Table(sub) = item {
                        key_paths(sub, &path, paths);
                    }
                }
            }
            _ => paths.push(path),
        }
    }
}

/// The series names in `source`: every string literal that is a `kvroute_`
/// metric name.
fn series_names(source: &str) -> Vec<String> {
    let mut names: Vec<String> = source
        .split('"')
        .skip(1)
        .step_by(2)
        .filter(|s| {
            s.starts_with("kvroute_")
                && s.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        })
        .map(str::to_owned)
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Fails naming every one of `names` (found in `source`) that has no row in
/// the page `doc_path`, whose rows look like `row_shape`.
fn assert_documented(names: &[String], source: &str, doc_path: &str, row_shape: &str) {
    // A parser that found next to nothing would pass vacuously.
    assert!(
        names.len() > 40,
        "found only {} names in {source}",
        names.len()
    );
    let doc = read(doc_path);
    let missing: Vec<&String> = names.iter().filter(|name| !has_row(&doc, name)).collect();
    assert!(
        missing.is_empty(),
        "names in {source} without a row ({row_shape}) in {doc_path}: {missing:?}"
    );
}

#[test]
fn every_config_key_is_documented() {
    let config: toml::Table = with_examples(&read("config/router.toml"))
        .parse()
        .expect("config/router.toml, its examples uncommented, is valid TOML");
    let mut keys = Vec::new();
    key_paths(&config, "", &mut keys);
    assert_documented(
        &keys,
        "config/router.toml",
        "docs/operator/configuration.md",
        "| `key` | default | what it does |",
    );
}

#[test]
fn every_metric_series_is_documented() {
    let names = series_names(&read("crates/kvroute-router/src/metrics.rs"));
    assert_documented(
        &names,
        "crates/kvroute-router/src/metrics.rs",
        "docs/operator/metrics.md",
        "| `name` | type | labels | meaning |",
    );
}

#[test]
fn a_row_is_a_table_line_that_starts_with_the_name() {
    let doc = "| `ingest.grace_period_ms` | `30000` | ... |\nsee `block_size` above\n";
    assert!(has_row(doc, "ingest.grace_period_ms"));
    assert!(!has_row(doc, "block_size"));
    assert!(!has_row(doc, "grace_period_ms"));
}

#[test]
fn nested_keys_are_named_by_their_path() {
    let config: toml::Table = "a = 1\n[t]\nb = 2\n[[w]]\nc = 3\n".parse().unwrap();
    let mut keys = Vec::new();
    key_paths(&config, "", &mut keys);
    keys.sort();
    assert_eq!(keys, ["a", "t.b", "w.c"]);
}

#[test]
fn commented_examples_count_as_keys() {
    let text =
        "[auth]\nworker_token = \"\"\n# Prose = not a key.\n# [[auth.bound]]\n# token = \"...\"\n";
    let config: toml::Table = with_examples(text).parse().unwrap();
    let mut keys = Vec::new();
    key_paths(&config, "", &mut keys);
    keys.sort();
    assert_eq!(keys, ["auth.bound.token", "auth.worker_token"]);
}
