//! `birdtrain compare RUN [RUN…] [--json]`: runs side by side, as the table the multi-GPU
//! articles end on: model, devices × ranks, global batch, best and final validation accuracy,
//! training time, images/s, speed-up and scaling efficiency against the first run, and the
//! price to train. Each figure is read from what the run folder records
//! ([`crate::train::folder::RunFigures`]).
//!
//! Speed-up is the ratio of training images per second (this run's over the first run's),
//! not of times: runs of other epoch counts still compare. Efficiency is the speed-up over
//! the ratio of devices (GPUs, or machines on the CPU).

use std::path::PathBuf;

use clap::Args;
use serde_json::json;

use super::CliError;
use crate::train::folder::machine_time::money;
use crate::train::folder::RunFigures;
use crate::train::TrainError;

/// Compare finished runs: accuracy, time, speed-up, scaling efficiency and price to train.
#[derive(Debug, Clone, Args)]
pub struct CompareArgs {
    /// Run folders (the first is the baseline of speed-up and efficiency).
    #[arg(value_name = "RUN", required = true)]
    pub runs: Vec<PathBuf>,
    /// Print JSON Lines, one object per run, every field present (null when unknown).
    #[arg(long)]
    pub json: bool,
}

/// One row: a run's figures with its speed-up and efficiency against the first run.
struct Row {
    run: PathBuf,
    figures: RunFigures,
    speedup: Option<f64>,
    efficiency: Option<f64>,
}

/// Prints the comparison of `args.runs` (a folder that holds no run is refused, naming it).
pub fn run(args: CompareArgs) -> Result<(), CliError> {
    let mut figures = Vec::with_capacity(args.runs.len());
    for run in &args.runs {
        figures.push(RunFigures::read(run).map_err(TrainError::from)?);
    }
    let rows = rows(&args.runs, figures);
    if args.json {
        for row in &rows {
            outln!("{}", json_line(row));
        }
    } else {
        print_table(&rows);
    }
    Ok(())
}

/// Each run's row, the first run the baseline (its speed-up and efficiency are 1).
fn rows(runs: &[PathBuf], figures: Vec<RunFigures>) -> Vec<Row> {
    let base = figures.first().cloned();
    runs.iter()
        .zip(figures)
        .enumerate()
        .map(|(i, (run, figures))| {
            let base = base.as_ref().expect("one run at least");
            let speedup = match (figures.images_per_sec, base.images_per_sec) {
                (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                _ => None,
            };
            let devices = match (figures.devices, base.devices) {
                (Some(a), Some(b)) if b > 0 => Some(a as f64 / b as f64),
                _ => None,
            };
            let efficiency = speedup.zip(devices).map(|(s, d)| s / d);
            // The baseline is 1 by definition, also where its figures are unknown.
            let (speedup, efficiency) = match i {
                0 => (Some(1.0), Some(1.0)),
                _ => (speedup, efficiency),
            };
            Row {
                run: run.clone(),
                figures,
                speedup,
                efficiency,
            }
        })
        .collect()
}

fn json_line(row: &Row) -> String {
    let f = &row.figures;
    json!({
        "run": row.run.display().to_string(),
        "model": f.model,
        "devices": f.devices,
        "ranks": f.ranks,
        "global_batch": f.global_batch,
        "best_accuracy": f.best_accuracy,
        "final_accuracy": f.final_accuracy,
        "seconds": f.seconds,
        "images_per_sec": f.images_per_sec,
        "speedup": row.speedup,
        "efficiency": row.efficiency,
        "cost": f.cost,
    })
    .to_string()
}

fn print_table(rows: &[Row]) {
    let cell = |x: Option<f64>, p: usize| x.map_or("-".to_string(), |x| format!("{x:.p$}"));
    let header = [
        "run",
        "model",
        "devices × ranks",
        "global batch",
        "best acc",
        "final acc",
        "seconds",
        "images/s",
        "speed-up",
        "efficiency",
        "cost",
    ];
    let body: Vec<[String; 11]> = rows
        .iter()
        .map(|row| {
            let f = &row.figures;
            [
                row.run.display().to_string(),
                f.model.clone(),
                format!(
                    "{} × {}",
                    f.devices.map_or("-".into(), |d| d.to_string()),
                    f.ranks
                ),
                f.global_batch.to_string(),
                cell(f.best_accuracy, 4),
                cell(f.final_accuracy, 4),
                cell(f.seconds, 1),
                cell(f.images_per_sec, 1),
                cell(row.speedup, 2),
                cell(row.efficiency, 2),
                f.cost.map_or("-".into(), money),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            body.iter()
                .map(|r| r[i].chars().count())
                .chain([header[i].chars().count()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: Vec<&str>| {
        cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, &w))| match i {
                0 | 1 => format!("{c:<w$}"),
                _ => format!("{c:>w$}"),
            })
            .collect::<Vec<_>>()
            .join("  ")
    };
    outln!("{}", line(header.to_vec()));
    for r in &body {
        outln!("{}", line(r.iter().map(String::as_str).collect()));
    }
}
