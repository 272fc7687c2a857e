//! The trainer's error type.

use std::path::PathBuf;

use super::folder::FolderError;
use crate::backend::BackendError;
use crate::dist::collective::CollectiveError;
use crate::dist::launch::LaunchError;
use crate::model::ModelError;
use crate::optim::OptimError;
use pipeline::PipelineError;

/// Everything that can stop a training, evaluation or prediction run. Each variant names the
/// file, flag or value involved and, where it helps, what to do.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A file could not be read or written.
    #[error("cannot {what} {path}: {source}{}", super::folder::io_hint(source))]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What was being done ("write", "read the metrics file", …).
        what: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint does not fit the requested run (another model, class list, image size).
    #[error(
        "checkpoint {path} is for {what} `{found}`, but this run has `{expected}` (hint: {hint})"
    )]
    CheckpointMismatch {
        /// The run folder.
        path: PathBuf,
        /// What differs ("model", "class list", "image size").
        what: &'static str,
        /// The value of this run.
        expected: String,
        /// The value in the checkpoint.
        found: String,
        /// What to do about it.
        hint: &'static str,
    },
    /// `--resume` on training data that changed since the checkpoint.
    #[error("cannot resume {path}: the training data changed since its checkpoint ({change}) (hint: resume on the data it was trained on, or pass --allow-data-change to restart epoch {epoch} on the new data)")]
    DataChanged {
        /// The run folder.
        path: PathBuf,
        /// What changed, in words.
        change: String,
        /// The interrupted epoch, counted from 1.
        epoch: u64,
    },
    /// The loss became NaN or infinite: the run stops without saving the diverged weights.
    #[error("training diverged: the {what} is {loss} at step {step} (epoch {epoch}, learning rate {lr:.6}); {kept} (hint: {hint})")]
    NonFiniteLoss {
        /// "training loss" or "validation loss".
        what: &'static str,
        /// The mean loss (NaN or ±inf).
        loss: f64,
        /// The global step (counted from 1) at which it was seen.
        step: u64,
        /// The epoch, counted from 1.
        epoch: u64,
        /// The learning rate of that step.
        lr: f32,
        /// What the run folder keeps ("the last checkpoint in RUN is kept", or that none
        /// was saved yet).
        kept: String,
        /// What to change: the weight decay where it overturns the weights, else the learning rate.
        hint: String,
    },
    /// The weights or batch-norm statistics overflowed: the run stops before they reach a
    /// checkpoint.
    #[error("training diverged: {tensor} holds NaN or infinite values at step {step} (epoch {epoch}, learning rate {lr:.6}); {kept} (hint: {hint})")]
    NonFiniteWeights {
        /// The first tensor (torchvision name) with a non-finite value.
        tensor: String,
        /// Steps taken.
        step: u64,
        /// The epoch, counted from 1.
        epoch: u64,
        /// The learning rate of the last step.
        lr: f32,
        /// What the run folder keeps (as for [`TrainError::NonFiniteLoss`]).
        kept: String,
        /// What to change: the weight decay where it overturns the weights, else the learning rate.
        hint: String,
    },
    /// `--out` names a folder that holds a run already.
    #[error("{path} holds a run already ({found}) (hint: {}choose another --out, or pass --overwrite to replace it)", resume_hint(.path, *.resumable))]
    RunExists {
        /// The folder.
        path: PathBuf,
        /// What was found there.
        found: String,
        /// Whether `--resume` can continue it (not from `lr-find`, which starts afresh).
        resumable: bool,
    },
    /// An option value that cannot work.
    #[error("invalid value {value} for {flag}: {hint}")]
    InvalidConfig {
        /// The flag (`--epochs`, …).
        flag: &'static str,
        /// The offending value.
        value: String,
        /// What would be valid.
        hint: String,
    },
    /// An image given to `predict` cannot be decoded.
    #[error("cannot classify {path}: {reason} (hint: leave it out, or --on-bad-image skip classifies the others)")]
    BadImage {
        /// The file as the user named it.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A GPU could not be opened.
    #[error("cannot open {device}: {reason} (hint: --gpus 0 trains on the CPU)")]
    Device {
        /// The device ("cuda:0").
        device: String,
        /// The driver's answer.
        reason: String,
    },
    /// The input engine failed.
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    /// A thread (a rank's, a helper's) could not start: a limit on threads or memory.
    #[error(transparent)]
    Thread(#[from] pipeline::threads::ThreadStartError),
    /// The model failed (bad weights file, shape mismatch…).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A backend op failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The optimizer failed (state file from another model…).
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// The run folder could not be read or written.
    #[error(transparent)]
    Folder(#[from] FolderError),
    /// A collective failed: a rank stopped answering, failed, or the group was aborted.
    #[error(transparent)]
    Collective(Box<CollectiveError>),
    /// The launch flags or launcher variables (`--gpus`, `--nodes`, `WORLD_SIZE`, …) do not
    /// describe a run this machine can start; the message names the flag or variable.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// A rank's weights differ from rank 0's: the data-parallel invariant broke.
    #[error(
        "rank {rank}: weights diverged from rank 0 at step {step} (checksum {mine:016x} vs {reference:016x}); \
         hint: a non-deterministic kernel or a missed all-reduce bucket"
    )]
    Diverged {
        /// The rank that noticed.
        rank: usize,
        /// Optimizer step.
        step: u64,
        /// Its checksum.
        mine: u64,
        /// Rank 0's.
        reference: u64,
    },
    /// The `--trace` file could not be written.
    #[error("{0}")]
    Trace(String),
    /// A broken invariant of the trainer itself (a bug), with what was found.
    #[error("internal error (please report): {0}")]
    Internal(String),
    /// One rank of a run of several failed with `source`: the rank and its device put in front
    /// of an error that does not say where it happened (a GPU out of memory, a backend op);
    /// see [`TrainError::on_rank`].
    #[error("rank {rank} ({device}): {source}")]
    OnRank {
        /// The rank that failed.
        rank: usize,
        /// Its device ("cuda:1", "CPU").
        device: String,
        /// Its own error.
        source: Box<TrainError>,
    },
}

