//! The training step users call instead of hand-wiring backward, gradient synchronisation,
//! global-norm clipping and the optimizer step for whichever strategy the context runs.

use std::collections::HashSet;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{DType, Gradients, Tensor, TensorData};
use burn_parallel_comm::ReduceOp;
use burn_parallel_describe::{ModelDescription, Parallelize};
use burn_parallel_fsdp::{clip_to_norm, grad_square_sums, scale_grads};
use burn_parallel_tp::TpModule;

use crate::config::{DataParallel, Unsupported};
use crate::context::{LocalRows, MeshContext};
use crate::ddp;
use crate::error::ParallelError;

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct StepReport {
    /// The loss over the global batch: the data-parallel average of every rank's mean loss
    /// over its rows, weighted by its share of the batch (see [`Step`](crate::Step)).
    pub loss: f32,
    /// The global L2 norm of the gradients before clipping, every element counted once.
    pub grad_norm: f32,
}

/// How a [`Step`](crate::Step) updates the model once its gradients are synced: a Burn optimizer
/// ([`OptimizerStep`]) or any closure `FnOnce(model, grads, &StepReport) -> model`.
pub trait StepUpdate<M> {
    /// The updated model.
    fn update(self, model: M, grads: Gradients, report: &StepReport) -> M;
}

impl<M, F: FnOnce(M, Gradients, &StepReport) -> M> StepUpdate<M> for F {
    fn update(self, model: M, grads: Gradients, report: &StepReport) -> M {
        self(model, grads, report)
    }
}

/// A Burn optimizer (AdamW, SGD, ...: Burn's `ModuleOptimizer`) stepping at a learning rate:
/// the usual [`StepUpdate`].
pub struct OptimizerStep<'a> {
    optimizer: &'a mut ModuleOptimizer,
    lr: f64,
}

impl<'a> OptimizerStep<'a> {
    /// `optimizer` stepping at `lr`.
    pub fn new(optimizer: &'a mut ModuleOptimizer, lr: f64) -> Self {
        Self { optimizer, lr }
    }
}

impl<M: Module> StepUpdate<M> for OptimizerStep<'_> {
    fn update(self, model: M, grads: Gradients, _report: &StepReport) -> M {
        let grads = GradientsParams::from_grads(grads, &model);
        self.optimizer.step(self.lr, model, grads)
    }
}

/// The step of a whole model ([`Step::run`](crate::Step::run)): backward of `loss` (weighted
/// by the rows' share), the earlier micro-batches' gradients added, the gradient sync, the
/// data-parallel loss, then `update`.
pub(crate) fn whole_model_step<M: Parallelize>(
    model: M,
    loss: Tensor<1>,
    accumulated: Accumulated,
    rows: &LocalRows,
    max_grad_norm: Option<f32>,
    ctx: &MeshContext,
    update: impl StepUpdate<M>,
) -> Result<(M, StepReport), ParallelError> {
    // Before backward, so that no rank communicates.
    refuse_pipeline(ctx)?;
    let loss = loss.mul_scalar(rows.loss_weight());
    let local_loss = scalar(loss.clone().detach().into_data()) + accumulated.loss as f32;
    let mut grads = loss.backward();
    if let Some(from) = accumulated.grads {
        model.visit(&mut AddGrads {
            into: &mut grads,
            from,
        });
    }
    let grad_norm = sync_gradients(&model, &mut grads, max_grad_norm, ctx)?;
    let loss = scalar(
        ctx.dp_cp_group()
            .all_reduce(TensorData::new(vec![local_loss], [1]), ReduceOp::Avg)?,
    );
    let report = StepReport { loss, grad_norm };
    let model = update.update(model, grads, &report);
    Ok((model, report))
}

/// The gradients and loss of a step's earlier micro-batches (gradient accumulation), which
/// [`Step::accumulated`](crate::Step::accumulated) adds to its last micro-batch's before the gradient sync.
///
/// Each micro-batch's `loss` handed to [`backward`](Self::backward) is already weighted: its
/// share of the step's global loss times the data-parallel size (the step averages over dp),
/// so that the sum over micro-batches and ranks is the loss of the whole accumulated batch.
/// Run the earlier micro-batches with `ctx.set_requires_gradient_sync(false)` (FSDP then keeps
/// a local unsharded sum and reduces it once in the last backward) and the last with `true`.
#[derive(Default)]
pub struct Accumulated {
    grads: Option<Gradients>,
    loss: f64,
}

