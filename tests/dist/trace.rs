//! The Chrome trace writer: JSON shape, thread safety, file output.

use std::thread;
use std::time::{Duration, Instant};

use birdtrain::trace::{Span, TraceRecorder, ENGINE_PID};
use serde_json::Value;

#[test]
fn spans_and_names_become_chrome_trace_events() {
    let trace = TraceRecorder::new();
    trace.name_process(0, "GPU 0");
    trace.name_thread(0, 1, "copy stream");
    trace.record(Span {
        name: "h2d 3".into(),
        category: "copy".into(),
        pid: 0,
        tid: 1,
        start: Duration::from_micros(1500),
        duration: Duration::from_nanos(2_250_500),
    });
    let json = trace.to_json();
    assert_eq!(json["displayTimeUnit"], "ms");
    let events = json["traceEvents"].as_array().unwrap();
    assert_eq!(events.len(), 3);
    assert_eq!(events[0]["ph"], "M");
    assert_eq!(events[0]["name"], "process_name");
    assert_eq!(events[0]["args"]["name"], "GPU 0");
    assert_eq!(events[1]["name"], "thread_name");
    assert_eq!(
        (events[1]["pid"].as_u64(), events[1]["tid"].as_u64()),
        (Some(0), Some(1))
    );
    let x = &events[2];
    assert_eq!(x["ph"], "X");
    assert_eq!(x["name"], "h2d 3");
    assert_eq!(x["cat"], "copy");
    assert_eq!(x["ts"].as_f64(), Some(1500.0));
    assert_eq!(x["dur"].as_f64(), Some(2250.5));
}

#[test]
fn threads_record_concurrently_and_guards_time_their_scope() {
    let trace = TraceRecorder::new();
    let workers: Vec<_> = (0..4u32)
        .map(|t| {
            let trace = trace.clone();
            thread::spawn(move || {
                for i in 0..50 {
                    let _g = trace.span(&format!("decode {i}"), "engine", ENGINE_PID, t);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let spans = trace.spans();
    assert_eq!(spans.len(), 200);
    for t in 0..4 {
        assert_eq!(spans.iter().filter(|s| s.tid == t).count(), 50);
    }
    // Within one thread the guards ran one after another, so their spans do not overlap.
    for t in 0..4 {
        let mine: Vec<_> = spans.iter().filter(|s| s.tid == t).collect();
        for pair in mine.windows(2) {
            assert!(
                pair[0].start + pair[0].duration <= pair[1].start,
                "{pair:?}"
            );
        }
    }
}

#[test]
fn save_writes_parseable_json_and_disabled_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    let trace = TraceRecorder::new();
    trace.record_since("step", "compute", 0, 0, Instant::now());
    trace.save(&path).unwrap();
    let parsed: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(parsed["traceEvents"].as_array().unwrap().len(), 1);
    assert!(!dir.path().join("trace.json.tmp").exists());

    let off = TraceRecorder::disabled();
    off.record_since("step", "compute", 0, 0, Instant::now());
    assert!(off.spans().is_empty());
    let other = dir.path().join("off.json");
    off.save(&other).unwrap();
    assert!(!other.exists());

    let err = trace
        .save(&dir.path().join("missing/dir/t.json"))
        .unwrap_err();
    assert!(err.to_string().contains("missing/dir"), "{err}");
}

#[test]
fn a_trace_path_that_cannot_be_written_is_refused_before_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    // A folder, a file in a missing folder: one error naming the path, nothing left behind.
    let folder = tmp.path().join("traces");
    std::fs::create_dir(&folder).unwrap();
    let missing = tmp.path().join("nowhere").join("trace.json");
    for path in [&folder, &missing] {
        let e = birdtrain::trace::check_destination(path).unwrap_err();
        assert!(e.to_string().contains(&path.display().to_string()), "{e}");
    }
    assert_eq!(std::fs::read_dir(&folder).unwrap().count(), 0);
    // The training command checks it before anything runs or is written.
    let mut cfg = birdtrain::train::TrainConfig::new(tmp.path().join("no-data"));
    cfg.out = tmp.path().join("run");
    cfg.dist.trace = Some(folder.clone());
    let e = birdtrain::train::train(&cfg, &std::sync::atomic::AtomicBool::new(false)).unwrap_err();
    assert!(e.to_string().contains("trace"), "{e}");
    assert!(!cfg.out.exists());
    // A writable path passes and leaves no file.
    let fine = tmp.path().join("trace.json");
    birdtrain::trace::check_destination(&fine).unwrap();
    assert!(!fine.exists() && !tmp.path().join("trace.json.tmp").exists());
}
