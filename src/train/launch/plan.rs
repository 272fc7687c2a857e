//! The launch plan of a GPU run: `--gpus n` with the distributed flags and the launcher's
//! variables, against the GPUs the one probe finds ([`launch::probe_gpus`]).

use crate::dist::launch::{self, LaunchPlan};
use crate::train::config::TrainConfig;
use crate::train::rank::cuda::config_error;
use crate::train::TrainError;

/// The launch plan for `--gpus n` and the distributed settings.
pub(crate) fn launch_plan(n: usize, cfg: &TrainConfig) -> Result<LaunchPlan, TrainError> {
    let flags = cfg
        .dist
        .launch_flags(Some(&n.to_string()))
        .map_err(|e| config_error("--gpus", n, e))?;
    Ok(launch::resolve(
        &flags,
        &launch::process_env,
        &launch::probe_gpus(),
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_gpus_than_present_is_an_error_listing_the_devices() {
        // This machine may have no GPU: asking for 64 fails either way, naming the flag.
        let mut cfg = TrainConfig::new("data");
        cfg.device = crate::train::DeviceChoice::Cuda(64);
        let e = launch_plan(64, &cfg).unwrap_err();
        assert!(e.to_string().contains("--gpus"), "{e}");
    }
}
