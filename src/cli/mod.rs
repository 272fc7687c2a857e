//! The `birdtrain` command line: the clap tree and one `run` per command.
//!
//! Training is the default command (`birdtrain --data DIR …` ≡ `birdtrain train --data DIR …`).
//! Every failure ends in one line on stderr (`error: …`) and a non-zero exit code: 2 for a
//! usage error (an unparsable flag, or a value, launch flag or launcher variable that the CLI,
//! the training settings or the launch refuse: [`CliError::exit_code`]), 1 for everything
//! else, 130 and 143 after Ctrl-C and SIGTERM (once the checkpoint is saved), 101 after a
//! panic (a bug, reported as one line by [`panic_hook`]).
//!
//! The flags' doc comments are their `--help` texts, where `<class>` and `<n>` are
//! placeholders, not HTML.
#![allow(rustdoc::invalid_html_tags)]

/// `print!` that a closed stdout cannot crash (see [`output`]).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::output::write(format_args!($($arg)*))
    };
}

/// `println!` that a closed stdout cannot crash (see [`output`]).
macro_rules! outln {
    () => {
        $crate::cli::output::write(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::cli::output::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub mod augment_args;
pub mod bench_pipeline;
pub mod bench_plan;
pub mod bench_scaling;
pub mod bench_step;
pub mod choice;
pub mod compare;
mod counts;
pub mod demo;
mod dry_run;
mod elastic;
pub mod env;
mod error;
pub mod eval;
pub mod flags_doc;
pub mod kernels;
pub mod kernels_report;
mod launcher;
pub mod lr_find;
mod output;
pub mod panic_hook;
mod paths;
pub mod predict;
pub mod settings_args;
mod sidecar;
mod stop_signals;
pub mod synth;
pub mod train_args;
pub mod train_command;
pub mod train_config;

use std::ffi::OsString;
use std::io::Write as _;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub use error::CliError;
pub use train_args::TrainArgs;

/// `birdtrain`: train ResNet image classifiers on an image folder.
#[derive(Debug, Parser)]
#[command(
    name = "birdtrain",
    version,
    about = "Train ResNet image classifiers on an image folder (train/valid/test/<class>/…)",
    long_about = None,
    args_conflicts_with_subcommands = true,
    after_help = "Start with `birdtrain demo`; train with `birdtrain --data ./285birds --gpus 4`."
)]
pub struct Cli {
    /// A command; without one, birdtrain trains (the flags below).
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Training flags (the default command).
    #[command(flatten)]
    pub train: Box<TrainArgs>,
}

/// The commands of `birdtrain`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a model (the default command).
    Train(Box<TrainArgs>),
    /// Learning-rate range test: the run's training steps with the rate raised geometrically
    /// until the loss diverges; suggests --lr and draws the curve.
    LrFind(Box<lr_find::LrFindArgs>),
    /// Evaluate a checkpoint on a split: loss, top-1, top-5 and per-class accuracy.
    Eval(eval::EvalArgs),
    /// Classify images with a checkpoint: top-k classes with probabilities.
    Predict(predict::PredictArgs),
    /// Generate a small synthetic dataset and train on it (the first thing to try).
    Demo(demo::DemoArgs),
    /// Write a synthetic dataset in the 285-birds layout.
    Synth(synth::SynthArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// CUDA kernel tools.
    #[command(subcommand)]
    Kernels(KernelsCommand),
    /// What birdtrain finds on this machine: CPU, CUDA driver and GPUs, NVRTC, headers, NCCL.
    Env(env::EnvArgs),
    /// Runs side by side: accuracy, training time, speed-up, scaling efficiency, price to train.
    Compare(compare::CompareArgs),
}

/// `birdtrain bench …`
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Run the input engine alone and print images/s per epoch.
    Pipeline(bench_pipeline::BenchPipelineArgs),
    /// Time training steps on the chosen device.
    Step(bench_step::BenchStepArgs),
    /// Measure data-parallel scaling over GPU counts.
    Scaling(bench_scaling::BenchScalingArgs),
}

/// `birdtrain kernels …`
#[derive(Debug, Subcommand)]
pub enum KernelsCommand {
    /// Compile every CUDA kernel with NVRTC for the given architectures.
    Check(kernels::KernelsArgs),
    /// Registers, spills, shared memory, occupancy and the main loops' instruction mix of the
    /// convolution kernels, v1 and v2 side by side (needs nvdisasm and cuobjdump).
    Report(kernels_report::ReportArgs),
}

