//! The crate's modules depend on each other in one direction only (ARCHITECTURE.md):
//! oom ← panics ← trace ← backend ← model ← optim ← cuda ← dist ← train ← cli. A `crate::` path in code (not
//! in comments) that points up the stack fails this test, and so does clap or anyhow outside
//! the command line.

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
