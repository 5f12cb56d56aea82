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
        /// The op called.
        op: String,
        /// The group's label.
        group: String,
        /// What is wrong with the arguments.
        message: String,
    },

    /// Two ranks issued different calls in the same position of the group's call sequence.
    #[error(
        "collective mismatch in call #{seq} of group {group}: rank {rank_a} called {call_a} but rank {rank_b} called {call_b}"
    )]
    Mismatch {
        /// The group's label.
        group: String,
        /// The call's number in the group's call sequence.
        seq: u64,
        /// Global rank of one of the two ranks.
        rank_a: usize,
        /// The call `rank_a` issued.
        call_a: String,
        /// Global rank of the other.
        rank_b: usize,
        /// The call `rank_b` issued.
        call_b: String,
    },

    /// Some ranks did not join within the timeout.
    #[error(
        "timed out after {waited:?} in {op} (call #{seq} of group {group}): ranks {missing:?} did not arrive"
    )]
    Timeout {
        /// The op called.
        op: String,
        /// The group's label.
        group: String,
        /// The call's number in the group's call sequence.
        seq: u64,
        /// How long this rank waited.
        waited: Duration,
        /// Global ranks that had not issued the call.
        missing: Vec<usize>,
    },

    /// Every rank in a set waits for another rank of the set, in calls of different groups, so
    /// none can ever proceed: the ranks issued their collectives in different orders. Names
    /// every rank of the set with the call it waits in (threads engine).
    #[error(
        "collective order diverged: {}. Every rank must issue its collectives in the same order on every group: the order must not depend on the rank or on the data (routing, token counts, padding); compare each rank's calls above with its code path",
        list(.waits)
    )]
    Diverged {
        /// The call each rank of the set is blocked in, by rank.
        waits: Vec<PendingCall>,
    },

    /// A call did not complete within the timeout, on an engine that cannot see which ranks
    /// are missing (MPI): names the call and every call this rank had pending at that moment.
    #[error("timed out after {waited:?}: {call}; calls pending on this rank: {}", list(.pending))]
    Stalled {
        /// The call that timed out (boxed: it would make every `Result` of this error large).
        call: Box<PendingCall>,
        /// How long this rank waited.
        waited: Duration,
        /// Every call this rank had issued and not seen complete, on any group, the timed-out
        /// one included.
        pending: Vec<PendingCall>,
    },

    /// A rank this call needs has already finished its work without joining.
    #[error("{op} (call #{seq} of group {group}): ranks {ranks:?} exited without joining it")]
    RankExited {
        /// The op called.
        op: String,
        /// The group's label.
        group: String,
        /// The call's number in the group's call sequence.
        seq: u64,
        /// Global ranks that exited.
        ranks: Vec<usize>,
    },

    /// Another rank failed (error or panic); this rank stops at its next collective.
    #[error("{op} on group {group} aborted: rank {rank} failed: {reason}")]
    PeerFailed {
        /// The op called.
        op: String,
        /// The group's label.
        group: String,
        /// Global rank of the rank that failed.
        rank: usize,
        /// Its error or panic message.
        reason: String,
    },

    /// An earlier error left the group's call sequence out of step; it cannot be used again.
    #[error("group {group} is unusable after an earlier error: {reason}")]
    GroupBroken {
        /// The group's label.
        group: String,
        /// What broke it.
        reason: String,
    },

    /// The op does not support this element type.
    #[error("{op} does not support dtype {dtype}")]
    UnsupportedDtype {
        /// The op called.
        op: String,
        /// The rejected element type.
        dtype: String,
    },

    /// A rank index outside the group.
    #[error("{op} on group {group}: rank {rank} is not in this group of {size} ranks")]
    NoSuchRank {
        /// The op called.
        op: String,
        /// The group's label.
        group: String,
        /// The position given.
        rank: usize,
        /// Number of ranks in the group.
        size: usize,
    },
}

