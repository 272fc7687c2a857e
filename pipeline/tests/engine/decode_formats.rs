//! Decoding: every colour type becomes the right RGB8 pixels, EXIF orientation is applied,
//! the format comes from the bytes, the resize modes do what they say.

use std::path::Path;

use pipeline::{DatasetSource, PipelineBuilder, ResizeMode};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

/// Decodes one file through the whole engine at `size`×`size` and returns its pixels.
fn decode_one(bytes: &[u8], name: &str, size: u32, mode: ResizeMode) -> Vec<u8> {
    let data = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let dir = data.path().join("train/only");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(name), bytes).unwrap();
    let p = PipelineBuilder::new(DatasetSource::folder(data.path()))
        .image_size(size)
        .resize_mode(mode)
        .cache_dir(cache.path())
        .batch_size(1)
        .workers(1)
        .build()
        .unwrap();
    let batch = p.epoch(0, 0, 0).unwrap().next().unwrap().unwrap();
    assert_eq!(batch.len, 1, "{name} decoded: {:?}", p.bad_files());
    batch.pixels().to_vec()
}

fn encode(img: impl Into<image::DynamicImage>, format: image::ImageFormat) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    img.into().write_to(&mut out, format).unwrap();
    out.into_inner()
}

fn pixel(pixels: &[u8], size: u32, x: u32, y: u32) -> [u8; 3] {
    let i = ((y * size + x) * 3) as usize;
    [pixels[i], pixels[i + 1], pixels[i + 2]]
}

fn close(a: [u8; 3], b: [u8; 3], tol: i32) -> bool {
    a.iter()
        .zip(b)
        .all(|(x, y)| (i32::from(*x) - i32::from(y)).abs() <= tol)
}

#[test]
fn grayscale_becomes_equal_rgb_channels() {
    let img = image::GrayImage::from_fn(8, 8, |x, _| image::Luma([(x * 30) as u8]));
    let px = decode_one(
        &encode(img, image::ImageFormat::Png),
        "g.png",
        8,
        ResizeMode::Direct,
    );
    for x in 0..8 {
        let v = (x * 30) as u8;
        assert_eq!(pixel(&px, 8, x, 3), [v, v, v]);
    }
}

#[test]
fn rgba_is_composited_on_white() {
    let img = image::RgbaImage::from_fn(8, 8, |x, _| match x {
        0..=1 => image::Rgba([200, 0, 0, 0]), // fully transparent → white
        2..=3 => image::Rgba([0, 0, 200, 255]), // opaque → itself
        _ => image::Rgba([0, 0, 0, 128]),     // half black over white → mid grey
    });
    let px = decode_one(
        &encode(img, image::ImageFormat::Png),
        "a.png",
        8,
        ResizeMode::Direct,
    );
    assert_eq!(pixel(&px, 8, 0, 0), [255, 255, 255]);
    assert_eq!(pixel(&px, 8, 2, 0), [0, 0, 200]);
    assert_eq!(pixel(&px, 8, 5, 0), [127, 127, 127]);
}

#[test]
fn palette_png_is_expanded() {
    let bytes = std::fs::read(Path::new(FIXTURES).join("palette.png")).unwrap();
    let px = decode_one(&bytes, "p.png", 8, ResizeMode::Direct);
    assert_eq!(pixel(&px, 8, 3, 1), [10, 200, 30]);
    assert_eq!(pixel(&px, 8, 3, 6), [250, 250, 0]);
}

#[test]
fn cmyk_jpeg_becomes_rgb() {
    let bytes = std::fs::read(Path::new(FIXTURES).join("cmyk_red.jpg")).unwrap();
    let px = decode_one(&bytes, "c.jpg", 16, ResizeMode::Direct);
    for (x, y) in [(0, 0), (8, 8), (15, 15)] {
        let got = pixel(&px, 16, x, y);
        assert!(close(got, [255, 0, 0], 16), "CMYK red decoded to {got:?}");
    }
}

