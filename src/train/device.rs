//! Which device trains: `--gpus N|all`, with the CPU as the default when no GPU exists; and
//! the largest batch the chosen GPUs hold (`--batch-size auto`).

use crate::cuda::CudaBackend;
use crate::model::Graph;

/// Where a run computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The CPU reference backend (`--gpus 0`).
    Cpu,
    /// This many CUDA devices of this machine.
    Cuda(usize),
}

/// The CUDA devices present, or why there are none (no driver library, driver error).
///
/// The driver is loaded dynamically, so a machine without CUDA answers `Err` instead of
/// failing to start.
pub fn cuda_device_count() -> Result<usize, String> {
    // SAFETY: only probes whether the driver library can be opened; loads nothing else.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver library (libcuda) on this machine".into());
    }
    // The driver library exists; a failing init is reported, never unwrapped.
    match crate::panics::catch_expected(cudarc::driver::CudaContext::device_count) {
        Ok(Ok(n)) => Ok(n.max(0) as usize),
        Ok(Err(e)) => Err(format!("the CUDA driver reports {e}")),
        Err(_) => Err("the CUDA driver library could not be used".into()),
    }
}

impl DeviceChoice {
    /// Resolves `--gpus`: `None` picks every GPU present or, with none, the CPU (and says so
    /// in the returned note); `Some(0)` is the CPU; `Some(n)` needs n devices; `all` is every
    /// device (at least one).
    pub fn resolve(gpus: Option<&str>) -> Result<(Self, Option<String>), super::TrainError> {
        let count = cuda_device_count();
        let found = *count.as_ref().unwrap_or(&0);
        let why = match &count {
            Ok(_) => String::new(),
            Err(reason) => format!("; {reason}"),
        };
        let not_enough = |requested: &str| super::TrainError::NotEnoughGpus {
            requested: requested.to_string(),
            found,
            extra: why.clone(),
        };
        match gpus.map(str::trim) {
            None => {
                if found == 0 {
                    Ok((
                        Self::Cpu,
                        Some(format!("no GPU found{why}: training on the CPU (--gpus 0)")),
                    ))
                } else {
                    Ok((Self::Cuda(found), None))
                }
            }
            Some("all") => {
                if found == 0 {
                    Err(not_enough("all"))
                } else {
                    Ok((Self::Cuda(found), None))
                }
            }
            Some(text) => {
                let n: usize = text.parse().map_err(|_| super::TrainError::InvalidConfig {
                    flag: "--gpus",
                    value: text.to_string(),
                    hint: "a number of GPUs (0 = CPU) or `all`".into(),
                })?;
                if n == 0 {
                    Ok((Self::Cpu, None))
                } else if n > found {
                    Err(not_enough(text))
                } else {
                    Ok((Self::Cuda(n), None))
                }
            }
        }
    }
}

/// `--batch-size auto`: the largest per-GPU batch that every GPU of the run holds for
/// `cfg`'s model and image size with `classes` classes, measured on each device
/// ([`crate::cuda::memory::auto_batch_size`]: a probe network's footprint against the free
/// memory) and rounded down to a multiple of 8 (from 16 on); with it, the line that says so.
/// Refused on the CPU, and with several processes (each would measure only its own GPUs).
pub fn largest_gpu_batch(
    cfg: &super::TrainConfig,
    classes: usize,
) -> Result<(usize, String), super::TrainError> {
    let refused = |reason: String| super::TrainError::InvalidConfig {
        flag: "--batch-size",
        value: "auto".into(),
        hint: reason,
    };
    let DeviceChoice::Cuda(n) = cfg.device else {
        return Err(refused(
            "auto measures a GPU's memory; on the CPU give a number, e.g. --batch-size 64".into(),
        ));
    };
    let plan = super::rank::cuda::launch_plan(n, cfg)?;
    if plan.is_multi_node() {
        return Err(refused(format!(
            "each of the {} processes would measure only its own GPUs; give every node the same number",
            plan.nodes
        )));
    }
    let graph = Graph::new(cfg.arch, classes);
    let image_size = cfg.image_size;
    let mut smallest: Option<(usize, String)> = None;
    for &ordinal in &plan.devices {
        let device = format!("cuda:{ordinal}");
        let opened = |e: crate::cuda::CudaError| super::TrainError::Device {
            device: device.clone(),
            reason: e.to_string(),
        };
        let backend = CudaBackend::new(ordinal).map_err(opened)?;
        let (batch, footprint) = crate::cuda::memory::auto_batch_size(&backend, &graph, image_size)
            .map_err(|e| refused(format!("{device}: {e}")))?;
        let (free, _) = backend.device().memory().map_err(opened)?;
        let batch = if batch >= 16 { batch / 8 * 8 } else { batch };
        if smallest.as_ref().is_none_or(|(b, _)| batch < *b) {
            let line = format!(
                "--batch-size auto: {batch} images per GPU ({} at {image_size} px: {} MiB fixed + {:.1} MiB per image, {} MiB free on {device}{})",
                cfg.arch,
                footprint.fixed_bytes >> 20,
                footprint.per_image_bytes as f64 / (1u64 << 20) as f64,
                free >> 20,
                if plan.devices.len() > 1 { ", the least of the GPUs" } else { "" }
            );
            smallest = Some((batch, line));
        }
    }
    smallest.ok_or_else(|| refused("no GPU to measure".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_flag_values() {
        assert_eq!(
            DeviceChoice::resolve(Some("0")).unwrap().0,
            DeviceChoice::Cpu
        );
        let err = DeviceChoice::resolve(Some("two")).unwrap_err().to_string();
        assert!(err.contains("--gpus") && err.contains("two"), "{err}");
        let found = cuda_device_count().unwrap_or(0);
        let err = DeviceChoice::resolve(Some(&(found + 1).to_string()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("--gpus 0 trains on the CPU"), "{err}");
        if found == 0 {
            let (choice, note) = DeviceChoice::resolve(None).unwrap();
            assert_eq!(choice, DeviceChoice::Cpu);
            assert!(note.unwrap().contains("training on the CPU"));
            let err = DeviceChoice::resolve(Some("all")).unwrap_err().to_string();
            assert!(err.starts_with("--gpus all:"), "{err}");
        }
    }
}
