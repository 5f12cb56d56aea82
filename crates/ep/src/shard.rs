//! Which experts a rank holds.

use std::fmt;
use std::ops::Range;

use burn_parallel_comm::ProcessGroup;

use crate::error::EpError;

/// A MoE layer's experts split evenly over an ep group: group index `r` holds experts
/// `r * E/ep .. (r + 1) * E/ep`. Cheap to clone.
#[derive(Clone)]
pub struct ExpertShard {
    group: ProcessGroup,
    num_experts: usize,
}

impl fmt::Debug for ExpertShard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ExpertShard(experts {:?} of {} over {:?})",
            self.local_experts(),
            self.num_experts,
            self.group
        )
    }
}

impl ExpertShard {
    /// `num_experts` experts over `group`; an expert count the group size does not divide is
    /// an error naming both.
    pub fn new(group: ProcessGroup, num_experts: usize) -> Result<Self, EpError> {
        let ep = group.size();
        if num_experts == 0 || !num_experts.is_multiple_of(ep) {
            return Err(EpError::ExpertsNotDivisible {
                experts: num_experts,
                ep,
            });
        }
        Ok(Self { group, num_experts })
    }

    /// The ep group the experts are split over.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Experts in the layer, over all ranks.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// Experts on each rank.
    pub fn experts_per_rank(&self) -> usize {
        self.num_experts / self.group.size()
    }

    /// The global indices of this rank's experts.
    pub fn local_experts(&self) -> Range<usize> {
        let n = self.experts_per_rank();
        let start = self.group.index() * n;
        start..start + n
    }
}
