//! The `nccl` engine: ranks are GPUs, one communicator per group made by `ncclCommSplit`.
//!
//! Two ways to start: one process per GPU ([`NcclEngine::from_env`]: the launcher passes the
//! rank and world size in the environment and the id travels as [`super::rendezvous`] says;
//! [`NcclEngine::join`] when the caller has them), or one process with one thread per GPU
//! ([`super::launcher`]: one process creates the id and every communicator, nothing to hand
//! over).
//! Every communicator is non-blocking and every wait for one (its creation, a split, a call)
//! runs under the rank's watchdog, so a rank that never comes ends the others with an error.
//! A rank that fails aborts its communicators ([`NcclEngine::abort_all`]), which ends its
//! peers' calls; destroying them instead would wait for those peers.
//!
//! `ProcessGroup` calls carry host `TensorData`, so this engine's [`Communicator`] stages
//! them: upload, the collective on device buffers (reused across calls), download. That is the
//! path for code that holds host data (and the reference the GPU check compares against); Burn
//! tensors on a CUDA device exchange through NCCL on their own buffers instead
//! (`crate::device`), which never leaves the GPU. Before a call the ranks agree on it
//! ([`super::agreement`]: a mismatch is the same error on every rank, never a hang), and every
//! call runs under the rank's [`Watchdog`] (another rank's failure or the timeout aborts it).
//! Point-to-point calls do not agree: each message carries its own header
//! ([`super::p2p_header`]).

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use burn::tensor::{DType, TensorData};

use crate::transport::chunk::offsets;
use crate::transport::collective::{
    Collective, CollectiveHandle, CollectiveOutput, CollectiveResult, Communicator, GroupInfo,
    OpKind,
};
use crate::transport::data::ReduceOp;
use crate::transport::engine::{Engine, group_info};
use crate::transport::error::CollectiveError;
use crate::transport::stats::CommStats;
use crate::transport::traffic::CallBytes;

use super::agreement::{Agreed, Agreement, AgreementMode, CallKind, CallSpec};
use super::comm::{NcclComm, NcclError};
use super::launch_env::LaunchEnv;
use super::layout::{AlongDim, gather_layout, narrow_copy, place_copy, scatter_layout};
use super::p2p_header::{HEADER_BYTES, point_to_point_header, read_point_to_point_header};
use super::rendezvous::IdSource;
use super::scope::{Scope, Slot, Staging, collective_error, watched_name};
use super::split::split_key;
use super::types::{NcclDataType, nccl_dtype, nccl_reduce};
use super::unique_id::UniqueIdBytes;
use super::watchdog::{Abort, FailureSignal, Watchdog};

/// How an NCCL engine guards its calls.
#[derive(Debug, Clone)]
pub struct NcclOptions {
    /// How long one call may take before the watchdog aborts it.
    pub timeout: Duration,
    /// Whether the ranks agree on every call or once per repeating call.
    pub agreement: AgreementMode,
    /// The failures of the other ranks of this process, which end this rank's calls.
    pub signal: FailureSignal,
}

impl NcclOptions {
    /// The options the environment sets: `BURN_PARALLEL_TIMEOUT_SECS` (the threads engine's
    /// timeout, 300 s by default) and `BURN_PARALLEL_NCCL_CHECK=every-call`.
    pub fn from_env() -> Self {
        let timeout = std::env::var(crate::transport::threads::TIMEOUT_ENV)
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .map_or(
                crate::transport::threads::DEFAULT_TIMEOUT,
                Duration::from_secs_f64,
            );
        Self {
            timeout,
            agreement: AgreementMode::from_env(),
            signal: FailureSignal::default(),
        }
    }
}

/// One rank's connection to the NCCL world.
#[derive(Debug)]
pub struct NcclEngine {
    world: Arc<NcclComm>,
    stats: Arc<Mutex<CommStats>>,
    watchdog: Arc<Watchdog>,
    agreement: AgreementMode,
    /// Every communicator of this rank (the world and its groups), for [`Self::abort_all`].
    comms: Mutex<Vec<Weak<NcclComm>>>,
}

