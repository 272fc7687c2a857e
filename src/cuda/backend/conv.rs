//! The convolutions: with `BIRDTRAIN_CONV=v3`, the Hopper kernels where they take the layer
//! (`conv3.rs`); v2 (kernels/conv2.cu, the default) where its planner takes the shape, else
//! v1 (kernels/conv.cu); and the v2 helpers the fused batch-norm ops share (the stem's padded
//! or paired copies, the phase-ordered dgrad weight, the launch configuration of a plan).

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::base::{
    check_len, dev_err, drv_err, elementwise_cfg, ensure, to_i32, AppliedArgs, Conv2Scratch,
    CudaBackend,
};
use crate::backend::{BackendError, ConvShape};
use crate::cuda::conv::{self as plan, Conv2Launch, ConvVersion, Pass, StemCopy};
use crate::cuda::kernel_types::ConvArgs;
use crate::cuda::launchers::{
    Conv2DgradWeights, Conv2Gemm, Conv2PadChannels, Conv2PairPixels, Conv2Wgrad, Conv2WgradApply,
    Conv2WgradReduce, ConvGemm, ConvWgrad,
};
use crate::cuda::tensor::CudaTensor;

/// Threads per block of the implicit-GEMM convolution kernels (kernels/conv.cu).
const CONV_THREADS: u32 = 256;
/// Output tile of the convolution kernels (BM = BN).
const CONV_TILE: usize = 128;

impl CudaBackend {
    /// The v2 launch of `pass`, when v2 (or v3, for the layers its kernels leave to v2) is
    /// selected and takes this shape (else v1 runs).
    pub(super) fn conv2_plan(&self, pass: Pass, s: &ConvShape) -> Option<Conv2Launch> {
        (self.conv != ConvVersion::V1)
            .then(|| plan::plan(pass, s, &self.limits).ok())
            .flatten()
    }

    /// The stem's operands as the v2 launch `l` reads them (kernels/conv2.cu, "The stem"): `x`
    /// and `w` themselves, or their copies in the scratch, padded to 8 channels or paired
    /// ([`StemCopy`]), into the scratch's `(x_stem, w_stem)`. The weight is copied only when
    /// given (the weight gradient needs x alone).
    pub(super) fn stem_operands<'a>(
        &self,
        op: &'static str,
        l: &Conv2Launch,
        s: &ConvShape,
        x: &'a CudaSlice<u16>,
        w: Option<&'a CudaSlice<u16>>,
        (x_stem, w_stem): (
            &'a mut Option<CudaSlice<u16>>,
            &'a mut Option<CudaSlice<u16>>,
        ),
    ) -> Result<(&'a CudaSlice<u16>, Option<&'a CudaSlice<u16>>), BackendError> {
        if l.stem == StemCopy::None {
            return Ok((x, w));
        }
        let image_rows = PixelRows {
            rows: s.n * s.h,
            width: s.w,
            lead: 0,
        };
        self.stem_copy(op, l.stem, s.c_in, x, image_rows, x_stem)?;
        if let Some(w) = w {
            let filter_rows = PixelRows {
                rows: s.c_out * s.kernel,
                width: s.kernel,
                lead: StemCopy::pair_lead(s),
            };
            self.stem_copy(op, l.stem, s.c_in, w, filter_rows, w_stem)?;
        }
        let w = w.map(|_| w_stem.as_ref().expect("copied"));
        Ok((x_stem.as_ref().expect("copied"), w))
    }

    /// `dst` = the rows of pixels of `src` (`c_in` channels each) padded to 8 channels, or
    /// paired ([`PixelRows`]).
    fn stem_copy(
        &self,
        op: &'static str,
        copy: StemCopy,
        c_in: usize,
        src: &CudaSlice<u16>,
        PixelRows { rows, width, lead }: PixelRows,
        dst: &mut Option<CudaSlice<u16>>,
    ) -> Result<(), BackendError> {
        // 16 bytes a padded pixel or a pair: one thread each.
        let chunks = rows
            * match copy {
                StemCopy::Pairs => (width + lead).div_ceil(2),
                _ => width,
            };
        ensure(&self.dev, dst, chunks * 8, op)?;
        let dst = dst.as_mut().expect("ensured");
        let c = to_i32(op, "c_in", c_in)?;
        match copy {
            StemCopy::None => Ok(()),
            StemCopy::PadChannels => self.launch(
                op,
                "conv2_pad_channels",
                elementwise_cfg(chunks),
                Conv2PadChannels {
                    src: src.into(),
                    dst: dst.into(),
                    rows: chunks as i64,
                    c_from: c,
                    c_to: 8,
                },
            ),
            StemCopy::Pairs => self.launch(
                op,
                "conv2_pair_pixels",
                elementwise_cfg(chunks),
                Conv2PairPixels {
                    src: src.into(),
                    dst: dst.into(),
                    rows: rows as i64,
                    width: to_i32(op, "width", width)?,
                    c,
                    lead: to_i32(op, "lead", lead)?,
                },
            ),
        }
    }

    /// The weights as the data-gradient kernel of `l` reads them: `w` itself, or, when the
    /// plan asks for it, `w` rearranged into the scratch's `wt` (one copy for the plain and
    /// the batch-norm epilogue kernels).
    pub(super) fn dgrad_weights<'a>(
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
        self.launch(
            op,
            "conv2_dgrad_weights",
            elementwise_cfg(s.w_len() / 8),
            Conv2DgradWeights {
                w: w.into(),
                wt: wt.into(),
                args: l.args,
            },
        )?;
        Ok(scratch.wt.as_ref().expect("ensured"))
    }

    /// Raises the kernel's dynamic shared memory limit to what `l` needs (> 48 KiB) and
    /// returns its launch configuration.
    pub(super) fn conv2_prepare(
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
}

