//! Which samples each replica gets at each step of an epoch.
//!
//! One global permutation per `(seed, epoch)`; global batch `s` is positions
//! `[s·R·B, (s+1)·R·B)` of it and replica `r` takes the `r`-th micro-batch. The last,
//! incomplete global batch follows the [`LastBatch`] policy identically on every replica.

use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::LastBatch;

/// The epoch plan: a permutation and the batching arithmetic over it.
#[derive(Debug, Clone)]
pub(crate) struct EpochPlan {
    order: Vec<u32>,
    replicas: usize,
    batch_size: usize,
    last_batch: LastBatch,
}

/// Number of steps in an epoch of `n` samples.
pub(crate) fn steps_per_epoch(
    n: usize,
    replicas: usize,
    batch_size: usize,
    last: LastBatch,
) -> usize {
    let global = replicas * batch_size;
    match last {
        LastBatch::Drop => n / global,
        LastBatch::Partial | LastBatch::Pad => n.div_ceil(global),
    }
}

/// How many samples `replica` gets at `step` of an epoch of `n` samples: the length of its
/// micro-batch, known without the permutation (every rank computes a step's image count from
/// it instead of exchanging it). `None` past the epoch's last step.
pub(crate) fn micro_batch_len(
    n: usize,
    replicas: usize,
    batch_size: usize,
    last: LastBatch,
    step: usize,
    replica: usize,
) -> Option<usize> {
    if step >= steps_per_epoch(n, replicas, batch_size, last) || replica >= replicas {
        return None;
    }
    let global = replicas * batch_size;
    let remaining = n.saturating_sub(step * global);
    Some(if remaining >= global || last != LastBatch::Partial {
        batch_size
    } else {
        // The remainder split as evenly as possible: the first `extra` replicas get one more.
        remaining / replicas + usize::from(replica < remaining % replicas)
    })
}

impl EpochPlan {
    /// The plan for one epoch; `shuffle = false` keeps the scan (file) order.
    pub(crate) fn new(
        n: usize,
        seed: u64,
        epoch: u64,
        shuffle: bool,
        replicas: usize,
        batch_size: usize,
        last_batch: LastBatch,
    ) -> Self {
        let mut order: Vec<u32> = (0..n as u32).collect();
        if shuffle {
            // Mix the epoch into the seed so consecutive epochs are unrelated streams.
            let stream = seed ^ epoch.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(stream);
            order.shuffle(&mut rng);
        }
        Self {
            order,
            replicas,
            batch_size,
            last_batch,
        }
    }

    /// Sample indices of `replica`'s micro-batch at `step` (may be empty for `partial`).
    pub(crate) fn micro_batch(&self, step: usize, replica: usize) -> Vec<u32> {
        let n = self.order.len();
        let b = self.batch_size;
        let global = self.replicas * b;
        let start = step * global;
        let remaining = n.saturating_sub(start);
        if remaining >= global || self.last_batch == LastBatch::Drop {
            let lo = start + replica * b;
            return self.order[lo.min(n)..(lo + b).min(n)].to_vec();
        }
        match self.last_batch {
            LastBatch::Pad => (0..b)
                .map(|j| self.order[(start + replica * b + j) % n])
                .collect(),
            _ => {
                // Split the remainder as evenly as possible (see `micro_batch_len`).
                let base = remaining / self.replicas;
                let extra = remaining % self.replicas;
                let lo = start + replica * base + replica.min(extra);
                let len = micro_batch_len(n, self.replicas, b, self.last_batch, step, replica)
                    .unwrap_or(0);
                self.order[lo..lo + len].to_vec()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counted_lengths_are_the_micro_batches_lengths() {
        for n in [1, 7, 12, 13, 31] {
            for replicas in 1..=4 {
                for batch in 1..=5 {
                    for policy in [LastBatch::Partial, LastBatch::Drop, LastBatch::Pad] {
                        let plan = EpochPlan::new(n, 9, 0, true, replicas, batch, policy);
                        let steps = steps_per_epoch(n, replicas, batch, policy);
                        for step in 0..steps {
                            for r in 0..replicas {
                                assert_eq!(
                                    micro_batch_len(n, replicas, batch, policy, step, r),
                                    Some(plan.micro_batch(step, r).len()),
                                    "n {n} R {replicas} B {batch} {policy:?} step {step}"
                                );
                            }
                        }
                        assert_eq!(micro_batch_len(n, replicas, batch, policy, steps, 0), None);
                    }
                }
            }
        }
    }

    /// Every (n, R, B, policy) combination: equal steps on all replicas, disjoint shares, the
    /// union is the epoch (partial), a prefix of it (drop) or the epoch plus a wrap (pad).
    #[test]
    fn plans_partition_the_epoch_for_every_shape() {
        for n in 1..=23 {
            for replicas in 1..=4 {
                for batch in 1..=5 {
                    for policy in [LastBatch::Partial, LastBatch::Drop, LastBatch::Pad] {
                        let plan = EpochPlan::new(n, 3, 1, true, replicas, batch, policy);
                        let steps = steps_per_epoch(n, replicas, batch, policy);
                        let mut seen = Vec::new();
                        for step in 0..steps {
                            let sizes: Vec<usize> = (0..replicas)
                                .map(|r| plan.micro_batch(step, r).len())
                                .collect();
                            let max = *sizes.iter().max().unwrap();
                            let min = *sizes.iter().min().unwrap();
                            assert!(max - min <= 1, "even split {sizes:?}");
                            for r in 0..replicas {
                                seen.extend(plan.micro_batch(step, r));
                            }
                        }
                        let ctx = format!("n={n} R={replicas} B={batch} {policy:?}");
                        let global = replicas * batch;
                        match policy {
                            LastBatch::Partial => {
                                seen.sort_unstable();
                                assert_eq!(seen, (0..n as u32).collect::<Vec<_>>(), "{ctx}");
                            }
                            LastBatch::Drop => {
                                assert_eq!(seen.len(), n / global * global, "{ctx}");
                                seen.sort_unstable();
                                seen.dedup();
                                assert_eq!(seen.len(), n / global * global, "{ctx}");
                            }
                            LastBatch::Pad => {
                                assert_eq!(seen.len(), n.div_ceil(global) * global, "{ctx}");
                                seen.sort_unstable();
                                seen.dedup();
                                assert_eq!(seen.len(), n, "{ctx}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_permutation_depends_on_seed_and_epoch_only() {
        let a = EpochPlan::new(50, 1, 2, true, 1, 50, LastBatch::Partial).micro_batch(0, 0);
        let b = EpochPlan::new(50, 1, 2, true, 2, 25, LastBatch::Partial);
        let b: Vec<u32> = [b.micro_batch(0, 0), b.micro_batch(0, 1)].concat();
        assert_eq!(a, b, "replicas cut the same global order");
        assert_ne!(
            a,
            EpochPlan::new(50, 1, 3, true, 1, 50, LastBatch::Partial).micro_batch(0, 0)
        );
        assert_ne!(
            a,
            EpochPlan::new(50, 2, 2, true, 1, 50, LastBatch::Partial).micro_batch(0, 0)
        );
    }
}