/// Waits, under a guard of `watchdog` named `what`, for a communicator whose creation may
/// still be in progress (non-blocking): ready, or aborted with the reason.
pub(super) fn ready(
    comm: NcclComm,
    watchdog: &Watchdog,
    what: String,
) -> Result<NcclComm, NcclError> {
    let comm = Arc::new(comm);
    let guard = watchdog.guard(what, comm.clone())?;
    let settled = comm.settle(Some(guard.watch()));
    drop(guard);
    settled?;
    Ok(Arc::into_inner(comm).expect("the guard held the only other reference"))
}

impl NcclEngine {
    /// An engine on the world communicator `world` (ready), with the options the environment
    /// sets.
    pub fn new(world: NcclComm) -> Self {
        Self::with_options(world, NcclOptions::from_env())
    }

    /// An engine on the world communicator `world` (ready).
    pub fn with_options(world: NcclComm, options: NcclOptions) -> Self {
        Self::assemble(
            world,
            Arc::new(Watchdog::new(options.timeout, options.signal)),
            options.agreement,
        )
    }

    fn assemble(world: NcclComm, watchdog: Arc<Watchdog>, agreement: AgreementMode) -> Self {
        let world = Arc::new(world);
        Self {
            comms: Mutex::new(vec![Arc::downgrade(&world)]),
            world,
            stats: Arc::default(),
            watchdog,
            agreement,
        }
    }

    /// One process per GPU: joins the world of `world_size` ranks named by `id` as `rank`, on
    /// GPU `local_rank`. Rank 0's process must be the one that created `id` and must stay
    /// alive (see [`super::rendezvous`]). A rank that does not come within the timeout ends
    /// the join with an error naming it.
    pub fn join(
        rank: usize,
        world_size: usize,
        local_rank: usize,
        id: &UniqueIdBytes,
        options: NcclOptions,
    ) -> Result<Self, NcclError> {
        let watchdog = Arc::new(Watchdog::new(options.timeout, options.signal));
        let comm = NcclComm::init_rank(local_rank, rank, world_size, id)?;
        let what = format!(
            "ncclCommInitRankConfig of rank {rank} of {world_size} on GPU {local_rank} (every \
             rank must join; rank 0's process holds the bootstrap root)"
        );
        let comm = ready(comm, &watchdog, what)?;
        Ok(Self::assemble(comm, watchdog, options.agreement))
    }

    /// One process per GPU: joins the world described by the launcher's environment (`RANK`,
    /// `WORLD_SIZE`, `LOCAL_RANK`, and `NCCL_COMM_ID` or `BURN_PARALLEL_NCCL_ID`) on GPU
    /// `LOCAL_RANK`. A failing rank aborts its communicators, which ends its peers' calls.
    pub fn from_env() -> Result<Self, NcclError> {
        let env = LaunchEnv::from_env()?;
        let id = match env.source {
            IdSource::Given(id) => id,
            // With NCCL_COMM_ID set, ncclGetUniqueId only encodes that address (no root
            // starts here); rank 0's init starts the root in its own process.
            IdSource::CommIdEnv(_) => super::comm::new_unique_id()?,
            IdSource::Broadcast => {
                return Err(NcclError::InvalidArgument(
                    "rank 0's id is broadcast over MPI by the launch (Ranks::engine with the \
                     nccl engine under mpirun), not read from the environment"
                        .into(),
                ));
            }
        };
        Self::join(
            env.rank,
            env.world_size,
            env.local_rank,
            &id,
            NcclOptions::from_env(),
        )
    }

    /// The world communicator (the device API runs on it).
    pub fn world_comm(&self) -> &Arc<NcclComm> {
        &self.world
    }

    /// Aborts every communicator of this rank (`ncclCommAbort`): what a rank that failed does,
    /// so that its peers' calls end at once. Destroying them would wait for peers that may be
    /// blocked on this rank. Call it from the rank's own thread (the communicators' owner).
    pub fn abort_all(&self) {
        for comm in lock(&self.comms).iter().filter_map(Weak::upgrade) {
            comm.abort();
        }
    }
}

