//! The input op (kernels/input.cu): the batch's u8 pixels uploaded, then cropped, mirrored,
//! erased, normalised and mixed into bf16 in one launch; and the kernel's forms of the CPU
//! side's [`Augment`] and [`Mix`], which the staged backend uses too.

use cudarc::driver::DeviceRepr;

use super::{check_len, drv_err, elementwise_cfg, ensure, to_i32, CudaBackend};
use crate::backend::BackendError;
use crate::cuda::launchers::InputTransform;
use crate::cuda::tensor::CudaTensor;
use crate::model::{Augment, InputBatch, Mix, PixelBox, IMAGENET_MEAN, IMAGENET_STD};

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

/// See [`crate::backend::Backend::input`].
pub(super) fn input(
    be: &CudaBackend,
    batch: &InputBatch<'_>,
    out: &mut CudaTensor,
) -> Result<(), BackendError> {
    let op = "input";
    let s = batch.image_size as usize;
    let n = batch.len;
    let bytes = n * s * s * 3;
    check_len(op, "pixels", batch.pixels.len(), bytes)?;
    check_len(op, "output", out.len, bytes)?;
    let mut work = be.work();
    let w = &mut *work;
    ensure(&be.dev, &mut w.pixels, bytes, op)?;
    ensure(&be.dev, &mut w.norm, 6, op)?;
    let stream = be.dev.stream().clone();
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
            ensure(&be.dev, &mut w.ints, params.len(), op)?;
            stream
                .memcpy_htod(&params, w.ints.as_mut().expect("ensured"))
                .map_err(drv_err(op))?;
            1
        }
        None => {
            ensure(&be.dev, &mut w.ints, 1, op)?;
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
    let args = InputTransform {
        src: pixels.into(),
        aug: aug.into(),
        use_aug,
        scale: (&scale).into(),
        shift: (&shift).into(),
        mix,
        dst: dst.into(),
        n: n_i,
        size: s_i,
    };
    be.launch(op, "input_transform", elementwise_cfg(bytes), args)?;
    be.note_work(3 * bytes, 0.0);
    Ok(())
}
