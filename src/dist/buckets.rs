//! Gradient buckets: which parameters share one all-reduce, and where they live.
//!
//! Backward produces gradients in reverse forward order, so parameters are walked from the last
//! one to the first and packed greedily into buckets of about `--bucket-mb`. The flat gradient
//! buffer is laid out in that same backward order, so every bucket is one contiguous range and
//! needs exactly one all-reduce. A parameter larger than the target gets a bucket of its own
//! (parameters are never split: its gradient is written by one kernel).
//!
//! [`BucketTracker`] turns "parameter i's gradient is ready" into "launch bucket k now", always
//! in bucket order: NCCL requires every rank to issue collectives in the same order, and the
//! order in which gradients become ready may differ between ranks. [`GradientSync`] is what a
//! rank calls from its backward hook: it starts each complete bucket's average on the rank's
//! [`Collective`] (in-process or NCCL alike), while backward goes on.

use super::collective::{Collective, CollectiveError};

pub use super::bucket_error::BucketError;

/// One parameter's gradient as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    /// Parameter name (torchvision naming).
    pub name: String,
    /// Gradient size in bytes.
    pub bytes: usize,
}

/// One all-reduce: a contiguous range of the flat gradient buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Forward indices of its parameters, in backward order (the order they are produced).
    pub params: Vec<usize>,
    /// Offset of the range in the flat buffer, in bytes.
    pub offset_bytes: usize,
    /// Length of the range in bytes (parameters plus alignment padding between them).
    pub len_bytes: usize,
}

/// The bucket layout of a model's gradients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    names: Vec<String>,
    buckets: Vec<Bucket>,
    /// Per forward index: (offset in bytes, bucket index).
    placement: Vec<(usize, usize)>,
    sizes: Vec<usize>,
    total_bytes: usize,
    element_bytes: usize,
}

/// Settings of the planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketSettings {
    /// Target bucket size in bytes (`--bucket-mb` × 2^20).
    pub target_bytes: usize,
    /// Element size of the gradients (4 for f32), the unit of every offset and length.
    pub element_bytes: usize,
    /// Every parameter starts at a multiple of this many bytes (a multiple of `element_bytes`;
    /// 256 keeps each parameter's kernels on aligned addresses).
    pub align_bytes: usize,
}

impl BucketSettings {
    /// f32 gradients, 256-byte alignment, `bucket_mb` MiB buckets.
    pub fn f32_mb(bucket_mb: f64) -> Self {
        BucketSettings {
            target_bytes: (bucket_mb * 1024.0 * 1024.0).round().max(0.0) as usize,
            element_bytes: 4,
            align_bytes: 256,
        }
    }
}

impl BucketPlan {
    /// Plans buckets for `params` given in **forward** order.
    pub fn new(params: &[ParamSpec], settings: BucketSettings) -> Result<Self, BucketError> {
        let BucketSettings {
            target_bytes,
            element_bytes,
            align_bytes,
        } = settings;
        if target_bytes == 0 {
            return Err(BucketError::InvalidSetting {
                what: "bucket size (bytes)",
                value: 0,
                hint: "use a positive --bucket-mb such as 25",
            });
        }
        if element_bytes == 0 || align_bytes == 0 || align_bytes % element_bytes != 0 {
            return Err(BucketError::InvalidSetting {
                what: "alignment (bytes)",
                value: align_bytes,
                hint: "alignment must be a positive multiple of the element size",
            });
        }
        for p in params {
            if p.bytes == 0 {
                return Err(BucketError::EmptyParameter {
                    name: p.name.clone(),
                });
            }
            if p.bytes % element_bytes != 0 {
                return Err(BucketError::Misaligned {
                    name: p.name.clone(),
                    bytes: p.bytes,
                    element_bytes,
                });
            }
        }

        let mut buckets: Vec<Bucket> = Vec::new();
        let mut placement = vec![(0usize, 0usize); params.len()];
        let mut cursor = 0usize;
        let mut current: Option<Bucket> = None;
        for index in (0..params.len()).rev() {
            let bucket = current.get_or_insert_with(|| Bucket {
                params: Vec::new(),
                offset_bytes: cursor,
                len_bytes: 0,
            });
            let start = cursor;
            placement[index] = (start, buckets.len());
            bucket.params.push(index);
            cursor = start + params[index].bytes;
            bucket.len_bytes = cursor - bucket.offset_bytes;
            if bucket.len_bytes >= target_bytes {
                buckets.extend(current.take());
            }
            // The next parameter (in this bucket or the next) starts aligned.
            cursor = cursor.div_ceil(align_bytes) * align_bytes;
        }
        buckets.extend(current.take());
        let total_bytes = buckets.last().map_or(0, |b| b.offset_bytes + b.len_bytes);
        Ok(BucketPlan {
            names: params.iter().map(|p| p.name.clone()).collect(),
            buckets,
            placement,
            sizes: params.iter().map(|p| p.bytes).collect(),
            total_bytes,
            element_bytes,
        })
    }

