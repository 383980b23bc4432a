//! No import cycle between the modules of any crate or of `src/`.
//!
//! Reads every `src/**/*.rs`, resolves the `crate::…` and `super::…` paths its
//! non-test code names to the modules that hold them, and fails naming the
//! cycle if module A reaches B and B reaches A back. A module may use its own
//! submodules (it declares and owns them) and they it: an edge from a module
//! into its own subtree is not counted, every other edge is, so a cycle that
//! runs through a parent is still found.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// A module's path inside its crate: `["fleet", "booking"]`; the root is empty.
type Module = Vec<String>;

#[test]
fn no_crate_has_an_import_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut sources = vec![root.join("src")];
    for entry in fs::read_dir(root.join("crates")).unwrap() {
        let src = entry.unwrap().path().join("src");
        if src.is_dir() {
            sources.push(src);
        }
    }
    let mut failures = Vec::new();
    for src in sources {
        let modules = read_modules(&src);
        assert!(!modules.is_empty(), "no modules under {}", src.display());
        for cycle in cycles(&modules) {
            failures.push(format!("{}: {}", src.display(), describe(&cycle)));
        }
    }
    assert!(
        failures.is_empty(),
        "import cycles (break each by moving what both sides need below both):\n{}",
        failures.join("\n")
    );
}

#[test]
fn a_two_module_cycle_is_named() {
    let modules = BTreeMap::from([
        (vec![], "mod a;\nmod b;\nmod c;".to_string()),
        (
            vec!["a".to_string()],
            "use crate::b::Thing;\n// use crate::c;\n".to_string(),
        ),
        (
            vec!["b".to_string()],
            "pub fn f() { super::a::g() }\n#[cfg(test)]\nmod tests {\n    use crate::c::X;\n}\n"
                .to_string(),
        ),
        (vec!["c".to_string()], "use crate::a;".to_string()),
    ]);
    assert_eq!(
        cycles(&modules)
            .iter()
            .map(|c| describe(c))
            .collect::<Vec<_>>(),
        ["a -> b -> a"]
    );
}

#[test]
fn a_cycle_through_a_parent_is_named_and_its_own_children_are_not() {
    let m = |path: &str| path.split("::").map(str::to_string).collect::<Module>();
    let modules = BTreeMap::from([
        (vec![], "mod fleet;\nmod state;".to_string()),
        (
            m("fleet"),
            "mod booking;\nuse booking::Booking;\nuse crate::fleet::booking::X;".to_string(),
        ),
        (m("fleet::booking"), "use super::Fleet;".to_string()),
        (
            m("state"),
            "use crate::fleet::booking::Booking;".to_string(),
        ),
    ]);
    assert!(cycles(&modules).is_empty());

    let mut with_cycle = modules.clone();
    with_cycle.insert(m("fleet"), "use crate::state::AppState;".to_string());
    assert_eq!(
        cycles(&with_cycle)
            .iter()
            .map(|c| describe(c))
            .collect::<Vec<_>>(),
        ["fleet -> state -> fleet::booking -> fleet"]
    );
}

fn describe(cycle: &[Module]) -> String {
    let mut names: Vec<String> = cycle.iter().map(|m| m.join("::")).collect();
    names.push(names[0].clone());
    names.join(" -> ")
}

/// Every `.rs` file under `src` as its module path, with its text.
fn read_modules(src: &Path) -> BTreeMap<Module, String> {
    let mut files = Vec::new();
    collect_files(src, &mut files);
    files
        .into_iter()
        .map(|file| {
            let relative = file.strip_prefix(src).unwrap().with_extension("");
            let mut module: Module = relative
                .iter()
                .map(|part| part.to_string_lossy().into_owned())
                .collect();
            if matches!(
                module.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                module.pop();
            }
            let text = fs::read_to_string(&file).unwrap();
            (module, text)
        })
        .collect()
}