/// What to change after a divergence with `weight_decay` and a peak learning rate of
/// `peak_lr`: a weight decay beyond the usual range (above 0.1) that overturns the weights
/// at each step (learning rate × decay ≥ 1) is named as the cause; otherwise the learning
/// rate is (an absurd rate makes any decay overturn them).
pub(crate) fn divergence_hint(weight_decay: f32, peak_lr: f32) -> String {
    let product = weight_decay * peak_lr;
    if weight_decay > 0.1 && product >= 1.0 {
        format!(
            "--weight-decay {} × the learning rate {} = {} ≥ 1: each step would scale the weights by 1 − {}; use a --weight-decay well below {} (usual values: 1e-4 to 5e-2)",
            short(weight_decay),
            short(peak_lr),
            short(product),
            short(product),
            short(1.0 / peak_lr)
        )
    } else {
        "lower --lr, e.g. by 10×, add --warmup-epochs, or start deep models with --zero-init-residual".into()
    }
}

/// A value for a message: as written when of moderate size, else in scientific notation
/// (`1e30`, not thirty-one digits).
fn short(v: f32) -> String {
    if v != 0.0 && (v.abs() >= 1e5 || v.abs() < 1e-4) {
        format!("{v:e}")
    } else {
        format!("{}", (v * 1e4).round() / 1e4)
    }
}

impl TrainError {
    /// This error as rank `rank`'s (on `device`) in a run of several ranks, where the user must
    /// learn which one failed: wrapped in [`TrainError::OnRank`], unless its message names the
    /// rank already ("rank N: …" of the collective, the divergence check and the driver
    /// threads, "NCCL … failed on rank N").
    pub fn on_rank(self, rank: usize, device: impl Into<String>) -> TrainError {
        if names_rank(&self.to_string(), rank) {
            return self;
        }
        TrainError::OnRank {
            rank,
            device: device.into(),
            source: Box::new(self),
        }
    }

    /// The error itself, without the rank a run of several put in front of it (what callers
    /// that tell errors apart by kind, such as the CLI's exit code, look at).
    pub fn unranked(&self) -> &TrainError {
        match self {
            TrainError::OnRank { source, .. } => source.unranked(),
            other => other,
        }
    }

