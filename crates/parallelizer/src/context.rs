//! `MeshContext`: one rank's view of the job: its config, mesh, groups and device.

use burn::tensor::{Device, GradientCheckpointingStrategy};
use burn_parallel_comm::collectives::describe;
use burn_parallel_comm::collectives::is_cuda_device;
use burn_parallel_comm::{DeviceMesh, MeshShape, ProcessGroup, RankContext};
use burn_parallel_fsdp::{
    FsdpConfig, GradientReduction, MemoryTracker, OffloadPolicy, ShardLayout,
};

use crate::config::{
    ConfigError, DataParallel, DistributedConfig, MeshNames, MeshSizes, Plan, ZeroDpStrategy,
};
use crate::error::ParallelError;

/// The name of the flattened data-parallel dimension (dp_replicate x dp_shard): the group over
/// which the batch is split and losses are averaged.
pub const DP: &str = "dp";

/// The name of the dimension that spans every rank of one pipeline stage: the whole mesh
/// without pipeline parallelism (every group but [`PP`] lives within a stage).
pub const WORLD: &str = "world";

/// With `pp > 1`, the name of the pipeline dimension, the outermost: the ranks holding the same
/// place in every stage, one per stage, in stage order. Activations travel on it.
pub const PP: &str = "pp";

/// With `pp > 1`, a second group of the [`PP`] ranks, on which gradients travel back (each
/// group delivers its messages between two ranks in order; two keep the two directions apart).
pub const PP_BACKWARD: &str = "pp_backward";

/// With `pp > 1`, the name of the dimension that spans every rank of every stage (the whole
/// mesh, pp included; [`WORLD`] is one stage's ranks): what a sharded checkpoint agrees over.
const ALL_STAGES: &str = "all_stages";

/// The name of the flattened `dp_replicate x dp_shard x cp` dimension (NeMo's `dp_cp`) when
/// `cp > 1`: every rank holding a different part of the global batch, over which losses are
/// averaged (with `cp` 1 that is the dp group).
pub const DP_CP: &str = "dp_cp";

/// With `cp > 1`, the name of the data-parallel shard dimension without the cp ranks (the
/// configured `dp_shard` name, `dp_shard_cp` by default, is then its flattening with cp).
pub const DP_SHARD_ONLY: &str = "dp_shard";

/// With `cp > 1`, the name of the context-parallel dimension.
pub const CP: &str = "cp";

/// One rank's parallel context. Build it on every rank from the same config; the config is
/// validated against the world before any communication.
#[derive(Debug, Clone)]
pub struct MeshContext {
    plan: Plan,
    mesh: DeviceMesh,
    device: Device,
    checkpointing: bool,
    /// The FSDP settings every unit of a model parallelized with this context shares (so one
    /// gradient-sync switch reaches them all).
    fsdp: FsdpConfig,
    /// The expert-parallel groups (`None` without expert parallelism).
    experts: Option<ExpertGroups>,
}

/// The groups of expert parallelism. dp_shard (flattened with cp under context parallelism,
/// as TorchTitan borrows `dp_shard_cp`) splits into `ep_shard x ep` (ep innermost): the `ep`
/// consecutive ranks of one group hold one copy of every expert between them and exchange
/// tokens, whichever rows or parts of a sequence those tokens come from.
#[derive(Debug, Clone)]
pub struct ExpertGroups {
    /// The ranks that split the experts (and exchange tokens).
    pub ep: ProcessGroup,
    /// The ranks of one dp_shard group holding the same experts: FSDP shards the experts over
    /// them.
    pub shard: ProcessGroup,
    /// Every data-parallel rank holding the same experts (dp_replicate x shard): DDP averages
    /// the experts' gradients over them.
    pub replicas: ProcessGroup,
}