/// Rows of pixels a stem copy takes: the image's rows, or the filter's (paired with `lead`
/// empty slots before each row's first pixel).
#[derive(Debug, Clone, Copy)]
struct PixelRows {
    rows: usize,
    width: usize,
    lead: usize,
}

/// The v1 kernels' shape argument, after checking the shape fits them.
pub(super) fn conv_args(op: &'static str, s: &ConvShape) -> Result<ConvArgs, BackendError> {
    if s.kernel == 0
        || s.stride == 0
        || s.h + 2 * s.padding < s.kernel
        || s.w + 2 * s.padding < s.kernel
    {
        return Err(BackendError::Shape {
            op,
            detail: format!("{s:?}: kernel larger than the padded input, or zero kernel/stride"),
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

/// See [`crate::backend::Backend::conv_forward`].
pub(super) fn forward(
    be: &CudaBackend,
    s: &ConvShape,
    x: &CudaTensor,
    w: &CudaTensor,
    y: &mut CudaTensor,
) -> Result<(), BackendError> {
    let op = "conv_forward";
    let args = conv_args(op, s)?;
    check_len(op, "x", x.len, s.x_len())?;
    check_len(op, "w", w.len, s.w_len())?;
    check_len(op, "y", y.len, s.y_len())?;
    if be.conv3_takes_forward(s) {
        let (x, w, y) = (x.bf16(op, "x")?, w.bf16(op, "w")?, y.bf16_mut(op, "y")?);
        return be.conv3_forward(op, s, x, w, y, None);
    }
    if let Some(l) = be.conv2_plan(Pass::Forward, s) {
        let cfg = be.conv2_prepare(op, &l)?;
        let (x, w, y) = (x.bf16(op, "x")?, w.bf16(op, "w")?, y.bf16_mut(op, "y")?);
        let mut scratch = be.conv2.lock().unwrap_or_else(|e| e.into_inner());
        let Conv2Scratch { x_stem, w_stem, .. } = &mut *scratch;
        let (x, w) = be.stem_operands(op, &l, s, x, Some(w), (x_stem, w_stem))?;
        let gemm = Conv2Gemm {
            a: x.into(),
            b: w.expect("given").into(),
            out: y.into(),
            args: l.args,
        };
        be.launch(op, l.kernel, cfg, gemm)?;
        be.note_work(2 * (s.x_len() + s.w_len() + s.y_len()), s.flops());
        return Ok(());
    }
    let cfg = gemm_grid(s.n * s.out_h() * s.out_w(), s.c_out, 1);
    let (x, w, y) = (x.bf16(op, "x")?, w.bf16(op, "w")?, y.bf16_mut(op, "y")?);
    let kernel = if s.c_in % 8 == 0 {
        "conv_fwd_vec"
    } else {
        "conv_fwd_scalar"
    };
    let gemm = ConvGemm {
        a: x.into(),
        b: w.into(),
        out: y.into(),
        shape: args,
    };
    be.launch(op, kernel, cfg, gemm)?;
    be.note_work(2 * (s.x_len() + s.w_len() + s.y_len()), s.flops());
    Ok(())
}

/// See [`crate::backend::Backend::conv_backward_data`].
pub(super) fn backward_data(
    be: &CudaBackend,
    s: &ConvShape,
    dy: &CudaTensor,
    w: &CudaTensor,
    dx: &mut CudaTensor,
    accumulate: bool,
) -> Result<(), BackendError> {
    let op = "conv_backward_data";
    let mut args = conv_args(op, s)?;
    args.accumulate = i32::from(accumulate);
    check_len(op, "dy", dy.len, s.y_len())?;
    check_len(op, "w", w.len, s.w_len())?;
    check_len(op, "dx", dx.len, s.x_len())?;
    if be.conv3_takes_dgrad(s) {
        let (dy, w, dx) = (dy.bf16(op, "dy")?, w.bf16(op, "w")?, dx.bf16_mut(op, "dx")?);
        return be.conv3_backward_data(op, s, dy, w, dx, accumulate, None);
    }
    if let Some(mut l) = be.conv2_plan(Pass::Dgrad, s) {
        l.args.accumulate = i32::from(accumulate);
        let cfg = be.conv2_prepare(op, &l)?;
        let (dy, w, dx) = (dy.bf16(op, "dy")?, w.bf16(op, "w")?, dx.bf16_mut(op, "dx")?);
        let mut scratch = be.conv2.lock().unwrap_or_else(|e| e.into_inner());
        let w = be.dgrad_weights(op, &l, s, w, &mut scratch)?;
        let gemm = Conv2Gemm {
            a: dy.into(),
            b: w.into(),
            out: dx.into(),
            args: l.args,
        };
        be.launch(op, l.kernel, cfg, gemm)?;
        be.note_work(
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
    let gemm = ConvGemm {
        a: dy.into(),
        b: w.into(),
        out: dx.into(),
        shape: args,
    };
    be.launch(op, kernel, cfg, gemm)?;
    be.note_work(
        2 * (s.y_len() + s.w_len() + s.x_len() * (1 + usize::from(accumulate))),
        s.flops(),
    );
    Ok(())
}

/// See [`crate::backend::Backend::conv_backward_weight`].
pub(super) fn backward_weight(
    be: &CudaBackend,
    s: &ConvShape,
    x: &CudaTensor,
    dy: &CudaTensor,
    dw: &mut CudaTensor,
) -> Result<(), BackendError> {
    let op = "conv_backward_weight";
    let mut args = conv_args(op, s)?;
    check_len(op, "x", x.len, s.x_len())?;
    check_len(op, "dy", dy.len, s.y_len())?;
    check_len(op, "dw", dw.len, s.w_len())?;
    if be.conv3_takes_wgrad(s) {
        let (dy, x, dw) = (dy.bf16(op, "dy")?, x.bf16(op, "x")?, dw.f32_mut(op, "dw")?);
        return be.conv3_backward_weight(op, s, x, dy, dw);
    }
    if let Some(l) = be.conv2_plan(Pass::Wgrad, s) {
        let cfg = be.conv2_prepare(op, &l)?;
        let (dy, x) = (dy.bf16(op, "dy")?, x.bf16(op, "x")?);
        let dw = dw.f32_mut(op, "dw")?;
        let mut scratch = be.conv2.lock().unwrap_or_else(|e| e.into_inner());
        let Conv2Scratch {
            x_stem,
            w_stem,
            planes,
            ..
        } = &mut *scratch;
        let x = be.stem_operands(op, &l, s, x, None, (x_stem, w_stem))?.0;
        return conv2_wgrad(be, op, s, &l, cfg, (x, dy), dw, planes, None);
    }
    // Split the huge reduction (N·P·Q) over gridDim.z so the GPU is full; partial sums meet
    // in f32 atomics on a zeroed gradient.
    let reduction = s.n * s.out_h() * s.out_w();
    let tiles = s.c_out.div_ceil(CONV_TILE) * s.w_len().div_ceil(s.c_out).div_ceil(CONV_TILE);
    let want = (2 * be.sms as usize).div_ceil(tiles.max(1)).max(1);
    let splits = want.min(reduction.div_ceil(256)).max(1);
    let chunk = reduction.div_ceil(splits).div_ceil(32) * 32;
    let splits = reduction.div_ceil(chunk);
    args.k_chunk = to_i32(op, "k_chunk", chunk)?;
    let cfg = gemm_grid(s.c_out, s.w_len() / s.c_out, splits);
    let stream = be.dev.stream().clone();
    let (dy, x) = (dy.bf16(op, "dy")?, x.bf16(op, "x")?);
    let dw = dw.f32_mut(op, "dw")?;
    let mut head = dw.slice_mut(0..s.w_len());
    stream.memset_zeros(&mut head).map_err(drv_err(op))?;
    let kernel = match (s.c_out % 8 == 0, s.c_in % 8 == 0) {
        (true, true) => "conv_wgrad_vec",
        (true, false) => "conv_wgrad_stem",
        _ => "conv_wgrad_scalar",
    };
    let gemm = ConvWgrad {
        dy: dy.into(),
        x: x.into(),
        dw: dw.into(),
        shape: args,
    };
    be.launch(op, kernel, cfg, gemm)?;
    be.note_work(2 * (s.x_len() + s.y_len()) + 4 * s.w_len(), s.flops());
    Ok(())
}
/// The v2 weight gradient `l` (its kernel plain, or with `applied` the `conv2_wgrad_apply_*`
/// one reading the batch norm's input as `x`): one reduction slice writes `dw` itself;
/// several write their f32 planes (every element once: no atomics, no zeroing), summed in
/// slice order by `conv2_wgrad_reduce`.
#[allow(clippy::too_many_arguments)]
pub(super) fn conv2_wgrad(
    be: &CudaBackend,
    op: &'static str,
    s: &ConvShape,
    l: &Conv2Launch,
    cfg: LaunchConfig,
    (x, dy): (&CudaSlice<u16>, &CudaSlice<u16>),
    dw: &mut CudaSlice<f32>,
    planes: &mut Option<CudaSlice<f32>>,
    applied: Option<&AppliedArgs<'_>>,
) -> Result<(), BackendError> {
    let slices = l.grid.2 as usize;
    // What the GEMM itself moves: the operands read, and its planes (or dw) written.
    let gemm_bytes = 2 * (s.x_len() + s.y_len()) + 4 * s.w_len() * slices;
    let len = s.w_len();
    let out = if slices == 1 {
        &mut *dw
    } else {
        ensure(&be.dev, planes, slices * len, op)?;
        planes.as_mut().expect("ensured")
    };
    match applied {
        None => {
            let gemm = Conv2Wgrad {
                dy: dy.into(),
                x: x.into(),
                dw: (&mut *out).into(),
                args: l.args,
            };
            be.launch(op, l.kernel, cfg, gemm)?;
        }
        Some(bn) => {
            let gemm = Conv2WgradApply {
                dy: dy.into(),
                z: x.into(),
                dw: (&mut *out).into(),
                args: l.args,
                mean: bn.mean.into(),
                invstd: bn.invstd.into(),
                gamma: bn.gamma.into(),
                beta: bn.beta.into(),
                relu: bn.relu,
            };
            be.launch(op, l.kernel, cfg, gemm)?;
        }
    }
    be.note_work(gemm_bytes, s.flops());
    if slices == 1 {
        return Ok(());
    }
    let (len_i, slices_i) = (len as i64, to_i32(op, "slices", slices)?);
    let planes = planes.as_ref().expect("ensured");
    be.launch(
        op,
        "conv2_wgrad_reduce",
        elementwise_cfg(len.div_ceil(4)),
        Conv2WgradReduce {
            planes: planes.into(),
            dw: dw.into(),
            len: len_i,
            slices: slices_i,
        },
    )?;
    // The reduce reads every plane and writes dw once; it does no GEMM work.
    be.note_work(4 * len * (slices + 1), 0.0);
    Ok(())
}
