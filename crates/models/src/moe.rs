//! The sparse mixture-of-experts block of Qwen3-MoE and Mixtral, as transformers computes
//! it: a linear router, softmax in f32, top-k experts per token (their weights renormalized
//! when `norm_topk_prob`), SwiGLU experts, outputs summed with the routing weights. Dropless:
//! every token reaches its k experts. Under expert parallelism the experts are split over an
//! ep group and the routed rows travel with [`burn_parallel_ep::run_experts`].

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::activation::softmax;
use burn::tensor::{DType, Device, FloatDType, Int, Tensor, TensorData};
use burn_parallel_comm::ProcessGroup;
use burn_parallel_comm::collectives::split_views;
use burn_parallel_comm::linear::linear;
use burn_parallel_ep::{EpError, ExpertModule, ExpertShard, Routing, run_experts};
use burn_parallel_fsdp::try_with_module_unit;
use burn_parallel_macros::parallelize;

/// A layer's experts, stacked: expert `e`'s SwiGLU is `down[e](silu(x gate[e]) * x up[e])`.
/// Under expert parallelism the stack holds this rank's experts only (`shard` says which).
#[derive(Module, Debug)]
pub struct Experts {
    /// Gate projections, `[experts, hidden, intermediate]` (Burn's `x @ W` layout).
    pub gate_proj: Param<Tensor<3>>,
    /// Up projections, `[experts, hidden, intermediate]`.
    pub up_proj: Param<Tensor<3>>,
    /// Down projections, `[experts, intermediate, hidden]`.
    pub down_proj: Param<Tensor<3>>,
    /// Experts of the layer over all ranks.
    #[module(skip)]
    pub num_experts: usize,
    /// The ep group the experts are split over (`None`: all experts are here).
    #[module(skip)]
    pub shard: Option<ExpertShard>,
}

impl Experts {
    /// Global indices of the experts this stack holds.
    pub fn local_experts(&self) -> std::ops::Range<usize> {
        match &self.shard {
            Some(s) => s.local_experts(),
            None => 0..self.num_experts,
        }
    }

    /// Keeps this rank's experts of the full stack: those `shard` assigns to it.
    pub fn shard(self, shard: ExpertShard) -> Result<Self, EpError> {
        if let Some(current) = &self.shard {
            return Err(EpError::Split(format!(
                "they are already split as {current:?}"
            )));
        }
        if shard.num_experts() != self.num_experts {
            return Err(EpError::Split(format!(
                "the layer has {} experts, the split {shard:?} is for {}",
                self.num_experts,
                shard.num_experts()
            )));
        }
        let local = shard.local_experts();
        let keep = |p: Param<Tensor<3>>| {
            p.map(|t| {
                let trainable = t.is_require_grad();
                let kept = t.narrow(0, local.start, local.len()).detach();
                if trainable { kept.require_grad() } else { kept }
            })
        };
        Ok(Self {
            gate_proj: keep(self.gate_proj),
            up_proj: keep(self.up_proj),
            down_proj: keep(self.down_proj),
            num_experts: self.num_experts,
            shard: Some(shard),
        })
    }

    /// Each local expert's `[in, out]` matrices of the three projections, in `dtype`: views of
    /// the stacks whose backward builds each stack's gradient once (a plain slice per expert
    /// would allocate a whole stack of zeros per expert in backward).
    fn per_expert(&self, dtype: DType) -> [Vec<Tensor<2>>; 3] {
        let views = |p: &Param<Tensor<3>>| -> Vec<Tensor<2>> {
            // The value's shape: under FSDP the stored shard has another.
            let value = p.val();
            let [n, d_in, d_out] = value.dims();
            let size = d_in * d_out;
            let ranges: Vec<_> = (0..n).map(|e| e * size..(e + 1) * size).collect();
            split_views(value.reshape([n * size]), &ranges)
                .into_iter()
                .map(|w| w.reshape([d_in, d_out]).cast(dtype))
                .collect()
        };
        [
            views(&self.gate_proj),
            views(&self.up_proj),
            views(&self.down_proj),
        ]
    }
}

