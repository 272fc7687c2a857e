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

/// Decodes `bytes` (any supported format, detected from the content) to upright RGB8 into `out`. Plain baseline/progressive YCbCr or RGB
/// JPEGs (nearly every photo) go straight through zune-jpeg into the reused buffer, with one
/// header parse instead of the three `image` makes and no zero-filled fresh allocation;
/// everything else (other formats, CMYK, grayscale, errors) takes the general path, so
/// results and error kinds are the same either way.
pub(crate) fn decode_rgb8_into(
    bytes: &[u8],
    max_pixels: u64,
    out: &mut Pixels,
) -> Result<(), DecodeFailure> {
    refuse_truncated_jpeg(bytes, max_pixels)?;
    if decode_plain_jpeg(bytes, max_pixels, out) {
        return Ok(());
    }
    let img = decode_general(bytes, max_pixels)?;
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

/// Decodes `bytes` (any supported format, detected from the content) to upright RGB8: the
/// general path alone (the tests compare the JPEG fast path with it).
#[cfg(test)]
pub(crate) fn decode_rgb8(bytes: &[u8], max_pixels: u64) -> Result<RgbImage, DecodeFailure> {
    refuse_truncated_jpeg(bytes, max_pixels)?;
    decode_general(bytes, max_pixels)
}

/// Where a JPEG's marker segments lead, read by their lengths from the start of the file.
#[derive(Debug, PartialEq, Eq)]
enum JpegWalk {
    /// The first start-of-scan segment begins at this offset (its entropy data follows);
    /// with the [`HuffmanFrame`] its frame header declares, when the frame is Huffman-coded
    /// (sequential SOF0/SOF1 or progressive SOF2) and names its height.
    Scan(usize, Option<HuffmanFrame>),

    /// The file ends inside the headers.
    Ended,
    /// Something other than a marker where one must be: corrupt, for the decoder to report.
    Malformed,
}

fn walk_to_first_scan(bytes: &[u8]) -> JpegWalk {
    let mut at = 2; // after SOI
    let mut frame = None;
    loop {
        match bytes.get(at) {
            None => return JpegWalk::Ended,
            Some(0xFF) => {}
            Some(_) => return JpegWalk::Malformed,
        }
        // A marker may be preceded by any number of 0xFF fill bytes.
        while bytes.get(at) == Some(&0xFF) {
            at += 1;
        }
        let Some(&marker) = bytes.get(at) else {
            return JpegWalk::Ended;
        };
        at += 1;
        match marker {
            0xDA => return JpegWalk::Scan(at, frame),
            // Stand-alone markers carry no length.
            0x01 | 0xD0..=0xD8 => {}
            0xD9 | 0x00 => return JpegWalk::Malformed,
            _ => {
                let Some(len) = bytes.get(at..at + 2) else {
                    return JpegWalk::Ended;
                };
                let len = usize::from(u16::from_be_bytes([len[0], len[1]]));
                if len < 2 {
                    return JpegWalk::Malformed;
                }
                if matches!(marker, 0xC0..=0xC2) {
                    let progressive = marker == 0xC2;
                    frame = bytes
                        .get(at + 2..at + len)
                        .and_then(|f| huffman_frame(f, progressive));
                }
                at += len;
                if at > bytes.len() {
                    return JpegWalk::Ended;
                }
            }
        }
    }
}

/// What a Huffman-coded frame header declares.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
struct HuffmanFrame {
    /// Progressive (SOF2), else sequential (SOF0, SOF1).
    progressive: bool,
    /// Colour components.
    components: usize,
    /// Width × height.
    pixels: u64,
    /// 8×8 blocks over all components, without the padding to whole MCUs.
    blocks: u64,
}

impl HuffmanFrame {
    /// The fewest bits any Huffman coding of the frame's blocks takes: every block has a DC
    /// code of at least one bit (a progressive file's first DC scan codes each block, and only
    /// its AC scans can cover empty blocks in runs), and a sequential block also ends with an
    /// end-of-block code or carries AC codes, at least one more bit.
    fn least_bits(&self) -> u64 {
        self.blocks * if self.progressive { 1 } else { 2 }
    }
}

/// The [`HuffmanFrame`] of a frame header (after its length: precision, height, width,
/// components with their sampling factors); `None` for a header that is cut short, has no
/// height yet (a DNL marker gives it later) or a sampling factor of 0 (malformed: the decoder
/// reports it).
fn huffman_frame(frame: &[u8], progressive: bool) -> Option<HuffmanFrame> {
    let height = u64::from(u16::from_be_bytes([*frame.get(1)?, *frame.get(2)?]));
    let width = u64::from(u16::from_be_bytes([*frame.get(3)?, *frame.get(4)?]));
    let count = usize::from(*frame.get(5)?);
    let factors: Vec<(u64, u64)> = frame
        .get(6..6 + 3 * count)?
        .chunks(3)
        .map(|c| (u64::from(c[1] >> 4), u64::from(c[1] & 0x0F)))
        .collect();
    let h_max = factors.iter().map(|f| f.0).max()?;
    let v_max = factors.iter().map(|f| f.1).max()?;
    if height == 0 || factors.iter().any(|&(h, v)| h == 0 || v == 0) {
        return None;
    }
    let blocks = factors
        .iter()
        .map(|&(h, v)| {
            let w = (width * h).div_ceil(h_max).div_ceil(8);
            let rows = (height * v).div_ceil(v_max).div_ceil(8);
            w * rows
        })
        .sum();
    Some(HuffmanFrame {
        progressive,
        components: factors.len(),
        pixels: width * height,
        blocks,
    })
}

/// Refuses a JPEG the decoders would misread without an error: one whose data ends early
/// (they would fill the missing rows with grey), or a sequential colour image coded one
/// component per scan (wrong colours).
///
/// A JPEG whose data ends early, which the decoders would otherwise finish by
/// filling the missing rows with grey. A complete JPEG has an end-of-image marker (FF D9)
/// after its first scan: entropy-coded data never holds one (a data byte FF is followed by
/// 00), and the headers before the scan are skipped by their lengths, so an EXIF
/// thumbnail's own FF D9 does not count. A file without it is decoded once in strict mode,
/// which accepts it only when no data is missing (some encoders drop the final marker).
fn refuse_truncated_jpeg(bytes: &[u8], max_pixels: u64) -> Result<(), DecodeFailure> {
    if !bytes.starts_with(&[0xFF, 0xD8]) {
        return Ok(());
    }
    let (scan, frame) = match walk_to_first_scan(bytes) {
        JpegWalk::Scan(at, frame) => (at, frame),
        JpegWalk::Malformed => return Ok(()),
        JpegWalk::Ended => {
            return Err(DecodeFailure::new(
                BadFileKind::Truncated,
                format!(
                    "the file ends inside the JPEG headers after {} bytes",
                    bytes.len()
                ),
            ))
        }
    };
    // Less data than any Huffman coding of the declared blocks needs is a header that claims
    // more image than the file holds, which the decoders would fill with grey. (Too many
    // pixels is reported as such by the general path.)
    if let Some(f) = frame.filter(|f| f.pixels <= max_pixels) {
        let data = (bytes.len() - scan) as u64;
        if data.saturating_mul(8) < f.least_bits() {
            return Err(DecodeFailure::new(
                BadFileKind::Truncated,
                format!(
                    "its header declares {} blocks of 8×8 pixels, which take at least {} bytes, but only {data} bytes of image data follow",
                    f.blocks,
                    f.least_bits().div_ceil(8)
                ),
            ));
        }
        // A sequential colour image coded one component per scan (legal, rare): the JPEG
        // decoder (zune-jpeg 0.5.15) returns wrong colours for it without an error.
        let scan_components = bytes.get(scan + 2).map_or(0, |&n| usize::from(n));
        if !f.progressive && f.components > 1 && scan_components < f.components {
            return Err(DecodeFailure::new(
                BadFileKind::Unsupported,
                format!(
                    "a sequential JPEG whose {} colour components are coded in separate scans, which the decoder cannot read correctly (re-encode it, e.g. with the usual interleaved scan)",
                    f.components
                ),
            ));
        }
    }
    // From the end: an end-of-image marker is nearly always the file's last two bytes, and
    // scanning the whole entropy-coded data forwards cost ~2 % of a first epoch.
    if bytes[scan..].windows(2).rev().any(|w| w == [0xFF, 0xD9]) {
        return Ok(());
    }
    let strict = DecoderOptions::default()
        .set_strict_mode(true)
        .set_max_width(usize::MAX)
        .set_max_height(usize::MAX);
    let mut decoder = zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(bytes), strict);
    if decoder.decode_headers().is_ok() {
        // Too many pixels is reported as such by the general path, without decoding here.
        let pixels = decoder.dimensions().map_or(0, |(w, h)| w as u64 * h as u64);
        if pixels > max_pixels {
            return Ok(());
        }
    }
    match decoder.decode() {
        Ok(_) => Ok(()),
        Err(e) => Err(DecodeFailure::new(
            BadFileKind::Truncated,
            format!(
                "no end-of-image marker after {} bytes and the image data is incomplete ({e})",
                bytes.len()
            ),
        )),
    }
}