impl ExpertGroups {
    /// The groups of the rank `rank` of a `(pp x) dp_replicate x dp_shard x cp x tp` mesh (tp
    /// innermost) whose `dp_shard x cp` splits into `ep_shard x ep`. Every rank builds its own,
    /// in this order.
    fn new(ctx: &RankContext, sizes: MeshSizes) -> Result<Self, ParallelError> {
        // cp sits between dp_shard and tp, so `dp_shard x cp` is one contiguous index.
        let (shards, ep, tp) = (sizes.dp_shard * sizes.cp, sizes.ep, sizes.tp);
        let me = ctx.rank();
        let (t, shard, replica) = (me % tp, (me / tp) % shards, me / (tp * shards));
        let (block, e) = (shard / ep, shard % ep);
        // Under pipeline parallelism `replica` counts the replicas of every stage before this
        // one: this stage's are the dp_replicate from its first.
        let first_replica = replica - replica % sizes.dp_replicate;
        let global =
            |replica: usize, block: usize, e: usize| ((replica * shards) + block * ep + e) * tp + t;
        let ep_ranks: Vec<usize> = (0..ep).map(|e| global(replica, block, e)).collect();
        let shard_ranks: Vec<usize> = (0..shards / ep).map(|b| global(replica, b, e)).collect();
        let replica_ranks: Vec<usize> = (first_replica..first_replica + sizes.dp_replicate)
            .flat_map(|r| (0..shards / ep).map(move |b| (r, b)))
            .map(|(r, b)| global(r, b, e))
            .collect();
        Ok(Self {
            ep: ctx.group("ep", &ep_ranks)?,
            shard: ctx.group("ep_shard", &shard_ranks)?,
            replicas: ctx.group("ep_replicas", &replica_ranks)?,
        })
    }
}

impl MeshContext {
    /// A `dp_replicate x dp_shard x tp` mesh (names from `config.mesh_names`; with `cp_size >
    /// 1`, `dp_replicate x dp_shard x cp x tp` whose `dp_shard_cp` is the flattened `dp_shard x
    /// cp`; with `pp_size > 1`, a [`PP`] dimension outermost) over the ranks of `rank`,
    /// computing on `device`: `parallelize_model` moves the model there, and inputs are built
    /// there too. Checked before any communication.
    ///
    /// Burn 0.22 selects gradient checkpointing per device (every tensor of an op must agree).
    /// Activation checkpointing recomputes activations only on a checkpointing device: pass
    /// `device.gradient_checkpointing()` for it (asking for it on a plain device is an error
    /// that says so). FSDP's `reshard_after_forward` holds on both: on a plain device the
    /// weights of layers that gather them again in backward (`Lora<Linear>`, the models'
    /// projections, `comm::collectives::resharded_linear`) are dropped after forward and the
    /// others kept until backward; a checkpointing device drops them all, at about 1.4x the
    /// activations.
    pub fn new(
        rank: &RankContext,
        config: DistributedConfig,
        device: Device,
    ) -> Result<Self, ParallelError> {
        Self::from_plan(rank, config.plan(rank.world_size())?, device)
    }

    /// [`MeshContext::new`] from a plan already made ([`DistributedConfig::plan`]), which is
    /// then not checked again: how a program that validated its config before starting the
    /// ranks builds each rank's context. A plan made for another world size is an error.
    pub fn from_plan(
        rank: &RankContext,
        plan: Plan,
        device: Device,
    ) -> Result<Self, ParallelError> {
        let sizes = plan.sizes();
        if sizes.world() != rank.world_size() {
            return Err(ConfigError::WorldSize {
                configured: sizes.world(),
                launched: rank.world_size(),
            }
            .into());
        }
        let checkpointing = device.gradient_checkpointing_strategy()
            == Some(GradientCheckpointingStrategy::Balanced);
        check_device(&plan, &device, checkpointing)?;
        let names = plan.mesh_names();
        let mesh = match sizes.cp {
            1 => {
                // Pipeline stages outermost (NeMo's `pp x dp_replicate x dp_shard x cp x tp`).
                let stages = (sizes.pp > 1).then_some((PP, sizes.pp));
                let dims: Vec<(&str, usize)> = stages
                    .into_iter()
                    .chain([
                        (names.dp_replicate.as_str(), sizes.dp_replicate),
                        (names.dp_shard.as_str(), sizes.dp_shard),
                        (names.tp.as_str(), sizes.tp),
                    ])
                    .collect();
                let shape = MeshShape::new(&dims)?;
                let mut mesh = DeviceMesh::new(rank, shape)?;
                mesh.flatten(&[&names.dp_replicate, &names.dp_shard], DP)?;
                mesh.flatten(&[&names.dp_replicate, &names.dp_shard, &names.tp], WORLD)?;
                if sizes.pp > 1 {
                    mesh.flatten(&[PP], PP_BACKWARD)?;
                    mesh.flatten(
                        &[PP, &names.dp_replicate, &names.dp_shard, &names.tp],
                        ALL_STAGES,
                    )?;
                }
                mesh
            }
            _ => context_parallel_mesh(rank, names, sizes)?,
        };
        let fsdp = fsdp_config(&plan, &mesh, &device)?;
        let experts = match sizes.ep > 1 {
            true => Some(ExpertGroups::new(rank, sizes)?),
            false => None,
        };
        Ok(Self {
            plan,
            mesh,
            device,
            checkpointing,
            fsdp,
            experts,
        })
    }

