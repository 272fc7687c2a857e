//! The v3 convolutions (kernels/conv3.cu, `BIRDTRAIN_CONV=v3`): 1×1 convolutions at stride 1,
//! 3×3 ones at stride 1 (in whole tiles of pixels), the forward and weight gradient of
//! strided 3×3 and 1×1 ones and their data gradients (even extents for the 3×3) on Hopper as `wgmma`
//! GEMMs fed by TMA, with the same batch-norm epilogues and records as v2, so the fused batch
//! norm reads them unchanged. [`crate::cuda::conv3`] decides which
//! layers they take; every other layer keeps v2. Each launch encodes its operands' tensor
//! maps (a host call, no device work) and passes them by value.

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};

use super::base::{dev_err, drv_err, elementwise_cfg, ensure, to_i32, Conv2Scratch, CudaBackend};
use crate::backend::{BackendError, ConvShape};
use crate::cuda::conv::ConvVersion;
use crate::cuda::conv3::{self, Conv3Args, TensorMap};
use crate::cuda::error::CudaError;
use crate::cuda::launchers::{
    Conv2WgradReduce, Conv3DgradBn, Conv3DgradWeights3x3, Conv3DgradWeightsS2, Conv3FwdStats,
    Conv3Gemm, Conv3TransposeWeights, Conv3Wgrad,
};

/// The batch-norm gradient epilogue's operands of a v3 data gradient (conv2's contract).
pub(super) struct DgradBn<'a> {
    /// The per-tile records (`[2][tiles][channels]`).
    pub(super) part: &'a mut CudaSlice<f32>,
    /// The batch norm's output (its ReLU's mask), or none.
    pub(super) bn_y: Option<&'a CudaSlice<u16>>,
    /// The batch norm's input.
    pub(super) bn_x: &'a CudaSlice<u16>,
    /// Its saved mean and 1/std.
    pub(super) mean: &'a CudaSlice<f32>,
    /// See `mean`.
    pub(super) invstd: &'a CudaSlice<f32>,
    /// A gradient added before the mask, or none.
    pub(super) residual: Option<&'a CudaSlice<u16>>,
    /// γ and β where the mask is recomputed from `bn_x` (no `bn_y`, `relu` set).
    pub(super) gamma_beta: Option<(&'a CudaSlice<u16>, &'a CudaSlice<u16>)>,
    /// Whether the batch norm has a ReLU (the mask: from `bn_y`, else from `bn_signs`, else
    /// recomputed).
    pub(super) relu: bool,
    /// y's signs packed a bit per element (`bn_apply_signs_vec`), read for the mask instead
    /// of `bn_y` (which is then none).
    pub(super) bn_signs: Option<&'a CudaSlice<u8>>,
}

impl CudaBackend {
    /// Whether v3 is selected and takes this layer's weight gradient (1×1 at stride 1, or
    /// through 4-D boxes a 3×3 at stride 1 or 2 or a strided 1×1, with whole 64-pixel tiles).
    pub(super) fn conv3_takes_wgrad(&self, s: &ConvShape) -> bool {
        self.conv == ConvVersion::V3 && conv3::takes_wgrad(s, self.dev.arch())
    }

    /// Whether v3 is selected and takes this layer's data gradient (1×1 at stride 1 or 2, or
    /// 3×3 at stride 1 with whole tiles).
    pub(super) fn conv3_takes_dgrad(&self, s: &ConvShape) -> bool {
        self.conv == ConvVersion::V3 && conv3::takes_dgrad(s, self.dev.arch())
    }

    /// Whether v3 is selected and takes this layer's data gradient with the batch-norm
    /// gradient epilogue ([`conv3::takes_dgrad_bn`]: not the strided 1×1's).
    pub(super) fn conv3_takes_dgrad_bn(&self, s: &ConvShape) -> bool {
        self.conv == ConvVersion::V3 && conv3::takes_dgrad_bn(s, self.dev.arch())
    }

    /// Whether v3 is selected and takes this layer's forward pass (1×1 at stride 1, or through
    /// 4-D boxes a 3×3 at stride 1 or 2 or a strided 1×1, with whole tiles).
    pub(super) fn conv3_takes_forward(&self, s: &ConvShape) -> bool {
        self.conv == ConvVersion::V3 && conv3::takes_forward(s, self.dev.arch())
    }

