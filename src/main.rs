//! The `birdtrain` binary: see `birdtrain --help` and [`birdtrain::cli`].

fn main() -> std::process::ExitCode {
    birdtrain::cli::main_with_args(std::env::args_os())
}
