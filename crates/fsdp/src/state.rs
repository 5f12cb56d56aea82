//! FSDP's state as owned objects, in the spirit of PyTorch's `FSDPParamGroup` / `FSDPParam`:
//! a [`UnitState`] per `fully_shard` call (its groups, policy, resharding, prefetch depth,
//! gradient-sync switch and memory tracker) and a [`ParamState`] per sharded parameter (its
//! global shape, its rows, the unit it belongs to). Both hang off the parameter's
//! reparameterization, so they are reachable from the sharded model and travel with it.

use std::ops::Range;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use burn::module::ParamId;
use burn::tensor::{DType, Device, Tensor};
use burn_parallel_comm::ProcessGroup;
use burn_parallel_comm::chunk::padded_chunk;
use burn_parallel_comm::collectives::DevicePending;

use crate::config::FsdpConfig;
use crate::memory::MemoryTracker;
use crate::policy::MixedPrecisionPolicy;

/// One unit: the parameters one `fully_shard` call sharded (FSDP2's `FSDPParamGroup`).
#[derive(Debug)]
pub struct UnitState {
    pub(crate) group: ProcessGroup,
    pub(crate) replicate_group: Option<ProcessGroup>,
    pub(crate) reshard_after_forward: bool,
    pub(crate) policy: MixedPrecisionPolicy,
    /// Under an offload policy, the device that gathers and computes (shards live on the host).
    pub(crate) compute: Option<Device>,
    /// The device the unit computes on (where its inputs must be).
    pub(crate) device: Device,
    pub(crate) prefetch_depth: usize,
    pub(crate) sync: Arc<AtomicBool>,
    pub(crate) memory: MemoryTracker,
}

impl UnitState {
    pub(crate) fn new(config: &FsdpConfig, compute: &Device) -> Self {
        Self {
            group: config.group.clone(),
            replicate_group: config.replicate_group.clone(),
            reshard_after_forward: config.reshard_after_forward,
            policy: config.mixed_precision,
            compute: config.offload.as_ref().map(|_| compute.clone()),
            device: compute.clone(),
            prefetch_depth: config.forward_prefetch_depth,
            sync: config.sync_switch().clone(),
            memory: config.memory().clone(),
        }
    }

    /// The group the unit is sharded over.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Under HSDP, the group of replicas gradients are all-reduced across (`None`: plain FSDP).
    pub fn replicate_group(&self) -> Option<&ProcessGroup> {
        self.replicate_group.as_ref()
    }

    /// Whether gathered weights are dropped after forward and gathered again in backward.
    pub fn reshard_after_forward(&self) -> bool {
        self.reshard_after_forward
    }

    /// The dtypes the unit computes, reduces and outputs in.
    pub fn mixed_precision(&self) -> &MixedPrecisionPolicy {
        &self.policy
    }

    /// Units after this one that `forward_units` keeps gathering while this one computes.
    pub fn prefetch_depth(&self) -> usize {
        self.prefetch_depth
    }

    /// The dtype the unit gathers and computes in (`None`: the shards').
    pub(crate) fn compute_dtype(&self) -> Option<DType> {
        self.policy.param_dtype.map(DType::from)
    }

    pub(crate) fn reduce_dtype(&self) -> Option<DType> {
        self.policy.reduce_dtype.map(DType::from)
    }
}

/// One sharded parameter (FSDP2's `FSDPParam`): dim 0 split in pad-to-ceil chunks over the
/// unit's group, this rank holding `rows`.
#[derive(Debug)]
pub struct ParamState {
    pub(crate) id: ParamId,
    pub(crate) global_shape: Vec<usize>,
    pub(crate) rows: Range<usize>,
    pub(crate) unit: Arc<UnitState>,
    /// The gradient summed over micro-steps while gradient sync is off (full, unsharded).
    pub(crate) accumulator: DevicePending,
    /// While the unit runs under one coalesced gather: this parameter's slice of it (flat).
    served: Mutex<Option<Tensor<1>>>,
}

impl ParamState {
    pub(crate) fn new(id: ParamId, global_shape: Vec<usize>, unit: Arc<UnitState>) -> Self {
        let group = &unit.group;
        let rows =
            burn_parallel_comm::chunk::chunk_range(global_shape[0], group.size(), group.index());
        Self {
            id,
            global_shape,
            rows,
            unit,
            accumulator: DevicePending::default(),
            served: Mutex::new(None),
        }
    }

    /// The id of the parameter this state shards.
    pub fn id(&self) -> ParamId {
        self.id
    }

    /// The full parameter's shape.
    pub fn global_shape(&self) -> &[usize] {
        &self.global_shape
    }

    /// The rows (along dim 0) of the full parameter this rank stores.
    pub fn rows(&self) -> Range<usize> {
        self.rows.clone()
    }

    /// Rows per rank once padded (FSDP2's pad-to-ceil chunk).
    pub fn padded_rows(&self) -> usize {
        padded_chunk(self.global_shape[0], self.unit.group.size())
    }

    /// Elements per row (the product of dims 1..).
    pub fn row_len(&self) -> usize {
        self.global_shape[1..].iter().product()
    }

    /// The unit the parameter was sharded in.
    pub fn unit(&self) -> &Arc<UnitState> {
        &self.unit
    }

    /// The value served while the unit runs, reshaped to the full parameter.
    pub(crate) fn served<const D: usize>(&self) -> Option<Tensor<D>> {
        let served = self.served.lock().unwrap_or_else(|e| e.into_inner());
        let shape: [usize; D] = self.global_shape.clone().try_into().expect("rank kept");
        served.as_ref().map(|flat| flat.clone().reshape(shape))
    }

    pub(crate) fn serve(&self, value: Option<Tensor<1>>) {
        *self.served.lock().unwrap_or_else(|e| e.into_inner()) = value;
    }
}
