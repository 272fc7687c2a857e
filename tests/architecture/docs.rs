//! The documentation stays true: `docs/flags.md` is what the clap tree renders
//! (`BIRDTRAIN_UPDATE_DOCS=1` rewrites it), the README stays short, and every markdown link in
//! README.md, ARCHITECTURE.md and docs/ stays inside the repository and resolves (file and
//! heading), as does every `../` path they name.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use birdtrain::cli::flags_doc::{anchor, flags_markdown, UPDATE_DOCS_VAR};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md, ARCHITECTURE.md and every markdown file under docs/.
fn doc_files() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md"), root().join("ARCHITECTURE.md")];
    let mut pages: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    assert!(!pages.is_empty(), "docs/ holds no markdown page");
    files.extend(pages);
    files
}

#[test]
fn flags_page_is_what_the_command_line_renders() {
    let path = root().join("docs/flags.md");
    let rendered = flags_markdown();
    if std::env::var_os(UPDATE_DOCS_VAR).is_some_and(|v| v == "1") {
        std::fs::write(&path, &rendered).unwrap();
        return;
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    if on_disk != rendered {
        let first = on_disk
            .lines()
            .zip(rendered.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(on_disk.lines().count().min(rendered.lines().count()));
        panic!(
            "docs/flags.md is out of date (first difference at line {}: {:?}); rewrite it with \
             `{UPDATE_DOCS_VAR}=1 cargo test --test architecture docs::`",
            first + 1,
            rendered.lines().nth(first).unwrap_or("<end of page>")
        );
    }
}

#[test]
fn flags_page_covers_every_command_and_flag() {
    let page = flags_markdown();
    for needle in [
        "## `birdtrain train`",
        "## `birdtrain eval`",
        "## `birdtrain predict`",
        "## `birdtrain bench step`",
        "## `birdtrain kernels check`",
        "| `--color-jitter` |",
        "| `<IMAGE>...` |",
    ] {
        assert!(page.contains(needle), "docs/flags.md lacks {needle:?}");
    }
    // The help flag clap adds and the hidden flags are no user's business here.
    assert!(!page.contains("| `-h`, `--help` |"));
}

#[test]
fn readme_is_short_and_starts_with_the_two_commands() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(lines <= 150, "README.md has {lines} lines, at most 150");
    let demo = readme
        .find("cargo run --release -- demo")
        .expect("the demo command");
    let tests = readme
        .find("bash scripts/test.sh")
        .expect("the test command");
    let first_heading = readme[1..].find("\n## ").map_or(readme.len(), |i| i + 1);
    assert!(
        demo < first_heading && tests < first_heading,
        "the two commands come first, before the README's first section"
    );
    assert!(root().join("scripts/test.sh").is_file());
}

/// A markdown link or image target, with the line it is on.
struct Link {
    line: usize,
    target: String,
}

/// The text of a page with fenced code blocks and inline code spans blanked, so the code a page
/// shows is never read as a link.
fn prose(text: &str) -> Vec<String> {
    let mut in_fence = false;
    text.lines()
        .map(|line| {
            if line.trim_start().starts_with("```") {
                in_fence = !in_fence;
                return String::new();
            }
            if in_fence {
                return String::new();
            }
            let mut out = String::new();
            let mut in_code = false;
            for c in line.chars() {
                if c == '`' {
                    in_code = !in_code;
                } else if !in_code {
                    out.push(c);
                }
            }
            out
        })
        .collect()
}

/// Inline links `[text](target)`, images `![alt](target)`, autolinks `<scheme:…>` and
/// reference definitions `[label]: target`.
fn links(text: &str) -> Vec<Link> {
    let mut found = Vec::new();
    for (n, line) in prose(text).iter().enumerate() {
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let end = after.find(')').unwrap_or(after.len());
            let target = after[..end].split_whitespace().next().unwrap_or("");
            found.push(Link {
                line: n + 1,
                target: target.trim_matches(|c| c == '<' || c == '>').to_string(),
            });
            rest = &after[end..];
        }
        let trimmed = line.trim_start();
        if let Some(close) = trimmed.strip_prefix('[').and_then(|r| r.find("]:")) {
            let target = trimmed[close + 3..].split_whitespace().next().unwrap_or("");
            found.push(Link {
                line: n + 1,
                target: target.to_string(),
            });
        }
        let mut rest = line.as_str();
        while let Some(at) = rest.find('<') {
            let after = &rest[at + 1..];
            let end = after.find('>').unwrap_or(after.len());
            if after[..end].contains("://") || after[..end].starts_with("mailto:") {
                found.push(Link {
                    line: n + 1,
                    target: after[..end].to_string(),
                });
            }
            rest = &after[end..];
        }
    }
    found
}

