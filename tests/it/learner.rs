//! burn-train's `SupervisedTraining` under `ParallelStrategy`: each strategy's per-epoch
//! metrics equal burn-train's own single-device run, an interruption on one rank stops every
//! rank at the same step, and a run resumed from a sharded checkpoint under another strategy
//! continues as the uninterrupted run did.

#[allow(dead_code)]
#[path = "../../examples/support/learner_setup.rs"]
mod setup;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, mpsc};
use std::time::Duration;

use burn::module::{Module, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::AdamWConfig;
use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::tensor::Device;
use burn::tensor::activation::relu;
use burn::tensor::{Distribution, Tensor};
use burn_parallel::learner::ParallelStrategy;
use burn_parallel::learner::burn_train::metric::store::EventStoreClient;
use burn_parallel::learner::burn_train::metric::{AccuracyMetric, LearningRateMetric, LossMetric};
use burn_parallel::learner::burn_train::{
    ClassificationOutput, EarlyStoppingStrategy, ExecutionStrategy, InferenceStep, Interrupter,
    Learner, SupervisedTraining, TrainOutput, TrainStep, TrainingStrategy,
};
use burn_parallel::models::{Experts, SparseMoe};
use burn_parallel::prelude::*;
use setup::{ClassBatch, Classifier, Quiet, Recorder, Table};

const TRAIN: usize = 32;
const VALID: usize = 16;
const BATCH: usize = 8;

/// What a run left: its metrics, the items its renderer showed, whether it was interrupted,
/// its error, and the returned model's parameters.
struct Run {
    table: Table,
    rendered: usize,
    interrupted: bool,
    error: Option<String>,
    params: Vec<f32>,
}

fn init() -> burn::store::ModuleRecord {
    Classifier::new(&Device::flex().autodiff()).into_record()
}

fn config(strategy: Strategy, world: usize, tp: usize) -> DistributedConfig {
    DistributedConfig {
        strategy,
        world_size: Some(world),
        tp_size: tp,
        ..Default::default()
    }
}

fn params<M: Module>(model: &M) -> Vec<f32> {
    struct Flat(Vec<f32>);
    impl burn::module::ModuleVisitor for Flat {
        fn visit_float<const D: usize>(
            &mut self,
            p: &burn::module::Param<burn::tensor::Tensor<D>>,
        ) {
            let data = p.val().into_data().convert_dtype(burn::tensor::DType::F32);
            self.0.extend(data.try_into_vec::<f32>().unwrap());
        }
    }
    let mut flat = Flat(Vec::new());
    model.visit(&mut flat);
    flat.0
}

/// A `SupervisedTraining` of `model` for `epochs` epochs under `strategy`, with a linearly
/// decaying learning rate (so a resumed scheduler shows), resuming from `resume`.
fn train<M>(
    model: M,
    strategy: TrainingStrategy<M>,
    epochs: usize,
    resume: Option<usize>,
    interrupter: Option<Interrupter>,
    accumulate: Option<usize>,
    stop_after: Option<usize>,
) -> Run
where
    M: burn_parallel::learner::burn_train::LearnerModel
        + TrainStep<Input = ClassBatch, Output = ClassificationOutput>
        + InferenceStep<Input = ClassBatch, Output = ClassificationOutput>,
{
    let (train, valid) = setup::loaders(TRAIN, VALID, BATCH, 7, &model.devices()[0]);
    let recorder = Recorder::default();
    let quiet = Quiet::default();
    let dir = scratch("run");
    let mut training = SupervisedTraining::new(&dir, train, valid)
        .metrics((LossMetric::new(), AccuracyMetric::new()))
        .metric_train_numeric(LearningRateMetric::new())
        .with_metric_logger(recorder.clone())
        .with_application_logger(None)
        .renderer(Box::new(quiet.clone()))
        .num_epochs(epochs)
        .with_training_strategy(strategy);
    if let Some(epoch) = resume {
        training = training.checkpoint(epoch);
    }
    if let Some(interrupter) = interrupter {
        training = training.with_interrupter(interrupter);
    }
    if let Some(every) = accumulate {
        training = training.grads_accumulation(every);
    }
    if let Some(epoch) = stop_after {
        training = training.early_stopping(StopAfter(epoch));
    }
    let scheduler = LinearLrSchedulerConfig::new(2e-2, 2e-3, 40).init().unwrap();
    let result = training.launch(Learner::new(model, AdamWConfig::new().init(), scheduler));
    let _ = std::fs::remove_dir_all(&dir);
    Run {
        table: recorder.table(),
        rendered: quiet.items.load(Ordering::Relaxed),
        interrupted: result.interrupted.is_some(),
        error: result.error.map(|e| e.to_string()),
        params: params(&result.model),
    }
}

fn scratch(name: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("bp-learner-{name}-{}-{n}", std::process::id()))
}

