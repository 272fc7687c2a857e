//! What every rank of a run shares, set up once: the input engines, the graph, the starting
//! weights and optimizer state (a checkpoint, `--init-from` or a fresh init), the data
//! position, the schedule, the bucket plan and the run folder.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pipeline::{BatchAllocator, DatasetSource, Pipeline, PipelineBuilder, Split};

use super::config::TrainConfig;
use super::device::DeviceChoice;
use super::ema::ModelEma;
use super::evaluate::summarise;
use super::folder::checkpoint::BEST_DIR;
use super::folder::{BestEpoch, CheckpointMeta, DataPosition, DatasetStamp, RunFolder, Segment};
use super::TrainError;
use crate::dist::buckets::{specs_from_numel, BucketPlan};
use crate::dist::rendezvous::StartPoint;
use crate::model::{Graph, HeadPolicy, ModelState};
use crate::optim::{Hyper, Optimizer, OptimizerKind, Schedule};
use crate::trace::TraceRecorder;

/// The tensor of the optimizer file that holds every rank's batch-norm buffers at a
/// checkpoint inside an epoch (shape `[ranks, buffer values]`).
pub(crate) const RANK_BUFFERS_TENSOR: &str = "rank_bn_buffers";

/// Steps between two comparisons of the ranks' weight checksums (and at every epoch end).
pub(crate) const CHECKSUM_EVERY: u64 = 50;

/// The dataset as the engine reads it (`--data`, see [`DatasetSource::at`]).
pub(crate) fn source(cfg: &TrainConfig) -> DatasetSource {
    DatasetSource::at(&cfg.data, cfg.valid_fraction).with_split_rule(cfg.split_rule())
}

/// The engine of `split`: the training split shuffled and sliced over `ranks`, validation in
/// file order, also sliced over `ranks` (each rank validates its share, the last shares of
/// the last batch possibly empty); batches in memory from `allocator` when given (pinned, for
/// GPUs).
pub(crate) fn pipeline_for(
    cfg: &TrainConfig,
    folder: &RunFolder,
    split: Split,
    ranks: usize,
    allocator: Option<Arc<dyn BatchAllocator>>,
) -> Result<Pipeline, TrainError> {
    let training = split == Split::Train;
    let mut b = PipelineBuilder::new(source(cfg))
        .split(split)
        .image_size(cfg.image_size)
        .store_size(cfg.store_size)
        .resize_mode(cfg.resize_mode)
        .seed(cfg.seed)
        .replicas(ranks)
        // A training batch is one rank's optimizer step: its K micro-batches together (the
        // data order and position count optimizer steps).
        .batch_size(if training {
            cfg.rank_step_batch()
        } else {
            cfg.batch_size
        })
        .shuffle(training)
        .random_resized_crop(cfg.augmentation().engine_crop().filter(|_| training))
        .center_crop((!training).then_some(cfg.crop_pct))
        .color_jitter(cfg.engine_jitter().filter(|_| training))
        .auto_augment(cfg.auto_augment.filter(|_| training))
        .mirrored_later(
            cfg.augmentation()
                .mirrored_later(cfg.seed, cfg.image_size)
                .filter(|_| training),
        )
        .sampling(if training {
            cfg.sampler
        } else {
            pipeline::Sampling::Shuffle
        })
        .last_batch(if training {
            cfg.last_batch
        } else {
            pipeline::LastBatch::Partial
        })
        .on_bad_image(cfg.on_bad_image);
    // The run folder is node 0's alone (see `node_rank`).
    if node_rank(cfg) == 0 {
        b = b.bad_files_report(folder.bad_files_path(split));
    }
    if cfg.workers > 0 {
        b = b.workers(cfg.workers);
    }
    if let Some(dir) = &cfg.cache_dir {
        b = b.cache_dir(dir.clone());
    }
    if let Some(a) = allocator {
        b = b.allocator(a);
    }
    Ok(b.build()?)
}

