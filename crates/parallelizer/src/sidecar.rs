//! The sidecar: NeMo AutoModel's `ModelParallelizer` hooks as a trait with default methods.
//! A model overrides any hook by naming its own sidecar type in `#[parallelize(sidecar = T)]`;
//! every hook it does not override falls back to the default flow below.

use std::collections::BTreeMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};
use burn_parallel_comm::ProcessGroup;
use burn_parallel_comm::checkpoint::LayerCheckpointing;
use burn_parallel_comm::collectives::{describe, same_device};
use burn_parallel_describe::{
    CheckpointScope, DefaultParallelizer, ModelDescription, Parallelize, UnitMap,
    check_fused_colwise,
};
use burn_parallel_ep::ExpertModule;
use burn_parallel_fsdp::{FsdpConfig, fully_shard, param_ids, trainability};
use burn_parallel_tp::{TpApplier, TpModule, local_heads};

use crate::config::{Checkpointing, ConfigError, DataParallel, FrozenModuleSharding};
use crate::context::MeshContext;
use crate::ddp;
use crate::error::ParallelError;

/// The parallelizer hooks, narrowest first: `fully_shard_module` (the FSDP primitive),
/// `apply_fsdp_sharding` (unit boundaries), `fully_shard_untied_input_output_embeddings`,
/// `validate_tp_mesh`, `apply_tp`, `use_full_layer_activation_checkpointing`,
/// `reapply_trainability`, `apply` (the whole dense flow), `parallelize_megatron_fsdp`,
/// `parallelize_moe` and `parallelize` (the dispatch).
pub trait ModelParallelizer {
    /// Dispatches on the strategy: DDP, Megatron-FSDP, or the dense flow (FSDP2, HSDP, TP,
    /// FSDP2 + TP, and unsharded FSDP2 where a mixed-precision policy needs it: one rank, or
    /// DDP that casts).
    fn parallelize<M: Parallelize>(&self, model: M, ctx: &MeshContext) -> Result<M, ParallelError>
    where
        Self: Sized,
    {
        if ctx.expert_groups().is_some() {
            return self.parallelize_moe(model, ctx);
        }
        match ctx.plan().data_parallel() {
            DataParallel::Replicate { .. } => {
                let model = move_to_context_device(self, model, ctx)?;
                let model = self.reapply_trainability(model, ctx)?;
                ddp::replicate(model, ctx)
            }
            DataParallel::Flat { .. } => self.parallelize_megatron_fsdp(model, ctx),
            DataParallel::Shard | DataParallel::None => self.apply(model, ctx),
        }
    }

    /// Expert parallelism (`ep_size > 1`), as NeMo's MoE parallelizer: every `#[experts]`
    /// module keeps its share of the experts (split over the context's ep group), then the
    /// data parallelism of the strategy: DDP replicates the dense parameters over every
    /// data-parallel rank and the experts over the ranks holding the same ones; FSDP2/HSDP
    /// shards the dense units over dp_shard and each experts module as a unit of its own over
    /// the ranks holding the same experts. A model without `#[experts]` modules is an error.
    fn parallelize_moe<M: Parallelize>(
        &self,
        model: M,
        ctx: &MeshContext,
    ) -> Result<M, ParallelError>
    where
        Self: Sized,
    {
        let model = move_to_context_device(self, model, ctx)?;
        let (model, description) = split_experts(model, ctx)?;
        if ctx.uses_ddp() {
            let model = self.reapply_trainability(model, ctx)?;
            return ddp::replicate_with_experts(model, &description, ctx);
        }
        self.apply(model, ctx)
    }

    /// Megatron-FSDP: the dense flow's unit boundaries ([`Self::apply_fsdp_sharding`]) with
    /// the context's FSDP config, whose layout is one flat buffer per unit (see
    /// [`ShardLayout::FlatBuffer`](burn_parallel_fsdp::ShardLayout)).
    fn parallelize_megatron_fsdp<M: Parallelize>(
        &self,
        model: M,
        ctx: &MeshContext,
    ) -> Result<M, ParallelError>
    where
        Self: Sized,
    {
        self.apply(model, ctx)
    }

    /// The dense flow, as TorchTitan's `parallelize_llama` reads: validate the mesh against
    /// the model and apply tensor parallelism (when the mesh has a tp dimension), activation
    /// checkpointing (or the move to the context's device), then FSDP sharding.
    fn apply<M: Parallelize>(&self, model: M, ctx: &MeshContext) -> Result<M, ParallelError>
    where
        Self: Sized,
    {
        let mut description = ModelDescription::default();
        model.describe("", &mut description);
        let model = if ctx.sizes().tp > 1 {
            self.validate_tp_mesh(&model, &description, ctx)?;
            self.apply_tp(model, &description, ctx)?
        } else {
            model
        };
        let model = move_to_context_device(self, model, ctx)?;
        let model = self.reapply_trainability(model, ctx)?;
        self.apply_fsdp_sharding(model, &description, ctx)
    }

