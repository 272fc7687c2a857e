//! The training flags (and, with `--resume`, the checkpoint's settings) turned into a
//! [`TrainConfig`].

use std::path::{Path, PathBuf};
use std::str::FromStr;

use super::launcher;
use super::settings_args::{EngineArgs, RecipeArgs};
use super::train_args::{BatchSize, TrainArgs};
use super::CliError;
use crate::dist::launch::{self, LaunchPlan};
use crate::model::Arch;
use crate::optim::{Decay, OptimizerChoice};
use crate::train::{
    self, Augmentation, CheckpointMeta, DeviceChoice, EmaRecipe, TrainConfig, TrainError,
};

/// The variable that gives `--price-per-hour` when the flag is not given.
pub const PRICE_ENV: &str = "BIRDTRAIN_PRICE_PER_HOUR";

/// `--price-per-hour`, else [`PRICE_ENV`] (the flag wins): a finite number ≥ 0, or refused
/// naming the one it came from.
fn price_per_hour(flag: Option<&str>, env: Option<&str>) -> Result<Option<f64>, CliError> {
    let (source, text) = match (flag, env) {
        (Some(text), _) => ("--price-per-hour", text),
        (None, Some(text)) => (PRICE_ENV, text),
        (None, None) => return Ok(None),
    };
    match text.trim().parse::<f64>() {
        Ok(price) if price.is_finite() && price >= 0.0 => Ok(Some(price)),
        _ => Err(CliError::BadValue {
            flag: source,
            value: text.to_string(),
            hint: "expected the price of one device for one hour, a number ≥ 0 (per GPU on GPUs, per machine on the CPU)".into(),
        }),
    }
}

/// Turns the flags (and, with `--resume`, the checkpoint's settings) into a [`TrainConfig`],
/// on the GPUs the driver lists and the launcher's variables.
///
/// With `--resume RUN`, every setting (model, image size, seed, batch, replicas, epochs,
/// optimizer and its hyper-parameters, schedule, augmentation…) defaults to the checkpoint's;
/// flags given again override them, except model, image size and resize mode, which must match.
pub fn to_config(args: &TrainArgs) -> Result<(TrainConfig, Option<String>), CliError> {
    let plan = launcher::plan(args, &launch::process_env, &launch::probe_gpus())?;
    config_for(args, &plan)
}

