//! Full state in and out of a sharded module: a sharded load asks its source only for this
//! rank's rows of one parameter at a time and never initializes a full parameter; it equals
//! sharding the fully loaded module; the gathered full state (on every rank or the first)
//! round-trips exactly, keyed by module path.

use std::collections::{BTreeMap, HashMap};

use burn::module::{Module, Param, ParamId};
use burn::nn::Linear;
use burn::tensor::{Device, Shape, Tensor, TensorData};
use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::comm::launch;
use burn_parallel::fsdp::{
    FsdpConfig, FsdpError, PathVisitor, RowRequest, ShardLayout, StateDictRanks, fully_shard,
    fully_shard_from, gather_state_dict, param_states, visit_with_paths,
};
use burn_parallel::parallelize;
use burn_parallel::parallelizer::{
    DistributedConfig, MeshContext, ModelParallelizer, ParallelError, parallelize_model_from,
};

use crate::common::{ndarray_ad, values};

/// Layer widths: 5, 3 and 2 rows do not divide by 2-4 ranks (3 ranks leave 2-row biases with
/// an empty shard).
const DIMS: [usize; 4] = [4, 5, 3, 2];

#[derive(Module, Debug)]
struct Stack {
    layers: Vec<Linear>,
}

/// A parameter that must never be materialized whole.
fn lazy<const D: usize>(shape: [usize; D], device: &Device) -> Param<Tensor<D>> {
    Param::uninitialized(
        ParamId::new(),
        |_, _| panic!("a full parameter was initialized"),
        device.clone(),
        true,
        Shape::from(shape.to_vec()),
    )
}

fn lazy_stack(device: &Device) -> Stack {
    let layers = DIMS
        .windows(2)
        .map(|d| Linear {
            weight: lazy([d[0], d[1]], device),
            bias: Some(lazy([d[1]], device)),
        })
        .collect();
    Stack { layers }
}

/// The checkpoint: a full tensor per module path, from a seed per path.
fn checkpoint() -> BTreeMap<String, TensorData> {
    let mut state = BTreeMap::new();
    for (i, d) in DIMS.windows(2).enumerate() {
        let seed = 50 + 10 * i as u64;
        state.insert(
            format!("layers.{i}.weight"),
            TensorData::new(values(seed, d[0] * d[1]), [d[0], d[1]]),
        );
        state.insert(
            format!("layers.{i}.bias"),
            TensorData::new(values(seed + 1, d[1]), [d[1]]),
        );
    }
    state
}

/// Rows `rows` of a full tensor, as a reader of a memory-mapped file would return them.
fn rows_of(full: &TensorData, rows: std::ops::Range<usize>) -> TensorData {
    let shape = full.shape().to_vec();
    let row: usize = shape[1..].iter().product();
    let all = full.try_to_vec::<f32>().unwrap();
    let mut out_shape = shape.clone();
    out_shape[0] = rows.len();
    TensorData::new(all[rows.start * row..rows.end * row].to_vec(), out_shape)
}

/// The module built whole from the checkpoint (the reference a sharded load must equal).
fn full_stack(state: &BTreeMap<String, TensorData>, device: &Device) -> Stack {
    let param = |path: String| state[&path].clone();
    let layers = (0..DIMS.len() - 1)
        .map(|i| Linear {
            weight: Param::from_tensor(
                Tensor::from_data(param(format!("layers.{i}.weight")), device).require_grad(),
            ),
            bias: Some(Param::from_tensor(
                Tensor::from_data(param(format!("layers.{i}.bias")), device).require_grad(),
            )),
        })
        .collect();
    Stack { layers }
}

fn shards(model: &Stack) -> Vec<TensorData> {
    model
        .layers
        .iter()
        .flat_map(|l| {
            [
                l.weight.base().to_data(),
                l.bias.as_ref().unwrap().base().to_data(),
            ]
        })
        .collect()
}