    /// NeMo's `reapply_trainability`: sets which parameters train (`Param::set_require_grad`),
    /// run after tensor parallelism and activation checkpointing and before FSDP sharding
    /// (DDP: before the replicas are made), so that frozen parameters are known when units are
    /// formed. The default keeps the model's own settings: TP splits, device moves and the
    /// checkpointing device keep each parameter's `require_grad`.
    fn reapply_trainability<M: Module>(
        &self,
        model: M,
        _ctx: &MeshContext,
    ) -> Result<M, ParallelError> {
        Ok(model)
    }

    /// Attention heads and kv heads must divide by the tp size, and no fused projection (one
    /// Linear computing q, k and v side by side) of an attention module that declares its heads
    /// may get plain `colwise`: the error names `colwise_fused(k)` (the rule:
    /// [`check_fused_colwise`]). Reads `model` for its layers' widths; NeMo's
    /// `validate_tp_mesh(model, tp_mesh)`.
    fn validate_tp_mesh<M: Module>(
        &self,
        model: &M,
        description: &ModelDescription,
        ctx: &MeshContext,
    ) -> Result<(), ParallelError> {
        let tp = ctx.sizes().tp;
        for h in &description.heads {
            let heads = h.heads.unwrap_or(0);
            let kv_heads = h.kv_heads.unwrap_or(heads);
            if heads > 0 {
                local_heads(heads, kv_heads, tp).map_err(|e| ConfigError::Heads {
                    path: h.path.clone(),
                    reason: e.to_string(),
                })?;
            }
        }
        if description.heads.is_empty() {
            return Ok(());
        }
        let plan = ctx.plan().tp_plan(description)?;
        check_fused_colwise(&description.heads, &plan, &linear_weights(model))
            .map_err(|e| ConfigError::FusedProjection(e).into())
    }

    /// Applies the TP plan: the config's `tp_shard_plan` when given, else the one the model
    /// declares. Plan entries that match no module are errors.
    fn apply_tp<M: TpModule>(
        &self,
        model: M,
        description: &ModelDescription,
        ctx: &MeshContext,
    ) -> Result<M, ParallelError> {
        let plan = ctx.plan().tp_plan(description)?;
        if plan.entries().is_empty() {
            return Err(ConfigError::NoTpPlan { tp: ctx.sizes().tp }.into());
        }
        let mut applier = TpApplier::new(&plan, ctx.tp_group())
            .with_async_steps(ctx.plan().async_tensor_parallel());
        if let Some(dtype) = ctx.plan().mixed_precision().reduce_dtype {
            applier = applier.with_reduce_dtype(dtype.into());
        }
        let model = model.apply_tp("", &mut applier)?;
        applier.finish().check_entries()?;
        Ok(model)
    }

    /// Activation checkpointing, as the plan's [`Checkpointing`] says. By layer: the model's
    /// `#[checkpoint]` fields in `activation_checkpointing_scope` take the policy, and their
    /// forwards recompute each picked layer in backward. By op (or `"full"` on a model without that field): Burn 0.22's checkpointing
    /// device, whose balanced strategy recomputes memory-bound activations in backward; the
    /// context's device must be that variant. Either way the parameters move to the context's
    /// device.
    fn use_full_layer_activation_checkpointing<M: Parallelize>(
        &self,
        mut model: M,
        ctx: &MeshContext,
    ) -> Result<M, ParallelError> {
        let per_layer = match ctx.plan().checkpointing() {
            Some(Checkpointing::Layers(k)) => {
                let scope = checkpointing_scope(&model, ctx.plan().checkpointed_part())?;
                let set = model.set_layer_checkpointing(LayerCheckpointing::Every(k), scope);
                if set == 0
                    && let Some(part) = ctx.plan().checkpointed_part()
                {
                    return Err(ConfigError::NoLayerCheckpointingInPart {
                        scope: part.to_string(),
                    }
                    .into());
                }
                (set > 0).then_some(k)
            }
            _ => None,
        };
        let needs = match (ctx.plan().checkpointing(), per_layer) {
            (_, Some(_)) | (None, _) => None,
            (Some(Checkpointing::Layers(1)), None) => Some(
                "activation_checkpointing_mode = \"full\" on a model without a #[checkpoint] field \
                 (per-layer checkpointing) recomputes through Burn's device",
            ),
            (Some(Checkpointing::Layers(_)), None) => {
                return Err(ConfigError::NoLayerCheckpointing.into());
            }
            (Some(Checkpointing::Ops), None) => None,
        };
        if let Some(needs) = needs.filter(|_| !ctx.on_checkpointing_device()) {
            return Err(ConfigError::NeedsCheckpointingDevice {
                needs,
                device: describe(ctx.device()),
            }
            .into());
        }
        Ok(model.map(&mut ToDevice(ctx.device())))
    }

