//! The CUDA implementation of [`StagingStreams`]: pinned host slots, device slots, a copy
//! stream and the compute stream, with CUDA events.
//!
//! The pinned buffers are allocated once; the engine assembles each batch straight into a
//! slot's pinned buffer (the pipeline's allocator hook hands out [`CudaStaging::host_slot`]),
//! and `cuMemcpyHtoDAsync` from pinned memory runs truly asynchronously on the copy stream.

use std::sync::Arc;

use cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtrMut, DriverError,
    PinnedHostSlice,
};

use super::{ExternalBatch, StagingStreams};

/// Pinned host + device staging slots on one GPU.
pub struct CudaStaging {
    copy: Arc<CudaStream>,
    compute: Arc<CudaStream>,
    /// Kept alive for the raw pointers below.
    pinned: Vec<PinnedHostSlice<u8>>,
    host_ptrs: Vec<*mut u8>,
    device: Vec<CudaSlice<u8>>,
    slot_bytes: usize,
}

impl std::fmt::Debug for CudaStaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStaging")
            .field("slots", &self.device.len())
            .field("slot_bytes", &self.slot_bytes)
            .finish()
    }
}

// SAFETY: the raw host pointers point into `pinned`, which this struct owns; access goes
// through `&mut self`, so moving the struct to another thread moves exclusive access with it.
unsafe impl Send for CudaStaging {}

impl CudaStaging {
    /// `slots` pairs of `slot_bytes` pinned host and device buffers on `ctx`; uploads run on a
    /// new copy stream, kernels on `compute`.
    pub fn new(
        ctx: &Arc<CudaContext>,
        compute: Arc<CudaStream>,
        slots: usize,
        slot_bytes: usize,
    ) -> Result<Self, DriverError> {
        let copy = ctx.new_stream()?;
        let mut pinned = Vec::with_capacity(slots);
        let mut host_ptrs = Vec::with_capacity(slots);
        let mut device = Vec::with_capacity(slots);
        for _ in 0..slots {
            // SAFETY: the memory is uninitialised only until the engine writes a batch into it;
            // it is never read before that (bytes beyond a batch are never uploaded).
            // Portable (not write-combined): the engine may read back what it assembled.
            let mut host = unsafe {
                ctx.alloc_pinned_with_flags::<u8>(slot_bytes, sys::CU_MEMHOSTALLOC_PORTABLE)?
            };
            host_ptrs.push(host.as_mut_ptr()?);
            pinned.push(host);
            // Zeroed on the copy stream, so the memset is ordered before the first upload
            // into the slot (event tracking is off: nothing else orders the two streams).
            device.push(copy.alloc_zeros::<u8>(slot_bytes)?);
        }
        Ok(CudaStaging {
            copy,
            compute,
            pinned,
            host_ptrs,
            device,
            slot_bytes,
        })
    }

    /// The device buffer of `slot` (what the transform kernel reads).
    ///
    /// # Panics
    /// When `slot` is out of range (a programmer error).
    pub fn device_slot(&self, slot: usize) -> &CudaSlice<u8> {
        &self.device[slot]
    }

    /// The copy stream.
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    /// The compute stream.
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    fn check(&self, slot: usize) -> Result<(), DriverError> {
        if slot < self.device.len() && self.pinned.len() == self.device.len() {
            Ok(())
        } else {
            Err(DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE))
        }
    }
}

impl StagingStreams for CudaStaging {
    type Event = CudaEvent;
    type Error = DriverError;

    fn slot_count(&self) -> usize {
        self.device.len()
    }

    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn new_event(&mut self) -> Result<CudaEvent, DriverError> {
        // With timing: the ring measures how long compute waited for an upload. With blocking
        // sync: the host waits on these events (a slot's reuse), and should sleep in the
        // driver while it does, not spin a core.
        self.compute.context().new_event(Some(
            cudarc::driver::sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC,
        ))
    }

    fn is_complete(&mut self, event: &CudaEvent) -> Result<bool, DriverError> {
        event.try_is_complete()
    }

