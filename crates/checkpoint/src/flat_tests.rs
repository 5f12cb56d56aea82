//! Round trips through FSDP's flat-buffer layout (Megatron-FSDP): a tiny model whose
//! parameters are 2-D, 1-D and 3-D, sharded over threads as real FSDP units, saved from one
//! layout and loaded into others (whole, dim-0 rows, flat at other world sizes, empty pieces
//! and empty rows included). Each rank checks that its placements describe what FSDP actually
//! stores, and after a load that it holds exactly its elements of every parameter and of the
//! optimizer's state.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Gradients, Tensor, TensorData};
use burn_parallel_comm::launch;
use burn_parallel_fsdp::{FsdpConfig, ShardLayout, fully_shard};
use burn_parallel_parallelizer::{
    DefaultParallelizer, DistributedConfig, MeshContext, ModelDescription, Parallelize, Strategy,
    UnitMap,
};
use burn_parallel_tp::{TpApplier, TpError, TpModule};

use crate::{
    Checkpoint, LoadOptions, OptimizerState, Placement, SaveOptions, TrainingProgress, placements,
    save,
};

/// `a.weight` [5, 3], `a.bias` [3], `c` [2, 3, 4]: 42 elements, so flat pieces of 2, 3 and 4
/// ranks cut rows, and at 4 ranks some pieces are empty.
#[derive(Module, Debug)]
struct Net {
    a: Linear,
    c: Param<Tensor<3>>,
}

impl TpModule for Net {
    fn apply_tp(self, _path: &str, _cx: &mut TpApplier<'_>) -> Result<Self, TpError> {
        Ok(self)
    }
    fn sync_tp_grads(&self, _grads: &mut Gradients) -> Result<(), TpError> {
        Ok(())
    }
    fn visit_tp_sharded<V: ModuleVisitor>(&self, _visitor: &mut V) {}
    fn gather_tp(self) -> Result<Self, TpError> {
        Ok(self)
    }
}

/// No units, plans or experts of its own: the test shards it by hand.
impl Parallelize for Net {
    type Sidecar = DefaultParallelizer;
    fn describe(&self, _path: &str, _out: &mut ModelDescription) {}
    fn map_units<F: UnitMap>(self, _path: &str, _f: &mut F) -> Result<Self, F::Error> {
        Ok(self)
    }
}

/// Element `i` (row-major) of the full parameter `path`: distinct across parameters.
fn full_value(path: &str, i: usize) -> f32 {
    let base = match path {
        "a.weight" => 0,
        "a.bias" => 100,
        "c" => 200,
        other => panic!("no parameter {other}"),
    };
    (base + i) as f32
}

fn full(path: &str, n: usize) -> Vec<f32> {
    (0..n).map(|i| full_value(path, i)).collect()
}

