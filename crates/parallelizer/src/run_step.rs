//! [`Step`]: the one training step users call, for whole models and for pipeline stages:
//! configured (clipping, accumulated micro-batches), then run with an update.

use burn::tensor::Tensor;
use burn_parallel_describe::Parallelize;
use burn_parallel_pp::{PipelineStage, ScheduleKind};

use crate::config::Unsupported;
use crate::context::{LocalRows, MeshContext};
use crate::error::ParallelError;
use crate::pipeline::{PipelineBatch, PipelineReport, pipeline_step};
use crate::step::{Accumulated, StepReport, StepUpdate, whole_model_step};

/// One training step, configured and then run: the one entry point for whole models and for
/// pipeline stages, whatever the layout. Collective: every rank runs the same step.
///
/// ```ignore
/// let rows = ctx.local_rows(global_batch);
/// // ... forward of this rank's rows: `loss` is their mean ...
/// let (model, report) = Step::new(&ctx, &rows)
///     .clip(1.0)
///     .run(model, loss, OptimizerStep::new(&mut optimizer, lr))?;
/// ```
///
/// [`run`](Self::run) does backward of `loss`, then the tp gradient sync of replicated
/// sequence-parallel parameters, the data-parallel average (DDP's bucketed all-reduce; FSDP
/// reduces inside backward and the sum is divided here), clipping by the global norm when
/// [`clip`](Self::clip) set one, and the update on this rank's parameters (shards under FSDP).
/// `loss` is the mean over this rank's `rows` (from [`MeshContext::local_rows`]); it is
/// weighted by the rows' share of the global batch, so that the step trains on the mean over
/// the global batch however unevenly the rows split. [`run_pipeline`](Self::run_pipeline) is
/// the same for this rank's stages of a pipeline-parallel model.
#[must_use = "a step does nothing until it is run"]
pub struct Step<'a> {
    ctx: &'a MeshContext,
    rows: &'a LocalRows,
    max_grad_norm: Option<f32>,
    accumulated: Accumulated,
}

impl<'a> Step<'a> {
    /// A step of `ctx`'s model on this rank's `rows` of the global batch: no clipping, no
    /// earlier micro-batches.
    pub fn new(ctx: &'a MeshContext, rows: &'a LocalRows) -> Self {
        Self {
            ctx,
            rows,
            max_grad_norm: None,
            accumulated: Accumulated::default(),
        }
    }

    /// Clips the gradients to a global L2 norm of at most `max_norm` (every element counted
    /// once, whatever holds it).
    pub fn clip(self, max_norm: f32) -> Self {
        self.max_grad_norm(Some(max_norm))
    }

    /// [`clip`](Self::clip) when `Some`, no clipping when `None` (a setting passed through).
    pub fn max_grad_norm(mut self, max_norm: Option<f32>) -> Self {
        self.max_grad_norm = max_norm;
        self
    }

    /// Adds the gradients and loss of the step's earlier micro-batches (gradient
    /// accumulation; see [`Accumulated`]) to the last one's before the sync. Whole models
    /// only: a pipeline step splits its rows into microbatches itself.
    pub fn accumulated(mut self, accumulated: Accumulated) -> Self {
        self.accumulated = accumulated;
        self
    }

    /// Runs the step on a whole model (every layout but pipeline parallelism). `update`
    /// receives the model, its synced, averaged and clipped gradients and the step's report
    /// (the data-parallel loss and the global gradient norm, the same on every rank), and
    /// returns the updated model: [`OptimizerStep`] for a Burn optimizer, or a closure
    /// `|model, grads, report| ...` for any other (returning the model unchanged withholds the
    /// update on every rank alike). The reported loss is the data-parallel average over the
    /// global batch (and the earlier micro-batches).
    pub fn run<M: Parallelize>(
        self,
        model: M,
        loss: Tensor<1>,
        update: impl StepUpdate<M>,
    ) -> Result<(M, StepReport), ParallelError> {
        whole_model_step(
            model,
            loss,
            self.accumulated,
            self.rows,
            self.max_grad_norm,
            self.ctx,
            update,
        )
    }

    /// Runs the step on this rank's stages of a pipeline-parallel model (docs/pipeline.md):
    /// `chunks` are its stages, `microbatches[m]` holds `microbatch_rows[m]` of this rank's
    /// rows, and `schedule` orders their forwards and backwards. Refused with
    /// [`accumulated`](Self::accumulated) micro-batches.
    pub fn run_pipeline<const D: usize, S: PipelineStage<D> + Parallelize>(
        self,
        chunks: Vec<S>,
        microbatches: &[S::Microbatch],
        microbatch_rows: &[usize],
        schedule: ScheduleKind,
        update: impl StepUpdate<Vec<S>>,
    ) -> Result<(Vec<S>, PipelineReport), ParallelError> {
        if self.accumulated.has_grads() {
            return Err(ParallelError::NotSupported(Unsupported::PipelineParallel {
                pp: self.ctx.sizes().pp,
                with: "accumulated micro-batches: a pipeline step splits its rows into \
                       microbatches itself"
                    .into(),
            }));
        }
        let batch = PipelineBatch {
            microbatches,
            microbatch_rows,
            rows: self.rows,
            schedule,
        };
        pipeline_step(chunks, batch, self.max_grad_norm, self.ctx, update)
    }
}