/// The watched name of the split that makes `label`'s communicator: what a rank left waiting
/// reads when another rank never joins it.
pub(crate) fn split_watch_name(label: &str, ranks: &[usize]) -> String {
    format!(
        "ncclCommSplit creating group {label} (ranks {ranks:?}), which every rank of the world \
         calls at the same time: a rank that failed before its mesh existed (its GPU did not \
         start, say) never joins it"
    )
}

impl Engine for NcclEngine {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn rank(&self) -> usize {
        self.world.rank()
    }

    fn world_size(&self) -> usize {
        self.world.size()
    }

    /// Splits the world communicator. `ncclCommSplit` is collective over the world: every rank
    /// must ask for its own group at the same time, as `DeviceMesh` does for each dimension
    /// (groups that partition the world). A group asked for by some ranks only would wait for
    /// the others.
    fn new_group(
        &self,
        label: &str,
        ranks: &[usize],
    ) -> Result<Arc<dyn Communicator>, CollectiveError> {
        let info = group_info(label, ranks, self.rank());
        let broken = |e: String| CollectiveError::GroupBroken {
            group: info.label.clone(),
            reason: e,
        };
        let key = split_key(self.rank(), ranks).map_err(|e| broken(e.to_string()))?;
        // Guarded: a rank that never joins is a timeout (or its failure, in this process)
        // naming the split, and this thread aborts it, instead of a hang.
        let guard = self
            .watchdog
            .guard(split_watch_name(label, ranks), self.world.clone())
            .map_err(|e| broken(e.to_string()))?;
        let comm = self
            .world
            .split(key, guard.watch())
            .map_err(|e| broken(e.to_string()))?;
        drop(guard);
        if comm.size() != ranks.len() || comm.rank() != info.index {
            return Err(broken(format!(
                "ncclCommSplit made a group of {} with this rank at {}, expected {} at {}: \
                 every rank must create its group at the same time (groups partitioning the world)",
                comm.size(),
                comm.rank(),
                ranks.len(),
                info.index
            )));
        }
        let comm = Arc::new(comm);
        lock(&self.comms).push(Arc::downgrade(&comm));
        Ok(Arc::new(NcclCommunicator {
            comm,
            info,
            stats: Mutex::default(),
            rank_stats: self.stats.clone(),
            watchdog: self.watchdog.clone(),
            agreement: Mutex::new(Agreement::new(self.agreement)),
            staging: Mutex::default(),
        }))
    }

    fn stats(&self) -> CommStats {
        self.stats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// One rank's handle on one NCCL group.
pub struct NcclCommunicator {
    comm: Arc<NcclComm>,
    info: GroupInfo,
    stats: Mutex<CommStats>,
    rank_stats: Arc<Mutex<CommStats>>,
    watchdog: Arc<Watchdog>,
    agreement: Mutex<Agreement>,
    staging: Mutex<Staging>,
}

impl std::fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclCommunicator({}, {:?})", self.info.label, self.comm)
    }
}

type Res<T> = Result<T, CollectiveError>;

impl NcclCommunicator {
    /// The group's NCCL communicator, for collectives on device buffers.
    pub fn comm(&self) -> &Arc<NcclComm> {
        &self.comm
    }

