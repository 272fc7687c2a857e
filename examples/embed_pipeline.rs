//! Embedding birdtrain's input engine with no trainer: write a small synthetic dataset to a
//! temporary folder, build a pipeline over it, iterate two epochs and print the statistics.
//! The first epoch decodes every image and fills the cache; the second decodes nothing.
//!
//! Run: `cargo run --example embed_pipeline`

use pipeline::synth::{write_dataset, ImageFormatKind, SynthConfig};
use pipeline::{DatasetSource, LastBatch, PipelineBuilder, Split};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let data = tempfile::tempdir()?;
    let cache = tempfile::tempdir()?;
    let summary = write_dataset(&SynthConfig {
        out: data.path().to_path_buf(),
        classes: 4,
        train_per_class: 24,
        valid_per_class: 6,
        test_per_class: 0,
        width: 96,
        height: 72,
        format: ImageFormatKind::Jpg,
        seed: 1,
    })?;
    println!(
        "wrote {} training images of {} classes to {}",
        summary.files[0],
        summary.classes.len(),
        data.path().display()
    );

    let pipeline = PipelineBuilder::new(DatasetSource::folder(data.path()))
        .split(Split::Train)
        .image_size(64)
        .batch_size(16)
        .last_batch(LastBatch::Partial)
        .cache_dir(cache.path())
        .seed(7)
        .build()?;
    println!(
        "{} samples, {} classes, {} steps per epoch, cache {}",
        pipeline.len(),
        pipeline.classes().len(),
        pipeline.steps_per_epoch(),
        pipeline.cache_path().display()
    );

    for epoch in 0..2 {
        let before = pipeline.stats().decoded;
        let mut images = 0;
        let mut per_class = vec![0usize; pipeline.classes().len()];
        for batch in pipeline.epoch(epoch, 0, 0)? {
            let batch = batch?;
            // u8 NHWC RGB, ready to be copied to a device and normalised there.
            assert_eq!(batch.pixels().len(), batch.len * 64 * 64 * 3);
            for &label in batch.labels() {
                per_class[label as usize] += 1;
            }
            images += batch.len;
        }
        let stats = pipeline.stats();
        println!(
            "epoch {epoch}: {images} images ({per_class:?} per class), decoded {}, cache hits so far {}",
            stats.decoded - before,
            stats.cache_hits
        );
    }
    println!("{:#?}", pipeline.stats());
    Ok(())
}
