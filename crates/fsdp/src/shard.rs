//! `fully_shard`: per-parameter sharding through Burn's `Reparameterization`. One call is one
//! unit ([`UnitState`]); each parameter it shards gets a [`ParamState`] in its
//! [`ShardGather`].

use std::collections::HashSet;
use std::ops::Range;
use std::sync::Arc;

use burn::module::{Module, Param, ParamId, Reparameterizer};
use burn::tensor::{Tensor, TensorData};
use burn_parallel_comm::chunk::chunk_range;

use crate::config::FsdpConfig;
use crate::error::FsdpError;
use crate::reparam::{ShardGather, collect, is_marker};
use crate::state::{ParamState, UnitState};

/// What a sharded load asks its source for: rows `rows` (along dim 0) of the full parameter at
/// `path` (Burn's module path, e.g. `layers.0.weight`), whose full shape is `shape`. `rows` is
/// empty on a rank that holds no rows of a small parameter: return a `[0, ...]` tensor of the
/// parameter's dtype.
#[derive(Debug, Clone)]
pub struct RowRequest<'a> {
    /// Burn's module path of the parameter.
    pub path: &'a str,
    /// The parameter's id.
    pub id: ParamId,
    /// The full (unsharded) shape.
    pub shape: &'a [usize],
    /// The rows (along dim 0) this rank stores.
    pub rows: Range<usize>,
}

pub(crate) type Source<'a> = &'a mut dyn FnMut(&RowRequest) -> Result<TensorData, String>;

struct Sharder<'a> {
    config: &'a FsdpConfig,
    /// The unit this call makes, once its first parameter (and so its compute device) is seen.
    unit: Option<Arc<UnitState>>,
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

    /// The unit of this call, made on the first parameter (whose device computes).
    fn unit(&mut self, compute: &burn::tensor::Device) -> Arc<UnitState> {
        let config = self.config;
        self.unit
            .get_or_insert_with(|| Arc::new(UnitState::new(config, compute)))
            .clone()
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
        // without its reparameterization, so sharded ones are recognised by id; the markers
        // that carry their state (see `reparam`) are passed through.
        if is_marker(&param) || self.already_sharded.contains(&param.id) {
            return (param, None);
        }
        let (id, shape) = (param.id, param.lazy_shape().to_vec());
        let compute = param.lazy_device();
        if self.error.is_none()
            && let Err(e) = self.config.mixed_precision.check(&compute)
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
        let unit = self.unit(&compute);
        let gather = ShardGather::new(ParamState::new(id, shape, unit), &shard.lazy_device());
        (shard, Some(gather))
    }
}

/// Shards every float parameter of `module` on dim 0 over `config.group`: one FSDP unit. Every
/// rank calls it with the same (replicated) module; each keeps its own chunk. Parameter ids are
/// kept. Parameters already sharded (by an earlier call on a submodule, FSDP2's inner units)
/// keep their own unit.
/// Fails, before any communication, on a mixed-precision dtype the device cannot run.
pub fn fully_shard<M: Module>(module: M, config: &FsdpConfig) -> Result<M, FsdpError> {
    shard_module(module, config, None)
}

pub(crate) fn shard_module<'a, M: Module>(
    module: M,
    config: &'a FsdpConfig,
    source: Option<Source<'a>>,
) -> Result<M, FsdpError> {
    let already_sharded = collect(&module).iter().map(|c| c.state.id).collect();
    let mut sharder = Sharder {
        config,
        unit: None,
        already_sharded,
        source,
        error: None,
    };
    let sharded = module.apply_reparameterization(&mut sharder);
    match sharder.error {
        Some(e) => Err(e),
        None => Ok(sharded),
    }
}
