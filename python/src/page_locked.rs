//! Page-locked batch buffers (`pin_memory=True` where torch has CUDA): the engine's pool
//! allocates page-aligned buffers and registers each once with the CUDA driver
//! (`cuMemHostRegister`, portable, so every context counts it as pinned), unregistering it when
//! the buffer is freed. Batches are then written once by the decode threads and DMA'd by an H2D
//! copy straight from the engine's buffer, with no staging copy.
//!
//! The driver's functions come as addresses from the Python side (ctypes resolves them in the
//! `libcuda.so.1` torch loaded), so this crate links nothing of CUDA and the engine works the
//! same without it: without a `PageLocker` the pool keeps the engine's ordinary allocator.

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use pipeline::{BatchAllocator, HostBuffer, PipelineError};

/// Alignment and size granule of a buffer: whole pages, so no two registrations share a page.
const PAGE: usize = 4096;
/// `CU_MEMHOSTREGISTER_PORTABLE`: pinned for every CUDA context, not only the current one.
const PORTABLE: u32 = 1;
/// `CUDA_SUCCESS`.
const SUCCESS: i32 = 0;

type Init = unsafe extern "C" fn(u32) -> i32;
type DeviceGet = unsafe extern "C" fn(*mut i32, i32) -> i32;
type PrimaryRetain = unsafe extern "C" fn(*mut *mut c_void, i32) -> i32;
type PrimaryRelease = unsafe extern "C" fn(i32) -> i32;
type CtxPush = unsafe extern "C" fn(*mut c_void) -> i32;
type CtxPop = unsafe extern "C" fn(*mut *mut c_void) -> i32;
type HostRegister = unsafe extern "C" fn(*mut c_void, usize, u32) -> i32;
type HostUnregister = unsafe extern "C" fn(*mut c_void) -> i32;

/// The driver functions used, by the names the Python side resolves.
pub(crate) const DRIVER_FUNCTIONS: [&str; 8] = [
    "cuInit",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
];

/// The driver's functions, typed.
#[derive(Clone, Copy)]
pub(crate) struct Driver {
    init: Init,
    device_get: DeviceGet,
    primary_retain: PrimaryRetain,
    primary_release: PrimaryRelease,
    push: CtxPush,
    pop: CtxPop,
    register: HostRegister,
    unregister: HostUnregister,
}

impl Driver {
    /// The functions at `addresses` (name → address, every name of [`DRIVER_FUNCTIONS`]).
    ///
    /// # Safety
    /// Each address must be the CUDA driver function of that name, loaded for the life of the
    /// process.
    pub(crate) unsafe fn from_addresses(
        addresses: &HashMap<String, usize>,
    ) -> Result<Self, String> {
        let at = |name: &str| -> Result<*const c_void, String> {
            match addresses.get(name) {
                Some(&a) if a != 0 => Ok(a as *const c_void),
                _ => Err(format!("no address for the CUDA driver function {name}")),
            }
        };
        // SAFETY: the caller vouches that each address is the function of that name, whose C
        // signature the type spells.
        unsafe {
            Ok(Self {
                init: std::mem::transmute::<*const c_void, Init>(at("cuInit")?),
                device_get: std::mem::transmute::<*const c_void, DeviceGet>(at("cuDeviceGet")?),
                primary_retain: std::mem::transmute::<*const c_void, PrimaryRetain>(at(
                    "cuDevicePrimaryCtxRetain",
                )?),
                primary_release: std::mem::transmute::<*const c_void, PrimaryRelease>(at(
                    "cuDevicePrimaryCtxRelease_v2",
                )?),
                push: std::mem::transmute::<*const c_void, CtxPush>(at("cuCtxPushCurrent_v2")?),
                pop: std::mem::transmute::<*const c_void, CtxPop>(at("cuCtxPopCurrent_v2")?),
                register: std::mem::transmute::<*const c_void, HostRegister>(at(
                    "cuMemHostRegister_v2",
                )?),
                unregister: std::mem::transmute::<*const c_void, HostUnregister>(at(
                    "cuMemHostUnregister",
                )?),
            })
        }
    }
}

/// Registers and unregisters host memory in one GPU's primary context (the one torch uses),
/// retained for as long as a registered buffer lives.
pub(crate) struct PageLocker {
    driver: Driver,
    device: i32,
    context: *mut c_void,
    locked: AtomicUsize,
    failures: AtomicUsize,
    first_failure: Mutex<Option<String>>,
}

// SAFETY: the context handle is only passed to the driver, whose calls are thread-safe.
unsafe impl Send for PageLocker {}
// SAFETY: as above; the counters are atomics and the message sits behind a mutex.
unsafe impl Sync for PageLocker {}