/// The anchors GitHub gives a page's headings (a repeated heading gets `-1`, `-2`, …).
fn anchors(text: &str) -> HashSet<String> {
    let mut seen = HashSet::new();
    let mut in_fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
        }
        if in_fence || !line.starts_with('#') {
            continue;
        }
        let base = anchor(line.trim_start_matches('#'));
        let mut slug = base.clone();
        let mut k = 0;
        while seen.contains(&slug) {
            k += 1;
            slug = format!("{base}-{k}");
        }
        seen.insert(slug);
    }
    seen
}

/// Every path in a line that climbs with `../`, in prose, code spans or code blocks alike: a
/// file the reader cannot find in the repository is as broken as a link to it.
fn parent_paths(line: &str) -> Vec<&str> {
    let mut found = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("../") {
        let start = rest[..at]
            .rfind(|c: char| c.is_whitespace() || "`(<\"'[".contains(c))
            .map_or(0, |i| i + 1);
        let end = rest[at..]
            .find(|c: char| c.is_whitespace() || "`)>\"']#,;".contains(c))
            .map_or(rest.len(), |i| at + i);
        found.push(&rest[start..end]);
        rest = &rest[end..];
    }
    found
}

fn relative(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}

#[test]
fn no_link_leaves_the_repository_and_every_link_resolves() {
    let mut broken = Vec::new();
    for file in doc_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let name = relative(&file);
        for (n, line) in text.lines().enumerate() {
            if line.contains("http://") || line.contains("https://") {
                broken.push(format!("{name}:{}: a web address: {line}", n + 1));
            }
        }
        for (n, line) in text.lines().enumerate() {
            for path in parent_paths(line) {
                let outside = file
                    .parent()
                    .unwrap()
                    .join(path)
                    .components()
                    .fold(Vec::new(), |mut kept, part| {
                        match part {
                            std::path::Component::ParentDir => {
                                kept.pop();
                            }
                            other => kept.push(other),
                        }
                        kept
                    })
                    .into_iter()
                    .collect::<PathBuf>();
                if !outside.starts_with(root()) {
                    broken.push(format!(
                        "{name}:{}: `{path}` is outside the repository",
                        n + 1
                    ));
                }
            }
        }
        for link in links(&text) {
            let at = format!("{name}:{}: `{}`", link.line, link.target);
            let target = link.target.as_str();
            if target.is_empty() {
                broken.push(format!("{at}: empty link"));
                continue;
            }
            if target.contains(':') || target.starts_with("//") {
                broken.push(format!("{at}: leaves the repository"));
                continue;
            }
            let (path, fragment) = target.split_once('#').unwrap_or((target, ""));
            let resolved = if path.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap().join(path)
            };
            let Ok(canonical) = resolved.canonicalize() else {
                broken.push(format!("{at}: no such file"));
                continue;
            };
            if !canonical.starts_with(root().canonicalize().unwrap()) {
                broken.push(format!("{at}: leaves the repository"));
                continue;
            }
            if !fragment.is_empty() {
                let is_markdown = canonical.extension().is_some_and(|e| e == "md");
                let page = std::fs::read_to_string(&canonical).unwrap_or_default();
                if !is_markdown || !anchors(&page).contains(fragment) {
                    broken.push(format!("{at}: no heading #{fragment} there"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_link_reader_finds_what_it_must() {
    let text = "see [a](docs/a.md#x) and ![p](p.png)\n`[not](code)`\n```\n[no](fence)\n```\n\
                [ref]: other.md\n<https://example.org>\n";
    let targets: Vec<String> = links(text).into_iter().map(|l| l.target).collect();
    assert_eq!(
        targets,
        ["docs/a.md#x", "p.png", "other.md", "https://example.org"]
    );
    assert_eq!(
        parent_paths("see `../shared/x.py` and [a](../ARCHITECTURE.md#b), ../../y"),
        ["../shared/x.py", "../ARCHITECTURE.md", "../../y"]
    );
    let headings = anchors("# A b\n## A b\n```\n# not\n```\n### `birdtrain eval`: Options\n");
    let expected: HashSet<String> = ["a-b", "a-b-1", "birdtrain-eval-options"]
        .map(String::from)
        .into();
    assert_eq!(headings, expected);
}
