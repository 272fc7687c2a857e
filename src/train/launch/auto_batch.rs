//! `--batch-size auto`: the largest batch the GPUs of a launch hold, and where it cannot be
//! measured (the CPU, several processes).

use super::plan::launch_plan;
use crate::cuda::CudaBackend;
use crate::dist::launch::LaunchPlan;
use crate::model::Graph;
use crate::train::config::TrainConfig;
use crate::train::device::DeviceChoice;
use crate::train::TrainError;
use pipeline::LastBatch;

/// The error of a `--batch-size auto` that cannot be measured.
fn auto_refused(reason: String) -> TrainError {
    TrainError::InvalidConfig {
        flag: "--batch-size",
        value: "auto".into(),
        hint: reason,
    }
}

/// Refuses `--batch-size auto` where it cannot be measured: on the CPU (a plan without GPUs),
/// and with several processes (each would measure only its own GPUs).
pub fn check_auto_batch(plan: &LaunchPlan) -> Result<(), TrainError> {
    if plan.devices.is_empty() {
        return Err(auto_refused(
            "auto measures a GPU's memory; on the CPU give a number, e.g. --batch-size 64".into(),
        ));
    }
    if plan.is_multi_node() {
        return Err(auto_refused(format!(
            "each of the {} processes would measure only its own GPUs; give every node the same number",
            plan.nodes
        )));
    }
    Ok(())
}

/// The most images per GPU that a step over `train_images` images can use: a larger batch
/// would only hold the whole set (each step all of it), or with `--last-batch drop` make no
/// full batch at all. Never 0 (a set smaller than the ranks is `validate`'s to refuse).
fn set_share(cfg: &TrainConfig, train_images: usize) -> usize {
    let batches_per_step = cfg.replicas.max(1) * cfg.grad_accum_steps.max(1) as usize;
    let share = match cfg.last_batch {
        LastBatch::Drop => train_images / batches_per_step,
        LastBatch::Partial | LastBatch::Pad => train_images.div_ceil(batches_per_step),
    };
    share.max(1)
}

/// The measured per-GPU batch capped at the training set's share ([`set_share`]), with the
/// words that say so when it is.
fn capped_to_set(cfg: &TrainConfig, measured: usize, train_images: usize) -> (usize, String) {
    let share = set_share(cfg, train_images);
    if measured <= share {
        return (measured, String::new());
    }
    let per_gpu = if cfg.replicas > 1 { " per GPU" } else { "" };
    (
        share,
        format!(
            "; capped at the training set's {train_images} images{per_gpu} (the GPU holds {measured})"
        ),
    )
}

/// `--batch-size auto`: the largest per-GPU batch that every GPU of the run holds for
/// `cfg`'s model and image size with `classes` classes, measured on each device
/// ([`crate::cuda::memory::auto_batch_size`]: a probe network's footprint against the free
/// memory) and rounded down to a multiple of 8 (from 16 on), then capped so that the
/// `train_images` of the training set are not fewer than one step's batch (Lightning's batch
/// size finder stops at the dataset's length too); with it, the line that says so. Refused
/// where [`check_auto_batch`] refuses it.
pub fn largest_gpu_batch(
    cfg: &TrainConfig,
    classes: usize,
    train_images: usize,
) -> Result<(usize, String), TrainError> {
    let plan = match cfg.device {
        DeviceChoice::Cuda(n) => launch_plan(n, cfg)?,
        DeviceChoice::Cpu => LaunchPlan::single_node(Vec::new()),
    };
    check_auto_batch(&plan)?;
    let graph = Graph::new(cfg.arch, classes);
    let image_size = cfg.image_size;
    let mut smallest: Option<(usize, String)> = None;
    for &ordinal in &plan.devices {
        let device = format!("cuda:{ordinal}");
        let opened = |e: crate::cuda::CudaError| TrainError::Device {
            device: device.clone(),
            reason: e.to_string(),
        };
        let backend = CudaBackend::new(ordinal).map_err(opened)?;
        let (batch, footprint) = crate::cuda::memory::auto_batch_size(
            &backend,
            &graph,
            image_size,
            cfg.grad_accum_steps,
        )
        .map_err(|e| auto_refused(format!("{device}: {e}")))?;
        let (free, _) = backend.device().memory().map_err(opened)?;
        let batch = if batch >= 16 { batch / 8 * 8 } else { batch };
        let (batch, capped) = capped_to_set(cfg, batch, train_images);
        if smallest.as_ref().is_none_or(|(b, _)| batch < *b) {
            let accumulated = match cfg.grad_accum_steps {
                k if k > 1 => format!(" per micro-batch, × {k} accumulated"),
                _ => String::new(),
            };
            let line = format!(
                "--batch-size auto: {batch} images per GPU{accumulated} ({} at {image_size} px: {} MiB fixed + {:.1} MiB per image, {} MiB free on {device}{}{capped})",
                cfg.arch,
                footprint.fixed_bytes >> 20,
                footprint.per_image_bytes as f64 / (1u64 << 20) as f64,
                free >> 20,
                if plan.devices.len() > 1 { ", the least of the GPUs" } else { "" }
            );
            smallest = Some((batch, line));
        }
    }
    smallest.ok_or_else(|| auto_refused("no GPU to measure".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_auto_batch_is_measured_by_one_process_on_gpus_only() {
        let gpus = LaunchPlan::single_node(vec![0, 1]);
        assert!(check_auto_batch(&gpus).is_ok());
        let e = check_auto_batch(&LaunchPlan::single_node(Vec::new())).unwrap_err();
        assert!(e.to_string().contains("on the CPU give a number"), "{e}");
        let torchrun = LaunchPlan { nodes: 4, ..gpus };
        let e = check_auto_batch(&torchrun).unwrap_err();
        assert!(e.to_string().contains("each of the 4 processes"), "{e}");
    }

    #[test]
    fn an_auto_batch_never_exceeds_the_training_sets_share() {
        let mut cfg = TrainConfig::new("data");
        // One GPU, 20 images: a GPU that holds 1 512 gets the whole set in one batch.
        let (batch, line) = capped_to_set(&cfg, 1_512, 20);
        assert_eq!(batch, 20);
        assert!(
            line.contains("capped at the training set's 20 images"),
            "{line}"
        );
        assert!(line.contains("holds 1512"), "{line}");
        // A set larger than the batch leaves it alone, and says nothing.
        assert_eq!(capped_to_set(&cfg, 256, 10_000), (256, String::new()));
        // 3 GPUs × 2 micro-batches share 20 images: ceil(20 / 6) = 4 a micro-batch…
        cfg.replicas = 3;
        cfg.grad_accum_steps = 2;
        assert_eq!(capped_to_set(&cfg, 1_512, 20).0, 4);
        // …and with --last-batch drop one full step must remain: floor(20 / 6) = 3.
        cfg.last_batch = LastBatch::Drop;
        assert_eq!(capped_to_set(&cfg, 1_512, 20).0, 3);
        // Fewer images than one per micro-batch: 1, for validate to refuse by name.
        assert_eq!(capped_to_set(&cfg, 1_512, 5).0, 1);
    }
}