impl PageLocker {
    /// Retains GPU `ordinal`'s primary context (creating it if torch has not yet).
    pub(crate) fn new(driver: Driver, ordinal: i32) -> Result<Self, String> {
        let mut device = 0;
        let mut context = std::ptr::null_mut();
        // SAFETY: the driver's functions with valid out-pointers.
        unsafe {
            check("cuInit", (driver.init)(0))?;
            check("cuDeviceGet", (driver.device_get)(&mut device, ordinal))?;
            check(
                "cuDevicePrimaryCtxRetain",
                (driver.primary_retain)(&mut context, device),
            )?;
        }
        Ok(Self {
            driver,
            device,
            context,
            locked: AtomicUsize::new(0),
            failures: AtomicUsize::new(0),
            first_failure: Mutex::new(None),
        })
    }

    /// Runs `call` with the retained context current on this thread.
    fn in_context(&self, what: &str, call: impl FnOnce() -> i32) -> Result<(), String> {
        // SAFETY: pushing a retained context, popping it after the call.
        unsafe {
            check("cuCtxPushCurrent", (self.driver.push)(self.context))?;
            let result = check(what, call());
            let mut popped = std::ptr::null_mut();
            (self.driver.pop)(&mut popped);
            result
        }
    }

    /// Page-locks `len` bytes at `data`; a refusal is counted and remembered, not an error:
    /// the buffer then serves as ordinary memory.
    fn lock(&self, data: *mut u8, len: usize) -> bool {
        // SAFETY: the range is a live allocation of ours.
        let result = self.in_context("cuMemHostRegister", || unsafe {
            (self.driver.register)(data.cast(), len, PORTABLE)
        });
        match result {
            Ok(()) => {
                self.locked.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(message) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                let mut first = self.first_failure.lock().unwrap_or_else(|e| e.into_inner());
                first.get_or_insert(message);
                false
            }
        }
    }

    fn unlock(&self, data: *mut u8) {
        // An error here (the driver shut down at exit) leaves nothing to undo.
        // SAFETY: `data` was registered by `lock`.
        let _ = self.in_context("cuMemHostUnregister", || unsafe {
            (self.driver.unregister)(data.cast())
        });
        self.locked.fetch_sub(1, Ordering::Relaxed);
    }

    /// Buffers page-locked now, buffers that could not be, and the first refusal's message.
    pub(crate) fn report(&self) -> (usize, usize, Option<String>) {
        let first = self.first_failure.lock().unwrap_or_else(|e| e.into_inner());
        (
            self.locked.load(Ordering::Relaxed),
            self.failures.load(Ordering::Relaxed),
            first.clone(),
        )
    }
}

impl Drop for PageLocker {
    fn drop(&mut self) {
        // SAFETY: releases the retain of `new`; every buffer holding this locker is gone.
        unsafe { (self.driver.primary_release)(self.device) };
    }
}

fn check(what: &str, code: i32) -> Result<(), String> {
    if code == SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed with CUDA error {code}"))
    }
}

/// The pool's allocator when buffers are page-locked.
pub(crate) struct PageLockedAllocator {
    pub(crate) locker: Arc<PageLocker>,
}

impl BatchAllocator for PageLockedAllocator {
    fn allocate(&self, pixel_bytes: usize) -> Result<Box<dyn HostBuffer>, PipelineError> {
        let mut buffer = PageBuffer::zeroed(pixel_bytes)?;
        if self.locker.lock(buffer.data.as_ptr(), buffer.size) {
            buffer.locker = Some(Arc::clone(&self.locker));
        }
        Ok(Box::new(buffer))
    }
}

/// A zeroed, page-aligned buffer of whole pages, page-locked while `locker` is set.
struct PageBuffer {
    data: NonNull<u8>,
    len: usize,
    /// The mapping's size: `len` rounded up to whole pages.
    size: usize,
    locker: Option<Arc<PageLocker>>,
}

// SAFETY: the buffer owns its mapping; the locker is Send + Sync.
unsafe impl Send for PageBuffer {}

impl PageBuffer {
    /// An anonymous private mapping: page-aligned and zero without a memset (the kernel hands
    /// out zero pages on first touch or when the driver locks them; a memset over a buffer
    /// the decode threads overwrite anyway cost ~3 % of a first epoch).
    fn zeroed(len: usize) -> Result<Self, PipelineError> {
        let size = len.max(1).div_ceil(PAGE) * PAGE;
        // SAFETY: a fresh anonymous mapping that aliases nothing; checked for failure below.
        let data = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if data == libc::MAP_FAILED {
            return Err(PipelineError::Allocator {
                message: format!(
                    "cannot allocate a page-aligned batch buffer of {}",
                    pipeline::limits::human_bytes(len as u64)
                ),
                source: Some(Box::new(std::io::Error::last_os_error())),
            });
        }
        Ok(Self {
            data: NonNull::new(data.cast::<u8>()).expect("mmap never maps address 0"),
            len,
            size,
            locker: None,
        })
    }
}

