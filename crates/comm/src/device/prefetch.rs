//! Backward prefetch: a gather that backward will run again (a resharded unit's parameters, a
//! weight's rebuild for a resharded linear) issued before backward needs it, so that its exchange overlaps the
//! backward of the units after it (FSDP2's `set_modules_to_backward_prefetch`).
//!
//! Burn's backward has no hooks, so a [`Prefetch`] is shared by two autodiff nodes: the node
//! that rebuilds the value (the gather's recomputation or a resharded linear's backward), which
//! takes the prefetched exchange when there is one and runs its own steps otherwise, and a
//! marker on a later unit's output whose backward issues it (`collectives::prefetch_on_backward`).
//! The result is the same bytes either way: the same steps on the same source, only issued
//! earlier.

use std::fmt;
use std::sync::{Arc, Mutex};

use burn::backend::Dispatch;
use burn::tensor::Tensor;

use super::steps::{
    DeviceOp, DeviceStep, Exchange, InFlight, Observer, Phase, StepKernels, read_data, run_steps,
};
use crate::transport::group::ProcessGroup;

/// `steps` split at their first engine collective, for issuing it ahead of its use: the steps
/// before it, the op and its group. `None` when there is no such step, when it exchanges
/// through NCCL (which cannot be issued ahead: CubeCL and tch hide their streams) or on a
/// group of one (where it exchanges nothing: `run_steps` passes the tensor through).
pub(crate) fn engine_prefix(
    steps: &[DeviceStep],
) -> Option<(&[DeviceStep], &DeviceOp, &ProcessGroup)> {
    let at = steps
        .iter()
        .position(|s| matches!(s, DeviceStep::Run { .. }))?;
    match &steps[at] {
        DeviceStep::Run {
            op,
            exchange: Exchange::Engine(group),
        } if group.size() > 1 => Some((&steps[..at], op, group)),
        _ => None,
    }
}

/// `steps` with their first collective (and the steps before it) replaced by awaiting
/// `started`, which must be that collective issued on the prefix's output.
pub(crate) fn awaiting(mut steps: Vec<DeviceStep>, started: InFlight) -> Vec<DeviceStep> {
    let at = steps
        .iter()
        .position(|s| matches!(s, DeviceStep::Run { .. }))
        .expect("awaiting replaces a collective step");
    steps.splice(..=at, [DeviceStep::Await(started)]);
    steps
}

/// A rebuild that backward may issue ahead of its use. Clones share one state: issuing one
/// issues them all, and the rebuild is taken once.
#[derive(Clone)]
pub struct Prefetch(Arc<Mutex<Slot>>);

struct Slot {
    /// Set once the node that rebuilds the value is part of the autodiff graph: an untracked
    /// consumer never runs backward, and its exchange would be issued for nothing.
    armed: bool,
    state: State,
    /// The bytes an issued exchange holds until taken, and who counts them.
    counted: Option<(usize, Observer)>,
}

enum State {
    /// Not issued: the source (outside the autodiff graph) and the steps that rebuild from it.
    Waiting {
        source: Box<Tensor<1>>,
        steps: Vec<DeviceStep>,
    },
    /// Issued: the exchange in flight.
    Issued(InFlight),
    /// Taken, or not issuable ahead (an NCCL exchange: CubeCL and tch hide their streams).
    Spent,
}

impl Prefetch {
    /// A rebuild of `steps` on `source`: a flat tensor on a device without autodiff (the
    /// shard's `inner()`), holding the same values as the input the rebuilding node reads.
    /// Only the steps up to the first exchange are issued ahead; the rebuilding node runs its
    /// own steps after it (which may add some, such as a decode, after the exchange).
    pub fn new(source: Tensor<1>, steps: Vec<DeviceStep>) -> Self {
        Self(Arc::new(Mutex::new(Slot {
            armed: false,
            state: State::Waiting {
                source: Box::new(source),
                steps,
            },
            counted: None,
        })))
    }

    /// This prefetch, telling `observer` the `bytes` its exchange's result holds when it is
    /// issued, and 0 when the rebuild takes it (whose own steps count the result from then on).
    pub fn counted(self, bytes: usize, observer: Observer) -> Self {
        self.slot().counted = Some((bytes, observer));
        self
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks the rebuild as part of the graph: backward will run it.
    pub(crate) fn arm(&self) {
        self.slot().armed = true;
    }

    /// Issues the rebuild's first exchange now, without waiting, when it is armed and not yet
    /// issued. Collective: every rank issues the same prefetches in the same order (every rank
    /// runs the same backward). `kernels` are the backend's own steps (its cast, for a
    /// mixed-precision rebuild).
    pub fn issue(&self, kernels: StepKernels<Dispatch>) {
        let mut slot = self.slot();
        if !slot.armed || !matches!(slot.state, State::Waiting { .. }) {
            return;
        }
        let State::Waiting { source, steps } = std::mem::replace(&mut slot.state, State::Spent)
        else {
            unreachable!("checked above")
        };
        let Some((prefix, op, group)) = engine_prefix(&steps) else {
            return;
        };
        let x = run_steps::<Dispatch>((*source).into_dispatch(), prefix, Phase::Recompute, kernels);
        let in_flight = InFlight::start(op.clone(), read_data::<Dispatch>(x), group);
        slot.state = State::Issued(in_flight);
        if let Some((bytes, observer)) = &slot.counted {
            observer.notify(*bytes);
        }
    }

    /// Whether the rebuild was issued ahead and not yet taken.
    pub fn is_issued(&self) -> bool {
        matches!(self.slot().state, State::Issued(_))
    }

    /// The rebuild's `steps` with the exchange issued ahead awaited in place of their first
    /// exchange and the steps before it (run them on any tensor of the target device), or
    /// `steps` themselves when nothing was issued. Either way the prefetch is spent.
    pub(crate) fn finish_steps(&self, steps: &[DeviceStep]) -> Vec<DeviceStep> {
        let mut slot = self.slot();
        match std::mem::replace(&mut slot.state, State::Spent) {
            State::Issued(in_flight) => {
                if let Some((_, observer)) = &slot.counted {
                    observer.notify(0);
                }
                awaiting(steps.to_vec(), in_flight)
            }
            _ => steps.to_vec(),
        }
    }
}

impl fmt::Debug for Prefetch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let slot = self.slot();
        let state = match slot.state {
            State::Waiting { .. } => "waiting",
            State::Issued(_) => "issued",
            State::Spent => "spent",
        };
        write!(f, "Prefetch({state}, armed: {})", slot.armed)
    }
}
