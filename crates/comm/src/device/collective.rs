//! What a differentiable collective is made of: the step lists of its forward, backward and
//! recomputation ([`DeviceCollective`]), and how backward rebuilds a weight
//! ([`RebuildSteps`]).

use super::prefetch::{Prefetch, awaiting, engine_prefix};
use super::steps::{DeviceOp, DeviceStep, InFlight, Observer};
use crate::transport::group::ProcessGroup;

/// A differentiable collective: `forward` runs on the input, `backward` on the gradient.
/// With `recompute`, under gradient checkpointing the output is dropped after forward and these
/// steps rebuild it from the input when backward needs it (FSDP's reshard-after-forward).
#[derive(Debug, Clone, Default)]
pub struct DeviceCollective {
    /// Steps run on the input.
    pub forward: Vec<DeviceStep>,
    /// Steps run on the gradient.
    pub backward: Vec<DeviceStep>,
    /// Steps that rebuild the dropped output in backward, under gradient checkpointing.
    pub recompute: Option<Vec<DeviceStep>>,
    /// `recompute` issued ahead by backward prefetch, taken when issued.
    pub prefetch: Option<Prefetch>,
}

impl DeviceCollective {
    /// Only `steps`, run forward.
    pub fn steps(steps: Vec<DeviceStep>) -> Self {
        Self {
            forward: steps,
            ..Self::default()
        }
    }

    /// The backward steps as a collective of their own (what the autodiff node runs).
    pub fn adjoint(&self) -> Option<DeviceCollective> {
        (!self.backward.is_empty()).then(|| Self::steps(self.backward.clone()))
    }

    /// The forward split at its first engine collective, for issuing it ahead of its use: the
    /// steps before it, the op and its group. `None` when the forward has no such step (or
    /// exchanges through NCCL, which cannot be issued ahead: CubeCL and tch hide their streams).
    pub fn engine_prefix(&self) -> Option<(&[DeviceStep], &DeviceOp, &ProcessGroup)> {
        engine_prefix(&self.forward)
    }

    /// This collective with the forward's first collective (and the steps before it) replaced
    /// by awaiting `started`, which must be that collective issued on the prefix's output.
    pub fn awaiting(mut self, started: InFlight) -> Self {
        self.forward = awaiting(self.forward, started);
        self
    }
}

/// How backward gets a weight again rather than keeping it from forward: `steps` run
/// on the weight's source (this rank's shard: a cast and an all-gather) give the weight,
/// flattened; `on_release` is told when backward has dropped it again.
#[derive(Debug, Clone)]
pub struct RebuildSteps {
    /// The steps from the source to the flattened weight.
    pub steps: Vec<DeviceStep>,
    /// Told (with 0) once the rebuilt weight is dropped.
    pub on_release: Option<Observer>,
    /// The same steps issued ahead by backward prefetch, taken when issued.
    pub prefetch: Option<Prefetch>,
}

impl RebuildSteps {
    pub(crate) fn released(&self) {
        if let Some(observer) = &self.on_release {
            observer.notify(0);
        }
    }
}
