//! One rank's NCCL communicator and the collectives on raw device buffers.
//!
//! Built on cudarc's `result`/`sys` layer rather than its `Comm`: `Comm` hides the raw handle
//! that `ncclCommSplit` needs (the safe split is missing for CUDA 12.8/13.x), is not `Send`,
//! and takes only cudarc's own slices, while Burn's CUDA tensors live in CubeCL's allocations.
//! Every call runs on the communicator's own CUDA stream; [`NcclComm::wait_for`] orders it after
//! work on another stream and [`DeviceWork`] lets other streams (or the host) wait for it.
//!
//! Communicators are non-blocking ([`super::config`]): a call may return `ncclInProgress`, and
//! the owning thread then polls `ncclCommGetAsyncError` until it is enqueued, under the watch
//! of the engine call in progress ([`NcclComm::set_watch`]), before anything else touches the
//! stream. Only that thread ever aborts the communicator (see [`super::watchdog`]).

use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::ThreadId;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError, sys as cuda};
use cudarc::nccl::result::NcclStatus;
use cudarc::nccl::{result, sys};

use super::config::NcclConfig;
use super::layout::{Copy2d, CopyPlan, MAX_COPY_PITCH};
use super::library::{LibraryMissing, check_libraries};
use super::split::{SplitError, SplitKey};
use super::types::{NcclDataType, NcclRedOp};
use super::unique_id::{IdError, UniqueIdBytes};
use super::watchdog::{Abort, Guard, InFlight, Stopped, Watch};

/// A device address (`CUdeviceptr`).
pub type DevicePtr = u64;

