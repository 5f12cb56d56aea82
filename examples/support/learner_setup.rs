//! What `examples/learner.rs` and `tests/it/learner.rs` share: a small classifier with its
//! parallelism attributes, a synthetic dataset, the loaders, a renderer that prints nothing and
//! a metric logger that keeps each epoch's values. Included with `#[path]` by both.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::learner::burn_train::logger::{
    EvaluationProgressLogger, MetricLogger, TrainingProgressLogger,
};
use burn_parallel::learner::burn_train::metric::store::{EpochSummary, MetricsUpdate, Split};
use burn_parallel::learner::burn_train::metric::{MetricDefinition, MetricId, NumericEntry};
use burn_parallel::learner::burn_train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};
use burn_parallel::learner::burn_train::{
    ClassificationOutput, InferenceStep, TrainOutput, TrainStep,
};
use burn_parallel::learner::{SplitBatch, slice_rows, slice_rows_int};
use burn_parallel::prelude::*;

/// Input features, hidden width and classes of the classifier.
pub const FEATURES: usize = 8;
pub const HIDDEN: usize = 16;
pub const CLASSES: usize = 4;

/// Three Linear layers: under tp the first splits its outputs (colwise), the second its inputs
/// (rowwise, so its output is whole again), the head stays replicated.
#[parallelize]
#[derive(Module, Debug)]
pub struct Classifier {
    #[tp(colwise)]
    fc1: Tp<Linear>,
    #[tp(rowwise)]
    fc2: Tp<Linear>,
    head: Linear,
}

impl Classifier {
    /// A classifier with Burn's default initialization on `device`.
    pub fn new(device: &Device) -> Self {
        Self {
            fc1: Tp::new(LinearConfig::new(FEATURES, HIDDEN).init(device)),
            fc2: Tp::new(LinearConfig::new(HIDDEN, HIDDEN).init(device)),
            head: LinearConfig::new(HIDDEN, CLASSES).init(device),
        }
    }

    fn classify(&self, batch: ClassBatch) -> ClassificationOutput {
        let x = relu(self.fc1.forward(batch.inputs));
        let x = relu(self.fc2.forward(x));
        let logits = self.head.forward(x);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, logits, batch.targets)
    }
}

impl TrainStep for Classifier {
    type Input = ClassBatch;
    type Output = ClassificationOutput;
    fn step(&self, batch: ClassBatch) -> TrainOutput<ClassificationOutput> {
        let output = self.classify(batch);
        TrainOutput::new(self, output.loss.backward(), output)
    }
}

impl InferenceStep for Classifier {
    type Input = ClassBatch;
    type Output = ClassificationOutput;
    fn step(&self, batch: ClassBatch) -> ClassificationOutput {
        self.classify(batch)
    }
}

/// One sample: features and its class.
#[derive(Debug, Clone)]
pub struct Item {
    features: [f32; FEATURES],
    label: i64,
}

/// A batch of samples.
#[derive(Debug, Clone)]
pub struct ClassBatch {
    inputs: Tensor<2>,
    targets: Tensor<1, Int>,
}

impl ClassBatch {
    /// The inputs `[rows, FEATURES]` and the classes `[rows]` (tests/it/learner.rs's MoE model).
    #[allow(dead_code)]
    pub fn parts(self) -> (Tensor<2>, Tensor<1, Int>) {
        (self.inputs, self.targets)
    }
}

/// Each data-parallel rank takes its rows of every batch.
impl SplitBatch for ClassBatch {
    fn batch_size(&self) -> usize {
        self.targets.dims()[0]
    }
    fn rows(&self, rows: Range<usize>, device: &Device) -> Self {
        Self {
            inputs: slice_rows(&self.inputs, rows.clone(), device),
            targets: slice_rows_int(&self.targets, rows, device),
        }
    }
}

#[derive(Clone)]
struct ItemBatcher;

impl Batcher<Item, ClassBatch> for ItemBatcher {
    fn batch(&self, items: Vec<Item>, device: &Device) -> ClassBatch {
        let n = items.len();
        let features: Vec<f32> = items.iter().flat_map(|i| i.features).collect();
        let labels: Vec<i64> = items.iter().map(|i| i.label).collect();
        ClassBatch {
            inputs: Tensor::from_data(TensorData::new(features, [n, FEATURES]), device),
            targets: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// `n` samples of four noisy clusters (a fixed generator: the same data on every run).
pub fn dataset(n: usize, seed: u64) -> InMemDataset<Item> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut uniform = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) as f32) / (1u64 << 31) as f32 - 0.5
    };
    let items = (0..n)
        .map(|i| {
            let label = (i % CLASSES) as i64;
            let mut features = [0.0; FEATURES];
            for (f, x) in features.iter_mut().enumerate() {
                let centre = if f % CLASSES == label as usize {
                    1.0
                } else {
                    0.0
                };
                *x = centre + uniform();
            }
            Item { features, label }
        })
        .collect();
    InMemDataset::new(items)
}