/// SwiGLU of one expert on `rows` `[n, hidden]`: `down(silu(rows gate) * rows up)`.
fn swiglu(rows: Tensor<2>, [gate, up, down]: [&Tensor<2>; 3]) -> Tensor<2> {
    let g = rows.clone().matmul(gate.clone());
    let u = rows.matmul(up.clone());
    crate::fused::swiglu(g, u).matmul(down.clone())
}

/// The sparse MoE block: `Qwen3MoeSparseMoeBlock` / `MixtralSparseMoeBlock`. Its experts
/// are the `#[experts]` field expert parallelism splits; the router is a dense parameter.
#[parallelize]
#[derive(Module, Debug)]
pub struct SparseMoe {
    /// The router, `hidden -> experts`, without bias.
    pub gate: Linear,
    /// The experts.
    #[experts]
    pub experts: Experts,
    /// Experts per token.
    #[module(skip)]
    pub top_k: usize,
    /// Whether the top-k weights are renormalized to sum to one.
    #[module(skip)]
    pub norm_topk_prob: bool,
}

impl SparseMoe {
    /// The block on `x` `[batch, seq, hidden]`, with the router logits `[batch * seq, experts]`
    /// (for the load-balancing loss). Collective over the experts' ep group when sharded.
    pub fn forward(&self, x: Tensor<3>) -> Result<(Tensor<3>, Tensor<2>), EpError> {
        let [b, s, h] = x.dims();
        let (tokens, k) = (b * s, self.top_k);
        let x = x.reshape([tokens, h]);
        let logits = linear(
            x.clone(),
            self.gate.weight.val(),
            self.gate.bias.as_ref().map(Param::val),
        );
        let probs = softmax(logits.clone().cast(FloatDType::F32), 1);
        let chosen = top_k(&probs.clone().into_data(), self.experts.num_experts, k);
        let device = x.device();
        let mut weights = probs.gather(1, int_tensor(&chosen, [tokens, k], &device));
        if self.norm_topk_prob {
            weights = weights.clone() / weights.sum_dim(1);
        }
        let weights = weights.cast(x.dtype());

        let routing = Routing::new(&chosen, self.experts.num_experts)?;
        // Slot t * k + j is token t's j-th choice.
        let token_of: Vec<usize> = routing.order.iter().map(|slot| slot / k).collect();
        let rows = x.select(0, int_tensor(&token_of, [token_of.len()], &device));
        // Under FSDP the experts are a unit of their own (sharded over the ranks holding the
        // same experts): gathered once for all of them.
        let first = self.experts.local_experts().start;
        let outputs = try_with_module_unit(&self.experts, || {
            let [gate, up, down] = self.experts.per_expert(rows.dtype());
            run_experts(
                rows,
                &routing.counts,
                self.experts.shard.as_ref(),
                |e, rows| {
                    let local = e - first;
                    swiglu(rows, [&gate[local], &up[local], &down[local]])
                },
            )
        })
        .map_err(|e| EpError::Gather(e.to_string()))??;
        let inverse = routing.inverse();
        let per_slot = outputs.select(0, int_tensor(&inverse, [inverse.len()], &device));
        let mixed = (per_slot.reshape([tokens, k, h]) * weights.reshape([tokens, k, 1]))
            .sum_dim(1)
            .reshape([b, s, h]);
        Ok((mixed, logits))
    }
}

impl ExpertModule for Experts {
    fn shard_experts(self, ep_group: &ProcessGroup) -> Result<Self, EpError> {
        if let Some(shard) = &self.shard {
            // Built already split (each rank read its own experts): the same split is kept.
            return if shard.group().ranks() == ep_group.ranks() {
                Ok(self)
            } else {
                Err(EpError::Split(format!(
                    "they are already split as {shard:?}, not over {ep_group:?}"
                )))
            };
        }
        let shard = ExpertShard::new(ep_group.clone(), self.num_experts)?;
        self.shard(shard)
    }

    fn expert_shard(&self) -> Option<&ExpertShard> {
        self.shard.as_ref()
    }

