//! The data-parallel flags, as one clap group the training command flattens in.

use std::path::PathBuf;
use std::time::Duration;

use super::buckets::BucketSettings;
use super::launch::{GpuCount, LaunchError, LaunchFlags};

/// Multi-GPU and multi-node flags (`--gpus` itself belongs to the training flags).
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct DistArgs {
    /// Number of nodes (processes) in a multi-node run [default: WORLD_SIZE, else 1].
    #[arg(long)]
    pub nodes: Option<usize>,
    /// This node's rank, 0..nodes; node 0 serves the rendezvous [default: RANK, else 0].
    #[arg(long)]
    pub node_rank: Option<usize>,
    /// Rendezvous address host:port of node 0 [default: MASTER_ADDR:MASTER_PORT].
    #[arg(long)]
    pub master: Option<String>,
    /// Seconds to wait for every node at the rendezvous.
    #[arg(long, default_value_t = 300)]
    pub rendezvous_timeout: u64,
    /// Seconds a collective may take before every rank aborts (a rank stopped answering).
    #[arg(long, default_value_t = 600)]
    pub collective_timeout: u64,
    /// Gradient bucket size in MiB (one all-reduce per bucket, overlapping backward).
    #[arg(long, default_value_t = 25.0)]
    pub bucket_mb: f64,
    /// Staging slots per GPU (batch k+1 uploads while batch k computes).
    #[arg(long, default_value_t = 2)]
    pub prefetch_depth: usize,
    /// Write a Chrome trace (open in Perfetto) of copies, compute, all-reduces and waits.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Synchronised batch norm: normalise with the statistics of the global batch (every
    /// GPU's images) instead of each GPU's own; costs two small all-reduces per BN layer.
    #[arg(long)]
    pub sync_bn: bool,
}

impl DistArgs {
    /// The launch flags, with `gpus` as the training command parsed it (`--gpus N|all`).
    pub fn launch_flags(&self, gpus: Option<&str>) -> Result<LaunchFlags, LaunchError> {
        Ok(LaunchFlags {
            gpus: gpus.map(str::parse::<GpuCount>).transpose()?,
            nodes: self.nodes,
            node_rank: self.node_rank,
            master: self.master.clone(),
        })
    }

    /// The rendezvous timeout.
    pub fn rendezvous_timeout(&self) -> Duration {
        Duration::from_secs(self.rendezvous_timeout.max(1))
    }

    /// The collective (watchdog) timeout.
    pub fn collective_timeout(&self) -> Duration {
        Duration::from_secs(self.collective_timeout.max(1))
    }

    /// The bucket planner settings for f32 gradients.
    pub fn bucket_settings(&self) -> BucketSettings {
        BucketSettings::f32_mb(self.bucket_mb)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        dist: DistArgs,
    }

    #[test]
    fn sync_bn_is_off_unless_asked_for() {
        let off = Wrap::try_parse_from(["t"]).unwrap().dist;
        assert!(!off.sync_bn);
        let on = Wrap::try_parse_from(["t", "--sync-bn"]).unwrap().dist;
        assert!(on.sync_bn);
    }
}
