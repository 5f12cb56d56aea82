//! FSDP2's CPU offload policy: shards, their gradients and the optimizer step live on a host
//! device; each gather first copies the shard to the compute device, and backward copies each
//! reduced gradient back to the host.

use burn::tensor::{Device, Tensor};

/// Where offloaded shards live. The compute device is the one the module was built on.
///
/// The copies are Burn's differentiable device transfers (also across backends, e.g. a host
/// ndarray device and a flex or CUDA compute device, both with autodiff): the gathered weights
/// and activations are on the compute device; the shards, their gradients and so the
/// optimizer's state and update are on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct OffloadPolicy {
    /// The device shards, their gradients and the optimizer state live on.
    pub host: Device,
}

impl OffloadPolicy {
    /// Offload to `host`.
    pub fn new(host: Device) -> Self {
        Self { host }
    }

    /// Moves a fresh shard (a leaf) to the host, keeping it a leaf.
    pub(crate) fn place<const D: usize>(&self, shard: Tensor<D>) -> Tensor<D> {
        let trainable = shard.is_require_grad();
        // Detached after the move too: a cross-backend transfer is an op, not a leaf.
        let moved = shard.detach().to_device(&self.host).detach();
        if trainable {
            moved.require_grad()
        } else {
            moved
        }
    }
}