/// The general path (every format) without the truncation check, done by the callers.
fn decode_general(bytes: &[u8], max_pixels: u64) -> Result<RgbImage, DecodeFailure> {
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| DecodeFailure::new(BadFileKind::Unreadable, e))?;
    if reader.format().is_none() {
        return Err(DecodeFailure::new(
            BadFileKind::NotAnImage,
            "unrecognised leading bytes (not JPEG, PNG, BMP, WebP or GIF)",
        ));
    }
    let mut decoder = reader.into_decoder().map_err(|e| match e {
        // The decoder refuses a header that declares more than it may allocate (a PNG of
        // 2³¹ × 2³¹): too large, like any image past the pixel limit, not corrupt.
        image::ImageError::Limits(_) => DecodeFailure::new(
            BadFileKind::TooLarge,
            match png_size(bytes) {
                Some((w, h)) => format!("{w}x{h} pixels; the limit is {max_pixels}"),
                None => format!(
                    "its header declares more pixels than the decoder may allocate; the limit is {max_pixels}"
                ),
            },
        ),
        other => failed(other),
    })?;
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
    let mut img = DynamicImage::from_decoder(decoder).map_err(failed)?;
    img.apply_orientation(orientation);
    Ok(to_rgb8_on_white(img))
}

/// A PNG's width and height as its header declares them (`None` for another format).
fn png_size(bytes: &[u8]) -> Option<(u32, u32)> {
    const SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";
    if bytes.len() < 24 || !bytes.starts_with(SIGNATURE) || &bytes[12..16] != b"IHDR" {
        return None;
    }
    let word = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    Some((word(16), word(20)))
}