/// Everything the ranks share (read-only).
pub(crate) struct Shared {
    /// The run's settings; `replicas` is the number of ranks.
    pub cfg: TrainConfig,
    /// The model.
    pub graph: Graph,
    /// Class names, index = label.
    pub classes: Vec<String>,
    /// The training engine (every rank reads its own slice).
    pub train_pipe: Pipeline,
    /// The validation engine (every rank validates its own slice).
    pub valid_pipe: Pipeline,
    /// The starting weights and buffers.
    pub initial: ModelState,
    /// The resumed checkpoint's optimizer state (graph order, torchvision layout).
    pub optimizer: Option<Optimizer>,
    /// Every rank's own batch-norm buffers (flat, graph order), when the checkpoint was
    /// taken inside an epoch by as many ranks as this run has.
    pub rank_buffers: Option<Vec<Vec<f32>>>,
    /// Where training starts in the data.
    pub position: DataPosition,
    /// The learning-rate schedule.
    pub schedule: Schedule,
    /// The update rule.
    pub kind: OptimizerKind,
    /// Its hyper-parameters.
    pub hyper: Hyper,
    /// Steps per epoch (every rank the same).
    pub steps_per_epoch: usize,
    /// The gradient buffer's layout and the buckets averaged together.
    pub bucket_plan: BucketPlan,
    /// The run folder (written by rank 0 of node 0).
    pub folder: RunFolder,
    /// What the checkpoints record of the training data.
    pub dataset: DatasetStamp,
    /// `--trace` spans.
    pub trace: TraceRecorder,
    /// Steps between cross-rank checksum comparisons.
    pub checksum_every: u64,
    /// The best epoch before this session (a resumed run's; rank 0 of node 0 only).
    pub best: Option<BestEpoch>,
    /// The moving average of the weights the run starts with (`--model-ema`): the resumed
    /// checkpoint's, else the starting weights.
    pub ema: Option<ModelEma>,
    /// What `--init-from` did not take from its file (a new class head), for the start lines.
    pub init_note: Option<String>,
    /// The machine time of the segments before this one (the resumed checkpoint's).
    pub earlier_segments: Vec<Segment>,
    /// When this segment started (the shared state's construction, before the engines'
    /// first epoch).
    pub started: std::time::Instant,
}

impl Shared {
    /// The images of one rank's training step as the engine delivers them (all its
    /// micro-batches with `--grad-accum-steps`; at least [`Shared::network_batch`]): what a GPU
    /// rank's staging slot holds.
    pub(crate) fn engine_batch(&self) -> usize {
        self.train_pipe
            .micro_batch_len(0, 0)
            .unwrap_or(0)
            .max(self.network_batch())
    }

    /// The images a rank's network must hold at once: the largest micro-batch either engine
    /// can really deliver (the first step's, a training step's cut to `--batch-size` when it
    /// accumulates), not `--batch-size` when the data is smaller.
    pub(crate) fn network_batch(&self) -> usize {
        let first = |p: &Pipeline| p.micro_batch_len(0, 0).unwrap_or(0);
        first(&self.train_pipe)
            .min(self.cfg.batch_size)
            .max(first(&self.valid_pipe))
            .max(1)
    }

