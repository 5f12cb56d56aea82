//! The trainer's side of sharded checkpoints: the optimizer a run steps with (whose state is
//! saved), where a run starts when it resumes, and what it records when it saves.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::Module;
use burn::tensor::Gradients;
use burn_parallel_checkpoint::{
    Checkpoint, OptimizerState, PendingSave, SaveOptions, StageParamPaths, TrainingProgress, save,
    save_async, save_stages, save_stages_async, step_dir,
};
use burn_parallel_parallelizer::{MeshContext, Parallelize, StepReport};
use serde_json::json;

use crate::config::{OptimizerKind, TrainConfig};
use crate::error::{TrainError, flag_error};
use crate::guard::skips;
use crate::optim::{AdamW, Optimizer, Sgd};
use crate::schedule::LrSchedule;

/// The optimizer of a run, concrete so that its state can be saved and restored.
pub(crate) enum RunOptimizer {
    Sgd(Sgd),
    AdamW(AdamW),
}

impl RunOptimizer {
    pub fn new(cfg: &TrainConfig) -> Self {
        match cfg.optimizer {
            OptimizerKind::Sgd => Self::Sgd(Sgd { lr: cfg.lr }),
            OptimizerKind::AdamW => Self::AdamW(AdamW::new(
                cfg.lr,
                cfg.beta1,
                cfg.beta2,
                cfg.eps,
                cfg.weight_decay,
            )),
        }
    }

    pub fn step<M: Module>(&mut self, model: M, grads: &Gradients) -> M {
        match self {
            Self::Sgd(o) => o.step(model, grads),
            Self::AdamW(o) => o.step(model, grads),
        }
    }

    /// The step's update unless `--on-nonfinite skip` drops it (decided on the reduced loss and
    /// global norm, before any update, so every rank keeps its weights and optimizer state at
    /// the same step): the model, and the update's seconds (`None`: skipped).
    pub fn step_unless_skipped<M: Module>(
        &mut self,
        cfg: &TrainConfig,
        model: M,
        grads: &Gradients,
        report: &StepReport,
    ) -> (M, Option<f64>) {
        if skips(cfg, report) {
            return (model, None);
        }
        let started = Instant::now();
        let model = self.step(model, grads);
        (model, Some(started.elapsed().as_secs_f64()))
    }

    /// Sets the learning rate of the next step (the schedule's).
    pub fn set_lr(&mut self, lr: f32) {
        match self {
            Self::Sgd(o) => o.lr = lr,
            Self::AdamW(o) => o.lr = lr,
        }
    }

    pub fn states_per_param(&self) -> usize {
        match self {
            Self::Sgd(o) => o.states_per_param(),
            Self::AdamW(o) => o.states_per_param(),
        }
    }

    pub fn state(&self) -> &dyn OptimizerState {
        match self {
            Self::Sgd(o) => o,
            Self::AdamW(o) => o,
        }
    }

    pub fn state_mut(&mut self) -> &mut dyn OptimizerState {
        match self {
            Self::Sgd(o) => o,
            Self::AdamW(o) => o,
        }
    }
}

/// Where a resumed run starts: the checkpoint (its metadata checked) and its progress.
pub(crate) struct Resume {
    pub checkpoint: Checkpoint,
    /// The first step to train.
    pub step: usize,
    /// Samples of the data stream already consumed.
    pub data_position: usize,
    /// The learning-rate schedule's position: the step whose rate comes next.
    pub schedule_position: usize,
}