impl Accumulated {
    /// Backward of one earlier micro-batch's weighted `loss`; its gradients (of this rank's
    /// parameters, shards under FSDP) are added to the sum kept so far.
    pub fn backward<M: Module>(&mut self, model: &M, loss: Tensor<1>) {
        self.loss += scalar(loss.clone().detach().into_data()) as f64;
        let grads = loss.backward();
        match self.grads.as_mut() {
            None => self.grads = Some(grads),
            Some(sum) => model.visit(&mut AddGrads {
                into: sum,
                from: grads,
            }),
        }
    }

    /// Whether any earlier micro-batch ran its backward.
    pub(crate) fn has_grads(&self) -> bool {
        self.grads.is_some()
    }

    /// The weighted loss of the micro-batches so far (this rank's, summed).
    pub fn loss(&self) -> f64 {
        self.loss
    }
}

/// Adds every parameter's gradient in `from` to its gradient in `into`.
struct AddGrads<'a> {
    into: &'a mut Gradients,
    from: Gradients,
}

impl ModuleVisitor for AddGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let shard = param.val();
        if let Some(g) = shard.grad_remove(&mut self.from) {
            let sum = match shard.grad_remove(self.into) {
                Some(acc) => acc + g,
                None => g,
            };
            shard.grad_replace(self.into, sum);
        }
    }
}

/// The gradient sync of one optimizer step, on the gradients of this rank's parameters (shards
/// under FSDP, already reduced over the shard group by backward): the tp sync of replicated
/// sequence-parallel parameters, the average over the data-parallel (and cp) ranks, DDP's
/// all-reduce, and clipping by the global norm when `max_grad_norm` is set. Returns the global
/// norm before clipping. What every step runs after its backward, whoever ran it (the
/// trainer's [`Step`](crate::Step), burn-train's Learner). Collective: every rank calls it.
///
/// Under pipeline parallelism a model is one stage of the whole: its step is
/// [`Step::run_pipeline`](crate::Step::run_pipeline), and this refuses.
pub fn sync_gradients<M: Parallelize>(
    model: &M,
    grads: &mut Gradients,
    max_grad_norm: Option<f32>,
    ctx: &MeshContext,
) -> Result<f32, ParallelError> {
    refuse_pipeline(ctx)?;
    sync_stage_gradients(model, grads, max_grad_norm, ctx)
}

/// A step for a whole model ([`Step::run`](crate::Step::run), the Learner's) under pipeline parallelism would
/// train every stage's ranks on a full replica: refused, naming the pipeline step.
fn refuse_pipeline(ctx: &MeshContext) -> Result<(), ParallelError> {
    match ctx.sizes().pp {
        1 => Ok(()),
        pp => Err(ParallelError::NotSupported(Unsupported::PipelineParallel {
            pp,
            with: "a whole-model training step: each rank holds one stage, trained with \
                   Step::run_pipeline"
                .into(),
        })),
    }
}

