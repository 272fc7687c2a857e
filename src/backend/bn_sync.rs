//! Synchronised batch norm's per-channel sums: what the replicas add up, where a backend keeps
//! them, and the host reference of the arithmetic around the sum.
//!
//! A synchronised BN layer (`--sync-bn`) sums, over every replica, `2·channels + 1` values in
//! forward (Σx, Σx², rows) and `2·channels` in backward (Σdz·x̂, Σdz, each on the global loss's
//! scale). The backend packs them from its own tensors into [`Backend::Sums`] (f64), a
//! reducer sums them in place where they are ([`SumsMut`]: host memory, or device memory that
//! a GPU collective reduces without a host round trip), and the backend turns the sums into
//! the global statistics and the gradient correction. The functions here are that arithmetic
//! on the host, in f64: the trait's default implementations (the CPU backend's) and the
//! reference the CUDA kernels follow.
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

/// Backward, after the sum: the per-channel correction `dx += a + b·x` that turns the frozen
/// statistics' backward into the global one, `−γ·invstd·(Σdβ/N + x̂·Σdγ/N)` written as an
/// affine map of the input. The global mean of a sum, on this replica's scale, is the sum over
/// this replica's rows.
pub fn backward_coefficients(
    shape: BnShape,
    sums: &[f64],
    gamma: &[f32],
    mean: &[f32],
    invstd: &[f32],
) -> Result<(Vec<f32>, Vec<f32>), BackendError> {
    let c = shape.channels;
    if sums.len() != grad_sums_len(c) || gamma.len() < c || mean.len() < c || invstd.len() < c {
        return Err(shape_error(
            "bn_sync_backward",
            format!(
                "{c} channels, {} sums, gamma {} mean {} invstd {}",
                sums.len(),
                gamma.len(),
                mean.len(),
                invstd.len()
            ),
        ));
    }
    let rows = shape.rows as f64;
    let mut a = vec![0.0f32; c];
    let mut b = vec![0.0f32; c];
    for ch in 0..c {
        let mdg = sums[ch] / rows;
        let mdb = sums[c + ch] / rows;
        let is = f64::from(invstd[ch]);
        let kk = f64::from(gamma[ch]) * is;
        a[ch] = (-kk * mdb + kk * is * f64::from(mean[ch]) * mdg) as f32;
        b[ch] = (-kk * is * mdg) as f32;
    }
    Ok((a, b))
}