    /// The shared state of a run of `ranks` ranks (`cfg.replicas` is set to it). `resumed` is
    /// the checkpoint to continue; `writer` says whether this process writes the run folder
    /// (node 0).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        cfg: &TrainConfig,
        ranks: usize,
        resumed: Option<&(PathBuf, CheckpointMeta)>,
        train_pipe: Pipeline,
        valid_pipe: Pipeline,
        folder: RunFolder,
        writer: bool,
    ) -> Result<Shared, TrainError> {
        let started = std::time::Instant::now();
        let mut cfg = cfg.clone();
        cfg.replicas = ranks;
        let valid_pipe = sliced_for(&cfg, &folder, valid_pipe, ranks)?;
        let classes = train_pipe.classes().to_vec();
        let graph = Graph::new(cfg.arch, classes.len());
        let steps_per_epoch = train_pipe.steps_per_epoch();
        if steps_per_epoch == 0 {
            return Err(TrainError::InvalidConfig {
                flag: "--batch-size",
                value: cfg.batch_size.to_string(),
                hint: format!(
                    "with --last-batch drop the {} training images make no full global batch of {}",
                    train_pipe.len(),
                    cfg.global_batch()
                ),
            });
        }
        let dataset = DatasetStamp::of(&train_pipe);
        warn_about_dataset(&cfg, classes.len(), train_pipe.len());
        let schedule = Schedule {
            base_lr: cfg.scaled_lr_for(train_pipe.len()),
            steps_per_epoch: steps_per_epoch as u64,
            warmup_epochs: cfg.warmup_epochs,
            total_epochs: cfg.epochs as u32,
            decay: cfg.decay(),
        };
        let hyper = Hyper {
            weight_decay: cfg.weight_decay,
            ..Hyper::default()
        };
        let kind = cfg.optimizer.kind(cfg.momentum, cfg.nesterov);
        let mut rank_buffers = None;
        let mut init_note = None;
        let (initial, optimizer, position) = match resumed {
            Some((run, meta)) => {
                check_resume(&cfg, run, meta, &classes)?;
                let state = ModelState::load_safetensors(
                    &graph,
                    &run.join(&meta.model_file),
                    HeadPolicy::Strict,
                )?;
                let mut optimizer = Optimizer::new(kind, hyper, graph.params());
                let optimizer_file = run.join(&meta.optimizer_state_file);
                let bytes = std::fs::read(&optimizer_file).map_err(|source| TrainError::Io {
                    path: optimizer_file.clone(),
                    what: "read",
                    source,
                })?;
                optimizer.load_safetensors_bytes(&bytes, &optimizer_file)?;
                let mut position =
                    resume_position(&cfg, run, meta, &dataset, steps_per_epoch as u64)?;
                super::resumed_files::check_resumed_contents(
                    &cfg,
                    run,
                    meta,
                    &train_pipe,
                    &mut position,
                )?;
                rank_buffers = saved_rank_buffers(&graph, &bytes, ranks);
                (state, Some(optimizer), position)
            }
            None => {
                let state = match &cfg.init_from {
                    Some(path) => {
                        let (state, head) = ModelState::load_with_head(
                            &graph,
                            path,
                            HeadPolicy::ReplaceMismatched { seed: cfg.seed },
                        )?;
                        init_note = head.map(|head| {
                            format!("--init-from {}: {}", path.display(), head.describe())
                        });
                        state
                    }
                    None => {
                        let mut fresh = ModelState::init(&graph, cfg.seed);
                        if cfg.zero_init_residual {
                            fresh.zero_residual_gammas(&graph);
                        }
                        fresh
                    }
                };
                (state, None, DataPosition::start())
            }
        };
        let resumed_ema = match (cfg.model_ema, resumed) {
            (Some(_), Some((run, meta))) => meta
                .model_ema_file
                .as_ref()
                .map(|file| read_average(&graph, &run.join(file)))
                .transpose()?,
            _ => None,
        };
        let ema = cfg.model_ema.map(|recipe| {
            let (state, updates) = resumed_ema.unwrap_or_else(|| (initial.clone(), 0));
            let alpha = recipe.alpha(cfg.global_batch(), cfg.epochs);
            ModelEma::new(state, updates, alpha, cfg.warmup_epochs)
        });
        let names: Vec<(String, usize)> = graph
            .params()
            .iter()
            .map(|p| (p.name.clone(), p.numel()))
            .collect();
        let bucket_plan = BucketPlan::new(&specs_from_numel(&names, 4), cfg.dist.bucket_settings())
            .map_err(|e| TrainError::InvalidConfig {
                flag: "--bucket-mb",
                value: cfg.dist.bucket_mb.to_string(),
                hint: e.to_string(),
            })?;
        let mut best = None;
        if writer {
            folder.start_metrics(resumed.map(|(run, _)| run.as_path()), position.epoch)?;
            best = start_best(&folder, resumed)?;
            if let (Some(b), Some((_, meta))) = (best, resumed) {
                let then = meta.settings.monitor;
                if then != cfg.monitor {
                    // The record was judged by another figure: it cannot be compared.
                    tracing::warn!(
                        "the best epoch so far (epoch {}) was picked by {}; with --monitor {} the next epoch starts a new best (best/ keeps epoch {} until then)",
                        b.epoch,
                        then.name(),
                        cfg.monitor.name(),
                        b.epoch
                    );
                    best = None;
                }
            }
        }
        let trace = if cfg.dist.trace.is_some() {
            TraceRecorder::new()
        } else {
            TraceRecorder::disabled()
        };
        Ok(Shared {
            cfg,
            graph,
            classes,
            train_pipe,
            valid_pipe,
            initial,
            rank_buffers,
            optimizer,
            position,
            schedule,
            kind,
            hyper,
            steps_per_epoch,
            bucket_plan,
            folder,
            dataset,
            trace,
            checksum_every: CHECKSUM_EVERY,
            best,
            init_note,
            ema,
            earlier_segments: resumed
                .map(|(_, meta)| meta.machine_time.clone())
                .unwrap_or_default(),
            started,
        })
    }

    /// The learning rate of optimizer step `step` (0-based) for a run at `position`: the
    /// schedule's, times the cuts the plateau schedule made so far (a scale left by a
    /// plateau run resumed with another schedule does not apply).
    pub(crate) fn lr_at(&self, step: u64, position: &DataPosition) -> f32 {
        if let Some(range) = self.cfg.lr_range {
            // The sweep is in --lr's units; the schedule's base rate is --lr scaled to the batch.
            return range.lr_at(step) * self.schedule.base_lr / self.cfg.lr;
        }
        let lr = self.schedule.lr_at(step);
        match self.schedule.decay {
            crate::optim::Decay::Plateau(_) => lr * position.lr_scale,
            _ => lr,
        }
    }

    /// Ranks in the run.
    pub(crate) fn ranks(&self) -> usize {
        self.cfg.replicas
    }

    /// Rank `rank`'s images at `step`, from the data order.
    pub(crate) fn rank_images(&self, step: usize, rank: usize) -> usize {
        self.train_pipe.micro_batch_len(step, rank).unwrap_or(0)
    }

    /// The micro-batches of `step` (`--grad-accum-steps`), the same on every rank: as many
    /// as the largest rank's share needs, at least one.
    pub(crate) fn micro_batches(&self, step: usize) -> usize {
        if self.cfg.grad_accum_steps <= 1 {
            return 1;
        }
        let most = (0..self.ranks())
            .map(|r| self.rank_images(step, r))
            .max()
            .unwrap_or(0);
        most.div_ceil(self.cfg.batch_size).max(1)
    }

    /// Every rank's images at `step`, from the data order.
    pub(crate) fn step_images(&self, step: usize) -> usize {
        (0..self.ranks()).map(|r| self.rank_images(step, r)).sum()
    }

    /// Prints a line when the run is verbose. Not `println!`: once stdout is closed (`| head`)
    /// the line is dropped and the run goes on (its progress is in the run folder too).
    pub(crate) fn say(&self, line: impl AsRef<str>) {
        if self.cfg.verbose {
            use std::io::Write;
            let _ = writeln!(std::io::stdout().lock(), "{}", line.as_ref());
        }
    }

    /// The sidecar of a checkpoint at `position` (file names and checksums are filled in by
    /// [`RunFolder::save_checkpoint`]).
    pub(crate) fn checkpoint_meta(&self, position: &DataPosition) -> CheckpointMeta {
        let cfg = &self.cfg;
        CheckpointMeta {
            version: 0,
            model: cfg.arch.name().into(),
            classes: self.classes.clone(),
            image_size: cfg.image_size,
            epoch: position.epoch,
            step: position.global_step,
            optimizer: cfg.optimizer,
            optimizer_state_file: String::new(),
            model_file: String::new(),
            seed: cfg.seed,
            data_position: position.clone(),
            global_batch: cfg.global_batch(),
            replicas: cfg.replicas,
            batch_size: cfg.batch_size,
            epochs: cfg.epochs,
            settings: cfg.recorded_settings(),
            model_checksum: String::new(),
            optimizer_checksum: String::new(),
            dataset: Some(self.dataset.clone()),
            best: None,
            model_ema_file: None,
            model_ema_checksum: None,
            train_files: None,
            machine_time: self.machine_time(),
        }
    }

    /// The machine time of the run's segments up to now: the resumed checkpoint's, then this
    /// one's, from its start to now.
    pub(crate) fn machine_time(&self) -> Vec<Segment> {
        let cfg = &self.cfg;
        // GPUs are paid per device (one per GPU rank: the rehearsal's test switch, several
        // ranks on one GPU, counts each as one), CPU runs per machine (CPU ranks are threads
        // of one process).
        let devices = match cfg.device {
            DeviceChoice::Cpu => 1,
            DeviceChoice::Cuda(_) => cfg.replicas,
        };
        let mut segments = self.earlier_segments.clone();
        segments.push(Segment {
            devices,
            ranks: cfg.replicas,
            seconds: self.started.elapsed().as_secs_f64(),
            price_per_hour: cfg.price_per_hour,
        });
        segments
    }

    /// The lines that open a run.
    pub(crate) fn say_start(&self, device: &str, resumed: Option<&(PathBuf, CheckpointMeta)>) {
        let cfg = &self.cfg;
        self.say(format!(
            "model {} ({} parameters) · {} · {} train / {} valid images at {}×{}",
            cfg.arch,
            self.graph.param_count(),
            summarise(&self.classes),
            self.train_pipe.len(),
            self.valid_pipe.len(),
            cfg.image_size,
            cfg.image_size
        ));
        let rate = match cfg.lr_range {
            Some(r) => format!(
                "lr swept {:e} to {:e} for batch 256, ×{:.6} for this batch",
                r.start,
                r.end,
                self.schedule.base_lr / cfg.lr
            ),
            None => format!(
                "lr {} for batch 256 → {:.6} scaled",
                cfg.lr, self.schedule.base_lr
            ),
        };
        self.say(format!(
            "device {device} · global batch {} ({} per rank{}) · {rate} · {} · {} steps per epoch",
            cfg.global_batch(),
            cfg.batch_size,
            if cfg.grad_accum_steps > 1 {
                format!(" × {} accumulated", cfg.grad_accum_steps)
            } else {
                String::new()
            },
            cfg.optimizer.name(),
            self.steps_per_epoch
        ));
        if let Some(note) = &self.init_note {
            self.say(note);
        }
        if let (Some(f), Some(rule)) = (cfg.valid_fraction, source(cfg).split_rule()) {
            self.say(format!(
                "validation split: {} of {} images held out, {} (--valid-fraction {f}, seed {})",
                self.valid_pipe.len(),
                self.train_pipe.len() + self.valid_pipe.len(),
                rule.words(),
                cfg.seed
            ));
        }
        if cfg.sampler == pipeline::Sampling::Balanced {
            self.say(format!(
                "balanced sampling: {} draws per epoch with replacement, each class equally likely",
                self.train_pipe.len()
            ));
        }
        if let Some(crop) = cfg.augmentation().engine_crop() {
            self.say(format!(
                "random resized crop: {:.0}–{:.0} % of each stored image's area, aspect {:.2}–{:.2}, scaled to {} px and mirrored at random",
                crop.scale.0 * 100.0,
                crop.scale.1 * 100.0,
                crop.ratio.0,
                crop.ratio.1,
                cfg.image_size
            ));
        }
        match cfg.auto_augment {
            Some(pipeline::AutoAugment::TrivialAugmentWide) => self.say(
                "automatic augmentation: TrivialAugmentWide, one of 14 operations per training image at a random strength (--auto-augment ta_wide)",
            ),
            Some(pipeline::AutoAugment::RandAugment { magnitude }) => self.say(format!(
                "automatic augmentation: RandAugment, two of 14 operations per training image at strength {magnitude} of 30 (--auto-augment ra, --ra-magnitude)"
            )),
            Some(pipeline::AutoAugment::AugMix { severity }) => self.say(format!(
                "automatic augmentation: AugMix, each training image blended with three chains of 1–3 operations at strengths up to {severity} of 10 (--auto-augment augmix, --augmix-severity)"
            )),
            Some(policy) => self.say(format!(
                "automatic augmentation: AutoAugment's {} policy, one of its 25 learned pairs of operations per training image (--auto-augment {})",
                policy.as_str(),
                policy.as_str()
            )),
            None => {}
        }
        if let Some(jitter) = cfg.engine_jitter() {
            let mut parts = Vec::new();
            if jitter.brightness > 0.0 {
                parts.push(format!(
                    "brightness, contrast and saturation each ×{:.2}–{:.2}",
                    (1.0 - jitter.brightness).max(0.0),
                    1.0 + jitter.brightness
                ));
            }
            if jitter.hue > 0.0 {
                parts.push(format!(
                    "hue turned by up to ±{} (--color-jitter-hue)",
                    jitter.hue
                ));
            }
            self.say(format!(
                "colour jitter: {}, in a random order (--color-jitter)",
                parts.join("; ")
            ));
        }
        if let Some(store) = cfg.store_size.filter(|&s| s != cfg.image_size) {
            self.say(format!(
                "the input engine caches {store}×{store} squares; every image is cut from one and scaled to {} px (--store-size)",
                cfg.image_size
            ));
        }
        if cfg.random_erase > 0.0 {
            self.say(format!(
                "random erasing: {:.0} % of training images get a rectangle of 2–33 % of their area set to the mean colour (--random-erase)",
                cfg.random_erase * 100.0
            ));
        }
        if cfg.mix().is_on() {
            let mix = &cfg.mix();
            let kinds = match (mix.mixup > 0.0, mix.cutmix > 0.0) {
                (true, true) => format!(
                    "mixup (α {}) or CutMix (α {}, {:.0} % of them)",
                    mix.mixup,
                    mix.cutmix,
                    mix.switch_prob * 100.0
                ),
                (true, false) => format!("mixup (α {})", mix.mixup),
                _ => format!("CutMix (α {})", mix.cutmix),
            };
            self.say(format!(
                "{:.0} % of training batches get {kinds}; training accuracy counts each image's own label (--mixup, --cutmix)",
                mix.prob * 100.0
            ));
        }
        if cfg.resize_mode == pipeline::ResizeMode::ShorterSideCenterCrop {
            self.say(format!(
                "each image keeps its aspect ratio: its centred square is stored, {} px a side (--resize-mode center-crop)",
                cfg.store_size.unwrap_or(cfg.image_size)
            ));
        }
        if let Some(n) = cfg.clip_grad_norm {
            self.say(format!(
                "gradients clipped to a global L2 norm of {n} before every update (--clip-grad-norm)"
            ));
        }
        if let (Some(recipe), Some(ema)) = (cfg.model_ema, &self.ema) {
            self.say(format!(
                "moving average of the weights: updated every {} steps with weight {:.6} for the new weights ({} adjusted for global batch {} and {} epochs), validated after every epoch{} (--model-ema)",
                recipe.steps,
                ema.alpha(),
                recipe.decay,
                cfg.global_batch(),
                cfg.epochs,
                if resumed.is_some_and(|(_, m)| m.model_ema_file.is_none()) {
                    "; the resumed checkpoint had none, so it starts from its weights"
                } else {
                    ""
                }
            ));
        }
        if cfg.crop_pct < 1.0 {
            self.say(format!(
                "validation sees the centred {} of each image's side, scaled to {} px (--crop-pct)",
                cfg.crop_pct, cfg.image_size
            ));
        }
        if let Some((run, meta)) = resumed {
            self.say(format!(
                "resuming {} at epoch {}, step {} of {} (global step {}, {} epochs done){}",
                run.display(),
                self.position.epoch + 1,
                self.position.step_in_epoch,
                self.steps_per_epoch,
                self.position.global_step,
                meta.epoch,
                match self.schedule.decay {
                    crate::optim::Decay::Plateau(_) if self.position.lr_scale != 1.0 => format!(
                        " · lr {:.6} after the plateau cuts",
                        self.lr_at(self.position.global_step, &self.position)
                    ),
                    _ => String::new(),
                }
            ));
        }
    }
}

