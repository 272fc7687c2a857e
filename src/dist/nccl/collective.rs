//! [`NcclCollective`]: the [`Collective`] of one GPU rank on its communicator.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{result as drv, CudaEvent, CudaSlice, CudaStream, DriverError};

use super::communicator::host_wait_event;
use super::{new_unique_id, Communicator, NcclElement, NcclError, UNIQUE_ID_BYTES};
use crate::backend::bn_sync::SumThroughHostError;
use crate::backend::SumsMut;
use crate::cuda::timeline::{rows, GpuTimeline};
use crate::cuda::{grad, GpuDevice};
use crate::dist::collective::{Collective, CollectiveError};
use crate::dist::watchdog::{Abortable, Watchdog};

/// A rank's flat gradient buffer on its GPU: the device address and length of the f32 arena
/// the network's gradient tensors are views of. It does not own the memory: the network does,
/// and outlives every collective on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceGrads {
    /// Device address of element 0.
    pub ptr: u64,
    /// Elements.
    pub len: usize,
}

/// A host exchange's device buffer (grown on demand).
struct Scratch<T> {
    buf: Option<CudaSlice<T>>,
}

impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> Scratch<T> {
    fn get(
        &mut self,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<&mut CudaSlice<T>, DriverError> {
        if self.buf.as_ref().is_none_or(|b| b.len() < len) {
            self.buf = None;
            self.buf = Some(stream.alloc_zeros::<T>(len.max(16))?);
        }
        Ok(self.buf.as_mut().expect("allocated above"))
    }
}

/// The [`Collective`] of one GPU rank: bucket averages on the communication stream ordered
/// against the compute stream by events, host exchanges that wait on their own event.
pub struct NcclCollective {
    // Declared first so it is dropped first: its thread must stop polling the communicator
    // before the communicator is destroyed.
    watchdog: Watchdog,
    comm: Communicator,
    device: Arc<GpuDevice>,
    ready: Vec<CudaEvent>,
    done: Vec<Arc<CudaEvent>>,
    last: Option<usize>,
    step: u64,
    small_f64: Scratch<f64>,
    small_f32: Scratch<f32>,
    timeline: Option<GpuTimeline>,
    /// Synchronised batch norm's sums, once [`NcclCollective::open_side_sums`] made them a
    /// communicator and stream of their own.
    side: Option<SideSums>,
}

/// The communicator and stream of synchronised batch norm's small sums, beside the gradient
/// buckets' (see [`NcclCollective::open_side_sums`]).
struct SideSums {
    comm: Communicator,
    /// Recorded on the compute stream before each sum; the side stream waits for it.
    ready: CudaEvent,
    /// Host sums (a rank replaying a step without images) go through this buffer.
    scratch: Scratch<f64>,
}

impl std::fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCollective")
            .field("rank", &self.comm.rank)
            .field("world", &self.comm.world_size)
            .field("step", &self.step)
            .finish()
    }
}

impl NcclCollective {
    /// The collective of `comm`'s rank; compute runs on `device`'s stream. A collective pending
    /// longer than `timeout` aborts the communicator.
    pub fn new(comm: Communicator, device: Arc<GpuDevice>, timeout: Duration) -> Self {
        NcclCollective {
            watchdog: comm.watchdog(timeout),
            comm,
            device,
            ready: Vec::new(),
            done: Vec::new(),
            last: None,
            step: 0,
            small_f64: Scratch { buf: None },
            small_f32: Scratch { buf: None },
            timeline: None,
            side: None,
        }
    }

