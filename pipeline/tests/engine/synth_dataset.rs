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

/// Features of one 32×32 image: the mean colour of its most saturated tenth (the shape's
/// colour, whatever the background) and the share of strongly saturated pixels (its area).
fn features_of(pixels: &[u8]) -> Vec<f32> {
    let sat = |p: &[u8]| f32::from(*p.iter().max().unwrap()) - f32::from(*p.iter().min().unwrap());
    let mut px: Vec<&[u8]> = pixels.chunks(3).collect();
    px.sort_by(|a, b| sat(b).total_cmp(&sat(a)));
    let top = &px[..px.len() / 10];
    let mut f = vec![0f32; 4];
    for p in top {
        for c in 0..3 {
            f[c] += f32::from(p[c]) / top.len() as f32 / 255.0;
        }
    }
    f[3] = px.iter().filter(|p| sat(p) > 100.0).count() as f32 / px.len() as f32;
    f
}

#[test]
fn classes_are_learnable_at_32px_through_the_pipeline() {
    use pipeline::{DatasetSource, PipelineBuilder, Split};
    let data = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let mut cfg = config(data.path(), 11);
    cfg.classes = 8;
    cfg.train_per_class = 12;
    cfg.valid_per_class = 8;
    cfg.test_per_class = 0;
    cfg.width = 64;
    cfg.height = 48;
    write_dataset(&cfg).unwrap();
    let features = |split| {
        let p = PipelineBuilder::new(DatasetSource::folder(data.path()))
            .split(split)
            .image_size(32)
            .batch_size(16)
            .cache_dir(cache.path())
            .build()
            .unwrap();
        let mut out = Vec::new();
        for b in p.epoch(0, 0, 0).unwrap() {
            let b = b.unwrap();
            for (img, &label) in b.pixels().chunks(32 * 32 * 3).zip(b.labels()) {
                out.push((features_of(img), label));
            }
        }
        out
    };
    let train = features(Split::Train);
    let valid = features(Split::Valid);
    // The simplest learner there is: nearest class centroid of two hand-made features.
    let mut centroids = vec![vec![0f32; 4]; 8];
    for (h, l) in &train {
        for (c, v) in centroids[*l as usize].iter_mut().zip(h) {
            *c += v / 12.0;
        }
    }
    let correct = valid
        .iter()
        .filter(|(h, l)| {
            let d = |c: &Vec<f32>| c.iter().zip(h).map(|(a, b)| (a - b).powi(2)).sum::<f32>();
            let best = (0..8)
                .min_by(|&a, &b| d(&centroids[a]).total_cmp(&d(&centroids[b])))
                .unwrap();
            best as u32 == *l
        })
        .count();
    assert!(
        correct * 10 >= valid.len() * 8,
        "nearest-centroid accuracy {correct}/{}",
        valid.len()
    );
}