/// This process's node rank, by `--node-rank` or the launcher's `RANK` or `SLURM_PROCID` (0
/// for a single node): node 0 alone writes, cleans and removes the run folder, and the other
/// nodes name their `--trace` files by it. A value that does not parse counts as node 0 here
/// and is refused by the launch.
pub(crate) fn node_rank(cfg: &TrainConfig) -> usize {
    let env_rank = || crate::dist::launch::launcher::node_rank(&crate::dist::launch::process_env);
    cfg.dist.node_rank.or_else(env_rank).unwrap_or(0)
}

/// What the rendezvous compares of the checkpoint a node resumes (every node must resume the
/// same one: only the weights are broadcast): its global step and its weights file's
/// checksum, or a fresh start.
pub(crate) fn start_point(resumed: Option<&(PathBuf, CheckpointMeta)>) -> StartPoint {
    match resumed {
        Some((_, meta)) => StartPoint::Checkpoint {
            step: meta.step,
            weights: meta.model_checksum.clone(),
        },
        None => StartPoint::Fresh,
    }
}

/// The validation engine sliced over `ranks`: the GPU launcher builds one before the
/// rendezvous tells it the rank count (its fingerprint goes there), and it is built again here
/// when the count turns out another.
fn sliced_for(
    cfg: &TrainConfig,
    folder: &RunFolder,
    valid_pipe: Pipeline,
    ranks: usize,
) -> Result<Pipeline, TrainError> {
    if valid_pipe.replicas() == ranks {
        return Ok(valid_pipe);
    }
    // Dropped first: it releases the cache file before the new engine opens it.
    drop(valid_pipe);
    pipeline_for(cfg, folder, Split::Valid, ranks, None)
}

