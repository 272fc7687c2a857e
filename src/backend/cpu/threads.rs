//! Starting a rayon pool whose threads the OS may refuse: each thread is started through
//! [`pipeline::threads::spawn`], so a refusal is the [`ThreadStartError`] that names the
//! thread and the limit, never rayon's bare OS error or its panic.

use std::sync::{Arc, Mutex};

use pipeline::threads::ThreadStartError;

use super::BackendError;

/// A pool of `threads` threads named `<name>-<i>`.
pub(crate) fn start_pool(
    threads: usize,
    name: &'static str,
) -> Result<rayon::ThreadPool, BackendError> {
    let refused: Arc<Mutex<Option<ThreadStartError>>> = Arc::default();
    let slot = Arc::clone(&refused);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |i| format!("{name}-{i}"))
        .spawn_handler(move |thread| {
            let thread_name = thread.name().unwrap_or(name).to_string();
            match pipeline::threads::spawn(thread_name, move || thread.run()) {
                Ok(_) => Ok(()),
                Err(e) => {
                    let io = std::io::Error::new(e.source.kind(), e.to_string());
                    *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    Err(io)
                }
            }
        })
        .build()
        .map_err(
            |e| match refused.lock().unwrap_or_else(|p| p.into_inner()).take() {
                Some(refusal) => BackendError::Thread(refusal),
                None => BackendError::Device {
                    op: "start the CPU thread pool",
                    source: Box::new(e),
                },
            },
        )
}