    /// Whether this error only reports that another rank aborted the group (its own error is
    /// the cause worth showing).
    pub fn is_abort_consequence(&self) -> bool {
        fn aborted(e: &(dyn std::error::Error + 'static)) -> bool {
            matches!(
                e.downcast_ref::<CollectiveError>(),
                Some(CollectiveError::Aborted { .. })
            )
        }
        match self {
            TrainError::OnRank { source, .. } => source.is_abort_consequence(),
            TrainError::Collective(e) => matches!(**e, CollectiveError::Aborted { .. }),
            TrainError::Model(ModelError::GradHook { source, .. })
            | TrainError::Model(ModelError::BnSync { source, .. }) => aborted(source.as_ref()),
            _ => false,
        }
    }
}

/// Whether `text` names rank `rank`: "rank 1", or a thread named after it ("rank-1",
/// "gpu-0-rank-1"), but not "rank 12".
fn names_rank(text: &str, rank: usize) -> bool {
    [format!("rank {rank}"), format!("rank-{rank}")]
        .iter()
        .any(|own| {
            text.match_indices(own.as_str()).any(|(at, _)| {
                !text[at + own.len()..]
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_digit())
            })
        })
}

/// The `--resume` part of [`TrainError::RunExists`]'s hint, when the run can be continued.
fn resume_hint(path: &std::path::Path, resumable: bool) -> String {
    if resumable {
        format!("continue it with --resume {}, ", path.display())
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_is_named_once() {
        let bare = TrainError::Internal("out of memory".into());
        let e = bare.on_rank(1, "CPU");
        assert_eq!(
            e.to_string(),
            "rank 1 (CPU): internal error (please report): out of memory"
        );
        // Named already (at the start, or inside), not twice; rank 12 is not rank 1.
        for text in ["rank 1: stuck", "NCCL all-reduce failed on rank 1: 5"] {
            let e = TrainError::Trace(text.into()).on_rank(1, "cuda:1");
            assert_eq!(e.to_string(), text);
        }
        let e = TrainError::Trace("rank 12: stuck".into()).on_rank(1, "cuda:1");
        assert_eq!(e.to_string(), "rank 1 (cuda:1): rank 12: stuck");
        // The kind is still there for those who tell errors apart by it.
        assert!(matches!(e.unranked(), TrainError::Trace(_)));
        // A rank's thread the OS refused is named after the rank: not named again.
        let refused = |thread: &str| {
            TrainError::Thread(pipeline::threads::ThreadStartError {
                thread: thread.into(),
                source: std::io::Error::from(std::io::ErrorKind::WouldBlock),
            })
        };
        for thread in ["rank-1", "gpu-0-rank-1"] {
            let e = refused(thread).on_rank(1, "CPU");
            assert!(matches!(e, TrainError::Thread(_)), "{e}");
            let text = e.to_string();
            assert!(
                text.starts_with(&format!("could not start thread `{thread}`")),
                "{text}"
            );
        }
        // A thread inside the rank (its watchdog) or another rank's name: the rank in front.
        for thread in ["watchdog-1", "rank-12"] {
            let text = refused(thread).on_rank(1, "CPU").to_string();
            assert!(
                text.starts_with(&format!("rank 1 (CPU): could not start thread `{thread}`")),
                "{text}"
            );
        }
    }

    #[test]
    fn an_absurd_weight_decay_is_named_and_an_absurd_rate_is_blamed_on_the_rate() {
        let decay = divergence_hint(1e30, 0.0125);
        assert!(decay.contains("--weight-decay 1e30"), "{decay}");
        assert!(decay.contains("well below 80"), "{decay}");
        assert!(!decay.contains("lower --lr"), "{decay}");
        // --lr 1e7 with the usual decay: the rate is the cause, though lr × decay ≥ 1.
        let rate = divergence_hint(5e-4, 156_250.0);
        assert!(rate.starts_with("lower --lr"), "{rate}");
        assert!(divergence_hint(5e-4, 0.1).starts_with("lower --lr"));
    }
}
