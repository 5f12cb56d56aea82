//! Coalesced unit gathers: FSDP2's one all-gather per unit. [`with_gathered_unit`] gathers
//! every sharded parameter of a module with a single collective (each rank contributes its
//! shards, each padded to the pad-to-ceil chunk, concatenated) and, while its closure runs,
//! `param.val()` of those parameters returns their slice of that buffer (served from each
//! parameter's own state); backward reduce-scatters the whole unit's gradient once.
//!
//! [`forward_units`] runs a stack of units with forward prefetch, at the depth the units were
//! sharded with.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::{DType, Device, FloatDType, Tensor};
use burn_parallel_comm::checkpoint::{LayerCheckpointing, LayerForward, checkpoint, detached};
use burn_parallel_comm::collectives::{
    Prefetch, device_mismatch, place_flat, prefetch_on_backward, split_segments,
};

use crate::error::FsdpError;
use crate::gather::{PendingGather, start_gather};
use crate::memory::Hold;
use crate::policy::MixedPrecisionPolicy;
use crate::reparam::{Collected, collect};
use crate::state::{FlatBuffer, ParamState, Prefetches, Served, UnitState};

/// Stops serving a unit's parameters when its scope ends, even by panic; when resharding
/// after forward, that is also when its gathered bytes are released.
struct ServeGuard {
    served: Vec<Arc<ParamState>>,
    _gathered: Option<Arc<Hold>>,
    /// The rebuilds the unit's backward will run, when it prefetches in backward: its gather's
    /// recomputation first, then what its forward adds (frozen weights' rebuilds).
    prefetches: Option<Prefetches>,
}

impl Drop for ServeGuard {
    fn drop(&mut self) {
        self.served.iter().for_each(|p| p.serve(None));
    }
}

/// One unit's share of a gather: what this rank contributes (each parameter's shard at its
/// offset, zeros elsewhere, `per_rank` elements) and how the gathered share maps to the
/// parameters.
struct Part {
    /// One per parameter (empty shards too), so that every rank builds the same graph.
    pieces: Vec<(usize, Tensor<1>)>,
    /// Each parameter's state and its padded chunk's start in a rank's contribution (rows),
    /// or its start in the unit's gathered buffer (flat).
    params: Vec<(Arc<ParamState>, usize)>,
    /// Elements each rank contributes.
    per_rank: usize,
    flat: bool,
}

/// A gather in flight: one collective for one or more parts (a bucket of flat units).
struct PendingUnit {
    gather: PendingGather<1>,
    world: usize,
    /// Each part's parameters and layout, and where its elements start in a rank's
    /// contribution.
    parts: Vec<(Part, usize)>,
    /// Elements each rank contributes, over every part.
    per_rank: usize,
    /// Whether any parameter of the gather trains (the gather then has a backward).
    trainable: bool,
}

/// The unit state shared by `collected`, or an error naming two groups that differ.
/// The parameters of `collected` sharded over the same group as the outermost unit: a nested
/// unit over another group (a MoE layer's experts, sharded over the ranks holding the same
/// experts) is gathered in its own scope, not with the unit around it.
fn outer_group(collected: Vec<Collected>) -> Vec<Collected> {
    let Some(outer) = collected.iter().max_by_key(|c| c.state.unit.level) else {
        return collected;
    };
    let (group, level) = (outer.state.unit.group.clone(), outer.state.unit.level);
    // Units of the outer level that disagree stay in, for `common_unit` to name them.
    let keep = |c: &Collected| {
        c.state.unit.level == level
            || (c.state.unit.group.ranks() == group.ranks()
                && c.state.unit.group.label() == group.label())
    };
    if collected.iter().all(keep) {
        return collected;
    }
    collected.into_iter().filter(keep).collect()
}

fn common_unit(collected: &[Collected]) -> Result<Option<Arc<UnitState>>, FsdpError> {
    let Some(first) = collected.first() else {
        return Ok(None);
    };
    let unit = first.state.unit.clone();
    if let Some(other) = collected
        .iter()
        .find(|c| c.state.unit.group.ranks() != unit.group.ranks())
    {
        return Err(FsdpError::MixedGroups {
            first: unit.group.label().to_string(),
            other: other.state.unit.group.label().to_string(),
        });
    }
    Ok(Some(unit))
}

