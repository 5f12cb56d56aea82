//! Per-rank model state (parameters, gradients, optimizer moments) and the global gradient
//! norm over every shard of every rank.

use std::collections::HashSet;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{Gradients, Tensor, TensorData};
use burn_parallel_dist::{DeviceMesh, ReduceOp};
use burn_parallel_models::Llama;
use burn_parallel_tp::{ParallelStyle, Tp};

use crate::error::TrainError;

struct CountElems(usize);

impl ModuleVisitor for CountElems {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.0 += param.val().dims().iter().product::<usize>();
    }
}

/// Bytes of this rank's model state: its (sharded) f32 parameters, their gradients, and
/// `optimizer_states` f32 tensors of the same size each (AdamW: 2, SGD: 0).
pub fn model_state_bytes<M: Module>(model: &M, optimizer_states: usize) -> u64 {
    let mut count = CountElems(0);
    model.visit(&mut count);
    (count.0 * 4 * (2 + optimizer_states)) as u64
}

/// Ids of the parameters that tensor parallelism split (each tp rank holds a different part).
fn tp_sharded(model: &Llama) -> HashSet<ParamId> {
    let mut ids = HashSet::new();
    let mut linear = |l: &Tp<burn::nn::Linear>| {
        if l.sharding().is_some_and(|s| s.spec.is_some()) {
            ids.insert(l.inner().weight.id);
            if let (Some(b), Some(ParallelStyle::Colwise { .. })) = (&l.inner().bias, l.style()) {
                ids.insert(b.id);
            }
        }
    };
    for layer in &model.layers {
        let a = &layer.self_attn;
        let m = &layer.mlp;
        for l in [
            &a.q_proj,
            &a.k_proj,
            &a.v_proj,
            &a.o_proj,
            &m.gate_proj,
            &m.up_proj,
            &m.down_proj,
        ] {
            linear(l);
        }
    }
    if let Some(head) = &model.lm_head {
        linear(head);
    }
    if model
        .embed_tokens
        .sharding()
        .is_some_and(|s| s.spec.is_some())
    {
        ids.insert(model.embed_tokens.inner().weight.id);
    }
    ids
}

struct SumSquares<'a> {
    grads: &'a Gradients,
    /// Which params this rank counts (others hold copies of them).
    counts: &'a dyn Fn(ParamId) -> bool,
    total: f64,
}

impl ModuleVisitor for SumSquares<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !(self.counts)(param.id) {
            return;
        }
        if let Some(g) = param.val().grad(self.grads) {
            if g.dims().iter().product::<usize>() == 0 {
                return;
            }
            let v = g.into_data().convert_dtype(burn::tensor::DType::F32);
            self.total += v
                .as_slice::<f32>()
                .expect("f32 gradient")
                .iter()
                .map(|x| (*x as f64) * (*x as f64))
                .sum::<f64>();
        }
    }
}

/// The L2 norm of the whole model's gradient, every shard counted once: FSDP shards are
/// distinct, copies (HSDP/DDP replicas, parameters tensor parallelism leaves replicated) are
/// counted on one rank only. With `max_norm`, scales the gradients so that the norm is at most
/// `max_norm` (PyTorch's `clip_grad_norm_`). Collective over the whole mesh.
pub fn global_grad_norm(
    model: &Llama,
    grads: &mut Gradients,
    mesh: &DeviceMesh,
    max_norm: Option<f32>,
) -> Result<f32, TrainError> {
    let sharded = tp_sharded(model);
    let first_replica = mesh.coord("dp_replicate")? == 0;
    let first_tp = mesh.coord("tp")? == 0;
    let counts = |id: ParamId| first_replica && (first_tp || sharded.contains(&id));
    let mut local = SumSquares {
        grads,
        counts: &counts,
        total: 0.0,
    };
    model.visit(&mut local);
    // An exact f32 pair (high and low part) so that the sum over ranks keeps f64 precision.
    let hi = local.total as f32;
    let lo = (local.total - hi as f64) as f32;
    let world = mesh.context().world()?;
    let summed = world.all_reduce(TensorData::new(vec![hi, lo], [2]), ReduceOp::Sum)?;
    let s = summed.as_slice::<f32>().expect("f32 sums");
    let norm = ((s[0] as f64) + (s[1] as f64)).sqrt() as f32;
    if let Some(max) = max_norm {
        let coef = max / (norm + 1e-6);
        if coef < 1.0 {
            burn_parallel_fsdp::scale_grads(model, grads, coef);
        }
    }
    Ok(norm)
}