/// What the NCCL engine can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NcclError {
    /// The CUDA driver or NCCL could not be loaded.
    #[error(transparent)]
    Library(#[from] LibraryMissing),
    /// The unique id or the launcher's environment could not be read.
    #[error(transparent)]
    Id(#[from] IdError),
    /// A group cannot be made by `ncclCommSplit`.
    #[error(transparent)]
    Split(#[from] SplitError),
    /// An NCCL call returned an error.
    #[error("{call} failed: {message}")]
    Nccl {
        /// The NCCL function.
        call: &'static str,
        /// NCCL's result code and its description.
        message: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA {call} failed: {message}")]
    Cuda {
        /// The driver function.
        call: &'static str,
        /// The driver's error.
        message: String,
    },
    /// Bad input caught before NCCL is called: a GPU that does not exist, a rank outside the
    /// world, buffer counts that do not match, a communicator used from a second thread.
    #[error("{0}")]
    InvalidArgument(String),
    /// A case the engine does not handle yet, such as a tensor that is not on a CUDA device.
    #[error("not supported yet: {0}")]
    Unsupported(String),
    /// The watchdog ended the call (another rank failed, a peer vanished, the timeout).
    #[error(transparent)]
    Stopped(#[from] Stopped),
    /// The communicator was aborted after an earlier failure and cannot be used again.
    #[error("the NCCL communicator of rank {rank} of {size} was aborted after an earlier failure")]
    Aborted {
        /// The rank in the communicator.
        rank: usize,
        /// The communicator's size.
        size: usize,
    },
}

fn nccl_err(call: &'static str) -> impl Fn(result::NcclError) -> NcclError {
    move |e| {
        // SAFETY: ncclGetErrorString returns a static C string for every result code.
        let text = unsafe { CStr::from_ptr(sys::ncclGetErrorString(e.0)) };
        NcclError::Nccl {
            call,
            message: format!("{:?}: {}", e.0, text.to_string_lossy()),
        }
    }
}

fn cuda_err(call: &'static str) -> impl Fn(DriverError) -> NcclError {
    move |e| NcclError::Cuda {
        call,
        message: format!("{e:?}"),
    }
}

fn check_cuda(call: &'static str, r: cuda::CUresult) -> Result<(), NcclError> {
    r.result().map_err(cuda_err(call))
}

pub(crate) fn to_sys_dtype(t: NcclDataType) -> sys::ncclDataType_t {
    use sys::ncclDataType_t as T;
    match t {
        NcclDataType::Int8 => T::ncclInt8,
        NcclDataType::Uint8 => T::ncclUint8,
        NcclDataType::Int32 => T::ncclInt32,
        NcclDataType::Uint32 => T::ncclUint32,
        NcclDataType::Int64 => T::ncclInt64,
        NcclDataType::Uint64 => T::ncclUint64,
        NcclDataType::Float16 => T::ncclFloat16,
        NcclDataType::Float32 => T::ncclFloat32,
        NcclDataType::Float64 => T::ncclFloat64,
        NcclDataType::Bfloat16 => T::ncclBfloat16,
    }
}

pub(crate) fn to_sys_op(op: NcclRedOp) -> sys::ncclRedOp_t {
    use sys::ncclRedOp_t as O;
    match op {
        NcclRedOp::Sum => O::ncclSum,
        NcclRedOp::Prod => O::ncclProd,
        NcclRedOp::Max => O::ncclMax,
        NcclRedOp::Min => O::ncclMin,
        NcclRedOp::Avg => O::ncclAvg,
    }
}

/// A fresh NCCL unique id (rank 0 creates it and hands it to the others).
pub fn new_unique_id() -> Result<UniqueIdBytes, NcclError> {
    check_libraries()?;
    let id = result::get_uniqueid().map_err(nccl_err("ncclGetUniqueId"))?;
    Ok(UniqueIdBytes(id.internal.map(|c| c as u8)))
}

/// The NCCL version as `major * 10000 + minor * 100 + patch` (2.27.5 is 22705).
pub fn nccl_version() -> Result<i32, NcclError> {
    check_libraries()?;
    result::get_nccl_version().map_err(nccl_err("ncclGetVersion"))
}

/// One rank's communicator on one GPU, with the stream its collectives run on.
pub struct NcclComm {
    raw: sys::ncclComm_t,
    rank: usize,
    size: usize,
    stream: Arc<CudaStream>,
    /// The thread that issues this communicator's calls: the first to use it, its rank's.
    /// NCCL matches collectives across ranks by issue order, so a rank must issue them from
    /// one thread in program order; a second thread (a lock would only serialise it) could
    /// interleave differently on different ranks and hang them.
    owner: OnceLock<ThreadId>,
    /// Set once `ncclCommAbort` ran: no call may use `raw` afterwards. Only the owner aborts,
    /// so its check in `enter` and its next call cannot be separated by an abort.
    aborted: AtomicBool,
    /// The watch of the engine call in progress: what bounds the polls of `ncclInProgress`.
    watch: Mutex<Option<Watch>>,
}

/// How long dropping a communicator waits for `ncclCommFinalize` before it aborts instead.
const FINALIZE_LIMIT: Duration = Duration::from_secs(30);

// SAFETY: an NCCL communicator may move to another thread before its first call; the CUDA
// context is bound before every call.
unsafe impl Send for NcclComm {}
// SAFETY: shared references issue calls only from the owning thread (`enter` checks it), so
// calls are never concurrent.
unsafe impl Sync for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclComm(rank {} of {}, GPU {})",
            self.rank,
            self.size,
            self.stream.context().ordinal()
        )
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::SeqCst) {
            return;
        }
        // Errors cannot be reported from drop; a failed destroy leaks the communicator only.
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: the stream is live; querying it does not block.
        let idle =
            unsafe { cuda::cuStreamQuery(self.stream.cu_stream()) } == cuda::CUresult::CUDA_SUCCESS;
        if idle && !std::thread::panicking() && self.finalize() {
            // SAFETY: `raw` came from a successful init or split, is finalized, and is
            // destroyed once.
            let _ = unsafe { result::comm_destroy(self.raw) };
        } else {
            // Work in flight (a peer never came) or a panicking rank: destroying would wait
            // for that work; aborting ends it and tells the peers.
            self.abort();
        }
    }
}

impl Abort for NcclComm {
    /// `ncclCommAbort`, once. Called by the owning thread only (the watchdog's monitor marks a
    /// call stopped; the owner aborts at its next poll), never while a thread is inside NCCL
    /// on this communicator, as NCCL requires.
    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            let _ = self.stream.context().bind_to_thread();
            // SAFETY: `raw` is live until this first abort, and no call on it is in progress
            // (the owner is here, not inside NCCL).
            let _ = unsafe { result::comm_abort(self.raw) };
        }
    }
}

/// Work issued on a communicator's stream, for the watchdog to poll.
struct Issued<'a> {
    comm: &'a NcclComm,
    event: CudaEvent,
}

impl InFlight for Issued<'_> {
    fn poll(&self) -> Result<bool, String> {
        match self.comm.async_error() {
            Some(e) => Err(e),
            None => event_state(self.event.try_is_complete()),
        }
    }
}

