//! Per-parameter sharding through Burn's `Reparameterization`.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::module::{Module, Param, ParamId, Reparameterization, Reparameterizer};
use burn::tensor::{DType, Tensor, TensorData};
use burn_parallel_dist::ProcessGroup;
use burn_parallel_dist::chunk::chunk_range;
use burn_parallel_dist::collectives::GatherOptions;

use crate::error::FsdpError;
use crate::gather::{Accumulator, GatherPlan, gather_param};
use crate::load::{RowRequest, Source};
use crate::offload::OffloadPolicy;
use crate::policy::MixedPrecisionPolicy;
use crate::unit::{COLLECTING, Collected, SERVED};

/// How [`fully_shard`] shards and gathers.
#[derive(Debug, Clone)]
pub struct FsdpConfig {
    /// The group the parameters are sharded over (FSDP2's shard mesh dimension).
    pub group: ProcessGroup,
    /// HSDP: the group of replicas of this shard (`dp_replicate`). Gradients are
    /// reduce-scattered within `group`, then all-reduced across replicas.
    pub replicate_group: Option<ProcessGroup>,
    /// Drop gathered weights after forward and gather again in backward. Takes effect on a
    /// device with gradient checkpointing (`Device::autodiff().gradient_checkpointing()`);
    /// otherwise the gathered weights are kept until backward.
    pub reshard_after_forward: bool,
    pub mixed_precision: MixedPrecisionPolicy,
    /// Shards, gradients and optimizer step on a host device (`None`: on the compute device).
    pub offload: Option<OffloadPolicy>,
    /// Shared by every parameter sharded with this config (and its clones).
    sync: Arc<AtomicBool>,
}

impl FsdpConfig {
    pub fn new(group: ProcessGroup) -> Self {
        Self {
            group,
            replicate_group: None,
            reshard_after_forward: true,
            mixed_precision: MixedPrecisionPolicy::default(),
            offload: None,
            sync: Arc::new(AtomicBool::new(true)),
        }
    }

    /// FSDP2's `set_requires_gradient_sync`: with `false`, backward adds each parameter's
    /// full gradient to a local accumulator and communicates nothing (the shards get zeros);
    /// the next backward with `true` reduce-scatters the accumulated sum once. Under HSDP it
    /// also skips the replica all-reduce.
    pub fn set_requires_gradient_sync(&self, sync: bool) {
        self.sync.store(sync, Ordering::SeqCst);
    }

    pub fn mixed_precision(mut self, policy: MixedPrecisionPolicy) -> Self {
        self.mixed_precision = policy;
        self
    }

    /// HSDP over `replicate` x `group`.
    pub fn hybrid(group: ProcessGroup, replicate: ProcessGroup) -> Self {
        Self {
            replicate_group: Some(replicate),
            ..Self::new(group)
        }
    }

    pub fn reshard_after_forward(mut self, reshard: bool) -> Self {
        self.reshard_after_forward = reshard;
        self
    }

    /// Keeps shards, their gradients and the optimizer step on `policy.host`.
    pub fn offload(mut self, policy: OffloadPolicy) -> Self {
        self.offload = Some(policy);
        self
    }
}

/// The reparameterization FSDP attaches to each sharded parameter: its effective value is the
/// all-gather of the shards along dim 0.
#[derive(Module, Debug)]
pub struct ShardGather {
    #[module(skip)]
    plan: Option<GatherPlan>,
    #[module(skip)]
    accumulator: Accumulator,
    /// The parameter's id and full size along dim 0, for coalesced unit gathers.
    #[module(skip)]
    id: Option<ParamId>,
    #[module(skip)]
    full_rows: usize,
}

/// The gather options in force: the shard dtype while `gather_full` materializes.
pub(crate) fn effective_options(options: GatherOptions) -> GatherOptions {
    if GATHER_IN_SHARD_DTYPE.get() {
        GatherOptions {
            compute_dtype: None,
            ..options
        }
    } else {
        options
    }
}

impl Reparameterization for ShardGather {
    const NAME: &'static str = "fsdp_shard";

