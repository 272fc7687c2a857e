//! The launch as the training command sees it: the plan of its flags and the launcher's
//! variables ([`crate::dist::launch`]), and what a launcher changes in the run: a torchrun
//! worker restarted after a failure resumes the run in `--out`.

use super::train_args::TrainArgs;
use super::CliError;
use crate::dist::launch::{self, Env, LaunchPlan, VisibleGpus};
use crate::train::folder::RunFolder;
use crate::train::TrainError;

/// The launch plan of the training flags `args`, the environment `env` and the GPUs `visible`.
pub(crate) fn plan(
    args: &TrainArgs,
    env: Env<'_>,
    visible: &VisibleGpus,
) -> Result<LaunchPlan, CliError> {
    let flags = args
        .dist
        .to_settings()
        .launch_flags(args.gpus.as_deref())
        .map_err(TrainError::from)?;
    Ok(launch::resolve(&flags, env, visible).map_err(TrainError::from)?)
}

/// A torchrun worker restarted after a failure (`TORCHELASTIC_RESTART_COUNT` > 0) runs the
/// same command line again: it resumes the run in `--out` (where the first attempt would
/// refuse an existing run), or starts it afresh when no checkpoint was saved yet. `--overwrite`
/// and `--init-from` belong to the first attempt and are dropped. Returns the arguments to run
/// and the line that says so.
pub(crate) fn resume_restarted(
    mut args: TrainArgs,
    plan: &LaunchPlan,
) -> Result<(TrainArgs, Option<String>), CliError> {
    if plan.restart_count == 0 || args.resume.is_some() {
        return Ok((args, None));
    }
    let Some(out) = args.out.clone() else {
        return Err(CliError::Missing {
            flag: "--out RUN",
            hint: "TORCHELASTIC_RESTART_COUNT > 0: a restarted torchrun worker resumes the run in --out, and without it each attempt would start a new run folder",
        });
    };
    let attempt = format!("TORCHELASTIC_RESTART_COUNT={}", plan.restart_count);
    if !RunFolder::new(&out).has_checkpoint() {
        let line = format!(
            "{attempt}: no checkpoint in {} yet, starting the run again",
            out.display()
        );
        return Ok((args, Some(line)));
    }
    let mut dropped = Vec::new();
    if std::mem::take(&mut args.overwrite) {
        dropped.push("--overwrite");
    }
    if args.init_from.take().is_some() {
        dropped.push("--init-from");
    }
    let mut line = format!("{attempt}: resuming the run in {}", out.display());
    if !dropped.is_empty() {
        line.push_str(&format!(
            " ({} applied to the first attempt only)",
            dropped.join(" and ")
        ));
    }
    args.resume = Some(out);
    Ok((args, Some(line)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn restarted(count: u64) -> LaunchPlan {
        LaunchPlan {
            restart_count: count,
            ..LaunchPlan::single_node(vec![0])
        }
    }

    fn args(out: Option<PathBuf>) -> TrainArgs {
        TrainArgs {
            out,
            overwrite: true,
            init_from: Some(PathBuf::from("w.safetensors")),
            ..TrainArgs::default()
        }
    }

    #[test]
    fn a_restarted_worker_resumes_the_run_in_out() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("run");
        std::fs::create_dir_all(&out).unwrap();
        // The first attempt keeps its flags.
        let (same, line) = resume_restarted(args(Some(out.clone())), &restarted(0)).unwrap();
        assert!(line.is_none() && same.resume.is_none() && same.overwrite);
        // Killed before its first checkpoint: it starts again, as it was asked.
        let (again, line) = resume_restarted(args(Some(out.clone())), &restarted(1)).unwrap();
        assert!(again.resume.is_none() && again.overwrite);
        assert!(line.unwrap().contains("no checkpoint"));
        std::fs::write(out.join("checkpoint.json"), "{}").unwrap();
        let (resumed, line) = resume_restarted(args(Some(out.clone())), &restarted(2)).unwrap();
        assert_eq!(resumed.resume.as_deref(), Some(out.as_path()));
        assert!(!resumed.overwrite && resumed.init_from.is_none());
        let line = line.unwrap();
        assert!(
            line.starts_with("TORCHELASTIC_RESTART_COUNT=2: resuming the run in")
                && line.contains("--overwrite and --init-from applied to the first attempt only"),
            "{line}"
        );
        // An explicit --resume is the user's.
        let mut own = args(Some(out.clone()));
        own.resume = Some(PathBuf::from("elsewhere"));
        let (own, line) = resume_restarted(own, &restarted(1)).unwrap();
        assert_eq!(own.resume, Some(PathBuf::from("elsewhere")));
        assert!(line.is_none());
    }

    #[test]
    fn a_restarted_worker_without_out_is_refused() {
        let e = resume_restarted(args(None), &restarted(1)).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("--out") && text.contains("TORCHELASTIC_RESTART_COUNT"),
            "{text}"
        );
        assert_eq!(e.exit_code(), 2);
    }
}
