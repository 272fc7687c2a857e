//! The data-parallel settings of a run, with their defaults in one place (the command line
//! takes its defaults from here).

use std::path::PathBuf;
use std::time::Duration;

use super::buckets::BucketSettings;
use super::launch::{GpuCount, LaunchError, LaunchFlags};

/// How the ranks of a run are launched and joined.
#[derive(Debug, Clone, PartialEq)]
pub struct DistSettings {
    /// Nodes (processes) of a multi-node run (`None`: the launcher's, else 1).
    pub nodes: Option<usize>,
    /// This node's rank (`None`: the launcher's, else 0).
    pub node_rank: Option<usize>,
    /// Rendezvous address host:port of node 0 (`None`: the launcher's, see
    /// [`super::launch::LaunchPlan::rendezvous_addr`]).
    pub master: Option<String>,
    /// Seconds to wait for every node at the rendezvous.
    pub rendezvous_timeout: u64,
    /// Seconds a collective may take before every rank aborts (a rank stopped answering).
    pub collective_timeout: u64,
    /// Seconds the ranks wait for each other at an epoch end or a checkpoint, where they meet
    /// after work outside the collectives: each rank validating its share, rank 0 writing
    /// metrics, `best/`, the checkpoint and the report (a large split or a slow disk can take
    /// longer than any collective should). A rank that fails meanwhile still aborts the others
    /// at once; this bounds only a writer that hangs or a peer that vanished unnoticed.
    pub epoch_end_timeout: u64,
    /// Gradient bucket size in MiB (one average per bucket, started during backward).
    pub bucket_mb: f64,
    /// Staging slots per GPU (batch k+1 uploads while batch k computes).
    pub prefetch_depth: usize,
    /// Write a Chrome trace (Perfetto) of the ranks' work to this file (node k > 0 of a
    /// multi-node run writes `<stem>.node<k>.<ext>` beside it).
    pub trace: Option<PathBuf>,
    /// GPU ranks join through NCCL. `false` runs a single GPU with no communication library
    /// (also the fallback when one GPU finds no NCCL).
    pub nccl: bool,
}

impl Default for DistSettings {
    fn default() -> Self {
        DistSettings {
            nodes: None,
            node_rank: None,
            master: None,
            rendezvous_timeout: 300,
            collective_timeout: 600,
            epoch_end_timeout: 3600,
            bucket_mb: 25.0,
            prefetch_depth: 2,
            trace: None,
            nccl: true,
        }
    }
}

impl DistSettings {
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

    /// How long the ranks wait for each other at an epoch end or a checkpoint (never less
    /// than the collective timeout).
    pub fn epoch_end_timeout(&self) -> Duration {
        Duration::from_secs(self.epoch_end_timeout.max(self.collective_timeout).max(1))
    }

    /// The bucket planner settings for f32 gradients.
    pub fn bucket_settings(&self) -> BucketSettings {
        BucketSettings::f32_mb(self.bucket_mb)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_epoch_end_wait_is_never_shorter_than_a_collective() {
        let mut d = DistSettings::default();
        assert_eq!(d.epoch_end_timeout(), Duration::from_secs(3600));
        d.collective_timeout = 7200;
        assert_eq!(d.epoch_end_timeout(), Duration::from_secs(7200));
        d.epoch_end_timeout = 0;
        d.collective_timeout = 0;
        assert_eq!(d.epoch_end_timeout(), Duration::from_secs(1));
    }
}
