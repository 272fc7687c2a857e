//! The crate's modules depend on each other in one direction only (ARCHITECTURE.md):
//! oom ← panics ← trace ← backend ← model ← optim ← cuda ← dist ← train ← cli. A `crate::` path in code (not
//! in comments) that points up the stack fails this test, and so does clap or anyhow outside
//! the command line. Inside `src/train` the files are layered too (`TRAIN_LAYERS`: building
//! blocks ← config ← setup ← rank ← epochs ← launch ← run). No file of `src/` or
//! `pipeline/src/` reaches itself through others (`crate_edges` says what counts as an edge;
//! `KNOWN_CIRCLE_EDGES` lists, with reasons, the edges that still close a circle).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, bottom first. A module may use the layers below it.
const LAYERS: [&str; 10] = [
    "oom", "panics", "trace", "backend", "model", "optim", "cuda", "dist", "train", "cli",
];

/// Known upward edges, each with the reason it is still there. Nothing else may be added.
const EXCEPTIONS: [(&str, &str, &str); 1] = [(
    "backend",
    "model",
    "the backends take the model's input batch types (InputBatch, Augment, ImageNet constants) \
     and the conformance suite drives a whole Network; moving them down belongs to the backend work",
)];

fn layer(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| *l == module)
}

/// The code of a line without its comment.
fn code(line: &str) -> &str {
    match line.find("//") {
        Some(i) => &line[..i],
        None => line,
    }
}

/// Every top-level module a piece of code names through `crate::` (including `crate::{a, b}`).
fn crate_targets(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let code: String = text.lines().map(code).collect::<Vec<_>>().join("\n");
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `mycrate::`, not the crate root
        }
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(head(&item));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
            if !item.trim().is_empty() {
                out.push(head(&item));
            }
        } else {
            out.push(head(rest));
        }
    }
    out.retain(|m| !m.is_empty());
    out
}

fn head(path: &str) -> String {
    path.trim()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// The upward `crate::` edges of `module`'s file text.
fn violations(module: &str, text: &str) -> Vec<String> {
    let Some(mine) = layer(module) else {
        return Vec::new();
    };
    crate_targets(text)
        .into_iter()
        .filter(|t| layer(t).is_some_and(|l| l > mine))
        .filter(|t| !EXCEPTIONS.iter().any(|(m, to, _)| *m == module && to == t))
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file under `src/` belongs to (`None` for lib.rs and main.rs).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib" && name != "main").then(|| name.to_string())
}

#[test]
fn every_crate_path_points_down_the_stack() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut found = Vec::new();
    let mut unplaced = Vec::new();
    for file in &files {
        let Some(module) = module_of(&src, file) else {
            continue;
        };
        if layer(&module).is_none() {
            unplaced.push(module.clone());
        }
        let text = std::fs::read_to_string(file).unwrap();
        for target in violations(&module, &text) {
            found.push(format!(
                "{}: {module} uses crate::{target}, which sits above it",
                file.display()
            ));
        }
    }
    unplaced.sort();
    unplaced.dedup();
    assert!(
        unplaced.is_empty(),
        "modules without a layer (add them to LAYERS): {unplaced:?}"
    );
    assert!(
        found.is_empty(),
        "dependencies must point down ({}):\n{}",
        LAYERS.join(" ← "),
        found.join("\n")
    );
}

