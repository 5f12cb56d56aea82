//! [`FsdpConfig`]: how `fully_shard` shards and gathers, shared by every unit sharded with it.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::module::ParamId;
use burn_parallel_comm::ProcessGroup;

use crate::memory::MemoryTracker;
use crate::offload::OffloadPolicy;
use crate::policy::MixedPrecisionPolicy;
use crate::rows::RowSource;

/// How [`fully_shard`](crate::fully_shard) shards and gathers. Clones share the gradient-sync
/// switch and the memory tracker, so one call reaches every unit sharded with them.
#[derive(Debug, Clone)]
pub struct FsdpConfig {
    /// The group the parameters are sharded over (FSDP2's shard mesh dimension).
    pub group: ProcessGroup,
    /// HSDP: the group of replicas of this shard (`dp_replicate`). Gradients are
    /// reduce-scattered within `group`, then all-reduced across replicas (default `None`).
    pub replicate_group: Option<ProcessGroup>,
    /// Drop gathered weights after forward and gather again in backward (default `true`). On
    /// a device with gradient checkpointing (`Device::autodiff().gradient_checkpointing()`)
    /// every gathered weight is dropped. On a plain device, the weights whose consumers gather
    /// them again ([`weight_rebuild`](crate::weight_rebuild): `Lora<Linear>`,
    /// `comm::collectives::resharded_linear`) are; the others stay until backward.
    pub reshard_after_forward: bool,
    /// The dtypes units compute, reduce and output in (default: all the shards' own).
    pub mixed_precision: MixedPrecisionPolicy,
    /// Shards, gradients and optimizer step on a host device (`None`: on the compute device).
    pub offload: Option<OffloadPolicy>,
    /// How many units after the computing one [`forward_units`](crate::forward_units) keeps
    /// gathering (FSDP2's forward prefetch; 0: none; default 1).
    pub forward_prefetch_depth: usize,
    /// How many units before the one whose backward starts have their re-gather issued at
    /// that moment, so that it overlaps backward (FSDP2's backward prefetch, for units that
    /// reshard after forward; 0: each unit is gathered again when backward reaches it;
    /// default 2). Each issued unit holds its gathered weights until its backward runs.
    pub backward_prefetch_depth: usize,
    /// How each unit's parameters are split over `group` (default FSDP2's per-parameter rows).
    pub layout: ShardLayout,
    /// How gradients reach the shards (default a reduce-scatter).
    pub gradient_reduction: GradientReduction,
    /// Under the flat layout, consecutive units of a [`forward_units`](crate::forward_units)
    /// stack are gathered (and their gradients reduced) by one collective while their buffers
    /// add up to at most this many elements (Megatron-FSDP's communication bucket; `None`, the
    /// default: one collective per unit).
    pub bucket_elements: Option<usize>,
    /// A sharded load: where lazy parameters read this rank's rows (`None`, the default:
    /// parameters are sharded from their own values).
    pub rows: Option<RowSource>,
    /// Parameters `fully_shard` leaves whole and unsharded on every rank (FSDP2's
    /// `ignored_params`): no gather, no reduction (default none; see [`Self::ignore_params`]).
    ignored: Arc<HashSet<ParamId>>,
    sync: Arc<AtomicBool>,
    memory: MemoryTracker,
}

impl FsdpConfig {
    /// FSDP over `group`: reshard after forward, no mixed precision or offload, forward
    /// prefetch 1, backward prefetch 2.
    pub fn new(group: ProcessGroup) -> Self {
        Self {
            group,
            replicate_group: None,
            reshard_after_forward: true,
            mixed_precision: MixedPrecisionPolicy::default(),
            offload: None,
            forward_prefetch_depth: 1,
            backward_prefetch_depth: 2,
            layout: ShardLayout::Rows,
            gradient_reduction: GradientReduction::ReduceScatter,
            bucket_elements: None,
            rows: None,
            ignored: Arc::default(),
            sync: Arc::new(AtomicBool::new(true)),
            memory: MemoryTracker::new(),
        }
    }

    /// This config, loading lazy parameters from `rows` (see [`RowSource`]).
    pub fn rows_from(mut self, rows: RowSource) -> Self {
        self.rows = Some(rows);
        self
    }

    /// HSDP over `replicate` x `group`.
    pub fn hybrid(group: ProcessGroup, replicate: ProcessGroup) -> Self {
        Self {
            replicate_group: Some(replicate),
            ..Self::new(group)
        }
    }