/// A call a rank has issued and not seen complete: what a divergence or a timeout reports for
/// each rank involved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingCall {
    /// Global rank of the caller.
    pub rank: usize,
    /// The op called.
    pub op: String,
    /// The group's label, which names its ranks, e.g. `tp[0, 1]`.
    pub group: String,
    /// The group's global ranks, in group order.
    pub ranks: Vec<usize>,
    /// The call's number in the group's collective sequence; `None` for point-to-point calls,
    /// which are not numbered.
    pub seq: Option<u64>,
    /// Global ranks the call still waits for; `None` when the engine cannot tell (MPI).
    pub missing: Option<Vec<usize>>,
}

impl PendingCall {
    /// Where the call stands, e.g. `call #3 of group tp[0, 1]` (labels name their ranks).
    pub fn position(&self) -> String {
        match self.seq {
            Some(seq) => format!("call #{seq} of group {}", self.group),
            None => format!("group {}", self.group),
        }
    }
}

impl std::fmt::Display for PendingCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} waits in {} ({})",
            self.rank,
            self.op,
            self.position()
        )?;
        match &self.missing {
            Some(missing) => write!(f, " for ranks {missing:?}"),
            None => Ok(()),
        }
    }
}

/// `calls` as one line, `; ` between them.
fn list(calls: &[PendingCall]) -> String {
    let parts: Vec<String> = calls.iter().map(ToString::to_string).collect();
    parts.join("; ")
}

/// Errors building a device mesh or one of its groups.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MeshError {
    /// The mesh shape was given no dimensions.
    #[error("a device mesh needs at least one dimension")]
    Empty,
    /// A dimension has size 0.
    #[error("mesh dimension {name:?} has size 0; every size must be at least 1")]
    ZeroSize {
        /// The dimension.
        name: String,
    },
    /// Two dimensions have the same name.
    #[error("mesh dimension name {name:?} is used twice in {dims}")]
    DuplicateName {
        /// The repeated name.
        name: String,
        /// The mesh's dimensions, as printed.
        dims: String,
    },
    /// A dimension name is empty or holds a character other than ASCII letters, digits and `_`.
    #[error("mesh dimension names must be non-empty identifiers, got {name:?}")]
    BadName {
        /// The name given.
        name: String,
    },
    /// The mesh's rank count differs from the world size.
    #[error("mesh {dims} has {mesh_size} ranks but the world has {world_size}")]
    WorldSizeMismatch {
        /// The mesh's dimensions, as printed.
        dims: String,
        /// Ranks in the mesh.
        mesh_size: usize,
        /// Ranks in the world.
        world_size: usize,
    },
    /// A dimension name that the mesh (with its flattened dimensions) does not have.
    #[error("mesh {dims} has no dimension {name:?}")]
    UnknownDim {
        /// The name asked for.
        name: String,
        /// The mesh's dimensions, as printed.
        dims: String,
    },
    /// A rank at or past the mesh's size.
    #[error("rank {rank} is outside mesh {dims} of {size} ranks")]
    RankOutOfRange {
        /// The rank given.
        rank: usize,
        /// The mesh's dimensions, as printed.
        dims: String,
        /// Ranks in the mesh.
        size: usize,
    },
    /// A flatten that cannot be done: nothing to flatten, a name already in use or a dimension
    /// listed twice (also used when NCCL cannot split a group, see the NCCL engine's split).
    #[error("cannot flatten {names:?} into {name:?}: {reason}")]
    BadFlatten {
        /// The dimensions to flatten.
        names: Vec<String>,
        /// The new dimension's name.
        name: String,
        /// Why not.
        reason: String,
    },
    /// Making a dimension's process group failed.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
}

/// A launch in which one or more ranks failed. The first entry is the rank that failed first,
/// usually the root cause; the others typically report that they were aborted because of it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}", describe_failures(.failures))]
pub struct LaunchError {
    /// Every rank's failure, the first one first.
    pub failures: Vec<RankFailure>,
}

/// One rank's failure inside a launch.
#[derive(Debug, Clone, PartialEq)]
pub struct RankFailure {
    /// The rank that failed.
    pub rank: usize,
    /// Its error or panic message.
    pub message: String,
    /// Whether it panicked (rather than returning an error).
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
