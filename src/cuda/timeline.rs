//! GPU spans for the Chrome trace, timed with CUDA events.
//!
//! Host code cannot see when a copy or a kernel runs, only when it was enqueued. A
//! [`GpuTimeline`] records a pair of timing events around each piece of stream work, and after
//! the stream work is done (once per step, say) converts them into spans: the start of the
//! timeline is an event whose completion the host waited for, which pins GPU time to the
//! trace's host clock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaEvent, CudaStream, DriverError};

use crate::trace::{Span, TraceRecorder};

/// Thread ids of a GPU's rows in the trace.
pub mod rows {
    /// The compute stream.
    pub const COMPUTE: u32 = 0;
    /// The copy (H2D staging) stream.
    pub const COPY: u32 = 1;
    /// The communication (NCCL) stream.
    pub const COMM: u32 = 2;
    /// Host-side waits of the driver thread.
    pub const HOST: u32 = 3;
}

struct Pending {
    name: String,
    category: &'static str,
    tid: u32,
    start: CudaEvent,
    end: CudaEvent,
}

/// Records GPU work of one device as trace spans.
pub struct GpuTimeline {
    trace: TraceRecorder,
    pid: u32,
    origin: CudaEvent,
    /// Host time (relative to the trace origin) at which `origin` completed.
    origin_at: Duration,
    pending: Vec<Pending>,
}

impl std::fmt::Debug for GpuTimeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuTimeline")
            .field("pid", &self.pid)
            .field("pending", &self.pending.len())
            .finish()
    }
}

fn timing_event(stream: &CudaStream) -> Result<CudaEvent, DriverError> {
    stream
        .context()
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
}

impl GpuTimeline {
    /// A timeline for GPU `pid` on `trace`, anchored now on `stream` (synchronises it once).
    pub fn new(
        trace: TraceRecorder,
        pid: u32,
        stream: &Arc<CudaStream>,
    ) -> Result<Self, DriverError> {
        let origin = timing_event(stream)?;
        origin.record(stream)?;
        origin.synchronize()?;
        let origin_at = trace.origin().map_or(Duration::ZERO, |o| {
            Instant::now().saturating_duration_since(o)
        });
        trace.name_process(pid, &format!("GPU {pid}"));
        for (tid, name) in [
            (rows::COMPUTE, "compute stream"),
            (rows::COPY, "copy stream"),
            (rows::COMM, "NCCL stream"),
            (rows::HOST, "driver thread"),
        ] {
            trace.name_thread(pid, tid, name);
        }
        Ok(GpuTimeline {
            trace,
            pid,
            origin,
            origin_at,
            pending: Vec::new(),
        })
    }

    /// Records the start of a span on `stream`; finish it with [`GpuTimeline::end`].
    /// Does nothing (and returns None) when tracing is disabled.
    pub fn begin(&self, stream: &CudaStream) -> Result<Option<CudaEvent>, DriverError> {
        if !self.trace.is_enabled() {
            return Ok(None);
        }
        let e = timing_event(stream)?;
        e.record(stream)?;
        Ok(Some(e))
    }

    /// Records the end of the span begun with `start` on `stream`.
    pub fn end(
        &mut self,
        start: Option<CudaEvent>,
        stream: &CudaStream,
        name: impl Into<String>,
        category: &'static str,
        tid: u32,
    ) -> Result<(), DriverError> {
        let Some(start) = start else {
            return Ok(());
        };
        let end = timing_event(stream)?;
        end.record(stream)?;
        self.pending.push(Pending {
            name: name.into(),
            category,
            tid,
            start,
            end,
        });
        Ok(())
    }

    /// Converts every recorded span into a trace span; blocks until their work is done (call it
    /// at a step boundary, where the host waits anyway).
    pub fn flush(&mut self) -> Result<(), DriverError> {
        for p in self.pending.drain(..) {
            let start_ms = self.origin.elapsed_ms(&p.start)?.max(0.0);
            let dur_ms = p.start.elapsed_ms(&p.end)?.max(0.0);
            self.trace.record(Span {
                name: p.name,
                category: p.category.to_string(),
                pid: self.pid,
                tid: p.tid,
                start: self.origin_at + Duration::from_secs_f64(f64::from(start_ms) / 1e3),
                duration: Duration::from_secs_f64(f64::from(dur_ms) / 1e3),
            });
        }
        Ok(())
    }
}
