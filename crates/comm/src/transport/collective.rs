//! The engine-facing side of a collective: the request a rank issues, its description for
//! matching and error messages, and the `Communicator` trait every engine implements.

use std::fmt;
use std::sync::Arc;
use std::thread::JoinHandle;

use burn::tensor::{DType, TensorData};

use crate::transport::data::ReduceOp;
use crate::transport::error::CollectiveError;
use crate::transport::stats::CommStats;
pub use crate::transport::stats::OpKind;

/// One request to a communicator. Indices (`root`, `dst`, `src`) are positions in the group.
#[derive(Debug, Clone)]
pub enum Collective {
    /// Every rank gets the elementwise `op` reduction of every rank's tensor.
    AllReduce {
        /// This rank's tensor.
        data: TensorData,
        /// The reduction.
        op: ReduceOp,
    },
    /// Concatenation along `dim` of every rank's tensor; sizes along `dim` may differ.
    AllGather {
        /// This rank's piece.
        data: TensorData,
        /// The dimension to concatenate along.
        dim: usize,
    },
    /// Rank `i` receives the reduction of every rank's slice `i` along `dim`, where slice sizes
    /// are `sizes` (one per rank, summing to the dimension).
    ReduceScatter {
        /// This rank's whole tensor, cut into one slice per rank.
        data: TensorData,
        /// The dimension the slices are cut along.
        dim: usize,
        /// Each rank's slice length along `dim`.
        sizes: Vec<usize>,
        /// The reduction.
        op: ReduceOp,
    },
    /// `data` is required on the root; elsewhere it is optional and, when given, checked.
    Broadcast {
        /// The tensor to send (root), or one of the expected shape and dtype (others).
        data: Option<TensorData>,
        /// Position of the sending rank.
        root: usize,
    },
    /// Slice `j` (of `send_sizes[j]` along `split_dim`) goes to rank `j`; the received slices
    /// are concatenated along `concat_dim` in source-rank order.
    AllToAll {
        /// This rank's tensor, cut into one slice per rank.
        data: TensorData,
        /// The dimension the outgoing slices are cut along.
        split_dim: usize,
        /// The dimension the received slices are concatenated along.
        concat_dim: usize,
        /// Length along `split_dim` of the slice for each rank.
        send_sizes: Vec<usize>,
    },
    /// Sends `data` to the member at position `dst`.
    Send {
        /// The message.
        data: TensorData,
        /// Position of the receiver.
        dst: usize,
    },
    /// Receives the next message from the member at position `src`.
    Recv {
        /// Position of the sender.
        src: usize,
    },
    /// Completes once every member has issued it.
    Barrier,
}

impl Collective {
    /// The op's kind, for counters and messages.
    pub fn kind(&self) -> OpKind {
        match self {
            Collective::AllReduce { .. } => OpKind::AllReduce,
            Collective::AllGather { .. } => OpKind::AllGather,
            Collective::ReduceScatter { .. } => OpKind::ReduceScatter,
            Collective::Broadcast { .. } => OpKind::Broadcast,
            Collective::AllToAll { .. } => OpKind::AllToAll,
            Collective::Send { .. } => OpKind::Send,
            Collective::Recv { .. } => OpKind::Recv,
            Collective::Barrier => OpKind::Barrier,
        }
    }

    /// What must agree across ranks for this call to be matched with theirs.
    pub fn signature(&self) -> Signature {
        let meta = |d: &TensorData| (d.dtype(), d.shape().to_vec());
        let (dtype, shape) = match self {
            Collective::AllReduce { data, .. }
            | Collective::AllGather { data, .. }
            | Collective::ReduceScatter { data, .. }
            | Collective::AllToAll { data, .. }
            | Collective::Send { data, .. } => {
                let (d, s) = meta(data);
                (Some(d), Some(s))
            }
            Collective::Broadcast { data, .. } => match data {
                Some(d) => {
                    let (d, s) = meta(d);
                    (Some(d), Some(s))
                }
                None => (None, None),
            },
            Collective::Recv { .. } | Collective::Barrier => (None, None),
        };
        Signature {
            kind: self.kind(),
            dtype,
            shape,
            dim: match self {
                Collective::AllGather { dim, .. } | Collective::ReduceScatter { dim, .. } => {
                    Some(*dim)
                }
                _ => None,
            },
            reduce: match self {
                Collective::AllReduce { op, .. } | Collective::ReduceScatter { op, .. } => {
                    Some(*op)
                }
                _ => None,
            },
            sizes: match self {
                Collective::ReduceScatter { sizes, .. } => Some(sizes.clone()),
                _ => None,
            },
            root: match self {
                Collective::Broadcast { root, .. } => Some(*root),
                _ => None,
            },
            dims: match self {
                Collective::AllToAll {
                    split_dim,
                    concat_dim,
                    ..
                } => Some((*split_dim, *concat_dim)),
                _ => None,
            },
        }
    }
}

