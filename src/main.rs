//! The `birdtrain` binary: see `birdtrain --help` and [`birdtrain::cli`].

use std::process::ExitCode;

/// An allocation that fails ends the process with one error line, not an abort.
#[global_allocator]
static ALLOCATOR: birdtrain::oom::ExitOnOom = birdtrain::oom::ExitOnOom;

fn main() -> ExitCode {
    birdtrain::cli::panic_hook::install();
    // The hook has printed the one-line report; 101 is Rust's exit code for a panic.
    std::panic::catch_unwind(|| birdtrain::cli::main_with_args(std::env::args_os()))
        .unwrap_or(ExitCode::from(101))
}
