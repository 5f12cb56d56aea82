//! What can go wrong in expert parallelism.

use burn_parallel_comm::CollectiveError;

/// An expert-parallel error: a mesh that does not fit the experts, a bad routing, or a failed
/// exchange.
#[derive(Debug, thiserror::Error)]
pub enum EpError {
    /// The expert count does not split evenly over the ep group.
    #[error(
        "{experts} experts cannot be split evenly over ep = {ep} ranks: choose an ep size that divides the expert count"
    )]
    ExpertsNotDivisible {
        /// Experts in the layer.
        experts: usize,
        /// Ranks in the ep group.
        ep: usize,
    },
    /// A routed slot names an expert the layer does not have.
    #[error("token slot {slot} is routed to expert {expert}, but the layer has {experts} experts")]
    NoSuchExpert {
        /// The slot's index.
        slot: usize,
        /// The expert it names.
        expert: usize,
        /// Experts in the layer.
        experts: usize,
    },
    /// The per-expert counts do not describe the rows given.
    #[error("{what}")]
    BadCounts {
        /// What does not add up.
        what: String,
    },
    /// An expert returned another shape than its input's `[rows, width]`.
    #[error(
        "expert {expert} maps {input:?} (rows, columns) to {output:?}; an expert must keep the rows and the width"
    )]
    ExpertShape {
        /// The global expert index.
        expert: usize,
        /// Its input's `[rows, columns]`.
        input: [usize; 2],
        /// Its output's `[rows, columns]`.
        output: [usize; 2],
    },
    /// Experts cannot be split as asked: already split otherwise, or a split of another
    /// expert count.
    #[error("cannot split the experts: {0}")]
    Split(String),
    /// The experts' parameters could not be gathered (under FSDP).
    #[error("gathering the experts' parameters failed: {0}")]
    Gather(String),
    /// The token or count exchange failed (on this rank or another).
    #[error("expert-parallel exchange failed: {0}")]
    Collective(#[from] CollectiveError),
}