fn collect_files(dir: &Path, files: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect_files(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

/// The cycles of the modules' import graph, each from its least module.
fn cycles(modules: &BTreeMap<Module, String>) -> Vec<Vec<Module>> {
    let graph: BTreeMap<&Module, BTreeSet<Module>> = modules
        .iter()
        .map(|(module, text)| (module, imports(module, text, modules)))
        .collect();
    // Each strongly connected component of more than one module holds a
    // cycle; the shortest one through its least module names it.
    let mut found = Vec::new();
    let mut seen = BTreeSet::new();
    for &start in graph.keys() {
        if seen.contains(start) {
            continue;
        }
        if let Some(cycle) = shortest_cycle(&graph, start) {
            seen.extend(cycle.iter().cloned());
            found.push(cycle);
        }
    }
    found
}

/// The shortest path from `start` back to itself, breadth first.
fn shortest_cycle(
    graph: &BTreeMap<&Module, BTreeSet<Module>>,
    start: &Module,
) -> Option<Vec<Module>> {
    let mut came_from: BTreeMap<Module, Module> = BTreeMap::new();
    let mut frontier = vec![start.clone()];
    while !frontier.is_empty() {
        let mut next = Vec::new();
        for module in frontier {
            for target in graph.get(&module).into_iter().flatten() {
                if target == start {
                    let mut cycle = vec![module.clone()];
                    while let Some(previous) = came_from.get(cycle.last().unwrap()) {
                        cycle.push(previous.clone());
                    }
                    cycle.reverse();
                    return Some(cycle);
                }
                if !came_from.contains_key(target) {
                    came_from.insert(target.clone(), module.clone());
                    next.push(target.clone());
                }
            }
        }
        frontier = next;
    }
    None
}

/// The modules `module`'s non-test code names through `crate::` and `super::`
/// paths, outside its own subtree.
fn imports(module: &Module, text: &str, modules: &BTreeMap<Module, String>) -> BTreeSet<Module> {
    let code = without_tests(&without_comments(text));
    let mut found = BTreeSet::new();
    for path in paths(&code) {
        let (mut base, rest): (Module, &[String]) = match path[0].as_str() {
            "crate" => (Vec::new(), &path[1..]),
            "super" => {
                let supers = path.iter().take_while(|s| *s == "super").count();
                let Some(keep) = module.len().checked_sub(supers) else {
                    continue;
                };
                (module[..keep].to_vec(), &path[supers..])
            }
            _ => continue,
        };
        // The longest prefix of the path that is a module holds the item.
        let mut target = base.clone();
        for segment in rest {
            base.push(segment.clone());
            if modules.contains_key(&base) {
                target = base.clone();
            } else {
                break;
            }
        }
        if !target.starts_with(module) {
            found.insert(target);
        }
    }
    found
}

/// Every path that starts with `crate` or `super`, with each item of a
/// `use crate::{a, b::{c, d}}` group spelled out.
fn paths(code: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let bytes = code.as_bytes();
    let is_ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut i = 0;
    while i < bytes.len() {
        let starts_word = i == 0 || !(is_ident(bytes[i - 1]) || bytes[i - 1] == b':');
        let rest = &code[i..];
        if starts_word && (rest.starts_with("crate::") || rest.starts_with("super::")) {
            i += expand(rest, Vec::new(), &mut found);
        } else {
            i += rest.chars().next().map_or(1, char::len_utf8);
        }
    }
    found
}

/// Reads one path (and its `{…}` group) at the start of `text` after the
/// segments in `prefix`; returns how many bytes it read.
fn expand(text: &str, mut prefix: Vec<String>, found: &mut Vec<Vec<String>>) -> usize {
    let mut i = 0;
    loop {
        let rest = &text[i..];
        let ident: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        i += ident.len();
        if !ident.is_empty() && ident != "self" {
            prefix.push(ident);
        }
        let after = &text[i..];
        if after.starts_with("::{") {
            i += 3;
            loop {
                let inner = text[i..].trim_start();
                i = text.len() - inner.len();
                if inner.starts_with('}') {
                    return i + 1;
                }
                i += expand(&text[i..], prefix.clone(), found);
                let inner = text[i..].trim_start();
                i = text.len() - inner.len();
                // Skip an `as name` and the comma.
                let skipped = inner.find([',', '}']).unwrap_or(inner.len());
                i += skipped;
                if text[i..].starts_with(',') {
                    i += 1;
                }
            }
        } else if after.starts_with("::") && !after[2..].starts_with(['*', '<']) {
            i += 2;
        } else {
            if !prefix.is_empty() {
                found.push(prefix);
            }
            return i.max(1);
        }
    }
}

/// `text` without `//` and `/* */` comments (doc comments included: their
/// links are not imports) and without string literals' contents.
fn without_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, chars.peek()) {
            ('/', Some('/')) => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            ('/', Some('*')) => {
                let mut last = ' ';
                for c in chars.by_ref() {
                    if last == '*' && c == '/' {
                        break;
                    }
                    last = c;
                }
            }
            // A char literal of a quote or an escape is no string.
            ('\'', Some('"')) => {
                chars.next();
                chars.next();
            }
            ('\'', Some('\\')) => {
                chars.next();
                chars.next();
            }
            ('r', Some('#' | '"')) if !out.ends_with(|c: char| c.is_alphanumeric() || c == '_') => {
                let mut hashes = 0;
                while chars.next_if_eq(&'#').is_some() {
                    hashes += 1;
                }
                if chars.next() != Some('"') {
                    continue;
                }
                let closing: String = std::iter::once('"')
                    .chain(std::iter::repeat_n('#', hashes))
                    .collect();
                let mut literal = String::new();
                for c in chars.by_ref() {
                    literal.push(c);
                    if literal.ends_with(&closing) {
                        break;
                    }
                }
                out.push_str("\"\"");
            }
            ('"', _) => {
                out.push('"');
                let mut escaped = false;
                for c in chars.by_ref() {
                    if !escaped && c == '"' {
                        break;
                    }
                    escaped = !escaped && c == '\\';
                }
                out.push('"');
            }
            _ => out.push(c),
        }
    }
    out
}

/// `code` without the items that `#[cfg(test)]` marks: tests may reach
/// anywhere.
fn without_tests(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        rest = &rest[at + "#[cfg(test)]".len()..];
        // The item ends at its first `;` outside braces, or where the braces
        // it opened close.
        let mut depth = 0usize;
        let mut end = rest.len();
        for (i, c) in rest.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = i + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}
