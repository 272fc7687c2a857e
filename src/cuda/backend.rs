//! [`CudaBackend`]: the [`Backend`] ops on one GPU, bf16 activations and weights, f32
//! accumulation, f32 parameter gradients and batch-norm statistics, NHWC.
//!
//! Every op validates lengths like the CPU backend, then queues its kernels on the device's one
//! compute stream; only `download` and the loss (which returns host statistics) wait for the
//! GPU. Scratch buffers (BN partial sums, the staged u8 batch, labels, per-row losses) live in a
//! workspace that grows to the largest batch seen and is then reused: no allocation per step.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};

use super::conv::{self, Conv2Launch, ConvVersion, GpuLimits, Pass};
use super::device::GpuDevice;
use super::error::CudaError;
use super::tensor::{from_bf16_bits, to_bf16_bits, CudaTensor, DType, Storage};
use crate::backend::{
    Backend, BackendError, BnBackward, BnForward, BnGradEpilogue, BnMode, BnShape, BnSyncBackward,
    ConvShape, DeviceSums, LinearShape, LossStats, PoolShape, SumsMut, Targets, TensorRole,
};
use crate::model::{Augment, InputBatch, Mix, PixelBox, IMAGENET_MEAN, IMAGENET_STD};

/// A null device pointer for optional kernel arguments.
static NULL_PTR: u64 = 0;

/// Threads per block of the element-wise kernels.
const THREADS: u32 = 256;
/// Threads per block of the implicit-GEMM convolution kernels (kernels/conv.cu).
const CONV_THREADS: u32 = 256;
/// Output tile of the convolution kernels (BM = BN).
const CONV_TILE: usize = 128;

/// Kernel-side mirror of `struct ConvShape` in kernels/conv.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ConvArgs {
    n: i32,
    h: i32,
    w: i32,
    c: i32,
    k: i32,
    r: i32,
    s: i32,
    p: i32,
    q: i32,
    stride: i32,
    pad: i32,
    k_chunk: i32,
    accumulate: i32,
}

// SAFETY: plain-old-data with the C layout the kernel declares.
unsafe impl DeviceRepr for ConvArgs {}

/// The batch's mixing as kernels/input.cu's `InputMix` takes it, by value: kind 0 (none), 1
/// (mixup, `lambda`) or 2 (CutMix, the box `y0..y1` × `x0..x1`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct InputMix {
    kind: i32,
    lambda: f32,
    y0: i32,
    y1: i32,
    x0: i32,
    x1: i32,
}

// SAFETY: plain-old-data with the C layout the kernel declares.
unsafe impl DeviceRepr for InputMix {}

impl InputMix {
    /// The kernel's form of `mix`. The box only chooses which image a pixel is read from, so
    /// even a box outside the image reads nothing out of bounds.
    pub(crate) fn of(mix: Option<Mix>) -> Self {
        match mix {
            None => Self::default(),
            Some(Mix::Blend { lambda }) => Self {
                kind: 1,
                lambda,
                ..Self::default()
            },
            Some(Mix::Paste(PixelBox { y0, y1, x0, x1 })) => Self {
                kind: 2,
                lambda: 0.0,
                y0: y0 as i32,
                y1: y1 as i32,
                x0: x0 as i32,
                x1: x1 as i32,
            },
        }
    }
}

/// One image's entry of kernels/input.cu's `aug` array: dy, dx, flip, then the erased box
/// (rows, columns; all 0 when none). A side past i32 is clamped: the box only chooses pixels
/// to zero, so no box reads out of bounds.
pub(crate) fn aug_ints(a: &Augment) -> [i32; 7] {
    let e = a.erase.unwrap_or_default();
    let side = |v: u32| v.min(i32::MAX as u32) as i32;
    [
        a.dy,
        a.dx,
        i32::from(a.flip),
        side(e.y0),
        side(e.y1),
        side(e.x0),
        side(e.x1),
    ]
}

/// Scratch of the v2 convolutions (grown, never shrunk).
#[derive(Debug, Default)]
struct Conv2Scratch {
    x8: Option<CudaSlice<u16>>,
    w8: Option<CudaSlice<u16>>,
    wt: Option<CudaSlice<u16>>,
    /// The split wgrad's partial sums, one weight-sized f32 plane per reduction slice.
    planes: Option<CudaSlice<f32>>,
}

/// Scratch buffers reused across steps (grown, never shrunk).
#[derive(Debug, Default)]
struct Workspace {
    f32a: Option<CudaSlice<f32>>,
    f32b: Option<CudaSlice<f32>>,
    pixels: Option<CudaSlice<u8>>,
    ints: Option<CudaSlice<i32>>,
    ints2: Option<CudaSlice<i32>>,
    norm: Option<CudaSlice<f32>>,
    /// `norm` holds the ImageNet scale/shift (a pageable upload synchronises the stream, so
    /// the constants go up once, not every step).
    norm_ready: bool,
    /// Synchronised batch norm's global reductions dgamma and dbeta (f32 [C] each).
    sync_a: Option<CudaSlice<f32>>,
    sync_b: Option<CudaSlice<f32>>,
}

/// Synchronised batch norm's sums on the GPU (f64 device memory): the collective sums them in
/// place on the device, or, without a device path, through the host.
pub struct CudaSums {
    buf: CudaSlice<f64>,
    stream: Arc<cudarc::driver::CudaStream>,
}

impl std::fmt::Debug for CudaSums {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaSums")
            .field("len", &self.buf.len())
            .finish()
    }
}

impl DeviceSums for CudaSums {
    fn device_ptr(&self) -> u64 {
        use cudarc::driver::DevicePtr;
        let (p, _record) = self.buf.device_ptr(&self.stream);
        p
    }

    fn len(&self) -> usize {
        self.buf.len()
    }

    fn download(&self) -> Result<Vec<f64>, BackendError> {
        // On the compute stream, after the kernels that wrote them (returns when copied).
        self.stream
            .clone_dtoh(&self.buf)
            .map_err(drv_err("download synchronised BN sums"))
    }

    fn upload(&mut self, values: &[f64]) -> Result<(), BackendError> {
        if values.len() != self.buf.len() {
            return Err(BackendError::Shape {
                op: "upload synchronised BN sums",
                detail: format!("{} values into {}", values.len(), self.buf.len()),
            });
        }
        self.stream
            .memcpy_htod(values, &mut self.buf)
            .map_err(drv_err("upload synchronised BN sums"))
    }
}

/// Per-launch timing (the `--breakdown` of `bench step`).
#[derive(Debug, Default)]
struct Profiler {
    enabled: bool,
    events: Vec<ProfiledLaunch>,
}

/// One timed launch and the work it did (when the op declared it).
#[derive(Debug)]
struct ProfiledLaunch {
    name: &'static str,
    start: CudaEvent,
    end: CudaEvent,
    bytes: f64,
    flops: f64,
}

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

/// The CUDA backend on one device.
#[derive(Debug, Clone)]
pub struct CudaBackend {
    dev: Arc<GpuDevice>,
    sms: u32,
    /// Which convolution kernels run (`BIRDTRAIN_CONV`, see [`conv`]).
    conv: ConvVersion,
    /// What the v2 tile choice models.
    limits: GpuLimits,
    /// Whether networks run batch norm fused into the convolutions (`BIRDTRAIN_BN_FUSION`, on
    /// unless `0`, [`bn_fused`]); it takes the v2 kernels.
    bn_fusion: bool,
    /// v2 scratch: the 8-channel stem input and weight, the phase-ordered dgrad weight.
    conv2: Arc<Mutex<Conv2Scratch>>,
    work: Arc<Mutex<Workspace>>,
    profiler: Arc<Mutex<Profiler>>,
}

fn dev_err(op: &'static str) -> impl Fn(CudaError) -> BackendError {
    move |e| BackendError::Device {
        op,
        source: Box::new(e),
    }
}

fn drv_err(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> BackendError {
    move |e| BackendError::Device {
        op,
        source: Box::new(CudaError::Driver {
            context: op.to_string(),
            source: e,
        }),
    }
}

fn check_len(op: &'static str, what: &str, got: usize, want: usize) -> Result<(), BackendError> {
    if got < want {
        return Err(BackendError::Shape {
            op,
            detail: format!("{what} has {got} elements, needs at least {want}"),
        });
    }
    Ok(())
}

fn to_i32(op: &'static str, what: &str, v: usize) -> Result<i32, BackendError> {
    i32::try_from(v).map_err(|_| BackendError::Shape {
        op,
        detail: format!("{what} = {v} exceeds the kernels' 32-bit index range"),
    })
}

/// Ensures `slot` holds at least `len` elements (allocating only when it must grow).
fn ensure<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    dev: &GpuDevice,
    slot: &mut Option<CudaSlice<T>>,
    len: usize,
    op: &'static str,
) -> Result<(), BackendError> {
    if slot.as_ref().is_none_or(|s| s.len() < len) {
        *slot = None;
        *slot = Some(
            dev.stream()
                .alloc_zeros::<T>(len.max(1))
                .map_err(|e| oom_or_device(op, len * size_of::<T>(), e))?,
        );
        dev.note_allocation(len.max(1) * size_of::<T>());
    }
    Ok(())
}

