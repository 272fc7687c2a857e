//! The fused optimizer of the CPU backend: updates parameter tensors in place, in the
//! backend's own layout (OHWI convolutions), with the momentum / Adam moments kept alongside.
//! The CPU twin of the GPU's device optimizer: no copy of the parameters out to torchvision
//! layout and back per step.
//!
//! # Algorithm
//!
//! Every tensor is cut into chunks of [`CHUNK`] values; the chunks of all tensors are spread
//! over the backend's threads and each is updated with the rule below, vectorised ([`Simd`])
//! with a scalar tail. The rules are elementwise, so permuting parameters, gradients and
//! moments alike (OIHW ↔ OHWI) changes nothing, and the arithmetic is written in the same
//! order as the host optimizer (`crate::optim::Optimizer`), separate multiplies and adds, no
//! fused multiply-add, so the two agree bit for bit (the tests check it):
//!
//! - SGD: `g = grad·scale + wd·p`; with momentum `m = μ·m + g`, step `g + μ·m` (Nesterov) or
//!   `m`; without momentum, step `g` (`m` untouched); `p = p − lr·step`.
//! - Adam: `g = grad·scale + wd·p`; AdamW instead decays `p = p·(1 − lr·wd)` first and uses
//!   `g = grad·scale`; `m = β1·m + (1−β1)·g`, `v = β2·v + ((1−β2)·g)·g`,
//!   `p = p − (lr·(m/(1−β1ᵗ))) / (√(v/(1−β2ᵗ)) + ε)`.
//!
//! Weight decay is per tensor (the caller passes 0 for batch-norm parameters and biases).
//!
//! # Layout
//!
//! `m` and `v` are flat in graph parameter order, each tensor in the backend's layout, as the
//! GPU's device optimizer keeps them; [`CpuOptimizer::state`] returns them so, and the caller
//! converts to torchvision layout for checkpoints.

use rayon::prelude::*;

use super::simd::{dispatch, Simd, SimdTask};
use super::CpuBackend;
use crate::backend::BackendError;

/// Values per chunk of the update.
pub(super) const CHUNK: usize = 1 << 14;

/// The update rule of a [`CpuOptimizer`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UpdateRule {
    /// SGD with optional (Nesterov) momentum, L2 weight decay added to the gradient.
    Sgd {
        /// Momentum μ (0 = plain SGD, no momentum buffer update).
        momentum: f32,
        /// Nesterov momentum.
        nesterov: bool,
    },
    /// Adam (L2 weight decay added to the gradient) or AdamW (`decoupled`: the weights decay
    /// by `lr·wd` before the step).
    Adam {
        /// β₁.
        beta1: f32,
        /// β₂.
        beta2: f32,
        /// ε.
        eps: f32,
        /// AdamW's decoupled decay.
        decoupled: bool,
    },
}

/// Momentum (SGD) or first and second moments (Adam) for every parameter tensor, updated in
/// place with the parameters. See the module documentation for the rules.
#[derive(Debug, Clone)]
pub struct CpuOptimizer {
    rule: UpdateRule,
    /// Weight decay per tensor.
    decay: Vec<f32>,
    /// Values per tensor.
    sizes: Vec<usize>,
    /// Start of each tensor in `m` / `v`.
    offsets: Vec<usize>,
    m: Vec<f32>,
    /// Empty for SGD.
    v: Vec<f32>,
    steps: u64,
    /// `(tensor, offset in the tensor, length)` of every chunk.
    chunks: Vec<(usize, usize, usize)>,
}

