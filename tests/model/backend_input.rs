//! The input op: ImageNet normalisation, the pad-and-crop shift + mirror augmentation, and
//! the batch's mixup or CutMix.

use birdtrain::backend::cpu::CpuBackend;
use birdtrain::backend::Backend;
use birdtrain::model::{Augment, InputBatch, Mix, PixelBox, IMAGENET_MEAN, IMAGENET_STD};

#[test]
fn normalises_and_applies_shift_and_flip() {
    let s = 8usize;
    let n = 3;
    let px: Vec<u8> = (0..n * s * s * 3).map(|i| (i * 7 % 256) as u8).collect();
    let labels = vec![0u32; n];
    let aug = [
        Augment::default(),
        Augment {
            dy: 1,
            dx: -1,
            flip: false,
            erase: None,
        },
        Augment {
            dy: -1,
            dx: 1,
            flip: true,
            erase: None,
        },
    ];
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: n,
        image_size: s as u32,
        augment: Some(&aug),
        mix: None,
    };
    let b = CpuBackend::new(2).unwrap();
    let mut out = vec![0.0f32; n * s * s * 3];
    b.input(&batch, &mut out).unwrap();
    for (i, a) in aug.iter().enumerate() {
        for y in 0..s {
            for x in 0..s {
                let xs = if a.flip { s - 1 - x } else { x } as i32;
                let (sy, sx) = (y as i32 + a.dy, xs + a.dx);
                for c in 0..3 {
                    let got = out[((i * s + y) * s + x) * 3 + c];
                    let want = if sy < 0 || sx < 0 || sy >= s as i32 || sx >= s as i32 {
                        0.0
                    } else {
                        let v = px[((i * s + sy as usize) * s + sx as usize) * 3 + c];
                        (f32::from(v) / 255.0 - IMAGENET_MEAN[c]) / IMAGENET_STD[c]
                    };
                    assert!(
                        (got - want).abs() < 1e-5,
                        "image {i} ({y},{x},{c}): {got} vs {want}"
                    );
                }
            }
        }
    }
}

/// Random erasing zeroes the box in output coordinates, after the shift and mirror, and only
/// in the image it was drawn for.
#[test]
fn erases_the_box_after_the_shift_and_mirror() {
    let (s, n) = (8usize, 2usize);
    let px: Vec<u8> = (0..n * s * s * 3).map(|i| (i * 5 % 253) as u8).collect();
    let labels = vec![0u32; n];
    let shifted = Augment {
        dy: 1,
        dx: -1,
        flip: true,
        erase: None,
    };
    let erase = PixelBox {
        y0: 1,
        y1: 4,
        x0: 5,
        x1: 8,
    };
    let b = CpuBackend::new(1).unwrap();
    let run = |aug: &[Augment]| {
        let mut out = vec![0.0f32; n * s * s * 3];
        let batch = InputBatch {
            pixels: &px,
            labels: &labels,
            len: n,
            image_size: s as u32,
            augment: Some(aug),
            mix: None,
        };
        b.input(&batch, &mut out).unwrap();
        out
    };
    let plain = run(&[shifted, shifted]);
    let erased = run(&[
        shifted,
        Augment {
            erase: Some(erase),
            ..shifted
        },
    ]);
    let img = s * s * 3;
    assert_eq!(plain[..img], erased[..img], "image 0 has no box");
    for y in 0..s {
        for x in 0..s {
            for c in 0..3 {
                let at = img + (y * s + x) * 3 + c;
                let want = if erase.contains(y, x) { 0.0 } else { plain[at] };
                assert_eq!(erased[at], want, "({y},{x},{c})");
            }
        }
    }
    assert_eq!(erase.area(), 9);
}

/// Mixup blends each augmented image with its partner n−1−i (the middle image of an odd
/// batch with itself); CutMix takes the partner's augmented pixels inside the box and keeps
/// the image's own outside. Checked against the unmixed output of the same batch.
#[test]
fn mixes_each_augmented_image_with_its_partner() {
    let (s, n) = (9usize, 5usize);
    let px: Vec<u8> = (0..n * s * s * 3).map(|i| (i * 13 % 251) as u8).collect();
    let labels = vec![0u32; n];
    let aug: Vec<Augment> = (0..n as i32)
        .map(|i| Augment {
            dy: i % 2,
            dx: -(i % 2),
            flip: i % 3 == 0,
            erase: None,
        })
        .collect();
    let b = CpuBackend::new(2).unwrap();
    let img = s * s * 3;
    let run = |mix: Option<Mix>| {
        let mut out = vec![0.0f32; n * img];
        let batch = InputBatch {
            pixels: &px,
            labels: &labels,
            len: n,
            image_size: s as u32,
            augment: Some(&aug),
            mix,
        };
        b.input(&batch, &mut out).unwrap();
        out
    };
    let plain = run(None);
    let blended = run(Some(Mix::Blend { lambda: 0.3 }));
    let (y0, y1, x0, x1) = (2, 7, 4, 9);
    let pasted = run(Some(Mix::Paste(PixelBox { y0, y1, x0, x1 })));
    for i in 0..n {
        let j = n - 1 - i;
        for y in 0..s {
            for x in 0..s {
                for c in 0..3 {
                    let at = |k: usize| (k * s + y) * s * 3 + x * 3 + c;
                    let want = 0.3 * plain[at(i)] + 0.7 * plain[at(j)];
                    let got = blended[at(i)];
                    assert!(
                        (got - want).abs() < 1e-5,
                        "mixup {i} ({y},{x},{c}): {got} vs {want}"
                    );
                    let inside = (y0 as usize..y1 as usize).contains(&y)
                        && (x0 as usize..x1 as usize).contains(&x);
                    let want = plain[at(if inside { j } else { i })];
                    assert_eq!(pasted[at(i)], want, "CutMix {i} ({y},{x},{c})");
                }
            }
        }
    }
    assert_ne!(blended, plain, "a blend of distinct images changes them");
    // The box's share of the image is the partner's label weight.
    let m = Mix::Paste(PixelBox { y0, y1, x0, x1 });
    assert!((m.own_weight(s as u32) - (1.0 - 25.0 / 81.0)).abs() < 1e-6);
}

#[test]
fn short_buffers_are_errors() {
    let b = CpuBackend::new(1).unwrap();
    let batch = InputBatch {
        pixels: &[0u8; 10],
        labels: &[0],
        len: 1,
        image_size: 4,
        augment: None,
        mix: None,
    };
    let err = b.input(&batch, &mut vec![0.0; 48]).unwrap_err().to_string();
    assert!(err.contains("pixels has 10 elements"), "{err}");
}
