//! `birdtrain lr-find [training flags] [--start-lr A] [--end-lr B] [--num-steps N]`: the
//! learning-rate range test ([`crate::train::lr_find`]) on the run the flags describe.

use std::path::Path;
use std::process::ExitCode;

use clap::Args;

use super::stop_signals::install_stop_signals;
use super::train_args::TrainArgs;
use super::train_config::{next_run_dir, to_config};
use super::CliError;
use crate::train::folder::files::write_atomic;
use crate::train::folder::report::write_lr_plot;
use crate::train::lr_find::{LrPoint, LrRange, LrTrace};
use crate::train::{self, TrainError};

/// File of the sweep's points inside the output folder.
pub const POINTS_FILE: &str = crate::train::folder::LR_FIND_FILE;
/// File of the sweep's picture inside the output folder.
pub const PLOT_FILE: &str = crate::train::folder::LR_FIND_PLOT_FILE;

/// Flags of `birdtrain lr-find`: the training flags (model, data, batch, optimizer,
/// augmentation, devices…), and the sweep's.
#[derive(Debug, Clone, Args)]
pub struct LrFindArgs {
    /// The run to test (its --epochs, checkpoint and validation flags do not apply).
    #[command(flatten)]
    pub train: TrainArgs,
    /// The first step's learning rate, in --lr's units (for a global batch of 256)
    #[arg(long, value_name = "LR", default_value_t = 1e-6)]
    pub start_lr: f32,
    /// The last step's learning rate, in --lr's units
    #[arg(long, value_name = "LR", default_value_t = 10.0)]
    pub end_lr: f32,
    /// Optimizer steps of the sweep (it stops sooner once the loss diverges)
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub num_steps: u64,
}

/// Runs the sweep, writes its points and picture, prints the suggestion.
pub fn run(args: LrFindArgs) -> Result<ExitCode, CliError> {
    if let Some(run) = &args.train.resume {
        return Err(CliError::BadValue {
            flag: "--resume",
            value: run.display().to_string(),
            hint: "lr-find starts from the model's first weights (or --init-from); it does not continue a run".into(),
        });
    }
    if args.train.dry_run {
        return Err(CliError::BadValue {
            flag: "--dry-run",
            value: "true".into(),
            hint: "it checks a training launch: give it to the training command (birdtrain --data … --dry-run)".into(),
        });
    }
    // The sweep's own flags first: a bad one is named as such (not as the --epochs or the
    // --stop-after-steps derived from it), and nothing is printed before every value is checked.
    let range = LrRange {
        start: args.start_lr,
        end: args.end_lr,
        steps: args.num_steps,
    };
    range.validate()?;
    let (mut cfg, note) = to_config(&args.train)?;
    if args.train.out.is_none() {
        cfg.out = next_run_dir(Path::new("runs"), &format!("lr-find-{}", cfg.arch.name()));
        super::paths::check_train_paths(&cfg)?;
    }
    refuse_training_run(&cfg.out)?;
    cfg.lr_range = Some(range);
    cfg.stop_after_steps = Some(range.steps);
    // Every epoch has a step at least, so the sweep never runs out of epochs.
    cfg.epochs = range.steps;
    // Nothing is validated or saved: the flags about either have nothing to act on.
    (cfg.model_ema, cfg.save_every, cfg.early_stop) = (None, 0, 0);
    cfg.set_best_rule(crate::train::BestRule::default());
    cfg.validate()?;
    if let Some(note) = note {
        outln!("{note}");
    }
    outln!(
        "lr-find: {} steps, lr {:e} to {:e} in --lr's units (for a global batch of 256), each step's training loss recorded",
        range.steps, range.start, range.end
    );
    let stop = install_stop_signals("writing the sweep so far")?;
    let outcome = train::train(&cfg, &stop.flag)?;
    // Every node holds the same sweep; node 0 writes and reports it.
    if outcome.writer {
        let trace = outcome.lr_sweep.unwrap_or_default();
        let suggestion = LrTrace::suggestion(&trace.points);
        write_results(&cfg.out, &trace.points, suggestion)?;
        let interrupted = stop.signal().is_some() && trace.diverged.is_none();
        out!(
            "{}",
            report(&trace, suggestion, range, &cfg.out, interrupted)
        );
    }
    match stop.signal() {
        Some(signal) => Ok(ExitCode::from(128 + signal as u8)),
        None => Ok(ExitCode::SUCCESS),
    }
}

