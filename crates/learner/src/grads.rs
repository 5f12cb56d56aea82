//! The gradient sync of one optimizer step, for gradients burn-train's `TrainStep` already
//! took: `parallelizer::sync_gradients`, what the `Step` runs after its backward, on the
//! gradients moved into the container it takes.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Gradients, Tensor};
use burn_parallel_describe::Parallelize;
use burn_parallel_parallelizer::{MeshContext, sync_gradients};

use crate::error::LearnerError;

/// Synchronizes `grads` (of this rank's parameters: shards under FSDP, already reduced over
/// the shard group by backward) and clips them by the global norm when `max_grad_norm` is set.
/// Collective: every rank calls it at every optimizer step.
pub(crate) fn sync_grads<M: Parallelize>(
    model: &M,
    grads: GradientsParams,
    max_grad_norm: Option<f32>,
    ctx: &MeshContext,
) -> Result<GradientsParams, LearnerError> {
    let mut raw = into_gradients(model, grads, ctx);
    sync_gradients(model, &mut raw, max_grad_norm, ctx)?;
    Ok(GradientsParams::from_grads(raw, model))
}

/// The autodiff container of `grads` (keyed by parameter id) keyed by the parameters' own
/// tensors, which the parallelizer's gradient functions take. Visitors see the stored base of
/// each parameter: the shard under FSDP.
fn into_gradients<M: Module>(model: &M, grads: GradientsParams, ctx: &MeshContext) -> Gradients {
    // Burn builds a `Gradients` only from a backward: the one of a scalar leaf, which no
    // parameter shares, gives an otherwise empty container.
    let leaf = Tensor::<1>::zeros([1], ctx.device()).require_grad();
    let mut into = leaf.sum().backward();
    struct Fill<'a> {
        from: GradientsParams,
        into: &'a mut Gradients,
    }
    impl ModuleVisitor for Fill<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.from.remove::<D>(param.id) {
                param.val().grad_replace(self.into, g);
            }
        }
    }
    model.visit(&mut Fill {
        from: grads,
        into: &mut into,
    });
    into
}
