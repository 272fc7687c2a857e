//! The CUDA side of [`super::device_group`]: ranks that share one GPU. A rank's compute stream
//! is its [`GpuDevice`]'s; it gets a communication stream of its own on the same (primary)
//! context, so the reduction a rank enqueues for every rank runs beside the compute streams and
//! is ordered against them by events only. Markers are CUDA events: ready markers are recorded
//! on a compute stream, done markers by the reduction (created with blocking sync, so a host
//! waiting for one sleeps instead of spinning a core).

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{result as drv, CudaEvent, CudaStream};

use super::device_group::{DevicePart, RankDevice, ReduceKind};
use crate::cuda::rank_reduce::{RankReducer, RankSlice};
use crate::cuda::{CudaError, GpuDevice};

/// One rank's device operations on a GPU shared with the other ranks of its process.
#[derive(Debug)]
pub struct SameGpuRank {
    device: Arc<GpuDevice>,
    comm: Arc<CudaStream>,
    reducer: RankReducer,
}

impl SameGpuRank {
    /// The operations of the rank computing on `device`'s stream: creates its communication
    /// stream and loads the reduction kernels (compiled on a cold kernel cache).
    pub fn new(device: Arc<GpuDevice>) -> Result<SameGpuRank, CudaError> {
        let comm = device
            .context()
            .new_stream()
            .map_err(CudaError::driver("creating the communication stream"))?;
        let reducer = RankReducer::new(&device)?;
        Ok(SameGpuRank {
            device,
            comm,
            reducer,
        })
    }

    fn event(&self, flags: Option<CUevent_flags>) -> Result<Arc<CudaEvent>, String> {
        self.device
            .context()
            .new_event(flags)
            .map(Arc::new)
            .map_err(|e| format!("create an event: {e}"))
    }
}

impl RankDevice for SameGpuRank {
    type Marker = Arc<CudaEvent>;

    fn mark_compute(&self) -> Result<Arc<CudaEvent>, String> {
        let ready = self.event(None)?;
        ready
            .record(self.device.stream())
            .map_err(|e| format!("record an event on the compute stream: {e}"))?;
        Ok(ready)
    }

    fn new_marker(&self) -> Result<Arc<CudaEvent>, String> {
        self.event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))
    }

    unsafe fn enqueue(
        &self,
        kind: ReduceKind,
        parts: &[&DevicePart<Arc<CudaEvent>>],
    ) -> Result<(), String> {
        let Some(first) = parts.first() else {
            return Ok(());
        };
        let len = first.len;
        let comm = &self.comm;
        self.device
            .context()
            .bind_to_thread()
            .map_err(|e| format!("bind the context: {e}"))?;
        for p in parts {
            comm.wait(&p.ready)
                .map_err(|e| format!("wait for a rank's ready event: {e}"))?;
        }
        match kind {
            ReduceKind::Average => {
                let slices: Vec<RankSlice> = parts
                    .iter()
                    .map(|p| RankSlice {
                        ptr: p.ptr,
                        scale: p.scale,
                    })
                    .collect();
                self.reducer
                    .average_f32(comm, &slices, len)
                    .map_err(|e| e.to_string())?;
            }
            ReduceKind::Sum => {
                let ptrs: Vec<u64> = parts.iter().map(|p| p.ptr).collect();
                self.reducer
                    .sum_f64(comm, &ptrs, len)
                    .map_err(|e| e.to_string())?;
                for p in parts {
                    if let Some(host) = p.host {
                        // SAFETY: the owner's page-locked memory of `len` f64, untouched until
                        // its done marker (recorded below, after this copy).
                        let dst = std::slice::from_raw_parts_mut(host.0, len);
                        drv::memcpy_dtoh_async(dst, p.ptr, comm.cu_stream())
                            .map_err(|e| format!("copy a sum to the host: {e}"))?;
                    }
                }
            }
        }
        for p in parts {
            p.done
                .record(comm)
                .map_err(|e| format!("record a rank's done event: {e}"))?;
        }
        Ok(())
    }

    fn compute_waits(&self, marker: &Arc<CudaEvent>) -> Result<(), String> {
        self.device
            .stream()
            .wait(marker)
            .map_err(|e| format!("make the compute stream wait: {e}"))
    }

    fn host_waits(&self, marker: &Arc<CudaEvent>) -> Result<(), String> {
        marker
            .synchronize()
            .map_err(|e| format!("wait for an event: {e}"))
    }

    fn is_done(marker: &Arc<CudaEvent>) -> Result<bool, String> {
        marker.try_is_complete().map_err(|e| e.to_string())
    }
}
