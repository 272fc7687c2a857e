//! Decoding any supported file to RGB8: format from the bytes, EXIF orientation applied,
//! alpha composited on white, 16-bit and palette images reduced to 8-bit RGB.

use std::io::Cursor;

use image::{DynamicImage, ImageDecoder, ImageReader, RgbImage};

use crate::bad::BadFileKind;

/// The default decompression-bomb guard: 64 megapixels (a 8000×8000 photo).
pub(crate) const DEFAULT_MAX_PIXELS: u64 = 64 * 1024 * 1024;

/// Why decoding failed, with the decoder's error kept as the source.
#[derive(Debug)]
pub(crate) struct DecodeFailure {
    pub(crate) kind: BadFileKind,
    pub(crate) source: Box<dyn std::error::Error + Send + Sync>,
}

impl DecodeFailure {
    fn new(kind: BadFileKind, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self {
            kind,
            source: source.into(),
        }
    }
}

/// Decodes `bytes` (any supported format, detected from the content) to upright RGB8.
pub(crate) fn decode_rgb8(bytes: &[u8], max_pixels: u64) -> Result<RgbImage, DecodeFailure> {
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| DecodeFailure::new(BadFileKind::Unreadable, e))?;
    if reader.format().is_none() {
        return Err(DecodeFailure::new(
            BadFileKind::NotAnImage,
            "unrecognised leading bytes (not JPEG, PNG, BMP, WebP or GIF)",
        ));
    }
    let mut decoder = reader
        .into_decoder()
        .map_err(|e| DecodeFailure::new(BadFileKind::Corrupt, e))?;
    let (w, h) = decoder.dimensions();
    if u64::from(w) * u64::from(h) > max_pixels || w == 0 || h == 0 {
        return Err(DecodeFailure::new(
            BadFileKind::TooLarge,
            format!("{w}x{h} pixels; the limit is {max_pixels}"),
        ));
    }
    // A broken EXIF block is not worth losing the image for: keep it upright-as-stored.
    let orientation = decoder
        .orientation()
        .unwrap_or(image::metadata::Orientation::NoTransforms);
    let mut img = DynamicImage::from_decoder(decoder)
        .map_err(|e| DecodeFailure::new(BadFileKind::Corrupt, e))?;
    img.apply_orientation(orientation);
    Ok(to_rgb8_on_white(img))
}

/// Converts any colour type to RGB8; transparent pixels are composited on white (the usual
/// convention for photos with alpha, and what a viewer shows).
fn to_rgb8_on_white(img: DynamicImage) -> RgbImage {
    if !img.color().has_alpha() {
        return match img {
            DynamicImage::ImageRgb8(rgb) => rgb,
            other => other.to_rgb8(),
        };
    }
    let rgba = img.to_rgba8();
    let (w, h) = rgba.dimensions();
    let mut out = RgbImage::new(w, h);
    for (dst, src) in out.pixels_mut().zip(rgba.pixels()) {
        let a = u32::from(src[3]);
        for c in 0..3 {
            // Rounded a·c + (1 − a)·255 in 0..=255 fixed point.
            dst[c] = ((u32::from(src[c]) * a + 255 * (255 - a) + 127) / 255) as u8;
        }
    }
    out
}