/// FSDP2's layout: each parameter's padded chunk, concatenated, so every rank contributes the
/// same length.
fn row_part(collected: &[Collected]) -> Part {
    let mut pieces = Vec::new();
    let mut params = Vec::new();
    let mut per_rank = 0;
    for c in collected {
        pieces.push((per_rank, c.shard.clone()));
        params.push((c.state.clone(), per_rank));
        per_rank += c.state.padded_rows() * c.state.row_len();
    }
    Part {
        pieces,
        params,
        per_rank,
        flat: false,
    }
}

/// The flat layout: this rank's slice of the unit's buffer is its pieces back to back (padded
/// at the buffer's end), and the gathered buffer is the parameters back to back. `collected`
/// must be exactly the unit's parameters.
fn flat_part(
    collected: &[Collected],
    unit: &Arc<UnitState>,
    flat: &FlatBuffer,
) -> Result<Part, FsdpError> {
    let in_unit = collected
        .iter()
        .filter(|c| Arc::ptr_eq(&c.state.unit, unit))
        .count();
    if in_unit != collected.len() || in_unit != flat.params {
        return Err(FsdpError::FlatUnit(format!(
            "a flat-buffer unit is gathered as a whole, but the module holds {in_unit} of its \
             {} parameters and {} parameters of other units: gather the module the unit was \
             sharded on",
            flat.params,
            collected.len() - in_unit
        )));
    }
    let mut pieces = Vec::with_capacity(collected.len());
    let mut own = 0;
    for c in collected {
        pieces.push((own, c.shard.clone()));
        own += c.shard.dims()[0];
    }
    let params = collected
        .iter()
        .map(|c| {
            let offset = c.state.flat_offset().expect("a flat unit's parameter");
            (c.state.clone(), offset)
        })
        .collect();
    Ok(Part {
        pieces,
        params,
        per_rank: flat.per_rank,
        flat: true,
    })
}

/// The part of `collected` (parameters of `unit`'s layout).
fn part_of(collected: &[Collected], unit: &Arc<UnitState>) -> Result<Part, FsdpError> {
    match &unit.flat {
        Some(flat) => flat_part(collected, unit, flat),
        None => Ok(row_part(collected)),
    }
}

/// Starts ONE gather of `parts` (all gathering like `unit`), whose shards are `collected`;
/// `None` when there is nothing to gather. `after`: see [`start_gather`].
fn start_parts(
    parts: Vec<Part>,
    collected: &[Collected],
    unit: &UnitState,
    after: Option<Tensor<1>>,
) -> Result<Option<PendingUnit>, FsdpError> {
    let world = unit.group.size();
    let per_rank: usize = parts.iter().map(|p| p.per_rank).sum();
    if per_rank == 0 {
        return Ok(None);
    }
    // A gather of frozen parameters only has no backward: its input is kept out of the graph
    // (no order anchor), so Burn records no backward node and runs no reduce-scatter for it
    // (with resharding it can still gather again in backward, for the input gradient).
    // Trainability is fixed when the model is sharded and is the same on every rank, so
    // every rank skips the same reductions.
    let trainable = parts
        .iter()
        .any(|p| p.params.iter().any(|(state, _)| state.trainable()));
    let after = after.filter(|_| trainable);
    let mut pieces = Vec::new();
    let mut placed = Vec::new();
    let mut start = 0;
    for mut part in parts {
        pieces.extend(part.pieces.drain(..).map(|(at, p)| (start + at, p)));
        let len = part.per_rank;
        placed.push((part, start));
        start += len;
    }
    // Rebuilt in backward, not kept, when the gather is recomputed (reshard after forward).
    // A rank with no rows of a parameter still places its (empty) shard, so the buffer is
    // tracked and backward runs the unit's reduce-scatter on every rank.
    let rebuilt: usize = placed
        .iter()
        .flat_map(|(part, _)| &part.params)
        .filter(|(state, _)| state.is_rebuilt())
        .map(|(state, _)| state.global_shape.iter().product::<usize>())
        .sum();
    let local = place_flat(per_rank, pieces);
    let gather = start_gather(
        local,
        unit,
        &collected[0].state.accumulator,
        vec![per_rank; world],
        (world * per_rank, rebuilt),
        after,
    )?;
    Ok(Some(PendingUnit {
        gather,
        world,
        parts: placed,
        per_rank,
        trainable,
    }))
}