    /// The buckets, in launch order (bucket 0 holds the last layers).
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// Number of parameters planned.
    pub fn param_count(&self) -> usize {
        self.sizes.len()
    }

    /// Name of parameter `index` (forward order).
    pub fn param_name(&self, index: usize) -> &str {
        &self.names[index]
    }

    /// Byte range of parameter `index` (forward order) in the flat gradient buffer.
    ///
    /// # Panics
    /// When `index >= param_count()` (a programmer error).
    pub fn param_range(&self, index: usize) -> std::ops::Range<usize> {
        let (offset, _) = self.placement[index];
        offset..offset + self.sizes[index]
    }

    /// The bucket holding parameter `index`.
    ///
    /// # Panics
    /// When `index >= param_count()` (a programmer error).
    pub fn bucket_of(&self, index: usize) -> usize {
        self.placement[index].1
    }

    /// Size of the flat gradient buffer in bytes (padding included).
    pub fn total_bytes(&self) -> usize {
        self.total_bytes
    }

    /// Size of the flat gradient buffer in elements.
    pub fn total_elements(&self) -> usize {
        self.total_bytes / self.element_bytes
    }

    /// Element range of bucket `k` in the flat buffer (what one all-reduce covers).
    pub fn bucket_elements(&self, k: usize) -> std::ops::Range<usize> {
        let b = &self.buckets[k];
        b.offset_bytes / self.element_bytes..(b.offset_bytes + b.len_bytes) / self.element_bytes
    }

    /// Element range of parameter `index` (forward order) in the flat buffer.
    pub fn param_elements(&self, index: usize) -> std::ops::Range<usize> {
        let r = self.param_range(index);
        r.start / self.element_bytes..r.end / self.element_bytes
    }
}

/// Turns per-parameter readiness into in-order bucket launches, one step at a time.
#[derive(Debug, Clone)]
pub struct BucketTracker {
    /// Parameters of each bucket not yet ready.
    pending: Vec<usize>,
    ready: Vec<bool>,
    next_launch: usize,
    bucket_of: Vec<usize>,
    names: Vec<String>,
}

impl BucketTracker {
    /// A tracker for `plan`, at the start of a step.
    pub fn new(plan: &BucketPlan) -> Self {
        let mut t = BucketTracker {
            pending: Vec::new(),
            ready: Vec::new(),
            next_launch: 0,
            bucket_of: (0..plan.param_count()).map(|i| plan.bucket_of(i)).collect(),
            names: plan.names.clone(),
        };
        t.pending = plan.buckets().iter().map(|b| b.params.len()).collect();
        t.ready = vec![false; plan.param_count()];
        t
    }

    /// Resets for the next step.
    pub fn reset(&mut self) {
        self.ready.iter_mut().for_each(|r| *r = false);
        for (k, p) in self.pending.iter_mut().enumerate() {
            *p = self.bucket_of.iter().filter(|&&b| b == k).count();
        }
        self.next_launch = 0;
    }

