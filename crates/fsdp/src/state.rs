//! FSDP's state as owned objects, in the spirit of PyTorch's `FSDPParamGroup` / `FSDPParam`:
//! a [`UnitState`] per `fully_shard` call (its groups, policy, resharding, prefetch depth,
//! gradient-sync switch and memory tracker) and a [`ParamState`] per sharded parameter (its
//! global shape, its rows, the unit it belongs to). Both hang off the parameter's
//! reparameterization, so they are reachable from the sharded model and travel with it.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn::module::ParamId;
use burn::tensor::{DType, Device, GradientCheckpointingStrategy, Tensor};
use burn_parallel_comm::ProcessGroup;
use burn_parallel_comm::chunk::padded_chunk;
use burn_parallel_comm::collectives::{DevicePending, Prefetch};

use crate::config::{FsdpConfig, GradientReduction, ShardLayout};
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
    pub(crate) backward_prefetch_depth: usize,
    pub(crate) sync: Arc<AtomicBool>,
    pub(crate) memory: MemoryTracker,
    /// The unit's flat buffer under [`ShardLayout::FlatBuffer`] (`None`: per-parameter rows).
    pub(crate) flat: Option<FlatBuffer>,
    pub(crate) reduction: GradientReduction,
    pub(crate) bucket_elements: Option<usize>,
    /// 0 for a unit with no unit inside its module, else one more than the highest level
    /// inside: a module's own unit is the highest-level one among its parameters.
    pub(crate) level: usize,
}

/// A unit's flat buffer (Megatron-FSDP): its parameters' elements, in module order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlatBuffer {
    /// Elements of every parameter of the unit.
    pub total: usize,
    /// Elements each rank stores (and contributes to a gather): `total` over the group,
    /// rounded up; the last ranks' tails are padding.
    pub per_rank: usize,
    /// How many parameters the buffer holds.
    pub params: usize,
}

impl FlatBuffer {
    /// The buffer of `params` parameters of `total` elements split over `world` ranks.
    pub fn new(total: usize, params: usize, world: usize) -> Self {
        Self {
            total,
            per_rank: total.div_ceil(world),
            params,
        }
    }

    /// The elements of the parameter at `offset` (of `len` elements) that each rank stores,
    /// as ranges of the parameter's own (flattened) elements.
    pub fn pieces(&self, offset: usize, len: usize, world: usize) -> Vec<Range<usize>> {
        (0..world)
            .map(|r| {
                let (lo, hi) = (r * self.per_rank, ((r + 1) * self.per_rank).min(self.total));
                let start = offset.max(lo).min(offset + len);
                let end = (offset + len).min(hi).max(start);
                start - offset..end - offset
            })
            .collect()
    }
}