/// Parses `args` (the program name first) and runs the command; prints errors as one line.
pub fn main_with_args<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            // Not eprintln!: a closed stderr (`2>&1 | head -1`) must not turn this into a panic.
            let _ = writeln!(
                std::io::stderr(),
                "error: {}",
                panic_hook::one_line(&e.to_string())
            );
            ExitCode::from(e.exit_code())
        }
    }
}

/// Runs a parsed command line. `Ok` carries the exit code (130 after Ctrl-C).
pub fn run(cli: Cli) -> Result<ExitCode, CliError> {
    init_tracing();
    panic_hook::inject_if_asked();
    // The training commands go on when nobody reads their output (their progress is in the
    // run folder too); the others stop quietly.
    if matches!(
        cli.command,
        None | Some(Command::Train(_) | Command::LrFind(_) | Command::Demo(_))
    ) {
        output::keep_running_when_closed();
    }
    match cli.command {
        None => train_command::run(*cli.train),
        Some(Command::Train(args)) => train_command::run(*args),
        Some(Command::LrFind(args)) => lr_find::run(*args),
        Some(Command::Eval(args)) => eval::run(args).map(|()| ExitCode::SUCCESS),
        Some(Command::Predict(args)) => predict::run(args).map(|()| ExitCode::SUCCESS),
        Some(Command::Demo(args)) => demo::run(args),
        Some(Command::Synth(args)) => synth::run(args).map(|()| ExitCode::SUCCESS),
        Some(Command::Bench(BenchCommand::Pipeline(args))) => {
            bench_pipeline::run(args).map(|()| ExitCode::SUCCESS)
        }
        Some(Command::Bench(BenchCommand::Step(args))) => bench_step::run(args)
            .map(|()| ExitCode::SUCCESS)
            .map_err(CliError::from_anyhow),
        Some(Command::Bench(BenchCommand::Scaling(args))) => bench_scaling::run(args)
            .map(|()| ExitCode::SUCCESS)
            .map_err(CliError::from_anyhow),
        Some(Command::Kernels(KernelsCommand::Check(args))) => kernels::run(args)
            .map(|()| ExitCode::SUCCESS)
            .map_err(CliError::Other),
        Some(Command::Kernels(KernelsCommand::Report(args))) => kernels_report::run(args)
            .map(|()| ExitCode::SUCCESS)
            .map_err(CliError::Other),
        Some(Command::Compare(args)) => compare::run(args).map(|()| ExitCode::SUCCESS),
        Some(Command::Env(args)) => env::run(args)
            .map(|()| ExitCode::SUCCESS)
            .map_err(CliError::Other),
    }
}

/// Clap's usage errors as one line: the message, what it lists (the missing arguments…) and
/// its tips, without the usage block (help and version print in full).
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            ExitCode::SUCCESS
        }
        _ => {
            let line = compact_usage_error(&e.render().to_string());
            let _ = writeln!(std::io::stderr(), "{line}");
            ExitCode::from(2)
        }
    }
}

/// One line from clap's rendered error: its first line, the lines it lists under it (the
/// missing arguments), its `tip:` lines as one hint, and a pointer to `--help`; the usage
/// block and the "For more information" line are left out.
fn compact_usage_error(text: &str) -> String {
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let mut head = lines
        .next()
        .unwrap_or("error: bad command line")
        .to_string();
    let (mut listed, mut tips) = (Vec::new(), Vec::new());
    for line in lines {
        if line.starts_with("Usage:") || line.starts_with("For more information") {
            break;
        }
        match line.strip_prefix("tip:") {
            Some(tip) => tips.push(tip.trim()),
            None => listed.push(line),
        }
    }
    if !listed.is_empty() {
        let sep = if head.ends_with(':') { " " } else { ": " };
        head = format!("{head}{sep}{}", listed.join(", "));
    }
    tips.push("see birdtrain --help");
    format!("{head} (hint: {})", tips.join("; "))
}

