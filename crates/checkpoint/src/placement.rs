//! Where each of this rank's stored parameters lies in the full tensor: the tensor-parallel
//! split (a dim cut by the layer's shard spec) and, inside it, the FSDP shard: rows along
//! dim 0, or (the flat layout) a contiguous run of the row-major elements, described as the
//! few boxes it splits into. The same computation places shards when saving and decides what
//! to read when loading, whatever the strategy: a replicated parameter simply covers its whole
//! tensor. A fused tensor-parallel split (`colwise_fused`: this rank's chunk of each of `k`
//! equal parts) is `k` boxes, one per part, concatenated along the split dim.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, Device, Tensor};
use burn_parallel_ep::ExpertModule;
use burn_parallel_fsdp::{ParamState, PathVisitor, param_states, visit_with_paths};
use burn_parallel_parallelizer::{Parallelize, UnitMap};
use burn_parallel_tp::{ShardSpec, TpModule};

use crate::error::CheckpointError;
use crate::region::{Region, boxes_of_range};

/// One stored parameter of this rank, and which elements of the full tensor it holds.
///
/// The stored tensor, flattened row-major, is the concatenation of `regions`, each read
/// row-major. Usually that is one box shaped like the stored tensor (FSDP rows, a
/// tensor-parallel slice, a replicated parameter's whole tensor). A piece of an FSDP flat
/// buffer, stored as `[len, 1, ..]`, need not be whole rows: it is the few boxes
/// [`boxes_of_range`](crate::boxes_of_range) splits it into, and none when it is empty.
/// Under a fused tensor-parallel style the stored tensor is instead its boxes (one per part it
/// holds a chunk of) concatenated along [`concat_dim`](Self::concat_dim).
#[derive(Debug, Clone)]
pub struct Placement {
    /// Burn's module path (`layers.0.mlp.up_proj.weight`): the tensor's name in a checkpoint.
    pub path: String,
    /// The parameter's id in this model.
    pub id: ParamId,
    /// The full (unsharded) tensor's shape.
    pub global_shape: Vec<usize>,
    /// The boxes of the full tensor this rank stores, in the order of its stored elements.
    pub regions: Vec<Region>,
    /// The shape of the tensor this rank stores (`[len, 1, ..]` for a flat-buffer piece).
    pub shape: Vec<usize>,
    /// `Some(dim)`: the stored tensor is `regions` concatenated along `dim`, each box shaped
    /// like the stored tensor but along `dim` (a fused tensor-parallel split, whose parts are
    /// not one contiguous block). `None`: `regions` one after the other in row-major order.
    pub concat_dim: Option<usize>,
    /// `None` for a lazy parameter not initialized yet (it takes the checkpoint's dtype).
    pub dtype: Option<DType>,
    /// Where the parameter lives (or will, for a lazy one).
    pub device: Device,
}

impl Placement {
    /// Elements this rank stores of the parameter (the volume of its boxes together).
    pub fn volume(&self) -> usize {
        self.regions.iter().map(Region::volume).sum()
    }

    /// Whether this rank stores no element of the parameter.
    pub fn is_empty(&self) -> bool {
        self.volume() == 0
    }
}

/// A stored parameter as a visitor sees it: path, id, shape and dtype.
struct Stored {
    path: String,
    id: ParamId,
    shape: Vec<usize>,
    dtype: Option<DType>,
    device: Device,
}

fn stored_params<M: Module>(model: &M) -> Vec<Stored> {
    struct Visit {
        out: Vec<Stored>,
    }
    impl PathVisitor for Visit {
        fn visit_float<const D: usize>(&mut self, path: &str, param: &Param<Tensor<D>>) {
            // A lazy parameter is not initialized for its dtype: loading replaces it unread.
            let dtype = param.is_initialized().then(|| param.base().dtype());
            self.out.push(Stored {
                path: path.to_string(),
                id: param.id,
                shape: param.lazy_shape().to_vec(),
                dtype,
                device: param.lazy_device(),
            });
        }
    }
    let mut visit = Visit { out: Vec::new() };
    visit_with_paths(model, &mut visit);
    visit.out
}

