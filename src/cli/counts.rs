//! Count flags checked against what this machine can serve (cores), before any work starts:
//! an absurd `--threads` or `--workers` is one clear error instead of a hang or a panic.
//! Counts that depend on the dataset (`--replicas` against its images, `--batch-size`
//! against memory) are checked by the input engine once it has scanned the images.

use pipeline::limits;

use super::CliError;
use crate::train::TrainConfig;

/// CPU backend threads allowed per available core: compute threads beyond the cores only
/// wait for each other, a few per core still leave room for cgroup quotas that undercount.
pub(crate) const THREADS_PER_CORE: usize = 4;

/// Checks `--threads`, `--workers`, and that `--replicas × --batch-size` is a number.
pub(crate) fn check_train_counts(cfg: &TrainConfig) -> Result<(), CliError> {
    check_threads(cfg.threads)?;
    check_workers(cfg.workers)?;
    if cfg.replicas.checked_mul(cfg.batch_size).is_none() {
        return Err(CliError::BadValue {
            flag: "--batch-size",
            value: cfg.batch_size.to_string(),
            hint: format!(
                "{} replicas × {} images per step overflows; use a smaller --batch-size",
                cfg.replicas, cfg.batch_size
            ),
        });
    }
    Ok(())
}

/// `--threads N` (0: one per core) is at most [`THREADS_PER_CORE`] per available core.
pub(crate) fn check_threads(threads: usize) -> Result<(), CliError> {
    let cores = limits::cores();
    let max = THREADS_PER_CORE * cores;
    if threads > max {
        return Err(CliError::BadValue {
            flag: "--threads",
            value: threads.to_string(),
            hint: format!(
                "at most {max} ({THREADS_PER_CORE} per core, {cores} cores available); \
                 leave it out for one per core"
            ),
        });
    }
    Ok(())
}

/// `--workers N` (0: one per core) is at most the input engine's limit per core.
pub(crate) fn check_workers(workers: usize) -> Result<(), CliError> {
    let cores = limits::cores();
    let max = limits::max_workers();
    if workers > max {
        return Err(CliError::BadValue {
            flag: "--workers",
            value: workers.to_string(),
            hint: format!(
                "at most {max} decode threads ({} per core, {cores} cores available); \
                 leave it out for one per core",
                limits::WORKERS_PER_CORE
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_up_to_the_limit_pass_and_beyond_it_name_the_flag() {
        let cores = limits::cores();
        assert!(check_threads(0).is_ok());
        assert!(check_threads(THREADS_PER_CORE * cores).is_ok());
        let e = check_threads(THREADS_PER_CORE * cores + 1).unwrap_err();
        assert!(e.to_string().contains("--threads"), "{e}");
        assert!(check_workers(limits::max_workers()).is_ok());
        let e = check_workers(100_000).unwrap_err().to_string();
        assert!(e.contains("--workers") && e.contains("100000"), "{e}");
        let mut cfg = TrainConfig::new(std::path::Path::new("d"));
        cfg.replicas = 2;
        cfg.batch_size = usize::MAX;
        let e = check_train_counts(&cfg).unwrap_err().to_string();
        assert!(e.contains("--batch-size") && e.contains("overflows"), "{e}");
    }
}