/// Warnings (e.g. skipped bad images) go to stderr; `RUST_LOG` overrides the level. They are
/// coloured only when stderr is a terminal and `NO_COLOR` is unset (or empty), so logs and
/// pipes get plain text.
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let colour = use_colour(
        std::io::IsTerminal::is_terminal(&std::io::stderr()),
        std::env::var_os("NO_COLOR").as_deref(),
    );
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .with_target(false)
        .without_time()
        .try_init();
}

/// Whether stderr gets ANSI colours: a terminal, and no `NO_COLOR` (no-color.org: set and
/// not empty turns them off).
fn use_colour(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::RunSettings;
    use clap::CommandFactory;

    #[test]
    fn clap_tree_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn training_is_the_default_command() {
        let cli = Cli::try_parse_from(["birdtrain", "--data", "d", "--epochs", "3"]).unwrap();
        assert!(cli.command.is_none());
        assert_eq!(cli.train.epochs, Some(3));
        let cli = Cli::try_parse_from(["birdtrain", "train", "--data", "d"]).unwrap();
        assert!(matches!(cli.command, Some(Command::Train(_))));
    }

    #[test]
    fn nesterov_is_a_switch_or_takes_a_value() {
        let parse = |extra: &[&str]| {
            let mut args = vec!["birdtrain", "--data", "d"];
            args.extend_from_slice(extra);
            Cli::try_parse_from(args).unwrap().train.recipe.nesterov
        };
        assert_eq!(parse(&[]), None);
        assert_eq!(parse(&["--nesterov"]), Some(true));
        assert_eq!(parse(&["--nesterov", "false"]), Some(false));
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        use std::ffi::OsStr;
        assert!(use_colour(true, None));
        assert!(use_colour(true, Some(OsStr::new(""))));
        assert!(!use_colour(true, Some(OsStr::new("1"))));
        assert!(!use_colour(false, None));
    }

    #[test]
    fn usage_errors_keep_what_is_missing_and_the_tips() {
        let err = |args: &[&str]| {
            let e = Cli::try_parse_from(args).unwrap_err();
            compact_usage_error(&e.render().to_string())
        };
        let line = err(&["birdtrain", "predict", "--checkpoint", "runs/r1"]);
        assert!(
            line.starts_with("error: the following required arguments were not provided: ")
                && line.contains("<IMAGE>"),
            "{line}"
        );
        let line = err(&["birdtrain", "--data", "d", "--epoch", "2"]);
        assert!(
            line.contains("'--epoch'") && line.contains("'--epochs'") && line.contains("hint"),
            "{line}"
        );
        for line in [line, err(&["birdtrain", "evl"])] {
            assert!(!line.contains('\n') && !line.contains("Usage"), "{line}");
            assert!(line.ends_with("see birdtrain --help)"), "{line}");
        }
    }

    // The recorded settings' flags, parsed through the whole command line.
    #[test]
    fn a_flag_given_overrides_the_checkpoint_and_one_left_out_keeps_it() {
        let cli =
            Cli::try_parse_from(["birdtrain", "--lr", "0.1", "--color-jitter", "0.4"]).unwrap();
        let mut resumed = RunSettings {
            lr: 0.5,
            momentum: 0.8,
            ..RunSettings::default()
        };
        cli.train.recipe.apply(&mut resumed);
        cli.train.augment.engine.apply(&mut resumed);
        assert_eq!(
            (resumed.lr, resumed.momentum, resumed.color_jitter),
            (0.1, 0.8, 0.4)
        );
    }

    #[test]
    fn every_training_flag_has_a_heading_and_a_row_prints_its_typed_default() {
        let cli = Cli::command();
        for arg in cli.get_arguments() {
            let id = arg.get_id().as_str();
            if !arg.is_hide_set() && !["help", "version"].contains(&id) {
                assert!(arg.get_help_heading().is_some(), "--{id} has no heading");
            }
        }
        let arg = |id: &str| cli.get_arguments().find(|a| a.get_id() == id).unwrap();
        let help = |id: &str| arg(id).get_help().unwrap().to_string();
        assert_eq!(arg("lr").get_help_heading(), Some("Optimizer"));
        assert!(help("lr").ends_with("[default: 0.8]"), "{}", help("lr"));
        assert!(help("weight_decay").ends_with("[default: 0.0005]"));
        assert!(help("schedule").ends_with("[default: cosine]"));
        assert!(
            !help("store_size").contains("[default"),
            "an optional setting"
        );
    }
}