impl UnitState {
    /// The state of a unit sharded with `config` that computes on `compute`; `flat` is its
    /// buffer when the config's layout is [`ShardLayout::FlatBuffer`], `level` its nesting
    /// level.
    pub(crate) fn new(
        config: &FsdpConfig,
        compute: &Device,
        flat: Option<FlatBuffer>,
        level: usize,
    ) -> Self {
        debug_assert_eq!(flat.is_some(), config.layout == ShardLayout::FlatBuffer);
        Self {
            flat,
            level,
            bucket_elements: config.bucket_elements,
            reduction: config.gradient_reduction,
            group: config.group.clone(),
            replicate_group: config.replicate_group.clone(),
            reshard_after_forward: config.reshard_after_forward,
            policy: config.mixed_precision,
            compute: config.offload.as_ref().map(|_| compute.clone()),
            device: compute.clone(),
            prefetch_depth: config.forward_prefetch_depth,
            backward_prefetch_depth: config.backward_prefetch_depth,
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

    /// The memory counters of the config the unit was sharded with (shared by its units).
    pub fn memory(&self) -> &MemoryTracker {
        &self.memory
    }

    /// Units after this one that `forward_units` keeps gathering while this one computes.
    pub fn prefetch_depth(&self) -> usize {
        self.prefetch_depth
    }

    /// Units before this one whose re-gather backward issues when this one's backward starts.
    pub fn backward_prefetch_depth(&self) -> usize {
        self.backward_prefetch_depth
    }

    /// Whether the unit's gathers are recomputed in backward by Burn's gradient checkpointing:
    /// resharding on a device that checkpoints. Elsewhere only the weights whose consumers
    /// rebuild them ([`weight_rebuild`](crate::weight_rebuild)) are resharded.
    pub(crate) fn recomputes_gathers(&self) -> bool {
        self.reshard_after_forward
            && self.device.gradient_checkpointing_strategy()
                == Some(GradientCheckpointingStrategy::Balanced)
    }

    /// The dtype the unit gathers and computes in (`None`: the shards').
    pub(crate) fn compute_dtype(&self) -> Option<DType> {
        self.policy.param_dtype.map(DType::from)
    }

    pub(crate) fn reduce_dtype(&self) -> Option<DType> {
        self.policy.reduce_dtype.map(DType::from)
    }

    /// The unit's flat buffer (Megatron-FSDP layout), `None` under per-parameter rows.
    pub fn flat_buffer(&self) -> Option<&FlatBuffer> {
        self.flat.as_ref()
    }

    /// How the unit's gradients reach the shards.
    pub fn gradient_reduction(&self) -> GradientReduction {
        self.reduction
    }

    /// Whether `other` gathers exactly as this unit does (groups, policy, resharding,
    /// reduction, gradient-sync switch), so that one collective can serve both.
    pub(crate) fn gathers_like(&self, other: &UnitState) -> bool {
        let ranks = |g: Option<&ProcessGroup>| g.map(|g| g.ranks().to_vec());
        self.group.ranks() == other.group.ranks()
            && ranks(self.replicate_group.as_ref()) == ranks(other.replicate_group.as_ref())
            && self.reshard_after_forward == other.reshard_after_forward
            && self.policy == other.policy
            && self.reduction == other.reduction
            && self.compute.is_none()
            && other.compute.is_none()
            && Arc::ptr_eq(&self.sync, &other.sync)
    }
}

/// Which part of the full parameter this rank stores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Split {
    /// Rows along dim 0 (FSDP2's pad-to-ceil chunk).
    Rows(Range<usize>),
    /// A piece of the unit's flat buffer: the parameter starts at `offset` in it, and rank
    /// `r` stores the parameter's elements `pieces[r]`.
    Flat {
        offset: usize,
        pieces: Vec<Range<usize>>,
    },
}

/// What a parameter is while its unit's coalesced gather serves it.
#[derive(Debug)]
pub(crate) struct Served {
    /// Its slice of the gathered buffer (flat).
    pub(crate) value: Tensor<1>,
    /// The unit's backward prefetch list, when it prefetches.
    pub(crate) prefetches: Option<Prefetches>,
}

impl Served {
    /// `value`, with no prefetch list.
    pub(crate) fn value(value: Tensor<1>) -> Self {
        Self {
            value,
            prefetches: None,
        }
    }
}

/// The rebuilds one unit's forward left for backward, in the order they were made: what a
/// later unit's backward issues ahead (see `comm::collectives::prefetch_on_backward`).
#[derive(Debug, Clone, Default)]
pub(crate) struct Prefetches(Arc<Mutex<Vec<Prefetch>>>);

impl Prefetches {
    pub(crate) fn push(&self, prefetch: Prefetch) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(prefetch);
    }

    pub(crate) fn list(&self) -> Vec<Prefetch> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// One sharded parameter (FSDP2's `FSDPParam`): dim 0 split in pad-to-ceil chunks over the
/// unit's group, or (Megatron-FSDP's flat layout) a contiguous piece of the unit's buffer.
#[derive(Debug)]
pub struct ParamState {
    pub(crate) id: ParamId,
    pub(crate) global_shape: Vec<usize>,
    pub(crate) split: Split,
    pub(crate) unit: Arc<UnitState>,
    /// The gradient summed over micro-steps while gradient sync is off (full, unsharded).
    pub(crate) accumulator: DevicePending,
    /// While the unit runs under one coalesced gather: this parameter's slice of it (flat),
    /// and where the rebuilds its consumers will run in backward are listed for prefetch.
    served: Mutex<Option<Served>>,
    /// Whether the parameter takes a gradient (`require_grad`), fixed when it is sharded.
    /// A frozen one is gathered but never reduced (see [`Self::trainable`]).
    trainable: bool,
    /// Whether its consumer gathers it again in backward rather than keeping the gathered
    /// value ([`weight_rebuild`](crate::weight_rebuild) was asked for it), learned in the
    /// first forward: its gathered bytes then count as dropped after forward.
    rebuilt: AtomicBool,
}

impl ParamState {
    /// The state of the parameter `id` of shape `global_shape`, starting at `offset` in its
    /// unit's flat buffer when the unit has one; `trainable`: whether it takes a gradient.
    pub(crate) fn new(
        id: ParamId,
        global_shape: Vec<usize>,
        unit: Arc<UnitState>,
        offset: usize,
        trainable: bool,
    ) -> Self {
        let group = &unit.group;
        let split = match &unit.flat {
            None => Split::Rows(burn_parallel_comm::chunk::chunk_range(
                global_shape[0],
                group.size(),
                group.index(),
            )),
            Some(flat) => Split::Flat {
                offset,
                pieces: flat.pieces(offset, global_shape.iter().product(), group.size()),
            },
        };
        Self {
            id,
            global_shape,
            split,
            unit,
            accumulator: DevicePending::default(),
            served: Mutex::new(None),
            trainable,
            rebuilt: AtomicBool::new(false),
        }
    }

    /// Whether the parameter takes a gradient. A frozen one (no `require_grad` when sharded)
    /// is still sharded and gathered, but its gathered value is detached from the graph: no
    /// gradient is computed for it, none is reduced, and the optimizer sees none; a unit of
    /// frozen parameters only has no backward at all.
    pub fn trainable(&self) -> bool {
        self.trainable
    }