/// A checkpoint's moving average and its update count.
fn read_average(graph: &Graph, path: &Path) -> Result<(ModelState, u64), TrainError> {
    let bytes = std::fs::read(path).map_err(|source| crate::model::ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let state = ModelState::from_safetensors_bytes(graph, &bytes, path, HeadPolicy::Strict)?;
    Ok((state, ModelEma::updates_in(&bytes)))
}

/// The best epoch the run starts from, with `RUN/best/` made to match it: none for a fresh
/// run (a previous run's `best/` is removed); a resumed run's record when its `best/` holds
/// that epoch (copied over when the run continues in another folder).
fn start_best(
    folder: &RunFolder,
    resumed: Option<&(PathBuf, CheckpointMeta)>,
) -> Result<Option<BestEpoch>, TrainError> {
    let Some((run, meta)) = resumed else {
        folder.remove_best()?;
        return Ok(None);
    };
    let best = resumed_best(run, meta);
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    };
    if !same(run, folder.path()) {
        folder.remove_best()?;
        if best.is_some()
            && folder
                .copy_best_checkpoint(&best_folder(run, meta))?
                .is_none()
        {
            return Ok(None);
        }
    }
    Ok(best)
}

/// Where the best epoch of a resumed run is kept: its `best/`, or the folder itself when it
/// is a `best/` folder (`--resume RUN/best`: its checkpoint is the epoch it records as the
/// best, and it holds no `best/` of its own).
fn best_folder(run: &Path, meta: &CheckpointMeta) -> PathBuf {
    let inner = run.join(BEST_DIR);
    let is_own_best = meta.best.is_some_and(|b| b.epoch == meta.epoch);
    if is_own_best && !inner.exists() {
        run.to_path_buf()
    } else {
        inner
    }
}