    /// The plan the context was built from: what the config means on this world.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The validated config the context was built from.
    pub fn config(&self) -> &DistributedConfig {
        self.plan.config()
    }

    /// The mesh sizes the config resolved to.
    pub fn sizes(&self) -> MeshSizes {
        self.plan.sizes()
    }

    /// The device mesh, with the flattened `dp` and `world` dimensions.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// The device given to [`MeshContext::new`]: the model is moved there and inputs are built
    /// there.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The expert-parallel groups, when `ep_size > 1`.
    pub fn expert_groups(&self) -> Option<&ExpertGroups> {
        self.experts.as_ref()
    }

    /// The FSDP config of the experts of a MoE model: this context's (sharing its
    /// gradient-sync switch and memory tracker), sharded over the ranks that hold the same
    /// experts. `None` without expert parallelism.
    pub fn expert_fsdp_config(&self) -> Option<FsdpConfig> {
        let groups = self.experts.as_ref()?;
        let mut config = self.fsdp.clone();
        config.group = groups.shard.clone();
        Some(config)
    }

    /// This context, with FSDP loading every lazy parameter's rows from `rows` (see
    /// [`RowSource`](burn_parallel_fsdp::RowSource)): what [`parallelize_model`](crate::parallelize_model)
    /// takes to load a lazily built model sharded, each rank reading only its rows. The
    /// gradient-sync switch and the memory tracker stay shared with this context.
    pub fn reading_rows(&self, rows: burn_parallel_fsdp::RowSource) -> Self {
        let mut ctx = self.clone();
        ctx.fsdp = ctx.fsdp.rows_from(rows);
        ctx
    }

    /// The FSDP config of this context: FSDP2 over dp_shard, or HSDP with the replicas, in
    /// the configured mixed precision. Units are sharded with clones of it.
    pub fn fsdp_config(&self) -> &FsdpConfig {
        &self.fsdp
    }

    /// FSDP2's `set_requires_gradient_sync` for every model parallelized with this context:
    /// with `false`, backward adds each unit's gradients to a local unsharded accumulator
    /// and communicates nothing; the next backward with `true` reduces the accumulated sum
    /// once (gradient accumulation over micro-steps). Ignored (every backward reduces) when the
    /// config's `defer_fsdp_grad_sync` is false.
    pub fn set_requires_gradient_sync(&self, sync: bool) {
        self.fsdp
            .set_requires_gradient_sync(sync || !self.plan.defers_grad_sync());
    }

    /// This rank's model-state counters (what FSDP gathers and reduces; see `fsdp::memory`).
    pub fn memory(&self) -> &MemoryTracker {
        self.fsdp.memory()
    }

    /// Whether data parallelism runs as DDP (replicated parameters, bucketed gradient
    /// all-reduce) rather than through FSDP.
    pub fn uses_ddp(&self) -> bool {
        self.plan.uses_ddp()
    }

    /// Whether the dense flow's FSDP step shards the parameters at all: sharded or replicated
    /// data parallelism, a mixed-precision or offload policy that only FSDP applies, or
    /// megatron_fsdp (whose flat buffers are the strategy, even on one rank). Plain tensor
    /// parallelism (or one rank) in f32 leaves the parameters as they are. DDP never reaches
    /// that step unless its policy casts.
    pub fn shards_parameters(&self) -> bool {
        self.plan.shards_parameters()
    }

    /// Whether [`device`](Self::device) is Burn's gradient-checkpointing variant (what FSDP
    /// resharding and activation checkpointing need).
    pub fn on_checkpointing_device(&self) -> bool {
        self.checkpointing
    }

    /// This rank's global index.
    pub fn rank(&self) -> usize {
        self.mesh.rank()
    }

    /// The number of ranks in the mesh.
    pub fn world_size(&self) -> usize {
        self.mesh.shape().size()
    }

    fn group(&self, name: &str) -> &ProcessGroup {
        self.mesh
            .group(name)
            .expect("MeshContext::new created every dimension")
    }

