//! The one training loop: resume, every step with its report, evaluation, checkpoints, the
//! stop request and the end of the run, over a [`StepRunner`] that holds the model: the whole
//! of it ([`crate::trainer`]) or this rank's pipeline stages ([`crate::pipeline`]). What a step
//! does differs between them; everything around it is written here once.

use std::time::Instant;

use crate::aux::RouterReport;
use burn::module::Module;
use burn::tensor::Gradients;
use burn_parallel_comm::compile::{FUSION_BUILT, FusionCounter, FusionCounts, is_cube_device};
use burn_parallel_comm::memory::reset_peak_rss;
use burn_parallel_comm::{CommStats, OpKind, RankContext};
use burn_parallel_fsdp::MemoryTracker;
use burn_parallel_parallelizer::{LocalRows, MeshContext, StepReport};

use crate::batches::evaluates_after;
use crate::config::TrainConfig;
use crate::data::Dataset;
use crate::error::TrainError;
use crate::guard::check_finite;
use crate::malloc::release_freed_pages;
use crate::resume::{Resume, RunOptimizer, SavePoint, Saves, saves_after};
use crate::schedule::LrSchedule;
use crate::state::{model_state_bytes, optimizer_state_bytes};
use crate::step_log::{
    RankResult, Skipped, StepCalls, StepLog, StepTimes, max_over_world, step_figures,
};
use crate::stop::stop_agreed;
use crate::stragglers::Stragglers;
use crate::usage::ProcessUsage;

/// The step's batch, as the loop hands it to the runner.
pub(crate) struct StepInput<'a> {
    /// The training data.
    pub data: &'a Dataset,
    /// Where the data stream stands, in samples.
    pub position: usize,
    /// This rank's rows of every global batch.
    pub rows: &'a LocalRows,
    /// Whether a `nan` fault drill poisons this step's loss on this rank.
    pub nan_fault: bool,
    /// This rank's context (its collective counters, which a runner reads where forward
    /// ends).
    pub ctx: &'a RankContext,
}

/// What a runner's step produced.
pub(crate) struct StepDone {
    /// The global batch's loss and gradient norm.
    pub report: StepReport,
    /// Seconds of forward before backward began (`None`: a schedule interleaving them, whose
    /// whole time is reported as backward).
    pub forward_s: Option<f64>,
    /// This rank's collective counters where forward ended (`None` as for `forward_s`): what
    /// the step's gathers waited in forward, and so in backward.
    pub forward_comm: Option<CommStats>,
    /// The MoE routing of the step's last micro-batch.
    pub routing: Option<RouterReport>,
    /// A pipeline schedule's wait for its neighbours (seconds) and the most microbatches it
    /// held activations for.
    pub schedule: Option<(f64, usize)>,
    /// Whether the global batch held no trained token: the runner then ran the step without
    /// its update, on every rank alike (the count is the same everywhere).
    pub no_trained_tokens: bool,
}

/// The update of a step whose global batch has no trained token: none. AdamW would still move
/// the weights (its moments and weight decay), on a step that learned nothing.
pub(crate) fn no_update<M>(model: M, _grads: Gradients, _report: &StepReport) -> M {
    model
}

/// The optimizer update a runner's step calls once its gradients are synced.
pub(crate) type Update<'a, M> = &'a mut dyn FnMut(M, Gradients, &StepReport) -> M;

/// The model a rank trains, as the loop sees it.
pub(crate) trait StepRunner {
    /// The whole model, or this rank's stages.
    type Model: Module;

    /// Samples of the data stream one step consumes.
    fn samples_per_step(&self, cfg: &TrainConfig) -> usize;

    /// The model and optimizer state restored from `resume`'s checkpoint.
    fn resume(
        &self,
        model: Self::Model,
        resume: &Resume,
        optimizer: &mut RunOptimizer,
        mesh: &MeshContext,
    ) -> Result<Self::Model, TrainError>;

    /// The FSDP memory counters of the model's units.
    fn memory(&self, model: &Self::Model) -> Vec<MemoryTracker>;

    /// One step: forward, backward, gradient sync and `update`. Collective.
    fn step(
        &self,
        model: Self::Model,
        input: StepInput<'_>,
        update: Update<'_, Self::Model>,
        mesh: &MeshContext,
    ) -> Result<(Self::Model, StepDone), TrainError>;

