//! The CPU's vector width, chosen at run time.
//!
//! Every hot loop of the CPU backend is written once, generic over [`Simd`] (a vector of
//! `LANES` f32 values), and instantiated three times: AVX-512 (16 lanes), AVX2 + FMA (8
//! lanes) and a portable fallback (4 lanes as a plain array, which the compiler maps to SSE2
//! on x86-64 and NEON on aarch64). [`SimdLevel::detect`] picks the widest the processor
//! supports, once per process; `BIRDTRAIN_CPU_SIMD=portable|avx2|avx512` forces a level
//! (never one the processor lacks), so the fallback is the same tested code on any machine.
//!
//! How the features reach the generic code: a kernel is a [`SimdTask`]; [`dispatch`] calls
//! its `run::<S>()` from a function compiled with the level's `#[target_feature]`s, and
//! every generic helper below is `#[inline(always)]`, so the whole kernel is inlined into that
//! function and compiled for the level's instructions. The binary itself stays baseline.

use std::sync::OnceLock;

use crate::backend::BackendError;

/// Environment variable that forces a [`SimdLevel`] (read once per process).
pub const SIMD_ENV: &str = "BIRDTRAIN_CPU_SIMD";

/// Which instantiation of the CPU kernels runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Plain Rust on 4-lane arrays: any processor (SSE2 on x86-64, NEON on aarch64).
    Portable,
    /// x86-64 AVX2 with FMA: 8 lanes.
    Avx2,
    /// x86-64 AVX-512F: 16 lanes.
    Avx512,
}

impl SimdLevel {
    /// The command-line / environment name.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Portable => "portable",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }

    /// f32 lanes per vector.
    pub fn lanes(self) -> usize {
        match self {
            SimdLevel::Portable => 4,
            SimdLevel::Avx2 => 8,
            SimdLevel::Avx512 => 16,
        }
    }

    /// Whether this processor can run the level.
    pub fn supported(self) -> bool {
        match self {
            SimdLevel::Portable => true,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(not(target_arch = "x86_64"))]
            SimdLevel::Avx2 | SimdLevel::Avx512 => false,
        }
    }

    /// The widest level this processor supports.
    pub fn best() -> SimdLevel {
        [SimdLevel::Avx512, SimdLevel::Avx2]
            .into_iter()
            .find(|l| l.supported())
            .unwrap_or(SimdLevel::Portable)
    }

    /// Parses a level name and checks the processor supports it; an error names
    /// [`SIMD_ENV`], the value and the valid ones.
    pub fn parse(value: &str) -> Result<SimdLevel, BackendError> {
        Self::parse_detail(value).map_err(|detail| BackendError::InvalidInput {
            op: SIMD_ENV,
            detail,
        })
    }

    /// [`SimdLevel::parse`] with the error as the message's detail (what follows
    /// "BIRDTRAIN_CPU_SIMD: invalid input: ").
    fn parse_detail(value: &str) -> Result<SimdLevel, String> {
        let level = match value.trim().to_ascii_lowercase().as_str() {
            "portable" | "scalar" | "none" => SimdLevel::Portable,
            "avx2" => SimdLevel::Avx2,
            "avx512" | "avx-512" | "avx512f" => SimdLevel::Avx512,
            _ => {
                return Err(format!(
                    "{value:?} is not a SIMD level (hint: portable, avx2 or avx512, or unset it \
                     to use the widest this processor has)"
                ))
            }
        };
        if !level.supported() {
            return Err(format!(
                "{value:?}: this processor lacks {} (hint: use {} or lower, or unset it)",
                level.name(),
                SimdLevel::best().name()
            ));
        }
        Ok(level)
    }

    /// The level for this process: `BIRDTRAIN_CPU_SIMD` when set (validated), else
    /// [`SimdLevel::best`]. Read once; later calls return the same answer.
    pub fn detect() -> Result<SimdLevel, BackendError> {
        static LEVEL: OnceLock<Result<SimdLevel, String>> = OnceLock::new();
        let got = LEVEL.get_or_init(|| match std::env::var(SIMD_ENV) {
            Ok(v) if !v.trim().is_empty() => SimdLevel::parse_detail(&v),
            _ => Ok(SimdLevel::best()),
        });
        // The detail is cached, not the message: the error is wrapped once, here.
        got.clone().map_err(|detail| BackendError::InvalidInput {
            op: SIMD_ENV,
            detail,
        })
    }
}