/// The checkpoint's best epoch when `run/best/` holds it. A `best/` newer than the checkpoint
/// (written just before a kill) gives none: the resumed run redoes that epoch and writes it
/// again. Anything else missing or different is said in a warning, and the next epoch starts
/// a new best.
fn resumed_best(run: &Path, meta: &CheckpointMeta) -> Option<BestEpoch> {
    let recorded = meta.best?;
    let best_dir = best_folder(run, meta);
    match CheckpointMeta::load(&best_dir) {
        Ok(saved) if saved.best == Some(recorded) => Some(recorded),
        Ok(saved) if saved.epoch > meta.epoch => None,
        Ok(saved) => {
            tracing::warn!(
                "{} holds epoch {}, the checkpoint names epoch {} as the best: the next epoch starts a new best",
                best_dir.display(),
                saved.epoch,
                recorded.epoch
            );
            None
        }
        Err(e) => {
            tracing::warn!(
                "the best epoch's checkpoint is not usable ({e}): the next epoch starts a new best"
            );
            None
        }
    }
}

/// The ranks' own batch-norm buffers a checkpoint inside an epoch saved beside the optimizer
/// state, when they fit this run: one row per rank, as many ranks, rows of this model's
/// buffer size. Another rank count starts every rank from the mean in the weights file.
fn saved_rank_buffers(
    graph: &Graph,
    optimizer_bytes: &[u8],
    ranks: usize,
) -> Option<Vec<Vec<f32>>> {
    let (shape, values) = crate::optim::read_f32_tensor(optimizer_bytes, RANK_BUFFERS_TENSOR)?;
    let len: usize = graph.buffers().iter().map(|b| b.numel()).sum();
    if len == 0 || shape != [ranks, len] {
        return None;
    }
    Some(values.chunks(len).map(<[f32]>::to_vec).collect())
}

