//! The step's own values that kernels read from device memory rather than as by-value
//! arguments: the labels, the mixing weight of the loss (`own_weight`), the rank's stop wish
//! (`loss_totals`) and the input's mixing (`input_transform`'s `InputMix`). Each has one
//! buffer whose address stays fixed once grown, so a CUDA graph captured over a step
//! (`crate::cuda::graph`) replays with the values of the step it replays.
//!
//! Eagerly, each op uploads its value into its buffer right before its launch (stream order:
//! after the previous step's kernels read it). For a captured or replayed step the trainer
//! uploads them all first ([`CudaBackend::preload_step`]): the ops then upload nothing (an
//! upload inside a capture would be recorded with its host address and replay stale values),
//! until [`CudaBackend::end_preload`].

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, ValidAsZeroBits};

use super::base::{drv_err, ensure, CudaBackend};
use crate::backend::BackendError;
use crate::cuda::kernel_types::InputMix;

/// What a captured or replayed step reads, uploaded before it ([`CudaBackend::preload_step`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepInputs<'a> {
    /// The rows' labels (as the loss's `Targets` hold them).
    pub(crate) labels: &'a [u32],
    /// The weight of each row's own label (1 without mixing).
    pub(crate) own_weight: f32,
    /// This rank's wish to stop after the step.
    pub(crate) stop: bool,
    /// The input's mixing (kernels/input.cu's `InputMix`).
    pub(crate) mix: InputMix,
}

/// Grows `slot` to `values.len()`, uploads them unless `preloaded`, and returns its address.
fn put<T: DeviceRepr + ValidAsZeroBits>(
    be: &CudaBackend,
    slot: &mut Option<CudaSlice<T>>,
    values: &[T],
    preloaded: bool,
    op: &'static str,
) -> Result<u64, BackendError> {
    ensure(&be.dev, slot, values.len().max(1), op)?;
    let buf = slot.as_mut().expect("ensured");
    let stream = be.dev.stream();
    if !preloaded && !values.is_empty() {
        stream
            .memcpy_htod(values, &mut buf.slice_mut(0..values.len()))
            .map_err(drv_err(op))?;
    }
    Ok(buf.device_ptr(stream).0)
}

impl CudaBackend {
    /// The device address of the step's labels, uploaded now unless preloaded.
    pub(super) fn step_labels(
        &self,
        op: &'static str,
        labels: &[u32],
    ) -> Result<u64, BackendError> {
        let ints: Vec<i32> = labels.iter().map(|&l| l as i32).collect();
        let mut w = self.work();
        let preloaded = w.step.preloaded;
        put(self, &mut w.step.labels, &ints, preloaded, op)
    }

    /// The device address of the loss's `own_weight`, uploaded now unless preloaded.
    pub(super) fn step_own_weight(&self, op: &'static str, w: f32) -> Result<u64, BackendError> {
        let mut work = self.work();
        let preloaded = work.step.preloaded;
        put(self, &mut work.step.own_weight, &[w], preloaded, op)
    }

    /// The device address of the stop wish `loss_totals` writes, uploaded now unless
    /// preloaded.
    pub(super) fn step_stop(&self, op: &'static str, stop: bool) -> Result<u64, BackendError> {
        let mut w = self.work();
        let preloaded = w.step.preloaded;
        put(self, &mut w.step.stop, &[i32::from(stop)], preloaded, op)
    }

    /// The device address of the input's mixing, uploaded now unless preloaded.
    pub(crate) fn step_mix(&self, op: &'static str, mix: InputMix) -> Result<u64, BackendError> {
        let mut w = self.work();
        let preloaded = w.step.preloaded;
        put(self, &mut w.step.mix, &[mix], preloaded, op)
    }

    /// Whether the coming step's values are on the device already (its ops upload nothing).
    pub fn step_preloaded(&self) -> bool {
        self.work().step.preloaded
    }

    /// Uploads the coming step's values into their buffers (on the compute stream, before
    /// the step's kernels) and makes the ops upload nothing until [`CudaBackend::end_preload`]:
    /// what a captured step needs, and what a replay reads.
    pub(crate) fn preload_step(&self, values: &StepInputs<'_>) -> Result<(), BackendError> {
        let op = "preload step values";
        self.end_preload();
        self.step_labels(op, values.labels)?;
        self.step_own_weight(op, values.own_weight)?;
        self.step_stop(op, values.stop)?;
        self.step_mix(op, values.mix)?;
        self.work().step.preloaded = true;
        Ok(())
    }

    /// Back to each op uploading its own value (after a captured or replayed step).
    pub fn end_preload(&self) {
        self.work().step.preloaded = false;
    }
}