/// A decoder error: `truncated` when the data ran out (an unexpected end of file anywhere in
/// the error's chain), else `corrupt`.
fn failed(e: image::ImageError) -> DecodeFailure {
    // `ImageError::IoError` passes its I/O error's own source on, not the error itself.
    let mut ran_out = matches!(&e, image::ImageError::IoError(io) if io.kind() == std::io::ErrorKind::UnexpectedEof);
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = cause {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            ran_out |= io.kind() == std::io::ErrorKind::UnexpectedEof;
        }
        cause = err.source();
    }
    let kind = if ran_out {
        BadFileKind::Truncated
    } else {
        BadFileKind::Corrupt
    };
    DecodeFailure::new(kind, e)
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

    fn jpeg(w: u32, h: u32) -> Vec<u8> {
        let img = RgbImage::from_fn(w, h, |x, y| {
            image::Rgb([(x * 5) as u8, (y * 9) as u8, ((x ^ y) * 3) as u8])
        });
        let mut bytes = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, 90)
            .encode_image(&img)
            .unwrap();
        bytes
    }

    fn kind_of(bytes: &[u8]) -> Option<BadFileKind> {
        let mut out = Pixels::default();
        let fast = decode_rgb8_into(bytes, DEFAULT_MAX_PIXELS, &mut out).err();
        let general = decode_rgb8(bytes, DEFAULT_MAX_PIXELS).err();
        assert_eq!(
            fast.as_ref().map(|f| f.kind),
            general.as_ref().map(|f| f.kind),
            "both entry points agree"
        );
        fast.map(|f| f.kind)
    }

    #[test]
    fn the_first_half_of_a_jpeg_is_truncated_not_filled_in() {
        let bytes = jpeg(64, 48);
        assert_eq!(kind_of(&bytes), None);
        for cut in [bytes.len() / 2, bytes.len() - 40, 300, 20, 3] {
            assert_eq!(
                kind_of(&bytes[..cut]),
                Some(BadFileKind::Truncated),
                "cut at {cut} of {}",
                bytes.len()
            );
        }
    }

    /// `bytes` with the first frame header's height and width replaced.
    fn with_declared_size(bytes: &[u8], w: u16, h: u16) -> Vec<u8> {
        let sof = bytes.windows(2).position(|m| m == [0xFF, 0xC0]).unwrap();
        let mut out = bytes.to_vec();
        out[sof + 5..sof + 7].copy_from_slice(&h.to_be_bytes());
        out[sof + 7..sof + 9].copy_from_slice(&w.to_be_bytes());
        out
    }

    #[test]
    fn a_header_claiming_more_image_than_the_data_holds_is_truncated() {
        // 48×48 of data with its end marker, under a header that says 8000×8000: the
        // lenient decoders would fill 64 M pixels with grey and call it an image.
        let small = jpeg(48, 48);
        let lying = with_declared_size(&small, 8000, 8000);
        assert_eq!(kind_of(&lying), Some(BadFileKind::Truncated));
        let mut out = Pixels::default();
        let why = decode_rgb8_into(&lying, DEFAULT_MAX_PIXELS, &mut out).unwrap_err();
        assert!(
            why.source.to_string().contains("at least"),
            "{}",
            why.source
        );
        // The bound is what any Huffman coding needs: a flat 2048×2048 image, the most
        // compressible there is (a few bits per block), passes.
        let flat = RgbImage::from_pixel(2048, 2048, image::Rgb([90, 140, 200]));
        let mut bytes = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, 90)
            .encode_image(&flat)
            .unwrap();
        assert_eq!(kind_of(&bytes), None, "{} bytes", bytes.len());
        // Past the pixel limit it is still a decompression bomb, not a cut file.
        let bomb = with_declared_size(&small, 65000, 65000);
        assert_eq!(kind_of(&bomb), Some(BadFileKind::TooLarge));
    }

    #[test]
    fn a_png_header_of_two_to_the_31_squared_is_too_large_not_corrupt() {
        let mut bytes = Vec::new();
        RgbImage::from_pixel(4, 4, image::Rgb([1, 2, 3]))
            .write_to(&mut Cursor::new(&mut bytes), image::ImageFormat::Png)
            .unwrap();
        // IHDR's width and height, and the chunk's CRC-32 over its type and data.
        bytes[16..20].copy_from_slice(&(1u32 << 31).to_be_bytes());
        bytes[20..24].copy_from_slice(&(1u32 << 31).to_be_bytes());
        let crc = bytes[12..29].iter().fold(!0u32, |mut crc, &b| {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
            }
            crc
        });
        bytes[29..33].copy_from_slice(&(!crc).to_be_bytes());
        let mut out = Pixels::default();
        let why = decode_rgb8_into(&bytes, DEFAULT_MAX_PIXELS, &mut out).unwrap_err();
        assert_eq!(why.kind, BadFileKind::TooLarge, "{}", why.source);
        assert!(
            why.source
                .to_string()
                .contains("2147483648x2147483648 pixels"),
            "{}",
            why.source
        );
    }

    #[test]
    fn a_progressive_header_claiming_more_image_than_the_data_holds_is_truncated() {
        // A progressive file codes every block in its first DC scan, at least one bit each.
        let fixture = |name: &str| {
            std::fs::read(format!(
                "{}/tests/fixtures/{name}",
                env!("CARGO_MANIFEST_DIR")
            ))
            .unwrap()
        };
        let progressive = fixture("progressive_32.jpg");
        assert_eq!(kind_of(&progressive), None);
        let sof2 = progressive
            .windows(2)
            .position(|m| m == [0xFF, 0xC2])
            .unwrap();
        let mut lying = progressive.clone();
        lying[sof2 + 5..sof2 + 9].copy_from_slice(&[0x20, 0x00, 0x20, 0x00]); // 8192×8192
        assert_eq!(kind_of(&lying), Some(BadFileKind::Truncated));
    }

    #[test]
    fn a_sequential_jpeg_coded_one_component_per_scan_is_refused_not_miscoloured() {
        // Flat (245, 187, 150) in three single-component scans (tests/fixtures/make_fixtures.py;
        // PIL reads it flat); zune-jpeg 0.5.15 returns wrong colours for such files without an
        // error.
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/non_interleaved_32.jpg"
        );
        let bytes = std::fs::read(path).unwrap();
        assert_eq!(kind_of(&bytes), Some(BadFileKind::Unsupported));
    }

    #[test]
    fn complete_jpegs_with_extras_are_not_truncated() {
        let bytes = jpeg(40, 24);
        // Bytes after the end-of-image marker (camera trailers, padding).
        let mut trailer = bytes.clone();
        trailer.extend_from_slice(b"\0\0trailing maker data");
        assert_eq!(kind_of(&trailer), None);
        // A complete image whose encoder left out the final marker.
        assert_eq!(&bytes[bytes.len() - 2..], &[0xFF, 0xD9]);
        assert_eq!(kind_of(&bytes[..bytes.len() - 2]), None);
        // An EXIF-rotated camera JPEG.
        let exif = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/exif_rot6.jpg"
        ))
        .unwrap();
        assert_eq!(kind_of(&exif), None);
        assert_eq!(
            kind_of(&exif[..exif.len() / 2]),
            Some(BadFileKind::Truncated)
        );
    }

    #[test]
    fn a_thumbnails_end_marker_does_not_hide_a_cut_main_image() {
        // SOI, an APP1 segment carrying a whole small JPEG (with its own FF D9), then the
        // main image's segments: the walk skips the APP1 by its length.
        let thumb = jpeg(8, 8);
        let main = jpeg(64, 64);
        let mut bytes = vec![0xFF, 0xD8, 0xFF, 0xE1];
        bytes.extend_from_slice(&((thumb.len() + 2) as u16).to_be_bytes());
        bytes.extend_from_slice(&thumb);
        bytes.extend_from_slice(&main[2..]);
        assert_eq!(kind_of(&bytes), None);
        let cut = bytes.len() - (main.len() / 2);
        assert_eq!(kind_of(&bytes[..cut]), Some(BadFileKind::Truncated));
    }

    #[test]
    fn a_cut_png_is_truncated_and_garbage_is_corrupt() {
        let img = RgbImage::from_fn(40, 40, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let mut png = std::io::Cursor::new(Vec::new());
        img.write_to(&mut png, image::ImageFormat::Png).unwrap();
        let png = png.into_inner();
        assert_eq!(kind_of(&png[..png.len() / 2]), Some(BadFileKind::Truncated));
        let mut garbage = png[..33].to_vec();
        garbage.extend((0..300u32).map(|i| (i * 37 % 251) as u8));
        assert_eq!(kind_of(&garbage), Some(BadFileKind::Corrupt));
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