#[test]
fn clap_and_anyhow_stay_in_the_command_line() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut found = Vec::new();
    for file in &files {
        let module = module_of(&src, file);
        if module.is_none() || module.as_deref() == Some("cli") {
            continue;
        }
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = code(line);
            if code.contains("clap::") || code.contains("anyhow") {
                found.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn the_checker_sees_upward_paths_and_ignores_comments() {
    let text = "use crate::backend::Backend;\n\
                use crate::{optim::Hyper, train::TrainConfig};\n\
                // see crate::cli for the flags\n\
                /// [`crate::dist::Collective`]\n\
                fn f() { let _ = crate::cli::run; }\n";
    assert_eq!(violations("model", text), vec!["optim", "train", "cli"]);
    assert_eq!(
        crate_targets("use crate::{a::{b, c}, d::e};"),
        vec!["a".to_string(), "d".to_string()]
    );
    assert!(violations("cli", text).is_empty());
    // The one known exception stays allowed, and only for its module.
    assert!(violations("backend", "use crate::model::InputBatch;").is_empty());
    assert_eq!(violations("optim", "use crate::train::X;"), vec!["train"]);
}

/// The layers inside `src/train`, bottom first, each with the modules it holds (a directory
/// module with every file under it). A file may use files of its own layer and of the layers
/// below; `train/mod.rs` is the facade above them all (its re-exports are followed, never
/// used as such). The per-step device code (`rank`) sits below the epochs loop that drives it,
/// and both below the launchers that start ranks, so what a launcher calls back (`run_rank`,
/// `RankReport`, `Launched`, `StopWish`) is never defined above it.
const TRAIN_LAYERS: [(&str, &[&str]); 7] = [
    (
        "building blocks",
        &[
            "error", "folder", "augment", "mix", "ema", "lr_find", "progress", "summary",
            "evaluate", "device",
        ],
    ),
    ("config", &["config"]),
    ("setup", &["setup", "resumed_files"]),
    ("rank", &["rank"]),
    (
        "epochs",
        &["validation", "report", "divergence", "epoch_end", "epochs"],
    ),
    ("launch", &["launch"]),
    ("run", &["outcome", "run", "multirank_tests"]),
];

/// Known edges that close a circle inside `src/train`, each with the reason it is still there.
/// Nothing else may be added, and one that is gone must leave this list.
const TRAIN_EXCEPTIONS: [(&str, &str, &str); 0] = [];

/// What the per-step device code (`src/train/rank/`) must not use: launchers, rendezvous,
/// thread starts and the abort of a process's communicators belong to `train/launch`.
const NOT_IN_RANKS: [&str; 5] = ["launch", "rendezvous", "ranks", "start_gate", "abort_group"];

/// A `#[path]` file: its path relative to the declaring file's folder, and its module.
type PathModule = (String, Vec<String>);

/// A leaf of a `use` tree: its segments and its alias (`as`).
type Leaf = (Vec<String>, Option<String>);

/// A `use` tree or path starting at `text[at..]`: each leaf's segments with its alias
/// (`as`), and where the tree ends. `{a, b::{c, self}}`, `*` and `as` are understood.
fn use_tree(text: &str, at: usize) -> (Vec<Leaf>, usize) {
    fn skip_space(text: &str, mut i: usize) -> usize {
        while text[i..].starts_with(|c: char| c.is_whitespace()) {
            i += text[i..].chars().next().map_or(1, char::len_utf8);
        }
        i
    }
    fn ident(text: &str, i: usize) -> Option<&str> {
        let end = text[i..]
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .map_or(text.len(), |n| i + n);
        (end > i).then(|| &text[i..end])
    }
    fn tree(text: &str, mut i: usize, prefix: Vec<String>) -> (Vec<Leaf>, usize) {
        let mut segs = prefix;
        loop {
            i = skip_space(text, i);
            if text[i..].starts_with('{') {
                let mut out = Vec::new();
                i += 1;
                loop {
                    i = skip_space(text, i);
                    if text[i..].starts_with('}') {
                        return (out, i + 1);
                    }
                    let (sub, end) = tree(text, i, segs.clone());
                    out.extend(sub);
                    i = skip_space(text, end);
                    if text[i..].starts_with(',') {
                        i += 1;
                    } else if text[i..].starts_with('}') {
                        return (out, i + 1);
                    } else {
                        return (out, i);
                    }
                }
            }
            if text[i..].starts_with('*') {
                return (vec![(segs, None)], i + 1);
            }
            let Some(name) = ident(text, i) else {
                return (vec![(segs, None)], i);
            };
            i += name.len();
            if name != "self" {
                segs.push(name.to_string());
            }
            let next = skip_space(text, i);
            if text[next..].starts_with("::") {
                i = next + 2;
                continue;
            }
            if text[next..].starts_with("as ") {
                let alias_at = skip_space(text, next + 2);
                if let Some(alias) = ident(text, alias_at) {
                    return (
                        vec![(segs, Some(alias.to_string()))],
                        alias_at + alias.len(),
                    );
                }
            }
            return (vec![(segs, None)], i);
        }
    }
    tree(text, at, Vec::new())
}

/// The inline modules of `code` (`mod tests { … }`): each name with the range of its body,
/// found by matching braces (a brace between quotes, `'{'`, does not count).
fn inline_modules(code: &str) -> Vec<(String, std::ops::Range<usize>)> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices("mod ") {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[at + 4..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let after = rest[name.len()..].trim_start();
        if name.is_empty() || !after.starts_with('{') {
            continue;
        }
        let open = code.len() - after.len();
        let mut depth = 0usize;
        let mut end = code.len();
        for (i, c) in code[open..].char_indices() {
            if c != '{' && c != '}' {
                continue;
            }
            let at = open + i;
            if code[..at].ends_with('\'') && code[at + 1..].starts_with('\'') {
                continue; // a quoted brace
            }
            if c == '{' {
                depth += 1;
            } else {
                depth -= 1;
                if depth == 0 {
                    end = at;
                    break;
                }
            }
        }
        out.push((name, open..end));
    }
    out
}

/// A source file as the checker reads it: its module path from the crate root
/// (`["train", "rank", "cpu"]`; empty for `lib.rs`), its code without comments, its inline
/// modules (where `super::` means something else), the child modules it declares and where
/// its re-exports (`pub use`, `pub(crate) use`, …) begin.
struct SourceFile {
    module: Vec<String>,
    code: String,
    inline: Vec<(String, std::ops::Range<usize>)>,
    children: BTreeSet<String>,
    reexport_at: BTreeSet<usize>,
}

impl SourceFile {
    /// `rel` is the path under the crate's `src` (`train/rank/cpu.rs`, `model/mod.rs`,
    /// `lib.rs`).
    fn new(rel: &str, text: &str) -> SourceFile {
        let stem = rel.strip_suffix(".rs").unwrap_or(rel);
        let mut module: Vec<String> = stem.split('/').map(str::to_string).collect();
        if module.last().is_some_and(|m| m == "mod") || module == ["lib"] {
            module.pop();
        }
        SourceFile::at(module, text)
    }

    /// The file of module `module` (a `#[path]` file lives elsewhere than its path says).
    fn at(module: Vec<String>, text: &str) -> SourceFile {
        let code: String = text.lines().map(code).collect::<Vec<_>>().join("\n");
        let inline = inline_modules(&code);
        let children = code
            .lines()
            .filter_map(|l| {
                let l = l.trim();
                let l = l.rsplit_once(") ").map_or(l, |(_, r)| r); // `pub(crate) mod x;`
                let l = l.strip_prefix("pub ").unwrap_or(l);
                let name = l.strip_prefix("mod ")?.strip_suffix(';')?;
                Some(name.trim().to_string())
            })
            .collect();
        let reexport_at = code
            .match_indices("use ")
            .filter(|(at, _)| {
                let before = code[..*at].trim_end();
                ["pub", "pub(crate)", "pub(super)", "pub(self)"]
                    .iter()
                    .any(|p| before.ends_with(p))
            })
            .map(|(at, _)| at + 4 + (code[at + 4..].len() - code[at + 4..].trim_start().len()))
            .collect();
        SourceFile {
            module,
            code,
            inline,
            children,
            reexport_at,
        }
    }

    /// The files declared with `#[path = "…"] mod name;`: (the file's path relative to this
    /// file's folder, the module it is).
    fn path_modules(&self) -> Vec<PathModule> {
        let lines: Vec<&str> = self.code.lines().map(str::trim).collect();
        lines
            .windows(2)
            .filter_map(|w| {
                let file = w[0].strip_prefix("#[path = \"")?.strip_suffix("\"]")?;
                let l = w[1].rsplit_once(") ").map_or(w[1], |(_, r)| r);
                let l = l.strip_prefix("pub ").unwrap_or(l);
                let name = l.strip_prefix("mod ")?.strip_suffix(';')?.trim();
                let mut module = self.module.clone();
                module.push(name.to_string());
                Some((file.to_string(), module))
            })
            .collect()
    }

    /// Every path the code names from `crate`, `super`, `self` or a child module, resolved
    /// from the (inline) module it is named in against the crate root (`["train", "rank",
    /// "Device"]`, `["dist", "launch", "probe_gpus"]`). With `uses_only`, the paths of
    /// re-exports are left out: they are followed to the defining file, never used as such.
    fn named(&self, uses_only: bool) -> Vec<Vec<String>> {
        let mut out = Vec::new();
        let code = self.code.as_str();
        let mut i = 0;
        while i < code.len() {
            let c = code[i..].chars().next().unwrap();
            let starts = (c.is_alphabetic() || c == '_')
                && !code[..i]
                    .chars()
                    .last()
                    .is_some_and(|p| p.is_alphanumeric() || p == '_' || p == ':' || p == '$');
            if !starts {
                i += c.len_utf8();
                continue;
            }
            let word_end = code[i..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .map_or(code.len(), |n| i + n);
            let word = &code[i..word_end];
            let rooted = ["crate", "super", "self"].contains(&word) || self.children.contains(word);
            let visibility = code[..i].trim_end().ends_with("(in"); // `pub(in crate::a)`
            if !rooted || visibility || !code[word_end..].starts_with("::") {
                i = word_end;
                continue;
            }
            let mut base = self.module.clone();
            for (name, body) in &self.inline {
                if body.contains(&i) {
                    base.push(name.clone());
                }
            }
            let (leaves, end) = use_tree(code, i);
            if !(uses_only && self.reexport_at.contains(&i)) {
                for (segs, _) in leaves {
                    out.push(absolute(&base, &segs));
                }
            }
            i = end.max(word_end);
        }
        out
    }

    /// Every path the code names (re-exports included), from the crate root.
    fn paths(&self) -> Vec<Vec<String>> {
        self.named(false)
    }

    /// The re-exports of this file: exported name → the path it stands for.
    fn reexports(&self) -> BTreeMap<String, Vec<String>> {
        let mut out = BTreeMap::new();
        for at in &self.reexport_at {
            let (leaves, _) = use_tree(&self.code, *at);
            for (segs, alias) in leaves {
                let Some(first) = segs.first() else { continue };
                let rooted = ["crate", "super", "self"].contains(&first.as_str())
                    || self.children.contains(first);
                if !rooted {
                    continue; // another crate's item
                }
                let path = absolute(&self.module, &segs);
                if let Some(name) = alias.or_else(|| path.last().cloned()) {
                    out.insert(name, path);
                }
            }
        }
        out
    }
}

/// `segs` (starting with `crate`, `super`, `self` or a child module) from module `base`.
fn absolute(base: &[String], segs: &[String]) -> Vec<String> {
    let mut path: Vec<String> = base.to_vec();
    let mut rest = segs;
    if rest.first().is_some_and(|s| s == "crate") {
        path.clear();
        rest = &rest[1..];
    }
    while let Some(first) = rest.first() {
        match first.as_str() {
            "super" => {
                path.pop();
            }
            "self" => {}
            _ => break,
        }
        rest = &rest[1..];
    }
    path.extend(rest.iter().cloned());
    path
}

/// The edges between the files of one crate, given as (path under its `src`, text): `a → b`
/// when `a`'s code uses something `b` defines. What counts as an edge:
/// - a `crate::`, `super::`, `self::` or child-module path in code (comments and `$crate`
///   do not count), resolved to the file that *defines* the item: a re-export is followed
///   to the item's file, so re-exporting is never a use of its own, and a `mod.rs` that
///   only declares and re-exports its children depends on none of them;
/// - declaring a child (`mod x;`) is not an edge; a parent and a child form a circle only
///   when each uses an item the other defines (`mod.rs` calling `x::f` while `x.rs` uses a
///   type defined in `mod.rs`), which is then fixed like any other circle;
/// - a file's own inline modules (`mod tests { use super::*; }`) are the file itself.
///
/// Module paths are written `train/rank/cpu`; the crate root (`lib.rs`) is the empty one.
fn crate_edges(files: &[(String, String)]) -> BTreeSet<(String, String)> {
    let mut parsed: BTreeMap<Vec<String>, SourceFile> = files
        .iter()
        .map(|(rel, text)| {
            let f = SourceFile::new(rel, text);
            (f.module.clone(), f)
        })
        .collect();
    // `#[path = "x.rs"] mod name;` makes x.rs the module `name` of the declaring file.
    let declared: Vec<(&String, Vec<PathModule>)> = files
        .iter()
        .map(|(rel, _)| (rel, parsed[&SourceFile::new(rel, "").module].path_modules()))
        .collect();
    for (rel, path_modules) in declared {
        let dir = rel.rsplit_once('/').map_or("", |(d, _)| d);
        for (file, module) in path_modules {
            let file_rel = if dir.is_empty() {
                file
            } else {
                format!("{dir}/{file}")
            };
            let Some((_, text)) = files.iter().find(|(r, _)| *r == file_rel) else {
                continue;
            };
            parsed.remove(&SourceFile::new(&file_rel, "").module);
            parsed.insert(module.clone(), SourceFile::at(module, text));
        }
    }
    let reexports: BTreeMap<&Vec<String>, BTreeMap<String, Vec<String>>> =
        parsed.iter().map(|(m, f)| (m, f.reexports())).collect();
    // The file defining what `path` (from the crate root) names, if it is one of `files`.
    let resolve = |path: &[String]| -> Option<Vec<String>> {
        let mut path = path.to_vec();
        for _ in 0..8 {
            let k = (0..=path.len())
                .rev()
                .find(|&k| parsed.contains_key(&path[..k]))?;
            let module = path[..k].to_vec();
            match path.get(k).and_then(|name| reexports[&module].get(name)) {
                Some(target) if *target != path[..=k] => {
                    let mut next = target.clone();
                    next.extend(path[k + 1..].iter().cloned());
                    path = next;
                }
                _ => return Some(module),
            }
        }
        None
    };
    let mut edges = BTreeSet::new();
    for (module, file) in &parsed {
        for path in file.named(true) {
            if let Some(target) = resolve(&path) {
                if &target != module {
                    edges.insert((module.join("/"), target.join("/")));
                }
            }
        }
    }
    edges
}

/// The files of `src/train` (as `crate_edges` of those files alone) and the edges between
/// them, with module paths relative to `src/train` (`rank/cpu`; `train/mod.rs` is the empty
/// one). `files` are (path under `src/train`, text).
fn train_edges(files: &[(String, String)]) -> BTreeSet<(String, String)> {
    let files: Vec<(String, String)> = files
        .iter()
        .map(|(rel, text)| (format!("train/{rel}"), text.clone()))
        .collect();
    let strip = |m: String| -> String {
        match m.strip_prefix("train/") {
            Some(rest) => rest.to_string(),
            None => String::new(), // `train` itself
        }
    };
    crate_edges(&files)
        .into_iter()
        .map(|(f, t)| (strip(f), strip(t)))
        .collect()
}

/// The layer of a `src/train` module path (`rank/cuda` is in `rank`'s).
fn train_layer(module: &str) -> Option<usize> {
    let first = module.split('/').next()?;
    TRAIN_LAYERS
        .iter()
        .position(|(_, modules)| modules.contains(&first))
}

fn is_train_exception(from: &str, to: &str) -> bool {
    TRAIN_EXCEPTIONS
        .iter()
        .any(|(f, t, _)| *f == from && *t == to)
}

/// Upward edges (and any use of the facade `train/mod.rs`), as messages.
fn train_violations(edges: &BTreeSet<(String, String)>) -> Vec<String> {
    let name = |l: Option<usize>| l.map_or("no layer", |l| TRAIN_LAYERS[l].0);
    edges
        .iter()
        .filter(|(from, to)| !from.is_empty() && !is_train_exception(from, to))
        .filter_map(|(from, to)| {
            let (lf, lt) = (train_layer(from), train_layer(to));
            if to.is_empty() {
                return Some(format!(
                    "{from} uses an item defined in train/mod.rs, the facade"
                ));
            }
            (lt > lf).then(|| {
                format!(
                    "{from} ({}) uses {to}, which sits above it ({})",
                    name(lf),
                    name(lt)
                )
            })
        })
        .collect()
}

/// Every circle among the files (a strongly connected component of two or more), each sorted.
fn train_cycles(edges: &BTreeSet<(String, String)>) -> Vec<Vec<String>> {
    let kept: BTreeSet<(String, String)> = edges
        .iter()
        .filter(|(f, t)| !is_train_exception(f, t))
        .cloned()
        .collect();
    cycles(&kept)
}

/// Every circle among the nodes of `edges` (a strongly connected component of two or more),
/// each sorted.
fn cycles(edges: &BTreeSet<(String, String)>) -> Vec<Vec<String>> {
    let mut next: BTreeMap<&String, Vec<&String>> = BTreeMap::new();
    for (f, t) in edges {
        next.entry(f).or_default().push(t);
    }
    let nodes: BTreeSet<&String> = edges.iter().flat_map(|(f, t)| [f, t]).collect();
    let reach = |from: &String| -> BTreeSet<&String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from];
        while let Some(n) = todo.pop() {
            for t in next.get(n).into_iter().flatten() {
                if seen.insert(*t) {
                    todo.push(t);
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<&String>> =
        nodes.iter().map(|n| (*n, reach(n))).collect();
    let mut cycles: BTreeSet<Vec<String>> = BTreeSet::new();
    for n in &nodes {
        if !reaches[n].contains(n) {
            continue;
        }
        let mut cycle: Vec<String> = nodes
            .iter()
            .filter(|m| reaches[n].contains(*m) && reaches[*m].contains(n))
            .map(|m| m.to_string())
            .collect();
        cycle.sort();
        cycles.insert(cycle);
    }
    cycles.into_iter().collect()
}

/// The `.rs` files under `dir` (relative to the workspace), as (path under `dir`, text).
fn read_files(dir: &str) -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut files = Vec::new();
    rust_files(&dir, &mut files);
    files.sort();
    files
        .iter()
        .map(|f| {
            let rel = f
                .strip_prefix(&dir)
                .unwrap()
                .to_str()
                .unwrap()
                .replace('\\', "/");
            (rel, std::fs::read_to_string(f).unwrap())
        })
        .collect()
}

/// The files of `src/train`, as (path under `src/train`, text).
fn read_train_files() -> Vec<(String, String)> {
    read_files("src/train")
}

/// Known edges that close a circle among the files of a crate's `src` (the crate's `src`,
/// from, to, why it is still there). Nothing else may be added, and one that is gone must
/// leave this list.
const KNOWN_CIRCLE_EDGES: [(&str, &str, &str, &str); 0] = [];

/// The circles among the files of a crate's `src` (the binary's `main.rs`, a crate of its
/// own, left out; the crate's `KNOWN_CIRCLE_EDGES` too), as messages, and the known edges
/// that are gone.
fn crate_circles(src: &str) -> (Vec<String>, Vec<String>) {
    let files: Vec<(String, String)> = read_files(src)
        .into_iter()
        .filter(|(rel, _)| rel != "main.rs")
        .collect();
    let name = |m: &String| {
        if m.is_empty() {
            format!("{src}/lib.rs")
        } else {
            format!("{src}/{m}")
        }
    };
    let all = crate_edges(&files);
    let known = |f: &str, t: &str| {
        KNOWN_CIRCLE_EDGES
            .iter()
            .any(|(c, kf, kt, _)| *c == src && *kf == f && *kt == t)
    };
    let edges: BTreeSet<(String, String)> =
        all.iter().filter(|(f, t)| !known(f, t)).cloned().collect();
    let circles = cycles(&edges)
        .iter()
        .map(|c| {
            let inside: Vec<String> = edges
                .iter()
                .filter(|(f, t)| c.contains(f) && c.contains(t))
                .map(|(f, t)| format!("  {} → {}", name(f), name(t)))
                .collect();
            format!(
                "{}\n{}",
                c.iter().map(name).collect::<Vec<_>>().join(" ⇄ "),
                inside.join("\n")
            )
        })
        .collect();
    let gone = KNOWN_CIRCLE_EDGES
        .iter()
        .filter(|(c, f, t, _)| *c == src && !all.contains(&(f.to_string(), t.to_string())))
        .map(|(_, f, t, why)| format!("{src}/{f} no longer uses {src}/{t} ({why})"))
        .collect();
    (circles, gone)
}

/// No file of `src/` or `pipeline/src/` reaches itself through others, inside a module
/// folder or across folders (what counts as an edge: `crate_edges`).
#[test]
fn no_source_file_reaches_itself_through_others() {
    let (mut found, mut gone) = crate_circles("src");
    let (pipeline_found, pipeline_gone) = crate_circles("pipeline/src");
    found.extend(pipeline_found);
    gone.extend(pipeline_gone);
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
    assert!(
        gone.is_empty(),
        "remove from KNOWN_CIRCLE_EDGES:\n{}",
        gone.join("\n")
    );
}

#[test]
fn the_trainer_is_layered_without_a_circle() {
    let files = read_train_files();
    let edges = train_edges(&files);
    let mut unplaced: Vec<String> = files
        .iter()
        .map(|(rel, text)| SourceFile::new(&format!("train/{rel}"), text).module[1..].join("/"))
        .filter(|m| !m.is_empty() && train_layer(m).is_none())
        .collect();
    unplaced.dedup();
    assert!(
        unplaced.is_empty(),
        "src/train modules without a layer (add them to TRAIN_LAYERS): {unplaced:?}"
    );
    let found = train_violations(&edges);
    let order: Vec<&str> = TRAIN_LAYERS.iter().map(|(n, _)| *n).collect();
    assert!(
        found.is_empty(),
        "src/train's dependencies must point down ({}):\n{}",
        order.join(" ← "),
        found.join("\n")
    );
    let cycles = train_cycles(&edges);
    assert!(
        cycles.is_empty(),
        "import circles in src/train:\n{}",
        cycles
            .iter()
            .map(|c| c.join(" ⇄ "))
            .collect::<Vec<_>>()
            .join("\n")
    );
    for (from, to, why) in TRAIN_EXCEPTIONS {
        assert!(
            edges.contains(&(from.to_string(), to.to_string())),
            "{from} no longer uses {to} ({why}): remove it from TRAIN_EXCEPTIONS"
        );
    }
}

#[test]
fn the_per_step_rank_code_starts_no_ranks() {
    let mut found = Vec::new();
    for (rel, text) in read_train_files() {
        if !rel.starts_with("rank/") {
            continue;
        }
        for path in SourceFile::new(&format!("train/{rel}"), &text).paths() {
            if path.first().is_some_and(|m| m == "dist")
                && path
                    .get(1)
                    .is_some_and(|m| NOT_IN_RANKS.contains(&m.as_str()))
            {
                found.push(format!("src/train/{rel} uses crate::{}", path.join("::")));
            }
        }
    }
    found.dedup();
    assert!(
        found.is_empty(),
        "launch code in the per-step rank code (it belongs to src/train/launch):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_train_checker_sees_back_edges_circles_and_reexports() {
    let file = |rel: &str, text: &str| (rel.to_string(), text.to_string());
    let files = vec![
        file(
            "mod.rs",
            "mod error;\nmod setup;\nmod epochs;\nmod report;\nmod launch;\n\
             pub use error::TrainError;\n",
        ),
        file("error.rs", "pub enum TrainError {}\n"),
        // A back edge: setup names a launcher (in code, after its tests module, whose
        // `super::` is setup itself; comments do not count).
        file(
            "setup.rs",
            "use super::TrainError;\n// super::launch::go is the launcher\n\
             #[cfg(test)]\nmod tests {\n    use super::s;\n}\n\
             pub fn s() { super::launch::cpu::go(); }\n",
        ),
        // A circle inside one layer: epochs ⇄ report.
        file(
            "epochs.rs",
            "use super::report::{RankReport, first_cause};\npub fn run_rank() {}\n",
        ),
        file(
            "report.rs",
            "pub struct RankReport;\nfn f() { crate::train::epochs::run_rank() }\n",
        ),
        file(
            "launch/mod.rs",
            "pub(crate) mod cpu;\nfn l() { cpu::go() }\n",
        ),
        file(
            "launch/cpu.rs",
            "use crate::train::{epochs::run_rank, TrainError};\npub fn go() {}\n\
             #[cfg(test)]\nmod tests {\n    use super::*;\n    fn f() { let _ = '}'; }\n    use super::super::cpu::go;\n}\n",
        ),
    ];
    let edges = train_edges(&files);
    let has = |a: &str, b: &str| edges.contains(&(a.to_string(), b.to_string()));
    // Re-exports lead to the defining file, not the facade.
    assert!(has("setup", "error") && has("launch/cpu", "error"));
    assert!(!edges.iter().any(|(_, t)| t.is_empty()), "{edges:?}");
    assert!(has("launch", "launch/cpu") && has("launch/cpu", "epochs"));
    // `super::*` and `super::super::cpu` inside the tests name the file itself.
    assert!(!has("launch/cpu", "launch"), "{edges:?}");
    assert!(!has("setup", "launch"), "a comment counted: {edges:?}");
    let violations = train_violations(&edges);
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].starts_with("setup (setup) uses launch/cpu"),
        "{violations:?}"
    );
    assert_eq!(
        train_cycles(&edges),
        vec![vec!["epochs".to_string(), "report".to_string()]]
    );
    let (leaves, _) = use_tree("crate::{a::{b, c as d}, e::*}", 0);
    let leaves: Vec<_> = leaves.into_iter().map(|(s, a)| (s.join("::"), a)).collect();
    assert_eq!(
        leaves,
        vec![
            ("crate::a::b".to_string(), None),
            ("crate::a::c".to_string(), Some("d".to_string())),
            ("crate::e".to_string(), None),
        ]
    );
}

#[test]
fn the_crate_checker_sees_circles_across_folders_and_between_parent_and_child() {
    let file = |rel: &str, text: &str| (rel.to_string(), text.to_string());
    let files = vec![
        file("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n"),
        // A facade: declaring and re-exporting its children is no use of them.
        file(
            "a/mod.rs",
            "mod x;\nmod y;\npub use x::X;\npub(crate) use y::Y;\n",
        ),
        file(
            "a/x.rs",
            "pub struct X;\nfn f() { let _ = super::Y; let _ = crate::c::C; }\n",
        ),
        file("a/y.rs", "pub struct Y;\n"),
        // A parent that uses its child while the child uses what the parent defines.
        file(
            "b/mod.rs",
            "mod kid;\npub struct Top;\nfn g() { kid::k() }\n\
             #[path = \"far.rs\"]\nmod near;\n",
        ),
        file("b/kid.rs", "pub fn k() { let _ = super::Top; }\n"),
        // A `#[path]` file is the module its declaring file names: its `super` is `b`.
        file("b/far.rs", "fn h() { let _ = super::Top; }\n"),
        // A circle across folders, and a visibility path that is no use.
        file(
            "c.rs",
            "pub(in crate::b) struct C;\nfn i() { crate::a::X; }\n",
        ),
    ];
    let edges = crate_edges(&files);
    let has = |a: &str, b: &str| edges.contains(&(a.to_string(), b.to_string()));
    assert!(
        !has("a", "a/x") && !has("a", "a/y"),
        "a re-export counted: {edges:?}"
    );
    assert!(
        has("a/x", "a/y"),
        "re-exports lead to the defining file: {edges:?}"
    );
    assert!(has("b", "b/kid") && has("b/kid", "b"));
    assert!(has("b/near", "b"), "{edges:?}");
    assert!(!edges.iter().any(|(f, _)| f == "b/far"), "{edges:?}");
    assert!(!has("c", "b"), "a visibility path counted: {edges:?}");
    assert_eq!(
        cycles(&edges),
        vec![
            vec!["a/x".to_string(), "c".to_string()],
            vec!["b".to_string(), "b/kid".to_string()],
        ]
    );
}
