//! The optimizer side of a checkpoint: what an optimizer exposes so that its state is saved
//! with each parameter's shard and restored into any other layout.

use burn::module::ParamId;
use burn::tensor::Tensor;

/// An optimizer whose state a checkpoint saves and restores. State comes in two parts:
/// scalars (step count, ...) saved once as JSON, and per-parameter tensors shaped like the
/// parameter's stored shard (AdamW's two moments), saved region by region beside it. An
/// elementwise optimizer's state of a shard is the slice of its full state, which is what
/// lets a checkpoint reshard it.
///
/// Implemented by the trainer's SGD and AdamW; implement it for your own optimizer in the
/// same way.
pub trait OptimizerState {
    /// The optimizer's name, saved and checked on load (`"adamw"`).
    fn kind(&self) -> &str;

    /// Names of the per-parameter state tensors (`["exp_avg", "exp_avg_sq"]`), in the order
    /// [`param_state`](Self::param_state) returns them. Loading checks them against the
    /// checkpoint's, unless this is empty (an optimizer that learns its names from
    /// [`load_scalars`](Self::load_scalars)).
    fn state_names(&self) -> Vec<String>;

    /// Everything that is not per-parameter (step count, hyperparameters), as JSON.
    fn scalars(&self) -> serde_json::Value;

    /// Restores [`scalars`](Self::scalars); an error message says what does not fit.
    fn load_scalars(&mut self, scalars: &serde_json::Value) -> Result<(), String>;

    /// This rank's state tensors of parameter `id`, one per state name, each flattened with as
    /// many elements as the parameter's stored shard; `None` when it has none (yet).
    fn param_state(&self, id: ParamId) -> Option<Vec<Tensor<1>>>;

    /// Restores the state of parameter `id` (flattened, on the parameter's device without
    /// autodiff), one tensor per state name.
    fn load_param_state(&mut self, id: ParamId, state: Vec<Tensor<1>>);

    /// Called once every parameter's state was handed over. Default: nothing to do.
    fn finish_load(&mut self) -> Result<(), String> {
        Ok(())
    }
}