impl std::fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A vector of `LANES` f32 values and the operations the kernels need.
///
/// # Safety
/// Implementations use instructions of their level: only call them from code that
/// [`dispatch`] reached for that level. Loads and stores take raw pointers to `LANES` valid
/// f32 values (no alignment required).
pub(super) unsafe trait Simd: Copy {
    /// f32 values per vector.
    const LANES: usize;
    /// The vector.
    type V: Copy;
    /// All lanes zero.
    unsafe fn zero() -> Self::V;
    /// All lanes `x`.
    unsafe fn splat(x: f32) -> Self::V;
    /// `LANES` values from `p`.
    unsafe fn load(p: *const f32) -> Self::V;
    /// `LANES` values to `p`.
    unsafe fn store(p: *mut f32, v: Self::V);
    /// `a + b`.
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    /// `a − b`.
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    /// `a · b`.
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// `a / b`.
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V;
    /// `√a`.
    unsafe fn sqrt(a: Self::V) -> Self::V;
    /// `a · b + c`, fused (one rounding) where the level has FMA; the portable level rounds
    /// twice.
    unsafe fn mul_add(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// `max(a, 0)`; a NaN stays NaN (a diverging run must show, not be masked).
    unsafe fn relu(a: Self::V) -> Self::V;
    /// `v` where `gate > 0` (or NaN), else 0: a select, no branch (the ReLU mask of
    /// backward, which passes the gradient unless the output was clamped).
    unsafe fn pass_where_positive(gate: Self::V, v: Self::V) -> Self::V;
}

/// The portable level: 4 lanes as an array; plain arithmetic the compiler vectorises.
#[derive(Clone, Copy)]
pub(super) struct Portable;

// SAFETY: plain Rust; loads/stores touch exactly LANES values, as the trait requires.
unsafe impl Simd for Portable {
    const LANES: usize = 4;
    type V = [f32; 4];
    #[inline(always)]
    unsafe fn zero() -> [f32; 4] {
        [0.0; 4]
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> [f32; 4] {
        [x; 4]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> [f32; 4] {
        p.cast::<[f32; 4]>().read_unaligned()
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: [f32; 4]) {
        p.cast::<[f32; 4]>().write_unaligned(v)
    }
    #[inline(always)]
    unsafe fn add(a: [f32; 4], b: [f32; 4]) -> [f32; 4] {
        std::array::from_fn(|i| a[i] + b[i])
    }
    #[inline(always)]
    unsafe fn sub(a: [f32; 4], b: [f32; 4]) -> [f32; 4] {
        std::array::from_fn(|i| a[i] - b[i])
    }
    #[inline(always)]
    unsafe fn mul(a: [f32; 4], b: [f32; 4]) -> [f32; 4] {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    unsafe fn div(a: [f32; 4], b: [f32; 4]) -> [f32; 4] {
        std::array::from_fn(|i| a[i] / b[i])
    }
    #[inline(always)]
    unsafe fn sqrt(a: [f32; 4]) -> [f32; 4] {
        std::array::from_fn(|i| a[i].sqrt())
    }
    #[inline(always)]
    unsafe fn mul_add(a: [f32; 4], b: [f32; 4], c: [f32; 4]) -> [f32; 4] {
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    unsafe fn relu(a: [f32; 4]) -> [f32; 4] {
        std::array::from_fn(|i| if a[i] < 0.0 { 0.0 } else { a[i] })
    }
    #[inline(always)]
    unsafe fn pass_where_positive(gate: [f32; 4], v: [f32; 4]) -> [f32; 4] {
        // All-ones or all-zeros mask per lane, applied to the bits: a select, not a branch.
        std::array::from_fn(|i| {
            // Passes unless `gate <= 0` (NaN passes, as the vector levels' unordered compare).
            use std::cmp::Ordering::{Equal, Less};
            let pass = !matches!(gate[i].partial_cmp(&0.0), Some(Less | Equal));
            let mask = (pass as u32).wrapping_neg();
            f32::from_bits(v[i].to_bits() & mask)
        })
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Simd;

    /// AVX2 + FMA, 8 lanes.
    #[derive(Clone, Copy)]
    pub(in crate::backend::cpu) struct Avx2;

    // SAFETY: only reached through `dispatch` after AVX2 and FMA were detected.
    unsafe impl Simd for Avx2 {
        const LANES: usize = 8;
        type V = __m256;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            _mm256_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            _mm256_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: __m256, b: __m256) -> __m256 {
            _mm256_sub_ps(a, b)
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            _mm256_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn div(a: __m256, b: __m256) -> __m256 {
            _mm256_div_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sqrt(a: __m256) -> __m256 {
            _mm256_sqrt_ps(a)
        }
        #[inline(always)]
        unsafe fn mul_add(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn relu(a: __m256) -> __m256 {
            // maxps returns its second operand when either is NaN.
            _mm256_max_ps(_mm256_setzero_ps(), a)
        }
        #[inline(always)]
        unsafe fn pass_where_positive(gate: __m256, v: __m256) -> __m256 {
            let mask = _mm256_cmp_ps::<_CMP_NLE_UQ>(gate, _mm256_setzero_ps());
            _mm256_and_ps(mask, v)
        }
    }

    /// AVX-512F, 16 lanes.
    #[derive(Clone, Copy)]
    pub(in crate::backend::cpu) struct Avx512;

    // SAFETY: only reached through `dispatch` after AVX-512F was detected.
    unsafe impl Simd for Avx512 {
        const LANES: usize = 16;
        type V = __m512;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: __m512, b: __m512) -> __m512 {
            _mm512_sub_ps(a, b)
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn div(a: __m512, b: __m512) -> __m512 {
            _mm512_div_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sqrt(a: __m512) -> __m512 {
            _mm512_sqrt_ps(a)
        }
        #[inline(always)]
        unsafe fn mul_add(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn relu(a: __m512) -> __m512 {
            _mm512_max_ps(_mm512_setzero_ps(), a)
        }
        #[inline(always)]
        unsafe fn pass_where_positive(gate: __m512, v: __m512) -> __m512 {
            let mask = _mm512_cmp_ps_mask::<_CMP_NLE_UQ>(gate, _mm512_setzero_ps());
            _mm512_maskz_mov_ps(mask, v)
        }
    }
}

/// A kernel written once over [`Simd`]; [`dispatch`] runs it at a level.
pub(super) trait SimdTask {
    /// What the kernel returns.
    type Output;
    /// The kernel at vector type `S`. Implementations are `#[inline(always)]` so the level's
    /// target features apply to the whole body.
    fn run<S: Simd>(self) -> Self::Output;
}

/// Runs `task` instantiated for `level`.
///
/// `level` must be supported by this processor; [`SimdLevel::detect`] and
/// [`SimdLevel::parse`] guarantee it, and a `CpuBackend` only holds such levels. (A level the
/// processor lacks is a programmer error: it falls back to the portable code.)
#[inline]
pub(super) fn dispatch<T: SimdTask>(level: SimdLevel, task: T) -> T::Output {
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 if level.supported() => {
            // SAFETY: AVX-512F, AVX2 and FMA were detected on this processor.
            unsafe { run_avx512(task) }
        }
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 if level.supported() => {
            // SAFETY: AVX2 and FMA were detected on this processor.
            unsafe { run_avx2(task) }
        }
        _ => task.run::<Portable>(),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn run_avx512<T: SimdTask>(task: T) -> T::Output {
    task.run::<x86::Avx512>()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2<T: SimdTask>(task: T) -> T::Output {
    task.run::<x86::Avx2>()
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Probe<'a>(&'a [f32], &'a [f32], &'a mut Vec<f32>);

    impl SimdTask for Probe<'_> {
        type Output = usize;
        #[inline(always)]
        fn run<S: Simd>(self) -> usize {
            let (a, b, out) = (self.0, self.1, self.2);
            out.clear();
            out.resize(a.len(), 0.0);
            let mut i = 0;
            while i + S::LANES <= a.len() {
                // SAFETY: i + LANES ≤ len for all three slices.
                unsafe {
                    let (x, y) = (S::load(a.as_ptr().add(i)), S::load(b.as_ptr().add(i)));
                    let v = S::mul_add(x, y, S::pass_where_positive(x, y));
                    S::store(out.as_mut_ptr().add(i), S::relu(v));
                }
                i += S::LANES;
            }
            S::LANES
        }
    }

    #[test]
    fn every_supported_level_computes_the_same_lanes() {
        let a: Vec<f32> = (0..32).map(|i| i as f32 * 0.25 - 3.0).collect();
        let b: Vec<f32> = (0..32).map(|i| 2.0 - i as f32 * 0.5).collect();
        let want: Vec<f32> = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| (x * y + if x > 0.0 { y } else { 0.0 }).max(0.0))
            .collect();
        for level in [SimdLevel::Portable, SimdLevel::Avx2, SimdLevel::Avx512] {
            if !level.supported() {
                continue;
            }
            let mut out = Vec::new();
            let lanes = dispatch(level, Probe(&a, &b, &mut out));
            assert_eq!(lanes, level.lanes());
            assert_eq!(out, want, "{level}");
        }
    }

    #[test]
    fn levels_parse_and_refuse_clearly() {
        assert_eq!(SimdLevel::parse("portable").unwrap(), SimdLevel::Portable);
        let err = SimdLevel::parse("sse9").unwrap_err().to_string();
        assert!(err.contains(SIMD_ENV) && err.contains("hint"), "{err}");
        if !SimdLevel::Avx512.supported() {
            let err = SimdLevel::parse("avx512").unwrap_err().to_string();
            assert!(err.contains("lacks avx512"), "{err}");
        }
        assert!(SimdLevel::best().supported());
    }
}
