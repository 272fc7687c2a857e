//! Memory planning on the GPU (`#[ignore]`d; `cargo test --release --test gpu -- --ignored cuda_memory::`).

use birdtrain::backend::BackendError;
use birdtrain::cuda::memory::{auto_batch_size, estimate, measure};
use birdtrain::cuda::CudaBackend;
use birdtrain::model::{Arch, Graph, ModelError, Network};

#[test]
#[ignore = "needs a CUDA GPU"]
fn measured_footprint_is_close_to_the_estimate_and_auto_fits() {
    let backend = CudaBackend::new(0).unwrap();
    let graph = Graph::new(Arch::ResNet18, 285);
    let measured = measure(&backend, &graph, 128).unwrap();
    let estimated = estimate(&graph, 128);
    let ratio = measured.per_image_bytes as f64 / estimated.per_image_bytes as f64;
    // The allocator rounds up (2 MiB pages); the estimate must be the right size, not exact.
    assert!(
        (0.7..1.6).contains(&ratio),
        "measured {measured:?} vs estimated {estimated:?}"
    );
    let (batch, _) = auto_batch_size(&backend, &graph, 128, 1).unwrap();
    assert!(batch >= 8, "auto batch {batch}");
    // The picked batch really fits: build it and run a step.
    let mut net = Network::new(backend.clone(), &graph, batch, 128).unwrap();
    let pixels = vec![7u8; batch * 128 * 128 * 3];
    let labels = vec![1u32; batch];
    net.train_step(&birdtrain::model::InputBatch {
        pixels: &pixels,
        labels: &labels,
        len: batch,
        image_size: 128,
        augment: None,
        mix: None,
    })
    .unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn out_of_memory_is_an_error_not_a_crash() {
    let backend = CudaBackend::new(0).unwrap();
    let graph = Graph::new(Arch::ResNet50, 285);
    // ~100 MiB per image: 100k images cannot fit any GPU of today.
    let err = Network::new(backend, &graph, 100_000, 224).unwrap_err();
    match err {
        ModelError::Backend(BackendError::OutOfMemory { hint, .. }) => {
            assert!(hint.contains("--batch-size"), "{hint}")
        }
        other => panic!("expected an out-of-memory error, got {other}"),
    }
}