    /// The launch configuration of a v3 GEMM over `grid`, after raising the kernel's dynamic
    /// shared-memory limit to the ring's size.
    fn conv3_prepare(
        &self,
        op: &'static str,
        kernel: &'static str,
        grid: (u32, u32, u32),
    ) -> Result<LaunchConfig, BackendError> {
        self.dev
            .function(conv3::FILE, kernel)
            .map_err(dev_err(op))?
            .set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                conv3::smem_bytes(kernel) as i32,
            )
            .map_err(drv_err(op))?;
        Ok(LaunchConfig {
            grid_dim: grid,
            block_dim: (conv3::THREADS, 1, 1),
            shared_mem_bytes: conv3::smem_bytes(kernel) as u32,
        })
    }

    /// The launch configuration of the forward or data-gradient GEMM of `args` run by `kernel`
    /// (what the tile schedule chose, `BIRDTRAIN_CONV3_TILES`), over the schedule's grid.
    fn conv3_gemm_cfg(
        &self,
        op: &'static str,
        kernel: &'static str,
        args: &Conv3Args,
    ) -> Result<LaunchConfig, BackendError> {
        let grid = self.conv3_tiles.grid(kernel, args, self.sms);
        self.conv3_prepare(op, kernel, grid)
    }

    /// The tensor map of `buf` as a `[rows][cols]` bf16 matrix read in boxes of `box_rows`.
    fn tensor_map(
        &self,
        op: &'static str,
        buf: &CudaSlice<u16>,
        rows: usize,
        cols: usize,
        box_rows: usize,
    ) -> Result<TensorMap, BackendError> {
        let (ptr, _record) = buf.device_ptr(self.dev.stream());
        TensorMap::bf16_matrix(ptr, rows, cols, box_rows).map_err(dev_err(op))
    }

    /// The tensor map of `buf` as an NHWC tensor of `shape` (images, rows, columns, channels)
    /// read in 4-D boxes of 64 channels × `tile` (images, rows, columns), every `stride`-th
    /// row and column.
    fn tensor_map_nhwc(
        &self,
        op: &'static str,
        buf: &CudaSlice<u16>,
        shape: (usize, usize, usize, usize),
        tile: (usize, usize, usize),
        stride: usize,
    ) -> Result<TensorMap, BackendError> {
        let (ptr, _record) = buf.device_ptr(self.dev.stream());
        TensorMap::bf16_nhwc(ptr, shape, tile, stride).map_err(dev_err(op))
    }

    /// y = conv(x, w) for a layer [`Self::conv3_takes_forward`] accepts (1×1 at stride 1 as a
    /// plain GEMM, else through 4-D boxes in whole tiles), and with `part` the per-tile
    /// statistics records of y.
    pub(super) fn conv3_forward(
        &self,
        op: &'static str,
        s: &ConvShape,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        y: &mut CudaSlice<u16>,
        part: Option<&mut CudaSlice<f32>>,
    ) -> Result<(), BackendError> {
        let (args, map_x, kernels) = if s.kernel == 1 && s.stride == 1 {
            let args = forward_args(op, s)?;
            let (m, k) = (args.m as usize, args.k as usize);
            let map_x = self.tensor_map(op, x, m, k, conv3::TILE_M)?;
            (args, map_x, (conv3::FWD_KERNEL, conv3::FWD_STATS_KERNEL))
        } else {
            let args = conv3::forward_4d_args(s, self.dev.arch()).ok_or_else(|| {
                dev_err(op)(CudaError::Unsupported {
                    what: format!("{s:?}: no whole tile for the v3 kernels"),
                })
            })?;
            // Tiles of output pixels; the input's boxes span stride × them.
            let tile =
                conv3::tile_3x3(s.n, s.out_h(), s.out_w()).expect("forward_4d_args found one");
            let shape = (s.n, s.h, s.w, s.c_in);
            let map_x = self.tensor_map_nhwc(op, x, shape, tile, s.stride)?;
            (
                args,
                map_x,
                (conv3::FWD_3X3_KERNEL, conv3::FWD_STATS_3X3_KERNEL),
            )
        };
        let (n, k) = (args.n as usize, args.k as usize);
        let bn = conv3::tile_n(&args);
        let kernels = (
            self.conv3_tiles.kernel(conv3::with_tile(kernels.0, bn)),
            self.conv3_tiles.kernel(conv3::with_tile(kernels.1, bn)),
        );
        // w as [K][R·S·C]: K-major rows of the (tap, channel) reduction.
        let map_w = self.tensor_map(op, w, n, k, bn)?;
        let records = conv3::records(&args);
        let bytes = 2 * (s.x_len() + s.w_len() + s.y_len());
        match part {
            None => {
                let cfg = self.conv3_gemm_cfg(op, kernels.0, &args)?;
                let gemm = Conv3Gemm {
                    map_a: map_x,
                    map_b: map_w,
                    out: y.into(),
                    args,
                };
                self.launch(op, kernels.0, cfg, gemm)?;
                self.note_work(bytes, s.flops());
            }
            Some(part) => {
                let cfg = self.conv3_gemm_cfg(op, kernels.1, &args)?;
                let gemm = Conv3FwdStats {
                    map_x,
                    map_w,
                    y: y.into(),
                    args,
                    part: part.into(),
                };
                self.launch(op, kernels.1, cfg, gemm)?;
                self.note_work(bytes + 8 * records * n, s.flops());
            }
        }
        Ok(())
    }

    /// dx = dgrad(dy, w) (+ dx when `accumulate`) for a layer [`Self::conv3_takes_dgrad`]
    /// accepts, through the weight transposed (1×1) or rearranged per tap (3×3; per phase and
    /// tap at stride 2) in the scratch;
    /// with `bn` (a layer [`Self::conv3_takes_dgrad_bn`] accepts), the batch-norm gradient
    /// epilogue and its records. A strided 1×1 writes the GEMM's pixels of dx and zeros (or,
    /// accumulating, nothing) at the others from the same epilogue.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn conv3_backward_data(
        &self,
        op: &'static str,
        s: &ConvShape,
        dy: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        dx: &mut CudaSlice<u16>,
        accumulate: bool,
        bn: Option<DgradBn<'_>>,
    ) -> Result<(), BackendError> {
        let three = s.kernel == 3;
        let strided = !three && s.stride > 1;
        if strided && bn.is_some() {
            return Err(dev_err(op)(CudaError::Unsupported {
                what: format!(
                    "{s:?}: the strided 1×1's v3 data gradient has no batch-norm epilogue"
                ),
            }));
        }
        let args = if three {
            conv3::dgrad_3x3_args(s, self.dev.arch(), accumulate)
        } else {
            conv3::dgrad_args(s, accumulate)
        }
        .ok_or_else(|| too_large(op, s))?;
        let (m, n, k) = (args.m as usize, args.n as usize, args.k as usize);
        let phased = conv3::is_phased(&args);
        // The stride-2 3×3's weight per phase: [4][c_in][4 taps·c_out] (16 taps for 9).
        let wt_rows = if phased { conv3::DGRAD_PHASES * n } else { n };
        let mut scratch = self.conv2.lock().unwrap_or_else(|e| e.into_inner());
        let Conv2Scratch { wt, .. } = &mut *scratch;
        ensure(&self.dev, wt, wt_rows * k, op)?;
        let wt = wt.as_mut().expect("ensured");
        if phased {
            let rearrange = Conv3DgradWeightsS2 {
                w: w.into(),
                wt: (&mut *wt).into(),
                k_out: to_i32(op, "c_out", s.c_out)?,
                c_in: to_i32(op, "c_in", s.c_in)?,
            };
            let kernel = conv3::DGRAD_WEIGHTS_S2_KERNEL;
            self.launch(op, kernel, elementwise_cfg(wt_rows * k), rearrange)?;
        } else if three {
            // w is KRSC; the GEMM's B is [c_in][(tap, c_out)] (K-major over the reduction).
            let rearrange = Conv3DgradWeights3x3 {
                w: w.into(),
                wt: (&mut *wt).into(),
                k_out: to_i32(op, "c_out", s.c_out)?,
                taps: 9,
                c_in: to_i32(op, "c_in", s.c_in)?,
            };
            let kernel = conv3::DGRAD_WEIGHTS_3X3_KERNEL;
            self.launch(op, kernel, elementwise_cfg(s.w_len()), rearrange)?;
        } else {
            // w is [K = c_out][c_in]; the GEMM's B is wᵀ, [c_in][K] (K-major).
            let (grid, block) = conv3::transpose_launch(k, n);
            let transpose = Conv3TransposeWeights {
                w: w.into(),
                wt: (&mut *wt).into(),
                rows: to_i32(op, "c_out", k)?,
                cols: to_i32(op, "c_in", n)?,
            };
            let cfg = LaunchConfig {
                grid_dim: grid,
                block_dim: block,
                shared_mem_bytes: 0,
            };
            self.launch(op, conv3::TRANSPOSE_KERNEL, cfg, transpose)?;
        }
        self.note_work(4 * s.w_len(), 0.0);
        let map_dy = if three {
            // Tiles of dx's pixels at stride 1, of dy's (each phase's) at stride 2.
            let (h, w) = (s.out_h(), s.out_w());
            let tile = conv3::tile_3x3(s.n, h, w).expect("dgrad_3x3_args found one");
            self.tensor_map_nhwc(op, dy, (s.n, h, w, s.c_out), tile, 1)?
        } else {
            self.tensor_map(op, dy, m, k, conv3::TILE_M)?
        };
        let bn_cols = conv3::tile_n(&args);
        let map_wt = self.tensor_map(op, wt, wt_rows, k, bn_cols)?;
        let (plain, with_bn) = if three {
            (conv3::DGRAD_3X3_KERNEL, conv3::DGRAD_BN_3X3_KERNEL)
        } else {
            (conv3::DGRAD_KERNEL, conv3::DGRAD_BN_KERNEL)
        };
        let (plain, with_bn) = (
            self.conv3_tiles.kernel(conv3::with_tile(plain, bn_cols)),
            self.conv3_tiles.kernel(conv3::with_tile(with_bn, bn_cols)),
        );
        let streams = 2 + usize::from(accumulate);
        let bytes = if strided {
            // dx written once (the GEMM's pixels and the zeros), or its GEMM pixels (dy's
            // count of them) read and written when accumulating.
            let dx_bytes = if accumulate { 2 * m * n } else { s.x_len() };
            2 * (s.y_len() + s.w_len() + dx_bytes)
        } else {
            2 * (s.y_len() + s.w_len() + s.x_len() * streams)
        };
        match bn {
            None => {
                let cfg = self.conv3_gemm_cfg(op, plain, &args)?;
                let gemm = Conv3Gemm {
                    map_a: map_dy,
                    map_b: map_wt,
                    out: dx.into(),
                    args,
                };
                self.launch(op, plain, cfg, gemm)?;
                self.note_work(bytes, s.flops());
            }
            Some(bn) => {
                let cfg = self.conv3_gemm_cfg(op, with_bn, &args)?;
                let extra = usize::from(bn.residual.is_some()) + usize::from(bn.bn_y.is_some());
                // A byte of packed signs per 8 elements of dx.
                let signs_bytes = bn.bn_signs.map_or(0, |_| s.x_len() / 8);
                let records = conv3::records(&args);
                let gemm = Conv3DgradBn {
                    map_dy,
                    map_wt,
                    dx: dx.into(),
                    args,
                    part: bn.part.into(),
                    bn_y: bn.bn_y.map(Into::into),
                    bn_x: bn.bn_x.into(),
                    mean: bn.mean.into(),
                    invstd: bn.invstd.into(),
                    residual: bn.residual.map(Into::into),
                    gamma: bn.gamma_beta.map(|(g, _)| g.into()),
                    beta: bn.gamma_beta.map(|(_, b)| b.into()),
                    relu: i32::from(bn.relu),
                    bn_signs: bn.bn_signs.map(Into::into),
                };
                self.launch(op, with_bn, cfg, gemm)?;
                self.note_work(
                    bytes + 2 * s.x_len() * extra + signs_bytes + 8 * records * n,
                    s.flops(),
                );
            }
        }
        Ok(())
    }

    /// dw = wgrad(x, dy) for a layer [`Self::conv3_takes_wgrad`] accepts: slices of the pixels
    /// into f32 planes, summed in slice order by conv2.cu's reduce (one slice writes dw itself).
    pub(super) fn conv3_backward_weight(
        &self,
        op: &'static str,
        s: &ConvShape,
        x: &CudaSlice<u16>,
        dy: &CudaSlice<u16>,
        dw: &mut CudaSlice<f32>,
    ) -> Result<(), BackendError> {
        // Both operands MN-major: boxes of 64 channels × 64 pixels (1×1 at stride 1: 64
        // consecutive rows; else a whole 64-pixel tile of dy, x's at stride × it, shifted by
        // the tap of each 64 columns of dw).
        let (args, slices, map_dy, map_x, kernel) = if s.kernel == 1 && s.stride == 1 {
            let (args, slices) =
                conv3::wgrad_args(s, self.sms as usize).ok_or_else(|| too_large(op, s))?;
            let (pixels, c_out, c_in) = (args.k as usize, args.m as usize, args.n as usize);
            let map_dy = self.tensor_map(op, dy, pixels, c_out, conv3::TILE_K)?;
            let map_x = self.tensor_map(op, x, pixels, c_in, conv3::TILE_K)?;
            (args, slices, map_dy, map_x, conv3::WGRAD_KERNEL)
        } else {
            let (args, slices, tile) = conv3::wgrad_4d_args(s, self.dev.arch(), self.sms as usize)
                .ok_or_else(|| too_large(op, s))?;
            let dy_shape = (s.n, s.out_h(), s.out_w(), s.c_out);
            let map_dy = self.tensor_map_nhwc(op, dy, dy_shape, tile, 1)?;
            let map_x = self.tensor_map_nhwc(op, x, (s.n, s.h, s.w, s.c_in), tile, s.stride)?;
            (args, slices, map_dy, map_x, conv3::WGRAD_3X3_KERNEL)
        };
        // 64-column tiles where N ≤ 64, 64-row ones where M (output channels) ≤ 64.
        let kernel = conv3::wgrad_kernel(kernel, &args);
        let grid = conv3::wgrad_grid(kernel, &args, slices);
        let cfg = self.conv3_prepare(op, kernel, grid)?;
        let len = s.w_len();
        let gemm_bytes = 2 * (s.x_len() + s.y_len()) + 4 * len * slices;
        if slices == 1 {
            let gemm = Conv3Wgrad {
                map_dy,
                map_x,
                dw: dw.into(),
                args,
            };
            self.launch(op, kernel, cfg, gemm)?;
            self.note_work(gemm_bytes, s.flops());
            return Ok(());
        }
        let mut scratch = self.conv2.lock().unwrap_or_else(|e| e.into_inner());
        let Conv2Scratch { planes, .. } = &mut *scratch;
        ensure(&self.dev, planes, slices * len, op)?;
        let planes = planes.as_mut().expect("ensured");
        let gemm = Conv3Wgrad {
            map_dy,
            map_x,
            dw: (&mut *planes).into(),
            args,
        };
        self.launch(op, kernel, cfg, gemm)?;
        self.note_work(gemm_bytes, s.flops());
        let reduce = Conv2WgradReduce {
            planes: (&*planes).into(),
            dw: dw.into(),
            len: len as i64,
            slices: to_i32(op, "slices", slices)?,
        };
        self.launch(
            op,
            "conv2_wgrad_reduce",
            elementwise_cfg(len.div_ceil(4)),
            reduce,
        )?;
        self.note_work(4 * len * (slices + 1), 0.0);
        Ok(())
    }
}

/// The forward GEMM's arguments, or the error naming a layer too large for 32-bit indices.
fn forward_args(op: &'static str, s: &ConvShape) -> Result<Conv3Args, BackendError> {
    conv3::forward_args(s).ok_or_else(|| too_large(op, s))
}

fn too_large(op: &'static str, s: &ConvShape) -> BackendError {
    dev_err(op)(CudaError::Unsupported {
        what: format!("{s:?}: an extent beyond the v3 kernels' 32-bit indices"),
    })
}
