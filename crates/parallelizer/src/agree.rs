//! Every rank must start from the same weights: FSDP and TP slice a replicated model, so a
//! rank built from another seed would train a different model silently. One all-gather of a
//! checksum per parameter finds the first parameter that differs, before any sharding.

use burn::module::{Module, Param};
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_parallel_fsdp::{PathVisitor, visit_with_paths};

use burn_parallel_describe::{ModelDescription, Parallelize};

use crate::context::MeshContext;
use crate::error::ParallelError;

/// Module paths and checksums (sum, sum of squares, in f32 on the parameter's device) of the
/// initialized float parameters, in module order. Lazy parameters (read from one checkpoint on
/// every rank) are left out.
fn checksums<M: Module>(model: &M, skip: &dyn Fn(&str) -> bool) -> (Vec<String>, Vec<Tensor<1>>) {
    struct Sums<'a> {
        skip: &'a dyn Fn(&str) -> bool,
        paths: Vec<String>,
        sums: Vec<Tensor<1>>,
    }
    impl PathVisitor for Sums<'_> {
        fn visit_float<const D: usize>(&mut self, path: &str, param: &Param<Tensor<D>>) {
            if !param.is_initialized() || (self.skip)(path) {
                return;
            }
            let value = param.val().detach().cast(FloatDType::F32);
            let n = value.shape().num_elements();
            let flat = value.reshape([n]);
            self.paths.push(path.to_string());
            self.sums.push(flat.clone().sum());
            self.sums.push(flat.clone().mul(flat).sum());
        }
    }
    let mut sums = Sums {
        skip,
        paths: Vec::new(),
        sums: Vec::new(),
    };
    visit_with_paths(model, &mut sums);
    (sums.paths, sums.sums)
}

/// Checks that every rank of the mesh holds the same parameters as rank 0, naming the first
/// parameter and rank that differ. Under expert parallelism the experts are left out: a model
/// loaded for it already holds each rank's own. Collective over the whole mesh.
pub(crate) fn check_replicas_agree<M: Parallelize>(
    model: &M,
    ctx: &MeshContext,
) -> Result<(), ParallelError> {
    let world = ctx.world_group();
    if world.size() == 1 {
        return Ok(());
    }
    let mut description = ModelDescription::default();
    if ctx.expert_groups().is_some() {
        model.describe("", &mut description);
    }
    let (paths, sums) = checksums(model, &|path| description.is_expert_param(path));
    let local: Vec<f32> = match sums.is_empty() {
        true => Vec::new(),
        false => Tensor::cat(sums, 0)
            .into_data()
            .convert_dtype(DType::F32)
            .try_to_vec()
            .expect("f32 checksums"),
    };
    let n = local.len();
    let all = world.all_gather(TensorData::new(local, [1, n]), 0)?;
    let all = all.try_to_vec::<f32>().expect("f32 checksums");
    let first = &all[..n];
    for rank in 1..world.size() {
        let theirs = &all[rank * n..(rank + 1) * n];
        if let Some(i) = (0..n).find(|&i| theirs[i].to_bits() != first[i].to_bits()) {
            return Err(ParallelError::ReplicasDiffer {
                rank: world.ranks()[rank],
                param: paths[i / 2].clone(),
            });
        }
    }
    Ok(())
}
