//! Per-op timing of the CPU backend, for `bench step --gpus 0 --breakdown`.
//!
//! Off by default (one relaxed atomic load per op). When on, every op adds its wall time,
//! its useful FLOPs and its compulsory bytes (inputs read once, outputs written once) to an
//! entry named after the op and, for convolutions, the kernel size and stride.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// The accumulated time of one op kind.
#[derive(Debug, Clone, PartialEq)]
pub struct OpTime {
    /// Op and shape class, e.g. `conv_fwd 3x3/2`, `bn_bwd`, `optimizer`.
    pub name: String,
    /// Calls recorded.
    pub calls: u64,
    /// Wall milliseconds, summed.
    pub ms: f64,
    /// Floating-point operations (multiply-adds × 2 of the dense convolution), summed.
    pub flops: f64,
    /// Compulsory bytes read and written, summed.
    pub bytes: f64,
}

impl OpTime {
    /// Achieved GFLOP/s (ops with FLOPs counted).
    pub fn gflops(&self) -> Option<f64> {
        (self.flops > 0.0 && self.ms > 0.0).then(|| self.flops / (self.ms * 1e6))
    }

    /// Achieved GB/s of compulsory traffic (ops with bytes counted).
    pub fn gb_per_s(&self) -> Option<f64> {
        (self.bytes > 0.0 && self.ms > 0.0).then(|| self.bytes / (self.ms * 1e6))
    }
}

/// Collects [`OpTime`]s while enabled.
#[derive(Debug, Default)]
pub(super) struct Profiler {
    on: AtomicBool,
    ops: Mutex<Vec<OpTime>>,
}

/// Records on drop.
pub(super) struct Timer<'a> {
    profiler: &'a Profiler,
    name: String,
    flops: f64,
    bytes: f64,
    start: Instant,
}

impl Drop for Timer<'_> {
    fn drop(&mut self) {
        let ms = self.start.elapsed().as_secs_f64() * 1e3;
        let mut ops = self.profiler.ops.lock().unwrap_or_else(|e| e.into_inner());
        match ops.iter_mut().find(|o| o.name == self.name) {
            Some(o) => {
                o.calls += 1;
                o.ms += ms;
                o.flops += self.flops;
                o.bytes += self.bytes;
            }
            None => ops.push(OpTime {
                name: std::mem::take(&mut self.name),
                calls: 1,
                ms,
                flops: self.flops,
                bytes: self.bytes,
            }),
        }
    }
}

impl Profiler {
    pub(super) fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// A timer for one call, or `None` when profiling is off (`name` is only built when on).
    pub(super) fn time(
        &self,
        name: impl FnOnce() -> String,
        flops: f64,
        bytes: f64,
    ) -> Option<Timer<'_>> {
        self.on.load(Ordering::Relaxed).then(|| Timer {
            profiler: self,
            name: name(),
            flops,
            bytes,
            start: Instant::now(),
        })
    }

    /// The entries so far (first-seen order), clearing them.
    pub(super) fn take(&self) -> Vec<OpTime> {
        std::mem::take(&mut *self.ops.lock().unwrap_or_else(|e| e.into_inner()))
    }
}