#[test]
fn sixteen_bit_png_is_scaled_to_eight_bits() {
    let img = image::ImageBuffer::<image::Rgb<u16>, Vec<u16>>::from_pixel(
        8,
        8,
        image::Rgb([65535, 0, 32896]),
    );
    let px = decode_one(
        &encode(
            image::DynamicImage::ImageRgb16(img),
            image::ImageFormat::Png,
        ),
        "d.png",
        8,
        ResizeMode::Direct,
    );
    assert_eq!(pixel(&px, 8, 4, 4), [255, 0, 128]);
}

#[test]
fn exif_orientation_is_applied() {
    // Stored 16×8 left red / right blue with orientation 6: upright it is 8×16, top red.
    let bytes = std::fs::read(Path::new(FIXTURES).join("exif_rot6.jpg")).unwrap();
    let px = decode_one(&bytes, "e.jpg", 8, ResizeMode::Direct);
    let top = pixel(&px, 8, 4, 1);
    let bottom = pixel(&px, 8, 4, 6);
    assert!(close(top, [255, 0, 0], 40), "top {top:?}");
    assert!(close(bottom, [0, 0, 255], 40), "bottom {bottom:?}");
}

#[test]
fn format_comes_from_the_bytes_not_the_extension() {
    let img = image::RgbImage::from_pixel(8, 8, image::Rgb([1, 2, 3]));
    for format in [
        image::ImageFormat::Png,
        image::ImageFormat::Bmp,
        image::ImageFormat::Gif,
        image::ImageFormat::WebP,
    ] {
        let px = decode_one(
            &encode(img.clone(), format),
            "misnamed.jpg",
            8,
            ResizeMode::Direct,
        );
        assert_eq!(pixel(&px, 8, 4, 4), [1, 2, 3], "{format:?}");
    }
}

#[test]
fn center_crop_keeps_the_middle_and_direct_keeps_everything() {
    // 24×8: red | green | blue thirds. Center-crop keeps the green middle 8×8 square.
    let img = image::RgbImage::from_fn(24, 8, |x, _| match x / 8 {
        0 => image::Rgb([255, 0, 0]),
        1 => image::Rgb([0, 255, 0]),
        _ => image::Rgb([0, 0, 255]),
    });
    let bytes = encode(img, image::ImageFormat::Png);
    let crop = decode_one(&bytes, "w.png", 4, ResizeMode::ShorterSideCenterCrop);
    for y in 0..4 {
        // Inner columns are pure green; edge columns may blend a little of the neighbours
        // (the filter's support reaches past the crop box, as in PIL).
        assert!(close(pixel(&crop, 4, 1, y), [0, 255, 0], 2));
        assert!(close(pixel(&crop, 4, 2, y), [0, 255, 0], 2));
        assert!(pixel(&crop, 4, 0, y)[1] > 150 && pixel(&crop, 4, 3, y)[1] > 150);
    }
    let direct = decode_one(&bytes, "w.png", 6, ResizeMode::Direct);
    assert!(close(pixel(&direct, 6, 0, 3), [255, 0, 0], 2));
    assert!(close(pixel(&direct, 6, 5, 3), [0, 0, 255], 2));
}

#[test]
fn a_decompression_bomb_is_a_bad_file() {
    let data = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let dir = data.path().join("train/c");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("ok.png"),
        encode(image::RgbImage::new(8, 8), image::ImageFormat::Png),
    )
    .unwrap();
    std::fs::write(
        dir.join("big.png"),
        encode(image::RgbImage::new(100, 100), image::ImageFormat::Png),
    )
    .unwrap();
    let p = PipelineBuilder::new(DatasetSource::folder(data.path()))
        .image_size(8)
        .max_pixels(64 * 64)
        .cache_dir(cache.path())
        .build()
        .unwrap();
    let n: usize = p.epoch(0, 0, 0).unwrap().map(|b| b.unwrap().len).sum();
    assert_eq!(n, 1);
    assert_eq!(p.bad_files()[0].kind, pipeline::BadFileKind::TooLarge);
}