/// Warnings about a training set that makes the figures misleading (the run goes on).
fn warn_about_dataset(cfg: &TrainConfig, classes: usize, train_images: usize) {
    if classes == 1 {
        tracing::warn!(
            "the training set has a single class: every prediction is that class, so accuracy is 1.0 by construction (add at least one more class folder)"
        );
    }
    let global = cfg.global_batch();
    if global > train_images && cfg.last_batch != pipeline::LastBatch::Pad {
        tracing::warn!(
            "a global batch of {global} is larger than the {train_images} training images: each step holds all {train_images}, and the learning rate is scaled for {train_images} (hint: a smaller --batch-size)"
        );
    }
}

/// Where a resumed run continues: the checkpoint's data position, moved to the same sample
/// count when the global batch changed (another rank count or batch size, saying so when
/// that repeats samples), and back to the start of the interrupted epoch when the training
/// data changed and `--allow-data-change` allows going on (otherwise a changed training set
/// is refused, saying what changed). The schedule's step count is then recounted for this
/// run's `steps_per_epoch`, so the learning rate goes on from the same point of the schedule.
fn resume_position(
    cfg: &TrainConfig,
    run: &std::path::Path,
    meta: &CheckpointMeta,
    now: &DatasetStamp,
    steps_per_epoch: u64,
) -> Result<DataPosition, TrainError> {
    let mut position = data_position_after_changes(cfg, run, meta, now)?;
    // The schedule counts optimizer steps; another global batch or training set makes
    // another number of steps per epoch, and the checkpoint's count would then point
    // elsewhere in the schedule (past its end, at rate 0, for a larger batch).
    let recounted = position.epoch * steps_per_epoch + position.step_in_epoch as u64;
    if recounted != position.global_step {
        tracing::warn!(
            "the learning-rate schedule goes on from epoch {}, step {} of {steps_per_epoch}: global step {recounted} for this run's steps per epoch (the checkpoint counted {} with a global batch of {})",
            position.epoch + 1,
            position.step_in_epoch,
            position.global_step,
            meta.global_batch
        );
        position.global_step = recounted;
    }
    Ok(position)
}

/// The checkpoint's data position after a changed global batch or training set (see
/// [`resume_position`]).
fn data_position_after_changes(
    cfg: &TrainConfig,
    run: &std::path::Path,
    meta: &CheckpointMeta,
    now: &DatasetStamp,
) -> Result<DataPosition, TrainError> {
    let mut position = meta.data_position.clone();
    if let Some(then) = &meta.dataset {
        if then != now {
            if !cfg.allow_data_change {
                return Err(TrainError::DataChanged {
                    path: run.to_path_buf(),
                    change: describe_change(then, now),
                    epoch: position.epoch + 1,
                });
            }
            tracing::warn!(
                "the training data changed since the checkpoint ({}): --allow-data-change restarts epoch {} on the new data",
                describe_change(then, now),
                position.epoch + 1
            );
            position.step_in_epoch = 0;
            position.samples_in_epoch = 0;
            position.partial_train = Default::default();
            return Ok(position);
        }
    }
    if meta.global_batch != cfg.global_batch() && position.step_in_epoch > 0 {
        let gb = cfg.global_batch() as u64;
        position.step_in_epoch = (position.samples_in_epoch / gb) as usize;
        if position.samples_in_epoch % gb != 0 {
            tracing::warn!(
                "resuming with global batch {gb} (was {}): {} samples of epoch {} are seen again",
                meta.global_batch,
                position.samples_in_epoch % gb,
                position.epoch + 1
            );
        }
    }
    Ok(position)
}

/// What differs between two stamps of the training data, in words.
fn describe_change(then: &DatasetStamp, now: &DatasetStamp) -> String {
    use std::cmp::Ordering;
    let (a, b) = (then.train_images, now.train_images);
    match b.cmp(&a) {
        Ordering::Less => format!("{a} training images then, {b} now: {} removed", a - b),
        Ordering::Greater => format!("{a} training images then, {b} now: {} added", b - a),
        Ordering::Equal => format!(
            "{a} training images then and now, but file names, sizes, labels or the image size differ"
        ),
    }
}

/// Checks a resumed checkpoint against this run: model, image size, class list.
fn check_resume(
    cfg: &TrainConfig,
    run: &std::path::Path,
    meta: &CheckpointMeta,
    classes: &[String],
) -> Result<(), TrainError> {
    check_resumed(run, meta, cfg.arch, cfg.image_size)?;
    if meta.classes != classes {
        return Err(TrainError::CheckpointMismatch {
            path: run.to_path_buf(),
            what: "class list",
            expected: summarise(classes),
            found: summarise(&meta.classes),
            hint: "resume on the dataset the checkpoint was trained on",
        });
    }
    Ok(())
}

