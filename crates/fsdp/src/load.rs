//! Full state in and out of a sharded module, one parameter at a time.
//!
//! Loading: [`fully_shard_from`] shards a module whose parameters are not initialized yet
//! (Burn's lazy `Param`s, as `LinearConfig::init` and friends create them) by asking a source
//! for this rank's rows of each parameter, so no rank ever holds a full parameter, let alone
//! the full model: a safetensors reader can read just those rows from a memory map.
//!
//! Export: [`for_each_full_param`] gathers one parameter at a time (on every rank of the shard
//! group, or on its first rank only) and hands it over with its module path;
//! [`gather_state_dict`] collects them.

use std::collections::{BTreeMap, HashMap};

use burn::module::{Module, Param, ParamId};
use burn::tensor::{Tensor, TensorData};

use burn_parallel_comm::collectives as coll;

use crate::config::FsdpConfig;
use crate::error::FsdpError;
use crate::paths::{PathVisitor, visit_with_paths};
use crate::reparam::collect;
use crate::rows::RowRequest;
use crate::shard::shard_module;
use crate::state::Served;

/// As [`fully_shard`](crate::fully_shard), but each rank's shard of every parameter comes from
/// `source` (its rows of the full tensor), called once per parameter, in module order, and
/// never for more than this rank's rows of one parameter. Uninitialized (lazy) parameters are
/// replaced without running their initializers, keeping their ids, devices and gradient
/// settings; parameters that are already initialized are sliced as `fully_shard` does. An
/// error of the source, or data of the wrong shape, stops the load and is returned naming the
/// parameter. Collective only in that every rank must build the same module; no communication
/// happens.
pub fn fully_shard_from<M: Module, E: std::fmt::Display>(
    module: M,
    config: &FsdpConfig,
    mut source: impl FnMut(&RowRequest) -> Result<TensorData, E>,
) -> Result<M, FsdpError> {
    let mut source = |request: &RowRequest| source(request).map_err(|e| e.to_string());
    shard_module(module, config, Some(&mut source))
}

/// Which ranks receive the gathered full state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateDictRanks {
    /// Every rank of the shard group.
    All,
    /// The first rank of the shard group (under HSDP, of each replica's group); the others
    /// only send their shards.
    First,
}

/// A stored parameter, flattened (visitors are generic over the rank), with its shape.
struct Stored {
    path: String,
    id: ParamId,
    flat: Tensor<1>,
    shape: Vec<usize>,
}

impl Stored {
    fn data(&self) -> TensorData {
        let data = self.flat.to_data();
        let dtype = data.dtype();
        TensorData::from_bytes(data.into_bytes(), self.shape.clone(), dtype)
    }
}

/// Module paths, ids and stored values (not copies) of a module's float parameters, in
/// module order.
fn stored_params<M: Module>(module: &M) -> Vec<Stored> {
    struct Params(Vec<Stored>);
    impl PathVisitor for Params {
        fn visit_float<const D: usize>(&mut self, path: &str, param: &Param<Tensor<D>>) {
            let base = param.base();
            let shape = base.dims().to_vec();
            self.0.push(Stored {
                path: path.to_string(),
                id: param.id,
                flat: base.reshape([shape.iter().product::<usize>()]),
                shape,
            });
        }
    }
    let mut params = Params(Vec::new());
    visit_with_paths(module, &mut params);
    params.0
}

/// `data` (of as many elements) viewed with `shape`.
fn with_shape(data: TensorData, shape: &[usize]) -> TensorData {
    debug_assert_eq!(data.num_elements(), shape.iter().product::<usize>());
    if data.shape().as_slice() == shape {
        return data;
    }
    let dtype = data.dtype();
    TensorData::from_bytes(data.into_bytes(), shape.to_vec(), dtype)
}

/// Concatenates row blocks (same dtype and trailing dims) along dim 0.
fn concat_rows(parts: Vec<TensorData>) -> TensorData {
    let dtype = parts[0].dtype();
    let mut shape = parts[0].shape().to_vec();
    shape[0] = parts.iter().map(|p| p.shape()[0]).sum();
    let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.as_bytes().len()).sum());
    for part in &parts {
        bytes.extend_from_slice(part.as_bytes());
    }
    TensorData::from_bytes_vec(bytes, shape, dtype)
}

/// Calls `f(path, full tensor)` for each float parameter of a sharded `module`, in module
/// order, gathering one parameter at a time in the shards' dtype (so a rank holds at most one
/// full parameter besides its shards, plus what `f` keeps). Parameters that are not sharded are
/// handed over as stored. Collective over each parameter's shard group: every rank calls it.
/// With [`StateDictRanks::First`], `f` runs only on the first rank of the shard group.
pub fn for_each_full_param<M: Module>(
    module: &M,
    ranks: StateDictRanks,
    mut f: impl FnMut(&str, TensorData),
) -> Result<(), FsdpError> {
    let sharded: HashMap<ParamId, _> = collect(module)
        .into_iter()
        .map(|c| (c.state.id, c.state))
        .collect();
    for param in stored_params(module) {
        let (path, stored) = (&param.path, param.data());
        let Some(state) = sharded.get(&param.id) else {
            f(path, stored);
            continue;
        };
        let group = &state.unit.group;
        let full = match ranks {
            StateDictRanks::All => Some(group.all_gather(stored, 0)?),
            StateDictRanks::First if group.index() == 0 => {
                let mut parts = vec![stored];
                for src in 1..group.size() {
                    parts.push(group.recv(src)?);
                }
                Some(concat_rows(parts))
            }
            StateDictRanks::First => {
                group.send(stored, 0)?;
                None
            }
        };
        if let Some(full) = full {
            // Flat pieces (`[len, 1, ..]`) gather into the flattened parameter.
            let full = with_shape(full, &state.global_shape);
            f(path, full);
        }
    }
    Ok(())
}

/// The full (gathered) state of a sharded module, keyed by module path, in the shards' dtype:
/// FSDP's shards only (tensor-parallel and expert splits stay split; the whole model's state
/// is `parallelizer::full_state_dict`). Empty on the ranks that [`StateDictRanks::First`]
/// leaves out.
pub fn gather_state_dict<M: Module>(
    module: &M,
    ranks: StateDictRanks,
) -> Result<BTreeMap<String, TensorData>, FsdpError> {
    let mut state = BTreeMap::new();
    for_each_full_param(module, ranks, |path, data| {
        state.insert(path.to_string(), data);
    })?;
    Ok(state)
}

/// The full (gathered) module, with plain parameters in the shards' dtype: collective, so every
/// rank of each parameter's shard group calls it. Each parameter is gathered on its own device
/// (no host round trip on a GPU) and served to Burn's `materialize`, which folds the
/// reparameterizations into plain parameters.
pub fn gather_full<M: Module>(module: M) -> Result<M, FsdpError> {
    struct Unserve(Vec<std::sync::Arc<crate::state::ParamState>>);
    impl Drop for Unserve {
        fn drop(&mut self) {
            self.0.iter().for_each(|s| s.serve(None));
        }
    }
    let mut served = Unserve(Vec::new());
    for c in collect(&module) {
        let shard = match &c.state.unit.compute {
            Some(device) => c.shard.detach().to_device(device),
            None => c.shard.detach(),
        };
        let full = coll::all_gather(shard, &c.state.unit.group, 0)?;
        c.state.serve(Some(Served::value(full)));
        served.0.push(c.state);
    }
    Ok(module.materialize())
}