/// What a query of a CUDA event says for a poll: done, still running, or the CUDA error that
/// ended the work (an illegal address, say), which `is_complete` would report as "running"
/// until the timeout blamed a missing rank.
pub(crate) fn event_state(query: Result<bool, DriverError>) -> Result<bool, String> {
    query.map_err(|e| {
        format!(
            "CUDA reported {:?} for the work on this rank's NCCL stream (a kernel before or \
             during the collective failed; run with CUDA_LAUNCH_BLOCKING=1 to find which)",
            e.0
        )
    })
}

/// A non-blocking operation on a communicator, until `ncclCommGetAsyncError` leaves
/// `ncclInProgress`.
struct Pending<'a>(&'a NcclComm);

impl InFlight for Pending<'_> {
    fn poll(&self) -> Result<bool, String> {
        self.0.async_state()
    }
}

/// Checks that the CUDA driver loads and GPU `ordinal` exists: a clear error where Burn's CUDA
/// backend would panic on its device thread.
pub fn check_gpu(ordinal: usize) -> Result<(), NcclError> {
    super::library::check_driver()?;
    let count = CudaContext::device_count().map_err(cuda_err("cuDeviceGetCount"))?;
    if ordinal >= count as usize {
        return Err(NcclError::InvalidArgument(format!(
            "GPU {ordinal} does not exist: this machine has {count} CUDA device(s) (ranks take \
             the GPU of the launcher's LOCAL_RANK, else their rank)"
        )));
    }
    Ok(())
}

fn context(ordinal: usize) -> Result<(Arc<CudaContext>, Arc<CudaStream>), NcclError> {
    check_gpu(ordinal)?;
    let ctx = CudaContext::new(ordinal).map_err(cuda_err("cuCtxCreate"))?;
    // SAFETY: this context's buffers are the engine's staging buffers, used on their
    // communicator's stream only and reused after the engine waited for that stream, so
    // cudarc's per-buffer events would order nothing (and cost an event per use).
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
    Ok((ctx, stream))
}

impl NcclComm {
    fn from_raw(raw: sys::ncclComm_t, rank: usize, size: usize, stream: Arc<CudaStream>) -> Self {
        Self {
            raw,
            rank,
            size,
            stream,
            owner: OnceLock::new(),
            aborted: AtomicBool::new(false),
            watch: Mutex::new(None),
        }
    }

    /// Bounds this communicator's polls of `ncclInProgress` by `watch` (the engine call in
    /// progress), or lifts the bound (`None`: the polls then wait as long as NCCL does).
    pub fn set_watch(&self, watch: Option<Watch>) {
        *self.watch.lock().unwrap_or_else(|p| p.into_inner()) = watch;
    }

