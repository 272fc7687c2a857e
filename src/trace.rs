//! A Chrome trace writer for `--trace trace.json` (opens in Perfetto and chrome://tracing).
//!
//! Spans are "complete" events (`"ph": "X"`) with a name, a category, a process id (one per GPU,
//! plus one for the input engine) and a thread id (a stream or a pipeline stage). Process and
//! thread names are metadata events (`"ph": "M"`), so the timeline reads "GPU 0 / copy stream"
//! rather than numbers. Times are microseconds since the trace was created.
//!
//! The recorder is cheap to clone and thread-safe (a mutex around a vector; spans are coarse:
//! per batch, per bucket, per stage). A disabled recorder drops everything, so call sites need
//! no `if`.

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Errors writing a trace.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The trace file could not be written.
    #[error("cannot write trace file {path}: {source} (check that the directory exists and is writable)")]
    Write {
        /// The file.
        path: std::path::PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Serialising to a writer failed.
    #[error("cannot serialise the trace: {0}")]
    Serialise(#[from] serde_json::Error),
}

/// The process id used for the input engine's stages (GPUs use their ordinal).
pub const ENGINE_PID: u32 = 1000;

/// One recorded span.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// What ran ("h2d 17", "all-reduce bucket 3", "decode").
    pub name: String,
    /// Category ("copy", "compute", "comm", "wait", "engine").
    pub category: String,
    /// Process: GPU ordinal, or [`ENGINE_PID`].
    pub pid: u32,
    /// Thread: stream or stage id within the process.
    pub tid: u32,
    /// Start, relative to the trace origin.
    pub start: Duration,
    /// Length.
    pub duration: Duration,
}

#[derive(Debug, Default)]
struct State {
    spans: Vec<Span>,
    process_names: Vec<(u32, String)>,
    thread_names: Vec<(u32, u32, String)>,
}

/// A thread-safe span recorder. Clones share the same trace.
#[derive(Debug, Clone)]
pub struct TraceRecorder {
    inner: Option<Arc<(Instant, Mutex<State>)>>,
}

impl TraceRecorder {
    /// A recorder whose origin (time 0) is now.
    pub fn new() -> Self {
        TraceRecorder {
            inner: Some(Arc::new((Instant::now(), Mutex::new(State::default())))),
        }
    }

    /// A recorder that drops everything (no `--trace`).
    pub fn disabled() -> Self {
        TraceRecorder { inner: None }
    }

    /// True unless [`TraceRecorder::disabled`].
    pub fn is_enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// The trace origin (None when disabled).
    pub fn origin(&self) -> Option<Instant> {
        self.inner.as_ref().map(|i| i.0)
    }

    fn with_state(&self, f: impl FnOnce(&mut State)) {
        if let Some(inner) = &self.inner {
            // A panic while holding the lock only loses trace data; keep recording.
            let mut state = inner.1.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut state);
        }
    }

    /// Names a process row ("GPU 0", "input engine").
    pub fn name_process(&self, pid: u32, name: &str) {
        self.with_state(|s| s.process_names.push((pid, name.to_string())));
    }

    /// Names a thread row within a process ("copy stream", "decode").
    pub fn name_thread(&self, pid: u32, tid: u32, name: &str) {
        self.with_state(|s| s.thread_names.push((pid, tid, name.to_string())));
    }

    /// Records a span with explicit times (GPU spans measured with events come this way).
    pub fn record(&self, span: Span) {
        self.with_state(|s| s.spans.push(span));
    }

    /// Records a span from `start` until now (host-side work).
    pub fn record_since(&self, name: &str, category: &str, pid: u32, tid: u32, start: Instant) {
        if let Some(origin) = self.origin() {
            let now = Instant::now();
            self.record(Span {
                name: name.to_string(),
                category: category.to_string(),
                pid,
                tid,
                start: start.saturating_duration_since(origin),
                duration: now.saturating_duration_since(start),
            });
        }
    }

    /// Starts a span that is recorded when the guard drops.
    pub fn span(&self, name: &str, category: &str, pid: u32, tid: u32) -> SpanGuard {
        SpanGuard {
            recorder: self.clone(),
            name: name.to_string(),
            category: category.to_string(),
            pid,
            tid,
            start: Instant::now(),
        }
    }

    /// The spans recorded so far, in recording order.
    pub fn spans(&self) -> Vec<Span> {
        let mut out = Vec::new();
        self.with_state(|s| out = s.spans.clone());
        out
    }

    /// The trace as a Chrome trace JSON object (`{"traceEvents": [...], ...}`).
    pub fn to_json(&self) -> Value {
        let mut events = Vec::new();
        self.with_state(|s| {
            for (pid, name) in &s.process_names {
                events.push(
                    json!({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                                   "args": {"name": name}}),
                );
            }
            for (pid, tid, name) in &s.thread_names {
                events.push(
                    json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                                   "args": {"name": name}}),
                );
            }
            for span in &s.spans {
                events.push(json!({
                    "name": span.name,
                    "cat": span.category,
                    "ph": "X",
                    "pid": span.pid,
                    "tid": span.tid,
                    "ts": micros(span.start),
                    "dur": micros(span.duration),
                }));
            }
        });
        json!({"traceEvents": events, "displayTimeUnit": "ms"})
    }

    /// Writes the trace JSON to `writer`.
    pub fn write_to(&self, writer: impl Write) -> Result<(), TraceError> {
        serde_json::to_writer(writer, &self.to_json())?;
        Ok(())
    }

    /// Writes the trace to `path` (through a temporary file and a rename, so a crash never
    /// leaves half a trace). A disabled recorder writes nothing.
    pub fn save(&self, path: &Path) -> Result<(), TraceError> {
        if !self.is_enabled() {
            return Ok(());
        }
        let err = |source| TraceError::Write {
            path: path.to_path_buf(),
            source,
        };
        let tmp = temp_path(path);
        let file = std::fs::File::create(&tmp).map_err(err)?;
        let mut writer = std::io::BufWriter::new(file);
        self.write_to(&mut writer)?;
        writer.flush().map_err(err)?;
        drop(writer);
        std::fs::rename(&tmp, path).map_err(err)
    }
}

/// Checks, before a run, that [`TraceRecorder::save`] will be able to write `path`: it is no
/// folder, and its temporary file can be created (and is removed again) beside it. A bad
/// `--trace` is then one line at the start, not after the whole run.
pub fn check_destination(path: &Path) -> Result<(), TraceError> {
    let err = |source| TraceError::Write {
        path: path.to_path_buf(),
        source,
    };
    if path.is_dir() {
        return Err(err(std::io::Error::new(
            std::io::ErrorKind::IsADirectory,
            "it is a folder; name a file such as trace.json",
        )));
    }
    let tmp = temp_path(path);
    std::fs::File::create(&tmp).map_err(err)?;
    std::fs::remove_file(&tmp).map_err(err)
}

/// The file a trace is written to before it is renamed into place.
fn temp_path(path: &Path) -> std::path::PathBuf {
    path.with_extension("json.tmp")
}

impl Default for TraceRecorder {
    fn default() -> Self {
        Self::new()
    }
}

/// Microseconds with sub-microsecond precision (Chrome trace times are µs, fractions allowed).
fn micros(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1000.0
}

/// Records its span when dropped.
#[derive(Debug)]
pub struct SpanGuard {
    recorder: TraceRecorder,
    name: String,
    category: String,
    pid: u32,
    tid: u32,
    start: Instant,
}

impl Drop for SpanGuard {
    fn drop(&mut self) {
        self.recorder
            .record_since(&self.name, &self.category, self.pid, self.tid, self.start);
    }
}
