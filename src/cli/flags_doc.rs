//! `docs/flags.md`, rendered from the clap tree: every command's arguments with their value,
//! default, help text and help heading. `tests/docs.rs` compares the file with
//! [`flags_markdown`], so the page cannot drift from what `--help` prints.

use clap::{Arg, Command, CommandFactory};

use super::Cli;

/// The environment variable that makes `tests/docs.rs` rewrite `docs/flags.md` instead of
/// failing when it is out of date.
pub const UPDATE_DOCS_VAR: &str = "BIRDTRAIN_UPDATE_DOCS";

/// The whole of `docs/flags.md`: an index of the commands, then one section per command (in
/// the order `birdtrain --help` lists them, subcommands of `bench` and `kernels` included)
/// with a table of its arguments per help heading.
pub fn flags_markdown() -> String {
    let root = Cli::command();
    let mut page = String::from("# Flags\n\n");
    page.push_str(
        "Generated from the command-line definitions in `src/cli/` (their doc comments are the \
         `--help` texts): edit those, then run `BIRDTRAIN_UPDATE_DOCS=1 cargo test --test architecture docs::` \
         to rewrite this page; `tests/docs.rs` fails while it is out of date. What the training \
         settings do, in more words: [training.md](training.md).\n\n",
    );
    let commands = leaf_commands(&root);
    for (path, command) in &commands {
        let about = command
            .get_about()
            .map(|a| a.to_string())
            .unwrap_or_default();
        page.push_str(&format!(
            "- [`{path}`](#{}): {}\n",
            anchor(path),
            cell(&about)
        ));
    }
    let train_ids = commands
        .iter()
        .find(|(path, _)| path == "birdtrain train")
        .map(|(_, train)| argument_ids(train));
    if train_ids.as_ref() == Some(&argument_ids(&root)) {
        page.push_str(
            "\nWithout a command, `birdtrain` trains: `birdtrain --data DIR …` is \
             `birdtrain train --data DIR …`.\n",
        );
    } else {
        page.push_str(&command_section("birdtrain", &root));
    }
    for (path, command) in &commands {
        page.push_str(&command_section(path, command));
    }
    page
}

/// Every command that takes arguments, as (`birdtrain sub …`, command), depth first in
/// declaration order; clap's own `help` command is left out.
fn leaf_commands(root: &Command) -> Vec<(String, Command)> {
    fn walk(prefix: &str, command: &Command, found: &mut Vec<(String, Command)>) {
        for sub in command.get_subcommands() {
            if sub.get_name() == "help" || sub.is_hide_set() {
                continue;
            }
            let path = format!("{prefix} {}", sub.get_name());
            if sub.has_subcommands() {
                walk(&path, sub, found);
            } else {
                found.push((path, sub.clone()));
            }
        }
    }
    let mut found = Vec::new();
    walk(root.get_name(), root, &mut found);
    found
}

/// The ids of a command's documented arguments, to tell whether two commands take the same.
fn argument_ids(command: &Command) -> Vec<String> {
    documented(command)
        .map(|a| a.get_id().to_string())
        .collect()
}

/// The arguments a user sees: not hidden, not clap's own help and version flags.
fn documented(command: &Command) -> impl Iterator<Item = &Arg> {
    command
        .get_arguments()
        .filter(|a| !a.is_hide_set() && !matches!(a.get_id().as_str(), "help" | "version"))
}

