//! What a mixture-of-experts module offers expert parallelism.

use burn::module::Module;
use burn_parallel_comm::ProcessGroup;

use crate::error::EpError;
use crate::shard::ExpertShard;

/// A module holding a layer's experts, stacked on a leading expert dim. `#[parallelize]`
/// models mark such fields `#[experts]`; `parallelize_model` then splits them over the ep
/// group, and the training step reduces their gradients over the ranks that hold the same
/// experts only.
pub trait ExpertModule: Module {
    /// Keeps this rank's `experts / ep` experts of `ep_group` (expert `e` lives on group index
    /// `e / (experts / ep)`); its forward then exchanges tokens over the group. An expert
    /// count the group size does not divide is an error naming both.
    fn shard_experts(self, ep_group: &ProcessGroup) -> Result<Self, EpError>;

    /// The shard, once split.
    fn expert_shard(&self) -> Option<&ExpertShard>;

    /// Every expert back on every rank of the group, unsplit: the inverse of
    /// [`shard_experts`](Self::shard_experts) (collective over the group; a module that is not
    /// split is returned as it is). What `full_model` runs on each `#[experts]` module.
    fn gather_experts(self) -> Result<Self, EpError>;
}