/// The parts of a call that other ranks' calls in the same slot must agree with. Serializable,
/// so that engines whose ranks do not share memory can exchange and compare them.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Signature {
    /// The op.
    pub kind: OpKind,
    /// Element type of the tensor given, if any.
    pub dtype: Option<DType>,
    /// Shape of the tensor given, if any.
    pub shape: Option<Vec<usize>>,
    /// all_gather and reduce_scatter: the dimension.
    pub dim: Option<usize>,
    /// all_reduce and reduce_scatter: the reduction.
    pub reduce: Option<ReduceOp>,
    /// reduce_scatter: each rank's slice length.
    pub sizes: Option<Vec<usize>>,
    /// broadcast: the root's position.
    pub root: Option<usize>,
    /// all_to_all: `(split_dim, concat_dim)`.
    pub dims: Option<(usize, usize)>,
}

impl Signature {
    /// Whether two ranks' calls can be executed together. Shapes must match except along the
    /// dimension that the op lets vary.
    pub fn compatible(&self, other: &Signature) -> bool {
        if self.kind != other.kind
            || self.dim != other.dim
            || self.reduce != other.reduce
            || self.sizes != other.sizes
            || self.root != other.root
            || self.dims != other.dims
        {
            return false;
        }
        if let (Some(a), Some(b)) = (self.dtype, other.dtype)
            && a != b
        {
            return false;
        }
        let (Some(a), Some(b)) = (&self.shape, &other.shape) else {
            return true;
        };
        match self.kind {
            OpKind::AllGather => {
                let dim = self.dim.unwrap_or(0);
                a.len() == b.len()
                    && a.iter()
                        .zip(b)
                        .enumerate()
                        .all(|(i, (x, y))| i == dim || x == y)
            }
            OpKind::AllToAll => {
                let (split, concat) = self.dims.unwrap_or((0, 0));
                a.len() == b.len()
                    && a.iter()
                        .zip(b)
                        .enumerate()
                        .all(|(i, (x, y))| i == split || i == concat || x == y)
            }
            _ => a == b,
        }
    }
}

/// The error for two members (positions `a` and `b` in the group) that issued incompatible calls
/// in call `seq`: every engine reports a mismatch in these words.
pub(crate) fn mismatch(
    info: &GroupInfo,
    seq: u64,
    (a, call_a): (usize, &Signature),
    (b, call_b): (usize, &Signature),
) -> CollectiveError {
    CollectiveError::Mismatch {
        group: info.label.clone(),
        seq,
        rank_a: info.ranks[a],
        call_a: call_a.to_string(),
        rank_b: info.ranks[b],
        call_b: call_b.to_string(),
    }
}

/// Checks that the slices an all_to_all delivers to one member (`shapes`, in source order) can
/// be concatenated along `concat_dim`: they must agree on every other dimension.
pub(crate) fn check_all_to_all_pieces(
    info: &GroupInfo,
    seq: u64,
    shapes: &[&[usize]],
    concat_dim: usize,
) -> Result<(), CollectiveError> {
    let reference = shapes[0];
    for (src, shape) in shapes.iter().enumerate() {
        let agrees = shape
            .iter()
            .zip(reference)
            .enumerate()
            .all(|(d, (a, b))| d == concat_dim || a == b);
        if !agrees {
            return Err(CollectiveError::Mismatch {
                group: info.label.clone(),
                seq,
                rank_a: info.ranks[0],
                call_a: format!("all_to_all sending a slice of shape {reference:?}"),
                rank_b: info.ranks[src],
                call_b: format!(
                    "all_to_all sending a slice of shape {shape:?}, which cannot be concatenated along dim {concat_dim}"
                ),
            });
        }
    }
    Ok(())
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(", self.kind)?;
        let mut parts = Vec::new();
        if let Some(d) = self.dim {
            parts.push(format!("dim={d}"));
        }
        if let Some((s, c)) = self.dims {
            parts.push(format!("split_dim={s}, concat_dim={c}"));
        }
        if let Some(op) = self.reduce {
            parts.push(format!("op={op}"));
        }
        if let Some(r) = self.root {
            parts.push(format!("root={r}"));
        }
        if let Some(s) = &self.sizes {
            parts.push(format!("sizes={s:?}"));
        }
        if let (Some(dtype), Some(shape)) = (self.dtype, &self.shape) {
            parts.push(format!("{dtype:?} {shape:?}"));
        }
        write!(f, "{})", parts.join(", "))
    }
}

/// Identity of one group as a rank sees it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GroupInfo {
    /// A readable name, e.g. `tp[2, 3]`.
    pub label: String,
    /// Global ranks of the members, in group order.
    pub ranks: Vec<usize>,
    /// This rank's position in `ranks`.
    pub index: usize,
}

