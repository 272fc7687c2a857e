//! What the ranks agree on each step, and what each GPU reports: the step totals and stop
//! flag reduced across ranks, the replica weight checksum, and the data-wait line.

use crate::dist::staging::{DataWaitMeter, StagingStats};
use crate::model::StepStats;

/// Errors the ranks detect about each other.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum AgreementError {
    /// A replica's weights differ from rank 0's: the data-parallel invariant broke.
    #[error(
        "rank {rank}: weights diverged from rank 0 at step {step} (checksum {mine:016x} vs {reference:016x}); \
         hint: a non-deterministic kernel or a missed all-reduce bucket"
    )]
    Diverged {
        /// The rank that noticed.
        rank: usize,
        /// Optimizer step.
        step: u64,
        /// Its checksum.
        mine: u64,
        /// Rank 0's.
        reference: u64,
    },
}

/// True when the weight checksum is compared at this (1-based) global step.
pub(crate) fn checksum_due(step: u64, every: u64) -> bool {
    every > 0 && step > 0 && step % every == 0
}

/// A u64 checksum as two f64 halves (exact: each half is below 2^32), so NCCL can broadcast it
/// in a type every NCCL build supports.
pub(crate) fn checksum_to_f64(sum: u64) -> [f64; 2] {
    [(sum >> 32) as f64, (sum & 0xffff_ffff) as f64]
}

/// The inverse of [`checksum_to_f64`].
pub(crate) fn checksum_from_f64(halves: [f64; 2]) -> u64 {
    ((halves[0] as u64) << 32) | (halves[1] as u64 & 0xffff_ffff)
}

/// Compares this rank's checksum with rank 0's.
pub(crate) fn compare_checksum(
    rank: usize,
    step: u64,
    mine: u64,
    reference: u64,
) -> Result<(), AgreementError> {
    if mine == reference {
        Ok(())
    } else {
        Err(AgreementError::Diverged {
            rank,
            step,
            mine,
            reference,
        })
    }
}

/// Length of the per-step reduction vector.
pub(crate) const TOTALS_LEN: usize = 5;

/// One rank's step: loss sum, top-1 and top-5 hits, images, and 1.0 when it wants to stop.
/// Summed over ranks (one small all-reduce), every rank learns the global metrics and whether
/// any rank was asked to stop, so all stop after the same step (no collective left waiting).
pub(crate) fn pack_totals(stats: &StepStats, stop: bool) -> [f64; TOTALS_LEN] {
    [
        stats.loss_sum,
        stats.correct_top1 as f64,
        stats.correct_top5 as f64,
        stats.count as f64,
        if stop { 1.0 } else { 0.0 },
    ]
}

/// The summed vector back as global stats and the agreed stop flag.
pub(crate) fn unpack_totals(v: [f64; TOTALS_LEN]) -> (StepStats, bool) {
    let stats = StepStats {
        loss_sum: v[0],
        correct_top1: v[1].round() as usize,
        correct_top5: v[2].round() as usize,
        count: v[3].round() as usize,
    };
    (stats, v[4] > 0.5)
}

/// One GPU's input report: `GPU 0 (rank 0): data wait 0.4 % of 120 steps (…)`.
pub(crate) fn data_wait_line(
    rank: usize,
    ordinal: usize,
    meter: &DataWaitMeter,
    staging: &StagingStats,
    depth: usize,
) -> String {
    let verdict = match meter.share() {
        s if s < 0.02 => "compute-bound: input keeps up",
        s if s < 0.10 => "input mostly keeps up",
        _ => "input-bound: more --workers, a warm cache or a larger --prefetch-depth",
    };
    format!(
        "GPU {ordinal} (rank {rank}): data wait {:.1} % of {:.1} s over {} steps · {} of {} batches not uploaded when compute wanted them · {} host waits on a busy slot (depth {depth}) · {verdict}",
        100.0 * meter.share(),
        meter.total.as_secs_f64(),
        meter.steps,
        staging.compute_stalls,
        staging.batches,
        staging.host_waits,
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn checksums_survive_the_f64_round_trip_exactly() {
        for sum in [
            0u64,
            1,
            u64::MAX,
            0x0123_4567_89ab_cdef,
            1 << 32,
            (1 << 32) - 1,
        ] {
            assert_eq!(checksum_from_f64(checksum_to_f64(sum)), sum);
        }
    }

    #[test]
    fn a_different_checksum_is_a_divergence_naming_rank_and_step() {
        assert_eq!(compare_checksum(1, 10, 5, 5), Ok(()));
        let e = compare_checksum(3, 40, 6, 5).unwrap_err();
        let text = e.to_string();
        assert!(
            text.starts_with("rank 3: weights diverged from rank 0 at step 40"),
            "{text}"
        );
    }

    #[test]
    fn checksums_are_due_every_n_steps_and_never_with_zero() {
        let due: Vec<u64> = (0..=10).filter(|&s| checksum_due(s, 4)).collect();
        assert_eq!(due, vec![4, 8]);
        assert!(!(0..100).any(|s| checksum_due(s, 0)));
    }

    #[test]
    fn summed_totals_give_global_metrics_and_one_stop_stops_all() {
        let a = StepStats {
            loss_sum: 2.5,
            correct_top1: 3,
            correct_top5: 7,
            count: 8,
        };
        let b = StepStats {
            loss_sum: 1.5,
            correct_top1: 1,
            correct_top5: 8,
            count: 8,
        };
        let (pa, pb) = (pack_totals(&a, false), pack_totals(&b, true));
        let sum: Vec<f64> = pa.iter().zip(&pb).map(|(x, y)| x + y).collect();
        let (total, stop) = unpack_totals(sum.try_into().unwrap());
        assert_eq!(
            (
                total.loss_sum,
                total.correct_top1,
                total.correct_top5,
                total.count
            ),
            (4.0, 4, 15, 16)
        );
        assert!(stop);
        let none = pack_totals(&a, false);
        assert!(!unpack_totals(none).1);
    }

    #[test]
    fn the_data_wait_line_gives_the_share_and_a_verdict() {
        let mut meter = DataWaitMeter::default();
        meter.record(Duration::from_millis(1), Duration::from_millis(100));
        meter.record(Duration::from_millis(0), Duration::from_millis(100));
        let stats = StagingStats {
            batches: 2,
            ..StagingStats::default()
        };
        let line = data_wait_line(1, 3, &meter, &stats, 2);
        assert!(
            line.starts_with("GPU 3 (rank 1): data wait 0.5 % of 0.2 s over 2 steps"),
            "{line}"
        );
        assert!(line.contains("compute-bound"), "{line}");
        meter.record(Duration::from_millis(100), Duration::from_millis(100));
        assert!(data_wait_line(0, 0, &meter, &stats, 2).contains("input-bound"));
    }
}
