//! `fully_shard`: per-parameter sharding through Burn's `Reparameterization`. One call is one
//! unit ([`UnitState`]); each parameter it shards gets a [`ParamState`] in its
//! [`ShardGather`].

use std::collections::HashSet;
use std::ops::Range;
use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param, ParamId, Reparameterizer};
use burn::tensor::{DType, Tensor, TensorData};
use burn_parallel_comm::chunk::chunk_range;

use crate::config::{FsdpConfig, ShardLayout};
use crate::error::FsdpError;
use crate::reparam::{ShardGather, collect, is_marker};
use crate::rows::RowRequest;
use crate::state::{FlatBuffer, ParamState, UnitState};

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
    /// The unit's flat buffer (flat layout only), and where the next parameter starts in it.
    flat: Option<FlatBuffer>,
    next_offset: usize,
    /// The dtype of the unit's first parameter: a flat buffer holds one dtype.
    flat_dtype: Option<DType>,
    /// The unit's nesting level (see `UnitState::level`).
    level: usize,
}

/// An empty `[0, ..]` tensor of `shape`'s trailing dims: Burn cannot narrow to zero elements.
fn empty<const D: usize>(
    mut shape: [usize; D],
    dtype: DType,
    device: &burn::tensor::Device,
) -> Tensor<D> {
    shape[0] = 0;
    let data = TensorData::new(Vec::<f32>::new(), shape).convert_dtype(dtype);
    // The dtype given explicitly: `from_data` alone takes the device's default float dtype.
    Tensor::<D>::from_data(data, (device, dtype))
}

/// The stored shape of a flat piece of `len` elements: `[len, 1, ..]`, so that gathering the
/// pieces along dim 0 concatenates the flattened parameter.
fn piece_shape<const D: usize>(len: usize) -> [usize; D] {
    let mut shape = [1; D];
    shape[0] = len;
    shape
}

/// Elements `piece` of `full` (flattened), as a fresh `[len, 1, ..]` tensor.
fn cut_piece<const D: usize>(full: Tensor<D>, piece: &Range<usize>) -> Tensor<D> {
    if piece.is_empty() {
        return empty(piece_shape::<D>(0), full.dtype(), &full.device());
    }
    let n = full.shape().num_elements();
    full.reshape([n])
        .narrow(0, piece.start, piece.len())
        .reshape(piece_shape::<D>(piece.len()))
}

