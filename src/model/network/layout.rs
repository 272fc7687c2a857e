//! Convolution weight layouts: torchvision's OIHW on the API side, the backends' OHWI inside
//! a [`Network`](super::Network).

/// OIHW (torchvision) → OHWI (backend).
pub(crate) fn oihw_to_ohwi(v: &[f32], shape: &[usize]) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    permute_conv_weight(v, shape, &mut out, false);
    out
}

/// OHWI (backend) → OIHW (torchvision).
pub(crate) fn ohwi_to_oihw(v: &[f32], shape: &[usize]) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    ohwi_to_oihw_into(v, shape, &mut out);
    out
}

/// OHWI (backend) → OIHW (torchvision), written into `out` (`v.len()` values).
pub(super) fn ohwi_to_oihw_into(v: &[f32], shape: &[usize], out: &mut [f32]) {
    permute_conv_weight(v, shape, out, true);
}

/// Transposes each output channel's `I × (H·W)` block between OIHW and OHWI (`to_oihw` picks
/// the direction). Output channels are independent, so they are done in parallel; a pure
/// permutation, hence the same bits whatever the thread count. Per parameter update this runs
/// over every convolution weight twice, which made it a visible share of a CPU step.
fn permute_conv_weight(v: &[f32], shape: &[usize], out: &mut [f32], to_oihw: bool) {
    use rayon::prelude::*;
    let (i, hw) = (shape[1], shape[2] * shape[3]);
    let block = i * hw;
    if block == 0 {
        return;
    }
    let permute = |(dst, src): (&mut [f32], &[f32])| {
        if to_oihw {
            // src is (hw × i), dst is (i × hw).
            for (p, row) in src.chunks_exact(i).enumerate() {
                for (b, &val) in row.iter().enumerate() {
                    dst[b * hw + p] = val;
                }
            }
        } else {
            // src is (i × hw), dst is (hw × i).
            for (b, row) in src.chunks_exact(hw).enumerate() {
                for (p, &val) in row.iter().enumerate() {
                    dst[p * i + b] = val;
                }
            }
        }
    };
    let out = &mut out[..v.len()];
    // Inside a pool (a backend op) the permutation shares it; elsewhere it runs on a pool of
    // its own, never rayon's global one, whose start panics where the OS refuses a thread.
    // Without threads it runs on the caller's: the same bits, later.
    let inside = rayon::current_thread_index().is_some();
    let pool = if inside { None } else { permute_pool() };
    if inside || pool.is_some() {
        let mut parallel = || {
            out.par_chunks_mut(block)
                .zip(v.par_chunks(block))
                .for_each(permute)
        };
        match pool {
            Some(pool) => pool.install(parallel),
            None => parallel(),
        }
    } else {
        out.chunks_mut(block).zip(v.chunks(block)).for_each(permute);
    }
}

/// The pool of the layout permutations outside a backend op (one thread per core), started
/// at the first use; `None` when the OS refused its threads.
fn permute_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        crate::backend::cpu::start_pool(cores, "weight-layout").ok()
    })
    .as_ref()
}
