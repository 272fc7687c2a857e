//! The collective interface that joins the ranks of a run: what every rank does together.
//!
//! A rank owns a backend, a model replica and its share of every global batch; everything it
//! must agree on with the others goes through one [`Collective`]:
//! - gradient buckets are averaged in place, started from the backward hook as soon as a
//!   bucket is complete ([`Collective::start_average`]) and finished before the optimizer
//!   ([`Collective::finish_averages`]);
//! - the initial weights are broadcast from rank 0 ([`Collective::broadcast`]);
//! - small host vectors are summed (the step's loss and hit counts, the stop flag, checksums:
//!   [`Collective::sum`]); a sum that waits for work done outside the collectives
//!   (validation, rank 0 writing the run folder) has a timeout of its own
//!   ([`Collective::sum_within`]); synchronised batch norm's per-channel sums are summed where
//!   the backend keeps them ([`Collective::sum_sums`]: on the device for GPU ranks);
//! - a failing rank aborts the group with a reason ([`Collective::abort`]), and every rank's
//!   next call fails instead of waiting for it.
//!
//! Two implementations: [`super::local::LocalCollective`] for CPU ranks on threads of one
//! process (buckets reduced on a communication thread, so the reduction overlaps backward as
//! on a GPU), and [`super::nccl::NcclCollective`] for GPUs (NCCL on a communication stream,
//! also across machines); and, for tests only, [`super::device_group::DeviceCollective`]: N GPU
//! ranks sharing one GPU, reduced on the device without NCCL. Every rank must issue the same
//! calls in the same order; every implementation detects a rank that stops answering with a
//! [`super::watchdog::Watchdog`].

use std::ops::Range;
use std::time::Duration;

use super::bucket_error::BucketError;
use super::nccl::NcclError;
use super::watchdog::WatchdogError;
use crate::backend::bn_sync::SumThroughHostError;
use crate::backend::SumsMut;