/// How a `Tp` layer cut one parameter: along `dim`, by `spec`, in `parts` equal parts each
/// split on its own (1: one contiguous chunk).
struct TpSplit {
    dim: usize,
    spec: ShardSpec,
    parts: usize,
    layer: String,
}

/// The tensor-parallel split of each parameter a `Tp` layer cut.
fn tp_splits<M: TpModule>(model: &M) -> HashMap<ParamId, TpSplit> {
    let mut splits = HashMap::new();
    model.visit_tp_shardings(&mut |s| {
        if let Some(spec) = &s.spec {
            for p in &s.split_params {
                let split = TpSplit {
                    dim: p.dim,
                    spec: spec.clone(),
                    parts: s.style.parts(),
                    layer: s.path.clone(),
                };
                splits.insert(p.id, split);
            }
        }
    });
    splits
}

/// The expert-parallel split of each parameter of an `#[experts]` module whose experts are
/// split over an ep group: along dim 0 (the experts), this rank's experts of how many.
fn expert_splits<M: Parallelize>(model: &M) -> HashMap<ParamId, (std::ops::Range<usize>, usize)> {
    struct Record(HashMap<ParamId, (std::ops::Range<usize>, usize)>);
    impl UnitMap for Record {
        type Error = std::convert::Infallible;
        fn unit<N: Module>(&mut self, _path: &str, module: N) -> Result<N, Self::Error> {
            Ok(module)
        }
        fn experts<N: ExpertModule>(&mut self, _path: &str, module: N) -> Result<N, Self::Error> {
            if let Some(shard) = module.expert_shard() {
                let split = (shard.local_experts(), shard.num_experts());
                let mut ids = Ids(HashSet::new());
                module.visit(&mut ids);
                self.0
                    .extend(ids.0.into_iter().map(|id| (id, split.clone())));
            }
            Ok(module)
        }
    }
    let mut record = Record(HashMap::new());
    // The walk rebuilds what it visits: a clone (its tensors are shared, not copied) takes it.
    let Ok(_) = model.clone().map_units("", &mut record);
    record.0
}

struct Ids(HashSet<ParamId>);

impl ModuleVisitor for Ids {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.0.insert(param.id);
    }
}

/// Ids of the parameters the model says tensor parallelism split (whether or not it reports
/// how).
fn tp_sharded_ids<M: TpModule>(model: &M) -> HashSet<ParamId> {
    let mut ids = Ids(HashSet::new());
    model.visit_tp_sharded(&mut ids);
    ids.0
}

/// Every stored float parameter of `model` on this rank, in module order, with the part of
/// the full tensor it holds (a split expert stack: this rank's experts along dim 0). No
/// communication.
pub fn placements<M: Parallelize>(model: &M) -> Result<Vec<Placement>, CheckpointError> {
    let fsdp: HashMap<ParamId, _> = param_states(model)
        .into_iter()
        .map(|s| (s.id(), s))
        .collect();
    let splits = tp_splits(model);
    let tp_sharded = tp_sharded_ids(model);
    let experts = expert_splits(model);
    let mut out = Vec::new();
    for p in stored_params(model) {
        let bad = |reason: String| CheckpointError::Placement {
            param: p.path.clone(),
            reason,
        };
        if tp_sharded.contains(&p.id) && !splits.contains_key(&p.id) {
            return Err(bad(
                "tensor parallelism split it but the model does not report how: \
                 its TpModule impl needs visit_tp_shardings (#[parallelize] generates it)"
                    .into(),
            ));
        }
        // The tensor before FSDP (the tp shard, or the whole parameter without tp) and the
        // boxes of it this rank stores.
        let (mut shape, mut regions) = match fsdp.get(&p.id) {
            Some(state) => (
                state.global_shape().to_vec(),
                fsdp_boxes(state).map_err(bad)?,
            ),
            None => (p.shape.clone(), vec![Region::full(&p.shape)]),
        };
        let flat = fsdp.get(&p.id).is_some_and(|s| s.rows().is_none());
        let concat_dim = match splits.get(&p.id) {
            Some(split) => place_tp_split(split, &mut shape, &mut regions, flat).map_err(bad)?,
            None => None,
        };
        if let Some((local, total)) = experts.get(&p.id) {
            place_expert_split(local, *total, &mut shape, &mut regions).map_err(bad)?;
        }
        check_stored(&regions, &p.shape, &shape, flat, concat_dim).map_err(bad)?;
        out.push(Placement {
            path: p.path,
            id: p.id,
            global_shape: shape,
            regions,
            shape: p.shape,
            concat_dim,
            dtype: p.dtype,
            device: p.device,
        });
    }
    Ok(out)
}