/// Starts the gathers of `collected`, parameters of `unit`: one, except that a unit of
/// FSDP2's rows that mixes trainable and frozen parameters gathers each kind with its own
/// collective, so that its reduce-scatter carries the trainable rows only (PyTorch's FSDP2
/// reduce-scatters only the parameters with gradients). A flat unit's buffer is one gather
/// whatever it holds: its frozen pieces are reduced as zeros.
fn start_own(
    collected: Vec<Collected>,
    unit: &Arc<UnitState>,
    after: Option<Tensor<1>>,
) -> Result<Vec<PendingUnit>, FsdpError> {
    if unit.flat.is_some() {
        let part = part_of(&collected, unit)?;
        return Ok(start_parts(vec![part], &collected, unit, after)?
            .into_iter()
            .collect());
    }
    let (trainable, frozen): (Vec<Collected>, Vec<Collected>) =
        collected.into_iter().partition(|c| c.state.trainable());
    let mut pending = Vec::new();
    for (kind, after) in [(trainable, after), (frozen, None)] {
        if !kind.is_empty() {
            pending.extend(start_parts(vec![row_part(&kind)], &kind, unit, after)?);
        }
    }
    Ok(pending)
}

/// The flat unit `collected` is exactly the parameters of, if any.
fn whole_flat_unit(collected: &[Collected]) -> Option<Arc<UnitState>> {
    let unit = &collected.first()?.state.unit;
    let flat = unit.flat.as_ref()?;
    let whole = collected.len() == flat.params
        && collected.iter().all(|c| Arc::ptr_eq(&c.state.unit, unit));
    whole.then(|| unit.clone())
}

/// Collects `module`'s shards and starts their one gather (see [`with_gathered_unit`]). In a
/// stack (`in_stack`), a module that holds part of a flat unit (a layer of a unit sharded on
/// the whole model) is not gathered on its own: its parameters are served by the enclosing
/// unit's scope, or gathered one by one.
fn start_unit<M: Module>(
    module: &M,
    after: Option<Tensor<1>>,
    in_stack: bool,
) -> Result<Vec<PendingUnit>, FsdpError> {
    // Parameters an enclosing scope serves (a frozen layer whose parameters joined the root's
    // unit, `frozen_multimodal_sharding = "root"`) are not gathered again.
    let collected: Vec<Collected> = collect(module)
        .into_iter()
        .filter(|c| !c.state.is_served())
        .collect();
    let collected = outer_group(collected);
    let Some(unit) = common_unit(&collected)? else {
        return Ok(Vec::new());
    };
    if in_stack && unit.flat.is_some() && whole_flat_unit(&collected).is_none() {
        return Ok(Vec::new());
    }
    start_own(collected, &unit, after)
}

/// Starts one gather for a bucket of flat units (consecutive units of a stack, see
/// [`buckets`]); a bucket of one unit is [`start_unit`].
fn start_bucket<U: Module>(
    units: &[U],
    after: Option<Tensor<1>>,
) -> Result<Vec<PendingUnit>, FsdpError> {
    if units.len() == 1 {
        return start_unit(&units[0], after, true);
    }
    let mut all = Vec::new();
    let mut parts = Vec::new();
    for u in units {
        let collected = collect(u);
        let unit = common_unit(&collected)?.expect("a bucket holds sharded units");
        parts.push(part_of(&collected, &unit)?);
        all.extend(collected);
    }
    let unit = all[0].state.unit.clone();
    Ok(start_parts(parts, &all, &unit, after)?
        .into_iter()
        .collect())
}