    /// The eval set's mean loss. Collective.
    fn eval(
        &self,
        model: &Self::Model,
        eval: &Dataset,
        rows: &LocalRows,
        mesh: &MeshContext,
    ) -> Result<f32, TrainError>;

    /// Writes a resumable checkpoint (collective; `saves` writes it in the background under
    /// `--async-save`).
    fn save_checkpoint(
        &self,
        saves: &mut Saves,
        at: SavePoint<'_>,
        model: &Self::Model,
        optimizer: &RunOptimizer,
        mesh: &MeshContext,
    ) -> Result<(), TrainError>;

    /// The end of a finished run: LoRA's adapter and merge, and `--save`. Collective.
    fn finish(&self, model: Self::Model, mesh: &MeshContext) -> Result<(), TrainError>;
}

/// What a rank's run works with, whatever its runner.
pub(crate) struct RankRun<'a> {
    /// The run's settings.
    pub cfg: &'a TrainConfig,
    /// The training data.
    pub data: &'a Dataset,
    /// The `--eval-data` set, if any.
    pub eval: Option<&'a Dataset>,
    /// The checkpoint to resume from, if any.
    pub resume: Option<&'a Resume>,
    /// This rank's mesh.
    pub mesh: &'a MeshContext,
    /// This rank's place in the launch (its collectives' statistics).
    pub ctx: &'a RankContext,
    /// Sees every step on rank 0.
    pub on_step: &'a (dyn Fn(&StepLog) + Sync),
}

/// Trains `model` (`trainable_params` of it) as `run.cfg` says through `runner`: resumes,
/// runs the steps, reports each to `on_step` on rank 0, evaluates, saves and stops as asked,
/// and finishes the run.
pub(crate) fn train_loop<R: StepRunner>(
    run: &RankRun<'_>,
    runner: &R,
    (model, trainable_params): (R::Model, u64),
) -> Result<RankResult, TrainError> {
    let (cfg, mesh, ctx) = (run.cfg, run.mesh, run.ctx);
    let mut optimizer = RunOptimizer::new(cfg);
    // Where the data stream stands, in samples: batches follow it rather than the step, so a
    // resumed run continues the stream exactly (also with another --global-batch). The
    // schedule continues from its saved position, so a run resumed mid-warmup goes on without
    // a jump.
    let (mut model, start, position, schedule_start) = match run.resume {
        Some(r) => {
            let model = runner.resume(model, r, &mut optimizer, mesh)?;
            (model, r.step, r.data_position, r.schedule_position)
        }
        None => (model, 0, 0, 0),
    };
    let (figures, my_state) = run_figures(runner, &model, &optimizer, trainable_params, run)?;
    let mut steps = Steps {
        run,
        runner,
        optimizer,
        rows: mesh.local_rows(cfg.global_batch),
        figures,
        stragglers: Stragglers::default(),
        position,
        kernels: (FUSION_BUILT && is_cube_device(mesh.device())).then(FusionCounter::start),
    };
    let schedule = LrSchedule::of(cfg);
    let stats_before = ctx.stats();
    let mut reports = Vec::with_capacity(cfg.steps - start);
    let mut saves = Saves::new();
    let mut stopped_at = None;
    for step in start..cfg.steps {
        let lr = schedule.lr_at(schedule_start + (step - start));
        let (next, report) = steps.step(model, step, lr)?;
        model = next;
        if ctx.rank() == 0 {
            (run.on_step)(&report);
        }
        reports.push(report);
        // A stop request (preemption) ends every rank's run after this step, saved.
        let stop = stop_agreed(cfg.stop.as_ref(), ctx)?;
        if let Some(save_dir) = &cfg.save_dir
            && (saves_after(cfg, step + 1) || stop)
        {
            let at = SavePoint {
                save_dir,
                done: step + 1,
                data_position: steps.position,
            };
            runner.save_checkpoint(&mut saves, at, &model, &steps.optimizer, mesh)?;
        }
        if stop {
            stopped_at = Some(step + 1);
            break;
        }
    }
    saves.commit(mesh)?;
    let comm = ctx.stats().since(&stats_before).total();
    let comm_per_step = (comm.bytes_sent + comm.bytes_received) / reports.len().max(1) as u64;
    // A stopped run is not finished: its checkpoint resumes it.
    if stopped_at.is_none() {
        runner.finish(model, mesh)?;
    }
    Ok((reports, my_state, comm_per_step, saves.done, stopped_at))
}

