//! DDP: replicated parameters (broadcast from data-parallel rank 0, like PyTorch's DDP
//! constructor) and gradients averaged over the data-parallel group in buckets.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{DType, Gradients, Tensor, TensorData};
use burn_parallel_dist::{CollectiveError, ProcessGroup, ReduceOp};

use crate::context::MeshContext;
use crate::error::ParallelError;

/// Makes every data-parallel rank hold rank 0's parameters. Collective over the dp group.
pub fn replicate<M: Module>(model: M, ctx: &MeshContext) -> Result<M, ParallelError> {
    let mut broadcast = Broadcast {
        group: ctx.dp_group(),
        error: None,
    };
    let model = model.map(&mut broadcast);
    broadcast.error.map_or(Ok(model), |e| Err(e.into()))
}

struct Broadcast<'a> {
    group: &'a ProcessGroup,
    error: Option<CollectiveError>,
}

impl ModuleMapper for Broadcast<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.error.is_some() || self.group.size() == 1 {
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
    if group.size() == 1 {
        return Ok(());
    }
    let mut collect = CollectGrads {
        grads,
        entries: Vec::new(),
    };
    model.visit(&mut collect);
    let entries = collect.entries;
    let mut reduced = Vec::with_capacity(entries.len());
    for bucket in buckets(&entries, bucket_bytes) {
        let flat: Vec<f32> = bucket
            .iter()
            .flat_map(|e| e.values.iter().copied())
            .collect();
        let n = flat.len();
        let summed = group.all_reduce(TensorData::new(flat, [n]), ReduceOp::Avg)?;
        let values = summed
            .try_into_vec::<f32>()
            .map_err(|e| ParallelError::Config(format!("gradient bucket: {e:?}")))?;
        let mut offset = 0;
        for e in bucket {
            reduced.push(values[offset..offset + e.values.len()].to_vec());
            offset += e.values.len();
        }
    }
    let mut replace = ReplaceGrads {
        grads,
        reduced: reduced.into_iter(),
    };
    model.visit(&mut replace);
    Ok(())
}

struct GradEntry {
    values: Vec<f32>,
}

/// Consecutive entries grouped so each group holds at least one entry and at most about
/// `bucket_bytes` of f32 values.
fn buckets(entries: &[GradEntry], bucket_bytes: usize) -> Vec<&[GradEntry]> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut bytes = 0;
    for (i, e) in entries.iter().enumerate() {
        let size = e.values.len() * 4;
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
    entries: Vec<GradEntry>,
}

impl ModuleVisitor for CollectGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        if !value.is_require_grad() {
            return;
        }
        let values = match value.grad(self.grads) {
            Some(g) => g
                .into_data()
                .convert_dtype(DType::F32)
                .try_into_vec::<f32>()
                .expect("an f32 gradient"),
            None => vec![0.0; value.shape().num_elements()],
        };
        self.entries.push(GradEntry { values });
    }
}

struct ReplaceGrads<'a, I> {
    grads: &'a mut Gradients,
    reduced: I,
}

impl<I: Iterator<Item = Vec<f32>>> ModuleVisitor for ReplaceGrads<'_, I> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        if !value.is_require_grad() {
            return;
        }
        let values = self.reduced.next().expect("one reduced gradient per entry");
        let dtype = value.grad(self.grads).map_or(DType::F32, |g| g.dtype());
        let data = TensorData::new(values, value.shape()).convert_dtype(dtype);
        let grad = Tensor::<D>::from_data(data, &value.device()).inner();
        value.grad_replace(self.grads, grad);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(n: usize) -> GradEntry {
        GradEntry {
            values: vec![0.0; n],
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
