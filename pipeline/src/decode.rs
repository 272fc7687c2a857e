//! Decoding any supported file to RGB8: format from the bytes, EXIF orientation applied,
//! alpha composited on white, 16-bit and palette images reduced to 8-bit RGB.

use std::io::Cursor;

use image::metadata::Orientation;
use image::{DynamicImage, ImageDecoder, ImageReader, RgbImage};
use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;

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

/// Upright RGB8 pixels (`width·height·3` bytes, row-major) in a buffer a worker reuses from
/// image to image, so the common JPEG case allocates nothing.
#[derive(Debug, Default)]
pub(crate) struct Pixels {
    pub(crate) buf: Vec<u8>,
    pub(crate) width: u32,
    pub(crate) height: u32,
}

impl Pixels {
    /// The decoded pixels, exactly `width·height·3` bytes.
    pub(crate) fn as_slice(&self) -> &[u8] {
        &self.buf[..self.width as usize * self.height as usize * 3]
    }
}

/// Decodes `bytes` like [`decode_rgb8`] into `out`. Plain baseline/progressive YCbCr or RGB
/// JPEGs (nearly every photo) go straight through zune-jpeg into the reused buffer, with one
/// header parse instead of the three `image` makes and no zero-filled fresh allocation;
/// everything else (other formats, CMYK, grayscale, errors) takes the general path, so
/// results and error kinds are the same either way.
pub(crate) fn decode_rgb8_into(
    bytes: &[u8],
    max_pixels: u64,
    out: &mut Pixels,
) -> Result<(), DecodeFailure> {
    if decode_plain_jpeg(bytes, max_pixels, out) {
        return Ok(());
    }
    let img = decode_rgb8(bytes, max_pixels)?;
    out.width = img.width();
    out.height = img.height();
    out.buf = img.into_raw();
    Ok(())
}

/// The JPEG fast path; `false` means "not handled here" (the general path decides).
fn decode_plain_jpeg(bytes: &[u8], max_pixels: u64, out: &mut Pixels) -> bool {
    if !bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        return false;
    }
    // The same options `image` uses, so the pixels are bit-identical to the general path.
    let options = DecoderOptions::default()
        .set_strict_mode(false)
        .set_max_width(usize::MAX)
        .set_max_height(usize::MAX)
        .jpeg_set_out_colorspace(ColorSpace::RGB);
    let mut decoder = zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(bytes), options);
    if decoder.decode_headers().is_err() {
        return false;
    }
    if !matches!(
        decoder.input_colorspace(),
        Some(ColorSpace::YCbCr | ColorSpace::RGB)
    ) {
        return false;
    }
    let Some((w, h)) = decoder.dimensions() else {
        return false;
    };
    let (w, h) = (w as u32, h as u32);
    if w == 0 || h == 0 || u64::from(w) * u64::from(h) > max_pixels {
        return false;
    }
    let orientation = decoder
        .exif()
        .and_then(|exif| Orientation::from_exif_chunk(exif))
        .unwrap_or(Orientation::NoTransforms);
    let len = w as usize * h as usize * 3;
    if out.buf.len() < len {
        out.buf.resize(len, 0);
    }
    if decoder.decode_into(&mut out.buf[..len]).is_err() {
        return false;
    }
    out.width = w;
    out.height = h;
    if orientation != Orientation::NoTransforms {
        // Rare (camera photos): rotate through `image`, which owns the orientation maths.
        out.buf.truncate(len);
        let raw = std::mem::take(&mut out.buf);
        let Some(rgb) = RgbImage::from_raw(w, h, raw) else {
            return false;
        };
        let mut img = DynamicImage::ImageRgb8(rgb);
        img.apply_orientation(orientation);
        out.width = img.width();
        out.height = img.height();
        out.buf = img.into_rgb8().into_raw();
    }
    true
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast path must take plain JPEGs and give exactly the general path's pixels.
    fn assert_fast_matches_general(bytes: &[u8]) {
        let mut fast = Pixels::default();
        assert!(decode_plain_jpeg(bytes, DEFAULT_MAX_PIXELS, &mut fast));
        let general = decode_rgb8(bytes, DEFAULT_MAX_PIXELS).unwrap();
        assert_eq!((fast.width, fast.height), general.dimensions());
        assert_eq!(fast.as_slice(), general.as_raw().as_slice());
    }

    #[test]
    fn plain_jpeg_fast_path_is_bit_identical() {
        let img = RgbImage::from_fn(37, 23, |x, y| {
            image::Rgb([(x * 7) as u8, (y * 11) as u8, ((x + y) * 5) as u8])
        });
        let mut bytes = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, 90)
            .encode_image(&img)
            .unwrap();
        assert_fast_matches_general(&bytes);
    }

    #[test]
    fn exif_rotated_jpeg_fast_path_is_bit_identical() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/exif_rot6.jpg");
        assert_fast_matches_general(&std::fs::read(path).unwrap());
    }

    #[test]
    fn a_reused_buffer_larger_than_the_image_is_fine() {
        let mut out = Pixels {
            buf: vec![7; 100_000],
            width: 0,
            height: 0,
        };
        let img = RgbImage::from_pixel(9, 5, image::Rgb([10, 200, 30]));
        let mut bytes = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, 95)
            .encode_image(&img)
            .unwrap();
        decode_rgb8_into(&bytes, DEFAULT_MAX_PIXELS, &mut out).unwrap();
        assert_eq!((out.width, out.height), (9, 5));
        assert_eq!(out.as_slice().len(), 9 * 5 * 3);
    }
}