fn oom_or_device(op: &'static str, bytes: usize, e: cudarc::driver::DriverError) -> BackendError {
    if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        BackendError::OutOfMemory {
            bytes,
            what: format!("{op} on the GPU"),
            hint: "use a smaller --batch-size".into(),
        }
    } else {
        drv_err(op)(e)
    }
}

/// One thread per channel, 128 per block (bn_eval_prepare, the bn_sync_* kernels).
fn per_channel_cfg(c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(128).max(1) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `sums` holds exactly `want` values (a reducer sums all of them).
fn check_sums(op: &'static str, sums: &CudaSums, want: usize) -> Result<(), BackendError> {
    if sums.buf.len() != want {
        return Err(BackendError::Shape {
            op,
            detail: format!("{} sums, needs {want}", sums.buf.len()),
        });
    }
    Ok(())
}

fn elementwise_cfg(total: usize) -> LaunchConfig {
    let blocks = total.div_ceil(THREADS as usize).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches `$name` of `$file` with the listed arguments, timed when profiling is on.
macro_rules! launch {
    ($self:expr, $op:expr, $file:expr, $name:expr, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        let f = $self.dev.function($file, $name).map_err(dev_err($op))?;
        let stream = $self.dev.stream();
        let mut b = stream.launch_builder(&f);
        $( b.arg($arg); )*
        let timing = $self.profile_begin()?;
        // SAFETY: the arguments match the kernel's signature in kernels/$file (checked by the
        // GPU tests against the CPU backend); every buffer was length-checked above.
        unsafe { b.launch($cfg) }.map_err(drv_err($op))?;
        $self.profile_end($name, timing)?;
    }};
}

// After the macro, which it uses.
#[path = "bn_fused.rs"]
mod bn_fused;
pub use bn_fused::{bn_fusion_from_env, parse_bn_fusion, BN_FUSION_ENV};

impl CudaBackend {
    /// The backend on device `ordinal`; kernels compile (or load from the disk cache) now.
    pub fn new(ordinal: usize) -> Result<CudaBackend, CudaError> {
        let dev = GpuDevice::open(ordinal)?;
        dev.warm_up()?;
        let sms = dev
            .context()
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(CudaError::driver("reading the SM count"))? as u32;
        let smem_per_sm = dev
            .context()
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            )
            .map_err(CudaError::driver("reading the shared memory per SM"))? as usize;
        Ok(CudaBackend {
            dev,
            sms,
            conv: ConvVersion::from_env()?,
            bn_fusion: bn_fusion_from_env()?,
            limits: GpuLimits {
                sms: sms as usize,
                smem_per_sm,
            },
            conv2: Arc::default(),
            work: Arc::default(),
            profiler: Arc::default(),
        })
    }

    /// Which convolution kernels this backend launches.
    pub fn conv_version(&self) -> ConvVersion {
        self.conv
    }

    /// Switches the convolution kernels (tests compare v1 and v2 on one device).
    pub fn set_conv_version(&mut self, version: ConvVersion) {
        self.conv = version;
    }

    /// The v2 launch of `pass`, when v2 is selected and takes this shape (else v1 runs).
    fn conv2_plan(&self, pass: Pass, s: &ConvShape) -> Option<Conv2Launch> {
        (self.conv == ConvVersion::V2)
            .then(|| conv::plan(pass, s, &self.limits).ok())
            .flatten()
    }

    /// `dst` = the `rows` rows of `src` (`c_from` channels) widened to 8 channels with zeros.
    fn pad_to_8(
        &self,
        op: &'static str,
        src: &CudaSlice<u16>,
        rows: usize,
        c_from: usize,
        dst: &mut Option<CudaSlice<u16>>,
    ) -> Result<(), BackendError> {
        ensure(&self.dev, dst, rows * 8, op)?;
        let dst = dst.as_mut().expect("ensured");
        let (rows_i, from, to) = (rows as i64, to_i32(op, "c_in", c_from)?, 8i32);
        launch!(
            self,
            op,
            "conv2.cu",
            "conv2_pad_channels",
            elementwise_cfg(rows),
            [src, dst, &rows_i, &from, &to]
        );
        Ok(())
    }

    /// The launch of BN's 16-byte element-wise kernel `name` over `groups` 8-channel groups:
    /// 256 threads, one wave of blocks (as many as fit the SMs at once, so none waits for a
    /// second wave), each thread walking many rows; the stride (blocks × 256) is a multiple of
    /// C / 8 whenever C / 8 divides 256 (every ResNet layer), so a thread's channels, whose
    /// parameters it keeps in registers, never change.
    fn channel_rows_cfg(
        &self,
        op: &'static str,
        name: &'static str,
        groups: usize,
    ) -> Result<LaunchConfig, BackendError> {
        let resident = self
            .dev
            .resident_blocks("bn.cu", name, THREADS)
            .map_err(dev_err(op))?;
        let wave = (resident.max(1) * self.sms.max(1)) as usize;
        let blocks = groups.div_ceil(THREADS as usize).clamp(1, wave) as u32;
        Ok(LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// Raises the kernel's dynamic shared memory limit to what `l` needs (> 48 KiB).
    /// The weights as the data-gradient kernel of `l` reads them: `w` itself, or, when the
    /// plan asks for it, `w` rearranged into the scratch's `wt` (one copy for the plain and
    /// the batch-norm epilogue kernels).
    fn dgrad_weights<'a>(
        &self,
        op: &'static str,
        l: &Conv2Launch,
        s: &ConvShape,
        w: &'a CudaSlice<u16>,
        scratch: &'a mut Conv2Scratch,
    ) -> Result<&'a CudaSlice<u16>, BackendError> {
        if !l.rearrange_weight {
            return Ok(w);
        }
        ensure(&self.dev, &mut scratch.wt, s.w_len(), op)?;
        let wt = scratch.wt.as_mut().expect("ensured");
        launch!(
            self,
            op,
            "conv2.cu",
            "conv2_dgrad_weights",
            elementwise_cfg(s.w_len() / 8),
            [w, wt, &l.args]
        );
        Ok(scratch.wt.as_ref().expect("ensured"))
    }

    fn conv2_prepare(
        &self,
        op: &'static str,
        l: &Conv2Launch,
    ) -> Result<LaunchConfig, BackendError> {
        self.dev
            .function("conv2.cu", l.kernel)
            .map_err(dev_err(op))?
            .set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                l.smem_bytes as i32,
            )
            .map_err(drv_err(op))?;
        Ok(LaunchConfig {
            grid_dim: l.grid,
            block_dim: (l.tile.threads(), 1, 1),
            shared_mem_bytes: l.smem_bytes,
        })
    }

    /// The device.
    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.dev
    }

    /// Waits for every queued op.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.dev.synchronize()
    }

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

    fn profile_begin(&self) -> Result<Option<CudaEvent>, BackendError> {
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

    fn profile_end(
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
    fn note_work(&self, bytes: usize, flops: f64) {
        let mut p = self.profiler.lock().unwrap_or_else(|e| e.into_inner());
        if p.enabled {
            if let Some(last) = p.events.last_mut() {
                last.bytes = bytes as f64;
                last.flops = flops;
            }
        }
    }

    fn work(&self) -> std::sync::MutexGuard<'_, Workspace> {
        self.work.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rows per slab and slab count of a per-channel reduction over `rows` rows.
    fn slabs(&self, rows: usize) -> (usize, usize) {
        let target = (4 * self.sms as usize).max(1);
        let slabs = rows.div_ceil(64).clamp(1, target);
        let per = rows.div_ceil(slabs);
        (per, rows.div_ceil(per))
    }

    fn conv_args(op: &'static str, s: &ConvShape) -> Result<ConvArgs, BackendError> {
        if s.kernel == 0
            || s.stride == 0
            || s.h + 2 * s.padding < s.kernel
            || s.w + 2 * s.padding < s.kernel
        {
            return Err(BackendError::Shape {
                op,
                detail: format!(
                    "{s:?}: kernel larger than the padded input, or zero kernel/stride"
                ),
            });
        }
        Ok(ConvArgs {
            n: to_i32(op, "n", s.n)?,
            h: to_i32(op, "h", s.h)?,
            w: to_i32(op, "w", s.w)?,
            c: to_i32(op, "c_in", s.c_in)?,
            k: to_i32(op, "c_out", s.c_out)?,
            r: to_i32(op, "kernel", s.kernel)?,
            s: to_i32(op, "kernel", s.kernel)?,
            p: to_i32(op, "out_h", s.out_h())?,
            q: to_i32(op, "out_w", s.out_w())?,
            stride: to_i32(op, "stride", s.stride)?,
            pad: to_i32(op, "padding", s.padding)?,
            k_chunk: 0,
            accumulate: 0,
        })
        .and_then(|a| {
            // Flat indices of every operand must fit the kernels' 32-bit GEMM coordinates.
            to_i32(op, "x elements", s.x_len())?;
            to_i32(op, "y elements", s.y_len())?;
            Ok(a)
        })
    }

    fn pool_check(op: &'static str, s: &PoolShape) -> Result<(), BackendError> {
        if s.kernel == 0
            || s.stride == 0
            || s.h + 2 * s.padding < s.kernel
            || s.w + 2 * s.padding < s.kernel
            || s.padding >= s.kernel
        {
            return Err(BackendError::Shape {
                op,
                detail: format!("{s:?}: window larger than the padded input, or padding ≥ kernel"),
            });
        }
        Ok(())
    }
}

fn gemm_grid(m: usize, n: usize, z: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            m.div_ceil(CONV_TILE) as u32,
            n.div_ceil(CONV_TILE) as u32,
            z as u32,
        ),
        block_dim: (CONV_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Sums = CudaSums;

    fn alloc_sums(&self, len: usize) -> Result<CudaSums, BackendError> {
        let op = "alloc_sums";
        let buf = self
            .dev
            .stream()
            .alloc_zeros::<f64>(len.max(1))
            .map_err(|e| oom_or_device(op, 8 * len, e))?;
        self.dev.note_allocation(8 * len.max(1));
        Ok(CudaSums {
            buf,
            stream: self.dev.stream().clone(),
        })
    }

    fn sums_mut<'a>(&self, sums: &'a mut CudaSums) -> SumsMut<'a> {
        SumsMut::Device(sums)
    }

    fn bn_sync_moments(
        &self,
        shape: BnShape,
        mean: &CudaTensor,
        var: &CudaTensor,
        moments: &mut CudaSums,
    ) -> Result<(), BackendError> {
        let op = "bn_sync_moments";
        let c = shape.channels;
        check_len(op, "mean", mean.len, c)?;
        check_len(op, "var", var.len, c)?;
        check_sums(op, moments, crate::backend::bn_sync::moments_len(c))?;
        let (c_i, rows) = (to_i32(op, "channels", c)?, shape.rows as f64);
        let (m, v) = (mean.f32(op, "mean")?, var.f32(op, "var")?);
        launch!(
            self,
            op,
            "bn.cu",
            "bn_sync_moments",
            per_channel_cfg(c),
            [m, v, &rows, &c_i, &mut moments.buf]
        );
        Ok(())
    }

    fn bn_sync_statistics(
        &self,
        channels: usize,
        moments: &mut CudaSums,
        mean: &mut CudaTensor,
        var: &mut CudaTensor,
        running_mean: &mut CudaTensor,
        running_var: &mut CudaTensor,
        momentum: f32,
    ) -> Result<(), BackendError> {
        let op = "bn_sync_statistics";
        let c = channels;
        for (what, len) in [
            ("mean", mean.len),
            ("var", var.len),
            ("running_mean", running_mean.len),
            ("running_var", running_var.len),
        ] {
            check_len(op, what, len, c)?;
        }
        check_sums(op, moments, crate::backend::bn_sync::moments_len(c))?;
        let c_i = to_i32(op, "channels", c)?;
        let (m, v) = (mean.f32_mut(op, "mean")?, var.f32_mut(op, "var")?);
        let (rm, rv) = (
            running_mean.f32_mut(op, "running_mean")?,
            running_var.f32_mut(op, "running_var")?,
        );
        launch!(
            self,
            op,
            "bn.cu",
            "bn_sync_statistics",
            per_channel_cfg(c),
            [&moments.buf, &c_i, &momentum, m, v, rm, rv]
        );
        Ok(())
    }

    fn bn_sync_grad_sums(
        &self,
        shape: BnShape,
        moments: &mut CudaSums,
        dgamma: &CudaTensor,
        dbeta: &CudaTensor,
        grads: &mut CudaSums,
    ) -> Result<(), BackendError> {
        let op = "bn_sync_grad_sums";
        let c = shape.channels;
        check_len(op, "dgamma", dgamma.len, c)?;
        check_len(op, "dbeta", dbeta.len, c)?;
        check_sums(op, moments, crate::backend::bn_sync::moments_len(c))?;
        check_sums(op, grads, crate::backend::bn_sync::grad_sums_len(c))?;
        let (c_i, rows) = (to_i32(op, "channels", c)?, shape.rows as f64);
        let (dg, db) = (dgamma.f32(op, "dgamma")?, dbeta.f32(op, "dbeta")?);
        launch!(
            self,
            op,
            "bn.cu",
            "bn_sync_grad_sums",
            per_channel_cfg(c),
            [dg, db, &moments.buf, &rows, &c_i, &mut grads.buf]
        );
        Ok(())
    }

    fn bn_sync_backward(
        &self,
        grads: &mut CudaSums,
        a: BnSyncBackward<'_, CudaTensor>,
    ) -> Result<(), BackendError> {
        let op = "bn_sync_backward";
        let (rows, c) = (a.shape.rows, a.shape.channels);
        for (what, len) in [
            ("gamma", a.gamma.len),
            ("saved_mean", a.saved_mean.len),
            ("saved_invstd", a.saved_invstd.len),
        ] {
            check_len(op, what, len, c)?;
        }
        for (what, len) in [
            ("x", a.x.len),
            ("y", a.y.len),
            ("dy", a.dy.len),
            ("dx", a.dx.len),
        ] {
            check_len(op, what, len, rows * c)?;
        }
        check_sums(op, grads, crate::backend::bn_sync::grad_sums_len(c))?;
        if c == 0 || rows == 0 {
            return Ok(());
        }
        let c_i = to_i32(op, "channels", c)?;
        let total = (rows * c) as i64;
        let mut work = self.work();
        let w = &mut *work;
        ensure(&self.dev, &mut w.sync_a, c, op)?;
        ensure(&self.dev, &mut w.sync_b, c, op)?;
        let (dgamma, dbeta) = (
            w.sync_a.as_mut().expect("ensured"),
            w.sync_b.as_mut().expect("ensured"),
        );
        launch!(
            self,
            op,
            "bn.cu",
            "bn_sync_reductions",
            per_channel_cfg(c),
            [&grads.buf, &c_i, &mut *dgamma, &mut *dbeta]
        );
        // The batch-statistics backward's own element-wise pass, on the global reductions (in
        // the workspace, in stream order: no wait, no host copy); the residual's gradient was
        // written by the frozen-statistics backward before.
        let (x, y, dy) = (a.x.bf16(op, "x")?, a.y.bf16(op, "y")?, a.dy.bf16(op, "dy")?);
        let (mean, invstd) = (
            a.saved_mean.f32(op, "saved_mean")?,
            a.saved_invstd.f32(op, "saved_invstd")?,
        );
        let gamma = a.gamma.bf16(op, "gamma")?;
        let dx = a.dx.bf16_mut(op, "dx")?;
        let (relu, batch_stats, acc) = (i32::from(a.relu), 1i32, 0i32);
        let vec = c % 8 == 0;
        let apply = if vec {
            "bn_bwd_apply_vec"
        } else {
            "bn_bwd_apply"
        };
        let cfg = if vec {
            self.channel_rows_cfg(op, apply, rows * c / 8)?
        } else {
            elementwise_cfg(rows * c)
        };
        launch!(
            self,
            op,
            "bn.cu",
            apply,
            cfg,
            [
                dy,
                y,
                x,
                mean,
                invstd,
                gamma,
                &*dbeta,
                &*dgamma,
                &total,
                &c_i,
                &relu,
                &batch_stats,
                dx,
                &NULL_PTR,
                &acc
            ]
        );
        self.note_work(2 * rows * c * (4 + usize::from(a.relu)), 0.0);
        Ok(())
    }

    fn name(&self) -> String {
        format!(
            "cuda:{} {} ({})",
            self.dev.context().ordinal(),
            self.dev.name(),
            self.dev.arch()
        )
    }

    fn alloc(&self, len: usize, role: TensorRole) -> Result<CudaTensor, BackendError> {
        let dtype = DType::for_role(role);
        let storage = if len == 0 {
            Storage::Empty
        } else {
            let stream = self.dev.stream();
            let bytes = len * dtype.size();
            self.dev.note_allocation(bytes);
            match dtype {
                DType::Bf16 => Storage::Bf16(
                    stream
                        .alloc_zeros::<u16>(len)
                        .map_err(|e| oom_or_device("alloc", bytes, e))?,
                ),
                DType::F32 => Storage::F32(
                    stream
                        .alloc_zeros::<f32>(len)
                        .map_err(|e| oom_or_device("alloc", bytes, e))?,
                ),
            }
        };
        Ok(CudaTensor {
            len,
            dtype,
            storage,
            view_of: None,
        })
    }

    fn alloc_views(
        &self,
        total: usize,
        ranges: &[std::ops::Range<usize>],
        role: TensorRole,
    ) -> Result<Option<(u64, Vec<CudaTensor>)>, BackendError> {
        let op = "alloc_views";
        if DType::for_role(role) != DType::F32 {
            return Err(BackendError::Shape {
                op,
                detail: format!("views are f32 ({role:?} is stored as bf16)"),
            });
        }
        if let Some(bad) = ranges.iter().find(|r| r.start > r.end || r.end > total) {
            return Err(BackendError::Shape {
                op,
                detail: format!("range {bad:?} is outside the {total}-element buffer"),
            });
        }
        let stream = self.dev.stream().clone();
        let arena = Arc::new(
            stream
                .alloc_zeros::<f32>(total.max(1))
                .map_err(|e| oom_or_device(op, 4 * total, e))?,
        );
        self.dev.note_allocation(4 * total.max(1));
        let base = {
            let (p, _record) = cudarc::driver::DevicePtr::device_ptr(&*arena, &stream);
            p
        };
        let views = ranges
            .iter()
            // SAFETY: every range lies inside the arena (checked above); the views and the
            // arena are used on this backend's one stream (or ordered by events).
            .map(|r| unsafe { CudaTensor::f32_view(&arena, &stream, r.start, r.len()) })
            .collect();
        Ok(Some((base, views)))
    }

    fn len(&self, t: &CudaTensor) -> usize {
        t.len
    }

    fn upload(&self, src: &[f32], dst: &mut CudaTensor) -> Result<(), BackendError> {
        if src.len() != dst.len {
            return Err(BackendError::Shape {
                op: "upload",
                detail: format!("{} values into a tensor of {}", src.len(), dst.len),
            });
        }
        let stream = self.dev.stream().clone();
        match &mut dst.storage {
            Storage::Empty => Ok(()),
            Storage::Bf16(d) => stream
                .memcpy_htod(&to_bf16_bits(src), d)
                .map_err(drv_err("upload")),
            Storage::F32(d) => stream.memcpy_htod(src, d).map_err(drv_err("upload")),
        }
    }

    fn download(&self, src: &CudaTensor) -> Result<Vec<f32>, BackendError> {
        let stream = self.dev.stream();
        let out = match &src.storage {
            Storage::Empty => Vec::new(),
            Storage::Bf16(s) => from_bf16_bits(&stream.clone_dtoh(s).map_err(drv_err("download"))?),
            Storage::F32(s) => stream.clone_dtoh(s).map_err(drv_err("download"))?,
        };
        stream.synchronize().map_err(drv_err("download"))?;
        Ok(out)
    }

    fn input(&self, batch: &InputBatch<'_>, out: &mut CudaTensor) -> Result<(), BackendError> {
        let op = "input";
        let s = batch.image_size as usize;
        let n = batch.len;
        let bytes = n * s * s * 3;
        check_len(op, "pixels", batch.pixels.len(), bytes)?;
        check_len(op, "output", out.len, bytes)?;
        let mut work = self.work();
        let w = &mut *work;
        ensure(&self.dev, &mut w.pixels, bytes, op)?;
        ensure(&self.dev, &mut w.norm, 6, op)?;
        let stream = self.dev.stream().clone();
        let pixels = w.pixels.as_mut().expect("ensured");
        stream
            .memcpy_htod(&batch.pixels[..bytes], pixels)
            .map_err(drv_err(op))?;
        let norm_buf = w.norm.as_mut().expect("ensured");
        if !w.norm_ready {
            let norm: Vec<f32> = (0..3)
                .map(|c| 1.0 / (255.0 * IMAGENET_STD[c]))
                .chain((0..3).map(|c| -IMAGENET_MEAN[c] / IMAGENET_STD[c]))
                .collect();
            stream.memcpy_htod(&norm, norm_buf).map_err(drv_err(op))?;
            w.norm_ready = true;
        }
        let use_aug: i32 = match batch.augment {
            Some(aug) => {
                check_len(op, "augment", aug.len(), n)?;
                let params: Vec<i32> = aug[..n].iter().flat_map(aug_ints).collect();
                ensure(&self.dev, &mut w.ints, params.len(), op)?;
                stream
                    .memcpy_htod(&params, w.ints.as_mut().expect("ensured"))
                    .map_err(drv_err(op))?;
                1
            }
            None => {
                ensure(&self.dev, &mut w.ints, 1, op)?;
                0
            }
        };
        let (n_i, s_i) = (to_i32(op, "n", n)?, to_i32(op, "image size", s)?);
        let mix = InputMix::of(batch.mix);
        let scale = norm_buf.slice(0..3);
        let shift = norm_buf.slice(3..6);
        let dst = out.bf16_mut(op, "output")?;
        let (pixels, aug) = (
            w.pixels.as_ref().expect("ensured"),
            w.ints.as_ref().expect("ensured"),
        );
        launch!(
            self,
            op,
            "input.cu",
            "input_transform",
            elementwise_cfg(bytes),
            [pixels, aug, &use_aug, &scale, &shift, &mix, dst, &n_i, &s_i]
        );
        self.note_work(3 * bytes, 0.0);
        Ok(())
    }

    fn conv_forward(
        &self,
        s: &ConvShape,
        x: &CudaTensor,
        w: &CudaTensor,
        y: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        let op = "conv_forward";
        let args = Self::conv_args(op, s)?;
        check_len(op, "x", x.len, s.x_len())?;
        check_len(op, "w", w.len, s.w_len())?;
        check_len(op, "y", y.len, s.y_len())?;
        if let Some(l) = self.conv2_plan(Pass::Forward, s) {
            let cfg = self.conv2_prepare(op, &l)?;
            let (x, w, y) = (x.bf16(op, "x")?, w.bf16(op, "w")?, y.bf16_mut(op, "y")?);
            let mut scratch = self.conv2.lock().unwrap_or_else(|e| e.into_inner());
            let Conv2Scratch { x8, w8, .. } = &mut *scratch;
            let (x, w) = if l.pad_channels {
                self.pad_to_8(op, x, s.n * s.h * s.w, s.c_in, x8)?;
                let rows_w = s.c_out * s.kernel * s.kernel;
                self.pad_to_8(op, w, rows_w, s.c_in, w8)?;
                (x8.as_ref().expect("padded"), w8.as_ref().expect("padded"))
            } else {
                (x, w)
            };
            let kernel = l.kernel; // conv::V2_GEMM_KERNELS
            launch!(self, op, "conv2.cu", kernel, cfg, [x, w, y, &l.args]);
            self.note_work(2 * (s.x_len() + s.w_len() + s.y_len()), s.flops());
            return Ok(());
        }
        let cfg = gemm_grid(s.n * s.out_h() * s.out_w(), s.c_out, 1);
        let (x, w, y) = (x.bf16(op, "x")?, w.bf16(op, "w")?, y.bf16_mut(op, "y")?);
        let kernel = if s.c_in % 8 == 0 {
            "conv_fwd_vec"
        } else {
            "conv_fwd_scalar"
        };
        launch!(self, op, "conv.cu", kernel, cfg, [x, w, y, &args]);
        self.note_work(2 * (s.x_len() + s.w_len() + s.y_len()), s.flops());
        Ok(())
    }

    fn conv_backward_data(
        &self,
        s: &ConvShape,
        dy: &CudaTensor,
        w: &CudaTensor,
        dx: &mut CudaTensor,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        let op = "conv_backward_data";
        let mut args = Self::conv_args(op, s)?;
        args.accumulate = i32::from(accumulate);
        check_len(op, "dy", dy.len, s.y_len())?;
        check_len(op, "w", w.len, s.w_len())?;
        check_len(op, "dx", dx.len, s.x_len())?;
        if let Some(mut l) = self.conv2_plan(Pass::Dgrad, s) {
            l.args.accumulate = i32::from(accumulate);
            let cfg = self.conv2_prepare(op, &l)?;
            let (dy, w, dx) = (dy.bf16(op, "dy")?, w.bf16(op, "w")?, dx.bf16_mut(op, "dx")?);
            let mut scratch = self.conv2.lock().unwrap_or_else(|e| e.into_inner());
            let w = self.dgrad_weights(op, &l, s, w, &mut scratch)?;
            let kernel = l.kernel; // conv::V2_GEMM_KERNELS
            launch!(self, op, "conv2.cu", kernel, cfg, [dy, w, dx, &l.args]);
            self.note_work(
                2 * (s.y_len() + s.w_len() + s.x_len() * (1 + usize::from(accumulate))),
                s.flops(),
            );
            return Ok(());
        }
        let cfg = gemm_grid(s.n * s.h * s.w, s.c_in, 1);
        let (dy, w, dx) = (dy.bf16(op, "dy")?, w.bf16(op, "w")?, dx.bf16_mut(op, "dx")?);
        let kernel = if s.c_in % 8 == 0 && s.c_out % 8 == 0 {
            "conv_dgrad_vec"
        } else {
            "conv_dgrad_scalar"
        };
        launch!(self, op, "conv.cu", kernel, cfg, [dy, w, dx, &args]);
        self.note_work(
            2 * (s.y_len() + s.w_len() + s.x_len() * (1 + usize::from(accumulate))),
            s.flops(),
        );
        Ok(())
    }

    fn conv_backward_weight(
        &self,
        s: &ConvShape,
        x: &CudaTensor,
        dy: &CudaTensor,
        dw: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        let op = "conv_backward_weight";
        let mut args = Self::conv_args(op, s)?;
        check_len(op, "x", x.len, s.x_len())?;
        check_len(op, "dy", dy.len, s.y_len())?;
        check_len(op, "dw", dw.len, s.w_len())?;
        if let Some(l) = self.conv2_plan(Pass::Wgrad, s) {
            let cfg = self.conv2_prepare(op, &l)?;
            let (dy, x) = (dy.bf16(op, "dy")?, x.bf16(op, "x")?);
            let dw = dw.f32_mut(op, "dw")?;
            let mut scratch = self.conv2.lock().unwrap_or_else(|e| e.into_inner());
            let Conv2Scratch { x8, planes, .. } = &mut *scratch;
            let x = if l.pad_channels {
                self.pad_to_8(op, x, s.n * s.h * s.w, s.c_in, x8)?;
                x8.as_ref().expect("padded")
            } else {
                x
            };
            let kernel = l.kernel; // conv::V2_GEMM_KERNELS
                                   // Every element of a slice's plane is stored once (no atomics, no zeroing): one
                                   // slice writes dw itself; several write their planes, summed in slice order.
            let slices = l.grid.2 as usize;
            // What the GEMM itself moves: the operands read, and its planes (or dw) written.
            let gemm_bytes = 2 * (s.x_len() + s.y_len()) + 4 * s.w_len() * slices;
            if slices == 1 {
                launch!(self, op, "conv2.cu", kernel, cfg, [dy, x, dw, &l.args]);
                self.note_work(gemm_bytes, s.flops());
            } else {
                let len = s.w_len();
                ensure(&self.dev, planes, slices * len, op)?;
                let planes = planes.as_mut().expect("ensured");
                launch!(
                    self,
                    op,
                    "conv2.cu",
                    kernel,
                    cfg,
                    [dy, x, &mut *planes, &l.args]
                );
                self.note_work(gemm_bytes, s.flops());
                let (len_i, slices_i) = (len as i64, to_i32(op, "slices", slices)?);
                launch!(
                    self,
                    op,
                    "conv2.cu",
                    "conv2_wgrad_reduce",
                    elementwise_cfg(len.div_ceil(4)),
                    [&*planes, dw, &len_i, &slices_i]
                );
                // The reduce reads every plane and writes dw once; it does no GEMM work.
                self.note_work(4 * len * (slices + 1), 0.0);
            }
            return Ok(());
        }
        // Split the huge reduction (N·P·Q) over gridDim.z so the GPU is full; partial sums meet
        // in f32 atomics on a zeroed gradient.
        let reduction = s.n * s.out_h() * s.out_w();
        let tiles = s.c_out.div_ceil(CONV_TILE) * s.w_len().div_ceil(s.c_out).div_ceil(CONV_TILE);
        let want = (2 * self.sms as usize).div_ceil(tiles.max(1)).max(1);
        let splits = want.min(reduction.div_ceil(256)).max(1);
        let chunk = reduction.div_ceil(splits).div_ceil(32) * 32;
        let splits = reduction.div_ceil(chunk);
        args.k_chunk = to_i32(op, "k_chunk", chunk)?;
        let cfg = gemm_grid(s.c_out, s.w_len() / s.c_out, splits);
        let stream = self.dev.stream().clone();
        let (dy, x) = (dy.bf16(op, "dy")?, x.bf16(op, "x")?);
        let dw = dw.f32_mut(op, "dw")?;
        let mut head = dw.slice_mut(0..s.w_len());
        stream.memset_zeros(&mut head).map_err(drv_err(op))?;
        let kernel = match (s.c_out % 8 == 0, s.c_in % 8 == 0) {
            (true, true) => "conv_wgrad_vec",
            (true, false) => "conv_wgrad_stem",
            _ => "conv_wgrad_scalar",
        };
        launch!(self, op, "conv.cu", kernel, cfg, [dy, x, dw, &args]);
        self.note_work(2 * (s.x_len() + s.y_len()) + 4 * s.w_len(), s.flops());
        Ok(())
    }

    fn bn_fusion(&self) -> bool {
        // The epilogues are v2 kernels; with v1 the fused ops would only compose the passes.
        self.bn_fusion && self.conv == ConvVersion::V2
    }

    fn conv_forward_moments(
        &self,
        s: &ConvShape,
        x: &CudaTensor,
        w: &CudaTensor,
        y: &mut CudaTensor,
        moments: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        self.fused_conv_forward_moments(s, x, w, y, moments)
    }

    fn conv_backward_data_bn(
        &self,
        s: &ConvShape,
        dy: &CudaTensor,
        w: &CudaTensor,
        dx: &mut CudaTensor,
        accumulate: bool,
        bn: BnGradEpilogue<'_, CudaTensor>,
    ) -> Result<(), BackendError> {
        self.fused_conv_backward_data_bn(s, dy, w, dx, accumulate, bn)
    }

    fn bn_forward(&self, a: BnForward<'_, CudaTensor>) -> Result<(), BackendError> {
        let op = "bn_forward";
        let (rows, c) = (a.shape.rows, a.shape.channels);
        if rows == 0 {
            return Err(BackendError::Shape {
                op,
                detail: "zero rows".into(),
            });
        }
        check_len(op, "x", a.x.len, rows * c)?;
        check_len(op, "y", a.y.len, rows * c)?;
        if let Some(r) = a.residual {
            check_len(op, "residual", r.len, rows * c)?;
        }
        for (name, len) in [
            ("gamma", a.gamma.len),
            ("beta", a.beta.len),
            ("saved_mean", a.saved_mean.len),
            ("saved_invstd", a.saved_invstd.len),
            ("running_mean", a.running_mean.len),
            ("running_var", a.running_var.len),
        ] {
            check_len(op, name, len, c)?;
        }
        let (rows_i, c_i) = (to_i32(op, "rows", rows)?, to_i32(op, "channels", c)?);
        let x = a.x.bf16(op, "x")?;
        let chan_cfg = LaunchConfig {
            grid_dim: (c.div_ceil(128) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        {
            let mean = a.saved_mean.f32_mut(op, "saved_mean")?;
            let invstd = a.saved_invstd.f32_mut(op, "saved_invstd")?;
            let run_mean = a.running_mean.f32_mut(op, "running_mean")?;
            let run_var = a.running_var.f32_mut(op, "running_var")?;
            match (a.mode, a.moments) {
                (BnMode::Train, Some(moments)) => {
                    // Fused: the convolution's epilogue reduced x already.
                    self.finalize_moments(
                        op, moments, c, a.eps, a.momentum, mean, invstd, run_mean, run_var,
                    )?;
                }
                (BnMode::Train, None) => {
                    let (per, slabs) = self.slabs(rows);
                    let mut work = self.work();
                    let w = &mut *work;
                    ensure(&self.dev, &mut w.f32a, slabs * c, op)?;
                    ensure(&self.dev, &mut w.f32b, slabs * c, op)?;
                    let (pm, pv) = (
                        w.f32a.as_mut().expect("ensured"),
                        w.f32b.as_mut().expect("ensured"),
                    );
                    let per_i = to_i32(op, "rows per slab", per)?;
                    let slabs_i = to_i32(op, "slabs", slabs)?;
                    let (partial, cfg) = reduction_launch(c, slabs, "bn_stats_partial");
                    launch!(
                        self,
                        op,
                        "bn.cu",
                        partial,
                        cfg,
                        [x, &rows_i, &c_i, &per_i, &mut *pm, &mut *pv]
                    );
                    self.note_work(2 * rows * c, 0.0);
                    let (eps, momentum) = (a.eps, a.momentum);
                    launch!(
                        self,
                        op,
                        "bn.cu",
                        "bn_stats_finalize",
                        finalize_cfg(c),
                        [
                            &*pm, &*pv, &slabs_i, &rows_i, &c_i, &per_i, &eps, &momentum, mean,
                            invstd, run_mean, run_var
                        ]
                    );
                }
                (BnMode::Frozen | BnMode::Eval, _) => {
                    let eps = a.eps;
                    launch!(
                        self,
                        op,
                        "bn.cu",
                        "bn_eval_prepare",
                        chan_cfg,
                        [&*run_mean, &*run_var, &c_i, &eps, mean, invstd]
                    );
                }
            }
        }
        let total = (rows * c) as i64;
        let relu = i32::from(a.relu);
        let (mean, invstd) = (
            a.saved_mean.f32(op, "saved_mean")?,
            a.saved_invstd.f32(op, "saved_invstd")?,
        );
        let (gamma, beta) = (a.gamma.bf16(op, "gamma")?, a.beta.bf16(op, "beta")?);
        let y = a.y.bf16_mut(op, "y")?;
        // 16 bytes per thread when every row is whole groups of 8 channels.
        let vec = c % 8 == 0;
        let apply = if vec { "bn_apply_vec" } else { "bn_apply" };
        let cfg = if vec {
            self.channel_rows_cfg(op, apply, rows * c / 8)?
        } else {
            elementwise_cfg(rows * c)
        };
        match a.residual {
            Some(r) => {
                let r = r.bf16(op, "residual")?;
                launch!(
                    self,
                    op,
                    "bn.cu",
                    apply,
                    cfg,
                    [x, mean, invstd, gamma, beta, r, y, &total, &c_i, &relu]
                );
                self.note_work(6 * rows * c, 0.0);
            }
            None => {
                launch!(
                    self,
                    op,
                    "bn.cu",
                    apply,
                    cfg,
                    [x, mean, invstd, gamma, beta, &NULL_PTR, y, &total, &c_i, &relu]
                );
                self.note_work(4 * rows * c, 0.0);
            }
        }
        Ok(())
    }

    fn bn_backward(&self, a: BnBackward<'_, CudaTensor>) -> Result<(), BackendError> {
        let op = "bn_backward";
        let (rows, c) = (a.shape.rows, a.shape.channels);
        if rows == 0 {
            return Err(BackendError::Shape {
                op,
                detail: "zero rows".into(),
            });
        }
        for (name, len) in [
            ("x", a.x.len),
            ("y", a.y.len),
            ("dy", a.dy.len),
            ("dx", a.dx.len),
        ] {
            check_len(op, name, len, rows * c)?;
        }
        if let Some((d, _)) = &a.dresidual {
            check_len(op, "dresidual", d.len, rows * c)?;
        }
        for (name, len) in [
            ("gamma", a.gamma.len),
            ("saved_mean", a.saved_mean.len),
            ("saved_invstd", a.saved_invstd.len),
            ("dgamma", a.dgamma.len),
            ("dbeta", a.dbeta.len),
        ] {
            check_len(op, name, len, c)?;
        }
        let (rows_i, c_i) = (to_i32(op, "rows", rows)?, to_i32(op, "channels", c)?);
        // Prepared (bn_fused): dy is g already, masked; dgamma and dbeta are its reductions.
        let relu = i32::from(a.relu && !a.prepared);
        let (x, y, dy) = (a.x.bf16(op, "x")?, a.y.bf16(op, "y")?, a.dy.bf16(op, "dy")?);
        let (mean, invstd) = (
            a.saved_mean.f32(op, "saved_mean")?,
            a.saved_invstd.f32(op, "saved_invstd")?,
        );
        let gamma = a.gamma.bf16(op, "gamma")?;
        let (per, slabs) = self.slabs(rows);
        let (per_i, slabs_i) = (
            to_i32(op, "rows per slab", per)?,
            to_i32(op, "slabs", slabs)?,
        );
        if !a.prepared {
            let mut work = self.work();
            let w = &mut *work;
            ensure(&self.dev, &mut w.f32a, slabs * c, op)?;
            ensure(&self.dev, &mut w.f32b, slabs * c, op)?;
            let (pb, pg) = (
                w.f32a.as_mut().expect("ensured"),
                w.f32b.as_mut().expect("ensured"),
            );
            let (partial, cfg) = reduction_launch(c, slabs, "bn_bwd_partial");
            launch!(
                self,
                op,
                "bn.cu",
                partial,
                cfg,
                [dy, y, x, mean, invstd, &rows_i, &c_i, &per_i, &relu, &mut *pb, &mut *pg]
            );
            self.note_work(2 * rows * c * (2 + relu as usize), 0.0);
            let dbeta = a.dbeta.f32_mut(op, "dbeta")?;
            let dgamma = a.dgamma.f32_mut(op, "dgamma")?;
            launch!(
                self,
                op,
                "bn.cu",
                "bn_bwd_finalize",
                finalize_cfg(c),
                [&*pb, &*pg, &slabs_i, &c_i, dbeta, dgamma]
            );
        }
        let total = (rows * c) as i64;
        let batch_stats = i32::from(a.batch_stats);
        let (dbeta, dgamma) = (a.dbeta.f32(op, "dbeta")?, a.dgamma.f32(op, "dgamma")?);
        let dx = a.dx.bf16_mut(op, "dx")?;
        let vec = c % 8 == 0;
        let apply = if vec {
            "bn_bwd_apply_vec"
        } else {
            "bn_bwd_apply"
        };
        let cfg = if vec {
            self.channel_rows_cfg(op, apply, rows * c / 8)?
        } else {
            elementwise_cfg(rows * c)
        };
        match a.dresidual {
            Some((dres, acc)) => {
                let acc = i32::from(acc);
                let dres = dres.bf16_mut(op, "dresidual")?;
                launch!(
                    self,
                    op,
                    "bn.cu",
                    apply,
                    cfg,
                    [
                        dy,
                        y,
                        x,
                        mean,
                        invstd,
                        gamma,
                        dbeta,
                        dgamma,
                        &total,
                        &c_i,
                        &relu,
                        &batch_stats,
                        dx,
                        dres,
                        &acc
                    ]
                );
                self.note_work(
                    2 * rows * c * (4 + relu as usize + usize::from(acc == 1)),
                    0.0,
                );
            }
            None => {
                let acc = 0i32;
                launch!(
                    self,
                    op,
                    "bn.cu",
                    apply,
                    cfg,
                    [
                        dy,
                        y,
                        x,
                        mean,
                        invstd,
                        gamma,
                        dbeta,
                        dgamma,
                        &total,
                        &c_i,
                        &relu,
                        &batch_stats,
                        dx,
                        &NULL_PTR,
                        &acc
                    ]
                );
                self.note_work(2 * rows * c * (3 + relu as usize), 0.0);
            }
        }
        Ok(())
    }

    fn maxpool_forward(
        &self,
        s: &PoolShape,
        x: &CudaTensor,
        y: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        let op = "maxpool_forward";
        Self::pool_check(op, s)?;
        let out = s.n * s.out_h() * s.out_w() * s.c;
        check_len(op, "x", x.len, s.n * s.h * s.w * s.c)?;
        check_len(op, "y", y.len, out)?;
        let d = pool_dims(op, s)?;
        let (x, y) = (x.bf16(op, "x")?, y.bf16_mut(op, "y")?);
        // 16-byte channel groups when C % 8 == 0: one thread per (output pixel, 8 channels).
        let vec = s.c % 8 == 0;
        let kernel = if vec {
            "maxpool_fwd_vec"
        } else {
            "maxpool_fwd"
        };
        launch!(
            self,
            op,
            "pool.cu",
            kernel,
            elementwise_cfg(if vec { out / 8 } else { out }),
            [x, y, &d[0], &d[1], &d[2], &d[3], &d[4], &d[5], &d[6], &d[7], &d[8]]
        );
        self.note_work(2 * (s.n * s.h * s.w * s.c + out), 0.0);
        Ok(())
    }

    fn maxpool_backward(
        &self,
        s: &PoolShape,
        x: &CudaTensor,
        dy: &CudaTensor,
        dx: &mut CudaTensor,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        let op = "maxpool_backward";
        Self::pool_check(op, s)?;
        let input = s.n * s.h * s.w * s.c;
        check_len(op, "x", x.len, input)?;
        check_len(op, "dx", dx.len, input)?;
        check_len(op, "dy", dy.len, s.n * s.out_h() * s.out_w() * s.c)?;
        let d = pool_dims(op, s)?;
        let acc = i32::from(accumulate);
        let (x, dy, dx) = (x.bf16(op, "x")?, dy.bf16(op, "dy")?, dx.bf16_mut(op, "dx")?);
        // maxpool_bwd_vec: C % 8 == 0, at most 2 windows per dimension over an input cell, window
        // positions in a byte (see pool.cu); maxpool_bwd otherwise.
        let vec = s.c % 8 == 0 && s.kernel <= 2 * s.stride && s.kernel <= 15;
        let kernel = if vec {
            "maxpool_bwd_vec"
        } else {
            "maxpool_bwd"
        };
        launch!(
            self,
            op,
            "pool.cu",
            kernel,
            if vec {
                maxpool_bwd_vec_cfg(s)
            } else {
                elementwise_cfg(input)
            },
            [x, dy, dx, &d[0], &d[1], &d[2], &d[3], &d[4], &d[5], &d[6], &d[7], &d[8], &acc]
        );
        self.note_work(
            2 * (input * (2 + usize::from(accumulate)) + s.n * s.out_h() * s.out_w() * s.c),
            0.0,
        );
        Ok(())
    }

    fn gap_forward(
        &self,
        n: usize,
        hw: usize,
        c: usize,
        x: &CudaTensor,
        y: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        let op = "gap_forward";
        check_len(op, "x", x.len, n * hw * c)?;
        check_len(op, "y", y.len, n * c)?;
        if hw == 0 {
            return Err(BackendError::Shape {
                op,
                detail: "empty spatial extent".into(),
            });
        }
        let (n_i, hw_i, c_i) = (
            to_i32(op, "n", n)?,
            to_i32(op, "hw", hw)?,
            to_i32(op, "c", c)?,
        );
        let (x, y) = (x.bf16(op, "x")?, y.bf16_mut(op, "y")?);
        launch!(
            self,
            op,
            "pool.cu",
            "gap_fwd",
            elementwise_cfg(n * c),
            [x, y, &n_i, &hw_i, &c_i]
        );
        self.note_work(2 * (n * hw * c + n * c), 0.0);
        Ok(())
    }

    fn gap_backward(
        &self,
        n: usize,
        hw: usize,
        c: usize,
        dy: &CudaTensor,
        dx: &mut CudaTensor,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        let op = "gap_backward";
        check_len(op, "dy", dy.len, n * c)?;
        check_len(op, "dx", dx.len, n * hw * c)?;
        if hw == 0 {
            return Err(BackendError::Shape {
                op,
                detail: "empty spatial extent".into(),
            });
        }
        let (n_i, hw_i, c_i) = (
            to_i32(op, "n", n)?,
            to_i32(op, "hw", hw)?,
            to_i32(op, "c", c)?,
        );
        let acc = i32::from(accumulate);
        let (dy, dx) = (dy.bf16(op, "dy")?, dx.bf16_mut(op, "dx")?);
        launch!(
            self,
            op,
            "pool.cu",
            "gap_bwd",
            elementwise_cfg(n * hw * c),
            [dy, dx, &n_i, &hw_i, &c_i, &acc]
        );
        self.note_work(
            2 * (n * c + n * hw * c * (1 + usize::from(accumulate))),
            0.0,
        );
        Ok(())
    }

    fn linear_forward(
        &self,
        s: &LinearShape,
        x: &CudaTensor,
        w: &CudaTensor,
        b: &CudaTensor,
        y: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        let op = "linear_forward";
        check_len(op, "x", x.len, s.n * s.inputs)?;
        check_len(op, "w", w.len, s.outputs * s.inputs)?;
        check_len(op, "b", b.len, s.outputs)?;
        check_len(op, "y", y.len, s.n * s.outputs)?;
        let (n, i, o) = linear_dims(op, s)?;
        let (x, w, b, y) = (
            x.bf16(op, "x")?,
            w.bf16(op, "w")?,
            b.bf16(op, "b")?,
            y.bf16_mut(op, "y")?,
        );
        launch!(
            self,
            op,
            "linear.cu",
            "linear_fwd",
            tile16(s.outputs, s.n),
            [x, w, b, y, &n, &i, &o]
        );
        Ok(())
    }

    fn linear_backward(
        &self,
        s: &LinearShape,
        x: &CudaTensor,
        w: &CudaTensor,
        dy: &CudaTensor,
        dx: &mut CudaTensor,
        dw: &mut CudaTensor,
        db: &mut CudaTensor,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        let op = "linear_backward";
        check_len(op, "x", x.len, s.n * s.inputs)?;
        check_len(op, "dx", dx.len, s.n * s.inputs)?;
        check_len(op, "w", w.len, s.outputs * s.inputs)?;
        check_len(op, "dw", dw.len, s.outputs * s.inputs)?;
        check_len(op, "db", db.len, s.outputs)?;
        check_len(op, "dy", dy.len, s.n * s.outputs)?;
        let (n, i, o) = linear_dims(op, s)?;
        let acc = i32::from(accumulate);
        let (x, w, dy) = (x.bf16(op, "x")?, w.bf16(op, "w")?, dy.bf16(op, "dy")?);
        let dx = dx.bf16_mut(op, "dx")?;
        launch!(
            self,
            op,
            "linear.cu",
            "linear_bwd_data",
            tile16(s.inputs, s.n),
            [dy, w, dx, &n, &i, &o, &acc]
        );
        let dw = dw.f32_mut(op, "dw")?;
        launch!(
            self,
            op,
            "linear.cu",
            "linear_bwd_weight",
            tile16(s.inputs, s.outputs),
            [dy, x, dw, &n, &i, &o]
        );
        let db = db.f32_mut(op, "db")?;
        let cfg = LaunchConfig {
            grid_dim: (s.outputs.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            op,
            "linear.cu",
            "linear_bias_grad",
            cfg,
            [dy, db, &n, &o]
        );
        Ok(())
    }

    fn softmax_cross_entropy(
        &self,
        n: usize,
        classes: usize,
        logits: &CudaTensor,
        targets: &Targets<'_>,
        dlogits: Option<&mut CudaTensor>,
        probs: Option<&mut Vec<f32>>,
    ) -> Result<LossStats, BackendError> {
        self.softmax_impl(n, classes, logits, targets, dlogits, probs, None)
    }
}

/// Where the loss op leaves a step's figures on the device (kernels/loss.cu `loss_totals`).
#[derive(Debug, Clone, Copy)]
pub struct DeviceTotalsAt {
    /// Device address of the five f64: loss sum, top-1 hits, top-5 hits, rows, `stop`.
    pub addr: u64,
    /// This rank's wish to stop after the step.
    pub stop: bool,
    /// Add the figures to what is there (a later micro-batch of the step) instead of
    /// overwriting them.
    pub add: bool,
}

impl CudaBackend {
    /// The loss op; with `totals`, the step's figures go to the device (see
    /// [`DeviceTotalsAt`]) and nothing waits for the GPU.
    #[allow(clippy::too_many_arguments)]
    fn softmax_impl(
        &self,
        n: usize,
        classes: usize,
        logits: &CudaTensor,
        targets: &Targets<'_>,
        dlogits: Option<&mut CudaTensor>,
        probs: Option<&mut Vec<f32>>,
        totals: Option<DeviceTotalsAt>,
    ) -> Result<LossStats, BackendError> {
        let op = "softmax_cross_entropy";
        check_len(op, "logits", logits.len, n * classes)?;
        check_len(op, "labels", targets.labels.len(), n)?;
        if let Some(d) = &dlogits {
            check_len(op, "dlogits", d.len, n * classes)?;
        }
        targets.check(op, n, classes)?;
        let (labels, smoothing, own_weight) =
            (targets.labels, targets.smoothing, targets.own_weight);
        if n == 0 {
            return Ok(LossStats::default());
        }
        let k = to_i32(op, "classes", classes)?;
        let scale = 1.0 / n as f32;
        let labels_i: Vec<i32> = labels[..n].iter().map(|&l| l as i32).collect();
        let stream = self.dev.stream().clone();
        let mut work = self.work();
        let w = &mut *work;
        ensure(&self.dev, &mut w.ints, n, op)?;
        ensure(&self.dev, &mut w.ints2, n, op)?;
        ensure(
            &self.dev,
            &mut w.f32a,
            n + if probs.is_some() { n * classes } else { 0 },
            op,
        )?;
        let lab = w.ints.as_mut().expect("ensured");
        stream.memcpy_htod(&labels_i, lab).map_err(drv_err(op))?;
        let rank = w.ints2.as_mut().expect("ensured");
        let f = w.f32a.as_mut().expect("ensured");
        let (mut loss, mut prob_buf) = f.split_at_mut(n);
        let z = logits.bf16(op, "logits")?;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let lab = &*lab;
        match (dlogits, probs.is_some()) {
            (Some(d), true) => {
                let d = d.bf16_mut(op, "dlogits")?;
                launch!(
                    self,
                    op,
                    "loss.cu",
                    "softmax_xent",
                    cfg,
                    [
                        z,
                        lab,
                        &k,
                        &smoothing,
                        &own_weight,
                        &scale,
                        &mut loss,
                        &mut *rank,
                        d,
                        &mut prob_buf
                    ]
                );
            }
            (Some(d), false) => {
                let d = d.bf16_mut(op, "dlogits")?;
                launch!(
                    self,
                    op,
                    "loss.cu",
                    "softmax_xent",
                    cfg,
                    [
                        z,
                        lab,
                        &k,
                        &smoothing,
                        &own_weight,
                        &scale,
                        &mut loss,
                        &mut *rank,
                        d,
                        &NULL_PTR
                    ]
                );
            }
            (None, true) => {
                launch!(
                    self,
                    op,
                    "loss.cu",
                    "softmax_xent",
                    cfg,
                    [
                        z,
                        lab,
                        &k,
                        &smoothing,
                        &own_weight,
                        &scale,
                        &mut loss,
                        &mut *rank,
                        &NULL_PTR,
                        &mut prob_buf
                    ]
                );
            }
            (None, false) => {
                launch!(
                    self,
                    op,
                    "loss.cu",
                    "softmax_xent",
                    cfg,
                    [
                        z,
                        lab,
                        &k,
                        &smoothing,
                        &own_weight,
                        &scale,
                        &mut loss,
                        &mut *rank,
                        &NULL_PTR,
                        &NULL_PTR
                    ]
                );
            }
        }
        if let Some(at) = totals {
            let n_i = to_i32(op, "n", n)?;
            let (stop, add, totals) = (i32::from(at.stop), i32::from(at.add), at.addr);
            let one_block = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(
                self,
                op,
                "loss.cu",
                "loss_totals",
                one_block,
                [&mut loss, &mut *rank, &n_i, &stop, &add, &totals]
            );
            return Ok(LossStats::default());
        }
        let losses = stream.clone_dtoh(&loss).map_err(drv_err(op))?;
        let ranks = stream.clone_dtoh(&rank.slice(0..n)).map_err(drv_err(op))?;
        if let Some(p) = probs {
            *p = stream
                .clone_dtoh(&prob_buf.slice(0..n * classes))
                .map_err(drv_err(op))?;
        }
        stream.synchronize().map_err(drv_err(op))?;
        let mut stats = LossStats::default();
        for (l, r) in losses.iter().zip(&ranks) {
            stats.loss_sum += f64::from(*l);
            stats.correct_top1 += usize::from(*r == 0);
            stats.correct_top5 += usize::from(*r < 5);
        }
        Ok(stats)
    }

    /// [`Backend::softmax_cross_entropy`] that leaves the step's figures on the device: the
    /// five f64 at `totals.addr` receive (or, with `totals.add`, have added) the loss sum,
    /// top-1 and top-5 hits, the row count, and `stop`, and nothing waits for the GPU (the
    /// trainer reads them a step later).
    ///
    /// # Safety
    /// `totals.addr` must address five f64 of this device's memory, alive until the kernels
    /// queued now have run.
    pub unsafe fn softmax_cross_entropy_on_device(
        &self,
        n: usize,
        classes: usize,
        logits: &CudaTensor,
        targets: &Targets<'_>,
        dlogits: Option<&mut CudaTensor>,
        totals: DeviceTotalsAt,
    ) -> Result<(), BackendError> {
        self.softmax_impl(n, classes, logits, targets, dlogits, None, Some(totals))
            .map(|_| ())
    }

    /// The step figures of a rank without images: zeros and `stop`, written to the five f64
    /// at `totals` on the device (see [`CudaBackend::softmax_cross_entropy_on_device`]).
    ///
    /// # Safety
    /// As [`CudaBackend::softmax_cross_entropy_on_device`].
    pub unsafe fn empty_step_totals(&self, totals: u64, stop: bool) -> Result<(), BackendError> {
        let op = "empty step totals";
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n, stop, add) = (0i32, i32::from(stop), 0i32);
        launch!(
            self,
            op,
            "loss.cu",
            "loss_totals",
            one_block,
            [&NULL_PTR, &NULL_PTR, &n, &stop, &add, &totals]
        );
        Ok(())
    }
}

fn pool_dims(op: &'static str, s: &PoolShape) -> Result<[i32; 9], BackendError> {
    Ok([
        to_i32(op, "n", s.n)?,
        to_i32(op, "h", s.h)?,
        to_i32(op, "w", s.w)?,
        to_i32(op, "c", s.c)?,
        to_i32(op, "out_h", s.out_h())?,
        to_i32(op, "out_w", s.out_w())?,
        to_i32(op, "kernel", s.kernel)?,
        to_i32(op, "stride", s.stride)?,
        to_i32(op, "padding", s.padding)?,
    ])
}

fn linear_dims(op: &'static str, s: &LinearShape) -> Result<(i32, i32, i32), BackendError> {
    Ok((
        to_i32(op, "n", s.n)?,
        to_i32(op, "inputs", s.inputs)?,
        to_i32(op, "outputs", s.outputs)?,
    ))
}

/// The per-slab reduction kernel (`base` or its 16-byte `_vec` form, which needs C % 8 == 0 and
/// C ≤ 2048) and its launch configuration.
fn reduction_launch(c: usize, slabs: usize, base: &'static str) -> (&'static str, LaunchConfig) {
    if c % 8 == 0 && c / 8 <= 256 {
        let name = if base == "bn_stats_partial" {
            "bn_stats_partial_vec"
        } else {
            "bn_bwd_partial_vec"
        };
        (
            name,
            LaunchConfig {
                grid_dim: (1, slabs as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
        )
    } else {
        (
            base,
            LaunchConfig {
                grid_dim: (c.div_ceil(32) as u32, slabs as u32, 1),
                block_dim: (32, 8, 1),
                shared_mem_bytes: 0,
            },
        )
    }
}

/// maxpool_bwd_vec: 256 threads, one block per tile of 7×7 outputs × 8 channel groups
/// (POOL_TP, POOL_TQ, POOL_GB in pool.cu), grid-stride beyond 65 535 tiles.
fn maxpool_bwd_vec_cfg(s: &PoolShape) -> LaunchConfig {
    let tiles = s.n * s.out_h().div_ceil(7) * s.out_w().div_ceil(7) * (s.c / 8).div_ceil(8);
    LaunchConfig {
        grid_dim: (tiles.clamp(1, 65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// bn_stats_finalize / bn_bwd_finalize: block (32 channels, 32 slab lanes: `FIN_Y` in bn.cu).
fn finalize_cfg(c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(32) as u32, 1, 1),
        block_dim: (32, 32, 1),
        shared_mem_bytes: 0,
    }
}

fn tile16(cols: usize, rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (cols.div_ceil(16) as u32, rows.div_ceil(16) as u32, 1),
        block_dim: (16, 16, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use crate::cuda::sources::KERNEL_FILES;

    /// The parameter count of kernel `name` in its source.
    fn kernel_arity(name: &str) -> Option<usize> {
        for file in KERNEL_FILES {
            let text = file.text;
            let Some(at) = text
                .find(&format!(" {name}("))
                .or_else(|| text.find(&format!("\n{name}(")))
            else {
                continue;
            };
            let open = at + text[at..].find('(')?;
            let close = open + text[open..].find(')')?;
            return Some(
                text[open + 1..close]
                    .split(',')
                    .filter(|p| !p.trim().is_empty())
                    .count(),
            );
        }
        None
    }

    /// Splits `text` on commas outside any bracket.
    fn top_level(text: &str) -> Vec<String> {
        let (mut depth, mut parts, mut cur) = (0i32, Vec::new(), String::new());
        for ch in text.chars() {
            match ch {
                '(' | '[' | '{' => depth += 1,
                ')' | ']' | '}' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(std::mem::take(&mut cur));
                    continue;
                }
                _ => {}
            }
            cur.push(ch);
        }
        parts.push(cur);
        parts
            .into_iter()
            .map(|p| p.trim().to_string())
            .filter(|p| !p.is_empty())
            .collect()
    }

    /// The text between the parenthesis opening at `open` and its match.
    fn group(text: &str, open: usize) -> &str {
        let mut depth = 0;
        for (i, ch) in text[open..].char_indices() {
            match ch {
                '(' | '[' => depth += 1,
                ')' | ']' => {
                    depth -= 1;
                    if depth == 0 {
                        return &text[open + 1..open + i];
                    }
                }
                _ => {}
            }
        }
        panic!("unbalanced launch! invocation")
    }

    #[test]
    fn every_launch_passes_as_many_arguments_as_its_kernel_takes() {
        let backend = include_str!("backend.rs");
        let fused = include_str!("bn_fused.rs");
        let source = format!(
            "{}{}",
            &backend[..backend.find("#[cfg(test)]").unwrap()],
            &fused[..fused.find("#[cfg(test)]").unwrap()]
        );
        let body = source.as_str();
        let mut launches = 0;
        for (at, _) in body.match_indices("launch!(") {
            // launch!(self, op, file, kernel, cfg, [args...])
            let parts = top_level(group(body, at + "launch!".len()));
            assert_eq!(parts.len(), 6, "{parts:?}");
            let args = top_level(parts[5].trim_start_matches('[').trim_end_matches(']')).len();
            // A kernel chosen at run time (`kernel`): every name in its `let` statement.
            let names: Vec<String> = if parts[3].starts_with('"') {
                vec![parts[3].trim_matches('"').to_string()]
            } else {
                let before = &body[..at];
                let from = before
                    .rfind(&format!("let {} =", parts[3]))
                    .or_else(|| before.rfind(&format!("let ({},", parts[3])))
                    .expect("kernel variable");
                let stmt = &before[from..from + before[from..].find(';').expect("let ends")];
                let mut names: Vec<String> = stmt
                    .split('"')
                    .skip(1)
                    .step_by(2)
                    .map(String::from)
                    .collect();
                if stmt.contains("l.kernel") {
                    // A v2 convolution GEMM: any kernel the planner names.
                    names.extend(
                        crate::cuda::conv::V2_GEMM_KERNELS
                            .iter()
                            .map(|k| k.to_string()),
                    );
                }
                if stmt.contains("bn_epilogue_kernel") {
                    // A v2 GEMM with a batch-norm epilogue (bn_fused.rs), of the pass its
                    // plan is named after (`fwd.` or `dgrad.`).
                    let pass = if stmt.contains("fwd.") {
                        "conv2_fwd"
                    } else {
                        "conv2_dgrad"
                    };
                    names.extend(
                        crate::cuda::conv::V2_BN_EPILOGUE_KERNELS
                            .iter()
                            .filter(|k| k.starts_with(pass))
                            .map(|k| k.to_string()),
                    );
                }
                if stmt.contains("reduction_launch(") {
                    // reduction_launch picks `base` or `base_vec`.
                    names.push(format!("{}_vec", names[0]));
                }
                names
            };
            assert!(!names.is_empty());
            for kernel in names {
                let arity = kernel_arity(&kernel)
                    .unwrap_or_else(|| panic!("kernel {kernel} not found in kernels/"));
                assert_eq!(
                    args, arity,
                    "launch of {kernel} passes {args} arguments, the kernel takes {arity}"
                );
                launches += 1;
            }
        }
        assert!(launches >= 20, "found only {launches} launches");
    }
}
