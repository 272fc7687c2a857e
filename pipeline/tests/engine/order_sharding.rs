//! Ordering: determinism across worker counts, disjoint and complete sharding, identical
//! last-batch handling on every replica, mid-epoch resume, unshuffled eval order.

use crate::common;

use std::collections::HashSet;

use common::{collect, synth};
use pipeline::LastBatch;

#[test]
fn same_batches_whatever_the_number_of_workers() {
    let fx = synth(3, 7, 0); // 21 images
    let one = fx.builder().workers(1).batch_size(4).build().unwrap();
    let a = collect(&one, 0, 0, 0);
    drop(one);
    // A fresh cache directory, so the second run decodes everything again.
    let other_cache = tempfile::tempdir().unwrap();
    let three = fx
        .builder()
        .cache_dir(other_cache.path())
        .workers(3)
        .batch_size(4)
        .build()
        .unwrap();
    let b = collect(&three, 0, 0, 0);
    assert_eq!(a, b);
    assert_eq!(three.stats().decoded, 21);
    // A different epoch is a different permutation.
    let c = collect(&three, 1, 0, 0);
    assert_ne!(
        a.iter().map(|s| &s.ids).collect::<Vec<_>>(),
        c.iter().map(|s| &s.ids).collect::<Vec<_>>()
    );
}

#[test]
fn replicas_get_disjoint_shares_whose_union_is_the_epoch() {
    let fx = synth(3, 9, 0); // 27 images, global batch 3 × 4 = 12 → steps 12, 12, 3
    let p = fx.builder().replicas(3).batch_size(4).build().unwrap();
    assert_eq!(p.steps_per_epoch(), 3);
    let mut all = Vec::new();
    let mut per_replica_steps = Vec::new();
    for r in 0..3 {
        let batches = collect(&p, 2, r, 0);
        per_replica_steps.push(batches.len());
        for b in batches {
            assert_eq!(b.replica, r);
            all.extend(b.ids);
        }
    }
    assert_eq!(per_replica_steps, vec![3, 3, 3]);
    let unique: HashSet<u64> = all.iter().copied().collect();
    assert_eq!(all.len(), 27, "every sample exactly once");
    assert_eq!(unique, (0..27).collect::<HashSet<u64>>());
}

fn last_batch_lens(policy: LastBatch, n_per_class: usize) -> Vec<Vec<usize>> {
    let fx = synth(2, n_per_class, 0);
    let p = fx
        .builder()
        .replicas(3)
        .batch_size(2)
        .last_batch(policy)
        .build()
        .unwrap();
    (0..3)
        .map(|r| {
            p.epoch(0, r, 0)
                .unwrap()
                .map(|b| b.unwrap().len)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn partial_last_batch_is_split_evenly_and_every_replica_yields_it() {
    // 2 × 4 = 8 images, global batch 6: one full step, then 2 images over 3 replicas.
    let lens = last_batch_lens(LastBatch::Partial, 4);
    assert_eq!(lens, vec![vec![2, 1], vec![2, 1], vec![2, 0]]);
}

#[test]
fn drop_last_batch_skips_it_on_every_replica() {
    let lens = last_batch_lens(LastBatch::Drop, 4);
    assert_eq!(lens, vec![vec![2], vec![2], vec![2]]);
}

#[test]
fn pad_last_batch_wraps_to_the_permutation_start() {
    let fx = synth(2, 4, 0);
    let p = fx
        .builder()
        .replicas(3)
        .batch_size(2)
        .last_batch(LastBatch::Pad)
        .build()
        .unwrap();
    let reps: Vec<Vec<common::Seen>> = (0..3).map(|r| collect(&p, 0, r, 0)).collect();
    for r in &reps {
        assert_eq!(
            r.iter().map(|b| b.ids.len()).collect::<Vec<_>>(),
            vec![2, 2]
        );
    }
    // Global order of step 0 is the permutation's start; step 1 holds the last 2 then wraps.
    let step0: Vec<u64> = reps.iter().flat_map(|r| r[0].ids.clone()).collect();
    let step1: Vec<u64> = reps.iter().flat_map(|r| r[1].ids.clone()).collect();
    assert_eq!(&step1[2..6], &step0[0..4]);
    let all: HashSet<u64> = step0.iter().chain(&step1[..2]).copied().collect();
    assert_eq!(all.len(), 8);
}

#[test]
fn a_mid_epoch_start_equals_the_tail_of_a_full_epoch() {
    let fx = synth(3, 6, 0);
    let p = fx.builder().batch_size(4).build().unwrap();
    let full = collect(&p, 3, 0, 0);
    assert_eq!(full.len(), 5);
    let tail = collect(&p, 3, 0, 2);
    assert_eq!(tail, full[2..].to_vec());
    assert!(collect(&p, 3, 0, 5).is_empty());
    assert!(matches!(
        p.epoch(3, 0, 6),
        Err(pipeline::PipelineError::StepOutOfRange { .. })
    ));
}

#[test]
fn unshuffled_order_is_file_order() {
    let fx = synth(2, 3, 0);
    let p = fx.builder().shuffle(false).batch_size(4).build().unwrap();
    let ids: Vec<u64> = collect(&p, 9, 0, 0)
        .into_iter()
        .flat_map(|s| s.ids)
        .collect();
    assert_eq!(ids, (0..6).collect::<Vec<u64>>());
    let labels: Vec<u32> = collect(&p, 9, 0, 0)
        .into_iter()
        .flat_map(|s| s.labels)
        .collect();
    assert_eq!(labels, vec![0, 0, 0, 1, 1, 1]);
}