    /// Gives synchronised batch norm's sums ([`Collective::sum_sums`]) a communicator and a
    /// stream of their own, so they run beside the gradient buckets' all-reduces instead of
    /// queueing behind them on the communication stream. Every rank calls it at the same point
    /// (a collective call), before its first sync-BN step; `timeout` bounds the wait for the
    /// others.
    ///
    /// The communicator comes from `ncclCommSplit` (NCCL ≥ 2.18, loaded when present); with an
    /// older library, from a second `ncclCommInitRank` whose unique id rank 0 draws and hands
    /// to the others over the first communicator (no second rendezvous). Either way it is
    /// aborted with the first (the watchdog and the abort group reach it) and passes the same
    /// barrier before use.
    pub fn open_side_sums(&mut self, timeout: Duration) -> Result<(), NcclError> {
        if self.side.is_some() {
            return Ok(());
        }
        let (rank, world) = (self.comm.rank, self.comm.world_size);
        let stream = self
            .compute()
            .context()
            .new_stream()
            .map_err(self.driver("create the sync-BN stream"))?;
        let (comm, how) = match self.comm.split(stream.clone(), timeout)? {
            Some(comm) => (comm, "ncclCommSplit"),
            None => {
                let mut id = if rank == 0 {
                    new_unique_id()?
                } else {
                    vec![0u8; UNIQUE_ID_BYTES]
                };
                let mut scratch = Scratch { buf: None };
                let label = "hand-out of the sync-BN communicator's id".to_string();
                self.host_exchange(
                    &self.comm,
                    &mut scratch,
                    &mut id,
                    label,
                    None,
                    |comm, p, n| {
                        // SAFETY: `p` addresses the scratch buffer of `n` bytes, used by the
                        // communication stream only.
                        unsafe { comm.broadcast_raw::<u8>(p, n, 0) }
                    },
                )?;
                let main = self.comm.handle.clone();
                let comm = Communicator::init_unless(stream, rank, world, &id, timeout, &|| {
                    main.is_aborted()
                })?;
                (comm, "a second ncclCommInitRank")
            }
        };
        tracing::info!(
            "rank {rank}: sync-BN sums on a communicator and stream of their own ({how}), on the device"
        );
        self.comm.adopt(&comm);
        comm.barrier(timeout)?;
        let ready = self.event("create the sync-BN ready event")?;
        self.side = Some(SideSums {
            comm,
            ready,
            scratch: Scratch { buf: None },
        });
        Ok(())
    }

    /// Whether synchronised batch norm's sums have their own communicator.
    pub fn has_side_sums(&self) -> bool {
        self.side.is_some()
    }

    /// The communicator.
    pub fn communicator(&self) -> &Communicator {
        &self.comm
    }

    /// Times every bucket's all-reduce on `timeline` (the `--trace` timeline of this GPU).
    pub fn set_timeline(&mut self, timeline: Option<GpuTimeline>) {
        self.timeline = timeline;
    }

    /// The timeline, to add spans or flush it at a step boundary.
    pub fn timeline_mut(&mut self) -> Option<&mut GpuTimeline> {
        self.timeline.as_mut()
    }

    fn driver(&self, op: &'static str) -> impl Fn(DriverError) -> NcclError {
        let rank = self.comm.rank;
        move |source| NcclError::Driver { op, rank, source }
    }

    fn compute(&self) -> &Arc<CudaStream> {
        self.device.stream()
    }

    fn event(&self, op: &'static str) -> Result<CudaEvent, NcclError> {
        self.compute()
            .context()
            .new_event(None)
            .map_err(self.driver(op))
    }

    /// Registers `event` (recorded after a collective) with the watchdog.
    fn watch(&self, label: String, event: &Arc<CudaEvent>) -> Result<(), NcclError> {
        self.watch_within(label, None, event)
    }

    /// [`NcclCollective::watch`] with a timeout of its own (`None`: the collective timeout).
    fn watch_within(
        &self,
        label: String,
        timeout: Option<Duration>,
        event: &Arc<CudaEvent>,
    ) -> Result<(), NcclError> {
        let probe = event.clone();
        let done = move || probe.try_is_complete().map_err(|e| e.to_string());
        match timeout {
            Some(t) => self.watchdog.watch_within(label, t, done)?,
            None => self.watchdog.watch(label, done)?,
        }
        Ok(())
    }

