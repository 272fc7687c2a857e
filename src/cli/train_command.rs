//! `birdtrain [train] --data DIR …`: the training command, from its flags to the exit code.
//! It asks the launcher for the plan (or prints it with `--dry-run`), builds the
//! configuration and trains.

use std::process::ExitCode;

use super::stop_signals::install_stop_signals;
use super::train_args::TrainArgs;
use super::train_config::config_for;
use super::CliError;
use super::{dry_run, launcher};
use crate::dist::launch;
use crate::train;

/// Runs the training command. Ctrl-C or SIGTERM finishes the current step, saves a checkpoint
/// and exits with 128 + the signal's number (130 after Ctrl-C, 143 after SIGTERM).
pub fn run(args: TrainArgs) -> Result<ExitCode, CliError> {
    if args.dry_run {
        return dry_run::run(args);
    }
    let plan = launcher::plan(&args, &launch::process_env, &launch::probe_gpus())?;
    let (args, restart) = launcher::resume_restarted(args, &plan)?;
    let (cfg, note) = config_for(&args, &plan)?;
    for note in plan.overrides.iter().chain(&restart).chain(&note) {
        outln!("{note}");
    }
    let stop = install_stop_signals("saving a checkpoint")?;
    let outcome = train::train(&cfg, &stop.flag)?;
    match stop.signal() {
        Some(signal) if outcome.interrupted => Ok(ExitCode::from(128 + signal as u8)),
        _ => Ok(ExitCode::SUCCESS),
    }
}
