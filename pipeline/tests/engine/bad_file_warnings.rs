//! A dataset with many bad files logs a warning line for the first ones and one line for the
//! rest; the bad-files report still lists every one.
//!
//! The warnings are caught by a process-wide tracing subscriber, so the test runs in a process
//! of its own (a child of the test binary), where no other test logs.

use crate::common;

use common::{Catcher, WARNINGS};

#[test]
fn many_bad_files_log_twenty_lines_and_one_summary_and_the_report_lists_all() {
    common::in_own_process(
        "bad_file_warnings::many_bad_files_log_twenty_lines_and_one_summary_and_the_report_lists_all",
        caught_warnings,
    );
}

fn caught_warnings() {
    tracing::subscriber::set_global_default(Catcher).unwrap();
    let fx = common::synth(2, 5, 0);
    let mut classes: Vec<_> = std::fs::read_dir(fx.root().join("train"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    classes.sort();
    for i in 0..50 {
        std::fs::write(
            classes[i % 2].join(format!("junk{i:02}.png")),
            b"not an image at all",
        )
        .unwrap();
    }
    let report = fx.cache.path().join("bad.jsonl");
    let p = fx
        .builder()
        .batch_size(8)
        .bad_files_report(&report)
        .build()
        .unwrap();
    for epoch in 0..2 {
        let served: usize = p.epoch(epoch, 0, 0).unwrap().map(|b| b.unwrap().len).sum();
        assert_eq!(served, 10);
    }
    let warnings = WARNINGS.lock().unwrap().clone();
    let each = warnings
        .iter()
        .filter(|w| w.starts_with("skipping bad image"))
        .count();
    let summary: Vec<&String> = warnings
        .iter()
        .filter(|w| w.contains("without a line each"))
        .collect();
    assert_eq!(each, 20, "{warnings:#?}");
    assert_eq!(summary.len(), 1, "{warnings:#?}");
    assert!(
        summary[0].contains("split `train`") && summary[0].contains(&report.display().to_string()),
        "{}",
        summary[0]
    );
    let listed = std::fs::read_to_string(&report).unwrap();
    assert_eq!(listed.lines().count(), 50);
    assert_eq!(p.bad_files().len(), 50);
    drop(p);

    // Files found bad by the scan (zero bytes) share the limit with those found decoding.
    WARNINGS.lock().unwrap().clear();
    let fx = common::synth(2, 5, 0);
    let class = fx.root().join("train").join(
        std::fs::read_dir(fx.root().join("train"))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .file_name(),
    );
    for i in 0..25 {
        std::fs::write(class.join(format!("empty{i:02}.png")), b"").unwrap();
    }
    for i in 0..5 {
        std::fs::write(class.join(format!("junk{i:02}.png")), b"not an image").unwrap();
    }
    let p = fx.builder().batch_size(8).build().unwrap();
    let served: usize = p.epoch(0, 0, 0).unwrap().map(|b| b.unwrap().len).sum();
    assert_eq!(served, 10);
    let warnings = WARNINGS.lock().unwrap().clone();
    let count = |what: &str| warnings.iter().filter(|w| w.contains(what)).count();
    assert_eq!(count("skipping bad file "), 20, "{warnings:#?}");
    assert_eq!(count("skipping bad image "), 0, "{warnings:#?}");
    assert_eq!(count("without a line each"), 1, "{warnings:#?}");
    assert_eq!(p.bad_files().len(), 30);
}
