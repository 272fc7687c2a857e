//! A bounds-checked wrapper over the `gemm` crate's strided f32 matrix product.

use gemm::Parallelism;

/// A read-only strided matrix view: element (r, c) at `data[r*rs + c*cs]`.
#[derive(Clone, Copy)]
pub(super) struct MatRef<'a> {
    pub(super) data: &'a [f32],
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) rs: usize,
    pub(super) cs: usize,
}

impl MatRef<'_> {
    fn fits(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.rs + (self.cols - 1) * self.cs < self.data.len()
    }
}

/// `dst[m×n, row-major, leading dim n] = (accumulate ? dst : 0) + a·b`.
///
/// # Panics
/// If the views do not fit their slices or the inner dimensions differ (a programmer error in
/// this backend: shapes are validated before the call).
pub(super) fn matmul(
    dst: &mut [f32],
    a: MatRef<'_>,
    b: MatRef<'_>,
    accumulate: bool,
    threads: usize,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "matmul: inner dimensions differ");
    assert!(a.fits() && b.fits(), "matmul: a view exceeds its slice");
    assert!(dst.len() >= m * n, "matmul: destination too small");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(0.0);
        }
        return;
    }
    let par = if threads > 1 && m * n * k > 32 * 32 * 32 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    // SAFETY: the asserts above guarantee every strided access of a, b and dst stays inside its
    // slice, and dst does not alias a or b (it is a distinct &mut).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}
