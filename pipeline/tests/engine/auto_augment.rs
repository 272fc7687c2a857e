//! `PipelineBuilder::auto_augment`: every operation against torchvision's own (where
//! `/usr/bin/python3` imports torch and torchvision: scripts/test.sh installs them and fails the
//! comparison without them), and every image handed out is its plain
//! image with the draw of `(seed, epoch, sample id)` applied, before the colour jitter,
//! whatever the workers or the cache.

use crate::common;
use common::pixels_by_id;

use std::io::Write;
use std::process::{Command, Stdio};

use pipeline::{AugmentOp, AugmentScratch, AutoAugment, ColorJitter, OpDraw, PipelineBuilder};
use rand::{Rng, SeedableRng};

use common::Listed;

const PYTHON: &str = "/usr/bin/python3";
const SIDE: u32 = 24;
const SEED: u64 = 21;

/// Whether the peer is there. Where the test command requires it (`BIRDTRAIN_REQUIRE_PEERS=1`,
/// set by scripts/test.sh after installing it) a missing peer fails the test instead.
fn torchvision_available() -> bool {
    let available = Command::new(PYTHON)
        .args(["-c", "import torch, torchvision"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        available || std::env::var_os("BIRDTRAIN_REQUIRE_PEERS").is_none_or(|v| v != "1"),
        "{PYTHON} cannot import torch and torchvision, which BIRDTRAIN_REQUIRE_PEERS=1 requires: \
         run scripts/install-test-peers.sh (Debian's python3-torch and python3-torchvision)"
    );
    available
}

/// What `tests/engine/torchvision_autoaugment.py` answers to `request`.
fn ask_torchvision(request: &serde_json::Value) -> Vec<u8> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/engine/torchvision_autoaugment.py"
    );
    let mut child = Command::new(PYTHON)
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(request.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// torchvision's result of each `(op, magnitude)` applied alone to `image`.
fn torchvision(image: &[u8], side: u32, ops: &[(AugmentOp, f32)]) -> Vec<Vec<u8>> {
    let out = ask_torchvision(&serde_json::json!({
        "side": side,
        "image": image,
        "ops": ops.iter().map(|(op, m)| serde_json::json!([op.name(), m])).collect::<Vec<_>>(),
    }));
    let len = image.len();
    assert_eq!(out.len(), len * ops.len());
    out.chunks_exact(len).map(<[u8]>::to_vec).collect()
}

/// A photo-like image: smooth colour waves with a little noise.
fn photo(side: u32, seed: u64) -> Vec<u8> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    for y in 0..side {
        for x in 0..side {
            let (fx, fy) = (x as f32 / side as f32, y as f32 / side as f32);
            for (c, phase) in [(0, 0.0f32), (1, 2.0), (2, 4.0)] {
                let wave = 0.5 + 0.4 * ((6.0 * fx + 3.0 * fy * (c + 1) as f32 + phase).sin());
                let noise: f32 = rng.random_range(-12.0..12.0);
                out.push((wave * 255.0 + noise).clamp(0.0, 255.0) as u8);
            }
        }
    }
    out
}

#[test]
fn every_operation_matches_torchvision() {
    if !torchvision_available() {
        eprintln!("skipped: {PYTHON} cannot import torch and torchvision");
        return;
    }
    use AugmentOp::*;
    let ops: Vec<(AugmentOp, f32)> = vec![
        (Identity, 0.0),
        (Brightness, 0.33),
        (Brightness, -0.66),
        (Color, 0.99),
        (Color, -0.5),
        (Contrast, 0.7),
        (Contrast, -0.9),
        (Sharpness, 0.99),
        (Sharpness, -0.99),
        (Posterize, 2.0),
        (Posterize, 5.0),
        (Posterize, 8.0),
        (Solarize, 255.0),
        (Solarize, 127.5),
        (Solarize, 0.0),
        (AutoContrast, 0.0),
        (Equalize, 0.0),
        (Invert, 0.0),
        (TranslateX, 13.0),
        (TranslateX, -31.6),
        (TranslateY, 7.9),
        (ShearX, 0.33),
        (ShearX, -0.99),
        (ShearY, 0.5),
        (Rotate, 30.0),
        (Rotate, -135.0),
        (Rotate, 4.5),
    ];
    for (side, seed) in [(40u32, 1u64), (33, 2)] {
        let image = photo(side, seed);
        let want = torchvision(&image, side, &ops);
        for ((op, magnitude), want) in ops.iter().zip(&want) {
            let mut got = image.clone();
            OpDraw {
                op: *op,
                magnitude: *magnitude,
            }
            .apply(&mut got, side, side, &mut Vec::new());
            let diffs: Vec<i32> = got
                .iter()
                .zip(want)
                .map(|(g, w)| (i32::from(*g) - i32::from(*w)).abs())
                .filter(|d| *d > 0)
                .collect();
            let worst = diffs.iter().max().copied().unwrap_or(0);
            let what = format!(
                "{} {magnitude} on {side}×{side}: {} of {} bytes differ, worst by {worst}",
                op.name(),
                diffs.len(),
                got.len()
            );
            eprintln!("{what}");
            if matches!(op, ShearX | ShearY | Rotate) {
                // The resampling follows torch's f32 steps, but where a tap's weight is a
                // half the rounding order of its sums can still tip a byte by one.
                assert!(worst <= 1 && diffs.len() * 100 <= got.len(), "{what}");
            } else {
                assert!(diffs.is_empty(), "{what}");
            }
        }
    }
}