fn single(epochs: usize, accumulate: Option<usize>) -> Run {
    let model = Classifier::new(&Device::flex().autodiff()).load_record(init_once().clone());
    let device = Device::flex().autodiff();
    train(
        model,
        TrainingStrategy::Default(ExecutionStrategy::SingleDevice(device)),
        epochs,
        None,
        None,
        accumulate,
        None,
    )
}

fn init_once() -> &'static burn::store::ModuleRecord {
    static INIT: std::sync::OnceLock<burn::store::ModuleRecord> = std::sync::OnceLock::new();
    INIT.get_or_init(init)
}

fn parallel(
    config: DistributedConfig,
    epochs: usize,
    checkpoints: Option<(&Path, Option<usize>)>,
    accumulate: Option<usize>,
) -> Run {
    let model = Classifier::new(&Device::flex().autodiff()).load_record(init_once().clone());
    let mut strategy = ParallelStrategy::new(config, AdamWConfig::new().init());
    if let Some((dir, _)) = checkpoints {
        strategy = strategy.checkpoints(dir);
    }
    train(
        model,
        strategy.into(),
        epochs,
        checkpoints.and_then(|(_, r)| r),
        None,
        accumulate,
        None,
    )
}

/// The largest relative difference of `got` from `want` over `want`'s entries (epochs `from..`).
fn worst(want: &Table, got: &Table, from: usize) -> f64 {
    let mut worst = 0.0f64;
    let mut compared = 0;
    for (key, w) in want.iter().filter(|(k, _)| k.1 >= from) {
        let g = got
            .get(key)
            .unwrap_or_else(|| panic!("no {key:?} in {got:?}"));
        worst = worst.max((g - w).abs() / w.abs().max(1e-3));
        compared += 1;
    }
    assert!(compared >= 4, "too few metrics compared: {want:?}");
    worst
}

fn max_param_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn learner_strategies_equal_one_device() {
    let reference = single(2, None);
    assert!(reference.error.is_none(), "{:?}", reference.error);
    for (name, config) in [
        ("ddp 2", config(Strategy::Ddp, 2, 1)),
        ("fsdp2 2", config(Strategy::Fsdp2, 2, 1)),
        ("tp 2", config(Strategy::Tp, 2, 2)),
        ("fsdp2_tp 2x2", config(Strategy::Fsdp2Tp, 4, 2)),
        ("hsdp 2x2", hsdp()),
        ("megatron_fsdp 2", config(Strategy::MegatronFsdp, 2, 1)),
    ] {
        let run = parallel(config, 2, None, None);
        assert!(run.error.is_none(), "{name}: {:?}", run.error);
        let diff = worst(&reference.table, &run.table, 1);
        assert!(
            diff <= 1e-5,
            "{name}: metrics differ by {diff:e}: {:?} vs {:?}",
            run.table,
            reference.table
        );
        // Rank 0 alone renders: as many items as the one-device run.
        assert_eq!(run.rendered, reference.rendered, "{name}");
        let d = max_param_diff(&run.params, &reference.params);
        assert!(d <= 1e-5, "{name}: the returned whole model differs by {d}");
    }
}

fn hsdp() -> DistributedConfig {
    DistributedConfig {
        dp_replicate_size: 2,
        ..config(Strategy::Hsdp, 4, 1)
    }
}