    /// The group parameters are sharded over (FSDP2's shard dimension): the dp_shard ranks,
    /// flattened with the cp ranks under context parallelism (`dp_shard_cp`).
    pub fn dp_shard_group(&self) -> &ProcessGroup {
        self.group(&self.plan.mesh_names().dp_shard)
    }

    /// The group of replicas (HSDP), size 1 otherwise.
    pub fn dp_replicate_group(&self) -> &ProcessGroup {
        self.group(&self.plan.mesh_names().dp_replicate)
    }

    /// Every data-parallel rank: replicas x shards. DDP all-reduces over it.
    pub fn dp_group(&self) -> &ProcessGroup {
        self.group(DP)
    }

    /// Every rank of the mesh (of this rank's pipeline stage under pipeline parallelism).
    pub fn world_group(&self) -> &ProcessGroup {
        self.group(WORLD)
    }

    /// Every rank of every pipeline stage, in global rank order (its index is
    /// [`rank`](Self::rank)): the whole mesh. The [`world_group`](Self::world_group) when
    /// `pp_size` is 1. Sharded checkpoints exchange their plans and agree over it.
    pub fn all_stages_group(&self) -> &ProcessGroup {
        match self.sizes().pp {
            1 => self.world_group(),
            _ => self.group(ALL_STAGES),
        }
    }

    /// The pipeline group: one rank per stage, in stage order, all holding the same place
    /// within their stages (`None` when `pp_size` is 1). This rank's stage is its index.
    pub fn pp_group(&self) -> Option<&ProcessGroup> {
        (self.sizes().pp > 1).then(|| self.group(PP))
    }

    /// The second group of the [`pp_group`](Self::pp_group)'s ranks, for the gradients that
    /// travel back between stages (`None` when `pp_size` is 1).
    pub fn pp_backward_group(&self) -> Option<&ProcessGroup> {
        (self.sizes().pp > 1).then(|| self.group(PP_BACKWARD))
    }

    /// The rows of a `global_batch`-row batch this rank trains on: data-parallel rank `d` of
    /// `dp` takes rows `d * B / dp .. (d + 1) * B / dp` (a contiguous split whose sizes differ
    /// by at most one), and the tp ranks of one data-parallel group take the same rows. Pass
    /// it to the [`Step`](crate::Step) with the mean loss over these rows: it weights the loss
    /// so that the data-parallel average is the mean over the global batch.
    pub fn local_rows(&self, global_batch: usize) -> LocalRows {
        let (dp, d) = (self.dp_size(), self.dp_rank());
        LocalRows {
            rows: d * global_batch / dp..(d + 1) * global_batch / dp,
            global: global_batch,
            dp,
        }
    }

    /// The tensor-parallel group (size 1 without tensor parallelism).
    pub fn tp_group(&self) -> &ProcessGroup {
        self.group(&self.plan.mesh_names().tp)
    }

    /// The context-parallel group: the ranks of one data-parallel group that split each
    /// sequence (`None` when `cp_size` is 1).
    pub fn cp_group(&self) -> Option<&ProcessGroup> {
        (self.sizes().cp > 1).then(|| self.group(CP))
    }

    /// Every rank holding a different part of the global batch: `dp_replicate x dp_shard x
    /// cp` (the dp group when `cp` is 1). Losses and token counts are summed or averaged over
    /// it.
    pub fn dp_cp_group(&self) -> &ProcessGroup {
        match self.sizes().cp {
            1 => self.group(DP),
            _ => self.group(DP_CP),
        }
    }

    /// The number of ranks of [`dp_cp_group`](Self::dp_cp_group).
    pub fn dp_cp_size(&self) -> usize {
        self.dp_size() * self.sizes().cp
    }

    /// This rank's index among the data-parallel ranks (which rows of the batch it takes).
    pub fn dp_rank(&self) -> usize {
        self.dp_group().index()
    }

    /// The number of data-parallel ranks: replicas x shards.
    pub fn dp_size(&self) -> usize {
        self.sizes().dp_replicate * self.sizes().dp_shard
    }
}

/// The rows of a global batch one rank trains on ([`MeshContext::local_rows`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalRows {
    /// This rank's rows of the global batch.
    pub rows: std::ops::Range<usize>,
    /// The global batch size.
    pub global: usize,
    /// The number of data-parallel ranks the global batch is split over.
    pub dp: usize,
}