    fn host_wait(&mut self, event: &CudaEvent) -> Result<(), DriverError> {
        event.synchronize()
    }

    fn host_slot(&mut self, slot: usize) -> Result<&mut [u8], DriverError> {
        self.check(slot)?;
        // SAFETY: the pointer addresses `slot_bytes` bytes owned by `self.pinned[slot]`; the
        // ring only hands a slot out after its previous upload completed.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.host_ptrs[slot], self.slot_bytes) })
    }

    fn enqueue_upload(
        &mut self,
        slot: usize,
        bytes: usize,
        reuse: &CudaEvent,
        copied: &CudaEvent,
    ) -> Result<(), DriverError> {
        self.check(slot)?;
        let bytes = bytes.min(self.slot_bytes);
        self.copy.wait(reuse)?;
        // SAFETY: see `host_slot`; the host range stays untouched until `copied` completes.
        let src = unsafe { std::slice::from_raw_parts(self.host_ptrs[slot], bytes) };
        let (dst, _record) = self.device[slot].device_ptr_mut(&self.copy);
        // SAFETY: `dst` holds `slot_bytes >= bytes` bytes; the source is pinned, so the copy
        // is asynchronous and ordered on the copy stream.
        unsafe { result::memcpy_htod_async(dst, src, self.copy.cu_stream())? };
        drop(_record);
        copied.record(&self.copy)
    }

    fn enqueue_upload_external(
        &mut self,
        slot: usize,
        src: &ExternalBatch,
        reuse: &CudaEvent,
        copied: &CudaEvent,
    ) -> Result<(), DriverError> {
        self.check(slot)?;
        let data: &[u8] = (**src).as_ref();
        if data.len() > self.slot_bytes {
            return Err(DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE));
        }
        self.copy.wait(reuse)?;
        let (dst, record) = self.device[slot].device_ptr_mut(&self.copy);
        // SAFETY: the ring keeps `src` alive and unmodified until `copied` completes. From
        // pinned memory the copy is asynchronous; from pageable memory the driver stages it
        // synchronously, which is slower but equally correct.
        unsafe { result::memcpy_htod_async(dst, data, self.copy.cu_stream())? };
        drop(record);
        copied.record(&self.copy)
    }

    fn compute_wait(&mut self, event: &CudaEvent) -> Result<(), DriverError> {
        self.compute.wait(event)
    }

    fn compute_record(&mut self, event: &CudaEvent) -> Result<(), DriverError> {
        event.record(&self.compute)
    }

    fn elapsed_ms(&mut self, from: &CudaEvent, to: &CudaEvent) -> Result<Option<f32>, DriverError> {
        if !(from.try_is_complete()? && to.try_is_complete()?) {
            return Ok(None);
        }
        from.elapsed_ms(to).map(Some)
    }
}

/// One page-locked host buffer, for the engine to assemble batches into (the pipeline's
/// allocator hook hands these out), so uploads need no extra host copy.
pub struct PinnedBuffer {
    /// Owns the allocation that `ptr` points into.
    _pinned: PinnedHostSlice<u8>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value; shared access is read-only
// (`&self`), writes need `&mut self`.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above.
unsafe impl Sync for PinnedBuffer {}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.len)
            .finish()
    }
}

impl PinnedBuffer {
    /// `len` zeroed bytes of pinned memory, usable by every context (portable).
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, DriverError> {
        // SAFETY: the memory is zeroed below before anything can read it.
        let mut pinned =
            unsafe { ctx.alloc_pinned_with_flags::<u8>(len, sys::CU_MEMHOSTALLOC_PORTABLE)? };
        let ptr = pinned.as_mut_ptr()?;
        // SAFETY: `ptr` addresses `len` bytes owned by `pinned`.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(PinnedBuffer {
            _pinned: pinned,
            ptr,
            len,
        })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` addresses `len` initialised bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl AsRef<[u8]> for PinnedBuffer {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}
