//! The engine's errors as Python exceptions: bad settings are `ValueError`, a bad image under
//! `on_bad_image="fail"` is `birdtrain.BadImageError`, the rest `birdtrain.LoaderError`.

use pipeline::{BadFileKind, PipelineError};
use pyo3::create_exception;
use pyo3::exceptions::{PyFileNotFoundError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

create_exception!(
    _engine,
    LoaderError,
    PyRuntimeError,
    "The input engine failed (the message says why and what to do)."
);
create_exception!(
    _engine,
    BadImageError,
    LoaderError,
    "A bad image file met with on_bad_image=\"fail\"; `.path` is the file."
);

/// Adds the exception types to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("LoaderError", py.get_type::<LoaderError>())?;
    m.add("BadImageError", py.get_type::<BadImageError>())?;
    Ok(())
}

/// A bad file's kind as one word (the bad-files report's spelling).
pub(crate) fn kind_word(kind: BadFileKind) -> String {
    let mut word = String::new();
    for (i, c) in format!("{kind:?}").chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            word.push('-');
        }
        word.push(c.to_ascii_lowercase());
    }
    word
}

/// The Python exception for an engine error, its message the engine's (with its source).
pub(crate) fn to_py(error: PipelineError) -> PyErr {
    let mut message = error.to_string();
    let mut source = std::error::Error::source(&error);
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    match &error {
        PipelineError::InvalidSetting { .. } | PipelineError::Limit { .. } => {
            PyValueError::new_err(message)
        }
        PipelineError::MissingDir { .. } => PyFileNotFoundError::new_err(message),
        PipelineError::BadImage { path, .. } => Python::with_gil(|py| {
            let err = BadImageError::new_err(message);
            let _ = err.value(py).setattr("path", path.clone());
            err
        }),
        _ => LoaderError::new_err(message),
    }
}
