//! What a model's pipeline stage implements: its place in the pipeline, the shapes it sends and
//! receives, and its forward on one microbatch.

use burn::tensor::Tensor;

use crate::error::PipelineError;

/// What a stage's forward produces: the activation for the next stage, or (on the last stage)
/// the microbatch's loss.
pub enum StageOutput<const D: usize> {
    /// The activation sent to the next stage.
    Activation(Tensor<D>),
    /// The last stage's loss on the microbatch: the mean over the microbatch's rows (the
    /// schedule weights it by the microbatch's share of the global batch).
    Loss(Tensor<1>),
}

/// One stage of a model split over pipeline ranks. Activations between stages are `Tensor<D>`
/// (`[batch, seq, hidden]` for a transformer, `D = 3`).
///
/// Every rank of the pipeline is given the same microbatches (a stage reads what it needs:
/// the first the inputs, the last the targets, the others only their sizes), so that both
/// ends of a link can declare the shapes they exchange before anything moves.
pub trait PipelineStage<const D: usize> {
    /// One microbatch's data.
    type Microbatch;

    /// This stage's index and the number of stages it was built for (checked against the
    /// pipeline group before any communication).
    fn position(&self) -> (usize, usize);

    /// The activation this stage receives for `microbatch` (`None` on the first stage).
    fn input_shape(&self, microbatch: &Self::Microbatch) -> Option<[usize; D]>;

    /// The activation this stage sends for `microbatch` (`None` on the last stage).
    fn output_shape(&self, microbatch: &Self::Microbatch) -> Option<[usize; D]>;

    /// The forward of `microbatch`: `input` is the previous stage's activation (a leaf that
    /// requires its gradient; `None` on the first stage). The last stage returns the loss,
    /// every other stage its activation.
    fn forward(
        &self,
        microbatch: &Self::Microbatch,
        input: Option<Tensor<D>>,
    ) -> Result<StageOutput<D>, PipelineError>;
}