impl CpuOptimizer {
    /// An optimizer with zero state for tensors of `sizes` values, with weight decay
    /// `weight_decay[i]` for tensor `i` (0 where no decay applies).
    pub fn new(
        rule: UpdateRule,
        sizes: Vec<usize>,
        weight_decay: Vec<f32>,
    ) -> Result<CpuOptimizer, BackendError> {
        if sizes.len() != weight_decay.len() {
            return Err(BackendError::Shape {
                op: "CpuOptimizer::new",
                detail: format!(
                    "{} tensors but {} weight-decay values",
                    sizes.len(),
                    weight_decay.len()
                ),
            });
        }
        let mut offsets = Vec::with_capacity(sizes.len());
        let mut chunks = Vec::new();
        let mut len = 0;
        for (i, &n) in sizes.iter().enumerate() {
            offsets.push(len);
            let mut done = 0;
            while done < n {
                let l = CHUNK.min(n - done);
                chunks.push((i, done, l));
                done += l;
            }
            len += n;
        }
        let zeros = |len: usize| -> Result<Vec<f32>, BackendError> {
            let mut v = Vec::new();
            crate::oom::fallible(|| v.try_reserve_exact(len)).map_err(|_| {
                BackendError::OutOfMemory {
                    bytes: len * 4,
                    what: "optimizer state".into(),
                    hint: "use a smaller model or plain SGD (no second moment)".into(),
                }
            })?;
            v.resize(len, 0.0);
            Ok(v)
        };
        let v = match rule {
            UpdateRule::Sgd { .. } => Vec::new(),
            UpdateRule::Adam { .. } => zeros(len)?,
        };
        Ok(CpuOptimizer {
            rule,
            decay: weight_decay,
            sizes,
            offsets,
            m: zeros(len)?,
            v,
            steps: 0,
            chunks,
        })
    }

