//! Which samples each replica gets at each step of an epoch.
//!
//! One global order per `(seed, epoch)`: a permutation, or with [`Sampling::Balanced`] as many
//! class-balanced draws with replacement. Global batch `s` is positions `[s·R·B, (s+1)·R·B)`
//! of it and replica `r` takes the `r`-th micro-batch. The last, incomplete global batch
//! follows the [`LastBatch`] policy identically on every replica.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::{LastBatch, Sampling};

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

/// The random stream of one epoch: the epoch is mixed into the seed so consecutive epochs
/// are unrelated streams.
fn epoch_rng(seed: u64, epoch: u64) -> rand_chacha::ChaCha8Rng {
    let stream = seed ^ epoch.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    rand_chacha::ChaCha8Rng::seed_from_u64(stream)
}

/// One epoch's order of sample indices for samples with these `labels`: with
/// [`Sampling::Shuffle`], every sample once (`shuffle = false` keeps the scan order); with
/// [`Sampling::Balanced`], class-balanced draws (the labels are read only then).
pub(crate) fn epoch_order(
    labels: impl ExactSizeIterator<Item = u32>,
    sampling: Sampling,
    shuffle: bool,
    seed: u64,
    epoch: u64,
) -> Vec<u32> {
    match sampling {
        Sampling::Balanced => balanced_order(labels, seed, epoch),
        Sampling::Shuffle => {
            let mut order: Vec<u32> = (0..labels.len() as u32).collect();
            if shuffle {
                order.shuffle(&mut epoch_rng(seed, epoch));
            }
            order
        }
    }
}

/// As many class-balanced draws with replacement as there are labels: a class uniformly
/// among those with samples, then one of its samples uniformly, which gives each sample the
/// chance `1 / (classes present × its class's size)`.
fn balanced_order(labels: impl ExactSizeIterator<Item = u32>, seed: u64, epoch: u64) -> Vec<u32> {
    let n = labels.len();
    let mut members: Vec<Vec<u32>> = Vec::new();
    for (i, l) in labels.enumerate() {
        let l = l as usize;
        if l >= members.len() {
            members.resize_with(l + 1, Vec::new);
        }
        members[l].push(i as u32);
    }
    members.retain(|m| !m.is_empty());
    let mut rng = epoch_rng(seed, epoch);
    (0..n)
        .map(|_| {
            let class = &members[rng.random_range(0..members.len())];
            class[rng.random_range(0..class.len())]
        })
        .collect()
}

impl EpochPlan {
    /// The plan for one epoch's `order` ([`epoch_order`]).
    pub(crate) fn new(
        order: Vec<u32>,
        replicas: usize,
        batch_size: usize,
        last_batch: LastBatch,
    ) -> Self {
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

    /// A shuffled plan over `n` samples.
    fn shuffled(
        n: usize,
        seed: u64,
        epoch: u64,
        replicas: usize,
        batch: usize,
        last: LastBatch,
    ) -> EpochPlan {
        let order = epoch_order(
            std::iter::repeat_n(0, n),
            Sampling::Shuffle,
            true,
            seed,
            epoch,
        );
        EpochPlan::new(order, replicas, batch, last)
    }

    /// A plan of `sampling` over samples with `labels`, unshuffled unless balanced.
    fn over(
        labels: &[u32],
        sampling: Sampling,
        epoch: u64,
        replicas: usize,
        batch: usize,
    ) -> EpochPlan {
        let order = epoch_order(labels.iter().copied(), sampling, false, 7, epoch);
        EpochPlan::new(order, replicas, batch, LastBatch::Partial)
    }

    #[test]
    fn the_counted_lengths_are_the_micro_batches_lengths() {
        for n in [1, 7, 12, 13, 31] {
            for replicas in 1..=4 {
                for batch in 1..=5 {
                    for policy in [LastBatch::Partial, LastBatch::Drop, LastBatch::Pad] {
                        let plan = shuffled(n, 9, 0, replicas, batch, policy);
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
                        let plan = shuffled(n, 3, 1, replicas, batch, policy);
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
        let a = shuffled(50, 1, 2, 1, 50, LastBatch::Partial).micro_batch(0, 0);
        let b = shuffled(50, 1, 2, 2, 25, LastBatch::Partial);
        let b: Vec<u32> = [b.micro_batch(0, 0), b.micro_batch(0, 1)].concat();
        assert_eq!(a, b, "replicas cut the same global order");
        assert_ne!(
            a,
            shuffled(50, 1, 3, 1, 50, LastBatch::Partial).micro_batch(0, 0)
        );
        assert_ne!(
            a,
            shuffled(50, 2, 2, 1, 50, LastBatch::Partial).micro_batch(0, 0)
        );
    }

    /// 90 images of class 0, 10 of class 2 (class 1 has none): a balanced epoch has 100
    /// draws, about half from each present class, the same for any replica count, another
    /// draw the next epoch; a resumed step sees the same draws.
    #[test]
    fn balanced_epochs_draw_classes_equally_often() {
        let labels: Vec<u32> = (0..100).map(|i| if i < 90 { 0 } else { 2 }).collect();
        let plan =
            |epoch, replicas, batch| over(&labels, Sampling::Balanced, epoch, replicas, batch);
        let whole = |p: &EpochPlan, replicas: usize, batch: usize| -> Vec<u32> {
            (0..steps_per_epoch(100, replicas, batch, LastBatch::Partial))
                .flat_map(|s| (0..replicas).flat_map(move |r| p.micro_batch(s, r)))
                .collect()
        };
        let mut minority = 0;
        for epoch in 0..10 {
            let drawn = whole(&plan(epoch, 1, 100), 1, 100);
            assert_eq!(drawn.len(), 100);
            assert_eq!(
                drawn,
                whole(&plan(epoch, 4, 5), 4, 5),
                "replicas cut one order"
            );
            assert_eq!(drawn, whole(&plan(epoch, 1, 100), 1, 100), "deterministic");
            assert_ne!(drawn, whole(&plan(epoch + 1, 1, 100), 1, 100));
            minority += drawn.iter().filter(|&&i| labels[i as usize] == 2).count();
        }
        // 1000 draws of a fair coin: 500 ± 50 is over 3 standard deviations.
        assert!(
            (450..=550).contains(&minority),
            "{minority} of 1000 from the small class"
        );
        // Without shuffling a shuffle plan is the file order; a balanced one stays random.
        let fixed = over(&labels, Sampling::Shuffle, 0, 1, 100);
        assert_eq!(fixed.micro_batch(0, 0), (0..100).collect::<Vec<u32>>());
        assert_ne!(plan(0, 1, 100).micro_batch(0, 0), fixed.micro_batch(0, 0));
        // An empty sample list draws nothing.
        let empty = over(&[], Sampling::Balanced, 0, 1, 4);
        assert!(empty.micro_batch(0, 0).is_empty());
    }
}
