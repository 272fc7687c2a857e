//! Panics a caller expects and handles: a third-party call that panics instead of returning
//! an error (the CUDA driver probe on a machine whose driver library lacks a symbol). The
//! binary's panic hook stays silent for them; every other panic is reported as a bug.

use std::cell::Cell;
use std::panic::UnwindSafe;

thread_local! {
    static EXPECTING: Cell<u32> = const { Cell::new(0) };
}

/// Runs `f`, catching a panic as `Err` without the hook's bug report.
pub fn catch_expected<R>(f: impl FnOnce() -> R + UnwindSafe) -> std::thread::Result<R> {
    EXPECTING.with(|n| n.set(n.get() + 1));
    let result = std::panic::catch_unwind(f);
    EXPECTING.with(|n| n.set(n.get() - 1));
    result
}

/// Whether this thread is inside [`catch_expected`].
pub fn expected() -> bool {
    EXPECTING.with(|n| n.get() > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_panics_inside_catch_expected_are_expected() {
        assert!(!expected());
        let seen = catch_expected(expected).unwrap();
        assert!(seen);
        let caught = catch_expected(|| -> u32 { panic!("a probe failed") });
        assert!(caught.is_err());
        assert!(!expected(), "the count is restored after a panic");
    }
}
