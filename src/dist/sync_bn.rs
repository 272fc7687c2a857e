//! Synchronised batch norm across ranks (`--sync-bn`): the reducers behind
//! [`crate::model::BnAllReduce`].
//!
//! The model does the math ([`crate::model::Network::train_step_synced`]): per BN layer it
//! sums per-channel Σx, Σx² and the row count over ranks in forward, and Σdz, Σdz·x̂ in
//! backward. A reducer only sums vectors, which any [`Collective`] does
//! ([`CollectiveBn`]); [`LocalBnGroup`] is a group of in-process ranks made for it, which the
//! tests use to check the semantics against one network on the whole batch.

use std::time::Duration;

use super::collective::Collective;
use super::local::{LocalCollective, LocalGroup};
use crate::model::{BnAllReduce, GradHookError};

/// [`BnAllReduce`] over a collective's [`Collective::sum`].
#[derive(Debug)]
pub struct CollectiveBn<'a, C: Collective + ?Sized>(pub &'a mut C);

impl<C: Collective + ?Sized> BnAllReduce for CollectiveBn<'_, C> {
    fn sum_in_place(&mut self, values: &mut [f64]) -> Result<(), GradHookError> {
        Ok(self.0.sum(values)?)
    }
}

/// One replica's handle on an in-process group of R replicas summing BN statistics.
#[derive(Debug)]
pub struct LocalBnGroup {
    comm: LocalCollective,
}

impl LocalBnGroup {
    /// Handles for `replicas` replicas (give one to each replica's thread). A replica that
    /// waits longer than `timeout` for the others gets an error instead of hanging.
    pub fn new(replicas: usize, timeout: Duration) -> Vec<LocalBnGroup> {
        LocalGroup::ranks(replicas, timeout)
            .into_iter()
            .map(|comm| LocalBnGroup { comm })
            .collect()
    }
}

impl BnAllReduce for LocalBnGroup {
    fn sum_in_place(&mut self, values: &mut [f64]) -> Result<(), GradHookError> {
        Ok(self.comm.sum(values)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_replicas_sum_many_rounds_and_a_missing_one_times_out() {
        let group = LocalBnGroup::new(3, Duration::from_secs(30));
        let results: Vec<Vec<Vec<f64>>> = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .into_iter()
                .enumerate()
                .map(|(replica, mut g)| {
                    s.spawn(move || {
                        (0..50)
                            .map(|round| {
                                let mut v = vec![replica as f64, round as f64, 1.0];
                                g.sum_in_place(&mut v).unwrap();
                                v
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for per_replica in &results {
            for (round, v) in per_replica.iter().enumerate() {
                assert_eq!(v, &vec![3.0, 3.0 * round as f64, 3.0]);
            }
        }
        let mut lonely = LocalBnGroup::new(2, Duration::from_millis(50));
        let e = lonely[0].sum_in_place(&mut [1.0]).unwrap_err().to_string();
        assert!(e.contains("rank 1 never joined"), "{e}");
    }
}