#[test]
fn learner_gradient_accumulation_equals_one_device() {
    // Four batches per epoch: the optimizer steps on the sum of every two.
    let reference = single(2, Some(2));
    assert!(reference.error.is_none(), "{:?}", reference.error);
    for (name, config) in [
        ("ddp 2", config(Strategy::Ddp, 2, 1)),
        ("fsdp2 2", config(Strategy::Fsdp2, 2, 1)),
    ] {
        let run = parallel(config, 2, None, Some(2));
        assert!(run.error.is_none(), "{name}: {:?}", run.error);
        let diff = worst(&reference.table, &run.table, 1);
        assert!(diff <= 1e-5, "{name}: metrics differ by {diff:e}");
        let d = max_param_diff(&run.params, &reference.params);
        assert!(d <= 1e-5, "{name}: the returned whole model differs by {d}");
    }
}

/// Stops after a given epoch (burn-train asks rank 0's store; every rank follows).
#[derive(Clone)]
struct StopAfter(usize);

impl EarlyStoppingStrategy for StopAfter {
    fn should_stop(&mut self, epoch: usize, _store: &EventStoreClient) -> bool {
        epoch >= self.0
    }
}

#[test]
fn learner_early_stopping_stops_every_rank() {
    let model = Classifier::new(&Device::flex().autodiff()).load_record(init_once().clone());
    let strategy = ParallelStrategy::new(config(Strategy::Fsdp2, 2, 1), AdamWConfig::new().init());
    let run = train(model, strategy.into(), 4, None, None, None, Some(2));
    assert!(run.error.is_none(), "{:?}", run.error);
    let epochs: std::collections::BTreeSet<usize> = run.table.keys().map(|k| k.1).collect();
    assert_eq!(epochs, [1, 2].into(), "trained epochs 1 and 2 only");
    let reference = single(2, None);
    assert!(worst(&reference.table, &run.table, 1) <= 1e-5);
}

#[test]
fn learner_uneven_batches_are_refused_with_what_to_do() {
    // 32 items in batches of 8 over 3 data-parallel ranks.
    let run = parallel(config(Strategy::Ddp, 3, 1), 1, None, None);
    let error = run.error.expect("refused");
    assert!(error.contains("multiples of 3"), "{error}");
}

/// The classifier, whose training step stops the Learner's interrupter at the `at`-th step
/// call over every rank thread: one rank raises it, mid-epoch.
#[parallelize]
#[derive(Module, Debug)]
struct Stopping {
    #[nested]
    inner: Classifier,
}

static STOP: Mutex<Option<(Interrupter, usize)>> = Mutex::new(None);
static CALLS: AtomicUsize = AtomicUsize::new(0);

impl TrainStep for Stopping {
    type Input = ClassBatch;
    type Output = ClassificationOutput;
    fn step(&self, batch: ClassBatch) -> TrainOutput<ClassificationOutput> {
        let calls = CALLS.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some((interrupter, at)) = STOP.lock().unwrap().as_ref()
            && calls == *at
        {
            interrupter.stop(Some("stopped from one rank's step"));
        }
        let output = InferenceStep::step(&self.inner, batch);
        let grads = output.loss.backward();
        TrainOutput::new(self, grads, output)
    }
}

impl InferenceStep for Stopping {
    type Input = ClassBatch;
    type Output = ClassificationOutput;
    fn step(&self, batch: ClassBatch) -> ClassificationOutput {
        InferenceStep::step(&self.inner, batch)
    }
}

#[test]
fn learner_interrupt_on_one_rank_stops_every_rank() {
    let (done, wait) = mpsc::channel();
    std::thread::spawn(move || {
        let interrupter = Interrupter::new();
        *STOP.lock().unwrap() = Some((interrupter.clone(), 3));
        let model = Stopping {
            inner: Classifier::new(&Device::flex().autodiff()).load_record(init_once().clone()),
        };
        let strategy = ParallelStrategy::new(config(Strategy::Tp, 2, 2), AdamWConfig::new().init());
        let run = train(
            model,
            strategy.into(),
            3,
            None,
            Some(interrupter),
            None,
            None,
        );
        let _ = done.send((run, CALLS.load(Ordering::SeqCst)));
    });
    let (run, calls) = wait
        .recv_timeout(Duration::from_secs(240))
        .expect("the interrupted job ended (no rank left waiting)");
    assert!(run.error.is_none(), "{:?}", run.error);
    assert!(run.interrupted, "the run reports its interruption");
    // Both ranks stopped after the same step: every call has its twin, and rank 0 rendered
    // that many training items (no validation: the stop came mid-epoch).
    assert_eq!(
        calls % 2,
        0,
        "ranks took different numbers of steps: {calls} calls"
    );
    assert!(
        (3..=4).contains(&calls),
        "stopped at the step the interruption came in: {calls} calls"
    );
    assert_eq!(run.rendered, calls / 2);
    assert!(
        run.table.keys().all(|(split, _, _)| split == "train"),
        "{:?}",
        run.table
    );
}