/// Opens `--resume` before any rank starts, so that a missing or unreadable checkpoint, or one
/// with nothing left to train, fails at once.
pub(crate) fn open_resume(cfg: &TrainConfig) -> Result<Option<Resume>, TrainError> {
    let Some(path) = &cfg.resume else {
        return Ok(None);
    };
    let checkpoint = Checkpoint::open(path)?;
    let progress = checkpoint.progress();
    let step = progress.step as usize;
    if step >= cfg.steps {
        return Err(flag_error(
            "--resume",
            format!(
                "{}: the checkpoint is at step {step}, so --steps {} (the total) leaves nothing \
                 to train",
                checkpoint.dir().display(),
                cfg.steps
            ),
        ));
    }
    if !cfg.allow_data_change {
        check_same_data(cfg, &progress.extra)
            .map_err(|e| flag_error("--resume", format!("{}: {e}", checkpoint.dir().display())))?;
    }
    let schedule_position = schedule_position(&progress.extra, step)
        .map_err(|e| flag_error("--resume", format!("{}: {e}", checkpoint.dir().display())))?;
    Ok(Some(Resume {
        step,
        data_position: progress.data_position as usize,
        schedule_position,
        checkpoint,
    }))
}

/// That the run reads the data stream the checkpoint's run read: the same `--data` (the same
/// file, however named), `--seq-len` and `--global-batch`. Otherwise the data position would
/// silently point into another stream. A checkpoint that recorded none of them (written by an
/// earlier build or another program) is not checked.
fn check_same_data(cfg: &TrainConfig, extra: &serde_json::Value) -> Result<(), String> {
    let same_file = |recorded: &str, given: &Path| {
        let canonical = |p: &Path| std::fs::canonicalize(p).ok();
        recorded == given.display().to_string()
            || canonical(Path::new(recorded)).is_some_and(|r| Some(r) == canonical(given))
    };
    let mut differences = Vec::new();
    if let Some(recorded) = extra.get("data") {
        let recorded = recorded.as_str();
        let same = match (recorded, cfg.data.as_deref()) {
            (None, None) => true,
            (Some(r), Some(given)) => same_file(r, given),
            _ => false,
        };
        if !same {
            let given = cfg.data.as_ref().map(|d| d.display().to_string());
            differences.push(format!(
                "--data {} (the checkpoint's run read {})",
                given.as_deref().unwrap_or("(none: the built-in tokens)"),
                recorded.unwrap_or("the built-in tokens")
            ));
        }
    }
    for (flag, key, given) in [
        ("--seq-len", "seq_len", cfg.seq_len),
        ("--global-batch", "global_batch", cfg.global_batch),
    ] {
        if let Some(recorded) = extra.get(key).and_then(|v| v.as_u64())
            && recorded != given as u64
        {
            differences.push(format!(
                "{flag} {given} (the checkpoint's run used {recorded})"
            ));
        }
    }
    match differences.is_empty() {
        true => Ok(()),
        false => Err(format!(
            "the data stream differs from the checkpoint's: {}. Give the checkpoint's values, \
             or --allow-data-change to continue at the same sample position anyway",
            differences.join("; ")
        )),
    }
}

/// The schedule position a checkpoint records (`extra.lr_schedule.position`), or `step` for a
/// checkpoint saved before schedules were recorded (whose rate was constant).
fn schedule_position(extra: &serde_json::Value, step: usize) -> Result<usize, String> {
    match extra.get("lr_schedule").and_then(|s| s.get("position")) {
        None => Ok(step),
        Some(p) => p.as_u64().map(|p| p as usize).ok_or_else(|| {
            format!("its learning-rate schedule position `{p}` is not a step number")
        }),
    }
}

/// Whether a run saves a checkpoint once `done` steps are done: every `--save-every` steps and
/// after the last one.
pub(crate) fn saves_after(cfg: &TrainConfig, done: usize) -> bool {
    cfg.save_every
        .is_some_and(|every| done.is_multiple_of(every) || done == cfg.steps)
}

/// Where and when a checkpoint is saved: `save_dir/step-N` after `done` steps, the data
/// stream at `data_position`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SavePoint<'a> {
    pub save_dir: &'a Path,
    pub done: usize,
    pub data_position: usize,
}