    /// Marks parameter `index`'s gradient as written; returns the buckets that may launch now,
    /// in launch order (possibly none, possibly several once an earlier bucket completes).
    pub fn mark_ready(&mut self, index: usize) -> Result<Vec<usize>, BucketError> {
        let count = self.ready.len();
        let slot = self
            .ready
            .get_mut(index)
            .ok_or(BucketError::UnknownParameter { index, count })?;
        if *slot {
            return Err(BucketError::DuplicateReady {
                index,
                name: self.names[index].clone(),
            });
        }
        *slot = true;
        self.pending[self.bucket_of[index]] -= 1;
        let mut launch = Vec::new();
        while self.next_launch < self.pending.len() && self.pending[self.next_launch] == 0 {
            launch.push(self.next_launch);
            self.next_launch += 1;
        }
        Ok(launch)
    }

    /// True when parameter `index`'s gradient was reported this step.
    pub fn is_ready(&self, index: usize) -> bool {
        self.ready.get(index).copied().unwrap_or(false)
    }

    /// True once every bucket of this step has been handed out for launch.
    pub fn all_launched(&self) -> bool {
        self.next_launch == self.pending.len()
    }
}

/// Builds [`ParamSpec`]s from (name, element count) pairs for `element_bytes`-byte gradients.
pub fn specs_from_numel(params: &[(String, usize)], element_bytes: usize) -> Vec<ParamSpec> {
    params
        .iter()
        .map(|(name, numel)| ParamSpec {
            name: name.clone(),
            bytes: numel * element_bytes,
        })
        .collect()
}

/// One rank's gradient averaging over any [`Collective`]: the backward hook reports each
/// parameter's gradient ([`GradientSync::grad_ready`]) and every bucket that became complete
/// starts averaging at once, in plan order; [`GradientSync::finish_step`] then waits for them.
#[derive(Debug, Clone)]
pub struct GradientSync {
    plan: BucketPlan,
    tracker: BucketTracker,
    scale: f32,
}

impl GradientSync {
    /// Averaging of gradients laid out by `plan`.
    pub fn new(plan: BucketPlan) -> Self {
        GradientSync {
            tracker: BucketTracker::new(&plan),
            plan,
            scale: 1.0,
        }
    }

    /// The bucket plan (the gradient buffer's layout).
    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// Starts a step: this rank's gradients are multiplied by `scale` before averaging (its
    /// share of the step's images × ranks; 1 for an even split).
    pub fn begin_step(&mut self, scale: f32) {
        self.tracker.reset();
        self.scale = scale;
    }

    /// Parameter `param`'s gradient is in its range of `buffer` (on a GPU: its kernel is
    /// enqueued on the compute stream): starts every bucket that became complete. Returns the
    /// buckets started.
    pub fn grad_ready<C: Collective + ?Sized>(
        &mut self,
        comm: &mut C,
        buffer: &mut C::Buffer,
        param: usize,
    ) -> Result<Vec<usize>, CollectiveError> {
        let launch = self.tracker.mark_ready(param)?;
        for &k in &launch {
            comm.start_average(buffer, k, self.plan.bucket_elements(k), self.scale)?;
        }
        Ok(launch)
    }

    /// Ends the step: every gradient must have been reported; then waits for the averages
    /// (on a GPU: orders the compute stream after them).
    pub fn finish_step<C: Collective + ?Sized>(
        &mut self,
        comm: &mut C,
        buffer: &mut C::Buffer,
    ) -> Result<(), CollectiveError> {
        let finished = comm.finish_averages(buffer);
        if !self.tracker.all_launched() {
            let missing: Vec<usize> = (0..self.plan.param_count())
                .filter(|&i| !self.tracker.is_ready(i))
                .collect();
            return Err(BucketError::IncompleteStep {
                missing: missing.len(),
                first: missing
                    .first()
                    .map_or_else(String::new, |&i| self.plan.param_name(i).to_string()),
            }
            .into());
        }
        finished
    }
}
