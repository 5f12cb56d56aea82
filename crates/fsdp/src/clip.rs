//! Gradient clipping by the global norm over every shard of every rank (the optimizer's own
//! clipping would only see this rank's shards), and the sums of squares it is built from.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, FloatDType, Gradients, Tensor, TensorData};
use burn_parallel_comm::{CollectiveError, ReduceOp};

use crate::config::FsdpConfig;

/// Sums of squared gradient elements of a module's parameters, split in two by a predicate.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SquareSums {
    /// Of the parameters the predicate marks (e.g. split across ranks).
    pub marked: f64,
    /// Of the others.
    pub other: f64,
}

/// The sums of squares of every gradient of `module`'s stored parameters (shards under FSDP),
/// `marked` ones apart. Each parameter's sum is computed on the gradient's device in f32; the
/// sums reach the host in one read per group (no per-step host copy of every gradient) and are
/// added in f64.
pub fn grad_square_sums<M: Module>(
    module: &M,
    grads: &Gradients,
    marked: impl Fn(ParamId) -> bool,
) -> SquareSums {
    struct Sums<'a, F> {
        grads: &'a Gradients,
        marked: F,
        sums: [Vec<Tensor<1>>; 2],
    }
    impl<F: Fn(ParamId) -> bool> ModuleVisitor for Sums<'_, F> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            // Visitors see the stored base: the shard, not the gathered weight.
            if let Some(g) = param.val().grad(self.grads) {
                let g = g.cast(FloatDType::F32);
                let n = g.shape().num_elements();
                let sum = g.clone().mul(g).reshape([n]).sum();
                self.sums[usize::from(!(self.marked)(param.id))].push(sum);
            }
        }
    }
    let mut sums = Sums {
        grads,
        marked,
        sums: [Vec::new(), Vec::new()],
    };
    module.visit(&mut sums);
    let [marked, other] = sums.sums.map(|parts| match parts.is_empty() {
        true => 0.0,
        false => Tensor::cat(parts, 0)
            .into_data()
            .convert_dtype(DType::F64)
            .iter::<f64>()
            .sum(),
    });
    SquareSums { marked, other }
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

/// PyTorch's `clip_grad_norm_` rule: scales the gradients by `max_norm / (norm + 1e-6)` when
/// that is below 1.
pub fn clip_to_norm<M: Module>(module: &M, grads: &mut Gradients, norm: f32, max_norm: f32) {
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        scale_grads(module, grads, coef);
    }
}

/// Clips the gradients of a sharded `module` in place so that their global L2 norm is at most
/// `max_norm` (PyTorch's `clip_grad_norm_`), and returns the global norm before clipping.
/// Collective over the shard group; under HSDP the replicas already hold identical gradients,
/// so no other group is involved.
pub fn clip_grad_norm<M: Module>(
    module: &M,
    grads: &mut Gradients,
    max_norm: f32,
    config: &FsdpConfig,
) -> Result<f32, CollectiveError> {
    let local = grad_square_sums(module, grads, |_| true).marked;
    let summed = config
        .group
        .all_reduce(TensorData::new(vec![local], [1]), ReduceOp::Sum)?;
    let norm = summed.iter::<f64>().next().expect("one sum").sqrt() as f32;
    clip_to_norm(module, grads, norm, max_norm);
    Ok(norm)
}
