//! Starting an OS thread as a resource that can run out.
//!
//! `std::thread::spawn` and `Scope::spawn` panic when the OS refuses a thread (a `ulimit -u`,
//! an address-space limit too small for one more stack, a container's pids limit). Every
//! thread birdtrain starts goes through [`spawn`] or [`spawn_scoped`] instead (thread pools
//! through their spawn handlers, which call [`spawn`]), so a refused thread is a
//! [`ThreadStartError`] that names the thread and says what limit was hit: one error line
//! with a hint, never a panic.
//!
//! Test hook: `BIRDTRAIN_FAULT=thread:<name>[@<n>]` makes the n-th start (the first when `@n`
//! is absent) of a thread whose name begins with `<name>` fail as the OS would (EAGAIN), so
//! the tests reach every place a thread is started. The variable is read once; without it
//! (or with another fault) the hook does nothing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::thread::{JoinHandle, Scope, ScopedJoinHandle};

/// The environment variable of birdtrain's fault hooks (this one: `thread:<name>[@<n>]`).
pub const FAULT_ENV: &str = "BIRDTRAIN_FAULT";

/// A thread the OS would not start.
#[derive(Debug, thiserror::Error)]
#[error("could not start thread `{thread}` ({source}): the process hit a limit on threads or memory (ulimit -u or -v, a container's pids or memory limit) (hint: fewer --workers, --threads or --replicas, or raise the limit)")]
pub struct ThreadStartError {
    /// The thread's name.
    pub thread: String,
    /// The OS's answer.
    #[source]
    pub source: std::io::Error,
}

impl From<ThreadStartError> for std::io::Error {
    /// The OS error, its message carrying the thread's name and the hint (for APIs that take
    /// an `io::Error`, such as a thread pool's spawn handler).
    fn from(e: ThreadStartError) -> Self {
        std::io::Error::new(e.source.kind(), e.to_string())
    }
}

/// Starts a thread named `name` running `f`; a refusal of the OS is an error, not a panic.
pub fn spawn<F, T>(name: impl Into<String>, f: F) -> Result<JoinHandle<T>, ThreadStartError>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let name = name.into();
    injected(&name)?;
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(f)
        .map_err(|source| ThreadStartError {
            thread: name,
            source,
        })
}

/// [`spawn`] in `scope` (the thread may borrow from the caller's stack).
pub fn spawn_scoped<'scope, 'env, F, T>(
    scope: &'scope Scope<'scope, 'env>,
    name: impl Into<String>,
    f: F,
) -> Result<ScopedJoinHandle<'scope, T>, ThreadStartError>
where
    F: FnOnce() -> T + Send + 'scope,
    T: Send + 'scope,
{
    let name = name.into();
    injected(&name)?;
    std::thread::Builder::new()
        .name(name.clone())
        .spawn_scoped(scope, f)
        .map_err(|source| ThreadStartError {
            thread: name,
            source,
        })
}

/// The armed fault: a thread-name prefix and which of its starts fails.
#[derive(Debug, Clone, PartialEq)]
struct Fault {
    prefix: String,
    nth: u64,
}

fn parse(spec: &str) -> Option<Fault> {
    let rest = spec.strip_prefix("thread:")?;
    let (prefix, nth) = match rest.rsplit_once('@') {
        Some((prefix, n)) => (prefix, n.parse().ok().filter(|n| *n >= 1)?),
        None => (rest, 1),
    };
    (!prefix.is_empty()).then(|| Fault {
        prefix: prefix.to_string(),
        nth,
    })
}

fn armed() -> Option<&'static Fault> {
    static FAULT: OnceLock<Option<Fault>> = OnceLock::new();
    FAULT
        .get_or_init(|| std::env::var(FAULT_ENV).ok().and_then(|s| parse(&s)))
        .as_ref()
}

/// Starts of threads the armed fault matches, so far.
static MATCHED: AtomicU64 = AtomicU64::new(0);

/// The OS's refusal, when the armed fault says this start of `name` fails.
fn injected(name: &str) -> Result<(), ThreadStartError> {
    let Some(fault) = armed() else {
        return Ok(());
    };
    if !name.starts_with(&fault.prefix) {
        return Ok(());
    }
    if MATCHED.fetch_add(1, Ordering::SeqCst) + 1 != fault.nth {
        return Ok(());
    }
    Err(ThreadStartError {
        thread: name.to_string(),
        source: std::io::Error::from_raw_os_error(libc::EAGAIN),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fault_names_a_prefix_and_a_count() {
        assert_eq!(
            parse("thread:rank-1"),
            Some(Fault {
                prefix: "rank-1".into(),
                nth: 1
            })
        );
        assert_eq!(
            parse("thread:pipeline-decode@3"),
            Some(Fault {
                prefix: "pipeline-decode".into(),
                nth: 3
            })
        );
        assert_eq!(parse("thread:"), None);
        assert_eq!(parse("thread:x@0"), None);
        assert_eq!(parse("checkpoint:sidecar"), None);
        assert_eq!(parse("panic"), None);
    }

    #[test]
    fn a_refused_thread_names_itself_the_limit_and_the_flags() {
        let e = ThreadStartError {
            thread: "rank-1".into(),
            source: std::io::Error::from_raw_os_error(libc::EAGAIN),
        };
        let text = e.to_string();
        for needle in [
            "`rank-1`",
            "os error 11",
            "ulimit",
            "pids",
            "hint",
            "--workers",
        ] {
            assert!(text.contains(needle), "{needle}: {text}");
        }
        let io: std::io::Error = e.into();
        assert_eq!(io.kind(), std::io::ErrorKind::WouldBlock);
        assert!(io.to_string().contains("`rank-1`"));
    }

    #[test]
    fn threads_start_and_scoped_ones_borrow() {
        assert_eq!(spawn("t", || 7).unwrap().join().unwrap(), 7);
        let v = [1, 2, 3];
        let sum = std::thread::scope(|s| {
            spawn_scoped(s, "s", || v.iter().sum::<i32>())
                .unwrap()
                .join()
                .unwrap()
        });
        assert_eq!(sum, 6);
    }
}
