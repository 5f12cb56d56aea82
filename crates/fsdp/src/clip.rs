//! Gradient clipping by the global norm over every shard of every rank: the optimizer's own
//! clipping would only see this rank's shards.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Gradients, Tensor, TensorData};
use burn_parallel_dist::{CollectiveError, ReduceOp};

use crate::shard::FsdpConfig;

struct SumSquares<'a> {
    grads: &'a Gradients,
    total: f32,
}

impl ModuleVisitor for SumSquares<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = param.val().grad(self.grads) {
            let squares: f32 = g.clone().mul(g).sum().into_scalar();
            self.total += squares;
        }
    }
}

struct Scale<'a> {
    grads: &'a mut Gradients,
    factor: f32,
}

impl ModuleVisitor for Scale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let shard = param.val();
        if let Some(g) = shard.grad(self.grads) {
            shard.grad_replace(self.grads, g * self.factor);
        }
    }
}

/// Multiplies the gradient of every parameter of `module` (its shard, when sharded) by
/// `factor`, in place: clipping, and turning a data-parallel sum into a mean.
pub fn scale_grads<M: Module>(module: &M, grads: &mut Gradients, factor: f32) {
    module.visit(&mut Scale { grads, factor });
}

/// Clips the gradients of a sharded `module` in place so that their global L2 norm is at most
/// `max_norm` (PyTorch's `clip_grad_norm_`: scale by `max_norm / (norm + 1e-6)` when that is
/// below 1), and returns the global norm before clipping. Collective over the shard group;
/// under HSDP the replicas already hold identical gradients, so no other group is involved.
pub fn clip_grad_norm<M: Module>(
    module: &M,
    grads: &mut Gradients,
    max_norm: f32,
    config: &FsdpConfig,
) -> Result<f32, CollectiveError> {
    let mut local = SumSquares { grads, total: 0.0 };
    module.visit(&mut local);
    let summed = config
        .group
        .all_reduce(TensorData::new(vec![local.total], [1]), ReduceOp::Sum)?;
    let norm = summed
        .as_slice::<f32>()
        .map(|v| v[0].sqrt())
        .expect("an f32 sum of squares");
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        scale_grads(module, grads, coef);
    }
    Ok(norm)
}