    /// Starts a call of `op`: the watchdog's guard and the staging buffers.
    pub(crate) fn scope(&self, op: OpKind) -> Res<Scope<'_>> {
        Scope::new(
            watched_name(op, &self.info.label),
            &self.comm,
            lock(&self.staging),
            &self.watchdog,
        )
        .map_err(self.fail(op))
    }

    pub(crate) fn fail(&self, op: OpKind) -> impl Fn(NcclError) -> CollectiveError + '_ {
        move |e| collective_error(op.name(), &self.info.label, e)
    }

    /// Agrees with the other ranks on `spec` (from the cache when it repeats): the same
    /// verdict on every rank, before any of them enters NCCL for the call itself.
    pub(crate) fn agree(&self, scope: &mut Scope<'_>, spec: &CallSpec) -> Res<Agreed> {
        let op = spec.op;
        lock(&self.agreement).agree(spec, &self.info, |words| {
            self.exchange_words(scope, words)
                .map_err(|e| self.fail(op)(scope.explain(e)))
        })
    }

    /// Every rank's words (the same count on each), in group order.
    fn exchange_words(
        &self,
        scope: &mut Scope<'_>,
        words: &[u64],
    ) -> Result<Vec<Vec<u64>>, NcclError> {
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let n = self.info.size();
        let send = scope.upload(Slot::WordsOut, &bytes)?;
        let recv = scope.buffer(Slot::WordsIn, bytes.len() * n)?;
        // SAFETY: both staging buffers hold the sizes passed.
        unsafe {
            scope
                .comm
                .all_gather(send, recv, bytes.len(), NcclDataType::Uint8)
        }?;
        let all = scope.download(recv, bytes.len() * n)?;
        Ok(all
            .chunks(bytes.len())
            .map(|c| {
                c.chunks(8)
                    .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
                    .collect()
            })
            .collect())
    }

    #[cfg_attr(not(any(feature = "cuda", feature = "tch")), allow(dead_code))]
    /// Counts a device collective as the host path counts the same call; `kept`: the bytes
    /// of its own slice that an all_to_all keeps.
    pub(crate) fn record_device(
        &self,
        kind: OpKind,
        input: usize,
        elem: usize,
        output: usize,
        kept: usize,
        took: Duration,
    ) {
        let (sent, received) =
            CallBytes::sized(kind, &self.info, input, elem, kept).traffic(output);
        self.record(kind, sent, received, took);
        // The host waits for the device call (CubeCL's stream gives no handle to await later).
        self.record_wait(kind, took);
    }

    fn record(&self, kind: OpKind, sent: u64, received: u64, took: Duration) {
        for stats in [&self.stats, &*self.rank_stats] {
            lock(stats).record(kind, sent, received, took);
        }
    }

    fn execute(&self, call: Collective) -> Res<CollectiveOutput> {
        let op = call.kind();
        let mut scope = self.scope(op)?;
        let spec = host_spec(&call);
        let agreed = match &spec {
            Some(spec) => Some(self.agree(&mut scope, spec)?),
            None => None,
        };
        self.execute_agreed(&mut scope, call, agreed)
            .map_err(|e| self.fail(op)(scope.explain(e)))
    }

    /// The call's NCCL work once every rank agreed (`agreed`: every rank's shapes, for the
    /// calls that agree).
    fn execute_agreed(
        &self,
        scope: &mut Scope<'_>,
        call: Collective,
        agreed: Option<Agreed>,
    ) -> Result<CollectiveOutput, NcclError> {
        match call {
            Collective::AllReduce { data, op: reduce } => all_reduce(scope, data, reduce),
            Collective::AllGather { data, dim } => {
                let agreed = agreed.ok_or_else(|| invalid("a gather agrees first"))?;
                self.all_gather(scope, data, dim, &agreed)
            }
            Collective::ReduceScatter {
                data,
                dim,
                sizes,
                op: reduce,
            } => self.reduce_scatter(scope, data, dim, &sizes, reduce),
            Collective::Broadcast { data, root } => {
                let agreed = agreed.ok_or_else(|| invalid("a broadcast agrees first"))?;
                self.broadcast(scope, data, root, &agreed)
            }
            Collective::AllToAll {
                data,
                split_dim,
                concat_dim,
                send_sizes,
            } => {
                let agreed = agreed.ok_or_else(|| invalid("an all_to_all agrees first"))?;
                self.all_to_all(scope, data, split_dim, concat_dim, &send_sizes, &agreed)
            }
            Collective::Send { data, dst } => send(scope, data, dst),
            Collective::Recv { src } => recv(scope, src),
            // The agreement was the barrier.
            Collective::Barrier => Ok(CollectiveOutput::none()),
        }
    }

    /// The gather of every rank's piece along `dim` (lengths from `agreed`): packed into
    /// NCCL's equal padded pieces, gathered, unpacked.
    fn all_gather(
        &self,
        scope: &mut Scope<'_>,
        data: TensorData,
        dim: usize,
        agreed: &Agreed,
    ) -> Result<CollectiveOutput, NcclError> {
        let me = self.info.index;
        let size = self.info.size();
        let sizes: Vec<usize> = agreed.shapes.iter().map(|s| s[dim]).collect();
        let eb = data.dtype().size();
        let layout = gather_layout(AlongDim::new(data.shape(), dim, eb), &sizes, me);
        let input = scope.upload(Slot::Input, data.as_bytes())?;
        let send = match layout.pack {
            Some(c) => {
                let send = scope.buffer(Slot::Send, layout.piece_bytes)?;
                // SAFETY: the plan stays inside the input and the padded piece.
                unsafe { scope.comm.copy_2d(input, send, c) }?;
                send
            }
            None => input,
        };
        let gathered = scope.buffer(Slot::Recv, layout.piece_bytes * size)?;
        if layout.piece_bytes > 0 {
            // SAFETY: `send` holds one padded piece, `gathered` one per rank.
            unsafe {
                scope
                    .comm
                    .all_gather(send, gathered, layout.piece_bytes, NcclDataType::Uint8)
            }?;
        }
        let out = match &layout.unpack {
            Some(copies) => {
                let out = scope.buffer(Slot::Output, layout.out_bytes)?;
                for c in copies {
                    // SAFETY: the plan stays inside both buffers.
                    unsafe { scope.comm.copy_2d(gathered, out, *c) }?;
                }
                out
            }
            None => gathered,
        };
        let mut shape = data.shape().to_vec();
        shape[dim] = sizes.iter().sum();
        let bytes = scope.download(out, layout.out_bytes)?;
        Ok(CollectiveOutput {
            data: Some(TensorData::from_bytes_vec(bytes, shape, data.dtype())),
            sizes,
        })
    }

    /// The reduction of every rank's slice `me` (slices `sizes` long along `dim`): the slices
    /// packed into NCCL's equal padded pieces, reduce-scattered, this rank's unpacked.
    fn reduce_scatter(
        &self,
        scope: &mut Scope<'_>,
        data: TensorData,
        dim: usize,
        sizes: &[usize],
        reduce: ReduceOp,
    ) -> Result<CollectiveOutput, NcclError> {
        let me = self.info.index;
        let size = self.info.size();
        let eb = data.dtype().size();
        let t = nccl_type(OpKind::ReduceScatter, data.dtype())?;
        let layout = scatter_layout(AlongDim::new(data.shape(), dim, eb), sizes, me);
        let input = scope.upload(Slot::Input, data.as_bytes())?;
        let send = match &layout.pack {
            Some(copies) => {
                let send = scope.buffer(Slot::Send, layout.piece_bytes * size)?;
                for c in copies {
                    // SAFETY: the plan stays inside both buffers.
                    unsafe { scope.comm.copy_2d(input, send, *c) }?;
                }
                send
            }
            None => input,
        };
        let recv = scope.buffer(Slot::Recv, layout.piece_bytes)?;
        if layout.piece_bytes > 0 {
            // SAFETY: `send` holds one padded piece per rank, `recv` one.
            unsafe {
                scope.comm.reduce_scatter(
                    send,
                    recv,
                    layout.piece_bytes / eb,
                    t,
                    nccl_reduce(reduce),
                )
            }?;
        }
        let out = match layout.unpack {
            Some(c) => {
                let out = scope.buffer(Slot::Output, layout.out_bytes)?;
                // SAFETY: the plan stays inside both buffers.
                unsafe { scope.comm.copy_2d(recv, out, c) }?;
                out
            }
            None => recv,
        };
        let mut shape = data.shape().to_vec();
        shape[dim] = sizes[me];
        let bytes = scope.download(out, layout.out_bytes)?;
        Ok(CollectiveOutput::tensor(TensorData::from_bytes_vec(
            bytes,
            shape,
            data.dtype(),
        )))
    }

    /// The root's tensor on every rank, as bytes: its dtype and shape come from `agreed`, so
    /// the other ranks need not pass one.
    fn broadcast(
        &self,
        scope: &mut Scope<'_>,
        data: Option<TensorData>,
        root: usize,
        agreed: &Agreed,
    ) -> Result<CollectiveOutput, NcclError> {
        let me = self.info.index;
        let dtype = agreed
            .dtype
            .ok_or_else(|| invalid("the root sent its tensor"))?;
        let shape = agreed.shapes[root].clone();
        let len = shape.iter().product::<usize>() * dtype.size();
        let p = match &data {
            Some(d) if me == root => scope.upload(Slot::Input, d.as_bytes())?,
            _ => scope.buffer(Slot::Input, len)?,
        };
        if len > 0 {
            // SAFETY: every rank's buffer holds `len` bytes.
            unsafe { scope.comm.broadcast(p, p, len, NcclDataType::Uint8, root) }?;
        }
        let bytes = scope.download(p, len)?;
        Ok(CollectiveOutput::tensor(TensorData::from_bytes_vec(
            bytes, shape, dtype,
        )))
    }

    /// Each rank's slices along `split_dim` to their ranks, the received ones concatenated along
    /// `concat_dim` in source order (every source's shape and send sizes from `agreed`).
    fn all_to_all(
        &self,
        scope: &mut Scope<'_>,
        data: TensorData,
        split_dim: usize,
        concat_dim: usize,
        send_sizes: &[usize],
        agreed: &Agreed,
    ) -> Result<CollectiveOutput, NcclError> {
        let me = self.info.index;
        let size = self.info.size();
        let eb = data.dtype().size();
        // What each source sends this rank: its shape with its send size for us along split.
        let pieces: Vec<Vec<usize>> = agreed
            .shapes
            .iter()
            .zip(&agreed.lists)
            .map(|(shape, sizes)| {
                let mut s = shape.clone();
                s[split_dim] = sizes[me];
                s
            })
            .collect();
        let view = AlongDim::new(data.shape(), split_dim, eb);
        let input = scope.upload(Slot::Input, data.as_bytes())?;
        let send_bytes: Vec<usize> = send_sizes.iter().map(|s| view.bytes_with(*s)).collect();
        let send = scope.buffer(Slot::Send, send_bytes.iter().sum())?;
        let send_at = offsets(&send_bytes);
        for (j, (start, len)) in offsets(send_sizes).into_iter().zip(send_sizes).enumerate() {
            let c = narrow_copy(view, start, *len).shifted(0, send_at[j]);
            // SAFETY: the plan stays inside both buffers.
            unsafe { scope.comm.copy_2d(input, send, c) }?;
        }
        let recv_bytes: Vec<usize> = pieces
            .iter()
            .map(|p| p.iter().product::<usize>() * eb)
            .collect();
        let recv = scope.buffer(Slot::Recv, recv_bytes.iter().sum())?;
        let recv_at = offsets(&recv_bytes);
        let sends: Vec<(u64, usize)> = (0..size)
            .map(|j| (send + send_at[j] as u64, send_bytes[j]))
            .collect();
        let recvs: Vec<(u64, usize)> = (0..size)
            .map(|j| (recv + recv_at[j] as u64, recv_bytes[j]))
            .collect();
        // SAFETY: every (pointer, count) lies inside `send` or `recv`.
        unsafe { scope.comm.all_to_all(&sends, &recvs, NcclDataType::Uint8) }?;
        let sizes: Vec<usize> = pieces.iter().map(|p| p[concat_dim]).collect();
        let total: usize = sizes.iter().sum();
        let mut shape = pieces[0].clone();
        shape[concat_dim] = total;
        let out_len = shape.iter().product::<usize>() * eb;
        let out = scope.buffer(Slot::Output, out_len)?;
        let at = offsets(&sizes);
        for (src, piece) in pieces.iter().enumerate() {
            let c = place_copy(
                AlongDim::new(piece, concat_dim, eb),
                sizes[src],
                at[src],
                total,
            )
            .shifted(recv_at[src], 0);
            // SAFETY: the plan stays inside both buffers.
            unsafe { scope.comm.copy_2d(recv, out, c) }?;
        }
        let bytes = scope.download(out, out_len)?;
        Ok(CollectiveOutput {
            data: Some(TensorData::from_bytes_vec(bytes, shape, data.dtype())),
            sizes,
        })
    }
}

