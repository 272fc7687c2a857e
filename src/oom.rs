//! Running out of memory as one error line, not an abort.
//!
//! When an allocation fails, Rust's default handler prints "memory allocation of N bytes
//! failed" and aborts (exit 134, a core dump where enabled); stable Rust has no hook to change
//! that. [`ExitOnOom`] is a global allocator over the system's that, where no caller is ready
//! for a failure, writes one `error:` line with a hint to stderr and exits with code 1 instead:
//! what a run leaves behind is then what kill -9 leaves, its last checkpoint whole. The few
//! allocations that can fail gracefully (the backends' tensors and optimizer state, which
//! name what did not fit) run inside [`fallible`], where a failure is returned to the caller
//! as usual.
//!
//! The binary installs it (`src/main.rs`); a program that embeds the library keeps its own
//! allocator, and [`fallible`] then changes nothing.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    /// Inside [`fallible`] on this thread: a failed allocation returns null.
    static FALLIBLE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with allocation failures returned to it (null, which `try_reserve` reports as an
/// error) instead of ending the process. Nested calls keep the outer setting afterwards.
pub fn fallible<T>(f: impl FnOnce() -> T) -> T {
    let before = FALLIBLE.with(|c| c.replace(true));
    let out = f();
    FALLIBLE.with(|c| c.set(before));
    out
}

/// The system allocator, ending the process with one line when an allocation outside
/// [`fallible`] fails.
pub struct ExitOnOom;

// SAFETY: every call is forwarded to `System` unchanged; only a null result outside
// `fallible` is turned into a process exit, which returns nothing to the caller.
unsafe impl GlobalAlloc for ExitOnOom {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is System's.
        checked(unsafe { System.alloc(layout) }, layout.size())
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as above.
        checked(unsafe { System.alloc_zeroed(layout) }, layout.size())
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as above.
        checked(unsafe { System.realloc(ptr, layout, new_size) }, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// `ptr`, unless it is null outside [`fallible`]: then the line and exit code 1.
fn checked(ptr: *mut u8, size: usize) -> *mut u8 {
    if ptr.is_null() && !FALLIBLE.with(Cell::get) {
        exit_out_of_memory(size);
    }
    ptr
}

/// Whether a thread is already writing the out-of-memory line and ending the process.
static ENDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Writes the out-of-memory line with raw writes (no allocation can succeed now) and exits
/// without running destructors or flushing buffers that may need memory. Threads whose
/// allocations fail at the same moment wait for the first one's exit: one line, not one per
/// thread.
fn exit_out_of_memory(size: usize) -> ! {
    if ENDING.swap(true, std::sync::atomic::Ordering::SeqCst) {
        loop {
            // SAFETY: pause(2) only waits for a signal; the first thread's _exit ends this one.
            unsafe {
                libc::pause();
            }
        }
    }
    let mut line = [0u8; 512];
    let mut len = 0;
    let mut put = |bytes: &[u8]| {
        let n = bytes.len().min(line.len() - len);
        line[len..len + n].copy_from_slice(&bytes[..n]);
        len += n;
    };
    put(b"\nerror: out of memory: an allocation of ");
    put(decimal(size, &mut [0u8; 20]));
    put(
        b" bytes failed (hint: a smaller --batch-size, --image-size or model, fewer --workers, \
          or more memory: see `ulimit -v` and the container's memory limit)\n",
    );
    // SAFETY: writing a stack buffer to stderr, then ending the process; nothing is shared.
    unsafe {
        libc::write(2, line.as_ptr().cast(), len);
        libc::_exit(1)
    }
}

/// `n` in decimal, in `buf`.
fn decimal(mut n: usize, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[at..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_without_allocating() {
        assert_eq!(decimal(0, &mut [0; 20]), b"0");
        assert_eq!(decimal(2_359_296, &mut [0; 20]), b"2359296");
        assert_eq!(
            decimal(usize::MAX, &mut [0; 20]),
            usize::MAX.to_string().as_bytes()
        );
    }

    #[test]
    fn fallible_sets_the_flag_for_its_closure_only() {
        assert!(!FALLIBLE.with(Cell::get));
        fallible(|| {
            assert!(FALLIBLE.with(Cell::get));
            fallible(|| ());
            assert!(FALLIBLE.with(Cell::get));
        });
        assert!(!FALLIBLE.with(Cell::get));
    }
}