/// Whether the checkpoint `meta` of `run` can continue as `arch` on images of `image_size`:
/// the weights fit no other model, and its cache and crops no other size. The command line
/// asks before anything else, the setup again for every caller.
pub(crate) fn check_resumed(
    run: &std::path::Path,
    meta: &CheckpointMeta,
    arch: crate::model::Arch,
    image_size: u32,
) -> Result<(), TrainError> {
    let mismatch = |what, expected: String, found: String, hint| TrainError::CheckpointMismatch {
        path: run.to_path_buf(),
        what,
        expected,
        found,
        hint,
    };
    if meta.model != arch.name() {
        return Err(mismatch(
            "model",
            arch.name().into(),
            meta.model.clone(),
            "resume with the checkpoint's --model, or start a new run",
        ));
    }
    if meta.image_size != image_size {
        return Err(mismatch(
            "image size",
            image_size.to_string(),
            meta.image_size.to_string(),
            "resume with the checkpoint's --image-size",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::folder::checkpoint::tests::meta;
    use crate::train::folder::CheckpointTensors;

    fn record(epoch: u64, accuracy: f64) -> BestEpoch {
        BestEpoch {
            epoch,
            accuracy,
            loss: 1.0 - accuracy,
        }
    }

    /// `run/` with a checkpoint after `done` epochs recording `recorded`, and a `best/`
    /// written after `best_done` epochs recording `saved` (none: no best/).
    fn run_with_best(
        dir: &Path,
        done: u64,
        recorded: Option<BestEpoch>,
        saved: Option<(u64, BestEpoch)>,
    ) -> CheckpointMeta {
        let folder = RunFolder::new(dir);
        folder.create().unwrap();
        let mut m = meta(dir);
        m.epoch = done;
        m.best = recorded;
        if let Some((best_done, best)) = saved {
            let mut b = m.clone();
            b.epoch = best_done;
            b.best = Some(best);
            folder
                .save_best(b, CheckpointTensors::pair(b"w", b"s"))
                .unwrap();
        }
        m
    }

    #[test]
    fn the_rendezvous_compares_the_resumed_checkpoints_step_and_weights() {
        let tmp = tempfile::tempdir().unwrap();
        let mut m = meta(tmp.path());
        m.step = 120;
        m.model_checksum = "00aa11bb22cc33dd".into();
        assert_eq!(
            start_point(Some(&(tmp.path().to_path_buf(), m))),
            StartPoint::Checkpoint {
                step: 120,
                weights: "00aa11bb22cc33dd".into()
            }
        );
        assert_eq!(start_point(None), StartPoint::Fresh);
    }

    #[test]
    fn a_run_resumed_from_its_best_folder_keeps_that_epoch_as_the_best() {
        let tmp = tempfile::tempdir().unwrap();
        let two = record(2, 0.8);
        let dir = tmp.path().join("run");
        run_with_best(&dir, 3, Some(two), Some((2, two)));
        let best_dir = dir.join(BEST_DIR);
        let m = CheckpointMeta::load(&best_dir).unwrap();
        assert_eq!(resumed_best(&best_dir, &m), Some(two));
        let to = RunFolder::new(tmp.path().join("to"));
        to.create().unwrap();
        let resumed = (best_dir, m);
        assert_eq!(start_best(&to, Some(&resumed)).unwrap(), Some(two));
        let copied = CheckpointMeta::load(&to.best_path()).unwrap();
        assert_eq!((copied.epoch, copied.best), (2, Some(two)));
    }

    #[test]
    fn a_resumed_run_keeps_its_best_epoch_only_when_best_holds_it() {
        let tmp = tempfile::tempdir().unwrap();
        let (two, three) = (record(2, 0.8), record(3, 0.9));
        let cases = [
            // best/ holds the recorded epoch.
            ("same", Some(two), Some((2, two)), Some(two)),
            // best/ written just before a kill, the checkpoint still at the epoch before.
            ("newer", Some(two), Some((3, three)), None),
            // best/ from elsewhere, or missing: a new best starts.
            ("other", Some(three), Some((2, two)), None),
            ("missing", Some(two), None, None),
            // No record (an older checkpoint).
            ("none", None, Some((2, two)), None),
        ];
        for (name, recorded, saved, want) in cases {
            let dir = tmp.path().join(name);
            let m = run_with_best(&dir, 2, recorded, saved);
            assert_eq!(resumed_best(&dir, &m), want, "{name}");
        }
        // Resumed elsewhere: best/ comes along with the record; a fresh run drops best/.
        let from = tmp.path().join("same");
        let m = CheckpointMeta {
            best: Some(two),
            ..meta(&from)
        };
        let to = RunFolder::new(tmp.path().join("to"));
        to.create().unwrap();
        let resumed = (from.clone(), m);
        assert_eq!(start_best(&to, Some(&resumed)).unwrap(), Some(two));
        assert!(CheckpointMeta::load(&to.best_path()).is_ok());
        assert_eq!(start_best(&to, None).unwrap(), None);
        assert!(!to.best_path().exists());
    }
}