/// The error for a call the engine cannot run as stated.
fn invalid(message: &str) -> NcclError {
    NcclError::InvalidArgument(message.into())
}

/// NCCL's element type for `dtype` in a call of `op`, or why there is none.
fn nccl_type(op: OpKind, dtype: DType) -> Result<NcclDataType, NcclError> {
    nccl_dtype(op.name(), dtype).map_err(|e| invalid(&e.to_string()))
}

/// An all-reduce in place on the uploaded input: every rank's shapes are equal, so there is
/// nothing to pack.
fn all_reduce(
    scope: &mut Scope<'_>,
    data: TensorData,
    reduce: ReduceOp,
) -> Result<CollectiveOutput, NcclError> {
    let t = nccl_type(OpKind::AllReduce, data.dtype())?;
    let p = scope.upload(Slot::Input, data.as_bytes())?;
    if data.num_elements() > 0 {
        // SAFETY: in place on a staging buffer of `num_elements` elements of `t`.
        unsafe {
            scope
                .comm
                .all_reduce(p, p, data.num_elements(), t, nccl_reduce(reduce))
        }?;
    }
    let out = scope.download(p, data.as_bytes().len())?;
    Ok(CollectiveOutput::tensor(TensorData::from_bytes_vec(
        out,
        data.shape().to_vec(),
        data.dtype(),
    )))
}

