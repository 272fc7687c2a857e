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
    if cfg
        .replicas
        .checked_mul(cfg.batch_size)
        .and_then(|b| b.checked_mul(cfg.grad_accum_steps as usize))
        .is_none()
    {
        return Err(CliError::BadValue {
            flag: "--batch-size",
            value: cfg.batch_size.to_string(),
            hint: format!(
                "{} replicas × {} images per step{} overflows; use a smaller --batch-size",
                cfg.replicas,
                cfg.batch_size,
                if cfg.grad_accum_steps > 1 {
                    format!(" × {} accumulation steps", cfg.grad_accum_steps)
                } else {
                    String::new()
                }
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

/// The most classes a benchmark's classifier head may have (ImageNet-21k has 21 841): more
/// only spends minutes initialising a head no dataset needs.
pub(crate) const MAX_BENCH_CLASSES: usize = 1_000_000;

/// A count flag that must lie in `min..=max` (`hint` says what it is for).
pub(crate) fn check_range(
    flag: &'static str,
    value: usize,
    min: usize,
    max: usize,
    hint: &str,
) -> Result<(), CliError> {
    if (min..=max).contains(&value) {
        return Ok(());
    }
    let range = if max == usize::MAX {
        format!("at least {min}")
    } else {
        format!("from {min} to {max}")
    };
    Err(CliError::BadValue {
        flag,
        value: value.to_string(),
        hint: format!("{range} ({hint})"),
    })
}

/// `--classes` of the benchmarks: 1 to [`MAX_BENCH_CLASSES`].
pub(crate) fn check_bench_classes(classes: usize) -> Result<(), CliError> {
    check_range(
        "--classes",
        classes,
        1,
        MAX_BENCH_CLASSES,
        "the classifier head's outputs; 285 for the birds set",
    )
}

/// `--image-size` of the benchmarks: the range training accepts.
pub(crate) fn check_bench_image_size(size: u32) -> Result<(), CliError> {
    check_range(
        "--image-size",
        size as usize,
        8,
        1024,
        "the image side in pixels, as training's --image-size",
    )
}

/// A flag that must be a finite number above 0 (`hint` says what it is for).
pub(crate) fn check_positive(flag: &'static str, value: f64, hint: &str) -> Result<(), CliError> {
    if value > 0.0 && value.is_finite() {
        return Ok(());
    }
    Err(CliError::BadValue {
        flag,
        value: value.to_string(),
        hint: format!("a number above 0 ({hint})"),
    })
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

    #[test]
    fn bench_values_out_of_range_name_the_flag_and_the_value() {
        assert!(check_bench_classes(1).is_ok() && check_bench_classes(285).is_ok());
        let e = check_bench_classes(0).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        let e = e.to_string();
        assert!(e.starts_with("invalid value `0` for --classes"), "{e}");
        let e = check_bench_image_size(0).unwrap_err().to_string();
        assert!(
            e.contains("--image-size") && e.contains("from 8 to 1024"),
            "{e}"
        );
        let e = check_range("--steps", 0, 1, usize::MAX, "timed steps")
            .unwrap_err()
            .to_string();
        assert!(e.contains("--steps") && e.contains("at least 1"), "{e}");
        assert!(check_positive("--step-ms", 1.5, "ms").is_ok());
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = check_positive("--step-ms", bad, "ms")
                .unwrap_err()
                .to_string();
            assert!(e.contains("--step-ms"), "{e}");
        }
    }
}
