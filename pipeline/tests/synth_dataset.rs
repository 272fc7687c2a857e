//! The synthetic dataset writer: layout, determinism, and class-dependent content.

use pipeline::synth::{class_name, write_dataset, ImageFormatKind, SynthConfig, SynthError};

fn config(out: &std::path::Path, seed: u64) -> SynthConfig {
    SynthConfig {
        out: out.to_path_buf(),
        classes: 3,
        train_per_class: 4,
        valid_per_class: 2,
        test_per_class: 1,
        width: 40,
        height: 30,
        format: ImageFormatKind::Jpg,
        seed,
    }
}

#[test]
fn writes_the_285_birds_layout() {
    let dir = tempfile::tempdir().unwrap();
    let summary = write_dataset(&config(dir.path(), 1)).unwrap();
    assert_eq!(summary.classes, ["class_00", "class_01", "class_02"]);
    assert_eq!(summary.files, [12, 6, 3]);
    for (split, n) in [("train", 4), ("valid", 2), ("test", 1)] {
        for class in &summary.classes {
            let files = std::fs::read_dir(dir.path().join(split).join(class))
                .unwrap()
                .count();
            assert_eq!(files, n, "{split}/{class}");
        }
    }
    let img = image::open(dir.path().join("train/class_01/train_00000.jpg")).unwrap();
    assert_eq!((img.width(), img.height()), (40, 30));
    assert_eq!(class_name(7, 120), "class_007");
}

#[test]
fn the_same_seed_gives_identical_files_and_another_seed_other_files() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let c = tempfile::tempdir().unwrap();
    write_dataset(&config(a.path(), 9)).unwrap();
    write_dataset(&config(b.path(), 9)).unwrap();
    write_dataset(&config(c.path(), 10)).unwrap();
    let f = "valid/class_02/valid_00001.jpg";
    let read = |d: &tempfile::TempDir| std::fs::read(d.path().join(f)).unwrap();
    assert_eq!(read(&a), read(&b));
    assert_ne!(read(&a), read(&c));
}

/// Mean colour of an image's most saturated pixels: the class's shape colour.
fn shape_colour(path: &std::path::Path) -> [f32; 3] {
    let img = image::open(path).unwrap().to_rgb8();
    let mut px: Vec<[f32; 3]> = img.pixels().map(|p| p.0.map(f32::from)).collect();
    let sat = |p: &[f32; 3]| {
        p.iter().cloned().fold(0.0, f32::max) - p.iter().cloned().fold(255.0, f32::min)
    };
    px.sort_by(|a, b| sat(b).total_cmp(&sat(a)));
    let top = &px[..px.len() / 10];
    let mut mean = [0.0; 3];
    for p in top {
        for c in 0..3 {
            mean[c] += p[c] / top.len() as f32;
        }
    }
    mean
}

#[test]
fn classes_differ_more_between_than_within() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), 3);
    cfg.format = ImageFormatKind::Png;
    cfg.width = 48;
    cfg.height = 48;
    write_dataset(&cfg).unwrap();
    let colours: Vec<Vec<[f32; 3]>> = (0..3)
        .map(|k| {
            (0..4)
                .map(|i| {
                    shape_colour(
                        &dir.path()
                            .join(format!("train/class_{k:02}/train_{i:05}.png")),
                    )
                })
                .collect()
        })
        .collect();
    let dist = |a: &[f32; 3], b: &[f32; 3]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).powi(2))
            .sum::<f32>()
            .sqrt()
    };
    let mut within = 0.0f32;
    let mut between = f32::MAX;
    for k in 0..3 {
        for i in 0..4 {
            for j in 0..4 {
                within = within.max(dist(&colours[k][i], &colours[k][j]));
            }
            for l in (k + 1)..3 {
                for j in 0..4 {
                    between = between.min(dist(&colours[k][i], &colours[l][j]));
                }
            }
        }
    }
    assert!(
        between > within,
        "nearest other-class colour {between} vs widest same-class spread {within}"
    );
}

#[test]
fn bad_settings_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), 0);
    cfg.classes = 0;
    assert!(matches!(
        write_dataset(&cfg),
        Err(SynthError::Invalid { .. })
    ));
    assert!("gif".parse::<ImageFormatKind>().is_err());
    assert_eq!(
        "PNG".parse::<ImageFormatKind>().unwrap(),
        ImageFormatKind::Png
    );
}
