//! Resizing decoded RGB8 images to the stored `S×S` with fast_image_resize (SIMD).

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

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
            let side = f64::from(w.min(h));
            options = options.crop(
                (f64::from(w) - side) / 2.0,
                (f64::from(h) - side) / 2.0,
                side,
                side,
            );
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
