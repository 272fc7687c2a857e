//! Every operation of the automatic augmentation policies (`--auto-augment`) on one image,
//! as a decode worker applies it after the crop.
//!
//! `cargo bench -p pipeline --bench auto_augment -- [--side 224] [--reps 50]`. Each operation
//! runs `reps` times on a fresh copy of a photo-like image after one warm-up; the median per
//! image is printed, in milliseconds, with torchvision's strengths at bin 15 of 30. The peer
//! is `benches/torch_augment_ops.py` (torchvision's own operations on the same image size, one
//! thread).

use std::time::Instant;

use pipeline::{AugmentOp, OpDraw};

fn main() {
    let mut side = 224u32;
    let mut reps = 50usize;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut number = |name: &str| -> usize {
            let v = it.next().unwrap_or_default();
            v.parse().ok().filter(|&n| n > 0).unwrap_or_else(|| {
                eprintln!("error: {name} {v}: expected a whole number of at least 1");
                std::process::exit(2)
            })
        };
        match flag.as_str() {
            "--bench" => {}
            "--side" => side = number("--side") as u32,
            "--reps" => reps = number("--reps"),
            other => {
                eprintln!("error: unknown flag {other} (expected --side or --reps)");
                std::process::exit(2)
            }
        }
    }
    let image: Vec<u8> = (0..side * side)
        .flat_map(|i| {
            let (x, y) = ((i % side) as f32, (i / side) as f32);
            [
                (128.0 + 100.0 * (x / 17.0).sin()) as u8,
                (128.0 + 90.0 * (y / 23.0 + x / 41.0).cos()) as u8,
                ((x + y) * 0.3) as u8,
            ]
        })
        .collect();
    // Bin 15 of TrivialAugmentWide's ranges.
    let strengths = [
        (AugmentOp::Identity, 0.0),
        (AugmentOp::ShearX, 0.495),
        (AugmentOp::ShearY, 0.495),
        (AugmentOp::TranslateX, 16.0),
        (AugmentOp::TranslateY, 16.0),
        (AugmentOp::Rotate, 67.5),
        (AugmentOp::Brightness, 0.495),
        (AugmentOp::Color, 0.495),
        (AugmentOp::Contrast, 0.495),
        (AugmentOp::Sharpness, 0.495),
        (AugmentOp::Posterize, 5.0),
        (AugmentOp::Solarize, 127.5),
        (AugmentOp::AutoContrast, 0.0),
        (AugmentOp::Equalize, 0.0),
    ];
    println!("operation      ms per {side}×{side} image (median of {reps})");
    let mut scratch = Vec::new();
    let mut total = 0.0;
    for (op, magnitude) in strengths {
        let draw = OpDraw { op, magnitude };
        let mut times = Vec::with_capacity(reps);
        for rep in 0..=reps {
            let mut rgb = image.clone();
            let started = Instant::now();
            draw.apply(&mut rgb, side, side, &mut scratch);
            let elapsed = started.elapsed().as_secs_f64() * 1e3;
            std::hint::black_box(&rgb);
            if rep > 0 {
                times.push(elapsed);
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        total += median;
        println!("{:<14} {median:.3}", op.name());
    }
    println!(
        "mean of the 14 (TrivialAugmentWide's cost per image) {:.3}",
        total / 14.0
    );
}
