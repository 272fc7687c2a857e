//! Device tensors of the CUDA backend: bf16 for activations and weights, f32 for gradients of
//! parameters and for statistics.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use crate::backend::{BackendError, TensorRole};

/// Storage type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// bfloat16, stored as its 16 raw bits.
    Bf16,
    /// IEEE f32.
    F32,
}

impl DType {
    /// The storage type the CUDA backend uses for `role`.
    pub fn for_role(role: TensorRole) -> DType {
        match role {
            TensorRole::Activation | TensorRole::Weight => DType::Bf16,
            TensorRole::WeightGrad | TensorRole::Statistic => DType::F32,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 => 2,
            DType::F32 => 4,
        }
    }
}

/// The buffer behind a [`CudaTensor`].
#[derive(Debug)]
pub(crate) enum Storage {
    /// A zero-length tensor (no device allocation).
    Empty,
    /// bf16 bits.
    Bf16(CudaSlice<u16>),
    /// f32 values.
    F32(CudaSlice<f32>),
}

/// A ReLU output's signs packed a bit per element beside it (bit e of byte i: element
/// 8·i + e is positive), written by the kernel that writes the output
/// (`bn_apply_signs_vec`) and read by a data gradient for the ReLU's mask instead of the
/// output itself: 1/16 of its bytes (`BIRDTRAIN_BN_MASK=packed`,
/// [`crate::cuda::bn_mask::MaskSource::Packed`]).
#[derive(Debug)]
pub(crate) struct PackedSigns {
    bits: CudaSlice<u8>,
    /// Whether `bits` are the signs of the tensor's current values: set after the kernel
    /// that wrote both, cleared by every other write (the tensor's mutable accessors and
    /// uploads clear it first, so a stale mask is never read).
    current: bool,
}

/// A flat device tensor.
#[derive(Debug)]
pub struct CudaTensor {
    pub(crate) len: usize,
    pub(crate) dtype: DType,
    pub(crate) storage: Storage,
    /// Set for a view into a larger allocation ([`crate::backend::Backend::alloc_views`]):
    /// keeps that allocation alive; the view's own slice must not free anything.
    pub(crate) view_of: Option<Arc<CudaSlice<f32>>>,
    /// The packed signs kept beside a ReLU output, when the backend keeps them
    /// ([`crate::backend::Backend::keep_relu_signs`]).
    signs: Option<PackedSigns>,
}

impl Drop for CudaTensor {
    fn drop(&mut self) {
        if self.view_of.is_some() {
            // A view's slice was made from a raw address inside `view_of`: forget it instead
            // of freeing it (the arena frees its memory once its last view is gone).
            if let Storage::F32(view) = std::mem::replace(&mut self.storage, Storage::Empty) {
                let _ = view.leak();
            }
        }
    }
}

impl CudaTensor {
    /// `len` f32 elements at element `offset` of `arena`, as a tensor that frees nothing.
    ///
    /// # Safety
    /// `offset + len` must not exceed `arena.len()`. Writes through the view change the
    /// arena: the caller orders every access (one stream, or events).
    pub(crate) unsafe fn f32_view(
        arena: &Arc<CudaSlice<f32>>,
        stream: &Arc<cudarc::driver::CudaStream>,
        offset: usize,
        len: usize,
    ) -> CudaTensor {
        let (base, _record) = cudarc::driver::DevicePtr::device_ptr(&**arena, stream);
        let view = stream.upgrade_device_ptr::<f32>(base + 4 * offset as u64, len);
        CudaTensor {
            len,
            dtype: DType::F32,
            storage: Storage::F32(view),
            view_of: Some(arena.clone()),
            signs: None,
        }
    }

    /// A tensor of `len` elements of `dtype` in `storage` (no packed signs).
    pub(crate) fn new(len: usize, dtype: DType, storage: Storage) -> CudaTensor {
        CudaTensor {
            len,
            dtype,
            storage,
            view_of: None,
            signs: None,
        }
    }

    /// Keeps `bits` (at least `len / 8` bytes) beside the tensor for its packed signs, not yet
    /// current.
    pub(crate) fn attach_signs(&mut self, bits: CudaSlice<u8>) {
        self.signs = Some(PackedSigns {
            bits,
            current: false,
        });
    }

    /// The packed signs of the tensor's current values, if the last write packed them.
    pub(crate) fn current_signs(&self) -> Option<&CudaSlice<u8>> {
        self.signs.as_ref().filter(|s| s.current).map(|s| &s.bits)
    }

    /// The bf16 buffer and the packed signs' buffer to write together (a write that packs
    /// the signs: [`CudaTensor::signs_written`] after it); the signs stop being current.
    pub(crate) fn bf16_and_signs_mut(
        &mut self,
        op: &'static str,
        what: &str,
    ) -> Result<(&mut CudaSlice<u16>, Option<&mut CudaSlice<u8>>), BackendError> {
        let (len, dtype) = (self.len, self.dtype);
        self.stale_signs();
        match &mut self.storage {
            Storage::Bf16(b) => Ok((b, self.signs.as_mut().map(|s| &mut s.bits))),
            _ => Err(wrong_type(op, what, "bf16", len, dtype)),
        }
    }