impl PendingUnit {
    /// Waits for the gather and serves the parameters until the guard drops. Each parameter
    /// is one view of the gathered buffer (its runs of it, see [`Columns`]), all under one
    /// split, so backward builds the unit's gradient once, in the gathered layout that the
    /// reduce-scatter takes.
    fn serve(mut self) -> ServeGuard {
        let trainable = self.trainable;
        let prefetches = self.gather.prefetch.take().map(|p| {
            let list = Prefetches::default();
            list.push(p);
            list
        });
        let (gathered, forward_hold) = self.gather.finish();
        let mut views = Vec::new();
        for (part, start) in self.parts {
            let columns = Columns {
                world: self.world,
                per_rank: self.per_rank,
                start,
                len: part.per_rank,
            };
            for (state, offset) in part.params {
                let len: usize = state.global_shape.iter().product();
                if len == 0 {
                    continue;
                }
                let segments = match part.flat {
                    true => columns.flat(offset..offset + len),
                    false => {
                        let chunk = state.padded_rows() * state.row_len();
                        columns.rows(offset..offset + chunk, len)
                    }
                };
                views.push((state, segments));
            }
        }
        let segments: Vec<_> = views.iter().map(|(_, s)| s.clone()).collect();
        let values = match segments.is_empty() {
            true => Vec::new(),
            false => split_segments(gathered, &segments),
        };
        let served = views
            .into_iter()
            .zip(values)
            .map(|((state, _), value)| {
                // A frozen parameter in a gather that also trains (a flat buffer): its value
                // leaves the graph, so Burn computes no gradient for it (its piece of the
                // unit's gradient stays zero). Values of a frozen-only gather are left as
                // they are: untracked already, and recomputable when resharding.
                let value = match trainable && !state.trainable() {
                    true => value.detach(),
                    false => value,
                };
                state.serve(Some(Served {
                    value,
                    prefetches: prefetches.clone(),
                }));
                state
            })
            .collect();
        ServeGuard {
            served,
            _gathered: forward_hold,
            prefetches,
        }
    }
}

/// One part's place in a gathered buffer: each of the `world` ranks contributes `per_rank`
/// elements, rank after rank, and the part is `len` of them from `start` in every rank's
/// contribution.
struct Columns {
    world: usize,
    per_rank: usize,
    start: usize,
    len: usize,
}

impl Columns {
    /// Elements `range` of the part's own buffer (its columns of every rank, rank after rank:
    /// a flat unit's parameters back to back) as ranges of the gathered buffer.
    fn flat(&self, range: Range<usize>) -> Vec<Range<usize>> {
        let mut segments = Vec::new();
        let mut at = range.start;
        while at < range.end {
            let (rank, column) = (at / self.len, at % self.len);
            let n = (self.len - column).min(range.end - at);
            let start = rank * self.per_rank + self.start + column;
            push_merged(&mut segments, start..start + n);
            at += n;
        }
        segments
    }

    /// A row-sharded parameter whose padded chunk is `chunk` of the part in every rank's
    /// contribution: its first `len` elements, the padding after the last rows left out.
    fn rows(&self, chunk: Range<usize>, len: usize) -> Vec<Range<usize>> {
        let mut segments = Vec::new();
        let mut left = len;
        for rank in 0..self.world {
            let n = chunk.len().min(left);
            if n == 0 {
                break;
            }
            let start = rank * self.per_rank + self.start + chunk.start;
            push_merged(&mut segments, start..start + n);
            left -= n;
        }
        segments
    }
}

/// Appends `range`, joined to the last range when they touch, so that a parameter whose
/// elements are contiguous in the buffer is one view of it rather than a copy.
fn push_merged(segments: &mut Vec<Range<usize>>, range: Range<usize>) {
    match segments.last_mut() {
        Some(last) if last.end == range.start => last.end = range.end,
        _ => segments.push(range),
    }
}

/// Runs `f` (typically the unit's forward) with every parameter of `unit` (a module sharded by
/// `fully_shard`) gathered by ONE all-gather; their gradients are reduce-scattered by ONE
/// reduce-scatter (plus, under HSDP, one all-reduce across replicas). Units nest and follow
/// each other: parameters outside every running unit are gathered one by one. Collective:
/// every rank of the shard group runs the same units in the same order. A flat-buffer unit
/// (Megatron-FSDP layout) is gathered whole: `unit` must hold exactly its parameters.
///
/// Infallible, like Burn's forward methods and [`forward_units`]: what can still go wrong in
/// forward (a module that mixes units of different groups or holds part of a flat unit, a rank
/// that failed or disagrees in the gather) panics with a message naming it, which the launcher
/// reports as this rank's failure while releasing the others. [`try_with_gathered_unit`]
/// returns it instead.
pub fn with_gathered_unit<M: Module, R>(unit: &M, f: impl FnOnce() -> R) -> R {
    try_with_gathered_unit(unit, f).unwrap_or_else(|e| panic!("FSDP unit: {e}"))
}

/// [`with_gathered_unit`], returning what goes wrong instead of panicking.
pub fn try_with_gathered_unit<M: Module, R>(
    unit: &M,
    f: impl FnOnce() -> R,
) -> Result<R, FsdpError> {
    let _guards: Vec<ServeGuard> = start_unit(unit, None, false)?
        .into_iter()
        .map(PendingUnit::serve)
        .collect();
    Ok(f())
}

