//! What resolving the launch configuration fails with.

/// Errors from resolving the launch configuration.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LaunchError {
    /// `--gpus` is neither a number nor `all`.
    #[error("invalid --gpus value {value:?}: expected a GPU count such as 4, or `all`")]
    InvalidGpus {
        /// The value given.
        value: String,
    },
    /// An environment variable holds something unparsable.
    #[error("invalid environment variable {var}={value:?}: expected {expected}")]
    InvalidEnv {
        /// Variable name.
        var: &'static str,
        /// Its value.
        value: String,
        /// What was expected.
        expected: &'static str,
    },
    /// A launcher variable another one implies is missing.
    #[error("{var} is not set but {because} (hint: {hint})")]
    MissingEnv {
        /// The missing variable.
        var: &'static str,
        /// What implies it.
        because: &'static str,
        /// What to do.
        hint: &'static str,
    },
    /// Launcher variables that contradict each other.
    #[error("{what} (hint: {hint})")]
    Inconsistent {
        /// The variables and their values.
        what: String,
        /// What to do.
        hint: &'static str,
    },
    /// A Slurm host list that does not expand.
    #[error("invalid host list {var}={value:?}: {reason} (hint: Slurm writes lists such as node[01-04,07])")]
    InvalidHostlist {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// More GPUs were requested than are visible.
    #[error("--gpus {requested} asks for more GPUs than are visible ({present}): {listing}")]
    TooManyGpus {
        /// GPUs requested.
        requested: usize,
        /// GPUs present.
        present: usize,
        /// The devices present, one `ordinal: name` per entry.
        listing: String,
    },
    /// GPUs were requested but none exist.
    #[error("--gpus {requested} but no CUDA device was found ({reason}); use --gpus 0 to train on the CPU")]
    NoDevices {
        /// What was requested.
        requested: String,
        /// Why none: no driver, no GPU, an empty `CUDA_VISIBLE_DEVICES`.
        reason: String,
    },
    /// `--dry-run` asks no driver, so "every GPU" has no count.
    #[error("{asked} means every visible GPU, and --dry-run asks no GPU driver while CUDA_VISIBLE_DEVICES is unset (hint: give --gpus N, or set CUDA_VISIBLE_DEVICES as the job will)")]
    GpuCountUnknown {
        /// What asked for every GPU.
        asked: String,
    },
    /// `--nodes 0` or `WORLD_SIZE=0`.
    #[error("the number of nodes must be at least 1 (from {source_name})")]
    ZeroNodes {
        /// Flag or variable that said 0.
        source_name: &'static str,
    },
    /// The node rank does not fit the world.
    #[error(
        "node rank {node_rank} (from {source_name}) is outside 0..{nodes} (from {nodes_source}); node ranks count from 0"
    )]
    NodeRankOutOfRange {
        /// The node rank.
        node_rank: usize,
        /// The node count.
        nodes: usize,
        /// Flag or variable it came from.
        source_name: &'static str,
        /// Flag or variable the node count came from.
        nodes_source: &'static str,
    },
    /// Several nodes but no rank for this one.
    #[error("{nodes} nodes but this node's rank is unknown: pass --node-rank (or set RANK)")]
    MissingNodeRank {
        /// The node count.
        nodes: usize,
    },
    /// Several nodes but no rendezvous address.
    #[error("{nodes} nodes need a rendezvous address: {hint}")]
    MissingMaster {
        /// The node count.
        nodes: usize,
        /// Where the address would come from.
        hint: &'static str,
    },
    /// Only one of MASTER_ADDR / MASTER_PORT is set.
    #[error("{set} is set but {missing} is not; set both (or pass --master host:port)")]
    PartialMasterEnv {
        /// The variable that is set.
        set: &'static str,
        /// The one that is missing.
        missing: &'static str,
    },
    /// `--master` is not `host:port`.
    #[error("invalid rendezvous address {value:?} (from {source_name}): {reason}; expected host:port such as 10.0.0.1:29500")]
    InvalidMaster {
        /// The value.
        value: String,
        /// Flag or variables it came from.
        source_name: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// torchrun's `MASTER_PORT` leaves no port above it for birdtrain's rendezvous.
    #[error("MASTER_PORT={port} is held by torchrun's agent and birdtrain's rendezvous listens on MASTER_PORT + 1, past 65535 (hint: a lower torchrun --master-port, or pass --master host:port)")]
    RendezvousPortOverflow {
        /// torchrun's port.
        port: u16,
    },
    /// One process per GPU (`LOCAL_RANK`, `SLURM_LOCALID`) together with `--gpus` above 1.
    #[error("{var}={index} means {mode}, but --gpus {gpus} asks this process to drive several; drop --gpus or use --gpus 1")]
    LocalGpuConflict {
        /// `LOCAL_RANK` or `SLURM_LOCALID`.
        var: &'static str,
        /// Its value.
        index: usize,
        /// Why one process per GPU.
        mode: String,
        /// The `--gpus` value.
        gpus: String,
    },
    /// `LOCAL_RANK` or `SLURM_LOCALID` names a GPU that is not visible.
    #[error("{var}={index} ({mode}) but {present} GPU(s) visible: {listing} (hint: {hint})")]
    LocalGpuMissing {
        /// `LOCAL_RANK` or `SLURM_LOCALID`.
        var: &'static str,
        /// Its value.
        index: usize,
        /// Why one process per GPU.
        mode: String,
        /// GPUs visible.
        present: usize,
        /// The devices visible (or why none).
        listing: String,
        /// What to change.
        hint: &'static str,
    },
    /// Several nodes with no GPU: the cross-node engine is NCCL.
    #[error("multi-node training ({nodes} nodes, from --nodes or the launcher's variables) runs on GPUs through NCCL; the CPU trains on one node only (hint: drop --nodes and the launcher, and use --replicas R for data parallelism on this machine's CPU)")]
    CpuMultiNode {
        /// The node count.
        nodes: usize,
    },
}