/// Moves `shape` and `regions` (the tensor before FSDP and this rank's boxes of it) from the
/// tp shard to the full tensor `split` cut; `flat` when FSDP keeps the parameter in a flat
/// buffer. Returns the dim the boxes concatenate along under a fused split.
fn place_tp_split(
    split: &TpSplit,
    shape: &mut [usize],
    regions: &mut Vec<Region>,
    flat: bool,
) -> Result<Option<usize>, String> {
    let TpSplit {
        dim,
        spec,
        parts,
        layer,
    } = split;
    let dim = *dim;
    if shape.get(dim) != Some(&(parts * spec.range.len())) {
        return Err(format!(
            "layer `{layer}` split dim {dim} into {:?} of {} ({parts} part(s)), but the \
             parameter's shard has shape {shape:?}",
            spec.range, spec.full
        ));
    }
    shape[dim] = parts * spec.full;
    if *parts == 1 {
        for region in regions.iter_mut() {
            region.start[dim] += spec.range.start;
        }
        Ok(None)
    } else if flat {
        // A flat piece's boxes are row-major runs; under a fused split each would be
        // cut again along `dim`, a layout neither save nor load describes.
        Err(format!(
            "layer `{layer}` is fused colwise (colwise_fused({parts})) and FSDP keeps it \
             in a flat buffer; checkpoints place fused splits under row-sharded FSDP: \
             use fsdp2 (not megatron_fsdp) with tensor parallelism of fused layers"
        ))
    } else {
        let ranges = spec.part_ranges(*parts);
        *regions = fused_boxes(regions, dim, &ranges, spec.range.len());
        Ok(Some(dim))
    }
}

/// Moves `shape` and `regions` from this rank's experts `local` to the full stack of `total`
/// experts along dim 0 (expert parallelism).
fn place_expert_split(
    local: &Range<usize>,
    total: usize,
    shape: &mut [usize],
    regions: &mut [Region],
) -> Result<(), String> {
    if shape.first() != Some(&local.len()) {
        return Err(format!(
            "expert parallelism keeps experts {local:?} of {total} on this rank, but the \
             parameter's shard has shape {shape:?}"
        ));
    }
    shape[0] = total;
    for region in regions {
        region.start[0] += local.start;
    }
    Ok(())
}

/// The boxes of the full tensor that `regions` (boxes of this rank's fused tp shard: its chunk
/// of each part, `chunk` long along `dim`, part by part) hold: each cut at the part
/// boundaries and moved to where its part's chunk lies (`ranges`, one per part), empty pieces
/// left out. Concatenated along `dim` they are the stored tensor again.
fn fused_boxes(
    regions: &[Region],
    dim: usize,
    ranges: &[Range<usize>],
    chunk: usize,
) -> Vec<Region> {
    let mut out = Vec::new();
    for region in regions {
        let (lo, hi) = (region.start[dim], region.start[dim] + region.shape[dim]);
        for (j, range) in ranges.iter().enumerate() {
            let (from, to) = (lo.max(j * chunk), hi.min((j + 1) * chunk));
            if from >= to || region.is_empty() {
                continue;
            }
            let mut piece = region.clone();
            piece.start[dim] = range.start + (from - j * chunk);
            piece.shape[dim] = to - from;
            out.push(piece);
        }
    }
    out
}