/// [`to_config`] for the launch `plan`; with `--dry-run`, neither the data nor the run folder
/// is looked at (a resumed run's checkpoint is read).
pub(crate) fn config_for(
    args: &TrainArgs,
    plan: &LaunchPlan,
) -> Result<(TrainConfig, Option<String>), CliError> {
    let data = args.data.clone().ok_or(CliError::Missing {
        flag: "--data DIR",
        hint: "point it at a dataset folder, or try `birdtrain demo`",
    })?;
    let look = !args.dry_run;
    if look {
        super::paths::expect_data(
            &data,
            "--data must be a folder with train/ and valid/ (or class folders with --valid-fraction), or a CSV file listing the images",
        )?;
    }
    if let (true, Some(f)) = (look, args.recipe.valid_fraction) {
        if data.join("train").is_dir() {
            return Err(CliError::BadValue {
                flag: "--valid-fraction",
                value: f.to_string(),
                hint: format!(
                    "{} has a train/ folder, so its valid/ split is used; --valid-fraction is for flat <class>/<images> folders",
                    data.display()
                ),
            });
        }
    }
    let resumed = match &args.resume {
        Some(run) => Some(CheckpointMeta::load(run).map_err(TrainError::from)?),
        None => None,
    };
    let mut cfg = TrainConfig::new(&data);
    match (&resumed, &args.resume) {
        (Some(meta), Some(run)) => resume_from(&mut cfg, args, meta, run)?,
        _ => {
            if let Some(model) = &args.model {
                cfg.arch = Arch::from_str(model).map_err(TrainError::from)?;
            }
            // CIFAR-style models are for small images: default to 32×32 with them.
            cfg.image_size = args
                .image_size
                .unwrap_or(if cfg.arch.is_cifar() { 32 } else { 224 });
        }
    }
    let device = DeviceChoice::of_plan(plan);
    let note = plan.cpu_fallback.clone();
    cfg.device = device;
    if let Some(v) = args.replicas {
        cfg.replicas = v;
    }
    if let DeviceChoice::Cuda(n) = device {
        cfg.replicas = n;
    }
    cfg.dist = args.dist.to_settings();
    if let Some(v) = args.epochs {
        cfg.epochs = v;
    }
    if let Some(BatchSize::Images(v)) = args.batch_size {
        cfg.batch_size = v;
    }
    if let Some(v) = args.seed {
        cfg.seed = v;
    }
    if let Some(v) = args.optimizer {
        cfg.optimizer = v;
        if v != OptimizerChoice::Sgd && args.recipe.lr.is_none() && resumed.is_none() {
            // Adam's usual 1e-3 at batch 32, expressed for the 256 reference batch.
            cfg.lr = 0.008;
        }
    }
    apply_recipe(&mut cfg, args)?;
    if let Some(v) = args.workers.filter(|&w| w > 0) {
        cfg.workers = v;
    } else if plan.local_processes > 1 {
        cfg.workers = plan.default_workers(pipeline::limits::cores());
    }
    if let Some(v) = args.threads {
        cfg.threads = v;
    }
    cfg.cache_dir = args.cache_dir.clone();
    if let Some(v) = args.on_bad_image {
        cfg.on_bad_image = v;
    }
    check_start(args)?;
    // A resumed run goes on from its own weights; the flag only shapes a fresh start.
    cfg.zero_init_residual = args.zero_init_residual;
    cfg.init_from = args.init_from.clone();
    if let Some(path) = cfg.init_from.as_ref().filter(|_| look) {
        super::paths::expect_file(path, "--init-from takes a .safetensors weights file")?;
    }
    cfg.resume = args.resume.clone();
    cfg.allow_data_change = args.allow_data_change;
    cfg.overwrite = args.overwrite;
    cfg.stop_after_steps = args.stop_after_steps;
    cfg.price_per_hour = price_per_hour(
        args.price_per_hour.as_deref(),
        std::env::var(PRICE_ENV).ok().as_deref(),
    )?;
    cfg.progress = !args.quiet;
    if let (Some(meta), Some(run), true) = (&resumed, &args.resume, look) {
        let changed = resume_overrides(meta, &cfg);
        if !changed.is_empty() {
            // As for another batch size: said once, and the values given are used.
            tracing::warn!(
                "resuming {} with {}: the values given win from here on (leave the flags out to keep the checkpoint's)",
                run.display(),
                changed.join(", ")
            );
        }
    }
    // Elastic resume: another rank count keeps the checkpoint's global batch (after the
    // warning above, which is about values given, not this split).
    let elastic = match &resumed {
        Some(meta) => {
            let ranks = match cfg.device {
                DeviceChoice::Cuda(local) => plan.nodes * local,
                DeviceChoice::Cpu => cfg.replicas,
            };
            let explicit = args.batch_size.is_some() || args.recipe.grad_accum_steps.is_some();
            super::elastic::keep_global_batch(&mut cfg, meta, ranks, explicit)?
        }
        None => None,
    };
    if resumed.is_none() {
        cfg.out = match &args.out {
            Some(out) => out.clone(),
            None => next_run_dir(Path::new("runs"), cfg.arch.name()),
        };
    } else if let Some(out) = &args.out {
        cfg.out = out.clone();
    }
    cfg.validate().map_err(CliError::Train)?;
    super::counts::check_train_counts(&cfg)?;
    if look {
        super::paths::check_train_paths(&cfg)?;
    }
    let mut note = match (note, elastic) {
        (Some(n), Some(e)) => Some(format!("{n}\n{e}")),
        (n, e) => n.or(e),
    };
    if look && args.batch_size == Some(BatchSize::Auto) {
        let (listed, train_images) = pipeline::DatasetSource::at(&cfg.data, cfg.valid_fraction)
            .train_listing()
            .map_err(TrainError::from)?;
        let classes = match &resumed {
            Some(meta) => meta.classes.len(),
            None => listed.len(),
        };
        let (batch, line) = train::largest_gpu_batch(&cfg, classes, train_images)?;
        cfg.batch_size = batch;
        // The measured batch meets the same checks as a given one (host memory included).
        cfg.validate().map_err(CliError::Train)?;
        super::counts::check_train_counts(&cfg)?;
        note = Some(match note {
            Some(n) => format!("{n}\n{line}"),
            None => line,
        });
    }
    Ok((cfg, note))
}

