//! Where each of this rank's stored parameters lies in the full tensor: the tensor-parallel
//! split (a dim cut by the layer's shard spec) and, inside it, the FSDP rows along dim 0. The
//! same computation places shards when saving and decides what to read when loading, whatever
//! the strategy: a replicated parameter simply covers its whole tensor.

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, Device, Tensor};
use burn_parallel_fsdp::{PathVisitor, param_states, visit_with_paths};
use burn_parallel_tp::{ShardSpec, TpModule};

use crate::error::CheckpointError;
use crate::region::Region;

/// One stored parameter of this rank.
#[derive(Debug, Clone)]
pub struct Placement {
    /// Burn's module path (`layers.0.mlp.up_proj.weight`): the tensor's name in a checkpoint.
    pub path: String,
    /// The parameter's id in this model.
    pub id: ParamId,
    /// The full (unsharded) tensor's shape.
    pub global_shape: Vec<usize>,
    /// The part of it this rank stores.
    pub region: Region,
    /// `None` for a lazy parameter not initialized yet (it takes the checkpoint's dtype).
    pub dtype: Option<DType>,
    /// Where the parameter lives (or will, for a lazy one).
    pub device: Device,
}

/// A stored parameter as a visitor sees it: path, id, shape and dtype.
struct Stored {
    path: String,
    id: ParamId,
    shape: Vec<usize>,
    dtype: Option<DType>,
    device: Device,
}

fn stored_params<M: Module>(model: &M) -> Vec<Stored> {
    struct Visit {
        out: Vec<Stored>,
    }
    impl PathVisitor for Visit {
        fn visit_float<const D: usize>(&mut self, path: &str, param: &Param<Tensor<D>>) {
            // A lazy parameter is not initialized for its dtype: loading replaces it unread.
            let dtype = param.is_initialized().then(|| param.base().dtype());
            self.out.push(Stored {
                path: path.to_string(),
                id: param.id,
                shape: param.lazy_shape().to_vec(),
                dtype,
                device: param.lazy_device(),
            });
        }
    }
    let mut visit = Visit { out: Vec::new() };
    visit_with_paths(model, &mut visit);
    visit.out
}

/// The tensor-parallel split of each parameter a `Tp` layer cut: the dim and the layer's spec.
fn tp_splits<M: TpModule>(model: &M) -> HashMap<ParamId, (usize, ShardSpec, String)> {
    let mut splits = HashMap::new();
    model.visit_tp_shardings(&mut |s| {
        if let Some(spec) = &s.spec {
            for p in &s.split_params {
                splits.insert(p.id, (p.dim, spec.clone(), s.path.clone()));
            }
        }
    });
    splits
}

/// Ids of the parameters the model says tensor parallelism split (whether or not it reports
/// how).
fn tp_sharded_ids<M: TpModule>(model: &M) -> HashSet<ParamId> {
    struct Ids(HashSet<ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.insert(param.id);
        }
    }
    let mut ids = Ids(HashSet::new());
    model.visit_tp_sharded(&mut ids);
    ids.0
}

/// Every stored float parameter of `model` on this rank, in module order, with the part of
/// the full tensor it holds. No communication.
pub fn placements<M: Module + TpModule>(model: &M) -> Result<Vec<Placement>, CheckpointError> {
    let fsdp: HashMap<ParamId, _> = param_states(model)
        .into_iter()
        .map(|s| (s.id(), s))
        .collect();
    let splits = tp_splits(model);
    let tp_sharded = tp_sharded_ids(model);
    let mut out = Vec::new();
    for p in stored_params(model) {
        let bad = |reason: String| CheckpointError::Placement {
            param: p.path.clone(),
            reason,
        };
        if tp_sharded.contains(&p.id) && !splits.contains_key(&p.id) {
            return Err(bad(
                "tensor parallelism split it but the model does not report how: \
                 its TpModule impl needs visit_tp_shardings (#[parallelize] generates it)"
                    .into(),
            ));
        }
        // The tensor before FSDP: the tp shard (or the whole parameter without tp).
        let (mut shape, rows) = match fsdp.get(&p.id) {
            Some(state) => (state.global_shape().to_vec(), Some(state.rows())),
            None => (p.shape.clone(), None),
        };
        let mut region = Region::full(&shape);
        if let Some((dim, spec, layer)) = splits.get(&p.id) {
            if shape.get(*dim) != Some(&spec.range.len()) {
                return Err(bad(format!(
                    "layer `{layer}` split dim {dim} into {:?} of {}, but the parameter's shard \
                     has shape {shape:?}",
                    spec.range, spec.full
                )));
            }
            shape[*dim] = spec.full;
            region.start[*dim] = spec.range.start;
        }
        if let Some(rows) = rows {
            region.start[0] += rows.start;
            region.shape[0] = rows.len();
        }
        if region.shape != p.shape || !region.fits(&shape) {
            return Err(bad(format!(
                "it stores {:?}, but its shards say {} of {shape:?}",
                p.shape,
                region.describe()
            )));
        }
        out.push(Placement {
            path: p.path,
            id: p.id,
            global_shape: shape,
            region,
            dtype: p.dtype,
            device: p.device,
        });
    }
    Ok(out)
}
