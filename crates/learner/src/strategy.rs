//! [`ParallelStrategy`]: burn-train's `SupervisedLearningStrategy` over our ranks.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Mutex};

use burn::optim::{GradientsAccumulator, ModuleOptimizer};
use burn::store::ModuleRecord;
use burn::tensor::{Device, TensorData};
use burn_parallel_checkpoint::{
    BurnOptimizer, Checkpoint, LoadOptions, SaveOptions, TrainingProgress, save,
};
use burn_parallel_comm::{RankContext, ReduceOp, run_ranks};
use burn_parallel_parallelizer::{
    DistributedConfig, MeshContext, ParallelizableModel, full_model, parallelize_model,
};
use burn_train::checkpoint::{CheckpointingAction, CheckpointingStrategy, KeepLastNCheckpoints};
use burn_train::metric::store::EventStoreClient;
use burn_train::train::WorkerFailure;
use burn_train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, InferenceStep, Interrupter, Learner,
    LearnerEvent, LearnerModel, SupervisedLearningStrategy, SupervisedTrainingEventProcessor,
    TrainLoader, TrainStep, TrainingComponents, TrainingError, TrainingItem, TrainingStrategy,
    ValidLoader,
};

use crate::batch::{GatherOutput, SplitBatch};
use crate::error::LearnerError;
use crate::feed::{Fed, feed};
use crate::grads::sync_grads;

/// The device of each rank, by global rank.
type DeviceOf = Arc<dyn Fn(usize) -> Device + Send + Sync>;

/// burn-train's [`SupervisedLearningStrategy`] running a `Learner` under any
/// [`DistributedConfig`] (ddp, fsdp2, hsdp, tp, fsdp2_tp, megatron_fsdp, ep for MoE models),
/// ranks as threads of this process or, under `mpirun`, as MPI processes (the engine
/// `run_ranks` picks).
///
/// ```ignore
/// let strategy = ParallelStrategy::new(DistributedConfig::from_file("fsdp2.toml")?, AdamWConfig::new().init());
/// let result = SupervisedTraining::new(dir, train, valid)
///     .metrics((LossMetric::new(), AccuracyMetric::new()))
///     .with_training_strategy(strategy.into())
///     .launch(Learner::new(model, AdamWConfig::new().init(), 1e-3));
/// ```
///
/// Each rank parallelizes a copy of the Learner's model, takes its rows of every batch (the
/// input implements [`SplitBatch`]), runs the model's `TrainStep`, averages and clips the
/// gradients as the `Step` does and steps the optimizer on its shards with the Learner's
/// learning-rate scheduler; the outputs of the data-parallel ranks are joined
/// ([`GatherOutput`]) so that rank 0 renders the metrics of the whole batch. Interruption, early
/// stopping and failures are agreed by every rank at each step. The returned model is whole
/// (`full_model`: FSDP, TP and expert shards gathered back).
///
/// What burn-train's extension point cannot express, and what this does instead:
/// - the Learner's optimizer is private: the strategy takes the optimizer (give the same one
///   to both; the Learner's stays unused);
/// - burn-train's checkpointers save the Learner's own model and optimizer records, which
///   hold neither the shards nor their optimizer state: the strategy writes sharded
///   checkpoints itself ([`checkpoints`](Self::checkpoints)), choosing which epochs to keep
///   with a burn-train [`CheckpointingStrategy`], and resumes from them when the Learner is
///   launched with `.checkpoint(epoch)`; the learning-rate scheduler is stepped again to the
///   saved step count (Burn's schedulers are functions of it). Registering burn-train
///   checkpointers as well is refused.
pub struct ParallelStrategy {
    config: DistributedConfig,
    optimizer: ModuleOptimizer,
    max_grad_norm: Option<f32>,
    device: Option<DeviceOf>,
    checkpoints: Option<PathBuf>,
    checkpointing: Mutex<Box<dyn CheckpointingStrategy>>,
    rank_interrupters: Vec<(usize, Interrupter)>,
}

