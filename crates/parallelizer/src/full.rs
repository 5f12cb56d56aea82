//! The whole model from any strategy: FSDP shards gathered, tensor-parallel layers gathered
//! back, so a parallelized model saves like a plain one.

use std::collections::BTreeMap;

use burn::module::{Module, Param};
use burn::tensor::{Tensor, TensorData};
use burn_parallel_describe::{Parallelize, UnitMap};
use burn_parallel_ep::ExpertModule;
use burn_parallel_fsdp::{PathVisitor, visit_with_paths};

use crate::error::ParallelError;

/// The whole model, on every rank: FSDP shards all-gathered (in the shards' dtype), `Tp` layers
/// gathered back whole with their styles removed and head counts made global, experts split
/// over an ep group gathered back into every `#[experts]` module. The result is a
/// plain model of the same type: save it with Burn's own record format
/// (`full.save_file(path)`), or take its tensors by path with [`full_state_dict`].
/// Collective: every rank calls it. Each rank holds the whole model at once; to stream FSDP
/// parameters one at a time use `fsdp::for_each_full_param`.
pub fn full_model<M: Parallelize>(model: M) -> Result<M, ParallelError> {
    let model = burn_parallel_fsdp::gather_full(model)?;
    let model = model.gather_tp()?;
    model.map_units("", &mut ExpertGatherer)
}

/// Gathers every `#[experts]` module's experts split over an ep group; units stay as they are.
struct ExpertGatherer;

impl UnitMap for ExpertGatherer {
    type Error = ParallelError;

    fn unit<N: Module>(&mut self, _path: &str, module: N) -> Result<N, ParallelError> {
        Ok(module)
    }

    fn experts<N: ExpertModule>(&mut self, _path: &str, module: N) -> Result<N, ParallelError> {
        Ok(module.gather_experts()?)
    }
}

/// Every float parameter of the whole model ([`full_model`]) by module path, as data.
/// Collective: every rank calls it.
pub fn full_state_dict<M: Parallelize>(
    model: M,
) -> Result<BTreeMap<String, TensorData>, ParallelError> {
    struct ByPath(BTreeMap<String, TensorData>);
    impl PathVisitor for ByPath {
        fn visit_float<const D: usize>(&mut self, path: &str, param: &Param<Tensor<D>>) {
            self.0.insert(path.to_string(), param.val().into_data());
        }
    }
    let mut by_path = ByPath(BTreeMap::new());
    visit_with_paths(&full_model(model)?, &mut by_path);
    Ok(by_path.0)
}
