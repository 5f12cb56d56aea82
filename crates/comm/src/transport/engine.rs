//! What an engine (threads, MPI, NCCL) provides to a rank, and the rank's view of it.

use std::fmt;
use std::sync::Arc;

use crate::transport::collective::{Communicator, GroupInfo};
use crate::transport::error::CollectiveError;
use crate::transport::group::ProcessGroup;
use crate::transport::stats::CommStats;

/// One rank's connection to an engine.
pub trait Engine: Send + Sync + fmt::Debug {
    /// A short name such as `threads`.
    fn name(&self) -> &'static str;
    /// This rank's global rank.
    fn rank(&self) -> usize;
    /// Number of ranks in the world.
    fn world_size(&self) -> usize;
    /// A communicator over `ranks` (global ranks, in group order), which must include this
    /// rank. Every member asks for the same group with the same label and rank list.
    fn new_group(
        &self,
        label: &str,
        ranks: &[usize],
    ) -> Result<Arc<dyn Communicator>, CollectiveError>;
    /// This rank's counters over all its groups.
    fn stats(&self) -> CommStats;
}

/// Everything a rank needs to talk to the others: its rank, the world size, and groups.
#[derive(Clone, Debug)]
pub struct RankContext {
    engine: Arc<dyn Engine>,
}

impl RankContext {
    /// A context on one rank's connection to `engine`.
    pub fn new(engine: Arc<dyn Engine>) -> Self {
        Self { engine }
    }

    /// This rank's global rank.
    pub fn rank(&self) -> usize {
        self.engine.rank()
    }

    /// Number of ranks in the world.
    pub fn world_size(&self) -> usize {
        self.engine.world_size()
    }

    /// The engine's short name, such as `threads`.
    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }

    /// The group of every rank.
    pub fn world(&self) -> Result<ProcessGroup, CollectiveError> {
        let ranks: Vec<usize> = (0..self.world_size()).collect();
        self.group("world", &ranks)
    }

    /// A group over `ranks` (global ranks, in group order) named `label` in messages.
    pub fn group(&self, label: &str, ranks: &[usize]) -> Result<ProcessGroup, CollectiveError> {
        let op = "new_group";
        let fail = |message: String| CollectiveError::InvalidArgument {
            op: op.into(),
            group: format!("{label}{ranks:?}"),
            message,
        };
        if ranks.is_empty() {
            return Err(fail("a group needs at least one rank".into()));
        }
        if let Some(r) = ranks.iter().find(|r| **r >= self.world_size()) {
            return Err(fail(format!(
                "rank {r} does not exist in a world of {} ranks",
                self.world_size()
            )));
        }
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(fail("a rank is listed twice".into()));
        }
        if !ranks.contains(&self.rank()) {
            return Err(fail(format!("rank {} is not a member", self.rank())));
        }
        let comm = self.engine.new_group(label, ranks)?;
        Ok(ProcessGroup::new(comm))
    }

    /// This rank's communication counters over all groups.
    pub fn stats(&self) -> CommStats {
        self.engine.stats()
    }
}

/// Group identity as engines see it.
pub(crate) fn group_info(label: &str, ranks: &[usize], rank: usize) -> GroupInfo {
    GroupInfo {
        label: format!("{label}{ranks:?}"),
        ranks: ranks.to_vec(),
        index: ranks
            .iter()
            .position(|r| *r == rank)
            .expect("membership checked by RankContext::group"),
    }
}