    /// Unit boundaries: every declared unit is fully sharded on its own (innermost first),
    /// then the untied embeddings, then the root takes what remains. Resharding after forward
    /// follows `reshard_after_forward`, or NeMo's default: every unit but the last reshards,
    /// the root never does.
    fn apply_fsdp_sharding<M: Parallelize>(
        &self,
        model: M,
        description: &ModelDescription,
        ctx: &MeshContext,
    ) -> Result<M, ParallelError>
    where
        Self: Sized,
    {
        shard_units(self, model, description, ctx)
    }

    /// NeMo gives large untied, trainable embedding and LM-head tables their own units. Here
    /// a model declares such tables as `#[fsdp(unit)]` fields; the default adds nothing.
    fn fully_shard_untied_input_output_embeddings<M: Parallelize>(
        &self,
        model: M,
        _description: &ModelDescription,
        _ctx: &MeshContext,
    ) -> Result<M, ParallelError> {
        Ok(model)
    }

    /// The FSDP primitive: shards every not-yet-sharded float parameter of `module`.
    fn fully_shard_module<N: Module>(
        &self,
        module: N,
        config: &FsdpConfig,
    ) -> Result<N, ParallelError> {
        Ok(fully_shard(module, config)?)
    }
}

/// The default sidecar runs every hook as defined above.
impl ModelParallelizer for DefaultParallelizer {}

/// The `[d_in, d_out]` weight of every Burn `Linear` of `model` by its module path: the
/// layers whose split the library does. A user's own `TpLayer` splits its parameters itself
/// (a fused projection it cuts part by part under plain `colwise`, say), so it is not checked.
fn linear_weights<M: Module>(model: &M) -> BTreeMap<String, [usize; 2]> {
    /// The module path, with the type of the struct each name is a field of.
    struct Weights {
        stack: Vec<(String, String)>,
        found: BTreeMap<String, [usize; 2]>,
    }
    impl ModuleVisitor for Weights {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.stack
                .push((name.to_string(), container_type.to_string()));
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(((field, owner), layer)) = self.stack.split_last() else {
                return;
            };
            if let ("weight", "Struct:Linear", [d_in, d_out]) = (
                field.as_str(),
                owner.as_str(),
                param.lazy_shape().as_slice(),
            ) {
                let path: Vec<&str> = layer.iter().map(|(name, _)| name.as_str()).collect();
                self.found.insert(path.join("."), [*d_in, *d_out]);
            }
        }
    }
    let mut weights = Weights {
        stack: Vec::new(),
        found: BTreeMap::new(),
    };
    model.visit(&mut weights);
    weights.found
}

/// The FSDP config of a context (see [`MeshContext::fsdp_config`]).
pub fn fsdp_config(ctx: &MeshContext) -> FsdpConfig {
    ctx.fsdp_config().clone()
}

/// Activation checkpointing when asked, else the move to the context's device (where the
/// inputs are built).
fn move_to_context_device<S: ModelParallelizer, M: Parallelize>(
    sidecar: &S,
    model: M,
    ctx: &MeshContext,
) -> Result<M, ParallelError> {
    if ctx.plan().activation_checkpointing() {
        sidecar.use_full_layer_activation_checkpointing(model, ctx)
    } else {
        Ok(model.map(&mut ToDevice(ctx.device())))
    }
}

/// The default unit boundaries (see [`ModelParallelizer::apply_fsdp_sharding`]). Every unit
/// goes through the sidecar's `fully_shard_module`, with the context's config (which carries
/// the row source of a sharded load, if any).
fn shard_units<S: ModelParallelizer, M: Parallelize>(
    sidecar: &S,
    model: M,
    description: &ModelDescription,
    ctx: &MeshContext,
) -> Result<M, ParallelError> {
    if !ctx.shards_parameters() {
        // Nothing shards: a lazy parameter reads its whole tensor when first used.
        return Ok(model);
    }
    let base = fsdp_config(ctx);
    let explicit = ctx.plan().resharding();
    let last = description.units.last().cloned();
    let mut sharder = UnitSharder {
        sidecar,
        base: base.clone(),
        experts: ctx.expert_fsdp_config(),
        reshard: |path: &str| explicit.unwrap_or(Some(path) != last.as_deref()),
        frozen: ctx.plan().frozen_sharding(),
    };
    let model = model.map_units("", &mut sharder)?;
    let model = sidecar.fully_shard_untied_input_output_embeddings(model, description, ctx)?;
    // `base` now leaves out the replicated frozen units.
    let root = sharder
        .base
        .clone()
        .reshard_after_forward(explicit.unwrap_or(false));
    sidecar.fully_shard_module(model, &root)
}