impl ParallelStrategy {
    /// A strategy running `config` (its `world_size` ranks; 1 when unset), stepping
    /// `optimizer` on each rank's shards.
    pub fn new(config: DistributedConfig, optimizer: ModuleOptimizer) -> Self {
        Self {
            config,
            optimizer,
            max_grad_norm: None,
            device: None,
            checkpoints: None,
            checkpointing: Mutex::new(Box::new(KeepLastNCheckpoints::new(2))),
            rank_interrupters: Vec::new(),
        }
    }

    /// Clips the gradients to `max_norm` by their global L2 norm over every shard (burn's
    /// per-optimizer clipping would see only the shards, so it is refused).
    pub fn max_grad_norm(mut self, max_norm: f32) -> Self {
        self.max_grad_norm = Some(max_norm);
        self
    }

    /// The device of each rank, by global rank (for example a GPU per rank); its autodiff
    /// variant is used. By default every rank computes on the Learner's model's device.
    pub fn device_per_rank(
        mut self,
        device: impl Fn(usize) -> Device + Send + Sync + 'static,
    ) -> Self {
        self.device = Some(Arc::new(device));
        self
    }

    /// Writes a sharded checkpoint (every rank its own shards and optimizer state) to
    /// `dir/epoch-N` at the end of each epoch the checkpointing strategy keeps, and resumes
    /// from `dir/epoch-N` when the Learner is launched with `.checkpoint(N)`, under any
    /// strategy and world size.
    pub fn checkpoints(mut self, dir: impl AsRef<Path>) -> Self {
        self.checkpoints = Some(dir.as_ref().to_path_buf());
        self
    }

    /// Which epochs' checkpoints to save and delete (default: keep the last two).
    pub fn checkpointing_strategy(
        mut self,
        strategy: impl CheckpointingStrategy + 'static,
    ) -> Self {
        self.checkpointing = Mutex::new(Box::new(strategy));
        self
    }

    /// An interrupter only rank `rank` watches, besides the Learner's: under MPI each process
    /// has its own Learner interrupter, and this gives rank threads the same (a check or a
    /// signal that concerns one rank). Stopping it stops every rank at the same step, as a
    /// stop of the Learner's interrupter does.
    pub fn rank_interrupter(mut self, rank: usize, interrupter: Interrupter) -> Self {
        self.rank_interrupters.push((rank, interrupter));
        self
    }

    /// Whether rank `rank`'s own interrupters ask to stop.
    fn rank_stops(&self, rank: usize) -> bool {
        self.rank_interrupters
            .iter()
            .any(|(r, i)| *r == rank && i.should_stop())
    }

    /// The checkpoint of `epoch` under `dir` (`dir/epoch-N`).
    pub fn epoch_dir(dir: &Path, epoch: usize) -> PathBuf {
        dir.join(format!("epoch-{epoch}"))
    }

    fn rank_device(&self, rank: usize, default: &Device) -> Device {
        let device = match &self.device {
            Some(of) => of(rank),
            None => default.clone(),
        };
        match device.is_autodiff() {
            true => device,
            false => device.autodiff(),
        }
    }

    /// What the Learner was given that this strategy cannot honour, before any rank starts.
    fn check<M: LearnerModel>(
        &self,
        components: &TrainingComponents<M>,
    ) -> Result<(), LearnerError> {
        if components.checkpointer.is_some() {
            return Err(LearnerError::Unsupported(
                "burn-train checkpointers (with_default_checkpointers / with_custom_checkpointers) \
                 save the Learner's own model and optimizer, not the shards ParallelStrategy trains: \
                 remove them and use ParallelStrategy::checkpoints(dir), which writes sharded \
                 checkpoints that resume under any strategy"
                    .into(),
            ));
        }
        if self.optimizer.has_gradient_clipping() {
            return Err(LearnerError::Unsupported(
                "the optimizer clips gradients, which on shards would use each shard's norm: \
                 configure the optimizer without clipping and use ParallelStrategy::max_grad_norm \
                 (the global norm over every shard)"
                    .into(),
            ));
        }
        if components.checkpoint.is_some() && self.checkpoints.is_none() {
            return Err(LearnerError::Unsupported(
                "the Learner resumes from a checkpoint (`.checkpoint(epoch)`) but ParallelStrategy \
                 has no checkpoint directory: call ParallelStrategy::checkpoints(dir)"
                    .into(),
            ));
        }
        Ok(())
    }
}