/// The figures every step reports unchanged, and this rank's model state in bytes: the
/// largest rank's state and optimizer state (collective). Every rank has built its model by
/// then (the max waits for all), so what construction freed goes back to the system and the
/// peak RSS is reset here: the steps report training's peak, not the full model each rank
/// builds before sharding it.
fn run_figures<R: StepRunner>(
    runner: &R,
    model: &R::Model,
    optimizer: &RunOptimizer,
    trainable_params: u64,
    run: &RankRun<'_>,
) -> Result<(RunFigures, u64), TrainError> {
    let states = optimizer.states_per_param();
    let my_state = model_state_bytes(model, states);
    let my_optimizer_state = optimizer_state_bytes(model, states);
    let [peak_state, peak_optimizer_state] =
        max_over_world(run.ctx, [my_state, my_optimizer_state])?;
    release_freed_pages();
    reset_peak_rss();
    let figures = RunFigures {
        peak_state,
        peak_optimizer_state,
        trainable_params,
        global_tokens: (runner.samples_per_step(run.cfg) * run.cfg.seq_len) as f64,
        memory: runner.memory(model),
    };
    Ok((figures, my_state))
}

/// The loop's state between steps.
struct Steps<'a, R: StepRunner> {
    run: &'a RankRun<'a>,
    runner: &'a R,
    optimizer: RunOptimizer,
    /// This rank's rows of every global batch.
    rows: LocalRows,
    figures: RunFigures,
    stragglers: Stragglers,
    /// Where the data stream stands, in samples.
    position: usize,
    /// Burn's fusion kernels, counted on a CubeCL backend of a `fusion` build.
    kernels: Option<FusionCounter>,
}

impl<R: StepRunner> Steps<'_, R> {
    /// Step `step` at learning rate `lr`: the runner's step with the optimizer's update (or its
    /// skip), the finite check, the evaluation when due, and the step's report. Collective.
    fn step(
        &mut self,
        model: R::Model,
        step: usize,
        lr: f32,
    ) -> Result<(R::Model, StepLog), TrainError> {
        let RankRun { cfg, mesh, ctx, .. } = *self.run;
        let start_time = Instant::now();
        let (usage_before, comm_before) = (ProcessUsage::now(), ctx.stats());
        let kernels_before = self.kernels.as_ref().map(FusionCounter::counts);
        let nan_fault = cfg.fault.is_some_and(|f| f.at_step_start(ctx.rank(), step));
        self.optimizer.set_lr(lr);
        let mut update_s = None;
        let optimizer = &mut self.optimizer;
        let mut update = |m: R::Model, g: Gradients, report: &StepReport| {
            let (m, seconds) = optimizer.step_unless_skipped(cfg, m, &g, report);
            update_s = seconds;
            m
        };
        let input = StepInput {
            data: self.run.data,
            position: self.position,
            rows: &self.rows,
            nan_fault,
            ctx,
        };
        let (model, done) = self.runner.step(model, input, &mut update, mesh)?;
        let skipped = match (done.no_trained_tokens, update_s) {
            (true, _) => Some(Skipped::NoTrainedTokens),
            (false, None) => Some(Skipped::NotFinite),
            (false, Some(_)) => None,
        };
        let optimizer_s = update_s.unwrap_or(0.0);
        if skipped.is_none() {
            check_finite(cfg, step, &done.report)?;
        }
        // A skipped step still counts and consumes its batch.
        self.position += self.runner.samples_per_step(cfg);
        let step_time_s = start_time.elapsed().as_secs_f64();
        let eval_loss = match self.run.eval {
            Some(eval) if evaluates_after(cfg, step + 1) => {
                Some(self.runner.eval(&model, eval, &self.rows, mesh)?)
            }
            _ => None,
        };
        let kernels = self
            .kernels
            .as_ref()
            .zip(kernels_before)
            .map(|(counter, before)| counter.counts().since(&before));
        let measured = Measured {
            kernels,
            step,
            lr,
            skipped,
            step_time_s,
            optimizer_s,
            eval_loss,
            usage_before,
            comm_before,
        };
        let report = step_log(measured, done, &self.figures, &mut self.stragglers, ctx)?;
        Ok((model, report))
    }
}

/// What every step's report carries unchanged from the start of the run.
struct RunFigures {
    /// The largest rank's parameters + gradients + optimizer state.
    peak_state: u64,
    /// The largest rank's optimizer state.
    peak_optimizer_state: u64,
    /// The elements of the whole model that train.
    trainable_params: u64,
    /// Tokens one step trains on, over every rank.
    global_tokens: f64,
    /// The FSDP memory counters of the model's units.
    memory: Vec<MemoryTracker>,
}