struct UnitSharder<'a, S, R> {
    sidecar: &'a S,
    /// The context's config, plus the parameters of frozen units kept whole (`replicate`).
    base: FsdpConfig,
    /// The experts' config under expert parallelism.
    experts: Option<FsdpConfig>,
    reshard: R,
    frozen: FrozenModuleSharding,
}

impl<S, R> UnitMap for UnitSharder<'_, S, R>
where
    S: ModelParallelizer,
    R: Fn(&str) -> bool,
{
    type Error = ParallelError;

    fn unit<N: Module>(&mut self, path: &str, module: N) -> Result<N, ParallelError> {
        // A wholly frozen unit (NeMo's frozen towers): the same on every rank, as every rank
        // holds the same model.
        if trainability(&module).wholly_frozen() {
            match self.frozen {
                FrozenModuleSharding::PerLayer => {}
                // The root's unit takes its parameters.
                FrozenModuleSharding::Root => return Ok(module),
                FrozenModuleSharding::Replicate => {
                    self.base = self.base.clone().ignore_params(param_ids(&module));
                    return Ok(module);
                }
            }
        }
        let config = self
            .base
            .clone()
            .reshard_after_forward((self.reshard)(path));
        self.sidecar.fully_shard_module(module, &config)
    }

    /// Under expert parallelism an experts module is a unit of its own, sharded over the
    /// ranks that hold the same experts (before its layer's unit takes the rest).
    fn experts<N: ExpertModule>(&mut self, path: &str, module: N) -> Result<N, ParallelError> {
        let Some(config) = &self.experts else {
            return Ok(module);
        };
        let config = config.clone().reshard_after_forward((self.reshard)(path));
        self.sidecar.fully_shard_module(module, &config)
    }
}

/// Splits every `#[experts]` module's experts over the context's ep group (those already split
/// over it stay as they are), with the model's description. A model without `#[experts]`
/// modules is an error, except a pipeline stage (its layers may all be dense).
fn split_experts<M: Parallelize>(
    model: M,
    ctx: &MeshContext,
) -> Result<(M, ModelDescription), ParallelError> {
    let groups = ctx
        .expert_groups()
        .expect("experts are split under expert parallelism");
    let mut description = ModelDescription::default();
    model.describe("", &mut description);
    // A pipeline stage may hold only dense layers of a MoE model.
    if description.experts.is_empty() && ctx.sizes().pp == 1 {
        return Err(ConfigError::NoExperts {
            ep: groups.ep.size(),
        }
        .into());
    }
    let model = model.map_units("", &mut ExpertSharder(&groups.ep))?;
    Ok((model, description))
}

/// Splits every `#[experts]` module's experts over the ep group; units stay as they are.
struct ExpertSharder<'a>(&'a ProcessGroup);

impl UnitMap for ExpertSharder<'_> {
    type Error = ParallelError;

    fn unit<N: Module>(&mut self, _path: &str, module: N) -> Result<N, ParallelError> {
        Ok(module)
    }

    fn experts<N: ExpertModule>(&mut self, _path: &str, module: N) -> Result<N, ParallelError> {
        Ok(module.shard_experts(self.0)?)
    }
}

/// Rebuilds each parameter that is not on the device (hardware and checkpointing strategy) on
/// it, keeping ids and trainability; parameters already there are left as they are.
struct ToDevice<'a>(&'a Device);

impl ModuleMapper for ToDevice<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let device = self.0;
        if !param.is_initialized() {
            // A lazy parameter moves without being read (a sharded load reads only its rows).
            return match same_device(&param.lazy_device(), device) {
                true => param,
                false => param.to_device(device),
            };
        }
        param.map(|t| {
            if same_device(&t.device(), device) {
                return t;
            }
            let trainable = t.is_require_grad();
            let moved = Tensor::<D>::from_data(t.into_data(), device);
            if trainable {
                moved.require_grad()
            } else {
                moved
            }
        })
    }
}

/// The [`CheckpointScope`] of `activation_checkpointing_scope`: the whole model, or a part it
/// declares (an undeclared one is an error listing the declared parts).
fn checkpointing_scope<'a, M: Parallelize>(
    model: &M,
    part: Option<&'a str>,
) -> Result<CheckpointScope<'a>, ParallelError> {
    let Some(part) = part else {
        return Ok(CheckpointScope::all());
    };
    let mut description = ModelDescription::default();
    model.describe("", &mut description);
    let declared = description.part_names();
    if !declared.contains(&part) {
        return Err(ConfigError::UndeclaredCheckpointingPart {
            scope: part.to_string(),
            declared: match declared.is_empty() {
                true => "no parts".into(),
                false => declared.join(", "),
            },
        }
        .into());
    }
    Ok(CheckpointScope::part(part))
}