/// Starts `cfg` from the checkpoint `meta` of `run`: its model, image size, position
/// figures and recorded settings, refusing a model, image size or resize mode flag that
/// differs from them.
fn resume_from(
    cfg: &mut TrainConfig,
    args: &TrainArgs,
    meta: &CheckpointMeta,
    run: &Path,
) -> Result<(), CliError> {
    cfg.arch = Arch::from_str(&meta.model).map_err(TrainError::from)?;
    cfg.image_size = meta.image_size;
    cfg.seed = meta.seed;
    cfg.batch_size = meta.batch_size;
    cfg.replicas = meta.replicas;
    cfg.epochs = meta.epochs;
    cfg.out = run.to_path_buf();
    cfg.optimizer = meta.optimizer;
    cfg.settings = meta.settings.clone();
    cfg.validate()
        .map_err(|e| super::sidecar::sidecar_error(run, e))?;
    let arch = match &args.model {
        Some(model) => Arch::from_str(model).map_err(TrainError::from)?,
        None => cfg.arch,
    };
    train::check_resumed(run, meta, arch, args.image_size.unwrap_or(meta.image_size))?;
    if let Some(wanted) = args.augment.engine.resize_mode {
        if wanted != meta.settings.resize_mode {
            return Err(TrainError::CheckpointMismatch {
                path: run.to_path_buf(),
                what: "resize mode",
                expected: wanted.as_str().into(),
                found: meta.settings.resize_mode.as_str().into(),
                hint: "resume with the checkpoint's --resize-mode (the images it learned from)",
            }
            .into());
        }
    }
    Ok(())
}

/// Gives `cfg` the recorded settings' flags: each flag given overrides the default (or the
/// checkpoint's); the flags that tune a part that is off are refused, naming the flag.
fn apply_recipe(cfg: &mut TrainConfig, args: &TrainArgs) -> Result<(), CliError> {
    args.recipe.apply(&mut cfg.settings);
    args.augment.engine.apply(&mut cfg.settings);
    let r = &args.recipe;
    let schedule = cfg.decay();
    refuse_unless(
        matches!(schedule, Decay::Step { .. }),
        [
            ("--step-every", r.step_every.map(|v| v.to_string())),
            ("--step-gamma", r.step_gamma.map(|v| v.to_string())),
        ],
        || tuning_hint(&schedule, "step"),
    )?;
    refuse_unless(
        matches!(schedule, Decay::Plateau(_)),
        [
            (
                "--plateau-patience",
                r.plateau_patience.map(|v| v.to_string()),
            ),
            ("--plateau-factor", r.plateau_factor.map(|v| v.to_string())),
            (
                "--plateau-cooldown",
                r.plateau_cooldown.map(|v| v.to_string()),
            ),
            ("--plateau-min-lr", r.plateau_min_lr.map(|v| v.to_string())),
        ],
        || tuning_hint(&schedule, "plateau"),
    )?;
    refuse_unless(
        cfg.mix().is_on(),
        [
            ("--mixup-prob", r.mixup_prob.map(|v| v.to_string())),
            (
                "--mixup-switch-prob",
                r.mixup_switch_prob.map(|v| v.to_string()),
            ),
        ],
        || {
            "it shares out the batches of --mixup and --cutmix, and both are off: add --mixup A or --cutmix A".into()
        },
    )?;
    if args.no_augment && args.augment.augment.is_some() {
        return Err(CliError::BadValue {
            flag: "--no-augment",
            value: "true".into(),
            hint:
                "give either --no-augment or --augment, not both (--no-augment is --augment none)"
                    .into(),
        });
    }
    let current = match args.no_augment {
        true => Augmentation::None,
        false => cfg.augmentation(),
    };
    let augmentation = args.augment.augmentation(current)?;
    cfg.set_augmentation(augmentation);
    cfg.auto_augment = args.augment.policy(cfg.auto_augment)?;
    if args.model_ema {
        cfg.model_ema.get_or_insert(EmaRecipe::TORCHVISION);
    }
    refuse_unless(
        cfg.model_ema.is_some(),
        [
            (
                "--model-ema-steps",
                args.model_ema_steps.map(|n| n.to_string()),
            ),
            (
                "--model-ema-decay",
                args.model_ema_decay.map(|d| d.to_string()),
            ),
        ],
        || "it tunes the moving average of the weights, which is off: add --model-ema".into(),
    )?;
    if let Some(ema) = &mut cfg.model_ema {
        if let Some(n) = args.model_ema_steps {
            ema.steps = n;
        }
        if let Some(d) = args.model_ema_decay {
            ema.decay = d;
        }
    }
    Ok(())
}

