//! Counts larger than the machine or the dataset can serve are clear errors naming the
//! setting (or are served as far as the data goes), never a hang, an abort or an OOM kill.

use crate::common;

use common::{collect, synth};
use pipeline::{LastBatch, PipelineError, Split};

fn limit(e: PipelineError) -> (&'static str, String) {
    match e {
        PipelineError::Limit { name, .. } => (name, e.to_string()),
        other => panic!("expected a Limit error, got {other}"),
    }
}

#[test]
fn more_workers_than_the_machine_can_use_is_an_error() {
    let fx = synth(2, 3, 0);
    let max = pipeline::limits::max_workers();
    assert!(fx.builder().workers(max).build().is_ok());
    let (name, text) = limit(fx.builder().workers(100_000).build().unwrap_err());
    assert_eq!(name, "workers");
    assert!(
        text.contains("100000") && text.contains(&max.to_string()),
        "{text}"
    );
}

#[test]
fn more_training_replicas_than_images_is_an_error() {
    let fx = synth(2, 3, 1);
    let (name, text) = limit(fx.builder().replicas(100_000).build().unwrap_err());
    assert_eq!(name, "replicas");
    assert!(text.contains("6 images"), "{text}");
    // Evaluation leaves some replicas empty instead.
    let valid = fx
        .builder()
        .split(Split::Valid)
        .replicas(4)
        .build()
        .unwrap();
    assert_eq!(valid.len(), 2);
}

#[test]
fn a_huge_batch_is_served_as_one_batch_of_every_image() {
    let fx = synth(2, 3, 0);
    let p = fx.builder().batch_size(1_000_000_000).build().unwrap();
    let batches = collect(&p, 0, 0, 0);
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].labels.len(), 6);
}

#[test]
fn padded_batches_or_prefetch_beyond_memory_are_errors() {
    let fx = synth(2, 3, 0);
    let (name, text) = limit(
        fx.builder()
            .batch_size(1_000_000_000)
            .last_batch(LastBatch::Pad)
            .build()
            .unwrap_err(),
    );
    assert_eq!(name, "batch_size");
    assert!(text.contains("available memory"), "{text}");
    let (name, _) = limit(fx.builder().prefetch(usize::MAX / 4).build().unwrap_err());
    assert_eq!(name, "prefetch");
    let (name, text) = limit(
        fx.builder()
            .replicas(2)
            .batch_size(usize::MAX)
            .build()
            .unwrap_err(),
    );
    assert_eq!(name, "batch_size");
    assert!(text.contains("overflows"), "{text}");
}