impl<M: LearnerModel> From<ParallelStrategy> for TrainingStrategy<M>
where
    ParallelStrategy: SupervisedLearningStrategy<M>,
{
    fn from(strategy: ParallelStrategy) -> Self {
        TrainingStrategy::Custom(Arc::new(strategy))
    }
}

/// What the rank threads of this process share.
struct Shared<M: LearnerModel> {
    learner: Mutex<Learner<M>>,
    /// The initial weights, as data: each rank builds its own tensors from them.
    init: ModuleRecord,
    processor: Mutex<SupervisedTrainingEventProcessor<M>>,
    early_stopping: Mutex<Option<Box<dyn CloneEarlyStoppingStrategy>>>,
    store: Arc<EventStoreClient>,
    interrupter: Interrupter,
    grad_accumulation: Option<usize>,
    epochs: (usize, usize),
    resume: Option<usize>,
    items: (usize, usize),
    device: Device,
}

/// What the strategy needs of a Learner's model: a model the parallelizer understands whose
/// train and valid batches split per data-parallel rank and whose outputs join back.
pub trait ParallelLearnerModel:
    LearnerModel
    + ParallelizableModel
    + TrainStep<Input: SplitBatch, Output: GatherOutput>
    + InferenceStep<Input: SplitBatch, Output: GatherOutput>
{
}

impl<M> ParallelLearnerModel for M where
    M: LearnerModel
        + ParallelizableModel
        + TrainStep<Input: SplitBatch, Output: GatherOutput>
        + InferenceStep<Input: SplitBatch, Output: GatherOutput>
{
}

/// The local ranks' ends of their feeds.
type Senders<T, V> = Vec<SyncSender<Fed<T, V>>>;

/// The channels that start the feeder once every local rank has one.
struct Registry<T, V> {
    start: Mutex<Option<mpsc::Sender<Senders<T, V>>>>,
    ranks: Mutex<Senders<T, V>>,
}

impl<M> SupervisedLearningStrategy<M> for ParallelStrategy
where
    M: ParallelLearnerModel,
{
    fn fit(
        &self,
        components: TrainingComponents<M>,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let model = learner.model();
        let interrupter = components.interrupter.clone();
        if let Err(e) = self.check(&components) {
            interrupter.fail(failure(0, e.to_string()));
            return (model, components.event_processor);
        }
        let device = model.devices().into_iter().next().unwrap_or_default();
        let device = self.rank_device(0, &device);
        // As the single-device strategy does: one `to_device` per loader (each forks its RNG).
        let train = dataloader_train.to_device(&device);
        let valid = dataloader_valid.to_device(&device);
        let shared = Shared {
            init: model.clone().into_record(),
            learner: Mutex::new(learner),
            processor: Mutex::new(components.event_processor),
            early_stopping: Mutex::new(components.early_stopping),
            store: components.event_store,
            interrupter: interrupter.clone(),
            grad_accumulation: components.grad_accumulation,
            epochs: (starting_epoch, components.num_epochs),
            resume: components.checkpoint,
            items: (train.num_items(), valid.num_items()),
            device,
        };
        let world = self.config.world_size.unwrap_or(1);
        let outcome = std::thread::scope(|scope| {
            let (start, ranks) = mpsc::channel();
            let epochs = shared.epochs;
            let feeder_interrupter = interrupter.clone();
            let feeder = scope.spawn(move || feed(ranks, train, valid, epochs, feeder_interrupter));
            let registry = Registry {
                start: Mutex::new(Some(start)),
                ranks: Mutex::new(Vec::new()),
            };
            let outcome = run_ranks(world, |rank| self.run_rank(rank, &shared, &registry));
            drop(registry); // a feeder still waiting for ranks ends
            let _ = feeder.join();
            outcome
        });
        let processor = shared
            .processor
            .into_inner()
            .unwrap_or_else(|p| p.into_inner());
        match outcome {
            Ok(models) => match models.into_iter().next() {
                Some((_, whole)) => (whole, processor),
                None => (model, processor),
            },
            Err(error) => {
                let failures = error
                    .failures
                    .iter()
                    .map(|f| WorkerFailure {
                        device_id: f.rank,
                        message: f.message.clone(),
                    })
                    .collect();
                interrupter.fail(TrainingError::Workers(failures));
                (model, processor)
            }
        }
    }
}