impl GroupInfo {
    /// Number of members.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }
}

/// What a collective produced on one rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CollectiveOutput {
    /// The tensor, for ops that produce one.
    pub data: Option<TensorData>,
    /// all_gather and all_to_all: the size along the concatenated dimension of each source
    /// rank's piece, in group order (what the op's inverse needs). Empty for other ops.
    pub sizes: Vec<usize>,
}

impl CollectiveOutput {
    /// An output holding `data`, with no per-source sizes.
    pub fn tensor(data: TensorData) -> Self {
        Self {
            data: Some(data),
            sizes: Vec::new(),
        }
    }

    /// The output of an op that produces no tensor.
    pub fn none() -> Self {
        Self::default()
    }
}

/// The result of a collective on one rank.
pub type CollectiveResult = Result<CollectiveOutput, CollectiveError>;

/// One engine's connection to one group, as held by one rank.
///
/// A call takes its place in the group's sequence when it is issued: every member must issue
/// the same calls in the same order, and `start` returns only after that place is taken, so a
/// rank can start several calls and wait for them in any order.
pub trait Communicator: Send + Sync + fmt::Debug {
    /// The group as this rank sees it.
    fn info(&self) -> &GroupInfo;

    /// Runs the call to completion.
    fn run(&self, call: Collective) -> CollectiveResult;

    /// Issues the call and returns at once; the call progresses in the background.
    fn start(&self, call: Collective) -> CollectiveHandle;

    /// This rank's counters for this group.
    fn stats(&self) -> CommStats;

    /// Counts time this rank was blocked on a call of `kind` (in this group's counters and the
    /// rank's): [`OpCounters::waited`](crate::transport::stats::OpCounters::waited).
    fn record_wait(&self, kind: OpKind, waited: std::time::Duration);

    /// The engine's own type, for engine-specific paths (the NCCL device collectives need the
    /// group's NCCL communicator). `None` when the engine offers none.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
}

/// A collective in flight. Dropping it without waiting still lets the call complete.
#[must_use = "wait() on a started collective to get its result and errors"]
pub struct CollectiveHandle {
    state: HandleState,
    kind: OpKind,
    group: String,
    /// Where the time `wait` blocks is counted (set by the group that issued the call).
    waits: Option<Arc<dyn Communicator>>,
}

enum HandleState {
    Ready(CollectiveResult),
    Running(JoinHandle<CollectiveResult>),
}

impl CollectiveHandle {
    /// A handle whose result is already known (a call that completed or failed at once).
    pub fn ready(kind: OpKind, group: String, result: CollectiveResult) -> Self {
        Self {
            state: HandleState::Ready(result),
            kind,
            group,
            waits: None,
        }
    }

    /// A handle on a call that runs on `thread`.
    pub fn running(kind: OpKind, group: String, thread: JoinHandle<CollectiveResult>) -> Self {
        Self {
            state: HandleState::Running(thread),
            kind,
            group,
            waits: None,
        }
    }

    /// Whether `wait` would return without blocking.
    pub fn is_done(&self) -> bool {
        match &self.state {
            HandleState::Ready(_) => true,
            HandleState::Running(t) => t.is_finished(),
        }
    }

    /// The kind of call in flight.
    pub fn kind(&self) -> OpKind {
        self.kind
    }

    /// This handle, counting the time its `wait` blocks in `comm`'s counters.
    pub(crate) fn counting_waits(mut self, comm: Arc<dyn Communicator>) -> Self {
        self.waits = Some(comm);
        self
    }

    /// Blocks until the call completes.
    pub fn wait(self) -> CollectiveResult {
        let started = std::time::Instant::now();
        let (kind, waits) = (self.kind, self.waits.clone());
        let result = self.join();
        if let Some(comm) = waits {
            comm.record_wait(kind, started.elapsed());
        }
        result
    }

    fn join(self) -> CollectiveResult {
        match self.state {
            HandleState::Ready(r) => r,
            HandleState::Running(t) => t.join().unwrap_or_else(|_| {
                Err(CollectiveError::GroupBroken {
                    group: self.group,
                    reason: format!("the background {} panicked", self.kind),
                })
            }),
        }
    }

    /// Waits for a call that produces a tensor.
    pub fn wait_data(self) -> Result<TensorData, CollectiveError> {
        self.wait_sized().map(|(data, _)| data)
    }

    /// Waits for a call that produces a tensor, with the per-source sizes.
    pub fn wait_sized(self) -> Result<(TensorData, Vec<usize>), CollectiveError> {
        let kind = self.kind;
        let group = self.group.clone();
        let out = self.wait()?;
        let data = out.data.ok_or(CollectiveError::InvalidArgument {
            op: kind.name().into(),
            group,
            message: "this call produces no tensor".into(),
        })?;
        Ok((data, out.sizes))
    }
}
