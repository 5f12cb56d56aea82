//! Errors of the collective layer. Every variant names what went wrong in terms a user can act
//! on: the op, the group, the ranks involved and the sizes or dtypes that disagreed.

use std::time::Duration;

/// What a collective, a group or a launch can fail with.
///
/// `Clone` because one failure (a mismatch, a dead peer) is reported to every waiting rank.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CollectiveError {
    /// Bad arguments detected locally, before any rank was contacted.
    #[error("{op} on group {group}: {message}")]
    InvalidArgument {
        op: String,
        group: String,
        message: String,
    },

    /// Two ranks issued different calls in the same position of the group's call sequence.
    #[error(
        "collective mismatch in call #{seq} of group {group}: rank {rank_a} called {call_a} but rank {rank_b} called {call_b}"
    )]
    Mismatch {
        group: String,
        seq: u64,
        rank_a: usize,
        call_a: String,
        rank_b: usize,
        call_b: String,
    },

    /// Some ranks did not join within the timeout.
    #[error(
        "timed out after {waited:?} in {op} (call #{seq} of group {group}): ranks {missing:?} did not arrive"
    )]
    Timeout {
        op: String,
        group: String,
        seq: u64,
        waited: Duration,
        missing: Vec<usize>,
    },

    /// A rank this call needs has already finished its work without joining.
    #[error("{op} (call #{seq} of group {group}): ranks {ranks:?} exited without joining it")]
    RankExited {
        op: String,
        group: String,
        seq: u64,
        ranks: Vec<usize>,
    },

    /// Another rank failed (error or panic); this rank stops at its next collective.
    #[error("{op} on group {group} aborted: rank {rank} failed: {reason}")]
    PeerFailed {
        op: String,
        group: String,
        rank: usize,
        reason: String,
    },

    /// An earlier error left the group's call sequence out of step; it cannot be used again.
    #[error("group {group} is unusable after an earlier error: {reason}")]
    GroupBroken { group: String, reason: String },

    /// The op does not support this element type.
    #[error("{op} does not support dtype {dtype}")]
    UnsupportedDtype { op: String, dtype: String },

    /// A rank index outside the group.
    #[error("{op} on group {group}: rank {rank} is not in this group of {size} ranks")]
    NoSuchRank {
        op: String,
        group: String,
        rank: usize,
        size: usize,
    },
}

/// Errors building a device mesh or one of its groups.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MeshError {
    #[error("a device mesh needs at least one dimension")]
    Empty,
    #[error("mesh dimension {name:?} has size 0; every size must be at least 1")]
    ZeroSize { name: String },
    #[error("mesh dimension name {name:?} is used twice in {dims}")]
    DuplicateName { name: String, dims: String },
    #[error("mesh dimension names must be non-empty identifiers, got {name:?}")]
    BadName { name: String },
    #[error("mesh {dims} has {mesh_size} ranks but the world has {world_size}")]
    WorldSizeMismatch {
        dims: String,
        mesh_size: usize,
        world_size: usize,
    },
    #[error("mesh {dims} has no dimension {name:?}")]
    UnknownDim { name: String, dims: String },
    #[error("rank {rank} is outside mesh {dims} of {size} ranks")]
    RankOutOfRange {
        rank: usize,
        dims: String,
        size: usize,
    },
    #[error("cannot flatten {names:?} into {name:?}: {reason}")]
    BadFlatten {
        names: Vec<String>,
        name: String,
        reason: String,
    },
    #[error(transparent)]
    Collective(#[from] CollectiveError),
}

/// A launch in which one or more ranks failed. The first entry is the rank that failed first,
/// usually the root cause; the others typically report that they were aborted because of it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}", describe_failures(.failures))]
pub struct LaunchError {
    pub failures: Vec<RankFailure>,
}

/// One rank's failure inside a launch.
#[derive(Debug, Clone, PartialEq)]
pub struct RankFailure {
    pub rank: usize,
    pub message: String,
    pub panicked: bool,
}

fn describe_failures(failures: &[RankFailure]) -> String {
    let parts: Vec<String> = failures
        .iter()
        .map(|f| {
            let how = if f.panicked { "panicked" } else { "failed" };
            format!("rank {} {how}: {}", f.rank, f.message)
        })
        .collect();
    parts.join("; ")
}

impl LaunchError {
    /// The failure of the rank that failed first.
    pub fn first(&self) -> &RankFailure {
        &self.failures[0]
    }
}