/// What the loop measured around one step.
struct Measured {
    /// Burn's fusion kernels during the step, where they are counted.
    kernels: Option<FusionCounts>,
    step: usize,
    lr: f32,
    skipped: Option<Skipped>,
    step_time_s: f64,
    optimizer_s: f64,
    eval_loss: Option<f32>,
    usage_before: ProcessUsage,
    comm_before: CommStats,
}

/// The step's report: its result, times, collective calls and memory, with every rank's
/// figures exchanged (after the step's counters: the bookkeeping exchange is not the step's
/// traffic). Collective.
fn step_log(
    measured: Measured,
    done: StepDone,
    figures: &RunFigures,
    stragglers: &mut Stragglers,
    ctx: &RankContext,
) -> Result<StepLog, TrainError> {
    let m = measured;
    let (step, step_time_s, optimizer_s) = (m.step, m.step_time_s, m.optimizer_s);
    let usage = ProcessUsage::now();
    let comm = ctx.stats().since(&m.comm_before);
    let comm_s = |kind| comm.op(kind).time.as_secs_f64();
    let forward_s = done.forward_s.unwrap_or(0.0);
    let gather = comm.op(OpKind::AllGather);
    let (gather_s, gather_wait_s) = (gather.time.as_secs_f64(), gather.waited.as_secs_f64());
    let forward_gather = done
        .forward_comm
        .as_ref()
        .map(|at| at.since(&m.comm_before).op(OpKind::AllGather));
    let forward_gather_s = forward_gather.map(|g| g.time.as_secs_f64());
    let forward_wait_s = forward_gather.map(|g| g.waited.as_secs_f64());
    let times = StepTimes {
        forward_s,
        backward_s: step_time_s - forward_s - optimizer_s,
        optimizer_s,
        all_gather_s: gather_s,
        all_gather_forward_s: forward_gather_s,
        all_gather_backward_s: forward_gather_s.map(|f| gather_s - f),
        all_gather_forward_wait_s: forward_wait_s,
        all_gather_backward_wait_s: forward_wait_s.map(|f| gather_wait_s - f),
        reduce_scatter_s: comm_s(OpKind::ReduceScatter),
        all_reduce_s: comm_s(OpKind::AllReduce),
        all_to_all_s: comm_s(OpKind::AllToAll),
    };
    let calls = StepCalls {
        all_gather_calls: comm.op(OpKind::AllGather).calls,
        reduce_scatter_calls: comm.op(OpKind::ReduceScatter).calls,
        all_reduce_calls: comm.op(OpKind::AllReduce).calls,
        all_to_all_calls: comm.op(OpKind::AllToAll).calls,
    };
    let exchanged = step_figures(
        ctx,
        &figures.memory,
        stragglers,
        (step, step_time_s),
        &comm,
        usage.peak_rss_bytes,
    )?;
    let routing = done.routing.as_ref();
    Ok(StepLog {
        step,
        report: done.report,
        lr: m.lr,
        skipped: m.skipped,
        step_time_s,
        tokens_per_s: figures.global_tokens / step_time_s.max(1e-12),
        peak_model_state_bytes_per_rank: figures.peak_state,
        trainable_params: figures.trainable_params,
        optimizer_state_bytes_per_rank: figures.peak_optimizer_state,
        times,
        calls,
        minor_faults: usage.minor_faults - m.usage_before.minor_faults,
        peak_rss_bytes: usage.peak_rss_bytes,
        peak_rss_bytes_per_rank: exchanged.rss_peak,
        gathered_peak_bytes_per_rank: exchanged.gathered_peak,
        rank_compute_s: exchanged.compute_s,
        rank_wait_s: exchanged.wait_s,
        eval_loss: m.eval_loss,
        aux_loss: routing.and_then(|r| r.aux_loss),
        expert_tokens_min: routing.map(|r| r.expert_tokens.0),
        expert_tokens_max: routing.map(|r| r.expert_tokens.1),
        pp_wait_s: done.schedule.map(|s| s.0),
        pp_peak_microbatches: done.schedule.map(|s| s.1),
        kernels: m.kernels.map(|k| k.blocks),
        fused_kernels: m.kernels.map(|k| k.fused_blocks),
    })
}