/// Runs `f` (typically a model's whole forward) with the parameters of `module`'s own unit
/// (the one `fully_shard` made when called on `module` itself: for a model's root, what no
/// inner unit took, such as the embedding, the final norm and the LM head) gathered by ONE
/// all-gather, as FSDP2 and Megatron-FSDP gather the root's parameters when the forward
/// starts; without it each of them is gathered on its own when used (a tied embedding twice).
/// The inner units' parameters are left to their own scopes ([`forward_units`]). Nothing is
/// gathered when `module` has no sharded parameter. Collective and infallible, like
/// [`with_gathered_unit`]; [`try_with_module_unit`] returns what goes wrong instead.
pub fn with_module_unit<M: Module, R>(module: &M, f: impl FnOnce() -> R) -> R {
    try_with_module_unit(module, f).unwrap_or_else(|e| panic!("FSDP unit: {e}"))
}

/// [`with_module_unit`], returning what goes wrong instead of panicking.
pub fn try_with_module_unit<M: Module, R>(
    module: &M,
    f: impl FnOnce() -> R,
) -> Result<R, FsdpError> {
    let collected = collect(module);
    let Some(level) = collected.iter().map(|c| c.state.unit.level).max() else {
        return Ok(f());
    };
    let own: Vec<Collected> = collected
        .into_iter()
        .filter(|c| c.state.unit.level == level)
        .collect();
    let unit = common_unit(&own)?.expect("the module has sharded parameters");
    let _guards: Vec<ServeGuard> = start_own(own, &unit, None)?
        .into_iter()
        .map(PendingUnit::serve)
        .collect();
    Ok(f())
}

/// Groups a stack's units into gathers: consecutive units that are each exactly one flat unit
/// and gather alike, up to their config's bucket size in elements; every other unit alone.
fn buckets<U: Module>(units: &[U]) -> Vec<std::ops::Range<usize>> {
    let flat: Vec<Option<Arc<UnitState>>> =
        units.iter().map(|u| whole_flat_unit(&collect(u))).collect();
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    let mut filled = 0;
    for (i, unit) in flat.iter().enumerate() {
        let size = unit.as_ref().and_then(|u| u.flat).map_or(0, |f| f.total);
        let joins = match (out.last(), unit) {
            (Some(last), Some(unit)) => {
                let limit = unit.bucket_elements.unwrap_or(0);
                let prev = flat[last.end - 1].as_ref();
                prev.is_some_and(|p| p.gathers_like(unit)) && filled + size <= limit
            }
            _ => false,
        };
        if joins {
            out.last_mut().expect("joined a bucket").end = i + 1;
            filled += size;
        } else {
            out.push(i..i + 1);
            filled = size;
        }
    }
    out
}

/// What a stack of units passes from one unit to the next (an activation tensor).
pub trait UnitInput: Sized {
    /// An exact zero `[1]` computed from this input, or `None` when the input is not part of
    /// the autodiff graph. Each unit's gather is tied to the input current when it is issued,
    /// so that backward reduce-scatters a unit's gradient right after running through the unit
    /// (and through the units prefetched with it), rather than every unit's at the end of
    /// backward, keeping the unsharded gradients of at most the prefetched units alive.
    fn order_anchor(&self) -> Option<Tensor<1>>;

    /// This value with its floating-point tensors cast to `dtype` (the mixed-precision
    /// policy's `cast_forward_inputs` and `output_dtype`).
    fn cast(self, dtype: FloatDType) -> Self;

    /// The device of the value's tensors (checked against the units' device).
    fn device(&self) -> Device;

    /// This value with a node whose backward issues `prefetches`
    /// (`comm::collectives::prefetch_on_backward` on one of its tracked tensors). The default
    /// returns the value unchanged: the units' backward then gathers each unit when it needs it.
    fn prefetch_on_backward(self, prefetches: Vec<Prefetch>) -> Self {
        let _ = prefetches;
        self
    }
}

impl<const D: usize> UnitInput for Tensor<D> {
    fn order_anchor(&self) -> Option<Tensor<1>> {
        let n = self.shape().num_elements();
        if n == 0 || !self.is_tracked() {
            return None;
        }
        // One element times zero: an exact zero in the graph below this input (its gradient
        // adds an exact zero to the input's).
        Some(self.clone().reshape([n]).narrow(0, 0, 1).mul_scalar(0.0))
    }

