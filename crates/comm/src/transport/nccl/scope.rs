//! One collective call on a group's communicator, from its first NCCL call to the wait for its
//! stream: the watchdog's guard, the group's reused staging buffers, and the mapping of what
//! went wrong to the error every caller reports.

use std::sync::{Arc, MutexGuard};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr as _, sys as cuda};

use super::comm::{DevicePtr, NcclComm, NcclError};
use super::watchdog::{Abort, Guard, Stopped, Watchdog};
use crate::transport::collective::OpKind;
use crate::transport::error::CollectiveError;

/// The staging buffers a call may use at once, by role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// This rank's statement for the agreement.
    WordsOut = 0,
    /// Every rank's statements.
    WordsIn,
    /// The host input, uploaded.
    Input,
    /// The input packed into NCCL's equal pieces.
    Send,
    /// NCCL's output before unpacking.
    Recv,
    /// The output, unpacked.
    Output,
}

const SLOTS: usize = 6;

/// Device buffers reused across a group's calls, each grown to the largest size asked so far:
/// with static shapes (FSDP's) they are allocated in the first step only. A call waits for its
/// stream before it ends, so the next call may overwrite them.
#[derive(Default)]
pub(crate) struct Staging {
    buffers: [Option<CudaSlice<u8>>; SLOTS],
}

impl Staging {
    fn get(
        &mut self,
        stream: &Arc<CudaStream>,
        slot: Slot,
        len: usize,
    ) -> Result<DevicePtr, NcclError> {
        let held = &mut self.buffers[slot as usize];
        if held.as_ref().is_none_or(|b| b.len() < len.max(1)) {
            // The old buffer goes first, so that growing never holds both.
            *held = None;
            *held = Some(
                stream
                    .alloc_zeros::<u8>(len.max(1))
                    .map_err(|e| NcclError::Cuda {
                        call: "cuMemAlloc",
                        message: format!("{e:?}"),
                    })?,
            );
        }
        let buffer = held.as_ref().expect("allocated above");
        // The context tracks no events (see `comm::context`): the guard is a no-op.
        Ok(buffer.device_ptr(stream).0)
    }
}

/// A call in progress: what its NCCL calls, copies and waits go through.
pub(crate) struct Scope<'a> {
    /// The group's communicator.
    pub comm: &'a NcclComm,
    staging: MutexGuard<'a, Staging>,
    guard: Guard,
}

impl<'a> Scope<'a> {
    /// Starts a call of `what` on `comm` under `watchdog` (an error at once when another rank
    /// has already failed).
    pub fn new(
        what: String,
        comm: &'a Arc<NcclComm>,
        staging: MutexGuard<'a, Staging>,
        watchdog: &Watchdog,
    ) -> Result<Self, NcclError> {
        let target: Arc<dyn Abort> = comm.clone();
        let guard = watchdog.guard(what, target)?;
        // Every poll of a call still in progress on `comm` is bounded by this call's guard.
        comm.set_watch(Some(guard.watch().clone()));
        Ok(Self {
            comm,
            staging,
            guard,
        })
    }

    /// A staging buffer of at least `len` bytes.
    pub fn buffer(&mut self, slot: Slot, len: usize) -> Result<DevicePtr, NcclError> {
        self.staging.get(self.comm.stream(), slot, len)
    }

    /// Waits for everything issued so far in this call.
    pub fn finish(&self) -> Result<(), NcclError> {
        self.comm.finish(&self.guard)
    }

    /// Uploads `bytes` into `slot`.
    pub fn upload(&mut self, slot: Slot, bytes: &[u8]) -> Result<DevicePtr, NcclError> {
        let p = self.buffer(slot, bytes.len())?;
        if !bytes.is_empty() {
            // SAFETY: `p` holds at least `bytes.len()` bytes; a copy from pageable memory has
            // read the host bytes by the time it returns.
            let r = unsafe {
                cuda::cuMemcpyHtoDAsync_v2(
                    p,
                    bytes.as_ptr().cast(),
                    bytes.len(),
                    self.comm.stream().cu_stream(),
                )
            };
            check("cuMemcpyHtoDAsync", r)?;
        }
        Ok(p)
    }

    /// Downloads `len` bytes at `src` once the call's work is done.
    pub fn download(&self, src: DevicePtr, len: usize) -> Result<Vec<u8>, NcclError> {
        self.finish()?;
        let mut out = vec![0u8; len];
        if len > 0 {
            // SAFETY: `src` holds `len` bytes written by work that has finished.
            let r = unsafe {
                cuda::cuMemcpyDtoHAsync_v2(
                    out.as_mut_ptr().cast(),
                    src,
                    len,
                    self.comm.stream().cu_stream(),
                )
            };
            check("cuMemcpyDtoHAsync", r)?;
            self.finish()?;
        }
        Ok(out)
    }

    /// What a failure of this call means: the watchdog's reason when it stopped the call (the
    /// NCCL error is then its consequence), else the error, after aborting the communicator
    /// so that peers waiting on this rank end too.
    pub fn explain(&self, error: NcclError) -> NcclError {
        match (self.guard.stopped(), error) {
            (Some(reason), _) => NcclError::Stopped(reason),
            (None, e @ (NcclError::Nccl { .. } | NcclError::Cuda { .. })) => {
                self.comm.abort();
                e
            }
            (None, e) => e,
        }
    }
}

impl Drop for Scope<'_> {
    fn drop(&mut self) {
        self.comm.set_watch(None);
    }
}

fn check(call: &'static str, r: cuda::CUresult) -> Result<(), NcclError> {
    r.result().map_err(|e| NcclError::Cuda {
        call,
        message: format!("{e:?}"),
    })
}

/// The error a collective reports for an NCCL-engine failure in `op` on `group`.
pub(crate) fn collective_error(op: &str, group: &str, e: NcclError) -> CollectiveError {
    match e {
        NcclError::Stopped(Stopped::PeerFailed { rank, message }) => CollectiveError::PeerFailed {
            op: op.into(),
            group: group.into(),
            rank,
            reason: message,
        },
        e => CollectiveError::GroupBroken {
            group: group.into(),
            reason: format!("{op} failed: {e}"),
        },
    }
}

/// The name a call is watched under.
pub(crate) fn watched_name(op: OpKind, group: &str) -> String {
    format!("{op} on group {group}")
}