/// lr-find never writes into a training run's folder, `--overwrite` or not: a sweep writes
/// two files and no checkpoint, so "replacing" the run would delete its history and best
/// epoch while its checkpoint stayed (a half-deleted run that still resumes). Replacing an
/// earlier sweep is what `--overwrite` is for here.
fn refuse_training_run(out: &Path) -> Result<(), CliError> {
    let folder = crate::train::RunFolder::new(out);
    let mut found: Vec<&str> = [
        crate::train::checkpoint::SIDECAR_FILE,
        crate::train::folder::METRICS_FILE,
    ]
    .into_iter()
    .filter(|f| out.join(f).exists())
    .collect();
    if folder.best_path().exists() {
        found.push("best/");
    }
    if found.is_empty() {
        return Ok(());
    }
    Err(CliError::WouldOverwrite {
        flag: "--out",
        path: out.to_path_buf(),
        clash: format!(
            "holds a training run ({}): lr-find never replaces one, even with --overwrite, since its sweep saves no checkpoint and would leave the run without its history",
            found.join(", ")
        ),
        hint: format!(
            "give lr-find a new --out; to train afresh there, `birdtrain --out {} --overwrite` replaces the run",
            out.display()
        ),
    })
}

/// `lr_find.jsonl` (one point per line) and `lr_find.png`.
fn write_results(
    out: &Path,
    points: &[LrPoint],
    suggestion: Option<LrPoint>,
) -> Result<(), CliError> {
    let mut text = String::new();
    for p in points {
        text += &serde_json::to_string(p).expect("points serialise (plain numbers)");
        text.push('\n');
    }
    write_atomic(&out.join(POINTS_FILE), text.as_bytes()).map_err(TrainError::from)?;
    let curve: Vec<(f64, f64, f64)> = points
        .iter()
        .map(|p| (f64::from(p.lr), p.loss, p.smoothed))
        .collect();
    let marked = suggestion.map(|p| (f64::from(p.lr), p.smoothed));
    write_lr_plot(&out.join(PLOT_FILE), &curve, marked).map_err(TrainError::from)?;
    Ok(())
}

/// What lr-find prints at the end; `interrupted`: Ctrl-C or SIGTERM ended the sweep before
/// its last rate (the suggestion then covers only the rates swept).
pub fn report(
    trace: &LrTrace,
    suggestion: Option<LrPoint>,
    range: LrRange,
    out: &Path,
    interrupted: bool,
) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let points = &trace.points;
    let _ = writeln!(
        s,
        "{} of {} steps recorded{}",
        points.len(),
        range.steps,
        match &trace.diverged {
            Some(why) => format!(" · stopped: {why}"),
            None => String::new(),
        }
    );
    if let (true, Some(last)) = (interrupted, points.last()) {
        let _ = writeln!(
            s,
            "interrupted at lr {:.3e} of the {:.3e} asked for: what follows covers only the rates swept so far",
            last.lr, range.end
        );
    }
    if let Some(low) = points
        .iter()
        .min_by(|a, b| a.smoothed.total_cmp(&b.smoothed))
    {
        let _ = writeln!(
            s,
            "lowest smoothed loss {:.4} at lr {:.3e}",
            low.smoothed, low.lr
        );
    }
    match suggestion {
        Some(p) => {
            let _ = writeln!(
                s,
                "suggested --lr {:.3e}: the smoothed loss falls fastest there (step {}, loss {:.4}); rates a few times lower are the safer choice",
                p.lr, p.step, p.smoothed
            );
        }
        None => {
            let _ = writeln!(s, "no suggestion: {}", LrTrace::no_suggestion(points));
        }
    }
    let _ = writeln!(
        s,
        "{}: {POINTS_FILE} (step, lr, loss, smoothed per line), {PLOT_FILE}",
        out.display()
    );
    s
}
