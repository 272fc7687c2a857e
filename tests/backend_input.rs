//! The input op: ImageNet normalisation and the pad-and-crop shift + mirror augmentation.

use birdtrain::backend::cpu::CpuBackend;
use birdtrain::backend::Backend;
use birdtrain::model::{Augment, InputBatch, IMAGENET_MEAN, IMAGENET_STD};

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
        },
        Augment {
            dy: -1,
            dx: 1,
            flip: true,
        },
    ];
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: n,
        image_size: s as u32,
        augment: Some(&aug),
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

#[test]
fn short_buffers_are_errors() {
    let b = CpuBackend::new(1).unwrap();
    let batch = InputBatch {
        pixels: &[0u8; 10],
        labels: &[0],
        len: 1,
        image_size: 4,
        augment: None,
    };
    let err = b.input(&batch, &mut vec![0.0; 48]).unwrap_err().to_string();
    assert!(err.contains("pixels has 10 elements"), "{err}");
}
