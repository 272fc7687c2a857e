//! An exponential moving average of the weights (`--model-ema`): torchvision's reference
//! recipe (`--model-ema --model-ema-steps 32 --model-ema-decay 0.99998`).
//!
//! Every `steps` optimizer steps of an epoch (after the epoch's steps 0, `steps`, `2·steps`,
//! …) the average moves toward the replica's master weights and batch-norm statistics:
//! `avg ← avg + α·(w − avg)`, α = 1 − decay. The first update after a reset copies the
//! weights; during the warm-up epochs every update resets, so the average is the latest
//! weights until the learning rate has settled (torchvision's rule). The decay given is per
//! image-normalised update, adjusted as torchvision does so that one flag value fits any
//! batch and run length: α = min(1, (1 − decay) · global_batch · steps / epochs).
//!
//! The average lives on the writing rank, on the host (one download of the weights every
//! `steps` steps); validation runs on it after every epoch beside the live weights, and the
//! checkpoint stores it (with its update count, so a resumed run averages exactly as the
//! uninterrupted one) for `birdtrain eval --ema` and `predict --ema`.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::TrainError;
use crate::model::{BufferKind, Graph, ModelState};

/// `--model-ema-steps` and `--model-ema-decay`: the moving average of the weights as a
/// checkpoint records it (what it does: `crate::train::ModelEma`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EmaRecipe {
    /// Optimizer steps between updates (`--model-ema-steps`).
    pub steps: u32,
    /// The decay before torchvision's adjustment (`--model-ema-decay`; f64: in f32 the
    /// 1 − 0.99998 that matters would keep two digits).
    pub decay: f64,
}

impl EmaRecipe {
    /// torchvision's defaults.
    pub const TORCHVISION: Self = Self {
        steps: 32,
        decay: 0.99998,
    };
}

impl EmaRecipe {
    /// Checks both values, naming the flag of a bad one.
    pub fn validate(&self) -> Result<(), TrainError> {
        if self.steps == 0 {
            return Err(TrainError::InvalidConfig {
                flag: "--model-ema-steps",
                value: "0".into(),
                hint:
                    "optimizer steps between updates of the average, at least 1 (torchvision: 32)"
                        .into(),
            });
        }
        if !(self.decay > 0.0 && self.decay < 1.0) {
            return Err(TrainError::InvalidConfig {
                flag: "--model-ema-decay",
                value: self.decay.to_string(),
                hint: "strictly between 0 and 1 (torchvision: 0.99998, adjusted for the batch, --model-ema-steps and --epochs)".into(),
            });
        }
        Ok(())
    }

    /// The weight α of the new weights in one update, after torchvision's adjustment for a
    /// run of `epochs` epochs at `global_batch` images a step.
    pub fn alpha(&self, global_batch: usize, epochs: u64) -> f32 {
        let adjust = global_batch as f64 * f64::from(self.steps) / epochs.max(1) as f64;
        ((1.0 - self.decay) * adjust).min(1.0) as f32
    }

    /// Whether the average is updated after step `step_in_epoch` (0-based) of an epoch.
    pub fn due(&self, step_in_epoch: usize) -> bool {
        step_in_epoch % self.steps.max(1) as usize == 0
    }
}

/// Safetensors metadata key of the update count since the last reset.
const UPDATES_KEY: &str = "ema_updates";

/// The moving average of one run's weights.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelEma {
    /// The averaged parameters and buffers.
    pub state: ModelState,
    /// Updates since the last reset (0: the next update copies).
    pub updates: u64,
    alpha: f32,
    warmup_epochs: u32,
}

impl ModelEma {
    /// An average starting at `state` (a copy, as torchvision's starts) whose first update
    /// copies, or one read back from a checkpoint with its update count.
    pub fn new(state: ModelState, updates: u64, alpha: f32, warmup_epochs: u32) -> Self {
        Self {
            state,
            updates,
            alpha,
            warmup_epochs,
        }
    }

    /// The weight of the new weights in an update.
    pub fn alpha(&self) -> f32 {
        self.alpha
    }

    /// Moves the average toward `live` (the master weights and buffers after a step of
    /// `epoch`). Batch counters are copied: they count, they do not average.
    pub fn update(&mut self, graph: &Graph, live: &ModelState, epoch: u64) {
        if self.updates == 0 {
            self.state.clone_from(live);
        } else {
            let a = self.alpha;
            let lerp = |avg: &mut [f32], now: &[f32]| {
                for (m, &w) in avg.iter_mut().zip(now) {
                    *m += a * (w - *m);
                }
            };
            for (avg, now) in self.state.params.iter_mut().zip(&live.params) {
                lerp(avg, now);
            }
            let kinds = graph.buffers().iter().map(|b| b.kind);
            for ((avg, now), kind) in self.state.buffers.iter_mut().zip(&live.buffers).zip(kinds) {
                if kind == BufferKind::NumBatchesTracked {
                    avg.copy_from_slice(now);
                } else {
                    lerp(avg, now);
                }
            }
        }
        self.updates = if epoch < u64::from(self.warmup_epochs) {
            0
        } else {
            self.updates + 1
        };
    }

