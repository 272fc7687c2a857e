//! `--batch-size auto`: the largest batch the GPUs of a launch hold, and where it cannot be
//! measured (the CPU, several processes).

use super::plan::launch_plan;
use crate::cuda::CudaBackend;
use crate::dist::launch::LaunchPlan;
use crate::model::Graph;
use crate::train::config::TrainConfig;
use crate::train::device::DeviceChoice;
use crate::train::TrainError;

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

/// `--batch-size auto`: the largest per-GPU batch that every GPU of the run holds for
/// `cfg`'s model and image size with `classes` classes, measured on each device
/// ([`crate::cuda::memory::auto_batch_size`]: a probe network's footprint against the free
/// memory) and rounded down to a multiple of 8 (from 16 on); with it, the line that says so.
/// Refused where [`check_auto_batch`] refuses it.
pub fn largest_gpu_batch(cfg: &TrainConfig, classes: usize) -> Result<(usize, String), TrainError> {
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
        if smallest.as_ref().is_none_or(|(b, _)| batch < *b) {
            let accumulated = match cfg.grad_accum_steps {
                k if k > 1 => format!(" per micro-batch, × {k} accumulated"),
                _ => String::new(),
            };
            let line = format!(
                "--batch-size auto: {batch} images per GPU{accumulated} ({} at {image_size} px: {} MiB fixed + {:.1} MiB per image, {} MiB free on {device}{})",
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
}
