//! The [`Collective`] of a run with one rank and no communication library: every average is
//! the rank's own values, every sum its own. One GPU trains this way without NCCL.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;

use super::collective::{Collective, CollectiveError};
use crate::backend::SumsMut;
use crate::cuda::timeline::GpuTimeline;
use crate::cuda::GpuDevice;

/// A one-rank group over gradient buffers of type `B`.
pub struct SingleRank<B> {
    /// The GPU, for a GPU rank (its stream orders the device-side step totals).
    pub device: Option<Arc<GpuDevice>>,
    /// The `--trace` timeline of that GPU.
    pub timeline: Option<GpuTimeline>,
    _buffer: PhantomData<fn(B)>,
}

impl<B> std::fmt::Debug for SingleRank<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SingleRank").finish_non_exhaustive()
    }
}

impl<B> SingleRank<B> {
    /// The group of one rank (on `device`, for a GPU).
    pub fn new(device: Option<Arc<GpuDevice>>) -> Self {
        SingleRank {
            device,
            timeline: None,
            _buffer: PhantomData,
        }
    }
}

impl<B> Collective for SingleRank<B> {
    type Buffer = B;

    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn start_average(
        &mut self,
        _buffer: &mut B,
        bucket: usize,
        _range: Range<usize>,
        scale: f32,
    ) -> Result<(), CollectiveError> {
        // A rank alone has every image of the step: its share is exactly 1.
        if scale != 1.0 {
            return Err(CollectiveError::Buffer {
                rank: 0,
                detail: format!("bucket {bucket}: a single rank's share is 1, not {scale}"),
            });
        }
        Ok(())
    }

    fn finish_averages(&mut self, _buffer: &mut B) -> Result<(), CollectiveError> {
        Ok(())
    }

    fn broadcast(&mut self, _values: &mut [f32], _root: usize) -> Result<(), CollectiveError> {
        Ok(())
    }

    fn sum(&mut self, _values: &mut [f64]) -> Result<(), CollectiveError> {
        Ok(())
    }

    fn sum_within(
        &mut self,
        _values: &mut [f64],
        _timeout: std::time::Duration,
    ) -> Result<(), CollectiveError> {
        Ok(())
    }

    fn sum_sums(&mut self, _sums: SumsMut<'_>) -> Result<(), CollectiveError> {
        // One rank: the sums are already the total (and stay where they are: no round trip).
        Ok(())
    }

    fn check(&self) -> Result<(), CollectiveError> {
        Ok(())
    }

    fn abort(&self, _reason: &str) {}
}
