//! The input op (kernels/input.cu): the batch's u8 pixels uploaded, then cropped, mirrored,
//! erased, normalised and mixed into bf16 in one launch.

use super::base::{check_len, drv_err, elementwise_cfg, ensure, to_i32, CudaBackend};
use crate::backend::BackendError;
use crate::cuda::kernel_types::{aug_ints, InputMix};
use crate::cuda::launch::In;
use crate::cuda::launchers::InputTransform;
use crate::cuda::tensor::CudaTensor;
use crate::model::{InputBatch, IMAGENET_MEAN, IMAGENET_STD};

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
    let mix_at = be.step_mix(op, InputMix::of(batch.mix))?;
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
        // SAFETY: the step's mix buffer (one InputMix, uploaded above), alive with the backend.
        mix: unsafe { In::addr(mix_at) },
        dst: dst.into(),
        n: n_i,
        size: s_i,
    };
    be.launch(op, "input_transform", elementwise_cfg(bytes), args)?;
    be.note_work(3 * bytes, 0.0);
    Ok(())
}