/// A run's checkpoint saves into `save_dir/step-N`: written before training goes on, or with
/// `--async-save` on a background thread from a snapshot of the state while the next steps
/// train, at most one in flight (the previous one is committed before the next starts, and
/// at the end). A save in flight becomes a checkpoint only when committed, so a crash while it
/// is written leaves the previous checkpoint the newest.
pub(crate) struct Saves {
    in_flight: Option<PendingSave>,
    /// The committed checkpoints, in order.
    pub done: Vec<PathBuf>,
}

impl Saves {
    pub fn new() -> Self {
        Self {
            in_flight: None,
            done: Vec::new(),
        }
    }

    /// Saves the run's state after `done` steps (collective).
    pub fn save_model<M: Parallelize>(
        &mut self,
        cfg: &TrainConfig,
        at: SavePoint<'_>,
        model: &M,
        optimizer: &RunOptimizer,
        mesh: &MeshContext,
    ) -> Result<(), TrainError> {
        let (dir, progress, options) = self.next(cfg, at, mesh)?;
        let state = Some(optimizer.state());
        match cfg.async_save {
            true => {
                self.in_flight = Some(save_async(&dir, model, state, &progress, mesh, &options)?)
            }
            false => self
                .done
                .push(save(&dir, model, state, &progress, mesh, &options)?.dir),
        }
        Ok(())
    }

    /// [`save_model`](Self::save_model) of a pipeline run: this rank's `stages`, each under
    /// the whole model's paths (collective over every stage).
    pub fn save_stages<M: Parallelize + StageParamPaths>(
        &mut self,
        cfg: &TrainConfig,
        at: SavePoint<'_>,
        stages: &[M],
        optimizer: &RunOptimizer,
        mesh: &MeshContext,
    ) -> Result<(), TrainError> {
        let (dir, progress, options) = self.next(cfg, at, mesh)?;
        let state = Some(optimizer.state());
        match cfg.async_save {
            true => {
                let pending = save_stages_async(&dir, stages, state, &progress, mesh, &options)?;
                self.in_flight = Some(pending);
            }
            false => {
                let report = save_stages(&dir, stages, state, &progress, mesh, &options)?;
                self.done.push(report.dir);
            }
        }
        Ok(())
    }

    /// Commits the save in flight (one at a time), then where the save after `done` steps
    /// goes and what it records.
    fn next(
        &mut self,
        cfg: &TrainConfig,
        at: SavePoint<'_>,
        mesh: &MeshContext,
    ) -> Result<(PathBuf, TrainingProgress, SaveOptions), TrainError> {
        self.commit(mesh)?;
        let dir = step_dir(at.save_dir, at.done as u64);
        let progress = progress(cfg, at.done, at.data_position);
        let options = SaveOptions {
            fault: cfg.fault.and_then(|f| f.save_fault(at.done)),
        };
        Ok((dir, progress, options))
    }

    /// Commits the save in flight, if any (collective): waits for every rank's files.
    pub fn commit(&mut self, mesh: &MeshContext) -> Result<(), TrainError> {
        if let Some(pending) = self.in_flight.take() {
            self.done.push(pending.finish(mesh)?.dir);
        }
        Ok(())
    }
}

/// The progress a checkpoint after `done` steps records.
fn progress(cfg: &TrainConfig, done: usize, data_position: usize) -> TrainingProgress {
    TrainingProgress {
        step: done as u64,
        data_position: data_position as u64,
        // What the trainer needs to reproduce the data stream and the schedule (a resumed run
        // takes the schedule's position from here).
        extra: json!({
            // Every step advances the schedule, a skipped one too: its position is `done`.
            "lr_schedule": LrSchedule::of(cfg).to_json(done),
            "global_batch": cfg.global_batch,
            "seq_len": cfg.seq_len,
            "data": cfg.data.as_ref().map(|d| d.display().to_string()),
            "seed": cfg.seed,
        }),
    }
}
