//! Where the data gradients with a batch-norm epilogue (v3 and v2) take the ReLU's mask from
//! (`BIRDTRAIN_BN_MASK`): the batch norm's stored output y (`stored`, the default), or, for a
//! batch norm whose output is ReLU(BN(x)) alone (no residual added before the ReLU: the inner
//! ones of a block), y's sign recomputed from x, γ and β (`recomputed`); or that, and for the
//! batch norms with a residual (the blocks' outputs, whose sign x alone does not give) y's
//! signs packed a bit per element beside y by the forward's bn_apply (`packed`).
//!
//! Why: the epilogue reads x anyway, for Σg·x̂, so recomputing the mask spares the read of y:
//! for resnet50 at batch 256 the inner batch norms' outputs are about 1.7 GB a step (a model of
//! the shapes, ~0.6 ms at 3 TB/s). The recomputation is bn_apply's own expression, rounded to
//! bf16 as bn_apply rounds it, so both give the same mask and the same bits (the emulator
//! checks this for every v3 and v2 data gradient with the epilogue, v3's one tile a block and
//! persistent). The kernels recompute it in their sums, where the column pair's x and
//! parameters are in registers, and write dx after them. The packed signs cost the forward
//! 1/16 of y's bytes more and spare the data gradient 15/16 of its read of y: the blocks'
//! outputs are ~2.8 GB a resnet50 step at batch 256 (~0.9 ms at 3 TB/s); v3's data gradients
//! read them (v2's read y). `stored` stays the default until a GPU has measured another
//! faster.

use super::CudaError;

/// The environment variable that picks the mask's source: `stored` (unset), `recomputed` or
/// `packed`.
pub const MASK_ENV: &str = "BIRDTRAIN_BN_MASK";

/// Where the fused data gradients take a ReLU's mask from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MaskSource {
    /// The batch norm's stored output y (its sign).
    #[default]
    Stored,
    /// y's sign recomputed from x, γ and β, where y is ReLU(BN(x)) alone; y otherwise.
    Recomputed,
    /// As `Recomputed`, and where a residual entered y, y's signs packed a bit per element
    /// beside it ([`crate::backend::Backend::keep_relu_signs`]) read instead of y by the v3
    /// data gradients.
    Packed,
}

impl MaskSource {
    /// Parses the value of `BIRDTRAIN_BN_MASK` (unset or empty: `stored`).
    pub fn parse(value: Option<&str>) -> Result<MaskSource, CudaError> {
        match value.map(str::trim) {
            None | Some("") | Some("stored") => Ok(MaskSource::Stored),
            Some("recomputed") => Ok(MaskSource::Recomputed),
            Some("packed") => Ok(MaskSource::Packed),
            Some(other) => Err(CudaError::Unsupported {
                what: format!(
                    "{MASK_ENV}={other:?}: expected stored (the data gradients read the batch \
                     norm's output for the ReLU's mask), recomputed (they recompute it from \
                     the batch norm's input where no residual entered it) or packed \
                     (recomputed, and elsewhere read from the output's signs packed a bit per \
                     element); unset means stored"
                ),
            }),
        }
    }

    /// The source `BIRDTRAIN_BN_MASK` asks for.
    pub fn from_env() -> Result<MaskSource, CudaError> {
        MaskSource::parse(std::env::var(MASK_ENV).ok().as_deref())
    }

    /// Its name in `BIRDTRAIN_BN_MASK`.
    pub fn name(self) -> &'static str {
        match self {
            MaskSource::Stored => "stored",
            MaskSource::Recomputed => "recomputed",
            MaskSource::Packed => "packed",
        }
    }

    /// Whether the mask of ReLU(BN(x)) alone is recomputed from x (`recomputed`, `packed`).
    pub fn recomputes(self) -> bool {
        matches!(self, MaskSource::Recomputed | MaskSource::Packed)
    }

    /// Whether the outputs with a residual keep their signs packed (`packed`).
    pub fn packs(self) -> bool {
        self == MaskSource::Packed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_source_parses_its_names_and_refuses_others_by_name() {
        assert_eq!(MaskSource::parse(None).unwrap(), MaskSource::Stored);
        assert_eq!(MaskSource::parse(Some(" ")).unwrap(), MaskSource::Stored);
        for m in [
            MaskSource::Stored,
            MaskSource::Recomputed,
            MaskSource::Packed,
        ] {
            assert_eq!(MaskSource::parse(Some(m.name())).unwrap(), m);
        }
        let e = MaskSource::parse(Some("x")).unwrap_err().to_string();
        assert!(
            e.contains("BIRDTRAIN_BN_MASK=\"x\"")
                && e.contains("expected stored")
                && e.contains("packed"),
            "{e}"
        );
    }
}
