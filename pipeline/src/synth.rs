//! Synthetic image datasets in the 285-birds layout, learnable by a small ResNet.
//!
//! Each class has its own shape (6 kinds), hue and texture (solid, stripes, checks at a
//! class-dependent frequency); each image jitters position, scale, colour and adds pixel noise
//! on a random background, so a model must learn the class features, not memorise pixels.
//! The output is a pure function of the configuration (seed included).

use std::io::BufWriter;
use std::path::{Path, PathBuf};

use image::{ImageEncoder, RgbImage};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Errors of the synthetic dataset writer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SynthError {
    /// A setting is out of range.
    #[error("invalid synth setting {name} = {value}: {hint}")]
    Invalid {
        /// The setting.
        name: &'static str,
        /// Its value.
        value: String,
        /// What is allowed.
        hint: &'static str,
    },
    /// Creating a folder or writing a file failed.
    #[error("cannot write {path}: {source} (hint: check --out is writable and has space)")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The image encoder failed.
    #[error("cannot encode {path}: {source}")]
    Encode {
        /// The file.
        path: PathBuf,
        /// The encoder's error.
        #[source]
        source: image::ImageError,
    },
}

/// The encoded file format of the synthetic images.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImageFormatKind {
    /// JPEG, quality 90 (`.jpg`).
    #[default]
    Jpg,
    /// PNG (`.png`).
    Png,
}

impl ImageFormatKind {
    /// The file extension.
    pub fn extension(self) -> &'static str {
        match self {
            Self::Jpg => "jpg",
            Self::Png => "png",
        }
    }
}

impl std::str::FromStr for ImageFormatKind {
    type Err = SynthError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "jpg" | "jpeg" => Ok(Self::Jpg),
            "png" => Ok(Self::Png),
            _ => Err(SynthError::Invalid {
                name: "--format",
                value: s.to_string(),
                hint: "expected jpg or png",
            }),
        }
    }
}

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthConfig {
    /// Output root; `train/`, `valid/`, `test/` are created under it.
    pub out: PathBuf,
    /// Number of classes (folders `class_00`, `class_01`, …).
    pub classes: usize,
    /// Images per class in `train/`.
    pub train_per_class: usize,
    /// Images per class in `valid/`.
    pub valid_per_class: usize,
    /// Images per class in `test/` (0: no test split).
    pub test_per_class: usize,
    /// Image width in pixels.
    pub width: u32,
    /// Image height in pixels.
    pub height: u32,
    /// File format.
    pub format: ImageFormatKind,
    /// Seed: the same seed gives byte-identical files.
    pub seed: u64,
}

impl SynthConfig {
    /// A small default set: 4 classes, 20/5/5 images of 64×48 JPEG, seed 0.
    pub fn new(out: impl Into<PathBuf>) -> Self {
        Self {
            out: out.into(),
            classes: 4,
            train_per_class: 20,
            valid_per_class: 5,
            test_per_class: 5,
            width: 64,
            height: 48,
            format: ImageFormatKind::Jpg,
            seed: 0,
        }
    }
}

/// What was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SynthSummary {
    /// The class folder names.
    pub classes: Vec<String>,
    /// Files written per split: train, valid, test.
    pub files: [usize; 3],
    /// The output root.
    pub out: PathBuf,
}

/// The class folder name of class `k` (`class_00`, …; wider when there are ≥ 100 classes).
pub fn class_name(k: usize, classes: usize) -> String {
    let width = classes.saturating_sub(1).to_string().len().max(2);
    format!("class_{k:0width$}")
}

/// Writes the dataset described by `cfg`.
pub fn write_dataset(cfg: &SynthConfig) -> Result<SynthSummary, SynthError> {
    let invalid = |name, value: String, hint| Err(SynthError::Invalid { name, value, hint });
    if cfg.classes == 0 {
        return invalid("--classes", "0".into(), "at least 1 class");
    }
    if cfg.width < 8 || cfg.height < 8 || cfg.width > 8192 || cfg.height > 8192 {
        return invalid(
            "--size",
            format!("{}x{}", cfg.width, cfg.height),
            "each side in 8..=8192",
        );
    }
    let classes: Vec<String> = (0..cfg.classes)
        .map(|k| class_name(k, cfg.classes))
        .collect();
    let splits = [
        ("train", cfg.train_per_class),
        ("valid", cfg.valid_per_class),
        ("test", cfg.test_per_class),
    ];
    let mut files = [0usize; 3];
    for (s, (split, per_class)) in splits.iter().enumerate() {
        if *per_class == 0 && s > 0 {
            continue;
        }
        for (k, class) in classes.iter().enumerate() {
            let dir = cfg.out.join(split).join(class);
            std::fs::create_dir_all(&dir).map_err(|source| SynthError::Io {
                path: dir.clone(),
                source,
            })?;
            for i in 0..*per_class {
                let stream = cfg.seed
                    ^ ((s as u64) << 56)
                    ^ ((k as u64) << 32)
                    ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                let mut rng = ChaCha8Rng::seed_from_u64(stream);
                let img = draw(k, cfg.width, cfg.height, &mut rng);
                let path = dir.join(format!("{split}_{i:05}.{}", cfg.format.extension()));
                save(&img, cfg.format, &path)?;
                files[s] += 1;
            }
        }
    }
    Ok(SynthSummary {
        classes,
        files,
        out: cfg.out.clone(),
    })
}

