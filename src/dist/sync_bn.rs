//! Synchronised batch norm across ranks (`--sync-bn`): the reducers behind
//! [`crate::model::BnAllReduce`].
//!
//! The model and its backend do the math ([`crate::model::Network::train_step_synced`],
//! [`crate::backend::bn_sync`]): per BN layer they sum per-channel Σx, Σx² and the row count
//! over ranks in forward, and Σdz, Σdz·x̂ in backward. A reducer only sums vectors where the
//! backend keeps them ([`Collective::sum_sums`]: host memory on the CPU, device memory on a
//! GPU, which NCCL sums on the device), which any [`Collective`] does ([`CollectiveBn`]);
//! [`LocalBnGroup`] is a group of in-process ranks made for it, which the tests use to check
//! the semantics against one network on the whole batch (GPU replicas through the host).

use std::time::Duration;

use super::collective::Collective;
use super::local::{LocalCollective, LocalGroup};
use crate::backend::SumsMut;
use crate::model::{BnAllReduce, GradHookError};

/// [`BnAllReduce`] over a collective's [`Collective::sum`].
#[derive(Debug)]
pub struct CollectiveBn<'a, C: Collective + ?Sized>(pub &'a mut C);

impl<C: Collective + ?Sized> BnAllReduce for CollectiveBn<'_, C> {
    fn sum_in_place(&mut self, values: &mut [f64]) -> Result<(), GradHookError> {
        Ok(self.0.sum(values)?)
    }

    fn sum_sums(&mut self, sums: SumsMut<'_>) -> Result<(), GradHookError> {
        Ok(self.0.sum_sums(sums)?)
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

    fn sum_sums(&mut self, sums: SumsMut<'_>) -> Result<(), GradHookError> {
        Ok(self.comm.sum_sums(sums)?)
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
    /// Device-resident sums, faked in host memory; counts the copies to and from the host.
    struct FakeDeviceSums {
        values: Vec<f64>,
        uploads: usize,
    }

    impl crate::backend::DeviceSums for FakeDeviceSums {
        fn device_ptr(&self) -> u64 {
            self.values.as_ptr() as u64
        }
        fn len(&self) -> usize {
            self.values.len()
        }
        fn download(&self) -> Result<Vec<f64>, crate::backend::BackendError> {
            Ok(self.values.clone())
        }
        fn upload(&mut self, values: &[f64]) -> Result<(), crate::backend::BackendError> {
            self.uploads += 1;
            self.values.copy_from_slice(values);
            Ok(())
        }
    }

    #[test]
    fn device_sums_and_a_replaying_ranks_host_zeros_meet_in_the_same_sum() {
        // Ranks 0 and 1 hold a step's images (their backend's sums, device-resident); rank 2
        // has none and replays the step with host zeros: one call each, one round, one total.
        let group = LocalGroup::ranks(3, Duration::from_secs(30));
        let results: Vec<Vec<f64>> = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .into_iter()
                .enumerate()
                .map(|(rank, mut comm)| {
                    s.spawn(move || {
                        let mut last = Vec::new();
                        for round in 0..3 {
                            let base = (rank + 1) as f64 * (round + 1) as f64;
                            if rank == 2 {
                                let mut zeros = vec![0.0; 5];
                                comm.sum_sums(SumsMut::Host(&mut zeros)).unwrap();
                                last = zeros;
                            } else {
                                let mut d = FakeDeviceSums {
                                    values: vec![base; 5],
                                    uploads: 0,
                                };
                                CollectiveBn(&mut comm)
                                    .sum_sums(SumsMut::Device(&mut d))
                                    .unwrap();
                                // Without a device path the total comes back through the host.
                                assert_eq!(d.uploads, 1);
                                last = d.values;
                            }
                        }
                        last
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // The third round: 1·3 + 2·3 + 0 on every rank.
        for r in &results {
            assert_eq!(r, &vec![9.0; 5]);
        }
    }
}
