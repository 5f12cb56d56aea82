//! What a MoE model's routers did in a step, over the global batch: the tokens each expert
//! received and the load-balancing loss as one device computes it on the whole batch. The
//! experts' top-k counts are summed over the data-parallel and cp ranks; each rank's share of the
//! loss is differentiable through its own router probabilities.

use burn::tensor::{Tensor, TensorData};
use burn_parallel_comm::ReduceOp;
use burn_parallel_models::{Llama, RouterStats};
use burn_parallel_parallelizer::{LocalRows, MeshContext};

use crate::error::TrainError;

/// A step's routing over the global batch.
pub struct RouterReport {
    /// This rank's term of the weighted load-balancing loss, to add to its loss, when the
    /// model adds it (`output_router_logits`). The `Step` weights a rank's loss by its rows'
    /// share and averages over the data-parallel ranks; the term is scaled so that the
    /// average is `router_aux_loss_coef` times the global loss.
    pub term: Option<Tensor<1>>,
    /// The unweighted load-balancing loss over the global batch (with `term`).
    pub aux_loss: Option<f32>,
    /// The fewest and most tokens any expert of any sparse layer received.
    pub expert_tokens: (u64, u64),
}

/// The routing report of this step's `router_logits` (every sparse layer's, in order);
/// `None` for a dense model. Collective over the data-parallel ranks and, under context
/// parallelism, the cp ranks (each routes its part of every sequence).
pub fn router_report(
    model: &Llama,
    router_logits: &[Tensor<2>],
    rows: &LocalRows,
    mesh: &MeshContext,
) -> Result<Option<RouterReport>, TrainError> {
    let Some(moe) = model.config.moe.as_ref() else {
        return Ok(None);
    };
    if router_logits.is_empty() {
        return Ok(None);
    }
    let k = moe.num_experts_per_tok;
    let layers: Vec<RouterStats> = router_logits
        .iter()
        .map(|l| RouterStats::new(std::slice::from_ref(l), k))
        .collect();
    let experts = moe.num_experts;
    let with_aux = moe.output_router_logits;
    let prob_sums = layers
        .iter()
        .map(|s| s.prob_sums.clone())
        .reduce(|a, b| a + b)
        .expect("a sparse layer");
    let local = local_stats(&layers, &prob_sums, with_aux)?;
    let n = local.len();
    let total = mesh
        .dp_cp_group()
        .all_reduce(TensorData::new(local, [n]), ReduceOp::Sum)?
        .try_to_vec::<f64>()
        .map_err(|e| TrainError::Config(format!("summed router stats: {e:?}")))?;
    let expert_tokens = expert_token_range(&total[..layers.len() * experts]);
    if !with_aux {
        return Ok(Some(RouterReport {
            term: None,
            aux_loss: None,
            expert_tokens,
        }));
    }
    // Undo the Step's weighting (rows' share) and averaging (1 / dp_cp) for this term.
    let scale = mesh.dp_cp_size() as f64 / rows.loss_weight();
    let (term, aux_loss) = load_balancing(
        &total,
        layers.len(),
        experts,
        prob_sums,
        scale * moe.router_aux_loss_coef,
    );
    Ok(Some(RouterReport {
        term: Some(term),
        aux_loss: Some(aux_loss),
        expert_tokens,
    }))
}

/// This rank's part of the step's one exchange: every layer's counts, the rows and (for the
/// loss, `with_aux`) the detached probability sums `prob_sums`.
fn local_stats(
    layers: &[RouterStats],
    prob_sums: &Tensor<1>,
    with_aux: bool,
) -> Result<Vec<f64>, TrainError> {
    let mut local: Vec<f64> = layers
        .iter()
        .flat_map(|s| s.counts.iter().map(|&c| c as f64))
        .collect();
    local.push(layers.iter().map(|s| s.rows).sum::<usize>() as f64);
    if with_aux {
        let probs: Vec<f32> = prob_sums
            .clone()
            .into_data()
            .convert::<f32>()
            .try_to_vec()
            .map_err(|e| TrainError::Config(format!("router probabilities: {e:?}")))?;
        local.extend(probs.iter().map(|&p| p as f64));
    }
    Ok(local)
}

/// The fewest and most tokens any expert of any layer received, of the summed counts
/// `per_layer`. A token's k slots each reach an expert: counts are slots.
fn expert_token_range(per_layer: &[f64]) -> (u64, u64) {
    let min = per_layer.iter().copied().fold(f64::INFINITY, f64::min) as u64;
    let max = per_layer.iter().copied().fold(0.0, f64::max) as u64;
    (min, max)
}

/// The load-balancing loss of the summed stats `total` (`layers x experts` counts, the rows,
/// the probability sums): this rank's term, differentiable through its own `prob_sums` and
/// scaled by `scale`, and the unweighted loss over the global batch.
fn load_balancing(
    total: &[f64],
    layers: usize,
    experts: usize,
    prob_sums: Tensor<1>,
    scale: f64,
) -> (Tensor<1>, f32) {
    let per_layer = &total[..layers * experts];
    // The load-balancing loss stacks every layer's rows: counts summed over layers.
    let counts: Vec<f32> = (0..experts)
        .map(|e| (0..layers).map(|l| per_layer[l * experts + e]).sum::<f64>() as f32)
        .collect();
    let total_rows = total[layers * experts] as usize;
    let global_probs = &total[layers * experts + 1..];
    let global = experts as f64
        * counts
            .iter()
            .zip(global_probs)
            .map(|(&c, &p)| c as f64 / total_rows as f64 * p / total_rows as f64)
            .sum::<f64>();
    let stacked = RouterStats {
        counts: counts.clone(),
        prob_sums,
        rows: total_rows,
    };
    (
        stacked.loss(&counts, total_rows).mul_scalar(scale),
        global as f32,
    )
}