fn save(img: &RgbImage, format: ImageFormatKind, path: &Path) -> Result<(), SynthError> {
    let file = std::fs::File::create(path).map_err(|source| SynthError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = BufWriter::new(file);
    let (w, h) = img.dimensions();
    let encoded = match format {
        ImageFormatKind::Jpg => image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 90)
            .write_image(img.as_raw(), w, h, image::ExtendedColorType::Rgb8),
        ImageFormatKind::Png => image::codecs::png::PngEncoder::new(&mut out).write_image(
            img.as_raw(),
            w,
            h,
            image::ExtendedColorType::Rgb8,
        ),
    };
    encoded.map_err(|source| SynthError::Encode {
        path: path.to_path_buf(),
        source,
    })?;
    std::io::Write::flush(&mut out).map_err(|source| SynthError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Fully saturated colour of hue `h` in `[0, 1)`.
fn hue_rgb(h: f32) -> [f32; 3] {
    let x = h * 6.0;
    let f = |n: f32| {
        let k = (n + x) % 6.0;
        255.0 * (1.0 - (k.min(4.0 - k).clamp(0.0, 1.0)))
    };
    [f(5.0), f(3.0), f(1.0)]
}

/// Whether `(u, v)` (shape-centred, radius 1) lies inside shape `kind`.
fn inside(kind: usize, u: f32, v: f32) -> bool {
    let r2 = u * u + v * v;
    match kind {
        0 => r2 <= 1.0,                                                                // disc
        1 => u.abs() <= 0.8 && v.abs() <= 0.8,                                         // square
        2 => v <= 0.8 && v >= -0.9 + 2.0 * u.abs() * 0.95, // triangle (apex up)
        3 => (u.abs() <= 0.3 && v.abs() <= 1.0) || (v.abs() <= 0.3 && u.abs() <= 1.0), // cross
        4 => (0.45..=1.0).contains(&r2),                   // ring
        _ => u.abs() + v.abs() <= 1.0,                     // diamond
    }
}

/// Draws one image of class `k`.
fn draw(k: usize, width: u32, height: u32, rng: &mut ChaCha8Rng) -> RgbImage {
    const GOLDEN: f32 = 0.618_034;
    let shape = k % 6;
    let texture = (k / 6) % 3;
    let freq = 0.15 + 0.05 * ((k / 18) % 4) as f32;
    let base = hue_rgb((k as f32 * GOLDEN) % 1.0);
    let jitter: [f32; 3] = std::array::from_fn(|_| rng.random_range(-20.0..20.0));
    let fg: [f32; 3] = std::array::from_fn(|c| (base[c] * 0.85 + jitter[c]).clamp(0.0, 255.0));
    let bg_level = rng.random_range(30.0..200.0f32);
    let bg: [f32; 3] = std::array::from_fn(|_| bg_level + rng.random_range(-25.0..25.0f32));
    let side = width.min(height) as f32;
    let radius = side * rng.random_range(0.22..0.36);
    let cx = width as f32 / 2.0 + rng.random_range(-0.2..0.2) * width as f32;
    let cy = height as f32 / 2.0 + rng.random_range(-0.2..0.2) * height as f32;
    let noise = 8.0;
    let mut img = RgbImage::new(width, height);
    for (x, y, px) in img.enumerate_pixels_mut() {
        let (xf, yf) = (x as f32, y as f32);
        let (u, v) = ((xf - cx) / radius, (yf - cy) / radius);
        let mut colour = if inside(shape, u, v) {
            // Texture in shape coordinates, so it scales with the shape.
            let t = match texture {
                0 => 1.0,
                1 => 0.6 + 0.4 * ((u * radius * freq * 2.0).sin() > 0.0) as u8 as f32,
                _ => {
                    let a = ((u * radius * freq).floor() + (v * radius * freq).floor()) as i32;
                    if a.rem_euclid(2) == 0 {
                        1.0
                    } else {
                        0.55
                    }
                }
            };
            fg.map(|c| c * t)
        } else {
            // A gentle gradient keeps the background from being a constant.
            let g = 0.85 + 0.3 * (yf / height as f32);
            bg.map(|c| c * g)
        };
        for c in &mut colour {
            *c += rng.random_range(-noise..noise);
        }
        *px = image::Rgb(colour.map(|c| c.clamp(0.0, 255.0) as u8));
    }
    img
}