    fn apply<const D: usize>(&self, base: Tensor<D>) -> Tensor<D> {
        let plan = self.plan.as_ref().expect("set by fully_shard");
        let id = self.id.expect("set by fully_shard");
        let collecting = COLLECTING.with(|c| match c.borrow_mut().as_mut() {
            Some(collected) => {
                let dims = base.dims();
                collected.push(Collected {
                    id,
                    shard: base.clone().reshape([dims.iter().product::<usize>()]),
                    full_rows: self.full_rows,
                    row_len: dims[1..].iter().product(),
                    plan: plan.clone(),
                    accumulator: self.accumulator.clone(),
                });
                true
            }
            None => false,
        });
        if collecting {
            return base;
        }
        let served = SERVED.with(|s| {
            s.borrow().get(&id).map(|flat| {
                let mut shape = base.dims();
                shape[0] = self.full_rows;
                flat.clone().reshape(shape)
            })
        });
        if let Some(value) = served {
            return value;
        }
        // `Param::val` cannot return an error; the launcher reports the panic as this rank's
        // failure and releases the others.
        let gathered_elems = self.full_rows * base.dims()[1..].iter().product::<usize>();
        gather_param(
            base,
            plan,
            effective_options(plan.options),
            &self.accumulator,
            gathered_elems,
        )
        .unwrap_or_else(|e| panic!("FSDP all-gather of a parameter failed: {e}"))
    }
}

struct Sharder<'a> {
    config: &'a FsdpConfig,
    /// Parameters an earlier `fully_shard` (an inner unit) already sharded.
    already_sharded: HashSet<ParamId>,
    /// Where a sharded load takes each shard's rows from (`None`: from the module itself).
    source: Option<Source<'a>>,
    error: Option<FsdpError>,
}

impl Sharder<'_> {
    /// This rank's rows of a full parameter, as a fresh leaf.
    fn slice<const D: usize>(&self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let group = &self.config.group;
        param.map(|full| {
            let rows = chunk_range(full.dims()[0], group.size(), group.index());
            let trainable = full.is_require_grad();
            // A fresh leaf: the shard, not a view into the full tensor, is what is trained.
            let shard = if rows.is_empty() {
                // Burn cannot narrow to zero rows; an empty shard is built directly.
                let mut shape = full.dims();
                shape[0] = 0;
                let data = TensorData::new(Vec::<f32>::new(), shape).convert_dtype(full.dtype());
                Tensor::<D>::from_data(data, &full.device())
            } else {
                full.narrow(0, rows.start, rows.len()).detach()
            };
            if trainable {
                shard.require_grad()
            } else {
                shard
            }
        })
    }

    /// This rank's rows read from the source; the (lazy) full parameter is never initialized.
    fn load<const D: usize>(
        &mut self,
        path: &str,
        param: Param<Tensor<D>>,
    ) -> Result<Param<Tensor<D>>, FsdpError> {
        let group = &self.config.group;
        let shape = param.lazy_shape().to_vec();
        let rows = chunk_range(shape[0], group.size(), group.index());
        let mut want = shape.clone();
        want[0] = rows.len();
        let source = self.source.as_mut().expect("a sharded load has a source");
        let request = RowRequest {
            path,
            id: param.id,
            shape: &shape,
            rows,
        };
        let data = source(&request).map_err(|message| FsdpError::Load {
            path: path.to_string(),
            message,
        })?;
        if data.shape().to_vec() != want || !data.dtype().is_float() {
            return Err(FsdpError::Load {
                path: path.to_string(),
                message: format!(
                    "the source returned {:?} {:?} for rows {:?} of {shape:?}; expected float {want:?}",
                    data.dtype(),
                    data.shape().to_vec(),
                    request.rows,
                ),
            });
        }
        let shard = Tensor::<D>::from_data(data, &param.lazy_device());
        let id = param.id;
        // Takes the parameter's device and gradient setting without running its initializer.
        Ok(param.transform_for_load(shard, id))
    }
}