    /// Waits for `event` itself (the host blocks in the driver until the collective is done;
    /// an abort by the watchdog ends the wait too), then reports a fault if there was one.
    fn wait(&self, event: &CudaEvent, op: &'static str) -> Result<(), NcclError> {
        let waited = event.synchronize().map_err(self.driver(op));
        self.check_live()?;
        waited
    }

    /// Ok unless this rank's watchdog fired or the communicator was aborted from elsewhere
    /// (the process's abort group): an aborted collective's event completes too, and its
    /// result must not be taken for a real one.
    fn check_live(&self) -> Result<(), NcclError> {
        self.watchdog.check()?;
        if self.comm.handle.is_aborted() {
            return Err(NcclError::UseAfterAbort {
                rank: self.comm.rank,
            });
        }
        Ok(())
    }

    /// Sums `len` f64 values at device address `ptr` over every rank, after the compute work
    /// issued so far, and copies the result to host memory at `host` on the communication
    /// stream. Returns the event that completes with the copy: the host reads `host` after
    /// waiting for it (one step later, so a step has no host synchronisation).
    ///
    /// # Safety
    /// `ptr` must address `len` live f64 on this device and `host` `len` f64 of page-locked
    /// host memory; neither may be touched until the returned event has completed.
    pub unsafe fn sum_on_device(
        &mut self,
        ptr: u64,
        len: usize,
        host: *mut f64,
        label: &str,
    ) -> Result<Arc<CudaEvent>, NcclError> {
        let after = self.event("record compute for a device sum")?;
        after
            .record(self.compute())
            .map_err(self.driver("record compute for a device sum"))?;
        let stream = self.comm.stream.clone();
        stream
            .wait(&after)
            .map_err(self.driver("order a device sum after compute"))?;
        self.comm.all_reduce_raw::<f64>(ptr, len, false)?;
        let dst = std::slice::from_raw_parts_mut(host, len);
        drv::memcpy_dtoh_async(dst, ptr, stream.cu_stream())
            .map_err(self.driver("copy a device sum to the host"))?;
        // The host waits on it (`wait_device_sum`): blocking sync, no spinning core.
        let done = Arc::new(host_wait_event(&stream).map_err(self.driver("record a device sum"))?);
        done.record(&stream)
            .map_err(self.driver("record a device sum"))?;
        self.watch(format!("{label} in step {}", self.step + 1), &done)?;
        Ok(done)
    }

    /// A collective on host `values`: uploads them into `scratch` on the communication
    /// stream, runs `collective` on the device copy (address, length), waits for it (watched
    /// under `label`, for `timeout` when given, else the collective timeout), and downloads
    /// the result into `values`.
    fn host_exchange<
        T: NcclElement + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits,
    >(
        &self,
        comm: &Communicator,
        scratch: &mut Scratch<T>,
        values: &mut [T],
        label: String,
        timeout: Option<Duration>,
        collective: impl FnOnce(&Communicator, u64, usize) -> Result<(), NcclError>,
    ) -> Result<(), NcclError> {
        let stream = comm.stream.clone();
        let n = values.len();
        let buf = scratch
            .get(&stream, n)
            .map_err(self.driver("allocate a host exchange buffer"))?;
        stream
            .memcpy_htod(values, &mut buf.slice_mut(0..n))
            .map_err(self.driver("upload host values"))?;
        {
            let (p, _record) = cudarc::driver::DevicePtr::device_ptr(&*buf, &stream);
            collective(comm, p, n)?;
        }
        let done =
            Arc::new(host_wait_event(&stream).map_err(self.driver("record a host exchange"))?);
        done.record(&stream)
            .map_err(self.driver("record a host exchange"))?;
        self.watch_within(label, timeout, &done)?;
        self.wait(&done, "wait for a host exchange")?;
        stream
            .memcpy_dtoh(&buf.slice(0..n), values)
            .map_err(self.driver("download host values"))?;
        // The download into pageable memory is done when the call returns; the event's wait
        // (not a stream synchronise, which spins under the default scheduling) is a guard.
        done.record(&stream)
            .map_err(self.driver("download host values"))?;
        done.synchronize()
            .map_err(self.driver("download host values"))
    }

