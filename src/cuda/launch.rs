//! Typed kernel launches: every kernel of kernels/*.cu that the Rust side launches has one
//! launcher in [`super::launchers`], a struct whose fields are the kernel's parameters, one for
//! one and in order, declared with [`kernel_launchers!`]. A pointer parameter is an [`In`]
//! (`const T*`) or an [`Out`] (`T*`) of the element type the kernel reads (`u16` for bf16), a
//! pointer the kernel accepts as null is an `Option` of one (`None` passes a null pointer),
//! and a value parameter has its own type (`i32` for `int`, `i64` for `long`, a `#[repr(C)]`
//! mirror for a struct). So the compiler checks each launch's arguments against its launcher,
//! and the launchers' unit test checks each launcher against the kernel's signature in
//! kernels/*.cu (count, order, pointer or value, element type, `const`, value sizes):
//! together they stand in for the argument check no GPU-free build can make. [`launch`] is
//! the one place that hands arguments to the driver.

use std::marker::PhantomData;

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DriverError, LaunchArgs,
    LaunchConfig, PushKernelArg,
};

use super::device::GpuDevice;
use super::error::CudaError;

/// The value passed for a null pointer.
static NULL_PTR: u64 = 0;

/// What one kernel parameter is, as the unit test compares it with the C declaration.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ArgKind {
    /// A pointer to `elem` (its C type name: `bf16`, `float`, `int`, `long`, ...), declared
    /// `const` unless `mutable`.
    Ptr {
        /// The C type the pointer addresses.
        elem: &'static str,
        /// Whether the kernel may write through it (no `const`).
        mutable: bool,
    },
    /// A value of the named C type (`int`, `long`, `float`, `double`, or a struct's name),
    /// `size` bytes on the Rust side.
    Value {
        /// The C type.
        ty: &'static str,
        /// The size of the Rust type passed.
        size: usize,
    },
}

/// An element type of device memory, named as kernels/*.cu name it.
pub(crate) trait DeviceElem {
    /// The C type name (`u16` holds bf16 bits, so it is `bf16`).
    #[cfg(test)]
    const C_NAME: &'static str;
}

macro_rules! device_elem {
    ($($t:ty => $c:literal),* $(,)?) => {
        $(impl DeviceElem for $t {
            #[cfg(test)]
            const C_NAME: &'static str = $c;
        })*
    };
}

device_elem! {
    u8 => "u8",
    u16 => "bf16",
    i32 => "int",
    i64 => "long",
    u64 => "unsigned long long",
    f32 => "float",
    f64 => "double",
}

/// One kernel parameter: its kind, and how it is handed to the launch.
pub(crate) trait KernelArg {
    /// What the parameter is (read by the signature check).
    #[cfg(test)]
    const KIND: ArgKind;
    /// Appends the argument to `b`.
    fn push<'b>(&'b mut self, b: &mut LaunchArgs<'b>);
}

/// A `const T*` parameter: device memory the kernel reads.
#[derive(Debug)]
pub(crate) struct In<'a, T>(Source<'a, T>);

/// An `In`'s memory: a buffer of the stream's (cudarc's view of it), or a bare address.
#[derive(Debug)]
enum Source<'a, T> {
    View(CudaView<'a, T>),
    Addr(u64, PhantomData<&'a T>),
}

impl<T> In<'_, T> {
    /// The pointer `ptr`, a device address the caller vouches for.
    ///
    /// # Safety
    /// `ptr` must address as many live `T` of the launching context as the kernel reads, and
    /// stay valid until the launch has run.
    pub(crate) unsafe fn addr(ptr: u64) -> Self {
        In(Source::Addr(ptr, PhantomData))
    }
}

impl<'a, T> From<&'a CudaSlice<T>> for In<'a, T> {
    fn from(s: &'a CudaSlice<T>) -> Self {
        In(Source::View(s.as_view()))
    }
}

impl<'a, 'b: 'a, T> From<&'a CudaView<'b, T>> for In<'a, T> {
    fn from(v: &'a CudaView<'b, T>) -> Self {
        In(Source::View(v.slice(..)))
    }
}

impl<'a, 'b: 'a, T> From<&'a CudaViewMut<'b, T>> for In<'a, T> {
    fn from(v: &'a CudaViewMut<'b, T>) -> Self {
        In(Source::View(v.as_view()))
    }
}

impl<T: DeviceElem> KernelArg for In<'_, T> {
    #[cfg(test)]
    const KIND: ArgKind = ArgKind::Ptr {
        elem: T::C_NAME,
        mutable: false,
    };

    fn push<'b>(&'b mut self, b: &mut LaunchArgs<'b>) {
        match &self.0 {
            Source::View(v) => b.arg(v),
            Source::Addr(a, _) => b.arg(a),
        };
    }
}

