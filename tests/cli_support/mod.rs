//! Helpers shared by the tests that drive the `birdtrain` binary.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub(crate) mod small_run;

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

/// Runs the binary with its stdout a pipe whose reader is closed at once (`birdtrain … |
/// head -0`): every write to stdout fails with a broken pipe. Fails the test on a panic.
pub(crate) fn birdtrain_closed_stdout(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_birdtrain"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the birdtrain binary runs");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("the birdtrain binary ends");
    assert_no_panic(args, &out);
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

/// A tmpfs mounted at `at` for the life of the value.
pub(crate) struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mounts a tmpfs of `bytes` at `at`; `None` where mounting is not permitted.
    pub(crate) fn mount(at: &Path, bytes: u64) -> Option<Self> {
        std::fs::create_dir_all(at).unwrap();
        let mounted = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={bytes}"),
                "tmpfs",
                s(at),
            ])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|st| st.success());
        if !mounted {
            eprintln!("skipped: cannot mount a tmpfs here (not root?)");
            return None;
        }
        Some(Self(at.to_path_buf()))
    }

    /// Where it is mounted.
    pub(crate) fn path(&self) -> &Path {
        &self.0
    }

    pub(crate) fn remount_read_only(&self) {
        let st = Command::new("mount")
            .args(["-o", "remount,ro", s(&self.0)])
            .status()
            .unwrap();
        assert!(st.success(), "remounting {} read-only", self.0.display());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}