/// A strategy error as burn-train's `TrainingError`, naming the rank.
fn failure(rank: usize, message: String) -> TrainingError {
    TrainingError::Workers(vec![WorkerFailure {
        device_id: rank,
        message,
    }])
}

/// One rank's state through the epochs.
struct Rank<'a, M: LearnerModel> {
    ctx: MeshContext,
    model: M,
    optimizer: ModuleOptimizer,
    learner: Learner<M>,
    /// Optimizer steps taken (what the scheduler has been stepped).
    steps: u64,
    leader: bool,
    shared: &'a Shared<M>,
    strategy: &'a ParallelStrategy,
}

type Feed<M> = Receiver<Fed<<M as TrainStep>::Input, <M as InferenceStep>::Input>>;

impl ParallelStrategy {
    fn run_rank<M>(
        &self,
        rank: RankContext,
        shared: &Shared<M>,
        registry: &Registry<<M as TrainStep>::Input, <M as InferenceStep>::Input>,
    ) -> Result<M, LearnerError>
    where
        M: ParallelLearnerModel,
    {
        let id = rank.rank();
        let device = self.rank_device(id, &shared.device);
        let ctx = MeshContext::new(&rank, self.config.clone(), device)?;
        let (sender, feed) = mpsc::sync_channel(2);
        lock(&registry.ranks).push(sender);
        // Every local rank has registered once every rank has reached this barrier.
        ctx.world_group().barrier()?;
        if let Some(start) = lock(&registry.start).take() {
            let _ = start.send(std::mem::take(&mut *lock(&registry.ranks)));
        }
        let learner = lock(&shared.learner).clone();
        let model = learner.model().load_record(shared.init.clone());
        let model = parallelize_model(model, &ctx)?;
        let mut rank = Rank {
            ctx,
            model,
            optimizer: self.optimizer.clone(),
            learner,
            steps: 0,
            leader: id == 0,
            shared,
            strategy: self,
        };
        if let Some(epoch) = shared.resume {
            rank.resume(epoch)?;
        }
        let (first, last) = shared.epochs;
        for epoch in first..=last {
            rank.event(|p| {
                p.process_train(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: shared.items.0,
                })
            });
            let stopped = rank.train_epoch(&feed)?;
            rank.event(|p| p.process_train(LearnerEvent::EndSplit(epoch)));
            if stopped {
                break;
            }
            rank.event(|p| {
                p.process_valid(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: shared.items.1,
                })
            });
            let stopped = rank.valid_epoch(&feed)?;
            rank.event(|p| p.process_valid(LearnerEvent::EndSplit(epoch)));
            rank.event(|p| p.process_train(LearnerEvent::EndEpoch(epoch)));
            if self.checkpoints.is_some() || lock(&shared.early_stopping).is_some() {
                rank.event(|p| p.flush());
            }
            if stopped || rank.agree(false)? {
                break;
            }
            if let Some(dir) = &self.checkpoints {
                rank.checkpoint(dir, epoch)?;
            }
            if rank.early_stop(epoch)? {
                break;
            }
        }
        drop(feed);
        Ok(full_model(rank.model)?)
    }
}