/// A `T*` parameter: device memory the kernel writes (and may read).
#[derive(Debug)]
pub(crate) struct Out<'a, T>(Sink<'a, T>);

/// An `Out`'s memory.
#[derive(Debug)]
enum Sink<'a, T> {
    View(CudaViewMut<'a, T>),
    Addr(u64, PhantomData<&'a mut T>),
}

impl<T> Out<'_, T> {
    /// The pointer `ptr`, a device address the caller vouches for.
    ///
    /// # Safety
    /// `ptr` must address as many live `T` of the launching context as the kernel reads and
    /// writes, which nothing else uses until the launch has run.
    pub(crate) unsafe fn addr(ptr: u64) -> Self {
        Out(Sink::Addr(ptr, PhantomData))
    }
}

impl<'a, T> From<&'a mut CudaSlice<T>> for Out<'a, T> {
    fn from(s: &'a mut CudaSlice<T>) -> Self {
        Out(Sink::View(s.as_view_mut()))
    }
}

impl<'a, 'b: 'a, T> From<&'a mut CudaViewMut<'b, T>> for Out<'a, T> {
    fn from(v: &'a mut CudaViewMut<'b, T>) -> Self {
        Out(Sink::View(v.slice_mut(..)))
    }
}

impl<T: DeviceElem> KernelArg for Out<'_, T> {
    #[cfg(test)]
    const KIND: ArgKind = ArgKind::Ptr {
        elem: T::C_NAME,
        mutable: true,
    };

    fn push<'b>(&'b mut self, b: &mut LaunchArgs<'b>) {
        match &mut self.0 {
            Sink::View(v) => b.arg(v),
            Sink::Addr(a, _) => b.arg(&*a),
        };
    }
}

/// A pointer the kernel accepts as null: `None` passes a null pointer.
impl<'a, T: DeviceElem> KernelArg for Option<In<'a, T>> {
    #[cfg(test)]
    const KIND: ArgKind = <In<'a, T> as KernelArg>::KIND;

    fn push<'b>(&'b mut self, b: &mut LaunchArgs<'b>) {
        match self {
            Some(p) => p.push(b),
            None => {
                b.arg(&NULL_PTR);
            }
        }
    }
}

/// A pointer the kernel accepts as null: `None` passes a null pointer.
impl<'a, T: DeviceElem> KernelArg for Option<Out<'a, T>> {
    #[cfg(test)]
    const KIND: ArgKind = <Out<'a, T> as KernelArg>::KIND;

    fn push<'b>(&'b mut self, b: &mut LaunchArgs<'b>) {
        match self {
            Some(p) => p.push(b),
            None => {
                b.arg(&NULL_PTR);
            }
        }
    }
}

/// Declares types passed by value as the C type named (`value_arg!(i32 => "int")`); a struct
/// must be a `#[repr(C)]` mirror of the kernel's and implement
/// [`DeviceRepr`](cudarc::driver::DeviceRepr).
macro_rules! value_arg {
    ($($t:ty => $c:literal),* $(,)?) => {
        $(impl $crate::cuda::launch::KernelArg for $t {
            #[cfg(test)]
            const KIND: $crate::cuda::launch::ArgKind = $crate::cuda::launch::ArgKind::Value {
                ty: $c,
                size: ::std::mem::size_of::<$t>(),
            };

            fn push<'b>(&'b mut self, b: &mut ::cudarc::driver::LaunchArgs<'b>) {
                ::cudarc::driver::PushKernelArg::arg(b, &*self);
            }
        })*
    };
}
pub(crate) use value_arg;

value_arg! {
    i32 => "int",
    i64 => "long",
    f32 => "float",
    f64 => "double",
    super::conv::Conv2Args => "Conv2Args",
    super::conv3::Conv3Args => "Conv3Args",
    super::conv3::TensorMap => "CUtensorMap",
}

/// A kernel's launcher (declared by [`kernel_launchers!`]).
pub(crate) trait Kernel {
    /// The file of kernels/ that defines the kernel.
    const FILE: &'static str;
    /// The kernels this launcher may launch: all share one parameter list.
    const NAMES: &'static [&'static str];
    /// Each parameter's name and kind, in order.
    #[cfg(test)]
    const PARAMS: &'static [(&'static str, ArgKind)];
    /// Appends every argument to `b`, in order.
    fn push_args<'b>(&'b mut self, b: &mut LaunchArgs<'b>);
}

