//! The machine time a run used, per segment: each invocation of the trainer on a run (the
//! first, then each `--resume`) is one segment, with its devices, ranks, seconds and the price
//! per device-hour it was given (`--price-per-hour`). A resumed run may run on another device
//! count or another machine at another price, so the price is not a recorded setting but a
//! figure of its segment.
//!
//! The segments are part of the checkpoint's record (`checkpoint.json`'s `machine_time`), so
//! they are committed with the checkpoint they lead to: a segment's seconds run from the start
//! of its invocation to the checkpoint, and the time a killed run spent after its last
//! checkpoint is not counted (nothing of it was kept). Checkpoints of older versions have no
//! segments: their time is unknown.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::names::SIDECAR_FILE;

/// One invocation's share of a run's machine time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    /// Devices it paid for: GPUs on GPU runs (every node's), machines (nodes) on CPU runs.
    pub devices: usize,
    /// Ranks (replicas) it trained with.
    pub ranks: usize,
    /// Seconds from its start to its last checkpoint.
    pub seconds: f64,
    /// Price of one device for one hour (`--price-per-hour`), when it was given.
    pub price_per_hour: Option<f64>,
}

impl Segment {
    /// Device-hours: devices × hours.
    pub fn device_hours(&self) -> f64 {
        self.devices as f64 * self.seconds / 3600.0
    }

    /// Device-hours × price, when the price is known.
    pub fn cost(&self) -> Option<f64> {
        self.price_per_hour.map(|p| p * self.device_hours())
    }
}

/// What a run's segments add up to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MachineTime {
    /// Segments.
    pub segments: usize,
    /// Seconds of every segment.
    pub seconds: f64,
    /// Device-hours of every segment.
    pub device_hours: f64,
    /// The price of every segment, when each had one.
    pub cost: Option<f64>,
}

impl MachineTime {
    /// The sums of `segments`; `None` when there are none (a checkpoint of an older version).
    pub fn of(segments: &[Segment]) -> Option<MachineTime> {
        if segments.is_empty() {
            return None;
        }
        Some(MachineTime {
            segments: segments.len(),
            seconds: segments.iter().map(|s| s.seconds).sum(),
            device_hours: segments.iter().map(Segment::device_hours).sum(),
            cost: segments.iter().map(Segment::cost).sum(),
        })
    }

    /// The summary's line: "machine time 12.3 s in 2 segments · 0.0068 device-hours · cost
    /// 0.0171" (the cost when every segment had a price).
    pub fn line(&self) -> String {
        let segments = match self.segments {
            1 => String::new(),
            n => format!(" in {n} segments"),
        };
        let cost = self
            .cost
            .map_or(String::new(), |c| format!(" · cost {}", money(c)));
        format!(
            "machine time {:.1} s{segments} · {:.4} device-hours{cost}",
            self.seconds, self.device_hours
        )
    }
}

/// The segments the checkpoint in run folder `run` records, read from its sidecar alone
/// (nothing is checked: for the summary of the run that just wrote it); empty when there is
/// no checkpoint or it records none.
pub fn recorded(run: &Path) -> Vec<Segment> {
    #[derive(Deserialize)]
    struct Record {
        #[serde(default)]
        machine_time: Vec<Segment>,
    }
    std::fs::read_to_string(run.join(SIDECAR_FILE))
        .ok()
        .and_then(|text| serde_json::from_str::<Record>(&text).ok())
        .map_or_else(Vec::new, |r| r.machine_time)
}

/// A price with four significant decimals for small sums, two for large ones.
pub fn money(value: f64) -> String {
    if value.abs() >= 100.0 {
        format!("{value:.2}")
    } else {
        format!("{value:.4}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cost_sums_the_segments_and_is_unknown_when_one_has_no_price() {
        let a = Segment {
            devices: 4,
            ranks: 4,
            seconds: 1800.0,
            price_per_hour: Some(2.0),
        };
        let b = Segment {
            devices: 2,
            ranks: 2,
            seconds: 3600.0,
            price_per_hour: Some(3.0),
        };
        let t = MachineTime::of(&[a.clone(), b.clone()]).unwrap();
        assert_eq!((t.segments, t.seconds, t.device_hours), (2, 5400.0, 4.0));
        assert_eq!(t.cost, Some(4.0 + 6.0));
        assert_eq!(
            t.line(),
            "machine time 5400.0 s in 2 segments · 4.0000 device-hours · cost 10.0000"
        );
        let unpriced = Segment {
            price_per_hour: None,
            ..b
        };
        let t = MachineTime::of(&[a, unpriced]).unwrap();
        assert_eq!(t.cost, None);
        assert!(!t.line().contains("cost"), "{}", t.line());
        assert_eq!(MachineTime::of(&[]), None);
    }
}