    fn cast(self, dtype: FloatDType) -> Self {
        match self.dtype() == DType::from(dtype) {
            true => self,
            false => Tensor::<D>::cast(self, dtype),
        }
    }

    fn device(&self) -> Device {
        Tensor::device(self)
    }

    fn prefetch_on_backward(self, prefetches: Vec<Prefetch>) -> Self {
        prefetch_on_backward(self, prefetches)
    }
}

/// The unit's input and output casts, as FSDP2 applies them around each `fully_shard` module's
/// forward: inputs to `param_dtype` when `cast_forward_inputs`, outputs to `output_dtype`.
fn unit_forward<U, T: UnitInput>(
    policy: Option<MixedPrecisionPolicy>,
    unit: &U,
    x: T,
    f: &mut impl FnMut(&U, T) -> T,
) -> T {
    let Some(policy) = policy else {
        return f(unit, x);
    };
    let x = match (policy.cast_forward_inputs, policy.param_dtype) {
        (true, Some(dtype)) => x.cast(dtype),
        _ => x,
    };
    let y = f(unit, x);
    match policy.output_dtype {
        Some(dtype) => y.cast(dtype),
        None => y,
    }
}

/// The state of a stack's first sharded unit, whose prefetch depth and policy the stack runs
/// with (`None` when nothing in it is sharded).
fn first_unit<U: Module>(units: &[U]) -> Option<Arc<UnitState>> {
    units
        .iter()
        .find_map(|u| collect(u).first().map(|c| c.state.unit.clone()))
}

/// Runs `units` in order as FSDP units (a decoder's layers), threading `input` through
/// `f(unit, x)`. The next units' all-gathers are in flight while one computes, as many as the
/// units' [`FsdpConfig::forward_prefetch_depth`](crate::FsdpConfig) says (FSDP2's forward
/// prefetch; each prefetched unit holds its gathered weights until it runs), and each unit's
/// input and output take the casts of the units' mixed-precision policy
/// (`cast_forward_inputs`, `output_dtype`), as FSDP2 applies them around each sharded module.
/// Units that are not sharded run as a plain loop.
///
/// Infallible, like Burn's own forward methods: the configuration errors a unit can meet are
/// checked when the model is sharded, and what remains (an input on another device than the
/// units, a rank that failed or disagrees in a collective) panics with a message naming it,
/// which the launcher reports as this rank's failure while releasing the others. Burn 0.22
/// has no module forward hooks, so the unit boundaries are this call, not the parameters'
/// first use: a parameter cannot know when its unit's forward ends (to release the gathered
/// weights) or the other parameters' current shards (to gather them in one collective).
pub fn forward_units<U: Module, T: UnitInput>(
    units: &[U],
    input: T,
    mut f: impl FnMut(&U, T) -> T,
) -> T {
    run_units(units, input, |_| false, |_, unit, x| f(unit, x))
}

/// [`forward_units`] with the layers `checkpointing` picks checkpointed
/// ([`comm::checkpoint`](burn_parallel_comm::checkpoint)): such a layer runs forward on
/// detached parameters (its gather, when sharded, records nothing either) and keeps only its
/// input; backward gathers it again, runs `f` again and then its backward. `f` is therefore
/// owned (`'static`): what it needs besides the layer and its input (rotary tables, masks) it
/// holds by value. A checkpointed layer issues no backward prefetch: its recomputation gathers
/// it when its backward starts.
pub fn forward_units_checkpointed<U, const D: usize>(
    units: &[U],
    input: Tensor<D>,
    checkpointing: LayerCheckpointing,
    f: impl Fn(&U, Tensor<D>) -> Tensor<D> + Send + Sync + 'static,
) -> Tensor<D>
where
    U: Module + Send + Sync + 'static,
{
    if !checkpointing.is_on() {
        return forward_units(units, input, f);
    }
    let f = Arc::new(f);
    let recompute: LayerForward<U, D> = {
        let f = f.clone();
        Arc::new(move |unit: &U, x| with_gathered_unit(unit, || f(unit, x)))
    };
    // What the stack runs forward: the checkpointed layers detached, so that their gathers
    // and their forward stay out of the graph.
    let run: Vec<U> = units
        .iter()
        .enumerate()
        .map(|(i, u)| match checkpointing.checkpoints(i) {
            true => detached(u),
            false => u.clone(),
        })
        .collect();
    let checkpointed = |i: usize| checkpointing.checkpoints(i);
    run_units(
        &run,
        input,
        checkpointed,
        |i, unit, x| match checkpointing.checkpoints(i) {
            true => checkpoint(&units[i], x, |x| f(unit, x), recompute.clone()),
            false => f(unit, x),
        },
    )
}