#[test]
fn the_strength_bins_are_torchvisions() {
    if !torchvision_available() {
        eprintln!("skipped: {PYTHON} cannot import torch and torchvision");
        return;
    }
    let side = 224;
    let out = ask_torchvision(&serde_json::json!({ "spaces": side }));
    let spaces: serde_json::Value = serde_json::from_slice(&out).unwrap();
    for (class, policy) in [
        ("TrivialAugmentWide", AutoAugment::TrivialAugmentWide),
        ("RandAugment", AutoAugment::RAND_AUGMENT),
        ("AutoAugment", AutoAugment::ImageNet),
        ("AugMix", AutoAugment::AUGMIX),
    ] {
        let space = spaces[class].as_object().unwrap();
        for (name, bins) in space {
            let op = AugmentOp::ALL
                .into_iter()
                .chain([AugmentOp::Invert])
                .find(|op| op.name() == name)
                .unwrap_or_else(|| panic!("{class} has {name}, which the engine lacks"));
            let bins = bins.as_array().unwrap();
            if bins.is_empty() {
                assert_eq!(policy.magnitude(op, 0, side), 0.0, "{class} {name}");
                continue;
            }
            assert_eq!(bins.len() as u32, policy.bins(), "{class} {name}");
            for (bin, want) in bins.iter().enumerate() {
                let want = want.as_f64().unwrap() as f32;
                let got = policy.magnitude(op, bin as u32, side);
                // torch's f32 linspace adds steps to a base chosen per vector of lanes, which
                // depends on the CPU's vector width: its values can move by an ulp or two.
                let ulps = 2.0 * f32::EPSILON * want.abs().max(1.0);
                assert!(
                    (got - want).abs() <= ulps,
                    "{class} {name} bin {bin}: {got} against torchvision's {want}"
                );
            }
        }
    }
}

fn images(count: usize) -> Listed {
    common::colourful(count, SIDE)
}

fn builder(im: &Listed) -> PipelineBuilder {
    im.train_builder(SIDE, SEED)
}

#[test]
fn each_image_is_its_plain_image_with_its_draw_then_the_jitter_applied() {
    let im = images(12);
    let plain = builder(&im).build().unwrap();
    let jitter = ColorJitter::uniform(0.3);
    for policy in [
        AutoAugment::TrivialAugmentWide,
        AutoAugment::RandAugment { magnitude: 15 },
        AutoAugment::ImageNet,
        AutoAugment::AugMix { severity: 5 },
    ] {
        for with_jitter in [false, true] {
            // The even samples are mirrored afterwards (as the device mirrors): their
            // operations are the draw as it looks in the mirror.
            let mirrored: pipeline::MirroredLater = std::sync::Arc::new(|_, id| id % 2 == 0);
            let augmented = builder(&im)
                .auto_augment(Some(policy))
                .mirrored_later(Some(mirrored))
                .color_jitter(with_jitter.then_some(jitter))
                .workers(3)
                .build()
                .unwrap();
            let mut changed = 0;
            for epoch in 0..2 {
                let before = pixels_by_id(&plain, epoch, 0, 0);
                let after = pixels_by_id(&augmented, epoch, 0, 0);
                assert_eq!(before.len(), 12);
                for (id, plain) in &before {
                    let mut want = plain.clone();
                    let draw = policy.draw(SEED, epoch, *id, SIDE);
                    let draw = if id % 2 == 0 { draw.mirrored() } else { draw };
                    draw.apply(&mut want, SIDE, &mut AugmentScratch::default());
                    if with_jitter {
                        jitter.draw(SEED, epoch, *id).apply(&mut want);
                    }
                    assert_eq!(after[id], want, "{policy:?} sample {id} epoch {epoch}");
                    changed += usize::from(after[id] != *plain);
                }
            }
            // Identity is 1 of 14 operations: nearly every image changes.
            assert!(
                changed >= 18,
                "{policy:?}: only {changed} of 24 images changed"
            );
        }
    }
    // The cache keeps the images as decoded: a plain pipeline on it still sees them so.
    let again = builder(&im).build().unwrap();
    assert_eq!(pixels_by_id(&again, 0, 0, 0), pixels_by_id(&plain, 0, 0, 0));
}

#[test]
fn the_draws_depend_on_seed_epoch_and_sample_only() {
    let im = images(8);
    let policy = Some(AutoAugment::TrivialAugmentWide);
    let one = builder(&im).auto_augment(policy).build().unwrap();
    let other_workers = builder(&im)
        .auto_augment(policy)
        .workers(1)
        .build()
        .unwrap();
    assert_eq!(
        pixels_by_id(&one, 3, 0, 0),
        pixels_by_id(&other_workers, 3, 0, 0)
    );
    let other_seed = builder(&im)
        .auto_augment(policy)
        .seed(SEED + 1)
        .build()
        .unwrap();
    assert_ne!(
        pixels_by_id(&one, 3, 0, 0),
        pixels_by_id(&other_seed, 3, 0, 0)
    );
    assert_ne!(pixels_by_id(&one, 3, 0, 0), pixels_by_id(&one, 4, 0, 0));
    let stats = one.stats();
    assert!(
        stats.transform_seconds > 0.0,
        "the augmentation's time is counted"
    );
}

#[test]
fn an_impossible_magnitude_is_refused_naming_the_flag() {
    let im = images(2);
    let err = builder(&im)
        .auto_augment(Some(AutoAugment::RandAugment { magnitude: 40 }))
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--ra-magnitude") && err.contains("40"),
        "{err}"
    );
}