impl LocalRows {
    /// The number of rows this rank takes.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether this rank takes no rows (a global batch smaller than `dp`).
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// What the mean loss over these rows is multiplied by so that the data-parallel average
    /// of every rank's weighted loss is the mean over the global batch: `rows * dp / global`
    /// (1 when the batch divides evenly).
    pub fn loss_weight(&self) -> f64 {
        self.rows.len() as f64 * self.dp as f64 / self.global as f64
    }
}

/// What the device cannot do for the plan: selective checkpointing by op on a device without
/// gradient checkpointing.
fn check_device(plan: &Plan, device: &Device, checkpointing: bool) -> Result<(), ParallelError> {
    if checkpointing || !plan.checkpoints_ops() {
        return Ok(());
    }
    Err(ConfigError::NeedsCheckpointingDevice {
        needs: "selective_ac_option = \"op\" recomputes the element-wise ops",
        device: describe(device),
    }
    .into())
}

/// The FSDP config every unit of a model parallelized with the plan clones: FSDP2 over
/// dp_shard (HSDP with the replicas), in the plan's precision, prefetch and offload, with
/// Megatron-FSDP's flat buffers under that layout.
fn fsdp_config(
    plan: &Plan,
    mesh: &DeviceMesh,
    device: &Device,
) -> Result<FsdpConfig, ParallelError> {
    let names = plan.mesh_names();
    let shard = mesh.group(&names.dp_shard)?.clone();
    let mut fsdp = if plan.sizes().dp_replicate > 1 {
        FsdpConfig::hybrid(shard, mesh.group(&names.dp_replicate)?.clone())
    } else {
        FsdpConfig::new(shard)
    }
    .mixed_precision(plan.mixed_precision())
    .forward_prefetch_depth(plan.forward_prefetch_depth())
    .backward_prefetch_depth(plan.backward_prefetch_depth());
    if let DataParallel::Flat {
        zero,
        bucket_elements,
    } = plan.data_parallel()
    {
        fsdp = fsdp
            .layout(ShardLayout::FlatBuffer)
            .bucket_elements(bucket_elements);
        if zero == ZeroDpStrategy::Optim {
            fsdp = fsdp.gradient_reduction(GradientReduction::AllReduce);
        }
    }
    if plan.offloads() {
        fsdp = fsdp.offload(OffloadPolicy::new(offload_host(device)));
    }
    Ok(fsdp)
}

/// The mesh of a context-parallel config, `dp_replicate x dp_shard x cp x tp` (tp innermost):
/// the configured `dp_shard` name (`dp_shard_cp`) is the flattened `dp_shard x cp`, FSDP's
/// shard group; `dp` is `dp_replicate x dp_shard` (the ranks reading different rows), `dp_cp`
/// adds cp, `world` is every rank.
fn context_parallel_mesh(
    rank: &RankContext,
    names: &MeshNames,
    sizes: MeshSizes,
) -> Result<DeviceMesh, ParallelError> {
    for name in [&names.dp_replicate, &names.dp_shard, &names.tp] {
        if name == DP_SHARD_ONLY || name == CP {
            return Err(ConfigError::ContextParallelMeshName(name.clone()).into());
        }
    }
    let shape = MeshShape::new(&[
        (names.dp_replicate.as_str(), sizes.dp_replicate),
        (DP_SHARD_ONLY, sizes.dp_shard),
        (CP, sizes.cp),
        (names.tp.as_str(), sizes.tp),
    ])?;
    let mut mesh = DeviceMesh::new(rank, shape)?;
    mesh.flatten(&[DP_SHARD_ONLY, CP], &names.dp_shard)?;
    mesh.flatten(&[&names.dp_replicate, DP_SHARD_ONLY], DP)?;
    mesh.flatten(&[&names.dp_replicate, DP_SHARD_ONLY, CP], DP_CP)?;
    mesh.flatten(&[&names.dp_replicate, DP_SHARD_ONLY, CP, &names.tp], WORLD)?;
    Ok(mesh)
}

/// Where offloaded shards live: a CPU device with autodiff (flex) for a GPU compute device, the
/// compute device itself for a CPU one (offloading is then a no-op).
fn offload_host(compute: &Device) -> Device {
    if is_cuda_device(compute) {
        Device::flex().autodiff()
    } else {
        compute.clone()
    }
}
