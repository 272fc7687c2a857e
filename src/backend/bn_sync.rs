//! Synchronised batch norm's per-channel sums: what the replicas add up, where a backend keeps
//! them, and the host reference of the arithmetic around the sum.
//!
//! A synchronised BN layer (`--sync-bn`) sums, over every replica, `2·channels + 1` values in
//! forward (Σx, Σx², rows) and `2·channels` in backward (Σdz·x̂, Σdz, each on the global loss's
//! scale). The backend packs them from its own tensors into [`Backend::Sums`] (f64), a
//! reducer sums them in place where they are ([`SumsMut`]: host memory, or device memory that
//! a GPU collective reduces without a host round trip), and the backend turns the sums into
//! the global statistics and the global backward reductions, with which the backend's own
//! batch-statistics backward writes the input gradient. The functions here are that
//! arithmetic on the host, in f64: the trait's default implementations (the CPU backend's)
//! and the reference the CUDA kernels follow.
//!
//! [`Backend::Sums`]: super::Backend::Sums

use super::{BackendError, BnShape};

/// Sums that live in device memory: a reducer either sums them on the device (the address
/// and length; the values are f64) or, without a device path, through the host.
pub trait DeviceSums: Send {
    /// Device address of the first value.
    fn device_ptr(&self) -> u64;
    /// Values (f64).
    fn len(&self) -> usize;
    /// Whether there are no values.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The values, once the work queued on the backend's stream so far has written them.
    fn download(&self) -> Result<Vec<f64>, BackendError>;
    /// Replaces the values (as many as there are), before the work queued next reads them.
    fn upload(&mut self, values: &[f64]) -> Result<(), BackendError>;
}

