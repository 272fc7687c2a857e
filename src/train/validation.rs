//! The validation at an epoch end, sharded over the ranks.
//!
//! Every rank evaluates its slice of the validation split (the engine slices it over the
//! ranks as it slices training batches, in file order) with its replica, whose weights are
//! every rank's (the checksum comparison before proves it), and, with `--model-ema`, with the
//! moving average, which rank 0 keeps and broadcasts first ([`Rank::shared_average`]). One
//! sum then combines the shares' figures (loss, top-1 and top-5 hits, images) and the ranks'
//! stop flags, so every rank holds the whole split's figures, equal to one rank's validation
//! up to the order of the f32 loss sums, and N − 1 devices do not idle while rank 0 validates.
//! The sum waits under `--epoch-end-timeout`: the ranks reach it after passes of their own.

use std::time::Instant;

use super::evaluate::{evaluate_share_until, Views};
use super::folder::metrics::{EpochMetrics, MetricsAccumulator, MetricsSplit};
use super::progress::EpochBar;
use super::rank::{Device, Rank};
use super::setup::Shared;
use super::TrainError;
use crate::dist::collective::Collective;

/// The figures of one pass that add up over the shares: loss sum, top-1 hits, top-5 hits,
/// images.
const PASS_LEN: usize = 4;

/// What an epoch's validation gave every rank.
#[derive(Debug, Clone)]
pub(crate) enum Validation {
    /// Some rank was stopped (Ctrl-C, SIGTERM) during its pass: the figures are incomplete.
    Stopped,
    /// The whole split's figures.
    Done(EpochFigures),
}

/// The validation figures of one epoch, the same on every rank.
#[derive(Debug, Clone)]
pub(crate) struct EpochFigures {
    /// The replica's weights.
    pub valid: EpochMetrics,
    /// The moving average of the weights (`--model-ema`).
    pub average: Option<EpochMetrics>,
    /// Images this rank evaluated (its share, once per pass).
    pub own_images: u64,
}

/// Validates epoch `epoch` (counted from 1) on every rank; `stop` is asked before every batch.
/// Every rank must call it at the same point.
pub(crate) fn validate<D: Device>(
    shared: &Shared,
    rank: &mut Rank<D>,
    epoch: u64,
    stop: &dyn Fn() -> bool,
) -> Result<Validation, TrainError> {
    let cfg = &shared.cfg;
    let started = Instant::now();
    let average = rank.shared_average(shared)?;
    let bar = EpochBar::new(
        rank.is_writer() && cfg.progress && cfg.verbose,
        format!("epoch {epoch}/{} valid", cfg.epochs),
        shared.valid_pipe.steps_per_epoch(),
        0,
    );
    let pipe = &shared.valid_pipe;
    let share = rank.rank;
    let live = evaluate_share_until(&mut rank.net, pipe, share, Views::AsStored, stop)?;
    let live_done = started.elapsed();
    let averaged = match (&live, &average) {
        (Some(_), Some(state)) => {
            // The replica's own weights go back bit for bit: read in the form it holds them.
            let own = rank.net.state()?;
            rank.net.load_state(state)?;
            let report = evaluate_share_until(&mut rank.net, pipe, share, Views::AsStored, stop);
            rank.net.load_state(&own)?;
            report?
        }
        _ => None,
    };
    bar.finish();
    let stopped = live.is_none() || (average.is_some() && averaged.is_none());
    let mut sums = vec![f64::from(u8::from(stopped))];
    let own_images = [&live, &averaged]
        .iter()
        .filter_map(|r| r.as_ref())
        .map(|r| r.totals.count)
        .sum();
    sums.extend(pass_sums(live.as_ref().map(|r| &r.totals)));
    if average.is_some() {
        sums.extend(pass_sums(averaged.as_ref().map(|r| &r.totals)));
    }
    rank.comm
        .sum_within(&mut sums, cfg.dist.epoch_end_timeout())?;
    if sums[0] > 0.5 {
        return Ok(Validation::Stopped);
    }
    // The wait for the other ranks' shares counts in the last pass's time.
    let total = started.elapsed().as_secs_f64();
    let (live_seconds, average_seconds) = match average {
        Some(_) => (live_done.as_secs_f64(), total - live_done.as_secs_f64()),
        None => (total, 0.0),
    };
    let line = |at: usize, seconds: f64, split| {
        combined(&sums[at..at + PASS_LEN], seconds).finish(epoch, split)
    };
    Ok(Validation::Done(EpochFigures {
        valid: line(1, live_seconds, MetricsSplit::Valid),
        average: average
            .is_some()
            .then(|| line(1 + PASS_LEN, average_seconds, MetricsSplit::ValidEma)),
        own_images,
    }))
}

/// A pass's figures as the values the ranks sum (zeros for a pass that was stopped).
fn pass_sums(totals: Option<&MetricsAccumulator>) -> [f64; PASS_LEN] {
    totals.map_or([0.0; PASS_LEN], |t| {
        [
            t.loss_sum,
            t.correct_top1 as f64,
            t.correct_top5 as f64,
            t.count as f64,
        ]
    })
}

/// The whole split's figures from the summed values of its shares (the counts are exact in
/// f64: far below 2^53).
fn combined(sums: &[f64], seconds: f64) -> MetricsAccumulator {
    MetricsAccumulator {
        loss_sum: sums[0],
        correct_top1: sums[1].round() as u64,
        correct_top5: sums[2].round() as u64,
        count: sums[3].round() as u64,
        seconds,
        wait_seconds: 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_round_trips_through_its_sums_and_a_stopped_one_adds_nothing() {
        let totals = MetricsAccumulator {
            loss_sum: 12.375,
            correct_top1: 7,
            correct_top5: 11,
            count: 13,
            seconds: 2.0,
            wait_seconds: 0.0,
        };
        let back = combined(&pass_sums(Some(&totals)), 2.0);
        assert_eq!(back, totals);
        assert_eq!(pass_sums(None), [0.0; PASS_LEN]);
    }
}