    fn current_watch(&self) -> Option<Watch> {
        self.watch.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// `ncclCommGetAsyncError` as a poll: `Ok(true)` when nothing is in progress, `Ok(false)`
    /// while an operation is, `Err` with NCCL's error.
    fn async_state(&self) -> Result<bool, String> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(format!(
                "the communicator of rank {} was aborted",
                self.rank
            ));
        }
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is live (not aborted, and only this thread aborts it).
        let r = unsafe { sys::ncclCommGetAsyncError(self.raw, &mut state) };
        match (r, state) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess) => Ok(true),
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclInProgress) => Ok(false),
            (sys::ncclResult_t::ncclSuccess, e) | (e, _) => {
                Err(nccl_err("ncclCommGetAsyncError")(result::NcclError(e)).to_string())
            }
        }
    }

    /// Waits until no operation is in progress on this communicator, under `watch` (else the
    /// communicator's current watch, else as long as NCCL takes). A stop or an NCCL error
    /// aborts the communicator here, on its owner's thread.
    pub fn settle(&self, watch: Option<&Watch>) -> Result<(), NcclError> {
        let pending = Pending(self);
        if let Some(w) = watch.cloned().or_else(|| self.current_watch()) {
            return super::watchdog::wait(&pending, &w).map_err(NcclError::from);
        }
        let mut sleep = Duration::from_micros(10);
        loop {
            match pending.poll() {
                Ok(true) => return Ok(()),
                Ok(false) => std::thread::sleep(sleep),
                Err(e) => {
                    self.abort();
                    return Err(NcclError::Stopped(Stopped::Failed(e)));
                }
            }
            sleep = (sleep * 2).min(Duration::from_millis(1));
        }
    }

    /// `ncclCommFinalize` and its completion, within [`FINALIZE_LIMIT`]: whether the
    /// communicator may now be destroyed without waiting on anyone.
    fn finalize(&self) -> bool {
        // SAFETY: `raw` is live; finalizing only flushes what was issued.
        if unsafe { result::comm_finalize(self.raw) }.is_err() {
            return false;
        }
        let deadline = std::time::Instant::now() + FINALIZE_LIMIT;
        loop {
            match self.async_state() {
                Ok(true) => return true,
                Ok(false) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                _ => return false,
            }
        }
    }

    /// Joins the communicator of `world_size` ranks named by `id` as `rank`, on GPU `ordinal`
    /// (one process per GPU), non-blocking: the join may still be in progress when this
    /// returns; [`Self::settle`] waits for it (under a watch, so a rank that never comes is a
    /// timeout, not a hang).
    pub fn init_rank(
        ordinal: usize,
        rank: usize,
        world_size: usize,
        id: &UniqueIdBytes,
    ) -> Result<Self, NcclError> {
        check_libraries()?;
        if rank >= world_size {
            return Err(NcclError::InvalidArgument(format!(
                "rank {rank} is outside a world of {world_size}"
            )));
        }
        let (ctx, stream) = context(ordinal)?;
        ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        let id = sys::ncclUniqueId {
            internal: id.0.map(|b| b as std::ffi::c_char),
        };
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        let mut config = NcclConfig::non_blocking();
        // SAFETY: `raw` is written by the call (also when it returns ncclInProgress); the
        // config is NCCL 2.17's layout, which NCCL reads by its `size` (see `config`).
        unsafe {
            sys::ncclCommInitRankConfig(
                &mut raw,
                world_size as i32,
                id,
                rank as i32,
                (&mut config as *mut NcclConfig).cast(),
            )
            .result()
            .map_err(nccl_err("ncclCommInitRankConfig"))?;
        }
        Ok(Self::from_raw(raw, rank, world_size, stream))
    }

    /// One communicator per GPU of `ordinals`, all in this process; rank `i` runs on
    /// `ordinals[i]`. This is what `ncclCommInitAll` does (an id of this process, then one
    /// `ncclCommInitRank` per GPU in one group), with the non-blocking config, which
    /// `ncclCommInitAll` cannot take: NCCL makes a split block or not as its parent does, and a
    /// split that blocks cannot be aborted by its owner. The joins may still be in progress:
    /// [`Self::settle`] each, then hand each to its rank's thread.
    pub fn init_local(ordinals: &[usize]) -> Result<Vec<Self>, NcclError> {
        check_libraries()?;
        if ordinals.is_empty() {
            return Err(NcclError::InvalidArgument("no GPU given".into()));
        }
        let streams = ordinals
            .iter()
            .map(|o| context(*o).map(|(_, s)| s))
            .collect::<Result<Vec<_>, _>>()?;
        let size = ordinals.len();
        // The id's root listens in this process, which lives through the launch.
        let id = result::get_uniqueid().map_err(nccl_err("ncclGetUniqueId"))?;
        let mut raws = vec![std::ptr::null_mut(); size];
        let mut config = NcclConfig::non_blocking();
        result::group_start().map_err(nccl_err("ncclGroupStart"))?;
        let mut first_error = None;
        for (rank, (raw, stream)) in raws.iter_mut().zip(&streams).enumerate() {
            // NCCL takes the GPU from the thread's current context.
            if let Err(e) = stream.context().bind_to_thread() {
                first_error = Some(cuda_err("cuCtxSetCurrent")(e));
                break;
            }
            // SAFETY: `raw` is this rank's slot; the config as in `init_rank`.
            let joined = unsafe {
                sys::ncclCommInitRankConfig(
                    raw,
                    size as i32,
                    id,
                    rank as i32,
                    (&mut config as *mut NcclConfig).cast(),
                )
                .result()
            };
            if let Err(e) = joined {
                first_error = Some(nccl_err("ncclCommInitRankConfig")(e));
                break;
            }
        }
        // Closed even after an error, so NCCL's group state stays balanced.
        let ended = result::group_end().map_err(nccl_err("ncclGroupEnd"));
        let comms: Vec<Self> = raws
            .into_iter()
            .zip(streams)
            .enumerate()
            .filter(|(_, (raw, _))| !raw.is_null())
            .map(|(rank, (raw, stream))| Self::from_raw(raw, rank, size, stream))
            .collect();
        if let Some(e) = first_error.or(ended.err()) {
            comms.iter().for_each(Abort::abort);
            return Err(e);
        }
        Ok(comms)
    }

    /// The communicator of the ranks that pass the same `key.color` (ordered by `key.key`):
    /// collective over this communicator, every rank calls it. See [`super::split`]. Waits
    /// for the new communicator under `watch` (guarding this communicator): when a rank never
    /// joins (it failed before its mesh existed), the watch's timeout or the process's failure
    /// signal ends the wait, and this thread aborts the parent (which ends the child's
    /// creation, as NCCL ties them) and the child.
    ///
    /// A non-blocking split reports its progress on the parent. NCCL 2.18 hands the new
    /// communicator back at once; newer NCCL (2.28 on an H200 here) leaves it null until the
    /// split is complete and writes it from its own thread then. So the slot lives on the heap
    /// and is read once the parent settles; on a failure before that it is leaked, since
    /// NCCL may still write to it.
    pub fn split(&self, key: SplitKey, watch: &Watch) -> Result<Self, NcclError> {
        self.enter()?;
        let stream = self
            .stream
            .context()
            .new_stream()
            .map_err(cuda_err("cuStreamCreate"))?;
        let slot: *mut sys::ncclComm_t = Box::into_raw(Box::new(std::ptr::null_mut()));
        let mut config = NcclConfig::non_blocking();
        // SAFETY: `self.raw` is live; `slot` stays allocated for as long as NCCL may write it.
        let status = unsafe {
            sys::ncclCommSplit(
                self.raw,
                key.color,
                key.key,
                slot,
                (&mut config as *mut NcclConfig).cast(),
            )
            .result()
        };
        if let Err(e) = status {
            return Err(nccl_err("ncclCommSplit")(e));
        }
        // Waits for the split on the parent; on failure the watch has aborted the parent.
        self.settle(Some(watch))?;
        // SAFETY: the split is complete and NCCL no longer touches the slot; NCCL stores it with
        // release ordering, read here with acquire, then freed.
        let raw = unsafe {
            let raw = std::sync::atomic::AtomicPtr::from_ptr(slot).load(Ordering::Acquire);
            drop(Box::from_raw(slot));
            raw
        };
        if raw.is_null() {
            return Err(NcclError::Nccl {
                call: "ncclCommSplit",
                message: "returned no communicator".into(),
            });
        }
        let mut child = Self::from_raw(raw, self.rank, 0, stream);
        if let Err(e) = child.settle(Some(watch)) {
            child.abort();
            return Err(e);
        }
        // SAFETY: `raw` is the communicator the split just created, now ready.
        let (rank, size) = unsafe {
            (
                result::comm_user_rank(raw).map_err(nccl_err("ncclCommUserRank"))?,
                result::comm_count(raw).map_err(nccl_err("ncclCommCount"))?,
            )
        };
        child.rank = rank as usize;
        child.size = size as usize;
        Ok(child)
    }

    /// This rank's position in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the communicator.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The stream every collective of this communicator runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Checks that the calling thread owns the communicator (the first caller does) and binds
    /// its CUDA context, before any call.
    fn enter(&self) -> Result<(), NcclError> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(NcclError::Aborted {
                rank: self.rank,
                size: self.size,
            });
        }
        let me = std::thread::current().id();
        let owner = *self.owner.get_or_init(|| me);
        if owner != me {
            return Err(NcclError::InvalidArgument(format!(
                "the NCCL communicator of rank {} of {} is used from thread {me:?} but belongs \
                 to {owner:?}, which used it first: issue every collective of a rank from that \
                 rank's own thread (two threads could issue them in different orders on \
                 different ranks and hang them)",
                self.rank, self.size
            )));
        }
        self.stream
            .context()
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))
    }

    fn cu_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as _
    }

    /// Makes the communicator's stream wait for the work issued so far on `producer` (the
    /// kernels that wrote the buffers about to be sent), without blocking the host.
    pub fn wait_for(&self, producer: &CudaStream) -> Result<(), NcclError> {
        self.stream
            .join(producer)
            .map_err(cuda_err("cuStreamWaitEvent"))
    }

    /// The GPU this communicator runs on.
    pub fn ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// An error NCCL found while work ran (a peer that aborted or vanished), if any.
    pub fn async_error(&self) -> Option<String> {
        self.async_state().err()
    }

    /// Waits, under `guard`, for the work issued so far on the stream: done, or the reason it
    /// never will be (the watchdog's, or NCCL's asynchronous error, which aborts this
    /// communicator). Polls, so a stuck peer never blocks the thread past the watchdog.
    pub fn finish(&self, guard: &Guard) -> Result<(), NcclError> {
        self.settle(Some(guard.watch()))?;
        let event = self
            .stream
            .record_event(None)
            .map_err(cuda_err("cuEventRecord"))?;
        super::watchdog::wait(&Issued { comm: self, event }, guard).map_err(NcclError::from)
    }

    /// Marks the end of the work issued so far, for other streams or the host to wait on.
    pub fn record(&self) -> Result<DeviceWork, NcclError> {
        // An event recorded before NCCL enqueued the call would complete too early.
        self.settle(None)?;
        let event = self
            .stream
            .record_event(None)
            .map_err(cuda_err("cuEventRecord"))?;
        Ok(DeviceWork { event })
    }

    /// Issues one NCCL call on this communicator's stream: from the owning thread with the
    /// context bound (`enter`), `call` gets the live raw communicator and its stream, and a
    /// failure is named after `ffi_name`. A call still in progress (non-blocking) is settled
    /// before this returns, so the next work on the stream comes after it. Every single-call
    /// collective goes through here, so none can skip those checks.
    fn issue<F>(&self, ffi_name: &'static str, call: F) -> Result<(), NcclError>
    where
        F: FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Result<NcclStatus, result::NcclError>,
    {
        self.enter()?;
        match call(self.raw, self.cu_stream()).map_err(nccl_err(ffi_name))? {
            NcclStatus::InProgress => self.settle(None),
            _ => Ok(()),
        }
    }

    /// `all_gather`: `count` elements from every rank, rank-major into `recv`
    /// (`count * size` elements).
    ///
    /// # Safety
    /// `send` and `recv` are live allocations on this communicator's GPU of the stated sizes,
    /// not written by other work until the collective has finished on [`Self::stream`].
    pub unsafe fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: NcclDataType,
    ) -> Result<(), NcclError> {
        let dtype = to_sys_dtype(dtype);
        self.issue("ncclAllGather", |comm, stream| {
            // SAFETY: the caller's contract; `comm` and `stream` are this communicator's.
            unsafe { result::all_gather(send as _, recv as _, count, dtype, comm, stream) }
        })
    }

    /// `reduce_scatter`: rank `i` receives the reduction of every rank's piece `i` of
    /// `recv_count` elements.
    ///
    /// # Safety
    /// As [`Self::all_gather`]; `send` holds `recv_count * size` elements.
    pub unsafe fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: NcclDataType,
        op: NcclRedOp,
    ) -> Result<(), NcclError> {
        let (dtype, op) = (to_sys_dtype(dtype), to_sys_op(op));
        self.issue("ncclReduceScatter", |comm, stream| {
            // SAFETY: the caller's contract; `comm` and `stream` are this communicator's.
            unsafe {
                result::reduce_scatter(send as _, recv as _, recv_count, dtype, op, comm, stream)
            }
        })
    }

    /// `all_reduce` of `count` elements (`send == recv` reduces in place).
    ///
    /// # Safety
    /// As [`Self::all_gather`].
    pub unsafe fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: NcclDataType,
        op: NcclRedOp,
    ) -> Result<(), NcclError> {
        let (dtype, op) = (to_sys_dtype(dtype), to_sys_op(op));
        self.issue("ncclAllReduce", |comm, stream| {
            // SAFETY: the caller's contract; `comm` and `stream` are this communicator's.
            unsafe { result::all_reduce(send as _, recv as _, count, dtype, op, comm, stream) }
        })
    }

    /// `broadcast` of `count` elements from `root`'s `send` into every rank's `recv`
    /// (`send` is read on the root only).
    ///
    /// # Safety
    /// As [`Self::all_gather`].
    pub unsafe fn broadcast(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: NcclDataType,
        root: usize,
    ) -> Result<(), NcclError> {
        let (dtype, root) = (to_sys_dtype(dtype), root as i32);
        self.issue("ncclBroadcast", |comm, stream| {
            // SAFETY: the caller's contract; `comm` and `stream` are this communicator's.
            unsafe { result::broadcast(send as _, recv as _, count, dtype, root, comm, stream) }
        })
    }

    /// Sends `count` elements to `peer`, which must post the matching [`Self::recv`].
    ///
    /// # Safety
    /// As [`Self::all_gather`].
    pub unsafe fn send(
        &self,
        send: DevicePtr,
        count: usize,
        dtype: NcclDataType,
        peer: usize,
    ) -> Result<(), NcclError> {
        let (dtype, peer) = (to_sys_dtype(dtype), peer as i32);
        self.issue("ncclSend", |comm, stream| {
            // SAFETY: the caller's contract; `comm` and `stream` are this communicator's.
            unsafe { result::send(send as _, count, dtype, peer, comm, stream) }
        })
    }

    /// Receives `count` elements from `peer`.
    ///
    /// # Safety
    /// As [`Self::all_gather`].
    pub unsafe fn recv(
        &self,
        recv: DevicePtr,
        count: usize,
        dtype: NcclDataType,
        peer: usize,
    ) -> Result<(), NcclError> {
        let (dtype, peer) = (to_sys_dtype(dtype), peer as i32);
        self.issue("ncclRecv", |comm, stream| {
            // SAFETY: the caller's contract; `comm` and `stream` are this communicator's.
            unsafe { result::recv(recv as _, count, dtype, peer, comm, stream) }
        })
    }

    /// all_to_all as one group of sends and receives (some NCCL builds, such as the 2.27
    /// wheel, lack `ncclAlltoAll`, and pieces may differ in size): `sends[j]` goes to rank `j`,
    /// `recvs[j]` comes from rank `j`, each as (buffer, element count); empty pieces are
    /// skipped.
    ///
    /// # Safety
    /// As [`Self::all_gather`], for every buffer.
    pub unsafe fn all_to_all(
        &self,
        sends: &[(DevicePtr, usize)],
        recvs: &[(DevicePtr, usize)],
        dtype: NcclDataType,
    ) -> Result<(), NcclError> {
        if sends.len() != self.size || recvs.len() != self.size {
            return Err(NcclError::InvalidArgument(format!(
                "all_to_all needs one send and one receive per rank ({}), got {} and {}",
                self.size,
                sends.len(),
                recvs.len()
            )));
        }
        self.enter()?;
        let t = to_sys_dtype(dtype);
        result::group_start().map_err(nccl_err("ncclGroupStart"))?;
        let mut first_error = None;
        for peer in 0..self.size {
            let (s, sc) = sends[peer];
            let (r, rc) = recvs[peer];
            // SAFETY: the caller's contract.
            let issued = unsafe {
                let sent = if sc > 0 {
                    result::send(s as _, sc, t, peer as i32, self.raw, self.cu_stream()).map(drop)
                } else {
                    Ok(())
                };
                sent.and_then(|()| {
                    if rc > 0 {
                        result::recv(r as _, rc, t, peer as i32, self.raw, self.cu_stream())
                            .map(drop)
                    } else {
                        Ok(())
                    }
                })
            };
            if let Err(e) = issued {
                first_error = Some(nccl_err("ncclSend/ncclRecv")(e));
                break;
            }
        }
        // The group is closed even after an error, so NCCL's group state stays balanced.
        let ended = result::group_end().map_err(nccl_err("ncclGroupEnd"));
        match (first_error, ended) {
            (Some(e), _) | (None, Err(e)) => Err(e),
            (None, Ok(NcclStatus::InProgress)) => self.settle(None),
            (None, Ok(_)) => Ok(()),
        }
    }

    /// A device-to-device copy on the communicator's stream (packing and unpacking uneven
    /// pieces, see [`super::layout`]): linear where the rows are back to back, strided where
    /// the pitches allow, row by row past the 2-D copy's pitch limit.
    ///
    /// # Safety
    /// The copy's source and destination ranges lie inside live allocations at `src`/`dst`.
    pub unsafe fn copy_2d(
        &self,
        src: DevicePtr,
        dst: DevicePtr,
        copy: Copy2d,
    ) -> Result<(), NcclError> {
        let linear = |from: usize, to: usize, bytes: usize| {
            // SAFETY: the caller's contract covers every byte of the copy.
            check_cuda("cuMemcpyDtoDAsync", unsafe {
                cuda::cuMemcpyDtoDAsync_v2(
                    dst + to as u64,
                    src + from as u64,
                    bytes,
                    self.stream.cu_stream(),
                )
            })
        };
        let copy = match copy.plan(MAX_COPY_PITCH) {
            CopyPlan::Empty => return Ok(()),
            CopyPlan::Linear {
                src_offset,
                dst_offset,
                bytes,
            } => {
                self.enter()?;
                return linear(src_offset, dst_offset, bytes);
            }
            CopyPlan::Rows(c) => {
                self.enter()?;
                for r in 0..c.height {
                    linear(
                        c.src_offset + r * c.src_pitch,
                        c.dst_offset + r * c.dst_pitch,
                        c.width,
                    )?;
                }
                return Ok(());
            }
            CopyPlan::Strided(c) => c,
        };
        self.enter()?;
        let params = cuda::CUDA_MEMCPY2D {
            srcXInBytes: copy.src_offset,
            srcY: 0,
            srcMemoryType: cuda::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: copy.src_pitch.max(copy.width),
            dstXInBytes: copy.dst_offset,
            dstY: 0,
            dstMemoryType: cuda::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: copy.dst_pitch.max(copy.width),
            WidthInBytes: copy.width,
            Height: copy.height,
        };
        // SAFETY: the caller's contract; `params` lives through the call.
        check_cuda("cuMemcpy2DAsync", unsafe {
            cuda::cuMemcpy2DAsync_v2(&params, self.stream.cu_stream())
        })
    }
}