/// A classifier whose middle layer is a sparse mixture of experts (top-2 of 4 experts), for
/// expert parallelism under the Learner.
#[parallelize]
#[derive(Module, Debug)]
struct MoeClassifier {
    fc: Linear,
    #[nested]
    moe: SparseMoe,
    head: Linear,
}

impl MoeClassifier {
    fn new(device: &Device) -> Self {
        let (hidden, experts, inner) = (setup::HIDDEN, 4, 8);
        let param = |dims: [usize; 3]| {
            Param::from_tensor(Tensor::random(dims, Distribution::Normal(0.0, 0.2), device))
        };
        Self {
            fc: LinearConfig::new(setup::FEATURES, hidden).init(device),
            moe: SparseMoe {
                gate: LinearConfig::new(hidden, experts)
                    .with_bias(false)
                    .init(device),
                experts: Experts {
                    gate_proj: param([experts, hidden, inner]),
                    up_proj: param([experts, hidden, inner]),
                    down_proj: param([experts, inner, hidden]),
                    num_experts: experts,
                    shard: None,
                },
                top_k: 2,
                norm_topk_prob: true,
            },
            head: LinearConfig::new(hidden, setup::CLASSES).init(device),
        }
    }

    fn classify(&self, batch: ClassBatch) -> ClassificationOutput {
        let (inputs, targets) = batch.parts();
        let x = relu(self.fc.forward(inputs));
        let [b, h] = x.dims();
        let (x, _router) = self.moe.forward(x.reshape([b, 1, h])).expect("routing");
        let logits = self.head.forward(x.reshape([b, h]));
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), targets.clone());
        ClassificationOutput::new(loss, logits, targets)
    }
}

impl TrainStep for MoeClassifier {
    type Input = ClassBatch;
    type Output = ClassificationOutput;
    fn step(&self, batch: ClassBatch) -> TrainOutput<ClassificationOutput> {
        let output = self.classify(batch);
        TrainOutput::new(self, output.loss.backward(), output)
    }
}

impl InferenceStep for MoeClassifier {
    type Input = ClassBatch;
    type Output = ClassificationOutput;
    fn step(&self, batch: ClassBatch) -> ClassificationOutput {
        self.classify(batch)
    }
}

#[test]
fn learner_expert_parallel_equals_one_device() {
    let device = Device::flex().autodiff();
    let init = MoeClassifier::new(&device).into_record();
    let model = || MoeClassifier::new(&device).load_record(init.clone());
    let single = TrainingStrategy::Default(ExecutionStrategy::SingleDevice(device.clone()));
    let reference = train(model(), single, 2, None, None, None, None);
    assert!(reference.error.is_none(), "{:?}", reference.error);
    for (name, strategy) in [("ddp ep 2", Strategy::Ddp), ("fsdp2 ep 2", Strategy::Fsdp2)] {
        let config = DistributedConfig {
            ep_size: 2,
            ..config(strategy, 2, 1)
        };
        let parallel = ParallelStrategy::new(config, AdamWConfig::new().init());
        let run = train(model(), parallel.into(), 2, None, None, None, None);
        assert!(run.error.is_none(), "{name}: {:?}", run.error);
        let diff = worst(&reference.table, &run.table, 1);
        assert!(diff <= 1e-5, "{name}: metrics differ by {diff:e}");
        // The returned model is whole: every expert of the four, gathered over ep.
        assert_eq!(run.params.len(), reference.params.len(), "{name}");
        let d = max_param_diff(&run.params, &reference.params);
        assert!(d <= 1e-5, "{name}: weights differ by {d:e}");
    }
}