impl Reparameterizer for &mut Sharder<'_> {
    type Reparam = ShardGather;

    fn reparameterize<const D: usize>(
        &mut self,
        path: &str,
        param: Param<Tensor<D>>,
    ) -> (Param<Tensor<D>>, Option<ShardGather>) {
        // FSDP2 shards inner units first and the root last: the root keeps only what no
        // unit took (Burn does not nest reparameterizations). Burn hands the mapper the base
        // without its reparameterization, so sharded ones are recognised by id.
        if self.already_sharded.contains(&param.id) {
            return (param, None);
        }
        let group = &self.config.group;
        let policy = self.config.mixed_precision;
        let (id, full_rows) = (param.id, param.lazy_shape()[0]);
        let compute = param.lazy_device();
        if self.error.is_none()
            && let Err(e) = policy.check(&compute)
        {
            self.error = Some(e);
        }
        // A sharded load reads only parameters that are still lazy: ones an earlier step (a
        // tensor-parallel split) materialized are sliced like any other.
        let shard = if self.source.is_some() && !param.is_initialized() {
            if self.error.is_some() {
                // Ask the source for nothing more once a load failed.
                return (param, None);
            }
            match self.load(path, param.clone()) {
                Ok(shard) => shard,
                Err(e) => {
                    self.error = Some(e);
                    return (param, None);
                }
            }
        } else {
            self.slice(param)
        };
        let shard = match &self.config.offload {
            Some(offload) => shard.map(|s| offload.place(s)),
            None => shard,
        };
        let gather = ShardGather {
            plan: Some(GatherPlan {
                group: group.clone(),
                replicate_group: self.config.replicate_group.clone(),
                options: GatherOptions {
                    recompute: self.config.reshard_after_forward,
                    compute_dtype: policy.param_dtype.map(DType::from),
                    reduce_dtype: policy.reduce_dtype.map(DType::from),
                },
                sync: self.config.sync.clone(),
                compute: self.config.offload.as_ref().map(|_| compute),
            }),
            accumulator: Accumulator::default(),
            id: Some(id),
            full_rows,
        };
        (shard, Some(gather))
    }
}

/// Shards every float parameter of `module` on dim 0 over `config.group`. Every rank calls
/// it with the same (replicated) module; each keeps its own chunk. Parameter ids are kept.
/// Parameters already sharded (by an earlier call on a submodule, FSDP2's inner units) keep
/// their own config.
/// Fails, before any communication, on a mixed-precision dtype the device cannot run.
pub fn fully_shard<M: Module>(module: M, config: &FsdpConfig) -> Result<M, FsdpError> {
    shard_module(module, config, None)
}

pub(crate) fn shard_module<'a, M: Module>(
    module: M,
    config: &'a FsdpConfig,
    source: Option<Source<'a>>,
) -> Result<M, FsdpError> {
    let mut sharded = ShardedIds::default();
    module.visit(&mut sharded);
    let mut sharder = Sharder {
        config,
        already_sharded: sharded.ids,
        source,
        error: None,
    };
    let sharded = module.apply_reparameterization(&mut sharder);
    match sharder.error {
        Some(e) => Err(e),
        None => Ok(sharded),
    }
}

thread_local! {
    /// Set while `gather_full` materializes, so that a full state keeps the shards' dtype
    /// (f32) instead of the mixed-precision compute dtype. A rank is one thread (or process).
    static GATHER_IN_SHARD_DTYPE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The full (gathered) module, with plain parameters in the shards' dtype: collective, so every
/// rank of the group calls it.
pub fn gather_full<M: Module>(module: M) -> M {
    GATHER_IN_SHARD_DTYPE.set(true);
    let full = module.materialize();
    GATHER_IN_SHARD_DTYPE.set(false);
    full
}

/// Collects the ids of parameters that carry a [`ShardGather`]: a visitor sees a parameter's
/// base first, then enters its reparameterization as a module named after it.
#[derive(Default)]
struct ShardedIds {
    last: Option<ParamId>,
    ids: HashSet<ParamId>,
}

impl burn::module::ModuleVisitor for ShardedIds {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.last = Some(param.id);
    }

    fn enter_module(&mut self, name: &str, container_type: &str) {
        if container_type == "Reparameterization"
            && name == <ShardGather as Reparameterization>::NAME
            && let Some(id) = self.last.take()
        {
            self.ids.insert(id);
        }
    }
}
