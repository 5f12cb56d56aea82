//! The router's load-balancing loss of a MoE model over the global batch, as one device
//! computes it on the whole batch: the experts' top-k counts are summed over the
//! data-parallel ranks, and each rank's share of the loss is differentiable through its own
//! router probabilities.

use burn::tensor::{Tensor, TensorData};
use burn_parallel_comm::ReduceOp;
use burn_parallel_models::{Llama, RouterStats};
use burn_parallel_parallelizer::{LocalRows, MeshContext};

use crate::error::TrainError;

/// This rank's term of the weighted load-balancing loss (`router_aux_loss_coef` times it),
/// and the unweighted loss over the global batch, when the model adds it
/// (`output_router_logits`). `train_step` weights a rank's loss by its rows' share and
/// averages over the data-parallel ranks; the term is scaled so that the average is the
/// global loss.
pub fn aux_loss(
    model: &Llama,
    router_logits: &[Tensor<2>],
    rows: &LocalRows,
    mesh: &MeshContext,
) -> Result<Option<(Tensor<1>, f32)>, TrainError> {
    let Some(moe) = model.config.moe.as_ref().filter(|m| m.output_router_logits) else {
        return Ok(None);
    };
    if router_logits.is_empty() {
        return Ok(None);
    }
    let stats = RouterStats::new(router_logits, moe.num_experts_per_tok);
    let experts = stats.counts.len();
    // One exchange: the counts, the rows and the (detached) probability sums of every rank.
    let probs: Vec<f32> = stats
        .prob_sums
        .clone()
        .into_data()
        .convert::<f32>()
        .try_to_vec()
        .map_err(|e| TrainError::Config(format!("router probabilities: {e:?}")))?;
    let mut local: Vec<f64> = stats.counts.iter().map(|&c| c as f64).collect();
    local.push(stats.rows as f64);
    local.extend(probs.iter().map(|&p| p as f64));
    let n = local.len();
    let total = mesh
        .dp_group()
        .all_reduce(TensorData::new(local, [n]), ReduceOp::Sum)?
        .try_to_vec::<f64>()
        .map_err(|e| TrainError::Config(format!("summed router stats: {e:?}")))?;
    let counts: Vec<f32> = total[..experts].iter().map(|&c| c as f32).collect();
    let total_rows = total[experts] as usize;
    let prob_sums = &total[experts + 1..];
    let global = experts as f64
        * counts
            .iter()
            .zip(prob_sums)
            .map(|(&c, &p)| c as f64 / total_rows as f64 * p / total_rows as f64)
            .sum::<f64>();
    // Undo train_step's weighting (rows' share) and averaging (1 / dp) for this term.
    let scale = mesh.dp_size() as f64 / rows.loss_weight();
    let term = stats
        .loss(&counts, total_rows)
        .mul_scalar(scale * moe.router_aux_loss_coef);
    Ok(Some((term, global as f32)))
}
