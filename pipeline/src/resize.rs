//! Resizing decoded RGB8 images to the stored `S×S` with fast_image_resize (SIMD).

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

use crate::crop::center_offset;
use crate::{CropWindow, ResizeMode};

/// A resizer bound to one output size and mode; each decode worker owns one so its internal
/// buffers are reused from image to image.
pub(crate) struct SquareResizer {
    resizer: Resizer,
    size: u32,
    mode: ResizeMode,
}

impl SquareResizer {
    pub(crate) fn new(size: u32, mode: ResizeMode) -> Self {
        Self {
            resizer: Resizer::new(),
            size,
            mode,
        }
    }

    /// Resizes `src` (`w·h·3` bytes, RGB8) into `dst` (exactly `S·S·3` bytes, NHWC RGB).
    pub(crate) fn resize_into(
        &mut self,
        (w, h): (u32, u32),
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let s = self.size;
        if w == s && h == s && self.mode == ResizeMode::Direct {
            dst.copy_from_slice(src);
            return Ok(());
        }
        let src_view = ImageRef::new(w, h, src, PixelType::U8x3)?;
        let mut dst_view = Image::from_slice_u8(s, s, dst, PixelType::U8x3)?;
        // Bilinear with antialiasing, as Keras' default interpolation.
        let mut options =
            ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear));
        if self.mode == ResizeMode::ShorterSideCenterCrop {
            let (left, top, width, height) = center_crop_window((w, h), s);
            options = options.crop(left, top, width, height);
        }
        self.resizer.resize(&src_view, &mut dst_view, &options)?;
        Ok(())
    }

    /// Scales `window` of the stored square `src` (`side·side·3` bytes) to the whole square
    /// `dst` (`out·out·3` bytes), with the same filter as
    /// [`SquareResizer::resize_into`] (torchvision's `RandomResizedCrop` is bilinear with
    /// antialiasing too).
    pub(crate) fn crop_into(
        &mut self,
        src: &[u8],
        side: u32,
        window: CropWindow,
        dst: &mut [u8],
        out: u32,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let src_view = ImageRef::new(side, side, src, PixelType::U8x3)?;
        let mut dst_view = Image::from_slice_u8(out, out, dst, PixelType::U8x3)?;
        let options = ResizeOptions::new()
            .resize_alg(ResizeAlg::Convolution(FilterType::Bilinear))
            .crop(
                f64::from(window.x),
                f64::from(window.y),
                f64::from(window.width),
                f64::from(window.height),
            );
        self.resizer.resize(&src_view, &mut dst_view, &options)?;
        Ok(())
    }
}

/// The window of a `w × h` image that torchvision's `Resize(s)` then `CenterCrop(s)` keep,
/// in source pixels (left, top, width, height). `Resize` scales the shorter side to `s` and
/// the longer to `int(s · long / short)`, a whole number; `CenterCrop` then starts at the
/// rounded half of the difference ([`center_offset`]). Scaling this window straight to
/// `s × s` samples the same points as the two steps, so the stored square is theirs, not a
/// window shifted by the roundings (up to a pixel on the longer side).
pub(crate) fn center_crop_window((w, h): (u32, u32), s: u32) -> (f64, f64, f64, f64) {
    let (short, long) = (u64::from(w.min(h)), u64::from(w.max(h)));
    let scaled_long = (u64::from(s) * long / short.max(1)).max(u64::from(s)) as u32;
    let (sw, sh) = if w <= h {
        (s, scaled_long)
    } else {
        (scaled_long, s)
    };
    let (fx, fy) = (f64::from(w) / f64::from(sw), f64::from(h) / f64::from(sh));
    (
        f64::from(center_offset(sw, s)) * fx,
        f64::from(center_offset(sh, s)) * fy,
        f64::from(s) * fx,
        f64::from(s) * fy,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_centre_square_is_torchvisions_resize_then_center_crop() {
        // 500×375 to 256: Resize gives 341×256 (341.33 truncated), CenterCrop starts at
        // round(42.5) = 42 (halves to even): the window is 42·500/341 wide of the left edge.
        let (l, t, w, h) = center_crop_window((500, 375), 256);
        let f = 500.0 / 341.0;
        assert_eq!((l, t, w, h), (42.0 * f, 0.0, 256.0 * f, 375.0));
        // Portrait: the same on the other axis; 375×500 to 224 gives 224×298, offset 37.
        let (l, t, w, h) = center_crop_window((375, 500), 224);
        let f = 500.0 / 298.0;
        assert_eq!((l, t, w, h), (0.0, 37.0 * f, 375.0, 224.0 * f));
        // A square is the whole image.
        assert_eq!(
            center_crop_window((300, 300), 224),
            (0.0, 0.0, 300.0, 300.0)
        );
        // An image smaller than the store is scaled up the same way: 20×10 to 16 gives
        // 32×16, offset 8.
        assert_eq!(center_crop_window((20, 10), 16), (5.0, 0.0, 10.0, 10.0));
    }
}
