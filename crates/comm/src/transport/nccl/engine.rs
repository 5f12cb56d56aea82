//! The `nccl` engine: ranks are GPUs, one communicator per group made by `ncclCommSplit`.
//!
//! Two ways to start: one process per GPU ([`NcclEngine::from_env`]: the launcher passes the
//! rank, world size and rank 0's unique id in the environment, see [`super::unique_id`]), or one
//! process with one thread per GPU ([`launch_local`], `ncclCommInitAll`).
//!
//! `ProcessGroup` calls carry host `TensorData`, so this engine's [`Communicator`] stages
//! them: upload, the collective on device buffers, download. That is the path for code that
//! holds host data (and the reference the GPU check compares against); Burn tensors on a CUDA
//! device exchange through NCCL on their own buffers instead (`crate::device`), which never leaves
//! the GPU. Every rank checks the others' shapes and dtypes first (one small all_gather), so a
//! mismatch is an error naming both ranks rather than a hang or garbage.

use std::sync::{Arc, Mutex};

use burn::tensor::{DType, TensorData};
use cudarc::driver::{CudaSlice, DevicePtr as _};

use crate::transport::chunk::offsets;
use crate::transport::collective::{
    Collective, CollectiveHandle, CollectiveOutput, CollectiveResult, Communicator, GroupInfo,
    OpKind,
};
use crate::transport::data::reducible;
use crate::transport::engine::{Engine, RankContext, group_info};
use crate::transport::error::{CollectiveError, LaunchError, RankFailure};
use crate::transport::rank_threads::{RankThreads, run_on_threads};
use crate::transport::stats::CommStats;
use crate::transport::traffic::CallBytes;

use super::comm::{NcclComm, NcclError};
use super::layout::{AlongDim, gather_layout, narrow_copy, place_copy, scatter_layout};
use super::split::split_key;
use super::types::{NcclDataType, dtype_code, dtype_from_code, nccl_dtype, nccl_reduce};
use super::unique_id::LaunchEnv;

/// Dimensions a tensor may have on this engine (the metadata exchange has a fixed size).
const MAX_DIMS: usize = 8;
/// Metadata words per rank: op, dtype, ndim, dims.
const META_WORDS: usize = 3 + MAX_DIMS;

/// One rank's connection to the NCCL world.
#[derive(Debug)]
pub struct NcclEngine {
    world: Arc<NcclComm>,
    stats: Arc<Mutex<CommStats>>,
}

impl NcclEngine {
    /// An engine on the world communicator `world`.
    pub fn new(world: NcclComm) -> Self {
        Self {
            world: Arc::new(world),
            stats: Arc::default(),
        }
    }

    /// One process per GPU: joins the world described by the launcher's environment
    /// (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `BURN_PARALLEL_NCCL_ID`) on GPU `LOCAL_RANK`.
    pub fn from_env() -> Result<Self, NcclError> {
        let env = LaunchEnv::from_env()?;
        let comm = NcclComm::init_rank(env.local_rank, env.rank, env.world_size, &env.id)?;
        Ok(Self::new(comm))
    }

