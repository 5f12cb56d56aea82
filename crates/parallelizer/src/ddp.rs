//! DDP: replicated parameters (broadcast from data-parallel rank 0, like PyTorch's DDP
//! constructor) and gradients averaged over the data-parallel group in buckets. The buckets
//! are tensors on the gradients' device, so on CUDA with the nccl engine they never leave it.

use std::collections::HashSet;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, FloatDType, Gradients, Tensor};
use burn_parallel_comm::collectives as coll;
use burn_parallel_comm::{CollectiveError, ProcessGroup, ReduceOp};

use burn_parallel_describe::ModelDescription;
use burn_parallel_fsdp::{PathVisitor, visit_with_paths};

use crate::context::MeshContext;
use crate::error::ParallelError;

/// Makes every data-parallel rank hold rank 0's parameters. Collective over the dp group.
pub fn replicate<M: Module>(model: M, ctx: &MeshContext) -> Result<M, ParallelError> {
    broadcast(model, ctx.dp_group(), &|_| true)
}

/// [`replicate`] for a model whose experts are split over an ep group: the dense parameters
/// from data-parallel rank 0, each expert parameter from the first of the ranks holding the
/// same experts. Collective over the dp group.
pub fn replicate_with_experts<M: Module>(
    model: M,
    description: &ModelDescription,
    ctx: &MeshContext,
) -> Result<M, ParallelError> {
    let experts = expert_param_ids(&model, description);
    let model = broadcast(model, ctx.dp_group(), &|id| !experts.contains(&id))?;
    match ctx.expert_groups() {
        Some(groups) => broadcast(model, &groups.replicas, &|id| experts.contains(&id)),
        None => Ok(model),
    }
}

fn broadcast<M: Module>(
    model: M,
    group: &ProcessGroup,
    select: &dyn Fn(ParamId) -> bool,
) -> Result<M, ParallelError> {
    let mut broadcast = Broadcast {
        group,
        select,
        error: None,
    };
    let model = model.map(&mut broadcast);
    broadcast.error.map_or(Ok(model), |e| Err(e.into()))
}

struct Broadcast<'a> {
    group: &'a ProcessGroup,
    select: &'a dyn Fn(ParamId) -> bool,
    error: Option<CollectiveError>,
}

impl ModuleMapper for Broadcast<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.error.is_some() || self.group.size() == 1 || !(self.select)(param.id) {
            return param;
        }
        param.map(|t| {
            let data = (self.group.index() == 0).then(|| t.to_data());
            match self.group.broadcast(data, 0) {
                Ok(data) => {
                    let trainable = t.is_require_grad();
                    let replica = Tensor::<D>::from_data(data, &t.device());
                    if trainable {
                        replica.require_grad()
                    } else {
                        replica
                    }
                }
                Err(e) => {
                    self.error = Some(e);
                    t
                }
            }
        })
    }
}

/// Averages the gradients of `model`'s trainable parameters over `group`, in buckets of about
/// `bucket_bytes` (one all-reduce each, in f32). A trainable parameter without a gradient on
/// this rank (unused in its forward) contributes zeros, so ranks never disagree on bucket
/// layout.
pub fn all_reduce_gradients<M: Module>(
    model: &M,
    grads: &mut Gradients,
    group: &ProcessGroup,
    bucket_bytes: usize,
) -> Result<(), ParallelError> {
    reduce_selected(model, grads, group, bucket_bytes, &|_| true, ReduceOp::Avg)
}

/// DDP's gradient sync for a model whose experts are split over an ep group: the dense
/// parameters averaged over the dp group; the experts' gradients, which already hold every
/// ep rank's tokens (the token exchange brought them back), summed over the ranks holding the
/// same experts and divided by the data-parallel size, so that every parameter's gradient is
/// the mean over the global batch.
pub fn all_reduce_gradients_with_experts<M: Module>(
    model: &M,
    grads: &mut Gradients,
    experts: &HashSet<ParamId>,
    ctx: &MeshContext,
    bucket_bytes: usize,
) -> Result<(), ParallelError> {
    let dense = |id: ParamId| !experts.contains(&id);
    reduce_selected(
        model,
        grads,
        ctx.dp_group(),
        bucket_bytes,
        &dense,
        ReduceOp::Avg,
    )?;
    let Some(groups) = ctx.expert_groups() else {
        return Ok(());
    };
    let expert = |id: ParamId| experts.contains(&id);
    reduce_selected(
        model,
        grads,
        &groups.replicas,
        bucket_bytes,
        &expert,
        ReduceOp::Sum,
    )?;
    let scale = 1.0 / ctx.dp_size() as f32;
    let mut scaled = ScaleSelected {
        grads,
        select: &expert,
        scale,
    };
    model.visit(&mut scaled);
    Ok(())
}

