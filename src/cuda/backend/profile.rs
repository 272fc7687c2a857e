//! Per-launch timing for `bench step --breakdown`: events around every launch while profiling
//! is on, summed per kernel, with the work each op declares for its launches (bytes moved,
//! FLOPs) so the breakdown can show GB/s and TFLOP/s.

use cudarc::driver::CudaEvent;

use super::base::{drv_err, CudaBackend, ProfiledLaunch};
use crate::backend::BackendError;
use crate::cuda::error::CudaError;

/// Time spent in one kernel over a profiled interval.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTime {
    /// Kernel name.
    pub name: &'static str,
    /// Launches.
    pub calls: usize,
    /// Total GPU milliseconds.
    pub ms: f64,
    /// DRAM bytes the launches had to move at least (inputs read + outputs written), summed;
    /// 0 when not declared.
    pub bytes: f64,
    /// Floating-point operations (2 × multiply-adds), summed; 0 when not declared.
    pub flops: f64,
}

impl KernelTime {
    /// Achieved bandwidth in GB/s (None when no bytes were declared).
    pub fn gb_per_s(&self) -> Option<f64> {
        (self.bytes > 0.0 && self.ms > 0.0).then(|| self.bytes / (self.ms * 1e-3) / 1e9)
    }

    /// Achieved TFLOP/s (None when no FLOPs were declared).
    pub fn tflops(&self) -> Option<f64> {
        (self.flops > 0.0 && self.ms > 0.0).then(|| self.flops / (self.ms * 1e-3) / 1e12)
    }
}

impl CudaBackend {
    /// Turns per-launch timing on or off (off by default: events cost a little per launch).
    pub fn set_profiling(&self, on: bool) {
        let mut p = self.profiler.lock().unwrap_or_else(|e| e.into_inner());
        p.enabled = on;
        p.events.clear();
    }

    /// Per-kernel GPU time since profiling was turned on (or last taken), largest first.
    pub fn take_profile(&self) -> Result<Vec<KernelTime>, CudaError> {
        self.synchronize()?;
        let events = std::mem::take(
            &mut self
                .profiler
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .events,
        );
        let mut out: Vec<KernelTime> = Vec::new();
        for e in events {
            let ms = f64::from(
                e.start
                    .elapsed_ms(&e.end)
                    .map_err(CudaError::driver("cuEventElapsedTime"))?,
            );
            match out.iter_mut().find(|k| k.name == e.name) {
                Some(k) => {
                    k.calls += 1;
                    k.ms += ms;
                    k.bytes += e.bytes;
                    k.flops += e.flops;
                }
                None => out.push(KernelTime {
                    name: e.name,
                    calls: 1,
                    ms,
                    bytes: e.bytes,
                    flops: e.flops,
                }),
            }
        }
        out.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        Ok(out)
    }

    pub(super) fn profile_begin(&self) -> Result<Option<CudaEvent>, BackendError> {
        if !self
            .profiler
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .enabled
        {
            return Ok(None);
        }
        let ev = self
            .dev
            .context()
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv_err("profiler event"))?;
        ev.record(self.dev.stream())
            .map_err(drv_err("profiler event"))?;
        Ok(Some(ev))
    }

    pub(super) fn profile_end(
        &self,
        name: &'static str,
        start: Option<CudaEvent>,
    ) -> Result<(), BackendError> {
        let Some(start) = start else { return Ok(()) };
        let end = self
            .dev
            .context()
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv_err("profiler event"))?;
        end.record(self.dev.stream())
            .map_err(drv_err("profiler event"))?;
        self.profiler
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .events
            .push(ProfiledLaunch {
                name,
                start,
                end,
                bytes: 0.0,
                flops: 0.0,
            });
        Ok(())
    }

    /// Declares the work of the launch just queued (for `--breakdown`'s GB/s and TFLOP/s).
    pub(super) fn note_work(&self, bytes: usize, flops: f64) {
        let mut p = self.profiler.lock().unwrap_or_else(|e| e.into_inner());
        if p.enabled {
            if let Some(last) = p.events.last_mut() {
                last.bytes = bytes as f64;
                last.flops = flops;
            }
        }
    }
}