impl HostBuffer for PageBuffer {
    fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` ≤ the allocation's size, initialised (zeroed) at allocation.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr(), self.len) }
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.data.as_ptr(), self.len) }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for PageBuffer {
    fn drop(&mut self) {
        if let Some(locker) = self.locker.take() {
            locker.unlock(self.data.as_ptr());
        }
        // SAFETY: mapped in `zeroed` with this size; nothing refers to it any more.
        unsafe { libc::munmap(self.data.as_ptr().cast(), self.size) };
    }
}

#[cfg(test)]
mod tests {
    //! The allocator against a stand-in driver that records its calls.

    use super::*;
    use std::sync::atomic::AtomicBool;

    static CALLS: Mutex<Vec<String>> = Mutex::new(Vec::new());
    static REFUSE: AtomicBool = AtomicBool::new(false);
    static CONTEXT: u8 = 0;

    fn log(call: String) -> i32 {
        CALLS.lock().unwrap().push(call);
        0
    }
    unsafe extern "C" fn init(_: u32) -> i32 {
        0
    }
    unsafe extern "C" fn device_get(device: *mut i32, ordinal: i32) -> i32 {
        unsafe { *device = ordinal + 10 };
        0
    }
    unsafe extern "C" fn retain(context: *mut *mut c_void, device: i32) -> i32 {
        unsafe { *context = std::ptr::addr_of!(CONTEXT).cast_mut().cast() };
        log(format!("retain {device}"))
    }
    unsafe extern "C" fn release(device: i32) -> i32 {
        log(format!("release {device}"))
    }
    unsafe extern "C" fn push(context: *mut c_void) -> i32 {
        assert_eq!(context.cast_const(), std::ptr::addr_of!(CONTEXT).cast());
        0
    }
    unsafe extern "C" fn pop(_: *mut *mut c_void) -> i32 {
        0
    }
    unsafe extern "C" fn register(data: *mut c_void, len: usize, flags: u32) -> i32 {
        if REFUSE.load(Ordering::SeqCst) {
            return 2;
        }
        assert_eq!(data as usize % PAGE, 0, "page-aligned");
        log(format!("register {data:p} {len} {flags}"))
    }
    unsafe extern "C" fn unregister(data: *mut c_void) -> i32 {
        log(format!("unregister {data:p}"))
    }

    fn fake_driver() -> Driver {
        Driver {
            init,
            device_get,
            primary_retain: retain,
            primary_release: release,
            push,
            pop,
            register,
            unregister,
        }
    }

    /// One test runs the whole sequence: the stand-in's log and switch are shared statics.
    #[test]
    fn each_buffer_is_registered_once_and_unregistered_when_freed_then_the_context_released() {
        let locker = Arc::new(PageLocker::new(fake_driver(), 1).unwrap());
        let allocator = PageLockedAllocator {
            locker: Arc::clone(&locker),
        };
        let mut buffer = allocator.allocate(5000).unwrap();
        assert_eq!(buffer.as_slice().len(), 5000);
        assert!(buffer.as_slice().iter().all(|&b| b == 0));
        buffer.as_mut_slice()[4999] = 7;
        let data = buffer.as_slice().as_ptr();
        assert_eq!(locker.report(), (1, 0, None));
        drop(buffer);
        assert_eq!(locker.report().0, 0);

        REFUSE.store(true, Ordering::SeqCst);
        let unlocked = allocator.allocate(100).unwrap();
        REFUSE.store(false, Ordering::SeqCst);
        let (locked, failures, message) = locker.report();
        assert_eq!((locked, failures), (0, 1));
        assert!(message
            .unwrap()
            .contains("cuMemHostRegister failed with CUDA error 2"));
        drop(unlocked);
        drop(allocator);
        drop(locker);
        let calls = CALLS.lock().unwrap().clone();
        assert_eq!(
            calls,
            vec![
                "retain 11".to_string(),
                format!("register {data:p} 8192 1"),
                format!("unregister {data:p}"),
                "release 11".to_string(),
            ]
        );
    }

    #[test]
    fn a_missing_address_is_named() {
        let addresses = HashMap::from([("cuInit".to_string(), 1usize)]);
        let error = unsafe { Driver::from_addresses(&addresses) }.err().unwrap();
        assert!(error.contains("cuDeviceGet"), "{error}");
    }
}