/// Errors of a collective operation. Each names the rank that saw it.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// This rank's watchdog fired: a collective did not complete in time, or failed.
    #[error("{source}{detail}")]
    Watchdog {
        /// The watchdog's fault (rank, operation, timeout).
        #[source]
        source: WatchdogError,
        /// What the group knows about the stuck operation ("; rank 2 never joined it").
        detail: String,
    },
    /// The group was aborted by another rank (its watchdog fired or it failed).
    #[error("rank {rank}: stopped because the group was aborted: {reason}")]
    Aborted {
        /// This rank.
        rank: usize,
        /// Why the group was aborted.
        reason: String,
    },
    /// Ranks called different operations, or with different lengths, at the same point.
    #[error("rank {rank}: {what} does not match the other ranks ({detail}); every rank must run the same model and issue the same collectives in the same order")]
    Mismatch {
        /// This rank.
        rank: usize,
        /// The operation.
        what: String,
        /// What differs.
        detail: String,
    },
    /// A bucket or buffer outside the gradient buffer, or used out of order.
    #[error("rank {rank}: {detail}")]
    Buffer {
        /// This rank.
        rank: usize,
        /// What is wrong.
        detail: String,
    },
    /// Gradient bookkeeping failed (a parameter reported twice, or never).
    #[error(transparent)]
    Buckets(#[from] BucketError),
    /// An NCCL or CUDA call failed.
    #[error(transparent)]
    Nccl(#[from] NcclError),
    /// A rank's helper thread (its communication thread) could not start.
    #[error(transparent)]
    Thread(#[from] pipeline::threads::ThreadStartError),
}

/// What the ranks of a run do together. One value per rank; see the module docs.
pub trait Collective: Send {
    /// Where this rank keeps its flat gradient buffer: host memory for CPU ranks, device
    /// memory for GPU ranks.
    type Buffer;

    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn world_size(&self) -> usize;

    /// Starts averaging `range` (elements) of `buffer` over every rank, in place; this rank's
    /// values are multiplied by `scale` first (its share of the step's images × ranks, 1 for
    /// an even split). Returns at once: the average runs while the caller goes on (backward
    /// computing earlier layers). `bucket` numbers the call within the step (0, 1, …, in the
    /// same order on every rank).
    fn start_average(
        &mut self,
        buffer: &mut Self::Buffer,
        bucket: usize,
        range: Range<usize>,
        scale: f32,
    ) -> Result<(), CollectiveError>;

    /// Ends the step's averages: afterwards every started range holds the average (on a GPU:
    /// everything issued next on the compute stream sees it).
    fn finish_averages(&mut self, buffer: &mut Self::Buffer) -> Result<(), CollectiveError>;

    /// Rank `root`'s `values` on every rank (host values; returns when they have arrived).
    fn broadcast(&mut self, values: &mut [f32], root: usize) -> Result<(), CollectiveError>;

    /// Sums `values` element-wise over every rank, in place (host values; returns when the
    /// sum is there, waiting on the operation itself, not on a polling tick).
    fn sum(&mut self, values: &mut [f64]) -> Result<(), CollectiveError>;

    /// [`Collective::sum`] under `timeout` instead of the collective timeout: for a sum the
    /// ranks reach far apart because some of them first do long work outside the collectives
    /// (validating their share, rank 0 writing a checkpoint to a slow disk). A failing rank
    /// still aborts it at once, and so does an asynchronous error of the communicator (a peer
    /// process that died), whatever the timeout.
    fn sum_within(&mut self, values: &mut [f64], timeout: Duration) -> Result<(), CollectiveError>;

    /// Sums synchronised batch norm's per-channel `sums` element-wise over every rank, in
    /// place, where the backend keeps them: the same call for a rank with images (its
    /// backend's sums) and for one replaying a step with zeros (host values).
    ///
    /// The default goes through [`Collective::sum`] (device sums are downloaded and uploaded
    /// again), so CPU ranks and any collective without a device path take part with the same
    /// call order. NCCL overrides it: sums in device memory are reduced on the device, on a
    /// communicator and stream of their own, ordered against compute by events, never behind
    /// the gradient buckets in flight and never through the host.
    fn sum_sums(&mut self, mut sums: SumsMut<'_>) -> Result<(), CollectiveError> {
        let rank = self.rank();
        sums.sum_through_host(|v| self.sum(v)).map_err(|e| match e {
            SumThroughHostError::Sum(e) => e,
            SumThroughHostError::Device(e) => CollectiveError::Buffer {
                rank,
                detail: format!("synchronised batch norm's sums: {e}"),
            },
        })
    }

    /// Ok unless the group was aborted.
    fn check(&self) -> Result<(), CollectiveError>;

    /// Aborts the group: every rank's pending and later operations fail with `reason`.
    fn abort(&self, reason: &str);
}

/// A u64 checksum as two f64 halves (each exact: below 2^32), so that [`Collective::sum`] can
/// carry it; [`checksum_from_f64`] is the inverse.
pub fn checksum_to_f64(sum: u64) -> [f64; 2] {
    [(sum >> 32) as f64, (sum & 0xffff_ffff) as f64]
}

/// The inverse of [`checksum_to_f64`].
pub fn checksum_from_f64(halves: [f64; 2]) -> u64 {
    ((halves[0] as u64) << 32) | (halves[1] as u64 & 0xffff_ffff)
}

/// Rank `root`'s checksum on every rank: `root` contributes its halves, every other rank
/// zeros, so the sum is exactly `root`'s value.
pub fn broadcast_checksum<C: Collective + ?Sized>(
    comm: &mut C,
    mine: u64,
    root: usize,
) -> Result<u64, CollectiveError> {
    let mut v = if comm.rank() == root {
        checksum_to_f64(mine)
    } else {
        [0.0, 0.0]
    };
    comm.sum(&mut v)?;
    Ok(checksum_from_f64(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_survive_the_f64_round_trip_exactly() {
        for sum in [
            0u64,
            1,
            u64::MAX,
            0x0123_4567_89ab_cdef,
            1 << 32,
            (1 << 32) - 1,
        ] {
            assert_eq!(checksum_from_f64(checksum_to_f64(sum)), sum);
        }
    }
}
