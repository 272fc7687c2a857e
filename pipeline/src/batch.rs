//! A micro-batch handed to the consumer: pixels in the caller-allocated buffer, labels, ids.

use crate::buffer::{HostBuffer, Slot};

/// One replica's micro-batch of one step. Dropping it returns its buffer to the pool.
pub struct Batch {
    /// The epoch it belongs to.
    pub epoch: u64,
    /// The step within the epoch.
    pub step: usize,
    /// The replica it was made for.
    pub replica: usize,
    /// Real images in it: may be below the batch size (last batch, skipped bad files) or 0.
    pub len: usize,
    /// Side of the stored square images.
    pub image_size: u32,
    /// Index of each image in the split's sorted sample list.
    pub sample_ids: Vec<u64>,
    pub(crate) slot: Option<Slot>,
    pub(crate) returner: flume::Sender<Slot>,
}

impl Batch {
    fn slot(&self) -> &Slot {
        self.slot
            .as_ref()
            .expect("a batch owns its slot until dropped (programmer error otherwise)")
    }

    /// `len × S × S × 3` bytes, u8 NHWC RGB.
    pub fn pixels(&self) -> &[u8] {
        let bytes = self.len * self.image_size as usize * self.image_size as usize * 3;
        &self.slot().pixels.as_slice()[..bytes]
    }

    /// `len × S × S × 3` bytes, writable: for a consumer that finishes the images in place
    /// (a mirror, a colour change) before handing the buffer on without a copy.
    pub fn pixels_mut(&mut self) -> &mut [u8] {
        let bytes = self.len * self.image_size as usize * self.image_size as usize * 3;
        let slot = self
            .slot
            .as_mut()
            .expect("a batch owns its slot until dropped (programmer error otherwise)");
        &mut slot.pixels.as_mut_slice()[..bytes]
    }

    /// The class index of each image.
    pub fn labels(&self) -> &[u32] {
        &self.slot().labels
    }

    /// The caller-allocated buffer itself (for downcasting to a pinned buffer type). Only the
    /// first `pixels().len()` bytes belong to this batch.
    pub fn buffer(&self) -> &dyn HostBuffer {
        self.slot().pixels.as_ref()
    }
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("epoch", &self.epoch)
            .field("step", &self.step)
            .field("replica", &self.replica)
            .field("len", &self.len)
            .field("image_size", &self.image_size)
            .field("sample_ids", &self.sample_ids)
            .finish_non_exhaustive()
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if let Some(mut slot) = self.slot.take() {
            slot.ids = std::mem::take(&mut self.sample_ids);
            // The pool may be gone (pipeline dropped): then the buffer is simply freed.
            let _ = self.returner.send(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pixels_mut_writes_what_pixels_reads_and_the_buffer_goes_back_to_the_pool() {
        let (returner, returned) = flume::unbounded();
        let mut batch = Batch {
            epoch: 0,
            step: 0,
            replica: 0,
            len: 1,
            image_size: 2,
            sample_ids: vec![7],
            // A pool buffer may be larger than the batch: only its first bytes are the batch's.
            slot: Some(Slot {
                pixels: Box::new(vec![0u8; 20]),
                labels: vec![3],
                ids: Vec::new(),
            }),
            returner,
        };
        assert_eq!(batch.pixels_mut().len(), 12);
        batch.pixels_mut()[11] = 9;
        assert_eq!(batch.pixels()[11], 9);
        drop(batch);
        let slot = returned.try_recv().expect("the slot is returned");
        assert_eq!(slot.pixels.as_slice()[11], 9);
        assert_eq!(slot.ids, vec![7]);
    }
}