/// Sends `data` to `dst`: the header, then the payload. An empty tensor sends no payload: the
/// receiver learns its length from the header and posts no receive for it either.
fn send(
    scope: &mut Scope<'_>,
    data: TensorData,
    dst: usize,
) -> Result<CollectiveOutput, NcclError> {
    let header = point_to_point_header(&data)?;
    let h = scope.upload(Slot::WordsOut, &header)?;
    let body = scope.upload(Slot::Input, data.as_bytes())?;
    // SAFETY: both buffers hold the counts passed.
    unsafe { scope.comm.send(h, header.len(), NcclDataType::Uint8, dst) }?;
    let len = data.as_bytes().len();
    if len > 0 {
        // SAFETY: as above.
        unsafe { scope.comm.send(body, len, NcclDataType::Uint8, dst) }?;
    }
    scope.finish()?;
    Ok(CollectiveOutput::none())
}

/// Receives the next message from `src`: its header, then the payload the header announces.
fn recv(scope: &mut Scope<'_>, src: usize) -> Result<CollectiveOutput, NcclError> {
    let h = scope.buffer(Slot::WordsIn, HEADER_BYTES)?;
    // SAFETY: `h` holds a header.
    unsafe { scope.comm.recv(h, HEADER_BYTES, NcclDataType::Uint8, src) }?;
    let (dtype, shape) = read_point_to_point_header(&scope.download(h, HEADER_BYTES)?)?;
    let len = shape.iter().product::<usize>() * dtype.size();
    let body = scope.buffer(Slot::Input, len)?;
    if len > 0 {
        // SAFETY: `body` holds `len` bytes.
        unsafe { scope.comm.recv(body, len, NcclDataType::Uint8, src) }?;
    }
    let bytes = scope.download(body, len)?;
    Ok(CollectiveOutput::tensor(TensorData::from_bytes_vec(
        bytes, shape, dtype,
    )))
}