/// The loop of [`forward_units`]: `f(index, unit, x)` for each unit in order; the units for
/// which `checkpointed` holds are gathered outside the graph and issue no backward prefetch.
fn run_units<U: Module, T: UnitInput>(
    units: &[U],
    input: T,
    checkpointed: impl Fn(usize) -> bool,
    mut f: impl FnMut(usize, &U, T) -> T,
) -> T {
    let unit_state = first_unit(units);
    if let Some(unit) = &unit_state
        && let Some(message) =
            device_mismatch("the input of the FSDP units", &input.device(), &unit.device)
    {
        panic!("{message}");
    }
    let depth = unit_state.as_ref().map_or(0, |u| u.prefetch_depth);
    let backward_depth = unit_state.as_ref().map_or(0, |u| u.backward_prefetch_depth);
    let policy = unit_state.map(|u| u.policy);
    let buckets = buckets(units);
    let mut x = input;
    // Gathers issued ahead, in bucket order: buckets[started - in_flight.len() .. started].
    let mut in_flight = VecDeque::new();
    let mut started = 0;
    // The rebuilds of the last `backward_depth + 1` buckets, newest first.
    let mut rebuilds: VecDeque<Vec<Prefetch>> = VecDeque::new();
    for (b, bucket) in buckets.iter().enumerate() {
        // Keep `depth` buckets after this one in flight (this one's gather, when not
        // prefetched, starts now).
        while started < buckets.len() && started <= b + depth {
            let range = buckets[started].clone();
            let anchor = match range.clone().any(&checkpointed) {
                true => None,
                false => x.order_anchor(),
            };
            let pending = start_bucket(&units[range.clone()], anchor)
                .unwrap_or_else(|e| panic!("FSDP units {range:?}: {e}"));
            in_flight.push_back(pending);
            started += 1;
        }
        let _guards: Vec<ServeGuard> = in_flight
            .pop_front()
            .into_iter()
            .flatten()
            .map(PendingUnit::serve)
            .collect();
        for i in bucket.clone() {
            x = unit_forward(policy, &units[i], x, &mut |unit, x| f(i, unit, x));
        }
        if backward_depth > 0 {
            let recomputed = bucket.clone().any(&checkpointed);
            rebuilds.push_front(
                _guards
                    .iter()
                    .filter(|_| !recomputed)
                    .filter_map(|g| g.prefetches.as_ref())
                    .flat_map(Prefetches::list)
                    .collect(),
            );
            rebuilds.truncate(backward_depth + 1);
            // When this bucket's backward starts, its own rebuilds and those of the
            // `backward_depth` buckets before it are issued (each once).
            x = x.prefetch_on_backward(rebuilds.iter().flatten().cloned().collect());
        }
    }
    x
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // a view of one run is a list of one range
mod tests {
    use super::Columns;

    /// 4 ranks each contribute 10 elements; the part is columns 2..8 of each.
    const PART: Columns = Columns {
        world: 4,
        per_rank: 10,
        start: 2,
        len: 6,
    };

    /// A parameter of 5 rows of 1 element, padded to chunks of 2 rows: ranks 0 and 1 hold 2
    /// rows, rank 2 one row and its padding, rank 3 padding only, which no run reads.
    #[test]
    fn rows_take_each_ranks_chunk_up_to_the_parameters_length() {
        assert_eq!(PART.rows(1..3, 5), [3..5, 13..15, 23..24]);
    }

    /// A flat parameter spanning the end of rank 0's columns and the start of rank 1's; one
    /// within rank 2's.
    #[test]
    fn flat_ranges_split_at_rank_bounds() {
        assert_eq!(PART.flat(4..9), [6..8, 12..15]);
        assert_eq!(PART.flat(13..15), [23..25]);
    }

    /// A part that is every rank's whole contribution: the ranks' runs join into one.
    #[test]
    fn contiguous_runs_merge_into_one_view() {
        let whole = Columns {
            world: 3,
            per_rank: 4,
            start: 0,
            len: 4,
        };
        assert_eq!(whole.flat(2..11), [2..11]);
        assert_eq!(whole.rows(0..4, 12), [0..12]);
    }
}
