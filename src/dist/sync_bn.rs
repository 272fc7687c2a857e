//! Synchronised batch norm across replicas (`--sync-bn`): the reducers behind
//! [`crate::model::BnAllReduce`].
//!
//! The model does the math ([`crate::model::Network::train_step_synced`]): per BN layer it
//! sums per-channel Σx, Σx² and the row count over replicas in forward, and Σdz, Σdz·x̂ in
//! backward. A reducer only sums vectors. Two exist:
//! - [`LocalBnGroup`]: R replicas in one process (threads), e.g. CPU replicas; it is also what
//!   the tests use to check the semantics against one network on the whole batch;
//! - on GPUs, the NCCL driver sums through its communicator (`train::gpu`).

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::model::{BnAllReduce, GradHookError};

/// Errors of the in-process reducer.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SyncBnError {
    /// Replicas passed vectors of different lengths (they are not running the same layer).
    #[error("replica {replica} summed {got} values while the others sum {expected}; every replica must run the same model and call in the same order")]
    LengthMismatch {
        /// The replica.
        replica: usize,
        /// Its length.
        got: usize,
        /// The group's.
        expected: usize,
    },
    /// Not every replica arrived in time (one failed or stopped).
    #[error("replica {replica} waited {waited:?} for the other replicas' batch-norm statistics; one of them stopped")]
    Timeout {
        /// The waiting replica.
        replica: usize,
        /// How long.
        waited: Duration,
    },
    /// Another replica panicked while holding the group's lock.
    #[error("the batch-norm group's lock is poisoned (a replica panicked)")]
    Poisoned,
}

#[derive(Debug)]
struct Round {
    /// Running sum of this round.
    acc: Vec<f64>,
    /// Replicas that added their values this round.
    arrived: usize,
    /// The last completed round's result, and its round number.
    result: Vec<f64>,
    generation: u64,
}

#[derive(Debug)]
struct Shared {
    replicas: usize,
    timeout: Duration,
    round: Mutex<Round>,
    done: Condvar,
}

/// One replica's handle on an in-process group of R replicas summing BN statistics.
#[derive(Debug)]
pub struct LocalBnGroup {
    shared: Arc<Shared>,
    replica: usize,
}

impl LocalBnGroup {
    /// Handles for `replicas` replicas (give one to each replica's thread). A replica that
    /// waits longer than `timeout` for the others gets an error instead of hanging.
    pub fn new(replicas: usize, timeout: Duration) -> Vec<LocalBnGroup> {
        let shared = Arc::new(Shared {
            replicas: replicas.max(1),
            timeout,
            round: Mutex::new(Round {
                acc: Vec::new(),
                arrived: 0,
                result: Vec::new(),
                generation: 0,
            }),
            done: Condvar::new(),
        });
        (0..replicas)
            .map(|replica| LocalBnGroup {
                shared: shared.clone(),
                replica,
            })
            .collect()
    }

    fn sum(&self, values: &mut [f64]) -> Result<(), SyncBnError> {
        let s = &self.shared;
        let mut round = s.round.lock().map_err(|_| SyncBnError::Poisoned)?;
        if round.arrived == 0 {
            round.acc = vec![0.0; values.len()];
        } else if round.acc.len() != values.len() {
            return Err(SyncBnError::LengthMismatch {
                replica: self.replica,
                got: values.len(),
                expected: round.acc.len(),
            });
        }
        for (a, v) in round.acc.iter_mut().zip(values.iter()) {
            *a += v;
        }
        round.arrived += 1;
        let generation = round.generation;
        if round.arrived == s.replicas {
            // Last to arrive: publish, open the next round, wake the others.
            round.result = std::mem::take(&mut round.acc);
            round.arrived = 0;
            round.generation += 1;
            values.copy_from_slice(&round.result);
            s.done.notify_all();
            return Ok(());
        }
        let (round, wait) = s
            .done
            .wait_timeout_while(round, s.timeout, |r| r.generation == generation)
            .map_err(|_| SyncBnError::Poisoned)?;
        if wait.timed_out() {
            return Err(SyncBnError::Timeout {
                replica: self.replica,
                waited: s.timeout,
            });
        }
        // The next round cannot complete before this replica joins it, so `result` is still
        // this round's.
        values.copy_from_slice(&round.result);
        Ok(())
    }
}

impl BnAllReduce for LocalBnGroup {
    fn sum_in_place(&mut self, values: &mut [f64]) -> Result<(), GradHookError> {
        Ok(self.sum(values)?)
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
                .map(|mut g| {
                    s.spawn(move || {
                        (0..50)
                            .map(|round| {
                                let mut v = vec![g.replica as f64, round as f64, 1.0];
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
        let lonely = LocalBnGroup::new(2, Duration::from_millis(50));
        let e = lonely[0].sum(&mut [1.0]).unwrap_err();
        assert!(matches!(e, SyncBnError::Timeout { replica: 0, .. }), "{e}");
    }
}