/// Collective work issued on a communicator's stream: other streams can wait for it without
/// blocking the host, or the host can block on it.
#[derive(Debug)]
pub struct DeviceWork {
    event: CudaEvent,
}

impl DeviceWork {
    /// Orders everything issued later on `stream` after this work.
    pub fn wait_on(&self, stream: &CudaStream) -> Result<(), NcclError> {
        stream
            .wait(&self.event)
            .map_err(cuda_err("cuStreamWaitEvent"))
    }

    /// Blocks the calling thread until the work is done.
    pub fn synchronize(&self) -> Result<(), NcclError> {
        self.event
            .synchronize()
            .map_err(cuda_err("cuEventSynchronize"))
    }

    /// Whether the work is done (never blocks), or the CUDA error that ended it.
    pub fn is_done(&self) -> Result<bool, NcclError> {
        event_state(self.event.try_is_complete()).map_err(|message| NcclError::Cuda {
            call: "cuEventQuery",
            message,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::nccl::types::NcclDataType;

    #[test]
    fn our_nccl_codes_equal_cudarcs() {
        for t in [
            NcclDataType::Int8,
            NcclDataType::Uint8,
            NcclDataType::Int32,
            NcclDataType::Uint32,
            NcclDataType::Int64,
            NcclDataType::Uint64,
            NcclDataType::Float16,
            NcclDataType::Float32,
            NcclDataType::Float64,
            NcclDataType::Bfloat16,
        ] {
            assert_eq!(to_sys_dtype(t) as u32, t as u32, "{t:?}");
        }
        for op in [
            NcclRedOp::Sum,
            NcclRedOp::Prod,
            NcclRedOp::Max,
            NcclRedOp::Min,
            NcclRedOp::Avg,
        ] {
            assert_eq!(to_sys_op(op) as u32, op as u32, "{op:?}");
        }
    }

    /// Without CUDA (CI), creating a communicator is a clear error, never a panic in cudarc;
    /// with CUDA, a communicator on GPU 0 has its rank, size and ordinal, and aborting it makes
    /// every later call a clear error.
    #[test]
    fn communicators_need_the_libraries() {
        if let Err(missing) = check_libraries() {
            let e = NcclComm::init_local(&[0]).unwrap_err();
            assert!(matches!(e, NcclError::Library(_)), "{e}");
            assert!(matches!(new_unique_id(), Err(NcclError::Library(_))));
            let id = UniqueIdBytes([0; 128]);
            let e = NcclComm::init_rank(0, 0, 1, &id).unwrap_err();
            assert!(e.to_string().contains("lib"), "{e}");
            crate::transport::nccl::engine::tests::skipped(
                "the GPU half of the communicator test",
                &missing.to_string(),
            );
            return;
        }
        match NcclComm::init_local(&[0]) {
            Ok(comms) => {
                let comm = &comms[0];
                assert_eq!((comm.rank(), comm.size(), comm.ordinal()), (0, 1, 0));
                assert_eq!(comm.async_error(), None);
                comm.abort();
                // SAFETY: a null buffer is never touched: the aborted communicator refuses
                // the call before NCCL sees it.
                let e = unsafe { comm.all_reduce(0, 0, 1, NcclDataType::Float32, NcclRedOp::Sum) }
                    .unwrap_err();
                assert!(matches!(e, NcclError::Aborted { .. }), "{e}");
            }
            Err(e) => crate::transport::nccl::engine::tests::skipped(
                "the GPU half of the communicator test",
                &e.to_string(),
            ),
        }
    }
}
