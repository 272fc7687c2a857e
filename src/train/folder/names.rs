//! The names of a run folder's own files, which the checkpoint and the record of the training
//! files both use (each imports them from here, neither from the other).

/// File name of the JSON sidecar inside a run folder.
pub const SIDECAR_FILE: &str = "checkpoint.json";
/// Stable name of the current weights inside a run folder (a link to the file the sidecar
/// names).
pub const MODEL_FILE: &str = "model.safetensors";
/// Stable name of the current optimizer state inside a run folder.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Stable name of the current moving average of the weights (`--model-ema`).
pub const MODEL_EMA_FILE: &str = "model_ema.safetensors";
/// The folder inside a run folder that holds the best epoch's checkpoint (itself a run
/// folder: `eval`, `predict` and `--resume` take it).
pub const BEST_DIR: &str = "best";
/// File name of the metrics inside a run folder.
pub const METRICS_FILE: &str = "metrics.jsonl";