/// A stop that one rank alone sees (as each MPI process sees only its own interrupter): the
/// rank stops at its first check and the others must stop with it, at the same step, or they
/// would wait in the next step's collectives for a rank that left.
#[test]
fn learner_stop_seen_by_one_rank_stops_every_rank() {
    let (done, wait) = mpsc::channel();
    std::thread::spawn(move || {
        let model = Classifier::new(&Device::flex().autodiff()).load_record(init_once().clone());
        let only_rank_1 = Interrupter::new();
        only_rank_1.stop(Some("rank 1 stops"));
        for (strategy, world, tp) in [(Strategy::Tp, 2, 2), (Strategy::Fsdp2, 2, 1)] {
            let strategy =
                ParallelStrategy::new(config(strategy, world, tp), AdamWConfig::new().init())
                    .rank_interrupter(1, only_rank_1.clone());
            let run = train(model.clone(), strategy.into(), 2, None, None, None, None);
            if done.send(run).is_err() {
                return;
            }
        }
    });
    for _ in 0..2 {
        let run = wait
            .recv_timeout(Duration::from_secs(240))
            .expect("the job ended (no rank left waiting)");
        assert!(run.error.is_none(), "{:?}", run.error);
        assert!(run.interrupted, "rank 0's Learner reports the interruption");
        // Every rank stopped after the first step: rank 0 rendered one training item.
        assert_eq!(run.rendered, 1);
    }
}

#[test]
fn learner_resumes_from_a_sharded_checkpoint_under_another_strategy() {
    let dir = scratch("resume");
    let whole = parallel(config(Strategy::Fsdp2, 2, 1), 3, None, None);
    assert!(whole.error.is_none(), "{:?}", whole.error);
    // Two epochs under ddp, saving sharded checkpoints at each epoch's end.
    let first = parallel(config(Strategy::Ddp, 2, 1), 2, Some((&dir, None)), None);
    assert!(first.error.is_none(), "{:?}", first.error);
    assert!(
        ParallelStrategy::epoch_dir(&dir, 2)
            .join("checkpoint.json")
            .exists()
    );
    assert!(worst(&first.table, &whole.table, 1) <= 1e-5);
    // The third under tp, from the second epoch's checkpoint: the same epoch 3 as the
    // uninterrupted run (its optimizer state, learning rate and data order included).
    let resumed = parallel(config(Strategy::Tp, 2, 2), 3, Some((&dir, Some(2))), None);
    assert!(resumed.error.is_none(), "{:?}", resumed.error);
    assert!(
        resumed.table.keys().all(|k| k.1 == 3),
        "only epoch 3 trained: {:?}",
        resumed.table
    );
    let third: Table = whole
        .table
        .iter()
        .filter(|(k, _)| k.1 == 3)
        .map(|(k, v)| (k.clone(), *v))
        .collect();
    let diff = worst(&third, &resumed.table, 3);
    assert!(
        diff <= 1e-5,
        "resumed epoch 3 differs by {diff:e}: {:?} vs {:?}",
        resumed.table,
        third
    );
    let d = max_param_diff(&resumed.params, &whole.params);
    assert!(
        d <= 1e-5,
        "the resumed model differs from the uninterrupted one by {d}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn learner_refuses_burn_checkpointers_with_what_to_do() {
    let device = Device::flex().autodiff();
    let model = Classifier::new(&device).load_record(init_once().clone());
    let (train, valid) = setup::loaders(TRAIN, VALID, BATCH, 7, &device);
    let dir = scratch("refuse");
    let strategy = ParallelStrategy::new(config(Strategy::Ddp, 2, 1), AdamWConfig::new().init());
    let result = SupervisedTraining::new(&dir, train, valid)
        .with_default_checkpointers()
        .with_application_logger(None)
        .with_metric_logger(Recorder::default())
        .renderer(Box::new(Quiet::default()))
        .with_training_strategy(strategy.into())
        .launch(Learner::new(model, AdamWConfig::new().init(), 1e-2));
    let _ = std::fs::remove_dir_all(&dir);
    let error = result.error.expect("refused").to_string();
    assert!(error.contains("ParallelStrategy::checkpoints"), "{error}");
}
