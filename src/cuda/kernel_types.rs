//! The kernels' by-value struct parameters, mirrored in Rust with the C layout
//! (`#[repr(C)]`): what a launcher passes for `ConvShape` (kernels/conv.cu), `InputMix`
//! (kernels/input.cu) and `RankBuffersF32`/`RankBuffersF64` (kernels/collective.cu), with the
//! host's forms of the CPU side's [`Augment`] and [`Mix`] that the input kernel reads. (The
//! v2 convolutions' `Conv2Args` lives with their planner, [`super::conv`].) The launchers'
//! unit test compares each size with its C declaration.

use cudarc::driver::DeviceRepr;

use super::launch::value_arg;
use crate::model::{Augment, Mix, PixelBox};

/// Ranks one launch reduces at most (`BT_MAX_RANKS` in kernels/collective.cu).
pub const MAX_RANKS: usize = 8;

/// Kernel-side mirror of `struct ConvShape` in kernels/conv.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConvArgs {
    pub(crate) n: i32,
    pub(crate) h: i32,
    pub(crate) w: i32,
    pub(crate) c: i32,
    pub(crate) k: i32,
    pub(crate) r: i32,
    pub(crate) s: i32,
    pub(crate) p: i32,
    pub(crate) q: i32,
    pub(crate) stride: i32,
    pub(crate) pad: i32,
    pub(crate) k_chunk: i32,
    pub(crate) accumulate: i32,
}

// SAFETY: plain-old-data with the C layout the kernel declares.
unsafe impl DeviceRepr for ConvArgs {}

/// The batch's mixing as kernels/input.cu's `InputMix` reads it from device memory (uploaded
/// before the step, so that a captured CUDA graph replays with each step's own): kind 0
/// (none), 1 (mixup, `lambda`) or 2 (CutMix, the box `y0..y1` × `x0..x1`).
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
// SAFETY: i32 and f32 fields only: all zero bits is a valid value (kind 0, no mixing).
unsafe impl cudarc::driver::ValidAsZeroBits for InputMix {}

/// `input_transform` reads it through a `const InputMix*`.
impl super::launch::DeviceElem for InputMix {
    #[cfg(test)]
    const C_NAME: &'static str = "InputMix";
}

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

/// Kernel-side mirror of `struct RankBuffersF32`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct RankBuffersF32 {
    pub(crate) ptr: [u64; MAX_RANKS],
    pub(crate) scale: [f32; MAX_RANKS],
}

// SAFETY: plain-old-data with the C layout the kernel declares (8 pointers, 8 floats).
unsafe impl DeviceRepr for RankBuffersF32 {}

/// Kernel-side mirror of `struct RankBuffersF64`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct RankBuffersF64 {
    pub(crate) ptr: [u64; MAX_RANKS],
}

// SAFETY: as above (8 pointers).
unsafe impl DeviceRepr for RankBuffersF64 {}

value_arg! {
    ConvArgs => "ConvShape",
    InputMix => "InputMix",
    RankBuffersF32 => "RankBuffersF32",
    RankBuffersF64 => "RankBuffersF64",
}