    /// The world communicator (the device API runs on it).
    pub fn world_comm(&self) -> &Arc<NcclComm> {
        &self.world
    }
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
        let comm = self.world.split(key).map_err(|e| broken(e.to_string()))?;
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
        Ok(Arc::new(NcclCommunicator {
            comm: Arc::new(comm),
            info,
            stats: Mutex::default(),
            rank_stats: self.stats.clone(),
        }))
    }

    fn stats(&self) -> CommStats {
        self.stats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Runs one rank per GPU of `ordinals` as threads of this process (communicators from
/// `ncclCommInitAll`, what cudarc's `Comm::from_devices` uses) and returns their results in
/// rank order, or every failure.
pub fn launch_local<T, E, F>(ordinals: &[usize], f: F) -> Result<Vec<T>, LaunchError>
where
    T: Send,
    E: std::fmt::Display,
    F: Fn(RankContext) -> Result<T, E> + Sync,
{
    let comms = NcclComm::init_local(ordinals).map_err(|e| LaunchError {
        failures: vec![RankFailure {
            rank: 0,
            message: e.to_string(),
            panicked: false,
        }],
    })?;
    let world = comms.len();
    let ranks = NcclRanks(Mutex::new(comms.into_iter().map(Some).collect()));
    run_on_threads(world, &ranks, &f)
}

/// Threads of one process, one per GPU: each rank takes its communicator.
struct NcclRanks(Mutex<Vec<Option<NcclComm>>>);

impl RankThreads for NcclRanks {
    fn context(&self, rank: usize) -> RankContext {
        let comm = self.0.lock().unwrap_or_else(|p| p.into_inner())[rank]
            .take()
            .expect("each rank takes its communicator once");
        RankContext::new(Arc::new(NcclEngine::new(comm)))
    }

    fn finished(&self, _rank: usize, _failure: Option<&str>) {}
}

/// One rank's handle on one NCCL group.
pub struct NcclCommunicator {
    comm: Arc<NcclComm>,
    info: GroupInfo,
    stats: Mutex<CommStats>,
    rank_stats: Arc<Mutex<CommStats>>,
}

impl std::fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclCommunicator({}, {:?})", self.info.label, self.comm)
    }
}

type Res<T> = Result<T, CollectiveError>;

/// What one rank said it is calling: dtype (none without a tensor), shape, extra words.
type RankCall = (Option<DType>, Vec<usize>, Vec<u64>);
/// A [`RankCall`] with its op code first, as exchanged.
type ParsedCall = (u64, Option<DType>, Vec<usize>, Vec<u64>);

impl NcclCommunicator {
    /// The group's NCCL communicator, for collectives on device buffers.
    pub fn comm(&self) -> &Arc<NcclComm> {
        &self.comm
    }