    /// The update rule.
    pub fn rule(&self) -> UpdateRule {
        self.rule
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// `(m, v, steps)`: momentum or first moment, second moment (empty for SGD), flat in
    /// graph order and the backend's layout.
    pub fn state(&self) -> (&[f32], &[f32], u64) {
        (&self.m, &self.v, self.steps)
    }

    /// Replaces the state (same layout as [`CpuOptimizer::state`]), e.g. restored from a
    /// checkpoint after conversion to the backend's layout.
    pub fn set_state(&mut self, m: Vec<f32>, v: Vec<f32>, steps: u64) -> Result<(), BackendError> {
        if m.len() != self.m.len() || v.len() != self.v.len() {
            return Err(BackendError::Shape {
                op: "CpuOptimizer::set_state",
                detail: format!(
                    "state of {} + {} values for an optimizer holding {} + {}",
                    m.len(),
                    v.len(),
                    self.m.len(),
                    self.v.len()
                ),
            });
        }
        self.m = m;
        self.v = v;
        self.steps = steps;
        Ok(())
    }

    /// One update of every parameter tensor from its gradient, in place, on `backend`'s
    /// threads: `grad_scale` multiplies the gradients first (e.g. `1/replicas` when they hold
    /// a sum). Tensors are in graph order; each must have the size given at construction.
    pub fn step<G: AsRef<[f32]> + Sync>(
        &mut self,
        backend: &CpuBackend,
        params: &mut [&mut Vec<f32>],
        grads: &[G],
        lr: f32,
        grad_scale: f32,
    ) -> Result<(), BackendError> {
        let op = "CpuOptimizer::step";
        if params.len() != self.sizes.len() || grads.len() != self.sizes.len() {
            return Err(BackendError::Shape {
                op,
                detail: format!(
                    "{} parameter and {} gradient tensors for an optimizer of {}",
                    params.len(),
                    grads.len(),
                    self.sizes.len()
                ),
            });
        }
        for (i, &n) in self.sizes.iter().enumerate() {
            if params[i].len() != n || grads[i].as_ref().len() != n {
                return Err(BackendError::Shape {
                    op,
                    detail: format!(
                        "tensor {i}: parameter {} and gradient {} values, expected {n}",
                        params[i].len(),
                        grads[i].as_ref().len()
                    ),
                });
            }
        }
        if !lr.is_finite() || !grad_scale.is_finite() {
            return Err(BackendError::InvalidInput {
                op,
                detail: format!(
                    "learning rate {lr} and gradient scale {grad_scale} must be finite \
                     (hint: check the schedule and the replica count)"
                ),
            });
        }
        let _timer = backend
            .profiler
            .time(|| "optimizer".into(), 0.0, self.bytes_per_step());
        self.steps += 1;
        let rule = match self.rule {
            UpdateRule::Sgd { momentum, nesterov } => Rule::Sgd { momentum, nesterov },
            UpdateRule::Adam {
                beta1,
                beta2,
                eps,
                decoupled,
            } => {
                // Exactly the host optimizer's f32 expressions.
                let t = self.steps as i32;
                Rule::Adam {
                    beta1,
                    beta2,
                    one_minus_beta1: 1.0 - beta1,
                    one_minus_beta2: 1.0 - beta2,
                    eps,
                    // In f64, as PyTorch forms them, then f32.
                    bc1: (1.0 - f64::from(beta1).powi(t)) as f32,
                    bc2: (1.0 - f64::from(beta2).powi(t)) as f32,
                    decoupled,
                }
            }
        };
        let level = backend.level;
        let param_ptrs: Vec<Shared> = params.iter_mut().map(|p| Shared(p.as_mut_ptr())).collect();
        let m = Shared(self.m.as_mut_ptr());
        let v = Shared(self.v.as_mut_ptr());
        let (chunks, offsets, decay) = (&self.chunks, &self.offsets, &self.decay);
        backend.pool.install(|| {
            chunks.par_iter().for_each(|&(t, off, len)| {
                let flat = offsets[t] + off;
                // SAFETY: chunks partition every tensor (and the flat state) into disjoint
                // ranges, each inside its buffer (sizes checked above); one task per chunk.
                let (p, m, v) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(param_ptrs[t].get().add(off), len),
                        std::slice::from_raw_parts_mut(m.get().add(flat), len),
                        if matches!(rule, Rule::Adam { .. }) {
                            std::slice::from_raw_parts_mut(v.get().add(flat), len)
                        } else {
                            &mut [][..]
                        },
                    )
                };
                let g = &grads[t].as_ref()[off..off + len];
                let wd = decay[t];
                dispatch(
                    level,
                    Update {
                        rule,
                        p,
                        g,
                        m,
                        v,
                        lr,
                        wd,
                        scale: grad_scale,
                    },
                );
            });
        });
        Ok(())
    }

    /// Bytes one step reads and writes (for the profile's bandwidth).
    fn bytes_per_step(&self) -> f64 {
        let n = self.m.len() as f64;
        let per = match self.rule {
            UpdateRule::Sgd { .. } => 5.0, // p, g, m read; p, m written
            UpdateRule::Adam { .. } => 7.0,
        };
        per * 4.0 * n
    }
}

/// A raw pointer shared by tasks writing disjoint ranges.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
// SAFETY: every use writes a range no other task touches (see `CpuOptimizer::step`).
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// The rule with its per-step constants.
#[derive(Debug, Clone, Copy)]
enum Rule {
    Sgd {
        momentum: f32,
        nesterov: bool,
    },
    Adam {
        beta1: f32,
        beta2: f32,
        one_minus_beta1: f32,
        one_minus_beta2: f32,
        eps: f32,
        bc1: f32,
        bc2: f32,
        decoupled: bool,
    },
}

/// One chunk's update.
struct Update<'a> {
    rule: Rule,
    p: &'a mut [f32],
    g: &'a [f32],
    m: &'a mut [f32],
    v: &'a mut [f32],
    lr: f32,
    wd: f32,
    scale: f32,
}