/// A backend's sums, as a reducer sees them.
pub enum SumsMut<'a> {
    /// In host memory.
    Host(&'a mut [f64]),
    /// In device memory.
    Device(&'a mut dyn DeviceSums),
}

impl SumsMut<'_> {
    /// Values.
    pub fn len(&self) -> usize {
        match self {
            SumsMut::Host(v) => v.len(),
            SumsMut::Device(d) => d.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values, on the host.
    pub fn read(&self) -> Result<Vec<f64>, BackendError> {
        match self {
            SumsMut::Host(v) => Ok(v.to_vec()),
            SumsMut::Device(d) => d.download(),
        }
    }

    /// Replaces the values.
    pub fn write(&mut self, values: &[f64]) -> Result<(), BackendError> {
        if values.len() != self.len() {
            return Err(BackendError::Shape {
                op: "bn_sync sums",
                detail: format!("{} values written into {}", values.len(), self.len()),
            });
        }
        match self {
            SumsMut::Host(v) => {
                v.copy_from_slice(values);
                Ok(())
            }
            SumsMut::Device(d) => d.upload(values),
        }
    }

    /// Sums these values over replicas through the host: read, `sum` in place, written back
    /// (what a reducer without a device path does with device sums).
    pub fn sum_through_host<E>(
        &mut self,
        sum: impl FnOnce(&mut [f64]) -> Result<(), E>,
    ) -> Result<(), SumThroughHostError<E>> {
        match self {
            SumsMut::Host(v) => sum(v).map_err(SumThroughHostError::Sum),
            SumsMut::Device(d) => {
                let mut v = d.download().map_err(SumThroughHostError::Device)?;
                sum(&mut v).map_err(SumThroughHostError::Sum)?;
                d.upload(&v).map_err(SumThroughHostError::Device)
            }
        }
    }
}

/// What [`SumsMut::sum_through_host`] can fail with.
#[derive(Debug, thiserror::Error)]
pub enum SumThroughHostError<E> {
    /// Moving the sums between device and host failed.
    #[error(transparent)]
    Device(BackendError),
    /// The sum itself failed.
    #[error(transparent)]
    Sum(E),
}

/// Values of a layer's forward sums: Σx and Σx² per channel, then the rows.
pub fn moments_len(channels: usize) -> usize {
    2 * channels + 1
}

/// Values of a layer's backward sums: Σdz·x̂ and Σdz per channel.
pub fn grad_sums_len(channels: usize) -> usize {
    2 * channels
}

fn shape_error(op: &'static str, detail: String) -> BackendError {
    BackendError::Shape { op, detail }
}

/// Forward, before the sum: `[rows·mean, (rows − 1)·var + rows·mean², rows]` per channel from
/// this replica's batch mean and unbiased variance (Σx and Σx² of its rows; for one row the
/// variance is 0).
pub fn moments(shape: BnShape, mean: &[f32], var: &[f32]) -> Result<Vec<f64>, BackendError> {
    let c = shape.channels;
    if mean.len() < c || var.len() < c {
        return Err(shape_error(
            "bn_sync_moments",
            format!("{c} channels, mean {} var {}", mean.len(), var.len()),
        ));
    }
    let n = shape.rows as f64;
    let mut out = Vec::with_capacity(moments_len(c));
    out.extend((0..c).map(|ch| n * f64::from(mean[ch])));
    out.extend((0..c).map(|ch| {
        let m = f64::from(mean[ch]);
        (n - 1.0).max(0.0) * f64::from(var[ch]) + n * m * m
    }));
    out.push(n);
    Ok(out)
}

/// Forward, after the sum: the global batch's mean and biased variance per channel, and its
/// rows. Fails when no replica had a row (no step has that).
pub fn global_statistics(
    channels: usize,
    sums: &[f64],
) -> Result<(Vec<f64>, Vec<f64>, f64), BackendError> {
    let c = channels;
    if sums.len() != moments_len(c) {
        return Err(shape_error(
            "bn_sync_statistics",
            format!("{} sums for {c} channels", sums.len()),
        ));
    }
    let rows = sums[2 * c];
    if rows < 1.0 {
        return Err(BackendError::InvalidInput {
            op: "bn_sync_statistics",
            detail: format!("the replicas hold {rows} rows in all"),
        });
    }
    let mean: Vec<f64> = sums[..c].iter().map(|s| s / rows).collect();
    let var: Vec<f64> = (0..c)
        .map(|ch| (sums[c + ch] / rows - mean[ch] * mean[ch]).max(0.0))
        .collect();
    Ok((mean, var, rows))
}

/// The running statistics advanced with the global batch's mean and unbiased variance (as the
/// local op does with its own batch).
pub fn advance_running(
    running_mean: &mut [f32],
    running_var: &mut [f32],
    mean: &[f64],
    var: &[f64],
    rows: f64,
    momentum: f32,
) {
    let unbias = if rows > 1.0 { rows / (rows - 1.0) } else { 1.0 };
    let m = f64::from(momentum);
    let c = mean.len().min(running_mean.len()).min(running_var.len());
    for ch in 0..c {
        running_mean[ch] = ((1.0 - m) * f64::from(running_mean[ch]) + m * mean[ch]) as f32;
        running_var[ch] = ((1.0 - m) * f64::from(running_var[ch]) + m * var[ch] * unbias) as f32;
    }
}

/// Backward, before the sum: this replica's dγ = Σdz·x̂ and dβ = Σdz, times its share of the
/// global rows. Each replica's dz is the gradient of its own mean loss; the step's gradient is
/// the image-weighted mean of the replicas', so the share puts every replica on the global
/// loss's scale.
pub fn grad_sums(
    shape: BnShape,
    global_rows: f64,
    dgamma: &[f32],
    dbeta: &[f32],
) -> Result<Vec<f64>, BackendError> {
    let c = shape.channels;
    if dgamma.len() < c || dbeta.len() < c {
        return Err(shape_error(
            "bn_sync_grad_sums",
            format!(
                "{c} channels, dgamma {} dbeta {}",
                dgamma.len(),
                dbeta.len()
            ),
        ));
    }
    let share = shape.rows as f64 / global_rows;
    let mut out = Vec::with_capacity(grad_sums_len(c));
    out.extend(dgamma[..c].iter().map(|&v| f64::from(v) * share));
    out.extend(dbeta[..c].iter().map(|&v| f64::from(v) * share));
    Ok(out)
}

/// Backward, after the sum: the global Σdz·x̂ and Σdz of the layer on this replica's scale (the
/// summed `sums`, rounded to f32), as `(dgamma, dbeta)`. Over this replica's rows they have
/// the global batch's means (`Σ/rows`), so the backend's own batch-statistics input gradient
/// ([`input_gradient`] on the CPU, `bn_bwd_apply` on the GPU) run with them in place of its
/// local reductions is the global backward; over one replica they are its own dγ and dβ, bit
/// for bit, so synchronised batch norm over one replica is plain batch norm.
pub fn global_reductions(
    channels: usize,
    sums: &[f64],
) -> Result<(Vec<f32>, Vec<f32>), BackendError> {
    let c = channels;
    if sums.len() != grad_sums_len(c) {
        return Err(shape_error(
            "bn_sync_backward",
            format!("{} sums for {c} channels", sums.len()),
        ));
    }
    let dgamma = sums[..c].iter().map(|&v| v as f32).collect();
    let dbeta = sums[c..].iter().map(|&v| v as f32).collect();
    Ok((dgamma, dbeta))
}

/// The per-channel constants of batch norm's input gradient with batch statistics over `rows`
/// rows, from its reductions dγ = Σdz·x̂ and dβ = Σdz: `k = γ·invstd` (an f32 product, as the
/// frozen-statistics backward forms it), `mdb = dβ/rows` and `c2 = invstd·dγ/rows`, so that
/// `dx = k·(dz − (mdb + (x − mean)·c2))`.
pub fn input_gradient_constants(
    rows: usize,
    gamma: &[f32],
    invstd: &[f32],
    dgamma: &[f32],
    dbeta: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let n = rows.max(1) as f64;
    let c = gamma
        .len()
        .min(invstd.len())
        .min(dgamma.len())
        .min(dbeta.len());
    let k = (0..c).map(|ch| gamma[ch] * invstd[ch]).collect();
    let mdb = (0..c).map(|ch| (f64::from(dbeta[ch]) / n) as f32).collect();
    let c2 = (0..c)
        .map(|ch| (f64::from(invstd[ch]) * f64::from(dgamma[ch]) / n) as f32)
        .collect();
    (k, mdb, c2)
}

/// What [`input_gradient`] reads: a batch norm's forward over `shape.rows × shape.channels`
/// (NHWC), the gradient reaching its output, and the two reductions of its backward.
#[derive(Debug, Clone, Copy)]
pub struct InputGradientArgs<'a> {
    /// Rows and channels.
    pub shape: BnShape,
    /// The forward's input.
    pub x: &'a [f32],
    /// The forward's output (for the ReLU mask).
    pub y: &'a [f32],
    /// The gradient of the output.
    pub dy: &'a [f32],
    /// γ.
    pub gamma: &'a [f32],
    /// The mean it normalised with.
    pub mean: &'a [f32],
    /// The inverse standard deviation it normalised with.
    pub invstd: &'a [f32],
    /// Whether a ReLU followed.
    pub relu: bool,
    /// Σdz·x̂ per channel.
    pub dgamma: &'a [f32],
    /// Σdz per channel.
    pub dbeta: &'a [f32],
}

/// Batch norm's input gradient with batch statistics on the host, element by element:
/// `dx = k·(dz − (mdb + (x − mean)·c2))` ([`input_gradient_constants`]), `dz = dy` masked by
/// the ReLU. The CPU backend's own pass computes the same in SIMD lanes.
pub fn input_gradient(a: InputGradientArgs<'_>, dx: &mut [f32]) -> Result<(), BackendError> {
    let (rows, c) = (a.shape.rows, a.shape.channels);
    let n = rows * c;
    if [a.x.len(), a.y.len(), a.dy.len(), dx.len()]
        .iter()
        .any(|&len| len < n)
        || [a.gamma.len(), a.mean.len(), a.invstd.len()]
            .iter()
            .chain([a.dgamma.len(), a.dbeta.len()].iter())
            .any(|&len| len < c)
    {
        return Err(shape_error(
            "bn_sync_backward",
            format!(
                "{rows} × {c}: x {} y {} dy {} dx {}, per channel gamma {} mean {} invstd {} dgamma {} dbeta {}",
                a.x.len(),
                a.y.len(),
                a.dy.len(),
                dx.len(),
                a.gamma.len(),
                a.mean.len(),
                a.invstd.len(),
                a.dgamma.len(),
                a.dbeta.len()
            ),
        ));
    }
    if c == 0 {
        return Ok(());
    }
    let (k, mdb, c2) = input_gradient_constants(rows, a.gamma, a.invstd, a.dgamma, a.dbeta);
    for (i, d) in dx[..n].iter_mut().enumerate() {
        let ch = i % c;
        let dz = if a.relu && a.y[i] <= 0.0 {
            0.0
        } else {
            a.dy[i]
        };
        let centred = (a.x[i] - a.mean[ch]) * c2[ch] + mdb[ch];
        *d = k[ch] * (dz - centred);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Σx² rebuilt as `(rows − 1)·var + rows·mean²` from a replica's f32 mean and variance
    /// does not cancel catastrophically: the sum and the subtraction of the global mean² are
    /// f64, so the variance that comes back loses about `(mean/std)²·2⁻⁵³`, below 1e-7 even at
    /// a mean of 10⁴ standard deviations. Over one replica the mean comes back exactly and the
    /// variance as its biased value; over two, as the pooled variance of the means and
    /// variances given (each replica's f32 rounding of its own mean is its op's, not this
    /// arithmetic's).
    #[test]
    fn moments_rebuilt_from_f32_means_keep_the_variance() {
        for ratio in [1.0f64, 1e2, 1e4] {
            let std = 0.25f64;
            let (mean, var) = ((ratio * std) as f32, (std * std) as f32);
            let rows = 49usize;
            let shape = BnShape { rows, channels: 1 };
            let sums = moments(shape, &[mean], &[var]).unwrap();
            let (gm, gv, n) = global_statistics(1, &sums).unwrap();
            assert_eq!((gm[0], n), (f64::from(mean), rows as f64), "ratio {ratio}");
            let biased = f64::from(var) * (rows - 1) as f64 / rows as f64;
            let err = (gv[0] - biased).abs() / biased;
            assert!(err < 1e-7, "ratio {ratio}: variance off by {err}");

            // Two replicas: 49 rows around `mean`, 15 around `mean + std`.
            let other = (f64::from(mean) + std) as f32;
            let shape2 = BnShape {
                rows: 15,
                channels: 1,
            };
            let mut total = sums.clone();
            for (t, s) in total
                .iter_mut()
                .zip(moments(shape2, &[other], &[var]).unwrap())
            {
                *t += s;
            }
            let (_, gv, n) = global_statistics(1, &total).unwrap();
            let (m0, m1, v) = (f64::from(mean), f64::from(other), f64::from(var));
            let m = (49.0 * m0 + 15.0 * m1) / n;
            let pooled =
                (48.0 * v + 14.0 * v + 49.0 * (m0 - m).powi(2) + 15.0 * (m1 - m).powi(2)) / n;
            let err = (gv[0] - pooled).abs() / pooled;
            assert!(
                err < 1e-7,
                "ratio {ratio}, two replicas: variance off by {err}"
            );
        }
    }
}