/// The hint for a flag that tunes the schedule `wanted` when the run's is another.
fn tuning_hint(schedule: &Decay, wanted: &str) -> String {
    format!(
        "it tunes the {wanted} schedule, and this run's schedule is {}: add --schedule {wanted}",
        schedule.choice()
    )
}

/// Unless `ok`, the error for the first of `given` (flag, value if given), with `hint`;
/// `Ok` when none was given.
fn refuse_unless<const N: usize>(
    ok: bool,
    given: [(&'static str, Option<String>); N],
    hint: impl FnOnce() -> String,
) -> Result<(), CliError> {
    match given.into_iter().find_map(|(f, v)| Some((f, v?))) {
        Some((flag, value)) if !ok => Err(CliError::BadValue {
            flag,
            value,
            hint: hint(),
        }),
        _ => Ok(()),
    }
}

/// The flags that only shape a fresh start, refused together with what they contradict.
fn check_start(args: &TrainArgs) -> Result<(), CliError> {
    if let (Some(path), Some(run)) = (&args.init_from, &args.resume) {
        return Err(CliError::BadValue {
            flag: "--init-from",
            value: path.display().to_string(),
            hint: format!(
                "--resume {} continues from its own checkpoint's weights: give --init-from only to start a new run",
                run.display()
            ),
        });
    }
    if let (true, Some(path)) = (args.zero_init_residual, &args.init_from) {
        return Err(CliError::BadValue {
            flag: "--init-from",
            value: path.display().to_string(),
            hint: "these weights replace the fresh initialisation that --zero-init-residual changes: give one of the two".into(),
        });
    }
    Ok(())
}

/// The settings of `cfg` that differ from the checkpoint `meta` a run resumes, as
/// "--lr 0.1 (the checkpoint's: 0.8)": the flags given again with other values.
fn resume_overrides(meta: &CheckpointMeta, cfg: &TrainConfig) -> Vec<String> {
    let mut changed = Vec::new();
    if cfg.seed != meta.seed {
        changed.push(format!(
            "--seed {} (the checkpoint's: {})",
            cfg.seed, meta.seed
        ));
    }
    let (now, then) = (cfg.augmentation(), meta.settings.augmentation());
    if now.as_str() != then.as_str() {
        changed.push(format!(
            "--augment {} (the checkpoint's: {})",
            now.as_str(),
            then.as_str()
        ));
    }
    EngineArgs::resume_changes(&cfg.settings, &meta.settings, &mut changed);
    RecipeArgs::resume_changes(&cfg.settings, &meta.settings, &mut changed);
    changed
}

/// `runs/<model>-<n>` with the first n not taken.
pub(crate) fn next_run_dir(root: &Path, model: &str) -> PathBuf {
    (1..)
        .map(|n| root.join(format!("{model}-{n}")))
        .find(|p| !p.exists())
        .expect("an unbounded range always has a free name")
}