/// The boxes of the FSDP shard of `state`, in the tensor FSDP sharded (the tp shard or the
/// whole parameter): its rows, or the boxes of its flat-buffer piece.
fn fsdp_boxes(state: &ParamState) -> Result<Vec<Region>, String> {
    let shape = state.global_shape();
    if let Some(rows) = state.rows() {
        let mut region = Region::full(shape);
        region.start[0] = rows.start;
        region.shape[0] = rows.len();
        return Ok(vec![region]);
    }
    let elements = state.elements();
    let total: usize = shape.iter().product();
    if elements.end > total && !elements.is_empty() {
        return Err(format!(
            "its FSDP flat-buffer piece holds elements {elements:?}, past the {total} of its \
             shape {shape:?}"
        ));
    }
    Ok(boxes_of_range(shape, elements))
}

/// Checks that the boxes describe the stored tensor of shape `stored`: each inside the full
/// tensor of shape `full`, as many elements together as it holds, and (but for a flat-buffer
/// piece, which has its own `[len, 1, ..]` shape) one box shaped like it, or under a fused
/// split (`concat`) boxes that concatenate along that dim to its shape.
fn check_stored(
    regions: &[Region],
    stored: &[usize],
    full: &[usize],
    flat: bool,
    concat: Option<usize>,
) -> Result<(), String> {
    let describe = || {
        let boxes: Vec<String> = regions.iter().map(Region::describe).collect();
        format!("[{}]", boxes.join(" "))
    };
    let volume: usize = regions.iter().map(Region::volume).sum();
    let shaped = flat
        || match concat {
            None => matches!(regions, [one] if one.shape == stored),
            Some(dim) => concatenates(regions, stored, dim),
        };
    if !shaped
        || volume != stored.iter().product::<usize>()
        || !regions.iter().all(|r| r.fits(full))
    {
        return Err(format!(
            "it stores {stored:?}, but its shards say {} of {full:?}",
            describe()
        ));
    }
    Ok(())
}

/// Whether `regions` concatenated along `dim` have the shape `stored` (none at all when it is
/// empty).
fn concatenates(regions: &[Region], stored: &[usize], dim: usize) -> bool {
    if regions.is_empty() {
        return stored.iter().product::<usize>() == 0;
    }
    let alike = regions.iter().all(|r| {
        r.shape.len() == stored.len()
            && (0..stored.len()).all(|d| d == dim || r.shape[d] == stored[d])
    });
    alike && regions.iter().map(|r| r.shape[dim]).sum::<usize>() == stored[dim]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::tests::region;

    #[test]
    fn a_fused_shard_is_one_box_per_part_cut_by_fsdp_rows() {
        // Parts of 5 over 2 tp ranks, rank 1 holds 3..5 of each: its shard is [4, 6]; FSDP
        // rows 1..3 of it.
        let ranges = [3..5, 8..10, 13..15];
        let rows = [region(&[1, 0], &[2, 6])];
        let boxes = fused_boxes(&rows, 1, &ranges, 2);
        assert_eq!(
            boxes,
            vec![
                region(&[1, 3], &[2, 2]),
                region(&[1, 8], &[2, 2]),
                region(&[1, 13], &[2, 2])
            ]
        );
        assert!(concatenates(&boxes, &[2, 6], 1));
        assert!(!concatenates(&boxes, &[2, 5], 1));
        // A bias cut by FSDP across the part boundary: elements 1..4 of the shard are the
        // second of part 0 and both of part 1.
        let bias = fused_boxes(&[region(&[1], &[3])], 0, &ranges, 2);
        assert_eq!(bias, vec![region(&[4], &[1]), region(&[8], &[2])]);
        // An empty FSDP shard holds no box.
        assert!(fused_boxes(&[region(&[4, 0], &[0, 6])], 1, &ranges, 2).is_empty());
        assert!(concatenates(&[], &[0, 6], 1));
    }
}