/// [`sync_gradients`] of one pipeline stage (any pp): the global norm sums over the stages.
pub(crate) fn sync_stage_gradients<M: Parallelize>(
    model: &M,
    grads: &mut Gradients,
    max_grad_norm: Option<f32>,
    ctx: &MeshContext,
) -> Result<f32, ParallelError> {
    model.sync_tp_grads(grads)?;
    // FSDP's reduce-scatter (and HSDP's replica all-reduce) sum over the data-parallel ranks
    // (and the cp ranks, each holding a part of every sequence); every strategy here averages,
    // as DDP and PyTorch's FSDP2 do.
    if !ctx.uses_ddp() && ctx.dp_cp_size() > 1 {
        scale_grads(model, grads, 1.0 / ctx.dp_cp_size() as f32);
    }
    let experts = expert_params(model, ctx);
    if let DataParallel::Replicate {
        bucket_bytes: bucket,
    } = ctx.plan().data_parallel()
    {
        match experts.is_empty() {
            true => ddp::all_reduce_gradients(model, grads, ctx.dp_group(), bucket)?,
            false => ddp::all_reduce_gradients_with_experts(model, grads, &experts, ctx, bucket)?,
        }
    }
    let mut grad_norm = grad_norm_with_experts(model, grads, &experts, ctx)?;
    if let Some(pp) = ctx.pp_group() {
        // Each pipeline stage holds different parameters: the squares add over the stages.
        let square = f64::from(grad_norm).powi(2);
        let summed = pp.all_reduce(TensorData::new(vec![square], [1]), ReduceOp::Sum)?;
        grad_norm = summed.try_into_vec::<f64>().expect("an f64 sum")[0].sqrt() as f32;
    }
    if let Some(max) = max_grad_norm {
        clip_to_norm(model, grads, grad_norm, max);
    }
    Ok(grad_norm)
}

pub(crate) fn scalar(data: TensorData) -> f32 {
    data.convert_dtype(DType::F32)
        .try_into_vec::<f32>()
        .expect("an f32 scalar")[0]
}

/// The parameters split over the ep group under expert parallelism (none without it).
fn expert_params<M: Parallelize>(model: &M, ctx: &MeshContext) -> HashSet<ParamId> {
    if ctx.expert_groups().is_none() {
        return HashSet::new();
    }
    let mut description = ModelDescription::default();
    model.describe("", &mut description);
    ddp::expert_param_ids(model, &description)
}

/// [`global_grad_norm`], counting split experts once: under FSDP their shards are disjoint
/// over dp_shard like every other shard; under DDP the dense gradients are replicated and the
/// experts' differ over the ep group, so only theirs are summed over it.
fn grad_norm_with_experts<M: Module + TpModule>(
    model: &M,
    grads: &Gradients,
    experts: &HashSet<ParamId>,
    ctx: &MeshContext,
) -> Result<f32, ParallelError> {
    let groups = match ctx.expert_groups() {
        Some(groups) if ctx.uses_ddp() && !experts.is_empty() => groups,
        _ => return global_grad_norm(model, grads, ctx),
    };
    let sums = grad_square_sums(model, grads, |id| experts.contains(&id));
    let summed = groups
        .ep
        .all_reduce(TensorData::new(vec![sums.marked], [1]), ReduceOp::Sum)?;
    let expert_sum = summed.try_into_vec::<f64>().expect("an f64 sum")[0];
    Ok((sums.other + expert_sum).sqrt() as f32)
}

/// The global gradient norm: FSDP shards hold disjoint elements (summed over the shard group),
/// HSDP and DDP replicas identical ones (counted once), tp-sharded parameters disjoint elements
/// (summed over tp) and tp-replicated ones identical elements (counted once). The squares are
/// summed on the gradients' device; only the sums cross to the host.
pub fn global_grad_norm<M: Module + TpModule>(
    model: &M,
    grads: &Gradients,
    ctx: &MeshContext,
) -> Result<f32, ParallelError> {
    let mut tp_sharded = CollectIds(HashSet::new());
    model.visit_tp_sharded(&mut tp_sharded);
    let sums = grad_square_sums(model, grads, |id| tp_sharded.0.contains(&id));
    let tp = ctx.sizes().tp as f64;
    let mut total = sums.marked + sums.other / tp;
    let mut reduce_over = Vec::new();
    if !ctx.uses_ddp() {
        reduce_over.push(ctx.dp_shard_group());
    }
    if ctx.sizes().tp > 1 {
        reduce_over.push(ctx.tp_group());
    }
    for group in reduce_over {
        if group.size() > 1 {
            let summed = group.all_reduce(TensorData::new(vec![total], [1]), ReduceOp::Sum)?;
            total = summed.try_into_vec::<f64>().expect("an f64 sum")[0];
        }
    }
    Ok(total.sqrt() as f32)
}

struct CollectIds(HashSet<ParamId>);

impl ModuleVisitor for CollectIds {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.0.insert(param.id);
    }
}