impl Net {
    fn new(device: &Device) -> Self {
        let mut a: Linear = LinearConfig::new(5, 3).init(device);
        let weight = TensorData::new(full("a.weight", 15), [5, 3]);
        // Trainable, as a training checkpoint's parameters are (frozen ones are not saved).
        a.weight = Param::from_tensor(Tensor::from_data(weight, device));
        let bias = TensorData::new(full("a.bias", 3), [3]);
        a.bias = Some(Param::from_tensor(Tensor::from_data(bias, device)));
        let c = TensorData::new(full("c", 24), [2, 3, 4]);
        Self {
            a,
            c: Param::from_tensor(Tensor::from_data(c, device)),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Layout {
    /// One rank, no FSDP.
    Whole,
    /// FSDP2's dim-0 rows.
    Rows(usize),
    /// Megatron-FSDP's flat buffer.
    Flat(usize),
}

impl Layout {
    fn world(self) -> usize {
        match self {
            Layout::Whole => 1,
            Layout::Rows(n) | Layout::Flat(n) => n,
        }
    }
}

#[allow(deprecated)]
fn device() -> Device {
    Device::ndarray().autodiff()
}

fn mesh(ctx: &burn_parallel_comm::RankContext, layout: Layout) -> MeshContext {
    let strategy = match layout {
        Layout::Whole => Strategy::Single,
        _ => Strategy::Fsdp2,
    };
    let config = DistributedConfig {
        strategy,
        world_size: Some(layout.world()),
        ..DistributedConfig::default()
    };
    MeshContext::new(ctx, config, device()).expect("a mesh")
}

/// The model as `layout` shards it on this rank.
fn model(mesh: &MeshContext, layout: Layout) -> Net {
    let net = Net::new(mesh.device());
    let config = FsdpConfig::new(mesh.dp_shard_group().clone());
    match layout {
        Layout::Whole => net,
        Layout::Rows(_) => fully_shard(net, &config).expect("rows"),
        Layout::Flat(_) => fully_shard(net, &config.layout(ShardLayout::FlatBuffer)).expect("flat"),
    }
}

/// What `p` should hold, plus `shift`: its boxes of the full tensor, read row-major in turn.
fn expected(p: &Placement, shift: f32) -> Vec<f32> {
    let mut out = Vec::new();
    for b in &p.regions {
        let mut index = vec![0usize; b.shape.len()];
        for _ in 0..b.volume() {
            let flat =
                (0..index.len()).fold(0, |at, d| at * p.global_shape[d] + b.start[d] + index[d]);
            out.push(full_value(&p.path, flat) + shift);
            for d in (0..index.len()).rev() {
                index[d] += 1;
                if index[d] < b.shape[d] {
                    break;
                }
                index[d] = 0;
            }
        }
    }
    out
}

/// Every stored parameter's local values (flattened) and shape, by id.
fn stored(model: &Net) -> HashMap<ParamId, (Vec<f32>, Vec<usize>)> {
    struct Values(HashMap<ParamId, (Vec<f32>, Vec<usize>)>);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let base = param.base();
            let shape = base.dims().to_vec();
            let values = base.into_data().try_to_vec::<f32>().expect("f32 values");
            self.0.insert(param.id, (values, shape));
        }
    }
    let mut values = Values(HashMap::new());
    model.visit(&mut values);
    values.0
}

/// An elementwise optimizer with two moments: `m` is the parameter plus 1000, `v` plus 2000.
#[derive(Default)]
struct Moments {
    state: HashMap<ParamId, Vec<Tensor<1>>>,
}

impl Moments {
    fn for_model(model: &Net) -> Self {
        let mut moments = Self::default();
        for p in placements(model).expect("placements") {
            let device = p.device.clone().inner();
            let moment = |shift| {
                let values = expected(&p, shift);
                let n = values.len();
                Tensor::<1>::from_data(TensorData::new(values, [n]), &device)
            };
            moments
                .state
                .insert(p.id, vec![moment(1000.0), moment(2000.0)]);
        }
        moments
    }
}

impl OptimizerState for Moments {
    fn kind(&self) -> &str {
        "moments"
    }
    fn state_names(&self) -> Vec<String> {
        vec!["m".into(), "v".into()]
    }
    fn scalars(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    fn load_scalars(&mut self, _scalars: &serde_json::Value) -> Result<(), String> {
        Ok(())
    }
    fn param_state(&self, id: ParamId) -> Option<Vec<Tensor<1>>> {
        self.state.get(&id).cloned()
    }
    fn load_param_state(&mut self, id: ParamId, state: Vec<Tensor<1>>) {
        self.state.insert(id, state);
    }
}

/// Checks, on one rank, that every placement describes what the model stores: its values
/// and shape, and for a flat piece `[len, 1, ..]` with `len` the boxes' volume.
fn check_placements(model: &Net, layout: Layout, what: &str) -> Vec<Placement> {
    let placed = placements(model).expect("placements");
    let values = stored(model);
    assert_eq!(placed.len(), 3, "{what}");
    for p in &placed {
        let (held, shape) = &values[&p.id];
        assert_eq!(
            held,
            &expected(p, 0.0),
            "{what}: `{}` {:?}",
            p.path,
            p.regions
        );
        assert_eq!(shape, &p.shape, "{what}: `{}`", p.path);
        if let Layout::Flat(_) = layout {
            assert_eq!(shape[0], p.volume(), "{what}: `{}`", p.path);
            assert!(shape[1..].iter().all(|&d| d == 1), "{what}: `{}`", p.path);
        } else {
            assert!(p.regions.len() == 1, "{what}: `{}`", p.path);
        }
    }
    placed
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bp-ckpt-flat-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temp dir");
    dir
}

/// Saves the model and its moments as `layout` shards them.
fn save_from(layout: Layout, dir: &Path) {
    launch(layout.world(), |ctx| {
        let mesh = mesh(&ctx, layout);
        let model = model(&mesh, layout);
        check_placements(&model, layout, &format!("saving {layout:?}"));
        let moments = Moments::for_model(&model);
        let progress = TrainingProgress::default();
        save(
            dir,
            &model,
            Some(&moments),
            &progress,
            &mesh,
            &SaveOptions::default(),
        )
        .map(|_| ())
    })
    .expect("the save");
}

/// Loads the checkpoint at `dir` into the model and moments as `layout` shards them (from
/// other values) and checks what each rank then holds and read.
fn load_into(layout: Layout, dir: &Path, from: Layout) {
    let what = format!("{from:?} -> {layout:?}");
    let checkpoint = Checkpoint::open(dir).expect("the checkpoint");
    launch(layout.world(), |ctx| {
        let mesh = mesh(&ctx, layout);
        // Other values than the checkpoint's: zeros, so nothing passes unloaded.
        let model = model(&mesh, layout).map(&mut Zero);
        let mut moments = Moments::default();
        let options = LoadOptions::default();
        let (model, report) = checkpoint.load(model, Some(&mut moments), &mesh, &options)?;
        let placed = check_placements(&model, layout, &what);
        let stored: usize = placed.iter().map(Placement::volume).sum();
        let largest = placed.iter().map(Placement::volume).max().unwrap_or(0);
        assert_eq!(report.bytes_read, (stored * 4 * 3) as u64, "{what}");
        assert_eq!(report.largest_region_bytes, (largest * 4) as u64, "{what}");
        assert!(
            report.peak_buffer_bytes <= report.largest_region_bytes,
            "{what}"
        );
        for p in placed.iter().filter(|p| !p.is_empty()) {
            let state = &moments.state[&p.id];
            for (t, shift) in state.iter().zip([1000.0, 2000.0]) {
                let values = t.clone().into_data().try_to_vec::<f32>().expect("f32");
                assert_eq!(values, expected(p, shift), "{what}: moment of `{}`", p.path);
            }
        }
        Ok::<_, crate::CheckpointError>(())
    })
    .expect("the load");
}

/// Sets every parameter to zeros of its shape.
struct Zero;

impl burn::module::ModuleMapper for Zero {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(|t| t.zeros_like())
    }
}

/// Saves from `from`, checks the whole tensors and checksums, then loads into each of `to`.
fn round_trip(name: &str, from: Layout, to: &[Layout]) {
    let dir = temp_dir(name);
    save_from(from, &dir);
    let checkpoint = Checkpoint::open(&dir).expect("the checkpoint");
    checkpoint.verify().expect("checksums");
    for (key, path, n) in [("model/a.weight", "a.weight", 15), ("model/c", "c", 24)] {
        let data = checkpoint.read_tensor(key).expect("a tensor");
        assert_eq!(
            data.try_to_vec::<f32>().expect("f32"),
            full(path, n),
            "{from:?} {key}"
        );
    }
    let m = checkpoint.read_tensor("optim/m/c").expect("a moment");
    let shifted: Vec<f32> = full("c", 24).iter().map(|v| v + 1000.0).collect();
    assert_eq!(m.try_to_vec::<f32>().expect("f32"), shifted, "{from:?}");
    let named = checkpoint
        .metadata()
        .tensors
        .values()
        .flat_map(|t| &t.regions)
        .any(|r| r.entry.is_some());
    assert_eq!(
        named,
        matches!(from, Layout::Flat(_)),
        "{from:?}: entry names"
    );
    for &layout in to {
        load_into(layout, &dir, from);
    }
    std::fs::remove_dir_all(&dir).expect("removed");
}

#[test]
fn a_flat_buffer_checkpoint_resumes_whole_as_rows_and_as_other_flat_splits() {
    let to = [
        Layout::Whole,
        Layout::Rows(3),
        Layout::Flat(2),
        Layout::Flat(4),
    ];
    round_trip("flat3", Layout::Flat(3), &to);
}

#[test]
fn a_rows_checkpoint_resumes_as_flat_buffers_with_empty_pieces() {
    round_trip(
        "rows2",
        Layout::Rows(2),
        &[Layout::Flat(3), Layout::Flat(4)],
    );
}

#[test]
fn a_flat_buffer_checkpoint_with_empty_pieces_resumes_as_rows() {
    round_trip("flat4", Layout::Flat(4), &[Layout::Rows(2), Layout::Whole]);
}