impl Sharder<'_> {
    /// This rank's piece of the parameter at `offset` in the unit's flat buffer (flat layout).
    fn flat_piece(&self, offset: usize, shape: &[usize]) -> Option<Range<usize>> {
        let group = &self.config.group;
        self.flat.map(|flat| {
            flat.pieces(offset, shape.iter().product(), group.size())[group.index()].clone()
        })
    }

    /// This rank's rows (or flat piece) of a full parameter, as a fresh leaf.
    fn slice<const D: usize>(
        &self,
        param: Param<Tensor<D>>,
        piece: Option<Range<usize>>,
    ) -> Param<Tensor<D>> {
        let group = &self.config.group;
        param.map(|full| {
            let rows = chunk_range(full.dims()[0], group.size(), group.index());
            let trainable = full.is_require_grad();
            // A fresh leaf: the shard, not a view into the full tensor, is what is trained.
            let shard = if let Some(piece) = &piece {
                cut_piece(full, piece).detach()
            } else if rows.is_empty() {
                empty(full.dims(), full.dtype(), &full.device())
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
    /// A flat piece reads the rows that cover it and keeps its elements.
    fn load<const D: usize>(
        &mut self,
        path: &str,
        param: Param<Tensor<D>>,
        piece: Option<Range<usize>>,
    ) -> Result<Param<Tensor<D>>, FsdpError> {
        let group = &self.config.group;
        let shape = param.lazy_shape().to_vec();
        let row_len: usize = shape[1..].iter().product();
        let rows = match &piece {
            Some(p) if p.is_empty() => 0..0,
            Some(p) => p.start / row_len..p.end.div_ceil(row_len),
            None => chunk_range(shape[0], group.size(), group.index()),
        };
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
        let shard = match &piece {
            Some(p) => {
                let first = request.rows.start * row_len;
                cut_piece(shard, &(p.start - first..p.end - first))
            }
            None => shard,
        };
        let id = param.id;
        // Takes the parameter's device and gradient setting without running its initializer.
        Ok(param.transform_for_load(shard, id))
    }

    /// The unit of this call, made on the first parameter (whose device computes).
    fn unit(&mut self, compute: &burn::tensor::Device) -> Arc<UnitState> {
        let (config, flat, level) = (self.config, self.flat, self.level);
        self.unit
            .get_or_insert_with(|| Arc::new(UnitState::new(config, compute, flat, level)))
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
        // Ignored parameters (a replicated frozen module) stay whole, outside every unit.
        if self.config.ignored_params().contains(&param.id) {
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
        let offset = self.next_offset;
        self.next_offset += shape.iter().product::<usize>();
        let piece = self.flat_piece(offset, &shape);
        let shard = if self.source.is_some() && !param.is_initialized() {
            if self.error.is_some() {
                // Ask the source for nothing more once a load failed.
                return (param, None);
            }
            match self.load(path, param.clone(), piece) {
                Ok(shard) => shard,
                Err(e) => {
                    self.error = Some(e);
                    return (param, None);
                }
            }
        } else {
            self.slice(param, piece)
        };
        if self.flat.is_some() {
            let dtype = shard.val().dtype();
            match self.flat_dtype {
                None => self.flat_dtype = Some(dtype),
                Some(first) if first != dtype && self.error.is_none() => {
                    self.error = Some(FsdpError::FlatDtypes {
                        path: path.to_string(),
                        dtype: format!("{dtype:?}"),
                        first: format!("{first:?}"),
                    });
                }
                Some(_) => {}
            }
        }
        let shard = match &self.config.offload {
            Some(offload) => shard.map(|s| offload.place(s)),
            None => shard,
        };
        // The same on every rank (every rank shards the same model): whether the unit's
        // gathers get a backward at all depends on it (see `unit::start_parts`).
        let trainable = shard.val().is_require_grad();
        let unit = self.unit(&compute);
        let state = ParamState::new(id, shape, unit, offset, trainable);
        let gather = ShardGather::new(state, &shard.lazy_device());
        (shard, Some(gather))
    }
}

/// Shards every float parameter of `module` on dim 0 over `config.group`: one FSDP unit. Every
/// rank calls it with the same (replicated) module; each keeps its own chunk. Parameter ids are
/// kept. Parameters already sharded (by an earlier call on a submodule, FSDP2's inner units)
/// keep their own unit.
/// Fails, before any communication, on a mixed-precision dtype the device cannot run.
pub fn fully_shard<M: Module>(module: M, config: &FsdpConfig) -> Result<M, FsdpError> {
    match &config.rows {
        // A sharded load: lazy parameters read only this rank's rows.
        Some(rows) => {
            let mut read = |request: &RowRequest| rows.read(request);
            shard_module(module, config, Some(&mut read))
        }
        None => shard_module(module, config, None),
    }
}

pub(crate) fn shard_module<'a, M: Module>(
    module: M,
    config: &'a FsdpConfig,
    source: Option<Source<'a>>,
) -> Result<M, FsdpError> {
    let inner = collect(&module);
    let level = inner
        .iter()
        .map(|c| c.state.unit.level + 1)
        .max()
        .unwrap_or(0);
    let already_sharded: HashSet<ParamId> = inner.iter().map(|c| c.state.id).collect();
    let flat = (config.layout == ShardLayout::FlatBuffer).then(|| {
        let skipped: HashSet<ParamId> = already_sharded
            .union(config.ignored_params())
            .copied()
            .collect();
        let (total, params) = unsharded_elements(&module, &skipped);
        FlatBuffer::new(total, params, config.group.size())
    });
    let mut sharder = Sharder {
        config,
        unit: None,
        already_sharded,
        source,
        error: None,
        flat,
        next_offset: 0,
        flat_dtype: None,
        level,
    };
    let sharded = module.apply_reparameterization(&mut sharder);
    match sharder.error {
        Some(e) => Err(e),
        None => Ok(sharded),
    }
}

/// The elements and the count of `module`'s float parameters not in `sharded` (what one
/// `fully_shard` call shards), read from their shapes without initializing lazy ones.
fn unsharded_elements<M: Module>(module: &M, sharded: &HashSet<ParamId>) -> (usize, usize) {
    struct Count<'a> {
        sharded: &'a HashSet<ParamId>,
        elements: usize,
        params: usize,
    }
    impl ModuleVisitor for Count<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !self.sharded.contains(&param.id) {
                self.elements += param.lazy_shape().iter().product::<usize>();
                self.params += 1;
            }
        }
    }
    let mut count = Count {
        sharded,
        elements: 0,
        params: 0,
    };
    module.visit(&mut count);
    (count.elements, count.params)
}