/// The ids of the parameters under the model's `#[experts]` modules.
pub fn expert_param_ids<M: Module>(model: &M, description: &ModelDescription) -> HashSet<ParamId> {
    struct Collect<'a>(&'a ModelDescription, HashSet<ParamId>);
    impl PathVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, path: &str, param: &Param<Tensor<D>>) {
            if self.0.is_expert_param(path) {
                self.1.insert(param.id);
            }
        }
    }
    if description.experts.is_empty() {
        return HashSet::new();
    }
    let mut collect = Collect(description, HashSet::new());
    visit_with_paths(model, &mut collect);
    collect.1
}

struct ScaleSelected<'a> {
    grads: &'a mut Gradients,
    select: &'a dyn Fn(ParamId) -> bool,
    scale: f32,
}

impl ModuleVisitor for ScaleSelected<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        if !(self.select)(param.id) || !value.is_require_grad() {
            return;
        }
        if let Some(g) = value.grad(self.grads) {
            value.grad_replace(self.grads, g.mul_scalar(self.scale));
        }
    }
}

/// Reduces (`op`) the gradients of the trainable parameters `select` picks over `group`, in
/// buckets.
fn reduce_selected<M: Module>(
    model: &M,
    grads: &mut Gradients,
    group: &ProcessGroup,
    bucket_bytes: usize,
    select: &dyn Fn(ParamId) -> bool,
    op: ReduceOp,
) -> Result<(), ParallelError> {
    if group.size() == 1 {
        return Ok(());
    }
    let mut collect = CollectGrads {
        grads,
        select,
        entries: Vec::new(),
    };
    model.visit(&mut collect);
    let entries = collect.entries;
    let mut reduced = Vec::with_capacity(entries.len());
    for bucket in buckets(&entries, bucket_bytes) {
        let flat = Tensor::cat(bucket.iter().map(|e| e.values.clone()).collect(), 0);
        let summed = coll::all_reduce(flat, group, op)?;
        let mut offset = 0;
        for e in bucket {
            let n = e.len();
            reduced.push(summed.clone().narrow(0, offset, n));
            offset += n;
        }
    }
    let mut replace = ReplaceGrads {
        grads,
        select,
        reduced: reduced.into_iter(),
    };
    model.visit(&mut replace);
    Ok(())
}

/// A gradient, flattened, in f32.
struct GradEntry {
    values: Tensor<1>,
}

impl GradEntry {
    fn len(&self) -> usize {
        self.values.dims()[0]
    }
}

/// Consecutive entries grouped so each group holds at least one entry and at most about
/// `bucket_bytes` of f32 values.
fn buckets(entries: &[GradEntry], bucket_bytes: usize) -> Vec<&[GradEntry]> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut bytes = 0;
    for (i, e) in entries.iter().enumerate() {
        let size = e.len() * 4;
        if i > start && bytes + size > bucket_bytes {
            out.push(&entries[start..i]);
            start = i;
            bytes = 0;
        }
        bytes += size;
    }
    if start < entries.len() {
        out.push(&entries[start..]);
    }
    out
}

struct CollectGrads<'a> {
    grads: &'a Gradients,
    select: &'a dyn Fn(ParamId) -> bool,
    entries: Vec<GradEntry>,
}

impl ModuleVisitor for CollectGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        if !(self.select)(param.id) || !value.is_require_grad() {
            return;
        }
        let n = value.shape().num_elements();
        let values = match value.grad(self.grads) {
            Some(g) => g.reshape([n]).cast(FloatDType::F32),
            None => Tensor::zeros([n], &value.device()).inner(),
        };
        self.entries.push(GradEntry { values });
    }
}

struct ReplaceGrads<'a, I> {
    grads: &'a mut Gradients,
    select: &'a dyn Fn(ParamId) -> bool,
    reduced: I,
}

impl<I: Iterator<Item = Tensor<1>>> ModuleVisitor for ReplaceGrads<'_, I> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        if !(self.select)(param.id) || !value.is_require_grad() {
            return;
        }
        let values = self.reduced.next().expect("one reduced gradient per entry");
        let dtype = value.grad(self.grads).map_or(DType::F32, |g| g.dtype());
        let grad = values.reshape(value.shape()).cast(FloatDType::from(dtype));
        value.grad_replace(self.grads, grad);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(deprecated)]
    fn entry(n: usize) -> GradEntry {
        GradEntry {
            values: Tensor::zeros([n], &burn::tensor::Device::ndarray()),
        }
    }

    #[test]
    fn buckets_respect_the_cap_and_keep_order() {
        let entries = vec![entry(10), entry(10), entry(30), entry(1)];
        let sizes: Vec<usize> = buckets(&entries, 80).iter().map(|b| b.len()).collect();
        assert_eq!(sizes, vec![2, 1, 1]);
        // An entry larger than the cap gets a bucket of its own.
        let sizes: Vec<usize> = buckets(&entries, 4).iter().map(|b| b.len()).collect();
        assert_eq!(sizes, vec![1, 1, 1, 1]);
    }
}
