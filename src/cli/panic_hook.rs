//! A panic anywhere in the binary is a bug: it is reported as one line saying so, where it
//! happened and where to report it, and the process exits with 101 (see `main.rs`), instead
//! of Rust's multi-line message with a backtrace hint.
//!
//! `BIRDTRAIN_FAULT=panic` makes a command panic on purpose right after its flags are
//! parsed, so the tests can check this path of the real binary.

use std::panic::PanicHookInfo;

/// Every panic line contains this, so tests (and `scripts/test.sh`) can look for it.
pub const BUG_MARKER: &str = "this is a bug in birdtrain";

/// The value of `BIRDTRAIN_FAULT` that injects a panic.
pub const PANIC_FAULT: &str = "panic";

/// Installs the one-line panic report for this process (the binary calls it first thing).
pub fn install() {
    std::panic::set_hook(Box::new(|info| {
        // A panic its caller expects and handles (see `crate::panics`) is not a bug.
        if !crate::panics::expected() {
            eprintln!("{}", report(info));
        }
    }));
}

fn report(info: &PanicHookInfo<'_>) -> String {
    let message = info
        .payload()
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| info.payload().downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into());
    let place = info.location().map_or("an unknown place".into(), |l| {
        format!("{}:{}", l.file(), l.line())
    });
    let thread = std::thread::current();
    let thread = thread.name().unwrap_or("unnamed");
    let report_to = match option_env!("CARGO_PKG_REPOSITORY") {
        Some(repo) if !repo.is_empty() => format!("{repo}/issues"),
        _ => "the birdtrain issue tracker".into(),
    };
    format!(
        "error: birdtrain panicked at {place} (thread {thread}): {}; {BUG_MARKER}, please \
         report it to {report_to} with this line, the command you ran and `birdtrain --version`",
        one_line(&message)
    )
}

/// Joins a multi-line message into one line.
pub(super) fn one_line(text: &str) -> String {
    text.split('\n')
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Panics when `BIRDTRAIN_FAULT=panic` asks for it (the tests' way to reach the hook).
pub(crate) fn inject_if_asked() {
    if std::env::var(crate::train::fault::FAULT_ENV).as_deref() == Ok(PANIC_FAULT) {
        panic!(
            "injected by {}={PANIC_FAULT}",
            crate::train::fault::FAULT_ENV
        );
    }
}

#[cfg(test)]
mod tests {
    use super::one_line;

    #[test]
    fn one_line_joins() {
        assert_eq!(one_line("a\n  b\n\nc"), "a b c");
    }
}