    fn gather_experts(self) -> Result<Self, EpError> {
        let Some(shard) = self.shard.clone() else {
            return Ok(self);
        };
        // Group order is expert order: rank i of the group holds the i-th block of experts.
        let gather = |p: Param<Tensor<3>>| -> Result<Param<Tensor<3>>, EpError> {
            let whole = shard.group().all_gather(p.val().into_data(), 0)?;
            Ok(p.map(|t| {
                let trainable = t.is_require_grad();
                let whole = Tensor::from_data(whole, &t.device());
                if trainable {
                    whole.require_grad()
                } else {
                    whole
                }
            }))
        };
        Ok(Self {
            gate_proj: gather(self.gate_proj)?,
            up_proj: gather(self.up_proj)?,
            down_proj: gather(self.down_proj)?,
            num_experts: self.num_experts,
            shard: None,
        })
    }
}

/// The `k` largest of each row of `probs` `[tokens, experts]` (ties to the lower expert), by
/// descending probability: `tokens * k` expert indices.
fn top_k(probs: &TensorData, experts: usize, k: usize) -> Vec<usize> {
    let values = probs
        .clone()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 router probabilities");
    let mut chosen = Vec::with_capacity(values.len() / experts * k);
    let mut ids: Vec<usize> = Vec::with_capacity(experts);
    for row in values.chunks(experts) {
        ids.clear();
        ids.extend(0..experts);
        ids.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        chosen.extend_from_slice(&ids[..k]);
    }
    chosen
}

fn int_tensor<const D: usize>(
    values: &[usize],
    shape: [usize; D],
    device: &Device,
) -> Tensor<D, Int> {
    let values: Vec<i64> = values.iter().map(|&v| v as i64).collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// What the load-balancing loss needs of some router logits: per expert, how many rows chose
/// it among their top k (`counts`) and the sum of its router probabilities (`prob_sums`,
/// differentiable), over `rows` rows (every sparse layer's tokens, stacked).
#[derive(Debug, Clone)]
pub struct RouterStats {
    /// Rows whose top-k holds each expert.
    pub counts: Vec<f32>,
    /// Each expert's router probability summed over the rows, `[experts]`.
    pub prob_sums: Tensor<1>,
    /// Rows counted.
    pub rows: usize,
}

impl RouterStats {
    /// The stats of every sparse layer's router logits (each `[tokens, experts]`).
    pub fn new(router_logits: &[Tensor<2>], k: usize) -> Self {
        let logits = Tensor::cat(router_logits.to_vec(), 0).cast(FloatDType::F32);
        let [rows, experts] = logits.dims();
        let probs = softmax(logits, 1);
        let mut counts = vec![0f32; experts];
        for e in top_k(&probs.clone().into_data(), experts, k) {
            counts[e] += 1.0;
        }
        Self {
            counts,
            prob_sums: probs.sum_dim(0).reshape([experts]),
            rows,
        }
    }

    /// `experts * sum_e (counts_e / total_rows) * (prob_sums_e / total_rows)`: the loss over
    /// `total_rows` rows of which these are some, given every row's `counts` (for data
    /// parallelism: the sums over the ranks; differentiable through this rank's `prob_sums`).
    pub fn loss(&self, counts: &[f32], total_rows: usize) -> Tensor<1> {
        let n = total_rows as f32;
        let experts = counts.len();
        let fractions: Vec<f32> = counts.iter().map(|c| c / n).collect();
        let fractions = Tensor::<1>::from_data(
            TensorData::new(fractions, [experts]),
            &self.prob_sums.device(),
        );
        (self.prob_sums.clone() * fractions)
            .sum()
            .mul_scalar(experts as f64 / total_rows as f64)
    }
}

/// transformers' `load_balancing_loss_func` over the router logits of every sparse layer
/// (each `[tokens, experts]`): with the logits of all layers stacked as `T` rows,
/// `experts * sum_e (f_e * P_e)` where `f_e` is the fraction of the `T` rows whose top-k
/// holds expert `e` and `P_e` the mean router probability of `e`. Differentiable through `P`.
pub fn load_balancing_loss(router_logits: &[Tensor<2>], k: usize) -> Tensor<1> {
    let stats = RouterStats::new(router_logits, k);
    stats.loss(&stats.counts, stats.rows)
}