/// Locks `m` even when a panicking rank poisoned it: the data stays usable for the others.
pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a host call states for the agreement (`None`: point-to-point, which does not agree).
fn host_spec(call: &Collective) -> Option<CallSpec> {
    let tensor = |d: &TensorData| Some((d.dtype(), d.shape().to_vec()));
    let (t, kind) = match call {
        Collective::AllReduce { data, .. } => (tensor(data), CallKind::Same),
        Collective::AllGather { data, dim } => (
            tensor(data),
            CallKind::Gather {
                dim: *dim,
                sizes: None,
            },
        ),
        Collective::ReduceScatter {
            data, dim, sizes, ..
        } => (
            tensor(data),
            CallKind::Scatter {
                dim: *dim,
                sizes: sizes.clone(),
            },
        ),
        Collective::Broadcast { data, root } => (
            data.as_ref().and_then(tensor),
            CallKind::Broadcast { root: *root },
        ),
        Collective::AllToAll {
            data,
            split_dim,
            concat_dim,
            send_sizes,
        } => (
            tensor(data),
            CallKind::AllToAll {
                split: *split_dim,
                concat: *concat_dim,
                send: send_sizes.clone(),
            },
        ),
        Collective::Barrier => (None, CallKind::Barrier),
        Collective::Send { .. } | Collective::Recv { .. } => return None,
    };
    Some(CallSpec {
        op: call.kind(),
        tensor: t,
        kind,
    })
}