    /// FSDP2's `set_requires_gradient_sync`: with `false`, backward adds each parameter's
    /// full gradient to a local accumulator and communicates nothing (the shards get zeros);
    /// the next backward with `true` reduce-scatters the accumulated sum once. Under HSDP it
    /// also skips the replica all-reduce.
    pub fn set_requires_gradient_sync(&self, sync: bool) {
        self.sync.store(sync, Ordering::SeqCst);
    }

    /// Whether backward reduces gradients now (see [`Self::set_requires_gradient_sync`]).
    pub fn requires_gradient_sync(&self) -> bool {
        self.sync.load(Ordering::SeqCst)
    }

    pub(crate) fn sync_switch(&self) -> &Arc<AtomicBool> {
        &self.sync
    }

    /// This rank's model-state counters: what units sharded with this config gather and reduce
    /// is recorded here (see [`memory`](crate::memory)).
    pub fn memory(&self) -> &MemoryTracker {
        &self.memory
    }

    /// Computes, reduces and outputs in the dtypes of `policy`.
    pub fn mixed_precision(mut self, policy: MixedPrecisionPolicy) -> Self {
        self.mixed_precision = policy;
        self
    }

    /// Whether to drop gathered weights after forward and gather again in backward (default
    /// `true`; see the field of the same name).
    pub fn reshard_after_forward(mut self, reshard: bool) -> Self {
        self.reshard_after_forward = reshard;
        self
    }

    /// Keeps shards, their gradients and the optimizer step on `policy.host`.
    pub fn offload(mut self, policy: OffloadPolicy) -> Self {
        self.offload = Some(policy);
        self
    }

    /// Units gathered ahead by [`forward_units`](crate::forward_units) (0: no prefetch).
    pub fn forward_prefetch_depth(mut self, depth: usize) -> Self {
        self.forward_prefetch_depth = depth;
        self
    }

    /// Units whose re-gather backward issues ahead (see
    /// [`Self::backward_prefetch_depth`]; 0: no backward prefetch).
    pub fn backward_prefetch_depth(mut self, depth: usize) -> Self {
        self.backward_prefetch_depth = depth;
        self
    }

    /// Splits each unit's parameters as `layout` says (see [`ShardLayout`]).
    pub fn layout(mut self, layout: ShardLayout) -> Self {
        self.layout = layout;
        self
    }

    /// Gathers consecutive flat units together up to `elements` (see the field).
    pub fn bucket_elements(mut self, elements: Option<usize>) -> Self {
        self.bucket_elements = elements;
        self
    }

    /// Also leaves the parameters `ids` unsharded (FSDP2's `ignored_params`): each rank keeps
    /// them whole, as they are, and no collective ever touches them. Meant for frozen modules
    /// (`frozen_multimodal_sharding = "replicate"`); a trainable parameter left out is not
    /// averaged over the data-parallel ranks by anything.
    pub fn ignore_params(mut self, ids: impl IntoIterator<Item = ParamId>) -> Self {
        Arc::make_mut(&mut self.ignored).extend(ids);
        self
    }

    /// The parameters `fully_shard` leaves unsharded (see [`Self::ignore_params`]).
    pub fn ignored_params(&self) -> &HashSet<ParamId> {
        &self.ignored
    }

    /// Reduces gradients as `reduction` says (see [`GradientReduction`]).
    pub fn gradient_reduction(mut self, reduction: GradientReduction) -> Self {
        self.gradient_reduction = reduction;
        self
    }
}

/// How a unit's parameters are split over the shard group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ShardLayout {
    /// FSDP2: each parameter split on dim 0 in pad-to-ceil chunks of rows; a unit's gather
    /// concatenates every parameter's padded chunk.
    #[default]
    Rows,
    /// Megatron-FSDP: the unit's parameters, flattened in module order, form one buffer split
    /// evenly over the group (only the last rank's tail is padded); a parameter may straddle
    /// ranks, and each rank stores its contiguous piece of each parameter as a `[len, 1, ..]`
    /// tensor. A unit's gather is one buffer whose slices are the parameters, without
    /// per-parameter padding or reordering. Every parameter of a unit has the same dtype.
    FlatBuffer,
}

/// How the gradient of a gathered weight becomes this rank's gradient shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GradientReduction {
    /// Reduce-scatter: each rank receives only its shard's sum (FSDP2; ZeRO-2 and ZeRO-3).
    #[default]
    ReduceScatter,
    /// All-reduce of the full gradient, of which each rank keeps its shard (ZeRO-1: the
    /// optimizer state alone is sharded; every rank holds the whole reduced gradient once).
    AllReduce,
}