    /// The average as safetensors bytes, its update count in the metadata.
    pub fn to_safetensors_bytes(&self, graph: &Graph) -> Result<Vec<u8>, TrainError> {
        let meta = HashMap::from([(UPDATES_KEY.to_string(), self.updates.to_string())]);
        Ok(self.state.to_safetensors_bytes(graph, Some(meta))?)
    }

    /// The update count a checkpoint's average file records (0 when it records none).
    pub fn updates_in(bytes: &[u8]) -> u64 {
        safetensors::SafeTensors::read_metadata(bytes)
            .ok()
            .and_then(|(_, m)| m.metadata().as_ref()?.get(UPDATES_KEY)?.parse().ok())
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Arch;

    fn states(graph: &Graph) -> (ModelState, ModelState) {
        (ModelState::init(graph, 1), ModelState::init(graph, 2))
    }

    #[test]
    fn torchvisions_adjustment_scales_alpha_by_batch_steps_and_epochs() {
        let r = EmaRecipe::TORCHVISION;
        // torchvision's ImageNet recipe: 8 GPUs × 32 images, 600 epochs.
        let a = r.alpha(256, 600);
        assert!((a - 2e-5 * 256.0 * 32.0 / 600.0).abs() < 1e-9, "{a}");
        // Capped at 1: the average is then the latest weights.
        assert_eq!(
            EmaRecipe {
                steps: 32,
                decay: 0.5
            }
            .alpha(256, 1),
            1.0
        );
        assert!(r.due(0) && r.due(32) && !r.due(31));
    }

    #[test]
    fn updates_copy_then_move_toward_the_weights_and_counters_are_copied() {
        let graph = Graph::new(Arch::ResNet8, 3);
        let (start, live) = states(&graph);
        let mut ema = ModelEma::new(start.clone(), 0, 0.25, 0);
        ema.update(&graph, &live, 0);
        assert_eq!(ema.state, live, "the first update copies");
        assert_eq!(ema.updates, 1);
        let mut later = live.clone();
        for p in &mut later.params {
            p.iter_mut().for_each(|v| *v += 4.0);
        }
        for b in &mut later.buffers {
            b.iter_mut().for_each(|v| *v += 8.0);
        }
        ema.update(&graph, &later, 1);
        for (avg, old) in ema.state.params.iter().zip(&live.params) {
            for (m, w) in avg.iter().zip(old) {
                assert!((m - (w + 1.0)).abs() < 1e-5, "{m} vs {w}+1");
            }
        }
        for ((avg, old), spec) in ema
            .state
            .buffers
            .iter()
            .zip(&live.buffers)
            .zip(graph.buffers())
        {
            let want = if spec.kind == BufferKind::NumBatchesTracked {
                8.0
            } else {
                2.0
            };
            for (m, w) in avg.iter().zip(old) {
                assert!((m - (w + want)).abs() < 1e-5, "{} {m} vs {w}", spec.name);
            }
        }
        assert_eq!(ema.updates, 2);
    }

    #[test]
    fn warm_up_updates_reset_so_the_average_is_the_latest_weights() {
        let graph = Graph::new(Arch::ResNet8, 3);
        let (start, live) = states(&graph);
        let mut ema = ModelEma::new(start.clone(), 0, 0.25, 2);
        ema.update(&graph, &live, 1);
        assert_eq!(ema.updates, 0);
        ema.update(&graph, &start, 1);
        assert_eq!(ema.state, start, "a warm-up update copies");
        ema.update(&graph, &live, 2);
        assert_eq!((ema.state == live, ema.updates), (true, 1));
        ema.update(&graph, &start, 2);
        assert!(ema.state != start && ema.state != live);
    }

    #[test]
    fn the_update_count_travels_in_the_file() {
        let graph = Graph::new(Arch::ResNet8, 3);
        let (start, _) = states(&graph);
        let ema = ModelEma::new(start.clone(), 17, 0.5, 0);
        let bytes = ema.to_safetensors_bytes(&graph).unwrap();
        assert_eq!(ModelEma::updates_in(&bytes), 17);
        let back = ModelState::from_safetensors_bytes(
            &graph,
            &bytes,
            std::path::Path::new("ema"),
            crate::model::HeadPolicy::Strict,
        )
        .unwrap();
        assert_eq!(back, start);
        let plain = start.to_safetensors_bytes(&graph, None).unwrap();
        assert_eq!(ModelEma::updates_in(&plain), 0);
    }

    #[test]
    fn bad_values_name_their_flag() {
        for (recipe, flag) in [
            (
                EmaRecipe {
                    steps: 0,
                    decay: 0.9,
                },
                "--model-ema-steps",
            ),
            (
                EmaRecipe {
                    steps: 1,
                    decay: 1.0,
                },
                "--model-ema-decay",
            ),
            (
                EmaRecipe {
                    steps: 1,
                    decay: f64::NAN,
                },
                "--model-ema-decay",
            ),
        ] {
            let e = recipe.validate().unwrap_err().to_string();
            assert!(e.contains(flag), "{e}");
        }
        EmaRecipe::TORCHVISION.validate().unwrap();
    }
}