    /// Sums `len` f64 at device address `ptr` over every rank on the side communicator:
    /// after the compute work issued so far, before the compute work issued next (events), with
    /// no host wait.
    fn side_device_sum(&self, side: &SideSums, ptr: u64, len: usize) -> Result<(), NcclError> {
        self.check_live()?;
        side.ready
            .record(self.compute())
            .map_err(self.driver("record compute for a sync-BN sum"))?;
        let stream = side.comm.stream();
        stream
            .wait(&side.ready)
            .map_err(self.driver("order a sync-BN sum after compute"))?;
        // SAFETY: the backend's sums hold `len` live f64 at `ptr` (DeviceSums); compute wrote
        // them before `ready` and reads them again only after `done`.
        unsafe { side.comm.all_reduce_raw::<f64>(ptr, len, false) }?;
        let done = Arc::new(self.event("record a sync-BN sum")?);
        done.record(stream)
            .map_err(self.driver("record a sync-BN sum"))?;
        self.compute()
            .wait(&done)
            .map_err(self.driver("order compute after a sync-BN sum"))?;
        self.watch(
            format!("sync-BN sum of {len} values in step {}", self.step + 1),
            &done,
        )
    }

    /// A sum of host values over every rank, watched for `timeout` (`None`: the collective
    /// timeout).
    fn sum_for(
        &mut self,
        values: &mut [f64],
        timeout: Option<Duration>,
    ) -> Result<(), CollectiveError> {
        let mut scratch = std::mem::replace(&mut self.small_f64, Scratch { buf: None });
        let label = format!("sum of {} values in step {}", values.len(), self.step + 1);
        let result = self.host_exchange(
            &self.comm,
            &mut scratch,
            values,
            label,
            timeout,
            |comm, p, n| {
                // SAFETY: as in `broadcast`.
                unsafe { comm.all_reduce_raw::<f64>(p, n, false) }
            },
        );
        self.small_f64 = scratch;
        Ok(result?)
    }

    /// Waits for an event returned by [`NcclCollective::sum_on_device`].
    pub fn wait_device_sum(&self, event: &CudaEvent) -> Result<(), NcclError> {
        self.wait(event, "wait for a device sum")
    }
}

impl Collective for NcclCollective {
    type Buffer = DeviceGrads;

    fn rank(&self) -> usize {
        self.comm.rank
    }

    fn world_size(&self) -> usize {
        self.comm.world_size
    }

    fn start_average(
        &mut self,
        buffer: &mut DeviceGrads,
        bucket: usize,
        range: Range<usize>,
        scale: f32,
    ) -> Result<(), CollectiveError> {
        let rank = self.comm.rank;
        self.check_live()?;
        if range.start > range.end || range.end > buffer.len {
            return Err(NcclError::OutOfRange {
                rank,
                range,
                len: buffer.len,
            }
            .into());
        }
        let ptr = buffer.ptr + 4 * range.start as u64;
        if scale != 1.0 {
            // On the compute stream, after the kernels that wrote the bucket.
            grad::scale_f32(&self.device, ptr, range.len(), scale)
                .map_err(|source| NcclError::Kernel { rank, source })?;
        }
        while self.ready.len() <= bucket {
            let ready = self.event("create bucket-ready event")?;
            let done = Arc::new(self.event("create bucket-done event")?);
            self.ready.push(ready);
            self.done.push(done);
        }
        self.ready[bucket]
            .record(self.compute())
            .map_err(self.driver("record bucket-ready event"))?;
        let stream = self.comm.stream.clone();
        stream
            .wait(&self.ready[bucket])
            .map_err(self.driver("wait bucket-ready event"))?;
        let span = match &self.timeline {
            Some(t) => t
                .begin(&stream)
                .map_err(self.driver("record trace event"))?,
            None => None,
        };
        // SAFETY: the range lies inside the arena (checked), which the network keeps alive;
        // the compute stream writes it only before `ready` and after `done` (finish_averages).
        unsafe { self.comm.all_reduce_raw::<f32>(ptr, range.len(), true) }?;
        if let Some(t) = &mut self.timeline {
            t.end(
                span,
                &stream,
                format!("all-reduce bucket {bucket}"),
                "comm",
                rows::COMM,
            )
            .map_err(|source| NcclError::Driver {
                op: "record trace event",
                rank,
                source,
            })?;
        }
        self.done[bucket]
            .record(&stream)
            .map_err(self.driver("record bucket-done event"))?;
        let label = format!("all-reduce of bucket {bucket} in step {}", self.step + 1);
        let done = self.done[bucket].clone();
        self.watch(label, &done)?;
        self.last = Some(bucket);
        Ok(())
    }