impl<M> Rank<'_, M>
where
    M: ParallelLearnerModel,
{
    /// An event for the renderer and the metrics: rank 0's alone.
    fn event(
        &self,
        f: impl FnOnce(
            &mut SupervisedTrainingEventProcessor<M>,
        ) -> Result<(), burn_train::EventProcessorError>,
    ) {
        if self.leader {
            let result = f(&mut lock(&self.shared.processor));
            self.shared.interrupter.fail_on_error(result);
        }
    }

    /// Whether any rank stops (its interrupter was stopped or failed, or `failed` here): every
    /// rank calls it at the same points and gets the same answer. A rank stopped by another
    /// one records it on its own interrupter (under MPI each process has its own).
    fn agree(&self, failed: bool) -> Result<bool, LearnerError> {
        let local = failed
            || self.shared.interrupter.should_stop()
            || self.strategy.rank_stops(self.ctx.rank());
        let stop = match self.ctx.world_size() {
            1 => local,
            _ => {
                let flag = TensorData::new(vec![f32::from(u8::from(local))], [1]);
                let all = self.ctx.world_group().all_reduce(flag, ReduceOp::Max)?;
                all.try_into_vec::<f32>().expect("an f32 flag")[0] > 0.0
            }
        };
        if stop && !self.shared.interrupter.should_stop() {
            self.shared
                .interrupter
                .stop(Some("another rank of the parallel job stopped"));
        }
        Ok(stop)
    }

    /// Rank 0's decision (from its event store), the same on every rank.
    fn leaders(&self, values: Vec<f64>) -> Result<Vec<f64>, LearnerError> {
        if self.ctx.world_size() == 1 {
            return Ok(values);
        }
        let data = self.leader.then(|| {
            let n = values.len();
            TensorData::new(values, [n])
        });
        let data = self.ctx.world_group().broadcast(data, 0)?;
        Ok(data.try_into_vec::<f64>().expect("f64 values"))
    }

    /// This rank's rows of a batch, on `device`.
    fn local_rows<B: SplitBatch>(
        &self,
        batch: &Mutex<B>,
        device: &Device,
    ) -> Result<(B, usize), LearnerError> {
        let batch = lock(batch);
        let size = batch.batch_size();
        let dp = self.ctx.dp_size();
        if !size.is_multiple_of(dp) {
            return Err(LearnerError::UnevenBatch { batch: size, dp });
        }
        let rows = self.ctx.local_rows(size);
        Ok((batch.rows(rows.rows.clone(), device), rows.len()))
    }

    /// One training split. True when the ranks agreed to stop.
    fn train_epoch(&mut self, feed: &Feed<M>) -> Result<bool, LearnerError> {
        let mut accumulator = GradientsAccumulator::new();
        let mut accumulated = 0;
        let mut iteration = 0;
        loop {
            let (batch, progress) = match next(feed)? {
                Fed::Train(batch, progress) => (batch, progress),
                Fed::End => return Ok(false),
                Fed::Failed => return self.agree(true),
                Fed::Valid(..) => return Err(out_of_order()),
            };
            iteration += 1;
            let device = self.ctx.device().clone();
            let (input, rows) = self.local_rows(&batch, &device)?;
            drop(batch);
            let output = TrainStep::step(&self.model, input);
            let grads = match self.shared.grad_accumulation {
                Some(every) => {
                    accumulator.accumulate(&self.model, output.grads);
                    accumulated += 1;
                    match accumulated >= every || progress.is_completed() {
                        true => {
                            accumulated = 0;
                            Some(accumulator.grads())
                        }
                        false => None,
                    }
                }
                None => Some(output.grads),
            };
            if let Some(grads) = grads {
                let grads = sync_grads(&self.model, grads, self.strategy.max_grad_norm, &self.ctx)?;
                self.learner.lr_step();
                self.steps += 1;
                let model = self.model.clone();
                self.model = self.optimizer.step(self.learner.lr_current(), model, grads);
            }
            let item = output.item.gather(rows, self.ctx.dp_group())?;
            let lr = self.learner.lr_current();
            self.event(|p| {
                let item = TrainingItem::new(item, progress, Some(iteration), Some(lr));
                p.process_train(LearnerEvent::ProcessedItem(item))
            });
            if self.agree(false)? {
                return Ok(true);
            }
        }
    }

    /// One validation split: the parallel model's forward on each rank's rows. True when the
    /// ranks agreed to stop.
    fn valid_epoch(&mut self, feed: &Feed<M>) -> Result<bool, LearnerError> {
        let model = self.model.valid();
        let device = self.ctx.device().clone().inner();
        let mut iteration = 0;
        loop {
            let (batch, progress) = match next(feed)? {
                Fed::Valid(batch, progress) => (batch, progress),
                Fed::End => return Ok(false),
                Fed::Failed => return self.agree(true),
                Fed::Train(..) => return Err(out_of_order()),
            };
            iteration += 1;
            let (input, rows) = self.local_rows(&batch, &device)?;
            drop(batch);
            let output = InferenceStep::step(&model, input);
            let item = output.gather(rows, self.ctx.dp_group())?;
            self.event(|p| {
                let item = TrainingItem::new(item, progress, Some(iteration), None);
                p.process_valid(LearnerEvent::ProcessedItem(item))
            });
            if self.agree(false)? {
                return Ok(true);
            }
        }
    }

    /// The checkpointing strategy's actions for `epoch` (rank 0 decides from its event
    /// store): the save, collective, then rank 0 deletes what it drops.
    fn checkpoint(&mut self, dir: &Path, epoch: usize) -> Result<(), LearnerError> {
        let mut decided = Vec::new();
        if self.leader {
            let actions =
                lock(&self.strategy.checkpointing).checkpointing(epoch, &self.shared.store);
            for action in actions {
                decided.push(match action {
                    CheckpointingAction::Save => -1.0,
                    CheckpointingAction::Delete(e) => e as f64,
                });
            }
        }
        decided.push(f64::NAN); // never empty
        let decided = self.leaders(decided)?;
        if decided.contains(&-1.0) {
            let state = BurnOptimizer::new(&mut self.optimizer, &self.model)?;
            let progress = TrainingProgress {
                step: self.steps,
                data_position: (epoch * self.shared.items.0) as u64,
                extra: serde_json::json!({ "epoch": epoch }),
            };
            let path = ParallelStrategy::epoch_dir(dir, epoch);
            save(
                &path,
                &self.model,
                Some(&state),
                &progress,
                &self.ctx,
                &SaveOptions::default(),
            )?;
        }
        if self.leader {
            for e in decided.iter().filter(|e| **e >= 0.0) {
                let path = ParallelStrategy::epoch_dir(dir, *e as usize);
                if path.exists() {
                    std::fs::remove_dir_all(&path)
                        .map_err(|source| LearnerError::Io { path, source })?;
                }
            }
        }
        Ok(())
    }

    /// Loads `dir/epoch-N` into this rank's model and optimizer and steps the scheduler to the
    /// saved step count.
    fn resume(&mut self, epoch: usize) -> Result<(), LearnerError> {
        let dir = self
            .strategy
            .checkpoints
            .as_deref()
            .expect("checked before launch");
        let checkpoint = Checkpoint::open(ParallelStrategy::epoch_dir(dir, epoch))?;
        let mut state = BurnOptimizer::new(&mut self.optimizer, &self.model)?;
        let model = self.model.clone();
        self.model = checkpoint
            .load(model, Some(&mut state), &self.ctx, &LoadOptions::default())?
            .0;
        self.steps = checkpoint.progress().step;
        for _ in 0..self.steps {
            self.learner.lr_step();
        }
        Ok(())
    }

    /// Rank 0's early-stopping decision for `epoch`, on every rank.
    fn early_stop(&self, epoch: usize) -> Result<bool, LearnerError> {
        let mut stopping = lock(&self.shared.early_stopping);
        let Some(early) = stopping.as_mut() else {
            return Ok(false);
        };
        let local = self.leader && early.should_stop(epoch, &self.shared.store);
        drop(stopping);
        Ok(self.leaders(vec![f64::from(u8::from(local))])?[0] > 0.0)
    }
}

/// The next message of the feeder.
fn next<T, V>(feed: &Receiver<Fed<T, V>>) -> Result<Fed<T, V>, LearnerError> {
    feed.recv().map_err(|_| {
        LearnerError::Unsupported(
            "the data feeder of this process ended before the epoch did (see the other ranks' \
             errors)"
                .into(),
        )
    })
}

fn out_of_order() -> LearnerError {
    LearnerError::Unsupported("the data feeder sent a batch of the other split (a bug)".into())
}

/// A lock that a panicking rank thread cannot poison for the others (the launch reports the
/// panic).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
