//! DLPack capsules over memory Rust owns: torch views the bytes without a copy and calls the
//! deleter when its tensor is released, which drops the owner (for a batch, its buffer goes
//! back to the engine's pool only then).

use std::ffi::{c_void, CStr};

use pyo3::ffi;
use pyo3::prelude::*;

/// DLPack's `DLDevice`.
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// DLPack's `DLDataType`.
#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// DLPack's `DLTensor`.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// DLPack's `DLManagedTensor` (the pre-1.0 layout torch 1.13 reads).
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// DLPack's `kDLCPU`.
const CPU: i32 = 1;
/// The capsule name a consumer takes (and renames to `used_dltensor`).
const CAPSULE_NAME: &CStr = c"dltensor";

/// Element types handed out.
#[derive(Clone, Copy)]
pub(crate) enum Element {
    /// `torch.uint8`.
    U8,
    /// `torch.int64`.
    I64,
}

impl Element {
    fn dtype(self) -> DlDataType {
        match self {
            // kDLUInt = 1, kDLInt = 0.
            Self::U8 => DlDataType {
                code: 1,
                bits: 8,
                lanes: 1,
            },
            Self::I64 => DlDataType {
                code: 0,
                bits: 64,
                lanes: 1,
            },
        }
    }
}

/// The managed tensor and what keeps its memory alive; the managed tensor comes first, so a
/// pointer to it is a pointer to the whole.
#[repr(C)]
struct Owned {
    managed: DlManagedTensor,
    shape: Vec<i64>,
    strides: Vec<i64>,
    _owner: Box<dyn Send>,
}

unsafe extern "C" fn delete_owned(managed: *mut DlManagedTensor) {
    if !managed.is_null() {
        // SAFETY: every DlManagedTensor handed out is the first field of a leaked Box<Owned>,
        // and DLPack calls the deleter once.
        drop(unsafe { Box::from_raw(managed.cast::<Owned>()) });
    }
}

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // A consumer renames the capsule when it takes the tensor; a capsule still named
    // `dltensor` was never taken, so its memory is released here.
    // SAFETY: called by Python with the capsule being destroyed, the GIL held.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE_NAME.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, CAPSULE_NAME.as_ptr());
            delete_owned(managed.cast());
        }
    }
}

/// A `dltensor` capsule viewing `data` (a C-contiguous array of `shape`), kept alive by
/// `owner` until the tensor made from it is released.
///
/// # Safety
/// `data` must point to `shape`'s product elements of `element` that stay valid and are not
/// written by anyone else for as long as `owner` lives.
pub(crate) unsafe fn capsule(
    py: Python<'_>,
    data: *mut u8,
    element: Element,
    shape: &[i64],
    owner: Box<dyn Send>,
) -> PyResult<PyObject> {
    let mut strides = vec![1i64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1].max(1);
    }
    let mut owned = Box::new(Owned {
        managed: DlManagedTensor {
            dl_tensor: DlTensor {
                data: data.cast(),
                device: DlDevice {
                    device_type: CPU,
                    device_id: 0,
                },
                ndim: shape.len() as i32,
                dtype: element.dtype(),
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_owned),
        },
        shape: shape.to_vec(),
        strides,
        _owner: owner,
    });
    // The vectors' heap blocks do not move when the box is leaked.
    owned.managed.dl_tensor.shape = owned.shape.as_mut_ptr();
    owned.managed.dl_tensor.strides = owned.strides.as_mut_ptr();
    let raw = Box::into_raw(owned);
    // SAFETY: raw is a valid leaked box; the destructor frees it unless a consumer took it.
    unsafe {
        (*raw).managed.manager_ctx = raw.cast();
        let capsule =
            ffi::PyCapsule_New(raw.cast(), CAPSULE_NAME.as_ptr(), Some(capsule_destructor));
        if capsule.is_null() {
            delete_owned(raw.cast());
            return Err(PyErr::fetch(py));
        }
        Ok(PyObject::from_owned_ptr(py, capsule))
    }
}
