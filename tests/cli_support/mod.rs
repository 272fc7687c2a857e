//! Helpers shared by the tests that drive the `birdtrain` binary.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

/// Runs the binary and returns its output, whatever the exit status; a panic of the binary
/// (its one-line bug report, or Rust's own message) fails the test whatever it expected.
pub(crate) fn birdtrain_output(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_birdtrain"))
        .args(args)
        .output()
        .expect("the birdtrain binary runs");
    assert_no_panic(args, &out);
    out
}

/// Fails when the binary's stderr shows a panic: every panic is a bug.
pub(crate) fn assert_no_panic(args: &[&str], out: &Output) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("panicked") && out.status.code() != Some(101),
        "birdtrain {args:?} panicked:\n{stderr}"
    );
}

/// Runs the binary and asserts it succeeded (its stdout and stderr are shown if not).
pub(crate) fn birdtrain(args: &[&str]) -> Output {
    let out = birdtrain_output(args);
    assert!(
        out.status.success(),
        "birdtrain {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A temp path as `&str` for the command line.
pub(crate) fn s(p: &Path) -> &str {
    p.to_str().expect("temp paths are UTF-8")
}

/// Asserts a failure with exactly one non-empty stderr line containing every `needle`.
pub(crate) fn assert_one_line_error(out: &Output, needles: &[&str]) -> String {
    assert!(!out.status.success(), "expected a failure, got success");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one line, got:\n{stderr}");
    assert!(lines[0].starts_with("error"), "{stderr}");
    for needle in needles {
        assert!(
            lines[0].to_lowercase().contains(&needle.to_lowercase()),
            "`{needle}` missing from: {stderr}"
        );
    }
    stderr
}