/// One command's section: its help text, then a table per heading (positional arguments
/// first, then the options without a heading, then each heading in the order it first
/// appears, as `--help` groups them).
fn command_section(path: &str, command: &Command) -> String {
    let mut section = format!("\n## `{path}`\n\n");
    let about = command
        .get_long_about()
        .or(command.get_about())
        .map(|a| a.to_string())
        .unwrap_or_default();
    if !about.is_empty() {
        section.push_str(&format!("{}\n", one_paragraph(&about)));
    }
    let mut groups: Vec<(String, Vec<&Arg>)> = Vec::new();
    for arg in documented(command) {
        let heading = if arg.is_positional() {
            "Arguments".to_string()
        } else {
            arg.get_help_heading().unwrap_or("Options").to_string()
        };
        match groups.iter_mut().find(|(h, _)| *h == heading) {
            Some((_, args)) => args.push(arg),
            None => groups.push((heading, vec![arg])),
        }
    }
    let rank = |heading: &str| match heading {
        "Arguments" => 0,
        "Options" => 1,
        _ => 2,
    };
    groups.sort_by_key(|(heading, _)| rank(heading));
    for (heading, args) in groups {
        section.push_str(&format!("\n### {path}: {heading}\n\n"));
        section.push_str("| flag | value | default | meaning |\n|---|---|---|---|\n");
        for arg in args {
            section.push_str(&argument_row(arg));
        }
    }
    section
}

/// One table row: the flag (or positional name), its value placeholder, clap's default and the
/// help text, with the values clap accepts added.
fn argument_row(arg: &Arg) -> String {
    let takes_values = arg.get_action().takes_values();
    let value_names = || -> Vec<String> {
        match arg.get_value_names() {
            Some(names) => names.iter().map(|n| format!("<{n}>")).collect(),
            None => vec![format!("<{}>", arg.get_id().as_str().to_uppercase())],
        }
    };
    let many = arg
        .get_num_args()
        .is_some_and(|range| range.max_values() > 1);
    let flag = if arg.is_positional() {
        format!(
            "`{}{}`",
            value_names().join(" "),
            if many { "..." } else { "" }
        )
    } else {
        let mut names = Vec::new();
        if let Some(short) = arg.get_short() {
            names.push(format!("`-{short}`"));
        }
        if let Some(long) = arg.get_long() {
            names.push(format!("`--{long}`"));
        }
        for alias in arg.get_visible_aliases().unwrap_or_default() {
            names.push(format!("`--{alias}`"));
        }
        names.join(", ")
    };
    let value = if takes_values && !arg.is_positional() {
        let dots = if many { "..." } else { "" };
        format!("`{}{dots}`", value_names().join(" "))
    } else {
        String::new()
    };
    let defaults: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    let default = if defaults.is_empty() {
        String::new()
    } else {
        format!("`{}`", defaults.join(" "))
    };
    let mut meaning = arg
        .get_long_help()
        .or(arg.get_help())
        .map(|h| one_paragraph(&h.to_string()))
        .unwrap_or_default();
    if takes_values {
        let choices: Vec<String> = arg
            .get_possible_values()
            .iter()
            .filter(|v| !v.is_hide_set())
            .map(|v| format!("`{}`", v.get_name()))
            .collect();
        if !choices.is_empty() {
            meaning.push_str(&format!(" Values: {}.", choices.join(", ")));
        }
    }
    format!(
        "| {} | {} | {} | {} |\n",
        cell(&flag),
        cell(&value),
        cell(&default),
        cell(meaning.trim())
    )
}

/// A help text's paragraphs and lines joined into one line.
fn one_paragraph(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Text made safe for a table cell: `|` escaped everywhere (GitHub splits cells before it reads
/// code spans), and outside code spans `<` escaped, so `<class>` is not taken for HTML.
fn cell(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_code = false;
    for c in one_paragraph(text).chars() {
        match c {
            '`' => in_code = !in_code,
            '|' => out.push('\\'),
            '<' if !in_code => out.push('\\'),
            _ => {}
        }
        out.push(c);
    }
    out
}

/// GitHub's anchor for a heading: lower case, spaces to `-`, punctuation other than `-` and `_`
/// dropped.
pub fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_escape_pipes_everywhere_and_angle_brackets_outside_code() {
        assert_eq!(
            cell("a|b <class> `x|<y>`\n  z"),
            r"a\|b \<class> `x\|<y>` z"
        );
    }

    #[test]
    fn anchors_follow_github() {
        assert_eq!(anchor("`birdtrain bench step`"), "birdtrain-bench-step");
        assert_eq!(anchor("What survives what"), "what-survives-what");
        assert_eq!(
            anchor("birdtrain train: Options"),
            "birdtrain-train-options"
        );
    }
}
