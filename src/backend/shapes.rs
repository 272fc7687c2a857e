//! Shape descriptors passed to backend ops.

/// A 2-D convolution over an NHWC batch (no bias, no groups, no dilation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConvShape {
    /// Images in this call.
    pub n: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Input channels.
    pub c_in: usize,
    /// Output channels.
    pub c_out: usize,
    /// Square kernel size.
    pub kernel: usize,
    /// Stride (both axes).
    pub stride: usize,
    /// Zero padding (both axes, both sides).
    pub padding: usize,
}

impl ConvShape {
    /// Output height: `(h + 2p - k) / s + 1`.
    pub fn out_h(&self) -> usize {
        (self.h + 2 * self.padding - self.kernel) / self.stride + 1
    }
    /// Output width.
    pub fn out_w(&self) -> usize {
        (self.w + 2 * self.padding - self.kernel) / self.stride + 1
    }
    /// Elements of the input.
    pub fn x_len(&self) -> usize {
        self.n * self.h * self.w * self.c_in
    }
    /// Elements of the output.
    pub fn y_len(&self) -> usize {
        self.n * self.out_h() * self.out_w() * self.c_out
    }
    /// Elements of the weight.
    pub fn w_len(&self) -> usize {
        self.c_out * self.kernel * self.kernel * self.c_in
    }
    /// Multiply-adds ×2 of the forward pass.
    pub fn flops(&self) -> f64 {
        2.0 * self.y_len() as f64 * (self.kernel * self.kernel * self.c_in) as f64
    }
}

/// A batch-norm input seen as `rows × channels` (rows = n·h·w in NHWC).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BnShape {
    /// n·h·w.
    pub rows: usize,
    /// Channels.
    pub channels: usize,
}

/// Which statistics batch norm normalises with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BnMode {
    /// Training: batch statistics, running statistics updated.
    Train,
    /// Training with frozen statistics (fine-tuning, replica-exact data parallel): running
    /// statistics, not updated; γ and β still learn.
    Frozen,
    /// Inference: running statistics.
    Eval,
}

/// A square pooling window over an NHWC batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolShape {
    /// Images.
    pub n: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Channels.
    pub c: usize,
    /// Window size.
    pub kernel: usize,
    /// Stride.
    pub stride: usize,
    /// Padding (never selected by max).
    pub padding: usize,
}

impl PoolShape {
    /// Output height.
    pub fn out_h(&self) -> usize {
        (self.h + 2 * self.padding - self.kernel) / self.stride + 1
    }
    /// Output width.
    pub fn out_w(&self) -> usize {
        (self.w + 2 * self.padding - self.kernel) / self.stride + 1
    }
}

/// A fully connected layer over `n` rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearShape {
    /// Rows (images).
    pub n: usize,
    /// Input features.
    pub inputs: usize,
    /// Output features.
    pub outputs: usize,
}