/// Declares launchers: for each, a struct with one field per kernel parameter (in the
/// kernel's order) and its [`Kernel`] implementation.
///
/// ```ignore
/// kernel_launchers! {
///     /// bn.cu `bn_grad_finish`.
///     "bn.cu" BnGradFinish<'a> ["bn_grad_finish"] {
///         g: Out<'a, u16>,
///         residual: Option<In<'a, u16>>,
///         y: Option<In<'a, u16>>,
///         total: i64,
///     }
/// }
/// ```
macro_rules! kernel_launchers {
    ($(
        $(#[$doc:meta])*
        $file:literal $name:ident $(<$lt:lifetime>)? [$($kernel:literal),+ $(,)?] {
            $($field:ident : $ty:ty),* $(,)?
        }
    )*) => {
        $(
            $(#[$doc])*
            #[derive(Debug)]
            pub(crate) struct $name $(<$lt>)? {
                $(pub(crate) $field: $ty,)*
            }

            impl $(<$lt>)? $crate::cuda::launch::Kernel for $name $(<$lt>)? {
                const FILE: &'static str = $file;
                const NAMES: &'static [&'static str] = &[$($kernel),+];
                #[cfg(test)]
                const PARAMS: &'static [(&'static str, $crate::cuda::launch::ArgKind)] = &[
                    $((stringify!($field), <$ty as $crate::cuda::launch::KernelArg>::KIND)),*
                ];

                fn push_args<'b>(&'b mut self, b: &mut ::cudarc::driver::LaunchArgs<'b>) {
                    $($crate::cuda::launch::KernelArg::push(&mut self.$field, b);)*
                }
            }
        )*

        /// Every launcher's file, kernels and parameters (what the unit test checks against
        /// kernels/*.cu).
        #[cfg(test)]
        pub(crate) const LAUNCHERS: &[$crate::cuda::launch::Signature] = &[$(
            $crate::cuda::launch::Signature {
                launcher: stringify!($name),
                file: $file,
                names: &[$($kernel),+],
                params: <$name as $crate::cuda::launch::Kernel>::PARAMS,
            },
        )*];
    };
}
pub(crate) use kernel_launchers;

/// A launcher as the unit test sees it.
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct Signature {
    /// The launcher's type name.
    pub(crate) launcher: &'static str,
    /// Its kernel file.
    pub(crate) file: &'static str,
    /// The kernels it launches.
    pub(crate) names: &'static [&'static str],
    /// Its parameters, in order.
    pub(crate) params: &'static [(&'static str, ArgKind)],
}

/// Whether `kernel` is one of the kernels launcher `K` declares.
pub(crate) fn declares<K: Kernel>(kernel: &str) -> bool {
    K::NAMES.contains(&kernel)
}

/// Queues `f` (one of `K`'s kernels, see [`declares`]) on `stream` with `args`.
///
/// # Safety
/// `f` must be a kernel `K` declares, and every memory range the launch's threads read or
/// write (`cfg` and the arguments decide which) must lie inside the buffers `args` pass.
pub(crate) unsafe fn launch<K: Kernel>(
    stream: &CudaStream,
    f: &CudaFunction,
    cfg: LaunchConfig,
    mut args: K,
) -> Result<(), DriverError> {
    let mut b = stream.launch_builder(f);
    args.push_args(&mut b);
    // SAFETY: the arguments are `K`'s parameters in its kernel's order and kinds (the
    // launchers' unit test compares them with kernels/*.cu); the caller guarantees the rest.
    unsafe { b.launch(cfg) }.map(drop)
}

/// Queues `kernel` (one of launcher `K`'s) on `dev`'s compute stream with `args`; a driver
/// error names the kernel.
///
/// # Safety
/// As [`launch`]: every memory range the launch's threads read or write must lie inside the
/// buffers `args` pass.
pub(crate) unsafe fn launch_on_device<K: Kernel>(
    dev: &GpuDevice,
    kernel: &'static str,
    cfg: LaunchConfig,
    args: K,
) -> Result<(), CudaError> {
    if !declares::<K>(kernel) {
        return Err(CudaError::Unsupported {
            what: format!(
                "{kernel} is not a kernel of the launcher {}",
                std::any::type_name::<K>()
            ),
        });
    }
    let f = dev.function(K::FILE, kernel)?;
    // SAFETY: `f` is one of `K`'s kernels (checked above); the caller guarantees the rest.
    unsafe { launch(dev.stream(), &f, cfg, args) }.map_err(CudaError::driver(kernel))
}