#[test]
fn a_sharded_load_reads_only_this_ranks_rows_and_round_trips() {
    let state = checkpoint();
    for world in 1..=4 {
        let runs = launch(world, |ctx| {
            let device = ndarray_ad();
            let group = ctx.world()?;
            let config = FsdpConfig::new(group.clone());
            let mut requests = Vec::new();
            let model = fully_shard_from(lazy_stack(&device), &config, |r: &RowRequest| {
                requests.push((r.path.to_string(), r.shape.to_vec(), r.rows.clone()));
                Ok::<_, String>(rows_of(&state[r.path], r.rows.clone()))
            })?;
            // The same shards as sharding the fully built module.
            let reference = fully_shard(full_stack(&state, &device), &config)?;
            let same = shards(&model) == shards(&reference);
            let trainable = model.layers[0].weight.base().is_require_grad();
            let all = gather_state_dict(&model, StateDictRanks::All)?;
            let first = gather_state_dict(&model, StateDictRanks::First)?;
            Ok::<_, Box<dyn std::error::Error>>((requests, same, trainable, all, first))
        })
        .unwrap();
        for (rank, (requests, same, trainable, all, first)) in runs.into_iter().enumerate() {
            let ctx = format!("{world} ranks, rank {rank}");
            // One request per parameter, in module order, for exactly this rank's rows.
            let want: Vec<_> = state.keys().collect();
            let mut asked: Vec<_> = requests.iter().map(|(p, _, _)| p).collect();
            asked.sort();
            assert_eq!(asked, want, "{ctx}: one request per parameter");
            for (path, shape, rows) in &requests {
                assert_eq!(shape, &state[path].shape().to_vec(), "{ctx}: {path} shape");
                assert_eq!(
                    *rows,
                    chunk_range(shape[0], world, rank),
                    "{ctx}: {path} rows"
                );
            }
            assert!(same, "{ctx}: shards equal sharding the full module");
            assert!(trainable, "{ctx}: loaded shards keep the gradient setting");
            assert_eq!(all, state, "{ctx}: full state on every rank");
            if rank == 0 {
                assert_eq!(first, state, "{ctx}: full state on the first rank");
            } else {
                assert!(first.is_empty(), "{ctx}: nothing on the other ranks");
            }
        }
    }
}

#[test]
fn a_source_returning_the_wrong_rows_is_an_error_naming_the_parameter() {
    let errors = launch(2, |ctx| {
        let config = FsdpConfig::new(ctx.world()?);
        let err = fully_shard_from(lazy_stack(&ndarray_ad()), &config, |r: &RowRequest| {
            // Every row instead of this rank's.
            Ok::<_, String>(TensorData::new(
                vec![0f32; r.shape.iter().product()],
                r.shape.to_vec(),
            ))
        })
        .unwrap_err();
        let missing = fully_shard_from(lazy_stack(&ndarray_ad()), &config, |r: &RowRequest| {
            Err(format!("{} is not in the file", r.path))
        })
        .unwrap_err();
        Ok::<_, burn_parallel::comm::CollectiveError>((err, missing))
    })
    .unwrap();
    let (err, missing) = &errors[1];
    assert!(
        matches!(err, FsdpError::Load { path, .. } if path == "layers.0.weight"),
        "{err}"
    );
    assert!(err.to_string().contains("expected float [2, 5]"), "{err}");
    assert_eq!(
        missing.to_string(),
        "loading layers.0.weight: layers.0.weight is not in the file"
    );
}

/// Each parameter's id and module path.
fn paths_by_id<M: Module>(module: &M) -> Vec<(ParamId, String)> {
    struct Paths(Vec<(ParamId, String)>);
    impl PathVisitor for Paths {
        fn visit_float<const D: usize>(&mut self, path: &str, param: &Param<Tensor<D>>) {
            self.0.push((param.id, path.to_string()));
        }
    }
    let mut paths = Paths(Vec::new());
    visit_with_paths(module, &mut paths);
    paths.0
}

/// A sidecar overriding the FSDP primitive: every unit in the flat-buffer layout.
#[derive(Default)]
pub struct FlatUnits;

impl ModelParallelizer for FlatUnits {
    fn fully_shard_module<N: Module>(
        &self,
        module: N,
        config: &FsdpConfig,
    ) -> Result<N, ParallelError> {
        Ok(fully_shard(
            module,
            &config.clone().layout(ShardLayout::FlatBuffer),
        )?)
    }
}

/// The lazy stack, parallelized by [`FlatUnits`].
#[parallelize(sidecar = FlatUnits)]
#[derive(Module, Debug)]
pub struct FlatLazyStack {
    #[fsdp(unit)]
    layers: Vec<Linear>,
}

#[test]
fn a_sidecars_fully_shard_module_serves_the_sharded_load_too() {
    let state = checkpoint();
    let runs = launch(2, |ctx| {
        let mesh = MeshContext::new(&ctx, DistributedConfig::default(), ndarray_ad())?;
        let model = FlatLazyStack {
            layers: lazy_stack(mesh.device()).layers,
        };
        // Requests name a parameter's path within its unit: the source keys on ids.
        let source: HashMap<ParamId, TensorData> = paths_by_id(&model)
            .into_iter()
            .map(|(id, path)| (id, state[&path].clone()))
            .collect();
        let model = parallelize_model_from(model, &mesh, move |r: &RowRequest| {
            Ok::<_, String>(rows_of(&source[&r.id], r.rows.clone()))
        })?;
        let flat = param_states(&model)
            .iter()
            .all(|s| s.unit().flat_buffer().is_some());
        let all = gather_state_dict(&model, StateDictRanks::All)?;
        Ok::<_, Box<dyn std::error::Error>>((flat, all))
    })
    .unwrap();
    for (rank, (flat, all)) in runs.into_iter().enumerate() {
        assert!(
            flat,
            "rank {rank}: every unit sharded by the sidecar's hook"
        );
        assert_eq!(all, state, "rank {rank}: the loaded state");
    }
}