    /// Records that the parameter's consumer rebuilds it in backward.
    pub(crate) fn mark_rebuilt(&self) {
        self.rebuilt.store(true, Ordering::Relaxed);
    }

    /// Whether the parameter's consumer rebuilds it in backward (see [`Self::mark_rebuilt`]).
    pub(crate) fn is_rebuilt(&self) -> bool {
        self.rebuilt.load(Ordering::Relaxed)
    }

    /// The id of the parameter this state shards.
    pub fn id(&self) -> ParamId {
        self.id
    }

    /// The full parameter's shape.
    pub fn global_shape(&self) -> &[usize] {
        &self.global_shape
    }

    /// The rows (along dim 0) of the full parameter this rank stores; `None` under the flat
    /// layout, where a rank's piece need not be whole rows (see [`Self::elements`]).
    pub fn rows(&self) -> Option<Range<usize>> {
        match &self.split {
            Split::Rows(rows) => Some(rows.clone()),
            Split::Flat { .. } => None,
        }
    }

    /// The elements of the full parameter, flattened row-major, that this rank stores (a
    /// contiguous range under both layouts).
    pub fn elements(&self) -> Range<usize> {
        match &self.split {
            Split::Rows(rows) => rows.start * self.row_len()..rows.end * self.row_len(),
            Split::Flat { pieces, .. } => pieces[self.unit.group.index()].clone(),
        }
    }

    /// What each rank stores along dim 0 of its stored tensor: rows, or (flat layout, where
    /// a piece is stored as `[len, 1, ..]`) elements. The sizes a gather of the parameter
    /// concatenates.
    pub(crate) fn gather_sizes(&self) -> Vec<usize> {
        match &self.split {
            Split::Rows(_) => {
                burn_parallel_comm::chunk::chunk_sizes(self.global_shape[0], self.unit.group.size())
            }
            Split::Flat { pieces, .. } => pieces.iter().map(|p| p.len()).collect(),
        }
    }

    /// Where the parameter starts in its unit's flat buffer (`None`: per-parameter rows).
    pub(crate) fn flat_offset(&self) -> Option<usize> {
        match &self.split {
            Split::Rows(_) => None,
            Split::Flat { offset, .. } => Some(*offset),
        }
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

    /// The full parameter's shape as an array (the stored tensor's rank).
    pub(crate) fn shape<const D: usize>(&self) -> [usize; D] {
        self.global_shape.clone().try_into().expect("rank kept")
    }

    /// The value served while the unit runs, reshaped to the full parameter.
    pub(crate) fn served<const D: usize>(&self) -> Option<Tensor<D>> {
        let served = self.served.lock().unwrap_or_else(|e| e.into_inner());
        served
            .as_ref()
            .map(|s| s.value.clone().reshape(self.shape::<D>()))
    }

    /// While served, the list of the serving unit's backward prefetches (`None` when the unit
    /// does not prefetch in backward).
    pub(crate) fn served_prefetches(&self) -> Option<Prefetches> {
        let served = self.served.lock().unwrap_or_else(|e| e.into_inner());
        served.as_ref().and_then(|s| s.prefetches.clone())
    }

    /// The elements each rank stores, in group order: what a gather of the flattened
    /// parameter concatenates.
    pub(crate) fn gather_elements(&self) -> Vec<usize> {
        match &self.split {
            Split::Rows(_) => {
                let row_len = self.row_len();
                self.gather_sizes()
                    .into_iter()
                    .map(|rows| rows * row_len)
                    .collect()
            }
            Split::Flat { pieces, .. } => pieces.iter().map(|p| p.len()).collect(),
        }
    }

    /// Whether an enclosing unit's scope is serving the parameter now.
    pub(crate) fn is_served(&self) -> bool {
        self.served
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    pub(crate) fn serve(&self, value: Option<Served>) {
        *self.served.lock().unwrap_or_else(|e| e.into_inner()) = value;
    }
}

#[cfg(test)]
mod tests {
    use super::FlatBuffer;

    /// Every element of a buffer of parameters lands on exactly one rank, in order.
    #[test]
    fn flat_pieces_cover_each_parameter_once_in_rank_order() {
        for world in 1..=5 {
            let lens = [7usize, 1, 0, 12, 5];
            let total = lens.iter().sum();
            let flat = FlatBuffer::new(total, lens.len(), world);
            assert!(flat.per_rank * world >= total && flat.per_rank * world < total + world);
            let mut offset = 0;
            for &len in &lens {
                let pieces = flat.pieces(offset, len, world);
                let mut next = 0;
                for (r, p) in pieces.iter().enumerate() {
                    if !p.is_empty() {
                        assert_eq!(p.start, next, "world {world}, rank {r}");
                        // The piece lies inside rank r's slice of the buffer.
                        assert!(offset + p.start >= r * flat.per_rank);
                        assert!(offset + p.end <= (r + 1) * flat.per_rank);
                    }
                    next = next.max(p.end);
                }
                assert_eq!(next, len);
                offset += len;
            }
        }
    }
}