impl Communicator for NcclCommunicator {
    fn info(&self) -> &GroupInfo {
        &self.info
    }

    fn run(&self, call: Collective) -> CollectiveResult {
        let bytes = CallBytes::of(&call, &self.info);
        let started = std::time::Instant::now();
        let out = self.execute(call)?;
        let produced = out.data.as_ref().map_or(0, |d| d.as_bytes().len());
        let (sent, received) = bytes.traffic(produced);
        self.record(bytes.kind(), sent, received, started.elapsed());
        Ok(out)
    }

    /// Runs the call before returning: host data must come back to the host anyway, and the
    /// device work is already asynchronous on the group's stream. Device-side overlap is what
    /// [`NcclComm::record`] and the device path give.
    fn start(&self, call: Collective) -> CollectiveHandle {
        let kind = call.kind();
        CollectiveHandle::ready(kind, self.info.label.clone(), self.run(call))
    }

    fn stats(&self) -> CommStats {
        self.stats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn record_wait(&self, kind: OpKind, waited: Duration) {
        for stats in [&self.stats, &*self.rank_stats] {
            lock(stats).record_wait(kind, waited);
        }
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

/// The nccl engine's handle on `group`, if the group belongs to that engine.
pub(crate) fn nccl_communicator(
    group: &crate::transport::group::ProcessGroup,
) -> Option<&NcclCommunicator> {
    group
        .communicator()
        .as_any()
        .and_then(|a| a.downcast_ref::<NcclCommunicator>())
}

/// The NCCL communicator of `group`, if the group belongs to the nccl engine.
pub fn nccl_comm(group: &crate::transport::group::ProcessGroup) -> Option<Arc<NcclComm>> {
    nccl_communicator(group).map(|c| c.comm.clone())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn a_split_left_waiting_names_the_group_and_the_likely_cause() {
        let what = split_watch_name("tp", &[0, 1]);
        let e = super::super::watchdog::Stopped::TimedOut {
            what,
            timeout: Duration::from_secs(60),
        }
        .to_string();
        assert!(
            e.starts_with("ncclCommSplit creating group tp (ranks [0, 1])"),
            "{e}"
        );
        assert!(
            e.contains("failed before its mesh existed") && e.contains("60s"),
            "{e}"
        );
    }

    /// Tells the terminal that part of a test could not run here (output the harness does not
    /// capture, so a skip is never a silent pass).
    pub(crate) fn skipped(what: &str, why: &str) {
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "SKIPPED {what}: {why}");
    }
}