    fn fail(&self, op: OpKind) -> impl Fn(NcclError) -> CollectiveError + '_ {
        move |e| CollectiveError::GroupBroken {
            group: self.info.label.clone(),
            reason: format!("{op} failed: {e}"),
        }
    }

    fn invalid(&self, op: OpKind, message: String) -> CollectiveError {
        CollectiveError::InvalidArgument {
            op: op.name().into(),
            group: self.info.label.clone(),
            message,
        }
    }

    fn upload(&self, op: OpKind, bytes: &[u8]) -> Res<CudaSlice<u8>> {
        let stream = self.comm.stream();
        let mut buf = self.alloc(op, bytes.len())?;
        if !bytes.is_empty() {
            stream
                .memcpy_htod(bytes, &mut buf)
                .map_err(|e| self.fail(op)(cuda("cuMemcpyHtoD", e)))?;
        }
        Ok(buf)
    }

    /// A device buffer of at least one byte (CUDA refuses empty allocations).
    fn alloc(&self, op: OpKind, len: usize) -> Res<CudaSlice<u8>> {
        self.comm
            .stream()
            .alloc_zeros::<u8>(len.max(1))
            .map_err(|e| self.fail(op)(cuda("cuMemAlloc", e)))
    }

    fn download(&self, op: OpKind, buf: &CudaSlice<u8>, len: usize) -> Res<Vec<u8>> {
        let stream = self.comm.stream();
        let mut out = vec![0u8; len];
        if len > 0 {
            stream
                .memcpy_dtoh(&buf.slice(..len), &mut out)
                .map_err(|e| self.fail(op)(cuda("cuMemcpyDtoH", e)))?;
        }
        stream
            .synchronize()
            .map_err(|e| self.fail(op)(cuda("cuStreamSynchronize", e)))?;
        Ok(out)
    }

    fn ptr(&self, buf: &CudaSlice<u8>) -> u64 {
        buf.device_ptr(self.comm.stream()).0
    }

    /// Every rank's metadata words (the same count on every rank), in group order.
    fn exchange(&self, op: OpKind, words: &[u64]) -> Res<Vec<Vec<u64>>> {
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let send = self.upload(op, &bytes)?;
        let recv = self.alloc(op, bytes.len() * self.info.size())?;
        // SAFETY: both buffers were just allocated with the sizes passed.
        unsafe {
            self.comm.all_gather(
                self.ptr(&send),
                self.ptr(&recv),
                bytes.len(),
                NcclDataType::Uint8,
            )
        }
        .map_err(self.fail(op))?;
        let all = self.download(op, &recv, bytes.len() * self.info.size())?;
        Ok(all
            .chunks(bytes.len())
            .map(|c| {
                c.chunks(8)
                    .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
                    .collect()
            })
            .collect())
    }

    fn header(&self, op: OpKind, data: Option<(DType, &[usize])>) -> Res<Vec<u64>> {
        let mut words = vec![0u64; META_WORDS];
        words[0] = op as u64 + 1;
        if let Some((dtype, shape)) = data {
            if shape.len() > MAX_DIMS {
                return Err(self.invalid(
                    op,
                    format!("the nccl engine handles at most {MAX_DIMS} dimensions"),
                ));
            }
            words[1] = dtype_code(dtype).ok_or_else(|| CollectiveError::UnsupportedDtype {
                op: format!("{op} (nccl)"),
                dtype: format!("{dtype:?}"),
            })? + 1;
            words[2] = shape.len() as u64;
            for (w, s) in words[3..].iter_mut().zip(shape.iter()) {
                *w = *s as u64;
            }
        }
        Ok(words)
    }

    /// Checks that every rank called the same op with compatible tensors (shapes equal except
    /// along the dimensions in `free`), and returns each rank's (dtype, shape).
    fn agree(
        &self,
        op: OpKind,
        data: Option<&TensorData>,
        extra: &[u64],
        free: &[usize],
    ) -> Res<Vec<RankCall>> {
        self.agree_on(op, data.map(|d| (d.dtype(), &d.shape()[..])), extra, free)
    }

    #[cfg_attr(not(any(feature = "cuda", feature = "tch")), allow(dead_code))]
    /// A device collective's [`Self::agree`]: every rank's shape of a `dtype` tensor whose
    /// shapes may differ along `free`. A mismatch is an error on every rank, not a hang.
    /// `extra`: words every rank states (as many on each), returned with its shape.
    pub(crate) fn agree_device(
        &self,
        op: OpKind,
        dtype: DType,
        shape: &[usize],
        free: &[usize],
        extra: &[u64],
    ) -> Res<Vec<(Vec<usize>, Vec<u64>)>> {
        let all = self.agree_on(op, Some((dtype, shape)), extra, free)?;
        Ok(all.into_iter().map(|(_, s, x)| (s, x)).collect())
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
    ) {
        let (sent, received) =
            CallBytes::sized(kind, &self.info, input, elem, kept).traffic(output);
        for stats in [&self.stats, &*self.rank_stats] {
            stats
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .record(kind, sent, received);
        }
    }

    fn agree_on(
        &self,
        op: OpKind,
        data: Option<(DType, &[usize])>,
        extra: &[u64],
        free: &[usize],
    ) -> Res<Vec<RankCall>> {
        let mut words = self.header(op, data)?;
        words.extend_from_slice(extra);
        let all = self.exchange(op, &words)?;
        let parsed: Vec<ParsedCall> = all
            .iter()
            .map(|w| {
                let dtype = w[1].checked_sub(1).and_then(dtype_from_code);
                let ndim = w[2] as usize;
                let shape = w[3..3 + ndim.min(MAX_DIMS)]
                    .iter()
                    .map(|x| *x as usize)
                    .collect();
                (w[0], dtype, shape, w[META_WORDS..].to_vec())
            })
            .collect();
        let me = self.info.index;
        let describe = |(code, dtype, shape, _): &ParsedCall| {
            let name = OpKind::ALL
                .get((*code as usize).wrapping_sub(1))
                .map_or("?", |k| k.name());
            match dtype {
                Some(d) => format!("{name}({d:?} {shape:?})"),
                None => format!("{name}()"),
            }
        };
        for (j, other) in parsed.iter().enumerate() {
            let mine = &parsed[me];
            let tensors_agree = match (mine.1, other.1) {
                (Some(a), Some(b)) => {
                    a == b
                        && mine.2.len() == other.2.len()
                        && mine
                            .2
                            .iter()
                            .zip(&other.2)
                            .enumerate()
                            .all(|(d, (x, y))| free.contains(&d) || x == y)
                }
                _ => true,
            };
            if other.0 != mine.0 || !tensors_agree {
                return Err(CollectiveError::Mismatch {
                    group: self.info.label.clone(),
                    seq: 0,
                    rank_a: self.info.ranks[me],
                    call_a: describe(mine),
                    rank_b: self.info.ranks[j],
                    call_b: describe(other),
                });
            }
        }
        Ok(parsed.into_iter().map(|(_, d, s, x)| (d, s, x)).collect())
    }

    fn execute(&self, call: Collective) -> Res<CollectiveOutput> {
        let op = call.kind();
        let me = self.info.index;
        let size = self.info.size();
        match call {
            Collective::AllReduce { data, op: reduce } => {
                self.check_reducible(op, &data)?;
                self.agree(op, Some(&data), &[], &[])?;
                let buf = self.upload(op, data.as_bytes())?;
                let t = nccl_dtype(op.name(), data.dtype())?;
                let p = self.ptr(&buf);
                // SAFETY: in place on a buffer of `num_elements` elements of `t`.
                unsafe {
                    self.comm
                        .all_reduce(p, p, data.num_elements(), t, nccl_reduce(reduce))
                }
                .map_err(self.fail(op))?;
                let out = self.download(op, &buf, data.as_bytes().len())?;
                Ok(CollectiveOutput::tensor(TensorData::from_bytes_vec(
                    out,
                    data.shape().to_vec(),
                    data.dtype(),
                )))
            }
            Collective::AllGather { data, dim } => {
                let all = self.agree(op, Some(&data), &[], &[dim])?;
                let sizes: Vec<usize> = all.iter().map(|(_, s, _)| s[dim]).collect();
                let eb = data.dtype().size();
                let layout = gather_layout(AlongDim::new(data.shape(), dim, eb), &sizes, me);
                let input = self.upload(op, data.as_bytes())?;
                let send = match layout.pack {
                    Some(c) => {
                        let send = self.alloc(op, layout.piece_bytes)?;
                        // SAFETY: the plan stays inside the input and the padded piece.
                        unsafe { self.comm.copy_2d(self.ptr(&input), self.ptr(&send), c) }
                            .map_err(self.fail(op))?;
                        send
                    }
                    None => input,
                };
                let gathered = self.alloc(op, layout.piece_bytes * size)?;
                if layout.piece_bytes > 0 {
                    // SAFETY: `send` holds one padded piece, `gathered` one per rank.
                    unsafe {
                        self.comm.all_gather(
                            self.ptr(&send),
                            self.ptr(&gathered),
                            layout.piece_bytes,
                            NcclDataType::Uint8,
                        )
                    }
                    .map_err(self.fail(op))?;
                }
                let out = match &layout.unpack {
                    Some(copies) => {
                        let out = self.alloc(op, layout.out_bytes)?;
                        for c in copies {
                            // SAFETY: the plan stays inside both buffers.
                            unsafe { self.comm.copy_2d(self.ptr(&gathered), self.ptr(&out), *c) }
                                .map_err(self.fail(op))?;
                        }
                        out
                    }
                    None => gathered,
                };
                let mut shape = data.shape().to_vec();
                shape[dim] = sizes.iter().sum();
                let bytes = self.download(op, &out, layout.out_bytes)?;
                Ok(CollectiveOutput {
                    data: Some(TensorData::from_bytes_vec(bytes, shape, data.dtype())),
                    sizes,
                })
            }
            Collective::ReduceScatter {
                data,
                dim,
                sizes,
                op: reduce,
            } => {
                self.check_reducible(op, &data)?;
                let wanted: Vec<u64> = sizes.iter().map(|s| *s as u64).collect();
                let all = self.agree(op, Some(&data), &[], &[])?;
                debug_assert_eq!(all.len(), size);
                if sizes.len() != size || sizes.iter().sum::<usize>() != data.shape()[dim] {
                    return Err(self.invalid(
                        op,
                        format!(
                            "sizes {wanted:?} must give one piece per rank summing to dim {dim}"
                        ),
                    ));
                }
                let eb = data.dtype().size();
                let t = nccl_dtype(op.name(), data.dtype())?;
                let layout = scatter_layout(AlongDim::new(data.shape(), dim, eb), &sizes, me);
                let input = self.upload(op, data.as_bytes())?;
                let send = match &layout.pack {
                    Some(copies) => {
                        let send = self.alloc(op, layout.piece_bytes * size)?;
                        for c in copies {
                            // SAFETY: the plan stays inside both buffers.
                            unsafe { self.comm.copy_2d(self.ptr(&input), self.ptr(&send), *c) }
                                .map_err(self.fail(op))?;
                        }
                        send
                    }
                    None => input,
                };
                let recv = self.alloc(op, layout.piece_bytes)?;
                if layout.piece_bytes > 0 {
                    // SAFETY: `send` holds one padded piece per rank, `recv` one.
                    unsafe {
                        self.comm.reduce_scatter(
                            self.ptr(&send),
                            self.ptr(&recv),
                            layout.piece_bytes / eb,
                            t,
                            nccl_reduce(reduce),
                        )
                    }
                    .map_err(self.fail(op))?;
                }
                let out = match layout.unpack {
                    Some(c) => {
                        let out = self.alloc(op, layout.out_bytes)?;
                        // SAFETY: the plan stays inside both buffers.
                        unsafe { self.comm.copy_2d(self.ptr(&recv), self.ptr(&out), c) }
                            .map_err(self.fail(op))?;
                        out
                    }
                    None => recv,
                };
                let mut shape = data.shape().to_vec();
                shape[dim] = sizes[me];
                let bytes = self.download(op, &out, layout.out_bytes)?;
                Ok(CollectiveOutput::tensor(TensorData::from_bytes_vec(
                    bytes,
                    shape,
                    data.dtype(),
                )))
            }
            Collective::Broadcast { data, root } => {
                if root >= size {
                    return Err(CollectiveError::NoSuchRank {
                        op: op.name().into(),
                        group: self.info.label.clone(),
                        rank: root,
                        size,
                    });
                }
                if me == root && data.is_none() {
                    return Err(self.invalid(op, "the root must provide the tensor".into()));
                }
                let all = self.agree(op, data.as_ref(), &[], &[])?;
                let (dtype, shape, _) = all[root].clone();
                let dtype = dtype.expect("the root sent its tensor");
                let len = shape.iter().product::<usize>() * dtype.size();
                let buf = match &data {
                    Some(d) if me == root => self.upload(op, d.as_bytes())?,
                    _ => self.alloc(op, len)?,
                };
                let p = self.ptr(&buf);
                // SAFETY: every rank's buffer holds `len` bytes.
                unsafe { self.comm.broadcast(p, p, len, NcclDataType::Uint8, root) }
                    .map_err(self.fail(op))?;
                let bytes = self.download(op, &buf, len)?;
                Ok(CollectiveOutput::tensor(TensorData::from_bytes_vec(
                    bytes, shape, dtype,
                )))
            }
            Collective::AllToAll {
                data,
                split_dim,
                concat_dim,
                send_sizes,
            } => self.all_to_all(data, split_dim, concat_dim, send_sizes),
            Collective::Send { data, dst } => {
                let header = self.header(op, Some((data.dtype(), &data.shape()[..])))?;
                let hb: Vec<u8> = header.iter().flat_map(|w| w.to_le_bytes()).collect();
                let h = self.upload(op, &hb)?;
                let body = self.upload(op, data.as_bytes())?;
                // SAFETY: both buffers hold the counts passed.
                unsafe {
                    self.comm
                        .send(self.ptr(&h), hb.len(), NcclDataType::Uint8, dst)
                }
                .map_err(self.fail(op))?;
                let len = data.as_bytes().len();
                if len > 0 {
                    // SAFETY: as above.
                    unsafe {
                        self.comm
                            .send(self.ptr(&body), len, NcclDataType::Uint8, dst)
                    }
                    .map_err(self.fail(op))?;
                }
                self.comm
                    .stream()
                    .synchronize()
                    .map_err(|e| self.fail(op)(cuda("cuStreamSynchronize", e)))?;
                Ok(CollectiveOutput::none())
            }
            Collective::Recv { src } => {
                let h = self.alloc(op, META_WORDS * 8)?;
                // SAFETY: `h` holds a header.
                unsafe {
                    self.comm
                        .recv(self.ptr(&h), META_WORDS * 8, NcclDataType::Uint8, src)
                }
                .map_err(self.fail(op))?;
                let words: Vec<u64> = self
                    .download(op, &h, META_WORDS * 8)?
                    .chunks(8)
                    .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
                    .collect();
                let dtype = words[1]
                    .checked_sub(1)
                    .and_then(dtype_from_code)
                    .ok_or_else(|| self.invalid(op, "the sender's header is corrupt".into()))?;
                let shape: Vec<usize> = words[3..3 + (words[2] as usize).min(MAX_DIMS)]
                    .iter()
                    .map(|x| *x as usize)
                    .collect();
                let len = shape.iter().product::<usize>() * dtype.size();
                let body = self.alloc(op, len)?;
                if len > 0 {
                    // SAFETY: `body` holds `len` bytes.
                    unsafe {
                        self.comm
                            .recv(self.ptr(&body), len, NcclDataType::Uint8, src)
                    }
                    .map_err(self.fail(op))?;
                }
                let bytes = self.download(op, &body, len)?;
                Ok(CollectiveOutput::tensor(TensorData::from_bytes_vec(
                    bytes, shape, dtype,
                )))
            }
            Collective::Barrier => {
                self.exchange(op, &[0])?;
                Ok(CollectiveOutput::none())
            }
        }
    }

    fn all_to_all(
        &self,
        data: TensorData,
        split_dim: usize,
        concat_dim: usize,
        send_sizes: Vec<usize>,
    ) -> Res<CollectiveOutput> {
        let op = OpKind::AllToAll;
        let me = self.info.index;
        let size = self.info.size();
        if send_sizes.len() != size || send_sizes.iter().sum::<usize>() != data.shape()[split_dim] {
            return Err(self.invalid(
                op,
                format!("send sizes {send_sizes:?} must give one slice per rank summing to dim {split_dim}"),
            ));
        }
        let extra: Vec<u64> = send_sizes.iter().map(|s| *s as u64).collect();
        let all = self.agree(op, Some(&data), &extra, &[split_dim, concat_dim])?;
        let eb = data.dtype().size();
        // What each source sends this rank: its shape with `send_sizes[me]` along split_dim.
        let pieces: Vec<Vec<usize>> = all
            .iter()
            .map(|(_, shape, sizes)| {
                let mut s = shape.clone();
                s[split_dim] = sizes[me] as usize;
                s
            })
            .collect();
        for (src, piece) in pieces.iter().enumerate() {
            let agrees = piece
                .iter()
                .zip(&pieces[0])
                .enumerate()
                .all(|(d, (a, b))| d == concat_dim || a == b);
            if !agrees {
                return Err(CollectiveError::Mismatch {
                    group: self.info.label.clone(),
                    seq: 0,
                    rank_a: self.info.ranks[0],
                    call_a: format!("all_to_all sending a slice of shape {:?}", pieces[0]),
                    rank_b: self.info.ranks[src],
                    call_b: format!(
                        "all_to_all sending a slice of shape {piece:?}, which cannot be concatenated along dim {concat_dim}"
                    ),
                });
            }
        }
        let view = AlongDim::new(data.shape(), split_dim, eb);
        let input = self.upload(op, data.as_bytes())?;
        let send_bytes: Vec<usize> = send_sizes.iter().map(|s| view.bytes_with(*s)).collect();
        let send = self.alloc(op, send_bytes.iter().sum())?;
        let send_at = offsets(&send_bytes);
        for (j, (start, len)) in offsets(&send_sizes)
            .into_iter()
            .zip(&send_sizes)
            .enumerate()
        {
            let c = narrow_copy(view, start, *len).shifted(0, send_at[j]);
            // SAFETY: the plan stays inside both buffers.
            unsafe { self.comm.copy_2d(self.ptr(&input), self.ptr(&send), c) }
                .map_err(self.fail(op))?;
        }
        let recv_bytes: Vec<usize> = pieces
            .iter()
            .map(|p| p.iter().product::<usize>() * eb)
            .collect();
        let recv = self.alloc(op, recv_bytes.iter().sum())?;
        let recv_at = offsets(&recv_bytes);
        let (sp, rp) = (self.ptr(&send), self.ptr(&recv));
        let sends: Vec<(u64, usize)> = (0..size)
            .map(|j| (sp + send_at[j] as u64, send_bytes[j]))
            .collect();
        let recvs: Vec<(u64, usize)> = (0..size)
            .map(|j| (rp + recv_at[j] as u64, recv_bytes[j]))
            .collect();
        // SAFETY: every (pointer, count) lies inside `send` or `recv`.
        unsafe { self.comm.all_to_all(&sends, &recvs, NcclDataType::Uint8) }
            .map_err(self.fail(op))?;
        let sizes: Vec<usize> = pieces.iter().map(|p| p[concat_dim]).collect();
        let total: usize = sizes.iter().sum();
        let mut shape = pieces[0].clone();
        shape[concat_dim] = total;
        let out_len = shape.iter().product::<usize>() * eb;
        let out = self.alloc(op, out_len)?;
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
            unsafe { self.comm.copy_2d(self.ptr(&recv), self.ptr(&out), c) }
                .map_err(self.fail(op))?;
        }
        let bytes = self.download(op, &out, out_len)?;
        Ok(CollectiveOutput {
            data: Some(TensorData::from_bytes_vec(bytes, shape, data.dtype())),
            sizes,
        })
    }

    fn check_reducible(&self, op: OpKind, data: &TensorData) -> Res<()> {
        if reducible(data.dtype()) {
            Ok(())
        } else {
            Err(CollectiveError::UnsupportedDtype {
                op: op.name().into(),
                dtype: format!("{:?}", data.dtype()),
            })
        }
    }
}

fn cuda(call: &'static str, e: cudarc::driver::DriverError) -> NcclError {
    NcclError::Cuda {
        call,
        message: format!("{e:?}"),
    }
}

impl Communicator for NcclCommunicator {
    fn info(&self) -> &GroupInfo {
        &self.info
    }

    fn run(&self, call: Collective) -> CollectiveResult {
        let bytes = CallBytes::of(&call, &self.info);
        let out = self.execute(call)?;
        let produced = out.data.as_ref().map_or(0, |d| d.as_bytes().len());
        let (sent, received) = bytes.traffic(produced);
        for stats in [&self.stats, &*self.rank_stats] {
            stats
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .record(bytes.kind(), sent, received);
        }
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
mod tests {
    use super::*;

    /// Without CUDA the launchers fail with the library message, before touching cudarc.
    #[test]
    fn launching_without_cuda_is_a_clear_error() {
        if super::super::library::check_libraries().is_ok() {
            return;
        }
        let e = launch_local(&[0], |_ctx| Ok::<(), String>(())).unwrap_err();
        assert!(e.first().message.contains("lib"), "{e}");
    }
}