impl SimdTask for Update<'_> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        let n = self.p.len();
        let full = n - n % S::LANES;
        let (lr, wd, scale) = (self.lr, self.wd, self.scale);
        let (p, g, m, v) = (self.p, self.g, self.m, self.v);
        match self.rule {
            Rule::Sgd { momentum, nesterov } => {
                let mut i = 0;
                // SAFETY (all vector blocks): i + LANES ≤ n = len of p, g, m.
                unsafe {
                    let (vlr, vwd, vmu, vs) = (
                        S::splat(lr),
                        S::splat(wd),
                        S::splat(momentum),
                        S::splat(scale),
                    );
                    while i < full {
                        let pi = S::load(p.as_ptr().add(i));
                        let gi = S::add(S::mul(S::load(g.as_ptr().add(i)), vs), S::mul(vwd, pi));
                        let d = if momentum != 0.0 {
                            let mi = S::add(S::mul(vmu, S::load(m.as_ptr().add(i))), gi);
                            S::store(m.as_mut_ptr().add(i), mi);
                            if nesterov {
                                S::add(gi, S::mul(vmu, mi))
                            } else {
                                mi
                            }
                        } else {
                            gi
                        };
                        S::store(p.as_mut_ptr().add(i), S::sub(pi, S::mul(vlr, d)));
                        i += S::LANES;
                    }
                }
                for i in full..n {
                    let gi = g[i] * scale + wd * p[i];
                    let d = if momentum != 0.0 {
                        m[i] = momentum * m[i] + gi;
                        if nesterov {
                            gi + momentum * m[i]
                        } else {
                            m[i]
                        }
                    } else {
                        gi
                    };
                    p[i] -= lr * d;
                }
            }
            Rule::Adam {
                beta1,
                beta2,
                one_minus_beta1,
                one_minus_beta2,
                eps,
                bc1,
                bc2,
                decoupled,
            } => {
                let decay_factor = 1.0 - lr * wd;
                let mut i = 0;
                // SAFETY (all vector blocks): i + LANES ≤ n = len of p, g, m, v.
                unsafe {
                    let (vb1, vb2, vo1, vo2) = (
                        S::splat(beta1),
                        S::splat(beta2),
                        S::splat(one_minus_beta1),
                        S::splat(one_minus_beta2),
                    );
                    let (veps, vbc1, vbc2, vlr) =
                        (S::splat(eps), S::splat(bc1), S::splat(bc2), S::splat(lr));
                    let (vwd, vs, vdecay) = (S::splat(wd), S::splat(scale), S::splat(decay_factor));
                    while i < full {
                        let mut pi = S::load(p.as_ptr().add(i));
                        let graw = S::mul(S::load(g.as_ptr().add(i)), vs);
                        let gi = if decoupled {
                            pi = S::mul(pi, vdecay);
                            graw
                        } else {
                            S::add(graw, S::mul(vwd, pi))
                        };
                        let mi = S::add(S::mul(vb1, S::load(m.as_ptr().add(i))), S::mul(vo1, gi));
                        let vi = S::add(
                            S::mul(vb2, S::load(v.as_ptr().add(i))),
                            S::mul(S::mul(vo2, gi), gi),
                        );
                        S::store(m.as_mut_ptr().add(i), mi);
                        S::store(v.as_mut_ptr().add(i), vi);
                        let mhat = S::div(mi, vbc1);
                        let vhat = S::div(vi, vbc2);
                        let upd = S::div(S::mul(vlr, mhat), S::add(S::sqrt(vhat), veps));
                        S::store(p.as_mut_ptr().add(i), S::sub(pi, upd));
                        i += S::LANES;
                    }
                }
                for i in full..n {
                    let graw = g[i] * scale;
                    let gi = if decoupled { graw } else { graw + wd * p[i] };
                    if decoupled {
                        p[i] *= decay_factor;
                    }
                    m[i] = beta1 * m[i] + one_minus_beta1 * gi;
                    v[i] = beta2 * v[i] + one_minus_beta2 * gi * gi;
                    let mhat = m[i] / bc1;
                    let vhat = v[i] / bc2;
                    p[i] -= lr * mhat / (vhat.sqrt() + eps);
                }
            }
        }
    }
}
