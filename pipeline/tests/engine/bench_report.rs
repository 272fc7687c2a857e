//! The pipeline benchmark: one report per epoch, the documented JSON shape, the cache at work.

use pipeline::bench::{run_pipeline_bench, EpochReport, PipelineBenchOptions};
use pipeline::synth::{write_dataset, SynthConfig};

#[test]
fn reports_every_epoch_and_decodes_only_in_the_first() {
    let data = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let mut cfg = SynthConfig::new(data.path());
    cfg.train_per_class = 5; // 4 classes → 20 images
    write_dataset(&cfg).unwrap();
    let mut opts = PipelineBenchOptions::new(data.path());
    opts.epochs = 3;
    opts.batch_size = 6;
    opts.image_size = 32;
    opts.workers = 2;
    opts.cache_dir = Some(cache.path().to_path_buf());
    let reports = run_pipeline_bench(&opts).unwrap();
    assert_eq!(reports.len(), 3);
    assert_eq!(
        reports.iter().map(|r| r.images).collect::<Vec<_>>(),
        vec![20, 20, 20]
    );
    assert_eq!(
        reports.iter().map(|r| r.decoded).collect::<Vec<_>>(),
        vec![20, 0, 0]
    );
    assert!(reports
        .iter()
        .all(|r| r.seconds > 0.0 && r.images_per_sec > 0.0));
}

#[test]
fn serialises_to_the_documented_json_line() {
    let r = EpochReport {
        epoch: 0,
        images: 400,
        decoded: 400,
        seconds: 0.71,
        images_per_sec: 563.4,
    };
    assert_eq!(
        serde_json::to_string(&r).unwrap(),
        r#"{"epoch":0,"images":400,"decoded":400,"seconds":0.71,"images_per_sec":563.4}"#
    );
}