    /// Marks the packed signs as those of the current values: the kernel launched on
    /// [`CudaTensor::bf16_and_signs_mut`]'s buffers wrote both.
    pub(crate) fn signs_written(&mut self) {
        if let Some(s) = &mut self.signs {
            s.current = true;
        }
    }

    /// Forgets that the packed signs are current (every write but the one that packs them).
    pub(crate) fn stale_signs(&mut self) {
        if let Some(s) = &mut self.signs {
            s.current = false;
        }
    }

    /// The device address of element 0 (0 for an empty tensor).
    pub fn device_address(&self) -> u64 {
        use cudarc::driver::DevicePtr;
        match &self.storage {
            Storage::Empty => 0,
            Storage::Bf16(s) => s.device_ptr(s.stream()).0,
            Storage::F32(s) => s.device_ptr(s.stream()).0,
        }
    }

    /// Element count.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Storage type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The f32 device buffer (`None` for bf16 or empty tensors), for device-side consumers
    /// such as [`super::optim::DeviceOptimizer`].
    pub fn f32_slice(&self) -> Option<&CudaSlice<f32>> {
        match &self.storage {
            Storage::F32(s) => Some(s),
            _ => None,
        }
    }

    /// The bf16 device buffer as raw bits (`None` for f32 or empty tensors).
    pub fn bf16_slice_mut(&mut self) -> Option<&mut CudaSlice<u16>> {
        self.stale_signs();
        match &mut self.storage {
            Storage::Bf16(s) => Some(s),
            _ => None,
        }
    }

    /// The bf16 buffer, or a shape error naming `op` and `what` (a caller passed a tensor of
    /// another role).
    pub(crate) fn bf16(
        &self,
        op: &'static str,
        what: &str,
    ) -> Result<&CudaSlice<u16>, BackendError> {
        match &self.storage {
            Storage::Bf16(s) => Ok(s),
            _ => Err(wrong_type(op, what, "bf16", self.len, self.dtype)),
        }
    }

    /// Mutable bf16 buffer.
    pub(crate) fn bf16_mut(
        &mut self,
        op: &'static str,
        what: &str,
    ) -> Result<&mut CudaSlice<u16>, BackendError> {
        let (len, dtype) = (self.len, self.dtype);
        self.stale_signs();
        match &mut self.storage {
            Storage::Bf16(s) => Ok(s),
            _ => Err(wrong_type(op, what, "bf16", len, dtype)),
        }
    }

    /// The f32 buffer.
    pub(crate) fn f32(
        &self,
        op: &'static str,
        what: &str,
    ) -> Result<&CudaSlice<f32>, BackendError> {
        match &self.storage {
            Storage::F32(s) => Ok(s),
            _ => Err(wrong_type(op, what, "f32", self.len, self.dtype)),
        }
    }

    /// Mutable f32 buffer.
    pub(crate) fn f32_mut(
        &mut self,
        op: &'static str,
        what: &str,
    ) -> Result<&mut CudaSlice<f32>, BackendError> {
        let (len, dtype) = (self.len, self.dtype);
        match &mut self.storage {
            Storage::F32(s) => Ok(s),
            _ => Err(wrong_type(op, what, "f32", len, dtype)),
        }
    }
}

fn wrong_type(op: &'static str, what: &str, want: &str, len: usize, dtype: DType) -> BackendError {
    BackendError::Shape {
        op,
        detail: format!("{what} must be a {want} tensor, got {dtype:?} of {len} elements (wrong TensorRole at alloc)"),
    }
}

/// f32 → bf16 bits, round to nearest even (as the GPU's __float2bfloat16_rn).
pub fn to_bf16_bits(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect()
}

/// bf16 bits → f32 (exact).
pub fn from_bf16_bits(bits: &[u16]) -> Vec<f32> {
    bits.iter()
        .map(|&b| half::bf16::from_bits(b).to_f32())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_rounds_to_nearest_even() {
        let v = [1.0f32, -2.5, 3.140625, 1.0 + 1.0 / 256.0, 65504.0];
        let back = from_bf16_bits(&to_bf16_bits(&v));
        assert_eq!(back[0], 1.0);
        assert_eq!(back[1], -2.5);
        assert_eq!(back[2], 3.140625);
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even mantissa wins.
        assert_eq!(back[3], 1.0);
        assert!((back[4] - 65504.0).abs() / 65504.0 < 1.0 / 128.0);
    }

    #[test]
    fn roles_map_to_storage_types() {
        assert_eq!(DType::for_role(TensorRole::Activation), DType::Bf16);
        assert_eq!(DType::for_role(TensorRole::Weight), DType::Bf16);
        assert_eq!(DType::for_role(TensorRole::WeightGrad), DType::F32);
        assert_eq!(DType::for_role(TensorRole::Statistic), DType::F32);
    }
}