    fn finish_averages(&mut self, _buffer: &mut DeviceGrads) -> Result<(), CollectiveError> {
        self.step += 1;
        self.check_live()?;
        // The communication stream runs buckets in order: the last one done means all are.
        if let Some(last) = self.last.take() {
            self.compute()
                .wait(&self.done[last])
                .map_err(self.driver("wait for the last bucket"))?;
        }
        Ok(())
    }

    fn broadcast(&mut self, values: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        let mut scratch = std::mem::replace(&mut self.small_f32, Scratch { buf: None });
        let label = format!("broadcast of {} values from rank {root}", values.len());
        let result = self.host_exchange(
            &self.comm,
            &mut scratch,
            values,
            label,
            None,
            |comm, p, n| {
                // SAFETY: `p` addresses the scratch buffer of at least `n` values, used by the
                // communication stream only.
                unsafe { comm.broadcast_raw::<f32>(p, n, root) }
            },
        );
        self.small_f32 = scratch;
        Ok(result?)
    }

    fn sum(&mut self, values: &mut [f64]) -> Result<(), CollectiveError> {
        self.sum_for(values, None)
    }

    fn sum_within(&mut self, values: &mut [f64], timeout: Duration) -> Result<(), CollectiveError> {
        self.sum_for(values, Some(timeout))
    }

    fn sum_sums(&mut self, mut sums: SumsMut<'_>) -> Result<(), CollectiveError> {
        let Some(mut side) = self.side.take() else {
            // No side communicator: through the host, on the main one.
            let rank = self.comm.rank;
            return sums.sum_through_host(|v| self.sum(v)).map_err(|e| match e {
                SumThroughHostError::Sum(e) => e,
                SumThroughHostError::Device(e) => CollectiveError::Buffer {
                    rank,
                    detail: format!("synchronised batch norm's sums: {e}"),
                },
            });
        };
        let result = match &mut sums {
            SumsMut::Device(d) => self.side_device_sum(&side, d.device_ptr(), d.len()),
            SumsMut::Host(values) => {
                let label = format!(
                    "sync-BN sum of {} values in step {}",
                    values.len(),
                    self.step + 1
                );
                let mut scratch = std::mem::replace(&mut side.scratch, Scratch { buf: None });
                let r = self.host_exchange(
                    &side.comm,
                    &mut scratch,
                    values,
                    label,
                    None,
                    |comm, p, n| {
                        // SAFETY: as in `sum`, on the side communicator's stream.
                        unsafe { comm.all_reduce_raw::<f64>(p, n, false) }
                    },
                );
                side.scratch = scratch;
                r
            }
        };
        self.side = Some(side);
        Ok(result?)
    }

    fn check(&self) -> Result<(), CollectiveError> {
        Ok(self.check_live()?)
    }

    fn abort(&self, reason: &str) {
        tracing::error!(
            "rank {}: aborting the NCCL communicator: {reason}",
            self.comm.rank
        );
        if let Err(e) = Abortable::abort(&*self.comm.handle) {
            tracing::warn!("rank {}: ncclCommAbort: {e}", self.comm.rank);
        }
    }
}