/// The training loader (shuffled with `seed`) and the validation loader, on `device`: a
/// loader built without `set_device` takes Burn's `Device::default()`, which in a build with
/// `wgpu` is the wgpu device, whatever the model trains on.
pub fn loaders(
    train: usize,
    valid: usize,
    batch: usize,
    seed: u64,
    device: &Device,
) -> (
    Arc<dyn DataLoader<ClassBatch>>,
    Arc<dyn DataLoader<ClassBatch>>,
) {
    let train = DataLoaderBuilder::new(ItemBatcher)
        .batch_size(batch)
        .shuffle(seed)
        .set_device(device.clone())
        .build(dataset(train, 1));
    let valid = DataLoaderBuilder::new(ItemBatcher)
        .batch_size(batch)
        .set_device(device.clone())
        .build(dataset(valid, 2));
    (train, valid)
}

/// A metric of one epoch of one split: (split, epoch, metric name).
pub type Key = (String, usize, String);

/// Each epoch's last running value of every numeric metric.
pub type Table = BTreeMap<Key, f64>;

/// A metric logger keeping each epoch's running (epoch-average) value of every numeric
/// metric, readable after training.
#[derive(Clone, Default)]
pub struct Recorder {
    names: Arc<Mutex<BTreeMap<String, String>>>,
    values: Arc<Mutex<Table>>,
    entries: Arc<Mutex<BTreeMap<Key, Vec<NumericEntry>>>>,
}

impl Recorder {
    /// The values recorded so far.
    pub fn table(&self) -> Table {
        self.values.lock().unwrap().clone()
    }

    fn key(id: &MetricId) -> String {
        format!("{id:?}")
    }
}

fn value(entry: &NumericEntry) -> f64 {
    match entry {
        NumericEntry::Value(v) | NumericEntry::Final(v) => *v,
        NumericEntry::Aggregated {
            aggregated_value, ..
        } => *aggregated_value,
    }
}

impl MetricLogger for Recorder {
    fn log(&mut self, update: MetricsUpdate, epoch: usize, split: &Split) {
        let names = self.names.lock().unwrap();
        for numeric in update.entries_numeric {
            let Some(name) = names.get(&Self::key(&numeric.entry.metric_id)) else {
                continue;
            };
            let key = (split.to_string(), epoch, name.clone());
            if let Some(running) = &numeric.running_entry {
                self.values
                    .lock()
                    .unwrap()
                    .insert(key.clone(), value(running));
            }
            if let Some(entry) = numeric.numeric_entry {
                self.entries
                    .lock()
                    .unwrap()
                    .entry(key)
                    .or_default()
                    .push(entry);
            }
        }
    }

    fn read_numeric(
        &mut self,
        name: &str,
        epoch: usize,
        split: &Split,
    ) -> Result<Vec<NumericEntry>, String> {
        let key = (split.to_string(), epoch, name.to_string());
        Ok(self
            .entries
            .lock()
            .unwrap()
            .get(&key)
            .cloned()
            .unwrap_or_default())
    }

    fn log_metric_definition(&mut self, definition: MetricDefinition) {
        self.names.lock().unwrap().insert(
            Self::key(&definition.metric_id),
            definition.name.to_string(),
        );
    }

    fn log_epoch_summary(&mut self, _summary: EpochSummary) {}
}

/// A renderer that prints nothing and counts the items it was shown (one process renders
/// once: a parallel run shows as many items as a one-device run).
#[derive(Clone, Default)]
pub struct Quiet {
    /// Training and validation items rendered.
    pub items: Arc<AtomicUsize>,
}

impl MetricsRendererTraining for Quiet {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
}

impl MetricsRendererEvaluation for Quiet {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
}

impl TrainingProgressLogger for Quiet {
    fn start(&mut self, _: usize, _: usize, _: Option<usize>, _: Option<&str>) {}
    fn update_epoch(&mut self, _: usize) {}
    fn start_split(&mut self, _: &str, _: usize) {}
    fn update_split(&mut self, _: usize) {
        self.items.fetch_add(1, Ordering::Relaxed);
    }
    fn end_split(&mut self) {}
    fn end(&mut self) {}
    fn log_event_training(&mut self, _: String) {}
}

impl EvaluationProgressLogger for Quiet {
    fn start_global_progress(&mut self, _: usize) {}
    fn start_test(&mut self, _: &str, _: usize) {}
    fn update_test_progress(&mut self, _: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _: String) {}
}

impl MetricsRenderer for Quiet {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _definition: MetricDefinition) {}
}
